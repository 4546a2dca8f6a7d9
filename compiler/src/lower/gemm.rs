//! f32 MatMul, Gemm and Conv lowered onto `Stmt::Gemm` (the back end picks a microkernel
//! or loops). Each function returns `Ok(false)` when the node is outside what it handles
//! (other dtypes, empty shapes, grouped convolution, ...), and the op's own scalar lowering
//! runs instead.
//!
//! The fused epilogue (`LowerCtx::epilogue`) goes into the call where it can: a leading
//! `Add` of an operand that is a 2-D view of the output (a bias) becomes the call's `init`,
//! a following `Add` of a whole tensor of the output's shape (a residual) its `add`, a
//! following Relu / Clip / LeakyRelu / SiLU its activation; the remaining steps run as a
//! pass over the output inside the same kernel.

mod winograd;

use crate::backend::cranelift::gemm::SPLIT_MIN_ROWS_PACKED;
use crate::ir::{broadcast_shapes, DType, OpResult, EXACT_SUMS};
use crate::kir::build::{
    add, and, cmp, divisor_at_most, for_, int, lin, loops, per_part, store, sub, two_threads_end,
};
use crate::kir::{BufKind, CmpOp, Expr, GemmAct, GemmCall, Kernel, MatView, Stmt, Ty, VarId};
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
    /// A residual of the output's shape, read at C's positions.
    add: Option<TensorRef>,
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
    // A residual after the bias (or the conv's own bias, or Gemm's C): every element of
    // the output's shape, so it reads at C's positions.
    let mut add = None;
    if let Some(EpStep::Add(t)) = steps.get(i) {
        let whole = t.len() == split.shape.iter().product::<usize>();
        if t.dtype == DType::F32 && t.shape.len() <= split.shape.len() && whole {
            add = Some(t.clone());
            i += 1;
        }
    }
    let mut act = GemmAct::None;
    if let Some(EpStep::Act(a)) = steps.get(i) {
        let g = match a {
            Act::Relu => Some(GemmAct::Relu),
            Act::Clip(lo, hi) => Some(GemmAct::Clip(*lo as f32, *hi as f32)),
            Act::LeakyRelu(al) => Some(GemmAct::Leaky(*al as f32)),
            Act::Silu => Some(GemmAct::Silu),
            _ => None,
        };
        if let Some(g) = g {
            act = g;
            i += 1;
        }
    }
    EpPlan {
        init,
        add,
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
            panel: None,
        })
    }

    /// The add view: the residual where `c` (a view of the output) reads.
    fn add_view(&self, c: &MatView) -> Option<MatView> {
        self.add.as_ref().map(|t| MatView {
            buf: t.buf,
            ..c.clone()
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
        let c = MatView::strided(out.buf, offset(bv, &ost), n as i64, 1);
        vec![Stmt::Gemm(Box::new(GemmCall {
            m: gm as u64,
            n: n as u64,
            k: kd as u64,
            a: MatView::strided(a.buf, offset(bv, &abs), kd as i64, 1),
            b: MatView::strided(b.buf, offset(bv, &bbs), n as i64, 1),
            add: plan.add_view(&c),
            c,
            alpha: 1.0,
            init: plan.init_view(&split, bv),
            act: plan.act,
            int8: false,
        }))]
    });
    body.extend(plan.rest_pass(&mut k, &out));
    k.body = body;
    lw.push(k);
    Ok(true)
}

/// MatMulInteger of a u8 A by a constant i8 `[K, N]` B without a zero point (what
/// `passes::widen_integer` leaves for targets with 8-bit dot products), K a multiple of
/// 4, as one 8-bit [`GemmCall`], A's batch dims folded into its rows, B in quads. A's zero point comes in through
/// init: `sum_p (a - za) b = sum_p a b - za colsum(b)`, the column sums known at compile
/// time and `-za colsum` computed on entry (za may be a run-time value, as after
/// DynamicQuantizeLinear). All of it in wrapping i32, as the reference.
pub fn matmul_int8(lw: &mut LowerCtx) -> OpResult<bool> {
    let (Ok(a), Ok(b)) = (lw.input(0).cloned(), lw.input(1).cloned()) else {
        return Ok(false);
    };
    let out = lw.outputs[0].clone();
    let za = lw.opt_input(2).cloned();
    let Some(bv) = b.value.as_ref().and_then(|t| t.to_i64_vec()) else {
        return Ok(false);
    };
    if a.dtype != DType::U8
        || b.dtype != DType::I8
        || out.dtype != DType::I32
        || a.shape.len() < 2
        || b.shape.len() != 2
        || lw.opt_input(3).is_some()
        || za
            .as_ref()
            .is_some_and(|z| z.dtype != DType::U8 || z.len() != 1)
    {
        return Ok(false);
    }
    let (kd, n) = (b.shape[0], b.shape[1]);
    let m = a.len() / kd.max(1);
    if a.shape[a.shape.len() - 1] != kd
        || m == 0
        || n == 0
        || kd == 0
        || !kd.is_multiple_of(4)
        || out.len() != m * n
        || bv.len() != kd * n
    {
        return Ok(false);
    }
    let quads = (0..kd * n)
        .map(|e| {
            let (q, j, t) = (e / (4 * n), e / 4 % n, e % 4);
            bv[(4 * q + t) * n + j] as i8 as u8
        })
        .collect::<Vec<u8>>();
    let wq = lw.program.add_buffer(
        format!("{}/w_quads", lw.name),
        BufKind::Const { data: quads },
        Ty::I8,
        (kd * n) as u64,
    );
    let mut k = lw.kernel("");
    let mut body = Vec::new();
    let init = za.as_ref().map(|z| {
        let mut colsum = vec![0i32; n];
        for (i, x) in bv.iter().enumerate() {
            colsum[i % n] = colsum[i % n].wrapping_add(*x as i32);
        }
        zero_point_init(lw, &mut k, &mut body, z, &colsum, (0, 1))
    });
    body.push(Stmt::Gemm(Box::new(GemmCall {
        m: m as u64,
        n: n as u64,
        k: kd as u64,
        a: MatView::strided(a.buf, Expr::Int(0), kd as i64, 1),
        b: MatView::strided(wq, Expr::Int(0), 4 * n as i64, 4),
        c: MatView::strided(out.buf, Expr::Int(0), n as i64, 1),
        alpha: 1.0,
        init,
        add: None,
        act: GemmAct::None,
        int8: true,
    })));
    k.body = body;
    lw.push(k);
    Ok(true)
}

/// The init view of an 8-bit product whose u8 operand has the zero point `z` (one u8):
/// `-z sums[j]` for each sum of the other operand over k, computed into arena scratch by
/// a loop appended to `body` (the sums are constants; `z` may be a run-time value), as a
/// view of strides `view` (rs, cs): `(0, 1)` for B's columns, `(1, 0)` for A's rows.
fn zero_point_init(
    lw: &mut LowerCtx,
    k: &mut Kernel,
    body: &mut Vec<Stmt>,
    z: &TensorRef,
    colsum: &[i32],
    view: (i64, i64),
) -> MatView {
    let n = colsum.len();
    let data = colsum.iter().flat_map(|x| x.to_le_bytes()).collect();
    let name = &lw.name;
    let cs = lw.program.add_buffer(
        format!("{name}/colsum"),
        BufKind::Const { data },
        Ty::I32,
        n as u64,
    );
    let ib = lw.program.add_buffer(
        format!("{name}/init"),
        BufKind::Arena { offset: 0 },
        Ty::I32,
        n as u64,
    );
    let j = k.var(Ty::I64);
    let zero = Expr::cast(Ty::I32, Expr::load(z.buf, Expr::Int(0)));
    body.push(for_(
        j,
        n,
        vec![store(
            ib,
            Expr::Var(j),
            Expr::bin(
                crate::kir::BinOp::Sub,
                Expr::cast(Ty::I32, Expr::Int(0)),
                Expr::mul(zero, Expr::load(cs, Expr::Var(j))),
            ),
        )],
    ));
    MatView::strided(ib, Expr::Int(0), view.0, view.1)
}

/// ConvInteger of u8 x by a constant i8 weight without a weight zero point (what
/// `passes::widen_integer` leaves for targets with 8-bit dot products), group 1, 1-D or
/// 2-D, as one 8-bit [`GemmCall`] per image in the output's own layout: the weights are
/// A (`[co][k]`, k ordered tap, channel, channels padded to a multiple of 4 with zero
/// weights), the input's columns B, the output channels' planes C. B is in quads (four
/// channels of a pixel together): x goes once into `xq[c/4][pixel][4]`, then, unless
/// the conv is 1x1 over every pixel (`xq` is then B), each tap's rows are copied out of
/// it as runs of bytes (`cols[tap][c/4][out pixel][4]`), the zero point wherever a tap
/// falls in the padding. x's zero point comes in through init, as in [`matmul_int8`]:
/// `-za` times each row's weight sum, and an input pixel equal to it adds nothing.
pub fn conv_int8(lw: &mut LowerCtx, g: &ConvGeom) -> OpResult<bool> {
    let (Ok(x), Ok(w)) = (lw.input(0).cloned(), lw.input(1).cloned()) else {
        return Ok(false);
    };
    let out = lw.outputs[0].clone();
    let za = lw.opt_input(2).cloned();
    let Some(wv) = w.value.as_ref().and_then(|t| t.to_i64_vec()) else {
        return Ok(false);
    };
    let Some(p2) = Plane::of(g) else {
        return Ok(false);
    };
    if x.dtype != DType::U8
        || w.dtype != DType::I8
        || out.dtype != DType::I32
        || g.group != 1
        || x.shape.len() < 3
        || lw.opt_input(3).is_some()
        || za
            .as_ref()
            .is_some_and(|z| z.dtype != DType::U8 || z.len() != 1)
    {
        return Ok(false);
    }
    let (nimg, c, m) = (x.shape[0], x.shape[1], w.shape[0]);
    let taps = p2.kh * p2.kw;
    let (il, ol) = (p2.h * p2.w, p2.oh * p2.ow);
    let cq = c.div_ceil(4);
    let kp = taps * cq * 4;
    if nimg == 0 || m == 0 || ol == 0 || c == 0 || out.len() != nimg * m * ol {
        return Ok(false);
    }
    if wv.len() != m * c * taps || x.len() != nimg * c * il {
        return Ok(false);
    }
    // A: [m][kp], column `(tap * cq + ci / 4) * 4 + ci % 4`; and each row's sum.
    let mut adata = vec![0u8; m * kp];
    let mut rowsum = vec![0i32; m];
    for co in 0..m {
        for ci in 0..c {
            for t in 0..taps {
                let v = wv[(co * c + ci) * taps + t] as i8;
                adata[co * kp + (t * cq + ci / 4) * 4 + ci % 4] = v as u8;
                rowsum[co] = rowsum[co].wrapping_add(i32::from(v));
            }
        }
    }
    let name = lw.name.clone();
    let buf = |lw: &mut LowerCtx, what: &str, kind: BufKind, ty: Ty, len: usize| {
        lw.program
            .add_buffer(format!("{name}/{what}"), kind, ty, len as u64)
    };
    let arena = || BufKind::Arena { offset: 0 };
    let wb = buf(lw, "w_i8", BufKind::Const { data: adata }, Ty::I8, m * kp);
    // Strided convs take x's quads in phases: plane (py, px) holds the pixels of rows
    // py, py + sh, ... and columns px, px + sw, ..., `[sh][sw][cq][hp][wp][4]`, so every
    // tap reads one phase at stride 1 and copies contiguous runs (per pixel at stride 2,
    // the copies were scalar: the 3-channel 7x7 stride-2 stem took 1.45 ms).
    let phased = p2.sh > 1 || p2.sw > 1;
    let (hp, wp) = (p2.h.div_ceil(p2.sh), p2.w.div_ceil(p2.sw));
    let xq = buf(
        lw,
        "x_quads",
        arena(),
        Ty::U8,
        cq * p2.sh * p2.sw * hp * wp * 4,
    );
    let direct = taps == 1 && p2.sh == 1 && p2.sw == 1 && p2.ph == 0 && p2.pw == 0 && ol == il;
    let cols = if direct {
        xq
    } else {
        buf(lw, "cols", arena(), Ty::U8, taps * cq * ol * 4)
    };
    let mut k = lw.kernel("");
    let mut body = Vec::new();
    // A byte as the vector loops copy bytes: through f32, exactly.
    let byte = |e: Expr| Expr::cast(Ty::U8, Expr::cast(Ty::F32, e));
    let zero_byte = match &za {
        Some(z) => byte(Expr::load(z.buf, Expr::Int(0))),
        None => Expr::cast(Ty::U8, Expr::f(0.0, Ty::F32)),
    };
    let init = za
        .as_ref()
        .map(|z| zero_point_init(lw, &mut k, &mut body, z, &rowsum, (1, 0)));
    let nv = k.var(Ty::I64);
    let (q, c4, e) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
    let oy = k.var(Ty::I64);
    let (qy, qx) = (k.var(Ty::I64), k.var(Ty::I64));
    let v = Expr::Var;
    let mut img = Vec::new();
    // x[nv] into quads, plane by plane (one plane without a stride): channel ci's byte of
    // plane pixel (qy, qx) at `(((ci / 4) hp + qy) wp + qx) 4 + ci % 4` from the plane's
    // start, the four channels of a quad stored by one iteration (a loop over them, or
    // over pixels with a stride of 4, runs as scalar code four times as long); the last
    // quad's missing channels (zero weights) hold the zero point.
    let quads = |c4v: Expr, present: usize| -> Vec<Stmt> {
        // Per plane: its start in the quads, its start in x, and its loops (variable,
        // extent, byte stride in the quads, in x); without a stride one flat loop over the
        // pixels (as two loops over rows and columns it took 10% longer).
        type Loops = Vec<(VarId, usize, usize, usize)>;
        let planes: Vec<(usize, usize, Loops)> = if phased {
            let mut v = Vec::new();
            for py in 0..p2.sh.min(p2.h) {
                for px in 0..p2.sw.min(p2.w) {
                    let rows = (p2.h - py).div_ceil(p2.sh);
                    let cols_n = (p2.w - px).div_ceil(p2.sw);
                    v.push((
                        (py * p2.sw + px) * cq * hp * wp * 4,
                        py * p2.w + px,
                        vec![(qy, rows, 4 * wp, p2.sh * p2.w), (qx, cols_n, 4, p2.sw)],
                    ));
                }
            }
            v
        } else {
            vec![(0, 0, vec![(q, il, 4, 1)])]
        };
        planes
            .into_iter()
            .map(|(plane, src0, loops)| {
                let body = (0..4)
                    .map(|t| {
                        let mut dst = vec![(c4v.clone(), 4 * hp * wp), (int(plane + t), 1)];
                        dst.extend(loops.iter().map(|l| (v(l.0), l.2)));
                        let val = if t < present {
                            let mut src = vec![
                                (v(nv), c * il),
                                (c4v.clone(), 4 * il),
                                (int(t * il + src0), 1),
                            ];
                            src.extend(loops.iter().map(|l| (v(l.0), l.3)));
                            Expr::load(x.buf, lin(src))
                        } else {
                            zero_byte.clone()
                        };
                        store(xq, lin(dst), val)
                    })
                    .collect();
                loops
                    .iter()
                    .rev()
                    .fold(body, |inner, l| vec![for_(l.0, l.1, inner)])
                    .remove(0)
            })
            .collect()
    };
    // Per quad of channels, its chain: the quads of x, then every tap's rows of cols
    // from them (padding filled with the zero point). One loop over the quads holds all
    // of it, so that two threads split one loop (thirty copy loops each handed to the
    // pool cost more than they saved: an 8-bit 64-channel 3x3 conv 0.43 ms on one thread
    // took 1.05 on two), and a quad's row of x is still in cache for its taps.
    let chain = |c4e: Expr, present: usize| -> Vec<Stmt> {
        let mut out = quads(c4e.clone(), present);
        if direct {
            return out;
        }
        // One quad only (an image's stem): the chain's loops would all run one after
        // another, each split between threads on its own (the 3-channel stem took 0.81
        // ms on two threads, 0.65 on one); instead one loop over output rows holds every
        // tap's row, the rows outside a tap's range filled under a condition.
        let by_rows = cq == 1;
        let mut row_body = Vec::new();
        for r in 0..p2.kh {
            let (ylo, yhi) = Plane::valid(p2.oh, p2.sh, p2.ph, r, p2.dh, p2.h);
            for s in 0..p2.kw {
                let (xlo, xhi) = Plane::valid(p2.ow, p2.sw, p2.pw, s, p2.dw, p2.w);
                // This tap's rows of cols: [cq][ol][4] bytes from `tap0`.
                let tap0 = (r * p2.kw + s) * cq * ol * 4;
                // The zero point into bytes `lo..lo + n` of output row `row` (plus `at`
                // rows) of the quad's plane.
                let fill_row = |row: Expr, at: usize, lo: usize, n: usize| {
                    let at = lin(vec![
                        (c4e.clone(), ol * 4),
                        (row, p2.ow * 4),
                        (v(e), 1),
                        (int(tap0 + at * p2.ow * 4 + lo), 1),
                    ]);
                    for_(e, n, vec![store(cols, at, zero_byte.clone())])
                };
                if ylo >= yhi || xlo >= xhi {
                    let fill = fill_row(v(oy), 0, 0, p2.ow * 4);
                    if by_rows {
                        row_body.push(fill);
                    } else {
                        out.push(for_(oy, p2.oh, vec![fill]));
                    }
                    continue;
                }
                // Input row iy = oy sh + d = (oy + dy) sh + py: phase plane (py, px) from
                // its row oy + dy (without a stride, the one plane and dy = d).
                let d = |r: usize, dil: usize, pad: i64, st: usize| {
                    let d = (r * dil) as i64 - pad;
                    let ph = d.rem_euclid(st as i64);
                    (ph as usize, (d - ph) / st as i64)
                };
                let (py, dy) = d(r, p2.dh, p2.ph, p2.sh);
                let (px, dx) = d(s, p2.dw, p2.pw, p2.sw);
                let plane = ((py * p2.sw + px) * cq * hp * wp * 4) as i64;
                // Bytes of the run's source in row oy: plane + (oy + dy) wp 4 + (xlo +
                // dx) 4, at or past 0 for oy >= ylo.
                let src_at = plane + ((dy * wp as i64) + xlo as i64 + dx) * 4;
                let n = (xhi - xlo) * 4;
                // Row `row` (plus `at` rows) of this tap: the ends' padding and the run.
                let row_stmts = |row: Expr, at: usize| {
                    let mut st = Vec::new();
                    if xlo > 0 {
                        st.push(fill_row(row.clone(), at, 0, xlo * 4));
                    }
                    if xhi < p2.ow {
                        st.push(fill_row(row.clone(), at, xhi * 4, (p2.ow - xhi) * 4));
                    }
                    let from = usize::try_from(src_at + (at * wp * 4) as i64)
                        .expect("a valid row's source is inside the planes");
                    let src = lin(vec![
                        (c4e.clone(), hp * wp * 4),
                        (row.clone(), wp * 4),
                        (v(e), 1),
                        (int(from), 1),
                    ]);
                    let dst = lin(vec![
                        (c4e.clone(), ol * 4),
                        (row, p2.ow * 4),
                        (v(e), 1),
                        (int(tap0 + (at * p2.ow + xlo) * 4), 1),
                    ]);
                    st.push(for_(
                        e,
                        n,
                        vec![store(cols, dst, byte(Expr::load(xq, src)))],
                    ));
                    st
                };
                if by_rows {
                    // (oy >= ylo: the source offset is taken at row ylo, oy - ylo added.)
                    let rel = sub(v(oy), int(ylo));
                    let st = row_stmts(rel, ylo);
                    if ylo == 0 && yhi == p2.oh {
                        row_body.extend(st);
                    } else {
                        row_body.push(Stmt::If {
                            cond: and(
                                cmp(CmpOp::Ge, v(oy), int(ylo)),
                                cmp(CmpOp::Lt, v(oy), int(yhi)),
                            ),
                            then: st,
                            els: vec![fill_row(v(oy), 0, 0, p2.ow * 4)],
                        });
                    }
                    continue;
                }
                // Padding: whole output rows above and below, then the run's rows.
                if ylo > 0 {
                    out.push(for_(oy, ylo, vec![fill_row(v(oy), 0, 0, p2.ow * 4)]));
                }
                if yhi < p2.oh {
                    let rows = p2.oh - yhi;
                    out.push(for_(oy, rows, vec![fill_row(v(oy), yhi, 0, p2.ow * 4)]));
                }
                out.push(for_(oy, yhi - ylo, row_stmts(v(oy), ylo)));
            }
        }
        if by_rows {
            out.push(for_(oy, p2.oh, row_body));
        }
        out
    };
    if c >= 4 {
        img.push(for_(c4, c / 4, chain(v(c4), 4)));
    }
    if c % 4 != 0 {
        img.extend(chain(int(c / 4), c % 4));
    }
    img.push(Stmt::Gemm(Box::new(GemmCall {
        m: m as u64,
        n: ol as u64,
        k: kp as u64,
        a: MatView::strided(wb, Expr::Int(0), kp as i64, 1),
        b: MatView::strided(cols, Expr::Int(0), (ol * 4) as i64, 4),
        c: MatView::strided(out.buf, lin(vec![(v(nv), m * ol)]), ol as i64, 1),
        alpha: 1.0,
        init,
        add: None,
        act: GemmAct::None,
        int8: true,
    })));
    body.push(for_(nv, nimg, img));
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
            Some(MatView::strided(
                c.buf,
                Expr::Int(0),
                st[0] as i64,
                st[1] as i64,
            ))
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
    let c = MatView::strided(out.buf, Expr::Int(0), n as i64, 1);
    let mut body = vec![Stmt::Gemm(Box::new(GemmCall {
        m: m as u64,
        n: n as u64,
        k: kd as u64,
        a: MatView::strided(a.buf, Expr::Int(0), ars, acs),
        b: MatView::strided(b.buf, Expr::Int(0), brs, bcs),
        add: plan.add_view(&c),
        c,
        alpha,
        init,
        act: plan.act,
        int8: false,
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
/// where X' is X itself for a 1x1 kernel with stride 1 and no padding (rows of X a whole
/// number of vectors apart, or few output channels), and otherwise an im2col copy. 1-D
/// and 2-D convs copy a block of output rows at a time (about [`IM2COL_BLOCK_BYTES`])
/// into arena scratch in the microkernel's B panel layout, then run the GEMM on that
/// block; 3-D convs copy the whole image.
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
    // A pooled output ([`LowerCtx::max_pool_2x2`]) has a quarter of the conv's elements.
    let pool = lw.max_pool_2x2;
    let out_len = if pool {
        nimg * m * ol / 4
    } else {
        nimg * m * ol
    };
    if nimg == 0 || m == 0 || ol == 0 || kd == 0 || out.len() != out_len {
        return Ok(false);
    }
    let direct = kl == 1 && g.s.iter().all(|&s| s == 1) && g.pb.iter().all(|&p| p == 0);
    if direct && ol != il {
        return Ok(false);
    }
    // Winograd's transforms round; a conv marked for exact sums (integers) skips it.
    let exact = lw.op.attrs.int(EXACT_SUMS, 0).unwrap_or(0) != 0;
    if !direct && !exact {
        let wino = Plane::of(g).and_then(|p2| Some((winograd::fits(&p2, c, m)?, p2)));
        if let Some((wino, p2)) = wino {
            let ep = lw.epilogue.take().filter(|e| !e.is_empty());
            let dims = (nimg, c, m);
            if winograd::conv(
                lw,
                wino,
                &p2,
                &x,
                &w,
                bias.as_ref(),
                (&out, pool),
                ep.as_ref(),
                dims,
            ) {
                lw.max_pool_2x2 = false;
                return Ok(true);
            }
            lw.epilogue = ep;
        }
    }
    if pool {
        // Only the Winograd lowering pools.
        return Ok(false);
    }
    if channels_in_lanes(m, ol, kd, direct) {
        if let (Some(p2), Some(wt)) = (Plane::of(g), transposed_weights(lw, &w, m, kd)) {
            conv_transposed(lw, &p2, &x, wt, bias, &out, (nimg, c, m));
            return Ok(true);
        }
    }
    if !direct {
        if let Some(p2) = Plane::of(g).filter(|p2| padded_fits(p2, c)) {
            conv_padded(lw, &p2, &x, w.buf, bias, &out, (nimg, c, m));
            return Ok(true);
        }
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
    let init_for = |nv: VarId, col0: Expr| -> Option<MatView> {
        match &bias {
            Some(bt) => Some(MatView::strided(bt.buf, Expr::Int(0), 1, 0)),
            None => plan.init_view(&split, &[nv]).map(|v| MatView {
                offset: shift(v.offset.clone(), col0, v.cs),
                ..v
            }),
        }
    };
    let gemm_call = |b: MatView, nv: VarId, col0: Expr, n: usize| {
        let c = MatView {
            buf: out.buf,
            offset: shift(
                Expr::mul(Expr::Var(nv), Expr::Int((m * ol) as i64)),
                col0.clone(),
                1,
            ),
            rs: ol as i64,
            cs: 1,
            panel: None,
        };
        Stmt::Gemm(Box::new(GemmCall {
            m: m as u64,
            n: n as u64,
            k: kd as u64,
            a: MatView::strided(w.buf, Expr::Int(0), kd as i64, 1),
            b,
            add: plan.add_view(&c),
            c,
            alpha: 1.0,
            init: init_for(nv, col0),
            act: plan.act,
            int8: false,
        }))
    };
    let mut k = lw.kernel("");
    let nv = k.var(Ty::I64);
    let mut body = Vec::new();
    // A 1x1 conv reads X in place, unless its rows are not whole vectors apart (the
    // microkernel's B loads would straddle cache lines) and enough rows of W reuse a
    // copy in panels.
    let in_place = direct && (il.is_multiple_of(16) || m < 48 || Plane::of(g).is_none());
    if in_place {
        let b = MatView::strided(
            x.buf,
            Expr::mul(Expr::Var(nv), Expr::Int((c * il) as i64)),
            il as i64,
            1,
        );
        body.push(gemm_call(b, nv, Expr::Int(0), ol));
    } else if let Some(p2) = Plane::of(g) {
        // Output rows in blocks: im2col of one block (its B operand stays in cache),
        // then the GEMM on that block. The blocks share out into parts, each with its
        // own scratch: the parts may run on different threads, each packing and
        // multiplying its own blocks (a GEMM split by columns instead has each core read
        // the panels the other packed, and its halves of a 3.5-panel block were unequal).
        let rb = p2.block_rows(kd, m);
        let full = p2.oh / rb;
        let tail = p2.oh - full * rb;
        let blk = kd * (rb * p2.ow).div_ceil(PANEL) * PANEL;
        let most = [4, 2]
            .into_iter()
            .find(|&s| s * blk * 4 <= IM2COL_SLOTS_BYTES)
            .unwrap_or(1);
        let plan = Parts::new(full, tail > 0, most);
        let cb = lw.program.add_buffer(
            format!("{}/im2col", lw.name),
            BufKind::Arena { offset: 0 },
            Ty::F32,
            (plan.parts * blk) as u64,
        );
        body.extend(plan.emit(&mut k, rb, |k, oh0, is_tail, slot| {
            let rows = if is_tail { tail } else { rb };
            let base = lin(vec![(slot, blk)]);
            // A 1x1 conv's block is a run of whole pixels: panels of flat pixels.
            let mut st = if direct {
                let px = (lin(vec![(oh0.clone(), p2.ow)]), rows * p2.ow);
                panels_of_pixels(k, x.buf, cb, nv, (c, il), px, base.clone(), PANEL)
            } else {
                p2.im2col(
                    k,
                    x.buf,
                    cb,
                    nv,
                    c,
                    kd,
                    oh0.clone(),
                    rows,
                    PANEL,
                    base.clone(),
                )
            };
            let col0 = Expr::mul(oh0, Expr::Int(p2.ow as i64));
            let b = MatView {
                offset: base,
                ..MatView::packed(cb, PANEL, kd, false)
            };
            st.push(gemm_call(b, nv, col0, rows * p2.ow));
            st
        }));
    } else {
        // Other ranks: the whole im2col matrix of one image.
        let cb = lw.program.add_buffer(
            format!("{}/im2col", lw.name),
            BufKind::Arena { offset: 0 },
            Ty::F32,
            (kd * ol) as u64,
        );
        body.extend(im2col(&mut k, g, x.buf, cb, nv, c, il, ol));
        let b = MatView::strided(cb, Expr::Int(0), ol as i64, 1);
        body.push(gemm_call(b, nv, Expr::Int(0), ol));
    }
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

/// Rows of an A operand's panels: the AVX-512 microkernel's tile height (AVX2's 6 and
/// NEON's 4 divide it; those back ends run one call per panel).
const A_PANEL: usize = 12;

/// Least depth (`c * kh * kw`) for [`conv_transposed`]: its transpose back costs a few
/// cycles per output element, small next to `kd` multiply-adds only for deep kernels.
const CT_MIN_K: usize = 1024;

/// The same for 1x1 convs (no im2col, only X transposed into panels). Measured on the
/// Zen 4 VM, 7x7 pointwise layers alone (A/B): 160 -> 960 channels 0.170 -> 0.157 ms,
/// 320 -> 1280 0.455 -> 0.405, 576 -> 160 0.106 -> 0.089, 960 -> 320 0.35 -> 0.28. (On
/// the Intel VM, with twice the FMA throughput, the transposes had cost about what the
/// lanes saved for K = 64..384.)
const CT_MIN_K_1X1: usize = 128;

/// Planes of at most this many pixels run with channels in lanes at any depth: with
/// pixels in lanes the microkernel's columns were nearly all wasted (squeeze-excitation
/// 48 -> 1152 at 1x1: a 16-lane panel per pixel, 0.023 ms), and the transpose back is
/// a few elements.
const CT_ANY_K_PIXELS: usize = 4;

/// Most elements of [`conv_transposed`]'s scratch (the output, and its im2col).
const CT_MAX_ELEMS: usize = 4 << 20;

/// The share of 16-lane vectors a count of columns fills.
fn lane_use(x: usize) -> f64 {
    x as f64 / (x.div_ceil(16) * 16) as f64
}

/// Whether a KxK (or, with `one_by_one`, a 1x1 stride-1) conv runs with its output
/// channels as the GEMM's columns: deep kernels on small planes, where the channels fill
/// the vector lanes better than the pixels (ResNet's and MobileNetV2's 7x7 layers: 49
/// pixels in 64 lanes, 512 or 320 channels in as many).
fn channels_in_lanes(m: usize, ol: usize, kd: usize, one_by_one: bool) -> bool {
    (kd >= if one_by_one { CT_MIN_K_1X1 } else { CT_MIN_K } || ol <= CT_ANY_K_PIXELS)
        && m >= 32
        && m * ol <= CT_MAX_ELEMS
        && kd * ol.div_ceil(A_PANEL) * A_PANEL <= CT_MAX_ELEMS
        && lane_use(m) > lane_use(ol) + 0.04
}

/// The `len` values of a tensor known at compile time, as f64 (`None` otherwise).
fn const_values(w: &TensorRef, len: usize) -> Option<Vec<f64>> {
    let vals: Vec<f64> = w.value.as_ref()?.to_f64()?.iter().copied().collect();
    (vals.len() == len).then_some(vals)
}

/// The weights `[m][kd]` transposed to `[kd][m]` as a new constant buffer, when they
/// are known at compile time.
fn transposed_weights(lw: &mut LowerCtx, w: &TensorRef, m: usize, kd: usize) -> Option<usize> {
    let vals = const_values(w, m * kd)?;
    let mut data = Vec::with_capacity(4 * m * kd);
    for kk in 0..kd {
        for mm in 0..m {
            data.extend_from_slice(&(vals[mm * kd + kk] as f32).to_le_bytes());
        }
    }
    Some(lw.program.add_buffer(
        format!("{}/wt", lw.name),
        BufKind::Const { data },
        Ty::F32,
        (m * kd) as u64,
    ))
}

/// Most parts [`conv_transposed`] cuts an image's pixels into.
const CT_PARTS: usize = 4;

/// A group-1 f32 KxK conv with pixels and channels swapped, per image:
/// `Ct[p, co] = sum_k X'[k, p] Wt[k, co] + bias[co]` into scratch, with the im2col `X'`
/// written as the A operand in row panels of [`A_PANEL`] pixels (the microkernel's packed
/// layout; a 1x1 conv in one part reads X itself) and `Wt` packed at compile time;
/// pixels are the GEMM's rows, where a partial register tile wastes no lanes, channels
/// its columns. Then `out[co, p] =
/// epilogue(Ct[p, co])`.
///
/// A 1x1 conv's pixels go in up to [`CT_PARTS`] parts of whole panels, each packed,
/// multiplied and copied out by one task: one `parallel_for` per conv, and a core reads
/// back only what it wrote (384 -> 64 on 14x14 alone, two threads: 0.050 -> 0.0445 ms).
/// Before, the packing, the GEMM and the copy were three jobs, each cut its own way.
/// Other convs run whole (the GEMM splits itself).
fn conv_transposed(
    lw: &mut LowerCtx,
    p2: &Plane,
    x: &TensorRef,
    wt: usize,
    bias: Option<TensorRef>,
    out: &TensorRef,
    (nimg, c, m): (usize, usize, usize),
) {
    let ol = p2.oh * p2.ow;
    let kd = c * p2.kh * p2.kw;
    let ep = lw.epilogue.take().filter(|e| !e.is_empty());
    let direct = p2.kh == 1
        && p2.kw == 1
        && p2.sh == 1
        && p2.sw == 1
        && p2.ph == 0
        && p2.pw == 0
        && (p2.oh, p2.ow) == (p2.h, p2.w);
    // Rows of the block loop: pixels of the flat plane (1x1) or output rows, `rw`
    // pixels each; blocks of `rb` rows.
    let (nrows, rw) = if direct { (ol, 1) } else { (p2.oh, p2.ow) };
    // Parts only for 1x1 convs, and only when the pixels' panels outnumber the weights'
    // column panels (which the GEMM splits by otherwise): every part reads all the
    // weights, and a 320 -> 1280 7x7 layer's 1.6 MB cut into three parts by pixels went
    // 0.268 -> 0.300 ms on one thread, 0.205 -> 0.234 on two. A KxK conv's parts of
    // output rows each end in a partial panel: 128 -> 256 3x3 stride 2 onto 14x14 went
    // as two parts of 9 panels (17 before) and took 0.551 -> 0.623 ms on two threads.
    let want =
        if direct && m * ol * kd >= PADDED_SPLIT_MACS && ol.div_ceil(A_PANEL) > m.div_ceil(PANEL) {
            CT_PARTS
        } else {
            1
        };
    let rb = if want > 1 {
        ct_block_pixels(ol, want)
    } else {
        nrows
    };
    let full = nrows / rb;
    let tail = nrows - full * rb;
    let plan = Parts::new(full, tail > 0, want);
    // A 1x1 conv in one part reads X in place as A (X^T: a pixel's channels `ol` apart,
    // a tile's 12 pixels side by side): no copy into panels, which took longer than the
    // GEMM lost to the strided reads (960 -> 320 on 7x7 alone 0.199 -> 0.188 ms on one
    // thread, 0.138 -> 0.119 on two; min of paired rounds). In parts (14x14 planes),
    // each core would then multiply straight from X's rows, half of them in the other
    // core's cache (the depthwise conv before splits by channels): 576 -> 96 on 14x14
    // went 0.147 -> 0.124 ms alone on one thread but 125 -> 151 us in MobileNetV2 on
    // two (task timeline), so parts pack.
    let in_place = direct && want == 1;
    // One block's panels (the tail's are no more).
    let slot = kd * (rb * rw).div_ceil(A_PANEL) * A_PANEL;
    let ct = lw.program.add_buffer(
        format!("{}/ct", lw.name),
        BufKind::Arena { offset: 0 },
        Ty::F32,
        (ol * m) as u64,
    );
    let cb = (!in_place).then(|| {
        lw.program.add_buffer(
            format!("{}/im2col", lw.name),
            BufKind::Arena { offset: 0 },
            Ty::F32,
            (plan.parts * slot) as u64,
        )
    });
    let mut k = lw.kernel("");
    let nv = k.var(Ty::I64);
    let block = |k: &mut Kernel, row0: Expr, is_tail: bool, sl: Expr| {
        let rows = if is_tail { tail } else { rb };
        let npix = rows * rw;
        let base = lin(vec![(sl, slot)]);
        let pix0 = lin(vec![(row0.clone(), rw)]);
        let (mut st, a) = match cb {
            None => {
                let at = lin(vec![(Expr::Var(nv), c * ol), (pix0.clone(), 1)]);
                (vec![], MatView::strided(x.buf, at, 1, ol as i64))
            }
            Some(cb) => {
                let st = if direct {
                    let (pix, n) = (pix0.clone(), npix);
                    panels_of_pixels(k, x.buf, cb, nv, (c, ol), (pix, n), base.clone(), A_PANEL)
                } else {
                    p2.im2col(k, x.buf, cb, nv, c, kd, row0, rows, A_PANEL, base.clone())
                };
                let a = MatView {
                    offset: base,
                    ..MatView::packed(cb, A_PANEL, kd, true)
                };
                (st, a)
            }
        };
        st.push(Stmt::Gemm(Box::new(GemmCall {
            m: npix as u64,
            n: m as u64,
            k: kd as u64,
            a,
            b: MatView::strided(wt, Expr::Int(0), m as i64, 1),
            c: MatView::strided(ct, lin(vec![(pix0.clone(), m)]), m as i64, 1),
            alpha: 1.0,
            init: bias
                .as_ref()
                .map(|b| MatView::strided(b.buf, Expr::Int(0), 0, 1)),
            add: None,
            act: GemmAct::None,
            int8: false,
        })));
        st.push(copy_out(
            k,
            out,
            ep.as_ref(),
            (nv, m, ol),
            (pix0.clone(), 1, npix),
            |mv, _, q| {
                let pix = lin(vec![(pix0.clone(), 1), (q, 1)]);
                Expr::load(ct, Expr::add(Expr::mul(pix, int(m)), mv))
            },
        ));
        st
    };
    let body = plan.emit(&mut k, rb, block);
    k.body = vec![Stmt::For {
        var: nv,
        extent: nimg as u64,
        body,
    }];
    lw.push(k);
}

/// Pixels per block of a 1x1 [`conv_transposed`] on `ol` pixels (whole panels): the
/// count whose parts (at most `want`, as [`Parts`] groups the blocks) end soonest on two
/// threads taking them in turn, counting panels; then the most parts (for the pool to
/// even out a slowed core), then the largest (one GEMM per part). 196 pixels in 4 parts
/// went as 5 + 5 + 5 + 2 panels, two threads' shares 10 : 7; now 8 + 8 + 1, 8 : 9.
fn ct_block_pixels(ol: usize, want: usize) -> usize {
    let panels = |px: usize| px.div_ceil(A_PANEL);
    (1..=panels(ol))
        .map(|u| (u * A_PANEL).min(ol))
        .min_by_key(|&rb| {
            let (full, tail) = (ol / rb, ol % rb);
            let p = Parts::new(full, tail > 0, want);
            let last = (full - p.per * (p.parts - 1)) * panels(rb) + panels(tail);
            let costs = std::iter::repeat_n(p.per * panels(rb), p.parts - 1).chain([last]);
            let parts = std::cmp::Reverse(p.parts);
            (two_threads_end(costs), parts, std::cmp::Reverse(rb))
        })
        .unwrap_or(ol)
}

/// The pixels `pix0..pix0 + n` of the `ol`-pixel planes of image `nv` (`c` channels of
/// `x`, a 1x1 stride-1 conv's X) copied into `cb` from `base` in panels of `w` pixels
/// (`cb[base + p * c * w + ci * w + r] = x[ci][pix0 + p * w + r]`, pixels past `n`
/// zero): with `w` = [`A_PANEL`] the A operand's row panels (X transposed), with `w` =
/// [`PANEL`] the B operand's column panels. Per panel one nest over the channels and a
/// row of the panel, which the AVX-512 back end runs as one call walking the channels.
/// (Plane::im2col split each channel's pixels at every image row and panel edge: a 7x7
/// plane was 15 loops of 1-7 elements per channel, a 14x14 plane's B panels 20.)
#[allow(clippy::too_many_arguments)]
fn panels_of_pixels(
    k: &mut Kernel,
    x: crate::kir::BufId,
    cb: crate::kir::BufId,
    nv: VarId,
    (c, ol): (usize, usize),
    (pix0, n): (Expr, usize),
    base: Expr,
    w: usize,
) -> Vec<Stmt> {
    let (full, rem) = (n / w, n % w);
    let (pv, cv, rv) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
    let v = |x: VarId| Expr::Var(x);
    let panel = c * w;
    let dst =
        |p: Expr, r: Expr, cv: VarId| lin(vec![(base.clone(), 1), (p, panel), (v(cv), w), (r, 1)]);
    let src = |p: Expr, r: Expr, cv: VarId| {
        lin(vec![
            (v(nv), c * ol),
            (v(cv), ol),
            (pix0.clone(), 1),
            (p, w),
            (r, 1),
        ])
    };
    let mut body = Vec::new();
    if rem > 0 {
        // The last panel zeroed first, then its pixels copied over.
        let zv = k.var(Ty::I64);
        body.push(Stmt::For {
            var: zv,
            extent: panel as u64,
            body: vec![Stmt::Store {
                buf: cb,
                index: lin(vec![(base.clone(), 1), (int(full), panel), (v(zv), 1)]),
                value: Expr::f(0.0, Ty::F32),
            }],
        });
    }
    // (One pixel: no loop of one iteration, which would keep the channel loop scalar.
    // The last panel's copy has variables of its own: a loop whose variables another
    // loop reuses stays on one thread.)
    let copy = |p: Expr, n: usize, (cv, rv): (VarId, VarId)| {
        let r = if n == 1 { int(0) } else { v(rv) };
        let mut st = Stmt::Store {
            buf: cb,
            index: dst(p.clone(), r.clone(), cv),
            value: Expr::load(x, src(p, r, cv)),
        };
        if n > 1 {
            st = Stmt::For {
                var: rv,
                extent: n as u64,
                body: vec![st],
            };
        }
        Stmt::For {
            var: cv,
            extent: c as u64,
            body: vec![st],
        }
    };
    if full > 0 {
        body.push(Stmt::For {
            var: pv,
            extent: full as u64,
            body: vec![copy(v(pv), w, (cv, rv))],
        });
    }
    if rem > 0 {
        let last = (k.var(Ty::I64), k.var(Ty::I64));
        body.push(copy(int(full), rem, last));
    }
    body
}

/// `out[img, co, pix0 + r * ow + q] = epilogue(src(co, r, q))` over the `m` channels and
/// the `oh x ow` pixels from `pix0` of image `nv`'s planes of `plane` pixels: how a conv
/// computed into scratch in another layout stores its output (`oh == 1`: a flat run,
/// without the row loop).
fn copy_out(
    k: &mut Kernel,
    out: &TensorRef,
    ep: Option<&Epilogue>,
    (nv, m, plane): (VarId, usize, usize),
    (pix0, oh, ow): (Expr, usize, usize),
    src: impl Fn(Expr, Expr, Expr) -> Expr,
) -> Stmt {
    let ol = oh * ow;
    let (mv, rv, qv) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
    let v = |x: VarId| Expr::Var(x);
    let int = |x: usize| Expr::Int(x as i64);
    // One pixel: no pixel loop (a loop of one iteration innermost kept the channel loop
    // scalar: squeeze-excitation's 1152 sigmoids).
    let one = ol == 1;
    let (row, col) = match (oh == 1, one) {
        (_, true) => (int(0), int(0)),
        (true, false) => (int(0), v(qv)),
        (false, _) => (v(rv), v(qv)),
    };
    let pix = shift(
        Expr::add(Expr::mul(row.clone(), int(ow)), col.clone()),
        pix0,
        1,
    );
    let oidx = Expr::add(
        Expr::add(
            Expr::mul(v(nv), int(m * plane)),
            Expr::mul(v(mv), int(plane)),
        ),
        pix,
    );
    let val = src(v(mv), row, col);
    let val = match ep {
        Some(ep) => ep.apply_flat(val, Ty::F32, oidx.clone(), &out.shape),
        None => val,
    };
    let mut body = vec![Stmt::Store {
        buf: out.buf,
        index: oidx,
        value: val,
    }];
    if !one {
        body = vec![Stmt::For {
            var: qv,
            extent: ow as u64,
            body,
        }];
    }
    if oh > 1 {
        body = vec![Stmt::For {
            var: rv,
            extent: oh as u64,
            body,
        }];
    }
    Stmt::For {
        var: mv,
        extent: m as u64,
        body,
    }
}

/// The padded plane `(hp, wp)` of a stride-1 conv: the output plus the kernel's reach.
fn padded_plane(p2: &Plane) -> (usize, usize) {
    (p2.oh + (p2.kh - 1) * p2.dh, p2.ow + (p2.kw - 1) * p2.dw)
}

/// Whether a conv runs as [`conv_padded`]: stride 1, a kernel wider than one tap, a
/// small plane (rows of at most 16 outputs, where [`Plane::im2col`] is mostly short
/// runs and their calls), the columns wasted on each padded row at most an eighth of
/// it, and the panels of the whole image within one im2col block.
fn padded_fits(p2: &Plane, c: usize) -> bool {
    let (hp, wp) = padded_plane(p2);
    let kd = c * p2.kh * p2.kw;
    let n = (p2.oh - 1) * wp + p2.ow;
    p2.sh == 1
        && p2.sw == 1
        && p2.kh * p2.kw > 1
        && p2.ow <= 16
        && p2.ph >= 0
        && p2.pw >= 0
        && p2.ph as usize + p2.h <= hp
        && p2.pw as usize + p2.w <= wp
        && (wp - p2.ow) * 8 <= wp
        && kd * n.div_ceil(PANEL) * PANEL * 4 <= IM2COL_BLOCK_BYTES
}

/// A group-1, stride-1 f32 conv on a small plane, per image, through zero-padded
/// planes: the input is copied into `P[c][hp][wp]` (zero borders), where output pixel
/// `(r, q)` is column `r * wp + q` and tap `(i, j)` of channel `ci` is plane `ci`
/// shifted by `i * dh * wp + j * dw`. Each B panel row `(ci, tap)` is then one
/// contiguous run of the plane (no bounds to test: the padding is in the plane), copied
/// as one 2-D nest per tap and panel, where [`Plane::im2col`] copies a run per output
/// row and tap. The GEMM computes the `wp - ow` columns at the end of each row too; the
/// result goes to scratch with rows of `wp`, and `out = epilogue(scratch)` copies the
/// pixels out. (On large planes this measured slower than im2col: see decisions.)
#[allow(clippy::too_many_arguments)]
fn conv_padded(
    lw: &mut LowerCtx,
    p2: &Plane,
    x: &TensorRef,
    wb: usize,
    bias: Option<TensorRef>,
    out: &TensorRef,
    (nimg, c, m): (usize, usize, usize),
) {
    let (hp, wp) = padded_plane(p2);
    let (oh, ow) = (p2.oh, p2.ow);
    let pl = hp * wp;
    let taps = p2.kh * p2.kw;
    let kd = c * taps;
    let n = (oh - 1) * wp + ow;
    // The panels in `parts` runs of `ppart`, each packed and multiplied by one task:
    // the largest run that divides them at most half of them (no partial run, no
    // panel computed twice), or one run for small convs.
    let npan = n.div_ceil(PANEL);
    let ppart = if m * n * kd >= PADDED_SPLIT_MACS && npan > 1 {
        divisor_at_most(npan, npan / 2)
    } else {
        npan
    };
    let parts = npan / ppart;
    let tap_off = |t: usize| (t / p2.kw) * p2.dh * wp + (t % p2.kw) * p2.dw;
    // The planes, and after them what the last panel reads past the last one.
    let xlen = (c - 1) * pl + tap_off(taps - 1) + npan * PANEL;
    let ep = lw.epilogue.take().filter(|e| !e.is_empty());
    let xp = lw.program.add_buffer(
        format!("{}/padded", lw.name),
        BufKind::Arena { offset: 0 },
        Ty::F32,
        xlen as u64,
    );
    let cb = lw.program.add_buffer(
        format!("{}/panels", lw.name),
        BufKind::Arena { offset: 0 },
        Ty::F32,
        (kd * npan * PANEL) as u64,
    );
    // Rows of `npan * PANEL` columns: every part's columns, the ones past `n` too.
    let ld = npan * PANEL;
    let rows = lw.program.add_buffer(
        format!("{}/rows", lw.name),
        BufKind::Arena { offset: 0 },
        Ty::F32,
        (m * ld) as u64,
    );
    let mut k = lw.kernel("");
    let nv = k.var(Ty::I64);
    let v = |x: VarId| Expr::Var(x);
    let int = |x: usize| Expr::Int(x as i64);
    let mut body = pad_planes(&mut k, (x.buf, nv, c), p2, (xp, xlen), (pl, wp));
    // Per part `h`, the B panels jp = h * ppart + jl:
    // cb[(jp * kd + ci * taps + t) * PANEL + jj] = P[ci * pl + off(t) + jp * PANEL + jj],
    // one (channel, column) nest per tap and panel; then the part's GEMM.
    let (hv, ci, jj) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
    let mut part = Vec::new();
    for t in 0..taps {
        for jl in 0..ppart {
            let dst = lin(vec![
                (v(hv), ppart * kd * PANEL),
                (v(ci), taps * PANEL),
                (v(jj), 1),
                (int((jl * kd + t) * PANEL), 1),
            ]);
            let src = lin(vec![
                (v(hv), ppart * PANEL),
                (v(ci), pl),
                (v(jj), 1),
                (int(tap_off(t) + jl * PANEL), 1),
            ]);
            part.extend(loops(
                &[(ci, c), (jj, PANEL)],
                vec![store(cb, dst, Expr::load(xp, src))],
            ));
        }
    }
    let cols = if parts == 1 { n } else { ppart * PANEL };
    part.push(Stmt::Gemm(Box::new(GemmCall {
        m: m as u64,
        n: cols as u64,
        k: kd as u64,
        a: MatView::strided(wb, Expr::Int(0), kd as i64, 1),
        b: MatView {
            offset: lin(vec![(v(hv), ppart * kd * PANEL)]),
            ..MatView::packed(cb, PANEL, kd, false)
        },
        c: MatView::strided(rows, lin(vec![(v(hv), ppart * PANEL)]), ld as i64, 1),
        alpha: 1.0,
        init: bias.map(|b| MatView::strided(b.buf, Expr::Int(0), 1, 0)),
        add: None,
        act: GemmAct::None,
        int8: false,
    })));
    body.extend(loops(&[(hv, parts)], part));
    // Out: the pixels of each padded row, through the epilogue.
    body.push(copy_out(
        &mut k,
        out,
        ep.as_ref(),
        (nv, m, oh * ow),
        (int(0), oh, ow),
        |mv, rv, qv| {
            let pix = Expr::add(Expr::mul(rv, int(wp)), qv);
            Expr::load(rows, Expr::add(Expr::mul(mv, int(ld)), pix))
        },
    ));
    k.body = vec![Stmt::For {
        var: nv,
        extent: nimg as u64,
        body,
    }];
    lw.push(k);
}

/// The input planes of image `img` of `x` (`c` planes of `p2.h x p2.w`) copied into `xp`
/// (`len` elements, zeroed first) as planes of `pl` elements with rows of `wp`, each at
/// row `p2.ph` and column `p2.pw` of its plane (the padding), for the convs that read
/// padded planes instead of testing bounds. One loop over the planes, each zeroed and
/// then copied while it is in L1 (one parallel job where it is large enough), and the
/// elements past the last plane zeroed after it.
fn pad_planes(
    k: &mut Kernel,
    (x, img, c): (usize, VarId, usize),
    p2: &Plane,
    (xp, len): (usize, usize),
    (pl, wp): (usize, usize),
) -> Vec<Stmt> {
    let il = p2.h * p2.w;
    let (cv, yv, xv) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
    let dst = lin(vec![
        (Expr::Var(cv), pl),
        (Expr::Var(yv), wp),
        (Expr::Var(xv), 1),
        (Expr::Int(1), p2.ph as usize * wp + p2.pw as usize),
    ]);
    let src = lin(vec![
        (Expr::Var(img), c * il),
        (Expr::Var(cv), il),
        (Expr::Var(yv), p2.w),
        (Expr::Var(xv), 1),
    ]);
    let mut plane = zero_range(k, xp, lin(vec![(Expr::Var(cv), pl)]), pl);
    plane.extend(loops(
        &[(yv, p2.h), (xv, p2.w)],
        vec![store(xp, dst, Expr::load(x, src))],
    ));
    let mut body = loops(&[(cv, c)], plane);
    if len > c * pl {
        body.extend(zero_range(k, xp, Expr::Int((c * pl) as i64), len - c * pl));
    }
    body
}

/// `buf[at + i] = 0` for `i < n`.
fn zero_range(k: &mut Kernel, buf: usize, at: Expr, n: usize) -> Vec<Stmt> {
    let zv = k.var(Ty::I64);
    let index = match at {
        Expr::Int(0) => Expr::Var(zv),
        at => add(at, Expr::Var(zv)),
    };
    loops(&[(zv, n)], vec![store(buf, index, Expr::f(0.0, Ty::F32))])
}

/// `e + col0 * cs`, folding zeros.
fn shift(e: Expr, col0: Expr, cs: i64) -> Expr {
    if cs == 0 || col0 == Expr::Int(0) {
        return e;
    }
    let t = if cs == 1 {
        col0
    } else {
        Expr::mul(col0, Expr::Int(cs))
    };
    match e {
        Expr::Int(0) => t,
        e => Expr::add(e, t),
    }
}

/// Bytes of one im2col block (the GEMM's B operand) that should stay in L2.
const IM2COL_BLOCK_BYTES: usize = 256 * 1024;

/// Weights bytes past which a conv's im2col blocks grow (see [`Plane::block_rows`]).
const BIG_WEIGHTS_BYTES: usize = 1 << 20;

/// Most bytes of a conv's im2col slots (blocks packed side by side, see [`conv`]): half
/// of a 2 MiB L2, so that the weights stay in L2 while one thread cycles through them.
const IM2COL_SLOTS_BYTES: usize = 5 << 18;

/// Columns per panel of an im2col block: the widest microkernel's (AVX-512, 32). Back
/// ends whose microkernel reads other widths run one call per panel.
const PANEL: usize = 32;

/// Least multiply-adds for which [`conv_padded`] cuts its panels into runs, each packed
/// and multiplied by one task (so that threads share the conv).
const PADDED_SPLIT_MACS: usize = 1 << 19;

/// How a conv's blocks of rows (`full` whole blocks of `rb` rows, then maybe a tail block
/// of fewer rows) share out among parallel tasks, each with its own scratch slot: every
/// part but the last runs `per` whole blocks, the last the remaining whole blocks and the
/// tail. The last part never has more rows than the others (a tail has fewer than a
/// whole block), which the parallel-loop analysis needs: each part's rows lie within
/// `per * rb` rows of its first.
///
/// One job per conv (before, the blocks went in groups of slots and the blocks left over,
/// tail included, ran on one thread: SqueezeNet's 55x55 Winograd layers, three whole
/// blocks and a tail, kept the second core idle half of the time).
#[derive(Debug, PartialEq)]
struct Parts {
    /// Tasks (and slots).
    parts: usize,
    per: usize,
    full: usize,
    tail: bool,
}

impl Parts {
    /// Blocks among at most `most` parts, as many a part as ends soonest on two threads
    /// ([`per_part`]: six blocks in 4 slots go as 3 + 3, not 2 + 2 + 2).
    fn new(full: usize, tail: bool, most: usize) -> Parts {
        let blocks = full + usize::from(tail);
        let per = per_part(blocks, most);
        if blocks <= 1 || full == 0 || blocks.div_ceil(per) <= 1 {
            return Parts {
                parts: 1,
                per: full,
                full,
                tail,
            };
        }
        Parts {
            parts: blocks.div_ceil(per),
            per,
            full,
            tail,
        }
    }

    /// `for p in 0..parts { if p < parts - 1 { per blocks } else { the rest, the tail } }`,
    /// `block(k, first row, is the tail, slot)` making each block. Both branches address
    /// their rows and slot through `p` (part `p` starts at row `p * per * rb`), so that
    /// the parallel-loop analysis sees every access as `p` times one stride plus less
    /// than that stride.
    fn emit(
        &self,
        k: &mut Kernel,
        rb: usize,
        mut block: impl FnMut(&mut Kernel, Expr, bool, Expr) -> Vec<Stmt>,
    ) -> Vec<Stmt> {
        let pv = k.var(Ty::I64);
        // (No loops of one iteration: one part is slot 0, one block its first row.)
        let (part_of, slot) = if self.parts == 1 {
            (int(0), int(0))
        } else {
            (Expr::Var(pv), Expr::Var(pv))
        };
        let mut part = |k: &mut Kernel, blocks: usize, with_tail: bool| {
            let base = (part_of.clone(), self.per * rb);
            let mut st = Vec::new();
            if blocks == 1 {
                st.extend(block(k, lin(vec![base.clone()]), false, slot.clone()));
            } else if blocks > 1 {
                let g = k.var(Ty::I64);
                let row0 = lin(vec![base.clone(), (Expr::Var(g), rb)]);
                let inner = block(k, row0, false, slot.clone());
                st.extend(loops(&[(g, blocks)], inner));
            }
            if with_tail {
                let row0 = lin(vec![base, (int(1), blocks * rb)]);
                st.extend(block(k, row0, true, slot.clone()));
            }
            st
        };
        let last = self.full - self.per * (self.parts - 1);
        let inner = if self.parts > 1 && (self.tail || last != self.per) {
            let first = part(k, self.per, false);
            let rest = part(k, last, self.tail);
            vec![Stmt::If {
                cond: Expr::cmp(CmpOp::Lt, Expr::Var(pv), int(self.parts - 1)),
                then: first,
                els: rest,
            }]
        } else {
            part(k, last, self.tail)
        };
        if self.parts == 1 {
            return inner;
        }
        loops(&[(pv, self.parts)], inner)
    }
}

/// The cost of `n` rows in blocks of `rb` (whole blocks, the rest one tail block, as
/// [`Parts`] takes them), `block(rows)` one block's: the sum over the blocks (the time on
/// one thread) and the larger of two parts' sums (on two). The block heights minimise
/// their total: summing the blocks alone, SqueezeNet's 13-row 3x3 convs came out as 11
/// rows and 2, two parts 11 : 2, when 7 and 6 cost the same panels.
fn blocks_cost(n: usize, rb: usize, block: impl Fn(usize) -> usize) -> (usize, usize) {
    let full = n / rb;
    let rest = n - full * rb;
    let tail = if rest > 0 { block(rest) } else { 0 };
    let p = Parts::new(full, rest > 0, 2);
    let first = if p.parts > 1 { p.per * block(rb) } else { 0 };
    let last = (full - p.per * (p.parts - 1)) * block(rb) + tail;
    (full * block(rb) + tail, first.max(last))
}

/// A 1-D or 2-D convolution's geometry as a plane (1-D: one row).
struct Plane {
    kh: usize,
    kw: usize,
    sh: usize,
    sw: usize,
    dh: usize,
    dw: usize,
    ph: i64,
    pw: i64,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
}

impl Plane {
    fn of(g: &ConvGeom) -> Option<Plane> {
        match g.k.len() {
            1 => Some(Plane {
                kh: 1,
                kw: g.k[0],
                sh: 1,
                sw: g.s[0],
                dh: 1,
                dw: g.d[0],
                ph: 0,
                pw: g.pb[0],
                h: 1,
                w: g.in_sp[0],
                oh: 1,
                ow: g.out_sp[0],
            }),
            2 => Some(Plane {
                kh: g.k[0],
                kw: g.k[1],
                sh: g.s[0],
                sw: g.s[1],
                dh: g.d[0],
                dw: g.d[1],
                ph: g.pb[0],
                pw: g.pb[1],
                h: g.in_sp[0],
                w: g.in_sp[1],
                oh: g.out_sp[0],
                ow: g.out_sp[1],
            }),
            _ => None,
        }
    }

    /// Output rows per block: at most about [`IM2COL_BLOCK_BYTES`] of im2col (but at least
    /// one row and 4 panels), choosing the count that wastes the fewest padding columns
    /// (a block costs about half a panel more: its call, and A read once more).
    fn block_rows(&self, kd: usize, m: usize) -> usize {
        let w = PANEL;
        // Each block reads all the weights again: when they outgrow L2 (and come from
        // L3 or memory every time), fewer, larger blocks.
        let budget = if m * kd * 4 > BIG_WEIGHTS_BYTES {
            4 * IM2COL_BLOCK_BYTES
        } else {
            IM2COL_BLOCK_BYTES
        };
        let max_cols = (budget / (kd * 4)).max(4 * w);
        let rb_max = (max_cols / self.ow).clamp(1, self.oh);
        let pad = |x: usize| x.div_ceil(w) * w;
        let block = |rows: usize| pad(rows * self.ow) + w / 2;
        let cost = |rb: usize| {
            let (one, two) = blocks_cost(self.oh, rb, block);
            if m * self.oh * self.ow * kd < PADDED_SPLIT_MACS {
                // Too little work to share: the time on one thread.
                one
            } else if rb == self.oh && m >= SPLIT_MIN_ROWS_PACKED {
                // One block of enough rows is split by the back end (both threads run
                // half of it).
                one + one / 2
            } else {
                one + two
            }
        };
        (1..=rb_max).rev().min_by_key(|&rb| cost(rb)).unwrap_or(1)
    }

    /// The outputs `o` in `0..n` whose input coordinate `o * s - p + t * d` lies in
    /// `0..size`, as `lo..hi` (empty when none).
    fn valid(n: usize, s: usize, p: i64, t: usize, d: usize, size: usize) -> (usize, usize) {
        let (s, off, size) = (s as i64, (t * d) as i64 - p, size as i64);
        // o * s + off >= 0  <=>  o >= ceil(-off / s); o * s + off < size <=> o < ceil((size - off) / s).
        let lo = (-off).max(0).div_euclid(s) + i64::from((-off).max(0) % s != 0);
        let hi = if size - off <= 0 {
            0
        } else {
            (size - off + s - 1) / s
        };
        let lo = lo.clamp(0, n as i64) as usize;
        let hi = hi.clamp(0, n as i64) as usize;
        (lo, hi.max(lo))
    }

    /// `cols[(ci, kh, kw), t * ow + o] = X[img, ci, ih, o * sw - pw + kw * dw]` with
    /// `ih = (oh0 + t) * sh - ph + kh * dh`, for `t < rows` (0 in the padding), stored in
    /// column panels of `w` (`[cols / w][kd][w]`, the padding columns of the last panel
    /// zero): a B operand in panels of [`PANEL`], or with `w` = [`A_PANEL`] the same
    /// matrix transposed as an A operand in row panels. Block rows and kernel columns are unrolled, so every run of
    /// zeros or copies has bounds fixed at compile time.
    #[allow(clippy::too_many_arguments)]
    fn im2col(
        &self,
        k: &mut Kernel,
        xb: usize,
        cb: usize,
        img: VarId,
        c: usize,
        kd: usize,
        oh0: Expr,
        rows: usize,
        w: usize,
        base: Expr,
    ) -> Vec<Stmt> {
        use crate::kir::{BinOp, CmpOp};
        let ps = (kd * w) as i64;
        let (ci, khv) = (k.var(Ty::I64), k.var(Ty::I64));
        let il = (self.h * self.w) as i64;
        // Loop-invariant bases, set once: `rbv` = the block row of (ci, kh, 0) times the
        // panel width, `xr` = the input row one block row reads.
        let (rbv, xr) = (k.var(Ty::I64), k.var(Ty::I64));
        let run = |k: &mut Kernel, kw: usize, from: usize, to: usize, src: Option<Expr>| {
            let sw = self.sw as i64;
            // Columns j in from..to: dst (j / w) * ps + r * w + j % w, src base + (j - from) * sw.
            let mut out = Vec::new();
            let mut piece = |k: &mut Kernel, a: usize, len: usize, count: usize| {
                if len == 0 || count == 0 {
                    return;
                }
                let jj = k.var(Ty::I64);
                let qv = (count > 1).then(|| k.var(Ty::I64));
                let q = Expr::Int(((a / w) as i64) * ps + (a % w + kw * w) as i64);
                let mut dst = Expr::add(Expr::add(Expr::Var(rbv), q), Expr::Var(jj));
                let mut soff = Expr::add(
                    Expr::Int((a - from) as i64 * sw),
                    Expr::mul(Expr::Var(jj), Expr::Int(sw)),
                );
                if let Some(qv) = qv {
                    dst = Expr::add(dst, Expr::mul(Expr::Var(qv), Expr::Int(ps)));
                    soff = Expr::add(soff, Expr::mul(Expr::Var(qv), Expr::Int(w as i64 * sw)));
                }
                let value = match &src {
                    Some(base) => Expr::load(xb, Expr::add(base.clone(), soff)),
                    None => Expr::f(0.0, Ty::F32),
                };
                let inner = Stmt::For {
                    var: jj,
                    extent: len as u64,
                    body: vec![Stmt::Store {
                        buf: cb,
                        index: dst,
                        value,
                    }],
                };
                out.push(match qv {
                    None => inner,
                    Some(qv) => Stmt::For {
                        var: qv,
                        extent: count as u64,
                        body: vec![inner],
                    },
                });
            };
            if to <= from {
                return out;
            }
            let head_end = to.min(from.div_ceil(w) * w);
            piece(k, from, head_end - from, 1);
            if head_end < to {
                let whole = (to - head_end) / w;
                piece(k, head_end, w, whole);
                let t0 = head_end + whole * w;
                piece(k, t0, to - t0, 1);
            }
            out
        };
        let mut rb = Expr::mul(
            Expr::add(
                Expr::mul(Expr::Var(ci), Expr::Int((self.kh * self.kw) as i64)),
                Expr::mul(Expr::Var(khv), Expr::Int(self.kw as i64)),
            ),
            Expr::Int(w as i64),
        );
        if base != Expr::Int(0) {
            rb = Expr::add(base, rb);
        }
        let mut body = vec![Stmt::Set {
            var: rbv,
            value: rb,
        }];
        for t in 0..rows {
            let ih = Expr::add(
                Expr::mul(
                    Expr::add(oh0.clone(), Expr::Int(t as i64)),
                    Expr::Int(self.sh as i64),
                ),
                Expr::bin(
                    BinOp::Sub,
                    Expr::mul(Expr::Var(khv), Expr::Int(self.dh as i64)),
                    Expr::Int(self.ph),
                ),
            );
            let xrow = Expr::add(
                Expr::add(
                    Expr::mul(Expr::Var(img), Expr::Int(c as i64 * il)),
                    Expr::mul(Expr::Var(ci), Expr::Int(il)),
                ),
                Expr::mul(ih.clone(), Expr::Int(self.w as i64)),
            );
            body.push(Stmt::Set {
                var: xr,
                value: xrow,
            });
            let j0 = t * self.ow;
            let mut copy = Vec::new();
            let mut zero = Vec::new();
            for kw in 0..self.kw {
                let (lo, hi) = Self::valid(self.ow, self.sw, self.pw, kw, self.dw, self.w);
                let src0 = Expr::add(
                    Expr::Var(xr),
                    Expr::Int(lo as i64 * self.sw as i64 + (kw * self.dw) as i64 - self.pw),
                );
                copy.extend(run(k, kw, j0, j0 + lo, None));
                copy.extend(run(k, kw, j0 + lo, j0 + hi, Some(src0)));
                copy.extend(run(k, kw, j0 + hi, j0 + self.ow, None));
                zero.extend(run(k, kw, j0, j0 + self.ow, None));
            }
            // Every input row inside for every output row and tap: no test.
            let rows_inside =
                self.ph == 0 && (self.oh - 1) * self.sh + (self.kh - 1) * self.dh < self.h;
            if rows_inside {
                body.extend(copy);
            } else {
                let ok = Expr::bin(
                    BinOp::And,
                    Expr::cmp(CmpOp::Ge, ih.clone(), Expr::Int(0)),
                    Expr::cmp(CmpOp::Lt, ih, Expr::Int(self.h as i64)),
                );
                body.push(Stmt::If {
                    cond: ok,
                    then: copy,
                    els: zero,
                });
            }
        }
        // The padding columns of the last panel.
        let nb = rows * self.ow;
        for kw in 0..self.kw {
            body.extend(run(k, kw, nb, nb.div_ceil(w) * w, None));
        }
        vec![Stmt::For {
            var: ci,
            extent: c as u64,
            body: vec![Stmt::For {
                var: khv,
                extent: self.kh as u64,
                body,
            }],
        }]
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_share_blocks_and_never_give_the_last_more() {
        let p = |full, tail, most| {
            let p = Parts::new(full, tail, most);
            (p.parts, p.per)
        };
        // Three whole blocks and a tail (SqueezeNet's 55x55 Winograd convs until the
        // sixteenth session): two a part.
        assert_eq!(p(3, true, 2), (2, 2));
        // Five whole blocks: three and two.
        assert_eq!(p(5, false, 2), (2, 3));
        // One whole block and a tail: one each.
        assert_eq!(p(1, true, 2), (2, 1));
        // SqueezeNet's stem (five blocks and a tail, four slots): 3 + 3, not 2 + 2 + 2.
        assert_eq!(p(5, true, 4), (2, 3));
        // One block, whole or tail, or one slot: one part.
        assert_eq!(p(1, false, 4), (1, 1));
        assert_eq!(p(0, true, 4), (1, 0));
        assert_eq!(p(6, false, 1), (1, 6));
    }
}
