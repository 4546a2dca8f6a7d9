//! onnxc: an ahead-of-time compiler for ONNX models.
//!
//! The pipeline, one module per stage (see `shared/DESIGN.md`):
//! [`onnx`] (front end) -> [`ir`] (graph IR) -> [`passes`] -> back ends. The
//! [`ops`] module holds every operator's inference and reference evaluation, and
//! [`eval`] runs a graph with them (the oracle for tests and for constant folding).

pub mod backend;
pub mod bench;
pub mod build;
pub mod check;
pub mod conformance;
pub mod driver;
pub mod emit;
pub mod error;
pub mod eval;
pub mod inspect;
pub mod io;
pub mod ir;
pub mod kir;
pub mod lower;
pub mod onnx;
pub mod ops;
pub mod passes;
pub mod runner;
pub mod targets;

pub use build::Build;
pub use error::{Error, Result};
