//! The ONNX front end: protobuf decoding (prost, types generated from the vendored
//! `onnx.proto`), safe external data, and import into the graph IR.

pub mod contrib;
mod external;
pub mod import;
pub mod tensor;

/// Message types generated from `compiler/proto/onnx/*.proto` by `build.rs`.
#[allow(clippy::all, missing_docs)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/onnx.rs"));
}

pub use external::ExternalData;
pub use import::Opsets;

use crate::error::{Error, Result};
use crate::ir::{DType, Graph, Value, ValueType};
use import::{domain_key, Importer};
use prost::Message;
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

/// The largest model file onnxc reads (protobuf itself cannot exceed 2 GiB).
pub const MAX_MODEL_BYTES: u64 = 2 << 30;

/// An imported model.
#[derive(Debug)]
pub struct Model {
    pub graph: Graph,
    pub opsets: Opsets,
    pub ir_version: i64,
    pub producer: String,
}

/// Domains whose ops onnxc knows. Others are reported with the nodes that use them.
pub const KNOWN_DOMAINS: [&str; 3] = ["", "ai.onnx.ml", contrib::DOMAIN];

/// Reads and imports a model file; external data is looked up next to it.
pub fn load(path: &Path) -> Result<Model> {
    load_with(path, false).map(|(m, _)| m)
}

/// Like [`load`], but nodes with unsupported ops are left out and listed instead of
/// failing the import (for `inspect`).
pub fn load_lenient(path: &Path) -> Result<(Model, Vec<String>)> {
    load_with(path, true)
}

fn load_with(path: &Path, lenient: bool) -> Result<(Model, Vec<String>)> {
    let bytes = read_bounded(path)?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let ext = ExternalData::new(dir)?;
    decode_with(&bytes, Some(&ext), lenient).map_err(|e| match e {
        Error::Decode { msg, .. } => Error::Decode {
            path: path.to_path_buf(),
            msg,
        },
        other => other,
    })
}

fn read_bounded(path: &Path) -> Result<Vec<u8>> {
    let io = |e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(Error::Usage(format!("`{}` is not a file", path.display())));
    }
    if meta.len() > MAX_MODEL_BYTES {
        return Err(Error::Decode {
            path: path.to_path_buf(),
            msg: format!("the file is {} bytes; ONNX protobuf files are at most 2 GiB (store large weights as external data)", meta.len()),
        });
    }
    std::fs::read(path).map_err(io)
}

/// Decodes and imports model bytes.
pub fn decode(bytes: &[u8], ext: Option<&ExternalData>) -> Result<Model> {
    decode_with(bytes, ext, false).map(|(m, _)| m)
}

fn decode_with(
    bytes: &[u8],
    ext: Option<&ExternalData>,
    lenient: bool,
) -> Result<(Model, Vec<String>)> {
    let decode_err = |msg: String| Error::Decode {
        path: "<memory>".into(),
        msg,
    };
    if bytes.is_empty() {
        return Err(decode_err("the file is empty".into()));
    }
    let mp = proto::ModelProto::decode(bytes).map_err(|e| {
        decode_err(format!(
            "protobuf decoding failed ({e}); is this an .onnx file?"
        ))
    })?;
    let gp = mp
        .graph
        .as_ref()
        .ok_or_else(|| decode_err("it has no graph (is this an ONNX model file?)".into()))?;
    let mut opsets = Opsets::new();
    for o in &mp.opset_import {
        opsets.insert(domain_key(o.domain()).to_string(), o.version());
    }
    if mp.opset_import.is_empty() {
        return Err(decode_err(
            "it imports no opset (opset_import is empty)".into(),
        ));
    }
    let opsets_arc = Arc::new(opsets.clone());
    let mut imp = Importer::new(&mp.functions, ext);
    let graph = imp.graph(gp, &opsets_arc, &HashSet::new(), 0)?;
    if !imp.unsupported.is_empty() && !lenient {
        return Err(Error::Unsupported(imp.unsupported));
    }
    if let Err(cycle) = graph.topo_order() {
        return Err(Error::model(format!(
            "the graph has a cycle through {}",
            cycle.join(", ")
        )));
    }
    let model = Model {
        graph,
        opsets,
        ir_version: mp.ir_version(),
        producer: mp.producer_name().to_string(),
    };
    Ok((model, imp.unsupported))
}

/// Decodes a test-data `.pb` file as a value of the given type (TensorProto,
/// SequenceProto or OptionalProto, as the ONNX backend test runner does).
pub fn decode_value(bytes: &[u8], ty: &ValueType, what: &str) -> Result<Value> {
    let err =
        |e: prost::DecodeError| Error::model(format!("{what}: protobuf decoding failed ({e})"));
    match ty {
        ValueType::Sequence(_) => {
            let sp = proto::SequenceProto::decode(bytes).map_err(err)?;
            sequence_value(&sp, what)
        }
        ValueType::Optional(_) => {
            let op = proto::OptionalProto::decode(bytes).map_err(err)?;
            optional_value(&op, ty, what)
        }
        _ => {
            let tp = proto::TensorProto::decode(bytes).map_err(err)?;
            Ok(Value::Tensor(tensor::from_proto(&tp, None, what)?))
        }
    }
}

fn sequence_value(sp: &proto::SequenceProto, what: &str) -> Result<Value> {
    let mut items = Vec::new();
    for t in &sp.tensor_values {
        items.push(Value::Tensor(tensor::from_proto(t, None, what)?));
    }
    for s in &sp.sequence_values {
        items.push(sequence_value(s, what)?);
    }
    let elem = items.first().and_then(|v| v.as_tensor()).map(|t| t.dtype());
    Ok(Value::Sequence { elem, items })
}

fn optional_value(op: &proto::OptionalProto, ty: &ValueType, what: &str) -> Result<Value> {
    let inner_ty = match ty {
        ValueType::Optional(t) => (**t).clone(),
        _ => ValueType::Unknown,
    };
    let value = if let Some(t) = &op.tensor_value {
        Some(Box::new(Value::Tensor(tensor::from_proto(t, None, what)?)))
    } else if let Some(s) = &op.sequence_value {
        Some(Box::new(sequence_value(s, what)?))
    } else {
        None
    };
    Ok(Value::Optional {
        ty: Box::new(inner_ty),
        value,
    })
}

/// The dtype name for messages, e.g. for `--input` checks.
pub fn dtype_name(dt: DType) -> &'static str {
    dt.onnx_name()
}
