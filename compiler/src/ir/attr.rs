//! Node attributes, independent of protobuf.

use super::{Graph, OpError, OpResult, Tensor, ValueType};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// Attributes whose names begin with this are onnxc's own marks on a node for the
/// lowerings; `--emit onnx` leaves them out (ONNX Runtime rejects unknown attributes).
pub const INTERNAL_PREFIX: &str = "onnxc_";

/// On a Conv: its sums must be exact in any order (integers below 2^24, as the
/// integer-conv widening makes them), so no lowering may transform the operands
/// (Winograd's fractions round).
pub const EXACT_SUMS: &str = "onnxc_exact_sums";

#[derive(Clone, Debug)]
pub enum Attr {
    Float(f32),
    Int(i64),
    String(String),
    Tensor(Tensor),
    Graph(Arc<Graph>),
    Type(ValueType),
    Floats(Vec<f32>),
    Ints(Vec<i64>),
    Strings(Vec<String>),
    Tensors(Vec<Tensor>),
    Graphs(Vec<Arc<Graph>>),
    Types(Vec<ValueType>),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Float(x) => write!(f, "{x:?}"),
            Attr::Int(x) => write!(f, "{x}"),
            Attr::String(s) => write!(f, "{s:?}"),
            Attr::Tensor(t) => write!(f, "{}", t.summary(8)),
            Attr::Graph(g) => write!(f, "graph {}", g.name),
            Attr::Type(t) => write!(f, "{t}"),
            Attr::Floats(v) => write!(f, "{v:?}"),
            Attr::Ints(v) => write!(f, "{v:?}"),
            Attr::Strings(v) => write!(f, "{v:?}"),
            Attr::Tensors(v) => write!(f, "<{} tensors>", v.len()),
            Attr::Graphs(v) => write!(f, "<{} graphs>", v.len()),
            Attr::Types(v) => write!(f, "<{} types>", v.len()),
        }
    }
}

/// A node's attributes by name, with typed getters that produce clear errors.
#[derive(Clone, Debug, Default)]
pub struct Attrs(pub BTreeMap<String, Attr>);

macro_rules! getter {
    ($name:ident, $opt:ident, $var:ident, $t:ty, $what:literal) => {
        pub fn $opt(&self, name: &str) -> OpResult<Option<$t>> {
            match self.0.get(name) {
                None => Ok(None),
                Some(Attr::$var(v)) => Ok(Some(v.clone())),
                Some(other) => Err(OpError::new(format!(
                    "attribute `{name}` should be {} but is {other}",
                    $what
                ))),
            }
        }
        pub fn $name(&self, name: &str, default: $t) -> OpResult<$t> {
            Ok(self.$opt(name)?.unwrap_or(default))
        }
    };
}

impl Attrs {
    getter!(float, get_float, Float, f32, "a float");
    getter!(int, get_int, Int, i64, "an int");
    getter!(string, get_string, String, String, "a string");
    getter!(floats, get_floats, Floats, Vec<f32>, "a list of floats");
    getter!(
        strings,
        get_strings,
        Strings,
        Vec<String>,
        "a list of strings"
    );

    /// Ints, also accepting a single int (some exporters write scalars for lists).
    pub fn get_ints(&self, name: &str) -> OpResult<Option<Vec<i64>>> {
        match self.0.get(name) {
            None => Ok(None),
            Some(Attr::Ints(v)) => Ok(Some(v.clone())),
            Some(Attr::Int(v)) => Ok(Some(vec![*v])),
            Some(other) => Err(OpError::new(format!(
                "attribute `{name}` should be a list of ints but is {other}"
            ))),
        }
    }

    pub fn ints(&self, name: &str, default: &[i64]) -> OpResult<Vec<i64>> {
        Ok(self.get_ints(name)?.unwrap_or_else(|| default.to_vec()))
    }

    pub fn get_tensor(&self, name: &str) -> OpResult<Option<Tensor>> {
        match self.0.get(name) {
            None => Ok(None),
            Some(Attr::Tensor(t)) => Ok(Some(t.clone())),
            Some(other) => Err(OpError::new(format!(
                "attribute `{name}` should be a tensor but is {other}"
            ))),
        }
    }

    pub fn get_graph(&self, name: &str) -> OpResult<Option<Arc<Graph>>> {
        match self.0.get(name) {
            None => Ok(None),
            Some(Attr::Graph(g)) => Ok(Some(g.clone())),
            Some(other) => Err(OpError::new(format!(
                "attribute `{name}` should be a graph but is {other}"
            ))),
        }
    }

    pub fn graph(&self, name: &str) -> OpResult<Arc<Graph>> {
        self.get_graph(name)?
            .ok_or_else(|| OpError::new(format!("required attribute `{name}` is missing")))
    }

    pub fn req_int(&self, name: &str) -> OpResult<i64> {
        self.get_int(name)?
            .ok_or_else(|| OpError::new(format!("required attribute `{name}` is missing")))
    }

    pub fn req_ints(&self, name: &str) -> OpResult<Vec<i64>> {
        self.get_ints(name)?
            .ok_or_else(|| OpError::new(format!("required attribute `{name}` is missing")))
    }

    pub fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Attr)> {
        self.0.iter()
    }
}
