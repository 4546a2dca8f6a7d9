//! Bad and hostile input: every case gets one clear error and exit code 1, never a
//! panic, a hang or an unbounded allocation.

mod common;

use common::*;
use onnxc::onnx::proto::{tensor_proto::DataType, GraphProto, StringStringEntryProto, TensorProto};
use prost::Message;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

#[test]
fn empty_file() {
    let d = tmp();
    let p = d.path().join("empty.onnx");
    std::fs::write(&p, b"").unwrap();
    assert_clean_error(&["inspect", p.to_str().unwrap()], "empty");
}

#[test]
fn truncated_model() {
    let d = tmp();
    let bytes = relu_model().encode_to_vec();
    for cut in [1, bytes.len() / 3, bytes.len() - 1] {
        let p = d.path().join(format!("cut{cut}.onnx"));
        std::fs::write(&p, &bytes[..cut]).unwrap();
        assert_clean_error(&["inspect", p.to_str().unwrap()], "not a valid ONNX model");
    }
}

#[test]
fn text_and_random_bytes() {
    let d = tmp();
    let p = d.path().join("text.onnx");
    std::fs::write(&p, b"this is a README, not a model\n").unwrap();
    assert_clean_error(&["inspect", p.to_str().unwrap()], "not a valid ONNX model");
    let mut x: u64 = 0x9E3779B97F4A7C15;
    let noise: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let p = d.path().join("noise.onnx");
    std::fs::write(&p, noise).unwrap();
    assert_clean_error(&["inspect", p.to_str().unwrap()], "not a valid ONNX model");
}

#[test]
fn missing_file_and_directory() {
    let d = tmp();
    let p = d.path().join("nope.onnx");
    assert_clean_error(&["inspect", p.to_str().unwrap()], "cannot read");
    assert_clean_error(&["inspect", d.path().to_str().unwrap()], "is not a file");
}

#[test]
fn cycle() {
    let d = tmp();
    let m = model(GraphProto {
        name: Some("cyc".into()),
        node: vec![node("Relu", &["b"], &["a"]), node("Relu", &["a"], &["b"])],
        input: vec![],
        output: vec![value_info("a", DataType::Float, &[1])],
        ..Default::default()
    });
    let p = write_model(d.path(), "cycle.onnx", &m);
    assert_clean_error(&["inspect", p.to_str().unwrap()], "cycle");
}

#[test]
fn dangling_and_duplicate_names() {
    let d = tmp();
    let mut m = relu_model();
    m.graph.as_mut().unwrap().node[0].input[0] = "nowhere".into();
    let p = write_model(d.path(), "dangling.onnx", &m);
    assert_clean_error(
        &["inspect", p.to_str().unwrap()],
        "`nowhere` is not produced",
    );

    let mut m = relu_model();
    m.graph
        .as_mut()
        .unwrap()
        .node
        .push(node("Relu", &["x"], &["y"]));
    let p = write_model(d.path(), "dup.onnx", &m);
    assert_clean_error(&["inspect", p.to_str().unwrap()], "defined twice");
}

#[test]
fn unsupported_ops_listed_at_once() {
    let d = tmp();
    let mut m = relu_model();
    let g = m.graph.as_mut().unwrap();
    g.node = vec![
        node("FrobnicateA", &["x"], &["t"]),
        node("FrobnicateB", &["t"], &["y"]),
    ];
    let p = write_model(d.path(), "unsup.onnx", &m);
    let (code, _, err) = onnxc(&[
        "run",
        p.to_str().unwrap(),
        "--output-dir",
        d.path().to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("FrobnicateA") && err.contains("FrobnicateB"),
        "{err}"
    );
    // inspect still reports the model, listing both.
    let (code, out, _) = onnxc(&["inspect", p.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.contains("unsupported ops (2 nodes)"), "{out}");
}

#[test]
fn unknown_domain() {
    let d = tmp();
    let mut m = relu_model();
    m.graph.as_mut().unwrap().node[0].domain = Some("com.example".into());
    let p = write_model(d.path(), "dom.onnx", &m);
    assert_clean_error(
        &[
            "run",
            p.to_str().unwrap(),
            "--output-dir",
            d.path().to_str().unwrap(),
        ],
        "com.example",
    );
}

#[test]
fn missing_and_mistyped_inputs() {
    let d = tmp();
    let p = write_model(d.path(), "relu.onnx", &relu_model());
    let out = d.path().to_str().unwrap();
    assert_clean_error(
        &["run", p.to_str().unwrap(), "--output-dir", out],
        "missing --input for: x",
    );
    // An int64 tensor where float is expected.
    let t = TensorProto {
        dims: vec![2, 3],
        data_type: Some(DataType::Int64 as i32),
        int64_data: vec![1, 2, 3, 4, 5, 6],
        ..Default::default()
    };
    let xp = d.path().join("x.pb");
    std::fs::write(&xp, t.encode_to_vec()).unwrap();
    let arg = format!("x={}", xp.display());
    assert_clean_error(
        &[
            "run",
            p.to_str().unwrap(),
            "--input",
            &arg,
            "--output-dir",
            out,
        ],
        "must be float",
    );
    // Wrong shape.
    let t = f32_tensor("x", &[3, 2], &[0.0; 6]);
    std::fs::write(&xp, t.encode_to_vec()).unwrap();
    assert_clean_error(
        &[
            "run",
            p.to_str().unwrap(),
            "--input",
            &arg,
            "--output-dir",
            out,
        ],
        "must have shape",
    );
}

#[test]
fn absurd_dims() {
    let d = tmp();
    let mut m = relu_model();
    let g = m.graph.as_mut().unwrap();
    g.initializer.push(TensorProto {
        name: Some("huge".into()),
        dims: vec![1 << 40, 1 << 40],
        data_type: Some(DataType::Float as i32),
        ..Default::default()
    });
    let p = write_model(d.path(), "huge.onnx", &m);
    assert_clean_error(&["inspect", p.to_str().unwrap()], "more than onnxc accepts");

    // Declared shape larger than the data actually present.
    let mut m = relu_model();
    m.graph.as_mut().unwrap().initializer.push(TensorProto {
        name: Some("short".into()),
        dims: vec![1000, 1000],
        data_type: Some(DataType::Float as i32),
        raw_data: Some(vec![0; 16]),
        ..Default::default()
    });
    let p = write_model(d.path(), "short.onnx", &m);
    assert_clean_error(&["inspect", p.to_str().unwrap()], "needs 4000000 bytes");
}

fn external(location: &str, offset: Option<&str>, length: Option<&str>) -> TensorProto {
    let mut kv = vec![StringStringEntryProto {
        key: Some("location".into()),
        value: Some(location.into()),
    }];
    if let Some(o) = offset {
        kv.push(StringStringEntryProto {
            key: Some("offset".into()),
            value: Some(o.into()),
        });
    }
    if let Some(l) = length {
        kv.push(StringStringEntryProto {
            key: Some("length".into()),
            value: Some(l.into()),
        });
    }
    TensorProto {
        name: Some("w".into()),
        dims: vec![4],
        data_type: Some(DataType::Float as i32),
        external_data: kv,
        data_location: Some(1),
        ..Default::default()
    }
}

fn model_with_external(dir: &std::path::Path, t: TensorProto) -> std::path::PathBuf {
    let mut m = relu_model();
    m.graph.as_mut().unwrap().initializer.push(t);
    write_model(dir, "ext.onnx", &m)
}

#[test]
fn hostile_external_data_paths() {
    let outer = tmp();
    let model_dir = outer.path().join("model");
    std::fs::create_dir(&model_dir).unwrap();
    std::fs::write(outer.path().join("secret.bin"), [7u8; 16]).unwrap();
    for loc in ["../secret.bin", "/etc/passwd", "sub/../../secret.bin"] {
        let p = model_with_external(&model_dir, external(loc, None, None));
        assert_clean_error(
            &["inspect", p.to_str().unwrap()],
            "outside the model's folder",
        );
    }
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(outer.path().join("secret.bin"), model_dir.join("link.bin"))
            .unwrap();
        let p = model_with_external(&model_dir, external("link.bin", None, None));
        assert_clean_error(
            &["inspect", p.to_str().unwrap()],
            "outside the model's folder",
        );
    }
}

#[test]
fn external_data_ranges() {
    let d = tmp();
    std::fs::write(d.path().join("w.bin"), [0u8; 16]).unwrap();
    // Valid: 4 floats at offset 0.
    let p = model_with_external(d.path(), external("w.bin", Some("0"), Some("16")));
    let (code, out, err) = onnxc(&["inspect", p.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("parameters: 4"), "{out}");
    let p = model_with_external(d.path(), external("w.bin", Some("8"), Some("16")));
    assert_clean_error(&["inspect", p.to_str().unwrap()], "beyond the end");
    let p = model_with_external(
        d.path(),
        external("w.bin", Some("18446744073709551615"), Some("16")),
    );
    assert_clean_error(&["inspect", p.to_str().unwrap()], "beyond the end");
    let p = model_with_external(d.path(), external("w.bin", Some("0"), Some("12")));
    assert_clean_error(&["inspect", p.to_str().unwrap()], "does not match");
    let p = model_with_external(d.path(), external("missing.bin", None, None));
    assert_clean_error(&["inspect", p.to_str().unwrap()], "cannot read");
}

#[test]
fn bad_shape_flag() {
    let d = tmp();
    let p = write_model(d.path(), "relu.onnx", &relu_model());
    let p = p.to_str().unwrap();
    assert_clean_error(&["inspect", p, "--shape", "x=2x"], "dims must be numbers");
    assert_clean_error(&["inspect", p, "--shape", "nope=2x3"], "not an input");
    assert_clean_error(&["inspect", p, "--shape", "x=2x3x4"], "rank 2");
    assert_clean_error(&["inspect", p, "--shape", "x=4x3"], "fixed by the model");
}

/// ONNX Runtime's quantized ops with inputs missing or miscounted, and one onnxc has no
/// body for: one clear error naming the node.
#[test]
fn malformed_microsoft_ops() {
    use onnxc::onnx::proto::OperatorSetIdProto;
    let d = tmp();
    let cases: [(&str, &[&str], &str); 3] = [
        (
            "QLinearConcat",
            &["ys", "yz", "x", "xs"],
            "(tensor, scale, zero point) triples, has 4 inputs",
        ),
        (
            "QGemm",
            &["x", "s", "z", "", "s"],
            "input 3 (B) is required",
        ),
        (
            "QAttention",
            &["x"],
            "operator `QAttention` in domain `com.microsoft` is not implemented",
        ),
    ];
    for (op, inputs, needle) in cases {
        let mut m = relu_model();
        m.opset_import.push(OperatorSetIdProto {
            domain: Some("com.microsoft".into()),
            version: Some(1),
        });
        let mut n = node(op, inputs, &["y"]);
        n.domain = Some("com.microsoft".into());
        m.graph.as_mut().unwrap().node = vec![n];
        let p = write_model(d.path(), &format!("{op}.onnx"), &m);
        assert_clean_error(
            &[
                "run",
                p.to_str().unwrap(),
                "--output-dir",
                d.path().to_str().unwrap(),
            ],
            needle,
        );
    }
}
