//! normalization ops: BatchNormalization, InstanceNormalization, LayerNormalization,
//! GroupNormalization, RMSNormalization, LRN, LpNormalization, MeanVarianceNormalization.
//! Statistics are computed in f64 and results rounded back to the input dtype.

use super::util::{axes, axis, f64s, input, opt_input, out, outs, zip_broadcast};
use super::{OpCtx, Registry};
use crate::ensure;
use crate::ir::{DType, OpError, OpResult, Tensor, Value};
use ndarray::{ArrayD, Axis, IxDyn};

pub fn register(r: &mut Registry) {
    r.add("BatchNormalization", batch_norm);
    r.add("InstanceNormalization", instance_norm);
    r.add("LayerNormalization", layer_norm);
    r.add("GroupNormalization", group_norm);
    r.add("RMSNormalization", rms_norm);
    r.add("LRN", lrn);
    r.add("LpNormalization", lp_norm);
    r.add("MeanVarianceNormalization", mvn);
}

fn float_input<'a>(ins: &[Option<&'a Value>], i: usize) -> OpResult<&'a Tensor> {
    let t = input(ins, i)?;
    ensure!(
        t.dtype().is_float(),
        "input {i} must be a float tensor, got {}",
        t.dtype()
    );
    Ok(t)
}

fn flat(t: &Tensor) -> OpResult<Vec<f64>> {
    Ok(f64s(t)?.iter().copied().collect())
}

fn tensor(dt: DType, shape: &[usize], v: Vec<f64>) -> Tensor {
    Tensor::from_f64(
        dt,
        ArrayD::from_shape_vec(IxDyn(shape), v).expect("sized"),
        false,
    )
}

/// A per-channel parameter of `c` values (a single value is broadcast).
fn per_channel(t: &Tensor, c: usize, what: &str) -> OpResult<Vec<f64>> {
    let v = flat(t)?;
    if v.len() == 1 && c != 1 {
        return Ok(vec![v[0]; c]);
    }
    ensure!(
        v.len() == c,
        "{what} has {} values but there are {c} channels",
        v.len()
    );
    Ok(v)
}

fn eps(ctx: &OpCtx) -> OpResult<f64> {
    Ok(ctx.attrs.float("epsilon", 1e-5)? as f64)
}

/// (N, C, spatial size) of an input of rank >= 2.
fn ncs(x: &Tensor) -> OpResult<(usize, usize, usize)> {
    let s = x.shape();
    ensure!(
        s.len() >= 2,
        "X must have rank >= 2 (N, C, ...), got shape {s:?}"
    );
    Ok((s[0], s[1], s[2..].iter().product()))
}

fn batch_norm(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let (n, c, sp) = ncs(x)?;
    let scale = per_channel(input(ins, 1)?, c, "scale")?;
    let bias = per_channel(input(ins, 2)?, c, "B")?;
    let mean_t = input(ins, 3)?;
    let mean = per_channel(mean_t, c, "input_mean")?;
    let var = per_channel(input(ins, 4)?, c, "input_var")?;
    let eps = eps(ctx)?;
    let training = if ctx.opset >= 14 {
        ctx.attrs.int("training_mode", 0)? != 0
    } else {
        ctx.n_outputs > 1
    };
    let xv = flat(x)?;
    let (use_mean, use_var) = if training {
        let cnt = (n * sp) as f64;
        let mut m = vec![0f64; c];
        let mut v = vec![0f64; c];
        for ci in 0..c {
            let mut s = 0.0;
            for ni in 0..n {
                s += xv[(ni * c + ci) * sp..][..sp].iter().sum::<f64>();
            }
            m[ci] = s / cnt;
            let mut q = 0.0;
            for ni in 0..n {
                q += xv[(ni * c + ci) * sp..][..sp]
                    .iter()
                    .map(|&a| (a - m[ci]) * (a - m[ci]))
                    .sum::<f64>();
            }
            v[ci] = q / cnt;
        }
        (m, v)
    } else {
        (mean.clone(), var.clone())
    };
    let mut y = xv;
    for (i, v) in y.iter_mut().enumerate() {
        let ci = (i / sp) % c;
        *v = scale[ci] * (*v - use_mean[ci]) / (use_var[ci] + eps).sqrt() + bias[ci];
    }
    let yt = tensor(x.dtype(), x.shape(), y);
    if !training {
        return out(yt);
    }
    let momentum = ctx.attrs.float("momentum", 0.9)? as f64;
    let mdt = mean_t.dtype();
    let run_mean: Vec<f64> = (0..c)
        .map(|i| mean[i] * momentum + use_mean[i] * (1.0 - momentum))
        .collect();
    let run_var: Vec<f64> = (0..c)
        .map(|i| var[i] * momentum + use_var[i] * (1.0 - momentum))
        .collect();
    let mut res = vec![yt, tensor(mdt, &[c], run_mean), tensor(mdt, &[c], run_var)];
    if ctx.opset < 14 {
        res.push(tensor(mdt, &[c], use_mean));
        res.push(tensor(mdt, &[c], use_var));
    }
    res.truncate(ctx.n_outputs.max(1));
    outs(res)
}

/// Normalises each contiguous block of `len` values to zero mean and unit variance.
fn normalize_blocks(v: &mut [f64], len: usize, eps: f64) {
    if len == 0 {
        return;
    }
    for b in v.chunks_mut(len) {
        let m = b.iter().sum::<f64>() / len as f64;
        let var = b.iter().map(|&a| (a - m) * (a - m)).sum::<f64>() / len as f64;
        let inv = 1.0 / (var + eps).sqrt();
        b.iter_mut().for_each(|a| *a = (*a - m) * inv);
    }
}

fn instance_norm(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let (_, c, sp) = ncs(x)?;
    let scale = per_channel(input(ins, 1)?, c, "scale")?;
    let bias = per_channel(input(ins, 2)?, c, "B")?;
    let mut y = flat(x)?;
    normalize_blocks(&mut y, sp, eps(ctx)?);
    for (i, v) in y.iter_mut().enumerate() {
        let ci = (i / sp.max(1)) % c;
        *v = *v * scale[ci] + bias[ci];
    }
    out(tensor(x.dtype(), x.shape(), y))
}

fn group_norm(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let (_, c, sp) = ncs(x)?;
    let g = ctx.attrs.req_int("num_groups")?;
    ensure!(
        g >= 1 && c % g as usize == 0,
        "num_groups {g} must divide the {c} channels"
    );
    let g = g as usize;
    let cpg = c / g;
    let st = input(ins, 1)?;
    let bt = input(ins, 2)?;
    // Opset 18 has one scale/bias per group, opset 21 one per channel.
    let per_group = ctx.opset < 21 && st.len() == g && bt.len() == g;
    let (scale, bias) = if per_group {
        let s = per_channel(st, g, "scale")?;
        let b = per_channel(bt, g, "bias")?;
        (
            (0..c).map(|i| s[i / cpg]).collect::<Vec<_>>(),
            (0..c).map(|i| b[i / cpg]).collect::<Vec<_>>(),
        )
    } else {
        (per_channel(st, c, "scale")?, per_channel(bt, c, "bias")?)
    };
    let mut y = flat(x)?;
    normalize_blocks(&mut y, cpg * sp, eps(ctx)?);
    for (i, v) in y.iter_mut().enumerate() {
        let ci = (i / sp.max(1)) % c;
        *v = *v * scale[ci] + bias[ci];
    }
    out(tensor(x.dtype(), x.shape(), y))
}

/// Multiplies `y` (shape of X) by `scale` and adds `bias`, broadcasting both to X.
fn scale_shift(y: ArrayD<f64>, scale: &Tensor, bias: Option<&Tensor>) -> OpResult<ArrayD<f64>> {
    let shape = y.shape().to_vec();
    let mut r = zip_broadcast(&y, &f64s(scale)?, |a, b| a * b)?;
    if let Some(b) = bias {
        r = zip_broadcast(&r, &f64s(b)?, |a, b| a + b)?;
    }
    ensure!(
        r.shape() == shape.as_slice(),
        "scale/bias shapes {:?} / {:?} do not broadcast to X's shape {shape:?}",
        scale.shape(),
        bias.map(|b| b.shape().to_vec())
    );
    Ok(r)
}

fn stash_dtype(ctx: &OpCtx) -> OpResult<DType> {
    let st = ctx.attrs.int("stash_type", 1)?;
    let dt = DType::from_onnx(st as i32)
        .ok_or_else(|| OpError::new(format!("unknown stash_type {st}")))?;
    ensure!(dt.is_float(), "stash_type must be a float type, got {dt}");
    Ok(dt)
}

fn layer_norm(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let scale = input(ins, 1)?;
    let bias = opt_input(ins, 2)?;
    let shape = x.shape().to_vec();
    let ax = axis(ctx.attrs.int("axis", -1)?, shape.len())?;
    let eps = eps(ctx)?;
    let rows: usize = shape[..ax].iter().product();
    let cols: usize = shape[ax..].iter().product();
    let mut y = flat(x)?;
    let mut means = vec![0f64; rows];
    let mut invs = vec![0f64; rows];
    if cols > 0 {
        for (r, b) in y.chunks_mut(cols).enumerate() {
            let m = b.iter().sum::<f64>() / cols as f64;
            let var = b.iter().map(|&a| (a - m) * (a - m)).sum::<f64>() / cols as f64;
            let inv = 1.0 / (var + eps).sqrt();
            b.iter_mut().for_each(|a| *a = (*a - m) * inv);
            means[r] = m;
            invs[r] = inv;
        }
    }
    let ya = ArrayD::from_shape_vec(IxDyn(&shape), y).expect("sized");
    let ya = scale_shift(ya, scale, bias)?;
    let mut res = vec![Tensor::from_f64(x.dtype(), ya, false)];
    if ctx.n_outputs > 1 {
        let sdt = stash_dtype(ctx)?;
        let mut rshape = shape[..ax].to_vec();
        rshape.extend(std::iter::repeat_n(1, shape.len() - ax));
        res.push(tensor(sdt, &rshape, means));
        res.push(tensor(sdt, &rshape, invs));
        res.truncate(ctx.n_outputs);
    }
    outs(res)
}

fn rms_norm(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let scale = input(ins, 1)?;
    let shape = x.shape().to_vec();
    let ax = axis(ctx.attrs.int("axis", -1)?, shape.len())?;
    stash_dtype(ctx)?;
    let eps = eps(ctx)?;
    let cols: usize = shape[ax..].iter().product();
    let mut y = flat(x)?;
    if cols > 0 {
        for b in y.chunks_mut(cols) {
            let ms = b.iter().map(|a| a * a).sum::<f64>() / cols as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            b.iter_mut().for_each(|a| *a *= inv);
        }
    }
    let ya = ArrayD::from_shape_vec(IxDyn(&shape), y).expect("sized");
    let ya = scale_shift(ya, scale, None)?;
    out(Tensor::from_f64(x.dtype(), ya, false))
}

fn lrn(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let (n, c, sp) = ncs(x)?;
    let alpha = ctx.attrs.float("alpha", 1e-4)? as f64;
    let beta = ctx.attrs.float("beta", 0.75)? as f64;
    let bias = ctx.attrs.float("bias", 1.0)? as f64;
    let size = ctx.attrs.req_int("size")?;
    ensure!(size >= 1, "size must be positive, got {size}");
    let lo = (size - 1) / 2; // floor
    let hi = size - 1 - lo; // ceil
    let xv = flat(x)?;
    let mut y = vec![0f64; xv.len()];
    for ni in 0..n {
        for ci in 0..c {
            let b = (ci as i64 - lo).max(0) as usize;
            let e = ((ci as i64 + hi) as usize).min(c.saturating_sub(1));
            for si in 0..sp {
                let mut sq = 0.0;
                for cj in b..=e {
                    let v = xv[(ni * c + cj) * sp + si];
                    sq += v * v;
                }
                let i = (ni * c + ci) * sp + si;
                y[i] = xv[i] / (bias + alpha / size as f64 * sq).powf(beta);
            }
        }
    }
    out(tensor(x.dtype(), x.shape(), y))
}

fn lp_norm(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let shape = x.shape().to_vec();
    let ax = axis(ctx.attrs.int("axis", -1)?, shape.len())?;
    let p = ctx.attrs.int("p", 2)?;
    ensure!(p == 1 || p == 2, "p must be 1 or 2, got {p}");
    let outer: usize = shape[..ax].iter().product();
    let len = shape.get(ax).copied().unwrap_or(1);
    let inner: usize = shape.get(ax + 1..).map_or(1, |s| s.iter().product());
    let mut y = flat(x)?;
    for o in 0..outer {
        for i in 0..inner {
            let idx = |j: usize| (o * len + j) * inner + i;
            let norm = if p == 1 {
                (0..len).map(|j| y[idx(j)].abs()).sum::<f64>()
            } else {
                (0..len).map(|j| y[idx(j)] * y[idx(j)]).sum::<f64>().sqrt()
            };
            for j in 0..len {
                let k = idx(j);
                y[k] = if norm == 0.0 { 0.0 } else { y[k] / norm };
            }
        }
    }
    out(tensor(x.dtype(), &shape, y))
}

/// Mean over `axes`, keeping the reduced dims as 1.
fn mean_keep(a: &ArrayD<f64>, ax: &[usize]) -> ArrayD<f64> {
    let mut r = a.clone();
    let mut cnt = 1usize;
    for &i in ax {
        cnt *= a.shape()[i];
        r = r.sum_axis(Axis(i)).insert_axis(Axis(i));
    }
    r.mapv(|v| v / cnt as f64)
}

fn mvn(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let a = f64s(x)?;
    let ax = axes(&ctx.attrs.ints("axes", &[0, 2, 3])?, a.ndim())?;
    let m = mean_keep(&a, &ax);
    let m2 = mean_keep(&a.mapv(|v| v * v), &ax);
    let std = zip_broadcast(&m2, &m, |q, m| (q - m * m).sqrt() + 1e-9)?;
    let centered = zip_broadcast(&a, &m, |v, m| v - m)?;
    let y = zip_broadcast(&centered, &std, |c, s| c / s)?;
    out(Tensor::from_f64(x.dtype(), y, false))
}
