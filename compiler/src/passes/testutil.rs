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

    /// A constant of any dtype.
    pub fn konst_t(&mut self, name: &str, t: Tensor) -> ValueId {
        self.g.add_const(name, t)
    }

    /// An input of any dtype.
    pub fn input_typed(&mut self, name: &str, dt: DType, shape: &[usize]) -> ValueId {
        self.g.add_input(name, ValueType::tensor(dt, shape))
    }

    /// A node holding subgraphs (If, Loop, Scan): the values its subgraphs read by name
    /// become its implicit inputs, as the importer records them. Its output types are not
    /// checked.
    pub fn node_sub(
        &mut self,
        op: &str,
        inputs: Vec<Option<ValueId>>,
        n_out: usize,
        attrs: &[(&str, Attr)],
    ) -> Vec<ValueId> {
        self.node_sub_in("", op, inputs, n_out, attrs)
    }

    /// [`Builder::node_sub`] for an op of another domain.
    pub fn node_sub_in(
        &mut self,
        domain: &str,
        op: &str,
        inputs: Vec<Option<ValueId>>,
        n_out: usize,
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
        let opset = if domain.is_empty() { 21 } else { 1 };
        let built = crate::ops::Registry::standard().build(crate::ops::OpCtx {
            op_type: op.into(),
            domain: domain.into(),
            attrs: a.clone(),
            opset,
            n_inputs: inputs.len(),
            n_outputs: n_out,
        });
        let op_impl = built.expect("op exists").expect("op builds");
        let mut implicit = Vec::new();
        for sg in op_impl.subgraphs() {
            for name in sg.free_names() {
                implicit.push(
                    self.g
                        .find(&name)
                        .expect("the subgraph reads a defined value"),
                );
            }
        }
        self.g.add_node(crate::ir::Node {
            name: format!("{op}_{}", self.k),
            op_type: op.into(),
            domain: domain.into(),
            opset,
            attrs: a,
            op: op_impl,
            inputs,
            outputs: outs.clone(),
            implicit,
        });
        outs
    }

    /// The graph with these outputs, shape-inferred but not checked (it may hold nodes
    /// inference leaves untyped, such as control flow).
    pub fn finish_untyped(mut self, outputs: &[ValueId]) -> Graph {
        self.g.outputs = outputs.to_vec();
        self.g.rewire();
        infer_shapes(&mut self.g).expect("inference");
        self.g
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
/// The op types of `g`'s nodes in topological order.
pub fn op_order(g: &Graph) -> Vec<String> {
    let o = crate::passes::util::order(g).expect("an acyclic graph");
    o.into_iter().map(|n| g.nodes[n].op_type.clone()).collect()
}

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

/// A subgraph (If branch, Loop or Scan body) built by hand.
pub struct Sub {
    g: Graph,
    k: usize,
}

impl Sub {
    pub fn new(name: &str) -> Sub {
        Sub {
            g: Graph::new(name),
            k: 0,
        }
    }

    /// A formal input.
    pub fn input(&mut self, name: &str, dt: DType, shape: &[usize]) -> ValueId {
        self.g.add_input(name, ValueType::tensor(dt, shape))
    }

    /// A value of an enclosing graph, read by name.
    pub fn outer(&mut self, name: &str) -> ValueId {
        self.g.add_value(name, ValueType::Unknown, Source::Outer)
    }

    pub fn konst(&mut self, name: &str, t: Tensor) -> ValueId {
        self.g.add_const(name, t)
    }

    /// Renames a value (for nested subgraphs that read it by name).
    pub fn rename(&mut self, v: ValueId, name: &str) {
        self.g.rename_value(v, name);
    }

    /// A one-output node (untyped until the graph around it is inferred).
    pub fn node(&mut self, op: &str, inputs: &[ValueId], attrs: &[(&str, Attr)]) -> ValueId {
        self.k += 1;
        let out = self.g.add_value(
            format!("{}_{}", op.to_lowercase(), self.k),
            ValueType::Unknown,
            Source::Undefined,
        );
        let mut a = Attrs::default();
        for (k, v) in attrs {
            a.0.insert(k.to_string(), v.clone());
        }
        let mut node = new_node(
            format!("{op}_{}", self.k),
            op,
            a,
            21,
            inputs.iter().map(|&i| Some(i)).collect(),
            vec![out],
        )
        .expect("op exists");
        let names: Vec<String> = node
            .op
            .subgraphs()
            .iter()
            .flat_map(|sg| sg.free_names())
            .collect();
        for name in names {
            let v = match self.g.find(&name) {
                Some(v) => v,
                None => self.outer(&name),
            };
            node.implicit.push(v);
        }
        self.g.add_node(node);
        out
    }

    pub fn finish(mut self, outputs: &[ValueId]) -> Attr {
        self.g.outputs = outputs.to_vec();
        self.g.rewire();
        Attr::Graph(std::sync::Arc::new(self.g))
    }
}

/// Runs [`super::infer_and_inline`] on a graph holding subgraphs, then checks that no
/// node holds a subgraph any more, that every value is typed, that the verifier accepts
/// the graph and that its outputs equal those before on every input set.
pub fn check_inlined(g: &mut Graph, input_sets: &[Vec<Value>]) {
    check_inlined_close(g, input_sets, 0.0);
}

/// [`check_inlined`] with outputs within `tol` (max|a-b| / max|b|) instead of equal.
pub fn check_inlined_close(g: &mut Graph, input_sets: &[Vec<Value>], tol: f64) {
    let before: Vec<Vec<Value>> = input_sets
        .iter()
        .map(|ins| crate::eval::run(g, ins.clone()).expect("eval before"))
        .collect();
    let rep = super::infer_and_inline(g).expect("rewrites");
    assert!(rep.unresolved.is_empty(), "{:?}", rep.unresolved);
    for n in g.nodes.node_indices() {
        assert!(
            g.nodes[n].op.subgraphs().is_empty(),
            "{} still holds a subgraph",
            g.node_label(n)
        );
    }
    if let Err(e) = verify(g, true) {
        panic!("verifier:\n{}\n{}", e.join("\n"), crate::ir::print_graph(g));
    }
    for (ins, want) in input_sets.iter().zip(&before) {
        let got = crate::eval::run(g, ins.clone()).expect("eval after");
        if tol == 0.0 {
            assert_eq!(&got, want, "{}", crate::ir::print_graph(g));
        }
        for (a, b) in got.iter().zip(want) {
            let e = rel_err(a, b);
            assert!(e <= tol, "outputs differ by {e:.3e}");
        }
    }
}
