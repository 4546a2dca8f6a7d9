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
    lower::register(r);
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

// ---------------------------------------------------------------------------------------
// Lowering to kernel IR. Every op is viewed as X reshaped to some `shape` with a set of
// reduced axes: one kernel loops over the kept positions and, for each, runs statistics
// passes and a write pass over the reduced axes. Statistics are in f64.

mod lower {
    use super::{eps, stash_dtype};
    use crate::ensure;
    use crate::ir::{DType, OpResult, Tensor};
    use crate::kir::build::*;
    use crate::kir::{BinOp, CmpOp, Expr, Kernel, MathFn, Stmt, Ty, UnOp, VarId};
    use crate::ops::lowering::{broadcast_strides, index, strides, LowerCtx, TensorRef};
    use crate::ops::util::{axes, axis};
    use crate::ops::{Lowering, Registry};

    fn set(var: VarId, e: Expr) -> Stmt {
        Stmt::Set { var, value: e }
    }
    fn to64(e: Expr) -> Expr {
        Expr::cast(Ty::F64, e)
    }

    /// X viewed as `shape` with reduced axes.
    struct View {
        shape: Vec<usize>,
        vars: Vec<VarId>,
        kept: Vec<(VarId, usize)>,
        red: Vec<(VarId, usize)>,
        /// Number of reduced elements.
        cnt: usize,
    }

    impl View {
        fn new(k: &mut Kernel, shape: &[usize], red: &[usize]) -> View {
            let vars: Vec<VarId> = shape.iter().map(|_| k.var(Ty::I64)).collect();
            let mut kept = Vec::new();
            let mut rd = Vec::new();
            for (d, &n) in shape.iter().enumerate() {
                if red.contains(&d) {
                    rd.push((vars[d], n));
                } else {
                    kept.push((vars[d], n));
                }
            }
            View {
                shape: shape.to_vec(),
                cnt: red.iter().map(|&d| shape[d]).product(),
                vars,
                kept,
                red: rd,
            }
        }
        /// Flat index into a tensor of the view's shape.
        fn idx(&self) -> Expr {
            index(&self.vars, &strides(&self.shape))
        }
        /// Index of a parameter of shape `ps` broadcast to the view.
        fn pidx(&self, ps: &[usize]) -> Expr {
            index(&self.vars, &broadcast_strides(ps, &self.shape))
        }
        /// Flat index over the kept dims.
        fn kidx(&self) -> Expr {
            let vars: Vec<VarId> = self.kept.iter().map(|x| x.0).collect();
            let ext: Vec<usize> = self.kept.iter().map(|x| x.1).collect();
            index(&vars, &strides(&ext))
        }
        /// `acc = sum over reduced dims of term`.
        fn sum(&self, acc: VarId, term: Expr) -> Vec<Stmt> {
            self.sum_as(acc, term, Ty::F64)
        }
        /// [`View::sum`] with an accumulator of type `ty`.
        fn sum_as(&self, acc: VarId, term: Expr, ty: Ty) -> Vec<Stmt> {
            let mut s = vec![set(acc, Expr::f(0.0, ty))];
            s.extend(loops(&self.red, vec![set(acc, add(v(acc), term))]));
            s
        }
        fn over_red(&self, body: Vec<Stmt>) -> Vec<Stmt> {
            loops(&self.red, body)
        }
        fn finish(&self, k: &mut Kernel, body: Vec<Stmt>) {
            k.body = loops(&self.kept, body);
        }
    }

    fn float_x(lw: &LowerCtx) -> OpResult<TensorRef> {
        let x = lw.input(0)?.clone();
        ensure!(x.ty().compute().is_float(), "input of {}", x.ty());
        Ok(x)
    }

    fn store(t: &TensorRef, index: Expr, value: Expr) -> Stmt {
        Stmt::Store {
            buf: t.buf,
            index,
            value: Expr::cast(t.ty().compute(), value),
        }
    }

    /// Loads parameter `t` (shape `ps` aligned to the view) as f64.
    fn param(view: &View, t: &TensorRef, ps: &[usize]) -> Expr {
        to64(Expr::load(t.buf, view.pidx(ps)))
    }

    /// Shape of a per-channel parameter aligned to a view with channels at dim 1.
    fn ch_shape(t: &TensorRef, c: usize, rank: usize) -> OpResult<Vec<usize>> {
        let mut s = vec![1; rank];
        if t.len() != 1 {
            ensure!(
                t.len() == c,
                "parameter has {} values for {c} channels",
                t.len()
            );
            s[1] = c;
        }
        Ok(s)
    }

    /// Mean and inverse standard deviation passes; returns (statements, mean, inv).
    fn mean_inv(k: &mut Kernel, view: &View, xv: &Expr, eps: f64) -> (Vec<Stmt>, VarId, VarId) {
        mean_inv_as(k, view, xv, eps, Ty::F64)
    }

    /// [`mean_inv`] in type `ty` (`xv` of that type).
    fn mean_inv_as(
        k: &mut Kernel,
        view: &View,
        xv: &Expr,
        eps: f64,
        ty: Ty,
    ) -> (Vec<Stmt>, VarId, VarId) {
        let mean = k.var(ty);
        let inv = k.var(ty);
        let n = view.cnt as f64;
        let c = |x: f64| Expr::f(x, ty);
        let mut s = view.sum_as(mean, xv.clone(), ty);
        s.push(set(mean, div(v(mean), c(n))));
        let d = sub(xv.clone(), v(mean));
        s.extend(view.sum_as(inv, mul(d.clone(), d), ty));
        s.push(set(
            inv,
            div(c(1.0), Expr::un(UnOp::Sqrt, add(div(v(inv), c(n)), c(eps)))),
        ));
        (s, mean, inv)
    }

    /// Most elements an f32 instance or group norm sums in f32 (its statistics in f32,
    /// which the loops vectorise; past it, f64).
    const F32_STATS_MOST: usize = 1 << 16;

    /// The compute type of an instance or group norm of `count` elements per mean:
    /// f32 where the input, scale, bias and output all are (an f64 accumulator kept the
    /// loops scalar: InstanceNormalization of `[1, 64, 56, 56]` 0.85 ms against ONNX
    /// Runtime's 0.10), else f64.
    fn stats_ty(lw: &LowerCtx, count: usize) -> Ty {
        let f32s = lw.inputs.iter().flatten().all(|t| t.ty() == Ty::F32)
            && lw.outputs.iter().all(|t| t.ty() == Ty::F32);
        if f32s && count <= F32_STATS_MOST {
            Ty::F32
        } else {
            Ty::F64
        }
    }

    /// Loads `x` at `idx` in type `ty` (f32 loads as they are).
    fn load_as(x: &TensorRef, idx: Expr, ty: Ty) -> Expr {
        let e = Expr::load(x.buf, idx);
        if ty == Ty::F64 {
            to64(e)
        } else {
            e
        }
    }

    fn batch_norm(lw: &mut LowerCtx) -> OpResult<()> {
        let x = float_x(lw)?;
        ensure!(x.shape.len() >= 2, "X must have rank >= 2");
        let (n, c) = (x.shape[0], x.shape[1]);
        let sp: usize = x.shape[2..].iter().product();
        let training = if lw.op.opset >= 14 {
            lw.op.attrs.int("training_mode", 0)? != 0
        } else {
            lw.op.n_outputs > 1
        };
        let eps = eps(lw.op)?;
        let momentum = lw.op.attrs.float("momentum", 0.9)? as f64;
        let ins: Vec<TensorRef> = (1..5)
            .map(|i| lw.input(i).cloned())
            .collect::<OpResult<_>>()?;
        let outs = lw.outputs.clone();
        // Inference in f32 with a constant scale and variance: `(x - mean) * a + bias`
        // in f32, `a = scale / sqrt(var + eps)` per channel computed at compile time in
        // f64 (one f32 constant). The general form divides by a square root in f64 per
        // element: a standalone BatchNormalization (one not folded into a conv: after a
        // Concat or an Add, as in DenseNet) of 64 x 56 x 56 took 0.42 ms against ONNX
        // Runtime's 0.06.
        let all_f32 = std::iter::once(&x)
            .chain(&ins)
            .chain(outs.first())
            .all(|t| t.dtype == DType::F32);
        let pss: Vec<Vec<usize>> = ins
            .iter()
            .map(|t| ch_shape(t, c, 3))
            .collect::<OpResult<_>>()?;
        // One value, or one per channel (`ch_shape` checked which).
        let per_ch = |v: &[f64], ch: usize| v[if v.len() == 1 { 0 } else { ch }];
        let factor = match (lw.const_input(1), lw.const_input(4)) {
            (Ok(sc), Ok(var)) if !training && all_f32 => sc.to_f64_vec().zip(var.to_f64_vec()),
            _ => None,
        };
        let factor = match factor {
            Some((sc, var)) => {
                let a: Vec<f32> = (0..c)
                    .map(|ch| (per_ch(&sc, ch) / (per_ch(&var, ch) + eps).sqrt()) as f32)
                    .collect();
                Some(lw.constant("bn_factor", &Tensor::from_vec(&[c], a))?)
            }
            None => None,
        };
        let mut k = lw.kernel("");
        let shape = [n, c, sp];
        let view = View::new(&mut k, &shape, if training { &[0, 2] } else { &[] });
        if let Some(a) = factor {
            let p32 = |buf: usize, ps: &[usize]| Expr::load(buf, view.pidx(ps));
            let xf = Expr::load(x.buf, view.idx());
            let y = add(
                mul(sub(xf, p32(ins[2].buf, &pss[2])), p32(a, &[1, c, 1])),
                p32(ins[1].buf, &pss[1]),
            );
            let body = view.over_red(vec![store(&outs[0], view.idx(), y)]);
            view.finish(&mut k, body);
            lw.push(k);
            return Ok(());
        }
        let p = |i: usize| param(&view, &ins[i], &pss[i]);
        let xv = to64(Expr::load(x.buf, view.idx()));
        let mut body = Vec::new();
        let (mean, var) = if training {
            let mean = k.var(Ty::F64);
            let var = k.var(Ty::F64);
            body.extend(view.sum(mean, xv.clone()));
            body.push(set(mean, div(v(mean), f64c(view.cnt as f64))));
            let d = sub(xv.clone(), v(mean));
            body.extend(view.sum(var, mul(d.clone(), d)));
            body.push(set(var, div(v(var), f64c(view.cnt as f64))));
            (v(mean), v(var))
        } else {
            (p(2), p(3))
        };
        let y = add(
            div(
                mul(p(0), sub(xv, mean.clone())),
                Expr::un(UnOp::Sqrt, add(var.clone(), f64c(eps))),
            ),
            p(1),
        );
        body.extend(view.over_red(vec![store(&outs[0], view.idx(), y)]));
        if training {
            // Channel-indexed outputs (the kept var is the channel).
            let ci = view.kidx();
            let run = |old: Expr, new: Expr| {
                add(mul(old, f64c(momentum)), mul(new, f64c(1.0 - momentum)))
            };
            // Running statistics read the inputs at the channel (not broadcast over N/SP:
            // the reduced vars are out of their loops here, so index by channel only).
            let mean_in = to64(Expr::load(
                ins[2].buf,
                if ins[2].len() == 1 {
                    Expr::Int(0)
                } else {
                    ci.clone()
                },
            ));
            let var_in = to64(Expr::load(
                ins[3].buf,
                if ins[3].len() == 1 {
                    Expr::Int(0)
                } else {
                    ci.clone()
                },
            ));
            let vals = [
                run(mean_in, mean.clone()),
                run(var_in, var.clone()),
                mean,
                var,
            ];
            for (o, val) in outs.iter().skip(1).zip(vals) {
                body.push(store(o, ci.clone(), val));
            }
        }
        view.finish(&mut k, body);
        lw.push(k);
        Ok(())
    }

    fn instance_norm(lw: &mut LowerCtx) -> OpResult<()> {
        let x = float_x(lw)?;
        ensure!(x.shape.len() >= 2, "X must have rank >= 2");
        let (n, c) = (x.shape[0], x.shape[1]);
        let sp: usize = x.shape[2..].iter().product();
        let (s, b) = (lw.input(1)?.clone(), lw.input(2)?.clone());
        let out = lw.outputs[0].clone();
        let eps = eps(lw.op)?;
        let mut k = lw.kernel("");
        let view = View::new(&mut k, &[n, c, sp], &[2]);
        let ty = stats_ty(lw, sp);
        let xv = load_as(&x, view.idx(), ty);
        let (mut body, mean, inv) = mean_inv_as(&mut k, &view, &xv, eps, ty);
        let y = add(
            mul(
                mul(sub(xv, v(mean)), v(inv)),
                load_as(&s, view.pidx(&ch_shape(&s, c, 3)?), ty),
            ),
            load_as(&b, view.pidx(&ch_shape(&b, c, 3)?), ty),
        );
        body.extend(view.over_red(vec![store(&out, view.idx(), y)]));
        view.finish(&mut k, body);
        lw.push(k);
        Ok(())
    }

    fn group_norm(lw: &mut LowerCtx) -> OpResult<()> {
        let x = float_x(lw)?;
        ensure!(x.shape.len() >= 2, "X must have rank >= 2");
        let (n, c) = (x.shape[0], x.shape[1]);
        let sp: usize = x.shape[2..].iter().product();
        let g = lw.op.attrs.req_int("num_groups")?;
        ensure!(
            g >= 1 && c % g as usize == 0,
            "num_groups {g} must divide {c}"
        );
        let g = g as usize;
        let cpg = c / g;
        let (s, b) = (lw.input(1)?.clone(), lw.input(2)?.clone());
        let per_group = lw.op.opset < 21 && s.len() == g && b.len() == g;
        let pshape = |t: &TensorRef| -> OpResult<Vec<usize>> {
            Ok(if t.len() == 1 {
                vec![1, 1, 1, 1]
            } else if per_group {
                vec![1, g, 1, 1]
            } else {
                ensure!(
                    t.len() == c,
                    "parameter has {} values for {c} channels",
                    t.len()
                );
                vec![1, g, cpg, 1]
            })
        };
        let out = lw.outputs[0].clone();
        let eps = eps(lw.op)?;
        let mut k = lw.kernel("");
        let view = View::new(&mut k, &[n, g, cpg, sp], &[2, 3]);
        let ty = stats_ty(lw, cpg * sp);
        let xv = load_as(&x, view.idx(), ty);
        let (mut body, mean, inv) = mean_inv_as(&mut k, &view, &xv, eps, ty);
        let y = add(
            mul(
                mul(sub(xv, v(mean)), v(inv)),
                load_as(&s, view.pidx(&pshape(&s)?), ty),
            ),
            load_as(&b, view.pidx(&pshape(&b)?), ty),
        );
        body.extend(view.over_red(vec![store(&out, view.idx(), y)]));
        view.finish(&mut k, body);
        lw.push(k);
        Ok(())
    }

    /// Checks that `ps` broadcasts to `shape` (numpy rules, no growth).
    fn broadcasts(ps: &[usize], shape: &[usize]) -> bool {
        ps.len() <= shape.len()
            && ps
                .iter()
                .rev()
                .zip(shape.iter().rev())
                .all(|(&a, &b)| a == 1 || a == b)
    }

    fn layer_norm(lw: &mut LowerCtx) -> OpResult<()> {
        let x = float_x(lw)?;
        let s = lw.input(1)?.clone();
        let b = lw.opt_input(2).cloned();
        let shape = x.shape.clone();
        let ax = axis(lw.op.attrs.int("axis", -1)?, shape.len())?;
        let eps = eps(lw.op)?;
        ensure!(
            broadcasts(&s.shape, &shape),
            "scale does not broadcast to X"
        );
        if let Some(b) = &b {
            ensure!(broadcasts(&b.shape, &shape), "bias does not broadcast to X");
        }
        if lw.op.n_outputs > 1 {
            stash_dtype(lw.op)?;
        }
        let outs = lw.outputs.clone();
        let cnt: usize = shape[ax..].iter().product();
        let f32s = |t: &TensorRef| t.dtype == crate::ir::DType::F32;
        if outs.len() == 1
            && f32s(&x)
            && f32s(&outs[0])
            && f32s(&s)
            && s.len() == cnt
            && b.as_ref().is_none_or(|b| f32s(b) && b.len() == cnt)
            && cnt > 0
        {
            let rows = x.len() / cnt;
            let k = layer_norm32(lw, &x, &s, b.as_ref(), &outs[0], rows, cnt, eps);
            lw.push(k);
            return Ok(());
        }
        let red: Vec<usize> = (ax..shape.len()).collect();
        let mut k = lw.kernel("");
        let view = View::new(&mut k, &shape, &red);
        let xv = to64(Expr::load(x.buf, view.idx()));
        let (mut body, mean, inv) = mean_inv(&mut k, &view, &xv, eps);
        let mut y = mul(mul(sub(xv, v(mean)), v(inv)), param(&view, &s, &s.shape));
        if let Some(b) = &b {
            y = add(y, param(&view, b, &b.shape));
        }
        body.extend(view.over_red(vec![store(&outs[0], view.idx(), y)]));
        if let Some(o) = outs.get(1) {
            body.push(store(o, view.kidx(), v(mean)));
        }
        if let Some(o) = outs.get(2) {
            body.push(store(o, view.kidx(), v(inv)));
        }
        view.finish(&mut k, body);
        lw.push(k);
        Ok(())
    }

    /// f32 LayerNormalization over contiguous rows of `cnt` elements with per-element
    /// scale and bias, in f32: the mean, the variance of the deviations (two passes, so
    /// no cancellation), then the normalised row. All three loops vectorise (the first
    /// two as reductions).
    #[allow(clippy::too_many_arguments)]
    fn layer_norm32(
        lw: &mut LowerCtx,
        x: &TensorRef,
        s: &TensorRef,
        b: Option<&TensorRef>,
        out: &TensorRef,
        rows: usize,
        cnt: usize,
        eps: f64,
    ) -> Kernel {
        let mut k = lw.kernel("");
        let (r, j) = (k.var(Ty::I64), k.var(Ty::I64));
        let (mean, var) = (k.var(Ty::F32), k.var(Ty::F32));
        let f = |x: f64| Expr::f(x, Ty::F32);
        let at = Expr::add(Expr::mul(v(r), Expr::Int(cnt as i64)), v(j));
        let xv = Expr::load(x.buf, at.clone());
        let d = sub(xv, v(mean));
        let mut y = mul(mul(d.clone(), v(var)), Expr::load(s.buf, v(j)));
        if let Some(b) = b {
            y = add(y, Expr::load(b.buf, v(j)));
        }
        let row = vec![
            set(mean, f(0.0)),
            for_(
                j,
                cnt,
                vec![set(mean, add(v(mean), Expr::load(x.buf, at.clone())))],
            ),
            set(mean, div(v(mean), f(cnt as f64))),
            set(var, f(0.0)),
            for_(j, cnt, vec![set(var, add(v(var), mul(d.clone(), d)))]),
            set(
                var,
                div(
                    f(1.0),
                    Expr::un(UnOp::Sqrt, add(div(v(var), f(cnt as f64)), f(eps))),
                ),
            ),
            for_(
                j,
                cnt,
                vec![Stmt::Store {
                    buf: out.buf,
                    index: at,
                    value: y,
                }],
            ),
        ];
        k.body = vec![for_(r, rows, row)];
        k
    }

    fn rms_norm(lw: &mut LowerCtx) -> OpResult<()> {
        let x = float_x(lw)?;
        let s = lw.input(1)?.clone();
        let shape = x.shape.clone();
        let ax = axis(lw.op.attrs.int("axis", -1)?, shape.len())?;
        stash_dtype(lw.op)?;
        let eps = eps(lw.op)?;
        ensure!(
            broadcasts(&s.shape, &shape),
            "scale does not broadcast to X"
        );
        let out = lw.outputs[0].clone();
        let red: Vec<usize> = (ax..shape.len()).collect();
        let mut k = lw.kernel("");
        let view = View::new(&mut k, &shape, &red);
        let xv = to64(Expr::load(x.buf, view.idx()));
        let inv = k.var(Ty::F64);
        let mut body = view.sum(inv, mul(xv.clone(), xv.clone()));
        body.push(set(
            inv,
            div(
                f64c(1.0),
                Expr::un(
                    UnOp::Sqrt,
                    add(div(v(inv), f64c(view.cnt as f64)), f64c(eps)),
                ),
            ),
        ));
        let y = mul(mul(xv, v(inv)), param(&view, &s, &s.shape));
        body.extend(view.over_red(vec![store(&out, view.idx(), y)]));
        view.finish(&mut k, body);
        lw.push(k);
        Ok(())
    }

    fn lp_norm(lw: &mut LowerCtx) -> OpResult<()> {
        let x = float_x(lw)?;
        let shape = x.shape.clone();
        let ax = axis(lw.op.attrs.int("axis", -1)?, shape.len())?;
        let p = lw.op.attrs.int("p", 2)?;
        ensure!(p == 1 || p == 2, "p must be 1 or 2, got {p}");
        let outer: usize = shape[..ax].iter().product();
        let len = shape.get(ax).copied().unwrap_or(1);
        let inner: usize = shape.get(ax + 1..).map_or(1, |s| s.iter().product());
        let out = lw.outputs[0].clone();
        let mut k = lw.kernel("");
        let view = View::new(&mut k, &[outer, len, inner], &[1]);
        let xv = to64(Expr::load(x.buf, view.idx()));
        let norm = k.var(Ty::F64);
        let term = if p == 1 {
            Expr::un(UnOp::Abs, xv.clone())
        } else {
            mul(xv.clone(), xv.clone())
        };
        let mut body = view.sum(norm, term);
        if p == 2 {
            body.push(set(norm, Expr::un(UnOp::Sqrt, v(norm))));
        }
        let y = Expr::select(
            Expr::cmp(CmpOp::Eq, v(norm), f64c(0.0)),
            f64c(0.0),
            div(xv, v(norm)),
        );
        body.extend(view.over_red(vec![store(&out, view.idx(), y)]));
        view.finish(&mut k, body);
        lw.push(k);
        Ok(())
    }

    fn mvn(lw: &mut LowerCtx) -> OpResult<()> {
        let x = float_x(lw)?;
        let shape = x.shape.clone();
        let red = axes(&lw.op.attrs.ints("axes", &[0, 2, 3])?, shape.len())?;
        let out = lw.outputs[0].clone();
        let mut k = lw.kernel("");
        let view = View::new(&mut k, &shape, &red);
        let xv = to64(Expr::load(x.buf, view.idx()));
        let m = k.var(Ty::F64);
        let m2 = k.var(Ty::F64);
        let n = view.cnt as f64;
        let mut body = view.sum(m, xv.clone());
        body.push(set(m, div(v(m), f64c(n))));
        body.extend(view.sum(m2, mul(xv.clone(), xv.clone())));
        body.push(set(m2, div(v(m2), f64c(n))));
        // std = sqrt(E[x^2] - E[x]^2) + 1e-9, as the reference.
        body.push(set(
            m2,
            add(
                Expr::un(UnOp::Sqrt, sub(v(m2), mul(v(m), v(m)))),
                f64c(1e-9),
            ),
        ));
        let y = div(sub(xv, v(m)), v(m2));
        body.extend(view.over_red(vec![store(&out, view.idx(), y)]));
        view.finish(&mut k, body);
        lw.push(k);
        Ok(())
    }

    fn lrn(lw: &mut LowerCtx) -> OpResult<()> {
        let x = float_x(lw)?;
        ensure!(x.shape.len() >= 2, "X must have rank >= 2");
        let (n, c) = (x.shape[0], x.shape[1]);
        let sp: usize = x.shape[2..].iter().product();
        let alpha = lw.op.attrs.float("alpha", 1e-4)? as f64;
        let beta = lw.op.attrs.float("beta", 0.75)? as f64;
        let bias = lw.op.attrs.float("bias", 1.0)? as f64;
        let size = lw.op.attrs.req_int("size")?;
        ensure!(size >= 1, "size must be positive, got {size}");
        let lo = (size - 1) / 2;
        let out = lw.outputs[0].clone();
        let mut k = lw.kernel("");
        let view = View::new(&mut k, &[n, c, sp], &[]);
        let (nv, cv, sv) = (view.vars[0], view.vars[1], view.vars[2]);
        let j = k.var(Ty::I64);
        let sq = k.var(Ty::F64);
        let cj = add(sub(v(cv), Expr::Int(lo)), v(j));
        let xj = to64(Expr::load(
            x.buf,
            add(
                mul(
                    add(mul(v(nv), Expr::Int(c as i64)), cj.clone()),
                    Expr::Int(sp as i64),
                ),
                v(sv),
            ),
        ));
        let valid = Expr::bin(
            BinOp::And,
            Expr::cmp(CmpOp::Ge, cj.clone(), Expr::Int(0)),
            Expr::cmp(CmpOp::Lt, cj, Expr::Int(c as i64)),
        );
        let xv = to64(Expr::load(x.buf, view.idx()));
        let body = vec![
            set(sq, f64c(0.0)),
            Stmt::For {
                var: j,
                extent: size as u64,
                body: vec![Stmt::If {
                    cond: valid,
                    then: vec![set(sq, add(v(sq), mul(xj.clone(), xj)))],
                    els: vec![],
                }],
            },
            store(
                &out,
                view.idx(),
                div(
                    xv,
                    Expr::call(
                        MathFn::Pow,
                        vec![
                            add(f64c(bias), mul(f64c(alpha / size as f64), v(sq))),
                            f64c(beta),
                        ],
                    ),
                ),
            ),
        ];
        view.finish(&mut k, body);
        lw.push(k);
        Ok(())
    }

    pub fn register(r: &mut Registry) {
        r.lower("BatchNormalization", Lowering::Custom(batch_norm));
        r.lower("InstanceNormalization", Lowering::Custom(instance_norm));
        r.lower("LayerNormalization", Lowering::Custom(layer_norm));
        r.lower("GroupNormalization", Lowering::Custom(group_norm));
        r.lower("RMSNormalization", Lowering::Custom(rms_norm));
        r.lower("LRN", Lowering::Custom(lrn));
        r.lower("LpNormalization", Lowering::Custom(lp_norm));
        r.lower("MeanVarianceNormalization", Lowering::Custom(mvn));
    }
}
