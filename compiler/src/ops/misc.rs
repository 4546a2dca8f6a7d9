//! misc ops: TfIdfVectorizer, random generators and the training optimizers of
//! `ai.onnx.preview.training`. (The string ops are in `strings.rs`.)

use super::util::{arr, f64s, input, out, outs, scalar_f64, scalar_i64};
use super::{OpCtx, Registry, Traits};
use crate::ir::{DType, OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{ArrayD, IxDyn};
use std::collections::HashMap;

const TRAINING: &str = "ai.onnx.preview.training";

pub fn register(r: &mut Registry) {
    r.add("TfIdfVectorizer", tfidf);
    r.add("RandomUniform", random_uniform);
    r.add("RandomNormal", random_normal);
    r.add("RandomUniformLike", random_uniform_like);
    r.add("RandomNormalLike", random_normal_like);
    r.add("Bernoulli", bernoulli);
    r.add("Multinomial", multinomial);
    r.add_with(TRAINING, "Momentum", momentum, Traits::default());
    r.add_with(TRAINING, "Adam", adam, Traits::default());
    r.add_with(TRAINING, "Adagrad", adagrad, Traits::default());
    lower::register(r);
}

fn shaped<T>(shape: &[usize], v: Vec<T>) -> OpResult<ArrayD<T>> {
    ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| OpError::new(e.to_string()))
}

// ---------------------------------------------------------------- TfIdfVectorizer

#[derive(Clone, PartialEq, Eq, Hash)]
enum Key {
    I(i64),
    S(String),
}

#[derive(Default)]
struct Gram {
    id: usize,
    leaves: Option<HashMap<Key, Gram>>,
}

fn insert_gram(m: &mut HashMap<Key, Gram>, items: &[Key], id: usize) {
    let Some((first, rest)) = items.split_first() else {
        return;
    };
    let p = m.entry(first.clone()).or_default();
    if rest.is_empty() {
        p.id = id;
    } else {
        insert_gram(p.leaves.get_or_insert_with(HashMap::new), rest, id);
    }
}

fn tfidf(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let a = &ctx.attrs;
    let mode = a.string("mode", "TF".into())?;
    let min_n = a.req_int("min_gram_length")?;
    let max_n = a.req_int("max_gram_length")?;
    let max_skip = a.req_int("max_skip_count")?;
    let counts = a.req_ints("ngram_counts")?;
    let indexes = a.req_ints("ngram_indexes")?;
    let weights = a.floats("weights", vec![])?;
    let pool: Vec<Key> = match a.get_ints("pool_int64s")? {
        Some(v) => v.into_iter().map(Key::I).collect(),
        None => a
            .strings("pool_strings", vec![])?
            .into_iter()
            .map(Key::S)
            .collect(),
    };
    ensure!(
        min_n >= 1 && max_n >= min_n && max_skip >= 0,
        "TfIdfVectorizer: bad gram lengths or skip count"
    );
    ensure!(
        indexes.iter().all(|&i| i >= 0),
        "TfIdfVectorizer: negative ngram index"
    );
    let out_size = indexes.iter().copied().max().map_or(0, |m| m as usize + 1);
    ensure!(
        weights.is_empty() || weights.len() >= out_size,
        "TfIdfVectorizer: too few weights"
    );
    let (min_n, max_n, max_skip) = (min_n as usize, max_n as usize, max_skip as usize);

    // Build the n-gram trie.
    let mut root: HashMap<Key, Gram> = HashMap::new();
    let mut next_id = 1usize;
    let total = pool.len();
    for (i, &start) in counts.iter().enumerate() {
        let n = i + 1;
        ensure!(start >= 0, "TfIdfVectorizer: negative ngram count");
        let start = start as usize;
        let end = match counts.get(i + 1) {
            Some(&e) => e.max(0) as usize,
            None => total,
        };
        ensure!(
            start <= end && end <= total,
            "TfIdfVectorizer: ngram_counts out of range"
        );
        let ngrams = (end - start) / n;
        if n < min_n || n > max_n {
            next_id += ngrams;
            continue;
        }
        for g in 0..ngrams {
            let items = &pool[start + g * n..start + (g + 1) * n];
            insert_gram(&mut root, items, next_id);
            next_id += 1;
        }
    }

    let shape = x.shape().to_vec();
    let (b, c) = match shape.len() {
        0 => (0, 1),
        1 => (0, shape[0]),
        2 => {
            ensure!(shape[0] >= 1, "TfIdfVectorizer: batch must be positive");
            (shape[0], shape[1])
        }
        _ => bail!("TfIdfVectorizer: input must be [C] or [B, C]"),
    };
    let rows = b.max(1);
    let keys: Vec<Key> = if x.dtype() == DType::Str {
        arr::<String>(x)?.iter().cloned().map(Key::S).collect()
    } else {
        super::util::ints(x)?.into_iter().map(Key::I).collect()
    };
    let mut freq = vec![0i64; rows * out_size];
    for row in 0..rows {
        let xs = &keys[row * c..(row + 1) * c];
        let mut start_n = min_n;
        for skip in 1..=max_skip + 1 {
            let mut s = 0;
            while s < c {
                if s + skip * (start_n - 1) >= c {
                    break;
                }
                let mut item = s;
                let mut m = &root;
                let mut n = 1;
                while !m.is_empty() && n <= max_n && item < c {
                    let Some(g) = m.get(&xs[item]) else { break };
                    if n >= start_n && g.id != 0 {
                        let idx = indexes.get(g.id - 1).copied().ok_or_else(|| {
                            OpError::new("TfIdfVectorizer: fewer ngram_indexes than n-grams")
                        })?;
                        freq[row * out_size + idx as usize] += 1;
                    }
                    match &g.leaves {
                        Some(l) => m = l,
                        None => break,
                    }
                    n += 1;
                    item += skip;
                }
                s += 1;
            }
            if start_n == 1 {
                start_n += 1;
                if start_n > max_n {
                    break;
                }
            }
        }
    }
    let y: Vec<f64> = freq
        .iter()
        .enumerate()
        .map(|(p, &f)| {
            let w = weights.get(p % out_size.max(1)).map(|&w| w as f64);
            match (mode.as_str(), w) {
                ("IDF", Some(w)) => {
                    if f > 0 {
                        w
                    } else {
                        0.0
                    }
                }
                ("IDF", None) => (f > 0) as u8 as f64,
                ("TFIDF", Some(w)) => w * f as f64,
                _ => f as f64,
            }
        })
        .collect();
    ensure!(
        matches!(mode.as_str(), "TF" | "IDF" | "TFIDF"),
        "TfIdfVectorizer: unknown mode {mode:?}"
    );
    let oshape = if b == 0 {
        vec![out_size]
    } else {
        vec![b, out_size]
    };
    out(Tensor::from_f64(DType::F32, shaped(&oshape, y)?, false))
}

/// The n-grams TfIdfVectorizer counts, each with its output slot, as the reference's
/// trie keeps them: every pool n-gram whose length is in [min_gram_length,
/// max_gram_length]; an n-gram listed twice counts once, in the slot of its last listing.
fn tfidf_grams(ctx: &OpCtx) -> OpResult<Vec<(Vec<Key>, usize)>> {
    let a = &ctx.attrs;
    let (min_n, max_n) = (a.req_int("min_gram_length")?, a.req_int("max_gram_length")?);
    let counts = a.req_ints("ngram_counts")?;
    let indexes = a.req_ints("ngram_indexes")?;
    let pool: Vec<Key> = match a.get_ints("pool_int64s")? {
        Some(v) => v.into_iter().map(Key::I).collect(),
        None => a
            .strings("pool_strings", vec![])?
            .into_iter()
            .map(Key::S)
            .collect(),
    };
    let mut slot: HashMap<Vec<Key>, usize> = HashMap::new();
    let mut order = Vec::new();
    let mut next_id = 1usize;
    for (i, &start) in counts.iter().enumerate() {
        let n = i + 1;
        ensure!(start >= 0, "TfIdfVectorizer: negative ngram count");
        let start = start as usize;
        let end = match counts.get(i + 1) {
            Some(&e) => e.max(0) as usize,
            None => pool.len(),
        };
        ensure!(
            start <= end && end <= pool.len(),
            "TfIdfVectorizer: ngram_counts out of range"
        );
        for g in 0..(end - start) / n {
            let id = next_id;
            next_id += 1;
            if (n as i64) < min_n || (n as i64) > max_n {
                continue;
            }
            let idx = indexes
                .get(id - 1)
                .copied()
                .ok_or_else(|| OpError::new("TfIdfVectorizer: fewer ngram_indexes than n-grams"))?;
            ensure!(idx >= 0, "TfIdfVectorizer: negative ngram index");
            let items = pool[start + g * n..start + (g + 1) * n].to_vec();
            if slot.insert(items.clone(), idx as usize).is_none() {
                order.push(items);
            }
        }
    }
    Ok(order
        .into_iter()
        .map(|items| {
            let s = slot[&items];
            (items, s)
        })
        .collect())
}

// ---------------------------------------------------------------- random

use super::rng::Mt;

impl Mt {
    /// Seeded from the `seed` attribute (a float), or from the clock when absent.
    fn from_attr(ctx: &OpCtx) -> OpResult<Mt> {
        let seed = match ctx.attrs.get_float("seed")? {
            Some(s) if !s.is_nan() => s as i64 as u32,
            _ => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32))
                .unwrap_or(0),
        };
        Ok(Mt::new(seed))
    }
}

fn random_dtype(ctx: &OpCtx, default: DType) -> OpResult<DType> {
    match ctx.attrs.get_int("dtype")? {
        Some(c) => DType::from_onnx(c as i32)
            .ok_or_else(|| OpError::new(format!("{}: unknown dtype {c}", ctx.op_type))),
        None => Ok(default),
    }
}

fn gen(ctx: &OpCtx, dt: DType, shape: &[usize], normal: bool) -> OpResult<Vec<Value>> {
    ensure!(
        dt.is_float(),
        "{}: dtype must be a float type, got {dt}",
        ctx.op_type
    );
    let mut rng = Mt::from_attr(ctx)?;
    let n: usize = shape.iter().product();
    let v: Vec<f64> = if normal {
        let mean = ctx.attrs.float("mean", 0.0)? as f64;
        let scale = ctx.attrs.float("scale", 1.0)? as f64;
        (0..n).map(|_| rng.gauss() * scale + mean).collect()
    } else {
        let low = ctx.attrs.float("low", 0.0)? as f64;
        let high = ctx.attrs.float("high", 1.0)? as f64;
        (0..n).map(|_| rng.uniform() * (high - low) + low).collect()
    };
    out(Tensor::from_f64(dt, shaped(shape, v)?, false))
}

fn random_uniform(ctx: &OpCtx, _ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let shape = super::util::dims(&ctx.attrs.req_ints("shape")?)?;
    gen(ctx, random_dtype(ctx, DType::F32)?, &shape, false)
}

fn random_normal(ctx: &OpCtx, _ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let shape = super::util::dims(&ctx.attrs.req_ints("shape")?)?;
    gen(ctx, random_dtype(ctx, DType::F32)?, &shape, true)
}

fn random_uniform_like(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    gen(ctx, random_dtype(ctx, x.dtype())?, x.shape(), false)
}

fn random_normal_like(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    gen(ctx, random_dtype(ctx, x.dtype())?, x.shape(), true)
}

fn bernoulli(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    ensure!(x.dtype().is_float(), "Bernoulli: input must be float");
    let dt = random_dtype(ctx, x.dtype())?;
    let p = f64s(x)?;
    ensure!(
        p.iter().all(|&v| (0.0..=1.0).contains(&v)),
        "Bernoulli: probabilities must lie in [0, 1]"
    );
    let mut rng = Mt::from_attr(ctx)?;
    let p = p.as_standard_layout();
    let v: Vec<f64> = p.iter().map(|&q| rng.bernoulli(q)).collect();
    out(Tensor::from_f64(dt, shaped(x.shape(), v)?, false))
}

fn multinomial(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    ensure!(
        x.dtype().is_float() && x.rank() == 2,
        "Multinomial: input must be a 2-D float tensor [batch, classes]"
    );
    let dt = random_dtype(ctx, DType::I32)?;
    ensure!(
        matches!(dt, DType::I32 | DType::I64),
        "Multinomial: dtype must be int32 or int64"
    );
    let n = ctx.attrs.int("sample_size", 1)?;
    let n = super::util::dims(&[n])?[0];
    let logits = f64s(x)?;
    let (b, k) = (x.shape()[0], x.shape()[1]);
    ensure!(k > 0, "Multinomial: no classes");
    let mut rng = Mt::from_attr(ctx)?;
    let mut res = Vec::with_capacity(b * n);
    for row in logits.outer_iter() {
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut cum = Vec::with_capacity(k);
        let mut s = 0.0;
        for &l in row.iter() {
            s += (l - m).exp();
            cum.push(s);
        }
        for _ in 0..n {
            let u = rng.uniform() * s;
            let c = cum.iter().position(|&c| u < c).unwrap_or(k - 1);
            res.push(c as i128);
        }
    }
    out(Tensor::from_i128(dt, shaped(&[b, n], res)?))
}

// ---------------------------------------------------------------- training

/// Splits the optimizer inputs after (R, T) into `groups` lists of `n` tensors.
fn groups<'a>(
    ctx: &OpCtx,
    ins: &[Option<&'a Value>],
    groups: usize,
) -> OpResult<(f64, i64, Vec<Vec<&'a Tensor>>)> {
    let r = scalar_f64(input(ins, 0)?)?;
    let t = scalar_i64(input(ins, 1)?)?;
    let rest = ins.len().saturating_sub(2);
    ensure!(
        rest > 0 && rest.is_multiple_of(groups),
        "{}: expected 2 + {groups}*N inputs, got {}",
        ctx.op_type,
        ins.len()
    );
    let n = rest / groups;
    let mut gs = Vec::with_capacity(groups);
    for g in 0..groups {
        let mut v = Vec::with_capacity(n);
        for i in 0..n {
            v.push(input(ins, 2 + g * n + i)?);
        }
        gs.push(v);
    }
    Ok((r, t, gs))
}

fn same_shape(ctx: &OpCtx, ts: &[&Tensor]) -> OpResult<()> {
    for t in ts {
        ensure!(
            t.shape() == ts[0].shape(),
            "{}: the tensors of one parameter must share a shape",
            ctx.op_type
        );
    }
    Ok(())
}

// The i-th tensor of each input group belongs to parameter i.
#[allow(clippy::needless_range_loop)]
fn momentum(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let alpha = ctx.attrs.float("alpha", 0.0)? as f64;
    let beta = ctx.attrs.float("beta", 0.0)? as f64;
    let norm = ctx.attrs.float("norm_coefficient", 0.0)? as f64;
    let mode = ctx.attrs.string("mode", "standard".into())?;
    let nesterov = match mode.as_str() {
        "standard" => false,
        "nesterov" => true,
        m => bail!("Momentum: unknown mode {m:?}"),
    };
    let (r, t, gs) = groups(ctx, ins, 3)?;
    let beta_adj = if t > 0 { beta } else { 1.0 };
    let mut xs = Vec::new();
    let mut vs = Vec::new();
    for i in 0..gs[0].len() {
        let (xt, gt, vt) = (gs[0][i], gs[1][i], gs[2][i]);
        same_shape(ctx, &[xt, gt, vt])?;
        let (x, g, v) = (f64s(xt)?, f64s(gt)?, f64s(vt)?);
        let greg = &x * norm + &g;
        let vn = &v * alpha + &greg * beta_adj;
        let xn = if nesterov {
            &x - &((&greg + &(&vn * alpha)) * r)
        } else {
            &x - &(&vn * r)
        };
        xs.push(Tensor::from_f64(xt.dtype(), xn, false));
        vs.push(Tensor::from_f64(vt.dtype(), vn, false));
    }
    xs.extend(vs);
    outs(xs)
}

// The i-th tensor of each input group belongs to parameter i.
#[allow(clippy::needless_range_loop)]
fn adam(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let alpha = ctx.attrs.float("alpha", 0.9)? as f64;
    let beta = ctx.attrs.float("beta", 0.999)? as f64;
    let eps = ctx.attrs.float("epsilon", 1e-6)? as f64;
    let norm = ctx.attrs.float("norm_coefficient", 0.0)? as f64;
    let norm_post = ctx.attrs.float("norm_coefficient_post", 0.0)? as f64;
    let (r, t, gs) = groups(ctx, ins, 4)?;
    let r_adj = if t > 0 {
        r * (1.0 - beta.powf(t as f64)).sqrt() / (1.0 - alpha.powf(t as f64))
    } else {
        r
    };
    let (mut xs, mut vs, mut hs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..gs[0].len() {
        let (xt, gt, vt, ht) = (gs[0][i], gs[1][i], gs[2][i], gs[3][i]);
        same_shape(ctx, &[xt, gt, vt, ht])?;
        let (x, g, v, h) = (f64s(xt)?, f64s(gt)?, f64s(vt)?, f64s(ht)?);
        let greg = &x * norm + &g;
        let vn = &v * alpha + &greg * (1.0 - alpha);
        let hn = &h * beta + &(&greg * &greg) * (1.0 - beta);
        let hs_ = hn.mapv(|q| q.sqrt() + eps);
        let xn = &x - &((&vn / &hs_) * r_adj);
        let xf = xn * (1.0 - norm_post);
        xs.push(Tensor::from_f64(xt.dtype(), xf, false));
        vs.push(Tensor::from_f64(vt.dtype(), vn, false));
        hs.push(Tensor::from_f64(ht.dtype(), hn, false));
    }
    xs.extend(vs);
    xs.extend(hs);
    outs(xs)
}

// The i-th tensor of each input group belongs to parameter i.
#[allow(clippy::needless_range_loop)]
fn adagrad(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let decay = ctx.attrs.float("decay_factor", 0.0)? as f64;
    let eps = ctx.attrs.float("epsilon", 1e-6)? as f64;
    let norm = ctx.attrs.float("norm_coefficient", 0.0)? as f64;
    let (r, t, gs) = groups(ctx, ins, 3)?;
    let r_ = r / (1.0 + t as f64 * decay);
    let (mut xs, mut hs) = (Vec::new(), Vec::new());
    for i in 0..gs[0].len() {
        let (xt, gt, ht) = (gs[0][i], gs[1][i], gs[2][i]);
        same_shape(ctx, &[xt, gt, ht])?;
        let (x, g, h) = (f64s(xt)?, f64s(gt)?, f64s(ht)?);
        let greg = &x * norm + &g;
        let hn = &h + &(&greg * &greg);
        let hsq = hn.mapv(|q| q.sqrt() + eps);
        let xn = &x - &((&greg / &hsq) * r_);
        xs.push(Tensor::from_f64(xt.dtype(), xn, false));
        hs.push(Tensor::from_f64(ht.dtype(), hn, false));
    }
    xs.extend(hs);
    outs(xs)
}

mod lower {
    use super::TRAINING;
    use crate::ensure;
    use crate::ir::{OpResult, Tensor};
    use crate::kir::build::*;
    use crate::kir::{BinOp, CmpOp, Expr, MathFn, Stmt, Ty, UnOp};
    use crate::ops::lowering::LowerCtx;
    use crate::ops::{Lowering, Registry};

    fn f(x: f64) -> Expr {
        Expr::Float(x, Ty::F64)
    }
    fn add(a: Expr, b: Expr) -> Expr {
        Expr::bin(BinOp::Add, a, b)
    }
    fn mul(a: Expr, b: Expr) -> Expr {
        Expr::bin(BinOp::Mul, a, b)
    }
    fn to_f64(e: Expr, t: Ty) -> Expr {
        if t.compute() == Ty::F64 {
            e
        } else {
            Expr::cast(Ty::F64, e)
        }
    }

    /// An optimizer update: per parameter, one flat loop that loads the group tensors
    /// into f64 vars and computes the new values. `step(r, t, loaded) -> (set statements
    /// over scratch vars, new values per output group)`.
    #[allow(clippy::type_complexity)]
    fn optimizer(
        lw: &mut LowerCtx,
        groups: usize,
        step: &dyn Fn(&mut crate::kir::Kernel, Expr, Expr, &[Expr]) -> (Vec<Stmt>, Vec<Expr>),
    ) -> OpResult<()> {
        let rest = lw.inputs.len().saturating_sub(2);
        ensure!(
            rest > 0 && rest.is_multiple_of(groups),
            "{}: expected 2 + {groups}*N inputs",
            lw.op.op_type
        );
        let n = rest / groups;
        let rr = lw.input(0)?.clone();
        let tt = lw.input(1)?.clone();
        for i in 0..n {
            let ins: Vec<_> = (0..groups)
                .map(|g| lw.input(2 + g * n + i).cloned())
                .collect::<OpResult<_>>()?;
            let len = ins[0].len();
            for x in &ins {
                ensure!(x.len() == len, "{}: shapes differ", lw.op.op_type);
                ensure!(
                    x.ty().compute().is_float(),
                    "{}: float tensors",
                    lw.op.op_type
                );
            }
            let mut k = lw.kernel(&format!("p{i}"));
            let j = k.var(Ty::I64);
            let r = to_f64(Expr::load(rr.buf, Expr::Int(0)), rr.ty());
            let t = Expr::cast(Ty::I64, Expr::load(tt.buf, Expr::Int(0)));
            let mut body = Vec::new();
            let mut loaded = Vec::new();
            for x in &ins {
                let var = k.var(Ty::F64);
                body.push(Stmt::Set {
                    var,
                    value: to_f64(Expr::load(x.buf, Expr::Var(j)), x.ty()),
                });
                loaded.push(Expr::Var(var));
            }
            let (sets, news) = step(&mut k, r, t, &loaded);
            body.extend(sets);
            let outs: Vec<_> = (0..news.len())
                .map(|g| lw.outputs[g * n + i].clone())
                .collect();
            let mut vars = Vec::new();
            for e in news {
                let var = k.var(Ty::F64);
                body.push(Stmt::Set { var, value: e });
                vars.push(var);
            }
            for (o, var) in outs.iter().zip(vars) {
                let ct = o.ty().compute();
                body.push(Stmt::Store {
                    buf: o.buf,
                    index: Expr::Var(j),
                    value: if ct == Ty::F64 {
                        v(var)
                    } else {
                        Expr::cast(ct, v(var))
                    },
                });
            }
            k.body = vec![Stmt::For {
                var: j,
                extent: len as u64,
                body,
            }];
            lw.push(k);
        }
        Ok(())
    }

    fn momentum(lw: &mut LowerCtx) -> OpResult<()> {
        let alpha = lw.op.attrs.float("alpha", 0.0)? as f64;
        let beta = lw.op.attrs.float("beta", 0.0)? as f64;
        let norm = lw.op.attrs.float("norm_coefficient", 0.0)? as f64;
        let mode = lw.op.attrs.string("mode", "standard".into())?;
        let nesterov = match mode.as_str() {
            "standard" => false,
            "nesterov" => true,
            m => crate::bail!("Momentum: unknown mode {m:?}"),
        };
        optimizer(lw, 3, &|k, r, t, a| {
            let (x, g, vv) = (a[0].clone(), a[1].clone(), a[2].clone());
            let beta_adj = Expr::select(Expr::cmp(CmpOp::Gt, t, Expr::Int(0)), f(beta), f(1.0));
            let (greg, vn) = (k.var(Ty::F64), k.var(Ty::F64));
            let sets = vec![
                Stmt::Set {
                    var: greg,
                    value: add(mul(x.clone(), f(norm)), g),
                },
                Stmt::Set {
                    var: vn,
                    value: add(mul(vv, f(alpha)), mul(v(greg), beta_adj)),
                },
            ];
            let xn = if nesterov {
                sub(x, mul(add(v(greg), mul(v(vn), f(alpha))), r))
            } else {
                sub(x, mul(v(vn), r))
            };
            (sets, vec![xn, v(vn)])
        })
    }

    fn adam(lw: &mut LowerCtx) -> OpResult<()> {
        let alpha = lw.op.attrs.float("alpha", 0.9)? as f64;
        let beta = lw.op.attrs.float("beta", 0.999)? as f64;
        let eps = lw.op.attrs.float("epsilon", 1e-6)? as f64;
        let norm = lw.op.attrs.float("norm_coefficient", 0.0)? as f64;
        let norm_post = lw.op.attrs.float("norm_coefficient_post", 0.0)? as f64;
        optimizer(lw, 4, &|k, r, t, a| {
            let (x, g, vv, h) = (a[0].clone(), a[1].clone(), a[2].clone(), a[3].clone());
            let tf = Expr::cast(Ty::F64, t.clone());
            let r_adj = Expr::select(
                Expr::cmp(CmpOp::Gt, t, Expr::Int(0)),
                div(
                    mul(
                        r.clone(),
                        Expr::un(
                            UnOp::Sqrt,
                            sub(f(1.0), Expr::call(MathFn::Pow, vec![f(beta), tf.clone()])),
                        ),
                    ),
                    sub(f(1.0), Expr::call(MathFn::Pow, vec![f(alpha), tf])),
                ),
                r,
            );
            let (greg, vn, hn) = (k.var(Ty::F64), k.var(Ty::F64), k.var(Ty::F64));
            let sets = vec![
                Stmt::Set {
                    var: greg,
                    value: add(mul(x.clone(), f(norm)), g),
                },
                Stmt::Set {
                    var: vn,
                    value: add(mul(vv, f(alpha)), mul(v(greg), f(1.0 - alpha))),
                },
                Stmt::Set {
                    var: hn,
                    value: add(mul(h, f(beta)), mul(mul(v(greg), v(greg)), f(1.0 - beta))),
                },
            ];
            let hs = add(Expr::un(UnOp::Sqrt, v(hn)), f(eps));
            let xn = sub(x, mul(div(v(vn), hs), r_adj));
            (sets, vec![mul(xn, f(1.0 - norm_post)), v(vn), v(hn)])
        })
    }

    fn adagrad(lw: &mut LowerCtx) -> OpResult<()> {
        let decay = lw.op.attrs.float("decay_factor", 0.0)? as f64;
        let eps = lw.op.attrs.float("epsilon", 1e-6)? as f64;
        let norm = lw.op.attrs.float("norm_coefficient", 0.0)? as f64;
        optimizer(lw, 3, &|k, r, t, a| {
            let (x, g, h) = (a[0].clone(), a[1].clone(), a[2].clone());
            let r_ = div(r, add(f(1.0), mul(Expr::cast(Ty::F64, t), f(decay))));
            let (greg, hn) = (k.var(Ty::F64), k.var(Ty::F64));
            let sets = vec![
                Stmt::Set {
                    var: greg,
                    value: add(mul(x.clone(), f(norm)), g),
                },
                Stmt::Set {
                    var: hn,
                    value: add(h, mul(v(greg), v(greg))),
                },
            ];
            let hs = add(Expr::un(UnOp::Sqrt, v(hn)), f(eps));
            let xn = sub(x, mul(div(v(greg), hs), r_));
            (sets, vec![xn, v(hn)])
        })
    }

    /// TfIdfVectorizer on integer tokens: per row, every n-gram of the pool is compared
    /// at every start and skip (tables of the n-grams of each length, compile-time
    /// loops), its matches counted into the output slot, then the counts weighted.
    fn tfidf(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let y = lw.outputs[0].clone();
        let a = &lw.op.attrs;
        let mode = a.string("mode", "TF".into())?;
        let (min_n, max_n) = (a.req_int("min_gram_length")?, a.req_int("max_gram_length")?);
        let max_skip = a.req_int("max_skip_count")?;
        ensure!(
            min_n >= 1 && max_n >= min_n && max_skip >= 0,
            "TfIdfVectorizer: bad gram lengths or skip count"
        );
        let weights = a.floats("weights", vec![])?;
        ensure!(!x.ty().is_float(), "TfIdfVectorizer: integer tokens");
        let (rows, c) = match x.shape.len() {
            0 => (1, 1),
            1 => (1, x.shape[0]),
            2 => (x.shape[0], x.shape[1]),
            _ => crate::bail!("TfIdfVectorizer: input must be [C] or [B, C]"),
        };
        let out = y.len().checked_div(rows).unwrap_or(0);
        ensure!(out * rows == y.len(), "TfIdfVectorizer: output size");
        ensure!(
            weights.is_empty() || weights.len() >= out,
            "TfIdfVectorizer: too few weights"
        );
        // The n-grams by length: token tables and output slots.
        let mut by_len: std::collections::BTreeMap<usize, (Vec<i64>, Vec<i64>)> =
            Default::default();
        for (items, slot) in super::tfidf_grams(lw.op)? {
            let mut toks = Vec::with_capacity(items.len());
            for k in &items {
                match k {
                    super::Key::I(t) => toks.push(*t),
                    super::Key::S(_) => {
                        return Err(crate::ir::OpError::unsupported(
                            "TfIdfVectorizer on strings is not compiled",
                        ))
                    }
                }
            }
            ensure!(slot < out, "TfIdfVectorizer: ngram index out of range");
            let e = by_len.entry(items.len()).or_default();
            e.0.extend(toks);
            e.1.push(slot as i64);
        }
        let mut k = lw.kernel("");
        let (r, o, sk, s, gi) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let yidx = |slot: Expr| add(mul(v(r), Expr::Int(out as i64)), slot);
        let mut row = vec![Stmt::For {
            var: o,
            extent: out as u64,
            body: vec![Stmt::Store {
                buf: y.buf,
                index: yidx(v(o)),
                value: Expr::f(0.0, Ty::F32),
            }],
        }];
        for (&n, (toks, slots)) in &by_len {
            let pool = lw.constant(
                &format!("pool{n}"),
                &Tensor::from_vec(&[toks.len()], toks.clone()),
            )?;
            let slot = lw.constant(
                &format!("slots{n}"),
                &Tensor::from_vec(&[slots.len()], slots.clone()),
            )?;
            // Unigrams are counted once (skip 1), longer n-grams at every skip.
            let skips = if n == 1 { 1 } else { max_skip as u64 + 1 };
            let skip = add(v(sk), Expr::Int(1));
            let mut hit: Option<Expr> = None;
            for j in 0..n {
                let at = add(
                    add(mul(v(r), Expr::Int(c as i64)), v(s)),
                    mul(skip.clone(), Expr::Int(j as i64)),
                );
                let tok = Expr::cast(Ty::I64, Expr::load(x.buf, at));
                let want = Expr::load(
                    pool,
                    add(mul(v(gi), Expr::Int(n as i64)), Expr::Int(j as i64)),
                );
                let eq = Expr::cmp(CmpOp::Eq, tok, want);
                hit = Some(match hit {
                    None => eq,
                    Some(h) => Expr::bin(BinOp::And, h, eq),
                });
            }
            let dst = yidx(Expr::load(slot, v(gi)));
            let count = Stmt::If {
                cond: hit.expect("n >= 1"),
                then: vec![Stmt::Store {
                    buf: y.buf,
                    index: dst.clone(),
                    value: add(Expr::load(y.buf, dst), Expr::f(1.0, Ty::F32)),
                }],
                els: vec![],
            };
            let grams = vec![Stmt::For {
                var: gi,
                extent: slots.len() as u64,
                body: vec![count],
            }];
            // The last token of the n-gram must lie inside the row.
            let last = add(v(s), mul(skip, Expr::Int(n as i64 - 1)));
            let starts = vec![Stmt::For {
                var: s,
                extent: c as u64,
                body: vec![Stmt::If {
                    cond: Expr::cmp(CmpOp::Lt, last, Expr::Int(c as i64)),
                    then: grams,
                    els: vec![],
                }],
            }];
            row.push(Stmt::For {
                var: sk,
                extent: skips,
                body: starts,
            });
        }
        // Weighting.
        let cnt = k.var(Ty::F64);
        let w = if weights.is_empty() {
            None
        } else {
            let w: Vec<f64> = weights[..out].iter().map(|&w| w as f64).collect();
            Some(Expr::load(
                lw.constant("weights", &Tensor::from_vec(&[out], w))?,
                v(o),
            ))
        };
        let value = match (mode.as_str(), w) {
            ("TF", _) | ("TFIDF", None) => v(cnt),
            ("IDF", w) => Expr::select(
                Expr::cmp(CmpOp::Gt, v(cnt), f(0.0)),
                w.unwrap_or(f(1.0)),
                f(0.0),
            ),
            ("TFIDF", Some(w)) => mul(w, v(cnt)),
            (m, _) => crate::bail!("TfIdfVectorizer: unknown mode {m:?}"),
        };
        row.push(Stmt::For {
            var: o,
            extent: out as u64,
            body: vec![
                Stmt::Set {
                    var: cnt,
                    value: Expr::cast(Ty::F64, Expr::load(y.buf, yidx(v(o)))),
                },
                Stmt::Store {
                    buf: y.buf,
                    index: yidx(v(o)),
                    value: Expr::cast(Ty::F32, value),
                },
            ],
        });
        k.body = vec![Stmt::For {
            var: r,
            extent: rows as u64,
            body: row,
        }];
        lw.push(k);
        Ok(())
    }

    /// Registers a lowering of the training domain.
    fn training(r: &mut Registry, op: &str, l: Lowering) {
        r.lower_in(TRAINING, op, l);
    }

    pub fn register(r: &mut Registry) {
        r.lower("TfIdfVectorizer", Lowering::Custom(tfidf));
        training(r, "Momentum", Lowering::Custom(momentum));
        training(r, "Adam", Lowering::Custom(adam));
        training(r, "Adagrad", Lowering::Custom(adagrad));
    }
}
