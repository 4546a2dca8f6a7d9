//! MatMulInteger by a constant weight runs on the f32 GEMM when f32 computes it exactly:
//! `Cast(A) - Cast(a_zero_point)` times the weight less its zero point (converted at
//! compile time), cast back to int32. Every term `(a - za) (b - zb)` is an integer, and
//! while every partial sum stays within 2^24 (checked from the weight: 255 times the
//! largest column sum of `|b - zb|`) f32 holds each exactly, whatever the order of the
//! sums, so the result is the int32 product bit for bit. Without this the product ran as
//! a scalar loop nest: 128 x 768 by 768 x 768 took 134 ms, ONNX Runtime 0.1 ms (its
//! int8 kernels). The dynamic quantization of transformers (DynamicQuantizeLinear, then
//! MatMulInteger by int8 weights) makes such products.

use super::util::{add_const, dtype_of, new_node, order, shape_of};
use crate::error::Result;
use crate::ir::{Attr, Attrs, DType, Graph, NodeId, Source, Tensor, ValueId, ValueType};

/// Largest `|a - za|` of 8-bit operands.
const A_MAX: f64 = 255.0;
/// Integers f32 holds exactly.
const EXACT: f64 = (1u64 << 24) as f64;

pub fn run(g: &mut Graph) -> Result<()> {
    for n in order(g)? {
        if !g.nodes.contains_node(n) {
            continue;
        }
        if let Some(b) = weight(g, n) {
            widen(g, n, b)?;
        }
    }
    g.rewire();
    Ok(())
}

/// For a MatMulInteger that qualifies, the weight less its zero point as f32 `[K, N]`.
fn weight(g: &Graph, n: NodeId) -> Option<Tensor> {
    let node = &g.nodes[n];
    if node.op_type != "MatMulInteger" || !node.domain.is_empty() || node.outputs.len() != 1 {
        return None;
    }
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let (a, b) = (input(0)?, input(1)?);
    let eight = |v: ValueId| matches!(dtype_of(g, v), Some(DType::U8 | DType::I8));
    if !eight(a) || !eight(b) || dtype_of(g, node.outputs[0]) != Some(DType::I32) {
        return None;
    }
    if shape_of(g, a)?.len() < 2 || shape_of(g, node.outputs[0]).is_none() {
        return None;
    }
    // A's zero point: one value (constant or not) of A's dtype.
    if let Some(za) = input(2) {
        if dtype_of(g, za) != dtype_of(g, a) || shape_of(g, za)?.iter().product::<usize>() != 1 {
            return None;
        }
    }
    let bt = g.const_of(b)?;
    let (k, nn) = match bt.shape() {
        &[k, nn] => (k, nn),
        _ => return None,
    };
    let bv = bt.to_i128()?;
    let zb: Vec<i128> = match input(3) {
        None => vec![0; nn],
        Some(z) => {
            let zt = g.const_of(z)?;
            if zt.dtype() != bt.dtype() {
                return None;
            }
            let z = zt.to_i128()?.iter().copied().collect::<Vec<_>>();
            match z.len() {
                1 => vec![z[0]; nn],
                l if l == nn && zt.rank() == 1 => z,
                _ => return None,
            }
        }
    };
    let mut w = vec![0f32; k * nn];
    let mut colsum = vec![0f64; nn];
    for p in 0..k {
        for j in 0..nn {
            let d = bv[[p, j]] - zb[j];
            w[p * nn + j] = d as f32;
            colsum[j] += (d as f64).abs();
        }
    }
    let worst = colsum.iter().copied().fold(0.0, f64::max);
    (A_MAX * worst <= EXACT).then(|| Tensor::from_vec(&[k, nn], w))
}

fn typed(g: &Graph, like: ValueId, dt: DType) -> ValueType {
    match &g.value(like).ty {
        ValueType::Tensor { shape, .. } => ValueType::Tensor {
            dt,
            shape: shape.clone(),
        },
        t => t.clone(),
    }
}

fn add(
    g: &mut Graph,
    name: String,
    op: &str,
    attrs: &[(&str, Attr)],
    inputs: &[ValueId],
    out: ValueId,
) -> Result<()> {
    let mut a = Attrs::default();
    for (k, v) in attrs {
        a.0.insert(k.to_string(), v.clone());
    }
    let node = new_node(
        name,
        op,
        a,
        13,
        inputs.iter().map(|&v| Some(v)).collect(),
        vec![out],
    )?;
    g.add_node(node);
    Ok(())
}

fn widen(g: &mut Graph, n: NodeId, w: Tensor) -> Result<()> {
    let node = g.remove_node(n).expect("a node of the order");
    let name = node.name.clone();
    let a = node.inputs[0].expect("checked");
    let y = node.outputs[0];
    let f32c = Attr::Int(i64::from(DType::F32.onnx_code()));
    let value = |g: &mut Graph, base: &str, ty: ValueType| {
        let v = g.fresh_name(base);
        g.add_value(v, ty, Source::Undefined)
    };
    let ty = typed(g, a, DType::F32);
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
        let zty = typed(g, za, DType::F32);
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
    let wv = add_const(g, &format!("{name}/b_f32"), w);
    let p = value(g, &format!("{name}/product"), typed(g, y, DType::F32));
    add(g, format!("{name}/product"), "MatMul", &[], &[a32, wv], p)?;
    let i32c = Attr::Int(i64::from(DType::I32.onnx_code()));
    add(
        g,
        format!("{name}/to_i32"),
        "Cast",
        &[("to", i32c)],
        &[p],
        y,
    )?;
    Ok(())
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
