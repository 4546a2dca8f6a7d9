//! The graph passes against oracles:
//! (a) every fixture model, at every `--opt-level` and after every pass, passes the IR
//!     verifier and evaluates (reference evaluator, seeded random inputs) to the outputs
//!     of the unoptimized graph within 1e-5 relative error;
//! (b) every node test case of the reference pass list that the pipeline changes
//!     evaluates to the same outputs as before (1e-5);
//! (c) ONNX Runtime runs the `--emit onnx` output of each fixture at each level and
//!     agrees with the original model (1e-4); onnxc loads and evaluates it too.
//!
//! Relative error is max|a - b| / max|b|; NaNs must match NaNs.

mod common;

use onnxc::driver::{self, Options};
use onnxc::ir::{print_graph, verify, DType, Graph, Tensor, Value};
use onnxc::passes::{self, MAX_OPT_LEVEL, PIPELINE};
use onnxc::{eval, io, onnx};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// A model made of the patterns the passes rewrite (PyTorch's exporter folds most of
/// them away already): Conv + BatchNormalization + per-channel Mul and Add, cancelling
/// Transposes, Identity, Reshape chains, rank-2 MatMul + Mul + Add, Dropout, duplicate
/// nodes, a zero Pad and a graph output that folds to a constant. Written to `dir` with a
/// seeded input.
fn pattern_model(dir: &Path) -> PathBuf {
    use common::{f32_tensor, int_attr, node, value_info};
    use onnxc::onnx::proto::{tensor_proto::DataType, AttributeProto, GraphProto, TensorProto};
    let vals = |n: usize, k: f32| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * k + 0.05)
            .collect()
    };
    let i64s = |name: &str, v: Vec<i64>| TensorProto {
        name: Some(name.into()),
        dims: vec![v.len() as i64],
        data_type: Some(DataType::Int64 as i32),
        int64_data: v,
        ..Default::default()
    };
    let ints = |name: &str, v: Vec<i64>| AttributeProto {
        name: Some(name.into()),
        r#type: Some(7),
        ints: v,
        ..Default::default()
    };
    let with = |mut n: onnxc::onnx::proto::NodeProto, a: Vec<AttributeProto>| {
        n.attribute = a;
        n
    };
    let graph = GraphProto {
        name: Some("patterns".into()),
        initializer: vec![
            f32_tensor("W", &[4, 3, 3, 3], &vals(108, 0.05)),
            f32_tensor("b", &[4], &vals(4, 0.1)),
            f32_tensor("scale", &[4], &[0.5, 1.5, -1.0, 2.0]),
            f32_tensor("shift", &[4], &vals(4, 0.2)),
            f32_tensor("mean", &[4], &vals(4, 0.03)),
            f32_tensor("var", &[4], &[0.5, 1.0, 2.0, 0.25]),
            f32_tensor("s1", &[4, 1, 1], &[1.0, -0.5, 2.0, 0.25]),
            f32_tensor("t1", &[1, 4, 1, 1], &vals(4, 0.3)),
            i64s("shape1", vec![1, 144, 1]),
            i64s("shape2", vec![1, -1]),
            f32_tensor("W2", &[144, 10], &vals(1440, 0.01)),
            f32_tensor("s2", &[10], &vals(10, 0.2)),
            f32_tensor("b2", &[10], &vals(10, 0.1)),
            i64s("pads", vec![0; 8]),
        ],
        node: vec![
            node("Conv", &["x", "W", "b"], &["c"]),
            node(
                "BatchNormalization",
                &["c", "scale", "shift", "mean", "var"],
                &["bn"],
            ),
            node("Mul", &["bn", "s1"], &["m1"]),
            node("Add", &["t1", "m1"], &["a1"]),
            node("Relu", &["a1"], &["r"]),
            with(
                node("Transpose", &["r"], &["tr1"]),
                vec![ints("perm", vec![0, 2, 3, 1])],
            ),
            with(
                node("Transpose", &["tr1"], &["tr2"]),
                vec![ints("perm", vec![0, 3, 1, 2])],
            ),
            node("Identity", &["tr2"], &["id"]),
            node("Reshape", &["id", "shape1"], &["rs1"]),
            node("Reshape", &["rs1", "shape2"], &["rs2"]),
            node("MatMul", &["rs2", "W2"], &["mm"]),
            node("Mul", &["mm", "s2"], &["mm2"]),
            node("Add", &["mm2", "b2"], &["y0"]),
            node("Dropout", &["y0"], &["y"]),
            node("Sigmoid", &["a1"], &["sa"]),
            node("Sigmoid", &["a1"], &["sb"]),
            node("Add", &["sa", "sb"], &["w0"]),
            node("Pad", &["w0", "pads"], &["w"]),
            node("Shape", &["x"], &["shp"]),
            with(node("Cast", &["shp"], &["z"]), vec![int_attr("to", 1)]),
        ],
        input: vec![value_info("x", DataType::Float, &[1, 3, 8, 8])],
        output: vec![
            value_info("y", DataType::Float, &[1, 10]),
            value_info("w", DataType::Float, &[1, 4, 6, 6]),
            value_info("z", DataType::Float, &[4]),
        ],
        ..Default::default()
    };
    let mut m = common::model(graph);
    m.opset_import[0].version = Some(13);
    std::fs::create_dir_all(dir).unwrap();
    let path = common::write_model(dir, "model.onnx", &m);
    let x = randomize(
        &[Value::Tensor(Tensor::zeros(DType::F32, &[1, 3, 8, 8]))],
        11,
    );
    io::write_npy(&dir.join("input_0.npy"), &x[0]).unwrap();
    path
}

/// Fixture folders (model.onnx + input_K.npy), and the digits example.
fn fixtures() -> Vec<PathBuf> {
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

fn input_files(dir: &Path) -> Vec<PathBuf> {
    let v: Vec<PathBuf> = (0..)
        .map(|k| dir.join(format!("input_{k}.npy")))
        .take_while(|p| p.is_file())
        .collect();
    if v.is_empty() {
        vec![dir.join("digit_7.npy")]
    } else {
        v
    }
}

fn read_inputs(dir: &Path) -> Vec<Value> {
    input_files(dir)
        .iter()
        .map(|p| Value::Tensor(io::from_npy(&std::fs::read(p).unwrap(), "input").unwrap()))
        .collect()
}

/// `--shape` bindings from the inputs' shapes.
fn shapes_of(g: &Graph, inputs: &[Value]) -> Vec<(String, Vec<usize>)> {
    g.inputs
        .iter()
        .zip(inputs)
        .map(|(&id, v)| {
            (
                g.value(id).name.clone(),
                v.as_tensor().unwrap().shape().to_vec(),
            )
        })
        .collect()
}

/// Float inputs replaced by seeded uniform values in [-1, 1); others (token ids, masks)
/// kept, since their range matters.
fn randomize(inputs: &[Value], seed: u64) -> Vec<Value> {
    let mut s = seed;
    let mut next = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    };
    inputs
        .iter()
        .map(|v| {
            let t = v.as_tensor().unwrap();
            if !t.dtype().is_float() {
                return v.clone();
            }
            let a = ndarray::ArrayD::from_shape_fn(ndarray::IxDyn(t.shape()), |_| next());
            Value::Tensor(Tensor::from_f64(t.dtype(), a, false))
        })
        .collect()
}

/// max|a - b| / max|b| over numbers (NaN only against NaN); exact for other values.
fn rel_err(a: &Value, b: &Value) -> f64 {
    let (Some(ta), Some(tb)) = (a.as_tensor(), b.as_tensor()) else {
        return if a == b { 0.0 } else { f64::INFINITY };
    };
    if ta.dtype() != tb.dtype() || ta.shape() != tb.shape() {
        return f64::INFINITY;
    }
    let (Some(x), Some(y)) = (ta.to_f64(), tb.to_f64()) else {
        return if ta == tb { 0.0 } else { f64::INFINITY };
    };
    let mut diff = 0f64;
    for (p, q) in x.iter().zip(y.iter()) {
        if p == q || (p.is_nan() && q.is_nan()) {
            continue;
        }
        let d = (p - q).abs();
        diff = diff.max(if d.is_nan() { f64::INFINITY } else { d });
    }
    if diff == 0.0 {
        return 0.0;
    }
    let scale = y
        .iter()
        .filter(|v| v.is_finite())
        .map(|v| v.abs())
        .fold(0.0, f64::max);
    diff / scale.max(1e-30)
}

fn max_err(a: &[Value], b: &[Value]) -> f64 {
    assert_eq!(a.len(), b.len(), "output count");
    a.iter()
        .zip(b)
        .map(|(x, y)| rel_err(x, y))
        .fold(0.0, f64::max)
}

#[test]
fn fixtures_after_every_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let mut table = Vec::new();
    let mut dirs = fixtures();
    let patterns = tmp.path().join("patterns");
    pattern_model(&patterns);
    dirs.push(patterns);
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let model = onnx::load(&dir.join("model.onnx")).unwrap();
        let given = read_inputs(&dir);
        let opts = Options {
            shapes: shapes_of(&model.graph, &given),
            ..Options::default()
        };
        let mut g0 = model.graph;
        driver::prepare(&mut g0, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let inputs = randomize(&given, 0x5eed);
        let want = eval::run(&g0, inputs.clone()).unwrap();
        let mut counts = vec![g0.node_count()];
        for level in 1..=MAX_OPT_LEVEL {
            let mut g = g0.clone();
            for p in PIPELINE.iter().filter(|p| p.level <= level) {
                (p.run)(&mut g).unwrap_or_else(|e| panic!("{name} -O{level} {}: {e}", p.name));
                if let Err(errs) = verify(&g, true) {
                    panic!(
                        "{name} -O{level}: verifier after `{}`:\n{}",
                        p.name,
                        errs.join("\n")
                    );
                }
                let got = eval::run(&g, inputs.clone())
                    .unwrap_or_else(|e| panic!("{name} -O{level} after `{}`: {e}", p.name));
                let err = max_err(&got, &want);
                assert!(
                    err <= 1e-5,
                    "{name} -O{level}: after `{}` the outputs differ by {err:.3e}",
                    p.name
                );
            }
            // The driver's path (passes + shape inference again) gives the same graph.
            let mut g2 = g0.clone();
            let mut known = Default::default();
            driver::optimize(&mut g2, level, &mut known).unwrap();
            assert_eq!(print_graph(&g2), print_graph(&g), "{name} -O{level}");
            counts.push(g.node_count());
        }
        table.push((name, counts));
    }
    println!("nodes per fixture and level:");
    println!(
        "{:26} {:>6} {}",
        "fixture",
        "-O0",
        (1..=MAX_OPT_LEVEL)
            .map(|l| format!("{:>6}", format!("-O{l}")))
            .collect::<String>()
    );
    for (name, counts) in &table {
        println!(
            "{name:26} {}",
            counts
                .iter()
                .map(|c| format!("{c:>6} "))
                .collect::<String>()
        );
    }
}

/// Where the ONNX node test cases are: `tests/onnx-node` (written by tests/run.sh), or
/// the folder `ONNXC_NODE_CASES` names.
fn node_cases() -> PathBuf {
    let d = std::env::var_os("ONNXC_NODE_CASES")
        .map(PathBuf::from)
        .unwrap_or_else(|| common::repo_root().join("tests/onnx-node"));
    assert!(
        d.join("COUNT").is_file(),
        "node test cases missing in {}: run tests/run.sh (it generates them)",
        d.display()
    );
    d
}

enum Case {
    /// The pipeline left the graph as it was.
    Unchanged,
    /// Changed, and the outputs agree.
    Agrees,
    /// Shapes not static, inputs unreadable, ...: the pipeline never runs on it.
    Skipped,
    Failed(String),
}

fn node_case(case: &Path) -> Case {
    let Ok(model) = onnx::load(&case.join("model.onnx")) else {
        return Case::Skipped;
    };
    let g = model.graph;
    let data = case.join("test_data_set_0");
    let mut opts = Options::default();
    // Inputs that decide shapes become constants, as the compiled harness binds them.
    let mut shape_inputs = std::collections::HashSet::new();
    for n in g.nodes.node_indices() {
        for &i in g.nodes[n].op.shape_inputs() {
            if let Some(Some(v)) = g.nodes[n].inputs.get(i) {
                shape_inputs.insert(*v);
            }
        }
    }
    let mut inputs = Vec::new();
    for (k, &id) in g.inputs.iter().enumerate() {
        let Ok(v) = io::read_value(&data.join(format!("input_{k}.pb")), &g.value(id).ty) else {
            return Case::Skipped;
        };
        let name = g.value(id).name.clone();
        match v {
            Value::Tensor(t) if shape_inputs.contains(&id) => opts.constants.push((name, t)),
            Value::Tensor(t) => {
                opts.shapes.push((name, t.shape().to_vec()));
                inputs.push(Value::Tensor(t));
            }
            _ => return Case::Skipped,
        }
    }
    let mut g0 = g;
    if driver::prepare(&mut g0, &opts).is_err() {
        return Case::Skipped;
    }
    let Ok(want) = eval::run(&g0, inputs.clone()) else {
        return Case::Skipped;
    };
    let mut g = g0.clone();
    if let Err(e) = passes::optimize(&mut g, MAX_OPT_LEVEL, true) {
        return Case::Failed(format!("passes: {e}"));
    }
    if print_graph(&g) == print_graph(&g0) {
        return Case::Unchanged;
    }
    let got = match eval::run(&g, inputs) {
        Ok(v) => v,
        Err(e) => return Case::Failed(format!("eval after the passes: {e}")),
    };
    if got.len() != want.len() {
        return Case::Failed("output count changed".into());
    }
    for (k, (a, b)) in got.iter().zip(&want).enumerate() {
        let e = rel_err(a, b);
        if e > 1e-5 {
            return Case::Failed(format!("output {k} differs by {e:.3e}"));
        }
    }
    Case::Agrees
}

#[test]
fn node_tests_changed_by_the_pipeline_agree() {
    let t = Instant::now();
    let dir = node_cases();
    let list =
        std::fs::read_to_string(common::repo_root().join("tests/conformance/reference-pass.txt"))
            .expect("reference pass list");
    let (mut same, mut agree, mut skipped, mut failed) = (0, 0, 0, Vec::new());
    for name in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let case = dir.join(name);
        let r = std::panic::catch_unwind(|| node_case(&case))
            .unwrap_or_else(|_| Case::Failed("panic".into()));
        match r {
            Case::Unchanged => same += 1,
            Case::Agrees => agree += 1,
            Case::Skipped => skipped += 1,
            Case::Failed(w) => failed.push(format!("{name}: {w}")),
        }
    }
    println!(
        "node tests: {agree} changed by the pipeline and agreeing, {same} unchanged, \
         {skipped} not compilable (skipped), {} failed, in {:.1} s",
        failed.len(),
        t.elapsed().as_secs_f64()
    );
    assert!(
        agree > 50,
        "the pipeline should change many node tests ({agree})"
    );
    assert!(
        failed.is_empty(),
        "cases the passes break:\n{}",
        failed.join("\n")
    );
}

/// Runs several models with ONNX Runtime on the same inputs; outputs of model `m` go to
/// `out/m/output_K.npy`.
const ORT_MANY: &str = r#"
import os, sys
import numpy as np
import onnxruntime as ort
out, n = sys.argv[1], int(sys.argv[2])
models, inputs = sys.argv[3:3 + n], sys.argv[3 + n:]
for m, path in enumerate(models):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    feeds = {i.name: np.load(p) for i, p in zip(sess.get_inputs(), inputs)}
    d = os.path.join(out, str(m))
    os.makedirs(d, exist_ok=True)
    for k, v in enumerate(sess.run(None, feeds)):
        np.save(os.path.join(d, f"output_{k}.npy"), np.ascontiguousarray(v))
"#;

fn read_outputs(dir: &Path) -> Vec<Value> {
    (0..)
        .map(|k| dir.join(format!("output_{k}.npy")))
        .take_while(|p| p.is_file())
        .map(|p| Value::Tensor(io::from_npy(&std::fs::read(&p).unwrap(), "ort output").unwrap()))
        .collect()
}

#[test]
fn emitted_onnx_runs_in_onnxruntime() {
    let tmp = tempfile::tempdir().unwrap();
    let mut dirs = fixtures();
    let patterns = tmp.path().join("patterns");
    pattern_model(&patterns);
    dirs.push(patterns);
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let model = onnx::load(&dir.join("model.onnx")).unwrap();
        let inputs = read_inputs(&dir);
        let mut models = vec![dir.join("model.onnx")];
        for level in 1..=MAX_OPT_LEVEL {
            let out = tmp.path().join(format!("{name}-O{level}.onnx"));
            let mut args: Vec<String> = vec![
                dir.join("model.onnx").display().to_string(),
                "--emit".into(),
                "onnx".into(),
                format!("-O{level}"),
                "-o".into(),
                out.display().to_string(),
            ];
            for (n, s) in shapes_of(&model.graph, &inputs) {
                let dims: Vec<String> = s.iter().map(|d| d.to_string()).collect();
                args.push("--shape".into());
                args.push(format!("{n}={}", dims.join("x")));
            }
            let argv: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, _, err) = common::onnxc(&argv);
            assert_eq!(code, 0, "{name}: onnxc --emit onnx failed:\n{err}");
            models.push(out);
        }
        let res = tmp.path().join(&name);
        let r = Command::new("python3")
            .arg("-c")
            .arg(ORT_MANY)
            .arg(&res)
            .arg(models.len().to_string())
            .args(&models)
            .args(input_files(&dir))
            .output()
            .expect("python3 runs");
        assert!(
            r.status.success(),
            "{name}: onnxruntime failed:\n{}",
            String::from_utf8_lossy(&r.stderr)
        );
        let want = read_outputs(&res.join("0"));
        assert!(!want.is_empty());
        for (m, path) in models.iter().enumerate().skip(1) {
            let got = read_outputs(&res.join(m.to_string()));
            let err = max_err(&got, &want);
            println!("{name} -O{m} in onnxruntime: relative error {err:.2e}");
            assert!(
                err <= 1e-4,
                "{name} -O{m}: ONNX Runtime differs by {err:.3e}"
            );
            // onnxc reads its own output back.
            let back = onnx::load(path).unwrap_or_else(|e| panic!("{name} -O{m}: {e}"));
            let ours = eval::run(&back.graph, inputs.clone()).unwrap();
            let err = max_err(&ours, &want);
            assert!(
                err <= 1e-4,
                "{name} -O{m}: onnxc on its own output differs by {err:.3e}"
            );
            let sig = |g: &Graph| -> Vec<(String, Option<DType>)> {
                g.inputs
                    .iter()
                    .chain(&g.outputs)
                    .map(|&v| (g.value(v).name.clone(), g.value(v).ty.dtype()))
                    .collect()
            };
            assert_eq!(
                sig(&back.graph),
                sig(&model.graph),
                "{name} -O{m}: interface"
            );
        }
    }
}

/// The pattern model compiled at each level (native code for the host) matches the
/// reference evaluator on the original graph (1e-4).
#[test]
fn pattern_model_compiles_at_every_level() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("patterns");
    let path = pattern_model(&dir);
    let inputs = read_inputs(&dir);
    let model = onnx::load(&path).unwrap();
    let want = eval::run(&model.graph, inputs.clone()).unwrap();
    for level in 0..=MAX_OPT_LEVEL {
        let opts = Options {
            opt_level: level,
            ..Options::default()
        };
        let c = driver::compile_graph(model.graph.clone(), "model", &opts)
            .unwrap_or_else(|e| panic!("-O{level}: {e}"));
        let scratch = tempfile::tempdir().unwrap();
        let got = onnxc::runner::run_compiled(&c, &inputs, scratch.path())
            .unwrap_or_else(|e| panic!("-O{level}: {e}"));
        let err = max_err(&got, &want);
        println!(
            "patterns -O{level}: {} nodes, {} kernels, compiled relative error {err:.2e}",
            c.graph.node_count(),
            c.lowered.program.kernels.len()
        );
        assert!(
            err <= 1e-4,
            "-O{level}: compiled outputs differ by {err:.3e}"
        );
    }
}

/// `--emit onnx`'s writer on every node test case of the reference pass list (no passes,
/// so every attribute kind, subgraph, sequence and optional value the cases use goes
/// through it): the model written back decodes and evaluates to the same outputs.
#[test]
fn node_tests_round_trip_through_the_onnx_writer() {
    let t = Instant::now();
    let dir = node_cases();
    let list =
        std::fs::read_to_string(common::repo_root().join("tests/conformance/reference-pass.txt"))
            .expect("reference pass list");
    let (mut ok, mut skipped, mut failed) = (0, 0, Vec::new());
    for name in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let case = dir.join(name);
        let Ok(m) = onnx::load(&case.join("model.onnx")) else {
            skipped += 1;
            continue;
        };
        let data = case.join("test_data_set_0");
        let inputs: Option<Vec<Value>> = m
            .graph
            .inputs
            .iter()
            .enumerate()
            .map(|(k, &id)| {
                io::read_value(&data.join(format!("input_{k}.pb")), &m.graph.value(id).ty).ok()
            })
            .collect();
        let Some(inputs) = inputs else {
            skipped += 1;
            continue;
        };
        let Ok(want) = eval::run(&m.graph, inputs.clone()) else {
            skipped += 1;
            continue;
        };
        let bytes = onnxc::emit::onnx::model_bytes(&m.graph, &m.opsets, m.ir_version);
        let back = match onnx::decode(&bytes, None) {
            Ok(b) => b,
            Err(e) => {
                failed.push(format!("{name}: the written model does not load: {e}"));
                continue;
            }
        };
        let got = match eval::run(&back.graph, inputs.clone()) {
            Ok(v) => v,
            Err(e) => {
                failed.push(format!("{name}: the written model fails: {e}"));
                continue;
            }
        };
        if max_err(&got, &want) == 0.0 {
            ok += 1;
        } else if eval::run(&m.graph, inputs).is_ok_and(|again| max_err(&again, &want) != 0.0) {
            skipped += 1; // random outputs
        } else {
            failed.push(format!("{name}: outputs differ"));
        }
    }
    println!(
        "onnx writer round trip: {ok} agree, {skipped} skipped, {} failed, in {:.1} s",
        failed.len(),
        t.elapsed().as_secs_f64()
    );
    assert!(ok > 1500, "too few cases checked ({ok})");
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
