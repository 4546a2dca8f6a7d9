//! attention ops: Attention (23+), RotaryEmbedding (23+), LinearAttention (27+) and
//! FlexAttention (ai.onnx.preview 1).
//!
//! Everything is computed in f64, rounding to the working dtype at the points where
//! ONNX's numpy reference rounds (so float16/bfloat16 results match it closely).

use super::util::{dims, f64s, input, ints, opt_input, outs};
use super::{OpCtx, Registry};
use crate::ir::{DType, Graph, Op, OpResult, SubgraphRunner, Tensor, Value};
use crate::{bail, ensure};
use half::{bf16, f16};
use ndarray::{Array2, Array4, ArrayD, ArrayView2, Axis, IxDyn};
use std::fmt;
use std::sync::Arc;

pub fn register(r: &mut Registry) {
    r.add("Attention", attention);
    r.add("RotaryEmbedding", rotary_embedding);
    r.add("LinearAttention", linear_attention);
    r.add_builder("ai.onnx.preview", "FlexAttention", flex_builder);
    lower::register(r);
}

// ---------------------------------------------------------------------------------
// Shared helpers

type Round = fn(f64) -> f64;

fn rnd_f32(x: f64) -> f64 {
    x as f32 as f64
}
fn rnd_f16(x: f64) -> f64 {
    f16::from_f64(x).to_f64()
}
fn rnd_bf16(x: f64) -> f64 {
    bf16::from_f64(x).to_f64()
}
fn rnd_none(x: f64) -> f64 {
    x
}

/// Rounding of an f64 to the nearest value of `dt`.
fn rounder(dt: DType) -> Round {
    match dt {
        DType::F32 => rnd_f32,
        DType::F16 => rnd_f16,
        DType::BF16 => rnd_bf16,
        _ => rnd_none,
    }
}

fn float_input<'a>(ins: &[Option<&'a Value>], i: usize, what: &str) -> OpResult<&'a Tensor> {
    let t = input(ins, i)?;
    ensure!(
        t.dtype().is_float(),
        "{what} must be a float tensor, got {}",
        t.dtype()
    );
    Ok(t)
}

/// A rank-4 view of an f64 tensor.
fn to4(a: ArrayD<f64>, what: &str) -> OpResult<Array4<f64>> {
    let s = a.shape().to_vec();
    a.into_dimensionality::<ndarray::Ix4>()
        .map_err(|_| crate::ir::OpError::new(format!("{what} must be rank 4, got shape {s:?}")))
}

/// (B, S, H*D) -> (B, H, S, D).
fn split_heads(a: ArrayD<f64>, heads: usize, what: &str) -> OpResult<Array4<f64>> {
    let s = a.shape().to_vec();
    ensure!(s.len() == 3, "{what} must be rank 3, got shape {s:?}");
    ensure!(heads > 0, "the number of heads for {what} must be positive");
    ensure!(
        s[2].is_multiple_of(heads),
        "{what}: hidden size {} is not divisible by {heads} heads",
        s[2]
    );
    let a = a
        .as_standard_layout()
        .into_owned()
        .into_shape_with_order(IxDyn(&[s[0], s[1], heads, s[2] / heads]))
        .map_err(|e| crate::ir::OpError::new(format!("{what}: {e}")))?;
    let a = to4(a, what)?;
    Ok(a.permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned())
}

/// (B, H, S, D) -> (B, S, H*D).
fn merge_heads(a: Array4<f64>) -> OpResult<ArrayD<f64>> {
    let (b, h, s, d) = a.dim();
    let a = a
        .permuted_axes([0, 2, 1, 3])
        .as_standard_layout()
        .into_owned();
    a.into_dyn()
        .into_shape_with_order(IxDyn(&[b, s, h * d]))
        .map_err(|e| crate::ir::OpError::new(format!("{e}")))
}

/// a @ b with each product rounded by `r`.
fn mm(a: ArrayView2<f64>, b: ArrayView2<f64>, r: Round) -> Array2<f64> {
    a.dot(&b).mapv(r)
}

/// NaN-propagating maximum (like `np.max`).
fn nan_max(v: impl Iterator<Item = f64>) -> f64 {
    let mut m = f64::NEG_INFINITY;
    for x in v {
        if x.is_nan() {
            return f64::NAN;
        }
        if x > m {
            m = x;
        }
    }
    m
}

/// Sum as numpy does it for `dt`: bfloat16 rounds each partial sum, the others round
/// once at the end.
fn sum_as(v: impl Iterator<Item = f64>, dt: DType, r: Round) -> f64 {
    if dt == DType::BF16 {
        v.fold(0.0, |acc, x| r(acc + x))
    } else {
        r(v.sum::<f64>())
    }
}

fn out_dtype(code: i64) -> OpResult<DType> {
    let dt = DType::from_onnx(code as i32)
        .ok_or_else(|| crate::ir::OpError::new(format!("unknown dtype code {code}")))?;
    ensure!(
        dt.is_float(),
        "softmax_precision must be a float type, got {dt}"
    );
    Ok(dt)
}

// ---------------------------------------------------------------------------------
// Attention

fn attention(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let qt = float_input(ins, 0, "Q")?;
    let kt = float_input(ins, 1, "K")?;
    let vt = float_input(ins, 2, "V")?;
    let mask_t = opt_input(ins, 3)?;
    let past_k_t = opt_input(ins, 4)?;
    let past_v_t = opt_input(ins, 5)?;
    let nonpad_t = opt_input(ins, 6)?;
    let dt = qt.dtype();
    let r = rounder(dt);
    let at = &ctx.attrs;
    ensure!(
        past_k_t.is_some() == past_v_t.is_some(),
        "past_key and past_value must be provided together"
    );
    ensure!(
        !(nonpad_t.is_some() && past_k_t.is_some()),
        "nonpad_kv_seqlen cannot be combined with past cache tensors"
    );
    let q_heads_attr = at.get_int("q_num_heads")?;
    let kv_heads_attr = at.get_int("kv_num_heads")?;
    let rank = qt.rank();
    ensure!(
        kt.rank() == rank && vt.rank() == rank,
        "Q, K and V must have the same rank, got {:?}, {:?}, {:?}",
        qt.shape(),
        kt.shape(),
        vt.shape()
    );
    ensure!(
        rank == 3 || rank == 4,
        "Q, K and V must be rank 3 or 4, got rank {rank}"
    );
    if ctx.opset >= 25 && rank == 4 {
        ensure!(
            q_heads_attr.is_none() && kv_heads_attr.is_none(),
            "q_num_heads and kv_num_heads must not be specified for 4D inputs"
        );
    }
    let (q, k, v) = if rank == 3 {
        let (Some(qh), Some(kvh)) = (q_heads_attr, kv_heads_attr) else {
            bail!("q_num_heads and kv_num_heads are required for 3D inputs");
        };
        ensure!(
            qh > 0 && kvh > 0,
            "q_num_heads and kv_num_heads must be positive"
        );
        (
            split_heads(f64s(qt)?, qh as usize, "Q")?,
            split_heads(f64s(kt)?, kvh as usize, "K")?,
            split_heads(f64s(vt)?, kvh as usize, "V")?,
        )
    } else {
        (
            to4(f64s(qt)?, "Q")?,
            to4(f64s(kt)?, "K")?,
            to4(f64s(vt)?, "V")?,
        )
    };
    let (bsz, hq, lq, dq) = q.dim();
    let (bk, hk, lk, dk) = k.dim();
    let (bv, hv, lv, dv) = v.dim();
    ensure!(
        bk == bsz && bv == bsz,
        "Q, K and V must share the batch size"
    );
    ensure!(dk == dq, "Q and K head sizes differ ({dq} vs {dk})");
    ensure!(hv == hk, "K and V must have the same number of heads");
    ensure!(lv == lk, "K and V must have the same sequence length");

    // Scale, applied as sqrt(scale) to both Q and K and rounded to the input dtype.
    let scale = match at.get_float("scale")? {
        Some(s) => s as f64,
        None => 1.0 / (dq as f64).sqrt(),
    };
    let sc = r(scale.sqrt());

    // Caches.
    let past_len = match past_k_t {
        Some(p) => p.shape().get(2).copied().unwrap_or(0),
        None => 0,
    };
    let (k, v) = match (past_k_t, past_v_t) {
        (Some(pk), Some(pv)) => {
            let pk = to4(f64s(pk)?, "past_key")?;
            let pv = to4(f64s(pv)?, "past_value")?;
            let (a, b, _, d) = pk.dim();
            ensure!(
                a == bsz && b == hk && d == dk,
                "past_key shape {:?} does not match K {:?}",
                pk.shape(),
                k.shape()
            );
            let (a, b, _, d) = pv.dim();
            ensure!(
                a == bsz && b == hv && d == dv,
                "past_value shape {:?} does not match V {:?}",
                pv.shape(),
                v.shape()
            );
            let k = ndarray::concatenate(Axis(2), &[pk.view(), k.view()])
                .map_err(|e| crate::ir::OpError::new(format!("{e}")))?;
            let v = ndarray::concatenate(Axis(2), &[pv.view(), v.view()])
                .map_err(|e| crate::ir::OpError::new(format!("{e}")))?;
            (k, v)
        }
        _ => (k, v),
    };
    let lkv = k.dim().2;

    let nonpad: Option<Vec<i64>> = match nonpad_t {
        Some(t) => {
            let n = ints(t)?;
            ensure!(
                n.len() == bsz,
                "nonpad_kv_seqlen must have batch_size ({bsz}) values, got {}",
                n.len()
            );
            Some(n)
        }
        None => None,
    };

    // The additive bias, materialised at (B, Hq, Lq, Lkv).
    let full = [bsz, hq, lq, lkv];
    dims(&full.iter().map(|&x| x as i64).collect::<Vec<_>>())?;
    let mut bias = Array4::<f64>::zeros(full);
    if let Some(m) = mask_t {
        let is_bool = m.dtype() == DType::Bool;
        let mut ma = f64s(m)?;
        if is_bool {
            ma.mapv_inplace(|x| if x != 0.0 { 0.0 } else { f64::NEG_INFINITY });
        }
        ensure!(
            ma.ndim() >= 1 && ma.ndim() <= 4,
            "attn_mask must have rank 1 to 4, got shape {:?}",
            ma.shape()
        );
        let last = ma.ndim() - 1;
        let mlen = ma.shape()[last];
        if mlen < lkv {
            let mut pshape = ma.shape().to_vec();
            pshape[last] = lkv - mlen;
            let pad = ArrayD::<f64>::from_elem(IxDyn(&pshape), f64::NEG_INFINITY);
            ma = ndarray::concatenate(Axis(last), &[ma.view(), pad.view()])
                .map_err(|e| crate::ir::OpError::new(format!("{e}")))?;
        }
        let mb = ma.broadcast(IxDyn(&full)).ok_or_else(|| {
            crate::ir::OpError::new(format!(
                "attn_mask shape {:?} does not broadcast to {full:?}",
                ma.shape()
            ))
        })?;
        bias.assign(
            &mb.into_dimensionality::<ndarray::Ix4>()
                .map_err(|e| crate::ir::OpError::new(format!("{e}")))?,
        );
    }

    let is_causal = at.int("is_causal", 0)? != 0;
    let (left, right) = if ctx.opset >= 25 {
        (
            at.int("left_window_size", -1)?,
            at.int("right_window_size", -1)?,
        )
    } else {
        (-1, -1)
    };
    ensure!(
        left >= -1 && right >= -1,
        "left_window_size and right_window_size must be -1 or nonnegative"
    );
    let offset = |b: usize| -> i64 {
        match (&nonpad, past_k_t) {
            (Some(n), None) => n[b] - lq as i64,
            _ => past_len as i64,
        }
    };
    for b in 0..bsz {
        let off = offset(b);
        for i in 0..lq {
            for j in 0..lkv {
                let diff = i as i64 + off - j as i64;
                let mut add = 0.0;
                if is_causal && diff < 0 {
                    add = f64::NEG_INFINITY;
                }
                if (left >= 0 && diff > left) || (right >= 0 && -diff > right) {
                    add = f64::NEG_INFINITY;
                }
                if let Some(n) = &nonpad {
                    if (j as i64) >= n[b] {
                        add = f64::NEG_INFINITY;
                    }
                }
                if add != 0.0 {
                    for h in 0..hq {
                        bias[[b, h, i, j]] += add;
                    }
                }
            }
        }
    }

    // GQA: query head h reads kv head h / rep.
    ensure!(
        hk > 0 && hq % hk == 0,
        "q_num_heads ({hq}) must be a multiple of kv_num_heads ({hk})"
    );
    let rep = hq / hk;

    let softcap = at.float("softcap", 0.0)? as f64;
    let mode = at.int("qk_matmul_output_mode", 0)?;
    let (sdt, rs) = match at.get_int("softmax_precision")? {
        Some(c) => {
            let d = out_dtype(c)?;
            (d, rounder(d))
        }
        None => (dt, r),
    };

    let mut qk_out = Array4::<f64>::zeros(full);
    let mut y = Array4::<f64>::zeros([bsz, hq, lq, dv]);
    for b in 0..bsz {
        for h in 0..hq {
            let kh = h / rep;
            let qs = q.slice(ndarray::s![b, h, .., ..]).mapv(|x| r(x * sc));
            let ks = k.slice(ndarray::s![b, kh, .., ..]).mapv(|x| r(x * sc));
            let mut s = mm(qs.view(), ks.t(), r);
            if softcap > 0.0 {
                s.mapv_inplace(|x| r(r(r(x / softcap).tanh()) * softcap));
            }
            let bias_bh = bias.slice(ndarray::s![b, h, .., ..]);
            let with_bias = (&s + &bias_bh).mapv(r);
            let mut p = Array2::<f64>::zeros((lq, lkv));
            for i in 0..lq {
                let row = with_bias.row(i).mapv(rs);
                let m = nan_max(row.iter().copied());
                let safe = if m == f64::NEG_INFINITY { 0.0 } else { m };
                let tmp = row.mapv(|x| rs(rs(x - safe).exp()));
                let mut sum = sum_as(tmp.iter().copied(), sdt, rs);
                if sum == 0.0 {
                    sum = 1.0;
                }
                let masked =
                    lkv > 0 && nan_max(bias_bh.row(i).iter().copied()) == f64::NEG_INFINITY;
                for j in 0..lkv {
                    p[[i, j]] = if masked { 0.0 } else { rs(tmp[j] / sum) };
                }
            }
            let qk_src = match mode {
                2 => &with_bias,
                3 => &p,
                _ => &s,
            };
            qk_out
                .slice_mut(ndarray::s![b, h, .., ..])
                .assign(&qk_src.mapv(r));
            let p = p.mapv(r);
            let vs = v.slice(ndarray::s![b, kh, .., ..]);
            y.slice_mut(ndarray::s![b, h, .., ..])
                .assign(&mm(p.view(), vs, r));
        }
    }
    let y = if rank == 3 {
        merge_heads(y)?
    } else {
        y.into_dyn()
    };
    let kd = kt.dtype();
    let vd = vt.dtype();
    let mut res = vec![
        Tensor::from_f64(dt, y, false),
        Tensor::from_f64(kd, k.into_dyn(), false),
        Tensor::from_f64(vd, v.into_dyn(), false),
        Tensor::from_f64(dt, qk_out.into_dyn(), false),
    ];
    res.truncate(ctx.n_outputs.clamp(1, 4));
    outs(res)
}

// ---------------------------------------------------------------------------------
// RotaryEmbedding

fn rotary_embedding(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let xt = float_input(ins, 0, "input")?;
    let cos_t = float_input(ins, 1, "cos_cache")?;
    let sin_t = float_input(ins, 2, "sin_cache")?;
    let pos_t = opt_input(ins, 3)?;
    let dt = xt.dtype();
    let r = rounder(dt);
    let at = &ctx.attrs;
    let interleaved = at.int("interleaved", 0)? != 0;
    let rot_attr = at.int("rotary_embedding_dim", 0)?;
    let orig_shape = xt.shape().to_vec();
    // To (B, S, H, D).
    let x = match xt.rank() {
        4 => to4(f64s(xt)?, "input")?
            .permuted_axes([0, 2, 1, 3])
            .as_standard_layout()
            .into_owned(),
        3 => {
            let nh = at.int("num_heads", 0)?;
            ensure!(nh > 0, "num_heads is required for 3D input");
            split_heads(f64s(xt)?, nh as usize, "input")?
                .permuted_axes([0, 2, 1, 3])
                .as_standard_layout()
                .into_owned()
        }
        n => bail!("input must be rank 3 or 4, got rank {n}"),
    };
    let (bsz, seq, nh, hd) = x.dim();
    let rot = if rot_attr == 0 { hd as i64 } else { rot_attr };
    ensure!(
        rot > 0 && rot as usize <= hd && rot % 2 == 0,
        "rotary_embedding_dim {rot} must be even and at most the head size {hd}"
    );
    let rot = rot as usize;
    let half = rot / 2;

    let gather = |c: &Tensor, what: &str| -> OpResult<Array4<f64>> {
        let ca = f64s(c)?;
        let g = match pos_t {
            Some(p) => {
                let pos = ints(p)?;
                ensure!(ca.ndim() >= 1, "{what} must have rank >= 1");
                let n = ca.shape()[0] as i64;
                let mut shape = p.shape().to_vec();
                shape.extend_from_slice(&ca.shape()[1..]);
                let mut views = Vec::with_capacity(pos.len());
                for &pi in &pos {
                    let idx = if pi < 0 { pi + n } else { pi };
                    ensure!(
                        idx >= 0 && idx < n,
                        "position id {pi} is out of range for {what} with {n} rows"
                    );
                    views.push(ca.index_axis(Axis(0), idx as usize));
                }
                let flat: Vec<f64> = views.iter().flat_map(|v| v.iter().copied()).collect();
                ArrayD::from_shape_vec(IxDyn(&shape), flat)
                    .map_err(|e| crate::ir::OpError::new(format!("{e}")))?
            }
            None => ca,
        };
        ensure!(
            g.ndim() >= 2 && g.shape()[g.ndim() - 1] == half,
            "last dimension of {what} ({:?}) does not match rotary_embedding_dim/2 ({half})",
            g.shape()
        );
        let g = g.insert_axis(Axis(2));
        let target = [bsz, seq, 1, half];
        let b = g.broadcast(IxDyn(&target)).ok_or_else(|| {
            crate::ir::OpError::new(format!(
                "{what} shape {:?} does not broadcast to {target:?}",
                g.shape()
            ))
        })?;
        b.to_owned()
            .into_dimensionality::<ndarray::Ix4>()
            .map_err(|e| crate::ir::OpError::new(format!("{e}")))
    };
    let cs = gather(cos_t, "cos_cache")?;
    let sn = gather(sin_t, "sin_cache")?;

    let mut out = x.clone();
    for b in 0..bsz {
        for s in 0..seq {
            for h in 0..nh {
                for i in 0..half {
                    let (i1, i2) = if interleaved {
                        (2 * i, 2 * i + 1)
                    } else {
                        (i, i + half)
                    };
                    let x1 = x[[b, s, h, i1]];
                    let x2 = x[[b, s, h, i2]];
                    let c = cs[[b, s, 0, i]];
                    let sv = sn[[b, s, 0, i]];
                    out[[b, s, h, i1]] = r(r(c * x1) - r(sv * x2));
                    out[[b, s, h, i2]] = r(r(sv * x1) + r(c * x2));
                }
            }
        }
    }
    let res = if orig_shape.len() == 3 {
        out.into_dyn()
            .into_shape_with_order(IxDyn(&orig_shape))
            .map_err(|e| crate::ir::OpError::new(format!("{e}")))?
    } else {
        out.permuted_axes([0, 2, 1, 3])
            .as_standard_layout()
            .into_owned()
            .into_dyn()
    };
    outs(vec![Tensor::from_f64(dt, res, false)])
}

// ---------------------------------------------------------------------------------
// LinearAttention

fn linear_attention(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let qt = float_input(ins, 0, "query")?;
    let kt = float_input(ins, 1, "key")?;
    let vt = float_input(ins, 2, "value")?;
    let past_t = opt_input(ins, 3)?;
    let decay_t = opt_input(ins, 4)?;
    let beta_t = opt_input(ins, 5)?;
    let at = &ctx.attrs;
    let rule = at.string("update_rule", "gated_delta".into())?;
    ensure!(
        matches!(rule.as_str(), "linear" | "gated" | "delta" | "gated_delta"),
        "unsupported update_rule '{rule}'"
    );
    let (Some(qh), Some(kvh)) = (at.get_int("q_num_heads")?, at.get_int("kv_num_heads")?) else {
        bail!("q_num_heads and kv_num_heads are required attributes");
    };
    ensure!(
        qh > 0 && kvh > 0 && qh % kvh == 0,
        "q_num_heads ({qh}) must be a positive multiple of kv_num_heads ({kvh})"
    );
    let (qh, kvh) = (qh as usize, kvh as usize);
    let gating = rule == "gated" || rule == "gated_delta";
    let delta = rule == "delta" || rule == "gated_delta";
    ensure!(
        gating == decay_t.is_some(),
        "update_rule '{rule}' {} the decay input",
        if gating { "requires" } else { "forbids" }
    );
    ensure!(
        delta == beta_t.is_some(),
        "update_rule '{rule}' {} the beta input",
        if delta { "requires" } else { "forbids" }
    );
    let q = split_heads(f64s(qt)?, qh, "query")?;
    let k = split_heads(f64s(kt)?, kvh, "key")?;
    let v = split_heads(f64s(vt)?, kvh, "value")?;
    let (b, _, t, d_k) = q.dim();
    let (bk, _, tk, dkk) = k.dim();
    let (bv, _, tv, d_v) = v.dim();
    ensure!(
        bk == b && bv == b && tk == t && tv == t,
        "query, key and value must share batch and sequence sizes"
    );
    ensure!(dkk == d_k, "key head size {dkk} differs from query's {d_k}");
    let group = qh / kvh;

    // decay as (B, T, H_kv, width) with width 1 or d_k.
    let decay = match decay_t {
        Some(d) => {
            let a = f64s(d)?;
            let s = a.shape().to_vec();
            ensure!(s.len() == 3, "decay must be rank 3, got shape {s:?}");
            ensure!(
                s[0] == b && s[1] == t,
                "decay shape {s:?} does not match (B, T) = ({b}, {t})"
            );
            let w = if s[2] == kvh {
                1
            } else if s[2] == kvh * d_k {
                d_k
            } else {
                bail!(
                    "decay last dim {} must equal kv_num_heads ({kvh}) or kv_num_heads*d_k ({})",
                    s[2],
                    kvh * d_k
                )
            };
            let a = a
                .as_standard_layout()
                .into_owned()
                .into_shape_with_order(IxDyn(&[b, t, kvh, w]))
                .map_err(|e| crate::ir::OpError::new(format!("{e}")))?;
            Some((to4(a, "decay")?, w))
        }
        None => None,
    };
    let beta = match beta_t {
        Some(d) => {
            let a = f64s(d)?;
            let s = a.shape().to_vec();
            ensure!(s.len() == 3, "beta must be rank 3, got shape {s:?}");
            ensure!(
                s[0] == b && s[1] == t,
                "beta shape {s:?} does not match (B, T) = ({b}, {t})"
            );
            ensure!(
                s[2] == kvh || s[2] == 1,
                "beta last dim {} must be kv_num_heads ({kvh}) or 1",
                s[2]
            );
            let w = s[2];
            Some((
                a.into_dimensionality::<ndarray::Ix3>()
                    .map_err(|e| crate::ir::OpError::new(format!("{e}")))?,
                w,
            ))
        }
        None => None,
    };
    let sshape = [b, kvh, d_k, d_v];
    let (mut state, state_dt) = match past_t {
        Some(p) => {
            ensure!(
                p.shape() == sshape,
                "past_state shape {:?} does not match {sshape:?}",
                p.shape()
            );
            ensure!(p.dtype().is_float(), "past_state must be a float tensor");
            (to4(f64s(p)?, "past_state")?, p.dtype())
        }
        None => (Array4::<f64>::zeros(sshape), qt.dtype()),
    };
    let scale = at.float("scale", 0.0)? as f64;
    let scale = if scale == 0.0 {
        1.0 / (d_k as f64).sqrt()
    } else {
        scale
    };

    let mut out = Array4::<f64>::zeros([b, qh, t, d_v]);
    let mut vt_buf = vec![0.0f64; d_v];
    for ti in 0..t {
        for bi in 0..b {
            for h in 0..kvh {
                if let Some((dec, w)) = &decay {
                    for d in 0..d_k {
                        let g = dec[[bi, ti, h, if *w == 1 { 0 } else { d }]].exp();
                        for m in 0..d_v {
                            state[[bi, h, d, m]] *= g;
                        }
                    }
                }
                for (m, x) in vt_buf.iter_mut().enumerate() {
                    *x = v[[bi, h, ti, m]];
                }
                if let Some((bt, w)) = &beta {
                    let be = bt[[bi, ti, if *w == 1 { 0 } else { h }]];
                    for (m, x) in vt_buf.iter_mut().enumerate() {
                        let mut ret = 0.0;
                        for d in 0..d_k {
                            ret += state[[bi, h, d, m]] * k[[bi, h, ti, d]];
                        }
                        *x = be * (*x - ret);
                    }
                }
                for d in 0..d_k {
                    let kd = k[[bi, h, ti, d]];
                    for (m, x) in vt_buf.iter().enumerate() {
                        state[[bi, h, d, m]] += kd * x;
                    }
                }
            }
            for h in 0..qh {
                let hkv = h / group;
                for m in 0..d_v {
                    let mut acc = 0.0;
                    for d in 0..d_k {
                        acc += q[[bi, h, ti, d]] * state[[bi, hkv, d, m]];
                    }
                    out[[bi, h, ti, m]] = scale * acc;
                }
            }
        }
    }
    let out = merge_heads(out)?;
    let mut res = vec![
        Tensor::from_f64(qt.dtype(), out, false),
        Tensor::from_f64(state_dt, state.into_dyn(), false),
    ];
    res.truncate(ctx.n_outputs.clamp(1, 2));
    outs(res)
}

// ---------------------------------------------------------------------------------
// FlexAttention (ai.onnx.preview)

struct FlexAttention {
    scale: Option<f32>,
    score_mod: Option<Arc<Graph>>,
    prob_mod: Option<Arc<Graph>>,
    softmax_precision: Option<DType>,
}

impl fmt::Debug for FlexAttention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FlexAttention")
    }
}

fn flex_builder(ctx: &OpCtx) -> OpResult<Arc<dyn Op>> {
    let at = &ctx.attrs;
    let softmax_precision = match at.get_int("softmax_precision")? {
        Some(c) => {
            let d = out_dtype(c)?;
            ensure!(
                matches!(d, DType::F32 | DType::F16 | DType::BF16 | DType::F64),
                "unsupported softmax_precision {d}"
            );
            Some(d)
        }
        None => None,
    };
    Ok(Arc::new(FlexAttention {
        scale: at.get_float("scale")?,
        score_mod: at.get_graph("score_mod")?,
        prob_mod: at.get_graph("prob_mod")?,
        softmax_precision,
    }))
}

fn call_mod(
    g: &Graph,
    sub: &mut Option<&mut dyn SubgraphRunner>,
    x: Array4<f64>,
    cd: DType,
    what: &str,
) -> OpResult<Array4<f64>> {
    let Some(sub) = sub.as_deref_mut() else {
        bail!("FlexAttention {what} needs a subgraph runner");
    };
    let shape = x.shape().to_vec();
    let outs = sub.run(
        g,
        vec![Value::Tensor(Tensor::from_f64(cd, x.into_dyn(), false))],
    )?;
    ensure!(
        outs.len() == 1,
        "{what} graph must produce exactly 1 output, got {}",
        outs.len()
    );
    let Some(t) = outs[0].as_tensor() else {
        bail!("{what} graph must produce a tensor");
    };
    let a = f64s(t)?.mapv(rounder(cd));
    let b = a.broadcast(IxDyn(&shape)).ok_or_else(|| {
        crate::ir::OpError::new(format!(
            "{what} output shape {:?} does not match {shape:?}",
            a.shape()
        ))
    })?;
    to4(b.to_owned(), what)
}

impl FlexAttention {
    fn run(
        &self,
        ins: &[Option<&Value>],
        mut sub: Option<&mut dyn SubgraphRunner>,
    ) -> OpResult<Vec<Value>> {
        let qt = float_input(ins, 0, "Q")?;
        let kt = float_input(ins, 1, "K")?;
        let vt = float_input(ins, 2, "V")?;
        ensure!(
            qt.rank() == 4 && kt.rank() == 4 && vt.rank() == 4,
            "FlexAttention requires rank-4 inputs, got {:?}, {:?}, {:?}",
            qt.shape(),
            kt.shape(),
            vt.shape()
        );
        let dt = qt.dtype();
        let r = rounder(dt);
        let q = to4(f64s(qt)?, "Q")?;
        let k = to4(f64s(kt)?, "K")?;
        let v = to4(f64s(vt)?, "V")?;
        let (b, hq, l, e) = q.dim();
        let (bk, hkv, s, ek) = k.dim();
        let (bv, hv, sv, ev) = v.dim();
        ensure!(bk == b && bv == b, "Q, K and V must share the batch size");
        ensure!(
            hv == hkv,
            "key and value must share the same head dimension"
        );
        ensure!(sv == s, "key and value must share the same sequence length");
        ensure!(
            ek == e,
            "query and key must share the same embedding dimension"
        );
        ensure!(
            hkv > 0 && hq % hkv == 0,
            "q_num_heads must be a multiple of kv_num_heads when they differ"
        );
        let rep = hq / hkv;
        let scale = match self.scale {
            Some(x) => x as f64,
            None => 1.0 / (e as f64).sqrt(),
        };
        let ss = r(((scale as f32) as f64).sqrt() as f32 as f64);
        let cd = match self.softmax_precision {
            Some(d) => d,
            None if matches!(dt, DType::F16 | DType::BF16) => DType::F32,
            None if dt == DType::F64 => DType::F64,
            None => DType::F32,
        };
        let rc = rounder(cd);
        dims(&[b as i64, hq as i64, l as i64, s as i64])?;
        let mut scores = Array4::<f64>::zeros([b, hq, l, s]);
        for bi in 0..b {
            for h in 0..hq {
                let qs = q.slice(ndarray::s![bi, h, .., ..]).mapv(|x| r(x * ss));
                let ks = k
                    .slice(ndarray::s![bi, h / rep, .., ..])
                    .mapv(|x| r(x * ss));
                let sc = mm(qs.view(), ks.t(), r).mapv(rc);
                scores.slice_mut(ndarray::s![bi, h, .., ..]).assign(&sc);
            }
        }
        if let Some(g) = &self.score_mod {
            scores = call_mod(g, &mut sub, scores, cd, "score_mod")?;
        }
        let mut probs = scores;
        for mut row in probs.lanes_mut(Axis(3)) {
            let m = nan_max(row.iter().copied());
            row.mapv_inplace(|x| rc(rc(x - m).exp()));
            let sum = sum_as(row.iter().copied(), cd, rc);
            row.mapv_inplace(|x| rc(x / sum));
        }
        if let Some(g) = &self.prob_mod {
            probs = call_mod(g, &mut sub, probs, cd, "prob_mod")?;
        }
        let mut y = Array4::<f64>::zeros([b, hq, l, ev]);
        for bi in 0..b {
            for h in 0..hq {
                let vs = v.slice(ndarray::s![bi, h / rep, .., ..]).mapv(rc);
                let p = probs.slice(ndarray::s![bi, h, .., ..]);
                y.slice_mut(ndarray::s![bi, h, .., ..])
                    .assign(&mm(p, vs.view(), rc));
            }
        }
        outs(vec![Tensor::from_f64(vt.dtype(), y.into_dyn(), false)])
    }
}

impl Op for FlexAttention {
    fn eval(&self, inputs: &[Option<&Value>]) -> OpResult<Vec<Value>> {
        self.run(inputs, None)
    }

    fn eval_with(
        &self,
        inputs: &[Option<&Value>],
        sub: &mut dyn SubgraphRunner,
    ) -> OpResult<Vec<Value>> {
        self.run(inputs, Some(sub))
    }

    fn subgraphs(&self) -> Vec<&Graph> {
        self.score_mod
            .iter()
            .chain(self.prob_mod.iter())
            .map(|g| &**g)
            .collect()
    }
}

// ---------------------------------------------------------------------------------
// Lowering to kernel IR

mod lower {
    use crate::ir::{DType, OpError, OpResult};
    use crate::kir::build::*;
    use crate::kir::{BinOp, BufId, BufKind, CmpOp, Expr, MathFn, Stmt, Ty, VarId};
    use crate::ops::lowering::{broadcast_strides, LowerCtx, TensorRef};
    use crate::ops::{Lowering, Registry};
    use crate::{bail, ensure};

    pub fn register(r: &mut Registry) {
        r.lower("Attention", Lowering::Custom(attention));
        r.lower("RotaryEmbedding", Lowering::Custom(rotary));
        r.lower("LinearAttention", Lowering::Custom(linear_attention));
    }

    /// The reference's recurrence, state in an f64 scratch buffer.
    fn linear_attention(lw: &mut LowerCtx) -> OpResult<()> {
        let q = lw.input(0)?.clone();
        let kt = lw.input(1)?.clone();
        let vt = lw.input(2)?.clone();
        let past = lw.opt_input(3).cloned();
        let decay = lw.opt_input(4).cloned();
        let beta = lw.opt_input(5).cloned();
        let at = &lw.op.attrs;
        let (Some(qh), Some(kvh)) = (at.get_int("q_num_heads")?, at.get_int("kv_num_heads")?)
        else {
            bail!("q_num_heads and kv_num_heads are required attributes");
        };
        ensure!(qh > 0 && kvh > 0 && qh % kvh == 0, "head counts");
        let (qh, kvh) = (qh as usize, kvh as usize);
        ensure!(
            q.shape.len() == 3 && kt.shape.len() == 3 && vt.shape.len() == 3,
            "LinearAttention inputs must be rank 3"
        );
        let (b, t) = (q.shape[0], q.shape[1]);
        ensure!(q.shape[2] % qh == 0 && vt.shape[2] % kvh == 0, "head sizes");
        let dk = q.shape[2] / qh;
        let dv = vt.shape[2] / kvh;
        ensure!(kt.shape[2] == kvh * dk, "key head size");
        let group = qh / kvh;
        let scale = at.float("scale", 0.0)? as f64;
        let scale = if scale == 0.0 {
            1.0 / (dk as f64).sqrt()
        } else {
            scale
        };
        let qv = View::heads3(q.buf, qh, t, dk);
        let kv = View::heads3(kt.buf, kvh, t, dk);
        let vv = View::heads3(vt.buf, kvh, t, dv);
        let y = lw.outputs[0].clone();
        let yv = View::heads3(y.buf, qh, t, dv);
        let yt = y.ty().compute();
        let f64_ = |tr: &TensorRef, e: Expr| cast_to(Ty::F64, e, tr.ty().compute());
        let slen = b * kvh * dk * dv;
        let st = scratch(lw, "state", Ty::F64, slen);
        let vb = scratch(lw, "vt", Ty::F64, dv);
        let sv = View::std4(st, kvh, dk, dv);
        let mut k = lw.kernel("");
        let (i, ti, bi, h, d, m) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let g = k.var(Ty::F64);
        let acc = k.var(Ty::F64);
        let be = k.var(Ty::F64);
        let mut body = vec![for_(
            i,
            slen,
            vec![store(
                st,
                v(i),
                match &past {
                    Some(p) => {
                        ensure!(p.len() == slen, "past_state shape");
                        f64_(p, Expr::load(p.buf, v(i)))
                    }
                    None => fl(0.0, Ty::F64),
                },
            )],
        )];
        let sat = |d: Expr, m: Expr| sv.at(v(bi), v(h), d, m);
        let sidx = |d: Expr, m: Expr| sv.idx(v(bi), v(h), d, m);
        let mut hb = Vec::new();
        if let Some(dc) = &decay {
            ensure!(
                dc.shape.len() == 3 && dc.shape[0] == b && dc.shape[1] == t,
                "decay shape"
            );
            let w = if dc.shape[2] == kvh {
                1
            } else if dc.shape[2] == kvh * dk {
                dk
            } else {
                bail!("decay last dim");
            };
            let di = lin(vec![
                (v(bi), t * kvh * w),
                (v(ti), kvh * w),
                (v(h), w),
                (v(d), if w == 1 { 0 } else { 1 }),
            ]);
            hb.push(for_(
                d,
                dk,
                vec![
                    set(
                        g,
                        Expr::call(MathFn::Exp, vec![f64_(dc, Expr::load(dc.buf, di))]),
                    ),
                    for_(
                        m,
                        dv,
                        vec![store(st, sidx(v(d), v(m)), mul(sat(v(d), v(m)), v(g)))],
                    ),
                ],
            ));
        }
        hb.push(for_(
            m,
            dv,
            vec![store(vb, v(m), f64_(&vt, vv.at(v(bi), v(h), v(ti), v(m))))],
        ));
        let kval = f64_(&kt, kv.at(v(bi), v(h), v(ti), v(d)));
        if let Some(bt) = &beta {
            ensure!(
                bt.shape.len() == 3 && bt.shape[0] == b && bt.shape[1] == t,
                "beta shape"
            );
            let w = bt.shape[2];
            ensure!(w == kvh || w == 1, "beta last dim");
            let bidx = lin(vec![
                (v(bi), t * w),
                (v(ti), w),
                (v(h), if w == 1 { 0 } else { 1 }),
            ]);
            hb.push(set(be, f64_(bt, Expr::load(bt.buf, bidx))));
            hb.push(for_(
                m,
                dv,
                vec![
                    set(acc, fl(0.0, Ty::F64)),
                    for_(
                        d,
                        dk,
                        vec![set(acc, add(v(acc), mul(sat(v(d), v(m)), kval.clone())))],
                    ),
                    store(vb, v(m), mul(v(be), sub(Expr::load(vb, v(m)), v(acc)))),
                ],
            ));
        }
        hb.push(for_(
            d,
            dk,
            vec![
                set(g, kval),
                for_(
                    m,
                    dv,
                    vec![store(
                        st,
                        sidx(v(d), v(m)),
                        add(sat(v(d), v(m)), mul(v(g), Expr::load(vb, v(m)))),
                    )],
                ),
            ],
        ));
        let hkv = div(v(h), int(group));
        let qb = vec![for_(
            m,
            dv,
            vec![
                set(acc, fl(0.0, Ty::F64)),
                for_(
                    d,
                    dk,
                    vec![set(
                        acc,
                        add(
                            v(acc),
                            mul(
                                f64_(&q, qv.at(v(bi), v(h), v(ti), v(d))),
                                sv.at(v(bi), hkv.clone(), v(d), v(m)),
                            ),
                        ),
                    )],
                ),
                store(
                    y.buf,
                    yv.idx(v(bi), v(h), v(ti), v(m)),
                    cast_to(yt, mul(fl(scale, Ty::F64), v(acc)), Ty::F64),
                ),
            ],
        )];
        body.push(for_(
            ti,
            t,
            vec![for_(bi, b, vec![for_(h, kvh, hb), for_(h, qh, qb)])],
        ));
        if lw.outputs.len() > 1 {
            let so = lw.outputs[1].clone();
            ensure!(so.len() == slen, "present_state shape");
            body.push(for_(
                i,
                slen,
                vec![store(
                    so.buf,
                    v(i),
                    cast_to(so.ty().compute(), Expr::load(st, v(i)), Ty::F64),
                )],
            ));
        }
        k.body = body;
        lw.push(k);
        Ok(())
    }

    fn sub(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Sub, a, b)
    }
    fn div(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Div, a, b)
    }
    fn fl(x: f64, t: Ty) -> Expr {
        Expr::f(x, t)
    }
    fn cast_to(t: Ty, e: Expr, from: Ty) -> Expr {
        if t == from {
            e
        } else {
            Expr::cast(t, e)
        }
    }
    fn if_(cond: Expr, then: Vec<Stmt>, els: Vec<Stmt>) -> Stmt {
        Stmt::If { cond, then, els }
    }
    /// NaN-propagating running maximum: `m = max(m, x)`.
    fn nan_max(m: VarId, x: Expr) -> Stmt {
        set(
            m,
            sel(
                cmp(CmpOp::Ne, x.clone(), x.clone()),
                x.clone(),
                sel(cmp(CmpOp::Gt, x.clone(), v(m)), x, v(m)),
            ),
        )
    }
    fn scratch(lw: &mut LowerCtx, what: &str, ty: Ty, len: usize) -> BufId {
        let name = format!("{}/{what}", lw.name);
        lw.program
            .add_buffer(name, BufKind::Arena { offset: 0 }, ty, len.max(1) as u64)
    }

    /// A rank-4 (b, h, s, d) view of a flat buffer.
    #[derive(Clone)]
    struct View {
        buf: BufId,
        st: [usize; 4],
    }
    impl View {
        fn idx(&self, b: Expr, h: Expr, s: Expr, d: Expr) -> Expr {
            lin(vec![
                (b, self.st[0]),
                (h, self.st[1]),
                (s, self.st[2]),
                (d, self.st[3]),
            ])
        }
        fn at(&self, b: Expr, h: Expr, s: Expr, d: Expr) -> Expr {
            Expr::load(self.buf, self.idx(b, h, s, d))
        }
        /// Standard (B, H, S, D) layout.
        fn std4(buf: BufId, h: usize, s: usize, d: usize) -> View {
            View {
                buf,
                st: [h * s * d, s * d, d, 1],
            }
        }
        /// (B, S, H*D) layout.
        fn heads3(buf: BufId, h: usize, s: usize, d: usize) -> View {
            View {
                buf,
                st: [s * h * d, d, h * d, 1],
            }
        }
    }

    /// (view, batch, heads, seq, head size) of Q/K/V.
    fn qkv_view(t: &TensorRef, heads: usize) -> OpResult<(View, usize, usize, usize, usize)> {
        let s = &t.shape;
        Ok(match s.len() {
            4 => (View::std4(t.buf, s[1], s[2], s[3]), s[0], s[1], s[2], s[3]),
            3 => {
                ensure!(heads > 0 && s[2].is_multiple_of(heads), "bad head count");
                let d = s[2] / heads;
                (View::heads3(t.buf, heads, s[1], d), s[0], heads, s[1], d)
            }
            n => bail!("Attention inputs must be rank 3 or 4, got {n}"),
        })
    }

    fn attention(lw: &mut LowerCtx) -> OpResult<()> {
        let q = lw.input(0)?.clone();
        let kt = lw.input(1)?.clone();
        let vt = lw.input(2)?.clone();
        let mask = lw.opt_input(3).cloned();
        let pk = lw.opt_input(4).cloned();
        let pv = lw.opt_input(5).cloned();
        let nonpad = lw.opt_input(6).cloned();
        let at = &lw.op.attrs;
        let dt = q.dtype;
        ensure!(
            matches!(dt, DType::F32 | DType::F64 | DType::F16 | DType::BF16),
            "Attention of {dt}"
        );
        let bf = dt == DType::BF16;
        if bf {
            if let Some(c) = at.get_int("softmax_precision")? {
                if DType::from_onnx(c as i32) != Some(DType::BF16) {
                    return Err(OpError::unsupported(
                        "bfloat16 Attention with another softmax_precision",
                    ));
                }
            }
        }
        let ct = if dt == DType::F64 { Ty::F64 } else { Ty::F32 };
        let acc_t = Ty::F64;
        let rank = q.shape.len();
        let (qh_attr, kvh_attr) = if rank == 3 {
            (
                at.get_int("q_num_heads")?.unwrap_or(0) as usize,
                at.get_int("kv_num_heads")?.unwrap_or(0) as usize,
            )
        } else {
            (0, 0)
        };
        let (qv, bsz, hq, lq, dq) = qkv_view(&q, qh_attr)?;
        let (kv0, _, hk, lk, dk) = qkv_view(&kt, kvh_attr)?;
        let (vv0, _, _, _, dv) = qkv_view(&vt, kvh_attr)?;
        ensure!(dk == dq && hk > 0 && hq % hk == 0, "Attention shapes");
        let rep = hq / hk;
        let scale = match at.get_float("scale")? {
            Some(s) => s as f64,
            None => 1.0 / (dq as f64).sqrt(),
        };
        let sc = if bf {
            half::bf16::from_f64(scale.sqrt()).to_f64()
        } else if ct == Ty::F32 {
            (scale.sqrt() as f32) as f64
        } else {
            scale.sqrt()
        };
        let past_len = pk.as_ref().map(|p| p.shape[2]).unwrap_or(0);
        let lkv = past_len + lk;
        let is_causal = at.int("is_causal", 0)? != 0;
        let (left, right) = if lw.op.opset >= 25 {
            (
                at.int("left_window_size", -1)?,
                at.int("right_window_size", -1)?,
            )
        } else {
            (-1, -1)
        };
        let softcap = at.float("softcap", 0.0)? as f64;
        let mode = at.int("qk_matmul_output_mode", 0)?;
        let nout = lw.outputs.len();
        let y = lw.outputs[0].clone();
        let present_k = if nout > 1 {
            Some(lw.outputs[1].clone())
        } else {
            None
        };
        let present_v = if nout > 2 {
            Some(lw.outputs[2].clone())
        } else {
            None
        };
        let qk_out = if nout > 3 {
            Some(lw.outputs[3].clone())
        } else {
            None
        };

        // Present key/value (past ++ new) in (B, H, Lkv, D).
        let mut k = lw.kernel("present");
        let mut body = Vec::new();
        let mut kview = kv0.clone();
        let mut vview = vv0.clone();
        for (which, newv, past, pres, d) in [
            ("key", kv0.clone(), pk.clone(), present_k.clone(), dk),
            ("value", vv0.clone(), pv.clone(), present_v.clone(), dv),
        ] {
            if past.is_none() && pres.is_none() {
                continue;
            }
            let dst = match &pres {
                Some(p) => p.buf,
                None => scratch(lw, &format!("all_{which}"), kt.ty(), bsz * hk * lkv * d),
            };
            let dview = View::std4(dst, hk, lkv, d);
            let (b, h, j, e) = (
                k.var(Ty::I64),
                k.var(Ty::I64),
                k.var(Ty::I64),
                k.var(Ty::I64),
            );
            let mut inner = Vec::new();
            if let Some(p) = &past {
                let pview = View::std4(p.buf, hk, past_len, d);
                inner.push(for_(
                    j,
                    past_len,
                    vec![for_(
                        e,
                        d,
                        vec![store(
                            dst,
                            dview.idx(v(b), v(h), v(j), v(e)),
                            pview.at(v(b), v(h), v(j), v(e)),
                        )],
                    )],
                ));
            }
            inner.push(for_(
                j,
                lk,
                vec![for_(
                    e,
                    d,
                    vec![store(
                        dst,
                        dview.idx(v(b), v(h), add(v(j), int(past_len)), v(e)),
                        newv.at(v(b), v(h), v(j), v(e)),
                    )],
                )],
            ));
            body.push(for_(b, bsz, vec![for_(h, hk, inner)]));
            if past.is_some() {
                if which == "key" {
                    kview = dview;
                } else {
                    vview = dview;
                }
            }
        }
        if !body.is_empty() {
            k.body = body;
            lw.push(k);
        }

        // Scores row scratch.
        let row = scratch(lw, "row", ct, lkv);
        // bfloat16: every step rounds through a one-element bf16 buffer.
        let rbuf = if bf {
            Some(scratch(lw, "round", Ty::BF16, 1))
        } else {
            None
        };
        let rnd = |x: VarId| -> Vec<Stmt> {
            match rbuf {
                Some(rb) => vec![
                    store(rb, Expr::Int(0), v(x)),
                    set(x, Expr::load(rb, Expr::Int(0))),
                ],
                None => vec![],
            }
        };
        let mut k = lw.kernel("");
        let (b, h, i, j, d) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let acc = k.var(acc_t);
        let s = k.var(ct);
        let bias = k.var(ct);
        let m = k.var(ct);
        let bm = k.var(ct);
        let sum = k.var(ct);
        let masked = k.var(Ty::U8);
        let tq = k.var(ct);
        let tk = k.var(ct);
        let te = k.var(ct);
        let kh = bin(BinOp::Div, v(h), int(rep));
        let ninf = fl(f64::NEG_INFINITY, ct);
        let zero = fl(0.0, ct);
        let ld = |t: Ty, e: Expr| cast_to(ct, e, t);
        let qty = q.ty().compute();
        let kty = kt.ty().compute();
        let vty = vt.ty().compute();
        let qkidx = |jj: Expr| {
            lin(vec![
                (v(b), hq * lq * lkv),
                (v(h), lq * lkv),
                (v(i), lkv),
                (jj, 1),
            ])
        };

        // Pass 1: scores, bias, row max.
        let mut p1 = vec![set(acc, fl(0.0, acc_t))];
        let qs = mul(ld(qty, qv.at(v(b), v(h), v(i), v(d))), fl(sc, ct));
        let ks = mul(ld(kty, kview.at(v(b), kh.clone(), v(j), v(d))), fl(sc, ct));
        if bf {
            let mut dl = vec![set(tq, qs)];
            dl.extend(rnd(tq));
            dl.push(set(tk, ks));
            dl.extend(rnd(tk));
            dl.push(set(
                acc,
                add(
                    v(acc),
                    mul(cast_to(acc_t, v(tq), ct), cast_to(acc_t, v(tk), ct)),
                ),
            ));
            p1.push(for_(d, dq, dl));
        } else {
            p1.push(for_(
                d,
                dq,
                vec![set(
                    acc,
                    add(v(acc), mul(cast_to(acc_t, qs, ct), cast_to(acc_t, ks, ct))),
                )],
            ));
        }
        p1.push(set(s, cast_to(ct, v(acc), acc_t)));
        p1.extend(rnd(s));
        if bf && softcap > 0.0 {
            p1.push(set(s, div(v(s), fl(softcap, ct))));
            p1.extend(rnd(s));
            p1.push(set(s, Expr::call(MathFn::Tanh, vec![v(s)])));
            p1.extend(rnd(s));
            p1.push(set(s, mul(v(s), fl(softcap, ct))));
            p1.extend(rnd(s));
        } else if softcap > 0.0 {
            p1.push(set(
                s,
                mul(
                    Expr::call(MathFn::Tanh, vec![div(v(s), fl(softcap, ct))]),
                    fl(softcap, ct),
                ),
            ));
        }
        if let Some(o) = &qk_out {
            if mode != 2 && mode != 3 {
                p1.push(store(o.buf, qkidx(v(j)), v(s)));
            }
        }
        // Bias.
        p1.push(set(bias, zero.clone()));
        if let Some(mt) = &mask {
            let ms = &mt.shape;
            ensure!(!ms.is_empty() && ms.len() <= 4, "attn_mask rank");
            let mlen = *ms.last().expect("nonempty");
            let full = [bsz, hq, lq, mlen];
            let off = 4 - ms.len();
            for (dd, &n) in ms.iter().enumerate() {
                ensure!(
                    n == 1 || n == full[dd + off],
                    "attn_mask shape {ms:?} does not broadcast"
                );
            }
            ensure!(mlen <= lkv, "attn_mask longer than the key sequence");
            let st = broadcast_strides(ms, &full);
            let raw = Expr::load(
                mt.buf,
                lin(vec![
                    (v(b), st[0]),
                    (v(h), st[1]),
                    (v(i), st[2]),
                    (v(j), st[3]),
                ]),
            );
            let val = if mt.dtype == DType::Bool {
                sel(raw, zero.clone(), ninf.clone())
            } else {
                ensure!(mt.dtype.is_float(), "attn_mask of {}", mt.dtype);
                ld(mt.ty().compute(), raw)
            };
            if mlen < lkv {
                p1.push(if_(
                    cmp(CmpOp::Lt, v(j), int(mlen)),
                    vec![set(bias, val)],
                    vec![set(bias, ninf.clone())],
                ));
            } else {
                p1.push(set(bias, val));
            }
        }
        // Causal / window / padding.
        let offset = match (&nonpad, &pk) {
            (Some(np), None) => {
                ensure!(np.shape == [bsz], "nonpad_kv_seqlen shape");
                sub(
                    cast_to(Ty::I64, Expr::load(np.buf, v(b)), np.ty().compute()),
                    int(lq),
                )
            }
            _ => int(past_len),
        };
        let diff = sub(add(v(i), offset), v(j));
        let mut conds = Vec::new();
        if is_causal {
            conds.push(cmp(CmpOp::Lt, diff.clone(), Expr::Int(0)));
        }
        if left >= 0 {
            conds.push(cmp(CmpOp::Gt, diff.clone(), Expr::Int(left)));
        }
        if right >= 0 {
            conds.push(cmp(
                CmpOp::Gt,
                bin(BinOp::Sub, Expr::Int(0), diff.clone()),
                Expr::Int(right),
            ));
        }
        if let Some(np) = &nonpad {
            conds.push(cmp(
                CmpOp::Ge,
                v(j),
                cast_to(Ty::I64, Expr::load(np.buf, v(b)), np.ty().compute()),
            ));
        }
        if let Some(c) = conds.into_iter().reduce(|a, b| bin(BinOp::Or, a, b)) {
            p1.push(set(bias, add(v(bias), sel(c, ninf.clone(), zero.clone()))));
        }
        p1.push(set(s, add(v(s), v(bias))));
        p1.extend(rnd(s));
        if let Some(o) = &qk_out {
            if mode == 2 {
                p1.push(store(o.buf, qkidx(v(j)), v(s)));
            }
        }
        p1.push(store(row, v(j), v(s)));
        p1.push(nan_max(m, v(s)));
        p1.push(nan_max(bm, v(bias)));

        let mut rowb = vec![set(m, ninf.clone()), set(bm, ninf.clone())];
        rowb.push(for_(j, lkv, p1));
        // Pass 2: exp and sum.
        rowb.push(set(
            m,
            sel(cmp(CmpOp::Eq, v(m), ninf.clone()), zero.clone(), v(m)),
        ));
        rowb.push(set(sum, zero.clone()));
        if bf {
            let mut el = vec![set(te, sub(Expr::load(row, v(j)), v(m)))];
            el.extend(rnd(te));
            el.push(set(te, Expr::call(MathFn::Exp, vec![v(te)])));
            el.extend(rnd(te));
            el.push(store(row, v(j), v(te)));
            el.push(set(sum, add(v(sum), v(te))));
            el.extend(rnd(sum));
            rowb.push(for_(j, lkv, el));
        } else {
            let e = Expr::call(MathFn::Exp, vec![sub(Expr::load(row, v(j)), v(m))]);
            rowb.push(for_(
                j,
                lkv,
                vec![
                    store(row, v(j), e),
                    set(sum, add(v(sum), Expr::load(row, v(j)))),
                ],
            ));
        }
        rowb.push(set(
            sum,
            sel(cmp(CmpOp::Eq, v(sum), zero.clone()), fl(1.0, ct), v(sum)),
        ));
        rowb.push(set(
            masked,
            if lkv > 0 {
                cmp(CmpOp::Eq, v(bm), ninf.clone())
            } else {
                Expr::cast(Ty::U8, Expr::Int(0))
            },
        ));
        // Pass 3: normalise.
        let mut p3 = if bf {
            let mut l = vec![set(te, div(Expr::load(row, v(j)), v(sum)))];
            l.extend(rnd(te));
            l.push(store(row, v(j), sel(v(masked), zero.clone(), v(te))));
            l
        } else {
            vec![store(
                row,
                v(j),
                sel(v(masked), zero.clone(), div(Expr::load(row, v(j)), v(sum))),
            )]
        };
        if let Some(o) = &qk_out {
            if mode == 3 {
                p3.push(store(o.buf, qkidx(v(j)), Expr::load(row, v(j))));
            }
        }
        rowb.push(for_(j, lkv, p3));
        // Pass 4: P @ V.
        let yview = if rank == 3 {
            View::heads3(y.buf, hq, lq, dv)
        } else {
            View::std4(y.buf, hq, lq, dv)
        };
        let pvv = mul(
            cast_to(acc_t, Expr::load(row, v(j)), ct),
            cast_to(acc_t, ld(vty, vview.at(v(b), kh.clone(), v(j), v(d))), ct),
        );
        rowb.push(for_(
            d,
            dv,
            vec![
                set(acc, fl(0.0, acc_t)),
                for_(j, lkv, vec![set(acc, add(v(acc), pvv))]),
                store(
                    y.buf,
                    yview.idx(v(b), v(h), v(i), v(d)),
                    cast_to(ct, v(acc), acc_t),
                ),
            ],
        ));
        k.body = vec![for_(b, bsz, vec![for_(h, hq, vec![for_(i, lq, rowb)])])];
        lw.push(k);
        Ok(())
    }

    fn rotary(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let cos = lw.input(1)?.clone();
        let sin = lw.input(2)?.clone();
        let pos = lw.opt_input(3).cloned();
        let at = &lw.op.attrs;
        let dt = x.dtype;
        if matches!(dt, DType::F16 | DType::BF16) {
            return Err(OpError::unsupported(
                "float16/bfloat16 RotaryEmbedding needs step rounding",
            ));
        }
        let ct = x.ty().compute();
        ensure!(ct.is_float(), "RotaryEmbedding of {dt}");
        let interleaved = at.int("interleaved", 0)? != 0;
        let rot_attr = at.int("rotary_embedding_dim", 0)?;
        let s = &x.shape;
        // View as (b, s, h, d).
        let (view, bsz, seq, nh, hd) = match s.len() {
            4 => (
                View {
                    buf: x.buf,
                    st: [s[1] * s[2] * s[3], s[2] * s[3], s[3], 1],
                },
                s[0],
                s[2],
                s[1],
                s[3],
            ),
            3 => {
                let nh = at.int("num_heads", 0)? as usize;
                ensure!(nh > 0 && s[2] % nh == 0, "num_heads");
                let hd = s[2] / nh;
                (
                    View {
                        buf: x.buf,
                        st: [s[1] * s[2], hd, s[2], 1],
                    },
                    s[0],
                    s[1],
                    nh,
                    hd,
                )
            }
            n => bail!("RotaryEmbedding input of rank {n}"),
        };
        let out = View {
            buf: lw.outputs[0].buf,
            st: view.st,
        };
        let rot = if rot_attr == 0 { hd } else { rot_attr as usize };
        ensure!(rot > 0 && rot <= hd && rot % 2 == 0, "rotary_embedding_dim");
        let half = rot / 2;
        let mut k = lw.kernel("");
        let (b, si, h, ii) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        // Cache row for (b, s).
        let cache = |t: &TensorRef, ii: Expr| -> OpResult<Expr> {
            let cs = &t.shape;
            ensure!(cs.last() == Some(&half), "cache last dim");
            Ok(match &pos {
                Some(p) => {
                    ensure!(cs.len() == 2, "cache rank with position_ids");
                    let pst = broadcast_strides(&p.shape, &[bsz, seq]);
                    let pi = cast_to(
                        Ty::I64,
                        Expr::load(p.buf, lin(vec![(v(b), pst[0]), (v(si), pst[1])])),
                        p.ty().compute(),
                    );
                    Expr::load(t.buf, add(mul(pi, int(half)), ii))
                }
                None => {
                    ensure!(cs.len() == 2 || cs.len() == 3, "cache rank");
                    let full: Vec<usize> = if cs.len() == 3 {
                        vec![bsz, seq, half]
                    } else {
                        vec![seq, half]
                    };
                    for (a, c) in cs.iter().zip(&full) {
                        ensure!(a == c || *a == 1, "cache shape {cs:?}");
                    }
                    let st = broadcast_strides(cs, &full);
                    if cs.len() == 3 {
                        Expr::load(t.buf, lin(vec![(v(b), st[0]), (v(si), st[1]), (ii, st[2])]))
                    } else {
                        Expr::load(t.buf, lin(vec![(v(si), st[0]), (ii, st[1])]))
                    }
                }
            })
        };
        let c = cast_to(ct, cache(&cos, v(ii))?, cos.ty().compute());
        let sn = cast_to(ct, cache(&sin, v(ii))?, sin.ty().compute());
        let (i1, i2) = if interleaved {
            (mul(v(ii), int(2)), add(mul(v(ii), int(2)), int(1)))
        } else {
            (v(ii), add(v(ii), int(half)))
        };
        let x1 = view.at(v(b), v(h), v(si), i1.clone());
        let x2 = view.at(v(b), v(h), v(si), i2.clone());
        let inner = vec![
            store(
                out.buf,
                out.idx(v(b), v(h), v(si), i1),
                sub(mul(c.clone(), x1.clone()), mul(sn.clone(), x2.clone())),
            ),
            store(
                out.buf,
                out.idx(v(b), v(h), v(si), i2),
                add(mul(sn, x1), mul(c, x2)),
            ),
        ];
        let mut body = vec![for_(ii, half, inner)];
        if rot < hd {
            let dd = k.var(Ty::I64);
            body.push(for_(
                dd,
                hd - rot,
                vec![store(
                    out.buf,
                    out.idx(v(b), v(h), v(si), add(v(dd), int(rot))),
                    view.at(v(b), v(h), v(si), add(v(dd), int(rot))),
                )],
            ));
        }
        k.body = vec![for_(b, bsz, vec![for_(si, seq, vec![for_(h, nh, body)])])];
        lw.push(k);
        Ok(())
    }
}
