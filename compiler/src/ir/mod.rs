//! The graph IR: dtypes, tensors, values, attributes, the op interface, the graph itself,
//! its verifier and its text printer. Knows nothing of protobuf.

mod attr;
mod dtype;
mod graph;
pub mod minifloat;
mod op;
mod print;
mod tensor;
mod value;
mod verify;

pub use attr::{Attr, Attrs, EXACT_SUMS, INTERNAL_PREFIX};
pub use dtype::{DType, Storage};
pub use graph::{Graph, Node, NodeId, Source, ValueId, ValueInfo};
pub use op::{InferInput, Op, OpError, OpResult, SubgraphRunner, UNSUPPORTED_PREFIX};
pub use print::print_graph;
pub use tensor::{broadcast_shapes, Data, Elem, Tensor};
pub use value::{Dim, Value, ValueType};
pub use verify::verify;
