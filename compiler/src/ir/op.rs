//! The interface every operator implements (implementations live in `crate::ops`).

use super::{Graph, Tensor, Value, ValueType};
use std::fmt;

/// How [`OpError::unsupported`] messages begin.
pub const UNSUPPORTED_PREFIX: &str = "unsupported: ";

/// An error raised by an operator; the caller adds the node name and op type.
#[derive(Clone, Debug, PartialEq)]
pub struct OpError(pub String);

impl OpError {
    pub fn new(msg: impl Into<String>) -> OpError {
        OpError(msg.into())
    }

    /// An input the op cannot handle by design (a codec it lacks, a mode it does not
    /// offer), as opposed to a wrong result. Test reports count these as unsupported.
    pub fn unsupported(msg: impl Into<String>) -> OpError {
        OpError(format!("{UNSUPPORTED_PREFIX}{}", msg.into()))
    }

    pub fn is_unsupported(&self) -> bool {
        self.0.starts_with(UNSUPPORTED_PREFIX)
    }
}

impl fmt::Display for OpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for OpError {}

pub type OpResult<T> = Result<T, OpError>;

/// Returns early with an [`OpError`] built from a format string.
#[macro_export]
macro_rules! bail {
    ($($t:tt)*) => { return Err($crate::ir::OpError::new(format!($($t)*))) };
}

/// Ensures a condition holds, else returns an [`OpError`].
#[macro_export]
macro_rules! ensure {
    ($c:expr, $($t:tt)*) => {{
        // The condition reads as the requirement (often a float comparison); its
        // negation is taken on the bool.
        let ok: bool = $c;
        if !ok {
            $crate::bail!($($t)*)
        }
    }};
}

/// What an operator with subgraphs (If, Loop, Scan, SequenceMap) asks of the evaluator.
pub trait SubgraphRunner {
    /// Runs `g` with its formal inputs bound to `inputs`; values the subgraph names from
    /// enclosing scopes are resolved by the runner.
    fn run(&mut self, g: &Graph, inputs: Vec<Value>) -> OpResult<Vec<Value>>;
}

/// What shape inference knows of one present input: its type, and its value if constant.
#[derive(Clone, Debug)]
pub struct InferInput {
    pub ty: ValueType,
    pub value: Option<Value>,
}

/// An operator with its attributes parsed: evaluation and shape/type inference together.
pub trait Op: fmt::Debug + Send + Sync {
    /// Reference evaluation. `inputs[i]` is None for an omitted optional input.
    fn eval(&self, inputs: &[Option<&Value>]) -> OpResult<Vec<Value>>;

    /// Evaluation for ops that run subgraphs; others need not override it.
    fn eval_with(
        &self,
        inputs: &[Option<&Value>],
        _sub: &mut dyn SubgraphRunner,
    ) -> OpResult<Vec<Value>> {
        self.eval(inputs)
    }

    /// Inputs whose *values* (not only shapes) decide the output shapes: Reshape's shape,
    /// Slice's starts, TopK's k and the like. Inference needs them constant.
    fn shape_inputs(&self) -> &'static [usize] {
        &[]
    }

    /// True when output shapes depend on the data itself (NonZero, Unique, ...), so no
    /// static shape can be known ahead of time.
    fn data_dependent_shape(&self) -> bool {
        false
    }

    /// The subgraphs this op holds (for verification and printing).
    fn subgraphs(&self) -> Vec<&Graph> {
        Vec::new()
    }

    /// Shape and type inference; `inputs[i]` is None for an omitted optional input.
    /// Returns None when the types cannot be known yet. The default evaluates the op on
    /// zero-filled inputs of the right shapes (constant inputs keep their values); heavy
    /// ops may override it with a closed-form rule.
    fn infer(&self, inputs: &[Option<InferInput>]) -> OpResult<Option<Vec<ValueType>>> {
        if self.data_dependent_shape() || !self.subgraphs().is_empty() {
            return Ok(None);
        }
        let mut vals = Vec::with_capacity(inputs.len());
        for (i, inp) in inputs.iter().enumerate() {
            let Some(inp) = inp else {
                vals.push(None); // an omitted optional input
                continue;
            };
            if let Some(v) = &inp.value {
                vals.push(Some(v.clone()));
                continue;
            }
            if self.shape_inputs().contains(&i) {
                return Ok(None);
            }
            match (&inp.ty, inp.ty.static_shape()) {
                (ValueType::Tensor { dt, .. }, Some(shape)) => {
                    let n: usize = shape.iter().product();
                    if n > (1 << 24) || dt.storage().is_none() {
                        return Ok(None);
                    }
                    vals.push(Some(Value::Tensor(Tensor::zeros(*dt, &shape))));
                }
                _ => return Ok(None),
            }
        }
        let refs: Vec<Option<&Value>> = vals.iter().map(|v| v.as_ref()).collect();
        let outs = self.eval(&refs)?;
        Ok(Some(outs.iter().map(|v| v.value_type()).collect()))
    }
}
