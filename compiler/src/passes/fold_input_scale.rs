//! A per-channel scale computed at run time on a Conv's input moves onto its weights:
//! `Conv(Mul(x, s), W, b)` with `s` of shape `[1, C, 1, 1]` (squeeze-excitation's gate)
//! becomes `Conv(x, Mul(W, s), b)`, since `sum_c W[m, c, .] (x[c, .] s[c]) = sum_c (W[m,
//! c, .] s[c]) x[c, .]` (zero padding stays zero). The Mul then runs on the `M x C x kh x
//! kw` weights instead of the `C x H x W` activation, so only where the plane is large
//! against the output channels ([`MIN_PIXELS_PER_OUTPUT`]): EfficientNet-B0's blocks on
//! 112x112 to 28x28. Only a batch of one (the gate is per image), group 1, constant f32
//! weights, and a product with no other reader are rewritten.

use super::util::{
    derived_name, dtype_of, fold_each, is_op, new_node, producer, shape_of, sole_reader,
};
use crate::error::Result;
use crate::ir::{Attrs, DType, Graph, NodeId, Source, ValueType};

/// Least output pixels per output channel for the rewrite: the weights' Mul (and the
/// conv then reading weights computed at run time, packed per call) must cost well under
/// the activation's Mul it replaces.
pub const MIN_PIXELS_PER_OUTPUT: usize = 4;

pub fn run(g: &mut Graph) -> Result<()> {
    fold_each(g, fold)
}

fn fold(g: &mut Graph, conv: NodeId) -> Result<bool> {
    if !is_op(g, conv, "Conv") {
        return Ok(false);
    }
    let node = &g.nodes[conv];
    let group = node.attrs.int("group", 1).unwrap_or(0);
    let (Some(Some(y)), Some(Some(w))) =
        (node.inputs.first().copied(), node.inputs.get(1).copied())
    else {
        return Ok(false);
    };
    let Some(&out) = node.outputs.first() else {
        return Ok(false);
    };
    let Some(mul) = producer(g, y) else {
        return Ok(false);
    };
    if group != 1 || !is_op(g, mul, "Mul") || sole_reader(g, y) != Some(conv) {
        return Ok(false);
    }
    let (Some(Some(a)), Some(Some(b))) = (
        g.nodes[mul].inputs.first().copied(),
        g.nodes[mul].inputs.get(1).copied(),
    ) else {
        return Ok(false);
    };
    let f32 = |v| dtype_of(g, v) == Some(DType::F32);
    let (Some(ws), Some(ys), Some(os)) = (shape_of(g, w), shape_of(g, y), shape_of(g, out)) else {
        return Ok(false);
    };
    if ![y, w, a, b].into_iter().all(f32) || g.const_of(w).is_none() || ws.len() != 4 {
        return Ok(false);
    }
    let c = ws[1];
    let gate = [1, c, 1, 1];
    // Which operand is the activation and which the gate.
    let (x, s) = match (shape_of(g, a), shape_of(g, b)) {
        (Some(sa), Some(sb)) if sa == ys && sb == gate => (a, b),
        (Some(sa), Some(sb)) if sb == ys && sa == gate => (b, a),
        _ => return Ok(false),
    };
    let pixels: usize = os.iter().skip(2).product();
    if ys.len() != 4 || ys[0] != 1 || ys[1] != c || pixels < MIN_PIXELS_PER_OUTPUT * ws[0] {
        return Ok(false);
    }
    let name = derived_name(&g.nodes[mul].name, "weights");
    let ws_value = g.add_value(
        g.fresh_name(&format!("{name}_out")),
        ValueType::tensor(DType::F32, &ws),
        Source::Undefined,
    );
    let scale = new_node(
        name,
        "Mul",
        Attrs::default(),
        g.nodes[mul].opset,
        vec![Some(w), Some(s)],
        vec![ws_value],
    )?;
    g.add_node(scale);
    let node = &mut g.nodes[conv];
    node.inputs[0] = Some(x);
    node.inputs[1] = Some(ws_value);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Attr;
    use crate::passes::testutil::*;

    /// An SE block's end: x * gate, then a 1x1 conv; `plane` pixels, `m` outputs.
    fn se_conv(plane: usize, m: usize, batch: usize) -> Graph {
        let mut b = Builder::new();
        let x = b.input("x", &[batch, 8, plane, plane]);
        let z = b.input("z", &[batch, 8, 1, 1]);
        let gate = b.node("Sigmoid", &[z], &[batch, 8, 1, 1]);
        let y = b.node("Mul", &[x, gate], &[batch, 8, plane, plane]);
        let w = b.konst(
            "w",
            &[m, 8, 1, 1],
            (0..m * 8).map(|i| (i as f32 * 0.37).sin()).collect(),
        );
        let bias = b.konst("bias", &[m], (0..m).map(|i| i as f32 * 0.1).collect());
        let o = b.node_full(
            "Conv",
            vec![Some(y), Some(w), Some(bias)],
            1,
            DType::F32,
            &[batch, m, plane, plane],
            &[("kernel_shape", Attr::Ints(vec![1, 1]))],
        )[0];
        b.finish(&[o])
    }

    /// The weights the (one) conv reads.
    fn conv_weights(g: &Graph) -> crate::ir::ValueId {
        let conv = g
            .nodes
            .node_indices()
            .find(|&n| is_op(g, n, "Conv"))
            .unwrap();
        g.nodes[conv].inputs[1].unwrap()
    }

    fn ops(g: &Graph) -> Vec<String> {
        let mut v: Vec<String> = g.nodes.node_weights().map(|n| n.op_type.clone()).collect();
        v.sort();
        v
    }

    #[test]
    fn gate_moves_onto_the_weights() {
        let mut g = se_conv(6, 4, 1);
        // check_pass compares the evaluated outputs before and after.
        check_pass(&mut g, run);
        let w = conv_weights(&g);
        assert!(g.const_of(w).is_none(), "the conv reads scaled weights");
        let scale = producer(&g, w).unwrap();
        assert!(is_op(&g, scale, "Mul"));
        assert_eq!(shape_of(&g, w).unwrap(), vec![4, 8, 1, 1]);
        assert_eq!(ops(&g), ["Conv", "Mul", "Sigmoid"]);
    }

    #[test]
    fn small_planes_and_batches_stay() {
        // 3x3 = 9 pixels for 4 outputs: under 4 per output.
        for mut g in [se_conv(3, 4, 1), se_conv(6, 4, 2)] {
            let before = ops(&g);
            check_pass(&mut g, run);
            assert!(g.const_of(conv_weights(&g)).is_some());
            assert_eq!(ops(&g), before);
        }
    }
}
