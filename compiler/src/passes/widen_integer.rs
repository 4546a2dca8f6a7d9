//! Products and convolutions of 8-bit integers by a constant weight run on the f32
//! kernels when f32 computes them exactly. MatMulInteger becomes `Cast(A) -
//! Cast(a_zero_point)` times the weight less its zero point (converted at compile time),
//! cast back to int32; ConvInteger the same with a Conv. Every term `(a - za) (b - zb)`
//! is an integer, and while every partial sum stays within 2^24 (checked from the
//! weight: the largest `|a - za|` times the largest sum of `|b - zb|` over one output
//! column or channel) f32 holds each exactly, whatever the order of the sums, so the
//! result is the int32 product bit for bit. The Conv is marked [`EXACT_SUMS`] so that
//! its lowering does not take Winograd (whose transforms round). A product whose sums
//! could pass 2^24 (a run-time zero point for A allows |a - za| up to 255) runs as f32
//! products over ranges of K that each stay within it, cast to int32 and summed there
//! (up to [`MOST_CHUNKS`] ranges: dynamically quantized BERT on AVX2, 762 -> 43 ms). On a
//! target with 8-bit dot products ([`Graph::int8_dot`]) a product of uint8 A by a weight
//! whose difference from its zero point fits int8 (k a multiple of 4) stays a
//! MatMulInteger by that difference, for the VNNI GEMM (`lower::gemm::matmul_int8`; a
//! conv likewise stays ConvInteger, `lower::gemm::conv_int8`). Zero padding of `x -
//! x_zero_point` is the reference's padding with the zero point. Without this the
//! product ran as a scalar loop nest: 128 x 768 by 768 x 768 took 134 ms, ONNX Runtime
//! 0.1 ms (its int8 kernels); a 64 -> 64 3x3 QLinearConv on 56x56, 134 ms. The dynamic
//! quantization of transformers (DynamicQuantizeLinear, then MatMulInteger by int8
//! weights) makes such products, static quantization QLinearConv and QLinearMatMul.
//!
//! QLinearMatMul and QLinearConv take the same exact product, then requantize it as the
//! reference does, in f64: `Round(c * factor + y_zero_point)` clipped to the output
//! type, where `c` includes QLinearConv's int32 bias and `factor` is `a_scale * b_scale
//! / y_scale` (QLinearMatMul: rounded to the scales' dtype after each operation, as its
//! reference does), computed here, so that the output is the reference's bit for bit.
//! Scales, zero points and bias must be constants (A's zero point aside), one value
//! each or one per column of B (output channel of the conv).

use super::inline_util::add_node_to;
use super::util::{add_const, dtype_of, retyped, rewrite_planned, shape_of};
use crate::error::Result;
use crate::ir::{Attr, DType, Graph, NodeId, Source, Tensor, ValueId, ValueType, EXACT_SUMS};
use crate::ops::util::round_to;
use ndarray::{ArrayD, IxDyn};

/// Integers f32 holds exactly.
const EXACT: f64 = (1u64 << 24) as f64;

pub fn run(g: &mut Graph) -> Result<()> {
    rewrite_planned(g, plan, widen)
}

/// How a qualifying node is rewritten.
struct Plan {
    /// Conv (else MatMul).
    conv: bool,
    /// The product stays in integers on a target with 8-bit dot products: a
    /// MatMulInteger of u8 A by this i8 weight (the weight less its zero point), which
    /// `lower::gemm::matmul_int8` runs; `w` is then unused.
    int8: Option<Tensor>,
    /// The weight less its zero point, f32, B's shape (`[K, N]`, or the conv's `[M, C/group,
    /// k...]`).
    w: Tensor,
    /// A product whose sums over the whole of K could pass 2^24: the ranges of K whose
    /// partial products stay within it, each an f32 MatMul cast to int32, summed in
    /// int32 (one range when the whole product is exact).
    chunks: Vec<(usize, usize)>,
    /// QLinearMatMul's or QLinearConv's requantization.
    requant: Option<Requant>,
}

/// `clip(round((c + bias) * factor + zp), lo, hi)` as `dt`, in f64.
struct Requant {
    /// QLinearConv's bias, `[M, 1...]` (or one value).
    bias: Option<Tensor>,
    /// One value, or one per column (`[N]`) or output channel (`[M, 1...]`).
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

/// Per-column (per-channel) values as an array that broadcasts against the output: `[]`
/// for one value, else `shape` (`[N]`, or `[M, 1...]` for a conv).
fn along(v: Vec<f64>, shape: &[usize]) -> Option<ArrayD<f64>> {
    let shape: &[usize] = if v.len() == 1 { &[] } else { shape };
    ArrayD::from_shape_vec(IxDyn(shape), v).ok()
}

/// The largest `|a - za|` for 8-bit A: from a constant zero point, else the dtype's span.
fn a_max(g: &Graph, a: ValueId, za: Option<ValueId>) -> Option<f64> {
    let (lo, hi) = dtype_of(g, a)?.int_range()?;
    let (lo, hi) = (lo as f64, hi as f64);
    let z = match za {
        None => 0.0,
        Some(z) => match g.const_of(z) {
            Some(t) => *t.to_f64()?.iter().next()?,
            None => return Some(hi - lo),
        },
    };
    Some((hi - z).max(z - lo))
}

/// For a MatMulInteger, QLinearMatMul, ConvInteger or QLinearConv that qualifies, its
/// rewrite.
fn plan(g: &Graph, n: NodeId) -> Option<Plan> {
    let node = &g.nodes[n];
    let (conv, q) = match node.op_type.as_str() {
        "MatMulInteger" => (false, false),
        "QLinearMatMul" => (false, true),
        "ConvInteger" => (true, false),
        "QLinearConv" => (true, true),
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
    let ys = shape_of(g, y)?;
    let ar = shape_of(g, a)?.len();
    if !eight(a) || !eight(b) || ar < 2 || (conv && (ar < 3 || ys.len() != ar)) {
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
    // Output columns (channels), and the weight's elements per step of them: element `i`
    // is in column `(i / per) % cols` (`[K, N]`: per 1; `[M, ...]`: per the rest).
    let bv = bt.to_f64()?;
    let (cols, per) = match (conv, bt.shape()) {
        (false, &[_, nn]) => (nn, 1),
        (true, s) if s.len() == ar && s[0] > 0 => (s[0], bv.len() / s[0]),
        _ => return None,
    };
    let zb = match zb {
        None => vec![0.0],
        Some(z) if dtype_of(g, z) == Some(bt.dtype()) => per_column(g, z, cols)?,
        Some(_) => return None,
    };
    // 8-bit integers and their differences are exact in f64 and f32.
    let mut w = Vec::with_capacity(bv.len());
    let mut colsum = vec![0f64; cols];
    for (i, &x) in bv.iter().enumerate() {
        let j = (i / per) % cols;
        let d = x - zb[if zb.len() == 1 { 0 } else { j }];
        w.push(d as f32);
        colsum[j] += d.abs();
    }
    // On a target with 8-bit dot products: u8 A by a weight that fits i8, k a multiple
    // of 4 (the kernel reads A four bytes at a time).
    // (A conv pads its channels to a multiple of 4 with zero weights; group 1, 1-D or
    // 2-D.)
    let int8_shape = match conv {
        false => bt.shape()[0].is_multiple_of(4),
        true => ar <= 4 && node.attrs.int("group", 1).ok() == Some(1),
    };
    let int8 = (g.int8_dot
        && int8_shape
        && dtype_of(g, a) == Some(DType::U8)
        && w.iter().all(|&x| (-128.0..=127.0).contains(&x)))
    .then(|| Tensor::from_vec(bt.shape(), w.iter().map(|&x| x as i8).collect::<Vec<i8>>()));
    let worst = colsum.iter().copied().fold(0.0, f64::max);
    let amax = a_max(g, a, za)?;
    let chunks = if int8.is_some() || amax * worst <= EXACT {
        vec![(0, bt.shape()[0])]
    } else if conv {
        return None;
    } else {
        exact_chunks(&w, cols, amax)?
    };
    // The shape per-column values take against the output.
    let mut col_shape = vec![cols];
    if conv {
        col_shape.resize(ar - 1, 1);
    }
    let requant = if q {
        let sa = per_column(g, input(1)?, 1)?[0];
        let sb = per_column(g, input(4)?, cols)?;
        let s_y = input(6)?;
        let sy = per_column(g, s_y, 1)?[0];
        let factor = if conv {
            // As the reference: in f64.
            along(sb.iter().map(|&s| sa * s / sy).collect(), &col_shape)?
        } else {
            // As the reference: each operation rounded to the scales' dtype.
            let sdt = dtype_of(g, s_y)?;
            round_to(sdt, round_to(sdt, along(sb, &col_shape)? * sa) / sy)
        };
        let bias = match input(8) {
            Some(bv) if conv => Some(Tensor::from_array(along(
                per_column(g, bv, cols)?,
                &col_shape,
            )?)),
            _ => None,
        };
        let (dt, zp) = match input(7) {
            Some(z) => (g.const_of(z)?.dtype(), per_column(g, z, 1)?[0]),
            None => (dtype_of(g, a)?, 0.0),
        };
        if dtype_of(g, y) != Some(dt) {
            return None;
        }
        let (lo, hi) = dt.int_range()?;
        Some(Requant {
            bias,
            factor: Tensor::from_array(factor),
            zp,
            lo: lo as f64,
            hi: hi as f64,
            dt,
        })
    } else {
        None
    };
    Some(Plan {
        conv,
        int8,
        chunks,
        w: Tensor::from_vec(bt.shape(), w),
        requant,
    })
}

/// Most ranges of K a product is cut into (see [`exact_chunks`]); past it the product
/// stays an integer loop nest.
const MOST_CHUNKS: usize = 16;

/// Consecutive ranges of the rows of `w` (`[K, cols]`, row-major) over which every
/// column's sum of `|w|` times `amax` stays within 2^24, each as long as it can be.
fn exact_chunks(w: &[f32], cols: usize, amax: f64) -> Option<Vec<(usize, usize)>> {
    let k = w.len() / cols.max(1);
    let mut chunks = Vec::new();
    let mut sums = vec![0f64; cols];
    let mut start = 0;
    for p in 0..k {
        let row = &w[p * cols..(p + 1) * cols];
        let over = sums
            .iter()
            .zip(row)
            .any(|(s, x)| (s + x.abs() as f64) * amax > EXACT);
        if over {
            chunks.push((start, p));
            start = p;
            sums.iter_mut().for_each(|s| *s = 0.0);
        }
        sums.iter_mut()
            .zip(row)
            .for_each(|(s, x)| *s += x.abs() as f64);
    }
    chunks.push((start, k));
    (chunks.len() <= MOST_CHUNKS && chunks.iter().all(|(a, b)| a < b)).then_some(chunks)
}

/// A new value named after `base`, made by the node the caller adds next.
fn value(g: &mut Graph, base: &str, ty: ValueType) -> ValueId {
    let v = g.fresh_name(base);
    g.add_value(v, ty, Source::Undefined)
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
    let za = node.inputs.get(2).copied().flatten();
    if let Some(w8) = plan.int8 {
        let wv = add_const(g, &format!("{name}/b_i8"), w8);
        let mut ins = vec![a, wv];
        ins.extend(za);
        // A conv keeps its attributes (group, kernel, pads, strides, dilations).
        let (op, attrs): (&str, Vec<(&str, Attr)>) = if plan.conv {
            let attrs = node.attrs.iter().map(|(k, v)| (k.as_str(), v.clone()));
            ("ConvInteger", attrs.collect())
        } else {
            ("MatMulInteger", vec![])
        };
        let Some(rq) = plan.requant else {
            return add(g, format!("{name}/product"), op, &attrs, &ins, y);
        };
        let p = value(g, &format!("{name}/product"), retyped(g, y, DType::I32));
        add(g, format!("{name}/product"), op, &attrs, &ins, p)?;
        return requantize(g, &name, p, y, &rq);
    }
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
    if let Some(za) = za {
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
    if plan.chunks.len() > 1 {
        return chunked(g, &name, a32, y, &plan);
    }
    let wv = add_const(g, &format!("{name}/b_f32"), plan.w);
    let p = value(g, &format!("{name}/product"), retyped(g, y, DType::F32));
    if plan.conv {
        // The conv's own attributes (group, kernel, pads, strides, dilations).
        let mut attrs: Vec<(&str, Attr)> = node
            .attrs
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        attrs.push((EXACT_SUMS, Attr::Int(1)));
        add(g, format!("{name}/product"), "Conv", &attrs, &[a32, wv], p)?;
    } else {
        add(g, format!("{name}/product"), "MatMul", &[], &[a32, wv], p)?;
    }
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
    requantize(g, &name, p, y, &rq)
}

/// A product over `plan.chunks` of K: each range's f32 MatMul (exact) cast to int32, the
/// parts summed in int32 (as the reference's int32 sum, whose order does not matter),
/// then requantized if the node was a QLinearMatMul.
fn chunked(g: &mut Graph, name: &str, a32: ValueId, y: ValueId, plan: &Plan) -> Result<()> {
    let ashape = shape_of(g, a32).expect("planned on a static shape");
    let axis = ashape.len() - 1;
    let n = plan.w.shape()[1];
    let w = plan.w.array::<f32>().expect("an f32 weight");
    let w = w.as_slice().expect("a standard layout");
    let i32c = Attr::Int(i64::from(DType::I32.onnx_code()));
    let mut parts = Vec::new();
    for (c, &(k0, k1)) in plan.chunks.iter().enumerate() {
        let i64s = |x: usize| Tensor::from_vec(&[1], vec![x as i64]);
        let st = add_const(g, &format!("{name}/k{c}_start"), i64s(k0));
        let en = add_const(g, &format!("{name}/k{c}_end"), i64s(k1));
        let ax = add_const(g, &format!("{name}/k{c}_axis"), i64s(axis));
        let mut sh = ashape.clone();
        sh[axis] = k1 - k0;
        let ac = value(
            g,
            &format!("{name}/a_k{c}"),
            ValueType::tensor(DType::F32, &sh),
        );
        add(
            g,
            format!("{name}/a_k{c}"),
            "Slice",
            &[],
            &[a32, st, en, ax],
            ac,
        )?;
        let wk = w[k0 * n..k1 * n].to_vec();
        let wc = add_const(
            g,
            &format!("{name}/b_f32_k{c}"),
            Tensor::from_vec(&[k1 - k0, n], wk),
        );
        let pc = value(
            g,
            &format!("{name}/product_k{c}"),
            retyped(g, y, DType::F32),
        );
        add(
            g,
            format!("{name}/product_k{c}"),
            "MatMul",
            &[],
            &[ac, wc],
            pc,
        )?;
        let ic = value(
            g,
            &format!("{name}/product_k{c}_i32"),
            retyped(g, y, DType::I32),
        );
        let to = [("to", i32c.clone())];
        add(
            g,
            format!("{name}/product_k{c}_i32"),
            "Cast",
            &to,
            &[pc],
            ic,
        )?;
        parts.push(ic);
    }
    let last = parts.len() - 1;
    let mut sum = parts[0];
    for (c, &part) in parts.iter().enumerate().skip(1) {
        let out = match (c == last, &plan.requant) {
            (true, None) => y,
            _ => value(g, &format!("{name}/sum_k{c}"), retyped(g, y, DType::I32)),
        };
        add(g, format!("{name}/sum_k{c}"), "Add", &[], &[sum, part], out)?;
        sum = out;
    }
    match &plan.requant {
        None => Ok(()),
        Some(rq) => requantize(g, name, sum, y, rq),
    }
}

/// `y = rq(p)`: the reference's requantization of the product `p`, in f64.
fn requantize(g: &mut Graph, name: &str, p: ValueId, y: ValueId, rq: &Requant) -> Result<()> {
    let f64t = retyped(g, y, DType::F64);
    let step = |g: &mut Graph, what: &str, op: &str, attrs: &[(&str, Attr)], ins: &[ValueId]| {
        let v = value(g, &format!("{name}/{what}"), f64t.clone());
        add(g, format!("{name}/{what}"), op, attrs, ins, v).map(|()| v)
    };
    let f64c = Attr::Int(i64::from(DType::F64.onnx_code()));
    let mut c = step(g, "product_f64", "Cast", &[("to", f64c)], &[p])?;
    if let Some(b) = rq.bias.clone() {
        let b = add_const(g, &format!("{name}/bias_f64"), b);
        c = step(g, "biased", "Add", &[], &[c, b])?;
    }
    let factor = add_const(g, &format!("{name}/factor"), rq.factor.clone());
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
    use crate::passes::util::order;

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
    fn with_dot_products_a_weight_that_fits_i8_stays_integer() {
        let ops = |g: &Graph| -> Vec<String> {
            let o = order(g).unwrap();
            o.into_iter().map(|n| g.nodes[n].op_type.clone()).collect()
        };
        // b - zb in [-128, 127]: MatMulInteger by the i8 difference, without zb.
        let mut g = product(vec![-125, 127, 5, -7, 0, 1, 100, -100], 3);
        g.int8_dot = true;
        check_pass(&mut g, run);
        assert_eq!(ops(&g), ["MatMulInteger"]);
        let n = g.nodes.node_weights().next().expect("a node");
        assert_eq!(n.inputs.len(), 3, "A, the weight, A's zero point; no zb");
        let w = g
            .const_of(n.inputs[1].expect("b"))
            .expect("a constant weight");
        assert_eq!(w.dtype(), DType::I8);
        assert_eq!(
            w.to_i64_vec().unwrap(),
            [-128, 124, 2, -10, -3, -2, 97, -103]
        );
        // -128 - 3 does not fit i8: the f32 GEMM.
        let mut g = product(vec![-128, 127, 5, -7, 0, 1, 100, -100], 3);
        g.int8_dot = true;
        check_pass(&mut g, run);
        assert!(ops(&g).contains(&"MatMul".to_string()), "{:?}", ops(&g));
        // A conv of group 1 stays ConvInteger with its attributes; of group 2, f32.
        for (group, want) in [(1, "ConvInteger"), (2, "Conv")] {
            let mut t = Builder::new();
            let x = t.input_typed("x", DType::U8, &[1, 2, 5, 5]);
            let w = t.konst_t(
                "w",
                Tensor::from_vec(&[2, 2 / group, 3, 3], vec![5i8; 36 / group]),
            );
            let attrs = [
                ("pads", Attr::Ints(vec![1; 4])),
                ("group", Attr::Int(group as i64)),
            ];
            let y = t.node_attrs("ConvInteger", &[x, w], DType::I32, &[1, 2, 5, 5], &attrs);
            let mut g = t.finish(&[y]);
            g.int8_dot = true;
            check_pass(&mut g, run);
            let conv = g
                .nodes
                .node_weights()
                .find(|n| n.op_type.starts_with("Conv"));
            let conv = conv.expect("a conv");
            assert_eq!(conv.op_type, want);
            assert_eq!(conv.attrs.get_ints("pads").unwrap(), Some(vec![1; 4]));
        }
    }

    #[test]
    fn a_product_past_f32s_integers_runs_in_exact_ranges_of_k() {
        // |b - zb| = 255 and |a - za| up to 255: 258 rows stay within 2^24, 259 do not.
        let w = vec![255f32; 600 * 2];
        assert_eq!(
            exact_chunks(&w, 2, 255.0),
            Some(vec![(0, 258), (258, 516), (516, 600)])
        );
        let w = vec![255f32; 258 * MOST_CHUNKS + 1];
        assert_eq!(exact_chunks(&w, 1, 255.0), None);
        let mut t = Builder::new();
        let a = t.input_typed("a", DType::U8, &[2, 600]);
        let w = t.konst_t("b", Tensor::from_vec(&[600, 1], vec![-128i8; 600]));
        let z = t.konst_t("zb", Tensor::from_vec(&[1], vec![127i8]));
        let za = t.input_typed("za", DType::U8, &[]);
        let y = t.node_typed("MatMulInteger", &[a, w, za, z], DType::I32, &[2, 1]);
        let mut g = t.finish(&[y]);
        check_pass(&mut g, run);
        let count = |op: &str| g.nodes.node_weights().filter(|n| n.op_type == op).count();
        assert_eq!((count("Slice"), count("MatMul"), count("Add")), (3, 3, 2));
        assert_eq!(count("MatMulInteger"), 0);
    }

    #[test]
    fn a_product_past_f32s_integers_stays() {
        // 255 * (K = 4) * 128 is far below 2^24; a weight of K = 4200 rows of
        // |b - zb| = 255 needs more than MOST_CHUNKS ranges of 258 rows.
        let k = 4200;
        let mut t = Builder::new();
        let a = t.input_typed("a", DType::U8, &[2, k]);
        let w = t.konst_t("b", Tensor::from_vec(&[k, 1], vec![-128i8; k]));
        let z = t.konst_t("zb", Tensor::from_vec(&[1], vec![127i8]));
        let za = t.input_typed("za", DType::U8, &[]);
        let y = t.node_typed("MatMulInteger", &[a, w, za, z], DType::I32, &[2, 1]);
        let mut g = t.finish(&[y]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 1);
    }

    #[test]
    fn an_exact_conv_is_marked_and_written_without_the_mark() {
        let mut t = Builder::new();
        let x = t.input_typed("x", DType::U8, &[1, 2, 5, 5]);
        let w = t.konst_t("w", Tensor::from_vec(&[3, 2, 3, 3], vec![5i8; 54]));
        let z = t.konst_t("xz", Tensor::scalar(128u8));
        let pads = ("pads", Attr::Ints(vec![1; 4]));
        let y = t.node_attrs(
            "ConvInteger",
            &[x, w, z],
            DType::I32,
            &[1, 3, 5, 5],
            &[pads],
        );
        let mut g = t.finish(&[y]);
        check_pass(&mut g, run);
        let conv = g.nodes.node_weights().find(|n| n.op_type == "Conv");
        let conv = conv.expect("a Conv");
        assert_eq!(conv.attrs.int(EXACT_SUMS, 0).unwrap(), 1);
        assert_eq!(conv.attrs.get_ints("pads").unwrap(), Some(vec![1; 4]));
        // ONNX Runtime rejects attributes it does not know: `--emit onnx` drops the mark.
        let opsets = [(String::new(), 13)].into_iter().collect();
        let m = crate::emit::onnx::model_proto(&g, &opsets, 8);
        let graph = m.graph.expect("a graph");
        let conv = graph.node.iter().find(|n| n.op_type() == "Conv");
        let names: Vec<&str> = conv
            .expect("a Conv")
            .attribute
            .iter()
            .map(|a| a.name())
            .collect();
        assert_eq!(names, ["pads"]);
    }
}
