//! nn ops: Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv,
//! CausalConvWithState. Also the sliding-window geometry shared with pooling.
//!
//! Convolutions are computed in f64: im2col per image and group, then one matrix
//! product (ndarray's optimised GEMM).

use super::util::{dims, f64s, input, opt_input, out, outs};
use super::{OpCtx, Registry};
use crate::ir::{DType, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{Array2, ArrayD, ArrayView2, IxDyn};

pub fn register(r: &mut Registry) {
    r.add("Conv", conv);
    r.add("ConvTranspose", conv_transpose);
    r.add("ConvInteger", conv_integer);
    r.add("QLinearConv", qlinear_conv);
    r.add("DeformConv", deform_conv);
    r.add("CausalConvWithState", causal_conv_with_state);
    lower::register(r);
}

// ---------------------------------------------------------------------------------------
// Geometry shared with pool.rs

/// Table code: the window position lies in the explicit padding.
pub(super) const PAD: usize = usize::MAX - 1;
/// Table code: the window position lies beyond the padded input (ceil mode).
pub(super) const OUTSIDE: usize = usize::MAX;

/// The geometry of a sliding window over the spatial dims.
#[derive(Clone, Debug)]
pub(super) struct Window {
    pub in_sp: Vec<usize>,
    pub k: Vec<usize>,
    pub s: Vec<usize>,
    pub d: Vec<usize>,
    /// Pads at the beginning and end of each spatial dim.
    pub pb: Vec<i64>,
    pub pe: Vec<i64>,
    pub out: Vec<usize>,
}

impl Window {
    pub fn kernel_len(&self) -> usize {
        self.k.iter().product()
    }
    pub fn out_len(&self) -> usize {
        self.out.iter().product()
    }
    pub fn in_len(&self) -> usize {
        self.in_sp.iter().product()
    }

    /// For each kernel offset `kk` and output position `p` (entry `kk * P + p`), the flat
    /// spatial index of the input it reads, or [`PAD`] / [`OUTSIDE`].
    pub fn table(&self) -> OpResult<Vec<usize>> {
        index_table(
            &self.out,
            &self.k,
            &self.s,
            &self.d,
            &self.pb,
            &self.pe,
            &self.in_sp,
        )
    }
}

fn positive(v: &[i64], what: &str, n: usize) -> OpResult<Vec<usize>> {
    ensure!(
        v.len() == n,
        "`{what}` has {} values but the input has {n} spatial dims",
        v.len()
    );
    let mut out = Vec::with_capacity(n);
    for &x in v {
        ensure!(
            (1..=1 << 20).contains(&x),
            "`{what}` value {x} must be positive"
        );
        out.push(x as usize);
    }
    Ok(out)
}

/// Reads strides, dilations, pads and auto_pad, and computes the output spatial shape.
/// `ceil` enables the pooling `ceil_mode` attribute.
pub(super) fn window(ctx: &OpCtx, in_sp: &[usize], k: &[usize], ceil: bool) -> OpResult<Window> {
    let n = in_sp.len();
    ensure!(
        k.len() == n,
        "kernel has {} dims but the input has {n} spatial dims",
        k.len()
    );
    let s = positive(&ctx.attrs.ints("strides", &vec![1; n])?, "strides", n)?;
    let d = positive(&ctx.attrs.ints("dilations", &vec![1; n])?, "dilations", n)?;
    let pads = ctx.attrs.ints("pads", &vec![0; 2 * n])?;
    ensure!(
        pads.len() == 2 * n,
        "`pads` has {} values, expected {}",
        pads.len(),
        2 * n
    );
    for &p in &pads {
        ensure!((0..=1 << 20).contains(&p), "pad {p} is out of range");
    }
    let ceil_mode = ceil && ctx.attrs.int("ceil_mode", 0)? != 0;
    let auto_pad = ctx.attrs.string("auto_pad", "NOTSET".into())?;
    let mut pb = pads[..n].to_vec();
    let mut pe = pads[n..].to_vec();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let ek = ((k[i] as i64) - 1) * d[i] as i64 + 1;
        let inn = in_sp[i] as i64;
        let st = s[i] as i64;
        match auto_pad.as_str() {
            "SAME_UPPER" | "SAME_LOWER" => {
                let o = (inn + st - 1) / st;
                let total = ((o - 1) * st + ek - inn).max(0);
                let head = if auto_pad == "SAME_UPPER" {
                    total / 2
                } else {
                    total - total / 2
                };
                pb[i] = head;
                pe[i] = total - head;
                out.push(o.max(0) as usize);
            }
            "VALID" => {
                pb[i] = 0;
                pe[i] = 0;
                let o = if inn >= ek { (inn - ek) / st + 1 } else { 0 };
                out.push(o as usize);
            }
            "NOTSET" | "" => {
                let span = inn + pb[i] + pe[i] - ek;
                ensure!(
                    span >= 0,
                    "the kernel (extent {ek}) is larger than the padded input ({})",
                    inn + pb[i] + pe[i]
                );
                let mut o = if ceil_mode {
                    (span + st - 1) / st + 1
                } else {
                    span / st + 1
                };
                // The last window must start inside the input or its head padding.
                if ceil_mode && (o - 1) * st >= inn + pb[i] {
                    o -= 1;
                }
                out.push(o as usize);
            }
            other => bail!("unknown auto_pad `{other}`"),
        }
    }
    dims(&out.iter().map(|&x| x as i64).collect::<Vec<_>>())?;
    Ok(Window {
        in_sp: in_sp.to_vec(),
        k: k.to_vec(),
        s,
        d,
        pb,
        pe,
        out,
    })
}

/// For kernel offsets over `k` and positions over `pos`, the flat index into `ext` of
/// `pos*s - pb + k*d` (entry `kk * P + p`), or PAD inside `[-pb, ext+pe)`, else OUTSIDE.
pub(super) fn index_table(
    pos: &[usize],
    k: &[usize],
    s: &[usize],
    d: &[usize],
    pb: &[i64],
    pe: &[i64],
    ext: &[usize],
) -> OpResult<Vec<usize>> {
    let n = pos.len();
    let kl: usize = k.iter().product();
    let pl: usize = pos.iter().product();
    dims(&[kl as i64, pl as i64])?;
    ensure!(
        kl.saturating_mul(pl) <= 1 << 32,
        "sliding window table too large ({kl} x {pl})"
    );
    // Per dim, per (ki, oi): the coordinate class.
    let mut per_dim: Vec<Vec<usize>> = Vec::with_capacity(n);
    for i in 0..n {
        let mut t = Vec::with_capacity(k[i] * pos[i]);
        for ki in 0..k[i] {
            for oi in 0..pos[i] {
                let c = (oi * s[i]) as i64 - pb[i] + (ki * d[i]) as i64;
                t.push(if c >= 0 && c < ext[i] as i64 {
                    c as usize
                } else if c >= -pb[i] && c < ext[i] as i64 + pe[i] {
                    PAD
                } else {
                    OUTSIDE
                });
            }
        }
        per_dim.push(t);
    }
    let mut table = vec![0usize; kl * pl];
    let mut kidx = vec![0usize; n];
    let mut pidx = vec![0usize; n];
    for kk in 0..kl {
        // Decode kk into kidx (row-major).
        let mut r = kk;
        for i in (0..n).rev() {
            kidx[i] = r % k[i];
            r /= k[i];
        }
        pidx.iter_mut().for_each(|x| *x = 0);
        let row = &mut table[kk * pl..(kk + 1) * pl];
        for slot in row.iter_mut() {
            let mut flat = 0usize;
            let mut code = 0usize; // 0 valid, 1 pad, 2 outside
            for i in 0..n {
                let c = per_dim[i][kidx[i] * pos[i] + pidx[i]];
                if c == OUTSIDE {
                    code = 2;
                } else if c == PAD {
                    code = code.max(1);
                } else {
                    flat = flat * ext[i] + c;
                }
            }
            *slot = match code {
                0 => flat,
                1 => PAD,
                _ => OUTSIDE,
            };
            // Advance the position odometer.
            for i in (0..n).rev() {
                pidx[i] += 1;
                if pidx[i] < pos[i] {
                    break;
                }
                pidx[i] = 0;
            }
        }
    }
    Ok(table)
}

fn flat(t: &Tensor) -> OpResult<Vec<f64>> {
    Ok(f64s(t)?.iter().copied().collect())
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

fn group_attr(ctx: &OpCtx) -> OpResult<usize> {
    let g = ctx.attrs.int("group", 1)?;
    ensure!(g >= 1, "group must be positive, got {g}");
    Ok(g as usize)
}

/// Checks X/W shapes of a convolution and returns (N, C, M, Cg, kernel, spatial).
fn conv_shapes(
    ctx: &OpCtx,
    xs: &[usize],
    ws: &[usize],
    group: usize,
) -> OpResult<(usize, usize, usize, Vec<usize>)> {
    ensure!(
        xs.len() >= 3,
        "X must have rank >= 3 (N, C, spatial...), got shape {xs:?}"
    );
    ensure!(
        ws.len() == xs.len(),
        "W has rank {} but X has rank {}",
        ws.len(),
        xs.len()
    );
    let (c, m, cg) = (xs[1], ws[0], ws[1]);
    ensure!(
        cg * group == c && m % group == 0,
        "shapes X {xs:?} and W {ws:?} do not fit group={group}"
    );
    let k = ws[2..].to_vec();
    if let Some(ks) = ctx.attrs.get_ints("kernel_shape")? {
        ensure!(
            ks.len() == k.len() && ks.iter().zip(&k).all(|(&a, &b)| a == b as i64),
            "kernel_shape {ks:?} does not match W's shape {ws:?}"
        );
    }
    Ok((xs[0], m, cg, k))
}

/// The core of a grouped N-d convolution on f64 data. Returns [N, M, out...] flat.
#[allow(clippy::too_many_arguments)]
fn conv_core(
    x: &[f64],
    xs: &[usize],
    w: &[f64],
    m: usize,
    cg: usize,
    group: usize,
    bias: Option<&[f64]>,
    win: &Window,
) -> OpResult<Vec<f64>> {
    let n = xs[0];
    let c = xs[1];
    let kl = win.kernel_len();
    let pl = win.out_len();
    let il = win.in_len();
    let mg = m / group;
    let table = win.table()?;
    let total = dims(&[n as i64, m as i64, pl as i64])?;
    let mut y = vec![0f64; total.iter().product()];
    let rows = cg * kl;
    let mut cols = vec![0f64; rows * pl];
    for ni in 0..n {
        for g in 0..group {
            for ci in 0..cg {
                let plane = &x[(ni * c + g * cg + ci) * il..][..il];
                for kk in 0..kl {
                    let dst = &mut cols[(ci * kl + kk) * pl..][..pl];
                    let src = &table[kk * pl..][..pl];
                    for (o, &t) in dst.iter_mut().zip(src) {
                        *o = if t < PAD { plane[t] } else { 0.0 };
                    }
                }
            }
            let cv = ArrayView2::from_shape((rows, pl), &cols[..]).expect("sized");
            let wv = ArrayView2::from_shape((mg, rows), &w[g * mg * rows..][..mg * rows])
                .expect("sized");
            let r: Array2<f64> = wv.dot(&cv);
            for mi in 0..mg {
                let oc = g * mg + mi;
                let b = bias.map(|b| b[oc]).unwrap_or(0.0);
                let dst = &mut y[(ni * m + oc) * pl..][..pl];
                for (o, v) in dst.iter_mut().zip(r.row(mi).iter()) {
                    *o = v + b;
                }
            }
        }
    }
    Ok(y)
}

fn out_shape(n: usize, m: usize, sp: &[usize]) -> Vec<usize> {
    let mut v = vec![n, m];
    v.extend_from_slice(sp);
    v
}

fn bias_vec(t: Option<&Tensor>, m: usize) -> OpResult<Option<Vec<f64>>> {
    match t {
        None => Ok(None),
        Some(b) => {
            let v = flat(b)?;
            if v.len() == 1 && m != 1 {
                return Ok(Some(vec![v[0]; m]));
            }
            ensure!(
                v.len() == m,
                "bias has {} values but there are {m} output channels",
                v.len()
            );
            Ok(Some(v))
        }
    }
}

fn conv(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let w = float_input(ins, 1)?;
    let group = group_attr(ctx)?;
    let (n, m, cg, k) = conv_shapes(ctx, x.shape(), w.shape(), group)?;
    let win = window(ctx, &x.shape()[2..], &k, false)?;
    let bias = bias_vec(opt_input(ins, 2)?, m)?;
    let y = conv_core(
        &flat(x)?,
        x.shape(),
        &flat(w)?,
        m,
        cg,
        group,
        bias.as_deref(),
        &win,
    )?;
    let shape = out_shape(n, m, &win.out);
    out(Tensor::from_f64(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&shape), y).expect("sized"),
        false,
    ))
}

/// Integer values with a zero point subtracted: scalar, or per channel along axis 0.
fn minus_zero_point(t: &Tensor, zp: Option<&Tensor>, what: &str) -> OpResult<Vec<f64>> {
    let mut v = flat(t)?;
    if let Some(z) = zp {
        let zv = flat(z)?;
        if zv.len() == 1 {
            v.iter_mut().for_each(|x| *x -= zv[0]);
        } else {
            let c = t.shape().first().copied().unwrap_or(1);
            ensure!(
                zv.len() == c && c > 0,
                "{what} zero point has {} values; expected 1 or {c}",
                zv.len()
            );
            let per = v.len() / c;
            for (i, x) in v.iter_mut().enumerate() {
                *x -= zv[i / per];
            }
        }
    }
    Ok(v)
}

fn conv_integer(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let w = input(ins, 1)?;
    ensure!(
        x.dtype().is_int() && w.dtype().is_int(),
        "ConvInteger takes integer inputs, got {} and {}",
        x.dtype(),
        w.dtype()
    );
    let group = group_attr(ctx)?;
    let (n, m, cg, k) = conv_shapes(ctx, x.shape(), w.shape(), group)?;
    let win = window(ctx, &x.shape()[2..], &k, false)?;
    let xv = {
        let zp = opt_input(ins, 2)?;
        if let Some(z) = zp {
            ensure!(z.len() == 1, "x_zero_point must be a scalar");
        }
        minus_zero_point(x, zp, "x")?
    };
    let wv = minus_zero_point(w, opt_input(ins, 3)?, "w")?;
    let y = conv_core(&xv, x.shape(), &wv, m, cg, group, None, &win)?;
    let shape = out_shape(n, m, &win.out);
    out(Tensor::from_f64(
        DType::I32,
        ArrayD::from_shape_vec(IxDyn(&shape), y).expect("sized"),
        false,
    ))
}

fn per_channel(t: &Tensor, m: usize, what: &str) -> OpResult<Vec<f64>> {
    let v = flat(t)?;
    if v.len() == 1 {
        return Ok(vec![v[0]; m]);
    }
    ensure!(
        v.len() == m,
        "{what} has {} values; expected 1 or {m}",
        v.len()
    );
    Ok(v)
}

fn qlinear_conv(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let x_scale = f64s(input(ins, 1)?)?;
    let x_zp = opt_input(ins, 2)?;
    let w = input(ins, 3)?;
    let w_scale = input(ins, 4)?;
    let w_zp = opt_input(ins, 5)?;
    let y_scale = f64s(input(ins, 6)?)?;
    let y_zp = opt_input(ins, 7)?;
    let b = opt_input(ins, 8)?;
    ensure!(
        x.dtype().is_int() && w.dtype().is_int(),
        "QLinearConv takes integer x and w, got {} and {}",
        x.dtype(),
        w.dtype()
    );
    ensure!(
        x_scale.len() == 1 && y_scale.len() == 1,
        "x_scale and y_scale must be scalars"
    );
    let xs0 = x_scale.iter().next().copied().unwrap_or(1.0);
    let ys0 = y_scale.iter().next().copied().unwrap_or(1.0);
    let group = group_attr(ctx)?;
    let (n, m, cg, k) = conv_shapes(ctx, x.shape(), w.shape(), group)?;
    let win = window(ctx, &x.shape()[2..], &k, false)?;
    if let Some(z) = x_zp {
        ensure!(z.len() == 1, "x_zero_point must be a scalar");
    }
    let xv = minus_zero_point(x, x_zp, "x")?;
    let wv = minus_zero_point(w, w_zp, "w")?;
    let bias = bias_vec(b, m)?;
    let y = conv_core(&xv, x.shape(), &wv, m, cg, group, bias.as_deref(), &win)?;
    let ws = per_channel(w_scale, m, "w_scale")?;
    let (odt, zp) = match y_zp {
        Some(z) => {
            ensure!(z.len() == 1, "y_zero_point must be a scalar");
            (z.dtype(), flat(z)?[0])
        }
        None => (x.dtype(), 0.0),
    };
    let (lo, hi) = odt
        .int_range()
        .ok_or_else(|| crate::ir::OpError::new(format!("bad output dtype {odt}")))?;
    let pl = win.out_len();
    let mut r = y;
    for (i, v) in r.iter_mut().enumerate() {
        let oc = (i / pl) % m;
        let q = *v * (xs0 * ws[oc] / ys0) + zp;
        *v = q.clamp(lo as f64, hi as f64).round_ties_even();
    }
    let shape = out_shape(n, m, &win.out);
    out(Tensor::from_f64(
        odt,
        ArrayD::from_shape_vec(IxDyn(&shape), r).expect("sized"),
        false,
    ))
}

// ---------------------------------------------------------------------------------------
// ConvTranspose

fn conv_transpose(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let w = float_input(ins, 1)?;
    let xs = x.shape();
    let ws = w.shape();
    let group = group_attr(ctx)?;
    ensure!(xs.len() >= 3, "X must have rank >= 3, got shape {xs:?}");
    ensure!(
        ws.len() == xs.len(),
        "W has rank {} but X has rank {}",
        ws.len(),
        xs.len()
    );
    let (n, c) = (xs[0], xs[1]);
    ensure!(
        ws[0] == c && c % group == 0,
        "shapes X {xs:?} and W {ws:?} do not fit group={group}"
    );
    let cg = c / group;
    let mg = ws[1];
    let m = mg * group;
    let k = ws[2..].to_vec();
    let nsp = k.len();
    let in_sp = &xs[2..];
    let s = positive(&ctx.attrs.ints("strides", &vec![1; nsp])?, "strides", nsp)?;
    let d = positive(
        &ctx.attrs.ints("dilations", &vec![1; nsp])?,
        "dilations",
        nsp,
    )?;
    let op = ctx.attrs.ints("output_padding", &vec![0; nsp])?;
    ensure!(
        op.len() == nsp,
        "output_padding has {} values, expected {nsp}",
        op.len()
    );
    let pads = ctx.attrs.ints("pads", &vec![0; 2 * nsp])?;
    ensure!(
        pads.len() == 2 * nsp,
        "`pads` has {} values, expected {}",
        pads.len(),
        2 * nsp
    );
    for &p in pads.iter().chain(op.iter()) {
        ensure!((0..=1 << 20).contains(&p), "pad {p} is out of range");
    }
    let auto_pad = ctx.attrs.string("auto_pad", "NOTSET".into())?;
    let same = matches!(auto_pad.as_str(), "SAME_UPPER" | "SAME_LOWER");
    let mut output_shape = ctx.attrs.get_ints("output_shape")?;
    if let Some(os) = &output_shape {
        ensure!(
            os.len() >= nsp,
            "output_shape {os:?} has fewer than {nsp} values"
        );
        output_shape = Some(os[os.len() - nsp..].to_vec());
    }
    if output_shape.is_none() && same {
        output_shape = Some(
            in_sp
                .iter()
                .zip(&s)
                .map(|(&a, &b)| (a * b) as i64)
                .collect(),
        );
    }
    let mut pb = pads[..nsp].to_vec();
    let mut pe = pads[nsp..].to_vec();
    let mut out_sp = Vec::with_capacity(nsp);
    for i in 0..nsp {
        let ek = (k[i] as i64 - 1) * d[i] as i64 + 1;
        let full = s[i] as i64 * (in_sp[i] as i64 - 1) + op[i] + ek;
        match &output_shape {
            Some(os) => {
                let total = full - os[i];
                let half = total.div_euclid(2);
                if auto_pad == "SAME_UPPER" {
                    pb[i] = half;
                    pe[i] = total - half;
                } else {
                    pb[i] = total - half;
                    pe[i] = half;
                }
                out_sp.push(os[i]);
            }
            None => out_sp.push(full - pb[i] - pe[i]),
        }
    }
    let out_sp = dims(&out_sp)?;
    let pin: usize = in_sp.iter().product();
    let kl: usize = k.iter().product();
    let pl: usize = out_sp.iter().product();
    // For each kernel offset and input position, the output position it adds to.
    let zero = vec![0i64; nsp];
    let table = index_table(in_sp, &k, &s, &d, &pb, &zero, &out_sp)?;
    let xv = flat(x)?;
    let wv = flat(w)?;
    let bias = bias_vec(opt_input(ins, 2)?, m)?;
    let total = dims(&[n as i64, m as i64, pl as i64])?;
    let mut y = vec![0f64; total.iter().product()];
    for ni in 0..n {
        for g in 0..group {
            let xg = ArrayView2::from_shape((cg, pin), &xv[(ni * c + g * cg) * pin..][..cg * pin])
                .expect("sized");
            let wg = ArrayView2::from_shape((cg, mg * kl), &wv[g * cg * mg * kl..][..cg * mg * kl])
                .expect("sized");
            let cols: Array2<f64> = wg.t().dot(&xg); // (mg*kl, pin)
            for mi in 0..mg {
                let oc = g * mg + mi;
                let dst = &mut y[(ni * m + oc) * pl..][..pl];
                for kk in 0..kl {
                    let row = cols.row(mi * kl + kk);
                    let tr = &table[kk * pin..][..pin];
                    for (&t, v) in tr.iter().zip(row.iter()) {
                        if t < PAD {
                            dst[t] += v;
                        }
                    }
                }
                if let Some(b) = &bias {
                    dst.iter_mut().for_each(|v| *v += b[oc]);
                }
            }
        }
    }
    let shape = out_shape(n, m, &out_sp);
    out(Tensor::from_f64(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&shape), y).expect("sized"),
        false,
    ))
}

// ---------------------------------------------------------------------------------------
// DeformConv

fn deform_conv(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let w = float_input(ins, 1)?;
    let off = float_input(ins, 2)?;
    let group = group_attr(ctx)?;
    let (n, m, cg, k) = conv_shapes(ctx, x.shape(), w.shape(), group)?;
    let xs = x.shape().to_vec();
    let c = xs[1];
    let nsp = k.len();
    let og = ctx.attrs.int("offset_group", 1)?;
    ensure!(
        og >= 1 && c % og as usize == 0,
        "offset_group {og} must divide the {c} input channels"
    );
    let og = og as usize;
    let win = window(ctx, &xs[2..], &k, false)?;
    let kl = win.kernel_len();
    let pl = win.out_len();
    let il = win.in_len();
    let mut want = vec![n, og * kl * nsp];
    want.extend_from_slice(&win.out);
    ensure!(
        off.shape() == want.as_slice(),
        "offset has shape {:?}, expected {want:?}",
        off.shape()
    );
    let mask = match opt_input(ins, 4)? {
        Some(mt) => {
            let mut want = vec![n, og * kl];
            want.extend_from_slice(&win.out);
            ensure!(
                mt.shape() == want.as_slice(),
                "mask has shape {:?}, expected {want:?}",
                mt.shape()
            );
            Some(flat(mt)?)
        }
        None => None,
    };
    let bias = bias_vec(opt_input(ins, 3)?, m)?;
    let xv = flat(x)?;
    let wv = flat(w)?;
    let ov = flat(off)?;
    let cpo = c / og;
    let mg = m / group;
    let rows = cg * kl;
    let total = dims(&[n as i64, m as i64, pl as i64])?;
    dims(&[c as i64, kl as i64, pl as i64])?;
    let mut y = vec![0f64; total.iter().product()];
    let mut cols = vec![0f64; c * kl * pl];
    // Base (undeformed) coordinate per dim, kernel offset and output position.
    let mut kidx = vec![0usize; nsp];
    let mut pidx = vec![0usize; nsp];
    let mut pos = vec![0f64; nsp];
    for ni in 0..n {
        for kk in 0..kl {
            let mut r = kk;
            for i in (0..nsp).rev() {
                kidx[i] = r % k[i];
                r /= k[i];
            }
            pidx.iter_mut().for_each(|v| *v = 0);
            for p in 0..pl {
                for gi in 0..og {
                    for i in 0..nsp {
                        let base = (pidx[i] * win.s[i]) as f64 - win.pb[i] as f64
                            + (kidx[i] * win.d[i]) as f64;
                        let ch = (gi * kl + kk) * nsp + i;
                        pos[i] = base + ov[(ni * og * kl * nsp + ch) * pl + p];
                    }
                    let mval = match &mask {
                        Some(mv) => mv[(ni * og * kl + gi * kl + kk) * pl + p],
                        None => 1.0,
                    };
                    // Multilinear interpolation weights of the 2^nsp corners.
                    for ci in gi * cpo..(gi + 1) * cpo {
                        let plane = &xv[(ni * c + ci) * il..][..il];
                        let v = interpolate(plane, &xs[2..], &pos);
                        cols[(ci * kl + kk) * pl + p] = v * mval;
                    }
                }
                for i in (0..nsp).rev() {
                    pidx[i] += 1;
                    if pidx[i] < win.out[i] {
                        break;
                    }
                    pidx[i] = 0;
                }
            }
        }
        for g in 0..group {
            let cv = ArrayView2::from_shape((rows, pl), &cols[g * rows * pl..][..rows * pl])
                .expect("sized");
            let wgv = ArrayView2::from_shape((mg, rows), &wv[g * mg * rows..][..mg * rows])
                .expect("sized");
            let r: Array2<f64> = wgv.dot(&cv);
            for mi in 0..mg {
                let oc = g * mg + mi;
                let b = bias.as_ref().map(|b| b[oc]).unwrap_or(0.0);
                let dst = &mut y[(ni * m + oc) * pl..][..pl];
                for (o, v) in dst.iter_mut().zip(r.row(mi).iter()) {
                    *o = v + b;
                }
            }
        }
    }
    let shape = out_shape(n, m, &win.out);
    out(Tensor::from_f64(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&shape), y).expect("sized"),
        false,
    ))
}

/// Multilinear interpolation of `plane` (row-major over `ext`) at `pos`; points outside
/// the grid read as zero.
fn interpolate(plane: &[f64], ext: &[usize], pos: &[f64]) -> f64 {
    let n = ext.len();
    if pos.iter().any(|p| !p.is_finite()) {
        return 0.0;
    }
    let mut acc = 0.0;
    'corner: for mask in 0..(1usize << n) {
        let mut wgt = 1.0;
        let mut idx = 0usize;
        for i in 0..n {
            let f = pos[i].floor();
            let frac = pos[i] - f;
            let bit = (mask >> i) & 1;
            let c = f as i64 + bit as i64;
            let wi = if bit == 1 { frac } else { 1.0 - frac };
            if wi == 0.0 {
                continue 'corner;
            }
            if c < 0 || c >= ext[i] as i64 {
                continue 'corner;
            }
            wgt *= wi;
            idx = idx * ext[i] + c as usize;
        }
        acc += wgt * plane[idx];
    }
    acc
}

// ---------------------------------------------------------------------------------------
// CausalConvWithState

fn causal_conv_with_state(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = float_input(ins, 0)?;
    let w = float_input(ins, 1)?;
    let act = ctx.attrs.string("activation", "none".into())?;
    let silu = match act.as_str() {
        "none" => false,
        "silu" | "swish" => true,
        other => bail!("unsupported activation `{other}` (expected none, silu or swish)"),
    };
    let xs = x.shape();
    let ws = w.shape();
    ensure!(xs.len() == 3, "input must be rank 3, got shape {xs:?}");
    ensure!(
        ws.len() == 3 && ws[0] == xs[1] && ws[1] == 1 && ws[2] >= 1,
        "weight must have shape ({}, 1, k), got {ws:?}",
        xs[1]
    );
    let (n, c, l) = (xs[0], xs[1], xs[2]);
    let k = ws[2];
    let bias = bias_vec(opt_input(ins, 2)?, c)?;
    let past = match opt_input(ins, 3)? {
        Some(p) => {
            ensure!(
                p.shape() == [n, c, k - 1],
                "past_state has shape {:?}, expected {:?}",
                p.shape(),
                [n, c, k - 1]
            );
            Some(flat(p)?)
        }
        None => None,
    };
    let xv = flat(x)?;
    let wv = flat(w)?;
    let pl = k - 1 + l;
    let dt = x.dtype();
    let mut y = vec![0f64; n * c * l];
    let mut state = vec![0f64; n * c * (k - 1)];
    let mut padded = vec![0f64; pl];
    for ni in 0..n {
        for ci in 0..c {
            let row = ni * c + ci;
            match &past {
                Some(p) => padded[..k - 1].copy_from_slice(&p[row * (k - 1)..][..k - 1]),
                None => padded[..k - 1].iter_mut().for_each(|v| *v = 0.0),
            }
            padded[k - 1..].copy_from_slice(&xv[row * l..][..l]);
            let wr = &wv[ci * k..][..k];
            let b = bias.as_ref().map(|b| b[ci]).unwrap_or(0.0);
            for t in 0..l {
                let s: f64 = wr.iter().zip(&padded[t..t + k]).map(|(a, b)| a * b).sum();
                y[row * l + t] = s + b;
            }
            state[row * (k - 1)..][..k - 1].copy_from_slice(&padded[pl - (k - 1)..]);
        }
    }
    let mut ya = ArrayD::from_shape_vec(IxDyn(&[n, c, l]), y).expect("sized");
    if silu {
        // The reference rounds the convolution to the input dtype first.
        let r = Tensor::from_f64(dt, ya, false);
        ya = f64s(&r)?.mapv(|v| v / (1.0 + (-v).exp()));
    }
    outs(vec![
        Tensor::from_f64(dt, ya, false),
        Tensor::from_f64(
            dt,
            ArrayD::from_shape_vec(IxDyn(&[n, c, k - 1]), state).expect("sized"),
            false,
        ),
    ])
}

// ---------------------------------------------------------------------------------------
// Lowering to kernel IR: direct loop nests (output position x kernel window), with the
// padding bounds checked by `If` statements. Sums are accumulated in f64 (float convs)
// or i64 (integer convs).

mod lower {
    use super::{conv_shapes, group_attr, positive, window};
    use crate::ir::OpResult;
    use crate::kir::build::*;
    use crate::kir::{BinOp, CmpOp, Expr, Kernel, MathFn, Stmt, Ty, UnOp, VarId};
    use crate::ops::lowering::{index, lit, strides, Act, EpStep, Epilogue, LowerCtx, TensorRef};
    use crate::ops::{Lowering, Registry};
    use crate::{bail, ensure};

    fn int(x: i64) -> Expr {
        Expr::Int(x)
    }
    fn set(var: VarId, e: Expr) -> Stmt {
        Stmt::Set { var, value: e }
    }
    /// Row-major flat index of coordinate expressions over `ext`.
    fn flat(coords: &[Expr], ext: &[usize]) -> Expr {
        let st = strides(ext);
        let mut e: Option<Expr> = None;
        for (c, &s) in coords.iter().zip(&st) {
            let t = if s == 1 {
                c.clone()
            } else {
                mul(c.clone(), int(s as i64))
            };
            e = Some(match e {
                None => t,
                Some(x) => add(x, t),
            });
        }
        e.unwrap_or(int(0))
    }
    /// `0 <= c < ext` for every dim (U8).
    fn inside(coords: &[Expr], ext: &[usize]) -> Expr {
        let mut e = lit(1.0, Ty::U8);
        for (c, &n) in coords.iter().zip(ext) {
            e = and(e, cmp(CmpOp::Ge, c.clone(), int(0)));
            e = and(e, cmp(CmpOp::Lt, c.clone(), int(n as i64)));
        }
        e
    }

    #[derive(Clone, Copy, PartialEq)]
    enum Mode {
        Float,
        Integer,
        QLinear,
    }

    /// Loads a per-channel (or scalar) parameter at channel `oc`.
    fn per_ch(t: &TensorRef, oc: Expr) -> Expr {
        if t.len() == 1 {
            Expr::load(t.buf, int(0))
        } else {
            Expr::load(t.buf, oc)
        }
    }

    fn conv_lower(lw: &mut LowerCtx, mode: Mode) -> OpResult<()> {
        let (xi, wi) = match mode {
            Mode::QLinear => (0, 3),
            _ => (0, 1),
        };
        let x = lw.input(xi)?.clone();
        let w = lw.input(wi)?.clone();
        let out = lw.outputs[0].clone();
        let xt = x.ty().compute();
        if mode == Mode::Float {
            ensure!(xt.is_float() && w.ty().compute().is_float(), "Conv of {xt}");
        } else {
            ensure!(
                !xt.is_float() && !w.ty().compute().is_float(),
                "integer convolution of {xt}"
            );
        }
        let group = group_attr(lw.op)?;
        let (n, m, cg, k) = conv_shapes(lw.op, &x.shape, &w.shape, group)?;
        let win = window(lw.op, &x.shape[2..], &k, false)?;
        let (kk, s, d, pb, in_sp, out_sp) = (&k, &win.s, &win.d, &win.pb, &win.in_sp, &win.out);
        let g = crate::lower::gemm::ConvGeom {
            group,
            k: kk,
            s,
            d,
            pb,
            in_sp,
            out_sp,
        };
        if lw.max_pool_2x2 {
            // Pooled output: only the Winograd lowering pools (it clears the flag); no
            // kernel otherwise (the fused node then lowers the pool apart).
            if mode == Mode::Float {
                crate::lower::gemm::conv(lw, &g)?;
            }
            return Ok(());
        }
        // Pixels in lanes pay only as 16-lane loops: on a Zen 3 (AVX2) SqueezeNet's stem
        // took 6.3 ms as f32x4 loops and 0.96 as im2col and the AVX2 GEMM.
        if mode == Mode::Float
            && group == 1
            && !lw.narrow_loops
            && std::env::var_os("ONNXC_NO_FEW_CHANNELS").is_none()
            && conv_few_channels(lw, &x, &w, &win)?
        {
            return Ok(());
        }
        // The GEMM lowerings: f32 convs, and integer ones on the 8-bit GEMM.
        let gemm = match mode {
            Mode::Float => crate::lower::gemm::conv(lw, &g)?,
            Mode::Integer => crate::lower::gemm::conv_int8(lw, &g)?,
            Mode::QLinear => false,
        };
        if gemm {
            return Ok(());
        }
        if mode == Mode::Float
            && group > 1
            && std::env::var_os("ONNXC_NO_DW_LANES").is_none()
            && dw_lanes(lw, &x, &w, group, &win)?
        {
            return Ok(());
        }
        if mode == Mode::Float && group > 1 && dw_flat(lw, &x, &w, group, &win)? {
            return Ok(());
        }
        if mode == Mode::Float && group > 1 && dw_rows(lw, &x, &w, group, &win)? {
            return Ok(());
        }
        if mode == Mode::Float && group > 1 && conv_rows(lw, &x, &w, group, &win)? {
            return Ok(());
        }
        let c = x.shape[1];
        let mg = m / group;
        let kl = win.kernel_len();
        let il = win.in_len();
        let acc_t = if mode == Mode::Float {
            Ty::F64
        } else {
            Ty::I64
        };
        let load_acc = |e: Expr| Expr::cast(acc_t, e);
        let bias = match mode {
            Mode::Float => lw.opt_input(2).cloned(),
            Mode::QLinear => lw.opt_input(8).cloned(),
            Mode::Integer => None,
        };
        let (xzp, wzp) = match mode {
            Mode::Float => (None, None),
            Mode::Integer => (lw.opt_input(2).cloned(), lw.opt_input(3).cloned()),
            Mode::QLinear => (lw.opt_input(2).cloned(), lw.opt_input(5).cloned()),
        };
        if let Some(z) = &xzp {
            ensure!(z.len() == 1, "x_zero_point must be a scalar");
        }
        if let Some(z) = &wzp {
            ensure!(z.len() == 1 || z.len() == m, "bad w_zero_point");
        }
        let mut k_ = lw.kernel("");
        let kr = &mut k_;
        let nv = kr.var(Ty::I64);
        let gv = kr.var(Ty::I64);
        let mv = kr.var(Ty::I64);
        let ov: Vec<VarId> = win.out.iter().map(|_| kr.var(Ty::I64)).collect();
        let civ = kr.var(Ty::I64);
        let kv: Vec<VarId> = k.iter().map(|_| kr.var(Ty::I64)).collect();
        let acc = kr.var(acc_t);
        let oc = add(mul(v(gv), int(mg as i64)), v(mv));
        let coords: Vec<Expr> = (0..k.len())
            .map(|i| {
                add(
                    sub(mul(v(ov[i]), int(win.s[i] as i64)), int(win.pb[i])),
                    mul(v(kv[i]), int(win.d[i] as i64)),
                )
            })
            .collect();
        let ch = add(mul(v(gv), int(cg as i64)), v(civ));
        let xidx = add(
            mul(add(mul(v(nv), int(c as i64)), ch), int(il as i64)),
            flat(&coords, &win.in_sp),
        );
        let kflat = index(&kv, &strides(&k));
        let widx = add(
            mul(add(mul(oc.clone(), int(cg as i64)), v(civ)), int(kl as i64)),
            kflat,
        );
        let mut xval = load_acc(Expr::load(x.buf, xidx));
        if let Some(z) = &xzp {
            xval = sub(xval, load_acc(Expr::load(z.buf, int(0))));
        }
        let mut wval = load_acc(Expr::load(w.buf, widx));
        if let Some(z) = &wzp {
            wval = sub(wval, load_acc(per_ch(z, oc.clone())));
        }
        let inner = vec![iff(
            inside(&coords, &win.in_sp),
            vec![set(acc, add(v(acc), mul(xval, wval)))],
        )];
        let mut window_loops: Vec<(VarId, usize)> = vec![(civ, cg)];
        window_loops.extend(kv.iter().copied().zip(k.iter().copied()));
        let init = match &bias {
            Some(b) => load_acc(per_ch(b, oc.clone())),
            None => lit(0.0, acc_t),
        };
        let ot = out.ty().compute();
        // Fused elementwise work (float convolutions only), applied before the store.
        let epilogue = match mode {
            Mode::Float => lw.epilogue.take(),
            _ => None,
        };
        let mut oshape = vec![n, m];
        oshape.extend_from_slice(&win.out);
        // Output index with oc in place of the channel var.
        let ost = strides(&oshape);
        let oidx = add(
            add(
                mul(v(nv), int(ost[0] as i64)),
                mul(oc.clone(), int(ost[1] as i64)),
            ),
            index(&ov, &ost[2..]),
        );
        let value = match mode {
            Mode::Float => match &epilogue {
                Some(ep) => ep.apply_flat(Expr::cast(ot, v(acc)), ot, oidx.clone(), &out.shape),
                None => Expr::cast(ot, v(acc)),
            },
            Mode::Integer => Expr::cast(ot, v(acc)),
            Mode::QLinear => {
                let xs = lw.input(1)?.clone();
                let ws = lw.input(4)?.clone();
                let ys = lw.input(6)?.clone();
                ensure!(
                    xs.len() == 1 && ys.len() == 1,
                    "x_scale and y_scale must be scalars"
                );
                ensure!(ws.len() == 1 || ws.len() == m, "bad w_scale");
                let f = |e: Expr| Expr::cast(Ty::F64, e);
                let scale = Expr::bin(
                    BinOp::Div,
                    mul(f(Expr::load(xs.buf, int(0))), f(per_ch(&ws, oc.clone()))),
                    f(Expr::load(ys.buf, int(0))),
                );
                let mut q = mul(f(v(acc)), scale);
                if let Some(z) = lw.opt_input(7) {
                    ensure!(z.len() == 1, "y_zero_point must be a scalar");
                    q = add(q, f(Expr::load(z.buf, int(0))));
                }
                let (lo, hi) = match ot {
                    Ty::U8 => (0.0, 255.0),
                    Ty::I8 => (-128.0, 127.0),
                    Ty::U16 => (0.0, 65535.0),
                    Ty::I16 => (-32768.0, 32767.0),
                    t => bail!("QLinearConv output of {t} is not compiled"),
                };
                let q = Expr::bin(
                    BinOp::Min,
                    Expr::bin(BinOp::Max, q, Expr::f(lo, Ty::F64)),
                    Expr::f(hi, Ty::F64),
                );
                Expr::cast(ot, Expr::cast(Ty::I64, Expr::un(UnOp::Nearest, q)))
            }
        };
        let mut body = vec![set(acc, init)];
        body.extend(loops(&window_loops, inner));
        body.push(Stmt::Store {
            buf: out.buf,
            index: oidx,
            value,
        });
        let mut outer: Vec<(VarId, usize)> = vec![(nv, n), (gv, group), (mv, mg)];
        outer.extend(ov.iter().copied().zip(win.out.iter().copied()));
        k_.body = loops(&outer, body);
        lw.push(k_);
        Ok(())
    }

    /// A depthwise lowering's epilogue with a trailing Relu / Clip taken off: that clamp
    /// is applied by compare-and-select on a local (cheaper vector code than min/max;
    /// NaN stays NaN), the steps before it as usual.
    struct ClampEpilogue {
        rest: Option<Epilogue>,
        clamp: Option<(f64, Option<f64>)>,
    }

    impl ClampEpilogue {
        fn take(lw: &mut LowerCtx) -> ClampEpilogue {
            let mut rest = lw.epilogue.take();
            let clamp = match rest.as_ref().and_then(|e| e.steps.last()) {
                Some(EpStep::Act(Act::Relu)) => Some((0.0, None)),
                Some(EpStep::Act(Act::Clip(lo, hi))) => Some((*lo, Some(*hi))),
                _ => None,
            };
            if clamp.is_some() {
                if let Some(ep) = rest.as_mut() {
                    ep.steps.pop();
                }
            }
            ClampEpilogue {
                rest: rest.filter(|e| !e.is_empty()),
                clamp,
            }
        }

        /// Statements storing `sum` through the epilogue at `out[oidx]` (a fresh local
        /// for the clamp, private to the loop the statements go in).
        fn store(&self, k: &mut Kernel, sum: Expr, out: &TensorRef, oidx: Expr) -> Vec<Stmt> {
            let value = match &self.rest {
                Some(ep) => ep.apply_flat(sum, Ty::F32, oidx.clone(), &out.shape),
                None => sum,
            };
            let mut st = Vec::new();
            let value = match self.clamp {
                None => value,
                Some((lo, hi)) => {
                    let t = k.var(Ty::F32);
                    st.push(set(t, value));
                    let lo = lit(lo, Ty::F32);
                    st.push(set(t, sel(cmp(CmpOp::Lt, v(t), lo.clone()), lo, v(t))));
                    if let Some(hi) = hi {
                        let hi = lit(hi, Ty::F32);
                        st.push(set(t, sel(cmp(CmpOp::Gt, v(t), hi.clone()), hi, v(t))));
                    }
                    v(t)
                }
            };
            st.push(store(out.buf, oidx, value));
            st
        }
    }

    /// What every depthwise lowering needs: a 2-D f32 conv (bias too) with one input
    /// channel per group, a window of at most [`DW_TAPS`] taps, no empty dim.
    fn dw_fits(
        x: &TensorRef,
        w: &TensorRef,
        out: &TensorRef,
        bias: Option<&TensorRef>,
        group: usize,
        win: &super::Window,
    ) -> bool {
        win.k.len() == 2
            && x.ty() == Ty::F32
            && w.ty() == Ty::F32
            && out.ty() == Ty::F32
            && bias.is_none_or(|b| b.ty() == Ty::F32)
            && win.kernel_len() <= DW_TAPS
            && !win.out.contains(&0)
            && !win.in_sp.contains(&0)
            && x.shape[1] == group
            && out.shape[1].is_multiple_of(group)
    }

    /// Channels per block of `dw_lanes`: one AVX-512 vector of f32.
    const DW_LANES: usize = 16;
    /// Largest padded input plane `dw_lanes` transposes per block (bytes) for windows of
    /// up to 3x3 (stride 1 onto 7x7: 5 KiB). Larger planes measured faster with pixels
    /// in the lanes (`dw_flat`), since the AVX-512 loops keep its nine weights in
    /// registers: a 144-channel 56x56 layer alone 0.205 -> 0.167 ms. This was 28x28
    /// (64 KiB) until `dw_flat` aligned its rows and computed two rows per iteration;
    /// then a 192-channel 28x28 layer alone took 0.059 ms in `dw_lanes` and 0.043 in
    /// `dw_flat`, and with 28x28 and 14x14 planes in `dw_flat` MobileNetV2 ran -3.8% on
    /// one thread and -5% on two, EfficientNet-B0 -2% on one (A/B, min of 6). Stride-2
    /// layers onto 7x7 transpose a 15x15 plane (14 KiB): these stay here too (see
    /// [`DW_LANES_MAX_OUT_PIXELS`]).
    const DW_LANES_MAX_PAD_BYTES: usize = 16 << 10;
    /// Most output pixels of a plane that `dw_lanes` takes for windows of up to 3x3: 7x7
    /// (and 8x8), whatever the stride. A 576-channel stride-2 layer from 14x14 onto 7x7
    /// took 0.050 ms in `dw_flat`, whose per-plane loops are short for 7-pixel rows, and
    /// 0.018 ms here (ONNX Runtime 0.035); a stride-1 14x14 layer (a 16x16 padded plane,
    /// 16 KiB) stays faster in `dw_flat`.
    const DW_LANES_MAX_OUT_PIXELS: usize = 64;
    /// The same for larger windows, whose weights do not all stay in registers (a
    /// 144-channel 5x5 stride-2 layer on 56x56: 0.168 ms in `dw_lanes`, 0.194 in
    /// `dw_flat`); beyond, the block's scratch leaves L2.
    const DW_LANES_MAX_PAD_BYTES_WIDE: usize = 256 << 10;
    /// Most output pixels `dw_lanes` computes per vector iteration (accumulators,
    /// inputs and one kernel row's weights stay within the 32 vector registers).
    const DW_LANES_PX: usize = 7;

    /// 2-D depthwise f32 convolution with the channels in the vector lanes, for planes up
    /// to 56x56 (a 7x7 row fills 7 of a vector's 16 lanes, a 14x14 row 14). Per block
    /// of [`DW_LANES`] channels: the input planes are transposed into zero-padded
    /// scratch `pad[hp][wp][lane]` (16x16 register transposes on AVX-512), each output
    /// pixel is one vector of the block's channels (bias, a multiply-add per tap with the
    /// weights prepacked at compile time as `[block][tap][lane]`, the epilogue), up to
    /// [`DW_LANES_PX`] pixels of a row per iteration, stored into `t[pixel][lane]`, and
    /// `t` is transposed into the output planes. The blocks share out into parts of
    /// consecutive blocks (`kir::build::per_part`), each part in its own scratch slot, so
    /// that the parts may run in parallel. Returns false (nothing
    /// lowered) when it does not fit: not depthwise, channels not a multiple of the
    /// block, a padded plane over [`DW_LANES_MAX_PAD_BYTES`] or an output plane over
    /// [`DW_LANES_MAX_OUT_PIXELS`] (windows over 3x3: a padded plane over
    /// [`DW_LANES_MAX_PAD_BYTES_WIDE`]), weights not constant, negative pads.
    fn dw_lanes(
        lw: &mut LowerCtx,
        x: &TensorRef,
        w: &TensorRef,
        group: usize,
        win: &super::Window,
    ) -> OpResult<bool> {
        let out = lw.outputs[0].clone();
        let bias = lw.opt_input(2).cloned();
        let lb = DW_LANES;
        if !dw_fits(x, w, &out, bias.as_ref(), group, win) || win.pb.iter().any(|&p| p < 0) {
            return Ok(false);
        }
        let (n, c, m) = (x.shape[0], x.shape[1], out.shape[1]);
        if m != c || !c.is_multiple_of(lb) {
            return Ok(false);
        }
        let taps = win.kernel_len();
        let Some(wvals) = w.value.as_ref().and_then(|t| t.to_f64()) else {
            return Ok(false);
        };
        let wvals: Vec<f64> = wvals.iter().copied().collect();
        if wvals.len() != c * taps {
            return Ok(false);
        }
        let (kh_n, kw_n) = (win.k[0], win.k[1]);
        let (oh_n, ow_n) = (win.out[0], win.out[1]);
        let (ih, iw) = (win.in_sp[0], win.in_sp[1]);
        let (sh, sw) = (win.s[0], win.s[1]);
        let (dh, dw) = (win.d[0], win.d[1]);
        let (ph, pw) = (win.pb[0] as usize, win.pb[1] as usize);
        let hp = ((oh_n - 1) * sh + (kh_n - 1) * dh + 1).max(ih + ph);
        let wp = ((ow_n - 1) * sw + (kw_n - 1) * dw + 1).max(iw + pw);
        let (pad_len, t_len) = (hp * wp * lb, oh_n * ow_n * lb);
        let fits = if taps > 9 {
            4 * pad_len <= DW_LANES_MAX_PAD_BYTES_WIDE
        } else {
            4 * pad_len <= DW_LANES_MAX_PAD_BYTES && oh_n * ow_n <= DW_LANES_MAX_OUT_PIXELS
        };
        if !fits {
            return Ok(false);
        }
        // Weights [block][tap][lane].
        let blocks = c / lb;
        let mut data = Vec::with_capacity(4 * c * taps);
        for b in 0..blocks {
            for t in 0..taps {
                for l in 0..lb {
                    data.extend_from_slice(&(wvals[(b * lb + l) * taps + t] as f32).to_le_bytes());
                }
            }
        }
        let wpk = lw.program.add_buffer(
            format!("{}/wlanes", lw.name),
            crate::kir::BufKind::Const { data },
            Ty::F32,
            (c * taps) as u64,
        );
        let slot_len = pad_len + t_len;
        let most = DW_FLAT_SLOTS.max(DW_FLAT_SLOT_BYTES / (4 * slot_len));
        // Part `pv` runs blocks `pv * per ..` in slot `pv`, one parallel task each.
        let per = crate::kir::build::per_part(blocks, most);
        let slots = blocks.div_ceil(per);
        let pad = lw.program.add_buffer(
            format!("{}/pad", lw.name),
            crate::kir::BufKind::Arena { offset: 0 },
            Ty::F32,
            (slots * pad_len) as u64,
        );
        let tb = lw.program.add_buffer(
            format!("{}/t", lw.name),
            crate::kir::BufKind::Arena { offset: 0 },
            Ty::F32,
            (slots * t_len) as u64,
        );
        let ep = lw.epilogue.take().filter(|e| !e.is_empty());
        let mut k_ = lw.kernel("");
        let kr = &mut k_;
        let (nv, g, slot, zv) = (
            kr.var(Ty::I64),
            kr.var(Ty::I64),
            kr.var(Ty::I64),
            kr.var(Ty::I64),
        );
        let (rv, qv, lv) = (kr.var(Ty::I64), kr.var(Ty::I64), kr.var(Ty::I64));
        let (c0, sb, tsb) = (kr.var(Ty::I64), kr.var(Ty::I64), kr.var(Ty::I64));
        let mut body = vec![
            set(c0, lin(vec![(v(slot), per * lb), (v(g), lb)])),
            set(sb, lin(vec![(v(slot), pad_len)])),
            set(tsb, lin(vec![(v(slot), t_len)])),
        ];
        // The input planes of the block, transposed into the padded scratch.
        let src = lin(vec![
            (v(nv), c * ih * iw),
            (v(c0), ih * iw),
            (v(lv), ih * iw),
            (v(rv), iw),
            (v(qv), 1),
        ]);
        let dst = lin(vec![
            (v(sb), 1),
            (v(rv), wp * lb),
            (v(qv), lb),
            (int(((ph * wp + pw) * lb) as i64), 1),
            (v(lv), 1),
        ]);
        body.extend(loops(
            &[(rv, ih), (qv, iw), (lv, lb)],
            vec![store(pad, dst, Expr::load(x.buf, src))],
        ));
        // Every output pixel: one vector of the block's channels, `px` pixels of a row
        // at a time: each weight vector is loaded once for them and each input vector
        // once per kernel row (fewer loads than multiply-adds), the accumulators
        // updated tap by tap so that few values are live at once.
        let px = divisor_at_most(ow_n, DW_LANES_PX);
        let gv = k_.var(Ty::I64);
        let accs: Vec<VarId> = (0..px).map(|_| k_.var(Ty::F32)).collect();
        let key = lin(vec![
            (v(sb), 1),
            (v(rv), sh * wp * lb),
            (v(gv), px * sw * lb),
            (v(lv), 1),
        ]);
        let wkey = lin(vec![
            (v(slot), per * taps * lb),
            (v(g), taps * lb),
            (v(lv), 1),
        ]);
        let init = match &bias {
            Some(b) => per_ch(b, add(v(c0), v(lv))),
            None => lit(0.0, Ty::F32),
        };
        let mut inner: Vec<Stmt> = accs.iter().map(|&a| set(a, init.clone())).collect();
        for kh in 0..kh_n {
            for kw in 0..kw_n {
                let t = kh * kw_n + kw;
                let wt = Expr::load(wpk, add(wkey.clone(), int((t * lb) as i64)));
                for (j, &a) in accs.iter().enumerate() {
                    let off = (kh * dh * wp + j * sw + kw * dw) * lb;
                    let xi = add(key.clone(), int(off as i64));
                    inner.push(set(a, add(v(a), mul(Expr::load(pad, xi), wt.clone()))));
                }
            }
        }
        for (j, &a) in accs.iter().enumerate() {
            let q = lin(vec![(v(gv), px), (int(j as i64), 1)]);
            let coords = [v(nv), add(v(c0), v(lv)), v(rv), q.clone()];
            let value = match &ep {
                Some(e) => e.apply_at(v(a), Ty::F32, &coords, &out.shape),
                None => v(a),
            };
            let ti = lin(vec![(v(tsb), 1), (v(rv), ow_n * lb), (q, lb), (v(lv), 1)]);
            inner.push(store(tb, ti, value));
        }
        body.extend(loops(&[(rv, oh_n), (gv, ow_n / px), (lv, lb)], inner));
        // The block's output planes from `t`.
        let ol = oh_n * ow_n;
        let oi = lin(vec![(v(nv), c * ol), (v(c0), ol), (v(lv), ol), (v(qv), 1)]);
        let ts = lin(vec![(v(tsb), 1), (v(qv), lb), (v(lv), 1)]);
        body.extend(loops(
            &[(lv, lb), (qv, ol)],
            vec![store(out.buf, oi, Expr::load(tb, ts))],
        ));
        // The last part's missing blocks skipped.
        if !blocks.is_multiple_of(per) {
            let bi = lin(vec![(v(slot), per), (v(g), 1)]);
            body = vec![iff(Expr::cmp(CmpOp::Lt, bi, int(blocks as i64)), body)];
        }
        // Per slot, before its blocks: the border the transposes do not write zeroed
        // (rows above, each row's right and the next one's left border as one run, the
        // rest), on the thread that runs the slot's blocks. (Zeroing every slot whole
        // first was 128 KiB per 14x14 layer, a loop of its own.)
        let gr = k_.var(Ty::I64);
        let zero = |from: usize, len: usize, row: Option<VarId>| {
            let mut at = vec![(v(slot), pad_len), (int(from as i64), 1), (v(zv), 1)];
            if let Some(r) = row {
                at.push((v(r), wp * lb));
            }
            for_(zv, len, vec![store(pad, lin(at), lit(0.0, Ty::F32))])
        };
        let first = (ph * wp + pw) * lb;
        let after = |r: usize| ((ph + r) * wp + pw + iw) * lb;
        let mut sbody = Vec::new();
        if first > 0 {
            sbody.push(zero(0, first, None));
        }
        if ih > 1 && wp > iw {
            sbody.push(for_(
                gr,
                ih - 1,
                vec![zero(after(0), (wp - iw) * lb, Some(gr))],
            ));
        }
        if pad_len > after(ih - 1) {
            sbody.push(zero(after(ih - 1), pad_len - after(ih - 1), None));
        }
        sbody.push(for_(g, per, body));
        k_.body = loops(&[(nv, n), (slot, slots)], sbody);
        lw.push(k_);
        Ok(true)
    }

    /// Most phase planes (`sh * sw`) `dw_flat` splits an input plane into.
    const DW_FLAT_PHASES: i64 = 16;
    /// Most scratch slots (parts of groups, see `dw_flat`) of `dw_flat` and `dw_lanes`:
    /// scratch per group for
    /// a whole layer outgrows the caches (a 96-channel 112x112 layer measured 14% slower
    /// than the row-by-row lowering with it).
    const DW_FLAT_SLOTS: usize = 8;
    /// Scratch bytes that small planes may fill with more slots than [`DW_FLAT_SLOTS`]:
    /// the parts are the loop threads share, and 8 groups of a 7x7 plane were too
    /// little work to hand out (EfficientNet-B0's 7x7 layers ran on one thread).
    const DW_FLAT_SLOT_BYTES: usize = 128 << 10;

    /// Narrowest phase planes (elements per row) that [`Phases`] aligns.
    const ALIGN_MIN_WIDTH: i64 = 32;

    /// The zero-padded phase planes through which a strided window reads at unit stride
    /// (`dw_flat`, `conv_few_channels`): plane `(r % sh) * sw + q % sw` holds the padded
    /// input's rows `r` and columns `q` of its phase, `wp` to a row, so that tap `(kh,
    /// kw)` of output `(oh, ow)` is element `oh * wp + ow + off` of plane `phase`
    /// ([`Phases::tap`]). Planes are `plane` elements apart (16-element aligned, large
    /// enough for the furthest tap).
    struct Phases {
        sh: i64,
        sw: i64,
        dh: i64,
        dw: i64,
        wp: i64,
        plane: i64,
        /// Per phase, where its plane starts in its `plane` elements: wide planes are
        /// shifted so that each copied row starts on a 16-element boundary.
        shift: Vec<i64>,
    }

    /// One phase's copy: input rows `r0 + sh * i` (`nr` of them) and columns `c0 + sw *
    /// j` (`nq`) go to rows `a + i` and columns `b + j` of plane `phase` (none when `nr`
    /// or `nq` is not positive).
    struct PhaseCopy {
        phase: i64,
        r0: i64,
        nr: i64,
        a: i64,
        c0: i64,
        nq: i64,
        b: i64,
    }

    impl Phases {
        /// None for negative pads or planes too large.
        fn of(win: &super::Window) -> Option<Phases> {
            let (kh_n, kw_n) = (win.k[0] as i64, win.k[1] as i64);
            let (oh_n, ow_n) = (win.out[0] as i64, win.out[1] as i64);
            let (ih, iw) = (win.in_sp[0] as i64, win.in_sp[1] as i64);
            let (sh, sw) = (win.s[0] as i64, win.s[1] as i64);
            let (ph, pw) = (win.pb[0], win.pb[1]);
            let (dh, dw) = (win.d[0] as i64, win.d[1] as i64);
            // Padded extent: every row/column a tap reads, and every input one placed.
            let hp = ((oh_n - 1) * sh + (kh_n - 1) * dh + 1).max(ih + ph);
            let wpad = ((ow_n - 1) * sw + (kw_n - 1) * dw + 1).max(iw + pw);
            let (hq, mut wp) = ((hp + sh - 1) / sh, (wpad + sw - 1) / sw);
            if ph < 0 || pw < 0 || oh_n * wp > 1 << 24 {
                return None;
            }
            // Rows of whole vectors apart, and every phase's first copied element on a
            // vector boundary: the copies' stores are then aligned (a 57-wide plane's
            // stores crossed cache lines, and the copies cost more than the window's
            // multiply-adds).
            let aligned = wp >= ALIGN_MIN_WIDTH;
            if aligned {
                wp = (wp + 15) / 16 * 16;
            }
            let mut p = Phases {
                sh,
                sw,
                dh,
                dw,
                wp,
                plane: 0,
                shift: vec![0; (sh * sw) as usize],
            };
            if aligned {
                for pc in p.copies(win) {
                    p.shift[pc.phase as usize] = (16 - (pc.a * wp + pc.b) % 16) % 16;
                }
            }
            let max_off = (0..kh_n)
                .flat_map(|kh| (0..kw_n).map(move |kw| (kh, kw)))
                .map(|(kh, kw)| p.tap(kh, kw).1)
                .max()
                .unwrap_or(0);
            let most_shift = p.shift.iter().copied().max().unwrap_or(0);
            p.plane = ((oh_n * wp + max_off).max(hq * wp + most_shift) + 15) / 16 * 16;
            Some(p)
        }

        /// Element `(row, col)` of plane `phase`, from the first plane's start.
        fn at(&self, phase: i64, row: i64, col: i64) -> i64 {
            phase * self.plane + self.shift[phase as usize] + row * self.wp + col
        }

        /// Tap `(kh, kw)`: its phase plane and its offset in it (from the start of the
        /// plane's `plane` elements).
        fn tap(&self, kh: i64, kw: i64) -> (i64, i64) {
            let (r, cq) = (kh * self.dh, kw * self.dw);
            let phase = (r % self.sh) * self.sw + cq % self.sw;
            (
                phase,
                self.shift[phase as usize] + (r / self.sh) * self.wp + cq / self.sw,
            )
        }

        /// Statements zeroing what of the phase planes at `base` (elements of `buf`) the
        /// copies leave unwritten: per phase the rows above and left of the first run,
        /// each run's right border with the next one's left as one run (a loop over
        /// `rv`), the rest of the plane; a plane no input reaches whole. (Zeroing all
        /// of the planes first wrote them twice.)
        fn zero_unwritten(
            &self,
            win: &super::Window,
            (buf, base): (crate::kir::BufId, &Expr),
            zv: VarId,
            rv: VarId,
        ) -> Vec<Stmt> {
            let (wp, plane) = (self.wp, self.plane);
            let zero = |at: Expr, len: i64| {
                for_(
                    zv,
                    len as usize,
                    vec![store(
                        buf,
                        add(add(base.clone(), at), v(zv)),
                        lit(0.0, Ty::F32),
                    )],
                )
            };
            let mut out = Vec::new();
            for pc in self.copies(win) {
                let at = pc.phase * plane;
                if pc.nr <= 0 || pc.nq <= 0 {
                    out.push(zero(int(at), plane));
                    continue;
                }
                let (a, b, nr, nq) = (pc.a, pc.b, pc.nr, pc.nq);
                let first = self.at(pc.phase, a, b) - at;
                if first > 0 {
                    out.push(zero(int(at), first));
                }
                if nr > 1 && wp > nq {
                    let gap = add(int(at + first + nq), mul(v(rv), int(wp)));
                    out.push(for_(rv, (nr - 1) as usize, vec![zero(gap, wp - nq)]));
                }
                let end = self.at(pc.phase, a + nr - 1, b + nq) - at;
                out.push(zero(int(at + end), plane - end));
            }
            out
        }

        /// Every phase's copy of the window's input plane.
        fn copies(&self, win: &super::Window) -> Vec<PhaseCopy> {
            let (ih, iw) = (win.in_sp[0] as i64, win.in_sp[1] as i64);
            let (ph, pw) = (win.pb[0], win.pb[1]);
            let (sh, sw) = (self.sh, self.sw);
            let mut v = Vec::new();
            for rh in 0..sh {
                // Input rows r with (r + ph) % sh == rh: r = r' sh + r0, padded row r' + a.
                let r0 = (rh - ph).rem_euclid(sh);
                for rw in 0..sw {
                    let c0 = (rw - pw).rem_euclid(sw);
                    v.push(PhaseCopy {
                        phase: rh * sw + rw,
                        r0,
                        nr: (ih - r0 + sh - 1) / sh,
                        a: (r0 + ph) / sh,
                        c0,
                        nq: (iw - c0 + sw - 1) / sw,
                        b: (c0 + pw) / sw,
                    });
                }
            }
            v
        }
    }

    /// 2-D depthwise f32 convolution over whole planes: each input plane is copied into
    /// zero-padded scratch, split into its `sh x sw` row and column phases, so that every
    /// tap of output `(oh, ow)` reads `phase[oh * wp + ow + const]` (`wp`: the phase
    /// planes' width). Each output row is then one unit-stride loop with no borders and
    /// no bounds tests, written straight to the output with the whole epilogue (the
    /// back ends take the rows as one vector loop; an earlier version computed the
    /// padding columns too, over one flat loop per plane, and copied the rows out:
    /// MobileNetV2 5% slower). The groups share out into parts of consecutive groups
    /// (`kir::build::per_part`, at most [`DW_FLAT_SLOTS`] or what fits
    /// [`DW_FLAT_SLOT_BYTES`]), each part in its own scratch slot: the scratch stays in
    /// cache from one group to the next, and the parts may run in parallel. On large
    /// planes the parts are bands of output rows instead, every group in each
    /// ([`Bands`]). Returns false (nothing lowered) when it does not fit.
    fn dw_flat(
        lw: &mut LowerCtx,
        x: &TensorRef,
        w: &TensorRef,
        group: usize,
        win: &super::Window,
    ) -> OpResult<bool> {
        let out = lw.outputs[0].clone();
        let bias = lw.opt_input(2).cloned();
        if !dw_fits(x, w, &out, bias.as_ref(), group, win)
            || (win.s[0] * win.s[1]) as i64 > DW_FLAT_PHASES
        {
            return Ok(false);
        }
        let (n, m) = (x.shape[0], out.shape[1]);
        let mg = m / group;
        let (kh_n, kw_n) = (win.k[0] as i64, win.k[1] as i64);
        let (oh_n, ow_n) = (win.out[0] as i64, win.out[1] as i64);
        let (ih, iw) = (win.in_sp[0] as i64, win.in_sp[1] as i64);
        let (sh, sw) = (win.s[0] as i64, win.s[1] as i64);
        let Some(phs) = Phases::of(win) else {
            return Ok(false);
        };
        let (wp, plane) = (phs.wp, phs.plane);
        let phases = sh * sw;
        let gplane = phases * plane;
        // Groups in parts of consecutive groups, one slot each, up to the slot count
        // (more for small planes, within DW_FLAT_SLOT_BYTES); or bands of output rows,
        // every group in each (see `Bands`).
        let bands = Bands::of(win);
        let (per, slots) = match &bands {
            Some(_) => (group, DW_BANDS),
            None => {
                let most = DW_FLAT_SLOTS.max(DW_FLAT_SLOT_BYTES / (4 * gplane.max(1) as usize));
                let per = crate::kir::build::per_part(group, most);
                (per, group.div_ceil(per))
            }
        };
        let scratch = lw.program.add_buffer(
            format!("{}/planes", lw.name),
            crate::kir::BufKind::Arena { offset: 0 },
            Ty::F32,
            (slots as i64 * gplane) as u64,
        );
        let epilogue = ClampEpilogue::take(lw);
        let mut k_ = lw.kernel("");
        let kr = &mut k_;
        let nv = kr.var(Ty::I64);
        let gi = kr.var(Ty::I64);
        let slot = kr.var(Ty::I64);
        let mv = kr.var(Ty::I64);
        let (rv, qv, zv) = (kr.var(Ty::I64), kr.var(Ty::I64), kr.var(Ty::I64));
        let (xb, sb, ob) = (kr.var(Ty::I64), kr.var(Ty::I64), kr.var(Ty::I64));
        let bv = kr.var(Ty::F32);
        let wv: Vec<VarId> = (0..kh_n * kw_n).map(|_| kr.var(Ty::F32)).collect();
        // The group: slot * per + gi (with bands, gi).
        let gv = match bands {
            Some(_) => v(gi),
            None => add(mul(v(slot), int(per as i64)), v(gi)),
        };
        let ng = add(mul(v(nv), int(group as i64)), gv.clone());
        // Per group: place the input plane in its slot's phase planes (their borders are
        // zeroed once per slot: the copies write only the same interior positions).
        let mut gbody = vec![
            set(xb, mul(ng, int(ih * iw))),
            set(sb, mul(v(slot), int(gplane))),
        ];
        // Phases whose runs are as long and as many share one loop over the rows, so
        // that the input plane is read once, in order: four passes over a 112x112 plane
        // read each row twice, every other row at a time, and the two passes that met a
        // row first waited on memory (a 96-channel stride-2 layer alone 0.250 -> 0.202
        // ms).
        // With bands, (d, n) of each copy (`Bands::rows_of`), and the phase row
        // `slot * rows + d + rv` that band row `rv` of the copy reads.
        type Run = (PhaseCopy, Option<(i64, i64)>, Vec<Stmt>);
        let mut runs: Vec<Run> = Vec::new();
        let band_row = |rows: i64, d: i64| add(mul(v(slot), int(rows)), add(v(rv), int(d)));
        for pc in phs.copies(win) {
            if pc.nr <= 0 || pc.nq <= 0 {
                continue;
            }
            let dn = bands.as_ref().map(|b| b.rows_of(&pc));
            // Phase row `i` of the copy's rows goes to padded row `a + i`; with bands,
            // the band's rows `d + rv` (i = slot * rows + d + rv) to padded row
            // `a + d + rv`.
            let (row0, prow) = match (&bands, dn) {
                (Some(b), Some((d, _))) => (pc.a + d, band_row(b.rows, d)),
                _ => (pc.a, v(rv)),
            };
            let dst = add(
                add(v(sb), int(phs.at(pc.phase, row0, pc.b))),
                add(mul(v(rv), int(wp)), v(qv)),
            );
            let src = add(
                add(v(xb), int(pc.r0 * iw + pc.c0)),
                add(mul(prow, int(sh * iw)), mul(v(qv), int(sw))),
            );
            let st = store(scratch, dst, Expr::load(x.buf, src));
            match runs.last_mut() {
                Some((first, fdn, body)) if (first.nr, first.nq, *fdn) == (pc.nr, pc.nq, dn) => {
                    body.push(st)
                }
                _ => runs.push((pc, dn, vec![st])),
            }
        }
        for (pc, dn, body) in runs {
            match (&bands, dn) {
                (Some(b), Some((d, n))) => {
                    // Rows outside the input (the padding of the first and last bands)
                    // are zeroed instead.
                    let i = band_row(b.rows, d);
                    let inside = and(
                        cmp(CmpOp::Ge, i.clone(), int(0)),
                        cmp(CmpOp::Lt, i, int(pc.nr)),
                    );
                    let zeros: Vec<Stmt> = body
                        .iter()
                        .map(|st| match st {
                            Stmt::Store { buf, index, .. } => {
                                store(*buf, index.clone(), lit(0.0, Ty::F32))
                            }
                            st => st.clone(),
                        })
                        .collect();
                    gbody.push(for_(
                        rv,
                        n as usize,
                        vec![Stmt::If {
                            cond: inside,
                            then: vec![for_(qv, pc.nq as usize, body)],
                            els: vec![for_(qv, pc.nq as usize, zeros)],
                        }],
                    ));
                }
                _ => gbody.push(for_(
                    rv,
                    pc.nr as usize,
                    vec![for_(qv, pc.nq as usize, body)],
                )),
            }
        }
        // Per output channel: weights and bias in variables, then the output rows.
        let oc = add(mul(gv.clone(), int(mg as i64)), v(mv));
        let noc = add(mul(v(nv), int(m as i64)), oc.clone());
        let mut cbody = vec![set(ob, mul(noc, int(oh_n * ow_n)))];
        for (t, &var) in wv.iter().enumerate() {
            let wi = add(mul(oc.clone(), int(kh_n * kw_n)), int(t as i64));
            cbody.push(set(var, Expr::load(w.buf, wi)));
        }
        cbody.push(set(
            bv,
            match &bias {
                Some(b) => per_ch(b, oc.clone()),
                None => lit(0.0, Ty::F32),
            },
        ));
        // Output (rv, qv) reads the phase planes at i = rv * wp + qv.
        let iv_at = add(mul(v(rv), int(wp)), v(qv));
        // One multiply-add chain per kernel row (the bias starts the first), the rows
        // summed as a tree: a 5x5 window waits on 6 + 3 latencies instead of 25.
        let rows: Vec<Expr> = (0..kh_n)
            .filter_map(|kh| {
                let taps = (0..kw_n).map(|kw| {
                    let (ph_i, off) = phs.tap(kh, kw);
                    let xi = add(add(v(sb), iv_at.clone()), int(ph_i * plane + off));
                    mul(Expr::load(scratch, xi), v(wv[(kh * kw_n + kw) as usize]))
                });
                (kh == 0).then(|| v(bv)).into_iter().chain(taps).reduce(add)
            })
            .collect();
        let sum = sum_tree(rows).unwrap_or_else(|| v(bv));
        // DW_FLAT_ROWS output rows per iteration, every sum into a local before any
        // store: the rows share input rows, which the back end then loads once (a 3x3
        // window 6 loads per output vector instead of 9). The rows left over alone.
        // With bands, row r of the band is output row `slot * rows + r` and reads the
        // padded rows from r (the band's rows sit `slot * rows` higher in the planes).
        let (nrows, band0) = match &bands {
            Some(b) => (b.rows, mul(v(slot), int(b.rows))),
            None => (oh_n, int(0)),
        };
        let at_row = |r: Expr| sum.subst(rv, &r);
        let oidx = |r: Expr| add(add(v(ob), mul(add(band0.clone(), r), int(ow_n))), v(qv));
        let rr = DW_FLAT_ROWS;
        let groups = nrows / rr;
        if groups > 0 {
            let rows_g: Vec<Expr> = (0..rr).map(|i| add(mul(v(rv), int(rr)), int(i))).collect();
            let sums: Vec<VarId> = (0..rr).map(|_| k_.var(Ty::F32)).collect();
            let mut st: Vec<Stmt> = (0..rr as usize)
                .map(|i| set(sums[i], at_row(rows_g[i].clone())))
                .collect();
            for i in 0..rr as usize {
                st.extend(epilogue.store(&mut k_, v(sums[i]), &out, oidx(rows_g[i].clone())));
            }
            cbody.push(for_(rv, groups as usize, vec![for_(qv, ow_n as usize, st)]));
        }
        for r in groups * rr..nrows {
            let last = int(r);
            let st = epilogue.store(&mut k_, at_row(last.clone()), &out, oidx(last));
            cbody.push(for_(qv, ow_n as usize, st));
        }
        gbody.extend(loops(&[(mv, mg)], cbody));
        // The last part's missing groups skipped.
        if !group.is_multiple_of(per) {
            gbody = vec![iff(Expr::cmp(CmpOp::Lt, gv, int(group as i64)), gbody)];
        }
        // Per slot, before its groups: what of its phase planes no copy writes is
        // zeroed, on the thread that runs the slot's groups.
        let zr = k_.var(Ty::I64);
        let mut sbody = phs.zero_unwritten(win, (scratch, &mul(v(slot), int(gplane))), zv, zr);
        sbody.push(for_(gi, per, gbody));
        k_.body = loops(&[(nv, n), (slot, slots)], sbody);
        k_.bands = bands.map(|b| crate::kir::Bands {
            buf: out.buf,
            image: nv,
            band: slot,
            images: n as u64,
            rows: m as u64,
            cols: (oh_n * ow_n) as u64,
            width: (b.rows * ow_n) as u64,
        });
        lw.push(k_);
        Ok(true)
    }

    /// [`dw_flat`]'s parts as bands of output rows, every group in each, instead of
    /// parts of groups: a depthwise layer split by channels left each core half of the
    /// channels of every pixel, and the 1x1 conv after it, split by pixels, read half of
    /// its input from the other core's cache. By bands, a core writes all channels of
    /// the pixels the next layer's task on that core reads (the pool gives each thread
    /// the same run of tasks in every job). Each band copies its input rows (and the
    /// rows around them its windows reach) into its slot's phase planes, shifted so that
    /// band row r reads padded rows from r. The kernel records its bands
    /// ([`crate::kir::Bands`]): a 1x1 conv after it then runs inside each band
    /// (`lower::bands`), on the pixels the band has just written.
    struct Bands {
        /// Output rows per band ([`DW_BANDS`] bands).
        rows: i64,
        sh: i64,
        ph: i64,
        kh: i64,
    }

    impl Bands {
        /// [`DW_BANDS`] bands when they divide the output rows and each band reads at
        /// least [`DW_BAND_MIN_PIXELS`] of each input plane (`ONNXC_NO_DW_BANDS=1`:
        /// never).
        fn of(win: &super::Window) -> Option<Bands> {
            let oh = win.out[0] as i64;
            let rows = oh / DW_BANDS as i64;
            (oh % DW_BANDS as i64 == 0
                && rows * win.s[0] as i64 * win.in_sp[1] as i64 >= DW_BAND_MIN_PIXELS
                && std::env::var_os("ONNXC_NO_DW_BANDS").is_none())
            .then(|| Bands {
                rows,
                sh: win.s[0] as i64,
                ph: win.pb[0],
                kh: (win.k[0] as i64 - 1) * win.d[0] as i64 + 1,
            })
        }

        /// The phase rows of copy `pc` band `p` reads: `p * rows + d ..` for `n` rows
        /// (the same `d` and `n` for every band; rows outside `0..pc.nr` are padding).
        fn rows_of(&self, pc: &PhaseCopy) -> (i64, i64) {
            // Input rows of the band's windows: from (p rows) sh - ph to
            // ((p + 1) rows - 1) sh - ph + kh - 1; phase rows i have input row r0 + i sh.
            let lo = -self.ph - pc.r0;
            let hi = (self.rows - 1) * self.sh - self.ph + self.kh - 1 - pc.r0;
            let d = lo.div_euclid(self.sh) + i64::from(lo.rem_euclid(self.sh) != 0);
            (d, hi.div_euclid(self.sh) + 1 - d)
        }
    }

    /// Bands of [`Bands`]: two per thread on two threads, so that a core that finishes
    /// first can take one of the other's when that core is slow.
    const DW_BANDS: usize = 4;
    /// Fewest input pixels a band of one plane reads (rows times stride times width,
    /// halo rows not counted) for [`Bands`]: the layers on 112x112 planes (3136). Each
    /// (group, band) pays for its weights, its copies' row loops, the halo rows and
    /// shorter row loops: on two threads MobileNetV2's 28x28 layers (bands of 7 rows)
    /// went 40-49 -> 70-87 us, its and EfficientNet-B0's stride-1 56x56 ones (784)
    /// 208 -> 236 and 332 -> 372 us summed over tasks, the 112x112 ones 232 -> 168
    /// (stride 1), 400 -> 352 (stride 2) and 312 -> 264 (with SiLU).
    const DW_BAND_MIN_PIXELS: i64 = 1568;

    /// Output rows per iteration of `dw_flat`'s row loop. Loads were its limit (nine per
    /// output vector for a 3x3 window, six of them across a cache line), not the
    /// multiply-adds: a 96-channel 56x56 layer alone 0.103 -> 0.078 ms with two rows,
    /// 0.074 with four; MobileNetV2 -4.3% and EfficientNet-B0 -2% on one thread with
    /// two, the same within noise with four (A/B, min of 6).
    const DW_FLAT_ROWS: i64 = 2;

    /// Most taps (`c * kh * kw`) of a group-1 conv [`conv_few_channels`] takes: an RGB
    /// stem's 27 (3x3 on 3 channels).
    const FEW_MAX_TAPS: usize = 32;
    /// Most input channels for [`conv_few_channels`], whose windows are wider than one
    /// pixel: 1x1 convs on 16 or 32 channels went there too, at 0.167 ms instead of the
    /// GEMM's 0.117 (32 -> 16 on 112x112), which copied no input and keeps 24
    /// accumulators.
    const FEW_MAX_CHANNELS: usize = 4;
    /// Fewest output pixels for [`conv_few_channels`]. On large planes the im2col's short
    /// runs (rows cut at every 32-pixel panel edge, stride-2 gathers) cost more than the
    /// GEMM of depth 27 they feed. An MNIST-sized first conv (1 -> 16 channels, 28x28)
    /// takes the same time either way on one thread (3.9 us), but here its rows are a
    /// loop two threads share, where the im2col's GEMM stayed on one: the small CNN 27.0
    /// -> 25.3 us on two threads (min of 5, interleaved).
    const FEW_MIN_PIXELS: usize = 1 << 9;
    /// Most phase planes (`sh * sw`) for [`conv_few_channels`].
    const FEW_MAX_PHASES: i64 = 4;
    /// Most parts [`conv_few_channels`] cuts its output rows into (the tasks threads
    /// share).
    const FEW_ROW_PARTS: i64 = 8;
    /// Fewest rows in a part of [`conv_few_channels`] (when there are two or more).
    const FEW_PART_ROWS: i64 = 16;

    /// Parts and rows per part (the last may have fewer) for [`conv_few_channels`]'s
    /// `oh` output rows: an even count where there are two (two threads then take the
    /// same share), as many as have [`FEW_PART_ROWS`] rows each.
    fn few_row_parts(oh: i64) -> (i64, i64) {
        let per = |p: i64| (oh + p - 1) / p;
        (1..=FEW_ROW_PARTS)
            .rev()
            .filter(|&p| p == 1 || p % 2 == 0)
            .find(|&p| per(p) >= FEW_PART_ROWS && per(p) * (p - 1) < oh)
            .map_or((1, oh), |p| (p, per(p)))
    }

    /// A group-1 2-D f32 conv on very few input channels over a large plane (an image
    /// model's stem: 3 -> 32 channels, 3x3, stride 2, on 224x224), computed directly
    /// with pixels in lanes instead of through im2col and a GEMM of depth 27. The output
    /// rows share out into parts (the loop threads share). Each part copies the input
    /// rows its windows reach into its own band of zero-padded phase planes, laid out
    /// as [`dw_flat`]'s ([`Phases`]), then per block of up to 8 output channels and row,
    /// one unit-stride loop over the row loads each of the `c * kh * kw` taps once for
    /// the block's accumulators (weights broadcast from memory) and stores through the
    /// whole epilogue; the band stays in L2 across the blocks. EfficientNet-B0's stem
    /// 0.50 -> 0.42 ms on one thread (MobileNetV2's, with a clamp, 0.32 -> 0.30), against
    /// im2col and a GEMM. Returns false (nothing lowered) when it does not fit.
    fn conv_few_channels(
        lw: &mut LowerCtx,
        x: &TensorRef,
        w: &TensorRef,
        win: &super::Window,
    ) -> OpResult<bool> {
        let out = lw.outputs[0].clone();
        let bias = lw.opt_input(2).cloned();
        if win.k.len() != 2
            || [x.ty(), w.ty(), out.ty()].iter().any(|&t| t != Ty::F32)
            || bias.as_ref().is_some_and(|b| b.ty() != Ty::F32)
            || win.out.contains(&0)
            || win.in_sp.contains(&0)
        {
            return Ok(false);
        }
        let (n, c, m) = (x.shape[0], x.shape[1], out.shape[1]);
        let (kh_n, kw_n) = (win.k[0] as i64, win.k[1] as i64);
        let (oh_n, ow_n) = (win.out[0] as i64, win.out[1] as i64);
        let (ih, iw) = (win.in_sp[0] as i64, win.in_sp[1] as i64);
        let (sh, sw) = (win.s[0] as i64, win.s[1] as i64);
        let taps = c * (kh_n * kw_n) as usize;
        if w.shape[1] != c
            || c > FEW_MAX_CHANNELS
            || kh_n * kw_n == 1
            || taps > FEW_MAX_TAPS
            || ((oh_n * ow_n) as usize) < FEW_MIN_PIXELS
            || sh * sw > FEW_MAX_PHASES
        {
            return Ok(false);
        }
        let Some(phs) = Phases::of(win) else {
            return Ok(false);
        };
        let wp = phs.wp;
        // Per part of the output rows (the loop threads share), its own band of every
        // phase plane: the plane rows its taps reach, `brows` of them (band row `i` is
        // plane row `p * per + i`), copied from the input or zeroed by the part itself.
        // (The planes were whole, copied by four jobs of their own with their borders
        // zeroed on the calling thread: on two threads, EfficientNet-B0's stem spent
        // about 18 us serial and 4 dispatches on them.)
        let (parts, per) = few_row_parts(oh_n);
        // (The last kernel row reaches furthest: `Phases::tap`'s row offset kh dh / sh.)
        let brows = per + (kh_n - 1) * win.d[0] as i64 / sh;
        let most_shift = phs.shift.iter().copied().max().unwrap_or(0);
        // (One row more: the last row's right border runs on into it.)
        let bplane = ((brows + 1) * wp + most_shift + 15) / 16 * 16;
        let cplane = sh * sw * bplane;
        let slot = c as i64 * cplane;
        let scratch = lw.program.add_buffer(
            format!("{}/planes", lw.name),
            crate::kir::BufKind::Arena { offset: 0 },
            Ty::F32,
            (parts * slot) as u64,
        );
        let epilogue = ClampEpilogue::take(lw);
        let mut k_ = lw.kernel("");
        let kr = &mut k_;
        let (nv, mv, pv) = (kr.var(Ty::I64), kr.var(Ty::I64), kr.var(Ty::I64));
        let (rv, qv, ob) = (kr.var(Ty::I64), kr.var(Ty::I64), kr.var(Ty::I64));
        let (cv, iv, jv, xb) = (
            kr.var(Ty::I64),
            kr.var(Ty::I64),
            kr.var(Ty::I64),
            kr.var(Ty::I64),
        );
        // The part's band, per input channel and phase copy: each band row holds the
        // input's phase row it stands for (zeros above and below the input), the
        // columns left and right of the copied run zero.
        let mut band = vec![set(
            xb,
            mul(add(mul(v(nv), int(c as i64)), v(cv)), int(ih * iw)),
        )];
        for pc in phs.copies(win) {
            let PhaseCopy {
                phase,
                r0,
                nr,
                a,
                c0,
                nq,
                b,
            } = pc;
            // Column `from + jv` of band row `row`.
            let at = |row: Expr, from: i64| {
                add(
                    add(mul(v(pv), int(slot)), mul(v(cv), int(cplane))),
                    add(
                        int(phase * bplane + phs.shift[phase as usize] + from),
                        add(mul(row, int(wp)), v(jv)),
                    ),
                )
            };
            let zero = |row: Expr, from: i64, len: i64| {
                for_(
                    jv,
                    len as usize,
                    vec![store(scratch, at(row, from), lit(0.0, Ty::F32))],
                )
            };
            let mut row_body = Vec::new();
            if nr <= 0 || nq <= 0 {
                row_body.push(zero(v(iv), 0, wp));
            } else {
                // Band row iv is phase row p * per + iv - a of the input.
                let ii = add(add(mul(v(pv), int(per)), v(iv)), int(-a));
                let src = add(
                    add(v(xb), int(r0 * iw + c0)),
                    add(mul(ii.clone(), int(sh * iw)), mul(v(jv), int(sw))),
                );
                let inside = and(
                    cmp(CmpOp::Ge, ii.clone(), int(0)),
                    cmp(CmpOp::Lt, ii, int(nr)),
                );
                row_body.push(Stmt::If {
                    cond: inside,
                    then: vec![for_(
                        jv,
                        nq as usize,
                        vec![store(scratch, at(v(iv), b), Expr::load(x.buf, src))],
                    )],
                    els: vec![zero(v(iv), b, nq)],
                });
                // The row's right border and the next row's left one, as one run.
                if wp > nq {
                    row_body.push(zero(v(iv), b + nq, wp - nq));
                }
                // The first row's left border.
                if b > 0 {
                    band.push(zero(int(0), 0, b));
                }
            }
            band.push(for_(iv, brows as usize, row_body));
        }
        // Per block of `cb` output channels and row of the part, one loop over the row:
        // per tap one load, shared by the block's `cb` accumulators (their weights
        // broadcast from memory), then the epilogue and `cb` stores. A block's rows in a
        // part are one call of the wide loop, its weights (uniforms) set up once per
        // call, not per row as when rows were the outer loop: that setup was 13% of a
        // 3 -> 64 stem's time (111x111 out, 0.39 -> 0.32 ms on one thread).
        let cb = [8, 4, 2, 1].into_iter().find(|&b| m % b == 0).unwrap_or(1);
        let last = oh_n - per * (parts - 1);
        let ol = oh_n * ow_n;
        let rows_loop = |kr: &mut crate::kir::Kernel, nrows: i64| -> Stmt {
            let acc: Vec<VarId> = (0..cb).map(|_| kr.var(Ty::F32)).collect();
            let xt = kr.var(Ty::F32);
            let co0 = mul(v(mv), int(cb as i64));
            let row = add(mul(v(pv), int(per)), v(rv));
            let mut inner: Vec<Stmt> = acc
                .iter()
                .enumerate()
                .map(|(j, &a)| {
                    let co = add(co0.clone(), int(j as i64));
                    set(
                        a,
                        match &bias {
                            Some(b) => per_ch(b, co),
                            None => lit(0.0, Ty::F32),
                        },
                    )
                })
                .collect();
            // Band row rv (plane row p * per + rv) of the part's slot.
            let iv_at = add(mul(v(pv), int(slot)), add(mul(v(rv), int(wp)), v(qv)));
            for ci in 0..c as i64 {
                for kh in 0..kh_n {
                    for kw in 0..kw_n {
                        let (ph_i, off) = phs.tap(kh, kw);
                        let xi = add(iv_at.clone(), int(ci * cplane + ph_i * bplane + off));
                        inner.push(set(xt, Expr::load(scratch, xi)));
                        let t = (ci * kh_n + kh) * kw_n + kw;
                        for (j, &a) in acc.iter().enumerate() {
                            let wi = add(
                                mul(co0.clone(), int(taps as i64)),
                                int(j as i64 * taps as i64 + t),
                            );
                            inner.push(set(a, add(v(a), mul(v(xt), Expr::load(w.buf, wi)))));
                        }
                    }
                }
            }
            for (j, &a) in acc.iter().enumerate() {
                let oi = add(
                    add(v(ob), int(j as i64 * ol)),
                    add(mul(row.clone(), int(ow_n)), v(qv)),
                );
                inner.extend(epilogue.store(kr, v(a), &out, oi));
            }
            for_(rv, nrows as usize, vec![for_(qv, ow_n as usize, inner)])
        };
        let full = rows_loop(&mut k_, per);
        let mut blk = vec![set(
            ob,
            mul(
                add(mul(v(nv), int(m as i64)), mul(v(mv), int(cb as i64))),
                int(ol),
            ),
        )];
        if last == per {
            blk.push(full);
        } else {
            // The last part is shorter.
            let short = rows_loop(&mut k_, last);
            blk.push(Stmt::If {
                cond: Expr::cmp(CmpOp::Lt, v(pv), int(parts - 1)),
                then: vec![full],
                els: vec![short],
            });
        }
        let part = vec![for_(cv, c, band), for_(mv, m / cb, blk)];
        k_.body = loops(&[(nv, n), (pv, parts as usize)], part);
        lw.push(k_);
        Ok(true)
    }

    /// Largest kernel window (taps) `dw_rows` keeps in registers.
    const DW_TAPS: usize = 64;
    /// Most output rows `dw_rows` emits one by one (border rows).
    const DW_EDGE_ROWS: usize = 16;
    /// Largest column stride `dw_rows` deinterleaves.
    const DW_MAX_STRIDE: usize = 4;

    /// 2-D depthwise f32 convolution (one input channel per group): every output element
    /// is computed in one expression (bias, every kernel tap inside the input, epilogue)
    /// and stored once, so the innermost loop over an output row segment is a chain of
    /// unit-stride loads times loop-invariant weights (held in variables) that the back
    /// end vectorises. The taps valid in each row segment and each border row are known
    /// at compile time (no bounds tests). With a column stride s > 1, each input plane
    /// is first split into its s column phases (scratch), so the taps still load at unit
    /// stride. Returns false (nothing lowered) when the shapes or types do not fit.
    fn dw_rows(
        lw: &mut LowerCtx,
        x: &TensorRef,
        w: &TensorRef,
        group: usize,
        win: &super::Window,
    ) -> OpResult<bool> {
        let out = lw.outputs[0].clone();
        let bias = lw.opt_input(2).cloned();
        if !dw_fits(x, w, &out, bias.as_ref(), group, win) || win.s[1] > DW_MAX_STRIDE {
            return Ok(false);
        }
        let (n, c, m) = (x.shape[0], x.shape[1], out.shape[1]);
        let mg = m / group;
        let (kh_n, kw_n) = (win.k[0], win.k[1]);
        let (oh_n, ow_n) = (win.out[0] as i64, win.out[1] as i64);
        let (ih, iw) = (win.in_sp[0] as i64, win.in_sp[1] as i64);
        let (sh, sw) = (win.s[0] as i64, win.s[1] as i64);
        let (dh, dw) = (win.d[0] as i64, win.d[1] as i64);
        let (ph, pw) = (win.pb[0], win.pb[1]);
        // Kernel rows valid for output row `oh`: 0 <= oh * sh - ph + kh * dh < ih.
        let rows_ok = |oh: i64| -> Vec<i64> {
            (0..kh_n as i64)
                .filter(|&kh| (0..ih).contains(&(oh * sh - ph + kh * dh)))
                .collect()
        };
        let all: Vec<i64> = (0..kh_n as i64).collect();
        let full: Vec<bool> = (0..oh_n).map(|oh| rows_ok(oh) == all).collect();
        // The interior rows: the longest run of rows seeing every kernel row.
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
        if ((oh_n - (hi - lo)) as usize) > DW_EDGE_ROWS {
            return Ok(false);
        }
        // Output columns [lo, hi) where kernel column kw reads inside the input.
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
        // The input as the taps read it: x itself, or the column phases of one plane
        // (phase r holds columns r, r + s, ...; `lp` elements per row).
        let lp = (iw + sw - 1) / sw;
        let phases = if sw > 1 {
            Some(lw.program.add_buffer(
                format!("{}/phases", lw.name),
                crate::kir::BufKind::Arena { offset: 0 },
                Ty::F32,
                (sw * ih * lp) as u64,
            ))
        } else {
            None
        };
        let epilogue = ClampEpilogue::take(lw);
        let mut k_ = lw.kernel("");
        let kr = &mut k_;
        let nv = kr.var(Ty::I64);
        let gv = kr.var(Ty::I64);
        let mv = kr.var(Ty::I64);
        let xb = kr.var(Ty::I64);
        let ob = kr.var(Ty::I64);
        let ohv = kr.var(Ty::I64);
        let rb = kr.var(Ty::I64);
        let orb = kr.var(Ty::I64);
        let j = kr.var(Ty::I64);
        let (iv, qv) = (kr.var(Ty::I64), kr.var(Ty::I64));
        let bv = kr.var(Ty::F32);
        let wv: Vec<VarId> = (0..kh_n * kw_n).map(|_| kr.var(Ty::F32)).collect();
        let oc = add(mul(v(gv), int(mg as i64)), v(mv));
        // Per group: the input plane's base, and its phases.
        let mut gbody = vec![set(
            xb,
            mul(add(mul(v(nv), int(c as i64)), v(gv)), int(ih * iw)),
        )];
        let (src, rstride) = match phases {
            Some(pbuf) => {
                for r in 0..sw {
                    let len = (iw - r + sw - 1) / sw;
                    if len <= 0 {
                        continue;
                    }
                    let dst = add(add(int(r * ih * lp), mul(v(iv), int(lp))), v(qv));
                    let srci = add(
                        add(v(xb), mul(v(iv), int(iw))),
                        add(mul(v(qv), int(sw)), int(r)),
                    );
                    gbody.push(for_(
                        iv,
                        ih as usize,
                        vec![for_(
                            qv,
                            len as usize,
                            vec![store(pbuf, dst, Expr::load(x.buf, srci))],
                        )],
                    ));
                }
                (pbuf, lp)
            }
            None => (x.buf, iw),
        };
        // Per output channel: weights and bias in variables, the output plane's base.
        let mut cbody = vec![set(
            ob,
            mul(add(mul(v(nv), int(m as i64)), oc.clone()), int(oh_n * ow_n)),
        )];
        for (t, &var) in wv.iter().enumerate() {
            let wi = add(mul(oc.clone(), int((kh_n * kw_n) as i64)), int(t as i64));
            cbody.push(set(var, Expr::load(w.buf, wi)));
        }
        cbody.push(set(
            bv,
            match &bias {
                Some(b) => per_ch(b, oc.clone()),
                None => lit(0.0, Ty::F32),
            },
        ));
        // One output row (`oh` its index; `rb`, `orb` set for it) seeing kernel rows `khs`.
        let mut row = |oh: Expr, khs: &[i64]| -> Vec<Stmt> {
            let base = match phases {
                Some(_) => int(0),
                None => v(xb),
            };
            let mut b = vec![
                set(
                    rb,
                    add(
                        base,
                        mul(sub(mul(oh.clone(), int(sh)), int(ph)), int(rstride)),
                    ),
                ),
                set(orb, add(v(ob), mul(oh, int(ow_n)))),
            ];
            for seg in cuts.windows(2) {
                let (a, e) = (seg[0], seg[1]);
                if e <= a {
                    continue;
                }
                let mut sum = v(bv);
                for &kh in khs {
                    for kw in 0..kw_n as i64 {
                        let (clo, chi) = range(kw);
                        if !(clo <= a && e <= chi) {
                            continue;
                        }
                        // Input column (ow + t) * s + r.
                        let off = kw * dw - pw;
                        let (t, r) = (off.div_euclid(sw), off.rem_euclid(sw));
                        let cst =
                            r * ih * lp * i64::from(phases.is_some()) + kh * dh * rstride + a + t;
                        let xi = add(add(v(rb), v(j)), int(cst));
                        let wt = v(wv[(kh as usize) * kw_n + kw as usize]);
                        sum = add(sum, mul(Expr::load(src, xi), wt));
                    }
                }
                let oidx = add(add(v(orb), v(j)), int(a));
                let st = epilogue.store(&mut k_, sum, &out, oidx);
                b.push(for_(j, (e - a) as usize, st));
            }
            b
        };
        for oh in 0..lo {
            cbody.extend(row(int(oh), &rows_ok(oh)));
        }
        if hi > lo {
            cbody.push(for_(
                ohv,
                (hi - lo) as usize,
                row(add(v(ohv), int(lo)), &all),
            ));
        }
        for oh in hi..oh_n {
            cbody.extend(row(int(oh), &rows_ok(oh)));
        }
        gbody.extend(loops(&[(mv, mg)], cbody));
        k_.body = loops(&[(nv, n), (gv, group)], gbody);
        lw.push(k_);
        Ok(true)
    }

    /// Longest kernel row `conv_rows` unrolls.
    const ROW_UNROLL: usize = 16;

    /// Grouped (depthwise) f32 convolution accumulated along output rows: for each
    /// output row, the row is set to the bias, then every input channel of the group and
    /// every kernel position but the last dim's adds its products to the whole row, and
    /// the epilogue is applied in a last pass. The last kernel dim is unrolled, so the
    /// valid part of each row is known at compile time (no bounds test in the innermost
    /// loop) and the innermost loop stores at unit stride (the back end vectorises it).
    /// Returns false (nothing lowered) when the shapes or types do not fit.
    fn conv_rows(
        lw: &mut LowerCtx,
        x: &TensorRef,
        w: &TensorRef,
        group: usize,
        win: &super::Window,
    ) -> OpResult<bool> {
        let out = lw.outputs[0].clone();
        let bias = lw.opt_input(2).cloned();
        let nsp = win.k.len();
        if nsp == 0
            || x.ty() != Ty::F32
            || w.ty() != Ty::F32
            || out.ty() != Ty::F32
            || bias.as_ref().is_some_and(|b| b.ty() != Ty::F32)
            || win.k[nsp - 1] > ROW_UNROLL
            || win.out.contains(&0)
        {
            return Ok(false);
        }
        let (n, c, m) = (x.shape[0], x.shape[1], out.shape[1]);
        let (cg, mg) = (c / group, m / group);
        let last = nsp - 1;
        let (kw_n, ow_n, iw) = (win.k[last], win.out[last], win.in_sp[last] as i64);
        let (s, d, pb) = (win.s[last] as i64, win.d[last] as i64, win.pb[last]);
        // Output positions [lo, hi) of the row where kernel column kw reads inside the
        // input: 0 <= ow * s - pb + kw * d < iw.
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
        let mut k_ = lw.kernel("");
        let kr = &mut k_;
        let nv = kr.var(Ty::I64);
        let gv = kr.var(Ty::I64);
        let mv = kr.var(Ty::I64);
        let ov: Vec<VarId> = (0..last).map(|_| kr.var(Ty::I64)).collect();
        let civ = kr.var(Ty::I64);
        let kv: Vec<VarId> = (0..last).map(|_| kr.var(Ty::I64)).collect();
        let j = kr.var(Ty::I64);
        let oc = add(mul(v(gv), int(mg as i64)), v(mv));
        let ch = add(mul(v(gv), int(cg as i64)), v(civ));
        let ist = strides(&win.in_sp);
        let mut oshape = vec![n, m];
        oshape.extend_from_slice(&win.out);
        let ost = strides(&oshape);
        let kst = strides(&win.k);
        // Leading input coordinates for output position `oh` and kernel position `kh`.
        let coords = |oh: &[Expr], kh: &[Expr]| -> Vec<Expr> {
            (0..last)
                .map(|i| {
                    add(
                        sub(mul(oh[i].clone(), int(win.s[i] as i64)), int(win.pb[i])),
                        mul(kh[i].clone(), int(win.d[i] as i64)),
                    )
                })
                .collect()
        };
        let xrow = |oh: &[Expr], kh: &[Expr]| {
            let mut e = mul(
                add(mul(v(nv), int(c as i64)), ch.clone()),
                int(win.in_len() as i64),
            );
            for (cd, &st) in coords(oh, kh).into_iter().zip(&ist) {
                e = add(e, mul(cd, int(st as i64)));
            }
            e
        };
        let orow = |oh: &[Expr]| {
            let mut e = add(
                mul(v(nv), int(ost[0] as i64)),
                mul(oc.clone(), int(ost[1] as i64)),
            );
            for (i, o) in oh.iter().enumerate() {
                e = add(e, mul(o.clone(), int(ost[2 + i] as i64)));
            }
            e
        };
        let wrow = |kh: &[Expr]| {
            let mut e = mul(
                add(mul(oc.clone(), int(cg as i64)), v(civ)),
                int(win.kernel_len() as i64),
            );
            for (k, &st) in kh.iter().zip(&kst) {
                e = add(e, mul(k.clone(), int(st as i64)));
            }
            e
        };
        let row_loop = |oh: &[Expr], at: i64, len: i64, value: &dyn Fn(Expr, Expr) -> Expr| {
            let ow = add(v(j), int(at));
            let oidx = add(orow(oh), ow.clone());
            for_(
                j,
                len as usize,
                vec![store(out.buf, oidx.clone(), value(ow, oidx))],
            )
        };
        // Row segments between cuts, each seeing a fixed set of kernel columns: adds the
        // products of every kernel position in `khs` (leading dims) to the row.
        let accumulate = |oh: &[Expr], khs: &[Vec<Expr>]| {
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
                acc.push(row_loop(oh, a, b - a, &|ow, oidx| {
                    let mut sum = Expr::load(out.buf, oidx);
                    for kh in khs {
                        let (xr, wr) = (xrow(oh, kh), wrow(kh));
                        for &kw in &cols {
                            let xi =
                                add(xr.clone(), add(mul(ow.clone(), int(s)), int(kw * d - pb)));
                            let wi = add(wr.clone(), int(kw));
                            sum = add(sum, mul(Expr::load(x.buf, xi), Expr::load(w.buf, wi)));
                        }
                    }
                    sum
                }));
            }
            acc
        };
        let init = match &bias {
            Some(b) => per_ch(b, oc.clone()),
            None => lit(0.0, Ty::F32),
        };
        let epilogue = lw.epilogue.take();
        // One output row: start at the bias, accumulate, apply the epilogue. `interior`:
        // every leading kernel position is inside the input (no test; unrolled).
        let row_body = |oh: &[Expr], interior: bool| {
            let mut body = vec![row_loop(oh, 0, ow_n as i64, &|_, _| init.clone())];
            if interior {
                let mut khs: Vec<Vec<Expr>> = vec![vec![]];
                for &kd in &win.k[..last] {
                    khs = khs
                        .into_iter()
                        .flat_map(|p| {
                            (0..kd as i64).map(move |q| {
                                let mut p = p.clone();
                                p.push(int(q));
                                p
                            })
                        })
                        .collect();
                }
                body.extend(loops(&[(civ, cg)], accumulate(oh, &khs)));
            } else {
                let kvs: Vec<Expr> = kv.iter().map(|&k| v(k)).collect();
                let acc = accumulate(oh, std::slice::from_ref(&kvs));
                let inner = if last == 0 {
                    acc
                } else {
                    vec![iff(inside(&coords(oh, &kvs), &win.in_sp[..last]), acc)]
                };
                let mut window_loops: Vec<(VarId, usize)> = vec![(civ, cg)];
                window_loops.extend(kv.iter().copied().zip(win.k[..last].iter().copied()));
                body.extend(loops(&window_loops, inner));
            }
            if let Some(ep) = &epilogue {
                let shape = out.shape.clone();
                body.push(row_loop(oh, 0, ow_n as i64, &|_, oidx| {
                    ep.apply_flat(Expr::load(out.buf, oidx.clone()), Ty::F32, oidx, &shape)
                }));
            }
            body
        };
        let mut outer: Vec<(VarId, usize)> = vec![(nv, n), (gv, group), (mv, mg)];
        let body = if last == 1 && win.k[0] <= ROW_UNROLL {
            // 2-D: rows whose whole window column is inside the input take the unrolled
            // form; the few border rows keep the tested loop.
            let (s0, d0, pb0, ih) = (
                win.s[0] as i64,
                win.d[0] as i64,
                win.pb[0],
                win.in_sp[0] as i64,
            );
            let oh_n = win.out[0] as i64;
            let mut lo_all = 0i64;
            let mut hi_all = oh_n;
            for kh in 0..win.k[0] as i64 {
                let a = pb0 - kh * d0;
                lo_all = lo_all.max(-(-a).div_euclid(s0));
                hi_all = hi_all.min((ih - 1 + pb0 - kh * d0).div_euclid(s0) + 1);
            }
            let hi_all = hi_all.max(lo_all).min(oh_n);
            let lo_all = lo_all.min(hi_all);
            let oh = ov[0];
            let mut b = Vec::new();
            for (from, to, interior) in [
                (0, lo_all, false),
                (lo_all, hi_all, true),
                (hi_all, oh_n, false),
            ] {
                if to > from {
                    let at = [add(v(oh), int(from))];
                    b.push(for_(oh, (to - from) as usize, row_body(&at, interior)));
                }
            }
            b
        } else {
            outer.extend(ov.iter().copied().zip(win.out[..last].iter().copied()));
            let ohs: Vec<Expr> = ov.iter().map(|&o| v(o)).collect();
            row_body(&ohs, false)
        };
        k_.body = loops(&outer, body);
        lw.push(k_);
        Ok(true)
    }

    fn conv(lw: &mut LowerCtx) -> OpResult<()> {
        conv_lower(lw, Mode::Float)
    }
    fn conv_integer(lw: &mut LowerCtx) -> OpResult<()> {
        conv_lower(lw, Mode::Integer)
    }
    fn qlinear_conv(lw: &mut LowerCtx) -> OpResult<()> {
        conv_lower(lw, Mode::QLinear)
    }

    /// A 2-D f32 ConvTranspose of one group as a GEMM and a scatter of its columns
    /// ("col2im"): per image, `cols[(co, kh, kw)][pixel] = sum over ci of w[ci][co][kh][kw]
    /// x[ci][pixel]` (the weights read transposed as A), then the output planes set to
    /// the bias (or zero) and, per output channel and kernel tap, the input pixels whose
    /// output position `(y sh - ph + kh dh, x sw - pw + kw dw)` lies inside added there:
    /// each tap's rows and columns of pixels inside are a range known at compile time, so
    /// the innermost loop is a unit-stride read of `cols` and a read-modify-write of every
    /// `sw`-th output element, which the loops vectorise. The gather form below (every
    /// output element summing its taps through bounds and divisibility tests, in f64) took
    /// 80 ms for a 64 -> 32, 2x2 stride-2 upsampling of 28x28 that ONNX Runtime runs in
    /// 0.13.
    fn conv_transpose_gemm(
        lw: &mut LowerCtx,
        (x, w, bias, out): (&TensorRef, &TensorRef, Option<&TensorRef>, &TensorRef),
        (pb, s, d): (&[i64], &[usize], &[usize]),
    ) -> OpResult<()> {
        let (n, c, m) = (x.shape[0], x.shape[1], out.shape[1]);
        let (kh_n, kw_n) = (w.shape[2], w.shape[3]);
        let (ih, iw) = (x.shape[2] as i64, x.shape[3] as i64);
        let (oh, ow) = (out.shape[2] as i64, out.shape[3] as i64);
        let rows = (m * kh_n * kw_n) as u64;
        let pixels = (ih * iw) as u64;
        let cols = lw.program.add_buffer(
            format!("{}/cols", lw.name),
            crate::kir::BufKind::Arena { offset: 0 },
            Ty::F32,
            rows * pixels,
        );
        let mut k_ = lw.kernel("");
        let (nv, mv, yv, xv, jv) = (
            k_.var(Ty::I64),
            k_.var(Ty::I64),
            k_.var(Ty::I64),
            k_.var(Ty::I64),
            k_.var(Ty::I64),
        );
        let xoff = mul(v(nv), int(c as i64 * ih * iw));
        let gemm = Stmt::Gemm(Box::new(crate::kir::GemmCall {
            m: rows,
            n: pixels,
            k: c as u64,
            a: crate::kir::MatView::strided(w.buf, int(0), 1, rows as i64),
            b: crate::kir::MatView::strided(x.buf, xoff, pixels as i64, 1),
            c: crate::kir::MatView::strided(cols, int(0), pixels as i64, 1),
            alpha: 1.0,
            init: None,
            add: None,
            act: crate::kir::GemmAct::None,
            int8: false,
        }));
        let plane = oh * ow;
        let obase = add(mul(v(nv), int(m as i64 * plane)), mul(v(mv), int(plane)));
        let init = match bias {
            Some(b) => per_ch(b, v(mv)),
            None => lit(0.0, Ty::F32),
        };
        let mut per_channel = vec![for_(
            jv,
            plane as usize,
            vec![store(out.buf, add(obase.clone(), v(jv)), init)],
        )];
        // The input indices `i` of a tap at offset `off` whose output `i s + off` lies in
        // `0..o`: `lo..hi` within `0..len`.
        let range = |off: i64, s: i64, o: i64, len: i64| {
            let lo = (-off).div_euclid(s) + i64::from((-off).rem_euclid(s) != 0);
            let hi = (o - off).div_euclid(s) + i64::from((o - off).rem_euclid(s) != 0);
            (lo.max(0), hi.min(len))
        };
        let (sh, sw) = (s[0] as i64, s[1] as i64);
        for kh in 0..kh_n as i64 {
            let offy = kh * d[0] as i64 - pb[0];
            let (ylo, yhi) = range(offy, sh, oh, ih);
            for kw in 0..kw_n as i64 {
                let offx = kw * d[1] as i64 - pb[1];
                let (xlo, xhi) = range(offx, sw, ow, iw);
                if yhi <= ylo || xhi <= xlo {
                    continue;
                }
                let y = add(v(yv), int(ylo));
                let xx = add(v(xv), int(xlo));
                let oi = add(
                    obase.clone(),
                    add(
                        mul(add(mul(y.clone(), int(sh)), int(offy)), int(ow)),
                        add(mul(xx.clone(), int(sw)), int(offx)),
                    ),
                );
                let row = add(
                    mul(v(mv), int((kh_n * kw_n) as i64)),
                    int(kh * kw_n as i64 + kw),
                );
                let ci = add(mul(row, int(pixels as i64)), add(mul(y, int(iw)), xx));
                let sum = add(Expr::load(out.buf, oi.clone()), Expr::load(cols, ci));
                per_channel.push(for_(
                    yv,
                    (yhi - ylo) as usize,
                    vec![for_(
                        xv,
                        (xhi - xlo) as usize,
                        vec![store(out.buf, oi, sum)],
                    )],
                ));
            }
        }
        let mut body = vec![gemm];
        body.push(for_(mv, m, per_channel));
        k_.body = vec![for_(nv, n, body)];
        lw.push(k_);
        Ok(())
    }

    /// ConvTranspose geometry: (pads at the beginning, output spatial shape, strides,
    /// dilations), following the reference evaluation.
    #[allow(clippy::type_complexity)]
    fn transpose_geometry(
        lw: &LowerCtx,
        in_sp: &[usize],
        k: &[usize],
    ) -> OpResult<(Vec<i64>, Vec<usize>, Vec<usize>, Vec<usize>)> {
        let ctx = lw.op;
        let nsp = k.len();
        let s = positive(&ctx.attrs.ints("strides", &vec![1; nsp])?, "strides", nsp)?;
        let d = positive(
            &ctx.attrs.ints("dilations", &vec![1; nsp])?,
            "dilations",
            nsp,
        )?;
        let op = ctx.attrs.ints("output_padding", &vec![0; nsp])?;
        ensure!(op.len() == nsp, "bad output_padding");
        let pads = ctx.attrs.ints("pads", &vec![0; 2 * nsp])?;
        ensure!(pads.len() == 2 * nsp, "bad pads");
        let auto_pad = ctx.attrs.string("auto_pad", "NOTSET".into())?;
        let same = matches!(auto_pad.as_str(), "SAME_UPPER" | "SAME_LOWER");
        let mut output_shape = ctx.attrs.get_ints("output_shape")?;
        if let Some(os) = &output_shape {
            ensure!(os.len() >= nsp, "bad output_shape");
            output_shape = Some(os[os.len() - nsp..].to_vec());
        }
        if output_shape.is_none() && same {
            output_shape = Some(
                in_sp
                    .iter()
                    .zip(&s)
                    .map(|(&a, &b)| (a * b) as i64)
                    .collect(),
            );
        }
        let mut pb = pads[..nsp].to_vec();
        let pe = pads[nsp..].to_vec();
        let mut out_sp = Vec::with_capacity(nsp);
        for i in 0..nsp {
            let ek = (k[i] as i64 - 1) * d[i] as i64 + 1;
            let full = s[i] as i64 * (in_sp[i] as i64 - 1) + op[i] + ek;
            match &output_shape {
                Some(os) => {
                    let total = full - os[i];
                    let half = total.div_euclid(2);
                    pb[i] = if auto_pad == "SAME_UPPER" {
                        half
                    } else {
                        total - half
                    };
                    out_sp.push(os[i]);
                }
                None => out_sp.push(full - pb[i] - pe[i]),
            }
        }
        ensure!(out_sp.iter().all(|&o| o >= 0), "negative output shape");
        Ok((pb, out_sp.iter().map(|&o| o as usize).collect(), s, d))
    }

    fn conv_transpose(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let w = lw.input(1)?.clone();
        let bias = lw.opt_input(2).cloned();
        let out = lw.outputs[0].clone();
        ensure!(x.ty().compute().is_float(), "ConvTranspose of {}", x.ty());
        let group = group_attr(lw.op)?;
        let (xs, ws) = (&x.shape, &w.shape);
        ensure!(
            xs.len() >= 3 && ws.len() == xs.len(),
            "bad ConvTranspose shapes"
        );
        let (n, c) = (xs[0], xs[1]);
        ensure!(ws[0] == c && c % group == 0, "bad ConvTranspose shapes");
        let cg = c / group;
        let mg = ws[1];
        let m = mg * group;
        let k = ws[2..].to_vec();
        let in_sp = xs[2..].to_vec();
        let (pb, out_sp, s, d) = transpose_geometry(lw, &in_sp, &k)?;
        ensure!(
            out.shape[2..] == out_sp[..] && out.shape[1] == m,
            "ConvTranspose output shape {:?} does not match {out_sp:?}",
            out.shape
        );
        let f32s = [x.ty(), w.ty(), out.ty()].iter().all(|&t| t == Ty::F32)
            && bias.as_ref().is_none_or(|b| b.ty() == Ty::F32);
        if f32s && group == 1 && k.len() == 2 && !out_sp.contains(&0) {
            return conv_transpose_gemm(lw, (&x, &w, bias.as_ref(), &out), (&pb, &s, &d));
        }
        let kl: usize = k.iter().product();
        let pin: usize = in_sp.iter().product();
        let mut k_ = lw.kernel("");
        let kr = &mut k_;
        let nv = kr.var(Ty::I64);
        let gv = kr.var(Ty::I64);
        let mv = kr.var(Ty::I64);
        let ov: Vec<VarId> = out_sp.iter().map(|_| kr.var(Ty::I64)).collect();
        let civ = kr.var(Ty::I64);
        let kv: Vec<VarId> = k.iter().map(|_| kr.var(Ty::I64)).collect();
        let acc = kr.var(Ty::F64);
        let oc = add(mul(v(gv), int(mg as i64)), v(mv));
        let ch = add(mul(v(gv), int(cg as i64)), v(civ));
        let mut cond = lit(1.0, Ty::U8);
        let mut coords = Vec::new();
        for i in 0..k.len() {
            let t = sub(add(v(ov[i]), int(pb[i])), mul(v(kv[i]), int(d[i] as i64)));
            cond = and(cond, cmp(CmpOp::Ge, t.clone(), int(0)));
            let si = s[i] as i64;
            let ci = if si == 1 {
                t.clone()
            } else {
                cond = and(
                    cond,
                    cmp(CmpOp::Eq, Expr::bin(BinOp::Rem, t.clone(), int(si)), int(0)),
                );
                Expr::bin(BinOp::Div, t.clone(), int(si))
            };
            cond = and(cond, cmp(CmpOp::Lt, ci.clone(), int(in_sp[i] as i64)));
            coords.push(ci);
        }
        let f = |e: Expr| Expr::cast(Ty::F64, e);
        let xidx = add(
            mul(add(mul(v(nv), int(c as i64)), ch.clone()), int(pin as i64)),
            flat(&coords, &in_sp),
        );
        let widx = add(
            mul(add(mul(ch, int(mg as i64)), v(mv)), int(kl as i64)),
            index(&kv, &strides(&k)),
        );
        let inner = vec![iff(
            cond,
            vec![set(
                acc,
                add(
                    v(acc),
                    mul(f(Expr::load(x.buf, xidx)), f(Expr::load(w.buf, widx))),
                ),
            )],
        )];
        let mut wl: Vec<(VarId, usize)> = vec![(civ, cg)];
        wl.extend(kv.iter().copied().zip(k.iter().copied()));
        let init = match &bias {
            Some(b) => f(per_ch(b, oc.clone())),
            None => Expr::f(0.0, Ty::F64),
        };
        let mut oshape = vec![n, m];
        oshape.extend_from_slice(&out_sp);
        let ost = strides(&oshape);
        let oidx = add(
            add(mul(v(nv), int(ost[0] as i64)), mul(oc, int(ost[1] as i64))),
            index(&ov, &ost[2..]),
        );
        let mut body = vec![set(acc, init)];
        body.extend(loops(&wl, inner));
        body.push(Stmt::Store {
            buf: out.buf,
            index: oidx,
            value: Expr::cast(out.ty().compute(), v(acc)),
        });
        let mut outer: Vec<(VarId, usize)> = vec![(nv, n), (gv, group), (mv, mg)];
        outer.extend(ov.iter().copied().zip(out_sp.iter().copied()));
        k_.body = loops(&outer, body);
        lw.push(k_);
        Ok(())
    }

    /// CausalConvWithState: a depthwise causal 1-D convolution over `past_state ++ X`;
    /// the optional SiLU is applied to the stored (rounded) convolution, as the reference.
    fn causal_conv(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let w = lw.input(1)?.clone();
        let bias = lw.opt_input(2).cloned();
        let past = lw.opt_input(3).cloned();
        let outs = lw.outputs.clone();
        ensure!(
            x.ty().compute().is_float(),
            "CausalConvWithState of {}",
            x.ty()
        );
        let silu = match lw.op.attrs.string("activation", "none".into())?.as_str() {
            "none" => false,
            "silu" | "swish" => true,
            other => bail!("unsupported activation `{other}`"),
        };
        let (xs, ws) = (&x.shape, &w.shape);
        ensure!(xs.len() == 3, "input must be rank 3");
        ensure!(
            ws.len() == 3 && ws[0] == xs[1] && ws[1] == 1 && ws[2] >= 1,
            "bad weight shape {ws:?}"
        );
        let (n, c, l) = (xs[0], xs[1], xs[2]);
        let kw = ws[2];
        if let Some(p) = &past {
            ensure!(p.shape == [n, c, kw - 1], "bad past_state shape");
        }
        if let Some(b) = &bias {
            ensure!(b.len() == 1 || b.len() == c, "bad bias");
        }
        let km1 = (kw - 1) as i64;
        let mut k_ = lw.kernel("");
        let kr = &mut k_;
        let row = kr.var(Ty::I64);
        let t = kr.var(Ty::I64);
        let j = kr.var(Ty::I64);
        let tmp = kr.var(Ty::F64);
        let acc = kr.var(Ty::F64);
        let f = |e: Expr| Expr::cast(Ty::F64, e);
        // tmp = (past ++ x)[row][q]
        let padded = |q: Expr| -> Stmt {
            let head = match &past {
                Some(p) => f(Expr::load(p.buf, add(mul(v(row), int(km1)), q.clone()))),
                None => Expr::f(0.0, Ty::F64),
            };
            Stmt::If {
                cond: cmp(CmpOp::Lt, q.clone(), int(km1)),
                then: vec![set(tmp, head)],
                els: vec![set(
                    tmp,
                    f(Expr::load(
                        x.buf,
                        add(mul(v(row), int(l as i64)), sub(q, int(km1))),
                    )),
                )],
            }
        };
        let ch = Expr::bin(BinOp::Rem, v(row), int(c as i64));
        let init = match &bias {
            Some(b) => f(per_ch(b, ch.clone())),
            None => Expr::f(0.0, Ty::F64),
        };
        let yi = add(mul(v(row), int(l as i64)), v(t));
        let y = &outs[0];
        let yt = y.ty().compute();
        let mut tbody = vec![set(acc, init)];
        tbody.push(Stmt::For {
            var: j,
            extent: kw as u64,
            body: vec![
                padded(add(v(t), v(j))),
                set(
                    acc,
                    add(
                        v(acc),
                        mul(
                            v(tmp),
                            f(Expr::load(
                                w.buf,
                                add(mul(ch.clone(), int(kw as i64)), v(j)),
                            )),
                        ),
                    ),
                ),
            ],
        });
        tbody.push(Stmt::Store {
            buf: y.buf,
            index: yi.clone(),
            value: Expr::cast(yt, v(acc)),
        });
        if silu {
            let r = Expr::load(y.buf, yi.clone());
            tbody.push(Stmt::Store {
                buf: y.buf,
                index: yi,
                value: Expr::bin(
                    BinOp::Div,
                    r.clone(),
                    add(
                        lit(1.0, yt),
                        Expr::call(MathFn::Exp, vec![Expr::un(UnOp::Neg, r)]),
                    ),
                ),
            });
        }
        let mut body = vec![Stmt::For {
            var: t,
            extent: l as u64,
            body: tbody,
        }];
        if let Some(st) = outs.get(1) {
            body.push(Stmt::For {
                var: j,
                extent: kw as u64 - 1,
                body: vec![
                    padded(add(int(l as i64), v(j))),
                    Stmt::Store {
                        buf: st.buf,
                        index: add(mul(v(row), int(km1)), v(j)),
                        value: Expr::cast(st.ty().compute(), v(tmp)),
                    },
                ],
            });
        }
        k_.body = loops(&[(row, n * c)], body);
        lw.push(k_);
        Ok(())
    }

    /// DeformConv: for every output position, kernel offset and input channel, the input
    /// is sampled by multilinear interpolation at the offset position (runtime offsets),
    /// times the optional mask; sums in f64.
    fn deform_conv(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let w = lw.input(1)?.clone();
        let off = lw.input(2)?.clone();
        let bias = lw.opt_input(3).cloned();
        let mask = lw.opt_input(4).cloned();
        let out = lw.outputs[0].clone();
        ensure!(x.ty().compute().is_float(), "DeformConv of {}", x.ty());
        let group = group_attr(lw.op)?;
        let (n, m, cg, k) = conv_shapes(lw.op, &x.shape, &w.shape, group)?;
        let c = x.shape[1];
        let nsp = k.len();
        let og = lw.op.attrs.int("offset_group", 1)?;
        ensure!(og >= 1 && c % og as usize == 0, "bad offset_group {og}");
        let og = og as usize;
        let cpo = c / og;
        let win = window(lw.op, &x.shape[2..], &k, false)?;
        let kl = win.kernel_len();
        let pl = win.out_len();
        let il = win.in_len();
        let mg = m / group;
        let mut want = vec![n, og * kl * nsp];
        want.extend_from_slice(&win.out);
        ensure!(
            off.shape == want,
            "offset has shape {:?}, expected {want:?}",
            off.shape
        );
        if let Some(mt) = &mask {
            ensure!(
                mt.len() == n * og * kl * pl,
                "bad mask shape {:?}",
                mt.shape
            );
        }
        let mut k_ = lw.kernel("");
        let kr = &mut k_;
        let nv = kr.var(Ty::I64);
        let gv = kr.var(Ty::I64);
        let mv = kr.var(Ty::I64);
        let ov: Vec<VarId> = win.out.iter().map(|_| kr.var(Ty::I64)).collect();
        let civ = kr.var(Ty::I64);
        let kv: Vec<VarId> = k.iter().map(|_| kr.var(Ty::I64)).collect();
        let pos: Vec<VarId> = k.iter().map(|_| kr.var(Ty::F64)).collect();
        let flo: Vec<VarId> = k.iter().map(|_| kr.var(Ty::I64)).collect();
        let acc = kr.var(Ty::F64);
        let val = kr.var(Ty::F64);
        let f = |e: Expr| Expr::cast(Ty::F64, e);
        let oc = add(mul(v(gv), int(mg as i64)), v(mv));
        let ch = add(mul(v(gv), int(cg as i64)), v(civ));
        let gi = Expr::bin(BinOp::Div, ch.clone(), int(cpo as i64));
        let kk = index(&kv, &strides(&k));
        let p = index(&ov, &strides(&win.out));
        let mut stmts = Vec::new();
        let mut finite = lit(1.0, Ty::U8);
        for i in 0..nsp {
            let base = add(
                sub(mul(v(ov[i]), int(win.s[i] as i64)), int(win.pb[i])),
                mul(v(kv[i]), int(win.d[i] as i64)),
            );
            let chn = add(
                mul(
                    add(mul(gi.clone(), int(kl as i64)), kk.clone()),
                    int(nsp as i64),
                ),
                int(i as i64),
            );
            let oidx = add(
                mul(
                    add(mul(v(nv), int((og * kl * nsp) as i64)), chn),
                    int(pl as i64),
                ),
                p.clone(),
            );
            stmts.push(set(pos[i], add(f(base), f(Expr::load(off.buf, oidx)))));
            finite = and(
                finite,
                cmp(CmpOp::Eq, sub(v(pos[i]), v(pos[i])), Expr::f(0.0, Ty::F64)),
            );
        }
        let mut corners = Vec::new();
        for i in 0..nsp {
            corners.push(set(
                flo[i],
                Expr::cast(Ty::I64, Expr::un(UnOp::Floor, v(pos[i]))),
            ));
        }
        corners.push(set(val, Expr::f(0.0, Ty::F64)));
        for cm in 0..(1usize << nsp) {
            let mut ok = lit(1.0, Ty::U8);
            let mut wgt = Expr::f(1.0, Ty::F64);
            let mut coords = Vec::new();
            for i in 0..nsp {
                let bit = (cm >> i) & 1;
                let frac = sub(v(pos[i]), Expr::un(UnOp::Floor, v(pos[i])));
                let wi = if bit == 1 {
                    frac
                } else {
                    sub(Expr::f(1.0, Ty::F64), frac)
                };
                let ci = add(v(flo[i]), int(bit as i64));
                ok = and(ok, cmp(CmpOp::Ne, wi.clone(), Expr::f(0.0, Ty::F64)));
                ok = and(ok, cmp(CmpOp::Ge, ci.clone(), int(0)));
                ok = and(ok, cmp(CmpOp::Lt, ci.clone(), int(win.in_sp[i] as i64)));
                wgt = mul(wgt, wi);
                coords.push(ci);
            }
            let xidx = add(
                mul(add(mul(v(nv), int(c as i64)), ch.clone()), int(il as i64)),
                flat(&coords, &win.in_sp),
            );
            corners.push(iff(
                ok,
                vec![set(val, add(v(val), mul(wgt, f(Expr::load(x.buf, xidx)))))],
            ));
        }
        let mut sample = v(val);
        if let Some(mt) = &mask {
            let midx = add(
                mul(
                    add(
                        mul(v(nv), int((og * kl) as i64)),
                        add(mul(gi.clone(), int(kl as i64)), kk.clone()),
                    ),
                    int(pl as i64),
                ),
                p.clone(),
            );
            sample = mul(sample, f(Expr::load(mt.buf, midx)));
        }
        let widx = add(
            mul(add(mul(oc.clone(), int(cg as i64)), v(civ)), int(kl as i64)),
            kk.clone(),
        );
        corners.push(set(
            acc,
            add(v(acc), mul(sample, f(Expr::load(w.buf, widx)))),
        ));
        stmts.push(iff(finite, corners));
        let mut wl: Vec<(VarId, usize)> = vec![(civ, cg)];
        wl.extend(kv.iter().copied().zip(k.iter().copied()));
        let init = match &bias {
            Some(b) => f(per_ch(b, oc.clone())),
            None => Expr::f(0.0, Ty::F64),
        };
        let mut oshape = vec![n, m];
        oshape.extend_from_slice(&win.out);
        let ost = strides(&oshape);
        let oidx = add(
            add(mul(v(nv), int(ost[0] as i64)), mul(oc, int(ost[1] as i64))),
            index(&ov, &ost[2..]),
        );
        let mut body = vec![set(acc, init)];
        body.extend(loops(&wl, stmts));
        body.push(Stmt::Store {
            buf: out.buf,
            index: oidx,
            value: Expr::cast(out.ty().compute(), v(acc)),
        });
        let mut outer: Vec<(VarId, usize)> = vec![(nv, n), (gv, group), (mv, mg)];
        outer.extend(ov.iter().copied().zip(win.out.iter().copied()));
        k_.body = loops(&outer, body);
        lw.push(k_);
        Ok(())
    }

    pub fn register(r: &mut Registry) {
        r.lower("DeformConv", Lowering::Custom(deform_conv));
        r.lower("CausalConvWithState", Lowering::Custom(causal_conv));
        r.lower("Conv", Lowering::Custom(conv));
        r.lower("ConvInteger", Lowering::Custom(conv_integer));
        r.lower("QLinearConv", Lowering::Custom(qlinear_conv));
        r.lower("ConvTranspose", Lowering::Custom(conv_transpose));
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn few_row_parts_cover_the_rows_evenly() {
            // Stems: SqueezeNet's 111 rows, MobileNetV2's 112, the tests' 65 and 28.
            assert_eq!(few_row_parts(111), (6, 19));
            assert_eq!(few_row_parts(112), (6, 19));
            assert_eq!(few_row_parts(65), (4, 17));
            assert_eq!(few_row_parts(28), (1, 28));
            for oh in 1..600 {
                let (parts, per) = few_row_parts(oh);
                let last = oh - per * (parts - 1);
                assert!(parts == 1 || parts % 2 == 0, "{oh}: {parts} parts");
                assert!(parts <= FEW_ROW_PARTS, "{oh}");
                assert!(
                    last >= 1 && last <= per,
                    "{oh}: {parts} x {per}, last {last}"
                );
                assert!(
                    parts == 1 || per >= FEW_PART_ROWS,
                    "{oh}: {per} rows a part"
                );
            }
        }
    }
}
