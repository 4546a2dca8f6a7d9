//! Recurrent ops: RNN, GRU, LSTM.
//!
//! All three share one driver: inputs are read as f64, each direction and batch entry is
//! stepped through its (possibly shortened) sequence, and the outputs are rounded back to
//! the dtype of X. Activations, alpha/beta, clip, sequence_lens, layout and the optional
//! outputs follow the ONNX spec.

use super::util::{dims, f64s, input, ints, opt_input, outs};
use super::{OpCtx, Registry};
use crate::ir::{OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{ArrayD, IxDyn};

pub fn register(r: &mut Registry) {
    r.add("RNN", rnn);
    r.add("GRU", gru);
    r.add("LSTM", lstm);
    lower::register(r);
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Rnn,
    Gru,
    Lstm,
}

#[derive(Clone, Copy, Debug)]
enum Act {
    Relu,
    Tanh,
    Sigmoid,
    Affine(f64, f64),
    LeakyRelu(f64),
    ThresholdedRelu(f64),
    ScaledTanh(f64, f64),
    HardSigmoid(f64, f64),
    Elu(f64),
    Softsign,
    Softplus,
}

impl Act {
    fn apply(self, x: f64) -> f64 {
        match self {
            Act::Relu => x.max(0.0),
            Act::Tanh => x.tanh(),
            Act::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Act::Affine(a, b) => a * x + b,
            Act::LeakyRelu(a) => {
                if x >= 0.0 {
                    x
                } else {
                    a * x
                }
            }
            Act::ThresholdedRelu(a) => {
                if x > a {
                    x
                } else {
                    0.0
                }
            }
            Act::ScaledTanh(a, b) => a * (b * x).tanh(),
            Act::HardSigmoid(a, b) => (a * x + b).clamp(0.0, 1.0),
            Act::Elu(a) => {
                if x >= 0.0 {
                    x
                } else {
                    a * (x.exp() - 1.0)
                }
            }
            Act::Softsign => x / (1.0 + x.abs()),
            Act::Softplus => (1.0 + x.exp()).ln(),
        }
    }
}

/// Parses the `activations` attribute (with `activation_alpha`/`activation_beta` consumed
/// in order by the activations that take them) into `per_dir * dirs` activations.
fn activations(ctx: &OpCtx, defaults: &[&str], dirs: usize) -> OpResult<Vec<Act>> {
    let names: Vec<String> = match ctx.attrs.get_strings("activations")? {
        Some(v) => v,
        None => {
            let mut v = Vec::new();
            for _ in 0..dirs {
                v.extend(defaults.iter().map(|s| s.to_string()));
            }
            v
        }
    };
    let per = defaults.len();
    let names = if names.len() == per && dirs == 2 {
        // The same activations for both directions.
        let mut v = names.clone();
        v.extend(names);
        v
    } else {
        names
    };
    ensure!(
        names.len() == per * dirs,
        "expected {} activations, got {}",
        per * dirs,
        names.len()
    );
    let alphas: Vec<f64> = ctx
        .attrs
        .floats("activation_alpha", vec![])?
        .into_iter()
        .map(|x| x as f64)
        .collect();
    let betas: Vec<f64> = ctx
        .attrs
        .floats("activation_beta", vec![])?
        .into_iter()
        .map(|x| x as f64)
        .collect();
    let (mut ia, mut ib) = (0usize, 0usize);
    let mut alpha = |d: f64| {
        let v = alphas.get(ia).copied().unwrap_or(d);
        ia += 1;
        v
    };
    let mut beta = |d: f64| {
        let v = betas.get(ib).copied().unwrap_or(d);
        ib += 1;
        v
    };
    let mut out = Vec::with_capacity(names.len());
    for n in &names {
        let a = match n.to_ascii_lowercase().as_str() {
            "relu" => Act::Relu,
            "tanh" => Act::Tanh,
            "sigmoid" => Act::Sigmoid,
            "affine" => {
                let a = alpha(1.0);
                Act::Affine(a, beta(0.0))
            }
            "leakyrelu" => Act::LeakyRelu(alpha(0.01)),
            "thresholdedrelu" => Act::ThresholdedRelu(alpha(1.0)),
            "scaledtanh" => {
                let a = alpha(1.0);
                Act::ScaledTanh(a, beta(1.0))
            }
            "hardsigmoid" => {
                let a = alpha(0.2);
                Act::HardSigmoid(a, beta(0.5))
            }
            "elu" => Act::Elu(alpha(1.0)),
            "softsign" => Act::Softsign,
            "softplus" => Act::Softplus,
            other => bail!("unknown activation function `{other}`"),
        };
        out.push(a);
    }
    Ok(out)
}

fn rnn(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    run(ctx, ins, Kind::Rnn)
}

fn gru(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    run(ctx, ins, Kind::Gru)
}

fn lstm(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    run(ctx, ins, Kind::Lstm)
}

/// y[j] += sum_k m[row0 + j, k] * v[k] for j in 0..n, with m row-major of width `w`.
fn matvec_add(y: &mut [f64], m: &[f64], row0: usize, w: usize, v: &[f64]) {
    for (j, yj) in y.iter_mut().enumerate() {
        let r = &m[(row0 + j) * w..(row0 + j + 1) * w];
        *yj += r.iter().zip(v).map(|(a, b)| a * b).sum::<f64>();
    }
}

/// Reads an array as f64 and checks its shape.
fn get(t: &Tensor, shape: &[usize], what: &str) -> OpResult<Vec<f64>> {
    ensure!(
        t.shape() == shape,
        "{what} has shape {:?}, expected {shape:?}",
        t.shape()
    );
    Ok(f64s(t)?.iter().copied().collect())
}

fn run(ctx: &OpCtx, ins: &[Option<&Value>], kind: Kind) -> OpResult<Vec<Value>> {
    let (gates, defaults): (usize, &[&str]) = match kind {
        Kind::Rnn => (1, &["Tanh"]),
        Kind::Gru => (3, &["Sigmoid", "Tanh"]),
        Kind::Lstm => (4, &["Sigmoid", "Tanh", "Tanh"]),
    };
    let x = input(ins, 0)?;
    let w = input(ins, 1)?;
    let r = input(ins, 2)?;
    let dt = x.dtype();
    ensure!(dt.is_float(), "X must be a float tensor, got {dt}");
    let layout = ctx.attrs.int("layout", 0)?;
    ensure!(layout == 0 || layout == 1, "layout must be 0 or 1");
    let direction = ctx.attrs.string("direction", "forward".into())?;
    let dirs = match direction.as_str() {
        "forward" | "reverse" => 1,
        "bidirectional" => 2,
        d => bail!("unknown direction `{d}`"),
    };
    ensure!(x.rank() == 3, "X must have rank 3, got {:?}", x.shape());
    let (seq, batch, isz) = if layout == 0 {
        (x.shape()[0], x.shape()[1], x.shape()[2])
    } else {
        (x.shape()[1], x.shape()[0], x.shape()[2])
    };
    ensure!(r.rank() == 3 && w.rank() == 3, "W and R must have rank 3");
    let hs = r.shape()[2];
    if let Some(h) = ctx.attrs.get_int("hidden_size")? {
        ensure!(h as usize == hs, "hidden_size {h} does not match R's shape");
    }
    let gh = gates * hs;
    let wv = get(w, &[dirs, gh, isz], "W")?;
    let rv = get(r, &[dirs, gh, hs], "R")?;
    let bv = match opt_input(ins, 3)? {
        Some(b) => get(b, &[dirs, 2 * gh], "B")?,
        None => vec![0.0; dirs * 2 * gh],
    };
    let lens: Vec<usize> = match opt_input(ins, 4)? {
        Some(s) => {
            let v = ints(s)?;
            ensure!(v.len() == batch, "sequence_lens must have {batch} entries");
            let mut o = Vec::with_capacity(batch);
            for l in v {
                ensure!(
                    l >= 0 && l as usize <= seq,
                    "sequence length {l} is out of range 0..={seq}"
                );
                o.push(l as usize);
            }
            o
        }
        None => vec![seq; batch],
    };
    // Initial states, as [dirs, batch, hs] regardless of layout.
    let state = |i: usize, what: &str| -> OpResult<Vec<f64>> {
        match opt_input(ins, i)? {
            None => Ok(vec![0.0; dirs * batch * hs]),
            Some(t) => {
                if layout == 0 {
                    get(t, &[dirs, batch, hs], what)
                } else {
                    let v = get(t, &[batch, dirs, hs], what)?;
                    let mut o = vec![0.0; v.len()];
                    for b in 0..batch {
                        for d in 0..dirs {
                            for k in 0..hs {
                                o[(d * batch + b) * hs + k] = v[(b * dirs + d) * hs + k];
                            }
                        }
                    }
                    Ok(o)
                }
            }
        }
    };
    let h0 = state(5, "initial_h")?;
    let c0 = if kind == Kind::Lstm {
        state(6, "initial_c")?
    } else {
        vec![]
    };
    let pv = if kind == Kind::Lstm {
        match opt_input(ins, 7)? {
            Some(p) => get(p, &[dirs, 3 * hs], "P")?,
            None => vec![0.0; dirs * 3 * hs],
        }
    } else {
        vec![]
    };
    let acts = activations(ctx, defaults, dirs)?;
    let clip = ctx.attrs.get_float("clip")?.map(|c| c as f64);
    let cl = |v: f64| match clip {
        Some(c) => v.clamp(-c, c),
        None => v,
    };
    let lbr = ctx.attrs.int("linear_before_reset", 0)? != 0;
    let input_forget = ctx.attrs.int("input_forget", 0)? != 0;
    dims(&[seq as i64, dirs as i64, batch as i64, hs as i64])?;

    let xv: Vec<f64> = f64s(x)?.iter().copied().collect();
    let xat = |t: usize, b: usize| -> &[f64] {
        let off = if layout == 0 {
            (t * batch + b) * isz
        } else {
            (b * seq + t) * isz
        };
        &xv[off..off + isz]
    };
    // Y as [seq, dirs, batch, hs]; Y_h, Y_c as [dirs, batch, hs].
    let mut y = vec![0.0; seq * dirs * batch * hs];
    let mut yh = vec![0.0; dirs * batch * hs];
    let mut yc = vec![0.0; dirs * batch * hs];
    let per = defaults.len();
    for d in 0..dirs {
        let reverse = direction == "reverse" || d == 1;
        let wd = &wv[d * gh * isz..(d + 1) * gh * isz];
        let rd = &rv[d * gh * hs..(d + 1) * gh * hs];
        let bd = &bv[d * 2 * gh..(d + 1) * 2 * gh];
        let a = &acts[d * per..(d + 1) * per];
        for b in 0..batch {
            let mut h: Vec<f64> = h0[(d * batch + b) * hs..(d * batch + b + 1) * hs].to_vec();
            let mut c: Vec<f64> = if kind == Kind::Lstm {
                c0[(d * batch + b) * hs..(d * batch + b + 1) * hs].to_vec()
            } else {
                vec![]
            };
            let len = lens[b];
            for step in 0..len {
                let t = if reverse { len - 1 - step } else { step };
                let xt = xat(t, b);
                match kind {
                    Kind::Rnn => {
                        let mut g: Vec<f64> = (0..hs).map(|j| bd[j] + bd[hs + j]).collect();
                        matvec_add(&mut g, wd, 0, isz, xt);
                        matvec_add(&mut g, rd, 0, hs, &h);
                        h = g.into_iter().map(|v| a[0].apply(cl(v))).collect();
                    }
                    Kind::Gru => {
                        // z, r gates.
                        let mut zr: Vec<f64> = (0..2 * hs).map(|j| bd[j] + bd[gh + j]).collect();
                        matvec_add(&mut zr, wd, 0, isz, xt);
                        matvec_add(&mut zr, rd, 0, hs, &h);
                        let z: Vec<f64> = zr[..hs].iter().map(|&v| a[0].apply(cl(v))).collect();
                        let rg: Vec<f64> = zr[hs..].iter().map(|&v| a[0].apply(cl(v))).collect();
                        let mut xh: Vec<f64> = (0..hs).map(|j| bd[2 * hs + j]).collect();
                        matvec_add(&mut xh, wd, 2 * hs, isz, xt);
                        let hh: Vec<f64> = if lbr {
                            let mut rh: Vec<f64> = (0..hs).map(|j| bd[gh + 2 * hs + j]).collect();
                            matvec_add(&mut rh, rd, 2 * hs, hs, &h);
                            (0..hs)
                                .map(|j| a[1].apply(cl(xh[j] + rg[j] * rh[j])))
                                .collect()
                        } else {
                            let rh_in: Vec<f64> = (0..hs).map(|j| rg[j] * h[j]).collect();
                            let mut rh: Vec<f64> = (0..hs).map(|j| bd[gh + 2 * hs + j]).collect();
                            matvec_add(&mut rh, rd, 2 * hs, hs, &rh_in);
                            (0..hs).map(|j| a[1].apply(cl(xh[j] + rh[j]))).collect()
                        };
                        h = (0..hs)
                            .map(|j| (1.0 - z[j]) * hh[j] + z[j] * h[j])
                            .collect();
                    }
                    Kind::Lstm => {
                        let mut g: Vec<f64> = (0..gh).map(|j| bd[j] + bd[gh + j]).collect();
                        matvec_add(&mut g, wd, 0, isz, xt);
                        matvec_add(&mut g, rd, 0, hs, &h);
                        let p = &pv[d * 3 * hs..(d + 1) * 3 * hs];
                        let mut nc = vec![0.0; hs];
                        let mut nh = vec![0.0; hs];
                        for j in 0..hs {
                            let i = a[0].apply(cl(g[j] + p[j] * c[j]));
                            let f = if input_forget {
                                1.0 - i
                            } else {
                                a[0].apply(cl(g[2 * hs + j] + p[2 * hs + j] * c[j]))
                            };
                            let cc = a[1].apply(cl(g[3 * hs + j]));
                            nc[j] = f * c[j] + i * cc;
                            let o = a[0].apply(cl(g[hs + j] + p[hs + j] * nc[j]));
                            nh[j] = o * a[2].apply(nc[j]);
                        }
                        c = nc;
                        h = nh;
                    }
                }
                let off = ((t * dirs + d) * batch + b) * hs;
                y[off..off + hs].copy_from_slice(&h);
            }
            yh[(d * batch + b) * hs..(d * batch + b + 1) * hs].copy_from_slice(&h);
            if kind == Kind::Lstm {
                yc[(d * batch + b) * hs..(d * batch + b + 1) * hs].copy_from_slice(&c);
            }
        }
    }
    let mk = |v: Vec<f64>, shape: &[usize]| -> Tensor {
        Tensor::from_f64(
            dt,
            ArrayD::from_shape_vec(IxDyn(shape), v).expect("sizes match"),
            false,
        )
    };
    let (y_t, yh_t, yc_t) = if layout == 0 {
        (
            mk(y, &[seq, dirs, batch, hs]),
            mk(yh, &[dirs, batch, hs]),
            mk(yc, &[dirs, batch, hs]),
        )
    } else {
        // Y: [batch, seq, dirs, hs]; Y_h, Y_c: [batch, dirs, hs].
        let mut y1 = vec![0.0; y.len()];
        for t in 0..seq {
            for d in 0..dirs {
                for b in 0..batch {
                    let src = ((t * dirs + d) * batch + b) * hs;
                    let dst = ((b * seq + t) * dirs + d) * hs;
                    y1[dst..dst + hs].copy_from_slice(&y[src..src + hs]);
                }
            }
        }
        let swap = |v: &[f64]| {
            let mut o = vec![0.0; v.len()];
            for d in 0..dirs {
                for b in 0..batch {
                    let src = (d * batch + b) * hs;
                    let dst = (b * dirs + d) * hs;
                    o[dst..dst + hs].copy_from_slice(&v[src..src + hs]);
                }
            }
            o
        };
        (
            mk(y1, &[batch, seq, dirs, hs]),
            mk(swap(&yh), &[batch, dirs, hs]),
            mk(swap(&yc), &[batch, dirs, hs]),
        )
    };
    let max = if kind == Kind::Lstm { 3 } else { 2 };
    let mut v = vec![y_t, yh_t, yc_t];
    v.truncate(max.min(ctx.n_outputs.max(1)));
    outs(v)
}

// ---------------------------------------------------------------------------------
// Lowering to kernel IR

mod lower {
    use super::{activations, Act, Kind};
    use crate::ir::{OpError, OpResult};
    use crate::kir::build::*;
    use crate::kir::{BufId, BufKind, CmpOp, Expr, MathFn, Stmt, Ty, UnOp};
    use crate::ops::lowering::{LowerCtx, TensorRef};
    use crate::ops::{Lowering, Registry};
    use crate::{bail, ensure};

    pub fn register(r: &mut Registry) {
        r.lower("RNN", Lowering::Custom(|lw| lower(lw, Kind::Rnn)));
        r.lower("GRU", Lowering::Custom(|lw| lower(lw, Kind::Gru)));
        r.lower("LSTM", Lowering::Custom(|lw| lower(lw, Kind::Lstm)));
    }

    const F: Ty = Ty::F64;

    fn fl(x: f64) -> Expr {
        Expr::f(x, F)
    }
    fn lt(a: Expr, b: Expr) -> Expr {
        Expr::cmp(CmpOp::Lt, a, b)
    }
    fn gt(a: Expr, b: Expr) -> Expr {
        Expr::cmp(CmpOp::Gt, a, b)
    }
    /// A load widened to f64.
    fn ld(t: &TensorRef, idx: Expr) -> Expr {
        let e = Expr::load(t.buf, idx);
        if t.ty().compute() == F {
            e
        } else {
            Expr::cast(F, e)
        }
    }
    fn to_out(t: &TensorRef, e: Expr) -> Expr {
        if t.ty().compute() == F {
            e
        } else {
            Expr::cast(t.ty().compute(), e)
        }
    }

    fn act(a: Act, x: Expr) -> Expr {
        match a {
            Act::Relu => sel(
                lt(x.clone(), fl(0.0)),
                fl(0.0),
                sel(Expr::cmp(CmpOp::Ne, x.clone(), x.clone()), fl(0.0), x),
            ),
            Act::Tanh => call(MathFn::Tanh, x),
            Act::Sigmoid => div(
                fl(1.0),
                add(fl(1.0), call(MathFn::Exp, Expr::un(UnOp::Neg, x))),
            ),
            Act::Affine(a, b) => add(mul(fl(a), x), fl(b)),
            Act::LeakyRelu(a) => sel(
                Expr::cmp(CmpOp::Ge, x.clone(), fl(0.0)),
                x.clone(),
                mul(fl(a), x),
            ),
            Act::ThresholdedRelu(a) => sel(gt(x.clone(), fl(a)), x, fl(0.0)),
            Act::ScaledTanh(a, b) => mul(fl(a), call(MathFn::Tanh, mul(fl(b), x))),
            Act::HardSigmoid(a, b) => {
                let y = add(mul(fl(a), x), fl(b));
                clampf(y, 0.0, 1.0)
            }
            Act::Elu(a) => sel(
                Expr::cmp(CmpOp::Ge, x.clone(), fl(0.0)),
                x.clone(),
                mul(fl(a), sub(call(MathFn::Exp, x), fl(1.0))),
            ),
            Act::Softsign => div(x.clone(), add(fl(1.0), Expr::un(UnOp::Abs, x))),
            Act::Softplus => crate::ops::elementwise::lower::softplus(x, F),
        }
    }
    /// `x.clamp(lo, hi)` (NaN stays NaN).
    fn clampf(x: Expr, lo: f64, hi: f64) -> Expr {
        sel(
            lt(x.clone(), fl(lo)),
            fl(lo),
            sel(gt(x.clone(), fl(hi)), fl(hi), x),
        )
    }

    fn lower(lw: &mut LowerCtx, kind: Kind) -> OpResult<()> {
        let (gates, defaults): (usize, &[&str]) = match kind {
            Kind::Rnn => (1, &["Tanh"]),
            Kind::Gru => (3, &["Sigmoid", "Tanh"]),
            Kind::Lstm => (4, &["Sigmoid", "Tanh", "Tanh"]),
        };
        let x = lw.input(0)?.clone();
        let w = lw.input(1)?.clone();
        let r = lw.input(2)?.clone();
        let bias = lw.opt_input(3).cloned().filter(|t| !t.is_empty());
        let lens = lw.opt_input(4).cloned().filter(|t| !t.is_empty());
        let h0 = lw.opt_input(5).cloned().filter(|t| !t.is_empty());
        let c0 = lw.opt_input(6).cloned().filter(|t| !t.is_empty());
        let pp = lw.opt_input(7).cloned().filter(|t| !t.is_empty());
        let at = &lw.op.attrs;
        ensure!(x.dtype.is_float(), "X must be a float tensor");
        let layout = at.int("layout", 0)?;
        let direction = at.string("direction", "forward".into())?;
        let dirs = match direction.as_str() {
            "forward" | "reverse" => 1,
            "bidirectional" => 2,
            d => bail!("unknown direction `{d}`"),
        };
        ensure!(x.shape.len() == 3, "X must have rank 3");
        let (seq, batch, isz) = if layout == 0 {
            (x.shape[0], x.shape[1], x.shape[2])
        } else {
            (x.shape[1], x.shape[0], x.shape[2])
        };
        let hs = r.shape[2];
        let gh = gates * hs;
        ensure!(
            w.shape == [dirs, gh, isz] && r.shape == [dirs, gh, hs],
            "W/R shapes"
        );
        if let Some(b) = &bias {
            ensure!(b.shape == [dirs, 2 * gh], "B shape");
        }
        if let Some(p) = &pp {
            ensure!(p.shape == [dirs, 3 * hs], "P shape");
        }
        let acts = activations(lw.op, defaults, dirs)?;
        let clip = at.get_float("clip")?.map(|c| c as f64);
        let lbr = at.int("linear_before_reset", 0)? != 0;
        let input_forget = at.int("input_forget", 0)? != 0;
        let per = defaults.len();
        if seq == 0 {
            return Err(OpError::unsupported("empty sequence"));
        }

        let cl = |e: Expr| match clip {
            Some(c) => clampf(e, -c, c),
            None => e,
        };
        let scratch = |lw: &mut LowerCtx, what: &str, n: usize| -> BufId {
            let name = format!("{}/{what}", lw.name);
            lw.program
                .add_buffer(name, BufKind::Arena { offset: 0 }, F, n.max(1) as u64)
        };
        let hb = scratch(lw, "h", hs);
        let cb = scratch(lw, "c", hs);
        let gb = scratch(lw, "g", gh);
        let tb = scratch(lw, "tmp", hs);
        let outs = lw.outputs.clone();
        let y = outs.first().cloned();
        let yh = outs.get(1).cloned();
        let yc = if kind == Kind::Lstm {
            outs.get(2).cloned()
        } else {
            None
        };

        let mut k = lw.kernel("");
        let (d, b, step, t, j, kk) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let (acc, s) = (k.var(F), k.var(F));
        let mut body = Vec::new();
        // Zero Y (positions past a sequence's length stay 0).
        if let (Some(yt), Some(_)) = (&y, &lens) {
            body.push(for_(
                j,
                yt.len(),
                vec![store(yt.buf, v(j), to_out(yt, fl(0.0)))],
            ));
        }
        // Indexing.
        let xidx = |t: Expr, b: Expr, i: Expr| {
            if layout == 0 {
                lin(vec![(t, batch * isz), (b, isz), (i, 1)])
            } else {
                lin(vec![(b, seq * isz), (t, isz), (i, 1)])
            }
        };
        let sidx = |d: Expr, b: Expr, i: Expr| {
            if layout == 0 {
                lin(vec![(d, batch * hs), (b, hs), (i, 1)])
            } else {
                lin(vec![(b, dirs * hs), (d, hs), (i, 1)])
            }
        };
        let yidx = |t: Expr, d: Expr, b: Expr, i: Expr| {
            if layout == 0 {
                lin(vec![
                    (t, dirs * batch * hs),
                    (d, batch * hs),
                    (b, hs),
                    (i, 1),
                ])
            } else {
                lin(vec![(b, seq * dirs * hs), (t, dirs * hs), (d, hs), (i, 1)])
            }
        };
        let wat = |row: Expr, i: Expr| ld(&w, lin(vec![(v(d), gh * isz), (row, isz), (i, 1)]));
        let rat = |row: Expr, i: Expr| ld(&r, lin(vec![(v(d), gh * hs), (row, hs), (i, 1)]));
        let bat = |i: Expr| match &bias {
            Some(bt) => ld(bt, add(mul(v(d), int(2 * gh)), i)),
            None => fl(0.0),
        };
        let pat = |i: Expr| match &pp {
            Some(pt) => ld(pt, add(mul(v(d), int(3 * hs)), i)),
            None => fl(0.0),
        };
        let hat = |i: Expr| Expr::load(hb, i);
        let cat = |i: Expr| Expr::load(cb, i);
        let gat = |i: Expr| Expr::load(gb, i);
        // acc += W[row0 + j] . x_t ; acc += R[row0 + j] . vec
        let wx = |row0: usize| {
            vec![
                set(s, fl(0.0)),
                for_(
                    kk,
                    isz,
                    vec![set(
                        s,
                        add(
                            v(s),
                            mul(
                                wat(add(v(j), int(row0)), v(kk)),
                                ld(&x, xidx(v(t), v(b), v(kk))),
                            ),
                        ),
                    )],
                ),
                set(acc, add(v(acc), v(s))),
            ]
        };
        let rv = |row0: usize, vecb: BufId| {
            vec![
                set(s, fl(0.0)),
                for_(
                    kk,
                    hs,
                    vec![set(
                        s,
                        add(
                            v(s),
                            mul(rat(add(v(j), int(row0)), v(kk)), Expr::load(vecb, v(kk))),
                        ),
                    )],
                ),
                set(acc, add(v(acc), v(s))),
            ]
        };
        // Per (d, b) program; `a` = this direction's activations.
        let per_dir = |dd: usize| -> Vec<Stmt> {
            let a = &acts[dd * per..(dd + 1) * per];
            let reverse = direction == "reverse" || dd == 1;
            let len = match &lens {
                Some(lt) => Expr::cast(Ty::I64, Expr::load(lt.buf, v(b))),
                None => int(seq),
            };
            let mut st = Vec::new();
            // Initial state.
            let init_h = match &h0 {
                Some(h) => ld(h, sidx(v(d), v(b), v(j))),
                None => fl(0.0),
            };
            let init_c = match &c0 {
                Some(c) => ld(c, sidx(v(d), v(b), v(j))),
                None => fl(0.0),
            };
            st.push(for_(
                j,
                hs,
                vec![store(hb, v(j), init_h), store(cb, v(j), init_c)],
            ));
            let mut stepb = vec![set(
                t,
                if reverse {
                    sub(sub(len.clone(), Expr::Int(1)), v(step))
                } else {
                    v(step)
                },
            )];
            match kind {
                Kind::Rnn => {
                    let mut g = vec![set(acc, add(bat(v(j)), bat(add(v(j), int(hs)))))];
                    g.extend(wx(0));
                    g.extend(rv(0, hb));
                    g.push(store(gb, v(j), v(acc)));
                    stepb.push(for_(j, hs, g));
                    stepb.push(for_(j, hs, vec![store(hb, v(j), act(a[0], cl(gat(v(j)))))]));
                }
                Kind::Gru => {
                    let mut g = vec![set(acc, add(bat(v(j)), bat(add(v(j), int(gh)))))];
                    g.extend(wx(0));
                    g.extend(rv(0, hb));
                    g.push(store(gb, v(j), act(a[0], cl(v(acc)))));
                    stepb.push(for_(j, 2 * hs, g));
                    // xh into g[2hs..].
                    let mut g = vec![set(acc, bat(add(v(j), int(2 * hs))))];
                    g.extend(wx(2 * hs));
                    g.push(store(gb, add(v(j), int(2 * hs)), v(acc)));
                    stepb.push(for_(j, hs, g));
                    let xh = gat(add(v(j), int(2 * hs)));
                    let rg = gat(add(v(j), int(hs)));
                    if lbr {
                        let mut g = vec![set(acc, bat(add(v(j), int(gh + 2 * hs))))];
                        g.extend(rv(2 * hs, hb));
                        g.push(store(tb, v(j), act(a[1], cl(add(xh, mul(rg, v(acc)))))));
                        stepb.push(for_(j, hs, g));
                    } else {
                        // tmp = r * h, then hh into g[2hs..] is not possible (xh needed), so
                        // compute rh into acc and hh into tmp after tmp is consumed: use the
                        // h-gate slot of g for r*h.
                        stepb.push(for_(
                            j,
                            hs,
                            vec![store(tb, v(j), mul(rg.clone(), hat(v(j))))],
                        ));
                        let mut g = vec![set(acc, bat(add(v(j), int(gh + 2 * hs))))];
                        g.extend(rv(2 * hs, tb));
                        // Overwrite r (no longer needed) with hh.
                        g.push(store(
                            gb,
                            add(v(j), int(hs)),
                            act(a[1], cl(add(xh, v(acc)))),
                        ));
                        stepb.push(for_(j, hs, g));
                        stepb.push(for_(j, hs, vec![store(tb, v(j), gat(add(v(j), int(hs))))]));
                    }
                    let z = gat(v(j));
                    stepb.push(for_(
                        j,
                        hs,
                        vec![store(
                            hb,
                            v(j),
                            add(
                                mul(sub(fl(1.0), z.clone()), Expr::load(tb, v(j))),
                                mul(z, hat(v(j))),
                            ),
                        )],
                    ));
                }
                Kind::Lstm => {
                    let mut g = vec![set(acc, add(bat(v(j)), bat(add(v(j), int(gh)))))];
                    g.extend(wx(0));
                    g.extend(rv(0, hb));
                    g.push(store(gb, v(j), v(acc)));
                    stepb.push(for_(j, gh, g));
                    let (iv, fv, ov) = (s, acc, acc);
                    let _ = ov;
                    let cj = cat(v(j));
                    let i_e = act(a[0], cl(add(gat(v(j)), mul(pat(v(j)), cj.clone()))));
                    let mut pj = vec![set(iv, i_e)];
                    if input_forget {
                        pj.push(set(fv, sub(fl(1.0), v(iv))));
                    } else {
                        pj.push(set(
                            fv,
                            act(
                                a[0],
                                cl(add(
                                    gat(add(v(j), int(2 * hs))),
                                    mul(pat(add(v(j), int(2 * hs))), cj.clone()),
                                )),
                            ),
                        ));
                    }
                    let cc = act(a[1], cl(gat(add(v(j), int(3 * hs)))));
                    pj.push(store(cb, v(j), add(mul(v(fv), cj), mul(v(iv), cc))));
                    let nc = cat(v(j));
                    let o = act(
                        a[0],
                        cl(add(
                            gat(add(v(j), int(hs))),
                            mul(pat(add(v(j), int(hs))), nc.clone()),
                        )),
                    );
                    pj.push(store(hb, v(j), mul(o, act(a[2], nc))));
                    stepb.push(for_(j, hs, pj));
                }
            }
            if let Some(yt) = &y {
                stepb.push(for_(
                    j,
                    hs,
                    vec![store(
                        yt.buf,
                        yidx(v(t), v(d), v(b), v(j)),
                        to_out(yt, hat(v(j))),
                    )],
                ));
            }
            let stepb = if lens.is_some() {
                vec![Stmt::If {
                    cond: lt(v(step), len),
                    then: stepb,
                    els: vec![],
                }]
            } else {
                stepb
            };
            st.push(for_(step, seq, stepb));
            if let Some(o) = &yh {
                st.push(for_(
                    j,
                    hs,
                    vec![store(o.buf, sidx(v(d), v(b), v(j)), to_out(o, hat(v(j))))],
                ));
            }
            if let Some(o) = &yc {
                st.push(for_(
                    j,
                    hs,
                    vec![store(o.buf, sidx(v(d), v(b), v(j)), to_out(o, cat(v(j))))],
                ));
            }
            st
        };
        for dd in 0..dirs {
            body.push(set(d, int(dd)));
            body.push(for_(b, batch, per_dir(dd)));
        }
        k.body = body;
        lw.push(k);
        Ok(())
    }
}
