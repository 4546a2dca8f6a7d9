//! Test helpers for the passes: a small graph builder and a checker that runs a pass,
//! verifies the graph and compares its evaluation with the graph before the pass.

use super::infer_shapes::infer_shapes;
use super::util::new_node;
use crate::error::Result;
use crate::ir::{verify, Attr, Attrs, DType, Graph, Source, Tensor, Value, ValueId, ValueType};

pub struct Builder {
    g: Graph,
    expect: Vec<(ValueId, DType, Vec<usize>)>,
    k: usize,
}

impl Builder {
    pub fn new() -> Builder {
        Builder {
            g: Graph::new("test"),
            expect: Vec::new(),
            k: 0,
        }
    }

    pub fn input(&mut self, name: &str, shape: &[usize]) -> ValueId {
        self.g.add_input(name, ValueType::tensor(DType::F32, shape))
    }

    pub fn konst(&mut self, name: &str, shape: &[usize], v: Vec<f32>) -> ValueId {
        self.g.add_const(name, Tensor::from_vec(shape, v))
    }

    pub fn konst_i64(&mut self, name: &str, shape: &[usize], v: Vec<i64>) -> ValueId {
        self.g.add_const(name, Tensor::from_vec(shape, v))
    }

    /// A float node; `shape` is the output shape inference must find.
    pub fn node(&mut self, op: &str, inputs: &[ValueId], shape: &[usize]) -> ValueId {
        self.node_attrs(op, inputs, DType::F32, shape, &[])
    }

    pub fn node_typed(
        &mut self,
        op: &str,
        inputs: &[ValueId],
        dt: DType,
        shape: &[usize],
    ) -> ValueId {
        self.node_attrs(op, inputs, dt, shape, &[])
    }

    pub fn node_attrs(
        &mut self,
        op: &str,
        inputs: &[ValueId],
        dt: DType,
        shape: &[usize],
        attrs: &[(&str, Attr)],
    ) -> ValueId {
        self.node_full(
            op,
            inputs.iter().map(|&i| Some(i)).collect(),
            1,
            dt,
            shape,
            attrs,
        )[0]
    }

    /// A node with `n_out` outputs; only the first one's type is checked.
    pub fn node_full(
        &mut self,
        op: &str,
        inputs: Vec<Option<ValueId>>,
        n_out: usize,
        dt: DType,
        shape: &[usize],
        attrs: &[(&str, Attr)],
    ) -> Vec<ValueId> {
        self.k += 1;
        let outs: Vec<ValueId> = (0..n_out)
            .map(|j| {
                self.g.add_value(
                    format!("{}_{}_{j}", op.to_lowercase(), self.k),
                    ValueType::Unknown,
                    Source::Undefined,
                )
            })
            .collect();
        let mut a = Attrs::default();
        for (k, v) in attrs {
            a.0.insert(k.to_string(), v.clone());
        }
        let node = new_node(format!("{op}_{}", self.k), op, a, 21, inputs, outs.clone())
            .expect("op exists");
        self.g.add_node(node);
        self.expect.push((outs[0], dt, shape.to_vec()));
        outs
    }

    /// The graph with these outputs, shape-inferred; inferred types are checked against
    /// the ones the test declared.
    pub fn finish(mut self, outputs: &[ValueId]) -> Graph {
        self.g.outputs = outputs.to_vec();
        self.g.rewire();
        let rep = infer_shapes(&mut self.g).expect("inference");
        assert!(rep.unresolved.is_empty(), "{:?}", rep.unresolved);
        for (v, dt, shape) in &self.expect {
            assert_eq!(
                self.g.value(*v).ty,
                ValueType::tensor(*dt, shape),
                "type of `{}`",
                self.g.value(*v).name
            );
        }
        self.g
    }
}

/// Deterministic pseudo-random inputs in [-1, 1) for every float input.
pub fn random_inputs(g: &Graph, seed: u64) -> Vec<Value> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    g.inputs
        .iter()
        .map(|&i| {
            let ty = &g.value(i).ty;
            let shape = ty.static_shape().expect("static input");
            let n: usize = shape.iter().product();
            let v: Vec<f64> = (0..n)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
                })
                .collect();
            Value::Tensor(Tensor::from_f64(
                ty.dtype().expect("tensor"),
                ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&shape), v).unwrap(),
                false,
            ))
        })
        .collect()
}

/// max|a - b| / max|b|.
pub fn rel_err(a: &Value, b: &Value) -> f64 {
    let (a, b) = (a.as_tensor().unwrap(), b.as_tensor().unwrap());
    assert_eq!(a.dtype(), b.dtype());
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.to_f64().unwrap(), b.to_f64().unwrap());
    let d = a
        .iter()
        .zip(b.iter())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    d / b.iter().map(|y| y.abs()).fold(0.0, f64::max).max(1e-30)
}

/// Runs `pass`, then checks the verifier accepts the graph, the interface is unchanged
/// and the outputs on random inputs agree with the graph before the pass (1e-5).
pub fn check_pass(g: &mut Graph, pass: fn(&mut Graph) -> Result<()>) {
    let ins = random_inputs(g, 7);
    let before = crate::eval::run(g, ins.clone()).expect("eval before");
    let sig = |g: &Graph| -> Vec<(String, ValueType)> {
        g.inputs
            .iter()
            .chain(&g.outputs)
            .map(|&v| (g.value(v).name.clone(), g.value(v).ty.clone()))
            .collect()
    };
    let s0 = sig(g);
    pass(g).expect("pass");
    if let Err(e) = verify(g, true) {
        panic!("verifier:\n{}\n{}", e.join("\n"), crate::ir::print_graph(g));
    }
    assert_eq!(sig(g), s0, "the interface changed");
    let after = crate::eval::run(g, ins).expect("eval after");
    for (a, b) in after.iter().zip(&before) {
        let e = rel_err(a, b);
        assert!(e <= 1e-5, "outputs differ by {e:.3e}");
    }
}
