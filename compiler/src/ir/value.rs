//! Runtime values (tensors, sequences, optionals) and their static types.

use super::{DType, Tensor};
use std::fmt;

/// A value flowing along an edge while evaluating.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Tensor(Tensor),
    /// An ONNX sequence; `elem` is the element dtype (needed for empty sequences).
    Sequence {
        elem: Option<DType>,
        items: Vec<Value>,
    },
    /// An ONNX optional: `None` holds the type of the absent value.
    Optional {
        ty: Box<ValueType>,
        value: Option<Box<Value>>,
    },
}

impl Value {
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    pub fn into_tensor(self) -> Option<Tensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The static type this value has.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::Tensor(t) => ValueType::tensor(t.dtype(), t.shape()),
            Value::Sequence { elem, items } => {
                let inner = match (items.first(), elem) {
                    (Some(v), _) => v.value_type().without_shape(),
                    (None, Some(dt)) => ValueType::Tensor {
                        dt: *dt,
                        shape: None,
                    },
                    (None, None) => ValueType::Unknown,
                };
                ValueType::Sequence(Box::new(inner))
            }
            Value::Optional { ty, value } => ValueType::Optional(Box::new(match value {
                Some(v) => v.value_type(),
                None => (**ty).clone(),
            })),
        }
    }
}

impl From<Tensor> for Value {
    fn from(t: Tensor) -> Value {
        Value::Tensor(t)
    }
}

/// One dimension of a static shape: a number, or a named symbol not yet bound.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Fixed(usize),
    Sym(String),
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Sym(s) => write!(f, "{s}"),
        }
    }
}

/// The static type of a value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// A tensor; `shape` is None when even the rank is unknown.
    Tensor {
        dt: DType,
        shape: Option<Vec<Dim>>,
    },
    Sequence(Box<ValueType>),
    Optional(Box<ValueType>),
    /// Not yet inferred.
    Unknown,
}

impl ValueType {
    pub fn tensor(dt: DType, shape: &[usize]) -> ValueType {
        ValueType::Tensor {
            dt,
            shape: Some(shape.iter().map(|&d| Dim::Fixed(d)).collect()),
        }
    }

    pub fn dtype(&self) -> Option<DType> {
        match self {
            ValueType::Tensor { dt, .. } => Some(*dt),
            _ => None,
        }
    }

    /// The shape when every dim is a number.
    pub fn static_shape(&self) -> Option<Vec<usize>> {
        match self {
            ValueType::Tensor { shape: Some(s), .. } => s
                .iter()
                .map(|d| match d {
                    Dim::Fixed(n) => Some(*n),
                    Dim::Sym(_) => None,
                })
                .collect(),
            _ => None,
        }
    }

    pub fn is_static(&self) -> bool {
        match self {
            ValueType::Tensor { .. } => self.static_shape().is_some(),
            ValueType::Sequence(_) | ValueType::Optional(_) => false,
            ValueType::Unknown => false,
        }
    }

    fn without_shape(self) -> ValueType {
        match self {
            ValueType::Tensor { dt, .. } => ValueType::Tensor { dt, shape: None },
            other => other,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueType::Tensor { dt, shape: Some(s) } => {
                let dims: Vec<String> = s.iter().map(|d| d.to_string()).collect();
                write!(f, "{dt}[{}]", dims.join(","))
            }
            ValueType::Tensor { dt, shape: None } => write!(f, "{dt}[?]"),
            ValueType::Sequence(t) => write!(f, "seq<{t}>"),
            ValueType::Optional(t) => write!(f, "opt<{t}>"),
            ValueType::Unknown => write!(f, "?"),
        }
    }
}
