//! `QuantizeLinear(MaxPool(DequantizeLinear(x_q, s, z)), s, z)` (the QDQ format's max
//! pool: ONNX Runtime's quantizer gives a MaxPool's output its input's scale and zero
//! point) becomes `MaxPool(x_q)`, the pool of the 8-bit values themselves.
//!
//! Exact: with `s > 0` dequantization is increasing, so the maximum of the dequantized
//! window is the dequantized maximum `(m - z) s`, and quantizing it with the same scale
//! and zero point gives back `m`: `(m - z) s / s` is within a few ulp of the integer
//! `m - z` (at most 255 in magnitude), which rounds to it, and `m` is in the type's range.
//! The MaxPool then reads and writes a quarter of the bytes, and the DequantizeLinear and
//! QuantizeLinear loops around it go (in QDQ SqueezeNet 1.1 three such pools, in QDQ
//! ResNet-18 one).

use super::util::{
    dtype_of, is_op, new_node, per_tensor_quant, producer, rewrite_planned, same_const,
    same_zero_point, sole_reader,
};
use crate::error::Result;
use crate::ir::{DType, Graph, NodeId, ValueId};

pub fn run(g: &mut Graph) -> Result<()> {
    rewrite_planned(g, plan, |g, n, (xq, q)| rewrite(g, n, xq, q))
}

/// For a MaxPool between such a DequantizeLinear and QuantizeLinear: the quantized input
/// and the QuantizeLinear node.
fn plan(g: &Graph, n: NodeId) -> Option<(ValueId, NodeId)> {
    if !is_op(g, n, "MaxPool") {
        return None;
    }
    let node = &g.nodes[n];
    // No Indices output.
    if node.outputs.len() != 1 {
        return None;
    }
    let (xq, sx, zx) = per_tensor_quant(
        g,
        producer(g, node.inputs.first().copied().flatten()?)?,
        "DequantizeLinear",
    )?;
    let q = sole_reader(g, node.outputs[0])?;
    let (_, sy, zy) = per_tensor_quant(g, q, "QuantizeLinear")?;
    let qo = *g.nodes[q].outputs.first()?;
    let dt = dtype_of(g, xq)?;
    let scale = g.const_of(sx)?.to_f64()?;
    let positive = scale.iter().all(|&s| s > 0.0 && s.is_finite());
    let zeros = same_zero_point(g, zx, zy);
    (matches!(dt, DType::U8 | DType::I8)
        && dtype_of(g, qo) == Some(dt)
        && positive
        && same_const(g, sx, sy)
        && zeros)
        .then_some((xq, q))
}

fn rewrite(g: &mut Graph, n: NodeId, xq: ValueId, q: NodeId) -> Result<()> {
    let qo = g.nodes[q].outputs[0];
    g.remove_node(q);
    let pool = g.remove_node(n).expect("a node of the order");
    let node = new_node(
        pool.name.clone(),
        "MaxPool",
        pool.attrs.clone(),
        pool.opset.max(12),
        vec![Some(xq)],
        vec![qo],
    )?;
    g.add_node(node);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, Tensor};
    use crate::passes::testutil::*;

    /// x (f32) -> QuantizeLinear -> DequantizeLinear -> MaxPool 3x3 / 2 ->
    /// QuantizeLinear (scale `sy`, zero point `zy`) -> DequantizeLinear.
    fn qdq_pool(sy: f32, zy: u8) -> Graph {
        let mut t = Builder::new();
        let x = t.input("x", &[1, 4, 9, 9]);
        let s = t.konst_t("s", Tensor::scalar(0.05f32));
        let z = t.konst_t("z", Tensor::scalar(120u8));
        let xq = t.node_typed("QuantizeLinear", &[x, s, z], DType::U8, &[1, 4, 9, 9]);
        let xd = t.node("DequantizeLinear", &[xq, s, z], &[1, 4, 9, 9]);
        let attrs = [
            ("kernel_shape", Attr::Ints(vec![3, 3])),
            ("strides", Attr::Ints(vec![2, 2])),
            ("pads", Attr::Ints(vec![1, 1, 1, 1])),
        ];
        let p = t.node_attrs("MaxPool", &[xd], DType::F32, &[1, 4, 5, 5], &attrs);
        let sy = t.konst_t("sy", Tensor::scalar(sy));
        let zy = t.konst_t("zy", Tensor::scalar(zy));
        let yq = t.node_typed("QuantizeLinear", &[p, sy, zy], DType::U8, &[1, 4, 5, 5]);
        let y = t.node("DequantizeLinear", &[yq, sy, zy], &[1, 4, 5, 5]);
        t.finish(&[y])
    }

    #[test]
    fn a_max_pool_between_the_same_quantization_pools_the_bytes() {
        let mut g = qdq_pool(0.05, 120);
        check_pass(&mut g, run);
        // The pool's QuantizeLinear is gone (its DequantizeLinear, unread now, is left
        // to eliminate_dead_code).
        let count = |op: &str| op_order(&g).iter().filter(|o| *o == op).count();
        assert_eq!(count("QuantizeLinear"), 1, "{:?}", op_order(&g));
        let pool = g.nodes.node_weights().find(|n| n.op_type == "MaxPool");
        let pool = pool.expect("a MaxPool");
        let x = pool.inputs[0].expect("an input");
        assert_eq!(g.value(x).ty.dtype(), Some(DType::U8));
    }

    #[test]
    fn another_scale_or_zero_point_keeps_the_f32_pool() {
        for (sy, zy) in [(0.06, 120), (0.05, 121)] {
            let mut g = qdq_pool(sy, zy);
            check_pass(&mut g, run);
            assert!(
                op_order(&g).contains(&"DequantizeLinear".to_string()) && op_order(&g).len() == 5,
                "{sy} {zy}: {:?}",
                op_order(&g)
            );
        }
    }
}
