//! Conv / ConvTranspose followed by BatchNormalization (inference mode, constant
//! statistics) becomes one Conv with scaled weights and a shifted bias:
//! `s = scale / sqrt(var + eps)`, `W' = W * s` per output channel, `b' = (b - mean) * s + B`.

use super::util::{absorb, const_f64, fold_each, is_op, producer, sole_reader, ConvWeights};
use crate::error::Result;
use crate::ir::{Graph, NodeId};

pub fn run(g: &mut Graph) -> Result<()> {
    fold_each(g, fold)
}

fn fold(g: &mut Graph, bn: NodeId) -> Result<bool> {
    if !is_op(g, bn, "BatchNormalization") {
        return Ok(false);
    }
    let node = &g.nodes[bn];
    if node.outputs.len() != 1
        || node.inputs.len() != 5
        || node.attrs.int("training_mode", 0).unwrap_or(1) != 0
        || node.attrs.int("spatial", 1).unwrap_or(0) != 1
    {
        return Ok(false);
    }
    let Some(x) = node.inputs[0] else {
        return Ok(false);
    };
    let eps = node.attrs.float("epsilon", 1e-5).unwrap_or(1e-5) as f64;
    let stats: Option<Vec<Vec<f64>>> = node.inputs[1..]
        .iter()
        .map(|&v| const_f64(g, v).map(|a| a.iter().copied().collect()))
        .collect();
    let Some(stats) = stats else {
        return Ok(false);
    };
    let Some(conv) = producer(g, x) else {
        return Ok(false);
    };
    if sole_reader(g, x) != Some(bn) || g.value(x).ty != g.value(node.outputs[0]).ty {
        return Ok(false);
    }
    let Some(mut cw) = ConvWeights::of(g, conv) else {
        return Ok(false);
    };
    let m = cw.m;
    if stats.iter().any(|s| s.len() != m) {
        return Ok(false);
    }
    let (scale, shift, mean, var) = (&stats[0], &stats[1], &stats[2], &stats[3]);
    let s: Vec<f64> = (0..m).map(|o| scale[o] / (var[o] + eps).sqrt()).collect();
    cw.scale(&s);
    let b: Vec<f64> = (0..m)
        .map(|o| {
            let b0 = cw.b.as_ref().map_or(0.0, |b| b[o]);
            (b0 - mean[o]) * s[o] + shift[o]
        })
        .collect();
    cw.b = Some(super::util::array(&[m], b));
    cw.store(g, conv)?;
    absorb(g, conv, bn);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, DType};
    use crate::passes::testutil::*;

    fn bn_after(op: &str, w_shape: &[usize], group: i64, out: &[usize], bias: bool) -> Graph {
        let mut b = Builder::new();
        let x = b.input("x", &[1, 4, 5, 5]);
        let n: usize = w_shape.iter().product();
        let w = b.konst(
            "w",
            w_shape,
            (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) / 7.0).collect(),
        );
        let m = out[1];
        let mut ins = vec![Some(x), Some(w)];
        if bias {
            ins.push(Some(b.konst(
                "b",
                &[m],
                (0..m).map(|i| i as f32 * 0.3).collect(),
            )));
        }
        let c = b.node_full(op, ins, 1, DType::F32, out, &[("group", Attr::Int(group))])[0];
        let sc = b.konst("scale", &[m], (0..m).map(|i| 0.5 + i as f32).collect());
        let sh = b.konst("shift", &[m], (0..m).map(|i| i as f32 - 1.0).collect());
        let mean = b.konst("mean", &[m], (0..m).map(|i| 0.1 * i as f32).collect());
        let var = b.konst("var", &[m], (0..m).map(|i| 1.0 + i as f32).collect());
        let y = b.node("BatchNormalization", &[c, sc, sh, mean, var], out);
        let r = b.node("Relu", &[y], out);
        b.finish(&[r])
    }

    #[test]
    fn conv_bn_folds() {
        for (w, group, bias) in [
            (vec![6, 4, 3, 3], 1, true),
            (vec![6, 2, 3, 3], 2, false),
            (vec![4, 1, 3, 3], 4, true),
        ] {
            let mut g = bn_after("Conv", &w, group, &[1, w[0], 3, 3], bias);
            check_pass(&mut g, run);
            assert_eq!(g.node_count(), 2);
        }
    }

    #[test]
    fn conv_transpose_bn_folds() {
        for (w, group) in [(vec![4, 3, 3, 3], 1), (vec![4, 3, 3, 3], 2)] {
            let m = w[1] * group as usize;
            let mut g = bn_after("ConvTranspose", &w, group, &[1, m, 7, 7], false);
            check_pass(&mut g, run);
            assert_eq!(g.node_count(), 2);
        }
    }

    #[test]
    fn shared_conv_output_is_not_folded() {
        let mut g = bn_after("Conv", &[6, 4, 3, 3], 1, &[1, 6, 3, 3], true);
        // Make the conv output a graph output too.
        let conv = g
            .nodes
            .node_indices()
            .find(|&n| g.nodes[n].op_type == "Conv")
            .unwrap();
        let y = g.nodes[conv].outputs[0];
        g.outputs.push(y);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 3);
    }
}
