//! Helpers shared by the integration tests: building small models from protobuf
//! messages, running the `onnxc` binary, and finding the repository's test data.
#![allow(dead_code)]

use onnxc::onnx::proto::{
    tensor_proto::DataType, tensor_shape_proto, type_proto, AttributeProto, GraphProto, ModelProto,
    NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto, TypeProto, ValueInfoProto,
};
use prost::Message;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root (the workspace folder above `compiler/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

pub fn tensor_type(elem: DataType, dims: &[i64]) -> TypeProto {
    TypeProto {
        value: Some(type_proto::Value::TensorType(type_proto::Tensor {
            elem_type: Some(elem as i32),
            shape: Some(TensorShapeProto {
                dim: dims
                    .iter()
                    .map(|&d| tensor_shape_proto::Dimension {
                        value: Some(tensor_shape_proto::dimension::Value::DimValue(d)),
                        ..Default::default()
                    })
                    .collect(),
            }),
        })),
        ..Default::default()
    }
}

pub fn value_info(name: &str, elem: DataType, dims: &[i64]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(tensor_type(elem, dims)),
        ..Default::default()
    }
}

pub fn node(op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        name: Some(format!("{op}_{}", outputs.first().copied().unwrap_or(""))),
        ..Default::default()
    }
}

pub fn int_attr(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(2),
        i: Some(v),
        ..Default::default()
    }
}

pub fn ints_attr(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(7),
        ints: v.to_vec(),
        ..Default::default()
    }
}

pub fn f32_tensor(name: &str, dims: &[i64], data: &[f32]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(DataType::Float as i32),
        float_data: data.to_vec(),
        ..Default::default()
    }
}

#[allow(dead_code)]
pub fn i64_tensor(name: &str, data: &[i64]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: vec![data.len() as i64],
        data_type: Some(DataType::Int64 as i32),
        int64_data: data.to_vec(),
        ..Default::default()
    }
}

pub fn model(graph: GraphProto) -> ModelProto {
    ModelProto {
        ir_version: Some(9),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(21),
        }],
        graph: Some(graph),
        ..Default::default()
    }
}

/// A one-node model: y = Relu(x), x: float[2,3].
pub fn relu_model() -> ModelProto {
    model(GraphProto {
        name: Some("relu".into()),
        node: vec![node("Relu", &["x"], &["y"])],
        input: vec![value_info("x", DataType::Float, &[2, 3])],
        output: vec![value_info("y", DataType::Float, &[2, 3])],
        ..Default::default()
    })
}

pub fn write_model(dir: &Path, name: &str, m: &ModelProto) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, m.encode_to_vec()).expect("write model");
    p
}

/// Runs the onnxc binary; returns (exit code, stdout, stderr).
pub fn onnxc(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_onnxc"))
        .args(args)
        .output()
        .expect("run onnxc");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts a clean failure: exit code 1, an `error:` message containing `needle`, and no
/// panic.
pub fn assert_clean_error(args: &[&str], needle: &str) {
    let (code, _out, err) = onnxc(args);
    assert!(
        !err.contains("panicked"),
        "onnxc panicked on {args:?}:\n{err}"
    );
    assert_eq!(
        code, 1,
        "onnxc {args:?} should fail with exit code 1; stderr:\n{err}"
    );
    assert!(
        err.starts_with("error: "),
        "message should start with `error: `:\n{err}"
    );
    assert!(
        err.contains(needle),
        "error for {args:?} should mention `{needle}`:\n{err}"
    );
}

/// `|x - y|` for comparing outputs, where a NaN on one side only is infinitely far off
/// (folding differences with `f64::max` would drop it) and NaN against NaN is equal.
pub fn abs_diff(x: f64, y: f64) -> f64 {
    if x == y || (x.is_nan() && y.is_nan()) {
        0.0
    } else if x.is_nan() || y.is_nan() {
        f64::INFINITY
    } else {
        (x - y).abs()
    }
}
