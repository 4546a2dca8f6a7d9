//! No-op removal: Identity, Dropout in inference, Cast to the same type, Reshape /
//! Flatten / Squeeze / Expand / Tile to the same shape, Pad with zero pads, Slice of
//! everything, identity Transposes; Transpose pairs that cancel are removed and Transpose
//! chains merged; consecutive reshapes become one Reshape.

use super::util::{
    add_const, bypass, const_ints, is_op, order, producer, rebuild, same_type, shape_of,
    shape_tensor,
};
use crate::error::Result;
use crate::ir::{Attr, DType, Graph, NodeId};

pub fn run(g: &mut Graph) -> Result<()> {
    for _round in 0..8 {
        let mut changed = false;
        for n in order(g)? {
            if g.nodes.contains_node(n) && simplify(g, n)? {
                changed = true;
            }
        }
        g.rewire();
        if !changed {
            break;
        }
    }
    Ok(())
}

/// Removes `n` when its first output can be replaced by its first input.
fn drop_node(g: &mut Graph, n: NodeId) -> bool {
    let node = &g.nodes[n];
    let (Some(Some(x)), Some(&y)) = (node.inputs.first().copied(), node.outputs.first()) else {
        return false;
    };
    if !same_type(g, x, y) {
        return false;
    }
    // Other outputs (Dropout's mask) must be unread.
    for &o in &node.outputs[1..] {
        if g.is_pinned(o) || !g.readers(o).is_empty() {
            return false;
        }
    }
    if bypass(g, y, x) {
        g.remove_node(n);
        true
    } else {
        false
    }
}

fn all_zero(v: Option<Vec<i64>>) -> bool {
    v.is_some_and(|v| v.iter().all(|&p| p == 0))
}

fn simplify(g: &mut Graph, n: NodeId) -> Result<bool> {
    let node = &g.nodes[n];
    if !node.domain.is_empty() || node.outputs.is_empty() || node.inputs.is_empty() {
        return Ok(false);
    }
    let Some(x) = node.inputs[0] else {
        return Ok(false);
    };
    let y = node.outputs[0];
    let same_shape = shape_of(g, x).is_some() && shape_of(g, x) == shape_of(g, y);
    let op = node.op_type.clone();
    let noop = match op.as_str() {
        "Identity" => true,
        "Dropout" => {
            node.opset < 12
                || match node.inputs.get(2).copied().flatten() {
                    None => true,
                    Some(t) => all_zero(const_ints(g, Some(t))),
                }
        }
        "Cast" | "CastLike" => true, // same_type in drop_node checks the dtype
        "Reshape" | "Flatten" | "Squeeze" | "Expand" | "Tile" | "Unsqueeze" => same_shape,
        "Pad" => {
            let pads = if node.opset < 11 {
                node.attrs
                    .get_ints("pads")
                    .ok()
                    .flatten()
                    .or_else(|| node.attrs.get_ints("paddings").ok().flatten())
            } else {
                const_ints(g, node.inputs.get(1).copied().flatten())
            };
            same_shape && all_zero(pads)
        }
        "Slice" => {
            let steps_one = node.opset < 10
                || match node.inputs.get(4).copied().flatten() {
                    None => true,
                    Some(s) => const_ints(g, Some(s)).is_some_and(|v| v.iter().all(|&k| k == 1)),
                };
            same_shape && steps_one
        }
        "Transpose" => {
            let r = shape_of(g, x).map(|s| s.len()).unwrap_or(0);
            let perm = perm_of(g, n, r);
            perm.iter().enumerate().all(|(i, &p)| i == p)
        }
        _ => false,
    };
    if noop && drop_node(g, n) {
        return Ok(true);
    }
    match op.as_str() {
        "Transpose" => merge_transposes(g, n),
        "Reshape" => merge_reshapes(g, n),
        _ => Ok(false),
    }
}

fn perm_of(g: &Graph, n: NodeId, rank: usize) -> Vec<usize> {
    match g.nodes[n].attrs.get_ints("perm").ok().flatten() {
        Some(p) if p.len() == rank && p.iter().all(|&i| i >= 0 && (i as usize) < rank) => {
            p.iter().map(|&i| i as usize).collect()
        }
        _ => (0..rank).rev().collect(),
    }
}

/// Transpose(Transpose(x, p1), p2) = Transpose(x, p1[p2[j]]), or x when that is the
/// identity.
fn merge_transposes(g: &mut Graph, n: NodeId) -> Result<bool> {
    let Some(y1) = g.nodes[n].inputs[0] else {
        return Ok(false);
    };
    let Some(p) = producer(g, y1) else {
        return Ok(false);
    };
    if !is_op(g, p, "Transpose") {
        return Ok(false);
    }
    let Some(Some(x)) = g.nodes[p].inputs.first().copied() else {
        return Ok(false);
    };
    let Some(r) = shape_of(g, x).map(|s| s.len()) else {
        return Ok(false);
    };
    let (p1, p2) = (perm_of(g, p, r), perm_of(g, n, r));
    let composed: Vec<usize> = p2.iter().map(|&j| p1[j]).collect();
    if composed.iter().enumerate().all(|(i, &c)| i == c) {
        let y = g.nodes[n].outputs[0];
        if bypass(g, y, x) {
            g.remove_node(n);
            return Ok(true);
        }
        return Ok(false);
    }
    let node = &mut g.nodes[n];
    node.inputs[0] = Some(x);
    node.attrs.0.insert(
        "perm".into(),
        Attr::Ints(composed.iter().map(|&c| c as i64).collect()),
    );
    rebuild(node)?;
    Ok(true)
}

/// Reshape(R(x)) where R only reshapes (Reshape, Flatten, Squeeze, Unsqueeze) reads `x`
/// directly with its static output shape.
fn merge_reshapes(g: &mut Graph, n: NodeId) -> Result<bool> {
    let Some(y1) = g.nodes[n].inputs[0] else {
        return Ok(false);
    };
    let Some(p) = producer(g, y1) else {
        return Ok(false);
    };
    let pure = ["Reshape", "Flatten", "Squeeze", "Unsqueeze"]
        .iter()
        .any(|op| is_op(g, p, op));
    if !pure {
        return Ok(false);
    }
    let Some(Some(x)) = g.nodes[p].inputs.first().copied() else {
        return Ok(false);
    };
    let y = g.nodes[n].outputs[0];
    let Some(shape) = shape_of(g, y) else {
        return Ok(false);
    };
    if shape.contains(&0)
        || shape_of(g, x).is_none()
        || g.value(x).ty.dtype() != g.value(y).ty.dtype()
    {
        return Ok(false);
    }
    let base = format!("{}_shape", g.value(y).name);
    let s = add_const(g, &base, shape_tensor(&shape));
    debug_assert_eq!(g.value(s).ty.dtype(), Some(DType::I64));
    let node = &mut g.nodes[n];
    node.inputs = vec![Some(x), Some(s)];
    node.attrs.0.remove("allowzero");
    rebuild(node)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Attr;
    use crate::passes::testutil::*;

    #[test]
    fn identity_cast_dropout_and_same_shape_ops_go() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 3]);
        let a = b.node("Identity", &[x], &[2, 3]);
        let c = b.node_attrs("Cast", &[a], DType::F32, &[2, 3], &[("to", Attr::Int(1))]);
        let d = b.node_full("Dropout", vec![Some(c)], 2, DType::F32, &[2, 3], &[])[0];
        let s = b.konst_i64("s", &[2], vec![2, 3]);
        let r = b.node("Reshape", &[d, s], &[2, 3]);
        let e = b.node("Expand", &[r, s], &[2, 3]);
        let pads = b.konst_i64("pads", &[4], vec![0, 0, 0, 0]);
        let p = b.node("Pad", &[e, pads], &[2, 3]);
        let st = b.konst_i64("st", &[1], vec![0]);
        let en = b.konst_i64("en", &[1], vec![100]);
        let sl = b.node("Slice", &[p, st, en], &[2, 3]);
        let y = b.node("Relu", &[sl], &[2, 3]);
        let mut g = b.finish(&[y]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 1, "{}", crate::ir::print_graph(&g));
    }

    #[test]
    fn graph_outputs_keep_their_names() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 3]);
        let r = b.node("Relu", &[x], &[2, 3]);
        let y = b.node("Identity", &[r], &[2, 3]);
        let z = b.node("Identity", &[x], &[2, 3]);
        let mut g = b.finish(&[y, z]);
        check_pass(&mut g, run);
        // y is renamed onto Relu's output; z (an input passed through) keeps its node.
        assert_eq!(g.node_count(), 2);
    }

    #[test]
    fn transposes_cancel_and_merge() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 3, 4]);
        let perm = |p: Vec<i64>| [("perm", Attr::Ints(p))];
        let t1 = b.node_attrs(
            "Transpose",
            &[x],
            DType::F32,
            &[3, 4, 2],
            &perm(vec![1, 2, 0]),
        );
        let t2 = b.node_attrs(
            "Transpose",
            &[t1],
            DType::F32,
            &[2, 3, 4],
            &perm(vec![2, 0, 1]),
        );
        let t3 = b.node_attrs(
            "Transpose",
            &[t2],
            DType::F32,
            &[4, 3, 2],
            &perm(vec![2, 1, 0]),
        );
        let t4 = b.node_attrs(
            "Transpose",
            &[t3],
            DType::F32,
            &[3, 2, 4],
            &perm(vec![1, 2, 0]),
        );
        let y = b.node("Relu", &[t4], &[3, 2, 4]);
        let mut g = b.finish(&[y]);
        check_pass(&mut g, |g| {
            run(g)?;
            super::super::eliminate_dead_code::run(g)
        });
        // t1,t2 cancel; t3,t4 merge into one Transpose of x.
        assert_eq!(g.node_count(), 2, "{}", crate::ir::print_graph(&g));
    }

    #[test]
    fn reshape_chains_merge_and_real_pads_stay() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 3, 4]);
        let f = b.node_attrs(
            "Flatten",
            &[x],
            DType::F32,
            &[2, 12],
            &[("axis", Attr::Int(1))],
        );
        let s = b.konst_i64("s", &[2], vec![6, -1]);
        let r = b.node("Reshape", &[f, s], &[6, 4]);
        let pads = b.konst_i64("pads", &[4], vec![1, 0, -1, 0]);
        let p = b.node("Pad", &[r, pads], &[6, 4]);
        let mut g = b.finish(&[p]);
        check_pass(&mut g, |g| {
            run(g)?;
            super::super::eliminate_dead_code::run(g)
        });
        assert_eq!(g.node_count(), 2, "{}", crate::ir::print_graph(&g));
    }
}
