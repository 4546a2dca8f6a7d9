//! Convs of dequantized tensors (the QDQ format: `DequantizeLinear(x_q)` and
//! `DequantizeLinear(w_q)` into an f32 Conv) on targets with 8-bit dot products
//! ([`Graph::int8_dot`]): the conv of the quantized values themselves, exact in i32, then
//! scaled back, `y = f32(ConvInteger(x_q, w_q, zx, zw)) * (sx * sw) + b`. `widen_integer`
//! and the lowering put the ConvInteger on the 8-bit GEMM (`lower::gemm::conv_int8`).
//!
//! The reference computes the f32 conv of the dequantized values, whose sums round at
//! every step; this sum is exact and rounds once, in the scaling, so the two differ by
//! rounding only (the ConvInteger's sums cannot wrap: u8 by i8 over a conv's k stays far
//! inside i32 for any k below 2^16). Runs before `fold_constants`, which would fold the
//! weight's DequantizeLinear into f32 weights; on other targets it leaves the graph alone
//! (there the f32 conv is the faster form).

use super::inline_util::add_node_to;
use super::util::{
    add_const, dtype_of, is_op, producer, quant_operands, retyped, rewrite_planned, shape_of,
};
use crate::error::Result;
use crate::ir::{Attr, DType, Graph, NodeId, Source, Tensor, ValueId, ValueType};

pub fn run(g: &mut Graph) -> Result<()> {
    if !g.int8_dot {
        return Ok(());
    }
    rewrite_planned(g, plan, rewrite)
}

/// A qualifying conv's quantized operands and its scale per output channel.
struct Plan {
    xq: ValueId,
    zx: Option<ValueId>,
    wq: ValueId,
    zw: Option<ValueId>,
    /// `sx * sw` in f32, shaped to broadcast over the output's channels.
    scale: Tensor,
    bias: Option<ValueId>,
    /// The shape of per-channel values against the output: `[co, 1, ...]`.
    channels: Vec<usize>,
}

/// `v = DequantizeLinear(q, scale, zero_point)` of the default domain, not blocked:
/// (q, scale, zero point, axis).
pub(super) fn dequantized(
    g: &Graph,
    v: ValueId,
) -> Option<(ValueId, ValueId, Option<ValueId>, i64)> {
    quant_operands(g, producer(g, v)?, "DequantizeLinear")
}

/// `x = DequantizeLinear(xq u8, one scale, one u8 zero point or none)`: (xq, the
/// scale as a one-element list, the zero point).
pub(super) fn u8_per_tensor(g: &Graph, x: ValueId) -> Option<(ValueId, Vec<f32>, Option<ValueId>)> {
    let (xq, sx, zx, _) = dequantized(g, x)?;
    let sx = floats(g, sx)?;
    if dtype_of(g, xq)? != DType::U8 || sx.len() != 1 {
        return None;
    }
    if let Some(z) = zx {
        let t = g.const_of(z)?;
        if t.dtype() != DType::U8 || t.len() != 1 {
            return None;
        }
    }
    Some((xq, sx, zx))
}

/// The values of a constant f32 tensor.
pub(super) fn floats(g: &Graph, v: ValueId) -> Option<Vec<f32>> {
    let t = g.const_of(v)?;
    if t.dtype() != DType::F32 {
        return None;
    }
    Some(t.to_f64()?.iter().map(|&x| x as f32).collect())
}

fn plan(g: &Graph, n: NodeId) -> Option<Plan> {
    if !is_op(g, n, "Conv") {
        return None;
    }
    let node = &g.nodes[n];
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let (x, w, y) = (input(0)?, input(1)?, *node.outputs.first()?);
    if node.outputs.len() != 1 || node.attrs.int("group", 1).ok()? != 1 {
        return None;
    }
    let ws = shape_of(g, w)?;
    let ys = shape_of(g, y)?;
    if !(3..=4).contains(&ws.len()) || ys.len() != ws.len() || dtype_of(g, y)? != DType::F32 {
        return None;
    }
    // (Any channel count: the 3-channel 7x7 stride-2 stem of ResNet-18 takes 0.71 ms as
    // an 8-bit conv on AMX, 0.91 on VNNI, against 1.5 in f32, since strided convs copy
    // their taps from phase planes.)
    let co = ws[0];
    let (xq, sx, zx) = u8_per_tensor(g, x)?;
    // w: constant i8, one scale or one per output channel (axis 0), zero points to match.
    let (wq, sw, zw, axis) = dequantized(g, w)?;
    let wt = g.const_of(wq)?;
    let sw = floats(g, sw)?;
    if wt.dtype() != DType::I8 || !(sw.len() == 1 || (sw.len() == co && axis == 0)) {
        return None;
    }
    if let Some(z) = zw {
        let t = g.const_of(z)?;
        if t.dtype() != DType::I8 || t.len() != sw.len() {
            return None;
        }
    }
    let bias = input(2);
    if let Some(b) = bias {
        if dtype_of(g, b)? != DType::F32 || shape_of(g, b)? != [co] {
            return None;
        }
    }
    let mut shape = vec![co];
    shape.resize(ys.len() - 1, 1);
    let scale = (0..co)
        .map(|c| sx[0] * sw[if sw.len() == 1 { 0 } else { c }])
        .collect::<Vec<f32>>();
    Some(Plan {
        xq,
        zx,
        wq,
        zw,
        scale: Tensor::from_vec(&shape, scale),
        channels: shape,
        bias,
    })
}

fn rewrite(g: &mut Graph, n: NodeId, p: Plan) -> Result<()> {
    let node = g.remove_node(n).expect("a node of the order");
    let name = node.name.clone();
    let y = node.outputs[0];
    // The conv keeps its attributes (kernel, pads, strides, dilations, group 1).
    let attrs: Vec<(&str, Attr)> = node
        .attrs
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let mut ins = vec![Some(p.xq), Some(p.wq), p.zx, p.zw];
    while ins.last() == Some(&None) {
        ins.pop();
    }
    let acc = fresh(g, &name, "product", retyped(g, y, DType::I32));
    add_node_to(
        g,
        13,
        format!("{name}/product"),
        "ConvInteger",
        &attrs,
        ins,
        vec![acc],
    )?;
    // The bias [co] against the output's channels: [co, 1, ...].
    let bias = match p.bias {
        Some(b) => {
            let dims: Vec<i64> = p.channels.iter().map(|&d| d as i64).collect();
            let dims = Tensor::from_vec(&[dims.len()], dims);
            let dims = add_const(g, &format!("{name}/bias_shape"), dims);
            let br = fresh(g, &name, "bias", ValueType::tensor(DType::F32, &p.channels));
            let ins = vec![Some(b), Some(dims)];
            add_node_to(g, 13, format!("{name}/bias"), "Reshape", &[], ins, vec![br])?;
            Some(br)
        }
        None => None,
    };
    scale_back(g, &name, acc, y, p.scale, bias)
}

/// A new value `name/what` of type `ty`.
fn fresh(g: &mut Graph, name: &str, what: &str, ty: ValueType) -> ValueId {
    let v = g.fresh_name(&format!("{name}/{what}"));
    g.add_value(v, ty, Source::Undefined)
}

/// `y = f32(acc) * scale (+ bias)`: an exact integer product `acc` (i32, `y`'s shape)
/// scaled back, and the bias (shaped to broadcast against `y`) added; nodes named after
/// `name` (opset 13: every op used here has its current form there).
pub(super) fn scale_back(
    g: &mut Graph,
    name: &str,
    acc: ValueId,
    y: ValueId,
    scale: Tensor,
    bias: Option<ValueId>,
) -> Result<()> {
    let add = |g: &mut Graph, what: &str, op: &str, attrs: &[(&str, Attr)], ins, out| {
        add_node_to(g, 13, format!("{name}/{what}"), op, attrs, ins, vec![out])
    };
    let f32c = Attr::Int(i64::from(DType::F32.onnx_code()));
    let accf = fresh(g, name, "product_f32", retyped(g, y, DType::F32));
    add(
        g,
        "product_f32",
        "Cast",
        &[("to", f32c)],
        vec![Some(acc)],
        accf,
    )?;
    let scale = add_const(g, &format!("{name}/scale"), scale);
    let product = vec![Some(accf), Some(scale)];
    let Some(b) = bias else {
        return add(g, "scaled", "Mul", &[], product, y);
    };
    let scaled = fresh(g, name, "scaled", retyped(g, y, DType::F32));
    add(g, "scaled", "Mul", &[], product, scaled)?;
    add(g, "biased", "Add", &[], vec![Some(scaled), Some(b)], y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;

    /// x (f32) -> QuantizeLinear -> DequantizeLinear, and a constant weight (i8, or u8
    /// with `u8_weight`) dequantized per output channel, into a padded 3x3 Conv with a
    /// bias.
    fn qdq_conv(u8_weight: bool) -> Graph {
        let mut t = Builder::new();
        let x = t.input("x", &[1, 16, 6, 6]);
        let sx = t.konst_t("sx", Tensor::scalar(0.01f32));
        let zx = t.konst_t("zx", Tensor::scalar(100u8));
        let xq = t.node_typed("QuantizeLinear", &[x, sx, zx], DType::U8, &[1, 16, 6, 6]);
        let xd = t.node_typed(
            "DequantizeLinear",
            &[xq, sx, zx],
            DType::F32,
            &[1, 16, 6, 6],
        );
        let wv = (0..576).map(|i| (i * 37 % 255) as i64 - 127);
        let w = if u8_weight {
            Tensor::from_vec(
                &[4, 16, 3, 3],
                wv.map(|v| (v + 128) as u8).collect::<Vec<u8>>(),
            )
        } else {
            Tensor::from_vec(&[4, 16, 3, 3], wv.map(|v| v as i8).collect::<Vec<i8>>())
        };
        let wq = t.konst_t("wq", w);
        let sw = t.konst("sw", &[4], vec![0.01, 0.02, 0.03, 0.04]);
        let wd = t.node_attrs(
            "DequantizeLinear",
            &[wq, sw],
            DType::F32,
            &[4, 16, 3, 3],
            &[("axis", Attr::Int(0))],
        );
        let b = t.konst("b", &[4], vec![0.5, -0.5, 1.0, 0.0]);
        let y = t.node_attrs(
            "Conv",
            &[xd, wd, b],
            DType::F32,
            &[1, 4, 6, 6],
            &[("pads", Attr::Ints(vec![1; 4]))],
        );
        t.finish(&[y])
    }

    #[test]
    fn a_dequantized_conv_becomes_an_integer_conv_scaled_back() {
        let mut g = qdq_conv(false);
        g.int8_dot = true;
        check_pass(&mut g, run);
        let ops = op_order(&g);
        assert!(ops.contains(&"ConvInteger".to_string()), "{ops:?}");
        assert!(!ops.contains(&"Conv".to_string()), "{ops:?}");
        // The scale: sx * sw per output channel, against the output's channels.
        let mul = g
            .nodes
            .node_weights()
            .find(|n| n.op_type == "Mul")
            .expect("Mul");
        let scale = g
            .const_of(mul.inputs[1].expect("scale"))
            .expect("a constant");
        assert_eq!(scale.shape(), &[4, 1, 1]);
        let s: Vec<f64> = scale.to_f64().unwrap().iter().copied().collect();
        let want = [0.01f32 * 0.01, 0.01 * 0.02, 0.01 * 0.03, 0.01 * 0.04].map(f64::from);
        assert_eq!(s, want);
    }

    #[test]
    fn a_dequantized_conv_stays_without_dot_products_or_i8_weights() {
        let mut g = qdq_conv(false);
        check_pass(&mut g, run);
        assert!(op_order(&g).contains(&"Conv".to_string()));
        // u8 weights: the 8-bit GEMM multiplies u8 by i8.
        let mut g = qdq_conv(true);
        g.int8_dot = true;
        check_pass(&mut g, run);
        assert!(!op_order(&g).contains(&"ConvInteger".to_string()));
    }
}
