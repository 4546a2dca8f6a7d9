//! The error type of the compiler's public API. Every message says what went wrong,
//! where (file, node, input), and, where it helps, what to do.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read `{path}`: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{path}` is not a valid ONNX model: {msg}")]
    Decode { path: PathBuf, msg: String },
    /// A structurally invalid model (dangling names, cycles, bad tensors, ...).
    #[error("invalid model: {0}")]
    Model(String),
    /// Ops or domains onnxc does not implement, all listed at once.
    #[error("unsupported operators ({} nodes):\n{}", .0.len(), .0.join("\n"))]
    Unsupported(Vec<String>),
    #[error("shape inference: {0}")]
    Shape(String),
    #[error("evaluation failed at {node}: {msg}")]
    Eval { node: String, msg: String },
    #[error("{0}")]
    Usage(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn model(msg: impl Into<String>) -> Error {
        Error::Model(msg.into())
    }
}
