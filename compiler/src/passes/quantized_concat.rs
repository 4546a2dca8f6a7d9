//! `QuantizeLinear(Concat(DequantizeLinear(x_i, s_i, z_i)...), s, z)` (a quantized
//! concatenation: ONNX Runtime's QLinearConcat imported, or the QDQ format's Concat)
//! becomes the Concat of the 8-bit parts: `x_i` itself where `(s_i, z_i)` is `(s, z)`,
//! else `QuantizeLinear(DequantizeLinear(x_i), s, z)`, that part requantized alone.
//!
//! Exact: QuantizeLinear is elementwise with one scale and zero point, so it commutes
//! with the Concat; and with the same scale and zero point, quantizing a dequantized
//! value gives it back: `(q - z) s / s` is within a few ulp of the integer `q - z` (at
//! most 255 in magnitude; with `s` a normal positive f32, `(q - z) s` is normal or
//! zero), which rounds to it. The concatenation then moves bytes, not f32 values, and
//! the parts of the output's own scale are copied without arithmetic (in QOperator
//! SqueezeNet 1.1 each fire module's concat has one such part).

use super::util::{
    dtype_of, is_op, new_node, per_tensor_quant, producer, retyped, rewrite_planned, same_const,
    same_zero_point, sole_reader,
};
use crate::error::Result;
use crate::ir::{DType, Graph, NodeId, Source, ValueId};

pub fn run(g: &mut Graph) -> Result<()> {
    rewrite_planned(g, plan, rewrite)
}

/// One input of the Concat: the 8-bit value itself, or the dequantized value to quantize
/// with the output's scale and zero point.
enum Part {
    Same(ValueId),
    Requantized(ValueId),
}

struct Plan {
    /// The QuantizeLinear after the Concat.
    q: NodeId,
    parts: Vec<Part>,
}

fn plan(g: &Graph, n: NodeId) -> Option<Plan> {
    if !is_op(g, n, "Concat") || g.nodes[n].outputs.len() != 1 {
        return None;
    }
    let q = sole_reader(g, g.nodes[n].outputs[0])?;
    let (_, sy, zy) = per_tensor_quant(g, q, "QuantizeLinear")?;
    let dt = dtype_of(g, *g.nodes[q].outputs.first()?)?;
    if !matches!(dt, DType::U8 | DType::I8) || g.const_of(sy)?.dtype() != DType::F32 {
        return None;
    }
    let s = g.const_of(sy)?.to_f64()?.iter().next().copied()? as f32;
    if !(s.is_normal() && s > 0.0 && (255.0 * s).is_finite()) {
        return None;
    }
    let mut parts = Vec::new();
    for v in g.nodes[n].inputs.iter() {
        let v = (*v)?;
        let (xq, sx, zx) = per_tensor_quant(g, producer(g, v)?, "DequantizeLinear")?;
        let zeros = same_zero_point(g, zx, zy);
        parts.push(
            if dtype_of(g, xq) == Some(dt) && same_const(g, sx, sy) && zeros {
                Part::Same(xq)
            } else {
                Part::Requantized(v)
            },
        );
    }
    Some(Plan { q, parts })
}

fn rewrite(g: &mut Graph, n: NodeId, plan: Plan) -> Result<()> {
    let quant = g.remove_node(plan.q).expect("planned");
    let cat = g.remove_node(n).expect("a node of the order");
    let qo = quant.outputs[0];
    let dt = dtype_of(g, qo).expect("planned");
    let mut inputs = Vec::new();
    for (i, part) in plan.parts.into_iter().enumerate() {
        let v = match part {
            Part::Same(x) => x,
            Part::Requantized(v) => {
                let name = format!("{}/part{i}_quantized", cat.name);
                let ty = retyped(g, v, dt);
                let fresh = g.fresh_name(&name);
                let out = g.add_value(fresh, ty, Source::Undefined);
                let mut ins = vec![Some(v)];
                ins.extend(quant.inputs[1..].iter().copied());
                g.add_node(new_node(
                    name,
                    "QuantizeLinear",
                    quant.attrs.clone(),
                    quant.opset,
                    ins,
                    vec![out],
                )?);
                out
            }
        };
        inputs.push(Some(v));
    }
    g.add_node(new_node(
        cat.name.clone(),
        "Concat",
        cat.attrs.clone(),
        cat.opset,
        inputs,
        vec![qo],
    )?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, Tensor};
    use crate::passes::testutil::*;

    /// Two u8 tensors dequantized (scale 0.05 / zero point 120, and `s1` / `z1`),
    /// concatenated on axis 1, quantized with 0.05 / 120; and the first's 8-bit value.
    fn qdq_concat(s1: f32, z1: u8) -> (Graph, ValueId) {
        let mut t = Builder::new();
        let a = t.input("a", &[1, 4, 3, 3]);
        let b = t.input("b", &[1, 2, 3, 3]);
        let s = t.konst_t("s", Tensor::scalar(0.05f32));
        let z = t.konst_t("z", Tensor::scalar(120u8));
        let s1 = t.konst_t("s1", Tensor::scalar(s1));
        let z1 = t.konst_t("z1", Tensor::scalar(z1));
        let aq = t.node_typed("QuantizeLinear", &[a, s, z], DType::U8, &[1, 4, 3, 3]);
        let bq = t.node_typed("QuantizeLinear", &[b, s1, z1], DType::U8, &[1, 2, 3, 3]);
        let ad = t.node("DequantizeLinear", &[aq, s, z], &[1, 4, 3, 3]);
        let bd = t.node("DequantizeLinear", &[bq, s1, z1], &[1, 2, 3, 3]);
        let c = t.node_attrs(
            "Concat",
            &[ad, bd],
            DType::F32,
            &[1, 6, 3, 3],
            &[("axis", Attr::Int(1))],
        );
        let y = t.node_typed("QuantizeLinear", &[c, s, z], DType::U8, &[1, 6, 3, 3]);
        (t.finish(&[y]), aq)
    }

    fn concat(g: &Graph) -> &crate::ir::Node {
        let cat = g.nodes.node_weights().find(|n| n.op_type == "Concat");
        cat.expect("a Concat")
    }

    #[test]
    fn a_concat_between_quantizations_concatenates_the_bytes() {
        let (mut g, aq) = qdq_concat(0.02, 100);
        check_pass(&mut g, run);
        // Part 0 has the output's scale and zero point: its bytes as they are; part 1
        // requantized from its dequantized value.
        let cat = concat(&g);
        assert_eq!(cat.inputs[0], Some(aq));
        let p1 = producer(&g, cat.inputs[1].unwrap()).unwrap();
        assert_eq!(g.nodes[p1].op_type, "QuantizeLinear");
        let d1 = producer(&g, g.nodes[p1].inputs[0].unwrap()).unwrap();
        assert_eq!(g.nodes[d1].op_type, "DequantizeLinear");
        assert_eq!(g.value(cat.outputs[0]).ty.dtype(), Some(DType::U8));
    }

    #[test]
    fn a_subnormal_scale_keeps_the_f32_concat() {
        let (mut g, _) = qdq_concat(0.02, 100);
        let s = g.find("s").unwrap();
        g.consts.insert(s, Tensor::scalar(1e-40f32));
        check_pass(&mut g, run);
        let cat = concat(&g);
        assert_eq!(g.value(cat.outputs[0]).ty.dtype(), Some(DType::F32));
    }
}
