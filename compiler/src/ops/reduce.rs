//! Reductions (ReduceSum, ReduceMean, ...), index reductions (ArgMax, ArgMin, TopK),
//! scans (CumSum, CumProd), the softmax family (Softmax, LogSoftmax, Hardmax) and the
//! losses built on them (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss).

use super::util::{axis, f64s, i128s, input, ints, opt_input, out, outs, scalar_i64};
use super::{OpCtx, Registry};
use crate::ir::{DType, OpResult, Tensor, Value};
use crate::{bail, ensure, try_map_data};
use ndarray::{ArrayD, IxDyn};
use std::cmp::Ordering;

pub fn register(r: &mut Registry) {
    r.add_shaped("ReduceSum", reduce_sum, &[1]);
    r.add_shaped("ReduceMean", reduce_mean, &[1]);
    r.add_shaped("ReduceMax", reduce_max, &[1]);
    r.add_shaped("ReduceMin", reduce_min, &[1]);
    r.add_shaped("ReduceProd", reduce_prod, &[1]);
    r.add_shaped("ReduceL1", reduce_l1, &[1]);
    r.add_shaped("ReduceL2", reduce_l2, &[1]);
    r.add_shaped("ReduceLogSum", reduce_log_sum, &[1]);
    r.add_shaped("ReduceLogSumExp", reduce_log_sum_exp, &[1]);
    r.add_shaped("ReduceSumSquare", reduce_sum_square, &[1]);
    r.add("ArgMax", argmax);
    r.add("ArgMin", argmin);
    r.add_shaped("TopK", topk, &[1]);
    r.add("CumSum", cumsum);
    r.add("CumProd", cumprod);
    r.add("Softmax", softmax);
    r.add("LogSoftmax", log_softmax);
    r.add("Hardmax", hardmax);
    r.add("NegativeLogLikelihoodLoss", nll_loss);
    r.add("SoftmaxCrossEntropyLoss", sce_loss);
    lower::register(r);
}

// ---------------------------------------------------------------------------------------
// Layout helpers

/// Elements in logical (row-major) order.
fn flat<T: Clone>(a: &ArrayD<T>) -> Vec<T> {
    match a.as_slice() {
        Some(s) => s.to_vec(),
        None => a.iter().cloned().collect(),
    }
}

fn from_flat<T>(shape: &[usize], v: Vec<T>) -> OpResult<ArrayD<T>> {
    ArrayD::from_shape_vec(IxDyn(shape), v)
        .map_err(|e| crate::ir::OpError::new(format!("internal shape error: {e}")))
}

/// (outer, n, inner) sizes when working along `ax`.
fn split3(shape: &[usize], ax: usize) -> (usize, usize, usize) {
    let outer = shape[..ax].iter().product();
    let n = shape.get(ax).copied().unwrap_or(1);
    let inner = shape[(ax + 1).min(shape.len())..].iter().product();
    (outer, n, inner)
}

// ---------------------------------------------------------------------------------------
// Reduce*

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
    L1,
    L2,
    LogSum,
    LogSumExp,
    SumSquare,
}

/// The axes to reduce: None for all, Some(empty) for none (noop_with_empty_axes).
fn reduce_axes(ctx: &OpCtx, ins: &[Option<&Value>], rank: usize) -> OpResult<Option<Vec<usize>>> {
    let given = match opt_input(ins, 1)? {
        Some(t) => Some(ints(t)?),
        None => ctx.attrs.get_ints("axes")?,
    };
    match given {
        Some(v) if !v.is_empty() => Ok(Some(super::util::axes(&v, rank.max(1))?)),
        _ => {
            if ctx.attrs.int("noop_with_empty_axes", 0)? != 0 {
                Ok(Some(vec![]))
            } else {
                Ok(None)
            }
        }
    }
}

/// Groups the elements so that each reduction's elements are contiguous.
struct Groups<T> {
    data: Vec<T>,
    groups: usize,
    size: usize,
    out_shape: Vec<usize>,
}

fn group<T: Clone>(a: &ArrayD<T>, axes: &Option<Vec<usize>>, keepdims: bool) -> Groups<T> {
    let rank = a.ndim();
    let red: Vec<bool> = (0..rank)
        .map(|i| match axes {
            None => true,
            Some(v) => v.contains(&i),
        })
        .collect();
    let shape = a.shape();
    let mut perm: Vec<usize> = (0..rank).filter(|&i| !red[i]).collect();
    perm.extend((0..rank).filter(|&i| red[i]));
    let groups: usize = (0..rank).filter(|&i| !red[i]).map(|i| shape[i]).product();
    let size: usize = (0..rank).filter(|&i| red[i]).map(|i| shape[i]).product();
    let mut out_shape = Vec::new();
    for i in 0..rank {
        if red[i] {
            if keepdims {
                out_shape.push(1);
            }
        } else {
            out_shape.push(shape[i]);
        }
    }
    let data = if perm.iter().enumerate().all(|(i, &p)| i == p) {
        flat(a)
    } else {
        a.view()
            .permuted_axes(IxDyn(&perm))
            .iter()
            .cloned()
            .collect()
    };
    Groups {
        data,
        groups,
        size,
        out_shape,
    }
}

fn run_groups<T: Clone, R>(g: &Groups<T>, f: impl Fn(&[T]) -> R) -> OpResult<ArrayD<R>> {
    let mut v = Vec::with_capacity(g.groups);
    for i in 0..g.groups {
        let s = &g.data[i * g.size..(i + 1) * g.size];
        v.push(f(s));
    }
    from_flat(&g.out_shape, v)
}

fn reduce_f64(kind: Kind, s: &[f64]) -> f64 {
    match kind {
        Kind::Sum => s.iter().sum(),
        Kind::Mean => s.iter().sum::<f64>() / s.len() as f64,
        Kind::Max => s.iter().fold(f64::NEG_INFINITY, |m, &x| {
            if x.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(x)
            }
        }),
        Kind::Min => s.iter().fold(f64::INFINITY, |m, &x| {
            if x.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.min(x)
            }
        }),
        Kind::Prod => s.iter().product(),
        Kind::L1 => s.iter().map(|x| x.abs()).sum(),
        Kind::L2 => s.iter().map(|x| x * x).sum::<f64>().sqrt(),
        Kind::LogSum => s.iter().sum::<f64>().ln(),
        Kind::LogSumExp => {
            let m = s.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            if m.is_finite() {
                m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
            } else {
                s.iter().map(|x| x.exp()).sum::<f64>().ln()
            }
        }
        Kind::SumSquare => s.iter().map(|x| x * x).sum(),
    }
}

fn reduce_i128(kind: Kind, s: &[i128], dt: DType) -> i128 {
    let (lo, hi) = dt
        .int_range()
        .unwrap_or((i64::MIN as i128, i64::MAX as i128));
    match kind {
        Kind::Sum => s.iter().fold(0i128, |a, &x| a.wrapping_add(x)),
        Kind::Max => s.iter().copied().max().unwrap_or(lo),
        Kind::Min => s.iter().copied().min().unwrap_or(hi),
        Kind::Prod => s.iter().fold(1i128, |a, &x| a.wrapping_mul(x)),
        Kind::L1 => s
            .iter()
            .fold(0i128, |a, &x| a.wrapping_add(x.wrapping_abs())),
        Kind::SumSquare => s
            .iter()
            .fold(0i128, |a, &x| a.wrapping_add(x.wrapping_mul(x))),
        // Not reached: the other kinds go through f64.
        _ => 0,
    }
}

fn reduce(kind: Kind, ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let dt = x.dtype();
    let axes = reduce_axes(ctx, ins, x.rank())?;
    let keepdims = ctx.attrs.int("keepdims", 1)? != 0;
    if dt == DType::Bool {
        let a = x.to_bool().unwrap_or_default();
        let g = group(&a, &axes, keepdims);
        let r = match kind {
            Kind::Max => run_groups(&g, |s| s.iter().any(|&b| b))?,
            Kind::Min => run_groups(&g, |s| s.iter().all(|&b| b))?,
            _ => bail!("{:?} is not defined for bool tensors", kind),
        };
        return out(Tensor::from_array(r));
    }
    let int_kind = matches!(
        kind,
        Kind::Sum | Kind::Max | Kind::Min | Kind::Prod | Kind::L1 | Kind::SumSquare
    );
    if dt.is_int() && int_kind {
        let a = i128s(x)?;
        let g = group(&a, &axes, keepdims);
        let r = run_groups(&g, |s| reduce_i128(kind, s, dt))?;
        return out(Tensor::from_i128(dt, r));
    }
    ensure!(dt.is_numeric(), "expected a numeric tensor, got {dt}");
    let a = f64s(x)?;
    let g = group(&a, &axes, keepdims);
    let r = run_groups(&g, |s| reduce_f64(kind, s))?;
    if dt.is_int() {
        // Integer results of float-valued reductions truncate toward zero.
        return out(Tensor::from_i128(dt, r.mapv(|v| v as i128)));
    }
    out(Tensor::from_f64(dt, r, false))
}

fn reduce_sum(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    reduce(Kind::Sum, ctx, ins)
}
fn reduce_mean(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    reduce(Kind::Mean, ctx, ins)
}
fn reduce_max(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    reduce(Kind::Max, ctx, ins)
}
fn reduce_min(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    reduce(Kind::Min, ctx, ins)
}
fn reduce_prod(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    reduce(Kind::Prod, ctx, ins)
}
fn reduce_l1(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    reduce(Kind::L1, ctx, ins)
}
fn reduce_l2(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    reduce(Kind::L2, ctx, ins)
}
fn reduce_log_sum(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    reduce(Kind::LogSum, ctx, ins)
}
fn reduce_log_sum_exp(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    reduce(Kind::LogSumExp, ctx, ins)
}
fn reduce_sum_square(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    reduce(Kind::SumSquare, ctx, ins)
}

// ---------------------------------------------------------------------------------------
// ArgMax / ArgMin

/// Index of the max (or min) of a lane; NaN wins (like NumPy), ties go to the first or
/// last occurrence.
fn pick<T: PartialOrd + Copy>(
    lane: impl Iterator<Item = T>,
    is_nan: impl Fn(T) -> bool,
    max: bool,
    last: bool,
) -> usize {
    let mut best: Option<(usize, T)> = None;
    for (j, x) in lane.enumerate() {
        let Some((_, b)) = best else {
            best = Some((j, x));
            continue;
        };
        let (xn, bn) = (is_nan(x), is_nan(b));
        let take = if bn {
            xn && last
        } else if xn {
            true
        } else if x == b {
            last
        } else if max {
            x > b
        } else {
            x < b
        };
        if take {
            best = Some((j, x));
        }
    }
    best.map(|(j, _)| j).unwrap_or(0)
}

fn arg_lanes<T: PartialOrd + Copy>(
    v: &[T],
    (outer, n, inner): (usize, usize, usize),
    is_nan: impl Fn(T) -> bool + Copy,
    max: bool,
    last: bool,
) -> Vec<i64> {
    let mut r = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let lane = (0..n).map(|j| v[(o * n + j) * inner + i]);
            r.push(pick(lane, is_nan, max, last) as i64);
        }
    }
    r
}

fn arg(ctx: &OpCtx, ins: &[Option<&Value>], max: bool) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let rank = x.rank();
    ensure!(rank >= 1, "ArgMax/ArgMin need an input of rank >= 1");
    let ax = axis(ctx.attrs.int("axis", 0)?, rank)?;
    let keepdims = ctx.attrs.int("keepdims", 1)? != 0;
    let last = ctx.attrs.int("select_last_index", 0)? != 0;
    let shape = x.shape().to_vec();
    let s3 = split3(&shape, ax);
    ensure!(s3.1 > 0, "cannot take ArgMax/ArgMin over an empty axis");
    let r = if x.dtype().is_float() {
        arg_lanes(&flat(&f64s(x)?), s3, |v: f64| v.is_nan(), max, last)
    } else {
        arg_lanes(&flat(&i128s(x)?), s3, |_| false, max, last)
    };
    let mut oshape = shape.clone();
    if keepdims {
        oshape[ax] = 1;
    } else {
        oshape.remove(ax);
    }
    out(Tensor::from_array(from_flat(&oshape, r)?))
}

fn argmax(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    arg(ctx, ins, true)
}
fn argmin(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    arg(ctx, ins, false)
}

// ---------------------------------------------------------------------------------------
// TopK

/// Takes elements along an axis laid out as (outer, n, inner) at the given per-lane
/// indices (laid out as (outer, k, inner)).
fn take_lanes<T: Clone>(
    a: &ArrayD<T>,
    (outer, n, inner): (usize, usize, usize),
    k: usize,
    idx: &[usize],
    oshape: &[usize],
) -> OpResult<ArrayD<T>> {
    let v = flat(a);
    let mut r = Vec::with_capacity(outer * k * inner);
    for o in 0..outer {
        for j in 0..k {
            for i in 0..inner {
                let src = idx[(o * k + j) * inner + i];
                r.push(v[(o * n + src) * inner + i].clone());
            }
        }
    }
    from_flat(oshape, r)
}

fn topk_indices<T: Copy>(
    v: &[T],
    (outer, n, inner): (usize, usize, usize),
    k: usize,
    cmp: impl Fn(T, T) -> Ordering,
    largest: bool,
) -> Vec<usize> {
    let mut r = vec![0usize; outer * k * inner];
    let mut lane: Vec<usize> = Vec::with_capacity(n);
    for o in 0..outer {
        for i in 0..inner {
            lane.clear();
            lane.extend(0..n);
            let at = |j: usize| v[(o * n + j) * inner + i];
            lane.sort_by(|&p, &q| {
                let c = cmp(at(p), at(q));
                let c = if largest { c.reverse() } else { c };
                c.then(p.cmp(&q))
            });
            for j in 0..k {
                r[(o * k + j) * inner + i] = lane[j];
            }
        }
    }
    r
}

/// Float order with NaN above everything (NumPy's sort order).
fn cmp_f64(a: f64, b: f64) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        _ => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    }
}

fn topk(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let rank = x.rank();
    ensure!(rank >= 1, "TopK needs an input of rank >= 1");
    let k = match opt_input(ins, 1)? {
        Some(t) => scalar_i64(t)?,
        None => ctx.attrs.req_int("k")?,
    };
    let ax = axis(ctx.attrs.int("axis", -1)?, rank)?;
    let largest = ctx.attrs.int("largest", 1)? != 0;
    let shape = x.shape().to_vec();
    let s3 = split3(&shape, ax);
    ensure!(
        k >= 0 && (k as usize) <= s3.1,
        "k = {k} is out of range for an axis of size {}",
        s3.1
    );
    let k = k as usize;
    let idx = if x.dtype().is_float() {
        topk_indices(&flat(&f64s(x)?), s3, k, cmp_f64, largest)
    } else if x.dtype().is_int() {
        topk_indices(&flat(&i128s(x)?), s3, k, |a: i128, b| a.cmp(&b), largest)
    } else {
        bail!("TopK expects a numeric tensor, got {}", x.dtype())
    };
    let mut oshape = shape.clone();
    oshape[ax] = k;
    let values = try_map_data!(x, a => take_lanes(a, s3, k, &idx, &oshape));
    let indices = from_flat(&oshape, idx.iter().map(|&i| i as i64).collect())?;
    outs(vec![values, Tensor::from_array(indices)])
}

// ---------------------------------------------------------------------------------------
// CumSum / CumProd

fn scan<T: Copy>(
    v: &[T],
    (outer, n, inner): (usize, usize, usize),
    init: T,
    f: impl Fn(T, T) -> T,
    exclusive: bool,
    reverse: bool,
) -> Vec<T> {
    let mut r = vec![init; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = init;
            for step in 0..n {
                let j = if reverse { n - 1 - step } else { step };
                let p = (o * n + j) * inner + i;
                if exclusive {
                    r[p] = acc;
                    acc = f(acc, v[p]);
                } else {
                    acc = f(acc, v[p]);
                    r[p] = acc;
                }
            }
        }
    }
    r
}

fn cum(ctx: &OpCtx, ins: &[Option<&Value>], prod: bool) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let rank = x.rank();
    let ax = axis(scalar_i64(input(ins, 1)?)?, rank)?;
    let exclusive = ctx.attrs.int("exclusive", 0)? != 0;
    let reverse = ctx.attrs.int("reverse", 0)? != 0;
    let shape = x.shape().to_vec();
    if rank == 0 {
        return out(x.clone());
    }
    let s3 = split3(&shape, ax);
    let dt = x.dtype();
    if dt.is_float() {
        let v = flat(&f64s(x)?);
        let r = if prod {
            scan(&v, s3, 1.0, |a, b| a * b, exclusive, reverse)
        } else {
            scan(&v, s3, 0.0, |a, b| a + b, exclusive, reverse)
        };
        out(Tensor::from_f64(dt, from_flat(&shape, r)?, false))
    } else if dt.is_int() {
        let v = flat(&i128s(x)?);
        let r = if prod {
            scan(
                &v,
                s3,
                1,
                |a: i128, b| a.wrapping_mul(b),
                exclusive,
                reverse,
            )
        } else {
            scan(
                &v,
                s3,
                0,
                |a: i128, b| a.wrapping_add(b),
                exclusive,
                reverse,
            )
        };
        out(Tensor::from_i128(dt, from_flat(&shape, r)?))
    } else {
        bail!("expected a numeric tensor, got {dt}")
    }
}

fn cumsum(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    cum(ctx, ins, false)
}
fn cumprod(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    cum(ctx, ins, true)
}

// ---------------------------------------------------------------------------------------
// Softmax, LogSoftmax, Hardmax

#[derive(Clone, Copy, PartialEq, Eq)]
enum SoftKind {
    Softmax,
    LogSoftmax,
    Hardmax,
}

/// Applies `kind` on each lane of `v` laid out as (outer, n, inner).
fn soft_lanes(v: &mut [f64], (outer, n, inner): (usize, usize, usize), kind: SoftKind, dt: DType) {
    let mut lane = vec![0f64; n];
    for o in 0..outer {
        for i in 0..inner {
            for (j, l) in lane.iter_mut().enumerate() {
                *l = v[(o * n + j) * inner + i];
            }
            if kind == SoftKind::Softmax && matches!(dt, DType::F16 | DType::BF16) {
                softmax_lane_16(&mut lane, dt);
            } else {
                soft_lane(&mut lane, kind);
            }
            for (j, l) in lane.iter().enumerate() {
                v[(o * n + j) * inner + i] = *l;
            }
        }
    }
}

/// Softmax of a float16/bfloat16 lane the way ONNX's reference computes it on such
/// arrays with numpy (`tmp = X - max; Y = exp(tmp); Y /= Y.sum()`): every step is rounded
/// to the element type, and a bfloat16 sum rounds each partial sum (float16 sums
/// accumulate in float32 and round once).
fn softmax_lane_16(lane: &mut [f64], dt: DType) {
    let r = |x: f64| -> f64 {
        if dt == DType::BF16 {
            half::bf16::from_f64(x).to_f64()
        } else {
            half::f16::from_f64(x).to_f64()
        }
    };
    let m = lane.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
    let m = if m.is_finite() { m } else { 0.0 };
    for l in lane.iter_mut() {
        *l = r(r(*l - m).exp());
    }
    let sum = if dt == DType::BF16 {
        lane.iter().fold(0.0, |acc, &x| r(acc + x))
    } else {
        r(lane.iter().fold(0f32, |acc, &x| acc + x as f32) as f64)
    };
    for l in lane.iter_mut() {
        *l = r(*l / sum);
    }
}

fn soft_lane(lane: &mut [f64], kind: SoftKind) {
    if lane.is_empty() {
        return;
    }
    match kind {
        SoftKind::Hardmax => {
            let best = pick(lane.iter().copied(), |x: f64| x.is_nan(), true, false);
            for (j, l) in lane.iter_mut().enumerate() {
                *l = if j == best { 1.0 } else { 0.0 };
            }
        }
        SoftKind::Softmax | SoftKind::LogSoftmax => {
            let m = lane.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            let m = if m.is_finite() { m } else { 0.0 };
            let sum: f64 = lane.iter().map(|&x| (x - m).exp()).sum();
            if kind == SoftKind::Softmax {
                for l in lane.iter_mut() {
                    *l = (*l - m).exp() / sum;
                }
            } else {
                let ls = sum.ln();
                for l in lane.iter_mut() {
                    *l = *l - m - ls;
                }
            }
        }
    }
}

fn soft(ctx: &OpCtx, ins: &[Option<&Value>], kind: SoftKind) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let dt = x.dtype();
    ensure!(dt.is_float(), "expected a float tensor, got {dt}");
    let shape = x.shape().to_vec();
    let rank = shape.len();
    let new = ctx.opset >= 13;
    let ax = ctx.attrs.int("axis", if new { -1 } else { 1 })?;
    if rank == 0 {
        let v = f64s(x)?;
        let r = v.mapv(|x| {
            let mut l = [x];
            soft_lane(&mut l, kind);
            l[0]
        });
        return out(Tensor::from_f64(dt, r, false));
    }
    let ax = if new {
        axis(ax, rank)?
    } else {
        // Opset < 13: the input is coerced to 2-D [prod(dims[..axis]), prod(dims[axis..])]
        // and the operation runs along the second dimension; axis may equal rank.
        let r = rank as i64;
        ensure!(
            ax >= -r && ax <= r,
            "axis {ax} is out of range for rank {rank}"
        );
        if ax < 0 {
            (ax + r) as usize
        } else {
            ax as usize
        }
    };
    let s3 = if new {
        split3(&shape, ax)
    } else {
        (
            shape[..ax].iter().product(),
            shape[ax..].iter().product(),
            1,
        )
    };
    let mut v = flat(&f64s(x)?);
    soft_lanes(&mut v, s3, kind, dt);
    out(Tensor::from_f64(dt, from_flat(&shape, v)?, false))
}

fn softmax(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    soft(ctx, ins, SoftKind::Softmax)
}
fn log_softmax(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    soft(ctx, ins, SoftKind::LogSoftmax)
}
fn hardmax(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    soft(ctx, ins, SoftKind::Hardmax)
}

// ---------------------------------------------------------------------------------------
// NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss

/// The shared loss: `logp` is (N, C, d...) log-probabilities (flat, row-major), `target`
/// is (N, d...). Returns the reduced (or unreduced) loss.
fn nll(
    logp: &[f64],
    shape: &[usize],
    target: &Tensor,
    weight: Option<&Tensor>,
    ignore_index: Option<i64>,
    reduction: &str,
) -> OpResult<ArrayD<f64>> {
    ensure!(
        shape.len() >= 2,
        "the input must have shape (N, C, d1, ...), got {shape:?}"
    );
    let (n, c) = (shape[0], shape[1]);
    let d: usize = shape[2..].iter().product();
    let tshape = target.shape().to_vec();
    let mut want = vec![n];
    want.extend_from_slice(&shape[2..]);
    ensure!(
        tshape == want,
        "target shape {tshape:?} does not match input shape {shape:?}"
    );
    let t = ints(target)?;
    let w = match weight {
        Some(w) => {
            let w = flat(&f64s(w)?);
            ensure!(w.len() == c, "weight has {} elements but C = {c}", w.len());
            Some(w)
        }
        None => None,
    };
    let mut loss = vec![0f64; n * d];
    let mut wsum = 0f64;
    for i in 0..n {
        for k in 0..d {
            let cls = t[i * d + k];
            if Some(cls) == ignore_index {
                continue;
            }
            ensure!(
                cls >= 0 && (cls as usize) < c,
                "target {cls} is out of range for {c} classes"
            );
            let cls = cls as usize;
            let wt = w.as_ref().map(|w| w[cls]).unwrap_or(1.0);
            loss[i * d + k] = -logp[(i * c + cls) * d + k] * wt;
            wsum += wt;
        }
    }
    Ok(match reduction {
        "none" => from_flat(&tshape, loss)?,
        "sum" => ArrayD::from_elem(IxDyn(&[]), loss.iter().sum()),
        "mean" => ArrayD::from_elem(IxDyn(&[]), loss.iter().sum::<f64>() / wsum),
        other => bail!("unknown reduction `{other}` (expected none, sum or mean)"),
    })
}

fn loss_attrs(ctx: &OpCtx) -> OpResult<(Option<i64>, String)> {
    Ok((
        ctx.attrs.get_int("ignore_index")?,
        ctx.attrs.string("reduction", "mean".to_string())?,
    ))
}

fn nll_loss(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let dt = x.dtype();
    ensure!(dt.is_float(), "expected a float input, got {dt}");
    let (ii, red) = loss_attrs(ctx)?;
    let v = flat(&f64s(x)?);
    let r = nll(&v, x.shape(), input(ins, 1)?, opt_input(ins, 2)?, ii, &red)?;
    out(Tensor::from_f64(dt, r, false))
}

fn sce_loss(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let dt = x.dtype();
    ensure!(dt.is_float(), "expected a float input, got {dt}");
    let (ii, red) = loss_attrs(ctx)?;
    let shape = x.shape().to_vec();
    ensure!(
        shape.len() >= 2,
        "the input must have shape (N, C, d1, ...), got {shape:?}"
    );
    let d: usize = shape[2..].iter().product();
    let mut v = flat(&f64s(x)?);
    soft_lanes(
        &mut v,
        (shape[0], shape[1], d),
        SoftKind::LogSoftmax,
        DType::F64,
    );
    let r = nll(&v, &shape, input(ins, 1)?, opt_input(ins, 2)?, ii, &red)?;
    let mut res = vec![Tensor::from_f64(dt, r, false)];
    if ctx.n_outputs >= 2 {
        res.push(Tensor::from_f64(dt, from_flat(&shape, v)?, false));
    }
    outs(res)
}

// ---------------------------------------------------------------------------------------
// Lowering to kernel IR

mod lower {
    use super::{split3, Kind};
    use crate::ir::{DType, OpError, OpResult};
    use crate::kir::build::*;
    use crate::kir::{BinOp, CmpOp, Expr, Kernel, MathFn, Stmt, Ty, UnOp, VarId};
    use crate::ops::lowering::{index, nest, strides, LowerCtx, TensorRef};
    use crate::ops::util::axis;
    use crate::ops::{Lowering, Registry};
    use crate::{bail, ensure};

    fn set(x: VarId, e: Expr) -> Stmt {
        Stmt::Set { var: x, value: e }
    }
    fn for_(var: VarId, extent: usize, body: Vec<Stmt>) -> Stmt {
        Stmt::For {
            var,
            extent: extent as u64,
            body,
        }
    }
    fn is_nan(x: Expr) -> Expr {
        cmp(CmpOp::Ne, x.clone(), x)
    }
    fn u8c(b: bool) -> Expr {
        Expr::cast(Ty::U8, Expr::Int(b as i64))
    }
    /// An integer constant of type `t` (wrapping).
    fn ic(x: i128, t: Ty) -> Expr {
        Expr::cast(t, Expr::Int(x as i64))
    }
    fn int_range(dt: DType) -> (i128, i128) {
        if dt == DType::Bool {
            (0, 1)
        } else {
            dt.int_range()
                .unwrap_or((i64::MIN as i128, i64::MAX as i128))
        }
    }
    /// `x > best` with NaN winning (for maximum-type folds over floats).
    fn wins(x: Expr, best: Expr, max: bool, float: bool) -> Expr {
        let c = cmp(if max { CmpOp::Gt } else { CmpOp::Lt }, x.clone(), best);
        if float {
            bin(BinOp::Or, c, is_nan(x))
        } else {
            c
        }
    }

    // -----------------------------------------------------------------------------------
    // Reduce*

    fn kind_of(op: &str) -> OpResult<Kind> {
        Ok(match op {
            "ReduceSum" => Kind::Sum,
            "ReduceMean" => Kind::Mean,
            "ReduceMax" => Kind::Max,
            "ReduceMin" => Kind::Min,
            "ReduceProd" => Kind::Prod,
            "ReduceL1" => Kind::L1,
            "ReduceL2" => Kind::L2,
            "ReduceLogSum" => Kind::LogSum,
            "ReduceLogSumExp" => Kind::LogSumExp,
            "ReduceSumSquare" => Kind::SumSquare,
            _ => bail!("no lowering for {op}"),
        })
    }

    /// Which axes are reduced.
    fn reduced_axes(lw: &LowerCtx, rank: usize) -> OpResult<Vec<bool>> {
        let given = match lw.opt_input(1) {
            Some(_) => Some(
                lw.const_input(1)?
                    .to_i64_vec()
                    .ok_or_else(|| OpError::new("axes must be integers"))?,
            ),
            None => lw.op.attrs.get_ints("axes")?,
        };
        Ok(match given {
            Some(a) if !a.is_empty() => {
                let ax = crate::ops::util::axes(&a, rank.max(1))?;
                (0..rank).map(|d| ax.contains(&d)).collect()
            }
            _ => {
                let noop = lw.op.attrs.int("noop_with_empty_axes", 0)? != 0;
                vec![!noop; rank]
            }
        })
    }

    /// Most elements a reduction of f32 sums in f32 (see [`reduce`]): past it, an f64
    /// accumulator (a sum of 65536 in 16 f32 lanes still keeps about 1e-6).
    const F32_SUM_MOST: usize = 1 << 16;

    fn reduce(lw: &mut LowerCtx) -> OpResult<()> {
        let kind = kind_of(&lw.op.op_type)?;
        let x = lw.input(0)?.clone();
        let out = lw.outputs[0].clone();
        let rank = x.shape.len();
        let red = reduced_axes(lw, rank)?;
        let t = x.ty().compute();
        let ot = out.ty().compute();
        let float = t.is_float();
        let int_kind = matches!(
            kind,
            Kind::Sum | Kind::Max | Kind::Min | Kind::Prod | Kind::L1 | Kind::SumSquare
        );
        if x.dtype == DType::Bool {
            ensure!(
                matches!(kind, Kind::Max | Kind::Min),
                "{kind:?} is not defined for bool tensors"
            );
        }
        // Accumulator type: f64 for floats and float-valued reductions of integers,
        // the element type (wrapping) for integer reductions; f32 for sums of f32 over at
        // most `F32_SUM_MOST` elements, which the loops vectorise (an f64 sum runs one
        // element at a time: ReduceMean over rows of 768, 0.134 ms against ONNX Runtime's
        // 0.013), its rounding within a few 1e-7 of the f64 sum's there.
        let count: usize = (0..rank).filter(|&d| red[d]).map(|d| x.shape[d]).product();
        let sum32 = x.dtype == DType::F32
            && out.dtype == DType::F32
            && matches!(
                kind,
                Kind::Sum | Kind::Mean | Kind::SumSquare | Kind::L1 | Kind::L2
            )
            && count <= F32_SUM_MOST;
        // Max and min of f32 in f32 (the same values as in f64): a NaN-skipping select
        // the loops vectorise, and a flag of NaNs seen (the f64 form, `x > m || x != x`,
        // ran one element at a time).
        let minmax32 = x.dtype == DType::F32
            && out.dtype == DType::F32
            && matches!(kind, Kind::Max | Kind::Min);
        // LogSumExp of f32 in f32 likewise: the maximum by the NaN-skipping select, the
        // sum of exponentials by the inline vector exp (the f64 form called libm's exp
        // per element: rows of 1000, 1.08 ms against ONNX Runtime's 0.70).
        let lse32 = x.dtype == DType::F32
            && out.dtype == DType::F32
            && kind == Kind::LogSumExp
            && count <= F32_SUM_MOST;
        let at = if sum32 || minmax32 || lse32 {
            Ty::F32
        } else if float || !int_kind {
            Ty::F64
        } else {
            t
        };
        let istr = strides(&x.shape);
        let kept: Vec<usize> = (0..rank).filter(|&d| !red[d]).collect();
        let reds: Vec<usize> = (0..rank).filter(|&d| red[d]).collect();
        let kshape: Vec<usize> = kept.iter().map(|&d| x.shape[d]).collect();
        let rshape: Vec<usize> = reds.iter().map(|&d| x.shape[d]).collect();
        let kstr: Vec<usize> = kept.iter().map(|&d| istr[d]).collect();
        let rstr: Vec<usize> = reds.iter().map(|&d| istr[d]).collect();
        ensure!(
            out.len() == kshape.iter().product::<usize>(),
            "reduction output size mismatch"
        );
        let mut k = lw.kernel("");
        let acc = k.var(at);
        let mx = k.var(at);
        let (lo, hi) = int_range(x.dtype);
        let init = match kind {
            Kind::Max if at.is_float() => Expr::f(f64::NEG_INFINITY, at),
            Kind::Min if at.is_float() => Expr::f(f64::INFINITY, at),
            Kind::Max => ic(lo, at),
            Kind::Min => ic(hi, at),
            Kind::Prod if at == Ty::F64 => f64c(1.0),
            Kind::Prod => ic(1, at),
            _ if at == Ty::F64 => f64c(0.0),
            _ => ic(0, at),
        };
        let body = nest(&mut k, &kshape, |k, kv| {
            let mut s = vec![set(acc, init.clone())];
            let load = |k: &mut Kernel, s: &mut Vec<Stmt>, f: &dyn Fn(Expr) -> Vec<Stmt>| {
                let inner = nest(k, &rshape, |_, rv| {
                    let mut vars = kv.to_vec();
                    vars.extend_from_slice(rv);
                    let mut st = kstr.clone();
                    st.extend_from_slice(&rstr);
                    let e = Expr::cast(at, Expr::load(x.buf, index(&vars, &st)));
                    f(e)
                });
                s.extend(inner);
            };
            let a = v(acc);
            match kind {
                Kind::LogSumExp => {
                    s.push(set(mx, Expr::f(f64::NEG_INFINITY, at)));
                    // The select skips NaN (the sum below makes it the result).
                    load(k, &mut s, &|e| {
                        vec![set(
                            mx,
                            Expr::select(cmp(CmpOp::Gt, e.clone(), v(mx)), e, v(mx)),
                        )]
                    });
                    // Shift by the max when it is finite.
                    let d = bin(BinOp::Sub, v(mx), v(mx));
                    s.push(set(
                        mx,
                        Expr::select(cmp(CmpOp::Eq, d, Expr::f(0.0, at)), v(mx), Expr::f(0.0, at)),
                    ));
                    load(k, &mut s, &|e| {
                        vec![set(
                            acc,
                            Expr::add(
                                v(acc),
                                Expr::call(MathFn::Exp, vec![bin(BinOp::Sub, e, v(mx))]),
                            ),
                        )]
                    });
                }
                Kind::Max | Kind::Min if minmax32 => {
                    // `mx` is 1 once a NaN was seen.
                    let c = |x: f64| Expr::f(x, Ty::F32);
                    s.push(set(mx, c(0.0)));
                    let op = if kind == Kind::Max {
                        CmpOp::Gt
                    } else {
                        CmpOp::Lt
                    };
                    load(k, &mut s, &|e| {
                        vec![
                            set(
                                acc,
                                Expr::select(cmp(op, e.clone(), a.clone()), e.clone(), a.clone()),
                            ),
                            raise_flag(mx, is_nan(e)),
                        ]
                    });
                }
                _ => {
                    let f = at.is_float();
                    load(k, &mut s, &|e| {
                        let nv = match kind {
                            Kind::Sum | Kind::Mean | Kind::LogSum => Expr::add(a.clone(), e),
                            Kind::Prod => Expr::mul(a.clone(), e),
                            Kind::L1 => Expr::add(a.clone(), Expr::un(UnOp::Abs, e)),
                            Kind::L2 | Kind::SumSquare => {
                                Expr::add(a.clone(), Expr::mul(e.clone(), e))
                            }
                            Kind::Max | Kind::Min => {
                                let max = kind == Kind::Max;
                                if f {
                                    Expr::select(
                                        wins(e.clone(), a.clone(), max, true),
                                        e,
                                        a.clone(),
                                    )
                                } else {
                                    bin(if max { BinOp::Max } else { BinOp::Min }, a.clone(), e)
                                }
                            }
                            Kind::LogSumExp => unreachable!(),
                        };
                        vec![set(acc, nv)]
                    });
                }
            }
            let r = match kind {
                Kind::Max | Kind::Min if minmax32 => Expr::select(
                    cmp(CmpOp::Gt, v(mx), Expr::f(0.0, Ty::F32)),
                    Expr::f(f64::NAN, Ty::F32),
                    a.clone(),
                ),
                Kind::Mean => bin(BinOp::Div, a.clone(), Expr::f(count as f64, at)),
                Kind::L2 => Expr::un(UnOp::Sqrt, a.clone()),
                Kind::LogSum => Expr::call(MathFn::Log, vec![a.clone()]),
                Kind::LogSumExp => Expr::add(v(mx), Expr::call(MathFn::Log, vec![a.clone()])),
                _ => a.clone(),
            };
            s.push(Stmt::Store {
                buf: out.buf,
                index: index(kv, &strides(&kshape)),
                value: Expr::cast(ot, r),
            });
            s
        });
        k.body = body;
        lw.push(k);
        Ok(())
    }

    // -----------------------------------------------------------------------------------
    // ArgMax / ArgMin

    /// Statements that leave in `bi` the lane index picked like the reference's `pick`
    /// (NaN wins; ties go to the first or last), `best` holding its value. `at(j)` loads
    /// element j of the lane.
    fn pick_stmts(
        k: &mut Kernel,
        t: Ty,
        n: usize,
        at: &dyn Fn(Expr) -> Expr,
        max: bool,
        last: bool,
    ) -> (Vec<Stmt>, VarId) {
        let best = k.var(t);
        let bi = k.var(Ty::I64);
        let j = k.var(Ty::I64);
        let x = at(v(j));
        let b = v(best);
        let gt = cmp(
            if max { CmpOp::Gt } else { CmpOp::Lt },
            x.clone(),
            b.clone(),
        );
        let take = if t.is_float() {
            let eq = cmp(CmpOp::Eq, x.clone(), b.clone());
            Expr::select(
                is_nan(b.clone()),
                bin(BinOp::And, is_nan(x.clone()), u8c(last)),
                Expr::select(
                    is_nan(x.clone()),
                    u8c(true),
                    Expr::select(eq, u8c(last), gt),
                ),
            )
        } else if last {
            cmp(if max { CmpOp::Ge } else { CmpOp::Le }, x.clone(), b)
        } else {
            gt
        };
        let s = vec![
            set(best, at(Expr::Int(0))),
            set(bi, Expr::Int(0)),
            for_(
                j,
                n,
                vec![Stmt::If {
                    cond: take,
                    then: vec![set(best, x), set(bi, v(j))],
                    els: vec![],
                }],
            ),
        ];
        (s, bi)
    }

    fn arg(lw: &mut LowerCtx) -> OpResult<()> {
        let max = lw.op.op_type == "ArgMax";
        let x = lw.input(0)?.clone();
        let out = lw.outputs[0].clone();
        let rank = x.shape.len();
        ensure!(rank >= 1, "ArgMax/ArgMin need an input of rank >= 1");
        let ax = axis(lw.op.attrs.int("axis", 0)?, rank)?;
        let last = lw.op.attrs.int("select_last_index", 0)? != 0;
        let (outer, n, inner) = split3(&x.shape, ax);
        ensure!(n > 0, "cannot take ArgMax/ArgMin over an empty axis");
        let t = x.ty().compute();
        if x.dtype == DType::F32 && n <= ARG_F32_MOST {
            if inner == 1 && n >= ARG_LANES_MIN {
                return arg_rows(lw, &x, &out, (outer, n), max, last);
            }
            if inner >= ARG_LANES_MIN && n >= 2 {
                return arg_lanes(lw, &x, &out, (outer, n, inner), max, last);
            }
        }
        let mut k = lw.kernel("");
        let body = nest(&mut k, &[outer, inner], |k, lv| {
            let (o, i) = (lv[0], lv[1]);
            let at = |j: Expr| {
                Expr::load(
                    x.buf,
                    index(&[o, i], &[n * inner, 1]).add_term(Expr::mul(j, Expr::Int(inner as i64))),
                )
            };
            let (mut s, bi) = pick_stmts(k, t, n, &at, max, last);
            s.push(Stmt::Store {
                buf: out.buf,
                index: index(&[o, i], &[inner, 1]),
                value: v(bi),
            });
            s
        });
        k.body = body;
        lw.push(k);
        Ok(())
    }

    /// Least count of elements an f32 ArgMax/ArgMin runs in vector lanes: the
    /// reduced axis when it is contiguous ([`arg_rows`]), the positions beside it
    /// otherwise ([`arg_lanes`]).
    const ARG_LANES_MIN: usize = 16;
    /// Most elements of the reduced axis: indices are f32 in the vector loops, exact up
    /// to 2^24.
    const ARG_F32_MOST: usize = 1 << 24;

    /// `(x != x)`, `(x > b)` or `(x < b)`, `(x >= b)` or `(x <= b)` for [`pick_stmts`]'s
    /// choice as masks: whether `x` (the element at a later index) replaces `b`. Without
    /// `last`, `(b == b) & (x is NaN | x beats b)`: the first NaN, else the first of the
    /// best; with it, `x is NaN | (b == b & x ties or beats b)`: the last of either.
    fn take_mask(x: Expr, b: Expr, max: bool, last: bool) -> Expr {
        let beats = match (max, last) {
            (true, false) => CmpOp::Gt,
            (false, false) => CmpOp::Lt,
            (true, true) => CmpOp::Ge,
            (false, true) => CmpOp::Le,
        };
        let nan = is_nan(x.clone());
        let num = cmp(CmpOp::Eq, b.clone(), b.clone());
        let wins = cmp(beats, x, b);
        if last {
            bin(BinOp::Or, nan, and(num, wins))
        } else {
            and(num, bin(BinOp::Or, nan, wins))
        }
    }

    /// ArgMax / ArgMin of f32 over a contiguous axis of `n`, per row in vector
    /// reductions: the NaN-skipping best (`x > m ? x : m`) and whether a NaN was seen;
    /// then the first (or, with `last`, the last) index holding a NaN if one was seen,
    /// else the best, as the least (greatest) of `hit ? j : n` (`-1`) over an f32 table
    /// of the indices. The same choice as [`pick_stmts`] (which ran one element at a time
    /// behind a chain of branches: 128 rows of 1000, 0.37 ms against ONNX Runtime's 0.18).
    fn arg_rows(
        lw: &mut LowerCtx,
        x: &TensorRef,
        out: &TensorRef,
        (outer, n): (usize, usize),
        max: bool,
        last: bool,
    ) -> OpResult<()> {
        let data: Vec<u8> = (0..n).flat_map(|j| (j as f32).to_le_bytes()).collect();
        let iota = lw.program.add_buffer(
            format!("{}/indices", lw.name),
            crate::kir::BufKind::Const { data },
            Ty::F32,
            n as u64,
        );
        let mut k = lw.kernel("");
        let (o, j) = (k.var(Ty::I64), k.var(Ty::I64));
        let (m, nan, idx) = (k.var(Ty::F32), k.var(Ty::F32), k.var(Ty::F32));
        let c = |x: f64| Expr::f(x, Ty::F32);
        let xj = Expr::load(x.buf, add(mul(v(o), int(n)), v(j)));
        let (better, start) = if max {
            (CmpOp::Gt, f64::NEG_INFINITY)
        } else {
            (CmpOp::Lt, f64::INFINITY)
        };
        let (none, fold) = if last {
            (-1.0, BinOp::Max)
        } else {
            (n as f64, BinOp::Min)
        };
        let find = |hit: Expr| {
            vec![
                set(idx, c(none)),
                for_(
                    j,
                    n,
                    vec![set(
                        idx,
                        bin(
                            fold,
                            v(idx),
                            Expr::select(hit, Expr::load(iota, v(j)), c(none)),
                        ),
                    )],
                ),
            ]
        };
        let body = vec![
            set(m, c(start)),
            set(nan, c(0.0)),
            for_(
                j,
                n,
                vec![
                    set(
                        m,
                        Expr::select(cmp(better, xj.clone(), v(m)), xj.clone(), v(m)),
                    ),
                    raise_flag(nan, is_nan(xj.clone())),
                ],
            ),
            Stmt::If {
                cond: cmp(CmpOp::Gt, v(nan), c(0.0)),
                then: find(is_nan(xj.clone())),
                els: find(cmp(CmpOp::Eq, xj.clone(), v(m))),
            },
            store(out.buf, v(o), Expr::cast(Ty::I64, v(idx))),
        ];
        k.body = vec![for_(o, outer, body)];
        lw.push(k);
        Ok(())
    }

    /// ArgMax / ArgMin of f32 over an axis of `n` with `inner` positions beside it, the
    /// positions in vector lanes: per outer index, the best value and its index (f32) of
    /// each position in scratch rows, updated by one unit-stride loop per element of the
    /// axis ([`take_mask`]), then the indices converted. The axis loop ran innermost one
    /// element at a time, strided (64 channels of 56x56: 0.81 ms against ONNX Runtime's
    /// 0.21).
    fn arg_lanes(
        lw: &mut LowerCtx,
        x: &TensorRef,
        out: &TensorRef,
        (outer, n, inner): (usize, usize, usize),
        max: bool,
        last: bool,
    ) -> OpResult<()> {
        let scratch = |lw: &mut LowerCtx, what: &str| {
            lw.program.add_buffer(
                format!("{}/{what}", lw.name),
                crate::kir::BufKind::Arena { offset: 0 },
                Ty::F32,
                inner as u64,
            )
        };
        let (best, bidx) = (scratch(lw, "best"), scratch(lw, "index"));
        let mut k = lw.kernel("");
        let (o, j, i) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let (xv, bv) = (k.var(Ty::F32), k.var(Ty::F32));
        let at = |j: Expr| {
            Expr::load(
                x.buf,
                add(mul(v(o), int(n * inner)), add(mul(j, int(inner)), v(i))),
            )
        };
        let take = take_mask(v(xv), v(bv), max, last);
        let body = vec![
            for_(
                i,
                inner,
                vec![
                    store(best, v(i), at(int(0))),
                    store(bidx, v(i), Expr::f(0.0, Ty::F32)),
                ],
            ),
            Stmt::For {
                var: j,
                extent: (n - 1) as u64,
                body: vec![for_(
                    i,
                    inner,
                    vec![
                        set(xv, at(add(v(j), int(1)))),
                        set(bv, Expr::load(best, v(i))),
                        store(best, v(i), Expr::select(take.clone(), v(xv), v(bv))),
                        store(
                            bidx,
                            v(i),
                            Expr::select(
                                take,
                                Expr::cast(Ty::F32, add(v(j), int(1))),
                                Expr::load(bidx, v(i)),
                            ),
                        ),
                    ],
                )],
            },
            for_(
                i,
                inner,
                vec![store(
                    out.buf,
                    add(mul(v(o), int(inner)), v(i)),
                    Expr::cast(Ty::I64, Expr::load(bidx, v(i))),
                )],
            ),
        ];
        k.body = vec![for_(o, outer, body)];
        lw.push(k);
        Ok(())
    }

    trait AddTerm {
        fn add_term(self, e: Expr) -> Expr;
    }
    impl AddTerm for Expr {
        fn add_term(self, e: Expr) -> Expr {
            match self {
                Expr::Int(0) => e,
                s => Expr::add(s, e),
            }
        }
    }

    // -----------------------------------------------------------------------------------
    // Softmax, LogSoftmax, Hardmax

    fn soft(lw: &mut LowerCtx) -> OpResult<()> {
        let op = lw.op.op_type.clone();
        let x = lw.input(0)?.clone();
        let out = lw.outputs[0].clone();
        let t = x.ty().compute();
        ensure!(t.is_float(), "expected a float tensor, got {}", x.dtype);
        let shape = x.shape.clone();
        let rank = shape.len();
        let new = lw.op.opset >= 13;
        let ax = lw.op.attrs.int("axis", if new { -1 } else { 1 })?;
        let (outer, n, inner) = if rank == 0 {
            (1, 1, 1)
        } else if new {
            split3(&shape, axis(ax, rank)?)
        } else {
            let r = rank as i64;
            ensure!(
                ax >= -r && ax <= r,
                "axis {ax} is out of range for rank {rank}"
            );
            let ax = if ax < 0 {
                (ax + r) as usize
            } else {
                ax as usize
            };
            (
                shape[..ax].iter().product(),
                shape[ax..].iter().product(),
                1,
            )
        };
        let half = matches!(x.dtype, DType::F16 | DType::BF16);
        let mut k = lw.kernel("");
        let body = nest(&mut k, &[outer, inner], |k, lv| {
            let (o, i) = (lv[0], lv[1]);
            let pos = |j: Expr| {
                index(&[o, i], &[n * inner, 1]).add_term(Expr::mul(j, Expr::Int(inner as i64)))
            };
            let at = |j: Expr| Expr::load(x.buf, pos(j));
            let j = k.var(Ty::I64);
            if op == "Hardmax" {
                if n == 0 {
                    return vec![];
                }
                let (mut s, bi) = pick_stmts(k, t, n, &at, true, false);
                s.push(for_(
                    j,
                    n,
                    vec![Stmt::Store {
                        buf: out.buf,
                        index: pos(v(j)),
                        value: Expr::select(
                            cmp(CmpOp::Eq, v(j), v(bi)),
                            Expr::f(1.0, Ty::F32),
                            Expr::f(0.0, Ty::F32),
                        ),
                    }],
                ));
                // Stored values are F32 for f16/bf16/f32 outputs.
                if t == Ty::F64 {
                    if let Some(Stmt::For { body, .. }) = s.last_mut() {
                        if let Some(Stmt::Store { value, .. }) = body.first_mut() {
                            *value = Expr::cast(Ty::F64, value.clone());
                        }
                    }
                }
                return s;
            }
            if x.dtype == DType::F32 && out.dtype == DType::F32 {
                if op == "Softmax" {
                    return softmax32(k, &at, out.buf, &pos, n, j);
                }
                if op == "LogSoftmax" {
                    return log_softmax32(k, &at, out.buf, &pos, n, j);
                }
            }
            let m = k.var(Ty::F64);
            let sum = k.var(Ty::F64);
            let xf = |j: VarId| Expr::cast(Ty::F64, at(v(j)));
            if op == "Softmax" && half {
                return softmax16(k, &x, &out, n, &pos, m, sum, j);
            }
            let d = bin(BinOp::Sub, v(m), v(m));
            let mut s = vec![
                set(m, f64c(f64::NEG_INFINITY)),
                for_(
                    j,
                    n,
                    vec![set(
                        m,
                        Expr::select(cmp(CmpOp::Gt, xf(j), v(m)), xf(j), v(m)),
                    )],
                ),
                set(
                    m,
                    Expr::select(cmp(CmpOp::Eq, d, f64c(0.0)), v(m), f64c(0.0)),
                ),
                set(sum, f64c(0.0)),
                for_(
                    j,
                    n,
                    vec![set(
                        sum,
                        Expr::add(
                            v(sum),
                            Expr::call(MathFn::Exp, vec![bin(BinOp::Sub, xf(j), v(m))]),
                        ),
                    )],
                ),
            ];
            let val = if op == "Softmax" {
                bin(
                    BinOp::Div,
                    Expr::call(MathFn::Exp, vec![bin(BinOp::Sub, xf(j), v(m))]),
                    v(sum),
                )
            } else {
                bin(
                    BinOp::Sub,
                    bin(BinOp::Sub, xf(j), v(m)),
                    Expr::call(MathFn::Log, vec![v(sum)]),
                )
            };
            s.push(for_(
                j,
                n,
                vec![Stmt::Store {
                    buf: out.buf,
                    index: pos(v(j)),
                    value: Expr::cast(t, val),
                }],
            ));
            s
        });
        k.body = body;
        lw.push(k);
        Ok(())
    }

    /// Softmax of an f32 lane in f32: the max, then `out[j] = exp(x[j] - max)` summed in
    /// the same loop, then `out[j] *= 1 / sum`: loops the vectoriser takes (with the inline
    /// exp). A max of +-inf or NaN is replaced by 0, as in the f64 path.
    fn softmax32(
        k: &mut Kernel,
        at: &dyn Fn(Expr) -> Expr,
        ob: crate::kir::BufId,
        pos: &dyn Fn(Expr) -> Expr,
        n: usize,
        j: VarId,
    ) -> Vec<Stmt> {
        if n == 0 {
            return vec![];
        }
        let (mut s, m) = lane_max32(k, at, n, j);
        let (sum, e) = (k.var(Ty::F32), k.var(Ty::F32));
        let f = |x: f64| Expr::f(x, Ty::F32);
        s.extend([
            set(sum, f(0.0)),
            for_(
                j,
                n,
                vec![
                    set(
                        e,
                        Expr::call(MathFn::Exp, vec![bin(BinOp::Sub, at(v(j)), v(m))]),
                    ),
                    Stmt::Store {
                        buf: ob,
                        index: pos(v(j)),
                        value: v(e),
                    },
                    set(sum, Expr::add(v(sum), v(e))),
                ],
            ),
            set(sum, bin(BinOp::Div, f(1.0), v(sum))),
            for_(
                j,
                n,
                vec![Stmt::Store {
                    buf: ob,
                    index: pos(v(j)),
                    value: bin(BinOp::Mul, Expr::load(ob, pos(v(j))), v(sum)),
                }],
            ),
        ]);
        s
    }

    /// The statements leaving in `m` (returned) an f32 lane's max, replaced by 0 where it
    /// is +-inf or NaN (as in the f64 path): [`softmax32`]'s and [`log_softmax32`]'s shift.
    fn lane_max32(
        k: &mut Kernel,
        at: &dyn Fn(Expr) -> Expr,
        n: usize,
        j: VarId,
    ) -> (Vec<Stmt>, VarId) {
        let m = k.var(Ty::F32);
        let f = |x: f64| Expr::f(x, Ty::F32);
        let d = bin(BinOp::Sub, v(m), v(m));
        let s = vec![
            set(m, f(f64::NEG_INFINITY)),
            for_(
                j,
                n,
                vec![set(
                    m,
                    Expr::select(cmp(CmpOp::Gt, at(v(j)), v(m)), at(v(j)), v(m)),
                )],
            ),
            set(m, Expr::select(cmp(CmpOp::Eq, d, f(0.0)), v(m), f(0.0))),
        ];
        (s, m)
    }

    /// LogSoftmax of an f32 lane in f32, in loops the vectoriser takes: the max `m`, the
    /// sum of `exp(x[j] - m)` (the input read again: the output is written once), then
    /// `out[j] = (x[j] - m) - log(sum)` (the reference's grouping: `x - (m + log sum)`
    /// would round `m + log sum` to `m`'s ulp, most of a near-zero output). The f64 form ran one
    /// element at a time with a call per exp: 128 rows of 1000 took 1.72 ms against ONNX
    /// Runtime's 0.051.
    fn log_softmax32(
        k: &mut Kernel,
        at: &dyn Fn(Expr) -> Expr,
        ob: crate::kir::BufId,
        pos: &dyn Fn(Expr) -> Expr,
        n: usize,
        j: VarId,
    ) -> Vec<Stmt> {
        if n == 0 {
            return vec![];
        }
        let (mut s, m) = lane_max32(k, at, n, j);
        let sum = k.var(Ty::F32);
        let e = Expr::call(MathFn::Exp, vec![bin(BinOp::Sub, at(v(j)), v(m))]);
        s.extend([
            set(sum, Expr::f(0.0, Ty::F32)),
            for_(j, n, vec![set(sum, Expr::add(v(sum), e))]),
            set(sum, Expr::call(MathFn::Log, vec![v(sum)])),
        ]);
        s.push(for_(
            j,
            n,
            vec![Stmt::Store {
                buf: ob,
                index: pos(v(j)),
                value: bin(BinOp::Sub, bin(BinOp::Sub, at(v(j)), v(m)), v(sum)),
            }],
        ));
        s
    }

    /// Softmax of a float16/bfloat16 lane the way the reference computes it: every step
    /// rounds to the element type (`tmp = r(x - max)`, `e = r(exp(tmp))`, a bfloat16 sum
    /// rounds each partial sum, a float16 sum accumulates in f32 and rounds once,
    /// `y = r(e / sum)`). Rounding goes through stores to the output lane, which rounds
    /// to the storage type; `e` is recomputed for the final pass.
    #[allow(clippy::too_many_arguments)]
    fn softmax16(
        k: &mut Kernel,
        x: &TensorRef,
        out: &TensorRef,
        n: usize,
        pos: &dyn Fn(Expr) -> Expr,
        m: VarId,
        sum: VarId,
        j: VarId,
    ) -> Vec<Stmt> {
        if n == 0 {
            return vec![];
        }
        let bf = out.dtype == DType::BF16;
        let acc32 = k.var(Ty::F32);
        let xf = Expr::cast(Ty::F64, Expr::load(x.buf, pos(v(j))));
        let o = |val: Expr| Stmt::Store {
            buf: out.buf,
            index: pos(v(j)),
            value: val,
        };
        let ol = || Expr::load(out.buf, pos(v(j)));
        // out[j] = e_j (rounded).
        let exp_steps = || {
            vec![
                o(Expr::cast(Ty::F32, bin(BinOp::Sub, xf.clone(), v(m)))),
                o(Expr::cast(
                    Ty::F32,
                    Expr::call(MathFn::Exp, vec![Expr::cast(Ty::F64, ol())]),
                )),
            ]
        };
        let d = bin(BinOp::Sub, v(m), v(m));
        let mut sum_body = exp_steps();
        if bf {
            // Round each partial sum through out[j] (recomputed below).
            sum_body.push(o(Expr::cast(
                Ty::F32,
                bin(BinOp::Add, v(sum), Expr::cast(Ty::F64, ol())),
            )));
            sum_body.push(set(sum, Expr::cast(Ty::F64, ol())));
        } else {
            sum_body.push(set(acc32, Expr::add(v(acc32), ol())));
        }
        let mut s = vec![
            set(m, f64c(f64::NEG_INFINITY)),
            for_(
                j,
                n,
                vec![set(
                    m,
                    Expr::select(cmp(CmpOp::Gt, xf.clone(), v(m)), xf.clone(), v(m)),
                )],
            ),
            set(
                m,
                Expr::select(cmp(CmpOp::Eq, d, f64c(0.0)), v(m), f64c(0.0)),
            ),
            set(sum, f64c(0.0)),
            set(acc32, Expr::f(0.0, Ty::F32)),
            for_(j, n, sum_body),
        ];
        if !bf {
            // Round the f32 sum once, through out[0].
            let o0 = pos(Expr::Int(0));
            s.push(Stmt::Store {
                buf: out.buf,
                index: o0.clone(),
                value: v(acc32),
            });
            s.push(set(sum, Expr::cast(Ty::F64, Expr::load(out.buf, o0))));
        }
        let mut fin = exp_steps();
        fin.push(o(Expr::cast(
            Ty::F32,
            bin(BinOp::Div, Expr::cast(Ty::F64, ol()), v(sum)),
        )));
        s.push(for_(j, n, fin));
        s
    }

    // -----------------------------------------------------------------------------------
    // CumSum / CumProd

    /// CumSum/CumProd. A constant axis gives one loop nest; an axis known only at run
    /// time gives one nest per possible axis, each guarded by a test of the axis value.
    fn cum(lw: &mut LowerCtx) -> OpResult<()> {
        let prod = lw.op.op_type == "CumProd";
        let x = lw.input(0)?.clone();
        let out = lw.outputs[0].clone();
        let rank = x.shape.len();
        let axis_in = lw.input(1)?.clone();
        let exclusive = lw.op.attrs.int("exclusive", 0)? != 0;
        let reverse = lw.op.attrs.int("reverse", 0)? != 0;
        let t = x.ty().compute();
        let ot = out.ty().compute();
        let at = if t.is_float() { Ty::F64 } else { t };
        let one = |z: f64| {
            if at == Ty::F64 {
                f64c(z)
            } else {
                ic(z as i128, at)
            }
        };
        // (axis, guard) pairs.
        let cases: Vec<(usize, Option<Expr>)> = if rank == 0 {
            vec![(0, None)]
        } else if let Some(c) = &axis_in.value {
            let a = c
                .to_i64_vec()
                .and_then(|v| v.first().copied())
                .ok_or_else(|| OpError::new("axis must be an integer scalar"))?;
            vec![(axis(a, rank)?, None)]
        } else {
            ensure!(axis_in.len() == 1, "axis must be a scalar");
            let av = Expr::cast(Ty::I64, Expr::load(axis_in.buf, Expr::Int(0)));
            (0..rank)
                .map(|a| {
                    let g = bin(
                        BinOp::Or,
                        cmp(CmpOp::Eq, av.clone(), Expr::Int(a as i64)),
                        cmp(CmpOp::Eq, av.clone(), Expr::Int(a as i64 - rank as i64)),
                    );
                    (a, if rank == 1 { None } else { Some(g) })
                })
                .collect()
        };
        let mut k = lw.kernel("");
        for (ax, guard) in cases {
            let (outer, n, inner) = if rank == 0 {
                (1, 1, 1)
            } else {
                split3(&x.shape, ax)
            };
            let body = nest(&mut k, &[outer, inner], |k, lv| {
                let (o, i) = (lv[0], lv[1]);
                let acc = k.var(at);
                let step = k.var(Ty::I64);
                let j = if reverse {
                    bin(BinOp::Sub, Expr::Int(n as i64 - 1), v(step))
                } else {
                    v(step)
                };
                let p =
                    index(&[o, i], &[n * inner, 1]).add_term(Expr::mul(j, Expr::Int(inner as i64)));
                let xv = Expr::cast(at, Expr::load(x.buf, p.clone()));
                let upd = set(
                    acc,
                    if prod {
                        Expr::mul(v(acc), xv)
                    } else {
                        Expr::add(v(acc), xv)
                    },
                );
                let st = Stmt::Store {
                    buf: out.buf,
                    index: p,
                    value: Expr::cast(ot, v(acc)),
                };
                let body = if exclusive {
                    vec![st, upd]
                } else {
                    vec![upd, st]
                };
                vec![
                    set(acc, one(if prod { 1.0 } else { 0.0 })),
                    for_(step, n, body),
                ]
            });
            match guard {
                None => k.body.extend(body),
                Some(cond) => k.body.push(Stmt::If {
                    cond,
                    then: body,
                    els: vec![],
                }),
            }
        }
        lw.push(k);
        Ok(())
    }

    // -----------------------------------------------------------------------------------
    // TopK (constant k): insertion into the sorted output rows.

    /// Each lane's `k` outputs are kept sorted while its elements are read in order: an
    /// element that comes before the `k`-th kept one (or any, while fewer than `k` are
    /// kept) goes in after the kept ones it does not come before, those past it moving
    /// down one. Elements are read by increasing index, so an element comes before a
    /// kept one only by value (larger, or smaller for `largest = 0`; NaN above every
    /// number, as the reference orders them), never by a tie: equal values keep index
    /// order. One comparison per element that is not kept; `n k` steps at worst (a lane
    /// in sorted order). The rank of every element counted against every other (the
    /// lowering before) was `n^2` always: 128 lanes of 1000, k = 5, took 437 ms against
    /// ONNX Runtime's 0.19.
    fn topk(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let rank = x.shape.len();
        ensure!(rank >= 1, "TopK needs an input of rank >= 1");
        let kk = match lw.opt_input(1) {
            Some(_) => lw
                .const_input(1)?
                .to_i64_vec()
                .and_then(|v| v.first().copied())
                .ok_or_else(|| OpError::new("k must be an integer"))?,
            None => lw.op.attrs.req_int("k")?,
        };
        let ax = axis(lw.op.attrs.int("axis", -1)?, rank)?;
        let largest = lw.op.attrs.int("largest", 1)? != 0;
        let (outer, n, inner) = split3(&x.shape, ax);
        ensure!(kk >= 0 && kk as usize <= n, "k = {kk} is out of range");
        let kk = kk as usize;
        let (vals, idxs): (TensorRef, TensorRef) = (lw.outputs[0].clone(), lw.outputs[1].clone());
        let float = x.ty().compute().is_float();
        let mut k = lw.kernel("");
        if kk == 0 {
            lw.push(k);
            return Ok(());
        }
        let body = nest(&mut k, &[outer, inner], |k, lv| {
            let (o, i) = (lv[0], lv[1]);
            let (j, r, kept, pos) = (
                k.var(Ty::I64),
                k.var(Ty::I64),
                k.var(Ty::I64),
                k.var(Ty::I64),
            );
            let thr = k.var(x.ty().compute());
            let elem = |jx: Expr| {
                Expr::load(
                    x.buf,
                    index(&[o, i], &[n * inner, 1])
                        .add_term(Expr::mul(jx, Expr::Int(inner as i64))),
                )
            };
            let opos = |r: Expr| {
                index(&[o, i], &[kk * inner, 1]).add_term(Expr::mul(r, Expr::Int(inner as i64)))
            };
            let kept_at = |r: Expr| Expr::load(vals.buf, opos(r));
            let not = |c: Expr| bin(BinOp::Xor, c, u8c(true));
            // `a` comes before `b` by value.
            let before = |a: Expr, b: Expr| {
                let op = if largest { CmpOp::Gt } else { CmpOp::Lt };
                let strict = cmp(op, a.clone(), b.clone());
                if !float {
                    return strict;
                }
                let (na, nb) = (is_nan(a), is_nan(b));
                let nan_order = if largest {
                    bin(BinOp::And, na, bin(BinOp::Xor, nb, u8c(true)))
                } else {
                    bin(BinOp::And, nb, bin(BinOp::Xor, na, u8c(true)))
                };
                bin(BinOp::Or, strict, nan_order)
            };
            let k64 = Expr::Int(kk as i64);
            let room = cmp(CmpOp::Lt, v(kept), k64.clone());
            let last = kept_at(Expr::Int(kk as i64 - 1));
            // The element at index `jx` inserted where it belongs, if it does.
            let insert = |jx: Expr| {
                let e = elem(jx.clone());
                let takes = bin(BinOp::Or, room.clone(), before(e.clone(), last.clone()));
                // Its place: the kept ones it does not come before (a prefix).
                let place = for_(
                    r,
                    kk,
                    vec![set(
                        pos,
                        Expr::add(
                            v(pos),
                            Expr::cast(
                                Ty::I64,
                                bin(
                                    BinOp::And,
                                    cmp(CmpOp::Lt, v(r), v(kept)),
                                    not(before(e.clone(), kept_at(v(r)))),
                                ),
                            ),
                        ),
                    )],
                );
                // Kept ones from `pos` move down one, the last first: position `k - 2 - r`.
                let from = bin(BinOp::Sub, Expr::Int(kk as i64 - 2), v(r));
                let shift = for_(
                    r,
                    kk - 1,
                    vec![iff(
                        bin(
                            BinOp::And,
                            cmp(CmpOp::Ge, from.clone(), v(pos)),
                            cmp(CmpOp::Lt, from.clone(), v(kept)),
                        ),
                        vec![
                            store(
                                vals.buf,
                                opos(Expr::add(from.clone(), Expr::Int(1))),
                                kept_at(from.clone()),
                            ),
                            store(
                                idxs.buf,
                                opos(Expr::add(from.clone(), Expr::Int(1))),
                                Expr::load(idxs.buf, opos(from.clone())),
                            ),
                        ],
                    )],
                );
                iff(
                    takes,
                    vec![
                        set(pos, Expr::Int(0)),
                        place,
                        shift,
                        store(vals.buf, opos(v(pos)), e.clone()),
                        store(idxs.buf, opos(v(pos)), jx),
                        set(
                            kept,
                            Expr::select(
                                cmp(CmpOp::Lt, v(kept), k64.clone()),
                                Expr::add(v(kept), Expr::Int(1)),
                                v(kept),
                            ),
                        ),
                    ],
                )
            };
            // The first k elements all go in; after them an element is tested against the
            // k-th kept value held in `thr` (set again after each insertion): one
            // comparison with a register per element. For floats the test is looser, true
            // also where either is NaN (the insertion then works out the NaN order).
            let pass = |e: Expr| {
                let op = if largest { CmpOp::Le } else { CmpOp::Ge };
                if float {
                    not(cmp(op, e, v(thr)))
                } else {
                    before(e, v(thr))
                }
            };
            let after = Expr::add(v(j), Expr::Int(kk as i64));
            let mut lane = vec![set(kept, Expr::Int(0)), for_(j, kk, vec![insert(v(j))])];
            if n > kk {
                lane.push(set(thr, last.clone()));
                lane.push(for_(
                    j,
                    n - kk,
                    vec![iff(
                        pass(elem(after.clone())),
                        vec![insert(after), set(thr, last.clone())],
                    )],
                ));
            }
            lane
        });
        k.body = body;
        lw.push(k);
        Ok(())
    }

    // -----------------------------------------------------------------------------------
    // NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss

    /// Both losses. For SoftmaxCrossEntropyLoss the log-probabilities are computed lane by
    /// lane where needed (and written whole to the optional second output).
    fn loss(lw: &mut LowerCtx) -> OpResult<()> {
        let sce = lw.op.op_type == "SoftmaxCrossEntropyLoss";
        let x = lw.input(0)?.clone();
        let target = lw.input(1)?.clone();
        let weight = lw.opt_input(2).cloned();
        let out = lw.outputs[0].clone();
        let t = x.ty().compute();
        ensure!(t.is_float(), "expected a float input, got {}", x.dtype);
        ensure!(
            x.shape.len() >= 2,
            "the input must have shape (N, C, d1, ...)"
        );
        let ii = lw.op.attrs.get_int("ignore_index")?;
        let red = lw.op.attrs.string("reduction", "mean".to_string())?;
        ensure!(
            matches!(red.as_str(), "none" | "sum" | "mean"),
            "unknown reduction `{red}`"
        );
        let (n, c) = (x.shape[0], x.shape[1]);
        let d: usize = x.shape[2..].iter().product();
        ensure!(
            target.len() == n * d,
            "target shape does not match the input"
        );
        let ot = out.ty().compute();
        let mut k = lw.kernel("");
        let (acc, wsum) = (k.var(Ty::F64), k.var(Ty::F64));
        let (m, sum, lp, cls, val, wt) = (
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::I64),
            k.var(Ty::F64),
            k.var(Ty::F64),
        );
        let cj = k.var(Ty::I64);
        let xat = |i: VarId, cl: Expr, q: VarId| {
            let idx = Expr::add(
                Expr::mul(
                    Expr::add(Expr::mul(v(i), Expr::Int(c as i64)), cl),
                    Expr::Int(d as i64),
                ),
                v(q),
            );
            Expr::cast(Ty::F64, Expr::load(x.buf, idx))
        };
        let per = |i: VarId, q: VarId| -> Vec<Stmt> {
            let mut s = vec![
                set(
                    cls,
                    Expr::cast(
                        Ty::I64,
                        Expr::load(
                            target.buf,
                            Expr::add(Expr::mul(v(i), Expr::Int(d as i64)), v(q)),
                        ),
                    ),
                ),
                set(val, f64c(0.0)),
                set(wt, f64c(0.0)),
            ];
            let mut valid = bin(
                BinOp::And,
                cmp(CmpOp::Ge, v(cls), Expr::Int(0)),
                cmp(CmpOp::Lt, v(cls), Expr::Int(c as i64)),
            );
            if let Some(ii) = ii {
                valid = bin(BinOp::And, valid, cmp(CmpOp::Ne, v(cls), Expr::Int(ii)));
            }
            let mut then = Vec::new();
            if sce {
                let d0 = bin(BinOp::Sub, v(m), v(m));
                then.extend([
                    set(m, f64c(f64::NEG_INFINITY)),
                    for_(
                        cj,
                        c,
                        vec![set(
                            m,
                            Expr::select(
                                cmp(CmpOp::Gt, xat(i, v(cj), q), v(m)),
                                xat(i, v(cj), q),
                                v(m),
                            ),
                        )],
                    ),
                    set(
                        m,
                        Expr::select(cmp(CmpOp::Eq, d0, f64c(0.0)), v(m), f64c(0.0)),
                    ),
                    set(sum, f64c(0.0)),
                    for_(
                        cj,
                        c,
                        vec![set(
                            sum,
                            Expr::add(
                                v(sum),
                                Expr::call(
                                    MathFn::Exp,
                                    vec![bin(BinOp::Sub, xat(i, v(cj), q), v(m))],
                                ),
                            ),
                        )],
                    ),
                    set(
                        lp,
                        bin(
                            BinOp::Sub,
                            bin(BinOp::Sub, xat(i, v(cls), q), v(m)),
                            Expr::call(MathFn::Log, vec![v(sum)]),
                        ),
                    ),
                ]);
            } else {
                then.push(set(lp, xat(i, v(cls), q)));
            }
            then.push(set(
                wt,
                match &weight {
                    Some(w) => Expr::cast(Ty::F64, Expr::load(w.buf, v(cls))),
                    None => f64c(1.0),
                },
            ));
            then.push(set(val, Expr::mul(Expr::un(UnOp::Neg, v(lp)), v(wt))));
            s.push(Stmt::If {
                cond: valid,
                then,
                els: vec![],
            });
            s
        };
        if red == "none" {
            k.body = nest(&mut k, &[n, d], |_, lv| {
                let mut s = per(lv[0], lv[1]);
                s.push(Stmt::Store {
                    buf: out.buf,
                    index: index(lv, &[d, 1]),
                    value: Expr::cast(ot, v(val)),
                });
                s
            });
        } else {
            let mut body = vec![set(acc, f64c(0.0)), set(wsum, f64c(0.0))];
            body.extend(nest(&mut k, &[n, d], |_, lv| {
                let mut s = per(lv[0], lv[1]);
                s.push(set(acc, Expr::add(v(acc), v(val))));
                s.push(set(wsum, Expr::add(v(wsum), v(wt))));
                s
            }));
            let r = if red == "mean" {
                bin(BinOp::Div, v(acc), v(wsum))
            } else {
                v(acc)
            };
            body.push(Stmt::Store {
                buf: out.buf,
                index: Expr::Int(0),
                value: Expr::cast(ot, r),
            });
            k.body = body;
        }
        lw.push(k);
        // The log-probabilities output.
        if sce && lw.outputs.len() >= 2 {
            let lpo = lw.outputs[1].clone();
            let mut k = lw.kernel("log_prob");
            let j = k.var(Ty::I64);
            let (m, sum, lp) = (k.var(Ty::F64), k.var(Ty::F64), k.var(Ty::F64));
            k.body = nest(&mut k, &[n, d], |_, lv| {
                let (i, q) = (lv[0], lv[1]);
                let d0 = bin(BinOp::Sub, v(m), v(m));
                vec![
                    set(m, f64c(f64::NEG_INFINITY)),
                    for_(
                        j,
                        c,
                        vec![set(
                            m,
                            Expr::select(
                                cmp(CmpOp::Gt, xat(i, v(j), q), v(m)),
                                xat(i, v(j), q),
                                v(m),
                            ),
                        )],
                    ),
                    set(
                        m,
                        Expr::select(cmp(CmpOp::Eq, d0, f64c(0.0)), v(m), f64c(0.0)),
                    ),
                    set(sum, f64c(0.0)),
                    for_(
                        j,
                        c,
                        vec![set(
                            sum,
                            Expr::add(
                                v(sum),
                                Expr::call(
                                    MathFn::Exp,
                                    vec![bin(BinOp::Sub, xat(i, v(j), q), v(m))],
                                ),
                            ),
                        )],
                    ),
                    set(lp, Expr::call(MathFn::Log, vec![v(sum)])),
                    for_(
                        j,
                        c,
                        vec![Stmt::Store {
                            buf: lpo.buf,
                            index: Expr::add(
                                Expr::mul(
                                    Expr::add(Expr::mul(v(i), Expr::Int(c as i64)), v(j)),
                                    Expr::Int(d as i64),
                                ),
                                v(q),
                            ),
                            value: Expr::cast(
                                lpo.ty().compute(),
                                bin(BinOp::Sub, bin(BinOp::Sub, xat(i, v(j), q), v(m)), v(lp)),
                            ),
                        }],
                    ),
                ]
            });
            lw.push(k);
        }
        Ok(())
    }

    pub fn register(r: &mut Registry) {
        for op in [
            "ReduceSum",
            "ReduceMean",
            "ReduceMax",
            "ReduceMin",
            "ReduceProd",
            "ReduceL1",
            "ReduceL2",
            "ReduceLogSum",
            "ReduceLogSumExp",
            "ReduceSumSquare",
        ] {
            r.lower(op, Lowering::Custom(reduce));
        }
        r.lower("ArgMax", Lowering::Custom(arg));
        r.lower("ArgMin", Lowering::Custom(arg));
        for op in ["Softmax", "LogSoftmax", "Hardmax"] {
            r.lower(op, Lowering::Custom(soft));
        }
        r.lower("CumSum", Lowering::Custom(cum));
        r.lower("CumProd", Lowering::Custom(cum));
        r.lower("TopK", Lowering::Custom(topk));
        r.lower("NegativeLogLikelihoodLoss", Lowering::Custom(loss));
        r.lower("SoftmaxCrossEntropyLoss", Lowering::Custom(loss));
    }
}
