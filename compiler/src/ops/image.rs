//! Image ops: Resize, Upsample, GridSample, AffineGrid, RoiAlign, NonMaxSuppression.
//!
//! Everything is computed in f64 and rounded back to the input dtype, following ONNX's
//! Python reference implementation (onnx/reference/ops/op_resize.py etc.).

use super::util::{axes as norm_axes, dims, f64s, input, ints, opt_input, out, scalar_f64};
use super::{OpCtx, Registry};
use crate::ir::{DType, OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{ArrayD, Axis, IxDyn};

pub fn register(r: &mut Registry) {
    r.add_shaped("Resize", resize, &[1, 2, 3]);
    r.add_shaped("Upsample", upsample, &[1]);
    r.add("GridSample", grid_sample);
    r.add_shaped("AffineGrid", affine_grid, &[1]);
    r.add("RoiAlign", roi_align);
    r.add_dynamic("NonMaxSuppression", nms);
    r.add_dynamic("ImageDecoder", image_decoder);
    lower::register(r);
}

// ---------------------------------------------------------------------------------------
// Resize / Upsample
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Nearest,
    Linear,
    Cubic,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum NearestMode {
    RoundPreferFloor,
    RoundPreferCeil,
    Floor,
    Ceil,
    /// Resize-10 / Upsample: floor when upsampling, ceil when downsampling.
    Simple,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Ctm {
    HalfPixel,
    HalfPixelSymmetric,
    PytorchHalfPixel,
    AlignCorners,
    Asymmetric,
    TfHalfPixelForNn,
    TfCropAndResize,
}

struct ResizeParams {
    mode: Mode,
    nearest: NearestMode,
    ctm: Ctm,
    cubic_a: f64,
    exclude_outside: bool,
    extrapolation: f64,
    antialias: bool,
}

fn cubic_coeffs(r: f64, a: f64) -> Vec<f64> {
    vec![
        ((a * (r + 1.0) - 5.0 * a) * (r + 1.0) + 8.0 * a) * (r + 1.0) - 4.0 * a,
        ((a + 2.0) * r - (a + 3.0)) * r * r + 1.0,
        ((a + 2.0) * (1.0 - r) - (a + 3.0)) * (1.0 - r) * (1.0 - r) + 1.0,
        ((a * ((1.0 - r) + 1.0) - 5.0 * a) * ((1.0 - r) + 1.0) + 8.0 * a) * ((1.0 - r) + 1.0)
            - 4.0 * a,
    ]
}

fn cubic_coeffs_antialias(r: f64, scale: f64, a: f64) -> Vec<f64> {
    let scale = scale.min(1.0);
    let f = |x: f64| {
        let x = x.abs();
        let x2 = x * x;
        let x3 = x * x2;
        if x <= 1.0 {
            (a + 2.0) * x3 - (a + 3.0) * x2 + 1.0
        } else if x < 2.0 {
            a * x3 - 5.0 * a * x2 + 8.0 * a * x - 4.0 * a
        } else {
            0.0
        }
    };
    let start = (-2.0 / scale).floor() as i64 + 1;
    let end = 2 - start;
    let c: Vec<f64> = (start..end).map(|i| f(scale * (i as f64 - r))).collect();
    let s: f64 = c.iter().sum();
    c.into_iter().map(|v| v / s).collect()
}

fn linear_coeffs_antialias(r: f64, scale: f64) -> Vec<f64> {
    let scale = scale.min(1.0);
    let start = (-1.0 / scale).floor() as i64 + 1;
    let fp = 2 - 2 * start;
    let c: Vec<f64> = (start..start + fp)
        .map(|i| (1.0 - ((i as f64 - r) * scale).abs()).clamp(0.0, 1.0))
        .collect();
    let s: f64 = c.iter().sum();
    c.into_iter().map(|v| v / s).collect()
}

fn coeffs(p: &ResizeParams, ratio: f64, scale: f64) -> Vec<f64> {
    match p.mode {
        Mode::Nearest => {
            if ratio.fract() == 0.0 {
                return vec![0.0, 1.0];
            }
            let b = |x: bool| if x { 1.0 } else { 0.0 };
            match p.nearest {
                NearestMode::RoundPreferFloor => vec![b(ratio <= 0.5), b(ratio > 0.5)],
                NearestMode::RoundPreferCeil => vec![b(ratio < 0.5), b(ratio >= 0.5)],
                NearestMode::Floor => vec![1.0, 0.0],
                NearestMode::Ceil => vec![0.0, 1.0],
                NearestMode::Simple => {
                    if scale < 1.0 {
                        vec![0.0, 1.0]
                    } else {
                        vec![1.0, 0.0]
                    }
                }
            }
        }
        Mode::Linear => {
            if p.antialias {
                linear_coeffs_antialias(ratio, scale)
            } else {
                vec![1.0 - ratio, ratio]
            }
        }
        Mode::Cubic => {
            if p.antialias {
                cubic_coeffs_antialias(ratio, scale, p.cubic_a)
            } else {
                cubic_coeffs(ratio, p.cubic_a)
            }
        }
    }
}

/// Resizes one axis of `data` (as in `_interpolate_1d_along_axis`).
/// Per output position along one axis: source indices (clamped), weights, and whether
/// the position is extrapolated.
type Taps = Vec<(Vec<usize>, Vec<f64>, bool)>;

fn resize_axis(
    data: &ArrayD<f64>,
    ax: usize,
    scale: f64,
    out_len: usize,
    roi: (f64, f64),
    p: &ResizeParams,
) -> OpResult<ArrayD<f64>> {
    let inw = data.shape()[ax];
    let mut shape = data.shape().to_vec();
    shape[ax] = out_len;
    if out_len == 0 || data.is_empty() {
        return Ok(ArrayD::zeros(IxDyn(&shape)));
    }
    let taps = resize_taps(inw, scale, out_len, roi, p)?;
    let mut o = ArrayD::zeros(IxDyn(&shape));
    for (lin, mut lout) in data.lanes(Axis(ax)).into_iter().zip(o.lanes_mut(Axis(ax))) {
        for (dst, (idx, c, ex)) in lout.iter_mut().zip(&taps) {
            *dst = if *ex {
                p.extrapolation
            } else {
                idx.iter().zip(c).map(|(&i, &w)| lin[i] * w).sum()
            };
        }
    }
    Ok(o)
}

fn resize_taps(
    inw: usize,
    scale: f64,
    out_len: usize,
    roi: (f64, f64),
    p: &ResizeParams,
) -> OpResult<Taps> {
    ensure!(inw > 0, "cannot resize an empty axis to {out_len}");
    ensure!(
        scale > 0.0 && scale.is_finite(),
        "scale {scale} must be positive"
    );
    let outw = scale * inw as f64;
    let fin = inw as f64;
    // Per output position: neighbour indices (clamped), weights, and extrapolation.
    let mut taps: Vec<(Vec<usize>, Vec<f64>, bool)> = Vec::with_capacity(out_len);
    for yi in 0..out_len {
        let y = yi as f64;
        let mut extrap = false;
        let x = match p.ctm {
            Ctm::AlignCorners => {
                if outw == 1.0 {
                    0.0
                } else {
                    y * (fin - 1.0) / (outw - 1.0)
                }
            }
            Ctm::Asymmetric => y / scale,
            Ctm::TfCropAndResize => {
                let x = if outw == 1.0 {
                    (roi.1 - roi.0) * (fin - 1.0) / 2.0
                } else {
                    y * (roi.1 - roi.0) * (fin - 1.0) / (outw - 1.0)
                };
                let x = x + roi.0 * (fin - 1.0);
                extrap = x < 0.0 || x > fin - 1.0;
                x
            }
            Ctm::PytorchHalfPixel => {
                if outw == 1.0 {
                    -0.5
                } else {
                    (y + 0.5) / scale - 0.5
                }
            }
            Ctm::HalfPixel => (y + 0.5) / scale - 0.5,
            Ctm::HalfPixelSymmetric => {
                let adj = out_len as f64 / outw;
                let center = fin / 2.0;
                let off = center * (1.0 - adj);
                off + (y + 0.5) / scale - 0.5
            }
            Ctm::TfHalfPixelForNn => (y + 0.5) / scale,
        };
        ensure!(x.is_finite(), "non-finite source coordinate");
        let xi = x.floor();
        let ratio = if x == xi { 1.0 } else { x - xi };
        let mut c = coeffs(p, ratio, scale);
        let n = c.len();
        let pad = n.div_ceil(2) as f64;
        let xp = x + pad;
        let pp = xp.floor();
        let frac = xp - pp;
        let off = if n.is_multiple_of(2) {
            if frac == 0.0 {
                -((n / 2) as f64)
            } else {
                -((n / 2) as f64) + 1.0
            }
        } else {
            let base = -(((n - 1) / 2) as f64);
            if frac <= 0.5 {
                base
            } else {
                base + 1.0
            }
        };
        let start = pp + off - pad;
        let idx: Vec<f64> = (0..n).map(|k| start + k as f64).collect();
        if p.exclude_outside {
            for (k, &i) in idx.iter().enumerate() {
                if i < 0.0 || i >= fin {
                    c[k] = 0.0;
                }
            }
            let s: f64 = c.iter().sum();
            let s = if s == 0.0 { 1.0 } else { s };
            for v in c.iter_mut() {
                *v /= s;
            }
        }
        let idx: Vec<usize> = idx
            .iter()
            .map(|&i| i.clamp(0.0, fin - 1.0) as usize)
            .collect();
        taps.push((idx, c, extrap));
    }
    Ok(taps)
}

/// Rounds f64 results back to `dt` like `onnx.numpy_helper.saturate_cast`.
fn saturate(dt: DType, a: ArrayD<f64>) -> Tensor {
    let range = match dt {
        DType::I8 => Some((i8::MIN as f64, i8::MAX as f64)),
        DType::U8 => Some((0.0, u8::MAX as f64)),
        DType::I16 => Some((i16::MIN as f64, i16::MAX as f64)),
        DType::U16 => Some((0.0, u16::MAX as f64)),
        DType::I32 => Some((i32::MIN as f64, i32::MAX as f64)),
        DType::U32 => Some((0.0, u32::MAX as f64)),
        DType::I64 => Some((i64::MIN as f64, i64::MAX as f64)),
        DType::U64 => Some((0.0, u64::MAX as f64)),
        _ => None,
    };
    match range {
        Some((lo, hi)) => Tensor::from_f64(
            dt,
            a.mapv(|x| {
                if x.is_nan() {
                    0.0
                } else {
                    x.round_ties_even().clamp(lo, hi)
                }
            }),
            false,
        ),
        None => Tensor::from_f64(dt, a, true),
    }
}

fn run_resize(
    x: &Tensor,
    scales: &[f64],
    sizes: &[usize],
    roi: Option<&[f64]>,
    p: &ResizeParams,
) -> OpResult<Tensor> {
    ensure!(
        x.dtype() != DType::Str && x.dtype() != DType::Bool,
        "Resize does not support {}",
        x.dtype()
    );
    let mut a = f64s(x)?;
    dims(&sizes.iter().map(|&s| s as i64).collect::<Vec<_>>())?;
    for (ax, lo, hi) in resized_axes(x.shape(), scales, sizes, roi) {
        a = resize_axis(&a, ax, scales[ax], sizes[ax], (lo, hi), p)?;
    }
    Ok(saturate(x.dtype(), a))
}

/// The axes Resize changes, in order, with their roi bounds.
fn resized_axes(
    in_shape: &[usize],
    scales: &[f64],
    sizes: &[usize],
    roi: Option<&[f64]>,
) -> Vec<(usize, f64, f64)> {
    let r = in_shape.len();
    let mut v = Vec::new();
    for ax in 0..r {
        let (lo, hi) = match roi {
            Some(v) => (v[ax], v[ax + r]),
            None => (0.0, 1.0),
        };
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
        if close(scales[ax], 1.0)
            && sizes[ax] == in_shape[ax]
            && (roi.is_none() || (lo == 0.0 && close(hi, 1.0)))
        {
            continue;
        }
        v.push((ax, lo, hi));
    }
    v
}

fn parse_ctm(s: &str) -> OpResult<Ctm> {
    Ok(match s {
        "half_pixel" => Ctm::HalfPixel,
        "half_pixel_symmetric" => Ctm::HalfPixelSymmetric,
        "pytorch_half_pixel" => Ctm::PytorchHalfPixel,
        "align_corners" => Ctm::AlignCorners,
        "asymmetric" => Ctm::Asymmetric,
        "tf_half_pixel_for_nn" => Ctm::TfHalfPixelForNn,
        "tf_crop_and_resize" => Ctm::TfCropAndResize,
        other => bail!("unknown coordinate_transformation_mode `{other}`"),
    })
}

fn parse_mode(s: &str) -> OpResult<Mode> {
    Ok(match s {
        "nearest" => Mode::Nearest,
        "linear" | "bilinear" | "trilinear" => Mode::Linear,
        "cubic" | "bicubic" => Mode::Cubic,
        other => bail!("unknown mode `{other}`"),
    })
}

/// A non-empty float tensor's values, or None when absent or empty.
fn nonempty_f64(t: Option<&Tensor>) -> OpResult<Option<Vec<f64>>> {
    match t {
        Some(t) if !t.is_empty() => Ok(Some(f64s(t)?.iter().copied().collect())),
        _ => Ok(None),
    }
}

fn resize(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let (scales, sizes, roi, p) = resize_setup(ctx, x.shape(), ins)?;
    out(run_resize(x, &scales, &sizes, roi.as_deref(), &p)?)
}

type Setup = (Vec<f64>, Vec<usize>, Option<Vec<f64>>, ResizeParams);

/// Resize's scales, output sizes, full roi and parameters (inputs 1-3 are read from
/// `ins`; input 0 is not).
fn resize_setup(ctx: &OpCtx, in_shape: &[usize], ins: &[Option<&Value>]) -> OpResult<Setup> {
    let r = in_shape.len();
    let in_shape = in_shape.to_vec();
    let mode = parse_mode(&ctx.attrs.string("mode", "nearest".into())?)?;
    let (ctm, nearest, roi_in, scales_in, sizes_in) = if ctx.opset < 11 {
        (
            Ctm::Asymmetric,
            NearestMode::Simple,
            None,
            nonempty_f64(opt_input(ins, 1)?)?,
            None,
        )
    } else {
        let nm = match ctx
            .attrs
            .string("nearest_mode", "round_prefer_floor".into())?
            .as_str()
        {
            "round_prefer_floor" => NearestMode::RoundPreferFloor,
            "round_prefer_ceil" => NearestMode::RoundPreferCeil,
            "floor" => NearestMode::Floor,
            "ceil" => NearestMode::Ceil,
            other => bail!("unknown nearest_mode `{other}`"),
        };
        let sizes = match opt_input(ins, 3)? {
            Some(t) if !t.is_empty() => Some(ints(t)?),
            _ => None,
        };
        (
            parse_ctm(
                &ctx.attrs
                    .string("coordinate_transformation_mode", "half_pixel".into())?,
            )?,
            nm,
            nonempty_f64(opt_input(ins, 1)?)?,
            nonempty_f64(opt_input(ins, 2)?)?,
            sizes,
        )
    };
    let p = ResizeParams {
        mode,
        nearest,
        ctm,
        cubic_a: ctx.attrs.float("cubic_coeff_a", -0.75)? as f64,
        exclude_outside: ctx.attrs.int("exclude_outside", 0)? != 0,
        extrapolation: ctx.attrs.float("extrapolation_value", 0.0)? as f64,
        antialias: ctx.attrs.int("antialias", 0)? != 0,
    };
    ensure!(
        !(p.antialias && mode == Mode::Nearest),
        "antialias is not supported for mode nearest"
    );
    let axes = match ctx.attrs.get_ints("axes")? {
        Some(v) => norm_axes(&v, r)?,
        None => (0..r).collect(),
    };
    let na = axes.len();
    let policy = ctx
        .attrs
        .string("keep_aspect_ratio_policy", "stretch".into())?;
    let mut scales = vec![1.0; r];
    let mut sizes = in_shape.clone();
    match (scales_in, sizes_in) {
        (Some(_), Some(_)) => bail!("only one of scales and sizes may be given"),
        (Some(s), None) => {
            ensure!(
                s.len() == na,
                "scales has {} values, expected {na}",
                s.len()
            );
            for (i, &a) in axes.iter().enumerate() {
                ensure!(
                    s[i] > 0.0 && s[i].is_finite(),
                    "scale {} must be positive",
                    s[i]
                );
                scales[a] = s[i];
                let o = s[i] * in_shape[a] as f64;
                ensure!(o < 1e12, "output size too large");
                sizes[a] = o as usize;
            }
        }
        (None, Some(sz)) => {
            ensure!(
                sz.len() == na,
                "sizes has {} values, expected {na}",
                sz.len()
            );
            for (i, &a) in axes.iter().enumerate() {
                ensure!(sz[i] >= 0, "negative size {}", sz[i]);
                ensure!(in_shape[a] > 0, "cannot resize an empty axis");
                sizes[a] = sz[i] as usize;
                scales[a] = sz[i] as f64 / in_shape[a] as f64;
            }
            if policy != "stretch" {
                let it = axes.iter().map(|&a| scales[a]);
                let s = match policy.as_str() {
                    "not_larger" => it.fold(f64::INFINITY, f64::min),
                    "not_smaller" => it.fold(f64::NEG_INFINITY, f64::max),
                    other => bail!("unknown keep_aspect_ratio_policy `{other}`"),
                };
                for &a in &axes {
                    scales[a] = s;
                    sizes[a] = (s * in_shape[a] as f64 + 0.5) as usize;
                }
            }
        }
        (None, None) => bail!("one of scales and sizes must be given"),
    }
    let roi = match roi_in {
        Some(v) => {
            ensure!(
                v.len() == 2 * na,
                "roi has {} values, expected {}",
                v.len(),
                2 * na
            );
            let mut full = vec![0.0; r];
            full.extend(vec![1.0; r]);
            for (i, &a) in axes.iter().enumerate() {
                full[a] = v[i];
                full[r + a] = v[na + i];
            }
            Some(full)
        }
        None => None,
    };
    let roi = if ctm == Ctm::TfCropAndResize && roi.is_none() {
        let mut full = vec![0.0; r];
        full.extend(vec![1.0; r]);
        Some(full)
    } else {
        roi
    };
    Ok((scales, sizes, roi, p))
}

fn upsample(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let (scales, sizes, _, p) = upsample_setup(ctx, x.shape(), ins)?;
    out(run_resize(x, &scales, &sizes, None, &p)?)
}

fn upsample_setup(ctx: &OpCtx, in_shape: &[usize], ins: &[Option<&Value>]) -> OpResult<Setup> {
    let r = in_shape.len();
    let scales: Vec<f64> = if ctx.opset < 9 {
        ctx.attrs
            .get_floats("scales")?
            .ok_or_else(|| crate::ir::OpError::new("Upsample needs `scales`".to_string()))?
            .into_iter()
            .map(|v| v as f64)
            .collect()
    } else {
        f64s(input(ins, 1)?)?.iter().copied().collect()
    };
    ensure!(
        scales.len() == r,
        "scales has {} values for rank {r}",
        scales.len()
    );
    let mut sizes = Vec::with_capacity(r);
    for (i, &s) in scales.iter().enumerate() {
        ensure!(s >= 1.0 && s.is_finite(), "Upsample scale {s} must be >= 1");
        let o = s * in_shape[i] as f64;
        ensure!(o < 1e12, "output size too large");
        sizes.push(o as usize);
    }
    let p = ResizeParams {
        mode: parse_mode(&ctx.attrs.string("mode", "nearest".into())?)?,
        nearest: NearestMode::Simple,
        ctm: Ctm::Asymmetric,
        cubic_a: -0.75,
        exclude_outside: false,
        extrapolation: 0.0,
        antialias: false,
    };
    Ok((scales, sizes, None, p))
}

// ---------------------------------------------------------------------------------------
// GridSample
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Pad {
    Zeros,
    Border,
    Reflection,
}

fn reflect(x: f64, lo: f64, hi: f64) -> f64 {
    let rng = hi - lo;
    if rng <= 0.0 {
        return lo;
    }
    if x < lo {
        let dx = lo - x;
        let n = (dx / rng).trunc();
        let r = dx - n * rng;
        if (n as i64) % 2 == 0 {
            lo + r
        } else {
            hi - r
        }
    } else if x > hi {
        let dx = x - hi;
        let n = (dx / rng).trunc();
        let r = dx - n * rng;
        if (n as i64) % 2 == 0 {
            hi - r
        } else {
            lo + r
        }
    } else {
        x
    }
}

fn gs_cubic(x: f64) -> [f64; 4] {
    let a = -0.75;
    let x = x.abs();
    [
        ((a * (x + 1.0) - 5.0 * a) * (x + 1.0) + 8.0 * a) * (x + 1.0) - 4.0 * a,
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
        ((a + 2.0) * (1.0 - x) - (a + 3.0)) * (1.0 - x) * (1.0 - x) + 1.0,
        ((a * (2.0 - x) - 5.0 * a) * (2.0 - x) + 8.0 * a) * (2.0 - x) - 4.0 * a,
    ]
}

fn grid_sample(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let g = input(ins, 1)?;
    ensure!(
        x.dtype().is_float() || x.dtype().is_int(),
        "unsupported X dtype {}",
        x.dtype()
    );
    let default_mode = if ctx.opset >= 20 {
        "linear"
    } else {
        "bilinear"
    };
    let mode = parse_mode(&ctx.attrs.string("mode", default_mode.into())?)?;
    let pad = match ctx.attrs.string("padding_mode", "zeros".into())?.as_str() {
        "zeros" => Pad::Zeros,
        "border" => Pad::Border,
        "reflection" => Pad::Reflection,
        o => bail!("unknown padding_mode `{o}`"),
    };
    let align = ctx.attrs.int("align_corners", 0)? != 0;
    let xs = x.shape().to_vec();
    let gs = g.shape().to_vec();
    ensure!(xs.len() >= 3, "X must have rank >= 3");
    let k = xs.len() - 2;
    ensure!(
        gs.len() == k + 2 && gs[0] == xs[0] && gs[k + 1] == k,
        "grid shape {gs:?} does not fit X shape {xs:?}"
    );
    let (n, c) = (xs[0], xs[1]);
    let sp = &xs[2..];
    let osp = &gs[1..k + 1];
    let mut yshape = vec![n, c];
    yshape.extend_from_slice(osp);
    dims(&yshape.iter().map(|&v| v as i64).collect::<Vec<_>>())?;
    let xa = f64s(x)?.as_standard_layout().into_owned();
    let xv = xa.as_slice().unwrap_or(&[]);
    let ga = f64s(g)?.as_standard_layout().into_owned();
    let gv = ga.as_slice().unwrap_or(&[]);
    let in_sz: usize = sp.iter().product();
    let out_sz: usize = osp.iter().product();
    let mut strides = vec![1usize; k];
    for d in (0..k.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * sp[d + 1];
    }
    let round32 = g.dtype() != DType::F64;
    let (lo, hi): (Vec<f64>, Vec<f64>) = sp
        .iter()
        .map(|&d| {
            if align {
                (0.0, d as f64 - 1.0)
            } else {
                (-0.5, d as f64 - 0.5)
            }
        })
        .unzip();
    // Maps an integer index along dim d through the padding mode; None = zero.
    let fetch_idx = |d: usize, i: i64| -> Option<usize> {
        let len = sp[d] as i64;
        match pad {
            Pad::Zeros => (i >= 0 && i < len).then_some(i as usize),
            Pad::Border => Some(i.clamp(0, len - 1) as usize),
            Pad::Reflection => {
                let r = reflect(i as f64, lo[d], hi[d]) as i64;
                Some(r.clamp(0, len - 1) as usize)
            }
        }
    };
    let mut y = vec![0.0; n * c * out_sz];
    if in_sz > 0 {
        for b in 0..n {
            for o in 0..out_sz {
                let goff = (b * out_sz + o) * k;
                // Grid's last dim is (x, y, z...) = reversed spatial order.
                let mut pos = vec![0.0; k];
                for d in 0..k {
                    let nv = gv[goff + (k - 1 - d)];
                    let len = sp[d] as f64;
                    let mut v = if align {
                        (nv + 1.0) / 2.0 * (len - 1.0)
                    } else {
                        ((nv + 1.0) * len - 1.0) / 2.0
                    };
                    if round32 {
                        v = v as f32 as f64;
                    }
                    if mode == Mode::Nearest {
                        v = v.round_ties_even();
                    }
                    if v < lo[d] || v > hi[d] {
                        match pad {
                            Pad::Border => v = v.clamp(0.0, len - 1.0),
                            Pad::Reflection => v = reflect(v, lo[d], hi[d]),
                            Pad::Zeros => {}
                        }
                        if round32 {
                            v = v as f32 as f64;
                        }
                    }
                    pos[d] = v;
                }
                // Per dim: list of (index, weight).
                let mut taps: Vec<Vec<(Option<usize>, f64)>> = Vec::with_capacity(k);
                for (d, &v) in pos.iter().enumerate().take(k) {
                    let t = match mode {
                        Mode::Nearest => {
                            if !v.is_finite() {
                                vec![(None, 1.0)]
                            } else {
                                vec![(fetch_idx(d, v as i64), 1.0)]
                            }
                        }
                        Mode::Linear => {
                            let f = v.floor();
                            let r = v - f;
                            let i0 = f as i64;
                            vec![
                                (fetch_idx(d, i0), 1.0 - r),
                                (fetch_idx(d, i0.saturating_add(1)), r),
                            ]
                        }
                        Mode::Cubic => {
                            let f = v.floor();
                            let cf = gs_cubic(v - f);
                            let i0 = f as i64;
                            (0..4)
                                .map(|j| (fetch_idx(d, i0.saturating_add(j as i64 - 1)), cf[j]))
                                .collect()
                        }
                    };
                    taps.push(t);
                }
                // Tensor-product over the taps.
                let mut combos: Vec<(Option<usize>, f64)> = vec![(Some(0), 1.0)];
                for (d, t) in taps.iter().enumerate() {
                    let mut next = Vec::with_capacity(combos.len() * t.len());
                    for &(off, w) in &combos {
                        for &(i, wt) in t {
                            next.push((off.and_then(|o| i.map(|i| o + i * strides[d])), w * wt));
                        }
                    }
                    combos = next;
                }
                for ch in 0..c {
                    let base = (b * c + ch) * in_sz;
                    let mut acc = 0.0;
                    for &(off, w) in &combos {
                        if let Some(off) = off {
                            acc += w * xv[base + off];
                        }
                    }
                    y[(b * c + ch) * out_sz + o] = acc;
                }
            }
        }
    }
    out(saturate(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&yshape), y).expect("sizes match"),
    ))
}

// ---------------------------------------------------------------------------------------
// AffineGrid
// ---------------------------------------------------------------------------------------

fn affine_grid(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let theta = input(ins, 0)?;
    let size = ints(input(ins, 1)?)?;
    let align = ctx.attrs.int("align_corners", 0)? != 0;
    ensure!(theta.dtype().is_float(), "theta must be float");
    ensure!(
        size.len() == 4 || size.len() == 5,
        "size must have 4 or 5 values"
    );
    let k = size.len() - 2;
    let ts = theta.shape();
    ensure!(
        ts.len() == 3 && ts[1] == k && ts[2] == k + 1 && ts[0] as i64 == size[0],
        "theta shape {ts:?} does not fit size {size:?}"
    );
    let n = ts[0];
    let sp = dims(&size[2..])?;
    let coords = |len: usize| -> Vec<f64> {
        (0..len)
            .map(|i| {
                if align {
                    if len == 1 {
                        -1.0
                    } else {
                        -1.0 + i as f64 * 2.0 / (len as f64 - 1.0)
                    }
                } else {
                    let step = 2.0 / len as f64;
                    -1.0 + step / 2.0 + i as f64 * step
                }
            })
            .collect()
    };
    let cs: Vec<Vec<f64>> = sp.iter().map(|&l| coords(l)).collect();
    let tv: Vec<f64> = f64s(theta)?.iter().copied().collect();
    let total: usize = sp.iter().product();
    let mut shape = vec![n];
    shape.extend_from_slice(&sp);
    shape.push(k);
    dims(&shape.iter().map(|&v| v as i64).collect::<Vec<_>>())?;
    let mut outv = Vec::with_capacity(n * total * k);
    for b in 0..n {
        let th = &tv[b * k * (k + 1)..(b + 1) * k * (k + 1)];
        for lin in 0..total {
            // Homogeneous point (x, y[, z], 1) with x the last spatial dim.
            let mut idx = vec![0usize; k];
            let mut rem = lin;
            for d in (0..k).rev() {
                idx[d] = rem % sp[d];
                rem /= sp[d];
            }
            let mut h = Vec::with_capacity(k + 1);
            for d in (0..k).rev() {
                h.push(cs[d][idx[d]]);
            }
            h.push(1.0);
            for row in 0..k {
                outv.push((0..=k).map(|j| th[row * (k + 1) + j] * h[j]).sum::<f64>());
            }
        }
    }
    out(Tensor::from_f64(
        theta.dtype(),
        ArrayD::from_shape_vec(IxDyn(&shape), outv).expect("sizes match"),
        false,
    ))
}

// ---------------------------------------------------------------------------------------
// RoiAlign
// ---------------------------------------------------------------------------------------

fn roi_align(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let rois = input(ins, 1)?;
    let bi = ints(input(ins, 2)?)?;
    ensure!(x.dtype().is_float(), "X must be float");
    ensure!(x.rank() == 4, "X must be [N, C, H, W]");
    let half_pixel = if ctx.opset >= 16 {
        match ctx
            .attrs
            .string("coordinate_transformation_mode", "half_pixel".into())?
            .as_str()
        {
            "half_pixel" => true,
            "output_half_pixel" => false,
            o => bail!("unknown coordinate_transformation_mode `{o}`"),
        }
    } else {
        false
    };
    let max_mode = match ctx
        .attrs
        .string("mode", "avg".into())?
        .to_lowercase()
        .as_str()
    {
        "avg" => false,
        "max" => true,
        o => bail!("unknown mode `{o}`"),
    };
    let oh = ctx.attrs.int("output_height", 1)?;
    let ow = ctx.attrs.int("output_width", 1)?;
    let sr = ctx.attrs.int("sampling_ratio", 0)?;
    let scale = ctx.attrs.float("spatial_scale", 1.0)? as f64;
    ensure!(oh >= 1 && ow >= 1, "output size must be positive");
    let (nb, c, h, w) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let nr = bi.len();
    ensure!(
        rois.shape() == [nr, 4],
        "rois must be [{nr}, 4], got {:?}",
        rois.shape()
    );
    let (ph_n, pw_n) = (oh as usize, ow as usize);
    dims(&[nr as i64, c as i64, oh, ow])?;
    let xa = f64s(x)?.as_standard_layout().into_owned();
    let xv = xa.as_slice().unwrap_or(&[]);
    let rv: Vec<f64> = f64s(rois)?.iter().copied().collect();
    let mut y = vec![0.0; nr * c * ph_n * pw_n];
    let off = if half_pixel { 0.5 } else { 0.0 };
    for n in 0..nr {
        let b = bi[n];
        ensure!(
            b >= 0 && (b as usize) < nb,
            "batch index {b} is out of range"
        );
        let b = b as usize;
        let r = &rv[n * 4..n * 4 + 4];
        let sw = r[0] * scale - off;
        let sh = r[1] * scale - off;
        let ew = r[2] * scale - off;
        let eh = r[3] * scale - off;
        let (mut rw, mut rh) = (ew - sw, eh - sh);
        if !half_pixel {
            rw = rw.max(1.0);
            rh = rh.max(1.0);
        }
        let bh = rh / ph_n as f64;
        let bw = rw / pw_n as f64;
        let gh = if sr > 0 {
            sr as usize
        } else {
            (rh / ph_n as f64).ceil().max(0.0) as usize
        };
        let gw = if sr > 0 {
            sr as usize
        } else {
            (rw / pw_n as f64).ceil().max(0.0) as usize
        };
        ensure!(gh <= 1 << 16 && gw <= 1 << 16, "sampling grid too large");
        dims(&[ph_n as i64, pw_n as i64, gh as i64, gw as i64])?;
        let count = (gh * gw).max(1) as f64;
        // Precomputed (positions, weights) per sample.
        let mut pre: Vec<([usize; 4], [f64; 4])> = Vec::with_capacity(ph_n * pw_n * gh * gw);
        for ph in 0..ph_n {
            for pw in 0..pw_n {
                for iy in 0..gh {
                    let yy = sh + ph as f64 * bh + (iy as f64 + 0.5) * bh / gh as f64;
                    for ix in 0..gw {
                        let xx = sw + pw as f64 * bw + (ix as f64 + 0.5) * bw / gw as f64;
                        let (mut yf, mut xf) = (yy, xx);
                        if yf < -1.0
                            || yf > h as f64
                            || xf < -1.0
                            || xf > w as f64
                            || h == 0
                            || w == 0
                        {
                            pre.push(([0; 4], [0.0; 4]));
                            continue;
                        }
                        yf = yf.max(0.0);
                        xf = xf.max(0.0);
                        let mut yl = yf as usize;
                        let mut xl = xf as usize;
                        let yh;
                        let xh;
                        if yl >= h - 1 {
                            yl = h - 1;
                            yh = h - 1;
                            yf = yl as f64;
                        } else {
                            yh = yl + 1;
                        }
                        if xl >= w - 1 {
                            xl = w - 1;
                            xh = w - 1;
                            xf = xl as f64;
                        } else {
                            xh = xl + 1;
                        }
                        let ly = yf - yl as f64;
                        let lx = xf - xl as f64;
                        let (hy, hx) = (1.0 - ly, 1.0 - lx);
                        pre.push((
                            [yl * w + xl, yl * w + xh, yh * w + xl, yh * w + xh],
                            [hy * hx, hy * lx, ly * hx, ly * lx],
                        ));
                    }
                }
            }
        }
        for ch in 0..c {
            let base = (b * c + ch) * h * w;
            let mut pi = 0;
            for ph in 0..ph_n {
                for pw in 0..pw_n {
                    let mut val = 0.0;
                    let mut first = true;
                    for _ in 0..gh * gw {
                        let (pos, wt) = &pre[pi];
                        pi += 1;
                        let px = |j: usize| xv.get(base + pos[j]).copied().unwrap_or(0.0);
                        if max_mode {
                            let v = (0..4)
                                .map(|j| wt[j] * px(j))
                                .fold(f64::NEG_INFINITY, f64::max);
                            val = if first { v } else { val.max(v) };
                            first = false;
                        } else {
                            val += (0..4).map(|j| wt[j] * px(j)).sum::<f64>();
                        }
                    }
                    if !max_mode {
                        val /= count;
                    }
                    y[((n * c + ch) * ph_n + ph) * pw_n + pw] = val;
                }
            }
        }
    }
    out(Tensor::from_f64(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&[nr, c, ph_n, pw_n]), y).expect("sizes match"),
        false,
    ))
}

// ---------------------------------------------------------------------------------------
// NonMaxSuppression
// ---------------------------------------------------------------------------------------

fn suppress(b1: &[f64], b2: &[f64], center: bool, thr: f64) -> bool {
    let mm = |a: f64, b: f64| if a >= b { (b, a) } else { (a, b) };
    let (x1min, x1max, x2min, x2max, y1min, y1max, y2min, y2max);
    if !center {
        (x1min, x1max) = mm(b1[1], b1[3]);
        (x2min, x2max) = mm(b2[1], b2[3]);
        (y1min, y1max) = mm(b1[0], b1[2]);
        (y2min, y2max) = mm(b2[0], b2[2]);
    } else {
        x1min = b1[0] - b1[2] / 2.0;
        x1max = b1[0] + b1[2] / 2.0;
        x2min = b2[0] - b2[2] / 2.0;
        x2max = b2[0] + b2[2] / 2.0;
        y1min = b1[1] - b1[3] / 2.0;
        y1max = b1[1] + b1[3] / 2.0;
        y2min = b2[1] - b2[3] / 2.0;
        y2max = b2[1] + b2[3] / 2.0;
    }
    let ixmin = x1min.max(x2min);
    let ixmax = x1max.min(x2max);
    if ixmax <= ixmin {
        return false;
    }
    let iymin = y1min.max(y2min);
    let iymax = y1max.min(y2max);
    if iymax <= iymin {
        return false;
    }
    let inter = (ixmax - ixmin) * (iymax - iymin);
    if inter <= 0.0 {
        return false;
    }
    let a1 = (x1max - x1min) * (y1max - y1min);
    let a2 = (x2max - x2min) * (y2max - y2min);
    let uni = a1 + a2 - inter;
    if a1 <= 0.0 || a2 <= 0.0 || uni <= 0.0 {
        return false;
    }
    inter / uni > thr
}

fn nms(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let boxes = input(ins, 0)?;
    let scores = input(ins, 1)?;
    let max_out = match opt_input(ins, 2)? {
        Some(t) if !t.is_empty() => ints(t)?[0].max(0),
        _ => 0,
    };
    let iou = match opt_input(ins, 3)? {
        Some(t) if !t.is_empty() => scalar_f64(t)?,
        _ => 0.0,
    };
    let score_thr = match opt_input(ins, 4)? {
        Some(t) if !t.is_empty() => Some(scalar_f64(t)?),
        _ => None,
    };
    let center = ctx.attrs.int("center_point_box", 0)? != 0;
    let bs = boxes.shape();
    let ss = scores.shape();
    ensure!(
        bs.len() == 3 && bs[2] == 4,
        "boxes must be [batches, boxes, 4], got {bs:?}"
    );
    ensure!(
        ss.len() == 3 && ss[0] == bs[0] && ss[2] == bs[1],
        "scores shape {ss:?} does not fit boxes {bs:?}"
    );
    let (nb, nbox, ncls) = (bs[0], bs[1], ss[1]);
    let bv: Vec<f64> = f64s(boxes)?.iter().copied().collect();
    let sv: Vec<f64> = f64s(scores)?.iter().copied().collect();
    let mut sel: Vec<i64> = Vec::new();
    for b in 0..nb {
        for cl in 0..ncls {
            let sc = &sv[(b * ncls + cl) * nbox..(b * ncls + cl + 1) * nbox];
            let mut cand: Vec<(f64, usize)> = (0..nbox)
                .filter(|&i| score_thr.is_none_or(|t| sc[i] > t))
                .map(|i| (sc[i], i))
                .collect();
            // Highest score first; ties by lower index.
            cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut kept: Vec<usize> = Vec::new();
            for &(_, i) in &cand {
                if kept.len() as i64 >= max_out {
                    break;
                }
                let bi = &bv[(b * nbox + i) * 4..(b * nbox + i + 1) * 4];
                let ok = kept.iter().all(|&j| {
                    let bj = &bv[(b * nbox + j) * 4..(b * nbox + j + 1) * 4];
                    !suppress(bi, bj, center, iou)
                });
                if ok {
                    kept.push(i);
                    sel.extend([b as i64, cl as i64, i as i64]);
                }
            }
        }
    }
    let n = sel.len() / 3;
    out(Tensor::from_vec(&[n, 3], sel))
}

// ---------------------------------------------------------------------------------------
// ImageDecoder (BMP and PNM only; other formats need codecs onnxc does not carry)
// ---------------------------------------------------------------------------------------

/// Decoded image: height, width, channels (1 or 3), row-major HWC bytes.
struct Image {
    h: usize,
    w: usize,
    c: usize,
    data: Vec<u8>,
}

fn le_u32(b: &[u8], at: usize) -> OpResult<u32> {
    match b.get(at..at + 4) {
        Some(s) => Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]])),
        None => bail!("truncated BMP header"),
    }
}

fn le_u16(b: &[u8], at: usize) -> OpResult<u16> {
    match b.get(at..at + 2) {
        Some(s) => Ok(u16::from_le_bytes([s[0], s[1]])),
        None => bail!("truncated BMP header"),
    }
}

fn decode_bmp(b: &[u8]) -> OpResult<Image> {
    let off = le_u32(b, 10)? as usize;
    let hdr = le_u32(b, 14)?;
    ensure!(hdr >= 40, "unsupported BMP header size {hdr}");
    let w = le_u32(b, 18)? as i32;
    let h = le_u32(b, 22)? as i32;
    let bpp = le_u16(b, 28)?;
    let comp = le_u32(b, 30)?;
    ensure!(
        (bpp == 24 && comp == 0) || (bpp == 32 && (comp == 0 || comp == 3)),
        "only uncompressed 24/32-bit BMP images are supported (bpp {bpp}, compression {comp})"
    );
    ensure!(w > 0 && h != 0, "bad BMP size {w}x{h}");
    let (wu, hu) = (w as usize, h.unsigned_abs() as usize);
    dims(&[hu as i64, wu as i64, 3])?;
    let bytes = bpp as usize / 8;
    let stride = (wu * bytes).div_ceil(4) * 4;
    ensure!(
        off.checked_add(stride * hu).is_some_and(|e| e <= b.len()),
        "truncated BMP pixel data"
    );
    let mut data = Vec::with_capacity(hu * wu * 3);
    for y in 0..hu {
        let row = if h > 0 { hu - 1 - y } else { y };
        let base = off + row * stride;
        for x in 0..wu {
            let p = base + x * bytes;
            data.extend([b[p + 2], b[p + 1], b[p]]);
        }
    }
    Ok(Image {
        h: hu,
        w: wu,
        c: 3,
        data,
    })
}

fn decode_pnm(b: &[u8]) -> OpResult<Image> {
    let kind = b.get(1).copied().unwrap_or(0);
    // Header: magic, width, height, maxval (skipping whitespace and comments).
    let mut pos = 2;
    let mut fields = Vec::new();
    while fields.len() < 3 {
        while pos < b.len() && (b[pos].is_ascii_whitespace() || b[pos] == b'#') {
            if b[pos] == b'#' {
                while pos < b.len() && b[pos] != b'\n' {
                    pos += 1;
                }
            } else {
                pos += 1;
            }
        }
        let start = pos;
        while pos < b.len() && b[pos].is_ascii_digit() {
            pos += 1;
        }
        ensure!(pos > start, "bad PNM header");
        let v: usize = std::str::from_utf8(&b[start..pos])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| crate::ir::OpError::new("bad PNM header".to_string()))?;
        fields.push(v);
    }
    pos += 1; // the single whitespace byte after maxval
    let (w, h, maxv) = (fields[0], fields[1], fields[2]);
    ensure!(
        maxv > 0 && maxv < 256,
        "only 8-bit PNM images are supported"
    );
    let c = match kind {
        b'5' => 1,
        b'6' => 3,
        _ => bail!("only binary PGM (P5) and PPM (P6) images are supported"),
    };
    dims(&[h as i64, w as i64, c as i64])?;
    let n = h * w * c;
    ensure!(
        pos.checked_add(n).is_some_and(|e| e <= b.len()),
        "truncated PNM pixel data"
    );
    let data = b[pos..pos + n]
        .iter()
        .map(|&v| ((v as usize * 255 + maxv / 2) / maxv).min(255) as u8)
        .collect();
    Ok(Image { h, w, c, data })
}

/// Baseline uncompressed 8-bit TIFF (chunky RGB or grayscale, strips).
fn decode_tiff(b: &[u8]) -> OpResult<Image> {
    let le = b[0] == b'I';
    let u16_at = |at: usize| -> OpResult<u32> {
        match b.get(at..at + 2) {
            Some(s) => Ok(if le {
                u16::from_le_bytes([s[0], s[1]])
            } else {
                u16::from_be_bytes([s[0], s[1]])
            } as u32),
            None => bail!("truncated TIFF"),
        }
    };
    let u32_at = |at: usize| -> OpResult<u32> {
        match b.get(at..at + 4) {
            Some(s) => Ok(if le {
                u32::from_le_bytes([s[0], s[1], s[2], s[3]])
            } else {
                u32::from_be_bytes([s[0], s[1], s[2], s[3]])
            }),
            None => bail!("truncated TIFF"),
        }
    };
    let ifd = u32_at(4)? as usize;
    let n = u16_at(ifd)? as usize;
    // Tag values as lists of u32.
    let mut tags: std::collections::HashMap<u32, Vec<u32>> = Default::default();
    for i in 0..n {
        let e = ifd + 2 + i * 12;
        let tag = u16_at(e)?;
        let ty = u16_at(e + 2)?;
        let count = u32_at(e + 4)? as usize;
        let size = match ty {
            3 => 2,
            4 => 4,
            1 => 1,
            _ => continue,
        };
        ensure!(count <= 1 << 20, "TIFF tag count too large");
        let base = if size * count <= 4 {
            e + 8
        } else {
            u32_at(e + 8)? as usize
        };
        let mut v = Vec::with_capacity(count);
        for k in 0..count {
            let at = base + k * size;
            v.push(match size {
                1 => *b
                    .get(at)
                    .ok_or_else(|| crate::ir::OpError::new("truncated TIFF".to_string()))?
                    as u32,
                2 => u16_at(at)?,
                _ => u32_at(at)?,
            });
        }
        tags.insert(tag, v);
    }
    let one = |t: u32, d: u32| tags.get(&t).and_then(|v| v.first().copied()).unwrap_or(d);
    let w = one(256, 0) as usize;
    let h = one(257, 0) as usize;
    let spp = one(277, 1) as usize;
    ensure!(
        one(259, 1) == 1,
        "only uncompressed TIFF images are supported"
    );
    ensure!(
        one(284, 1) == 1,
        "only chunky (interleaved) TIFF images are supported"
    );
    ensure!(
        tags.get(&258).is_none_or(|v| v.iter().all(|&x| x == 8)),
        "only 8-bit TIFF images are supported"
    );
    ensure!(
        spp == 1 || spp == 3 || spp == 4,
        "unsupported samples per pixel {spp}"
    );
    dims(&[h as i64, w as i64, spp as i64])?;
    let offs = tags.get(&273).cloned().unwrap_or_default();
    let counts = tags.get(&279).cloned().unwrap_or_default();
    ensure!(offs.len() == counts.len(), "bad TIFF strips");
    let mut raw = Vec::with_capacity(h * w * spp);
    for (&o, &c) in offs.iter().zip(&counts) {
        let (o, c) = (o as usize, c as usize);
        match b.get(o..o + c) {
            Some(s) => raw.extend_from_slice(s),
            None => bail!("truncated TIFF strip"),
        }
    }
    ensure!(raw.len() >= h * w * spp, "TIFF pixel data is too short");
    let c = if spp == 1 { 1 } else { 3 };
    let mut data = Vec::with_capacity(h * w * c);
    for i in 0..h * w {
        data.extend_from_slice(&raw[i * spp..i * spp + c]);
    }
    if spp == 1 && one(262, 1) == 0 {
        for v in data.iter_mut() {
            *v = 255 - *v;
        }
    }
    Ok(Image { h, w, c, data })
}

/// A DEFLATE (RFC 1951) bit reader.
struct Bits<'a> {
    b: &'a [u8],
    pos: usize,
    bit: u32,
}

impl Bits<'_> {
    fn get(&mut self, n: u32) -> OpResult<u32> {
        let mut v = 0u32;
        for i in 0..n {
            let byte = match self.b.get(self.pos) {
                Some(&x) => x,
                None => bail!("truncated deflate stream"),
            };
            v |= (((byte >> self.bit) & 1) as u32) << i;
            self.bit += 1;
            if self.bit == 8 {
                self.bit = 0;
                self.pos += 1;
            }
        }
        Ok(v)
    }
}

/// A canonical Huffman code: (counts per length, symbols in code order).
struct Huff {
    counts: [u16; 16],
    syms: Vec<u16>,
}

impl Huff {
    fn new(lengths: &[u8]) -> Huff {
        let mut counts = [0u16; 16];
        for &l in lengths {
            counts[l as usize] += 1;
        }
        counts[0] = 0;
        let mut offs = [0u16; 16];
        for i in 1..16 {
            offs[i] = offs[i - 1] + counts[i - 1];
        }
        let mut syms = vec![0u16; lengths.len()];
        for (s, &l) in lengths.iter().enumerate() {
            if l != 0 {
                syms[offs[l as usize] as usize] = s as u16;
                offs[l as usize] += 1;
            }
        }
        Huff { counts, syms }
    }

    fn decode(&self, r: &mut Bits) -> OpResult<u16> {
        let (mut code, mut first, mut index) = (0i32, 0i32, 0i32);
        for len in 1..16 {
            code |= r.get(1)? as i32;
            let count = self.counts[len] as i32;
            if code - count < first {
                return match self.syms.get((index + (code - first)) as usize) {
                    Some(&s) => Ok(s),
                    None => bail!("bad Huffman code"),
                };
            }
            index += count;
            first += count;
            first <<= 1;
            code <<= 1;
        }
        bail!("bad Huffman code")
    }
}

fn inflate(data: &[u8], limit: usize) -> OpResult<Vec<u8>> {
    const LBASE: [u16; 29] = [
        3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115,
        131, 163, 195, 227, 258,
    ];
    const LEXT: [u8; 29] = [
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
    ];
    const DBASE: [u16; 30] = [
        1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537,
        2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577,
    ];
    const DEXT: [u8; 30] = [
        0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12,
        13, 13,
    ];
    let mut r = Bits {
        b: data,
        pos: 0,
        bit: 0,
    };
    let mut out: Vec<u8> = Vec::new();
    loop {
        let last = r.get(1)?;
        let ty = r.get(2)?;
        match ty {
            0 => {
                if r.bit != 0 {
                    r.bit = 0;
                    r.pos += 1;
                }
                let len = match data.get(r.pos..r.pos + 4) {
                    Some(s) => u16::from_le_bytes([s[0], s[1]]) as usize,
                    None => bail!("truncated deflate stream"),
                };
                r.pos += 4;
                match data.get(r.pos..r.pos + len) {
                    Some(s) => out.extend_from_slice(s),
                    None => bail!("truncated deflate stream"),
                }
                r.pos += len;
            }
            1 | 2 => {
                let (lit, dist) = if ty == 1 {
                    let mut l = [0u8; 288];
                    for (i, v) in l.iter_mut().enumerate() {
                        *v = match i {
                            0..=143 => 8,
                            144..=255 => 9,
                            256..=279 => 7,
                            _ => 8,
                        };
                    }
                    (Huff::new(&l), Huff::new(&[5u8; 30]))
                } else {
                    let hlit = r.get(5)? as usize + 257;
                    let hdist = r.get(5)? as usize + 1;
                    let hclen = r.get(4)? as usize + 4;
                    const ORD: [usize; 19] = [
                        16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15,
                    ];
                    let mut cl = [0u8; 19];
                    for &o in ORD.iter().take(hclen) {
                        cl[o] = r.get(3)? as u8;
                    }
                    let ch = Huff::new(&cl);
                    let mut lens = Vec::with_capacity(hlit + hdist);
                    while lens.len() < hlit + hdist {
                        let sym = ch.decode(&mut r)?;
                        match sym {
                            0..=15 => lens.push(sym as u8),
                            16 => {
                                let prev = match lens.last() {
                                    Some(&p) => p,
                                    None => bail!("bad code lengths"),
                                };
                                let n = 3 + r.get(2)? as usize;
                                lens.resize(lens.len() + n, prev);
                            }
                            17 => {
                                let n = 3 + r.get(3)? as usize;
                                lens.resize(lens.len() + n, 0);
                            }
                            _ => {
                                let n = 11 + r.get(7)? as usize;
                                lens.resize(lens.len() + n, 0);
                            }
                        }
                    }
                    ensure!(lens.len() == hlit + hdist, "bad code lengths");
                    (Huff::new(&lens[..hlit]), Huff::new(&lens[hlit..]))
                };
                loop {
                    let sym = lit.decode(&mut r)? as usize;
                    if sym < 256 {
                        out.push(sym as u8);
                    } else if sym == 256 {
                        break;
                    } else {
                        let i = sym - 257;
                        ensure!(i < 29, "bad length symbol");
                        let len = LBASE[i] as usize + r.get(LEXT[i] as u32)? as usize;
                        let d = dist.decode(&mut r)? as usize;
                        ensure!(d < 30, "bad distance symbol");
                        let dd = DBASE[d] as usize + r.get(DEXT[d] as u32)? as usize;
                        ensure!(dd <= out.len(), "distance too far back");
                        let start = out.len() - dd;
                        for k in 0..len {
                            let v = out[start + k];
                            out.push(v);
                        }
                    }
                    ensure!(out.len() <= limit, "inflated data too large");
                }
            }
            _ => bail!("bad deflate block type"),
        }
        ensure!(out.len() <= limit, "inflated data too large");
        if last == 1 {
            break;
        }
    }
    Ok(out)
}

/// 8-bit PNG (gray, RGB, palette, with or without alpha; not interlaced).
fn decode_png(b: &[u8]) -> OpResult<Image> {
    let mut pos = 8;
    let (mut w, mut h, mut depth, mut ctype, mut interlace) = (0usize, 0usize, 0u8, 0u8, 0u8);
    let mut idat = Vec::new();
    let mut palette: Vec<u8> = Vec::new();
    while pos + 8 <= b.len() {
        let len = u32::from_be_bytes([b[pos], b[pos + 1], b[pos + 2], b[pos + 3]]) as usize;
        let kind = &b[pos + 4..pos + 8];
        let body = match b.get(pos + 8..pos + 8 + len) {
            Some(s) => s,
            None => bail!("truncated PNG chunk"),
        };
        match kind {
            b"IHDR" => {
                ensure!(len >= 13, "bad IHDR");
                w = u32::from_be_bytes([body[0], body[1], body[2], body[3]]) as usize;
                h = u32::from_be_bytes([body[4], body[5], body[6], body[7]]) as usize;
                depth = body[8];
                ctype = body[9];
                interlace = body[12];
            }
            b"PLTE" => palette = body.to_vec(),
            b"IDAT" => idat.extend_from_slice(body),
            b"IEND" => break,
            _ => {}
        }
        pos += 12 + len;
    }
    ensure!(depth == 8, "only 8-bit PNG images are supported");
    ensure!(interlace == 0, "interlaced PNG images are not supported");
    let spp = match ctype {
        0 => 1,
        2 => 3,
        3 => 1,
        4 => 2,
        6 => 4,
        _ => bail!("bad PNG color type {ctype}"),
    };
    dims(&[h as i64, w as i64, 4])?;
    ensure!(idat.len() > 2, "missing PNG data");
    let stride = w * spp;
    let raw = inflate(&idat[2..], (stride + 1) * h)?;
    ensure!(raw.len() >= (stride + 1) * h, "PNG data is too short");
    let mut px = vec![0u8; stride * h];
    for y in 0..h {
        let f = raw[y * (stride + 1)];
        let src = &raw[y * (stride + 1) + 1..(y + 1) * (stride + 1)];
        for x in 0..stride {
            let a = if x >= spp {
                px[y * stride + x - spp] as i32
            } else {
                0
            };
            let up = if y > 0 {
                px[(y - 1) * stride + x] as i32
            } else {
                0
            };
            let c = if y > 0 && x >= spp {
                px[(y - 1) * stride + x - spp] as i32
            } else {
                0
            };
            let pred = match f {
                0 => 0,
                1 => a,
                2 => up,
                3 => (a + up) / 2,
                4 => {
                    let p = a + up - c;
                    let (pa, pb, pc) = ((p - a).abs(), (p - up).abs(), (p - c).abs());
                    if pa <= pb && pa <= pc {
                        a
                    } else if pb <= pc {
                        up
                    } else {
                        c
                    }
                }
                _ => bail!("bad PNG filter {f}"),
            };
            px[y * stride + x] = (src[x] as i32 + pred) as u8;
        }
    }
    let (c, data) = match ctype {
        0 | 4 => (1, (0..h * w).map(|i| px[i * spp]).collect()),
        2 | 6 => (
            3,
            (0..h * w)
                .flat_map(|i| [px[i * spp], px[i * spp + 1], px[i * spp + 2]])
                .collect(),
        ),
        _ => {
            let mut d = Vec::with_capacity(h * w * 3);
            for &i in &px {
                let i = i as usize * 3;
                match palette.get(i..i + 3) {
                    Some(s) => d.extend_from_slice(s),
                    None => bail!("PNG palette index out of range"),
                }
            }
            (3, d)
        }
    };
    Ok(Image { h, w, c, data })
}

fn image_decoder(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    let bytes: Vec<u8> = match t.array::<u8>() {
        Some(a) if t.dtype() == DType::U8 => a.iter().copied().collect(),
        _ => bail!("encoded_stream must be uint8, got {}", t.dtype()),
    };
    let fmt = ctx.attrs.string("pixel_format", "RGB".into())?;
    let img = if bytes.starts_with(b"BM") {
        decode_bmp(&bytes)?
    } else if bytes.first() == Some(&b'P') {
        decode_pnm(&bytes)?
    } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        decode_png(&bytes)?
    } else if bytes.starts_with(b"II*\0") || bytes.starts_with(b"MM\0*") {
        decode_tiff(&bytes)?
    } else {
        return Err(OpError::unsupported("ImageDecoder: this image format is not decoded (only BMP, PNG, binary PNM and uncompressed TIFF are)"));
    };
    let (h, w) = (img.h, img.w);
    let px = |i: usize| -> [u8; 3] {
        if img.c == 1 {
            let v = img.data[i];
            [v, v, v]
        } else {
            [img.data[3 * i], img.data[3 * i + 1], img.data[3 * i + 2]]
        }
    };
    let (c, data): (usize, Vec<u8>) = match fmt.as_str() {
        "RGB" => (3, (0..h * w).flat_map(px).collect()),
        "BGR" => (
            3,
            (0..h * w)
                .flat_map(|i| {
                    let [r, g, b] = px(i);
                    [b, g, r]
                })
                .collect(),
        ),
        "Grayscale" => (
            1,
            (0..h * w)
                .map(|i| {
                    if img.c == 1 {
                        img.data[i]
                    } else {
                        let [r, g, b] = px(i);
                        ((r as u32 * 19595 + g as u32 * 38470 + b as u32 * 7471 + 0x8000) >> 16)
                            as u8
                    }
                })
                .collect(),
        ),
        o => bail!("unsupported pixel_format `{o}`"),
    };
    out(Tensor::from_vec(&[h, w, c], data))
}

// ---------------------------------------------------------------------------------------
// Lowering to kernel IR
// ---------------------------------------------------------------------------------------

mod lower {
    use super::{resize_setup, resize_taps, resized_axes, upsample_setup, Mode, Pad, Setup};
    use crate::ensure;
    use crate::ir::{DType, OpError, OpResult, Tensor, Value};
    use crate::kir::build::*;
    use crate::kir::{BinOp, BufId, BufKind, CmpOp, Expr, Stmt, Ty, UnOp};
    use crate::ops::lowering::LowerCtx;
    use crate::ops::{Lowering, OpCtx, Registry};

    pub fn register(r: &mut Registry) {
        r.lower("Resize", Lowering::Custom(resize));
        r.lower("Upsample", Lowering::Custom(upsample));
        r.lower("GridSample", Lowering::Custom(grid_sample_l));
        r.lower("AffineGrid", Lowering::Custom(affine_grid_l));
        r.lower("RoiAlign", Lowering::Custom(roi_align_l));
    }

    /// RoiAlign with a fixed sampling grid (sampling_ratio > 0): the grid size would
    /// otherwise depend on the ROI values.
    fn roi_align_l(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let rois = lw.input(1)?.clone();
        let bidx = lw.input(2)?.clone();
        let y = lw.outputs[0].clone();
        let at = &lw.op.attrs;
        ensure!(x.shape.len() == 4, "X must be [N, C, H, W]");
        let half_pixel = if lw.op.opset >= 16 {
            match at
                .string("coordinate_transformation_mode", "half_pixel".into())?
                .as_str()
            {
                "half_pixel" => true,
                "output_half_pixel" => false,
                o => crate::bail!("unknown coordinate_transformation_mode `{o}`"),
            }
        } else {
            false
        };
        let max_mode = match at.string("mode", "avg".into())?.to_lowercase().as_str() {
            "avg" => false,
            "max" => true,
            o => crate::bail!("unknown mode `{o}`"),
        };
        let ph_n = at.int("output_height", 1)? as usize;
        let pw_n = at.int("output_width", 1)? as usize;
        let sr = at.int("sampling_ratio", 0)?;
        let scale = at.float("spatial_scale", 1.0)? as f64;
        if sr <= 0 {
            return Err(OpError::unsupported(
                "RoiAlign with sampling_ratio 0 (the grid depends on the ROI values)",
            ));
        }
        let (gh, gw) = (sr as usize, sr as usize);
        let (nb, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
        let nr = bidx.len();
        ensure!(rois.shape == [nr, 4], "rois shape");
        ensure!(y.len() == nr * c * ph_n * pw_n, "RoiAlign output size");
        let mut k = lw.kernel("");
        if h == 0 || w == 0 || y.is_empty() {
            let j = k.var(Ty::I64);
            k.body = vec![for_(
                j,
                y.len(),
                vec![Stmt::Store {
                    buf: y.buf,
                    index: Expr::Var(j),
                    value: out_finish(f64e(0.0), y.ty()),
                }],
            )];
            lw.push(k);
            return Ok(());
        }
        let rt = rois.ty().compute();
        let xt = x.ty().compute();
        let off = if half_pixel { 0.5 } else { 0.0 };
        let (n, ch, ph, pw, iy, ix) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let f = |k: &mut crate::kir::Kernel| k.var(Ty::F64);
        let (sw, sh, bh, bw) = (f(&mut k), f(&mut k), f(&mut k), f(&mut k));
        let (yy, xx, yf, xf, ly, lx, val, vv) = (
            f(&mut k),
            f(&mut k),
            f(&mut k),
            f(&mut k),
            f(&mut k),
            f(&mut k),
            f(&mut k),
            f(&mut k),
        );
        let (yl, yh, xl, xh, bb) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let vr = Expr::Var;
        let r = |j: usize| -> Expr {
            Expr::mul(
                to64(
                    Expr::load(rois.buf, Expr::add(Expr::mul(vr(n), int(4)), int(j))),
                    rt,
                ),
                f64e(scale),
            )
        };
        let mut pre = vec![
            set(sw, sub(r(0), f64e(off))),
            set(sh, sub(r(1), f64e(off))),
            set(bw, sub(sub(r(2), f64e(off)), vr(sw))),
            set(bh, sub(sub(r(3), f64e(off)), vr(sh))),
        ];
        if !half_pixel {
            pre.push(set(bw, bin(BinOp::Max, vr(bw), f64e(1.0))));
            pre.push(set(bh, bin(BinOp::Max, vr(bh), f64e(1.0))));
        }
        pre.push(set(bh, div(vr(bh), f64e(ph_n as f64))));
        pre.push(set(bw, div(vr(bw), f64e(pw_n as f64))));
        pre.push(set(
            bb,
            bin(
                BinOp::Max,
                bin(
                    BinOp::Min,
                    Expr::cast(Ty::I64, Expr::load(bidx.buf, vr(n))),
                    int(nb - 1),
                ),
                Expr::Int(0),
            ),
        ));
        let cf = |v: usize| Expr::cast(Ty::F64, Expr::Var(v));
        let base = Expr::mul(Expr::add(Expr::mul(vr(bb), int(c)), vr(ch)), int(h * w));
        let px = |yi: usize, xi: usize| -> Expr {
            to64(
                Expr::load(
                    x.buf,
                    Expr::add(base.clone(), Expr::add(Expr::mul(vr(yi), int(w)), vr(xi))),
                ),
                xt,
            )
        };
        let hy = || sub(f64e(1.0), vr(ly));
        let hx = || sub(f64e(1.0), vr(lx));
        let terms = vec![
            Expr::mul(Expr::mul(hy(), hx()), px(yl, xl)),
            Expr::mul(Expr::mul(hy(), vr(lx)), px(yl, xh)),
            Expr::mul(Expr::mul(vr(ly), hx()), px(yh, xl)),
            Expr::mul(Expr::mul(vr(ly), vr(lx)), px(yh, xh)),
        ];
        let combined = if max_mode {
            terms
                .into_iter()
                .reduce(|a, b| bin(BinOp::Max, a, b))
                .expect("4 terms")
        } else {
            terms.into_iter().reduce(Expr::add).expect("4 terms")
        };
        let clampdim = |fv: usize, lo_v: usize, hi_v: usize, len: usize| -> Vec<Stmt> {
            vec![
                set(fv, bin(BinOp::Max, vr(fv), f64e(0.0))),
                set(lo_v, Expr::cast(Ty::I64, vr(fv))),
                Stmt::If {
                    cond: Expr::cmp(CmpOp::Ge, vr(lo_v), int(len - 1)),
                    then: vec![
                        set(lo_v, int(len - 1)),
                        set(hi_v, int(len - 1)),
                        set(fv, f64e(len as f64 - 1.0)),
                    ],
                    els: vec![set(hi_v, Expr::add(vr(lo_v), Expr::Int(1)))],
                },
            ]
        };
        let mut inrange = vec![set(yf, vr(yy)), set(xf, vr(xx))];
        inrange.extend(clampdim(yf, yl, yh, h));
        inrange.extend(clampdim(xf, xl, xh, w));
        inrange.push(set(ly, sub(vr(yf), cf(yl))));
        inrange.push(set(lx, sub(vr(xf), cf(xl))));
        inrange.push(set(vv, combined));
        let out_of = bin(
            BinOp::Or,
            bin(
                BinOp::Or,
                Expr::cmp(CmpOp::Lt, vr(yy), f64e(-1.0)),
                Expr::cmp(CmpOp::Gt, vr(yy), f64e(h as f64)),
            ),
            bin(
                BinOp::Or,
                Expr::cmp(CmpOp::Lt, vr(xx), f64e(-1.0)),
                Expr::cmp(CmpOp::Gt, vr(xx), f64e(w as f64)),
            ),
        );
        let first = Expr::cmp(CmpOp::Eq, Expr::add(vr(iy), vr(ix)), Expr::Int(0));
        let acc = if max_mode {
            set(
                val,
                Expr::select(first, vr(vv), bin(BinOp::Max, vr(val), vr(vv))),
            )
        } else {
            set(val, Expr::add(vr(val), vr(vv)))
        };
        let sample = vec![
            set(
                xx,
                Expr::add(
                    Expr::add(vr(sw), Expr::mul(cf(pw), vr(bw))),
                    div(
                        Expr::mul(Expr::add(cf(ix), f64e(0.5)), vr(bw)),
                        f64e(gw as f64),
                    ),
                ),
            ),
            Stmt::If {
                cond: out_of,
                then: vec![set(vv, f64e(0.0))],
                els: inrange,
            },
            acc,
        ];
        let count = (gh * gw).max(1) as f64;
        let fin = if max_mode {
            vr(val)
        } else {
            div(vr(val), f64e(count))
        };
        let cell = vec![
            set(val, f64e(0.0)),
            for_(
                iy,
                gh,
                vec![
                    set(
                        yy,
                        Expr::add(
                            Expr::add(vr(sh), Expr::mul(cf(ph), vr(bh))),
                            div(
                                Expr::mul(Expr::add(cf(iy), f64e(0.5)), vr(bh)),
                                f64e(gh as f64),
                            ),
                        ),
                    ),
                    for_(ix, gw, sample),
                ],
            ),
            Stmt::Store {
                buf: y.buf,
                index: Expr::add(
                    Expr::mul(
                        Expr::add(
                            Expr::mul(Expr::add(Expr::mul(vr(n), int(c)), vr(ch)), int(ph_n)),
                            vr(ph),
                        ),
                        int(pw_n),
                    ),
                    vr(pw),
                ),
                value: out_finish(fin, y.ty()),
            },
        ];
        pre.push(for_(
            ch,
            c,
            vec![for_(ph, ph_n, vec![for_(pw, pw_n, cell)])],
        ));
        k.body = vec![for_(n, nr, pre)];
        lw.push(k);
        Ok(())
    }

    fn f64e(x: f64) -> Expr {
        Expr::f(x, Ty::F64)
    }
    fn sub(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Sub, a, b)
    }
    fn div(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Div, a, b)
    }
    fn set(var: usize, value: Expr) -> Stmt {
        Stmt::Set { var, value }
    }
    /// Rounds through f32 when `on`.
    fn r32(e: Expr, on: bool) -> Expr {
        if on {
            Expr::cast(Ty::F64, Expr::cast(Ty::F32, e))
        } else {
            e
        }
    }
    /// The reference's `reflect(x, lo, hi)` on an F64 expression (x evaluated often: pass
    /// a variable).
    fn reflect_e(x: Expr, lo: f64, hi: f64) -> Expr {
        let rng = hi - lo;
        if rng <= 0.0 {
            return f64e(lo);
        }
        let side = |dx: Expr, near: f64, far: f64| -> Expr {
            let n = Expr::un(UnOp::Trunc, div(dx.clone(), f64e(rng)));
            let r = sub(dx, Expr::mul(n.clone(), f64e(rng)));
            let even = Expr::cmp(
                CmpOp::Eq,
                bin(BinOp::Rem, Expr::cast(Ty::I64, n), Expr::Int(2)),
                Expr::Int(0),
            );
            let near_v = if near < far {
                Expr::add(f64e(near), r.clone())
            } else {
                sub(f64e(near), r.clone())
            };
            let far_v = if near < far {
                sub(f64e(far), r)
            } else {
                Expr::add(f64e(far), r)
            };
            Expr::select(even, near_v, far_v)
        };
        let below = side(sub(f64e(lo), x.clone()), lo, hi);
        let above = side(sub(x.clone(), f64e(hi)), hi, lo);
        Expr::select(
            Expr::cmp(CmpOp::Lt, x.clone(), f64e(lo)),
            below,
            Expr::select(Expr::cmp(CmpOp::Gt, x.clone(), f64e(hi)), above, x),
        )
    }

    fn out_finish(e: Expr, ot: Ty) -> Expr {
        let oc = ot.compute();
        if oc == Ty::F64 {
            e
        } else if oc.is_float() {
            Expr::cast(oc, e)
        } else {
            let (lo, hi) = match ot {
                Ty::I8 => (i8::MIN as f64, i8::MAX as f64),
                Ty::U8 => (0.0, u8::MAX as f64),
                Ty::I16 => (i16::MIN as f64, i16::MAX as f64),
                Ty::U16 => (0.0, u16::MAX as f64),
                Ty::I32 => (i32::MIN as f64, i32::MAX as f64),
                Ty::U32 => (0.0, u32::MAX as f64),
                _ => return Expr::cast(oc, Expr::un(UnOp::Nearest, e)),
            };
            let r = Expr::un(UnOp::Nearest, e.clone());
            let r = bin(BinOp::Max, bin(BinOp::Min, r, f64e(hi)), f64e(lo));
            Expr::cast(
                oc,
                Expr::select(Expr::cmp(CmpOp::Ne, e.clone(), e), f64e(0.0), r),
            )
        }
    }

    fn grid_sample_l(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let g = lw.input(1)?.clone();
        let y = lw.outputs[0].clone();
        let at = &lw.op.attrs;
        let default_mode = if lw.op.opset >= 20 {
            "linear"
        } else {
            "bilinear"
        };
        let mode = super::parse_mode(&at.string("mode", default_mode.into())?)?;
        let pad = match at.string("padding_mode", "zeros".into())?.as_str() {
            "zeros" => Pad::Zeros,
            "border" => Pad::Border,
            "reflection" => Pad::Reflection,
            o => crate::bail!("unknown padding_mode `{o}`"),
        };
        let align = at.int("align_corners", 0)? != 0;
        let xs = x.shape.clone();
        let gs = g.shape.clone();
        ensure!(xs.len() >= 3, "X must have rank >= 3");
        let kd = xs.len() - 2;
        ensure!(
            gs.len() == kd + 2 && gs[0] == xs[0] && gs[kd + 1] == kd,
            "grid shape"
        );
        let (n, c) = (xs[0], xs[1]);
        let sp = xs[2..].to_vec();
        let in_sz: usize = sp.iter().product();
        let out_sz: usize = gs[1..kd + 1].iter().product();
        let st = crate::ops::lowering::strides(&sp);
        let round32 = g.dtype != DType::F64;
        let gt = g.ty().compute();
        let xt = x.ty().compute();
        let ot = y.ty();
        let mut k = lw.kernel("");
        if in_sz == 0 || y.is_empty() {
            let j = k.var(Ty::I64);
            k.body = vec![for_(
                j,
                y.len(),
                vec![Stmt::Store {
                    buf: y.buf,
                    index: Expr::Var(j),
                    value: out_finish(f64e(0.0), ot),
                }],
            )];
            lw.push(k);
            return Ok(());
        }
        let (b, o, ch) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let mut pre = Vec::new();
        // Per dim: taps of (idx var, valid var, weight var).
        let mut taps: Vec<Vec<(usize, usize, usize)>> = Vec::new();
        for (d, &len) in sp.iter().enumerate().take(kd) {
            let len = len as f64;
            let (lo, hi) = if align {
                (0.0, len - 1.0)
            } else {
                (-0.5, len - 0.5)
            };
            let pv = k.var(Ty::F64);
            let gidx = Expr::add(
                Expr::mul(
                    Expr::add(Expr::mul(Expr::Var(b), int(out_sz)), Expr::Var(o)),
                    int(kd),
                ),
                int(kd - 1 - d),
            );
            let nv = to64(Expr::load(g.buf, gidx), gt);
            let val = if align {
                Expr::mul(div(Expr::add(nv, f64e(1.0)), f64e(2.0)), f64e(len - 1.0))
            } else {
                div(
                    sub(Expr::mul(Expr::add(nv, f64e(1.0)), f64e(len)), f64e(1.0)),
                    f64e(2.0),
                )
            };
            pre.push(set(pv, r32(val, round32)));
            if mode == Mode::Nearest {
                pre.push(set(pv, Expr::un(UnOp::Nearest, Expr::Var(pv))));
            }
            if pad != Pad::Zeros {
                let fixed = match pad {
                    Pad::Border => bin(
                        BinOp::Max,
                        bin(BinOp::Min, Expr::Var(pv), f64e(len - 1.0)),
                        f64e(0.0),
                    ),
                    _ => reflect_e(Expr::Var(pv), lo, hi),
                };
                pre.push(Stmt::If {
                    cond: bin(
                        BinOp::Or,
                        Expr::cmp(CmpOp::Lt, Expr::Var(pv), f64e(lo)),
                        Expr::cmp(CmpOp::Gt, Expr::Var(pv), f64e(hi)),
                    ),
                    then: vec![set(pv, r32(fixed, round32))],
                    els: vec![],
                });
            }
            let fl = k.var(Ty::F64);
            let i0 = k.var(Ty::I64);
            pre.push(set(fl, Expr::un(UnOp::Floor, Expr::Var(pv))));
            pre.push(set(
                i0,
                Expr::cast(
                    Ty::I64,
                    if mode == Mode::Nearest {
                        Expr::Var(pv)
                    } else {
                        Expr::Var(fl)
                    },
                ),
            ));
            let rr = sub(Expr::Var(pv), Expr::Var(fl));
            let (offs, ws): (Vec<i64>, Vec<Expr>) = match mode {
                Mode::Nearest => (vec![0], vec![f64e(1.0)]),
                Mode::Linear => (vec![0, 1], vec![sub(f64e(1.0), rr.clone()), rr]),
                Mode::Cubic => {
                    let a = -0.75;
                    let xv = k.var(Ty::F64);
                    pre.push(set(xv, Expr::un(UnOp::Abs, rr)));
                    let x = || Expr::Var(xv);
                    let m = |p: Expr, q: Expr| Expr::mul(p, q);
                    let ad = |p: Expr, q: Expr| Expr::add(p, q);
                    let x1 = || ad(x(), f64e(1.0));
                    let omx = || sub(f64e(1.0), x());
                    let tmx = || sub(f64e(2.0), x());
                    let w0 = sub(
                        m(
                            ad(m(sub(m(f64e(a), x1()), f64e(5.0 * a)), x1()), f64e(8.0 * a)),
                            x1(),
                        ),
                        f64e(4.0 * a),
                    );
                    let w1 = ad(
                        m(m(sub(m(f64e(a + 2.0), x()), f64e(a + 3.0)), x()), x()),
                        f64e(1.0),
                    );
                    let w2 = ad(
                        m(m(sub(m(f64e(a + 2.0), omx()), f64e(a + 3.0)), omx()), omx()),
                        f64e(1.0),
                    );
                    let w3 = sub(
                        m(
                            ad(
                                m(sub(m(f64e(a), tmx()), f64e(5.0 * a)), tmx()),
                                f64e(8.0 * a),
                            ),
                            tmx(),
                        ),
                        f64e(4.0 * a),
                    );
                    (vec![-1, 0, 1, 2], vec![w0, w1, w2, w3])
                }
            };
            let mut t = Vec::new();
            let ilen = sp[d] as i64;
            for (off, w) in offs.into_iter().zip(ws) {
                let iv = k.var(Ty::I64);
                let vv = k.var(Ty::U8);
                let wv = k.var(Ty::F64);
                let raw = Expr::add(Expr::Var(i0), Expr::Int(off));
                let clamp = |e: Expr| {
                    bin(
                        BinOp::Max,
                        bin(BinOp::Min, e, Expr::Int(ilen - 1)),
                        Expr::Int(0),
                    )
                };
                let (idx, valid) = match pad {
                    Pad::Zeros => (
                        clamp(raw.clone()),
                        bin(
                            BinOp::And,
                            Expr::cmp(CmpOp::Ge, raw.clone(), Expr::Int(0)),
                            Expr::cmp(CmpOp::Lt, raw, Expr::Int(ilen)),
                        ),
                    ),
                    Pad::Border => (clamp(raw), Expr::cast(Ty::U8, Expr::Int(1))),
                    Pad::Reflection => (
                        clamp(Expr::cast(
                            Ty::I64,
                            reflect_e(Expr::cast(Ty::F64, raw), lo, hi),
                        )),
                        Expr::cast(Ty::U8, Expr::Int(1)),
                    ),
                };
                let valid = if mode == Mode::Nearest {
                    // Non-finite positions read nothing.
                    bin(
                        BinOp::And,
                        valid,
                        Expr::cmp(CmpOp::Eq, sub(Expr::Var(pv), Expr::Var(pv)), f64e(0.0)),
                    )
                } else {
                    valid
                };
                pre.push(set(iv, idx));
                pre.push(set(vv, valid));
                pre.push(set(wv, w));
                t.push((iv, vv, wv));
            }
            taps.push(t);
        }
        // Tensor product of the taps.
        let mut combos: Vec<(Expr, Expr, Expr)> =
            vec![(Expr::Int(0), Expr::cast(Ty::U8, Expr::Int(1)), f64e(1.0))];
        for (d, t) in taps.iter().enumerate() {
            let mut next = Vec::new();
            for (off, val, w) in &combos {
                for &(iv, vv, wv) in t {
                    let term = Expr::mul(Expr::Var(iv), int(st[d]));
                    let noff = if d == 0 {
                        term
                    } else {
                        Expr::add(off.clone(), term)
                    };
                    let nval = if d == 0 {
                        Expr::Var(vv)
                    } else {
                        bin(BinOp::And, val.clone(), Expr::Var(vv))
                    };
                    let nw = Expr::mul(w.clone(), Expr::Var(wv));
                    next.push((noff, nval, nw));
                }
            }
            combos = next;
        }
        let acc = k.var(Ty::F64);
        let base = Expr::mul(
            Expr::add(Expr::mul(Expr::Var(b), int(c)), Expr::Var(ch)),
            int(in_sz),
        );
        let mut inner = vec![set(acc, f64e(0.0))];
        // Precompute combined weights/offsets per combo as vars outside the channel loop.
        let mut cvars = Vec::new();
        for (off, val, w) in combos {
            let ov = k.var(Ty::I64);
            let vv = k.var(Ty::U8);
            let wv = k.var(Ty::F64);
            pre.push(set(ov, off));
            pre.push(set(vv, val));
            pre.push(set(wv, w));
            cvars.push((ov, vv, wv));
        }
        for (ov, vv, wv) in cvars {
            let xv = to64(
                Expr::load(x.buf, Expr::add(base.clone(), Expr::Var(ov))),
                xt,
            );
            inner.push(Stmt::If {
                cond: Expr::Var(vv),
                then: vec![set(
                    acc,
                    Expr::add(Expr::Var(acc), Expr::mul(Expr::Var(wv), xv)),
                )],
                els: vec![],
            });
        }
        inner.push(Stmt::Store {
            buf: y.buf,
            index: Expr::add(
                Expr::mul(
                    Expr::add(Expr::mul(Expr::Var(b), int(c)), Expr::Var(ch)),
                    int(out_sz),
                ),
                Expr::Var(o),
            ),
            value: out_finish(Expr::Var(acc), ot),
        });
        pre.push(for_(ch, c, inner));
        k.body = vec![for_(b, n, vec![for_(o, out_sz, pre)])];
        lw.push(k);
        Ok(())
    }

    fn affine_grid_l(lw: &mut LowerCtx) -> OpResult<()> {
        let th = lw.input(0)?.clone();
        let size: Vec<i64> = super::ints(lw.const_input(1)?)?;
        let align = lw.op.attrs.int("align_corners", 0)? != 0;
        ensure!(
            size.len() == 4 || size.len() == 5,
            "size must have 4 or 5 values"
        );
        let kd = size.len() - 2;
        let sp: Vec<usize> = size[2..].iter().map(|&v| v as usize).collect();
        let n = th.shape[0];
        let y = lw.outputs[0].clone();
        let tt = th.ty().compute();
        let ot = y.ty();
        let total: usize = sp.iter().product();
        let mut k = lw.kernel("");
        let b = k.var(Ty::I64);
        let ivars: Vec<usize> = (0..kd).map(|_| k.var(Ty::I64)).collect();
        let coord = |d: usize| -> Expr {
            let len = sp[d];
            let i = Expr::cast(Ty::F64, Expr::Var(ivars[d]));
            if align {
                if len == 1 {
                    f64e(-1.0)
                } else {
                    Expr::add(
                        f64e(-1.0),
                        div(Expr::mul(i, f64e(2.0)), f64e(len as f64 - 1.0)),
                    )
                }
            } else {
                let step = 2.0 / len as f64;
                Expr::add(f64e(-1.0 + step / 2.0), Expr::mul(i, f64e(step)))
            }
        };
        let mut h: Vec<Expr> = (0..kd).rev().map(coord).collect();
        h.push(f64e(1.0));
        let pos = crate::ops::lowering::index(&ivars, &crate::ops::lowering::strides(&sp));
        let mut body = Vec::new();
        for row in 0..kd {
            let mut acc: Option<Expr> = None;
            for (j, hj) in h.iter().enumerate() {
                let t = to64(
                    Expr::load(
                        th.buf,
                        Expr::add(
                            Expr::mul(Expr::Var(b), int(kd * (kd + 1))),
                            int(row * (kd + 1) + j),
                        ),
                    ),
                    tt,
                );
                let term = Expr::mul(t, hj.clone());
                acc = Some(match acc {
                    None => term,
                    Some(a) => Expr::add(a, term),
                });
            }
            body.push(Stmt::Store {
                buf: y.buf,
                index: Expr::add(
                    Expr::mul(
                        Expr::add(Expr::mul(Expr::Var(b), int(total)), pos.clone()),
                        int(kd),
                    ),
                    int(row),
                ),
                value: out_finish(acc.expect("k > 0"), ot),
            });
        }
        let mut nest = body;
        for d in (0..kd).rev() {
            nest = vec![for_(ivars[d], sp[d], nest)];
        }
        k.body = vec![for_(b, n, nest)];
        lw.push(k);
        Ok(())
    }

    fn resize(lw: &mut LowerCtx) -> OpResult<()> {
        lower_resize(lw, resize_setup)
    }

    fn upsample(lw: &mut LowerCtx) -> OpResult<()> {
        lower_resize(lw, upsample_setup)
    }

    fn for_(var: usize, n: usize, body: Vec<Stmt>) -> Stmt {
        Stmt::For {
            var,
            extent: n as u64,
            body,
        }
    }

    /// The factor `k` when an axis's taps copy input element `o / k` to every output
    /// position `o` (one tap of weight 1, the others 0, no extrapolation): nearest
    /// upsampling by an integer factor, whatever the coordinate mode that led there.
    fn replication(taps: &super::Taps, inw: usize) -> Option<usize> {
        let k = taps.len() / inw;
        if k == 0 || k * inw != taps.len() {
            return None;
        }
        let copies = taps.iter().enumerate().all(|(o, (idx, w, ex))| {
            !ex && w.iter().filter(|&&x| x != 0.0).count() == 1
                && idx
                    .iter()
                    .zip(w)
                    .all(|(&i, &x)| x == 0.0 || (x == 1.0 && i == o / k))
        });
        copies.then_some(k)
    }

    /// `out[p][y kh + ry][x kw + rx] = x[p][y][x]` over planes `p`: nearest upsampling by
    /// integer factors as unit-stride reads and stores every `kw`-th element, which the
    /// loops vectorise. The separable tap tables (f64, an f64 plane between the axes) took
    /// 2.66 ms for a 2x upsampling of `[1, 64, 56, 56]` that ONNX Runtime does in 0.62.
    fn replicate(
        lw: &mut LowerCtx,
        x: &crate::ops::lowering::TensorRef,
        out: &crate::ops::lowering::TensorRef,
        [kh, kw]: [usize; 2],
    ) {
        let planes = x.shape[0] * x.shape[1];
        let (ih, iw) = (x.shape[2], x.shape[3]);
        let (oh, ow) = (out.shape[2], out.shape[3]);
        let mut k = lw.kernel("");
        let (pv, yv, ry, rx, xv) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let src = lin(vec![(v(pv), ih * iw), (v(yv), iw), (v(xv), 1)]);
        let dst = lin(vec![
            (v(pv), oh * ow),
            (v(yv), kh * ow),
            (v(ry), ow),
            (v(xv), kw),
            (v(rx), 1),
        ]);
        k.body = loops(
            &[(pv, planes), (yv, ih), (ry, kh), (rx, kw), (xv, iw)],
            vec![store(out.buf, dst, Expr::load(x.buf, src))],
        );
        lw.push(k);
    }

    /// One phase of an axis upsampled by an integer factor `f` with two taps per output:
    /// outputs `f i + ph` for `i` in `lo..hi` read inputs `i + a` and `i + b` with
    /// weights `w`.
    struct Phase {
        lo: usize,
        hi: usize,
        a: i64,
        b: i64,
        w: [f64; 2],
    }

    /// The factor and phases when an axis's two-tap table (no extrapolation) is, away
    /// from the edges, the same taps shifted by one input per `f` outputs (linear
    /// upsampling by an integer factor, any coordinate mode); outputs outside the phases'
    /// runs are the edges.
    fn periodic(taps: &super::Taps, inw: usize) -> Option<(usize, Vec<Phase>)> {
        let f = taps.len() / inw;
        if f == 0 || f * inw != taps.len() || taps.iter().any(|t| t.2 || t.0.len() != 2) {
            return None;
        }
        let key = |i: usize, ph: usize| {
            let (idx, w, _) = &taps[f * i + ph];
            let off = |k: usize| idx[k] as i64 - i as i64;
            (off(0), off(1), [w[0], w[1]])
        };
        // Weights equal to far below f32's precision (coordinates like `(o + 0.5) / 3`
        // round differently from one output to the next).
        let same = |a: &(i64, i64, [f64; 2]), b: &(i64, i64, [f64; 2])| {
            a.0 == b.0 && a.1 == b.1 && (0..2).all(|j| (a.2[j] - b.2[j]).abs() <= 1e-12)
        };
        let mid = inw / 2;
        let mut phases = Vec::with_capacity(f);
        for ph in 0..f {
            let k = key(mid, ph);
            let run = |i: &usize| same(&key(*i, ph), &k);
            let lo = (0..mid).rev().take_while(run).last().unwrap_or(mid);
            let hi = (mid..inw).take_while(run).last()? + 1;
            // Mostly interior (a row of edges runs one element at a time).
            if 2 * (hi - lo) < inw {
                return None;
            }
            phases.push(Phase {
                lo,
                hi,
                a: k.0,
                b: k.1,
                w: k.2,
            });
        }
        Some((f, phases))
    }

    /// Linear upsampling of the last two axes of an f32 `[n, c, h, w]` tensor with two
    /// taps per axis, the columns by an integer factor (see [`periodic`]): per output row,
    /// its two input rows and weights read from tables, then per phase a unit-stride loop
    /// `out[f i + ph] = w0 (wy0 x[y0][i + a] + wy1 x[y1][i + a]) + w1 (wy0 x[y0][i + b] +
    /// wy1 x[y1][i + b])` stored every `f`-th element (the loops vectorise it), the edge
    /// columns one by one. In f32 (the reference sums in f64: within a few ulp), no
    /// intermediate plane: the separable f64 tables took 2.66 ms for a 2x upsampling of
    /// `[1, 64, 56, 56]` (ONNX Runtime 1.6).
    fn bilinear(
        lw: &mut LowerCtx,
        x: &crate::ops::lowering::TensorRef,
        out: &crate::ops::lowering::TensorRef,
        ytaps: &super::Taps,
        (f, phases): (usize, Vec<Phase>),
        xtaps: &super::Taps,
    ) -> OpResult<()> {
        let planes = x.shape[0] * x.shape[1];
        let (ih, iw) = (x.shape[2], x.shape[3]);
        let (oh, ow) = (out.shape[2], out.shape[3]);
        let yidx: Vec<i32> = ytaps
            .iter()
            .flat_map(|t| t.0.iter().map(|&i| i as i32))
            .collect();
        let yw: Vec<f32> = ytaps
            .iter()
            .flat_map(|t| t.1.iter().map(|&w| w as f32))
            .collect();
        let yidx_b = lw.constant("yidx", &Tensor::from_vec(&[yidx.len()], yidx))?;
        let yw_b = lw.constant("yw", &Tensor::from_vec(&[yw.len()], yw))?;
        let mut k = lw.kernel("bilinear");
        let (pv, oy, iv) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let (y0, y1) = (k.var(Ty::I64), k.var(Ty::I64));
        let (wy0, wy1) = (k.var(Ty::F32), k.var(Ty::F32));
        let f32c = |w: f64| Expr::f(w, Ty::F32);
        // w0 (wy0 x[y0][c0] + wy1 x[y1][c0]) + w1 (wy0 x[y0][c1] + wy1 x[y1][c1]).
        let value = |c0: Expr, c1: Expr, w: [f64; 2]| {
            let col = |c: Expr| {
                let at = |y: usize| {
                    let i = lin(vec![(v(pv), ih * iw), (v(y), iw)]);
                    Expr::load(x.buf, Expr::add(i, c.clone()))
                };
                Expr::add(Expr::mul(v(wy0), at(y0)), Expr::mul(v(wy1), at(y1)))
            };
            Expr::add(
                Expr::mul(f32c(w[0]), col(c0)),
                Expr::mul(f32c(w[1]), col(c1)),
            )
        };
        let row = lin(vec![(v(pv), oh * ow), (v(oy), ow)]);
        let tap = |t: i64| Expr::add(Expr::mul(v(oy), Expr::Int(2)), Expr::Int(t));
        let mut body = vec![
            Stmt::Set {
                var: y0,
                value: Expr::cast(Ty::I64, Expr::load(yidx_b, tap(0))),
            },
            Stmt::Set {
                var: y1,
                value: Expr::cast(Ty::I64, Expr::load(yidx_b, tap(1))),
            },
            Stmt::Set {
                var: wy0,
                value: Expr::load(yw_b, tap(0)),
            },
            Stmt::Set {
                var: wy1,
                value: Expr::load(yw_b, tap(1)),
            },
        ];
        for (ph, p) in phases.iter().enumerate() {
            // i = iv + lo.
            let i = Expr::add(v(iv), Expr::Int(p.lo as i64));
            let dst = Expr::add(
                row.clone(),
                Expr::add(
                    Expr::mul(i.clone(), Expr::Int(f as i64)),
                    Expr::Int(ph as i64),
                ),
            );
            let val = value(
                Expr::add(i.clone(), Expr::Int(p.a)),
                Expr::add(i, Expr::Int(p.b)),
                p.w,
            );
            body.push(for_(iv, p.hi - p.lo, vec![store(out.buf, dst, val)]));
        }
        for (ox, (idx, w, _)) in xtaps.iter().enumerate() {
            let (i, ph) = (ox / f, ox % f);
            if (phases[ph].lo..phases[ph].hi).contains(&i) {
                continue;
            }
            let c = |k: usize| Expr::Int(idx[k] as i64);
            let dst = Expr::add(row.clone(), Expr::Int(ox as i64));
            body.push(store(out.buf, dst, value(c(0), c(1), [w[0], w[1]])));
        }
        k.body = loops(&[(pv, planes), (oy, oh)], body);
        lw.push(k);
        Ok(())
    }

    /// How a resize op derives its per-axis setup from the input shape and inputs.
    type SetupFn = fn(&OpCtx, &[usize], &[Option<&Value>]) -> OpResult<Setup>;

    /// Separable resize: one kernel per changed axis, each a weighted sum of source
    /// elements through per-axis tap tables computed at compile time (like the reference).
    fn lower_resize(lw: &mut LowerCtx, setup: SetupFn) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let mut vals: Vec<Option<Value>> = vec![None];
        for i in 1..lw.inputs.len() {
            vals.push(match lw.opt_input(i) {
                None => None,
                Some(t) => match &t.value {
                    Some(v) => Some(Value::Tensor(v.clone())),
                    None if t.is_empty() => None,
                    None => {
                        return Err(OpError::unsupported(format!(
                            "input {i} must be a constant to compile Resize"
                        )))
                    }
                },
            });
        }
        let refs: Vec<Option<&Value>> = vals.iter().map(|v| v.as_ref()).collect();
        let (scales, sizes, roi, p) = setup(lw.op, &x.shape, &refs)?;
        let out = lw.outputs[0].clone();
        ensure!(
            out.shape == sizes,
            "Resize output shape {:?} vs {sizes:?}",
            out.shape
        );
        let xt = x.ty().compute();
        let ot = out.ty();
        ensure!(ot == x.ty(), "Resize output type");
        let steps = resized_axes(&x.shape, &scales, &sizes, roi.as_deref());
        // Current source: (buffer, its compute type, shape).
        let mut cur: (BufId, Ty, Vec<usize>) = (x.buf, xt, x.shape.clone());
        let finish = |e: Expr, from: Ty| -> Expr {
            let oc = ot.compute();
            if oc.is_float() {
                if from == oc {
                    e
                } else {
                    Expr::cast(oc, e)
                }
            } else if from.is_float() {
                Expr::cast(oc, Expr::un(UnOp::Nearest, e))
            } else if from == oc {
                e
            } else {
                Expr::cast(oc, e)
            }
        };
        if steps.is_empty() || out.is_empty() || x.is_empty() {
            let mut k = lw.kernel("copy");
            let j = k.var(Ty::I64);
            let n = out.len();
            k.body = if x.is_empty() || out.is_empty() {
                vec![for_(
                    j,
                    n,
                    vec![Stmt::Store {
                        buf: out.buf,
                        index: Expr::Var(j),
                        value: finish(Expr::f(0.0, Ty::F64), Ty::F64),
                    }],
                )]
            } else {
                vec![for_(
                    j,
                    n,
                    vec![Stmt::Store {
                        buf: out.buf,
                        index: Expr::Var(j),
                        value: finish(Expr::load(x.buf, Expr::Var(j)), xt),
                    }],
                )]
            };
            lw.push(k);
            return Ok(());
        }
        // Each resized axis's tap table (a step changes only its own axis, so its input
        // length is the input's).
        let tables = steps
            .iter()
            .map(|&(ax, lo, hi)| resize_taps(x.shape[ax], scales[ax], sizes[ax], (lo, hi), &p))
            .collect::<OpResult<Vec<_>>>()?;
        // Integer-factor nearest upsampling of the last two axes: one copy kernel.
        if x.shape.len() == 4 && x.ty() == Ty::F32 && ot == x.ty() {
            let mut factor = [1usize; 2];
            let mut all = true;
            for (&(ax, _, _), taps) in steps.iter().zip(&tables) {
                match (ax >= 2).then(|| replication(taps, x.shape[ax])).flatten() {
                    Some(k) => factor[ax - 2] = k,
                    None => all = false,
                }
            }
            if all {
                replicate(lw, &x, &out, factor);
                return Ok(());
            }
            // Two-tap (linear) upsampling of both axes, the columns by an integer factor.
            if let ([(2, ..), (3, ..)], [ytaps, xtaps]) = (&steps[..], &tables[..]) {
                let two =
                    |t: &super::Taps| t.iter().all(|(i, w, e)| !e && i.len() == 2 && w.len() == 2);
                if two(ytaps) {
                    if let Some(per) = periodic(xtaps, x.shape[3]) {
                        return bilinear(lw, &x, &out, ytaps, per, xtaps);
                    }
                }
            }
        }
        let nsteps = steps.len();
        for (si, (&(ax, _, _), taps)) in steps.iter().zip(&tables).enumerate() {
            let (src, st, shape) = cur.clone();
            let inw = shape[ax];
            let olen = sizes[ax];
            let n = taps[0].0.len();
            ensure!(
                taps.iter().all(|t| t.0.len() == n && t.1.len() == n),
                "Resize taps of varying width"
            );
            let idx: Vec<i32> = taps
                .iter()
                .flat_map(|t| t.0.iter().map(|&i| i as i32))
                .collect();
            let w: Vec<f64> = taps.iter().flat_map(|t| t.1.iter().copied()).collect();
            let ex: Vec<u8> = taps.iter().map(|t| t.2 as u8).collect();
            let any_ex = ex.iter().any(|&e| e != 0);
            let idx_b = lw.constant(&format!("idx{ax}"), &Tensor::from_vec(&[idx.len()], idx))?;
            let w_b = lw.constant(&format!("w{ax}"), &Tensor::from_vec(&[w.len()], w))?;
            let ex_b = if any_ex {
                Some(lw.constant(&format!("ex{ax}"), &Tensor::from_vec(&[ex.len()], ex))?)
            } else {
                None
            };
            let mut oshape = shape.clone();
            oshape[ax] = olen;
            let last = si + 1 == nsteps;
            let dst = if last {
                out.buf
            } else {
                let name = format!("{}/step{si}", lw.name);
                lw.program.add_buffer(
                    name,
                    BufKind::Arena { offset: 0 },
                    Ty::F64,
                    oshape.iter().product::<usize>() as u64,
                )
            };
            let outer: usize = shape[..ax].iter().product();
            let inner: usize = shape[ax + 1..].iter().product();
            let mut k = lw.kernel(&format!("axis{ax}"));
            let (a, o, b, t) = (
                k.var(Ty::I64),
                k.var(Ty::I64),
                k.var(Ty::I64),
                k.var(Ty::I64),
            );
            let acc = k.var(Ty::F64);
            let tap = Expr::add(Expr::mul(Expr::Var(o), int(n)), Expr::Var(t));
            let si_ = Expr::cast(Ty::I64, Expr::load(idx_b, tap.clone()));
            let src_idx = Expr::add(
                Expr::mul(
                    Expr::add(Expr::mul(Expr::Var(a), int(inw)), si_),
                    int(inner),
                ),
                Expr::Var(b),
            );
            let sv = Expr::load(src, src_idx);
            let sv = if st == Ty::F64 {
                sv
            } else {
                Expr::cast(Ty::F64, sv)
            };
            let mut val = Expr::Var(acc);
            if let Some(eb) = ex_b {
                val = Expr::select(
                    Expr::load(eb, Expr::Var(o)),
                    Expr::f(p.extrapolation, Ty::F64),
                    val,
                );
            }
            let val = if last { finish(val, Ty::F64) } else { val };
            let didx = Expr::add(
                Expr::mul(
                    Expr::add(Expr::mul(Expr::Var(a), int(olen)), Expr::Var(o)),
                    int(inner),
                ),
                Expr::Var(b),
            );
            k.body = vec![for_(
                a,
                outer,
                vec![for_(
                    o,
                    olen,
                    vec![for_(
                        b,
                        inner,
                        vec![
                            Stmt::Set {
                                var: acc,
                                value: Expr::f(0.0, Ty::F64),
                            },
                            for_(
                                t,
                                n,
                                vec![Stmt::Set {
                                    var: acc,
                                    value: Expr::add(
                                        Expr::Var(acc),
                                        Expr::mul(sv, Expr::load(w_b, tap)),
                                    ),
                                }],
                            ),
                            Stmt::Store {
                                buf: dst,
                                index: didx,
                                value: val,
                            },
                        ],
                    )],
                )],
            )];
            lw.push(k);
            cur = (dst, Ty::F64, oshape);
        }
        Ok(())
    }
}
