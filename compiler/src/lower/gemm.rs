//! f32 MatMul, Gemm and Conv lowered onto `Stmt::Gemm` (the back end picks a microkernel
//! or loops). Each function returns `Ok(false)` when the node is outside what it handles
//! (other dtypes, empty shapes, grouped convolution, ...), and the op's own scalar lowering
//! runs instead.
//!
//! The fused epilogue (`LowerCtx::epilogue`) goes into the call where it can: a leading
//! `Add` of an operand that is a 2-D view of the output (a bias) becomes the call's `init`,
//! a following Relu / Clip / LeakyRelu its activation; the remaining steps run as a pass
//! over the output inside the same kernel.

use crate::ir::{broadcast_shapes, DType, OpResult};
use crate::kir::{BufKind, Expr, GemmAct, GemmCall, Kernel, MatView, Stmt, Ty, VarId};
use crate::ops::lowering::{
    broadcast_strides, index, nest, strides, Act, EpStep, Epilogue, LowerCtx, TensorRef,
};

/// `sum(vars[d] * strides[d])` as an expression (0 when empty).
fn offset(vars: &[VarId], st: &[usize]) -> Expr {
    index(vars, st)
}

/// The stride of a run of dims flattened into one, if their strides allow it.
fn collapse(sizes: &[usize], st: &[usize]) -> Option<i64> {
    let dims: Vec<usize> = (0..sizes.len()).filter(|&d| sizes[d] != 1).collect();
    for w in dims.windows(2) {
        if st[w[0]] != st[w[1]] * sizes[w[1]] {
            return None;
        }
    }
    Some(dims.last().map_or(0, |&d| st[d] as i64))
}

/// The output viewed as `[batch..., rows..., cols...]`: how many dims of each.
struct OutSplit<'a> {
    shape: &'a [usize],
    nbatch: usize,
    nrows: usize,
}

/// What of the epilogue the call takes, and what is left.
struct EpPlan {
    /// A bias operand and its broadcast strides over the output dims.
    init: Option<(TensorRef, Vec<usize>)>,
    act: GemmAct,
    rest: Epilogue,
}

fn plan_epilogue(ep: Option<&Epilogue>, split: &OutSplit, allow_init: bool) -> EpPlan {
    let steps: &[EpStep] = ep.map_or(&[], |e| &e.steps);
    let mut i = 0;
    let mut init = None;
    if allow_init {
        if let Some(EpStep::Add(t)) = steps.first() {
            if t.dtype == DType::F32 && t.shape.len() <= split.shape.len() {
                let st = broadcast_strides(&t.shape, split.shape);
                let (b, r) = (split.nbatch, split.nbatch + split.nrows);
                let ok = collapse(&split.shape[b..r], &st[b..r]).is_some()
                    && matches!(collapse(&split.shape[r..], &st[r..]), Some(0 | 1));
                if ok {
                    init = Some((t.clone(), st));
                    i = 1;
                }
            }
        }
    }
    let mut act = GemmAct::None;
    if let Some(EpStep::Act(a)) = steps.get(i) {
        let g = match a {
            Act::Relu => Some(GemmAct::Relu),
            Act::Clip(lo, hi) => Some(GemmAct::Clip(*lo as f32, *hi as f32)),
            Act::LeakyRelu(al) => Some(GemmAct::Leaky(*al as f32)),
            _ => None,
        };
        if let Some(g) = g {
            act = g;
            i += 1;
        }
    }
    EpPlan {
        init,
        act,
        rest: Epilogue {
            steps: steps[i..].to_vec(),
        },
    }
}

impl EpPlan {
    /// The init view for the batch at `bvars`.
    fn init_view(&self, split: &OutSplit, bvars: &[VarId]) -> Option<MatView> {
        let (t, st) = self.init.as_ref()?;
        let (b, r) = (split.nbatch, split.nbatch + split.nrows);
        Some(MatView {
            buf: t.buf,
            offset: offset(bvars, &st[..b]),
            rs: collapse(&split.shape[b..r], &st[b..r])?,
            cs: collapse(&split.shape[r..], &st[r..])?,
        })
    }

    /// The leftover steps as a pass over the whole output.
    fn rest_pass(&self, k: &mut Kernel, out: &TensorRef) -> Vec<Stmt> {
        if self.rest.is_empty() {
            return vec![];
        }
        let shape = out.shape.clone();
        let st = strides(&shape);
        nest(k, &shape, |_, vars| {
            let idx = index(vars, &st);
            vec![Stmt::Store {
                buf: out.buf,
                index: idx.clone(),
                value: self
                    .rest
                    .apply(Expr::load(out.buf, idx), Ty::F32, vars, &shape),
            }]
        })
    }
}

fn is_f32(t: &TensorRef) -> bool {
    t.dtype == DType::F32
}

/// MatMul with NumPy rules (1-D operands, broadcast batch dims).
pub fn matmul(lw: &mut LowerCtx) -> OpResult<bool> {
    let (Ok(a), Ok(b)) = (lw.input(0).cloned(), lw.input(1).cloned()) else {
        return Ok(false);
    };
    let out = lw.outputs[0].clone();
    if !is_f32(&a) || !is_f32(&b) || !is_f32(&out) || a.shape.is_empty() || b.shape.is_empty() {
        return Ok(false);
    }
    let mut ash = a.shape.clone();
    if ash.len() == 1 {
        ash.insert(0, 1);
    }
    let mut bsh = b.shape.clone();
    if bsh.len() == 1 {
        bsh.push(1);
    }
    let (ra, rb) = (ash.len(), bsh.len());
    let (m, kd) = (ash[ra - 2], ash[ra - 1]);
    let (k2, n) = (bsh[rb - 2], bsh[rb - 1]);
    if kd != k2 || m == 0 || n == 0 || kd == 0 {
        return Ok(false);
    }
    let Some(batch) = broadcast_shapes(&ash[..ra - 2], &bsh[..rb - 2]) else {
        return Ok(false);
    };
    let nb: usize = batch.iter().product();
    if nb == 0 || out.len() != nb * m * n {
        return Ok(false);
    }
    let ab: Vec<usize> = broadcast_strides(&ash[..ra - 2], &batch)
        .into_iter()
        .map(|s| s * m * kd)
        .collect();
    let bb: Vec<usize> = broadcast_strides(&bsh[..rb - 2], &batch)
        .into_iter()
        .map(|s| s * kd * n)
        .collect();
    // The output as [batch..., m, n] (1-D operands drop a dim of the ONNX shape).
    let mut oshape = batch.clone();
    oshape.extend([m, n]);
    // Taken: this kernel applies it (the Fused lowering checks).
    let ep = lw.epilogue.take();
    // B shared by every batch and A contiguous: one GEMM with the batch folded into m.
    let fold = bb.iter().all(|&s| s == 0) && {
        let full: Vec<usize> = strides(&batch).iter().map(|s| s * m * kd).collect();
        ab == full
    };
    let (gm, gbatch): (usize, Vec<usize>) = if fold {
        (nb * m, vec![])
    } else {
        (m, batch.clone())
    };
    // Epilogue operands broadcast against [batch..., m, n]; folded batch dims are rows.
    let split = OutSplit {
        shape: &oshape,
        nbatch: gbatch.len(),
        nrows: oshape.len() - 1 - gbatch.len(),
    };
    let plain = a.shape.len() >= 2 && b.shape.len() >= 2;
    let plan = plan_epilogue(ep.as_ref(), &split, plain);
    let (abs, bbs) = if fold { (vec![], vec![]) } else { (ab, bb) };
    let mut k = lw.kernel("");
    let ost: Vec<usize> = strides(&gbatch).iter().map(|s| s * gm * n).collect();
    let mut body = nest(&mut k, &gbatch, |_, bv| {
        vec![Stmt::Gemm(Box::new(GemmCall {
            m: gm as u64,
            n: n as u64,
            k: kd as u64,
            a: MatView {
                buf: a.buf,
                offset: offset(bv, &abs),
                rs: kd as i64,
                cs: 1,
            },
            b: MatView {
                buf: b.buf,
                offset: offset(bv, &bbs),
                rs: n as i64,
                cs: 1,
            },
            c: MatView {
                buf: out.buf,
                offset: offset(bv, &ost),
                rs: n as i64,
                cs: 1,
            },
            alpha: 1.0,
            init: plan.init_view(&split, bv),
            act: plan.act,
        }))]
    });
    body.extend(plan.rest_pass(&mut k, &out));
    k.body = body;
    lw.push(k);
    Ok(true)
}

/// Gemm: `alpha * A' B' + beta * C` with transA / transB.
pub fn gemm(lw: &mut LowerCtx) -> OpResult<bool> {
    let (Ok(a), Ok(b)) = (lw.input(0).cloned(), lw.input(1).cloned()) else {
        return Ok(false);
    };
    let c = lw.opt_input(2).cloned();
    let out = lw.outputs[0].clone();
    if !is_f32(&a) || !is_f32(&b) || !is_f32(&out) || a.shape.len() != 2 || b.shape.len() != 2 {
        return Ok(false);
    }
    let ta = lw.op.attrs.int("transA", 0)? != 0;
    let tb = lw.op.attrs.int("transB", 0)? != 0;
    let alpha = lw.op.attrs.float("alpha", 1.0)?;
    let beta = lw.op.attrs.float("beta", 1.0)?;
    let (m, kd) = if ta {
        (a.shape[1], a.shape[0])
    } else {
        (a.shape[0], a.shape[1])
    };
    let (k2, n) = if tb {
        (b.shape[1], b.shape[0])
    } else {
        (b.shape[0], b.shape[1])
    };
    if kd != k2 || m == 0 || n == 0 || kd == 0 || out.shape != [m, n] {
        return Ok(false);
    }
    let shape = [m, n];
    let split = OutSplit {
        shape: &shape,
        nbatch: 0,
        nrows: 1,
    };
    let c = match c {
        Some(c) if beta != 0.0 => {
            if beta != 1.0 || !is_f32(&c) || c.shape.len() > 2 {
                return Ok(false);
            }
            if !c
                .shape
                .iter()
                .rev()
                .zip([n, m])
                .all(|(&d, o)| d == 1 || d == o)
            {
                return Ok(false);
            }
            let st = broadcast_strides(&c.shape, &shape);
            Some(MatView {
                buf: c.buf,
                offset: Expr::Int(0),
                rs: st[0] as i64,
                cs: st[1] as i64,
            })
        }
        _ => None,
    };
    // Taken: this kernel applies it (the Fused lowering checks).
    let ep = lw.epilogue.take();
    let plan = plan_epilogue(ep.as_ref(), &split, c.is_none());
    let init = c.or_else(|| plan.init_view(&split, &[]));
    let (ars, acs) = if ta { (1, m as i64) } else { (kd as i64, 1) };
    let (brs, bcs) = if tb { (1, kd as i64) } else { (n as i64, 1) };
    let mut k = lw.kernel("");
    let mut body = vec![Stmt::Gemm(Box::new(GemmCall {
        m: m as u64,
        n: n as u64,
        k: kd as u64,
        a: MatView {
            buf: a.buf,
            offset: Expr::Int(0),
            rs: ars,
            cs: acs,
        },
        b: MatView {
            buf: b.buf,
            offset: Expr::Int(0),
            rs: brs,
            cs: bcs,
        },
        c: MatView {
            buf: out.buf,
            offset: Expr::Int(0),
            rs: n as i64,
            cs: 1,
        },
        alpha,
        init,
        act: plan.act,
    }))];
    body.extend(plan.rest_pass(&mut k, &out));
    k.body = body;
    lw.push(k);
    Ok(true)
}

/// The geometry of a Conv, as the op's lowering computed it.
pub struct ConvGeom<'a> {
    pub group: usize,
    /// Kernel, strides, dilations, pads at the beginning of each spatial dim.
    pub k: &'a [usize],
    pub s: &'a [usize],
    pub d: &'a [usize],
    pub pb: &'a [i64],
    pub in_sp: &'a [usize],
    pub out_sp: &'a [usize],
}

/// f32 Conv (group 1) in NCHW as GEMM per image: `Y[co, o] = W[co, ci*kk] * X'[ci*kk, o]`,
/// where X' is X itself for a 1x1 kernel with stride 1 and no padding, and otherwise an
/// im2col copy in arena scratch.
pub fn conv(lw: &mut LowerCtx, g: &ConvGeom) -> OpResult<bool> {
    let (Ok(x), Ok(w)) = (lw.input(0).cloned(), lw.input(1).cloned()) else {
        return Ok(false);
    };
    let bias = lw.opt_input(2).cloned();
    let out = lw.outputs[0].clone();
    if !is_f32(&x) || !is_f32(&w) || !is_f32(&out) || g.group != 1 || x.shape.len() < 3 {
        return Ok(false);
    }
    if bias
        .as_ref()
        .is_some_and(|b| !is_f32(b) || b.len() != w.shape[0])
    {
        return Ok(false);
    }
    let (nimg, c, m) = (x.shape[0], x.shape[1], w.shape[0]);
    let kl: usize = g.k.iter().product();
    let il: usize = g.in_sp.iter().product();
    let ol: usize = g.out_sp.iter().product();
    let kd = c * kl;
    if nimg == 0 || m == 0 || ol == 0 || kd == 0 || out.len() != nimg * m * ol {
        return Ok(false);
    }
    let direct = kl == 1 && g.s.iter().all(|&s| s == 1) && g.pb.iter().all(|&p| p == 0);
    if direct && ol != il {
        return Ok(false);
    }
    // Output [n, m, spatial...] as [batch = n][rows = m][cols = spatial].
    let oshape = out.shape.clone();
    let split = OutSplit {
        shape: &oshape,
        nbatch: 1,
        nrows: 1,
    };
    // Taken: this kernel applies it (the Fused lowering checks).
    let ep = lw.epilogue.take();
    let plan = plan_epilogue(ep.as_ref(), &split, bias.is_none());
    // Scratch for the im2col matrix of one image.
    let cols = if direct {
        None
    } else {
        Some(lw.program.add_buffer(
            format!("{}/im2col", lw.name),
            BufKind::Arena { offset: 0 },
            Ty::F32,
            (kd * ol) as u64,
        ))
    };
    let mut k = lw.kernel("");
    let nv = k.var(Ty::I64);
    let mut body = Vec::new();
    if let Some(cb) = cols {
        body.extend(im2col(&mut k, g, x.buf, cb, nv, c, il, ol));
    }
    let b_view = match cols {
        None => MatView {
            buf: x.buf,
            offset: Expr::mul(Expr::Var(nv), Expr::Int((c * il) as i64)),
            rs: il as i64,
            cs: 1,
        },
        Some(cb) => MatView {
            buf: cb,
            offset: Expr::Int(0),
            rs: ol as i64,
            cs: 1,
        },
    };
    let init = match &bias {
        Some(bt) => Some(MatView {
            buf: bt.buf,
            offset: Expr::Int(0),
            rs: 1,
            cs: 0,
        }),
        None => plan.init_view(&split, &[nv]),
    };
    body.push(Stmt::Gemm(Box::new(GemmCall {
        m: m as u64,
        n: ol as u64,
        k: kd as u64,
        a: MatView {
            buf: w.buf,
            offset: Expr::Int(0),
            rs: kd as i64,
            cs: 1,
        },
        b: b_view,
        c: MatView {
            buf: out.buf,
            offset: Expr::mul(Expr::Var(nv), Expr::Int((m * ol) as i64)),
            rs: ol as i64,
            cs: 1,
        },
        alpha: 1.0,
        init,
        act: plan.act,
    })));
    let mut all = vec![Stmt::For {
        var: nv,
        extent: nimg as u64,
        body,
    }];
    all.extend(plan.rest_pass(&mut k, &out));
    k.body = all;
    lw.push(k);
    Ok(true)
}

/// `cols[(ci, kk), o] = X[img, ci, o * s - pb + kk * d]` (0 in the padding).
#[allow(clippy::too_many_arguments)]
fn im2col(
    k: &mut Kernel,
    g: &ConvGeom,
    xb: usize,
    cb: usize,
    img: VarId,
    c: usize,
    il: usize,
    ol: usize,
) -> Vec<Stmt> {
    use crate::kir::{BinOp, CmpOp};
    let r = g.k.len();
    let ci = k.var(Ty::I64);
    let kv: Vec<VarId> = (0..r).map(|_| k.var(Ty::I64)).collect();
    let ov: Vec<VarId> = (0..r).map(|_| k.var(Ty::I64)).collect();
    let kl: usize = g.k.iter().product();
    // Input coordinate per spatial dim, and whether all are inside.
    let mut inside: Option<Expr> = None;
    let mut xidx = Expr::add(
        Expr::mul(Expr::Var(img), Expr::Int((c * il) as i64)),
        Expr::mul(Expr::Var(ci), Expr::Int(il as i64)),
    );
    let ist = strides(g.in_sp);
    for dd in 0..r {
        let coord = Expr::add(
            Expr::bin(
                BinOp::Sub,
                Expr::mul(Expr::Var(ov[dd]), Expr::Int(g.s[dd] as i64)),
                Expr::Int(g.pb[dd]),
            ),
            Expr::mul(Expr::Var(kv[dd]), Expr::Int(g.d[dd] as i64)),
        );
        let ok = Expr::bin(
            BinOp::And,
            Expr::cmp(CmpOp::Ge, coord.clone(), Expr::Int(0)),
            Expr::cmp(CmpOp::Lt, coord.clone(), Expr::Int(g.in_sp[dd] as i64)),
        );
        inside = Some(match inside {
            None => ok,
            Some(e) => Expr::bin(BinOp::And, e, ok),
        });
        xidx = Expr::add(xidx, Expr::mul(coord, Expr::Int(ist[dd] as i64)));
    }
    let krow = Expr::add(
        Expr::mul(Expr::Var(ci), Expr::Int(kl as i64)),
        index(&kv, &strides(g.k)),
    );
    let dst = Expr::add(
        Expr::mul(krow, Expr::Int(ol as i64)),
        index(&ov, &strides(g.out_sp)),
    );
    let store = |value: Expr| Stmt::Store {
        buf: cb,
        index: dst.clone(),
        value,
    };
    let inner = vec![Stmt::If {
        cond: inside.unwrap_or(Expr::Int(1)),
        then: vec![store(Expr::load(xb, xidx))],
        els: vec![store(Expr::f(0.0, Ty::F32))],
    }];
    let mut body = inner;
    for dd in (0..r).rev() {
        body = vec![Stmt::For {
            var: ov[dd],
            extent: g.out_sp[dd] as u64,
            body,
        }];
    }
    for dd in (0..r).rev() {
        body = vec![Stmt::For {
            var: kv[dd],
            extent: g.k[dd] as u64,
            body,
        }];
    }
    vec![Stmt::For {
        var: ci,
        extent: c as u64,
        body,
    }]
}
