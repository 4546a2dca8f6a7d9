//! Operators, one module per family. Each op keeps together its attributes (with opset
//! checks), its shape/type inference and its reference evaluation.
//!
//! Most ops are plain functions `fn(&OpCtx, &[Option<&Value>]) -> OpResult<Vec<Value>>`
//! registered with [`Registry::add`]; the [`OpCtx`] carries the node's attributes and the
//! opset version it was imported under. Ops that need more (subgraphs, closed-form shape
//! inference) implement [`Op`] themselves and register a builder.

pub mod fused;
pub mod lowering;
pub mod util;

mod attention;
mod cast;
mod control;
mod elementwise;
mod gather;
mod image;
mod matmul;
mod misc;
mod ml;
mod nn;
mod normalization;
pub(crate) mod pool;
mod quant;
mod reduce;
mod rng;
mod rnn;
mod sequence;
mod shape;
mod signal;
mod strings;

use crate::ir::{Attrs, Op, OpResult, Value};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, OnceLock};

/// What a builder sees of the node it builds an op for.
#[derive(Clone, Debug)]
pub struct OpCtx {
    pub op_type: String,
    pub domain: String,
    pub attrs: Attrs,
    /// The opset version of the op's domain that the model imports.
    pub opset: i64,
    pub n_inputs: usize,
    pub n_outputs: usize,
}

pub type EvalFn = fn(&OpCtx, &[Option<&Value>]) -> OpResult<Vec<Value>>;
/// Lowers one node to kernel IR (see [`lowering`]).
pub type LowerFn = fn(&mut lowering::LowerCtx) -> OpResult<()>;

/// How an op is compiled.
#[derive(Clone, Copy)]
pub enum Lowering {
    /// A dedicated lowering.
    Custom(LowerFn),
    /// Pure data movement of the listed inputs, through index tables computed by the
    /// op's own evaluation (see [`lowering::lower_by_index_map`]); other inputs must be
    /// constant. Fill positions get zero.
    Movement(&'static [usize]),
}
pub type Builder = fn(&OpCtx) -> OpResult<Arc<dyn Op>>;

/// How an evaluation function behaves for shape inference.
#[derive(Clone, Copy, Debug, Default)]
pub struct Traits {
    /// Inputs whose values decide the output shape (see [`Op::shape_inputs`]).
    pub shape_inputs: &'static [usize],
    /// Output shapes depend on the data (see [`Op::data_dependent_shape`]).
    pub data_dependent: bool,
}

/// An op defined by an evaluation function plus its node context.
pub struct FnOp {
    pub ctx: OpCtx,
    pub f: EvalFn,
    pub traits: Traits,
}

impl fmt::Debug for FnOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.ctx.op_type)
    }
}

impl Op for FnOp {
    fn eval(&self, inputs: &[Option<&Value>]) -> OpResult<Vec<Value>> {
        (self.f)(&self.ctx, inputs)
    }
    fn shape_inputs(&self) -> &'static [usize] {
        self.traits.shape_inputs
    }
    fn data_dependent_shape(&self) -> bool {
        self.traits.data_dependent
    }
}

enum Entry {
    Fn(EvalFn, Traits),
    Build(Builder),
}

/// Op implementations by (domain, op type).
pub struct Registry {
    map: HashMap<(String, String), Entry>,
    lower: HashMap<(String, String), Lowering>,
}

/// The default ONNX domain, as the registry spells it.
pub const ONNX: &str = "";
/// The classic machine-learning domain.
pub const ONNX_ML: &str = "ai.onnx.ml";

impl Registry {
    fn empty() -> Registry {
        Registry {
            map: HashMap::new(),
            lower: HashMap::new(),
        }
    }

    /// The registry with every op onnxc implements.
    pub fn standard() -> &'static Registry {
        static REG: OnceLock<Registry> = OnceLock::new();
        REG.get_or_init(|| {
            let mut r = Registry::empty();
            elementwise::register(&mut r);
            cast::register(&mut r);
            shape::register(&mut r);
            gather::register(&mut r);
            reduce::register(&mut r);
            matmul::register(&mut r);
            nn::register(&mut r);
            pool::register(&mut r);
            normalization::register(&mut r);
            quant::register(&mut r);
            control::register(&mut r);
            sequence::register(&mut r);
            rnn::register(&mut r);
            image::register(&mut r);
            attention::register(&mut r);
            signal::register(&mut r);
            misc::register(&mut r);
            strings::register(&mut r);
            ml::register(&mut r);
            fused::register(&mut r);
            r
        })
    }

    /// Registers an op of the default domain defined by an evaluation function.
    pub fn add(&mut self, op_type: &str, f: EvalFn) {
        self.add_with(ONNX, op_type, f, Traits::default());
    }

    /// Registers an op whose output shapes depend on the values of some inputs.
    pub fn add_shaped(&mut self, op_type: &str, f: EvalFn, shape_inputs: &'static [usize]) {
        self.add_with(
            ONNX,
            op_type,
            f,
            Traits {
                shape_inputs,
                data_dependent: false,
            },
        );
    }

    /// Registers an op whose output shapes depend on its input data.
    pub fn add_dynamic(&mut self, op_type: &str, f: EvalFn) {
        self.add_with(
            ONNX,
            op_type,
            f,
            Traits {
                shape_inputs: &[],
                data_dependent: true,
            },
        );
    }

    pub fn add_with(&mut self, domain: &str, op_type: &str, f: EvalFn, traits: Traits) {
        self.map.insert(
            (domain.to_string(), op_type.to_string()),
            Entry::Fn(f, traits),
        );
    }

    /// Registers an op with its own [`Op`] implementation.
    pub fn add_builder(&mut self, domain: &str, op_type: &str, b: Builder) {
        self.map
            .insert((domain.to_string(), op_type.to_string()), Entry::Build(b));
    }

    /// Registers the lowering of a default-domain op.
    pub fn lower(&mut self, op_type: &str, l: Lowering) {
        self.lower
            .insert((ONNX.to_string(), op_type.to_string()), l);
    }

    /// Registers the lowering of an op of another domain (`ai.onnx.ml`, ...).
    pub fn lower_in(&mut self, domain: &str, op_type: &str, l: Lowering) {
        self.lower.insert(
            (normalize_domain(domain).to_string(), op_type.to_string()),
            l,
        );
    }

    /// How an op is compiled, if it can be.
    pub fn lowering(&self, domain: &str, op_type: &str) -> Option<Lowering> {
        self.lower
            .get(&(normalize_domain(domain).to_string(), op_type.to_string()))
            .copied()
    }

    pub fn contains(&self, domain: &str, op_type: &str) -> bool {
        self.map
            .contains_key(&(normalize_domain(domain).to_string(), op_type.to_string()))
    }

    /// Builds the op for a node, or None when the op is not implemented.
    pub fn build(&self, ctx: OpCtx) -> Option<OpResult<Arc<dyn Op>>> {
        let key = (
            normalize_domain(&ctx.domain).to_string(),
            ctx.op_type.clone(),
        );
        match self.map.get(&key)? {
            Entry::Fn(f, traits) => Some(Ok(Arc::new(FnOp {
                ctx,
                f: *f,
                traits: *traits,
            }))),
            Entry::Build(b) => Some(b(&ctx)),
        }
    }

    /// Every registered (domain, op type), sorted.
    pub fn op_names(&self) -> Vec<(String, String)> {
        let mut v: Vec<_> = self.map.keys().cloned().collect();
        v.sort();
        v
    }
}

fn normalize_domain(d: &str) -> &str {
    if d == "ai.onnx" {
        ""
    } else {
        d
    }
}
