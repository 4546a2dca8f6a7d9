//! MatMul of a rank-2 input by a constant 2-D weight, followed by Add of a constant
//! that broadcasts to the product, becomes one Gemm (bias as C). Higher-rank MatMul +
//! Add pairs are left for the fusion passes.

use super::util::{
    derived_name, dtype_of, foldable_float, is_op, new_node, order, producer, shape_of, sole_reader,
};
use crate::error::Result;
use crate::ir::{Attrs, Graph, NodeId, Source};

pub fn run(g: &mut Graph) -> Result<()> {
    for n in order(g)? {
        if g.nodes.contains_node(n) {
            fold(g, n)?;
        }
    }
    g.rewire();
    Ok(())
}

/// Rewrites `add` and the MatMul feeding it into one Gemm when the pattern applies.
pub(crate) fn fold(g: &mut Graph, add: NodeId) -> Result<bool> {
    if !is_op(g, add, "Add") {
        return Ok(false);
    }
    let node = &g.nodes[add];
    let (Some(Some(a)), Some(Some(b))) =
        (node.inputs.first().copied(), node.inputs.get(1).copied())
    else {
        return Ok(false);
    };
    let z = node.outputs[0];
    let (y, c) = if g.const_of(b).is_some() {
        (a, b)
    } else if g.const_of(a).is_some() {
        (b, a)
    } else {
        return Ok(false);
    };
    let Some(mm) = producer(g, y) else {
        return Ok(false);
    };
    if !is_op(g, mm, "MatMul") || sole_reader(g, y) != Some(add) || g.nodes[mm].opset < 7 {
        return Ok(false);
    }
    let (Some(Some(x)), Some(Some(w))) = (
        g.nodes[mm].inputs.first().copied(),
        g.nodes[mm].inputs.get(1).copied(),
    ) else {
        return Ok(false);
    };
    let dt = dtype_of(g, y);
    let ok = foldable_float(dt)
        && dtype_of(g, c) == dt
        && g.value(y).ty == g.value(z).ty
        && shape_of(g, x).is_some_and(|s| s.len() == 2)
        && g.const_of(w).is_some_and(|t| t.rank() == 2)
        && g.const_of(c).is_some_and(|t| t.rank() <= 2);
    if !ok {
        return Ok(false);
    }
    let name = derived_name(&g.nodes[mm].name, "gemm");
    let opset = g.nodes[mm].opset;
    let gemm = new_node(
        name,
        "Gemm",
        Attrs::default(),
        opset,
        vec![Some(x), Some(w), Some(c)],
        vec![z],
    )?;
    g.remove_node(add);
    g.remove_node(mm);
    g.add_node(gemm);
    g.value_mut(y).source = Source::Undefined;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;

    #[test]
    fn rank2_matmul_add_becomes_gemm() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 3]);
        let w = b.konst("w", &[3, 4], (0..12).map(|i| i as f32 * 0.1).collect());
        let y = b.node("MatMul", &[x, w], &[2, 4]);
        let c = b.konst("c", &[4], vec![1.0, -2.0, 0.5, 3.0]);
        let z = b.node("Add", &[c, y], &[2, 4]);
        let mut g = b.finish(&[z]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 1);
        let n = g.nodes.node_indices().next().unwrap();
        assert_eq!(g.nodes[n].op_type, "Gemm");
    }

    #[test]
    fn rank3_matmul_add_stays() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 2, 3]);
        let w = b.konst("w", &[3, 4], (0..12).map(|i| i as f32 * 0.1).collect());
        let y = b.node("MatMul", &[x, w], &[2, 2, 4]);
        let c = b.konst("c", &[4], vec![1.0, -2.0, 0.5, 3.0]);
        let z = b.node("Add", &[y, c], &[2, 2, 4]);
        let mut g = b.finish(&[z]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 2);
    }
}
