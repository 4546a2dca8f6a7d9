//! The compile pipeline in one call: load -> bind shapes -> infer -> lower -> emit.

use crate::emit::{emit, Artifacts};
use crate::error::{Error, Result};
use crate::ir::{Graph, Source, Tensor, ValueId};
use crate::lower::{lower, Lowered};
use crate::targets::Target;
use crate::{onnx, passes};
use std::collections::HashMap;
use std::path::Path;

/// Options of one compile.
#[derive(Clone, Debug)]
pub struct Options {
    /// Symbol prefix (`PREFIX_run`); default the file stem.
    pub name: Option<String>,
    /// Target name or path of a target TOML file.
    pub target: String,
    /// `NAME=dims` bindings for symbolic input dims.
    pub shapes: Vec<(String, Vec<usize>)>,
    /// Inputs fixed to constant values for this compile (shape-only inputs in tests).
    pub constants: Vec<(String, Tensor)>,
    /// Graph optimisation level (`--opt-level`): 0 none, 1 basic cleanup, 2 fusion,
    /// 3 layout choice. See [`passes::PIPELINE`].
    pub opt_level: u8,
    /// Float code computes exactly the operations kernel IR names, in its order, on
    /// every target (no FMA contraction, the portable exp/erf/tanh): the same bits from
    /// 128-bit and AVX-512 code. Off by default: the AVX-512 loops then contract
    /// multiply-adds and use shorter exp/erf/tanh (within a few ulp).
    pub exact_math: bool,
    /// Export `PREFIX_kernels` (each kernel's function and name, in run order) for
    /// `onnxc bench --profile`. Off by default.
    pub kernel_table: bool,
    /// Programs doing fewer element operations per run than this run every loop on the
    /// calling thread, threads or not (only GEMMs on prepacked weights still split):
    /// default [`crate::kir::parallel::MIN_PROGRAM_WORK`]. 0 hands out every loop that
    /// qualifies, however small the model (the tests of parallel code use it).
    pub min_program_work: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            name: None,
            target: "host".into(),
            shapes: Vec::new(),
            constants: Vec::new(),
            opt_level: 2,
            exact_math: false,
            kernel_table: false,
            min_program_work: crate::kir::parallel::MIN_PROGRAM_WORK,
        }
    }
}

/// Everything a compile produced.
pub struct Compiled {
    pub graph: Graph,
    /// What each optimisation pass did.
    pub passes: Vec<passes::PassStat>,
    pub lowered: Lowered,
    pub artifacts: Artifacts,
    pub target: Target,
    pub prefix: String,
}

/// Replaces graph inputs by constants (their value fixed for this compile).
pub fn bind_constants(g: &mut Graph, constants: &[(String, Tensor)]) -> Result<()> {
    for (name, t) in constants {
        let pos = g
            .inputs
            .iter()
            .position(|&i| g.value(i).name == *name)
            .ok_or_else(|| Error::Usage(format!("`{name}` is not an input of the model")))?;
        let id = g.inputs.remove(pos);
        g.value_mut(id).source = Source::Const;
        g.value_mut(id).ty = crate::ir::ValueType::tensor(t.dtype(), t.shape());
        g.consts.insert(id, t.clone());
    }
    Ok(())
}

/// Prepares a model's graph for lowering; returns the known (folded) values.
pub fn prepare(g: &mut Graph, opts: &Options) -> Result<HashMap<ValueId, crate::ir::Value>> {
    bind_constants(g, &opts.constants)?;
    passes::bind_input_shapes(g, &opts.shapes)?;
    passes::check_static_inputs(g)?;
    // Control flow becomes ordinary nodes where it can (inlined Ifs, unrolled loops).
    let rep = passes::infer_and_inline(g)?;
    if !rep.unresolved.is_empty() {
        return Err(Error::Shape(format!(
            "these values have no static shape, so the model cannot be compiled:\n  {}",
            rep.unresolved.join("\n  ")
        )));
    }
    if cfg!(debug_assertions) {
        if let Err(errs) = crate::ir::verify(g, true) {
            return Err(Error::model(format!("IR verifier:\n{}", errs.join("\n"))));
        }
    }
    Ok(rep.known)
}

/// Whether `target`'s back end runs 8-bit products natively ([`Graph::int8_dot`]).
pub fn int8_dot(target: &Target) -> bool {
    target.triple.starts_with("x86_64") && target.has("avx512vnni")
}

/// Whether `target` runs innermost f32 loops as 128-bit code beside an AVX2 machine-code
/// GEMM ([`Graph::narrow_loops`]).
pub fn narrow_loops(target: &Target) -> bool {
    target.triple.starts_with("x86_64")
        && !target.has("avx512f")
        && target.has("avx2")
        && target.has("fma")
}

/// Runs the optimisation passes of `level` on a prepared graph; when any pass ran, shape
/// inference runs again so `known` describes the optimised graph.
pub fn optimize(
    g: &mut Graph,
    level: u8,
    known: &mut HashMap<ValueId, crate::ir::Value>,
) -> Result<Vec<passes::PassStat>> {
    let stats = passes::optimize(g, level, cfg!(debug_assertions))?;
    if !stats.is_empty() {
        *known = passes::infer_shapes(g)?.known;
    }
    Ok(stats)
}

/// Compiles a graph (already imported) for a target.
pub fn compile_graph(mut g: Graph, prefix: &str, opts: &Options) -> Result<Compiled> {
    let target = Target::load(&opts.target).map_err(Error::Usage)?;
    g.int8_dot = int8_dot(&target);
    g.narrow_loops = narrow_loops(&target);
    let mut known = prepare(&mut g, opts)?;
    let passes = optimize(&mut g, opts.opt_level, &mut known)?;
    let lowered = lower(&g, &known)?;
    let mut artifacts = emit(
        &g,
        &lowered,
        prefix,
        &target.triple,
        &target.features,
        &crate::emit::CodeOptions {
            exact_math: opts.exact_math,
            kernel_table: opts.kernel_table,
            min_program_work: opts.min_program_work,
        },
    )?;
    artifacts.report["opt_level"] = opts.opt_level.into();
    artifacts.report["passes"] = serde_json::to_value(&passes).unwrap_or_default();
    Ok(Compiled {
        graph: g,
        passes,
        lowered,
        artifacts,
        target,
        prefix: prefix.to_string(),
    })
}

/// Compiles a model file.
pub fn compile_file(path: &Path, opts: &Options) -> Result<Compiled> {
    let m = onnx::load(path)?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
    let prefix = crate::emit::c_ident(opts.name.as_deref().unwrap_or(stem));
    compile_graph(m.graph, &prefix, opts)
}
