//! Innermost loops as 128-bit vector code (f32x4), with a scalar remainder loop.
//!
//! A `for` loop qualifies when its body is only `Store`s into f32 buffers at
//! `s * var + invariant` (unit stride, or a constant stride `s` stored lane by lane; two
//! stores into one buffer must be provably disjoint: see [`disjoint`]) and `Set`s of loop-local variables (each read only
//! after it is set in the same iteration, and never outside the loop). Expressions are
//! evaluated four lanes at a time: unit-stride f32 loads become vector loads, invariant
//! subexpressions are computed once and splatted, f32 arithmetic and comparisons use
//! vector instructions, and everything else (gathers, integer work, math calls) is
//! computed lane by lane with the scalar code generator and packed with `insertlane`.
//! A buffer the loop stores into may only be loaded at the very index it is stored at
//! (read-modify-write of the same element); anything else stays scalar.
//!
//! A loop may also carry f32 reductions (`acc = acc + e`, `max`/`min`, or the NaN-skipping
//! `e > acc ? e : acc`): four partial accumulators run in an f32x4 and are folded into
//! `acc` after the vector loop. f32 exp, log, erf, tanh, atan, sin, cos and tan are inline
//! vector code (vmath.rs; sin, cos and tan with a branch to libm past `SINCOS_MAX`).

use super::Gen;
use crate::kir::{BinOp, BufId, BufKind, CmpOp, Expr, Stmt, Ty, UnOp, VarId};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{types, InstBuilder, MemFlagsData, Value};
use cranelift_module::Module;
use std::collections::HashMap;

/// Lanes per vector.
const W: u64 = 4;
/// Vector loops of at most this many iterations are emitted as straight code.
const UNROLL: u64 = 4;

/// A value of the vectorised loop body, four lanes at a time.
#[derive(Clone, Copy)]
enum V {
    /// The same scalar in every lane (loop-invariant).
    Uni(Value),
    /// An f32x4.
    Vec(Value),
    /// The result of an f32x4 comparison: an i32x4 of all-ones or zero lanes (a U8
    /// 0/1 in kernel IR).
    Mask(Value),
    /// Four scalars of the expression's type.
    Lanes([Value; 4]),
}

/// What the loop body may touch, found by [`qualifies`].
pub(super) struct Plan {
    /// Variables set in the body (loop-local).
    pub(super) locals: Vec<VarId>,
    /// Accumulators carried across iterations (see [`reduction`]).
    pub(super) reds: Vec<Red>,
    /// The body copies integers (`buf[i] = src[j]`, both i32 or u32, or both u8 or
    /// both i8): only the AVX-512 loops take such a loop, moving 32-bit values through
    /// f32 lanes bit for bit (loads, stores and in-register transposes do not look at
    /// the bits) and bytes through f32 lanes exactly; the f32x4 code leaves it scalar.
    pub(super) int_copy: bool,
}

/// How an accumulator combines: `acc + e`, `max(acc, e)`, `min(acc, e)`, or the
/// NaN-skipping `e > acc ? e : acc` / `e < acc ? e : acc`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum RedKind {
    Add,
    Max,
    Min,
    SelGt,
    SelLt,
}

/// A reduction `acc = acc (op) e` of an f32 variable set once in the loop body and read
/// nowhere else in it: the vector loop keeps four partial accumulators (sums start at 0,
/// the others at the incoming value) and folds them into `acc` lane by lane after the
/// loop; the scalar remainder then goes on from there. Sums are thereby added in a
/// different order than the scalar loop would.
#[derive(Clone, Debug)]
pub(super) struct Red {
    pub(super) acc: VarId,
    pub(super) kind: RedKind,
    pub(super) e: Expr,
}

/// `value` as a reduction of `t`, when it is one.
fn reduction(t: VarId, value: &Expr) -> Option<(RedKind, Expr)> {
    let is_t = |e: &Expr| matches!(e, Expr::Var(v) if *v == t);
    let (kind, e) = match value {
        Expr::Bin(op @ (BinOp::Add | BinOp::Max | BinOp::Min), a, b) => {
            let kind = match op {
                BinOp::Add => RedKind::Add,
                BinOp::Max => RedKind::Max,
                _ => RedKind::Min,
            };
            if is_t(a) {
                (kind, (**b).clone())
            } else if is_t(b) {
                (kind, (**a).clone())
            } else {
                return None;
            }
        }
        Expr::Select(c, a, b) if is_t(b) => match &**c {
            Expr::Cmp(op @ (CmpOp::Gt | CmpOp::Lt), x, y) if x == a && is_t(y) => (
                if *op == CmpOp::Gt {
                    RedKind::SelGt
                } else {
                    RedKind::SelLt
                },
                (**a).clone(),
            ),
            _ => return None,
        },
        _ => return None,
    };
    let mut r = Vec::new();
    reads(&e, &mut r);
    (!r.contains(&t)).then_some((kind, e))
}

fn reads(e: &Expr, out: &mut Vec<VarId>) {
    match e {
        Expr::Var(v) => out.push(*v),
        Expr::Int(_) | Expr::Float(..) => {}
        Expr::Load(_, i) | Expr::Un(_, i) | Expr::Cast(_, i) => reads(i, out),
        Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => {
            reads(a, out);
            reads(b, out);
        }
        Expr::Select(c, a, b) => {
            reads(c, out);
            reads(a, out);
            reads(b, out);
        }
        Expr::Call(_, args) => args.iter().for_each(|a| reads(a, out)),
        Expr::StrByte(_, i, j) => {
            reads(i, out);
            reads(j, out);
        }
    }
}

/// Reads of `var` anywhere in `body` (expressions, conditions, GEMM offsets).
pub(super) fn count_reads(body: &[Stmt], var: VarId) -> usize {
    let in_expr = |e: &Expr| {
        let mut r = Vec::new();
        reads(e, &mut r);
        r.iter().filter(|&&v| v == var).count()
    };
    body.iter()
        .map(|s| match s {
            Stmt::For { body, .. } => count_reads(body, var),
            Stmt::Store { index, value, .. } => in_expr(index) + in_expr(value),
            Stmt::Set { value, .. } => in_expr(value),
            Stmt::If { cond, then, els } => {
                in_expr(cond) + count_reads(then, var) + count_reads(els, var)
            }
            Stmt::While { cond, body } => in_expr(cond) + count_reads(body, var),
            Stmt::Gemm(g) => g.views().iter().map(|v| in_expr(&v.offset)).sum(),
        })
        .sum()
}

fn loads<'e>(e: &'e Expr, out: &mut Vec<(usize, &'e Expr)>) {
    match e {
        Expr::Var(_) | Expr::Int(_) | Expr::Float(..) => {}
        Expr::Load(b, i) => {
            out.push((*b, &**i));
            loads(i, out);
        }
        Expr::Un(_, a) | Expr::Cast(_, a) => loads(a, out),
        Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => {
            loads(a, out);
            loads(b, out);
        }
        Expr::Select(c, a, b) => {
            loads(c, out);
            loads(a, out);
            loads(b, out);
        }
        Expr::Call(_, args) => args.iter().for_each(|a| loads(a, out)),
        // A string byte loads the pointer at `i` (the bytes themselves no kernel writes).
        Expr::StrByte(b, i, j) => {
            out.push((*b, &**i));
            loads(i, out);
            loads(j, out);
        }
    }
}

/// Whether `e` reads the loop variable or a loop-local variable.
pub(super) fn varies(e: &Expr, var: VarId, locals: &[VarId]) -> bool {
    let mut r = Vec::new();
    reads(e, &mut r);
    r.iter().any(|v| *v == var || locals.contains(v))
}

/// The coefficient of `var` when `e` is affine in it (other variables invariant, no
/// loop-local variables), else None.
pub(super) fn stride(e: &Expr, var: VarId, locals: &[VarId]) -> Option<i64> {
    if !varies(e, var, locals) {
        return Some(0);
    }
    match e {
        Expr::Var(v) if *v == var => Some(1),
        Expr::Bin(BinOp::Add, a, b) => stride(a, var, locals)?.checked_add(stride(b, var, locals)?),
        Expr::Bin(BinOp::Sub, a, b) => stride(a, var, locals)?.checked_sub(stride(b, var, locals)?),
        Expr::Bin(BinOp::Mul, a, b) => match (&**a, &**b) {
            (x, Expr::Int(k)) | (Expr::Int(k), x) => stride(x, var, locals)?.checked_mul(*k),
            _ => None,
        },
        _ => None,
    }
}

/// `e` with the loop variable replaced by 0.
pub(super) fn at_zero(e: &Expr, var: VarId) -> Expr {
    match e {
        Expr::Var(v) if *v == var => Expr::Int(0),
        Expr::Bin(op, a, b) => Expr::bin(*op, at_zero(a, var), at_zero(b, var)),
        Expr::Un(op, a) => Expr::un(*op, at_zero(a, var)),
        Expr::Cast(t, a) => Expr::cast(*t, at_zero(a, var)),
        e => e.clone(),
    }
}

/// `e` as (the rest, an integer constant added to it).
pub(super) fn split_const(e: &Expr) -> (Option<Expr>, i64) {
    match e {
        Expr::Int(c) => (None, *c),
        Expr::Bin(BinOp::Add, a, b) => {
            let (ea, ca) = split_const(a);
            let (eb, cb) = split_const(b);
            let rest = match (ea, eb) {
                (None, x) | (x, None) => x,
                (Some(a), Some(b)) => Some(Expr::add(a, b)),
            };
            (rest, ca.wrapping_add(cb))
        }
        Expr::Bin(BinOp::Sub, a, b) => {
            let (ea, ca) = split_const(a);
            let (eb, cb) = split_const(b);
            let rest = match (ea, eb) {
                (x, None) => x,
                (a, Some(b)) => Some(Expr::bin(BinOp::Sub, a.unwrap_or(Expr::Int(0)), b)),
            };
            (rest, ca.wrapping_sub(cb))
        }
        Expr::Bin(BinOp::Mul, a, b) => match (&**a, &**b) {
            (x, Expr::Int(k)) | (Expr::Int(k), x) => {
                let (ex, cx) = split_const(x);
                (ex.map(|x| Expr::mul(x, Expr::Int(*k))), cx.wrapping_mul(*k))
            }
            _ => (Some(e.clone()), 0),
        },
        e => (Some(e.clone()), 0),
    }
}

/// Whether two stores of one buffer, at `a` and `b` with strides `sa` and `sb` in `var`
/// (`0..extent`), never write the same element in any two iterations: equal strides
/// `s` and indices a constant `d` apart, with `d` not a multiple of `s` (two column
/// phases of a row) or at least `s * extent` (two rows).
fn disjoint((a, sa): (&Expr, i64), (b, sb): (&Expr, i64), var: VarId, extent: u64) -> bool {
    if sa != sb {
        return false;
    }
    let (ra, ca) = split_const(&at_zero(a, var));
    let (rb, cb) = split_const(&at_zero(b, var));
    if ra != rb {
        return false;
    }
    let d = (ca - cb).unsigned_abs();
    let s = sa.unsigned_abs();
    d % s != 0 || d / s >= extent
}

impl Gen<'_, '_> {
    /// Whether `body` of `for var` can be vectorised (see the module doc).
    pub(super) fn qualifies(&self, var: VarId, extent: u64, body: &[Stmt]) -> Option<Plan> {
        self.qualifies_as(var, extent, body, Ty::F32)
    }

    /// [`Gen::qualifies`] for a loop whose stored values are of type `lanes`: f32 (the
    /// vector loops), or f64 (the AVX-512 f64 loops only: stores into f64 buffers, or
    /// f64 values converted to bytes; no reductions or integer copies).
    pub(super) fn qualifies_as(
        &self,
        var: VarId,
        extent: u64,
        body: &[Stmt],
        lanes: Ty,
    ) -> Option<Plan> {
        let mut locals = Vec::new();
        let mut reds: Vec<Red> = Vec::new();
        let mut int_copy = false;
        for s in body {
            if let Stmt::Set { var: t, value } = s {
                let sets = body
                    .iter()
                    .filter(|s| matches!(s, Stmt::Set { var: u, .. } if u == t))
                    .count();
                let mut own = Vec::new();
                reads(value, &mut own);
                let own = own.iter().filter(|v| *v == t).count();
                if let Some((kind, e)) = reduction(*t, value) {
                    if *t != var
                        && self.k.vars[*t] == Ty::F32
                        && self.ty(&e).ok()? == Ty::F32
                        && sets == 1
                        && count_reads(body, *t) == own
                    {
                        reds.push(Red { acc: *t, kind, e });
                        continue;
                    }
                }
            }
            match s {
                Stmt::Set { var: t, .. } => {
                    if *t == var {
                        return None;
                    }
                    if !locals.contains(t) {
                        locals.push(*t);
                    }
                }
                Stmt::Store { .. } => {}
                _ => return None,
            }
        }
        // Locals: read only after their Set in the same iteration, never outside.
        let mut defined: Vec<VarId> = Vec::new();
        let mut stores: HashMap<usize, Vec<(&Expr, i64)>> = HashMap::new();
        let mut all_loads = Vec::new();
        for s in body {
            let mut r = Vec::new();
            match s {
                Stmt::Set { var: t, .. } if reds.iter().any(|x| x.acc == *t) => {
                    let red = reds.iter().find(|x| x.acc == *t)?;
                    reads(&red.e, &mut r);
                    if r.iter().any(|v| locals.contains(v) && !defined.contains(v)) {
                        return None;
                    }
                    loads(&red.e, &mut all_loads);
                }
                Stmt::Set { var: t, value } => {
                    reads(value, &mut r);
                    if r.iter().any(|v| locals.contains(v) && !defined.contains(v)) {
                        return None;
                    }
                    loads(value, &mut all_loads);
                    defined.push(*t);
                }
                Stmt::Store { buf, index, value } => {
                    reads(index, &mut r);
                    reads(value, &mut r);
                    if r.iter().any(|v| locals.contains(v) && !defined.contains(v)) {
                        return None;
                    }
                    // f32 stores; f16 ones and f32 values converted to bytes too (the
                    // AVX-512 loops store them whole, the f32x4 code lane by lane).
                    let b = &self.p.buffers[*buf];
                    if lanes == Ty::F32
                        && self.wide.avx512()
                        && self.int_copy_value(b.elem, value).is_some()
                    {
                        int_copy = true;
                    } else {
                        // f32 stores of an f64 loop: f32 values (the loop computes them
                        // in f64 lanes rounded to f32).
                        let (stored, ty) = match (b.elem, lanes) {
                            (Ty::F32 | Ty::F16, Ty::F32) | (Ty::F64, Ty::F64) => {
                                (Some(value), lanes)
                            }
                            (Ty::F32, Ty::F64) => (Some(value), Ty::F32),
                            (e, _) => (self.byte_store_value(e, value, lanes), lanes),
                        };
                        if stored.and_then(|v| self.ty(v).ok()) != Some(ty) {
                            return None;
                        }
                    }
                    let st = stride(index, var, &locals)?;
                    if st < 1 {
                        return None;
                    }
                    let prev = stores.entry(*buf).or_default();
                    if !prev.contains(&(index, st)) {
                        if !prev
                            .iter()
                            .all(|&(p, ps)| disjoint((p, ps), (index, st), var, extent))
                        {
                            return None;
                        }
                        prev.push((index, st));
                    }
                    loads(index, &mut all_loads);
                    loads(value, &mut all_loads);
                }
                _ => return None,
            }
        }
        for t in &locals {
            if count_reads(&self.k.body, *t) != count_reads(body, *t) {
                return None;
            }
        }
        // Aliasing: a stored buffer is loaded only at its store index (at any stride: each
        // iteration reads and writes its own element); no other buffer the loop loads
        // overlaps it.
        let overlap = |a: usize, b: usize| {
            let (x, y) = (&self.p.buffers[a], &self.p.buffers[b]);
            match (&x.kind, &y.kind) {
                (BufKind::Arena { offset: o1 }, BufKind::Arena { offset: o2 }) => {
                    *o1 < o2 + y.bytes() && *o2 < o1 + x.bytes()
                }
                _ => false,
            }
        };
        for (b, idx) in &all_loads {
            match stores.get(b).map(Vec::as_slice) {
                Some([(si, _)]) if *si == *idx => {}
                Some(_) => return None,
                None => {
                    if stores.keys().any(|s| overlap(*s, *b)) {
                        return None;
                    }
                }
            }
        }
        for s in stores.keys() {
            if stores.keys().any(|t| t != s && overlap(*s, *t)) {
                return None;
            }
        }
        Some(Plan {
            locals,
            reds,
            int_copy,
        })
    }

    /// Whether `body` computes an f64 value (a Set's or a Store's value, or a part of
    /// one).
    pub(super) fn computes_f64(&self, body: &[Stmt]) -> bool {
        fn f64_in(g: &Gen, e: &Expr) -> bool {
            g.ty(e).ok() == Some(Ty::F64)
                || match e {
                    Expr::Bin(_, a, b) => f64_in(g, a) || f64_in(g, b),
                    Expr::Un(_, a) | Expr::Cast(_, a) => f64_in(g, a),
                    Expr::Select(c, a, b) => f64_in(g, c) || f64_in(g, a) || f64_in(g, b),
                    Expr::Cmp(_, a, b) => f64_in(g, a) || f64_in(g, b),
                    _ => false,
                }
        }
        body.iter().any(|s| match s {
            Stmt::Set { value, .. } | Stmt::Store { value, .. } => f64_in(self, value),
            _ => false,
        })
    }

    /// For a store of `value` to a buffer of `elem`: the load it copies, when both are
    /// 32-bit integers or both the same bytes (see [`Plan::int_copy`]).
    pub(super) fn int_copy_value<'e>(
        &self,
        elem: Ty,
        value: &'e Expr,
    ) -> Option<(BufId, &'e Expr)> {
        let int32 = |t: Ty| matches!(t, Ty::I32 | Ty::U32);
        match value {
            Expr::Load(src, idx) => {
                let from = self.p.buffers[*src].elem;
                let bytes = matches!(elem, Ty::U8 | Ty::I8) && from == elem;
                ((int32(elem) && int32(from)) || bytes).then_some((*src, &**idx))
            }
            _ => None,
        }
    }

    /// For a store of `value` to a buffer of `elem` bytes (u8, i8): the `lanes` value
    /// (f32 or f64) it converts, as Cast writes it (`u8(i64(x))`) or QuantizeLinear
    /// (`u8(x)`).
    pub(super) fn byte_store_value<'e>(
        &self,
        elem: Ty,
        value: &'e Expr,
        lanes: Ty,
    ) -> Option<&'e Expr> {
        let Expr::Cast(to, a) = value else {
            return None;
        };
        if !matches!(elem, Ty::U8 | Ty::I8) || *to != elem {
            return None;
        }
        let x = match &**a {
            Expr::Cast(Ty::I64, b) => &**b,
            b => b,
        };
        (self.ty(x).ok()? == lanes).then_some(x)
    }

    /// Whether f32x4 floor/ceil/nearest/trunc have a native form on the target.
    fn vec_round_ok(&self) -> bool {
        let isa = self.module.isa();
        if isa.triple().architecture != target_lexicon::Architecture::X86_64 {
            return true;
        }
        isa.isa_flags()
            .iter()
            .any(|f| f.name == "has_sse41" && f.as_bool() == Some(true))
    }

    /// One vector iteration of a qualifying loop body (lanes `cx.i .. cx.i + 4`).
    fn vbody(
        &mut self,
        cx: &mut Cx,
        body: &[Stmt],
        accs: &[(Red, cranelift_frontend::Variable)],
    ) -> Result<(), String> {
        for s in body {
            match s {
                Stmt::Set { var: t, .. } if accs.iter().any(|(r, _)| r.acc == *t) => {
                    let (r, a) = accs.iter().find(|(r, _)| r.acc == *t).cloned().unwrap();
                    let x = self.vexpr(cx, &r.e)?;
                    let x = self.vec4(x)?;
                    let cur = self.b.use_var(a);
                    let new = self.combine(r.kind, cur, x);
                    self.b.def_var(a, new);
                }
                Stmt::Set { var: t, value } => {
                    let x = self.vexpr(cx, value)?;
                    cx.vals.insert(*t, x);
                }
                Stmt::Store { buf, index, value } => {
                    let elem = self.p.buffers[*buf].elem;
                    // Bytes: the f32 value, converted lane by lane.
                    let to_bytes = self.byte_store_value(elem, value, Ty::F32);
                    let x = self.vexpr(cx, to_bytes.unwrap_or(value))?;
                    let x = self.vec4(x)?;
                    let addr = self.addr(*buf, index)?;
                    if elem != Ty::F32 {
                        // f16 (and bytes): each lane narrowed as the scalar code does.
                        let st = stride(index, cx.var, &cx.locals)
                            .ok_or("vectorize: store index not affine")?;
                        let bytes = elem.bytes() as i64;
                        for l in 0..4u8 {
                            let xl = self.b.ins().extractlane(x, l);
                            let xl = if to_bytes.is_some() {
                                self.cast(xl, Ty::F32, elem)
                            } else {
                                self.narrow_for_store(xl, elem)
                            };
                            let off = i32::try_from(st * bytes * i64::from(l))
                                .map_err(|_| "vectorize: store stride too large")?;
                            self.b.ins().store(vflags(), xl, addr, off);
                        }
                        continue;
                    }
                    match stride(index, cx.var, &cx.locals) {
                        Some(1) => {
                            self.b.ins().store(vflags(), x, addr, 0);
                        }
                        // Strided stores (qualifies took them): lane by lane.
                        Some(st) => {
                            for l in 0..4u8 {
                                let xl = self.b.ins().extractlane(x, l);
                                let off = i32::try_from(st * 4 * i64::from(l))
                                    .map_err(|_| "vectorize: store stride too large")?;
                                self.b.ins().store(vflags(), xl, addr, off);
                            }
                        }
                        None => return Err("vectorize: store index not affine".into()),
                    }
                }
                _ => return Err("vectorize: unexpected statement".into()),
            }
        }
        Ok(())
    }

    /// Emits `for var in 0..extent` as a vector loop over the first `extent / 4 * 4`
    /// iterations when it qualifies; returns where the scalar loop must start (0 when
    /// nothing was emitted).
    pub(super) fn vectorize_for(
        &mut self,
        var: VarId,
        extent: u64,
        body: &[Stmt],
    ) -> Result<u64, String> {
        if extent < W {
            return Ok(0);
        }
        let Some(plan) = self.qualifies(var, extent, body) else {
            return Ok(if self.wide64_for(var, extent, body)? {
                extent
            } else {
                0
            });
        };
        if self.wide_for(var, extent, body, &plan)? {
            return Ok(extent);
        }
        // A body computing in f64 whose stores are f32 (a requantization fused with the
        // next conv's input conversion): the f32 lanes cannot take it, f64 ones may.
        if self.computes_f64(body) && self.wide64_for(var, extent, body)? {
            return Ok(extent);
        }
        if plan.int_copy {
            return Ok(0);
        }
        let n4 = extent / W * W;
        let v = self.vars[var];
        let zero = self.b.ins().iconst(types::I64, 0);
        self.b.def_var(v, zero);
        let mut accs = Vec::new();
        for r in &plan.reds {
            let a = self.b.declare_var(types::F32X4);
            let init = if r.kind == RedKind::Add {
                self.b.ins().f32const(0.0)
            } else {
                self.b.use_var(self.vars[r.acc])
            };
            let init = self.b.ins().splat(types::F32X4, init);
            self.b.def_var(a, init);
            accs.push((r.clone(), a));
        }
        let round_ok = self.vec_round_ok();
        if n4 / W <= UNROLL {
            // Short rows (a convolution's packing of small images has many): straight
            // code, each copy with a constant index the address arithmetic folds.
            for j in 0..n4 / W {
                let i = self.b.ins().iconst(types::I64, (j * W) as i64);
                self.b.def_var(v, i);
                let mut cx = Cx {
                    var,
                    i,
                    locals: plan.locals.clone(),
                    vals: HashMap::new(),
                    round_ok,
                };
                self.vbody(&mut cx, body, &accs)?;
            }
        } else {
            let header = self.b.create_block();
            let body_blk = self.b.create_block();
            let exit = self.b.create_block();
            self.b.ins().jump(header, &[]);
            self.b.switch_to_block(header);
            let i = self.b.use_var(v);
            let c = self
                .b
                .ins()
                .icmp_imm_s(IntCC::UnsignedLessThan, i, n4 as i64);
            self.b.ins().brif(c, body_blk, &[], exit, &[]);
            self.b.switch_to_block(body_blk);
            let i = self.b.use_var(v);
            let mut cx = Cx {
                var,
                i,
                locals: plan.locals.clone(),
                vals: HashMap::new(),
                round_ok,
            };
            self.vbody(&mut cx, body, &accs)?;
            let n = self.b.ins().iadd_imm_s(cx.i, W as i64);
            self.b.def_var(v, n);
            self.b.ins().jump(header, &[]);
            self.b.switch_to_block(exit);
        }
        for (r, a) in accs {
            let vacc = self.b.use_var(a);
            let mut acc = self.b.use_var(self.vars[r.acc]);
            if r.kind == RedKind::Add {
                // Pairwise: (l0 + l1) + (l2 + l3), then into the incoming value.
                let l: Vec<Value> = (0..4).map(|l| self.b.ins().extractlane(vacc, l)).collect();
                let p = self.b.ins().fadd(l[0], l[1]);
                let q = self.b.ins().fadd(l[2], l[3]);
                let pq = self.b.ins().fadd(p, q);
                acc = self.b.ins().fadd(acc, pq);
            } else {
                for l in 0..4 {
                    let x = self.b.ins().extractlane(vacc, l);
                    acc = self.combine(r.kind, acc, x);
                }
            }
            self.b.def_var(self.vars[r.acc], acc);
        }
        Ok(n4)
    }

    /// One step of a reduction, on f32 or f32x4 values.
    pub(super) fn combine(&mut self, kind: RedKind, acc: Value, x: Value) -> Value {
        let ins = self.b.ins();
        match kind {
            RedKind::Add => ins.fadd(acc, x),
            RedKind::Max => ins.fmax(acc, x),
            RedKind::Min => ins.fmin(acc, x),
            RedKind::SelGt | RedKind::SelLt => {
                let cc = if kind == RedKind::SelGt {
                    FloatCC::GreaterThan
                } else {
                    FloatCC::LessThan
                };
                let c = self.b.ins().fcmp(cc, x, acc);
                if self.b.func.dfg.value_type(x) == types::F32X4 {
                    let m = self.b.ins().bitcast(types::F32X4, MemFlagsData::new(), c);
                    self.b.ins().bitselect(m, x, acc)
                } else {
                    self.b.ins().select(c, x, acc)
                }
            }
        }
    }

    fn vec4(&mut self, x: V) -> Result<Value, String> {
        Ok(match x {
            V::Vec(v) => v,
            V::Uni(s) => self.b.ins().splat(types::F32X4, s),
            V::Lanes(l) => {
                let mut v = self.b.ins().splat(types::F32X4, l[0]);
                for (k, s) in l.iter().enumerate().skip(1) {
                    v = self.b.ins().insertlane(v, *s, k as u8);
                }
                v
            }
            V::Mask(_) => return Err("vectorize: a mask used as f32".into()),
        })
    }

    /// Lane `l` of `x` as a scalar of the expression's type.
    fn lane(&mut self, x: V, l: usize) -> Value {
        match x {
            V::Uni(s) => s,
            V::Lanes(a) => a[l],
            V::Vec(v) => self.b.ins().extractlane(v, l as u8),
            V::Mask(m) => {
                let s = self.b.ins().extractlane(m, l as u8);
                let s = self.b.ins().band_imm_s(s, 1);
                self.b.ins().ireduce(types::I8, s)
            }
        }
    }

    /// `e` evaluated lane by lane with the scalar code generator.
    fn per_lane(&mut self, cx: &mut Cx, e: &Expr) -> Result<V, String> {
        let mut r = Vec::new();
        reads(e, &mut r);
        let mut out = [cx.i; 4];
        for (l, o) in out.iter_mut().enumerate() {
            let il = self.b.ins().iadd_imm_s(cx.i, l as i64);
            self.b.def_var(self.vars[cx.var], il);
            for t in &cx.locals {
                if r.contains(t) {
                    let x = *cx
                        .vals
                        .get(t)
                        .ok_or("vectorize: a local read before it is set")?;
                    let s = self.lane(x, l);
                    self.b.def_var(self.vars[*t], s);
                }
            }
            *o = self.expr(e)?;
        }
        self.b.def_var(self.vars[cx.var], cx.i);
        Ok(V::Lanes(out))
    }

    fn vexpr(&mut self, cx: &mut Cx, e: &Expr) -> Result<V, String> {
        if !varies(e, cx.var, &cx.locals) {
            return Ok(V::Uni(self.expr(e)?));
        }
        let ty = self.ty(e)?;
        let f32 = ty == Ty::F32;
        Ok(match e {
            Expr::Var(t) if *t != cx.var => *cx
                .vals
                .get(t)
                .ok_or("vectorize: a local read before it is set")?,
            Expr::Load(b, idx)
                if f32
                    && self.p.buffers[*b].elem == Ty::F32
                    && stride(idx, cx.var, &cx.locals) == Some(1) =>
            {
                let addr = self.addr(*b, idx)?;
                V::Vec(self.b.ins().load(types::F32X4, vflags(), addr, 0))
            }
            Expr::Un(op, a)
                if f32
                    && (matches!(op, UnOp::Neg | UnOp::Abs | UnOp::Sqrt)
                        || (cx.round_ok
                            && matches!(
                                op,
                                UnOp::Floor | UnOp::Ceil | UnOp::Nearest | UnOp::Trunc
                            ))) =>
            {
                let x = self.vexpr(cx, a)?;
                let x = self.vec4(x)?;
                let ins = self.b.ins();
                V::Vec(match op {
                    UnOp::Neg => ins.fneg(x),
                    UnOp::Abs => ins.fabs(x),
                    UnOp::Sqrt => ins.sqrt(x),
                    UnOp::Floor => ins.floor(x),
                    UnOp::Ceil => ins.ceil(x),
                    UnOp::Nearest => ins.nearest(x),
                    _ => ins.trunc(x),
                })
            }
            Expr::Bin(op, a, b)
                if f32
                    && matches!(
                        op,
                        BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Div | BinOp::Min | BinOp::Max
                    ) =>
            {
                let x = self.vexpr(cx, a)?;
                let x = self.vec4(x)?;
                let y = self.vexpr(cx, b)?;
                let y = self.vec4(y)?;
                let ins = self.b.ins();
                V::Vec(match op {
                    BinOp::Add => ins.fadd(x, y),
                    BinOp::Sub => ins.fsub(x, y),
                    BinOp::Mul => ins.fmul(x, y),
                    BinOp::Div => ins.fdiv(x, y),
                    BinOp::Min => ins.fmin(x, y),
                    _ => ins.fmax(x, y),
                })
            }
            Expr::Cmp(op, a, b) if self.ty(a)? == Ty::F32 => {
                let x = self.vexpr(cx, a)?;
                let x = self.vec4(x)?;
                let y = self.vexpr(cx, b)?;
                let y = self.vec4(y)?;
                let cc = match op {
                    CmpOp::Eq => FloatCC::Equal,
                    CmpOp::Ne => FloatCC::NotEqual,
                    CmpOp::Lt => FloatCC::LessThan,
                    CmpOp::Le => FloatCC::LessThanOrEqual,
                    CmpOp::Gt => FloatCC::GreaterThan,
                    CmpOp::Ge => FloatCC::GreaterThanOrEqual,
                };
                V::Mask(self.b.ins().fcmp(cc, x, y))
            }
            Expr::Select(c, a, b) if f32 => {
                let m = self.vexpr(cx, c)?;
                let x = self.vexpr(cx, a)?;
                let y = self.vexpr(cx, b)?;
                match m {
                    V::Mask(m) => {
                        let x = self.vec4(x)?;
                        let y = self.vec4(y)?;
                        let m = self.b.ins().bitcast(types::F32X4, MemFlagsData::new(), m);
                        V::Vec(self.b.ins().bitselect(m, x, y))
                    }
                    m => {
                        let mut out = [cx.i; 4];
                        for (l, o) in out.iter_mut().enumerate() {
                            let (c, x, y) = (self.lane(m, l), self.lane(x, l), self.lane(y, l));
                            *o = self.b.ins().select(c, x, y);
                        }
                        V::Lanes(out)
                    }
                }
            }
            Expr::Bin(op @ (BinOp::And | BinOp::Or), a, b)
                if ty == Ty::U8 && is_mask(a, &cx.vals) && is_mask(b, &cx.vals) =>
            {
                match (self.vexpr(cx, a)?, self.vexpr(cx, b)?) {
                    (V::Mask(x), V::Mask(y)) => V::Mask(if *op == BinOp::And {
                        self.b.ins().band(x, y)
                    } else {
                        self.b.ins().bor(x, y)
                    }),
                    _ => self.per_lane(cx, e)?,
                }
            }
            Expr::Cast(Ty::F32, a) if self.ty(a)? == Ty::F32 => self.vexpr(cx, a)?,
            Expr::Cast(Ty::F32, a) if self.ty(a)? == Ty::U8 && is_mask(a, &cx.vals) => {
                // A comparison as 1.0 or 0.0 (Sign's `(x > 0) - (x < 0)`).
                match self.vexpr(cx, a)? {
                    V::Mask(m) => {
                        let one = self.b.ins().f32const(1.0);
                        let one = self.b.ins().splat(types::F32X4, one);
                        let zero = self.b.ins().f32const(0.0);
                        let zero = self.b.ins().splat(types::F32X4, zero);
                        let m = self.b.ins().bitcast(types::F32X4, MemFlagsData::new(), m);
                        V::Vec(self.b.ins().bitselect(m, one, zero))
                    }
                    _ => self.per_lane(cx, e)?,
                }
            }
            Expr::Call(f, args) if f32 && crate::backend::cranelift::vmath::is_inline(*f) => {
                let x = self.vexpr(cx, &args[0])?;
                let x = self.vec4(x)?;
                V::Vec(self.inline_math(*f, x)?)
            }
            Expr::Call(f, args) if f32 => {
                let xs = args
                    .iter()
                    .map(|a| self.vexpr(cx, a))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut out = [cx.i; 4];
                for (l, o) in out.iter_mut().enumerate() {
                    let la: Vec<Value> = xs.iter().map(|x| self.lane(*x, l)).collect();
                    *o = self.call(*f, Ty::F32, &la)?;
                }
                V::Lanes(out)
            }
            _ => self.per_lane(cx, e)?,
        })
    }
}

/// Whether `e` becomes a [`V::Mask`]: an f32 comparison, or And/Or of such (checked
/// again on the values; a miss falls back to lanes).
fn is_mask(e: &Expr, vals: &HashMap<VarId, V>) -> bool {
    match e {
        Expr::Cmp(..) => true,
        Expr::Bin(BinOp::And | BinOp::Or, a, b) => is_mask(a, vals) && is_mask(b, vals),
        Expr::Var(t) => matches!(vals.get(t), Some(V::Mask(_))),
        _ => false,
    }
}

/// State of the vector body being emitted.
struct Cx {
    var: VarId,
    /// The loop variable's value at lane 0.
    i: Value,
    locals: Vec<VarId>,
    vals: HashMap<VarId, V>,
    round_ok: bool,
}

/// Vector accesses need not be 16-byte aligned: never let a load fold into an SSE
/// instruction that requires alignment.
fn vflags() -> MemFlagsData {
    MemFlagsData::new().with_notrap()
}
