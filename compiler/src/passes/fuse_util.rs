//! What the fusion passes share: values known at compile time, and single-consumer tests.

use crate::error::Result;
use crate::ir::{Graph, NodeId, Value, ValueId};
use std::collections::HashMap;

/// The values known at compile time (constants and what inference folds). The graph's
/// types are refreshed as a side effect.
pub fn known_values(g: &mut Graph) -> Result<HashMap<ValueId, Value>> {
    Ok(super::infer_shapes(g)?.known)
}

/// The only node reading `v`, when there is exactly one, it reads `v` once, and `v` is
/// not a graph output.
pub fn fusible_output(g: &Graph, v: ValueId) -> Option<NodeId> {
    if g.outputs.contains(&v) {
        return None;
    }
    // A fused kernel keeps intermediates in registers at their compute type: values of a
    // storage-only type (f16, bf16, ...) would skip the rounding every unfused op applies.
    let storage_only = g
        .value(v)
        .ty
        .dtype()
        .and_then(crate::ops::lowering::kir_ty)
        .is_none_or(|t| t.is_storage_only());
    if storage_only {
        return None;
    }
    let mut users = g
        .nodes
        .node_indices()
        .filter(|&n| g.nodes[n].inputs.contains(&Some(v)) || g.nodes[n].implicit.contains(&v));
    let c = users.next()?;
    if users.next().is_some() {
        return None;
    }
    let node = &g.nodes[c];
    (node.inputs.iter().filter(|i| **i == Some(v)).count() == 1 && !node.implicit.contains(&v))
        .then_some(c)
}

/// Nodes reading `v` (as an input or implicitly).
pub fn users(g: &Graph, v: ValueId) -> Vec<NodeId> {
    g.nodes
        .node_indices()
        .filter(|&n| g.nodes[n].inputs.contains(&Some(v)) || g.nodes[n].implicit.contains(&v))
        .collect()
}

/// The value of a known one-element tensor, as f64.
pub fn const_scalar(known: &HashMap<ValueId, Value>, v: ValueId) -> Option<f64> {
    let t = known.get(&v)?.as_tensor()?;
    let x = t.to_f64_vec()?;
    (x.len() == 1).then(|| x[0])
}
