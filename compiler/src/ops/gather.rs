//! Indexing ops: Gather, GatherElements, GatherND, Scatter, ScatterElements, ScatterND,
//! TensorScatter, Compress, OneHot, NonZero, Unique.
//!
//! Data movement is generic over the element type; reductions compute in f64 (floats)
//! or i128 (integers) and convert back.

#![allow(clippy::clone_on_copy)] // generic bodies clone elements that are `Copy` for most dtypes

use super::shape::{at, build, generic};
use super::util::{arr, axis, dims, f64s, i128s, input, ints, numel, opt_input, out, outs};
use super::{OpCtx, Registry};
use crate::ir::{DType, OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{ArrayD, Axis, Dimension, IxDyn};
use std::cmp::Ordering;

pub fn register(r: &mut Registry) {
    r.add("Gather", gather);
    r.add("GatherElements", gather_elements);
    r.add("GatherND", gather_nd);
    r.add("Scatter", scatter_elements);
    r.add("ScatterElements", scatter_elements);
    r.add("ScatterND", scatter_nd);
    r.add("TensorScatter", tensor_scatter);
    r.add("Compress", compress);
    r.add_shaped("OneHot", one_hot, &[1]);
    r.add_dynamic("NonZero", nonzero);
    r.add_dynamic("Unique", unique);
    lower::register(r);
}

/// Normalises a possibly negative index against `dim`.
fn norm_index(i: i64, dim: usize) -> OpResult<usize> {
    let d = dim as i64;
    ensure!(
        i >= -d && i < d,
        "index {i} is out of bounds for an axis of size {dim}"
    );
    Ok(if i < 0 { i + d } else { i } as usize)
}

/// An integer tensor as an i64 array of the same shape.
fn index_array(t: &Tensor) -> OpResult<ArrayD<i64>> {
    ensure!(
        t.dtype().is_int(),
        "indices must be integers, got {}",
        t.dtype()
    );
    Ok(i128s(t)?.mapv(|x| x as i64))
}

fn gather(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    let idx = index_array(input(ins, 1)?)?;
    ensure!(t.rank() >= 1, "Gather: data must have rank >= 1");
    let ax = axis(ctx.attrs.int("axis", 0)?, t.rank())?;
    let dim = t.shape()[ax];
    let q = idx.ndim();
    let mut shape = t.shape()[..ax].to_vec();
    shape.extend(idx.shape());
    shape.extend(&t.shape()[ax + 1..]);
    dims(&shape.iter().map(|&d| d as i64).collect::<Vec<_>>())?;
    out(generic!(t, T => {
        let a = arr::<T>(t)?;
        let mut src = vec![0usize; t.rank()];
        build(&shape, |o| {
            src[..ax].copy_from_slice(&o[..ax]);
            src[ax] = norm_index(*at(&idx, &o[ax..ax + q])?, dim)?;
            src[ax + 1..].copy_from_slice(&o[ax + q..]);
            Ok(at(a, &src)?.clone())
        })?
    }))
}

fn gather_elements(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    let idx = index_array(input(ins, 1)?)?;
    ensure!(
        idx.ndim() == t.rank() && t.rank() >= 1,
        "GatherElements: data and indices must have the same rank"
    );
    let ax = axis(ctx.attrs.int("axis", 0)?, t.rank())?;
    let dim = t.shape()[ax];
    out(generic!(t, T => {
        let a = arr::<T>(t)?;
        let mut src = vec![0usize; t.rank()];
        build(idx.shape(), |o| {
            src.copy_from_slice(o);
            src[ax] = norm_index(*at(&idx, o)?, dim)?;
            Ok(at(a, &src)?.clone())
        })?
    }))
}

fn gather_nd(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    let idx = index_array(input(ins, 1)?)?;
    let b = ctx.attrs.int("batch_dims", 0)?;
    let r = t.rank();
    let q = idx.ndim();
    ensure!(
        b >= 0 && (b as usize) < r.min(q),
        "GatherND: bad batch_dims {b}"
    );
    let b = b as usize;
    ensure!(q >= 1, "GatherND: indices must have rank >= 1");
    let k = idx.shape()[q - 1];
    ensure!(
        k >= 1 && b + k <= r,
        "GatherND: last indices dimension {k} is too large"
    );
    ensure!(
        idx.shape()[..b] == t.shape()[..b],
        "GatherND: batch dimensions differ"
    );
    let mut shape = idx.shape()[..q - 1].to_vec();
    shape.extend(&t.shape()[b + k..]);
    dims(&shape.iter().map(|&d| d as i64).collect::<Vec<_>>())?;
    out(generic!(t, T => {
        let a = arr::<T>(t)?;
        let mut src = vec![0usize; r];
        let mut ii = vec![0usize; q];
        build(&shape, |o| {
            src[..b].copy_from_slice(&o[..b]);
            ii[..q - 1].copy_from_slice(&o[..q - 1]);
            for j in 0..k {
                ii[q - 1] = j;
                src[b + j] = norm_index(*at(&idx, &ii)?, t.shape()[b + j])?;
            }
            src[b + k..].copy_from_slice(&o[q - 1..]);
            Ok(at(a, &src)?.clone())
        })?
    }))
}

#[derive(Clone, Copy, PartialEq)]
enum Red {
    None,
    Add,
    Mul,
    Max,
    Min,
}

fn reduction(ctx: &OpCtx) -> OpResult<Red> {
    Ok(
        match ctx.attrs.string("reduction", "none".into())?.as_str() {
            "none" => Red::None,
            "add" => Red::Add,
            "mul" => Red::Mul,
            "max" => Red::Max,
            "min" => Red::Min,
            r => bail!("unknown reduction {r:?}"),
        },
    )
}

/// Scatters `upd` into a copy of `data` at `targets` (one destination index per update
/// element, in the update's row-major order), combining with `red`.
fn scatter_with(data: &Tensor, upd: &Tensor, targets: &[Vec<usize>], red: Red) -> OpResult<Tensor> {
    ensure!(
        data.dtype() == upd.dtype(),
        "updates dtype {} differs from data dtype {}",
        upd.dtype(),
        data.dtype()
    );
    ensure!(
        targets.len() == upd.len(),
        "internal: target count mismatch"
    );
    fn run<T: Clone>(
        a: &ArrayD<T>,
        u: &ArrayD<T>,
        targets: &[Vec<usize>],
        f: impl Fn(&T, &T) -> T,
    ) -> OpResult<ArrayD<T>> {
        let mut o = a.to_owned();
        for (t, v) in targets.iter().zip(u.iter()) {
            let dst = o
                .get_mut(IxDyn(t))
                .ok_or_else(|| OpError::new(format!("scatter index {t:?} out of bounds")))?;
            *dst = f(dst, v);
        }
        Ok(o)
    }
    let dt = data.dtype();
    if red == Red::None {
        return Ok(
            generic!(data, T => run(arr::<T>(data)?, arr::<T>(upd)?, targets, |_, v| v.clone())?),
        );
    }
    if dt.is_float() {
        let f = match red {
            Red::Add => |a: &f64, b: &f64| a + b,
            Red::Mul => |a: &f64, b: &f64| a * b,
            Red::Max => |a: &f64, b: &f64| a.max(*b),
            _ => |a: &f64, b: &f64| a.min(*b),
        };
        let r = run(&f64s(data)?, &f64s(upd)?, targets, f)?;
        Ok(Tensor::from_f64(dt, r, false))
    } else if dt.is_int() || dt == DType::Bool {
        let f = match red {
            Red::Add => |a: &i128, b: &i128| a.wrapping_add(*b),
            Red::Mul => |a: &i128, b: &i128| a.wrapping_mul(*b),
            Red::Max => |a: &i128, b: &i128| *a.max(b),
            _ => |a: &i128, b: &i128| *a.min(b),
        };
        let r = run(&i128s(data)?, &i128s(upd)?, targets, f)?;
        Ok(Tensor::from_i128(dt, r))
    } else {
        bail!("reductions need numeric data, got {dt}")
    }
}

fn scatter_elements(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    let idx = index_array(input(ins, 1)?)?;
    let upd = input(ins, 2)?;
    let red = reduction(ctx)?;
    let r = t.rank();
    ensure!(
        idx.ndim() == r && upd.shape() == idx.shape() && r >= 1,
        "ScatterElements: indices and updates must have the data's rank and one shape"
    );
    let ax = axis(ctx.attrs.int("axis", 0)?, r)?;
    let mut targets = Vec::with_capacity(idx.len());
    let idx = idx.as_standard_layout();
    let mut pos = vec![0usize; r];
    for (n, &i) in idx.iter().enumerate() {
        // Row-major multi-index of element n.
        let mut k = n;
        for d in (0..r).rev() {
            pos[d] = k % idx.shape()[d];
            k /= idx.shape()[d];
        }
        let mut dst = pos.clone();
        dst[ax] = norm_index(i, t.shape()[ax])?;
        targets.push(dst);
    }
    out(scatter_with(t, &upd.standard(), &targets, red)?)
}

fn scatter_nd(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    let idx = index_array(input(ins, 1)?)?;
    let upd = input(ins, 2)?;
    let red = reduction(ctx)?;
    let r = t.rank();
    let q = idx.ndim();
    ensure!(q >= 1, "ScatterND: indices must have rank >= 1");
    let k = idx.shape()[q - 1];
    ensure!(
        k <= r,
        "ScatterND: last indices dimension {k} exceeds rank {r}"
    );
    let mut ushape = idx.shape()[..q - 1].to_vec();
    ushape.extend(&t.shape()[k..]);
    ensure!(
        upd.shape() == ushape.as_slice(),
        "ScatterND: updates shape {:?} should be {:?}",
        upd.shape(),
        ushape
    );
    let idx = idx.as_standard_layout();
    let flat = idx
        .as_slice()
        .ok_or_else(|| OpError::new("ScatterND: layout"))?;
    let n_idx = numel(&idx.shape()[..q - 1]);
    let rest = &t.shape()[k..];
    let n_rest = numel(rest);
    let mut targets = Vec::with_capacity(n_idx * n_rest);
    for i in 0..n_idx {
        let mut base = Vec::with_capacity(r);
        for j in 0..k {
            base.push(norm_index(flat[i * k + j], t.shape()[j])?);
        }
        for m in 0..n_rest {
            let mut dst = base.clone();
            let mut tail = vec![0; rest.len()];
            let mut x = m;
            for d in (0..rest.len()).rev() {
                tail[d] = x % rest[d];
                x /= rest[d];
            }
            dst.extend(tail);
            targets.push(dst);
        }
    }
    out(scatter_with(t, &upd.standard(), &targets, red)?)
}

fn tensor_scatter(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let past = input(ins, 0)?;
    let upd = input(ins, 1)?;
    let r = past.rank();
    ensure!(r >= 2, "TensorScatter: past_cache must have rank >= 2");
    ensure!(upd.rank() == r, "TensorScatter: update rank differs");
    ensure!(past.dtype() == upd.dtype(), "TensorScatter: dtypes differ");
    let ax = axis(ctx.attrs.int("axis", -2)?, r)?;
    ensure!(ax >= 1, "TensorScatter: axis cannot be the batch axis");
    let circular = match ctx.attrs.string("mode", "linear".into())?.as_str() {
        "linear" => false,
        "circular" => true,
        m => bail!("TensorScatter: unknown mode {m:?}"),
    };
    for i in 0..r {
        if i == ax {
            ensure!(
                upd.shape()[i] <= past.shape()[i],
                "TensorScatter: update too long"
            );
        } else {
            ensure!(
                upd.shape()[i] == past.shape()[i],
                "TensorScatter: shapes differ"
            );
        }
    }
    let batch = past.shape()[0];
    let wi = match opt_input(ins, 2)? {
        Some(w) => ints(w)?,
        None => vec![0; batch],
    };
    ensure!(
        wi.len() == batch,
        "TensorScatter: write_indices has the wrong length"
    );
    let maxlen = past.shape()[ax] as i64;
    let up = upd.standard();
    let mut targets = Vec::with_capacity(up.len());
    let us = up.shape().to_vec();
    let mut pos = vec![0usize; r];
    for n in 0..up.len() {
        let mut k = n;
        for d in (0..r).rev() {
            pos[d] = k % us[d];
            k /= us[d];
        }
        let mut dst = pos.clone();
        let mut s = wi[pos[0]].saturating_add(pos[ax] as i64);
        if circular {
            s = s.rem_euclid(maxlen.max(1));
        }
        ensure!(
            s >= 0 && s < maxlen,
            "TensorScatter: write index {s} out of range"
        );
        dst[ax] = s as usize;
        targets.push(dst);
    }
    out(scatter_with(past, &up, &targets, Red::None)?)
}

fn compress(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    let c = input(ins, 1)?;
    ensure!(c.rank() == 1, "Compress: condition must be 1-D");
    let cond = c
        .to_bool()
        .ok_or_else(|| OpError::new("Compress: bad condition"))?;
    let (src, ax) = match ctx.attrs.get_int("axis")? {
        Some(a) => (t.clone(), axis(a, t.rank())?),
        None => (
            t.reshape(&[t.len()])
                .ok_or_else(|| OpError::new("Compress: reshape"))?,
            0,
        ),
    };
    let dim = src.shape()[ax];
    ensure!(
        cond.len() <= dim,
        "Compress: condition longer than the axis ({} > {dim})",
        cond.len()
    );
    let sel: Vec<usize> = cond
        .iter()
        .enumerate()
        .filter(|(_, &b)| b)
        .map(|(i, _)| i)
        .collect();
    out(generic!(src, T => arr::<T>(&src)?.select(Axis(ax), &sel)))
}

fn one_hot(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let ind = input(ins, 0)?;
    let depth = input(ins, 1)?;
    let values = input(ins, 2)?;
    ensure!(values.len() == 2, "OneHot: values must have two elements");
    ensure!(depth.len() == 1, "OneHot: depth must be a scalar");
    let depth = f64s(depth)?.iter().next().copied().unwrap_or_default();
    ensure!(
        depth >= 1.0 && depth.is_finite(),
        "OneHot: depth must be positive"
    );
    let depth = depth as i64;
    let r = ind.rank();
    let ax = axis(ctx.attrs.int("axis", -1)?, r + 1)?;
    let iv = f64s(ind)?.mapv(|x| x as i64);
    let mut shape = ind.shape()[..ax].to_vec();
    shape.push(depth as usize);
    shape.extend(&ind.shape()[ax..]);
    dims(&shape.iter().map(|&d| d as i64).collect::<Vec<_>>())?;
    let values = values
        .reshape(&[2])
        .ok_or_else(|| OpError::new("OneHot: values"))?;
    let mut src = vec![0usize; r];
    out(generic!(values, T => {
        let v = arr::<T>(&values)?;
        let (off, on) = (v[[0].as_slice()].clone(), v[[1].as_slice()].clone());
        build(&shape, |o| {
            src[..ax].copy_from_slice(&o[..ax]);
            src[ax..].copy_from_slice(&o[ax + 1..]);
            let mut i = *at(&iv, &src)?;
            if i < 0 {
                i += depth;
            }
            Ok(if i == o[ax] as i64 { on.clone() } else { off.clone() })
        })?
    }))
}

fn nonzero(_ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    let b = t
        .to_bool()
        .ok_or_else(|| OpError::new("NonZero: unsupported dtype"))?;
    let b = if b.ndim() == 0 {
        b.into_shape_with_order(IxDyn(&[1]))
            .map_err(|e| OpError::new(e.to_string()))?
    } else {
        b
    };
    let r = b.ndim();
    let hits: Vec<Vec<usize>> = b
        .indexed_iter()
        .filter(|(_, &v)| v)
        .map(|(i, _)| i.slice().to_vec())
        .collect();
    let n = hits.len();
    let mut v = vec![0i64; r * n];
    for (j, h) in hits.iter().enumerate() {
        for d in 0..r {
            v[d * n + j] = h[d] as i64;
        }
    }
    out(Tensor::from_vec(&[r, n], v))
}

/// A totally ordered key for one element.
#[derive(Clone, Debug)]
enum Key {
    F(f64),
    I(i128),
    S(String),
}

impl Key {
    fn cmp(&self, o: &Key) -> Ordering {
        match (self, o) {
            (Key::F(a), Key::F(b)) => {
                // NaN sorts last, like NumPy.
                match (a.is_nan(), b.is_nan()) {
                    (true, true) => Ordering::Equal,
                    (true, false) => Ordering::Greater,
                    (false, true) => Ordering::Less,
                    _ => a.partial_cmp(b).unwrap_or(Ordering::Equal),
                }
            }
            (Key::I(a), Key::I(b)) => a.cmp(b),
            (Key::S(a), Key::S(b)) => a.cmp(b),
            _ => Ordering::Equal,
        }
    }
}

fn keys(t: &Tensor) -> OpResult<Vec<Key>> {
    let t = t.standard();
    Ok(if t.dtype() == DType::Str {
        arr::<String>(&t)?
            .iter()
            .map(|s| Key::S(s.clone()))
            .collect()
    } else if t.dtype().is_float() {
        f64s(&t)?.iter().map(|&x| Key::F(x)).collect()
    } else {
        i128s(&t)?.iter().map(|&x| Key::I(x)).collect()
    })
}

fn cmp_rows(a: &[Key], b: &[Key]) -> Ordering {
    for (x, y) in a.iter().zip(b) {
        let o = x.cmp(y);
        if o != Ordering::Equal {
            return o;
        }
    }
    Ordering::Equal
}

fn unique(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    let sorted = ctx.attrs.int("sorted", 1)? != 0;
    let (src, ax) = match ctx.attrs.get_int("axis")? {
        Some(a) => (t.clone(), axis(a, t.rank())?),
        None => (
            t.reshape(&[t.len()])
                .ok_or_else(|| OpError::new("Unique: reshape"))?,
            0,
        ),
    };
    // Rows: the sub-tensors along `ax`, each flattened, as keys.
    let n = src.shape()[ax];
    let mut perm: Vec<usize> = vec![ax];
    perm.extend((0..src.rank()).filter(|&d| d != ax));
    let moved = if ax == 0 {
        src.standard()
    } else {
        let p = perm.clone();
        crate::map_data!(src, a => a.view().permuted_axes(IxDyn(&p)).as_standard_layout().into_owned())
    };
    let ks = keys(&moved)?;
    let w = ks.len().checked_div(n).unwrap_or(0);
    let rows: Vec<&[Key]> = (0..n).map(|i| &ks[i * w..(i + 1) * w]).collect();
    // Sort row ids by value (stable keeps first occurrences first).
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| cmp_rows(rows[a], rows[b]));
    // Groups of equal rows, in sorted order: (first index, members).
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for &i in &order {
        match groups.last_mut() {
            Some(g) if cmp_rows(rows[g.0], rows[i]) == Ordering::Equal => g.1.push(i),
            _ => groups.push((i, vec![i])),
        }
    }
    if !sorted {
        groups.sort_by_key(|g| g.0);
    }
    let mut inverse = vec![0i64; n];
    for (gi, g) in groups.iter().enumerate() {
        for &m in &g.1 {
            inverse[m] = gi as i64;
        }
    }
    let first: Vec<usize> = groups.iter().map(|g| g.0).collect();
    let y = generic!(src, T => arr::<T>(&src)?.select(Axis(ax), &first));
    let u = groups.len();
    let mut res = vec![y];
    if ctx.n_outputs > 1 {
        res.push(Tensor::from_vec(
            &[u],
            first.iter().map(|&i| i as i64).collect(),
        ));
    }
    if ctx.n_outputs > 2 {
        res.push(Tensor::from_vec(&[n], inverse));
    }
    if ctx.n_outputs > 3 {
        res.push(Tensor::from_vec(
            &[u],
            groups.iter().map(|g| g.1.len() as i64).collect(),
        ));
    }
    outs(res)
}

/// Lowerings: with constant indices, data movement through index tables; with runtime
/// indices, dedicated loops that wrap negative indices and clamp out-of-range ones.
mod lower {
    use crate::ir::{OpError, OpResult};
    use crate::kir::{BinOp, CmpOp, Expr, Kernel, Stmt, Ty, VarId};
    use crate::ops::lowering::{
        index, lit, lower_by_index_map, nest, strides, LowerCtx, TensorRef,
    };
    use crate::ops::{Lowering, Registry};
    use crate::{bail, ensure};

    /// The sum of the terms (0 when there are none).
    fn sum(terms: Vec<Expr>) -> Expr {
        terms.into_iter().reduce(Expr::add).unwrap_or(Expr::Int(0))
    }

    /// `e * s` (skipping multiplications by 1).
    fn scale(e: Expr, s: usize) -> Expr {
        if s == 1 {
            e
        } else {
            Expr::mul(e, Expr::Int(s as i64))
        }
    }

    /// An index element as i64.
    fn load_i64(t: &TensorRef, idx: Expr) -> Expr {
        let l = Expr::load(t.buf, idx);
        if t.ty() == Ty::I64 {
            l
        } else {
            Expr::cast(Ty::I64, l)
        }
    }

    /// Wraps a negative index against `dim` and clamps it into `0..dim`.
    fn norm(i: Expr, dim: usize) -> Expr {
        let d = dim as i64;
        let w = Expr::select(
            Expr::cmp(CmpOp::Lt, i.clone(), Expr::Int(0)),
            Expr::add(i.clone(), Expr::Int(d)),
            i,
        );
        Expr::bin(
            BinOp::Max,
            Expr::bin(BinOp::Min, w, Expr::Int(d - 1)),
            Expr::Int(0),
        )
    }

    /// `sum(vars[d] * strides[d])` as a list of terms.
    fn terms(vars: &[VarId], st: &[usize]) -> Vec<Expr> {
        vars.iter()
            .zip(st)
            .filter(|(_, &s)| s != 0)
            .map(|(&v, &s)| scale(Expr::Var(v), s))
            .collect()
    }

    /// The index-table lowering (constant indices).
    fn movement(lw: &mut LowerCtx) -> OpResult<()> {
        let op = lw.node_op;
        let fill = lw.outputs.first().map(|o| lit(0.0, o.ty()));
        lower_by_index_map(lw, &|ins| op.eval(ins), &[0], &[], fill)
    }

    fn indices_const(lw: &LowerCtx, i: usize) -> bool {
        lw.opt_input(i).is_some_and(|t| t.value.is_some())
    }

    fn axis_of(lw: &LowerCtx, rank: usize, default: i64) -> OpResult<usize> {
        let a = lw.op.attrs.int("axis", default)?;
        let r = rank as i64;
        ensure!(a >= -r && a < r, "axis {a} is out of range for rank {rank}");
        Ok(if a < 0 { a + r } else { a } as usize)
    }

    fn push_nest(
        lw: &mut LowerCtx,
        suffix: &str,
        shape: &[usize],
        f: impl FnOnce(&mut Kernel, &[VarId]) -> Vec<Stmt>,
    ) {
        // Empty shapes still get a (zero-trip) loop, so the output counts as written.
        let mut k = lw.kernel(suffix);
        k.body = nest(&mut k, shape, f);
        lw.push(k);
    }

    fn gather(lw: &mut LowerCtx) -> OpResult<()> {
        if indices_const(lw, 1) {
            return movement(lw);
        }
        let x = lw.input(0)?.clone();
        let ind = lw.input(1)?.clone();
        let out = lw.outputs[0].clone();
        let r = x.shape.len();
        ensure!(r >= 1, "Gather: data must have rank >= 1");
        let ax = axis_of(lw, r, 0)?;
        let q = ind.shape.len();
        let dim = x.shape[ax];
        if dim == 0 && !out.is_empty() {
            bail!("Gather: indices into an empty axis");
        }
        let xs = strides(&x.shape);
        let is = strides(&ind.shape);
        let os = strides(&out.shape);
        push_nest(lw, "", &out.shape.clone(), |_, v| {
            let mut t = terms(&v[..ax], &xs[..ax]);
            let i = load_i64(&ind, index(&v[ax..ax + q], &is));
            t.push(scale(norm(i, dim), xs[ax]));
            t.extend(terms(&v[ax + q..], &xs[ax + 1..]));
            vec![Stmt::Store {
                buf: out.buf,
                index: index(v, &os),
                value: Expr::load(x.buf, sum(t)),
            }]
        });
        Ok(())
    }

    fn gather_elements(lw: &mut LowerCtx) -> OpResult<()> {
        if indices_const(lw, 1) {
            return movement(lw);
        }
        let x = lw.input(0)?.clone();
        let ind = lw.input(1)?.clone();
        let out = lw.outputs[0].clone();
        let r = x.shape.len();
        ensure!(
            r >= 1 && ind.shape.len() == r,
            "GatherElements: data and indices must have the same rank"
        );
        let ax = axis_of(lw, r, 0)?;
        let dim = x.shape[ax];
        if dim == 0 && !out.is_empty() {
            bail!("GatherElements: indices into an empty axis");
        }
        let xs = strides(&x.shape);
        let is = strides(&ind.shape);
        push_nest(lw, "", &ind.shape.clone(), |_, v| {
            let mut t = Vec::new();
            for d in 0..r {
                if d == ax {
                    let i = load_i64(&ind, index(v, &is));
                    t.push(scale(norm(i, dim), xs[d]));
                } else {
                    t.push(scale(Expr::Var(v[d]), xs[d]));
                }
            }
            vec![Stmt::Store {
                buf: out.buf,
                index: index(v, &is),
                value: Expr::load(x.buf, sum(t)),
            }]
        });
        Ok(())
    }

    fn gather_nd(lw: &mut LowerCtx) -> OpResult<()> {
        if indices_const(lw, 1) {
            return movement(lw);
        }
        let x = lw.input(0)?.clone();
        let ind = lw.input(1)?.clone();
        let out = lw.outputs[0].clone();
        let b = lw.op.attrs.int("batch_dims", 0)?;
        let (r, q) = (x.shape.len(), ind.shape.len());
        ensure!(
            q >= 1 && b >= 0 && (b as usize) < r.min(q),
            "GatherND: bad batch_dims {b}"
        );
        let b = b as usize;
        let k = ind.shape[q - 1];
        ensure!(
            k >= 1 && b + k <= r,
            "GatherND: last indices dimension {k} is too large"
        );
        ensure!(
            ind.shape[..b] == x.shape[..b],
            "GatherND: batch dimensions differ"
        );
        if x.shape[b..b + k].contains(&0) && !out.is_empty() {
            bail!("GatherND: indices into an empty axis");
        }
        let xs = strides(&x.shape);
        let is = strides(&ind.shape);
        let os = strides(&out.shape);
        push_nest(lw, "", &out.shape.clone(), |_, v| {
            let mut t = terms(&v[..b], &xs[..b]);
            let base = index(&v[..q - 1], &is[..q - 1]);
            for j in 0..k {
                let i = load_i64(&ind, Expr::add(base.clone(), Expr::Int(j as i64)));
                t.push(scale(norm(i, x.shape[b + j]), xs[b + j]));
            }
            t.extend(terms(&v[q - 1..], &xs[b + k..]));
            vec![Stmt::Store {
                buf: out.buf,
                index: index(v, &os),
                value: Expr::load(x.buf, sum(t)),
            }]
        });
        Ok(())
    }

    /// `out = data` as a flat copy.
    fn copy(lw: &mut LowerCtx, x: &TensorRef, out: &TensorRef) {
        push_nest(lw, "copy", &[out.len()], |_, v| {
            vec![Stmt::Store {
                buf: out.buf,
                index: Expr::Var(v[0]),
                value: Expr::load(x.buf, Expr::Var(v[0])),
            }]
        });
    }

    /// The reduction attribute, checked.
    fn reduction(lw: &LowerCtx) -> OpResult<String> {
        let red = lw.op.attrs.string("reduction", "none".into())?;
        ensure!(
            matches!(red.as_str(), "none" | "add" | "mul" | "max" | "min"),
            "unknown reduction {red:?}"
        );
        Ok(red)
    }

    /// The value to store at `dst`, combining the old value with `u` per `red`.
    fn combine(red: &str, out: &TensorRef, dst: Expr, u: Expr) -> Expr {
        let old = Expr::load(out.buf, dst);
        match red {
            "add" => Expr::add(old, u),
            "mul" => Expr::mul(old, u),
            "max" => Expr::bin(BinOp::Max, old, u),
            "min" => Expr::bin(BinOp::Min, old, u),
            _ => u,
        }
    }

    /// ScatterElements and the deprecated Scatter: copy, then scatter in order.
    fn scatter_elements(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let ind = lw.input(1)?.clone();
        let upd = lw.input(2)?.clone();
        let out = lw.outputs[0].clone();
        let r = x.shape.len();
        ensure!(
            r >= 1 && ind.shape.len() == r && upd.shape == ind.shape,
            "ScatterElements: indices and updates must have the data's rank and one shape"
        );
        ensure!(upd.ty() == x.ty(), "ScatterElements: updates dtype differs");
        let ax = axis_of(lw, r, 0)?;
        let red = reduction(lw)?;
        let dim = x.shape[ax];
        if dim == 0 && !ind.is_empty() {
            bail!("ScatterElements: indices into an empty axis");
        }
        copy(lw, &x, &out);
        let os = strides(&out.shape);
        let is = strides(&ind.shape);
        push_nest(lw, "scatter", &ind.shape.clone(), |_, v| {
            let mut t = Vec::new();
            for d in 0..r {
                if d == ax {
                    let i = load_i64(&ind, index(v, &is));
                    t.push(scale(norm(i, dim), os[d]));
                } else {
                    t.push(scale(Expr::Var(v[d]), os[d]));
                }
            }
            let dst = sum(t);
            let u = Expr::load(upd.buf, index(v, &is));
            vec![Stmt::Store {
                buf: out.buf,
                index: dst.clone(),
                value: combine(&red, &out, dst, u),
            }]
        });
        Ok(())
    }

    fn scatter_nd(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let ind = lw.input(1)?.clone();
        let upd = lw.input(2)?.clone();
        let out = lw.outputs[0].clone();
        let (r, q) = (x.shape.len(), ind.shape.len());
        ensure!(q >= 1, "ScatterND: indices must have rank >= 1");
        let k = ind.shape[q - 1];
        ensure!(
            k <= r,
            "ScatterND: last indices dimension {k} exceeds rank {r}"
        );
        let mut ushape = ind.shape[..q - 1].to_vec();
        ushape.extend(&x.shape[k..]);
        ensure!(
            upd.shape == ushape,
            "ScatterND: updates shape {:?} should be {ushape:?}",
            upd.shape
        );
        ensure!(upd.ty() == x.ty(), "ScatterND: updates dtype differs");
        let red = reduction(lw)?;
        if x.shape[..k].contains(&0) && !upd.is_empty() {
            bail!("ScatterND: indices into an empty axis");
        }
        copy(lw, &x, &out);
        let os = strides(&out.shape);
        let is = strides(&ind.shape);
        let us = strides(&upd.shape);
        push_nest(lw, "scatter", &ushape, |_, v| {
            let base = index(&v[..q - 1], &is[..q - 1]);
            let mut t = Vec::new();
            for (j, (&dim, &st)) in x.shape.iter().zip(&os).take(k).enumerate() {
                let i = load_i64(&ind, Expr::add(base.clone(), Expr::Int(j as i64)));
                t.push(scale(norm(i, dim), st));
            }
            t.extend(terms(&v[q - 1..], &os[k..]));
            let dst = sum(t);
            let u = Expr::load(upd.buf, index(v, &us));
            vec![Stmt::Store {
                buf: out.buf,
                index: dst.clone(),
                value: combine(&red, &out, dst, u),
            }]
        });
        Ok(())
    }

    fn one_hot(lw: &mut LowerCtx) -> OpResult<()> {
        let ind = lw.input(0)?.clone();
        let vals = lw.input(2)?.clone();
        let out = lw.outputs[0].clone();
        let depth = lw
            .const_input(1)?
            .to_f64_vec()
            .and_then(|v| v.first().copied())
            .ok_or_else(|| OpError::new("OneHot: depth must be a scalar"))?;
        ensure!(
            depth >= 1.0 && depth.is_finite(),
            "OneHot: depth must be positive"
        );
        ensure!(vals.len() == 2, "OneHot: values must have two elements");
        let depth = depth as i64;
        let r = ind.shape.len();
        let ax = axis_of(lw, r + 1, -1)?;
        let is = strides(&ind.shape);
        let os = strides(&out.shape);
        let it = ind.ty();
        push_nest(lw, "", &out.shape.clone(), |_, v| {
            let mut iv: Vec<VarId> = v[..ax].to_vec();
            iv.extend(&v[ax + 1..]);
            let raw = Expr::load(ind.buf, index(&iv, &is));
            let i = if it == Ty::I64 {
                raw
            } else {
                Expr::cast(Ty::I64, raw)
            };
            let i = Expr::select(
                Expr::cmp(CmpOp::Lt, i.clone(), Expr::Int(0)),
                Expr::add(i.clone(), Expr::Int(depth)),
                i,
            );
            vec![Stmt::Store {
                buf: out.buf,
                index: index(v, &os),
                value: Expr::select(
                    Expr::cmp(CmpOp::Eq, i, Expr::Var(v[ax])),
                    Expr::load(vals.buf, Expr::Int(1)),
                    Expr::load(vals.buf, Expr::Int(0)),
                ),
            }]
        });
        Ok(())
    }

    mod tensor_scatter {
        use crate::ir::OpResult;
        use crate::kir::{BinOp, CmpOp, Expr, Stmt, Ty};
        use crate::ops::lowering::{index, nest, strides, LowerCtx};
        use crate::ops::{Lowering, Registry};
        use crate::{bail, ensure};

        fn tensor_scatter(lw: &mut LowerCtx) -> OpResult<()> {
            let past = lw.input(0)?.clone();
            let upd = lw.input(1)?.clone();
            let wi = lw.opt_input(2).cloned();
            let out = lw.outputs[0].clone();
            let r = past.shape.len();
            ensure!(r >= 2 && upd.shape.len() == r, "TensorScatter: ranks");
            let a = lw.op.attrs.int("axis", -2)?;
            let ax = if a < 0 { a + r as i64 } else { a };
            ensure!(ax >= 1 && ax < r as i64, "TensorScatter: axis");
            let ax = ax as usize;
            let circular = match lw.op.attrs.string("mode", "linear".into())?.as_str() {
                "linear" => false,
                "circular" => true,
                m => bail!("TensorScatter: unknown mode {m:?}"),
            };
            let mut k = lw.kernel("copy");
            let j = k.var(Ty::I64);
            k.body = vec![Stmt::For {
                var: j,
                extent: out.len() as u64,
                body: vec![Stmt::Store {
                    buf: out.buf,
                    index: Expr::Var(j),
                    value: Expr::load(past.buf, Expr::Var(j)),
                }],
            }];
            lw.push(k);
            if upd.is_empty() {
                return Ok(());
            }
            let maxlen = past.shape[ax] as i64;
            let os = strides(&out.shape);
            let us = strides(&upd.shape);
            let mut k = lw.kernel("");
            let s = k.var(Ty::I64);
            let body = nest(&mut k, &upd.shape, |_, v| {
                let w = match &wi {
                    Some(w) => Expr::cast(Ty::I64, Expr::load(w.buf, Expr::Var(v[0]))),
                    None => Expr::Int(0),
                };
                let mut st = vec![Stmt::Set {
                    var: s,
                    value: Expr::add(w, Expr::Var(v[ax])),
                }];
                if circular {
                    let m = Expr::Int(maxlen.max(1));
                    let rem = Expr::bin(BinOp::Rem, Expr::Var(s), m.clone());
                    st.push(Stmt::Set {
                        var: s,
                        value: Expr::select(
                            Expr::cmp(CmpOp::Lt, rem.clone(), Expr::Int(0)),
                            Expr::add(rem.clone(), m),
                            rem,
                        ),
                    });
                }
                let mut oi = Expr::mul(Expr::Var(s), Expr::Int(os[ax] as i64));
                for d in 0..r {
                    if d != ax {
                        oi = Expr::add(oi, Expr::mul(Expr::Var(v[d]), Expr::Int(os[d] as i64)));
                    }
                }
                st.push(Stmt::If {
                    cond: Expr::bin(
                        BinOp::And,
                        Expr::cmp(CmpOp::Ge, Expr::Var(s), Expr::Int(0)),
                        Expr::cmp(CmpOp::Lt, Expr::Var(s), Expr::Int(maxlen)),
                    ),
                    then: vec![Stmt::Store {
                        buf: out.buf,
                        index: oi,
                        value: Expr::load(upd.buf, index(v, &us)),
                    }],
                    els: vec![],
                });
                st
            });
            k.body = body;
            lw.push(k);
            Ok(())
        }

        pub fn register(r: &mut Registry) {
            r.lower("TensorScatter", Lowering::Custom(tensor_scatter));
        }
    }

    pub fn register(r: &mut Registry) {
        tensor_scatter::register(r);
        r.lower("Gather", Lowering::Custom(gather));
        r.lower("GatherElements", Lowering::Custom(gather_elements));
        r.lower("GatherND", Lowering::Custom(gather_nd));
        r.lower("ScatterElements", Lowering::Custom(scatter_elements));
        r.lower("Scatter", Lowering::Custom(scatter_elements));
        r.lower("ScatterND", Lowering::Custom(scatter_nd));
        r.lower("OneHot", Lowering::Custom(one_hot));
        // Compress with a runtime condition has a data-dependent shape: constant only.
        r.lower("Compress", Lowering::Movement(&[0]));
    }
}
