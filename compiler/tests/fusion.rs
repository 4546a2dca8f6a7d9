//! The fusion passes on the fixture models (tests/fixtures/*, examples/digits):
//! - onnxc at -O2 emits no more kernels than ONNX Runtime's optimized model has nodes
//!   (ORT_ENABLE_ALL, one thread, counted live by tests/fixtures/ort_count.py), and its
//!   arena is no larger than at -O0;
//! - the compiled -O2 model matches the reference evaluator of the original model within
//!   1e-4 (host; tests/compiled.rs checks aarch64);
//! - every pass of the pipeline keeps the graph equivalent: the reference evaluator gives
//!   the same outputs before and after it, on random inputs, within 1e-5.

mod common;

use onnxc::driver::{compile_graph, prepare, Options};
use onnxc::ir::{Graph, Tensor, Value};
use onnxc::{eval, io, onnx, passes, runner};
use std::path::{Path, PathBuf};
use std::process::Command;

fn models() -> Vec<PathBuf> {
    let dir = common::repo_root().join("tests/fixtures");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/fixtures")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").is_file())
        .collect();
    v.sort();
    assert!(
        v.len() >= 6,
        "expected the fixture models in {}",
        dir.display()
    );
    v.push(common::repo_root().join("examples/digits"));
    v
}

fn inputs_of(dir: &Path) -> Vec<Value> {
    let v: Vec<Value> = (0..)
        .map(|k| dir.join(format!("input_{k}.npy")))
        .take_while(|p| p.is_file())
        .map(|p| Value::Tensor(io::from_npy(&std::fs::read(p).unwrap(), "input").unwrap()))
        .collect();
    if !v.is_empty() {
        return v;
    }
    vec![Value::Tensor(
        io::from_npy(&std::fs::read(dir.join("digit_7.npy")).unwrap(), "digit").unwrap(),
    )]
}

fn shapes_of(g: &Graph, inputs: &[Value]) -> Vec<(String, Vec<usize>)> {
    g.inputs
        .iter()
        .zip(inputs)
        .map(|(&i, v)| {
            (
                g.value(i).name.clone(),
                v.as_tensor().unwrap().shape().to_vec(),
            )
        })
        .collect()
}

fn rel_err(a: &Value, b: &Value) -> f64 {
    let (a, b) = (a.as_tensor().unwrap(), b.as_tensor().unwrap());
    assert_eq!(a.dtype(), b.dtype());
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.to_f64().unwrap(), b.to_f64().unwrap());
    let diff = a
        .iter()
        .zip(b.iter())
        .map(|(x, y)| common::abs_diff(*x, *y))
        .fold(0.0, f64::max);
    diff / b.iter().map(|y| y.abs()).fold(0.0, f64::max).max(1e-30)
}

/// ONNX Runtime's optimized node count for a model.
fn ort_nodes(model: &Path) -> usize {
    let script = common::repo_root().join("tests/fixtures/ort_count.py");
    let r = Command::new("python3")
        .arg(&script)
        .arg(model)
        .output()
        .expect("python3 runs");
    assert!(
        r.status.success(),
        "ort_count.py failed on {}:\n{}",
        model.display(),
        String::from_utf8_lossy(&r.stderr)
    );
    String::from_utf8_lossy(&r.stdout)
        .trim()
        .parse()
        .expect("a node count")
}

#[test]
fn fewer_kernels_than_onnxruntime_nodes() {
    let scratch = tempfile::tempdir().unwrap();
    let mut table = vec![format!(
        "{:<24} {:>9} {:>10} {:>10} {:>10} {:>10}",
        "fixture", "ORT nodes", "kernels O0", "kernels O2", "arena O0", "arena O2"
    )];
    let mut failures = Vec::new();
    for dir in models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let model = onnx::load(&dir.join("model.onnx")).unwrap();
        let inputs = inputs_of(&dir);
        let expected = eval::run(&model.graph, inputs.clone()).unwrap();
        let shapes = shapes_of(&model.graph, &inputs);
        let compile = |level: u8| {
            let opts = Options {
                shapes: shapes.clone(),
                opt_level: level,
                ..Options::default()
            };
            compile_graph(model.graph.clone(), "model", &opts)
                .unwrap_or_else(|e| panic!("{name} at -O{level}: {e}"))
        };
        let (c0, c2) = (compile(0), compile(2));
        let ort = ort_nodes(&dir.join("model.onnx"));
        let (k0, k2) = (
            c0.lowered.program.kernels.len(),
            c2.lowered.program.kernels.len(),
        );
        let (a0, a2) = (c0.lowered.plan.arena_bytes, c2.lowered.plan.arena_bytes);
        table.push(format!(
            "{name:<24} {ort:>9} {k0:>10} {k2:>10} {a0:>10} {a2:>10}"
        ));
        if k2 > ort {
            failures.push(format!("{name}: {k2} kernels at -O2, ORT runs {ort} nodes"));
        }
        if a2 > a0 {
            failures.push(format!("{name}: arena {a2} at -O2 > {a0} at -O0"));
        }
        let dir_out = scratch.path().join(&name);
        std::fs::create_dir_all(&dir_out).unwrap();
        let got =
            runner::run_compiled(&c2, &inputs, &dir_out).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (k, (g, e)) in got.iter().zip(&expected).enumerate() {
            let err = rel_err(g, e);
            if err > 1e-4 {
                failures.push(format!(
                    "{name} output {k} at -O2: relative error {err:.3e}"
                ));
            }
        }
    }
    println!("{}", table.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Deterministic pseudo-random inputs: float inputs get values in [-1, 1), integer
/// inputs (token ids, masks) keep the fixture's values.
fn random_like(inputs: &[Value], seed: u64) -> Vec<Value> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    inputs
        .iter()
        .map(|v| {
            let t = v.as_tensor().unwrap();
            if !t.dtype().is_float() {
                return v.clone();
            }
            let data: Vec<f64> = (0..t.len()).map(|_| next()).collect();
            let a = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(t.shape()), data).unwrap();
            Value::Tensor(Tensor::from_f64(t.dtype(), a, false))
        })
        .collect()
}

#[test]
fn every_pass_keeps_the_graph_equivalent() {
    let mut changed = 0;
    for dir in models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let mut g = onnx::load(&dir.join("model.onnx")).unwrap().graph;
        let fixture_inputs = inputs_of(&dir);
        let opts = Options {
            shapes: shapes_of(&g, &fixture_inputs),
            ..Options::default()
        };
        prepare(&mut g, &opts).unwrap();
        let inputs = random_like(&fixture_inputs, 7);
        let mut before = eval::run(&g, inputs.clone()).unwrap();
        for p in passes::PIPELINE.iter().filter(|p| p.level <= 2) {
            let n0 = g.node_count();
            (p.run)(&mut g).unwrap_or_else(|e| panic!("{name}: pass {}: {e}", p.name));
            if let Err(errs) = onnxc::ir::verify(&g, true) {
                panic!("{name}: verifier after {}: {}", p.name, errs.join("\n"));
            }
            passes::infer_shapes(&mut g).unwrap();
            let after = eval::run(&g, inputs.clone())
                .unwrap_or_else(|e| panic!("{name}: evaluating after {}: {e}", p.name));
            for (k, (a, b)) in after.iter().zip(&before).enumerate() {
                let err = rel_err(a, b);
                assert!(
                    err <= 1e-5,
                    "{name}: pass {} changed output {k} by {err:.3e}",
                    p.name
                );
            }
            println!("{name}: {} {n0} -> {} nodes", p.name, g.node_count());
            if p.name.starts_with("fuse_") && g.node_count() < n0 {
                changed += 1;
            }
            before = after;
        }
    }
    assert!(
        changed >= 7,
        "the fusion passes changed only {changed} graphs"
    );
}

/// A graph of the patterns exporters write out op by op: MatMul + bias + GELU (Div/Erf/
/// Add/Mul/Mul) + SiLU, a max-subtracted softmax, a layer norm with scale and bias, and a
/// residual Add + Relu. After -O2 it is four nodes (an epilogue-fused MatMul, Softmax,
/// LayerNormalization, a fused elementwise tree); compiled, it matches the reference
/// evaluation of the original graph.
#[test]
fn exported_patterns_fuse() {
    use common::{f32_tensor, model, node, value_info};
    use onnxc::onnx::proto::{tensor_proto::DataType, GraphProto, TensorProto};
    let (n, c) = (4usize, 8usize);
    let det = |k: usize, s: f32| -> Vec<f32> {
        (0..k)
            .map(|i| ((i * 37 % 17) as f32 / 17.0 - 0.5) * s)
            .collect()
    };
    let i64s = |name: &str, v: &[i64]| TensorProto {
        name: Some(name.into()),
        dims: vec![v.len() as i64],
        data_type: Some(DataType::Int64 as i32),
        int64_data: v.to_vec(),
        ..Default::default()
    };
    let scalar = |name: &str, v: f32| f32_tensor(name, &[], &[v]);
    let nodes = vec![
        node("MatMul", &["x", "w"], &["h"]),
        node("Add", &["h", "b"], &["h2"]),
        node("Div", &["h2", "sqrt2"], &["gd"]),
        node("Erf", &["gd"], &["ge"]),
        node("Add", &["ge", "one"], &["ga"]),
        node("Mul", &["h2", "ga"], &["gm"]),
        node("Mul", &["gm", "half"], &["g"]),
        node("Sigmoid", &["g"], &["sg"]),
        node("Mul", &["g", "sg"], &["y1"]),
        node("ReduceMax", &["y1", "axes"], &["mx"]),
        node("Sub", &["y1", "mx"], &["sb"]),
        node("Exp", &["sb"], &["ex"]),
        node("ReduceSum", &["ex", "axes"], &["su"]),
        node("Div", &["ex", "su"], &["sm"]),
        node("ReduceMean", &["sm", "axes"], &["mean"]),
        node("Sub", &["sm", "mean"], &["dd"]),
        node("Pow", &["dd", "two"], &["pw"]),
        node("ReduceMean", &["pw", "axes"], &["var"]),
        node("Add", &["var", "eps"], &["ve"]),
        node("Sqrt", &["ve"], &["sd"]),
        node("Div", &["dd", "sd"], &["nrm"]),
        node("Mul", &["nrm", "gamma"], &["sc"]),
        node("Add", &["sc", "beta"], &["ln"]),
        node("Add", &["ln", "x"], &["res"]),
        node("Relu", &["res"], &["y"]),
    ];
    // Opset 24: the patterns make Swish (24) and Attention (23) only when the model has them.
    let m = at_opset_24(model(GraphProto {
        name: Some("patterns".into()),
        node: nodes,
        input: vec![value_info("x", DataType::Float, &[n as i64, c as i64])],
        output: vec![value_info("y", DataType::Float, &[n as i64, c as i64])],
        initializer: vec![
            f32_tensor("w", &[c as i64, c as i64], &det(c * c, 0.8)),
            f32_tensor("b", &[c as i64], &det(c, 0.3)),
            f32_tensor("gamma", &[c as i64], &det(c, 2.0)),
            f32_tensor("beta", &[c as i64], &det(c, 0.5)),
            scalar("sqrt2", std::f32::consts::SQRT_2),
            scalar("one", 1.0),
            scalar("half", 0.5),
            scalar("two", 2.0),
            scalar("eps", 1e-5),
            i64s("axes", &[-1]),
        ],
        ..Default::default()
    }));
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_model(dir.path(), "patterns.onnx", &m);
    let model = onnx::load(&path).unwrap();
    let x = Value::Tensor(Tensor::from_vec(&[n, c], det(n * c, 3.0)));
    let inputs = random_like(&[x], 3);
    let expected = eval::run(&model.graph, inputs.clone()).unwrap();

    let mut g = model.graph.clone();
    prepare(&mut g, &Options::default()).unwrap();
    for p in passes::PIPELINE.iter().filter(|p| p.level <= 2) {
        (p.run)(&mut g).unwrap();
        passes::infer_shapes(&mut g).unwrap();
        let got = eval::run(&g, inputs.clone()).unwrap();
        let err = rel_err(&got[0], &expected[0]);
        assert!(
            err <= 1e-5,
            "pass {} changed the output by {err:.3e}",
            p.name
        );
    }
    let mut ops: Vec<String> = g.nodes.node_weights().map(|n| n.op_type.clone()).collect();
    ops.sort();
    assert_eq!(
        ops,
        ["Fused", "Fused", "LayerNormalization", "Softmax"],
        "nodes after -O2"
    );
    let c2 = compile_graph(model.graph, "patterns", &Options::default()).unwrap();
    let got = runner::run_compiled(&c2, &inputs, dir.path()).unwrap();
    let err = rel_err(&got[0], &expected[0]);
    println!(
        "patterns: {} kernels, relative error {err:.2e}",
        c2.lowered.program.kernels.len()
    );
    assert!(err <= 1e-4, "compiled -O2: relative error {err:.3e}");
}

/// Scaled dot-product attention written out op by op (K^T made by a Transpose of
/// [B, S, H, D], a Div scale, an additive mask, Softmax, MatMul V) becomes one standard
/// Attention node (plus the Transpose, now to [B, H, S, D]); compiled, it matches the
/// reference evaluation of the original graph.
#[test]
fn exported_attention_fuses() {
    use common::{f32_tensor, int_attr, model, node, value_info};
    use onnxc::onnx::proto::{tensor_proto::DataType, AttributeProto, GraphProto};
    let (h, s, d) = (2i64, 4i64, 8i64);
    let mut kt = node("Transpose", &["k0"], &["kt"]);
    kt.attribute.push(AttributeProto {
        name: Some("perm".into()),
        r#type: Some(7),
        ints: vec![0, 2, 3, 1],
        ..Default::default()
    });
    let mut sm = node("Softmax", &["a"], &["p"]);
    sm.attribute.push(int_attr("axis", -1));
    // Opset 24: the patterns make Swish (24) and Attention (23) only when the model has them.
    let m = at_opset_24(model(GraphProto {
        name: Some("attention".into()),
        node: vec![
            kt,
            node("MatMul", &["q", "kt"], &["sc"]),
            node("Div", &["sc", "scale"], &["dv"]),
            node("Add", &["dv", "mask"], &["a"]),
            sm,
            node("MatMul", &["p", "v"], &["y"]),
        ],
        input: vec![
            value_info("q", DataType::Float, &[1, h, s, d]),
            value_info("k0", DataType::Float, &[1, s, h, d]),
            value_info("v", DataType::Float, &[1, h, s, d]),
            value_info("mask", DataType::Float, &[1, 1, 1, s]),
        ],
        output: vec![value_info("y", DataType::Float, &[1, h, s, d])],
        initializer: vec![f32_tensor("scale", &[], &[(d as f32).sqrt()])],
        ..Default::default()
    }));
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_model(dir.path(), "attention.onnx", &m);
    let model = onnx::load(&path).unwrap();
    let zeros = |shape: &[usize]| Value::Tensor(Tensor::zeros(onnxc::ir::DType::F32, shape));
    let (h, s, d) = (h as usize, s as usize, d as usize);
    let inputs = random_like(
        &[
            zeros(&[1, h, s, d]),
            zeros(&[1, s, h, d]),
            zeros(&[1, h, s, d]),
            zeros(&[1, 1, 1, s]),
        ],
        5,
    );
    let expected = eval::run(&model.graph, inputs.clone()).unwrap();
    let mut g = model.graph.clone();
    prepare(&mut g, &Options::default()).unwrap();
    for p in passes::PIPELINE.iter().filter(|p| p.level <= 2) {
        (p.run)(&mut g).unwrap();
        passes::infer_shapes(&mut g).unwrap();
        let got = eval::run(&g, inputs.clone()).unwrap();
        let err = rel_err(&got[0], &expected[0]);
        assert!(
            err <= 1e-5,
            "pass {} changed the output by {err:.3e}",
            p.name
        );
    }
    let mut ops: Vec<String> = g.nodes.node_weights().map(|n| n.op_type.clone()).collect();
    ops.sort();
    assert_eq!(ops, ["Attention", "Transpose"], "nodes after -O2");
    let c2 = compile_graph(model.graph, "attention", &Options::default()).unwrap();
    let got = runner::run_compiled(&c2, &inputs, dir.path()).unwrap();
    let err = rel_err(&got[0], &expected[0]);
    println!(
        "attention: {} kernels, relative error {err:.2e}",
        c2.lowered.program.kernels.len()
    );
    assert!(err <= 1e-4, "compiled -O2: relative error {err:.3e}");
}

/// A fused node whose body is neither an anchor with an epilogue nor elementwise only
/// (Softmax, Relu, Softmax) is lowered node by node, with arena buffers inside the body,
/// and still computes the original graph.
#[test]
fn fused_body_of_other_ops_lowers_node_by_node() {
    use common::{model, node, value_info};
    use onnxc::onnx::proto::{tensor_proto::DataType, GraphProto};
    // Opset 24: the patterns make Swish (24) and Attention (23) only when the model has them.
    let m = at_opset_24(model(GraphProto {
        name: Some("chain".into()),
        node: vec![
            node("Softmax", &["x"], &["a"]),
            node("Relu", &["a"], &["b"]),
            node("Softmax", &["b"], &["y"]),
        ],
        input: vec![value_info("x", DataType::Float, &[3, 5])],
        output: vec![value_info("y", DataType::Float, &[3, 5])],
        ..Default::default()
    }));
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_model(dir.path(), "chain.onnx", &m);
    let model = onnx::load(&path).unwrap();
    let inputs = random_like(
        &[Value::Tensor(Tensor::zeros(onnxc::ir::DType::F32, &[3, 5]))],
        11,
    );
    let expected = eval::run(&model.graph, inputs.clone()).unwrap();
    let mut g = model.graph.clone();
    prepare(&mut g, &Options::default()).unwrap();
    let order = g.topo_order().unwrap();
    onnxc::ops::fused::fuse_nodes(&mut g, &order, "chain").unwrap();
    assert_eq!(g.node_count(), 1);
    let got = eval::run(&g, inputs.clone()).unwrap();
    assert!(rel_err(&got[0], &expected[0]) <= 1e-6);
    let opts = Options {
        opt_level: 0,
        ..Options::default()
    };
    let c = compile_graph(g, "chain", &opts).unwrap();
    let got = runner::run_compiled(&c, &inputs, dir.path()).unwrap();
    let err = rel_err(&got[0], &expected[0]);
    assert!(err <= 1e-5, "relative error {err:.3e}");
}

/// GELU in its tanh form, written out as PyTorch exports it (`Pow 3`, `Mul 0.044715`,
/// `Add`, `Mul sqrt(2/pi)`, `Tanh`, `Add 1`, `(x * 0.5) * ...`), after a MatMul: one fused
/// node (the MatMul with a Gelu epilogue) that matches the original graph compiled.
#[test]
fn exported_tanh_gelu_joins_the_matmul() {
    use common::{f32_tensor, model, node, value_info};
    use onnxc::onnx::proto::{tensor_proto::DataType, GraphProto};
    let scalar = |name: &str, v: f32| f32_tensor(name, &[], &[v]);
    let w: Vec<f32> = (0..48)
        .map(|i| ((i * 29 % 13) as f32 - 6.0) / 5.0)
        .collect();
    // Opset 24: the patterns make Swish (24) and Attention (23) only when the model has them.
    let m = at_opset_24(model(GraphProto {
        name: Some("gelu_tanh".into()),
        node: vec![
            node("MatMul", &["x", "w"], &["h"]),
            node("Pow", &["h", "three"], &["p3"]),
            node("Mul", &["c", "p3"], &["cp"]),
            node("Add", &["h", "cp"], &["in"]),
            node("Mul", &["in", "k"], &["ki"]),
            node("Tanh", &["ki"], &["t"]),
            node("Add", &["t", "one"], &["a"]),
            node("Mul", &["h", "half"], &["hh"]),
            node("Mul", &["hh", "a"], &["y"]),
        ],
        input: vec![value_info("x", DataType::Float, &[3, 8])],
        output: vec![value_info("y", DataType::Float, &[3, 6])],
        initializer: vec![
            f32_tensor("w", &[8, 6], &w),
            scalar("three", 3.0),
            scalar("c", 0.044715),
            scalar("k", (2.0 / std::f32::consts::PI).sqrt()),
            scalar("one", 1.0),
            scalar("half", 0.5),
        ],
        ..Default::default()
    }));
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_model(dir.path(), "gelu_tanh.onnx", &m);
    let model = onnx::load(&path).unwrap();
    let inputs = random_like(
        &[Value::Tensor(Tensor::zeros(onnxc::ir::DType::F32, &[3, 8]))],
        13,
    );
    let expected = eval::run(&model.graph, inputs.clone()).unwrap();
    let mut g = model.graph.clone();
    prepare(&mut g, &Options::default()).unwrap();
    for p in passes::PIPELINE.iter().filter(|p| p.level <= 2) {
        (p.run)(&mut g).unwrap();
        passes::infer_shapes(&mut g).unwrap();
        let got = eval::run(&g, inputs.clone()).unwrap();
        let err = rel_err(&got[0], &expected[0]);
        assert!(
            err <= 1e-5,
            "pass {} changed the output by {err:.3e}",
            p.name
        );
    }
    let ops: Vec<String> = g.nodes.node_weights().map(|n| n.op_type.clone()).collect();
    assert_eq!(ops, ["Fused"], "nodes after -O2");
    let c2 = compile_graph(model.graph, "gelu_tanh", &Options::default()).unwrap();
    assert_eq!(c2.lowered.program.kernels.len(), 1, "one kernel");
    let got = runner::run_compiled(&c2, &inputs, dir.path()).unwrap();
    let err = rel_err(&got[0], &expected[0]);
    assert!(err <= 1e-4, "compiled -O2: relative error {err:.3e}");
}

fn at_opset_24(mut m: onnxc::onnx::proto::ModelProto) -> onnxc::onnx::proto::ModelProto {
    m.opset_import[0].version = Some(24);
    m
}
