//! pool ops: MaxPool, AveragePool, LpPool, the global pools, MaxUnpool, MaxRoiPool.
//!
//! Windows follow the ONNX spec: explicit pads, auto_pad, dilations and ceil_mode (a
//! ceil-mode window that would start in the tail padding is dropped; window positions
//! beyond the padded input never count). Values are computed in f64.

use super::nn::{window, Window, PAD};
use super::util::{dims, f64s, input, ints, opt_input, out, outs};
use super::{OpCtx, Registry};
use crate::ensure;
use crate::ir::{DType, OpResult, Tensor, Value};
use ndarray::{ArrayD, Dimension, IxDyn};

pub fn register(r: &mut Registry) {
    r.add("MaxPool", max_pool);
    r.add("AveragePool", average_pool);
    r.add("LpPool", lp_pool);
    r.add("GlobalAveragePool", global_average_pool);
    r.add("GlobalMaxPool", global_max_pool);
    r.add("GlobalLpPool", global_lp_pool);
    r.add_shaped("MaxUnpool", max_unpool, &[2]);
    r.add("MaxRoiPool", max_roi_pool);
    lower::register(r);
}

fn flat(t: &Tensor) -> OpResult<Vec<f64>> {
    Ok(f64s(t)?.iter().copied().collect())
}

/// Input X (rank >= 3) and the window geometry from kernel_shape and the attributes.
fn setup<'a>(ctx: &OpCtx, ins: &[Option<&'a Value>]) -> OpResult<(&'a Tensor, Window)> {
    let x = input(ins, 0)?;
    ensure!(
        x.dtype().is_numeric(),
        "X must be numeric, got {}",
        x.dtype()
    );
    let xs = x.shape();
    ensure!(
        xs.len() >= 3,
        "X must have rank >= 3 (N, C, spatial...), got shape {xs:?}"
    );
    let k = ctx.attrs.req_ints("kernel_shape")?;
    ensure!(
        k.len() == xs.len() - 2,
        "kernel_shape {k:?} does not match the {} spatial dims of X",
        xs.len() - 2
    );
    ensure!(
        k.iter().all(|&v| (1..=1 << 20).contains(&v)),
        "kernel_shape {k:?} must be positive"
    );
    let k: Vec<usize> = k.iter().map(|&v| v as usize).collect();
    let win = window(ctx, &xs[2..], &k, true)?;
    Ok((x, win))
}

fn out_shape(xs: &[usize], win: &Window) -> Vec<usize> {
    let mut v = xs[..2].to_vec();
    v.extend_from_slice(&win.out);
    v
}

fn max_pool(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let (x, win) = setup(ctx, ins)?;
    let xs = x.shape().to_vec();
    let storage_order = ctx.attrs.int("storage_order", 0)?;
    let planes = xs[0] * xs[1];
    let (kl, pl, il) = (win.kernel_len(), win.out_len(), win.in_len());
    let table = win.table()?;
    let xv = flat(x)?;
    let total = dims(&[planes as i64, pl as i64])?;
    let mut y = vec![f64::NAN; total.iter().product()];
    let mut idx = vec![-1i64; y.len()];
    // Column-major spatial strides, for storage_order = 1.
    let sp = &xs[2..];
    for pi in 0..planes {
        let plane = &xv[pi * il..][..il];
        let yb = &mut y[pi * pl..][..pl];
        let ib = &mut idx[pi * pl..][..pl];
        for kk in 0..kl {
            let tr = &table[kk * pl..][..pl];
            for p in 0..pl {
                let t = tr[p];
                if t >= PAD {
                    continue;
                }
                let v = plane[t];
                if v.is_nan() {
                    continue;
                }
                if ib[p] < 0 || v > yb[p] {
                    yb[p] = v;
                    ib[p] = t as i64;
                }
            }
        }
        for v in ib.iter_mut() {
            if *v < 0 {
                continue;
            }
            let t = *v as usize;
            let s = if storage_order == 0 {
                t
            } else {
                // Re-linearise the row-major spatial index column-major.
                let mut r = t;
                let mut coords = vec![0usize; sp.len()];
                for i in (0..sp.len()).rev() {
                    coords[i] = r % sp[i];
                    r /= sp[i];
                }
                let mut s = 0usize;
                for i in (0..sp.len()).rev() {
                    s = s * sp[i] + coords[i];
                }
                s
            };
            *v = (pi * il + s) as i64;
        }
    }
    let shape = out_shape(&xs, &win);
    let yt = Tensor::from_f64(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&shape), y).expect("sized"),
        false,
    );
    if ctx.n_outputs > 1 {
        outs(vec![
            yt,
            Tensor::from_array(ArrayD::from_shape_vec(IxDyn(&shape), idx).expect("sized")),
        ])
    } else {
        out(yt)
    }
}

/// Sums `f(x)` over each window; returns (sums, counts) where counts include padding
/// positions when `include_pad`.
fn window_sums(
    xv: &[f64],
    planes: usize,
    win: &Window,
    include_pad: bool,
    f: impl Fn(f64) -> f64,
) -> OpResult<(Vec<f64>, Vec<f64>)> {
    let (kl, pl, il) = (win.kernel_len(), win.out_len(), win.in_len());
    let table = win.table()?;
    let mut cnt = vec![0f64; pl];
    for kk in 0..kl {
        for (c, &t) in cnt.iter_mut().zip(&table[kk * pl..][..pl]) {
            if t < PAD || (t == PAD && include_pad) {
                *c += 1.0;
            }
        }
    }
    let total = dims(&[planes as i64, pl as i64])?;
    let mut sum = vec![0f64; total.iter().product()];
    for pi in 0..planes {
        let plane = &xv[pi * il..][..il];
        let sb = &mut sum[pi * pl..][..pl];
        for kk in 0..kl {
            for (s, &t) in sb.iter_mut().zip(&table[kk * pl..][..pl]) {
                if t < PAD {
                    *s += f(plane[t]);
                }
            }
        }
    }
    Ok((sum, cnt))
}

fn float_x(x: &Tensor) -> OpResult<()> {
    ensure!(
        x.dtype().is_float(),
        "X must be a float tensor, got {}",
        x.dtype()
    );
    Ok(())
}

fn average_pool(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let (x, win) = setup(ctx, ins)?;
    float_x(x)?;
    let xs = x.shape().to_vec();
    let include = ctx.attrs.int("count_include_pad", 0)? != 0;
    let pl = win.out_len();
    let (mut sum, cnt) = window_sums(&flat(x)?, xs[0] * xs[1], &win, include, |v| v)?;
    for (i, s) in sum.iter_mut().enumerate() {
        *s /= cnt[i % pl];
    }
    let shape = out_shape(&xs, &win);
    out(Tensor::from_f64(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&shape), sum).expect("sized"),
        false,
    ))
}

fn p_attr(ctx: &OpCtx) -> OpResult<f64> {
    // LpPool-1 had a float `p`; later versions an int.
    let p = match ctx.attrs.get_int("p") {
        Ok(Some(v)) => v as f64,
        Ok(None) => 2.0,
        Err(_) => ctx.attrs.float("p", 2.0)? as f64,
    };
    ensure!(p.is_finite() && p >= 1e-9, "p must be positive, got {p}");
    Ok(p)
}

fn lp_pool(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let (x, win) = setup(ctx, ins)?;
    float_x(x)?;
    let xs = x.shape().to_vec();
    let p = p_attr(ctx)?;
    let (sum, _) = window_sums(&flat(x)?, xs[0] * xs[1], &win, false, |v| v.abs().powf(p))?;
    let y: Vec<f64> = sum.into_iter().map(|s| s.powf(1.0 / p)).collect();
    let shape = out_shape(&xs, &win);
    out(Tensor::from_f64(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&shape), y).expect("sized"),
        false,
    ))
}

/// Reduces each (n, c) plane to one value; output shape [N, C, 1, ...].
fn global(ins: &[Option<&Value>], f: impl Fn(&[f64]) -> f64) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    float_x(x)?;
    let xs = x.shape();
    ensure!(
        xs.len() >= 2,
        "X must have rank >= 2 (N, C, spatial...), got shape {xs:?}"
    );
    let planes = xs[0] * xs[1];
    let il: usize = xs[2..].iter().product();
    let xv = flat(x)?;
    let y: Vec<f64> = (0..planes).map(|i| f(&xv[i * il..][..il])).collect();
    let mut shape = xs[..2].to_vec();
    shape.extend(std::iter::repeat_n(1, xs.len() - 2));
    out(Tensor::from_f64(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&shape), y).expect("sized"),
        false,
    ))
}

fn global_average_pool(_ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    global(ins, |v| v.iter().sum::<f64>() / v.len() as f64)
}

fn global_max_pool(_ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    global(ins, |v| {
        v.iter()
            .copied()
            .filter(|x| !x.is_nan())
            .fold(None, |a: Option<f64>, b| Some(a.map_or(b, |a| a.max(b))))
            .unwrap_or(f64::NAN)
    })
}

fn global_lp_pool(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let p = p_attr(ctx)?;
    global(ins, |v| {
        v.iter().map(|x| x.abs().powf(p)).sum::<f64>().powf(1.0 / p)
    })
}

fn max_unpool(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let ind = input(ins, 1)?;
    let xs = x.shape().to_vec();
    ensure!(
        xs.len() >= 3,
        "X must have rank >= 3 (N, C, spatial...), got shape {xs:?}"
    );
    ensure!(
        ind.shape() == xs.as_slice(),
        "I has shape {:?} but X has {xs:?}",
        ind.shape()
    );
    let nsp = xs.len() - 2;
    let k = ctx.attrs.req_ints("kernel_shape")?;
    ensure!(k.len() == nsp, "kernel_shape {k:?} does not match X");
    let s = ctx.attrs.ints("strides", &vec![1; nsp])?;
    let pads = ctx.attrs.ints("pads", &vec![0; 2 * nsp])?;
    ensure!(
        s.len() == nsp && pads.len() == 2 * nsp,
        "strides/pads have the wrong length"
    );
    let mut inferred = vec![xs[0] as i64, xs[1] as i64];
    for i in 0..nsp {
        inferred.push((xs[i + 2] as i64 - 1) * s[i] - (pads[i] + pads[nsp + i]) + k[i]);
    }
    let inferred = dims(&inferred)?;
    let shape = match opt_input(ins, 2)? {
        Some(t) => {
            let v = ints(t)?;
            ensure!(
                v.len() == xs.len(),
                "output_shape {v:?} must have {} values",
                xs.len()
            );
            dims(&v)?
        }
        None => inferred.clone(),
    };
    let total: usize = inferred.iter().product();
    let mut y = vec![0f64; total];
    let xv = flat(x)?;
    let iv = ints(ind)?;
    for (&i, &v) in iv.iter().zip(&xv) {
        ensure!(
            i >= 0 && (i as usize) < total,
            "index {i} is out of range for output shape {inferred:?}"
        );
        y[i as usize] = v;
    }
    let ya = ArrayD::from_shape_vec(IxDyn(&inferred), y).expect("sized");
    let res = if shape == inferred {
        ya
    } else {
        // Indices refer to the inferred shape; copy it into the top-left corner.
        let mut r = ArrayD::<f64>::zeros(IxDyn(&shape));
        for (ix, v) in ya.indexed_iter() {
            if ix.slice().iter().zip(&shape).all(|(a, b)| a < b) {
                r[ix.slice()] = *v;
            }
        }
        r
    };
    out(Tensor::from_f64(x.dtype(), res, false))
}

fn max_roi_pool(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    float_x(x)?;
    let rois = input(ins, 1)?;
    let xs = x.shape();
    ensure!(xs.len() == 4, "X must have rank 4, got shape {xs:?}");
    let rs = rois.shape();
    ensure!(
        rs.len() == 2 && rs[1] == 5,
        "rois must have shape (num_rois, 5), got {rs:?}"
    );
    let ps = ctx.attrs.req_ints("pooled_shape")?;
    ensure!(
        ps.len() == 2 && ps.iter().all(|&v| (1..=1 << 20).contains(&v)),
        "pooled_shape {ps:?} must be two positive values"
    );
    let (ph, pw) = (ps[0] as usize, ps[1] as usize);
    let scale = ctx.attrs.float("spatial_scale", 1.0)? as f64;
    let (n, c, h, w) = (xs[0], xs[1], xs[2], xs[3]);
    let xv = flat(x)?;
    let rv = flat(rois)?;
    let nr = rs[0];
    let total = dims(&[nr as i64, c as i64, ph as i64, pw as i64])?;
    let mut y = vec![0f64; total.iter().product()];
    // Coordinates are computed in the element type, as onnxruntime does (f32 for all
    // but double inputs); C's round() is half away from zero like f64::round.
    let single = x.dtype() != DType::F64;
    let fl = |v: f64| if single { v as f32 as f64 } else { v };
    let scale = fl(scale);
    for r in 0..nr {
        let roi = &rv[r * 5..][..5];
        let b = roi[0];
        ensure!(
            b >= 0.0 && (b as usize) < n,
            "roi batch index {b} is out of range"
        );
        let b = b as usize;
        let x1 = fl(fl(roi[1]) * scale).round() as i64;
        let y1 = fl(fl(roi[2]) * scale).round() as i64;
        let x2 = fl(fl(roi[3]) * scale).round() as i64;
        let y2 = fl(fl(roi[4]) * scale).round() as i64;
        let rh = (y2 - y1 + 1).max(1) as f64;
        let rw = (x2 - x1 + 1).max(1) as f64;
        let bh = fl(rh / ph as f64);
        let bw = fl(rw / pw as f64);
        for ci in 0..c {
            let plane = &xv[(b * c + ci) * h * w..][..h * w];
            for i in 0..ph {
                let hs = (fl(i as f64 * bh).floor() as i64 + y1).clamp(0, h as i64);
                let he = (fl((i + 1) as f64 * bh).ceil() as i64 + y1).clamp(0, h as i64);
                for j in 0..pw {
                    let ws = (fl(j as f64 * bw).floor() as i64 + x1).clamp(0, w as i64);
                    let we = (fl((j + 1) as f64 * bw).ceil() as i64 + x1).clamp(0, w as i64);
                    let mut best: Option<f64> = None;
                    for hh in hs..he {
                        for ww in ws..we {
                            let v = plane[hh as usize * w + ww as usize];
                            if best.is_none_or(|b| v > b) {
                                best = Some(v);
                            }
                        }
                    }
                    y[((r * c + ci) * ph + i) * pw + j] = best.unwrap_or(0.0);
                }
            }
        }
    }
    out(Tensor::from_f64(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&[nr, c, ph, pw]), y).expect("sized"),
        false,
    ))
}

// ---------------------------------------------------------------------------------------
// Lowering to kernel IR: one loop nest per pool (output position x window), padding
// checked with `If` statements; sums in f64.

pub(crate) use lower::max_of;

mod lower {
    use super::super::nn::{window, Window};
    use super::p_attr;
    use crate::ensure;
    use crate::ir::OpResult;
    use crate::kir::build::*;
    use crate::kir::{BinOp, CmpOp, Expr, Kernel, MathFn, Stmt, Ty, UnOp, VarId};
    use crate::ops::lowering::{index, lit, strides, LowerCtx, TensorRef};
    use crate::ops::{Lowering, Registry};

    fn int(x: i64) -> Expr {
        Expr::Int(x)
    }
    fn or(a: Expr, b: Expr) -> Expr {
        Expr::bin(BinOp::Or, a, b)
    }
    fn set(var: VarId, e: Expr) -> Stmt {
        Stmt::Set { var, value: e }
    }
    /// Flat index of coordinates over `ext`, row-major or (col) column-major.
    fn flat(coords: &[Expr], ext: &[usize], col: bool) -> Expr {
        let n = ext.len();
        let mut st = vec![1usize; n];
        if col {
            for i in 1..n {
                st[i] = st[i - 1] * ext[i - 1];
            }
        } else {
            st = strides(ext);
        }
        let mut e = int(0);
        for (c, &s) in coords.iter().zip(&st) {
            e = add(e, mul(c.clone(), int(s as i64)));
        }
        e
    }
    /// `lo <= c < ext + hi` in every dim.
    fn within(coords: &[Expr], lo: &[i64], hi: &[i64]) -> Expr {
        let mut e = lit(1.0, Ty::U8);
        for i in 0..coords.len() {
            e = and(e, cmp(CmpOp::Ge, coords[i].clone(), int(lo[i])));
            e = and(e, cmp(CmpOp::Lt, coords[i].clone(), int(hi[i])));
        }
        e
    }

    /// The largest of `taps` (NaN only when every tap is NaN; NaN when there are no
    /// taps), on fresh locals private to the loop `st` goes in, combined pairwise as a
    /// tree: a chain of compare-and-selects waits on every step's latency (SqueezeNet's
    /// 3x3 pools: 8 steps per vector), a tree on four.
    pub(crate) fn max_of(k: &mut Kernel, st: &mut Vec<Stmt>, taps: Vec<Expr>) -> Expr {
        if taps.is_empty() {
            return lit(f64::NAN, Ty::F32);
        }
        let mut level: Vec<VarId> = taps
            .into_iter()
            .map(|tap| {
                let t = k.var(Ty::F32);
                st.push(set(t, tap));
                t
            })
            .collect();
        while level.len() > 1 {
            let mut next = Vec::with_capacity(level.len().div_ceil(2));
            for pair in level.chunks(2) {
                let &[a, b] = pair else {
                    next.push(pair[0]);
                    continue;
                };
                let t = k.var(Ty::F32);
                let better = or(cmp(CmpOp::Gt, v(b), v(a)), cmp(CmpOp::Ne, v(a), v(a)));
                st.push(set(t, Expr::select(better, v(b), v(a))));
                next.push(t);
            }
            level = next;
        }
        v(level[0])
    }

    /// Kernel-shape window geometry for a pool over X.
    fn setup(lw: &LowerCtx) -> OpResult<(TensorRef, Window)> {
        let x = lw.input(0)?.clone();
        ensure!(x.shape.len() >= 3, "X must have rank >= 3");
        let k = lw.op.attrs.req_ints("kernel_shape")?;
        ensure!(
            k.len() == x.shape.len() - 2 && k.iter().all(|&v| (1..=1 << 20).contains(&v)),
            "bad kernel_shape {k:?}"
        );
        let k: Vec<usize> = k.iter().map(|&v| v as usize).collect();
        let win = window(lw.op, &x.shape[2..], &k, true)?;
        Ok((x, win))
    }

    /// The pieces of a pool's loop nest.
    struct Nest {
        /// Plane (n * C + c) as an expression.
        plane: Expr,
        /// Output flat index.
        oidx: Expr,
        /// Input spatial coordinates of the current window element.
        coords: Vec<Expr>,
        outer: Vec<(VarId, usize)>,
        inner: Vec<(VarId, usize)>,
    }

    fn nest_for(k: &mut Kernel, x: &TensorRef, win: &Window) -> Nest {
        let (n, c) = (x.shape[0], x.shape[1]);
        let nv = k.var(Ty::I64);
        let cv = k.var(Ty::I64);
        let ov: Vec<VarId> = win.out.iter().map(|_| k.var(Ty::I64)).collect();
        let kv: Vec<VarId> = win.k.iter().map(|_| k.var(Ty::I64)).collect();
        let coords = (0..win.k.len())
            .map(|i| {
                add(
                    Expr::bin(
                        BinOp::Sub,
                        mul(v(ov[i]), int(win.s[i] as i64)),
                        int(win.pb[i]),
                    ),
                    mul(v(kv[i]), int(win.d[i] as i64)),
                )
            })
            .collect();
        let mut oshape = vec![n, c];
        oshape.extend_from_slice(&win.out);
        let mut ovars = vec![nv, cv];
        ovars.extend_from_slice(&ov);
        let mut outer = vec![(nv, n), (cv, c)];
        outer.extend(ov.iter().copied().zip(win.out.iter().copied()));
        Nest {
            plane: add(mul(v(nv), int(c as i64)), v(cv)),
            oidx: index(&ovars, &strides(&oshape)),
            coords,
            outer,
            inner: kv.iter().copied().zip(win.k.iter().copied()).collect(),
        }
    }

    /// A pool computed along output rows: `Max`, or `Avg` with count_include_pad.
    #[derive(Clone, Copy, PartialEq)]
    enum RowPool {
        Max,
        Avg { include: bool },
    }

    /// Largest window (positions) `pool_2d` unrolls.
    const P2_TAPS: usize = 64;
    /// Most output rows `pool_2d` emits one by one (border rows).
    const P2_EDGE_ROWS: usize = 16;
    /// Largest column stride `pool_2d` deinterleaves.
    const P2_MAX_STRIDE: usize = 4;

    /// A 2-D f32 pool with every output element computed in one expression over the
    /// window positions inside the input (known at compile time for each row segment
    /// and each border row, so no bounds tests) and stored once; the innermost loop
    /// over a row segment loads at unit stride and the back end vectorises it. With a
    /// column stride s > 1, each input plane is first split into its s column phases
    /// (scratch). Max ignores NaN inputs and gives NaN for a window with none; averages
    /// divide by the count of positions inside the input (or the padded input with
    /// count_include_pad), like `pool_rows`. Returns false (nothing lowered) where it
    /// does not apply. A max pool of u8 or i8 values (a QDQ model's, see
    /// `passes::quantized_max_pool`) computes in f32, which holds them exactly.
    fn pool_2d(lw: &mut LowerCtx, x: &TensorRef, win: &Window, kind: RowPool) -> OpResult<bool> {
        let out = lw.outputs[0].clone();
        let bytes =
            matches!(kind, RowPool::Max) && matches!(x.ty(), Ty::U8 | Ty::I8) && out.ty() == x.ty();
        // Bytes widened where they are read, narrowed where the result is stored (as
        // Cast writes it: through i64).
        let widen = |e: Expr| if bytes { Expr::cast(Ty::F32, e) } else { e };
        let narrow = |e: Expr| {
            if bytes {
                Expr::cast(out.ty(), Expr::cast(Ty::I64, e))
            } else {
                e
            }
        };
        if lw.outputs.len() != 1
            || win.k.len() != 2
            || !(bytes || x.ty() == Ty::F32 && out.ty() == Ty::F32)
            || win.kernel_len() > P2_TAPS
            || win.s[1] > P2_MAX_STRIDE
            || win.out.contains(&0)
            || win.in_sp.contains(&0)
        {
            return Ok(false);
        }
        let planes = x.shape[0] * x.shape[1];
        let (kh_n, kw_n) = (win.k[0], win.k[1]);
        let (oh_n, ow_n) = (win.out[0] as i64, win.out[1] as i64);
        let (ih, iw) = (win.in_sp[0] as i64, win.in_sp[1] as i64);
        let (sh, sw) = (win.s[0] as i64, win.s[1] as i64);
        let (dh, dw) = (win.d[0] as i64, win.d[1] as i64);
        let (ph, pw) = (win.pb[0], win.pb[1]);
        let rows_ok = |oh: i64| -> Vec<i64> {
            (0..kh_n as i64)
                .filter(|&kh| (0..ih).contains(&(oh * sh - ph + kh * dh)))
                .collect()
        };
        let all: Vec<i64> = (0..kh_n as i64).collect();
        let full: Vec<bool> = (0..oh_n).map(|oh| rows_ok(oh) == all).collect();
        let (mut lo, mut hi) = (0i64, 0i64);
        let mut at = 0i64;
        while at < oh_n {
            if full[at as usize] {
                let mut e = at;
                while e < oh_n && full[e as usize] {
                    e += 1;
                }
                if e - at > hi - lo {
                    (lo, hi) = (at, e);
                }
                at = e;
            } else {
                at += 1;
            }
        }
        if ((oh_n - (hi - lo)) as usize) > P2_EDGE_ROWS {
            return Ok(false);
        }
        let range = |kw: i64| {
            let a = pw - kw * dw;
            let lo = (-(-a).div_euclid(sw)).max(0);
            let hi = ((iw - 1 + pw - kw * dw).div_euclid(sw) + 1).min(ow_n);
            (lo, hi.max(lo))
        };
        let mut cuts: Vec<i64> = vec![0, ow_n];
        for kw in 0..kw_n as i64 {
            let (a, b) = range(kw);
            cuts.extend([a, b]);
        }
        cuts.sort_unstable();
        cuts.dedup();
        // Average divisors: per-dim counts of the positions that count.
        let counts = |dim: usize, o: i64| -> f32 {
            let (clo, chi) = match kind {
                RowPool::Avg { include: true } => {
                    (-win.pb[dim], win.in_sp[dim] as i64 + win.pe[dim])
                }
                _ => (0, win.in_sp[dim] as i64),
            };
            (0..win.k[dim] as i64)
                .filter(|&kk| {
                    let c = o * win.s[dim] as i64 - win.pb[dim] + kk * win.d[dim] as i64;
                    clo <= c && c < chi
                })
                .count() as f32
        };
        let wtab = match kind {
            RowPool::Avg { .. } => {
                let cw: Vec<f32> = (0..ow_n).map(|o| counts(1, o)).collect();
                Some(lw.constant("countw", &crate::ir::Tensor::from_vec(&[cw.len()], cw))?)
            }
            RowPool::Max => None,
        };
        let lp = (iw + sw - 1) / sw;
        // The phases of a plane, in a scratch slot per part of consecutive planes, so
        // that the parts may run in parallel (with one slot for all, threads split each
        // plane's row loops instead: a hand-over per plane).
        let plen = sw * ih * lp;
        let (per, slots) = if sw > 1 {
            plane_parts(planes, plen as usize)
        } else {
            (1, planes)
        };
        let phases = if sw > 1 {
            Some(lw.program.add_buffer(
                format!("{}/phases", lw.name),
                crate::kir::BufKind::Arena { offset: 0 },
                Ty::F32,
                (slots as i64 * plen) as u64,
            ))
        } else {
            None
        };
        let mut k = lw.kernel("");
        let (slot, gi) = (k.var(Ty::I64), k.var(Ty::I64));
        // The plane, and its part's scratch slot.
        let pv = add(mul(v(slot), int(per as i64)), v(gi));
        let sb = mul(v(slot), int(plen));
        let xb = k.var(Ty::I64);
        let ob = k.var(Ty::I64);
        let ohv = k.var(Ty::I64);
        let rb = k.var(Ty::I64);
        let orb = k.var(Ty::I64);
        let j = k.var(Ty::I64);
        let (iv, qv) = (k.var(Ty::I64), k.var(Ty::I64));
        let mut body = vec![
            set(xb, mul(pv.clone(), int(ih * iw))),
            set(ob, mul(pv, int(oh_n * ow_n))),
        ];
        let (src, rstride) = match phases {
            Some(pbuf) => {
                for r in 0..sw {
                    let len = (iw - r + sw - 1) / sw;
                    if len <= 0 {
                        continue;
                    }
                    let dst = add(
                        add(sb.clone(), int(r * ih * lp)),
                        add(mul(v(iv), int(lp)), v(qv)),
                    );
                    let srci = add(
                        add(v(xb), mul(v(iv), int(iw))),
                        add(mul(v(qv), int(sw)), int(r)),
                    );
                    body.extend(loops(
                        &[(iv, ih as usize), (qv, len as usize)],
                        vec![store(pbuf, dst, widen(Expr::load(x.buf, srci)))],
                    ));
                }
                (pbuf, lp)
            }
            None => (x.buf, iw),
        };
        let mut row = |oh: Expr, khs: &[i64], hcount: f32| -> Vec<Stmt> {
            let base = match phases {
                Some(_) => sb.clone(),
                None => v(xb),
            };
            let mut b = vec![
                set(
                    rb,
                    add(
                        base,
                        mul(
                            Expr::bin(BinOp::Sub, mul(oh.clone(), int(sh)), int(ph)),
                            int(rstride),
                        ),
                    ),
                ),
                set(orb, add(v(ob), mul(oh, int(ow_n)))),
            ];
            for seg in cuts.windows(2) {
                let (a, e) = (seg[0], seg[1]);
                if e <= a {
                    continue;
                }
                let mut taps = Vec::new();
                for &kh in khs {
                    for kw in 0..kw_n as i64 {
                        let (clo, chi) = range(kw);
                        if !(clo <= a && e <= chi) {
                            continue;
                        }
                        let off = kw * dw - pw;
                        let (t, r) = (off.div_euclid(sw), off.rem_euclid(sw));
                        let cst =
                            r * ih * lp * i64::from(phases.is_some()) + kh * dh * rstride + a + t;
                        let tap = Expr::load(src, add(add(v(rb), v(j)), int(cst)));
                        taps.push(if src == x.buf { widen(tap) } else { tap });
                    }
                }
                let oidx = add(add(v(orb), v(j)), int(a));
                let mut st = Vec::new();
                let value = match (kind, wtab) {
                    (RowPool::Avg { .. }, Some(tab)) => {
                        let mut it = taps.into_iter();
                        let mut sum = it.next().unwrap_or(lit(0.0, Ty::F32));
                        for t in it {
                            sum = add(sum, t);
                        }
                        let cnt = mul(
                            lit(hcount as f64, Ty::F32),
                            Expr::load(tab, add(v(j), int(a))),
                        );
                        Expr::bin(BinOp::Div, sum, cnt)
                    }
                    _ => max_of(&mut k, &mut st, taps),
                };
                st.push(Stmt::Store {
                    buf: out.buf,
                    index: oidx,
                    value: narrow(value),
                });
                b.push(Stmt::For {
                    var: j,
                    extent: (e - a) as u64,
                    body: st,
                });
            }
            b
        };
        for oh in 0..lo {
            body.extend(row(int(oh), &rows_ok(oh), counts(0, oh)));
        }
        if hi > lo {
            let r = row(add(v(ohv), int(lo)), &all, counts(0, lo));
            body.push(Stmt::For {
                var: ohv,
                extent: (hi - lo) as u64,
                body: r,
            });
        }
        for oh in hi..oh_n {
            body.extend(row(int(oh), &rows_ok(oh), counts(0, oh)));
        }
        k.body = over_parts(body, (slot, gi), (per, slots), planes);
        lw.push(k);
        Ok(true)
    }

    /// Whether a pool fits `pool_direct` and `max_pool_planes`: one f32 output, 2-D, at
    /// most [`P2_TAPS`] taps, no empty dim, and every window inside the input (no
    /// padding at the start, the last window's end inside).
    fn all_inside(lw: &LowerCtx, x: &TensorRef, out: &TensorRef, win: &Window) -> bool {
        lw.outputs.len() == 1
            && win.k.len() == 2
            && x.ty() == Ty::F32
            && out.ty() == Ty::F32
            && win.kernel_len() <= P2_TAPS
            && !win.out.contains(&0)
            && !win.in_sp.contains(&0)
            && (0..2).all(|d| {
                let reach = (win.out[d] as i64 - 1) * win.s[d] as i64
                    + (win.k[d] as i64 - 1) * win.d[d] as i64;
                win.pb[d] == 0 && reach < win.in_sp[d] as i64
            })
    }

    /// A 2-D f32 pool whose windows all lie inside the input (no padding reached, as in
    /// 2x2 stride-2 pools and SqueezeNet's 3x3 stride-2 ones): each output is one
    /// expression over all `kh x kw` taps, loaded at the column stride, in a loop nest
    /// over planes, output rows and output columns, so the back ends run whole planes
    /// at a time (on AVX-512, stride-2 taps load by pairs of vectors and a permute). Max
    /// ignores NaN inputs like the other lowerings; averages divide by `kh * kw`.
    /// Returns false (nothing lowered) where it does not apply.
    fn pool_direct(
        lw: &mut LowerCtx,
        x: &TensorRef,
        win: &Window,
        kind: RowPool,
    ) -> OpResult<bool> {
        let out = lw.outputs[0].clone();
        if !all_inside(lw, x, &out, win) {
            return Ok(false);
        }
        let planes = x.shape[0] * x.shape[1];
        let (kh_n, kw_n) = (win.k[0] as i64, win.k[1] as i64);
        let (oh_n, ow_n) = (win.out[0] as i64, win.out[1] as i64);
        let (ih, iw) = (win.in_sp[0] as i64, win.in_sp[1] as i64);
        let (sh, sw) = (win.s[0] as i64, win.s[1] as i64);
        let (dh, dw) = (win.d[0] as i64, win.d[1] as i64);
        let mut k = lw.kernel("");
        let (pv, ohv, j) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let base = add(
            mul(v(pv), int(ih * iw)),
            add(mul(v(ohv), int(sh * iw)), mul(v(j), int(sw))),
        );
        let mut taps = Vec::new();
        for kh in 0..kh_n {
            for kw in 0..kw_n {
                taps.push(Expr::load(
                    x.buf,
                    add(base.clone(), int(kh * dh * iw + kw * dw)),
                ));
            }
        }
        let oidx = add(
            mul(v(pv), int(oh_n * ow_n)),
            add(mul(v(ohv), int(ow_n)), v(j)),
        );
        let mut st = Vec::new();
        let value = match kind {
            RowPool::Avg { .. } => {
                let mut it = taps.into_iter();
                let mut sum = it.next().expect("a window has taps");
                for t in it {
                    sum = add(sum, t);
                }
                Expr::bin(BinOp::Div, sum, lit((kh_n * kw_n) as f64, Ty::F32))
            }
            RowPool::Max => max_of(&mut k, &mut st, taps),
        };
        st.push(Stmt::Store {
            buf: out.buf,
            index: oidx,
            value,
        });
        k.body = loops(
            &[(pv, planes), (ohv, oh_n as usize), (j, ow_n as usize)],
            st,
        );
        lw.push(k);
        Ok(true)
    }

    /// Most scratch slots (parts of consecutive planes) of `max_pool_planes` and
    /// `max_pool_sep`.
    const MP_SLOTS: usize = 8;
    /// Scratch bytes they may fill with more slots than [`MP_SLOTS`].
    const MP_SLOT_BYTES: usize = 128 << 10;

    /// `planes` in parts of consecutive planes, each with a scratch slot of `slot_len`
    /// elements: (planes per part, parts).
    fn plane_parts(planes: usize, slot_len: usize) -> (usize, usize) {
        let most = MP_SLOTS.max(MP_SLOT_BYTES / (4 * slot_len.max(1)));
        let per = crate::kir::build::per_part(planes, most);
        (per, planes.div_ceil(per))
    }

    /// `body` (for plane `slot * per + gi`) over every part `slot` and its planes `gi`,
    /// the last part's missing planes skipped.
    fn over_parts(
        body: Vec<Stmt>,
        (slot, gi): (VarId, VarId),
        (per, slots): (usize, usize),
        planes: usize,
    ) -> Vec<Stmt> {
        let pv = add(mul(v(slot), int(per as i64)), v(gi));
        let body = if planes.is_multiple_of(per) {
            body
        } else {
            vec![iff(Expr::cmp(CmpOp::Lt, pv, int(planes as i64)), body)]
        };
        loops(&[(slot, slots), (gi, per)], body)
    }

    /// A 2-D f32 MaxPool whose windows all lie inside the input (as `pool_direct`) with
    /// a column stride s > 1, done separably over whole planes: first the window rows
    /// are folded into a plane of output rows at input width (`oh x w`, scratch; unit
    /// stride loads), then the window columns of that plane, loaded at the column
    /// stride, into the output. A tap at stride 2 costs two loads and a permute on
    /// AVX-512: this takes `kw` of them per output vector instead of `kh * kw`
    /// (SqueezeNet's 3x3 stride-2 pools: 9 -> 3), and each pass is one call per plane.
    /// The planes share out into parts of consecutive planes, each part in its own
    /// scratch slot, so that the parts may run in parallel. NaN inputs are ignored; a
    /// window with none gives NaN. Returns false where it does not apply.
    fn max_pool_planes(lw: &mut LowerCtx, x: &TensorRef, win: &Window) -> OpResult<bool> {
        let out = lw.outputs[0].clone();
        if !all_inside(lw, x, &out, win) || win.s[1] < 2 || win.k[0] < 2 || win.k[1] < 2 {
            return Ok(false);
        }
        let planes = x.shape[0] * x.shape[1];
        let (kh_n, kw_n) = (win.k[0] as i64, win.k[1] as i64);
        let (oh_n, ow_n) = (win.out[0] as i64, win.out[1] as i64);
        let (ih, iw) = (win.in_sp[0] as i64, win.in_sp[1] as i64);
        let (sh, sw) = (win.s[0] as i64, win.s[1] as i64);
        let (dh, dw) = (win.d[0] as i64, win.d[1] as i64);
        // The input columns the windows read.
        let vw = (ow_n - 1) * sw + (kw_n - 1) * dw + 1;
        let plane = oh_n * vw;
        let (per, slots) = plane_parts(planes, plane as usize);
        let scratch = lw.program.add_buffer(
            format!("{}/rows", lw.name),
            crate::kir::BufKind::Arena { offset: 0 },
            Ty::F32,
            (slots as i64 * plane) as u64,
        );
        let mut k = lw.kernel("");
        let (slot, gi, ohv, j) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let pv = add(mul(v(slot), int(per as i64)), v(gi));
        let sb = mul(v(slot), int(plane));
        // The window rows of output row ohv, at every column the windows read.
        let mut st = Vec::new();
        let taps = (0..kh_n)
            .map(|kh| {
                let i = add(
                    mul(pv.clone(), int(ih * iw)),
                    add(mul(v(ohv), int(sh * iw)), add(v(j), int(kh * dh * iw))),
                );
                Expr::load(x.buf, i)
            })
            .collect();
        let value = max_of(&mut k, &mut st, taps);
        let vidx = add(sb.clone(), add(mul(v(ohv), int(vw)), v(j)));
        st.push(store(scratch, vidx, value));
        let mut body = loops(&[(ohv, oh_n as usize), (j, vw as usize)], st);
        // Then its window columns, every sw-th.
        let mut st = Vec::new();
        let taps = (0..kw_n)
            .map(|kw| {
                let i = add(
                    sb.clone(),
                    add(mul(v(ohv), int(vw)), add(mul(v(j), int(sw)), int(kw * dw))),
                );
                Expr::load(scratch, i)
            })
            .collect();
        let value = max_of(&mut k, &mut st, taps);
        let oidx = add(
            mul(pv.clone(), int(oh_n * ow_n)),
            add(mul(v(ohv), int(ow_n)), v(j)),
        );
        st.push(store(out.buf, oidx, value));
        body.extend(loops(&[(ohv, oh_n as usize), (j, ow_n as usize)], st));
        k.body = over_parts(body, (slot, gi), (per, slots), planes);
        lw.push(k);
        Ok(true)
    }

    /// A 2-D f32 MaxPool with a column stride s > 1, done separably per output row:
    /// the window rows inside the input are folded into one input-width row (unit
    /// stride), then the window columns into a row at input resolution over each output
    /// segment (unit stride), and every s-th element of that is stored. The taps seen by
    /// each row and each segment are known at compile time, as in `pool_2d`. The planes
    /// share out into parts with scratch rows of their own, which may run in parallel
    /// (ResNet-18's pool on two threads 0.167 -> 0.081 ms). NaN inputs are ignored; a
    /// window with none gives NaN. Returns false where it does not apply.
    fn max_pool_sep(lw: &mut LowerCtx, x: &TensorRef, win: &Window) -> OpResult<bool> {
        let out = lw.outputs[0].clone();
        if lw.outputs.len() != 1
            || win.k.len() != 2
            || x.ty() != Ty::F32
            || out.ty() != Ty::F32
            || win.kernel_len() > P2_TAPS
            || win.s[1] < 2
            || win.out.contains(&0)
            || win.in_sp.contains(&0)
        {
            return Ok(false);
        }
        let planes = x.shape[0] * x.shape[1];
        let (kh_n, kw_n) = (win.k[0], win.k[1]);
        let (oh_n, ow_n) = (win.out[0] as i64, win.out[1] as i64);
        let (ih, iw) = (win.in_sp[0] as i64, win.in_sp[1] as i64);
        let (sh, sw) = (win.s[0] as i64, win.s[1] as i64);
        let (dh, dw) = (win.d[0] as i64, win.d[1] as i64);
        let (ph, pw) = (win.pb[0], win.pb[1]);
        let rows_ok = |oh: i64| -> Vec<i64> {
            (0..kh_n as i64)
                .filter(|&kh| (0..ih).contains(&(oh * sh - ph + kh * dh)))
                .collect()
        };
        let all: Vec<i64> = (0..kh_n as i64).collect();
        let full: Vec<bool> = (0..oh_n).map(|oh| rows_ok(oh) == all).collect();
        let (mut lo, mut hi) = (0i64, 0i64);
        let mut at = 0i64;
        while at < oh_n {
            if full[at as usize] {
                let mut e = at;
                while e < oh_n && full[e as usize] {
                    e += 1;
                }
                if e - at > hi - lo {
                    (lo, hi) = (at, e);
                }
                at = e;
            } else {
                at += 1;
            }
        }
        if ((oh_n - (hi - lo)) as usize) > P2_EDGE_ROWS {
            return Ok(false);
        }
        let range = |kw: i64| {
            let a = pw - kw * dw;
            let lo = (-(-a).div_euclid(sw)).max(0);
            let hi = ((iw - 1 + pw - kw * dw).div_euclid(sw) + 1).min(ow_n);
            (lo, hi.max(lo))
        };
        let mut cuts: Vec<i64> = vec![0, ow_n];
        for kw in 0..kw_n as i64 {
            let (a, b) = range(kw);
            cuts.extend([a, b]);
        }
        cuts.sort_unstable();
        cuts.dedup();
        let scratch = |lw: &mut LowerCtx, what: &str, len: i64| {
            lw.program.add_buffer(
                format!("{}/{what}", lw.name),
                crate::kir::BufKind::Arena { offset: 0 },
                Ty::F32,
                len as u64,
            )
        };
        // Parts of consecutive planes, each with its own scratch rows (one pair of rows
        // for the whole kernel kept its planes on one thread).
        let hl = (ow_n - 1) * sw + 1;
        let (per, slots) = plane_parts(planes, (iw + hl) as usize);
        let vm = scratch(lw, "rowmax", slots as i64 * iw);
        let hm = scratch(lw, "colmax", slots as i64 * hl);
        let mut k = lw.kernel("");
        let (slot, gi) = (k.var(Ty::I64), k.var(Ty::I64));
        let pv = add(mul(v(slot), int(per as i64)), v(gi));
        let (vb, hb) = (mul(v(slot), int(iw)), mul(v(slot), int(hl)));
        let xb = k.var(Ty::I64);
        let ob = k.var(Ty::I64);
        let ohv = k.var(Ty::I64);
        let rb = k.var(Ty::I64);
        let orb = k.var(Ty::I64);
        let j = k.var(Ty::I64);
        let mut body = vec![
            set(xb, mul(pv.clone(), int(ih * iw))),
            set(ob, mul(pv.clone(), int(oh_n * ow_n))),
        ];
        // `for j in 0..len: buf[at + j] = max of taps` (NaN-ignoring fold on locals).
        let mut fold = |buf: usize, at: Expr, len: i64, taps: Vec<Expr>| -> Stmt {
            let mut st = Vec::new();
            let value = max_of(&mut k, &mut st, taps);
            st.push(Stmt::Store {
                buf,
                index: add(at, v(j)),
                value,
            });
            Stmt::For {
                var: j,
                extent: len as u64,
                body: st,
            }
        };
        let mut row = |oh: Expr, khs: &[i64]| -> Vec<Stmt> {
            let mut b = vec![
                set(
                    rb,
                    add(
                        v(xb),
                        mul(
                            Expr::bin(BinOp::Sub, mul(oh.clone(), int(sh)), int(ph)),
                            int(iw),
                        ),
                    ),
                ),
                set(orb, add(v(ob), mul(oh, int(ow_n)))),
            ];
            if khs.is_empty() {
                b.push(fold(out.buf, v(orb), ow_n, vec![]));
                return b;
            }
            // 1. The window rows folded into one input row.
            let taps = khs
                .iter()
                .map(|&kh| Expr::load(x.buf, add(add(v(rb), v(j)), int(kh * dh * iw))))
                .collect();
            b.push(fold(vm, vb.clone(), iw, taps));
            for seg in cuts.windows(2) {
                let (a, e) = (seg[0], seg[1]);
                if e <= a {
                    continue;
                }
                let cols: Vec<i64> = (0..kw_n as i64)
                    .filter(|&kw| {
                        let (clo, chi) = range(kw);
                        clo <= a && e <= chi
                    })
                    .collect();
                if cols.is_empty() {
                    b.push(fold(out.buf, add(v(orb), int(a)), e - a, vec![]));
                    continue;
                }
                // 2. The window columns at input resolution, over [a * s, (e - 1) * s].
                let taps = cols
                    .iter()
                    .map(|&kw| {
                        let i = add(vb.clone(), add(v(j), int(a * sw + kw * dw - pw)));
                        Expr::load(vm, i)
                    })
                    .collect();
                let at = add(hb.clone(), int(a * sw));
                b.push(fold(hm, at, (e - 1 - a) * sw + 1, taps));
                // 3. Every s-th of them.
                let pick = Expr::load(hm, add(hb.clone(), mul(add(v(j), int(a)), int(sw))));
                b.push(fold(out.buf, add(v(orb), int(a)), e - a, vec![pick]));
            }
            b
        };
        for oh in 0..lo {
            body.extend(row(int(oh), &rows_ok(oh)));
        }
        if hi > lo {
            let r = row(add(v(ohv), int(lo)), &all);
            body.push(Stmt::For {
                var: ohv,
                extent: (hi - lo) as u64,
                body: r,
            });
        }
        for oh in hi..oh_n {
            body.extend(row(int(oh), &rows_ok(oh)));
        }
        k.body = over_parts(body, (slot, gi), (per, slots), planes);
        lw.push(k);
        Ok(true)
    }

    /// Longest window row `pool_rows` unrolls.
    const ROW_UNROLL: usize = 16;

    /// An f32 pool accumulated along output rows: each output row starts as NaN (max)
    /// or 0 (average); every window position but the last dim's folds its inputs into
    /// the whole row; the last window dim is unrolled so each segment of the row reads
    /// only inside the input (no bounds test in the innermost loop, whose store is unit
    /// stride and which the back end vectorises). Max ignores NaN inputs and gives NaN
    /// for a window with none, like the scalar lowering; averages divide by the count
    /// of the window's positions inside the input (or inside the padded input with
    /// count_include_pad), a per-dim product taken from compile-time tables. Returns
    /// false (nothing lowered) where it does not apply.
    fn pool_rows(lw: &mut LowerCtx, x: &TensorRef, win: &Window, kind: RowPool) -> OpResult<bool> {
        let out = lw.outputs[0].clone();
        let nsp = win.k.len();
        if lw.outputs.len() != 1
            || nsp == 0
            || x.ty() != Ty::F32
            || out.ty() != Ty::F32
            || win.k[nsp - 1] > ROW_UNROLL
            || win.out.contains(&0)
            || win.in_sp.contains(&0)
        {
            return Ok(false);
        }
        let last = nsp - 1;
        let planes = x.shape[0] * x.shape[1];
        let (kw_n, ow_n, iw) = (win.k[last], win.out[last], win.in_sp[last] as i64);
        let (s, d, pb) = (win.s[last] as i64, win.d[last] as i64, win.pb[last]);
        // Output positions [lo, hi) where window column kw reads inside the input.
        let range = |kw: i64| {
            let a = pb - kw * d;
            let lo = (-(-a).div_euclid(s)).max(0);
            let hi = ((iw - 1 + pb - kw * d).div_euclid(s) + 1).min(ow_n as i64);
            (lo, hi.max(lo))
        };
        let mut cuts: Vec<i64> = vec![0, ow_n as i64];
        for kw in 0..kw_n as i64 {
            let (lo, hi) = range(kw);
            cuts.extend([lo, hi]);
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut k = lw.kernel("");
        let pv = k.var(Ty::I64);
        let ov: Vec<VarId> = (0..last).map(|_| k.var(Ty::I64)).collect();
        let kv: Vec<VarId> = (0..last).map(|_| k.var(Ty::I64)).collect();
        let j = k.var(Ty::I64);
        let coords: Vec<Expr> = (0..last)
            .map(|i| {
                add(
                    Expr::bin(
                        BinOp::Sub,
                        mul(v(ov[i]), int(win.s[i] as i64)),
                        int(win.pb[i]),
                    ),
                    mul(v(kv[i]), int(win.d[i] as i64)),
                )
            })
            .collect();
        let ist = strides(&win.in_sp);
        let mut xrow = mul(v(pv), int(win.in_len() as i64));
        for (c, &st) in coords.iter().zip(&ist) {
            xrow = add(xrow, mul(c.clone(), int(st as i64)));
        }
        let ost = strides(&win.out);
        let mut orow = mul(v(pv), int(win.out.iter().product::<usize>() as i64));
        for (i, &o) in ov.iter().enumerate() {
            orow = add(orow, mul(v(o), int(ost[i] as i64)));
        }
        let at = |from: i64| add(orow.clone(), add(v(j), int(from)));
        let row = |len: i64, body: Vec<Stmt>| Stmt::For {
            var: j,
            extent: len as u64,
            body,
        };
        // 1. The row's start value.
        let init = match kind {
            RowPool::Max => lit(f64::NAN, Ty::F32),
            RowPool::Avg { .. } => lit(0.0, Ty::F32),
        };
        let mut body = vec![row(
            ow_n as i64,
            vec![Stmt::Store {
                buf: out.buf,
                index: at(0),
                value: init,
            }],
        )];
        // 2. Each segment of the row between cuts sees a fixed set of window columns.
        let mut acc = Vec::new();
        for seg in cuts.windows(2) {
            let (a, b) = (seg[0], seg[1]);
            let cols: Vec<i64> = (0..kw_n as i64)
                .filter(|&kw| {
                    let (lo, hi) = range(kw);
                    lo <= a && b <= hi
                })
                .collect();
            if cols.is_empty() || b <= a {
                continue;
            }
            let ow = add(v(j), int(a));
            let xat = |kw: i64| {
                Expr::load(
                    x.buf,
                    add(xrow.clone(), add(mul(ow.clone(), int(s)), int(kw * d - pb))),
                )
            };
            let oidx = at(a);
            let value = match kind {
                RowPool::Avg { .. } => {
                    let mut sum = Expr::load(out.buf, oidx.clone());
                    for &kw in &cols {
                        sum = add(sum, xat(kw));
                    }
                    vec![Stmt::Store {
                        buf: out.buf,
                        index: oidx,
                        value: sum,
                    }]
                }
                RowPool::Max => {
                    // Loop-local variables, fresh per loop.
                    let t = k.var(Ty::F32);
                    let xl = k.var(Ty::F32);
                    let mut st = vec![set(t, Expr::load(out.buf, oidx.clone()))];
                    for &kw in &cols {
                        st.push(set(xl, xat(kw)));
                        let better = and(
                            cmp(CmpOp::Eq, v(xl), v(xl)),
                            or(cmp(CmpOp::Ne, v(t), v(t)), cmp(CmpOp::Gt, v(xl), v(t))),
                        );
                        st.push(set(t, Expr::select(better, v(xl), v(t))));
                    }
                    st.push(Stmt::Store {
                        buf: out.buf,
                        index: oidx,
                        value: v(t),
                    });
                    st
                }
            };
            acc.push(row(b - a, value));
        }
        let inner = if last == 0 {
            acc
        } else {
            let zero = vec![0i64; last];
            let ext: Vec<i64> = win.in_sp[..last].iter().map(|&e| e as i64).collect();
            vec![iff(within(&coords, &zero, &ext), acc)]
        };
        body.extend(loops(
            &kv.iter()
                .copied()
                .zip(win.k[..last].iter().copied())
                .collect::<Vec<_>>(),
            inner,
        ));
        // 3. Averages: divide by the count of counted window positions, a product of
        // per-dim counts.
        if let RowPool::Avg { include } = kind {
            let mut cnt: Option<Expr> = None;
            for dim in 0..nsp {
                let (lo, hi) = if include {
                    (-win.pb[dim], win.in_sp[dim] as i64 + win.pe[dim])
                } else {
                    (0, win.in_sp[dim] as i64)
                };
                let counts: Vec<f32> = (0..win.out[dim] as i64)
                    .map(|o| {
                        (0..win.k[dim] as i64)
                            .filter(|&kk| {
                                let c =
                                    o * win.s[dim] as i64 - win.pb[dim] + kk * win.d[dim] as i64;
                                lo <= c && c < hi
                            })
                            .count() as f32
                    })
                    .collect();
                let tab = lw.constant(
                    &format!("count{dim}"),
                    &crate::ir::Tensor::from_vec(&[counts.len()], counts),
                )?;
                let idx = ov.get(dim).map_or(v(j), |&o| v(o));
                let e = Expr::load(tab, idx);
                cnt = Some(match cnt {
                    None => e,
                    Some(c) => mul(c, e),
                });
            }
            let oidx = at(0);
            if let Some(cnt) = cnt {
                body.push(row(
                    ow_n as i64,
                    vec![Stmt::Store {
                        buf: out.buf,
                        index: oidx.clone(),
                        value: Expr::bin(BinOp::Div, Expr::load(out.buf, oidx), cnt),
                    }],
                ));
            }
        }
        let mut outer = vec![(pv, planes)];
        outer.extend(ov.iter().copied().zip(win.out[..last].iter().copied()));
        k.body = loops(&outer, body);
        lw.push(k);
        Ok(true)
    }

    fn max_pool(lw: &mut LowerCtx) -> OpResult<()> {
        let (x, win) = setup(lw)?;
        if max_pool_planes(lw, &x, &win)?
            || pool_direct(lw, &x, &win, RowPool::Max)?
            || max_pool_sep(lw, &x, &win)?
            || pool_2d(lw, &x, &win, RowPool::Max)?
            || pool_rows(lw, &x, &win, RowPool::Max)?
        {
            return Ok(());
        }
        let t = x.ty().compute();
        let col = lw.op.attrs.int("storage_order", 0)? != 0;
        let out = lw.outputs[0].clone();
        let ind = lw.outputs.get(1).cloned();
        let mut k = lw.kernel("");
        let ns = nest_for(&mut k, &x, &win);
        let acc = k.var(t);
        let best = k.var(Ty::I64);
        let il = win.in_len() as i64;
        let xv = Expr::load(
            x.buf,
            add(
                mul(ns.plane.clone(), int(il)),
                flat(&ns.coords, &win.in_sp, false),
            ),
        );
        let mut better = or(
            cmp(CmpOp::Lt, v(best), int(0)),
            cmp(CmpOp::Gt, xv.clone(), v(acc)),
        );
        if t.is_float() {
            better = and(better, cmp(CmpOp::Eq, xv.clone(), xv.clone()));
        }
        let zero = vec![0i64; win.k.len()];
        let ext: Vec<i64> = win.in_sp.iter().map(|&e| e as i64).collect();
        let inner = vec![iff(
            within(&ns.coords, &zero, &ext),
            vec![iff(
                better,
                vec![set(acc, xv), set(best, flat(&ns.coords, &win.in_sp, col))],
            )],
        )];
        let none = cmp(CmpOp::Lt, v(best), int(0));
        let y = if t.is_float() {
            Expr::select(none.clone(), lit(f64::NAN, t), v(acc))
        } else {
            v(acc)
        };
        let mut body = vec![set(acc, lit(0.0, t)), set(best, int(-1))];
        body.extend(loops(&ns.inner, inner));
        body.push(Stmt::Store {
            buf: out.buf,
            index: ns.oidx.clone(),
            value: y,
        });
        if let Some(ind) = ind {
            ensure!(ind.ty() == Ty::I64, "Indices must be int64");
            body.push(Stmt::Store {
                buf: ind.buf,
                index: ns.oidx.clone(),
                value: Expr::select(none, int(-1), add(mul(ns.plane, int(il)), v(best))),
            });
        }
        k.body = loops(&ns.outer, body);
        lw.push(k);
        Ok(())
    }

    /// AveragePool and LpPool (p = None for average).
    fn sum_pool(lw: &mut LowerCtx, p: Option<f64>) -> OpResult<()> {
        let (x, win) = setup(lw)?;
        let t = x.ty().compute();
        ensure!(t.is_float(), "pool of {t}");
        let include = p.is_none() && lw.op.attrs.int("count_include_pad", 0)? != 0;
        if p.is_none()
            && (pool_direct(lw, &x, &win, RowPool::Avg { include })?
                || pool_2d(lw, &x, &win, RowPool::Avg { include })?
                || pool_rows(lw, &x, &win, RowPool::Avg { include })?)
        {
            return Ok(());
        }
        let out = lw.outputs[0].clone();
        let mut k = lw.kernel("");
        let ns = nest_for(&mut k, &x, &win);
        let acc = k.var(Ty::F64);
        let cnt = k.var(Ty::I64);
        let il = win.in_len() as i64;
        let xv = Expr::cast(
            Ty::F64,
            Expr::load(
                x.buf,
                add(
                    mul(ns.plane.clone(), int(il)),
                    flat(&ns.coords, &win.in_sp, false),
                ),
            ),
        );
        let term = match p {
            None => xv,
            Some(1.0) => Expr::un(UnOp::Abs, xv),
            Some(2.0) => mul(xv.clone(), xv),
            Some(p) => Expr::call(
                MathFn::Pow,
                vec![Expr::un(UnOp::Abs, xv), Expr::f(p, Ty::F64)],
            ),
        };
        let zero = vec![0i64; win.k.len()];
        let ext: Vec<i64> = win.in_sp.iter().map(|&e| e as i64).collect();
        let inc = set(cnt, add(v(cnt), int(1)));
        let mut valid = vec![set(acc, add(v(acc), term))];
        if !include {
            valid.push(inc.clone());
        }
        let mut inner = vec![iff(within(&ns.coords, &zero, &ext), valid)];
        if include {
            let lo: Vec<i64> = win.pb.iter().map(|&p| -p).collect();
            let hi: Vec<i64> = ext.iter().zip(&win.pe).map(|(e, p)| e + p).collect();
            inner.push(iff(within(&ns.coords, &lo, &hi), vec![inc]));
        }
        let y = match p {
            None => Expr::bin(BinOp::Div, v(acc), Expr::cast(Ty::F64, v(cnt))),
            Some(1.0) => v(acc),
            Some(2.0) => Expr::un(UnOp::Sqrt, v(acc)),
            Some(p) => Expr::call(MathFn::Pow, vec![v(acc), Expr::f(1.0 / p, Ty::F64)]),
        };
        let mut body = vec![set(acc, Expr::f(0.0, Ty::F64)), set(cnt, int(0))];
        body.extend(loops(&ns.inner, inner));
        body.push(Stmt::Store {
            buf: out.buf,
            index: ns.oidx,
            value: Expr::cast(out.ty().compute(), y),
        });
        k.body = loops(&ns.outer, body);
        lw.push(k);
        Ok(())
    }

    fn average_pool(lw: &mut LowerCtx) -> OpResult<()> {
        sum_pool(lw, None)
    }
    fn lp_pool(lw: &mut LowerCtx) -> OpResult<()> {
        let p = p_attr(lw.op)?;
        sum_pool(lw, Some(p))
    }

    #[derive(Clone, Copy, PartialEq)]
    enum Global {
        Avg,
        Max,
        Lp,
    }

    fn global(lw: &mut LowerCtx, kind: Global) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let t = x.ty().compute();
        ensure!(t.is_float(), "global pool of {t}");
        ensure!(x.shape.len() >= 2, "X must have rank >= 2");
        let p = if kind == Global::Lp {
            p_attr(lw.op)?
        } else {
            1.0
        };
        let out = lw.outputs[0].clone();
        let planes = x.shape[0] * x.shape[1];
        let il: usize = x.shape[2..].iter().product();
        if kind != Global::Lp && t == Ty::F32 && out.ty() == Ty::F32 && il >= 2 * GP_LANES {
            return global_lanes(lw, &x, &out, kind == Global::Max);
        }
        let mut k = lw.kernel("");
        let pv = k.var(Ty::I64);
        let j = k.var(Ty::I64);
        let acc = k.var(Ty::F64);
        let xv = Expr::cast(
            Ty::F64,
            Expr::load(x.buf, add(mul(v(pv), int(il as i64)), v(j))),
        );
        let (init, step, fin) = match kind {
            Global::Avg => (
                0.0,
                set(acc, add(v(acc), xv)),
                Expr::bin(BinOp::Div, v(acc), Expr::f(il as f64, Ty::F64)),
            ),
            Global::Lp => (
                0.0,
                set(
                    acc,
                    add(
                        v(acc),
                        Expr::call(
                            MathFn::Pow,
                            vec![Expr::un(UnOp::Abs, xv), Expr::f(p, Ty::F64)],
                        ),
                    ),
                ),
                Expr::call(MathFn::Pow, vec![v(acc), Expr::f(1.0 / p, Ty::F64)]),
            ),
            Global::Max => (
                f64::NAN,
                iff(
                    and(
                        cmp(CmpOp::Eq, xv.clone(), xv.clone()),
                        or(
                            cmp(CmpOp::Ne, v(acc), v(acc)),
                            cmp(CmpOp::Gt, xv.clone(), v(acc)),
                        ),
                    ),
                    vec![set(acc, xv)],
                ),
                v(acc),
            ),
        };
        let small32 = t == Ty::F32 && out.ty() == Ty::F32 && (2..2 * GP_LANES).contains(&il);
        let body = if kind == Global::Max && small32 {
            // A small plane's maximum in f32 by one loop of two reductions the back ends
            // run in vector lanes: the NaN-skipping select, and whether any element was
            // a number (a plane of NaN gives NaN, as the f64 form, which ran one
            // element at a time: 512 planes of 7x7 0.066 ms, ONNX Runtime 0.013).
            let (m32, seen) = (k.var(Ty::F32), k.var(Ty::F32));
            let xj = Expr::load(x.buf, add(mul(v(pv), int(il as i64)), v(j)));
            let c = |x: f64| lit(x, Ty::F32);
            vec![
                set(m32, c(f64::NEG_INFINITY)),
                set(seen, c(0.0)),
                Stmt::For {
                    var: j,
                    extent: il as u64,
                    body: vec![
                        set(
                            m32,
                            Expr::select(cmp(CmpOp::Gt, xj.clone(), v(m32)), xj.clone(), v(m32)),
                        ),
                        crate::kir::build::raise_flag(seen, cmp(CmpOp::Eq, xj.clone(), xj)),
                    ],
                },
                store(
                    out.buf,
                    v(pv),
                    Expr::select(cmp(CmpOp::Gt, v(seen), c(0.0)), v(m32), c(f64::NAN)),
                ),
            ]
        } else if kind == Global::Avg && small32 {
            // A small plane (under 64 elements) summed in f32 by one reduction loop,
            // which the back ends run in vector lanes of partial sums: the chain of f64
            // additions waited on each one's latency (a 1152-channel 7x7 mean: 0.062 ms,
            // as an f64 tree 0.030, this way 0.010; ONNX Runtime 0.015).
            let s32 = k.var(Ty::F32);
            let xj = Expr::load(x.buf, add(mul(v(pv), int(il as i64)), v(j)));
            let mean = Expr::bin(
                BinOp::Div,
                Expr::cast(Ty::F64, v(s32)),
                Expr::f(il as f64, Ty::F64),
            );
            vec![
                set(s32, lit(0.0, Ty::F32)),
                Stmt::For {
                    var: j,
                    extent: il as u64,
                    body: vec![set(s32, add(v(s32), xj))],
                },
                store(out.buf, v(pv), Expr::cast(out.ty().compute(), mean)),
            ]
        } else {
            vec![
                set(acc, Expr::f(init, Ty::F64)),
                Stmt::For {
                    var: j,
                    extent: il as u64,
                    body: vec![step],
                },
                Stmt::Store {
                    buf: out.buf,
                    index: v(pv),
                    value: Expr::cast(out.ty().compute(), fin),
                },
            ]
        };
        k.body = loops(&[(pv, planes)], body);
        lw.push(k);
        Ok(())
    }

    /// Partial results `global_lanes` keeps per plane.
    const GP_LANES: usize = 32;
    /// Chunks of GP_LANES elements `global_lanes` adds into the partial sums at once.
    const GP_FOLD: usize = 4;

    /// GlobalAveragePool / GlobalMaxPool of f32 over contiguous planes: each plane is
    /// folded into GP_LANES partial sums (maxima) held in its row of scratch, one unit-stride row
    /// of the plane at a time (an innermost loop the back end vectorises; sums take
    /// [`GP_FOLD`] rows at a time, added as a tree before they meet the partials), then the
    /// partials and the tail are folded in f64 (sums) or f32 (maxima). Max ignores NaN
    /// inputs and gives NaN for a plane with none, like the scalar lowering.
    fn global_lanes(lw: &mut LowerCtx, x: &TensorRef, out: &TensorRef, max: bool) -> OpResult<()> {
        let planes = x.shape[0] * x.shape[1];
        let il: usize = x.shape[2..].iter().product();
        let (l, chunks) = (GP_LANES, il / GP_LANES);
        let part = lw.program.add_buffer(
            format!("{}/partials", lw.name),
            crate::kir::BufKind::Arena { offset: 0 },
            Ty::F32,
            (planes * l) as u64,
        );
        let mut k = lw.kernel("");
        let pv = k.var(Ty::I64);
        let xb = k.var(Ty::I64);
        let (cv, lv, tv) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let acc = k.var(if max { Ty::F32 } else { Ty::F64 });
        let (pt, xl) = (k.var(Ty::F32), k.var(Ty::F32));
        // Each plane's partials in their own row of scratch, so that planes may run on
        // different threads (one shared row kept the loop serial: EfficientNet-B0's
        // squeeze-excitation means on 2 threads).
        let pat = |lane: Expr| add(mul(v(pv), int(l as i64)), lane);
        let better = |x: Expr, a: Expr| {
            and(
                cmp(CmpOp::Eq, x.clone(), x.clone()),
                or(cmp(CmpOp::Ne, a.clone(), a.clone()), cmp(CmpOp::Gt, x, a)),
            )
        };
        let xat = |i: Expr| Expr::load(x.buf, add(v(xb), i));
        let step = if max {
            // In the vector loop: xl, pt loop-local; a NaN partial takes any number.
            vec![
                set(xl, xat(add(mul(add(v(cv), int(1)), int(l as i64)), v(lv)))),
                set(pt, Expr::load(part, pat(v(lv)))),
                Stmt::Store {
                    buf: part,
                    index: pat(v(lv)),
                    value: Expr::select(
                        or(cmp(CmpOp::Gt, v(xl), v(pt)), cmp(CmpOp::Ne, v(pt), v(pt))),
                        v(xl),
                        v(pt),
                    ),
                },
            ]
        } else {
            // GP_FOLD chunks per update of the partials, summed as a tree first: the
            // update's load waits on the previous store, once per chunk that was most of
            // the cost of a large plane.
            let at = |u: usize| {
                xat(add(
                    mul(v(cv), int((GP_FOLD * l) as i64)),
                    add(v(lv), int(((1 + u) * l) as i64)),
                ))
            };
            let fold = crate::kir::build::sum_tree((0..GP_FOLD).map(at).collect());
            vec![Stmt::Store {
                buf: part,
                index: pat(v(lv)),
                value: add(Expr::load(part, pat(v(lv))), fold.expect("chunks")),
            }]
        };
        let fold = |e: Expr| {
            if max {
                iff(better(e.clone(), v(acc)), vec![set(acc, e)])
            } else {
                set(acc, add(v(acc), Expr::cast(Ty::F64, e)))
            }
        };
        let mut body = vec![
            set(xb, mul(v(pv), int(il as i64))),
            Stmt::For {
                var: lv,
                extent: l as u64,
                body: vec![Stmt::Store {
                    buf: part,
                    index: pat(v(lv)),
                    value: xat(v(lv)),
                }],
            },
        ];
        // Chunks 1.. (chunk 0 is the start value): sums in groups of GP_FOLD, then the
        // chunks left one at a time; maxima one at a time.
        let per = if max { 1 } else { GP_FOLD };
        body.push(Stmt::For {
            var: cv,
            extent: ((chunks - 1) / per) as u64,
            body: vec![Stmt::For {
                var: lv,
                extent: l as u64,
                body: step,
            }],
        });
        for c in (chunks - 1) / per * per + 1..chunks {
            let xc = xat(add(v(lv), int((c * l) as i64)));
            body.push(Stmt::For {
                var: lv,
                extent: l as u64,
                body: vec![Stmt::Store {
                    buf: part,
                    index: pat(v(lv)),
                    value: add(Expr::load(part, pat(v(lv))), xc),
                }],
            });
        }
        let body_tail = {
            let mut b = Vec::new();
            if max {
                b.push(set(acc, lit(f64::NAN, Ty::F32)));
                b.push(Stmt::For {
                    var: lv,
                    extent: l as u64,
                    body: vec![fold(Expr::load(part, pat(v(lv))))],
                });
                if il > chunks * l {
                    b.push(Stmt::For {
                        var: tv,
                        extent: (il - chunks * l) as u64,
                        body: vec![fold(xat(add(v(tv), int((chunks * l) as i64))))],
                    });
                }
            } else {
                // The partials and the tail summed as a balanced tree (depth 6 for at
                // most 63 terms): a chain of f64 additions waited on each add's latency,
                // and for small planes that was the whole cost (EfficientNet-B0's last
                // 1280-channel 7x7 mean: 0.08 ms).
                let f64_of = |e: Expr| Expr::cast(Ty::F64, e);
                let terms: Vec<Expr> = (0..l)
                    .map(|i| f64_of(Expr::load(part, pat(int(i as i64)))))
                    .chain((chunks * l..il).map(|t| f64_of(xat(int(t as i64)))))
                    .collect();
                let sum = crate::kir::build::sum_tree(terms).expect("32 partials");
                b.push(set(acc, sum));
            }
            let fin = if max {
                v(acc)
            } else {
                Expr::cast(
                    Ty::F32,
                    Expr::bin(BinOp::Div, v(acc), Expr::f(il as f64, Ty::F64)),
                )
            };
            b.push(Stmt::Store {
                buf: out.buf,
                index: v(pv),
                value: fin,
            });
            b
        };
        body.extend(body_tail);
        k.body = loops(&[(pv, planes)], body);
        lw.push(k);
        Ok(())
    }

    fn global_average_pool(lw: &mut LowerCtx) -> OpResult<()> {
        global(lw, Global::Avg)
    }
    fn global_max_pool(lw: &mut LowerCtx) -> OpResult<()> {
        global(lw, Global::Max)
    }
    fn global_lp_pool(lw: &mut LowerCtx) -> OpResult<()> {
        global(lw, Global::Lp)
    }

    /// Stores `value` at flat index `at` of shape `from` re-addressed into shape `to`
    /// (the top-left corner), skipping positions outside `to`.
    fn remap(at: &Expr, from: &[usize], to: &[usize], buf: usize, value: Expr) -> Vec<Stmt> {
        if from == to {
            return vec![Stmt::Store {
                buf,
                index: at.clone(),
                value,
            }];
        }
        let fs = strides(from);
        let ts = strides(to);
        let mut ok = lit(1.0, Ty::U8);
        let mut idx = int(0);
        for d in 0..from.len() {
            let c = Expr::bin(
                BinOp::Rem,
                Expr::bin(BinOp::Div, at.clone(), int(fs[d] as i64)),
                int(from[d] as i64),
            );
            ok = and(ok, cmp(CmpOp::Lt, c.clone(), int(to[d] as i64)));
            idx = add(idx, mul(c, int(ts[d] as i64)));
        }
        vec![iff(
            ok,
            vec![Stmt::Store {
                buf,
                index: idx,
                value,
            }],
        )]
    }

    /// MaxUnpool: zero fill, then scatter X through the (runtime) indices. Indices out of
    /// range are skipped. With an explicit output_shape
    /// the indices address the inferred shape, copied into the output's top-left corner.
    fn max_unpool(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let ind = lw.input(1)?.clone();
        let out = lw.outputs[0].clone();
        let xs = &x.shape;
        ensure!(xs.len() >= 3 && ind.shape == *xs, "bad MaxUnpool shapes");
        let nsp = xs.len() - 2;
        let k = lw.op.attrs.req_ints("kernel_shape")?;
        let st = lw.op.attrs.ints("strides", &vec![1; nsp])?;
        let pads = lw.op.attrs.ints("pads", &vec![0; 2 * nsp])?;
        ensure!(
            k.len() == nsp && st.len() == nsp && pads.len() == 2 * nsp,
            "bad MaxUnpool attributes"
        );
        let mut inferred = vec![xs[0] as i64, xs[1] as i64];
        for i in 0..nsp {
            inferred.push((xs[i + 2] as i64 - 1) * st[i] - (pads[i] + pads[nsp + i]) + k[i]);
        }
        ensure!(
            inferred.len() == out.shape.len() && inferred.iter().all(|&d| d >= 0),
            "bad MaxUnpool output shape"
        );
        let inferred: Vec<usize> = inferred.iter().map(|&d| d as usize).collect();
        let total = inferred.iter().product::<usize>() as i64;
        let t = out.ty().compute();
        let mut k1 = lw.kernel("fill");
        let i = k1.var(Ty::I64);
        k1.body = loops(
            &[(i, out.len())],
            vec![Stmt::Store {
                buf: out.buf,
                index: v(i),
                value: lit(0.0, t),
            }],
        );
        lw.push(k1);
        let mut k2 = lw.kernel("scatter");
        let i = k2.var(Ty::I64);
        let at = Expr::cast(Ty::I64, Expr::load(ind.buf, v(i)));
        k2.body = loops(
            &[(i, x.len())],
            vec![iff(
                and(
                    cmp(CmpOp::Ge, at.clone(), int(0)),
                    cmp(CmpOp::Lt, at.clone(), int(total)),
                ),
                remap(&at, &inferred, &out.shape, out.buf, Expr::load(x.buf, v(i))),
            )],
        );
        lw.push(k2);
        Ok(())
    }

    pub fn register(r: &mut Registry) {
        r.lower("MaxUnpool", Lowering::Custom(max_unpool));
        r.lower("MaxPool", Lowering::Custom(max_pool));
        r.lower("AveragePool", Lowering::Custom(average_pool));
        r.lower("LpPool", Lowering::Custom(lp_pool));
        r.lower("GlobalAveragePool", Lowering::Custom(global_average_pool));
        r.lower("GlobalMaxPool", Lowering::Custom(global_max_pool));
        r.lower("GlobalLpPool", Lowering::Custom(global_lp_pool));
    }
}
