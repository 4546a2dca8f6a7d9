//! Signal ops: DFT, STFT, the window functions and MelWeightMatrix.
//!
//! Complex values are held as the trailing dimension of size 2 (real, imaginary); a
//! trailing dimension of size 1 is a real signal. Transforms are computed in f64 with a
//! direct O(n^2) DFT (exact twiddles via index reduction modulo n).

use super::util::{axis as norm_axis, dims, f64s, input, opt_input, out, scalar_f64, scalar_i64};
use super::{OpCtx, Registry};
use crate::ir::{DType, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{ArrayD, Axis, IxDyn};

pub fn register(r: &mut Registry) {
    r.add_shaped("DFT", dft, &[1, 2]);
    r.add_shaped("STFT", stft, &[1, 3]);
    r.add_shaped("HannWindow", hann, &[0]);
    r.add_shaped("HammingWindow", hamming, &[0]);
    r.add_shaped("BlackmanWindow", blackman, &[0]);
    r.add_shaped("MelWeightMatrix", mel, &[0, 1, 2, 3, 4]);
    lower::register(r);
}

type C = (f64, f64);

/// Splits a tensor with a trailing dimension of 1 or 2 into a complex array.
fn to_complex(t: &Tensor) -> OpResult<ArrayD<C>> {
    ensure!(
        t.dtype().is_float(),
        "expected a float tensor, got {}",
        t.dtype()
    );
    let a = f64s(t)?;
    let s = a.shape().to_vec();
    ensure!(
        !s.is_empty() && (s[s.len() - 1] == 1 || s[s.len() - 1] == 2),
        "the last dimension must be 1 (real) or 2 (complex), got shape {s:?}"
    );
    let last = s.len() - 1;
    let c = s[last];
    let a = a.as_standard_layout().into_owned();
    let flat = a.as_slice().unwrap_or(&[]);
    let v: Vec<C> = flat
        .chunks(c)
        .map(|ch| (ch[0], if c == 2 { ch[1] } else { 0.0 }))
        .collect();
    Ok(ArrayD::from_shape_vec(IxDyn(&s[..last]), v).expect("sizes match"))
}

/// Joins a complex array back into a tensor with a trailing dimension of 2 (or 1 when
/// `real_only`).
fn from_complex(dt: DType, a: &ArrayD<C>, real_only: bool) -> Tensor {
    let mut s = a.shape().to_vec();
    let mut v = Vec::with_capacity(a.len() * 2);
    for &(re, im) in a.iter() {
        v.push(re);
        if !real_only {
            v.push(im);
        }
    }
    s.push(if real_only { 1 } else { 2 });
    Tensor::from_f64(
        dt,
        ArrayD::from_shape_vec(IxDyn(&s), v).expect("sizes match"),
        false,
    )
}

/// A DFT of length `n` of one lane (zero-padded or truncated to n), keeping `keep` bins.
fn dft_lane(x: &[C], n: usize, keep: usize, inverse: bool) -> Vec<C> {
    let sign = if inverse { 1.0 } else { -1.0 };
    let m = x.len().min(n);
    let tw: Vec<C> = (0..n)
        .map(|k| {
            let ang = sign * 2.0 * std::f64::consts::PI * k as f64 / n as f64;
            (ang.cos(), ang.sin())
        })
        .collect();
    (0..keep)
        .map(|k| {
            let (mut re, mut im) = (0.0, 0.0);
            for (j, &(xr, xi)) in x.iter().take(m).enumerate() {
                let (c, s) = tw[(k * j) % n];
                re += xr * c - xi * s;
                im += xr * s + xi * c;
            }
            if inverse {
                (re / n as f64, im / n as f64)
            } else {
                (re, im)
            }
        })
        .collect()
}

/// Applies `f` to every lane of `a` along `ax`, producing lanes of length `out_len`.
fn map_lanes(a: &ArrayD<C>, ax: usize, out_len: usize, f: impl Fn(&[C]) -> Vec<C>) -> ArrayD<C> {
    let mut s = a.shape().to_vec();
    s[ax] = out_len;
    let mut o = ArrayD::from_elem(IxDyn(&s), (0.0, 0.0));
    for (lin, mut lout) in a.lanes(Axis(ax)).into_iter().zip(o.lanes_mut(Axis(ax))) {
        let v: Vec<C> = lin.iter().copied().collect();
        let r = f(&v);
        for (dst, src) in lout.iter_mut().zip(r) {
            *dst = src;
        }
    }
    o
}

/// The core DFT on a complex array.
fn dft_core(
    x: &ArrayD<C>,
    ax: usize,
    n: usize,
    inverse: bool,
    onesided: bool,
    single: bool,
) -> OpResult<(ArrayD<C>, bool)> {
    ensure!(n >= 1, "dft_length must be positive, got {n}");
    if inverse && onesided {
        // Inverse of a one-sided (Hermitian) spectrum: a real signal of length n.
        let half = n / 2;
        let r = map_lanes(x, ax, n, |lane| {
            let mut full = vec![(0.0, 0.0); n];
            for (m, slot) in full.iter_mut().enumerate().take(half + 1) {
                if let Some(&v) = lane.get(m) {
                    *slot = v;
                }
            }
            full[0].1 = 0.0;
            if n.is_multiple_of(2) {
                full[half].1 = 0.0;
            }
            for m in half + 1..n {
                let (re, im) = full[n - m];
                full[m] = (re, -im);
            }
            dft_lane(&full, n, n, true)
        });
        return Ok((r, true));
    }
    let keep = if onesided { n / 2 + 1 } else { n };
    if inverse && single && !onesided {
        if let Some(plan) = F32Plan::new(n) {
            return Ok((map_lanes(x, ax, n, |lane| plan.inverse(lane)), false));
        }
    }
    Ok((
        map_lanes(x, ax, keep, |lane| dft_lane(lane, n, keep, inverse)),
        false,
    ))
}

fn dft(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let inverse = ctx.attrs.int("inverse", 0)? != 0;
    let onesided = ctx.attrs.int("onesided", 0)? != 0;
    let rank = x.rank();
    ensure!(rank >= 2, "DFT input must have rank >= 2");
    let ax = if ctx.opset >= 20 {
        let a = match opt_input(ins, 2)? {
            Some(t) => scalar_i64(t)?,
            None => -2,
        };
        norm_axis(a, rank)?
    } else {
        norm_axis(ctx.attrs.int("axis", 1)?, rank)?
    };
    ensure!(
        ax != rank - 1,
        "the DFT axis cannot be the last (complex) axis"
    );
    let c = to_complex(x)?;
    let len = x.shape()[ax];
    let n = match opt_input(ins, 1)? {
        Some(t) => {
            let v = scalar_i64(t)?;
            ensure!(v >= 1, "dft_length must be positive, got {v}");
            v as usize
        }
        None => {
            if inverse && onesided {
                ensure!(len >= 1, "empty one-sided spectrum");
                2 * (len - 1)
            } else {
                len
            }
        }
    };
    dims(&[n as i64, c.len() as i64])?;
    // ONNX's reference runs `np.fft.ifft` on complex64 data for float32/float16 inputs,
    // which numpy computes in single precision (pocketfft); reproduce its rounding.
    let single = matches!(x.dtype(), DType::F32 | DType::F16);
    let (r, real) = dft_core(&c, ax, n, inverse, onesided, single)?;
    out(from_complex(x.dtype(), &r, real))
}

fn stft(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let step = scalar_i64(input(ins, 1)?)?;
    ensure!(step >= 1, "frame_step must be positive, got {step}");
    let step = step as usize;
    let window = match opt_input(ins, 2)? {
        Some(w) => {
            ensure!(w.rank() == 1, "window must be 1-D");
            Some(f64s(w)?.iter().copied().collect::<Vec<f64>>())
        }
        None => None,
    };
    let onesided = ctx.attrs.int("onesided", 1)? != 0;
    ensure!(x.rank() == 3, "STFT signal must be [batch, length, 1 or 2]");
    let c = to_complex(x)?;
    let (batch, len) = (c.shape()[0], c.shape()[1]);
    let flen = match opt_input(ins, 3)? {
        Some(t) => {
            let v = scalar_i64(t)?;
            ensure!(v >= 1, "frame_length must be positive");
            v as usize
        }
        None => match &window {
            Some(w) => w.len(),
            None => len,
        },
    };
    let window = window.unwrap_or_else(|| vec![1.0; flen]);
    ensure!(
        window.len() == flen,
        "window length {} differs from frame_length {flen}",
        window.len()
    );
    ensure!(
        flen <= len,
        "frame_length {flen} exceeds the signal length {len}"
    );
    let frames = 1 + (len - flen) / step;
    let bins = if onesided { flen / 2 + 1 } else { flen };
    dims(&[batch as i64, frames as i64, bins as i64, 2])?;
    let mut v = Vec::with_capacity(batch * frames * bins * 2);
    for b in 0..batch {
        for f in 0..frames {
            let seg: Vec<C> = (0..flen)
                .map(|k| {
                    let (re, im) = c[[b, f * step + k]];
                    (re * window[k], im * window[k])
                })
                .collect();
            for (re, im) in dft_lane(&seg, flen, bins, false) {
                v.push(re);
                v.push(im);
            }
        }
    }
    out(Tensor::from_f64(
        x.dtype(),
        ArrayD::from_shape_vec(IxDyn(&[batch, frames, bins, 2]), v).expect("sizes match"),
        false,
    ))
}

fn out_dtype(ctx: &OpCtx, default: i64) -> OpResult<DType> {
    let code = ctx.attrs.int("output_datatype", default)?;
    match DType::from_onnx(code as i32) {
        Some(d) if d.storage().is_some() && d != DType::Str => Ok(d),
        _ => bail!("unsupported output_datatype {code}"),
    }
}

fn window(
    ctx: &OpCtx,
    ins: &[Option<&Value>],
    f: impl Fn(f64, f64) -> f64,
) -> OpResult<Vec<Value>> {
    let size = scalar_i64(input(ins, 0)?)?;
    ensure!(size >= 0, "window size must be non-negative, got {size}");
    dims(&[size])?;
    let periodic = ctx.attrs.int("periodic", 1)? != 0;
    let dt = out_dtype(ctx, 1)?;
    let n = if periodic {
        size as f64
    } else {
        size as f64 - 1.0
    };
    let v: Vec<f64> = (0..size).map(|i| f(i as f64, n)).collect();
    out(Tensor::from_f64(
        dt,
        ArrayD::from_shape_vec(IxDyn(&[size as usize]), v).expect("sizes match"),
        false,
    ))
}

fn hann(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    window(ctx, ins, |i, n| {
        let s = (std::f64::consts::PI * i / n).sin();
        s * s
    })
}

fn hamming(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    window(ctx, ins, |i, n| {
        let a = 25.0 / 46.0;
        a - (1.0 - a) * (2.0 * std::f64::consts::PI * i / n).cos()
    })
}

fn blackman(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    window(ctx, ins, |i, n| {
        let p = std::f64::consts::PI;
        0.42 - 0.5 * (2.0 * p * i / n).cos() + 0.08 * (4.0 * p * i / n).cos()
    })
}

fn mel(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let nmel = scalar_i64(input(ins, 0)?)?;
    let dftl = scalar_i64(input(ins, 1)?)?;
    let sr = scalar_i64(input(ins, 2)?)?;
    let lo = scalar_f64(input(ins, 3)?)?;
    let hi = scalar_f64(input(ins, 4)?)?;
    ensure!(
        nmel >= 0 && dftl >= 0,
        "num_mel_bins and dft_length must be non-negative"
    );
    ensure!(sr > 0, "sample_rate must be positive");
    let dt = out_dtype(ctx, 1)?;
    let nspec = (dftl / 2 + 1) as usize;
    let nmel_u = nmel as usize;
    dims(&[nspec as i64, nmel])?;
    let to_mel = |hz: f64| 2595.0 * (hz / 700.0).ln_1p() / std::f64::consts::LN_10;
    let (lm, hm) = (to_mel(lo), to_mel(hi));
    let step = (hm - lm) / (nmel + 2) as f64;
    let bins: Vec<i64> = (0..nmel + 2)
        .map(|k| {
            let m = k as f64 * step + lm;
            let hz = 700.0 * (m / 2595.0 * std::f64::consts::LN_10).exp_m1();
            (((dftl + 1) as f64 * hz) / sr as f64).floor() as i64
        })
        .collect();
    let mut o = vec![0.0f64; nspec * nmel_u];
    let mut set = |j: i64, i: usize, v: f64| -> OpResult<()> {
        ensure!(
            j >= 0 && (j as usize) < nspec,
            "mel bin {j} falls outside the {nspec} spectrogram bins"
        );
        o[j as usize * nmel_u + i] = v;
        Ok(())
    };
    for i in 0..nmel_u {
        let (l, c, h) = (bins[i], bins[i + 1], bins[i + 2]);
        let lc = c - l;
        if lc == 0 {
            set(c, i, 1.0)?;
        } else {
            for j in l..=c {
                set(j, i, (j - l) as f64 / lc as f64)?;
            }
        }
        let ch = h - c;
        if ch > 0 {
            for j in c..h {
                set(j, i, (h - j) as f64 / ch as f64)?;
            }
        }
    }
    out(Tensor::from_f64(
        dt,
        ArrayD::from_shape_vec(IxDyn(&[nspec, nmel_u]), o).expect("sizes match"),
        false,
    ))
}

/// A single-precision complex number, as pocketfft's `cmplx<float>`.
#[derive(Clone, Copy, Debug, Default)]
struct Cf {
    r: f32,
    i: f32,
}

impl Cf {
    fn add(self, o: Cf) -> Cf {
        Cf {
            r: self.r + o.r,
            i: self.i + o.i,
        }
    }
    fn sub(self, o: Cf) -> Cf {
        Cf {
            r: self.r - o.r,
            i: self.i - o.i,
        }
    }
    fn scale(self, f: f32) -> Cf {
        Cf {
            r: self.r * f,
            i: self.i * f,
        }
    }
    /// pocketfft's `special_mul<bwd>`: multiplication by `w` (backward) or by its conjugate.
    fn special_mul(self, w: Cf, bwd: bool) -> Cf {
        if bwd {
            Cf {
                r: self.r * w.r - self.i * w.i,
                i: self.r * w.i + self.i * w.r,
            }
        } else {
            Cf {
                r: self.r * w.r + self.i * w.i,
                i: self.i * w.r - self.r * w.i,
            }
        }
    }
    /// Multiplication by +i (`ROT90`).
    fn rot90(self) -> Cf {
        Cf {
            r: -self.i,
            i: self.r,
        }
    }
    /// Multiplication by -i (`ROTM90`).
    fn rotm90(self) -> Cf {
        Cf {
            r: self.i,
            i: -self.r,
        }
    }
}

/// A reproduction of pocketfft's single-precision complex FFT (`cfftp`, as used by
/// numpy >= 2 for complex64 data) for lengths whose prime factors are 2, 3 and 5: the same
/// factorization, radix passes and operation order, so the float32 rounding matches.
struct F32Plan {
    n: usize,
    factors: Vec<usize>,
    /// exp(2*pi*i*k/n) rounded to f32, k in 0..n.
    twiddle: Vec<Cf>,
}

impl F32Plan {
    fn new(n: usize) -> Option<F32Plan> {
        if n == 0 || n > (1 << 24) {
            return None;
        }
        let mut len = n;
        let mut factors = Vec::new();
        while len.is_multiple_of(4) {
            factors.push(4);
            len /= 4;
        }
        if len.is_multiple_of(2) {
            len /= 2;
            factors.push(2);
            let last = factors.len() - 1;
            factors.swap(0, last);
        }
        for d in [3, 5] {
            while len.is_multiple_of(d) {
                factors.push(d);
                len /= d;
            }
        }
        if len != 1 {
            return None;
        }
        let twiddle = (0..n)
            .map(|k| {
                let ang = 2.0 * std::f64::consts::PI * k as f64 / n as f64;
                Cf {
                    r: ang.cos() as f32,
                    i: ang.sin() as f32,
                }
            })
            .collect();
        Some(F32Plan {
            n,
            factors,
            twiddle,
        })
    }

    /// `np.fft.ifft` of one lane (zero-padded or truncated to n), in f32.
    fn inverse(&self, lane: &[C]) -> Vec<C> {
        let n = self.n;
        let mut c: Vec<Cf> = (0..n)
            .map(|k| match lane.get(k) {
                Some(&(re, im)) => Cf {
                    r: re as f32,
                    i: im as f32,
                },
                None => Cf::default(),
            })
            .collect();
        let fct = 1.0f32 / n as f32;
        self.pass_all(&mut c, true);
        c.iter()
            .map(|v| {
                let v = v.scale(fct);
                (v.r as f64, v.i as f64)
            })
            .collect()
    }

    fn pass_all(&self, c: &mut Vec<Cf>, bwd: bool) {
        let n = self.n;
        let mut l1 = 1;
        for &ip in &self.factors {
            let ido = n / (l1 * ip);
            let mut ch = vec![Cf::default(); n];
            // CC(a,b,c) = cc[a+ido*(b+ip*c)], CH(a,b,c) = ch[a+ido*(b+l1*c)],
            // WA(x,i) = twiddle[(x+1)*l1*i].
            let cc = |a: usize, b: usize, k: usize| c[a + ido * (b + ip * k)];
            let wa = |x: usize, i: usize| self.twiddle[((x + 1) * l1 * i) % n];
            let hidx = |a: usize, b: usize, k: usize| a + ido * (b + l1 * k);
            for k in 0..l1 {
                for i in 0..ido {
                    match ip {
                        2 => {
                            let (a, b) = (cc(i, 0, k), cc(i, 1, k));
                            ch[hidx(i, k, 0)] = a.add(b);
                            let d = a.sub(b);
                            ch[hidx(i, k, 1)] = if i == 0 {
                                d
                            } else {
                                d.special_mul(wa(0, i), bwd)
                            };
                        }
                        3 => {
                            let tw1r = -0.5f32;
                            let tw1i =
                                if bwd { 1.0 } else { -1.0 } * 0.866_025_403_784_438_6_f64 as f32;
                            let t0 = cc(i, 0, k);
                            let (t1, t2) =
                                (cc(i, 1, k).add(cc(i, 2, k)), cc(i, 1, k).sub(cc(i, 2, k)));
                            ch[hidx(i, k, 0)] = t0.add(t1);
                            let ca = t0.add(t1.scale(tw1r));
                            let cb = t2.scale(tw1i).rot90();
                            let (mut da, mut db) = (ca.add(cb), ca.sub(cb));
                            if i > 0 {
                                da = da.special_mul(wa(0, i), bwd);
                                db = db.special_mul(wa(1, i), bwd);
                            }
                            ch[hidx(i, k, 1)] = da;
                            ch[hidx(i, k, 2)] = db;
                        }
                        4 => {
                            let (c0, c1, c2, c3) =
                                (cc(i, 0, k), cc(i, 1, k), cc(i, 2, k), cc(i, 3, k));
                            let (t2, t1) = (c0.add(c2), c0.sub(c2));
                            let (t3, mut t4) = (c1.add(c3), c1.sub(c3));
                            t4 = if bwd { t4.rot90() } else { t4.rotm90() };
                            let (o0, o2) = (t2.add(t3), t2.sub(t3));
                            let (o1, o3) = (t1.add(t4), t1.sub(t4));
                            ch[hidx(i, k, 0)] = o0;
                            if i == 0 {
                                ch[hidx(i, k, 1)] = o1;
                                ch[hidx(i, k, 2)] = o2;
                                ch[hidx(i, k, 3)] = o3;
                            } else {
                                ch[hidx(i, k, 1)] = o1.special_mul(wa(0, i), bwd);
                                ch[hidx(i, k, 2)] = o2.special_mul(wa(1, i), bwd);
                                ch[hidx(i, k, 3)] = o3.special_mul(wa(2, i), bwd);
                            }
                        }
                        _ => {
                            // ip == 5
                            let s = if bwd { 1.0f32 } else { -1.0 };
                            let tw1r = 0.309_016_994_374_947_4_f64 as f32;
                            let tw1i = s * 0.951_056_516_295_153_5_f64 as f32;
                            let tw2r = -0.809_016_994_374_947_4_f64 as f32;
                            let tw2i = s * 0.587_785_252_292_473_1_f64 as f32;
                            let t0 = cc(i, 0, k);
                            let (t1, t4) =
                                (cc(i, 1, k).add(cc(i, 4, k)), cc(i, 1, k).sub(cc(i, 4, k)));
                            let (t2, t3) =
                                (cc(i, 2, k).add(cc(i, 3, k)), cc(i, 2, k).sub(cc(i, 3, k)));
                            ch[hidx(i, k, 0)] = Cf {
                                r: t0.r + t1.r + t2.r,
                                i: t0.i + t1.i + t2.i,
                            };
                            for (u1, u2, twar, twbr, twai, twbi) in [
                                (1, 4, tw1r, tw2r, tw1i, tw2i),
                                (2, 3, tw2r, tw1r, tw2i, -tw1i),
                            ] {
                                let ca = Cf {
                                    r: t0.r + twar * t1.r + twbr * t2.r,
                                    i: t0.i + twar * t1.i + twbr * t2.i,
                                };
                                let cb = Cf {
                                    r: -(twai * t4.i + twbi * t3.i),
                                    i: twai * t4.r + twbi * t3.r,
                                };
                                let (mut da, mut db) = (ca.add(cb), ca.sub(cb));
                                if i > 0 {
                                    da = da.special_mul(wa(u1 - 1, i), bwd);
                                    db = db.special_mul(wa(u2 - 1, i), bwd);
                                }
                                ch[hidx(i, k, u1)] = da;
                                ch[hidx(i, k, u2)] = db;
                            }
                        }
                    }
                }
            }
            *c = ch;
            l1 *= ip;
        }
    }
}

mod lower {
    use super::{norm_axis, scalar_i64};
    use crate::ensure;
    use crate::ir::{DType, OpResult, Tensor};
    use crate::kir::build::*;
    use crate::kir::{BinOp, BufId, BufKind, CmpOp, Expr, Kernel, Stmt, Ty, UnOp};
    use crate::ops::lowering::LowerCtx;
    use crate::ops::{Lowering, Registry};

    pub fn register(r: &mut Registry) {
        r.lower("DFT", Lowering::Custom(dft));
        r.lower("STFT", Lowering::Custom(stft));
    }

    /// Windowed frames through a direct f64 DFT (constant frame_step / frame_length).
    fn stft(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let y = lw.outputs[0].clone();
        let step = scalar_i64(lw.const_input(1)?)?;
        ensure!(step >= 1, "frame_step must be positive");
        let step = step as usize;
        let win = lw.opt_input(2).cloned();
        let onesided = lw.op.attrs.int("onesided", 1)? != 0;
        ensure!(
            x.shape.len() == 3,
            "STFT signal must be [batch, length, 1 or 2]"
        );
        let (batch, len, cdim) = (x.shape[0], x.shape[1], x.shape[2]);
        ensure!(cdim == 1 || cdim == 2, "STFT last dim");
        let flen = match lw.opt_input(3) {
            Some(_) => {
                let v = scalar_i64(lw.const_input(3)?)?;
                ensure!(v >= 1, "frame_length must be positive");
                v as usize
            }
            None => match &win {
                Some(w) => w.len(),
                None => len,
            },
        };
        if let Some(w) = &win {
            ensure!(w.shape.len() == 1 && w.len() == flen, "window length");
        }
        ensure!(flen <= len, "frame_length exceeds the signal length");
        let frames = 1 + (len - flen) / step;
        let bins = if onesided { flen / 2 + 1 } else { flen };
        ensure!(y.len() == batch * frames * bins * 2, "STFT output size");
        let (cs, sn): (Vec<f64>, Vec<f64>) = (0..flen)
            .map(|k| {
                let ang = -2.0 * std::f64::consts::PI * k as f64 / flen as f64;
                (ang.cos(), ang.sin())
            })
            .unzip();
        let cb = lw.constant("cos", &Tensor::from_vec(&[flen], cs))?;
        let sb = lw.constant("sin", &Tensor::from_vec(&[flen], sn))?;
        let xt = x.ty().compute();
        let ot = y.ty().compute();
        let mut k = lw.kernel("");
        let (b, fr, kk, j) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let (re, im, xr, xi, tc, ts, wv) = (
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::F64),
        );
        let xidx = |comp: usize| {
            Expr::add(
                Expr::mul(
                    Expr::add(
                        Expr::mul(v(b), int(len)),
                        Expr::add(Expr::mul(v(fr), int(step)), v(j)),
                    ),
                    int(cdim),
                ),
                int(comp),
            )
        };
        let mut jl = vec![set(
            wv,
            match &win {
                Some(w) => to64(Expr::load(w.buf, v(j)), w.ty().compute()),
                None => f(1.0),
            },
        )];
        jl.push(set(
            xr,
            Expr::mul(to64(Expr::load(x.buf, xidx(0)), xt), v(wv)),
        ));
        jl.push(set(
            xi,
            if cdim == 2 {
                Expr::mul(to64(Expr::load(x.buf, xidx(1)), xt), v(wv))
            } else {
                Expr::mul(f(0.0), v(wv))
            },
        ));
        let tw = Expr::bin(BinOp::Rem, Expr::mul(v(kk), v(j)), int(flen));
        jl.push(set(tc, Expr::load(cb, tw.clone())));
        jl.push(set(ts, Expr::load(sb, tw)));
        jl.push(set(
            re,
            Expr::add(v(re), sub(Expr::mul(v(xr), v(tc)), Expr::mul(v(xi), v(ts)))),
        ));
        jl.push(set(
            im,
            Expr::add(
                v(im),
                Expr::add(Expr::mul(v(xr), v(ts)), Expr::mul(v(xi), v(tc))),
            ),
        ));
        let fin = |e: Expr| if ot == Ty::F64 { e } else { Expr::cast(ot, e) };
        let oidx = Expr::mul(
            Expr::add(
                Expr::mul(Expr::add(Expr::mul(v(b), int(frames)), v(fr)), int(bins)),
                v(kk),
            ),
            int(2),
        );
        let body = vec![
            set(re, f(0.0)),
            set(im, f(0.0)),
            for_(j, flen, jl),
            Stmt::Store {
                buf: y.buf,
                index: oidx.clone(),
                value: fin(v(re)),
            },
            Stmt::Store {
                buf: y.buf,
                index: Expr::add(oidx, Expr::Int(1)),
                value: fin(v(im)),
            },
        ];
        k.body = vec![for_(
            b,
            batch,
            vec![for_(fr, frames, vec![for_(kk, bins, body)])],
        )];
        lw.push(k);
        Ok(())
    }

    /// Direct DFT in f64 with twiddle tables; one lane per (outer, inner) position.
    fn dft(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let y = lw.outputs[0].clone();
        let inverse = lw.op.attrs.int("inverse", 0)? != 0;
        let onesided = lw.op.attrs.int("onesided", 0)? != 0;
        let rank = x.shape.len();
        ensure!(rank >= 2, "DFT input must have rank >= 2");
        let ax = if lw.op.opset >= 20 {
            let a = match lw.opt_input(2) {
                Some(_) => scalar_i64(lw.const_input(2)?)?,
                None => -2,
            };
            norm_axis(a, rank)?
        } else {
            norm_axis(lw.op.attrs.int("axis", 1)?, rank)?
        };
        ensure!(ax != rank - 1, "the DFT axis cannot be the last axis");
        let cdim = x.shape[rank - 1];
        ensure!(cdim == 1 || cdim == 2, "DFT last dim");
        let len = x.shape[ax];
        let n = match lw.opt_input(1) {
            Some(_) => {
                let v = scalar_i64(lw.const_input(1)?)?;
                ensure!(v >= 1, "dft_length must be positive");
                v as usize
            }
            None => {
                if inverse && onesided {
                    ensure!(len >= 1, "empty one-sided spectrum");
                    2 * (len - 1)
                } else {
                    len
                }
            }
        };
        ensure!(n >= 1, "dft_length must be positive");
        let irfft = inverse && onesided;
        if inverse && !onesided && matches!(x.dtype, DType::F32 | DType::F16) {
            if let Some(plan) = super::F32Plan::new(n) {
                let lanes = Lanes {
                    outer: x.shape[..ax].iter().product(),
                    inner: x.shape[ax + 1..rank - 1].iter().product(),
                    len,
                    cdim,
                };
                return ifft_f32(lw, &plan, &lanes);
            }
        }
        let (keep, m, ocd) = if irfft {
            (n, n, 1)
        } else if onesided {
            (n / 2 + 1, len.min(n), 2)
        } else {
            (n, len.min(n), 2)
        };
        let outer: usize = x.shape[..ax].iter().product();
        let inner: usize = x.shape[ax + 1..rank - 1].iter().product();
        ensure!(y.len() == outer * keep * inner * ocd, "DFT output size");
        let sign = if inverse { 1.0 } else { -1.0 };
        let (cs, sn): (Vec<f64>, Vec<f64>) = (0..n)
            .map(|k| {
                let ang = sign * 2.0 * std::f64::consts::PI * k as f64 / n as f64;
                (ang.cos(), ang.sin())
            })
            .unzip();
        let cb = lw.constant("cos", &Tensor::from_vec(&[n], cs))?;
        let sb = lw.constant("sin", &Tensor::from_vec(&[n], sn))?;
        let xt = x.ty().compute();
        let ot = y.ty().compute();
        let mut k = lw.kernel("");
        let (a, kk, b, j) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let (re, im, xr, xi, tc, ts) = (
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::F64),
            k.var(Ty::F64),
        );
        let xidx = |jj: Expr, comp: usize| -> Expr {
            Expr::add(
                Expr::mul(
                    Expr::add(
                        Expr::mul(Expr::add(Expr::mul(v(a), int(len)), jj), int(inner)),
                        v(b),
                    ),
                    int(cdim),
                ),
                int(comp),
            )
        };
        let mut jl = Vec::new();
        if irfft {
            let half = n / 2;
            let jj = k.var(Ty::I64);
            let ok = k.var(Ty::U8);
            jl.push(set(
                jj,
                Expr::select(
                    Expr::cmp(CmpOp::Le, v(j), int(half)),
                    v(j),
                    sub(int(n), v(j)),
                ),
            ));
            jl.push(set(ok, Expr::cmp(CmpOp::Lt, v(jj), int(len))));
            let cl = Expr::bin(BinOp::Min, v(jj), int(len.max(1) - 1));
            jl.push(set(
                xr,
                Expr::select(
                    v(ok),
                    to64(Expr::load(x.buf, xidx(cl.clone(), 0)), xt),
                    f(0.0),
                ),
            ));
            if cdim == 2 {
                let mut zero_im = Expr::cmp(CmpOp::Eq, v(jj), Expr::Int(0));
                if n % 2 == 0 {
                    zero_im = Expr::bin(BinOp::Or, zero_im, Expr::cmp(CmpOp::Eq, v(jj), int(half)));
                }
                let raw = Expr::select(v(ok), to64(Expr::load(x.buf, xidx(cl, 1)), xt), f(0.0));
                let val = Expr::select(zero_im, f(0.0), raw);
                jl.push(set(xi, val));
                jl.push(Stmt::If {
                    cond: Expr::cmp(CmpOp::Gt, v(j), int(half)),
                    then: vec![set(xi, Expr::un(crate::kir::UnOp::Neg, v(xi)))],
                    els: vec![],
                });
            } else {
                jl.push(set(xi, f(0.0)));
            }
        } else {
            jl.push(set(xr, to64(Expr::load(x.buf, xidx(v(j), 0)), xt)));
            jl.push(set(
                xi,
                if cdim == 2 {
                    to64(Expr::load(x.buf, xidx(v(j), 1)), xt)
                } else {
                    f(0.0)
                },
            ));
        }
        let tw = Expr::bin(BinOp::Rem, Expr::mul(v(kk), v(j)), int(n));
        jl.push(set(tc, Expr::load(cb, tw.clone())));
        jl.push(set(ts, Expr::load(sb, tw)));
        jl.push(set(
            re,
            Expr::add(v(re), sub(Expr::mul(v(xr), v(tc)), Expr::mul(v(xi), v(ts)))),
        ));
        jl.push(set(
            im,
            Expr::add(
                v(im),
                Expr::add(Expr::mul(v(xr), v(ts)), Expr::mul(v(xi), v(tc))),
            ),
        ));
        let fin = |e: Expr| -> Expr {
            let e = if inverse {
                Expr::bin(BinOp::Div, e, f(n as f64))
            } else {
                e
            };
            if ot == Ty::F64 {
                e
            } else {
                Expr::cast(ot, e)
            }
        };
        let oidx = Expr::mul(
            Expr::add(
                Expr::mul(Expr::add(Expr::mul(v(a), int(keep)), v(kk)), int(inner)),
                v(b),
            ),
            int(ocd),
        );
        let mut body = vec![set(re, f(0.0)), set(im, f(0.0)), for_(j, m, jl)];
        body.push(Stmt::Store {
            buf: y.buf,
            index: oidx.clone(),
            value: fin(v(re)),
        });
        if ocd == 2 {
            body.push(Stmt::Store {
                buf: y.buf,
                index: Expr::add(oidx, Expr::Int(1)),
                value: fin(v(im)),
            });
        }
        k.body = vec![for_(
            a,
            outer,
            vec![for_(kk, keep, vec![for_(b, inner, body)])],
        )];
        lw.push(k);
        Ok(())
    }

    /// The lanes a DFT runs along: `outer` x `len` x `inner` x `cdim` (1 real, 2 complex).
    struct Lanes {
        outer: usize,
        inner: usize,
        len: usize,
        cdim: usize,
    }

    /// An f32 complex value as two expressions.
    #[derive(Clone)]
    struct Cx {
        r: Expr,
        i: Expr,
    }

    fn f32c(x: f32) -> Expr {
        Expr::f(x as f64, Ty::F32)
    }

    impl Cx {
        fn add(&self, o: &Cx) -> Cx {
            Cx {
                r: add(self.r.clone(), o.r.clone()),
                i: add(self.i.clone(), o.i.clone()),
            }
        }
        fn sub(&self, o: &Cx) -> Cx {
            Cx {
                r: sub(self.r.clone(), o.r.clone()),
                i: sub(self.i.clone(), o.i.clone()),
            }
        }
        fn scale(&self, f: f32) -> Cx {
            Cx {
                r: mul(self.r.clone(), f32c(f)),
                i: mul(self.i.clone(), f32c(f)),
            }
        }
        /// Multiplication by `w` (pocketfft's `special_mul<true>`).
        fn twiddle(&self, w: &Cx) -> Cx {
            Cx {
                r: sub(
                    mul(self.r.clone(), w.r.clone()),
                    mul(self.i.clone(), w.i.clone()),
                ),
                i: add(
                    mul(self.r.clone(), w.i.clone()),
                    mul(self.i.clone(), w.r.clone()),
                ),
            }
        }
        /// Multiplication by +i.
        fn rot90(&self) -> Cx {
            Cx {
                r: Expr::un(UnOp::Neg, self.i.clone()),
                i: self.r.clone(),
            }
        }
    }

    /// Straight-line f32 code of one radix step: intermediates bound to variables, as the
    /// reference binds them, so every operation rounds once in the same order.
    struct Step<'a> {
        k: &'a mut Kernel,
        body: Vec<Stmt>,
    }

    impl Step<'_> {
        fn bind(&mut self, c: Cx) -> Cx {
            let (r, i) = (self.k.var(Ty::F32), self.k.var(Ty::F32));
            self.body.push(set(r, c.r));
            self.body.push(set(i, c.i));
            Cx { r: v(r), i: v(i) }
        }
    }

    /// `buf[2 * at]`, `buf[2 * at + 1]` as a complex value.
    fn load_cx(buf: BufId, at: Expr) -> Cx {
        let at = mul(at, Expr::Int(2));
        Cx {
            r: Expr::load(buf, at.clone()),
            i: Expr::load(buf, add(at, Expr::Int(1))),
        }
    }

    fn store_cx(buf: BufId, at: Expr, c: Cx) -> Vec<Stmt> {
        let at = mul(at, Expr::Int(2));
        vec![
            Stmt::Store {
                buf,
                index: at.clone(),
                value: c.r,
            },
            Stmt::Store {
                buf,
                index: add(at, Expr::Int(1)),
                value: c.i,
            },
        ]
    }

    /// Inverse complex DFT of float32 (or float16) lanes with the reference's
    /// reproduction of pocketfft in single precision ([`super::F32Plan`]): per lane, the
    /// signal is copied into an f32 scratch, each radix pass (4, 2, 3, 5 as the plan
    /// factors the length) runs as loops over its `l1 x ido` butterflies into a second
    /// scratch, and the result is scaled by 1/n in f32. The same operations in the same
    /// order round the same way, so the output equals numpy's `ifft` on complex64 bit for
    /// bit, which the expected outputs need near zero.
    fn ifft_f32(lw: &mut LowerCtx, plan: &super::F32Plan, l: &Lanes) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let y = lw.outputs[0].clone();
        let n = plan.n;
        ensure!(y.len() == l.outer * n * l.inner * 2, "DFT output size");
        let tw: Vec<f32> = plan.twiddle.iter().flat_map(|c| [c.r, c.i]).collect();
        let twb = lw.constant("twiddle", &Tensor::from_vec(&[2 * n], tw))?;
        let bufs = [
            lw.program.add_buffer(
                format!("{}/fft_a", lw.name),
                BufKind::Arena { offset: 0 },
                Ty::F32,
                2 * n as u64,
            ),
            lw.program.add_buffer(
                format!("{}/fft_b", lw.name),
                BufKind::Arena { offset: 0 },
                Ty::F32,
                2 * n as u64,
            ),
        ];
        let mut k = lw.kernel("");
        let (a, b, j) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let xt = x.ty().compute();
        // The lane, zero-padded or truncated to n, as f32.
        let xidx = |jj: Expr, comp: usize| -> Expr {
            add(
                mul(
                    add(mul(add(mul(v(a), int(l.len)), jj), int(l.inner)), v(b)),
                    int(l.cdim),
                ),
                int(comp),
            )
        };
        let to32 = |e: Expr| {
            if xt == Ty::F32 {
                e
            } else {
                Expr::cast(Ty::F32, e)
            }
        };
        let m = l.len.min(n);
        let mut lane = vec![for_(
            j,
            m,
            store_cx(
                bufs[0],
                v(j),
                Cx {
                    r: to32(Expr::load(x.buf, xidx(v(j), 0))),
                    i: if l.cdim == 2 {
                        to32(Expr::load(x.buf, xidx(v(j), 1)))
                    } else {
                        f32c(0.0)
                    },
                },
            ),
        )];
        if m < n {
            lane.push(for_(
                j,
                n - m,
                store_cx(
                    bufs[0],
                    add(v(j), int(m)),
                    Cx {
                        r: f32c(0.0),
                        i: f32c(0.0),
                    },
                ),
            ));
        }
        let (kv, iv) = (k.var(Ty::I64), k.var(Ty::I64));
        let mut l1 = 1;
        let mut cur = 0;
        for &ip in &plan.factors {
            let ido = n / (l1 * ip);
            let (src, dst) = (bufs[cur], bufs[1 - cur]);
            let cc = |bb: usize| {
                load_cx(
                    src,
                    add(v(iv), mul(int(ido), add(int(bb), mul(int(ip), v(kv))))),
                )
            };
            let ch = |bb: usize| add(v(iv), mul(int(ido), add(v(kv), int(l1 * bb))));
            let wa = |xx: usize| load_cx(twb, mul(v(iv), int((xx + 1) * l1)));
            let mut st = Step {
                k: &mut k,
                body: Vec::new(),
            };
            // Outputs (slot, value) stored as they are, then those multiplied by a
            // twiddle when i > 0: (slot, value, twiddle index).
            let mut plain: Vec<(usize, Cx)> = Vec::new();
            let mut twisted: Vec<(usize, Cx, usize)> = Vec::new();
            match ip {
                2 => {
                    let (c0, c1) = (st.bind(cc(0)), st.bind(cc(1)));
                    plain.push((0, c0.add(&c1)));
                    let d = st.bind(c0.sub(&c1));
                    twisted.push((1, d, 0));
                }
                3 => {
                    let tw1r = -0.5f32;
                    let tw1i = 0.866_025_403_784_438_6_f64 as f32;
                    let t0 = st.bind(cc(0));
                    let (c1, c2) = (st.bind(cc(1)), st.bind(cc(2)));
                    let t1 = st.bind(c1.add(&c2));
                    let t2 = st.bind(c1.sub(&c2));
                    plain.push((0, t0.add(&t1)));
                    let ca = st.bind(t0.add(&t1.scale(tw1r)));
                    let cb = st.bind(t2.scale(tw1i).rot90());
                    twisted.push((1, st.bind(ca.add(&cb)), 0));
                    twisted.push((2, st.bind(ca.sub(&cb)), 1));
                }
                4 => {
                    let c: Vec<Cx> = (0..4).map(|q| st.bind(cc(q))).collect();
                    let t2 = st.bind(c[0].add(&c[2]));
                    let t1 = st.bind(c[0].sub(&c[2]));
                    let t3 = st.bind(c[1].add(&c[3]));
                    let t4 = st.bind(c[1].sub(&c[3]).rot90());
                    plain.push((0, t2.add(&t3)));
                    twisted.push((1, st.bind(t1.add(&t4)), 0));
                    twisted.push((2, st.bind(t2.sub(&t3)), 1));
                    twisted.push((3, st.bind(t1.sub(&t4)), 2));
                }
                _ => {
                    // ip == 5
                    let tw1r = 0.309_016_994_374_947_4_f64 as f32;
                    let tw1i = 0.951_056_516_295_153_5_f64 as f32;
                    let tw2r = -0.809_016_994_374_947_4_f64 as f32;
                    let tw2i = 0.587_785_252_292_473_1_f64 as f32;
                    let t0 = st.bind(cc(0));
                    let c: Vec<Cx> = (1..5).map(|q| st.bind(cc(q))).collect();
                    let t1 = st.bind(c[0].add(&c[3]));
                    let t4 = st.bind(c[0].sub(&c[3]));
                    let t2 = st.bind(c[1].add(&c[2]));
                    let t3 = st.bind(c[1].sub(&c[2]));
                    plain.push((
                        0,
                        Cx {
                            r: add(add(t0.r.clone(), t1.r.clone()), t2.r.clone()),
                            i: add(add(t0.i.clone(), t1.i.clone()), t2.i.clone()),
                        },
                    ));
                    for (u1, u2, twar, twbr, twai, twbi) in [
                        (1, 4, tw1r, tw2r, tw1i, tw2i),
                        (2, 3, tw2r, tw1r, tw2i, -tw1i),
                    ] {
                        let ca = st.bind(Cx {
                            r: add(
                                add(t0.r.clone(), mul(f32c(twar), t1.r.clone())),
                                mul(f32c(twbr), t2.r.clone()),
                            ),
                            i: add(
                                add(t0.i.clone(), mul(f32c(twar), t1.i.clone())),
                                mul(f32c(twbr), t2.i.clone()),
                            ),
                        });
                        let cb = st.bind(Cx {
                            r: Expr::un(
                                UnOp::Neg,
                                add(mul(f32c(twai), t4.i.clone()), mul(f32c(twbi), t3.i.clone())),
                            ),
                            i: add(mul(f32c(twai), t4.r.clone()), mul(f32c(twbi), t3.r.clone())),
                        });
                        twisted.push((u1, st.bind(ca.add(&cb)), u1 - 1));
                        twisted.push((u2, st.bind(ca.sub(&cb)), u2 - 1));
                    }
                }
            }
            let mut body = st.body;
            for (slot, c) in plain {
                body.extend(store_cx(dst, ch(slot), c));
            }
            let (mut first, mut rest) = (Vec::new(), Vec::new());
            for (slot, c, w) in twisted {
                first.extend(store_cx(dst, ch(slot), c.clone()));
                rest.extend(store_cx(dst, ch(slot), c.twiddle(&wa(w))));
            }
            body.push(Stmt::If {
                cond: Expr::cmp(CmpOp::Eq, v(iv), Expr::Int(0)),
                then: first,
                els: rest,
            });
            lane.push(for_(kv, l1, vec![for_(iv, ido, body)]));
            l1 *= ip;
            cur = 1 - cur;
        }
        // Scaled by 1/n in f32, stored in the output type.
        let fct = 1.0f32 / n as f32;
        let ot = y.ty().compute();
        let res = load_cx(bufs[cur], v(j)).scale(fct);
        let oidx = |comp: usize| -> Expr {
            add(
                mul(
                    add(mul(add(mul(v(a), int(n)), v(j)), int(l.inner)), v(b)),
                    int(2),
                ),
                int(comp),
            )
        };
        let fin = |e: Expr| if ot == Ty::F32 { e } else { Expr::cast(ot, e) };
        lane.push(for_(
            j,
            n,
            vec![
                Stmt::Store {
                    buf: y.buf,
                    index: oidx(0),
                    value: fin(res.r),
                },
                Stmt::Store {
                    buf: y.buf,
                    index: oidx(1),
                    value: fin(res.i),
                },
            ],
        ));
        k.body = vec![for_(a, l.outer, vec![for_(b, l.inner, lane)])];
        lw.push(k);
        Ok(())
    }
}
