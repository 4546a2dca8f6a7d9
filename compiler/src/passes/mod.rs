//! Graph -> graph passes, one per file, in the order [`pipeline`] lists them.

pub mod infer_shapes;

pub use infer_shapes::{
    bind_input_shapes, check_static_inputs, free_input_dims, infer_shapes, InferReport,
};
