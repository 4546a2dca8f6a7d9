//! A grouped convolution with enough channels per group for a GEMM (at least 4 in and 8
//! out, at most 16 groups, not depthwise) becomes one convolution per group between a
//! Split of its input's channels and a Concat of their outputs:
//!
//! ```text
//! x [N,C,H,W] -> Split (axis 1, C/g each) -> Conv_i (group 1, weights and bias rows
//!   i M/g..(i+1) M/g) -> Concat (axis 1) -> y
//! ```
//!
//! Each group's conv then takes the GEMM lowerings (1x1, im2col, Winograd) that group-1
//! convs have; a grouped conv kept the generic loop nest, which accumulates every input
//! channel's taps into the output rows in memory: 64 channels in 8 groups, 3x3 on 56x56,
//! 1.31 -> 0.42 ms on one thread (ONNX Runtime 0.99). The Concat writes nothing of its
//! own (the memory plan places each group's output in its slice).

use super::util::{add_const, derived_name, dtype_of, fold_each, is_op, new_node, shape_of};
use crate::error::Result;
use crate::ir::{Attr, Attrs, DType, Graph, NodeId, Source, Tensor, ValueId, ValueType};
use ndarray::{Axis, Slice};

/// Most groups split (each becomes a kernel of its own).
const MAX_GROUPS: usize = 16;

pub fn run(g: &mut Graph) -> Result<()> {
    fold_each(g, split)
}

/// The group count of a conv the rewrite takes.
fn groups(g: &Graph, n: NodeId) -> Option<usize> {
    if !is_op(g, n, "Conv") {
        return None;
    }
    let node = &g.nodes[n];
    let group = usize::try_from(node.attrs.int("group", 1).ok()?).ok()?;
    let x = node.inputs.first().copied().flatten()?;
    let w = g.const_of(node.inputs.get(1).copied().flatten()?)?;
    let xs = shape_of(g, x)?;
    let ys = shape_of(g, *node.outputs.first()?)?;
    let bias_ok = match node.inputs.get(2).copied().flatten() {
        None => true,
        Some(b) => g.const_of(b).is_some_and(|t| t.array::<f32>().is_some()),
    };
    let ok = (2..=MAX_GROUPS).contains(&group)
        && xs.len() == ys.len()
        && xs.len() >= 3
        && dtype_of(g, x) == Some(DType::F32)
        && w.array::<f32>().is_some()
        && bias_ok
        && xs[1] % group == 0
        && w.shape()[0] % group == 0
        && xs[1] / group >= 4
        && w.shape()[0] / group >= 8
        && w.shape()[1] == xs[1] / group;
    ok.then_some(group)
}

fn split(g: &mut Graph, n: NodeId) -> Result<bool> {
    let Some(groups) = groups(g, n) else {
        return Ok(false);
    };
    let node = &g.nodes[n];
    let (name, opset) = (node.name.clone(), node.opset);
    let x = node.inputs[0].expect("checked");
    let w = node.inputs[1].expect("checked");
    let bias = node.inputs.get(2).copied().flatten();
    let y = node.outputs[0];
    let mut attrs = node.attrs.clone();
    attrs.0.insert("group".into(), Attr::Int(1));
    let (xs, ys) = (
        shape_of(g, x).expect("checked"),
        shape_of(g, y).expect("checked"),
    );
    let (cg, mg) = (xs[1] / groups, ys[1] / groups);
    let label = |what: &str| derived_name(&name, &format!("groups/{what}"));
    let wt = g.const_of(w).expect("checked").clone();
    let bt = bias.map(|b| g.const_of(b).expect("checked").clone());
    // Rows `i mg..(i + 1) mg` of a constant, as a new constant.
    let rows = |g: &mut Graph, t: &Tensor, i: usize, what: &str| -> ValueId {
        let a = t.array::<f32>().expect("checked");
        let part = a
            .slice_axis(Axis(0), Slice::from(i * mg..(i + 1) * mg))
            .to_owned();
        add_const(g, &label(&format!("{what}{i}")), Tensor::from_array(part))
    };
    let typed = |shape: &[usize], c: usize| {
        let mut s = shape.to_vec();
        s[1] = c;
        ValueType::tensor(DType::F32, &s)
    };
    let sizes = add_const(
        g,
        &label("split"),
        Tensor::from_vec(&[groups], vec![cg as i64; groups]),
    );
    let parts: Vec<ValueId> = (0..groups)
        .map(|i| {
            let vname = g.fresh_name(&label(&format!("x{i}")));
            g.add_value(vname, typed(&xs, cg), Source::Undefined)
        })
        .collect();
    let mut split_attrs = Attrs::default();
    split_attrs.0.insert("axis".into(), Attr::Int(1));
    g.remove_node(n);
    g.value_mut(y).source = Source::Undefined;
    g.add_node(new_node(
        label("split"),
        "Split",
        split_attrs,
        13,
        vec![Some(x), Some(sizes)],
        parts.clone(),
    )?);
    let mut outs = Vec::new();
    for (i, &p) in parts.iter().enumerate() {
        let wi = rows(g, &wt, i, "w");
        let bi = bt.as_ref().map(|b| rows(g, b, i, "b"));
        let cname = g.fresh_name(&label(&format!("conv{i}")));
        let o = g.add_value(cname.clone(), typed(&ys, mg), Source::Undefined);
        let mut inputs = vec![Some(p), Some(wi)];
        if let Some(b) = bi {
            inputs.push(Some(b));
        }
        g.add_node(new_node(
            cname,
            "Conv",
            attrs.clone(),
            opset,
            inputs,
            vec![o],
        )?);
        outs.push(Some(o));
    }
    let mut cat = Attrs::default();
    cat.0.insert("axis".into(), Attr::Int(1));
    g.add_node(new_node(label("concat"), "Concat", cat, 13, outs, vec![y])?);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;

    fn conv(c: usize, m: usize, group: i64, bias: bool) -> Graph {
        let mut b = Builder::new();
        let x = b.input("x", &[2, c, 6, 7]);
        let cg = c / group as usize;
        let w = b.konst(
            "w",
            &[m, cg, 3, 3],
            (0..m * cg * 9)
                .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.05)
                .collect(),
        );
        let mut ins = vec![x, w];
        if bias {
            ins.push(b.konst("b", &[m], (0..m).map(|i| i as f32 * 0.1).collect()));
        }
        let y = b.node_attrs(
            "Conv",
            &ins,
            DType::F32,
            &[2, m, 6, 7],
            &[
                ("group", Attr::Int(group)),
                ("pads", Attr::Ints(vec![1, 1, 1, 1])),
            ],
        );
        b.finish(&[y])
    }

    #[test]
    fn grouped_conv_becomes_one_conv_per_group() {
        // 16 groups of 16 input channels: the Split's sizes multiply to 2^64 (they were
        // once checked as if they were a shape).
        for (c, m, group, bias) in [(16, 32, 4, true), (8, 16, 2, false), (256, 128, 16, true)] {
            let mut g = conv(c, m, group, bias);
            check_pass(&mut g, run);
            let convs = g
                .nodes
                .node_weights()
                .filter(|n| n.op_type == "Conv")
                .count();
            assert_eq!(convs, group as usize);
        }
    }

    #[test]
    fn depthwise_and_narrow_groups_stay() {
        // Depthwise; 2 input channels per group; 4 output channels per group.
        for (c, m, group) in [(8, 8, 8), (8, 16, 4), (16, 16, 4)] {
            let mut g = conv(c, m, group, true);
            check_pass(&mut g, run);
            assert_eq!(g.node_count(), 1, "{c} {m} {group}");
        }
    }
}
