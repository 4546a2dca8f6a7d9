//! Elementwise fusion: a tree (or small DAG) of elementwise ops that ends in one value
//! becomes one `onnxc.Fused` node, lowered as one loop nest that computes the whole
//! expression per element. A producer joins the group of its consumers when every node
//! reading its output is in the group and its output is not a graph output; every value
//! of the group must broadcast to the group's output shape. Values of a type narrower than
//! their compute type (f16 and smaller) are only a group's output (see [`narrow`]).

use super::fuse_epilogue::fused_name;
use super::fuse_util::{known_values, users};
use crate::error::{Error, Result};
use crate::ir::{broadcast_shapes, Graph, NodeId, Source, ValueId};
use crate::kir::Ty;
use crate::ops::fused::{fuse_nodes, scalar_expr_of};
use crate::ops::lowering::kir_ty;

/// True when `n` is an elementwise op that the fused lowering computes as one scalar
/// expression.
fn elementwise(g: &Graph, n: NodeId) -> bool {
    let node = &g.nodes[n];
    if !node.domain.is_empty() || node.outputs.len() != 1 || !node.implicit.is_empty() {
        return false;
    }
    // QuantizeLinear of f32 to 8 bits by one scale and zero point (a per-axis scale does
    // not broadcast as the group's values do).
    if node.op_type == "QuantizeLinear" {
        let one = |v: &Option<ValueId>| {
            v.is_some_and(|v| {
                g.value(v)
                    .ty
                    .static_shape()
                    .is_some_and(|s| s.iter().product::<usize>() == 1)
            })
        };
        let attrs_ok = ["block_size", "output_dtype", "precision"]
            .iter()
            .all(|a| node.attrs.int(a, 0).ok() == Some(0));
        let out = g.value(node.outputs[0]).ty.dtype();
        let x = node
            .inputs
            .first()
            .copied()
            .flatten()
            .and_then(|v| g.value(v).ty.dtype());
        if !attrs_ok
            || x != Some(crate::ir::DType::F32)
            || !matches!(out, Some(crate::ir::DType::U8 | crate::ir::DType::I8))
            || !one(node.inputs.get(1).unwrap_or(&None))
            || node.inputs.get(2).is_some_and(|z| z.is_some() && !one(z))
        {
            return false;
        }
    }
    let mut tys: Vec<Option<Ty>> = Vec::new();
    for i in &node.inputs {
        match i {
            None => tys.push(None),
            Some(v) => match g.value(*v).ty.dtype().and_then(kir_ty) {
                Some(t) => tys.push(Some(t.compute())),
                None => return false,
            },
        }
    }
    g.value(node.outputs[0])
        .ty
        .dtype()
        .and_then(kir_ty)
        .is_some()
        && scalar_expr_of(node, &tys).is_some()
}

/// True when `v`'s type is narrower than the type it is computed in (f16, bf16, the
/// 8- and 4-bit floats and integers): such a value is rounded where it is stored, so it
/// may end a group (its output) but not be computed inside one, where it would stay
/// unrounded (an f16 Mul read by a Cast to f32 came out a unit off).
fn narrow(g: &Graph, v: ValueId) -> bool {
    g.value(v)
        .ty
        .dtype()
        .and_then(kir_ty)
        .is_none_or(|t| t.compute() != t)
}

pub fn run(g: &mut Graph) -> Result<()> {
    let known = known_values(g)?;
    let order = g
        .topo_order()
        .map_err(|c| Error::model(format!("cycle through {}", c.join(", "))))?;
    let mut taken: Vec<NodeId> = Vec::new();
    let mut groups: Vec<Vec<NodeId>> = Vec::new();
    for &root in order.iter().rev() {
        if taken.contains(&root)
            || !elementwise(g, root)
            || known.contains_key(&g.nodes[root].outputs[0])
        {
            continue;
        }
        let Some(shape) = g.value(g.nodes[root].outputs[0]).ty.static_shape() else {
            continue;
        };
        let mut group = vec![root];
        let mut changed = true;
        while changed {
            changed = false;
            let inputs: Vec<_> = group
                .iter()
                .flat_map(|&n| g.nodes[n].inputs.iter().flatten().copied())
                .collect();
            for v in inputs {
                let Source::Node(p) = g.value(v).source else {
                    continue;
                };
                if group.contains(&p)
                    || taken.contains(&p)
                    || known.contains_key(&v)
                    || g.outputs.contains(&v)
                    || !elementwise(g, p)
                    || narrow(g, v)
                    || !users(g, v).iter().all(|u| group.contains(u))
                {
                    continue;
                }
                let fits = g.nodes[p].inputs.iter().flatten().chain([&v]).all(|x| {
                    g.value(*x)
                        .ty
                        .static_shape()
                        .and_then(|s| broadcast_shapes(&s, &shape))
                        .as_deref()
                        == Some(&shape[..])
                });
                if fits {
                    group.push(p);
                    changed = true;
                }
            }
        }
        taken.extend(&group);
        if group.len() > 1 {
            groups.push(group);
        }
    }
    for mut group in groups {
        // Schedule order inside the group.
        group.sort_by_key(|n| order.iter().position(|m| m == n));
        let name = fused_name(g, group[0]);
        fuse_nodes(g, &group, &name).map_err(|e| Error::model(e.0))?;
    }
    Ok(())
}
