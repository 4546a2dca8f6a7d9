//! Products of dequantized tensors (the QDQ format: `DequantizeLinear(x_q)` and a
//! constant `DequantizeLinear(w_q)` into an f32 Gemm or MatMul) on targets with 8-bit dot
//! products ([`Graph::int8_dot`]): the product of the quantized values themselves, exact
//! in i32, then scaled back, `y = f32(MatMulInteger(x_q, w_q, zx)) * (sx * sw) + c`, as
//! `integer_qdq_conv` does for convs (its argument for exactness holds here: u8 by i8
//! sums over k below 2^16 stay inside i32). A classifier's weights are then read as
//! bytes, not as the four-byte floats `fold_constants` would make of them (QDQ
//! MobileNetV2's 1280 x 1000: 5 MB from memory on every run).
//!
//! Taken: x u8 at one scale and zero point; w a constant i8 matrix (a Gemm's B, `[k, n]`
//! or with `transB` `[n, k]`, transposed here; a MatMul's `[k, n]`) at one scale or one
//! per column of the product (axis 1 of `[k, n]`, 0 of `[n, k]`) with zero points 0
//! (ONNX Runtime's quantizer makes int8 weights symmetric); a Gemm with alpha 1, no
//! transA, and a bias of `[n]` or `[1, n]` at beta 1.

use super::inline_util::add_node_to;
use super::integer_qdq_conv::{dequantized, floats, scale_back, u8_per_tensor};
use super::util::{add_const, dtype_of, is_op, retyped, rewrite_planned, shape_of};
use crate::error::Result;
use crate::ir::{DType, Graph, NodeId, Source, Tensor, ValueId};

pub fn run(g: &mut Graph) -> Result<()> {
    if !g.int8_dot {
        return Ok(());
    }
    rewrite_planned(g, plan, rewrite)
}

/// A qualifying product's quantized operands, its scale per column and its bias.
struct Plan {
    xq: ValueId,
    zx: Option<ValueId>,
    /// The weights as `[k, n]` i8.
    w: Tensor,
    /// `sx * sw` per column, `[n]`.
    scale: Tensor,
    bias: Option<ValueId>,
}

fn plan(g: &Graph, n: NodeId) -> Option<Plan> {
    let gemm = is_op(g, n, "Gemm");
    if !gemm && !is_op(g, n, "MatMul") {
        return None;
    }
    let node = &g.nodes[n];
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let (x, w, y) = (input(0)?, input(1)?, *node.outputs.first()?);
    let a = &node.attrs;
    let trans_b = gemm && a.int("transB", 0).ok()? != 0;
    if node.outputs.len() != 1
        || dtype_of(g, y)? != DType::F32
        || (gemm
            && (a.float("alpha", 1.0).ok()? != 1.0
                || a.float("beta", 1.0).ok()? != 1.0
                || a.int("transA", 0).ok()? != 0))
    {
        return None;
    }
    let ws = shape_of(g, w)?;
    let xs = shape_of(g, x)?;
    let [r, c] = ws[..] else { return None };
    let (k, cols) = if trans_b { (c, r) } else { (r, c) };
    if xs.last() != Some(&k) || (gemm && xs.len() != 2) || xs.len() < 2 {
        return None;
    }
    let (xq, sx, zx) = u8_per_tensor(g, x)?;
    // w: constant i8, one scale or one per column, zero points 0.
    let (wq, sw, zw, axis) = dequantized(g, w)?;
    let wt = g.const_of(wq)?;
    let sw = floats(g, sw)?;
    let col_axis = if trans_b { 0 } else { 1 };
    let per_col = sw.len() == cols && (axis == col_axis || axis == col_axis - 2);
    if wt.dtype() != DType::I8 || !(sw.len() == 1 || per_col) {
        return None;
    }
    if let Some(z) = zw {
        let t = g.const_of(z)?;
        if t.dtype() != DType::I8 || t.to_i64_vec()?.iter().any(|&v| v != 0) {
            return None;
        }
    }
    let bias = if gemm { input(2) } else { None };
    if let Some(b) = bias {
        let bs = shape_of(g, b)?;
        if dtype_of(g, b)? != DType::F32 || !(bs == [cols] || bs == [1, cols]) {
            return None;
        }
    }
    let wv = wt.to_i64_vec()?;
    let w: Vec<i8> = (0..k * cols)
        .map(|i| {
            let (p, j) = (i / cols, i % cols);
            wv[if trans_b { j * k + p } else { i }] as i8
        })
        .collect();
    let scale: Vec<f32> = (0..cols)
        .map(|j| sx[0] * sw[if sw.len() == 1 { 0 } else { j }])
        .collect();
    Some(Plan {
        xq,
        zx,
        w: Tensor::from_vec(&[k, cols], w),
        scale: Tensor::from_vec(&[cols], scale),
        bias,
    })
}

fn rewrite(g: &mut Graph, n: NodeId, p: Plan) -> Result<()> {
    let node = g.remove_node(n).expect("a node of the order");
    let name = node.name.clone();
    let y = node.outputs[0];
    let w = add_const(g, &format!("{name}/weight_i8"), p.w);
    let mut ins = vec![Some(p.xq), Some(w), p.zx];
    if ins.last() == Some(&None) {
        ins.pop();
    }
    let v = g.fresh_name(&format!("{name}/product"));
    let acc = g.add_value(v, retyped(g, y, DType::I32), Source::Undefined);
    add_node_to(
        g,
        13,
        format!("{name}/product"),
        "MatMulInteger",
        &[],
        ins,
        vec![acc],
    )?;
    scale_back(g, &name, acc, y, p.scale, p.bias)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Attr;
    use crate::passes::testutil::*;

    /// x (f32, [2, 8]) -> QuantizeLinear -> DequantizeLinear into a Gemm with a bias by a
    /// constant i8 weight `[6, 8]` (transB) dequantized per output column, or into a
    /// MatMul by `[8, 6]` at one scale.
    fn qdq_product(gemm: bool) -> Graph {
        let mut t = Builder::new();
        let x = t.input("x", &[2, 8]);
        let sx = t.konst_t("sx", Tensor::scalar(0.02f32));
        let zx = t.konst_t("zx", Tensor::scalar(120u8));
        let xq = t.node_typed("QuantizeLinear", &[x, sx, zx], DType::U8, &[2, 8]);
        let xd = t.node_typed("DequantizeLinear", &[xq, sx, zx], DType::F32, &[2, 8]);
        let wv: Vec<i8> = (0..48)
            .map(|i| ((i * 37 % 255) as i64 - 127) as i8)
            .collect();
        let shape = if gemm { [6, 8] } else { [8, 6] };
        let wq = t.konst_t("wq", Tensor::from_vec(&shape, wv));
        let y = if gemm {
            let sw = t.konst("sw", &[6], vec![0.01, 0.02, 0.03, 0.04, 0.05, 0.06]);
            let zw = t.konst_t("zw", Tensor::from_vec(&[6], vec![0i8; 6]));
            let wd = t.node_attrs(
                "DequantizeLinear",
                &[wq, sw, zw],
                DType::F32,
                &[6, 8],
                &[("axis", Attr::Int(0))],
            );
            let b = t.konst("b", &[6], vec![0.5, -0.5, 1.0, 0.0, 2.0, -1.0]);
            t.node_attrs(
                "Gemm",
                &[xd, wd, b],
                DType::F32,
                &[2, 6],
                &[("transB", Attr::Int(1))],
            )
        } else {
            let sw = t.konst_t("sw", Tensor::scalar(0.03f32));
            let wd = t.node_typed("DequantizeLinear", &[wq, sw], DType::F32, &[8, 6]);
            t.node_typed("MatMul", &[xd, wd], DType::F32, &[2, 6])
        };
        t.finish(&[y])
    }

    #[test]
    fn a_dequantized_product_becomes_an_integer_product_scaled_back() {
        for gemm in [true, false] {
            let mut g = qdq_product(gemm);
            g.int8_dot = true;
            check_pass(&mut g, run);
            let ops = op_order(&g);
            assert!(ops.contains(&"MatMulInteger".to_string()), "{ops:?}");
            assert!(!ops.iter().any(|o| o == "Gemm" || o == "MatMul"), "{ops:?}");
        }
    }

    #[test]
    fn a_dequantized_product_stays_without_dot_products() {
        let mut g = qdq_product(true);
        check_pass(&mut g, run);
        assert!(op_order(&g).contains(&"Gemm".to_string()));
    }
}
