//! MatMulInteger by a constant weight runs on the f32 GEMM when f32 computes it exactly:
//! `Cast(A) - Cast(a_zero_point)` times the weight less its zero point (converted at
//! compile time), cast back to int32. Every term `(a - za) (b - zb)` is an integer, and
//! while every partial sum stays within 2^24 (checked from the weight: 255 times the
//! largest column sum of `|b - zb|`) f32 holds each exactly, whatever the order of the
//! sums, so the result is the int32 product bit for bit. Without this the product ran as
//! a scalar loop nest: 128 x 768 by 768 x 768 took 134 ms, ONNX Runtime 0.1 ms (its
//! int8 kernels). The dynamic quantization of transformers (DynamicQuantizeLinear, then
//! MatMulInteger by int8 weights) makes such products.
//!
//! QLinearMatMul (static quantization's product) takes the same exact product, then
//! requantizes it as the reference does, in f64: `Round(c * factor + y_zero_point)`
//! clipped to the output type, `factor` = `a_scale * b_scale / y_scale` rounded to the
//! scales' dtype after each operation (computed here), so that the output is the
//! reference's bit for bit. Its scales and zero points must be constants (A's zero
//! point aside), one value each or one per column of B.

use super::inline_util::add_node_to;
use super::util::{add_const, dtype_of, order, retyped, shape_of};
use crate::error::Result;
use crate::ir::{Attr, DType, Graph, NodeId, Source, Tensor, ValueId, ValueType};
use crate::ops::util::round_to;
use ndarray::{ArrayD, IxDyn};

/// Largest `|a - za|` of 8-bit operands.
const A_MAX: f64 = 255.0;
/// Integers f32 holds exactly.
const EXACT: f64 = (1u64 << 24) as f64;

pub fn run(g: &mut Graph) -> Result<()> {
    for n in order(g)? {
        if !g.nodes.contains_node(n) {
            continue;
        }
        if let Some(plan) = plan(g, n) {
            widen(g, n, plan)?;
        }
    }
    g.rewire();
    Ok(())
}

/// How a qualifying node is rewritten.
struct Plan {
    /// The weight less its zero point, f32 `[K, N]`.
    w: Tensor,
    /// QLinearMatMul's requantization.
    requant: Option<Requant>,
}

/// `clip(round(c * factor + zp), lo, hi)` as `dt`, in f64.
struct Requant {
    /// One value, or one per column (`[N]`).
    factor: Tensor,
    zp: f64,
    lo: f64,
    hi: f64,
    dt: DType,
}

/// A constant's values as f64, when it has one value or `n` along its one axis.
fn per_column(g: &Graph, v: ValueId, n: usize) -> Option<Vec<f64>> {
    let t = g.const_of(v)?;
    let x = t.to_f64()?.iter().copied().collect::<Vec<f64>>();
    match x.len() {
        1 => Some(x),
        l if l == n && t.rank() == 1 => Some(x),
        _ => None,
    }
}

/// For a MatMulInteger or QLinearMatMul that qualifies, its rewrite.
fn plan(g: &Graph, n: NodeId) -> Option<Plan> {
    let node = &g.nodes[n];
    let q = match node.op_type.as_str() {
        "MatMulInteger" => false,
        "QLinearMatMul" => true,
        _ => return None,
    };
    if !node.domain.is_empty() || node.outputs.len() != 1 {
        return None;
    }
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    // (A, A's zero point, B, B's zero point)
    let (a, za, b, zb) = if q {
        (input(0)?, input(2), input(3)?, input(5))
    } else {
        (input(0)?, input(2), input(1)?, input(3))
    };
    let y = node.outputs[0];
    let eight = |v: ValueId| matches!(dtype_of(g, v), Some(DType::U8 | DType::I8));
    if !eight(a) || !eight(b) || shape_of(g, a)?.len() < 2 || shape_of(g, y).is_none() {
        return None;
    }
    if !q && dtype_of(g, y) != Some(DType::I32) {
        return None;
    }
    // A's zero point: one value (constant or not) of A's dtype.
    if let Some(za) = za {
        if dtype_of(g, za) != dtype_of(g, a) || shape_of(g, za)?.iter().product::<usize>() != 1 {
            return None;
        }
    }
    let bt = g.const_of(b)?;
    let (k, nn) = match bt.shape() {
        &[k, nn] => (k, nn),
        _ => return None,
    };
    let zb = match zb {
        None => vec![0.0],
        Some(z) if dtype_of(g, z) == Some(bt.dtype()) => per_column(g, z, nn)?,
        Some(_) => return None,
    };
    // 8-bit integers and their differences are exact in f64 and f32.
    let bv = bt.to_f64()?;
    let mut w = vec![0f32; k * nn];
    let mut colsum = vec![0f64; nn];
    for p in 0..k {
        for j in 0..nn {
            let d = bv[[p, j]] - zb[if zb.len() == 1 { 0 } else { j }];
            w[p * nn + j] = d as f32;
            colsum[j] += d.abs();
        }
    }
    let worst = colsum.iter().copied().fold(0.0, f64::max);
    if A_MAX * worst > EXACT {
        return None;
    }
    let requant = if q {
        let sa = per_column(g, input(1)?, 1)?[0];
        let sb = per_column(g, input(4)?, nn)?;
        let ys = input(6)?;
        let sy = per_column(g, ys, 1)?[0];
        // As the reference: each operation rounded to the scales' dtype.
        let sdt = dtype_of(g, ys)?;
        let shape: &[usize] = if sb.len() == 1 { &[] } else { &[nn] };
        let sb = ArrayD::from_shape_vec(IxDyn(shape), sb).ok()?;
        let factor = round_to(sdt, round_to(sdt, sb * sa) / sy);
        let factor = Tensor::from_array(factor);
        let (dt, zp) = match input(7) {
            Some(z) => (g.const_of(z)?.dtype(), per_column(g, z, 1)?[0]),
            None => (dtype_of(g, a)?, 0.0),
        };
        if dtype_of(g, y) != Some(dt) {
            return None;
        }
        let (lo, hi) = dt.int_range()?;
        Some(Requant {
            factor,
            zp,
            lo: lo as f64,
            hi: hi as f64,
            dt,
        })
    } else {
        None
    };
    Some(Plan {
        w: Tensor::from_vec(&[k, nn], w),
        requant,
    })
}

/// Adds `op(inputs) -> out` (opset 13: every op used here has its current form there).
fn add(
    g: &mut Graph,
    name: String,
    op: &str,
    attrs: &[(&str, Attr)],
    inputs: &[ValueId],
    out: ValueId,
) -> Result<()> {
    let ins = inputs.iter().map(|&v| Some(v)).collect();
    add_node_to(g, 13, name, op, attrs, ins, vec![out])
}

fn widen(g: &mut Graph, n: NodeId, plan: Plan) -> Result<()> {
    let node = g.remove_node(n).expect("a node of the order");
    let name = node.name.clone();
    let a = node.inputs[0].expect("checked");
    let y = node.outputs[0];
    let f32c = Attr::Int(i64::from(DType::F32.onnx_code()));
    let value = |g: &mut Graph, base: &str, ty: ValueType| {
        let v = g.fresh_name(base);
        g.add_value(v, ty, Source::Undefined)
    };
    let ty = retyped(g, a, DType::F32);
    let mut a32 = value(g, &format!("{name}/a_f32"), ty.clone());
    add(
        g,
        format!("{name}/a_f32"),
        "Cast",
        &[("to", f32c.clone())],
        &[a],
        a32,
    )?;
    if let Some(za) = node.inputs.get(2).copied().flatten() {
        let zty = retyped(g, za, DType::F32);
        let z32 = value(g, &format!("{name}/a_zero_f32"), zty);
        add(
            g,
            format!("{name}/a_zero_f32"),
            "Cast",
            &[("to", f32c)],
            &[za],
            z32,
        )?;
        let d = value(g, &format!("{name}/a_less_zero"), ty);
        add(g, format!("{name}/a_less_zero"), "Sub", &[], &[a32, z32], d)?;
        a32 = d;
    }
    let wv = add_const(g, &format!("{name}/b_f32"), plan.w);
    let p = value(g, &format!("{name}/product"), retyped(g, y, DType::F32));
    add(g, format!("{name}/product"), "MatMul", &[], &[a32, wv], p)?;
    let Some(rq) = plan.requant else {
        let i32c = Attr::Int(i64::from(DType::I32.onnx_code()));
        return add(
            g,
            format!("{name}/to_i32"),
            "Cast",
            &[("to", i32c)],
            &[p],
            y,
        );
    };
    // The reference's requantization, in f64.
    let f64t = retyped(g, y, DType::F64);
    let step = |g: &mut Graph, what: &str, op: &str, attrs: &[(&str, Attr)], ins: &[ValueId]| {
        let v = value(g, &format!("{name}/{what}"), f64t.clone());
        add(g, format!("{name}/{what}"), op, attrs, ins, v).map(|()| v)
    };
    let f64c = Attr::Int(i64::from(DType::F64.onnx_code()));
    let c = step(g, "product_f64", "Cast", &[("to", f64c)], &[p])?;
    let factor = add_const(g, &format!("{name}/factor"), rq.factor);
    let c = step(g, "scaled", "Mul", &[], &[c, factor])?;
    let zp = add_const(g, &format!("{name}/y_zero_f64"), Tensor::scalar(rq.zp));
    let c = step(g, "shifted", "Add", &[], &[c, zp])?;
    let c = step(g, "rounded", "Round", &[], &[c])?;
    let lo = add_const(g, &format!("{name}/lo"), Tensor::scalar(rq.lo));
    let hi = add_const(g, &format!("{name}/hi"), Tensor::scalar(rq.hi));
    let c = step(g, "clipped", "Clip", &[], &[c, lo, hi])?;
    let to = Attr::Int(i64::from(rq.dt.onnx_code()));
    add(
        g,
        format!("{name}/to_output"),
        "Cast",
        &[("to", to)],
        &[c],
        y,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;

    fn product(b: Vec<i8>, zb: i8) -> Graph {
        let mut t = Builder::new();
        let a = t.input_typed("a", DType::U8, &[3, 4]);
        let za = t.input_typed("za", DType::U8, &[]);
        let w = t.konst_t("b", Tensor::from_vec(&[4, 2], b));
        let z = t.konst_t("zb", Tensor::from_vec(&[1], vec![zb]));
        let y = t.node_typed("MatMulInteger", &[a, w, za, z], DType::I32, &[3, 2]);
        t.finish(&[y])
    }

    #[test]
    fn an_exact_integer_product_runs_in_f32() {
        let mut g = product(vec![-128, 127, 5, -7, 0, 1, 100, -100], 3);
        check_pass(&mut g, run);
        let ops: Vec<String> = order(&g)
            .unwrap()
            .into_iter()
            .map(|n| g.nodes[n].op_type.clone())
            .collect();
        assert!(ops.contains(&"MatMul".to_string()), "{ops:?}");
        assert!(!ops.contains(&"MatMulInteger".to_string()), "{ops:?}");
    }

    #[test]
    fn a_product_past_f32s_integers_stays() {
        // 255 * (K = 4) * 128 is far below 2^24; a weight of K = 600 columns of
        // |b - zb| = 255 is not (255 * 600 * 255 > 2^24).
        let mut t = Builder::new();
        let a = t.input_typed("a", DType::U8, &[2, 600]);
        let w = t.konst_t("b", Tensor::from_vec(&[600, 1], vec![-128i8; 600]));
        let z = t.konst_t("zb", Tensor::from_vec(&[1], vec![127i8]));
        let za = t.input_typed("za", DType::U8, &[]);
        let y = t.node_typed("MatMulInteger", &[a, w, za, z], DType::I32, &[2, 1]);
        let mut g = t.finish(&[y]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 1);
    }
}
