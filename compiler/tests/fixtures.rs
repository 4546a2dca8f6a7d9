//! Whole PyTorch-exported models (tests/fixtures/*/model.onnx, made by
//! tests/fixtures/make_fixtures.py) through the reference evaluator, compared with ONNX
//! Runtime (the `onnxruntime` Python package, run live) within 1e-4 relative error
//! (max|ours - ort| / max|ort|). Shape inference must also resolve every value once the
//! inputs are bound, agree with ORT's output shapes, and leave a graph the verifier
//! accepts.

mod common;

use onnxc::ir::{verify, Value};
use onnxc::{eval, io, onnx, passes};
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixtures() -> Vec<PathBuf> {
    let dir = common::repo_root().join("tests/fixtures");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/fixtures")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").is_file())
        .collect();
    v.sort();
    assert!(
        v.len() >= 4,
        "expected the fixture models in {}",
        dir.display()
    );
    v
}

fn inputs_of(dir: &Path) -> Vec<PathBuf> {
    (0..)
        .map(|k| dir.join(format!("input_{k}.npy")))
        .take_while(|p| p.is_file())
        .collect()
}

/// Runs ONNX Runtime on the fixture and returns its outputs.
fn ort_outputs(dir: &Path, out: &Path) -> Vec<Value> {
    let script = common::repo_root().join("tests/fixtures/ort_run.py");
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg(dir.join("model.onnx")).arg(out);
    cmd.args(inputs_of(dir));
    let r = cmd.output().expect("python3 runs");
    assert!(
        r.status.success(),
        "onnxruntime failed on {}:\n{}",
        dir.display(),
        String::from_utf8_lossy(&r.stderr)
    );
    (0..)
        .map(|k| out.join(format!("output_{k}.npy")))
        .take_while(|p| p.is_file())
        .map(|p| Value::Tensor(io::from_npy(&std::fs::read(&p).unwrap(), "ort output").unwrap()))
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
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
    diff / scale.max(1e-30)
}

#[test]
fn fixtures_match_onnxruntime() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let mut model = onnx::load(&dir.join("model.onnx")).unwrap();
        let inputs: Vec<Value> = inputs_of(&dir)
            .iter()
            .map(|p| Value::Tensor(io::from_npy(&std::fs::read(p).unwrap(), "input").unwrap()))
            .collect();
        let expected = ort_outputs(&dir, &tmp.path().join(&name));
        let got = eval::run(&model.graph, inputs.clone()).unwrap();
        assert_eq!(got.len(), expected.len());
        for (k, (g, e)) in got.iter().zip(&expected).enumerate() {
            let err = rel_err(g, e);
            println!("{name} output {k}: relative error {err:.2e} vs onnxruntime");
            assert!(
                err <= 1e-4,
                "{name} output {k}: relative error {err:.3e} > 1e-4"
            );
        }

        // Shape inference with the inputs' shapes bound.
        let binds: Vec<(String, Vec<usize>)> = model
            .graph
            .inputs
            .iter()
            .zip(&inputs)
            .map(|(&id, v)| {
                (
                    model.graph.value(id).name.clone(),
                    v.as_tensor().unwrap().shape().to_vec(),
                )
            })
            .collect();
        passes::bind_input_shapes(&mut model.graph, &binds).unwrap();
        let rep = passes::infer_shapes(&mut model.graph).unwrap();
        assert!(
            rep.unresolved.is_empty(),
            "{name}: shapes not inferred: {:?}",
            rep.unresolved
        );
        if let Err(errs) = verify(&model.graph, true) {
            panic!("{name}: verifier: {}", errs.join("\n"));
        }
        for (&o, e) in model.graph.outputs.iter().zip(&expected) {
            assert_eq!(
                model.graph.value(o).ty.static_shape().as_deref(),
                Some(e.as_tensor().unwrap().shape()),
                "{name}: inferred output shape"
            );
        }
    }
}
