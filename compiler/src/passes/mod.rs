//! Graph -> graph passes, one per file, run in the order [`PIPELINE`] lists them.
//!
//! Every pass takes a shape-inferred graph and leaves one: values keep their types, new
//! values get theirs. [`optimize`] runs the passes an `--opt-level` selects, runs the IR
//! verifier after each one when asked (always in tests and debug builds), and records the
//! node count before and after each pass and the time it took.
//!
//! Level 1 (cleanup): `fold_shape_ops`, `fold_constants`, `remove_noops`,
//! `eliminate_common_subexpressions`, `eliminate_dead_code`. Level 2 (algebraic folding
//! into weights, convs split into the forms the GEMM lowerings take, then fusion):
//! `integer_qdq_conv` and `integer_qdq_gemm` (before the cleanup: QDQ convs, Gemms and
//! MatMuls onto the 8-bit GEMM),
//! `quantized_max_pool` (a QDQ max pool on the 8-bit values), `quantized_concat` (a
//! quantized Concat of the 8-bit parts), `widen_f16` (f16 convs and products onto the f32 kernels), `widen_integer`
//! (MatMulInteger and QLinearMatMul onto the f32 GEMM where f32 is exact),
//! `fold_batchnorm`, `matmul_add_to_gemm`, `fold_scale_bias`, `fold_input_scale`,
//! `split_grouped_conv`, `split_dilated_conv`, `fuse_patterns`, `fuse_epilogue`,
//! `fuse_elementwise`, `eliminate_dead_code`.
//! No pass changes the graph's inputs or outputs (names and types), and every value it
//! creates is typed.

pub mod eliminate_common_subexpressions;
pub mod eliminate_dead_code;
pub mod expand_flex_attention;
pub mod fold_batchnorm;
pub mod fold_constants;
pub mod fold_input_scale;
pub mod fold_scale_bias;
pub mod fold_shape_ops;
pub mod fuse_elementwise;
pub mod fuse_epilogue;
pub mod fuse_patterns;
mod fuse_util;
pub mod infer_shapes;
pub mod inline_if;
mod inline_util;
pub mod integer_qdq_conv;
pub mod integer_qdq_gemm;
pub mod matmul_add_to_gemm;
pub mod quantized_concat;
pub mod quantized_max_pool;
pub mod remove_noops;
pub mod split_dilated_conv;
pub mod split_grouped_conv;
#[cfg(test)]
pub(crate) mod testutil;
pub mod unroll_loops;
pub mod util;
pub mod widen_f16;
pub mod widen_integer;

pub use infer_shapes::{
    bind_input_shapes, check_static_inputs, free_input_dims, infer_shapes, InferReport,
};

use crate::error::{Error, Result};
use crate::ir::Graph;
use serde::Serialize;
use std::time::Instant;

/// A graph -> graph pass.
pub type PassFn = fn(&mut Graph) -> Result<()>;

/// One pass of the pipeline.
pub struct Pass {
    pub name: &'static str,
    /// The lowest `--opt-level` that runs it: 1 basic cleanup, 2 fusion, 3 layout choice.
    pub level: u8,
    pub run: PassFn,
}

/// The passes, in order. Level 0 runs none of them.
pub const PIPELINE: &[Pass] = &[
    // Level 1: cleanup.
    Pass {
        name: "fold_shape_ops",
        level: 1,
        run: fold_shape_ops::run,
    },
    // (Level 2, but first: the weights' DequantizeLinear must not be folded yet.)
    Pass {
        name: "integer_qdq_conv",
        level: 2,
        run: integer_qdq_conv::run,
    },
    Pass {
        name: "integer_qdq_gemm",
        level: 2,
        run: integer_qdq_gemm::run,
    },
    Pass {
        name: "quantized_max_pool",
        level: 2,
        run: quantized_max_pool::run,
    },
    Pass {
        name: "quantized_concat",
        level: 2,
        run: quantized_concat::run,
    },
    Pass {
        name: "fold_constants",
        level: 1,
        run: fold_constants::run,
    },
    Pass {
        name: "remove_noops",
        level: 1,
        run: remove_noops::run,
    },
    Pass {
        name: "eliminate_common_subexpressions",
        level: 1,
        run: eliminate_common_subexpressions::run,
    },
    Pass {
        name: "eliminate_dead_code",
        level: 1,
        run: eliminate_dead_code::run,
    },
    // Level 2: algebraic folding into weights (then the fusion passes).
    Pass {
        name: "widen_f16",
        level: 2,
        run: widen_f16::run,
    },
    Pass {
        name: "widen_integer",
        level: 2,
        run: widen_integer::run,
    },
    Pass {
        name: "fold_batchnorm",
        level: 2,
        run: fold_batchnorm::run,
    },
    Pass {
        name: "matmul_add_to_gemm",
        level: 2,
        run: matmul_add_to_gemm::run,
    },
    Pass {
        name: "fold_scale_bias",
        level: 2,
        run: fold_scale_bias::run,
    },
    Pass {
        name: "fold_input_scale",
        level: 2,
        run: fold_input_scale::run,
    },
    // Level 2: convs into the forms the GEMM lowerings take (after the folds, so that a
    // BatchNormalization is already in the weights).
    Pass {
        name: "split_grouped_conv",
        level: 2,
        run: split_grouped_conv::run,
    },
    Pass {
        name: "split_dilated_conv",
        level: 2,
        run: split_dilated_conv::run,
    },
    // Level 2: fusion, after the folding.
    Pass {
        name: "fuse_patterns",
        level: 2,
        run: fuse_patterns::run,
    },
    Pass {
        name: "fuse_epilogue",
        level: 2,
        run: fuse_epilogue::run,
    },
    Pass {
        name: "fuse_elementwise",
        level: 2,
        run: fuse_elementwise::run,
    },
    Pass {
        name: "eliminate_dead_code",
        level: 2,
        run: eliminate_dead_code::run,
    },
];

/// What one pass did (for the report).
#[derive(Clone, Debug, Serialize)]
pub struct PassStat {
    pub pass: &'static str,
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub micros: u128,
}

/// The highest `--opt-level`.
pub const MAX_OPT_LEVEL: u8 = 3;

/// Runs the pipeline's passes up to `level` on a shape-inferred graph. With `verify`, the
/// IR verifier runs after every pass and names the pass that broke the graph.
pub fn optimize(g: &mut Graph, level: u8, verify: bool) -> Result<Vec<PassStat>> {
    let mut stats = Vec::new();
    for p in PIPELINE.iter().filter(|p| p.level <= level) {
        let before = g.node_count();
        let t = Instant::now();
        (p.run)(g)?;
        let micros = t.elapsed().as_micros();
        if verify {
            if let Err(errs) = crate::ir::verify(g, true) {
                return Err(Error::model(format!(
                    "IR verifier after pass `{}`:\n{}",
                    p.name,
                    errs.join("\n")
                )));
            }
        }
        stats.push(PassStat {
            pass: p.name,
            nodes_before: before,
            nodes_after: g.node_count(),
            micros,
        });
    }
    Ok(stats)
}

/// Shape inference together with the rewrites that turn nodes holding subgraphs into
/// ordinary nodes, repeated until nothing changes: If nodes with a condition known at
/// compile time become their taken branch, Loop and Scan nodes with a known trip count
/// are unrolled, FlexAttention becomes standard ops (its modifier subgraphs inlined),
/// and If nodes whose condition is only known at run time become both branches plus a
/// select. The report's `unresolved` lines give, for a node these
/// rewrites had to leave alone, the reason they did.
pub fn infer_and_inline(g: &mut Graph) -> Result<InferReport> {
    infer_and_inline_within(g, &inline_util::Budget::default())
}

/// [`infer_and_inline`] drawing on a budget of node copies shared with the caller's.
fn infer_and_inline_within(g: &mut Graph, budget: &inline_util::Budget) -> Result<InferReport> {
    let mut rep = infer_shapes(g)?;
    let mut refused = std::collections::BTreeMap::new();
    loop {
        refused.clear();
        let mut changed = inline_if::inline_constant_ifs(g, budget, &rep.known)?;
        if changed == 0 {
            changed = unroll_loops::unroll_loops(g, budget, &rep.known, &mut refused)?;
        }
        if changed == 0 {
            changed =
                expand_flex_attention::expand_flex_attention(g, budget, &rep.known, &mut refused)?;
        }
        if changed == 0 {
            changed = inline_if::select_runtime_ifs(g, budget, &rep.known, &mut refused)?;
        }
        if changed == 0 {
            break;
        }
        rep = infer_shapes(g)?;
    }
    if !refused.is_empty() {
        let mut lines: Vec<String> = refused
            .iter()
            .map(|(label, why)| format!("{label}: {why}"))
            .collect();
        lines.extend(
            rep.unresolved
                .iter()
                .filter(|l| !refused.keys().any(|k| l.starts_with(&format!("{k}: "))))
                .cloned(),
        );
        rep.unresolved = lines;
    }
    Ok(rep)
}
