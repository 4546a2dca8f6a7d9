//! Which loops of a kernel may run their iterations on several threads at once.
//!
//! A loop `for p in 0..n { body }` qualifies when no iteration can see another's effects:
//!
//! - its body has no `while` loop (no known amount of work; string kernels stay serial)
//!   and no store to a buffer of sub-byte elements (two iterations could share a byte);
//! - a GEMM call in its body reads an operand the body itself writes (a convolution's
//!   im2col block, packed per iteration): other GEMMs are split on their own, but such
//!   a call split across threads would have each core read the block the other packed.
//!   The GEMM's views count as accesses of all their elements (see [`gemm_forms`]);
//! - every variable the body writes is written before it is read in each iteration and is
//!   not used outside the loop (no value is carried between iterations or out of them);
//! - every access (load or store) to a buffer the body stores to has an index that is
//!   affine in the loop variables, `c * p + inv + low (+ H * high)`, where `c > 0` is the
//!   same for every access to that buffer, `inv` (the variables the body only reads) is the
//!   same too, `low` stays in `[0, c)` and, when present, `H > c * (n - 1) + low` with `high`
//!   any integer: then the index determines `p`, so iterations touch disjoint elements. (The
//!   `H` form covers the panel layouts GEMM operands are packed in.) Buffers that share
//!   arena bytes count as one buffer, and only when they start at the same byte.
//!
//! The analysis is conservative: a loop it cannot prove safe runs serially.

use super::{BinOp, BufId, BufKind, CmpOp, Expr, GemmCall, Kernel, MatView, Program, Stmt, VarId};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Loops doing fewer element operations than this (iterations times statements) stay
/// serial: handing them to threads would cost more than it saves.
pub const MIN_WORK: u64 = 1 << 15;

/// Programs doing fewer element operations than this in one run (all kernels together,
/// [`program_work`]) keep every loop on the calling thread. Their whole run is tens of
/// microseconds, and each job's hand-over and each tensor one core writes and the other
/// reads cost about what the job saves: the zoo's small CNN (0.85 M) took 0.024 ms with
/// its loops serial and 0.035 ms with them on two threads. GEMMs on prepacked weights
/// still split (the MLP's, 0.67 M: each core keeps its half of the weights in its own
/// cache).
pub const MIN_PROGRAM_WORK: u64 = 1 << 21;

/// What [`program_work`] counts a math call (`exp`, `erf`, ...) in a stored value as:
/// on AVX-512 one is a dozen or more instructions per vector where an add is one. With
/// calls counted once, `erf(x / s) * x + x` on 1x197x768 (0.15 M) stayed on one thread,
/// 0.056 ms against 0.035 on two.
const CALL_WORK: u64 = 16;

/// Element operations of one run of all of `p`'s kernels, roughly (as [`MIN_WORK`]
/// counts them, each math call as [`CALL_WORK`]).
pub fn program_work(p: &Program) -> u64 {
    p.kernels
        .iter()
        .map(|k| work_calls(&k.body, CALL_WORK))
        .fold(0, u64::saturating_add)
}

/// The variables of the loops of `k` that may run in parallel: the outermost qualifying
/// loop on each path (loops inside a chosen loop are not searched).
pub fn parallel_loops(k: &Kernel, p: &Program, min_work: u64) -> HashSet<VarId> {
    let mut total = HashMap::new();
    count_vars(&k.body, &mut total);
    let mut out = HashSet::new();
    walk(&k.body, p, min_work, &total, &mut out);
    out
}

fn walk(
    body: &[Stmt],
    p: &Program,
    min_work: u64,
    total: &HashMap<VarId, usize>,
    out: &mut HashSet<VarId>,
) {
    for s in body {
        match s {
            Stmt::For { var, extent, body } => {
                if *extent >= 2
                    && extent.saturating_mul(work(body)) >= min_work
                    && safe(*var, *extent, body, p, total)
                {
                    out.insert(*var);
                } else {
                    walk(body, p, min_work, total, out);
                }
            }
            Stmt::If { then, els, .. } => {
                walk(then, p, min_work, total, out);
                walk(els, p, min_work, total, out);
            }
            _ => {}
        }
    }
}

/// Element operations of one run of `body`, roughly.
fn work(body: &[Stmt]) -> u64 {
    work_calls(body, 0)
}

/// [`work`], with each math call in a stored or set value adding `call`.
fn work_calls(body: &[Stmt], call: u64) -> u64 {
    let w = |b: &[Stmt]| work_calls(b, call);
    body.iter()
        .map(|s| match s {
            Stmt::For { extent, body, .. } => extent.saturating_mul(w(body)),
            Stmt::If { then, els, .. } => w(then).max(w(els)).saturating_add(1),
            Stmt::Gemm(g) => g.m.saturating_mul(g.n).saturating_mul(g.k),
            // Unknown trips: counted once.
            Stmt::While { body, .. } => w(body).saturating_add(1),
            // A store of a long sum (a depthwise window's taps) weighs more: a quarter
            // per element it loads.
            Stmt::Store { value, .. } => {
                (count_loads(value) / 4).max(1) + call.saturating_mul(count_calls(value))
            }
            Stmt::Set { value, .. } => 1 + call.saturating_mul(count_calls(value)),
        })
        .fold(0u64, u64::saturating_add)
}

/// Math calls in `e`.
fn count_calls(e: &Expr) -> u64 {
    let here = u64::from(matches!(e, Expr::Call(..)));
    here + e.children().into_iter().map(count_calls).sum::<u64>()
}

/// Loads in `e`.
fn count_loads(e: &Expr) -> u64 {
    let here = u64::from(matches!(e, Expr::Load(..)));
    here + e.children().into_iter().map(count_loads).sum::<u64>()
}

/// Calls `f` on every variable `e` reads.
pub(crate) fn expr_vars(e: &Expr, f: &mut dyn FnMut(VarId)) {
    match e {
        Expr::Var(v) => f(*v),
        Expr::Int(_) | Expr::Float(..) => {}
        Expr::Load(_, i) | Expr::Un(_, i) | Expr::Cast(_, i) => expr_vars(i, f),
        Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => {
            expr_vars(a, f);
            expr_vars(b, f);
        }
        Expr::Select(c, a, b) => {
            expr_vars(c, f);
            expr_vars(a, f);
            expr_vars(b, f);
        }
        Expr::Call(_, args) => args.iter().for_each(|a| expr_vars(a, f)),
        Expr::StrByte(_, i, j) => {
            expr_vars(i, f);
            expr_vars(j, f);
        }
    }
}

/// Every expression directly in `s` (not in nested statements).
fn stmt_exprs(s: &Stmt) -> Vec<&Expr> {
    match s {
        Stmt::For { .. } => vec![],
        Stmt::Store { index, value, .. } => vec![index, value],
        Stmt::Set { value, .. } => vec![value],
        Stmt::If { cond, .. } | Stmt::While { cond, .. } => vec![cond],
        Stmt::Gemm(g) => g.views().into_iter().map(|v| &v.offset).collect(),
    }
}

fn children(s: &Stmt) -> Vec<&[Stmt]> {
    match s {
        Stmt::For { body, .. } | Stmt::While { body, .. } => vec![body],
        Stmt::If { then, els, .. } => vec![then, els],
        _ => vec![],
    }
}

/// Occurrences of each variable (reads, writes and loop headers).
fn count_vars(body: &[Stmt], n: &mut HashMap<VarId, usize>) {
    for s in body {
        match s {
            Stmt::For { var, .. } | Stmt::Set { var, .. } => *n.entry(*var).or_default() += 1,
            _ => {}
        }
        for e in stmt_exprs(s) {
            expr_vars(e, &mut |v| *n.entry(v).or_default() += 1);
        }
        for c in children(s) {
            count_vars(c, n);
        }
    }
}

/// The variables `body` reads without writing them (nor being `var`, the loop's own):
/// the values a task running part of the loop must be given.
pub fn captured(var: VarId, body: &[Stmt]) -> Vec<VarId> {
    let (mut read, mut written) = (Vec::new(), HashSet::new());
    fn go(b: &[Stmt], read: &mut Vec<VarId>, written: &mut HashSet<VarId>) {
        for s in b {
            match s {
                Stmt::For { var, .. } | Stmt::Set { var, .. } => {
                    written.insert(*var);
                }
                _ => {}
            }
            for e in stmt_exprs(s) {
                expr_vars(e, &mut |v| {
                    if !read.contains(&v) {
                        read.push(v)
                    }
                });
            }
            for c in children(s) {
                go(c, read, written);
            }
        }
    }
    go(body, &mut read, &mut written);
    read.retain(|v| *v != var && !written.contains(v));
    read
}

fn safe(
    var: VarId,
    extent: u64,
    body: &[Stmt],
    p: &Program,
    total: &HashMap<VarId, usize>,
) -> bool {
    // Variables: written ones (Set targets, inner loop variables) stay inside.
    let mut defs: HashMap<VarId, Vec<&Expr>> = HashMap::new();
    let mut loops: HashSet<VarId> = HashSet::new();
    let mut has_while = false;
    let mut gemms: Vec<&GemmCall> = Vec::new();
    fn scan<'a>(
        b: &'a [Stmt],
        defs: &mut HashMap<VarId, Vec<&'a Expr>>,
        loops: &mut HashSet<VarId>,
        has_while: &mut bool,
        gemms: &mut Vec<&'a GemmCall>,
    ) {
        for s in b {
            match s {
                Stmt::For { var, .. } => {
                    loops.insert(*var);
                }
                Stmt::Set { var, value } => defs.entry(*var).or_default().push(value),
                // A while loop has no known work.
                Stmt::While { .. } => *has_while = true,
                Stmt::Gemm(g) => gemms.push(g),
                _ => {}
            }
            for c in children(s) {
                scan(c, defs, loops, has_while, gemms);
            }
        }
    }
    scan(body, &mut defs, &mut loops, &mut has_while, &mut gemms);
    if has_while || defs.contains_key(&var) || loops.contains(&var) {
        return false;
    }
    let written: HashSet<VarId> = defs.keys().chain(loops.iter()).copied().collect();
    let mut inside = HashMap::new();
    count_vars(body, &mut inside);
    if written
        .iter()
        .any(|v| total.get(v).copied().unwrap_or(0) != inside.get(v).copied().unwrap_or(0))
    {
        return false;
    }
    let mut defined: HashSet<VarId> = HashSet::from([var]);
    if !defined_before_use(body, &mut defined, &written) {
        return false;
    }
    // Memory: group the accesses by buffer (arena aliases joined), check each stored one.
    let mut acc: Vec<Access> = Vec::new();
    access_forms(
        body,
        var,
        &mut HashMap::new(),
        &mut HashMap::new(),
        &mut acc,
    );
    let stored: Vec<BufId> = {
        let mut s: Vec<BufId> = acc.iter().filter(|a| a.2).map(|a| a.0).collect();
        s.sort_unstable();
        s.dedup();
        s
    };
    // Every GEMM must read an operand the body writes (see the module comment).
    if !gemms
        .iter()
        .all(|g| stored.contains(&g.a.buf) || stored.contains(&g.b.buf))
    {
        return false;
    }
    if stored.iter().any(|&b| p.buffers[b].elem.bits() < 8) {
        return false;
    }
    let range = |b: BufId| match p.buffers[b].kind {
        BufKind::Arena { offset } => Some((offset, offset + p.buffers[b].bytes())),
        _ => None,
    };
    // The stored buffer each accessed buffer is analysed as (None: not stored, no alias).
    let mut key: HashMap<BufId, BufId> = HashMap::new();
    let all: HashSet<BufId> = acc.iter().map(|a| a.0).collect();
    for &b in &all {
        let mut k = if stored.contains(&b) { Some(b) } else { None };
        if let Some((lo, hi)) = range(b) {
            for &s in &stored {
                if s == b {
                    continue;
                }
                let Some((slo, shi)) = range(s) else { continue };
                if lo < shi && slo < hi {
                    if lo != slo || p.buffers[b].elem != p.buffers[s].elem {
                        return false;
                    }
                    k = Some(k.map_or(s, |x: BufId| x.min(s)));
                }
            }
        }
        if let Some(k) = k {
            key.insert(b, k);
        }
    }
    let mut groups: BTreeMap<BufId, Vec<Option<(Aff, Scope)>>> = BTreeMap::new();
    for (b, form, _) in acc {
        if let Some(k) = key.get(&b) {
            groups.entry(*k).or_default().push(form);
        }
    }
    let cx = AffCtx { var };
    groups.into_values().all(|forms| {
        let forms: Option<Vec<(Aff, Scope)>> = forms.into_iter().collect();
        forms.is_some_and(|f| disjoint(&f, &cx, extent))
    })
}

/// Reads of written variables come after a write in the same or an enclosing scope.
fn defined_before_use(
    body: &[Stmt],
    defined: &mut HashSet<VarId>,
    written: &HashSet<VarId>,
) -> bool {
    let ok = |e: &Expr, defined: &HashSet<VarId>| {
        let mut ok = true;
        expr_vars(e, &mut |v| {
            ok &= !written.contains(&v) || defined.contains(&v)
        });
        ok
    };
    for s in body {
        if !stmt_exprs(s).into_iter().all(|e| ok(e, defined)) {
            return false;
        }
        match s {
            Stmt::Set { var, .. } => {
                defined.insert(*var);
            }
            Stmt::For { var, body, .. } => {
                let mut inner = defined.clone();
                inner.insert(*var);
                if !defined_before_use(body, &mut inner, written) {
                    return false;
                }
            }
            Stmt::If { then, els, .. } => {
                for b in [then, els] {
                    if !defined_before_use(b, &mut defined.clone(), written) {
                        return false;
                    }
                }
            }
            Stmt::While { body, .. }
                if !defined_before_use(body, &mut defined.clone(), written) =>
            {
                return false;
            }
            _ => {}
        }
    }
    true
}

/// Variables set in the body: the affine form of their current value (None: unknown,
/// such as after a scope that may or may not have set them).
type Env = HashMap<VarId, Option<Aff>>;

/// The extents of the loops (inside the body) around an access; under `if p < K` (`p`
/// the parallel loop's variable), also `K` for `p`.
type Scope = HashMap<VarId, u64>;

/// (buffer, index form and the loops around it, is a store).
type Access = (BufId, Option<(Aff, Scope)>, bool);

/// Every access in `body`, in program order, with each variable replaced by the
/// definition that reaches the access.
fn access_forms(
    body: &[Stmt],
    pvar: VarId,
    env: &mut Env,
    scope: &mut Scope,
    out: &mut Vec<Access>,
) {
    fn loads(e: &Expr, env: &Env, scope: &Scope, out: &mut Vec<Access>) {
        match e {
            Expr::Load(b, i) => {
                out.push((*b, aff(i, env).map(|f| (f, scope.clone())), false));
                loads(i, env, scope, out);
            }
            Expr::Var(_) | Expr::Int(_) | Expr::Float(..) => {}
            Expr::Un(_, a) | Expr::Cast(_, a) => loads(a, env, scope, out),
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => {
                loads(a, env, scope, out);
                loads(b, env, scope, out);
            }
            Expr::Select(c, a, b) => {
                loads(c, env, scope, out);
                loads(a, env, scope, out);
                loads(b, env, scope, out);
            }
            Expr::Call(_, args) => args.iter().for_each(|a| loads(a, env, scope, out)),
            // Reads the pointer at `i` (the bytes are never written by kernels).
            Expr::StrByte(b, i, j) => {
                out.push((*b, aff(i, env).map(|f| (f, scope.clone())), false));
                loads(i, env, scope, out);
                loads(j, env, scope, out);
            }
        }
    }
    // Variables a scope may set are unknown after it.
    fn forget(b: &[Stmt], env: &mut Env) {
        for s in b {
            if let Stmt::Set { var, .. } = s {
                env.insert(*var, None);
            }
            for c in children(s) {
                forget(c, env);
            }
        }
    }
    for s in body {
        if let Stmt::While { body, .. } = s {
            // The condition runs again after every pass through the body.
            forget(body, env);
        }
        for e in stmt_exprs(s) {
            loads(e, env, scope, out);
        }
        match s {
            Stmt::Store { buf, index, .. } => {
                out.push((*buf, aff(index, env).map(|f| (f, scope.clone())), true))
            }
            Stmt::Set { var, value } => {
                let f = aff(value, env);
                env.insert(*var, f);
            }
            Stmt::For { var, extent, body } => {
                let prev = scope.insert(*var, *extent);
                access_forms(body, pvar, env, scope, out);
                match prev {
                    Some(p) => scope.insert(*var, p),
                    None => scope.remove(var),
                };
                forget(body, env);
            }
            Stmt::If { cond, then, els } => {
                // `if p < K`: the then branch runs in iterations below K only.
                let below = match cond {
                    Expr::Cmp(CmpOp::Lt, a, b) if **a == Expr::Var(pvar) => match **b {
                        Expr::Int(k) if k > 0 => Some(k as u64),
                        _ => None,
                    },
                    _ => None,
                };
                let saved = scope.get(&pvar).copied();
                for (b, bound) in [(then, below), (els, None)] {
                    if let Some(k) = bound {
                        scope.insert(pvar, saved.map_or(k, |s| s.min(k)));
                    }
                    access_forms(b, pvar, &mut env.clone(), scope, out);
                    match saved {
                        Some(s) => scope.insert(pvar, s),
                        None => scope.remove(&pvar),
                    };
                    forget(b, env);
                }
            }
            Stmt::While { body, .. } => {
                access_forms(body, pvar, env, scope, out);
                forget(body, env);
            }
            Stmt::Gemm(g) => gemm_forms(g, env, scope, out),
        }
    }
}

/// The accesses of a GEMM: each view as every element it covers, `offset` plus its
/// strides times fresh variables ranging over the view's rows, columns and panels
/// (see [`MatView`]); C is stored, the rest (init included, even when it is C) loaded.
fn gemm_forms(g: &GemmCall, env: &Env, scope: &Scope, out: &mut Vec<Access>) {
    // Fresh variables: past every kernel variable.
    let mut next = usize::MAX / 2;
    let mut fresh = |n: u64, sc: &mut Scope| {
        next += 1;
        sc.insert(next, n);
        next
    };
    let (m, n, k) = (g.m, g.n, g.k);
    let mut view = |v: &MatView, rows: u64, cols: u64, is_a: bool, quads: bool, store: bool| {
        let mut sc = scope.clone();
        let form = aff(&v.offset, env).and_then(|mut f| {
            // (coefficient, extent) of each fresh variable.
            let dims = match v.panel {
                // An 8-bit product's B in quads: `(p / 4) rs + j cs + p % 4`.
                None if quads => {
                    vec![(v.rs, rows / 4), (v.cs, cols), (1, 4)]
                }
                None => vec![(v.rs, rows), (v.cs, cols)],
                // Panels across the rows of A or the columns of B.
                Some((w, ps)) => {
                    let (along, across, inner, other) = if is_a {
                        (rows, cols, v.rs, v.cs)
                    } else {
                        (cols, rows, v.cs, v.rs)
                    };
                    vec![
                        (ps, along.div_ceil(w.max(1))),
                        (inner, w.min(along)),
                        (other, across),
                    ]
                }
            };
            for (coef, n) in dims {
                let var = fresh(n, &mut sc);
                let e = f.terms.entry(var).or_default();
                *e = e.checked_add(coef)?;
            }
            f.terms.retain(|_, c| *c != 0);
            Some(f)
        });
        out.push((v.buf, form.map(|f| (f, sc)), store));
    };
    view(&g.a, m, k, true, false, false);
    view(&g.b, k, n, false, g.int8, false);
    for v in g.init.iter().chain(&g.add) {
        view(v, m, n, false, false, false);
    }
    view(&g.c, m, n, false, false, true);
}

/// The affine form of an index, variables set in the body replaced by their current
/// forms (others, loop variables and values from outside, stay symbols); None when it
/// is not affine.
fn aff(e: &Expr, env: &Env) -> Option<Aff> {
    match e {
        Expr::Int(k) => Some(Aff {
            terms: BTreeMap::new(),
            k: *k,
        }),
        Expr::Var(v) => match env.get(v) {
            Some(f) => f.clone(),
            None => Some(Aff {
                terms: BTreeMap::from([(*v, 1)]),
                k: 0,
            }),
        },
        Expr::Bin(op, a, b) => {
            let (x, y) = (aff(a, env)?, aff(b, env)?);
            match op {
                BinOp::Add => x.add(y, 1),
                BinOp::Sub => x.add(y, -1),
                BinOp::Mul if x.terms.is_empty() => y.scale(x.k),
                BinOp::Mul if y.terms.is_empty() => x.scale(y.k),
                _ => None,
            }
        }
        _ => None,
    }
}

/// `sum(coef * var) + k`.
#[derive(Clone, Debug, PartialEq)]
struct Aff {
    terms: BTreeMap<VarId, i64>,
    k: i64,
}

impl Aff {
    fn scale(mut self, s: i64) -> Option<Aff> {
        for c in self.terms.values_mut() {
            *c = c.checked_mul(s)?;
        }
        self.k = self.k.checked_mul(s)?;
        Some(self)
    }
    fn add(mut self, o: Aff, sign: i64) -> Option<Aff> {
        for (v, c) in o.terms {
            let e = self.terms.entry(v).or_default();
            *e = e.checked_add(c.checked_mul(sign)?)?;
        }
        self.terms.retain(|_, c| *c != 0);
        self.k = self.k.checked_add(o.k.checked_mul(sign)?)?;
        Some(self)
    }
}

struct AffCtx {
    var: VarId,
}

/// Whether accesses with these index forms, in different iterations of the loop (`extent`
/// iterations), never reach the same element (see the module comment).
fn disjoint(forms: &[(Aff, Scope)], cx: &AffCtx, extent: u64) -> bool {
    let c = forms[0].0.terms.get(&cx.var).copied().unwrap_or(0);
    let inv = |(f, sc): &(Aff, Scope)| -> BTreeMap<VarId, i64> {
        f.terms
            .iter()
            .filter(|(v, _)| **v != cx.var && !sc.contains_key(v))
            .map(|(v, c)| (*v, *c))
            .collect()
    };
    let inv0 = inv(&forms[0]);
    if c <= 0
        || forms
            .iter()
            .any(|x| x.0.terms.get(&cx.var).copied().unwrap_or(0) != c || inv(x) != inv0)
    {
        return false;
    }
    let Some(span) = c.checked_mul(extent as i64) else {
        return false;
    };
    // Panel and plane strides show up as loop-variable coefficients or inside constants.
    let mut cands: Vec<Option<i64>> = vec![None, Some(span)];
    for (f, sc) in forms {
        if f.k.abs() > c {
            cands.push(Some(f.k.abs()));
        }
        for (v, a) in &f.terms {
            if sc.contains_key(v) && a.abs() > c {
                cands.push(Some(a.abs()));
            }
        }
    }
    cands.into_iter().any(|h| {
        forms.iter().all(|(f, sc)| {
            let mut lo = match h {
                Some(h) => f.k.rem_euclid(h),
                None => f.k,
            } as i128;
            let mut hi = lo;
            for (v, a) in &f.terms {
                let Some(&n) = sc.get(v).filter(|_| *v != cx.var) else {
                    continue;
                };
                if h.is_some_and(|h| a % h == 0) {
                    continue;
                }
                let r = (*a as i128) * (n.saturating_sub(1) as i128);
                if r < 0 {
                    lo += r;
                } else {
                    hi += r;
                }
            }
            // Iteration p's elements lie in [c p, c p + c) modulo H, all below H for
            // the last p the access runs in (under `if p < K`, K - 1): a plane of H
            // elements may hold less than `extent * c` (a Winograd conv's 55 output
            // rows in two parts of 28 tile rows, the last with one row less).
            let last = sc.get(&cx.var).map_or(extent, |&k| k.min(extent)) - 1;
            lo >= 0
                && hi < c as i128
                && h.is_none_or(|h| (c as i128) * (last as i128) + hi < h as i128)
        })
    })
}

/// The variables `body` assigns (Set targets and loop variables), each once, in order.
pub fn assigned(body: &[Stmt]) -> Vec<VarId> {
    fn walk(body: &[Stmt], out: &mut Vec<VarId>) {
        for s in body {
            if let Stmt::For { var, .. } | Stmt::Set { var, .. } = s {
                if !out.contains(var) {
                    out.push(*var);
                }
            }
            for c in children(s) {
                walk(c, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(body, &mut out);
    out
}

/// `body` with variable `from` renamed `to` everywhere: its uses, Set targets and loop
/// variables (for a second copy of a body that must not share its locals with the first).
pub fn rename(body: &[Stmt], from: VarId, to: VarId) -> Vec<Stmt> {
    fn targets(body: Vec<Stmt>, from: VarId, to: VarId) -> Vec<Stmt> {
        let r = |v: VarId| if v == from { to } else { v };
        body.into_iter()
            .map(|s| match s {
                Stmt::For { var, extent, body } => Stmt::For {
                    var: r(var),
                    extent,
                    body: targets(body, from, to),
                },
                Stmt::Set { var, value } => Stmt::Set { var: r(var), value },
                Stmt::If { cond, then, els } => Stmt::If {
                    cond,
                    then: targets(then, from, to),
                    els: targets(els, from, to),
                },
                Stmt::While { cond, body } => Stmt::While {
                    cond,
                    body: targets(body, from, to),
                },
                s @ (Stmt::Store { .. } | Stmt::Gemm(_)) => s,
            })
            .collect()
    }
    targets(subst(body, from, &Expr::Var(to)), from, to)
}

/// `body` with every use of `var` replaced by `with`.
pub fn subst(body: &[Stmt], var: VarId, with: &Expr) -> Vec<Stmt> {
    body.iter()
        .map(|s| match s {
            Stmt::For {
                var: v,
                extent,
                body,
            } => Stmt::For {
                var: *v,
                extent: *extent,
                body: subst(body, var, with),
            },
            Stmt::Store { buf, index, value } => Stmt::Store {
                buf: *buf,
                index: index.subst(var, with),
                value: value.subst(var, with),
            },
            Stmt::Set { var: v, value } => Stmt::Set {
                var: *v,
                value: value.subst(var, with),
            },
            Stmt::If { cond, then, els } => Stmt::If {
                cond: cond.subst(var, with),
                then: subst(then, var, with),
                els: subst(els, var, with),
            },
            Stmt::While { cond, body } => Stmt::While {
                cond: cond.subst(var, with),
                body: subst(body, var, with),
            },
            Stmt::Gemm(g) => {
                let mut g = g.clone();
                for v in g.views_mut() {
                    v.offset = v.offset.subst(var, with);
                }
                Stmt::Gemm(g)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{Ty, UnOp};

    fn v(x: VarId) -> Expr {
        Expr::Var(x)
    }
    fn int(x: i64) -> Expr {
        Expr::Int(x)
    }
    fn add(a: Expr, b: Expr) -> Expr {
        Expr::bin(BinOp::Add, a, b)
    }
    fn mul(a: Expr, b: Expr) -> Expr {
        Expr::bin(BinOp::Mul, a, b)
    }
    fn for_(var: VarId, extent: u64, body: Vec<Stmt>) -> Stmt {
        Stmt::For { var, extent, body }
    }
    fn store(buf: BufId, index: Expr, value: Expr) -> Stmt {
        Stmt::Store { buf, index, value }
    }

    /// A program with buffers x (input), y (output), t (arena at 0), u (arena at 0 too,
    /// an alias of t) and w (arena past them), each of 64 x 64 f32; and a kernel whose
    /// body `make` builds from two loop variables (i outer, j inner).
    fn parallel(make: impl Fn(VarId, VarId) -> Vec<Stmt>) -> HashSet<VarId> {
        let mut p = Program::default();
        let n = 64 * 64;
        p.add_buffer("x", BufKind::Input(0), Ty::F32, n);
        p.add_buffer("y", BufKind::Output(0), Ty::F32, n);
        p.add_buffer("t", BufKind::Arena { offset: 0 }, Ty::F32, n);
        p.add_buffer("u", BufKind::Arena { offset: 0 }, Ty::F32, n);
        p.add_buffer("w", BufKind::Arena { offset: 4 * n }, Ty::F32, n);
        let mut k = Kernel::new("k");
        let (i, j) = (k.var(Ty::I64), k.var(Ty::I64));
        k.body = make(i, j);
        parallel_loops(&k, &p, 64)
    }
    const X: BufId = 0;
    const Y: BufId = 1;
    const T: BufId = 2;
    const U: BufId = 3;

    fn row(i: VarId, j: VarId) -> Expr {
        add(mul(v(i), int(64)), v(j))
    }

    /// `for i in 0..4 { pack 16 x 16 of x into t[i * 256 ..]; y[block i] = W t_i }`:
    /// `own` packs per iteration (t at i * 256), else every iteration packs t at 0; with
    /// `columns_of` the GEMMs write column block `i * 16` of y (rows 64 apart), else all
    /// of y.
    fn gemm_loop(own: bool, columns_of: bool) -> HashSet<VarId> {
        parallel(|i, j| {
            let slot = if own { mul(v(i), int(256)) } else { int(0) };
            let pack = for_(
                j,
                256,
                vec![store(T, add(slot.clone(), v(j)), Expr::load(X, v(j)))],
            );
            let c_off = if columns_of {
                mul(v(i), int(16))
            } else {
                int(0)
            };
            let g = crate::kir::GemmCall {
                m: 16,
                n: 16,
                k: 16,
                a: MatView::strided(X, int(0), 16, 1),
                b: MatView::strided(T, slot, 16, 1),
                c: MatView::strided(Y, c_off, 64, 1),
                alpha: 1.0,
                init: None,
                add: None,
                act: crate::kir::GemmAct::None,
                int8: false,
            };
            vec![for_(i, 4, vec![pack, Stmt::Gemm(Box::new(g))])]
        })
    }

    #[test]
    fn gemms_on_blocks_packed_per_iteration_run_in_parallel() {
        // (Variable 0 is the outer loop's.)
        assert_eq!(gemm_loop(true, true), HashSet::from([0]));
        // The packed block shared by every iteration, or every GEMM writing all of y:
        // iterations would race (the packing loop alone may still run in parallel).
        assert!(!gemm_loop(false, true).contains(&0));
        assert!(!gemm_loop(true, false).contains(&0));
    }

    #[test]
    fn gemms_on_operands_packed_elsewhere_stay_split_on_their_own() {
        let got = parallel(|i, _| {
            let g = crate::kir::GemmCall {
                m: 16,
                n: 16,
                k: 16,
                a: MatView::strided(X, int(0), 16, 1),
                b: MatView::strided(X, mul(v(i), int(256)), 16, 1),
                c: MatView::strided(Y, mul(v(i), int(16)), 64, 1),
                alpha: 1.0,
                init: None,
                add: None,
                act: crate::kir::GemmAct::None,
                int8: false,
            };
            vec![for_(i, 4, vec![Stmt::Gemm(Box::new(g))])]
        });
        assert!(got.is_empty());
    }

    /// `for p in 0..2 { if p < 1 { rows of 5 } else { rows of `last` } }`, each part
    /// writing `y[9 ch + 5 p + j]` for 8 planes `ch` of 9 elements (the Winograd parts'
    /// shape: the last part shorter, so that both fit one plane).
    fn parts(last: u64) -> bool {
        let mut p = Program::default();
        p.add_buffer("x", BufKind::Input(0), Ty::F32, 72);
        p.add_buffer("y", BufKind::Output(0), Ty::F32, 72);
        let mut k = Kernel::new("k");
        let pv = k.var(Ty::I64);
        let mut part = |len: u64| {
            let (ch, j) = (k.var(Ty::I64), k.var(Ty::I64));
            let at = add(add(mul(v(ch), int(9)), mul(v(pv), int(5))), v(j));
            vec![for_(
                ch,
                8,
                vec![for_(j, len, vec![store(Y, at.clone(), Expr::load(X, at))])],
            )]
        };
        let (first, rest) = (part(5), part(last));
        k.body = vec![for_(
            pv,
            2,
            vec![Stmt::If {
                cond: Expr::cmp(CmpOp::Lt, v(pv), int(1)),
                then: first,
                els: rest,
            }],
        )];
        parallel_loops(&k, &p, 64).contains(&pv)
    }

    #[test]
    fn parts_of_a_plane_run_in_parallel_when_the_last_fits() {
        // Part 0 writes elements 0..5 of each plane, part 1 5..9: disjoint, though two
        // parts of 5 would not fit a plane of 9 (so without the `p < 1` bound on part
        // 0's accesses, they would look as if they could reach the next plane).
        assert!(parts(4));
        // Part 1 writing 5..10 would reach element 0 of the next plane, part 0's.
        assert!(!parts(5));
    }

    #[test]
    fn elementwise_rows_run_in_parallel() {
        let got = parallel(|i, j| {
            vec![for_(
                i,
                64,
                vec![for_(
                    j,
                    64,
                    vec![store(
                        Y,
                        row(i, j),
                        Expr::un(UnOp::Neg, Expr::load(X, row(i, j))),
                    )],
                )],
            )]
        });
        assert_eq!(got, HashSet::from([0]));
    }

    #[test]
    fn in_place_and_aliased_buffers_at_the_same_index_are_safe() {
        // t[i, j] = u[i, j] + 1 with u and t the same arena bytes.
        let got = parallel(|i, j| {
            let body = vec![store(
                T,
                row(i, j),
                add(Expr::load(U, row(i, j)), Expr::Float(1.0, Ty::F32)),
            )];
            vec![for_(i, 64, vec![for_(j, 64, body)])]
        });
        assert_eq!(got, HashSet::from([0]));
    }

    #[test]
    fn reading_a_neighbour_row_of_an_aliased_buffer_is_not() {
        // t[i, j] = u[i + 1, j] (u is t): iteration i reads what i + 1 writes.
        let got = parallel(|i, j| {
            let body = vec![store(T, row(i, j), Expr::load(U, add(row(i, j), int(64))))];
            vec![for_(i, 63, vec![for_(j, 64, body)])]
        });
        assert!(!got.contains(&0), "{got:?}");
    }

    #[test]
    fn the_inner_loop_runs_when_the_outer_one_would_race() {
        // y[j] accumulates over i: i carries a dependence, j does not.
        let got = parallel(|i, j| {
            let s = vec![store(
                Y,
                v(j),
                add(Expr::load(Y, v(j)), Expr::load(X, row(i, j))),
            )];
            vec![for_(i, 64, vec![for_(j, 64, s)])]
        });
        assert!(!got.contains(&0), "{got:?}");
        // Inside, j alone is too little work for the threshold of 64 with one statement
        // per iteration: exactly 64 reaches it.
        assert!(got.contains(&1), "{got:?}");
    }

    #[test]
    fn panel_layouts_are_disjoint_and_overlaps_are_not() {
        // Packing into panels of 32: element (i, j) goes to (j / 32) * 2048 + i * 32 +
        // j % 32, written as two stores per i (two panels, constants carry the panel).
        let packed = |i: VarId, j: VarId, step: i64| {
            vec![for_(
                i,
                64,
                vec![for_(
                    j,
                    32,
                    vec![
                        store(Y, add(mul(v(i), int(step)), v(j)), Expr::load(X, row(i, j))),
                        store(
                            Y,
                            add(add(mul(v(i), int(step)), int(2048)), v(j)),
                            Expr::load(X, add(row(i, j), int(32))),
                        ),
                    ],
                )],
            )]
        };
        assert_eq!(parallel(|i, j| packed(i, j, 32)), HashSet::from([0]));
        // A row step of 16 overlaps the next row's first half.
        assert!(!parallel(|i, j| packed(i, j, 16)).contains(&0));
    }

    #[test]
    fn a_value_carried_between_iterations_keeps_the_loop_serial() {
        // acc is set in iteration i and read in i + 1 before being set again.
        let mut p = Program::default();
        p.add_buffer("y", BufKind::Output(0), Ty::F32, 4096);
        let mut k = Kernel::new("k");
        let (i, j, acc) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::F32));
        k.body = vec![for_(
            i,
            64,
            vec![for_(
                j,
                64,
                vec![
                    store(0, row(i, j), v(acc)),
                    Stmt::Set {
                        var: acc,
                        value: Expr::Float(2.0, Ty::F32),
                    },
                ],
            )],
        )];
        assert!(parallel_loops(&k, &p, 64).is_empty());
        // Set first, then used: private to the iteration.
        if let Stmt::For { body, .. } = &mut k.body[0] {
            if let Stmt::For { body, .. } = &mut body[0] {
                body.swap(0, 1);
            }
        }
        assert_eq!(parallel_loops(&k, &p, 64), HashSet::from([i]));
    }

    #[test]
    fn small_loops_stay_serial_and_substitution_replaces_uses() {
        let got = parallel(|i, j| {
            vec![for_(
                i,
                2,
                vec![for_(
                    j,
                    4,
                    vec![store(Y, row(i, j), Expr::load(X, row(i, j)))],
                )],
            )]
        });
        assert!(got.is_empty());
        let body = vec![store(Y, row(0, 1), Expr::load(X, v(0)))];
        let s = subst(&body, 0, &int(5));
        assert_eq!(s, vec![store(Y, row_with(5, 1), Expr::load(X, int(5)))]);
        assert_eq!(captured(0, &body), vec![1]);
    }

    #[test]
    fn variables_set_twice_and_loop_variables_reused_are_tracked_per_access() {
        // t = 64 i; y[t + j] for j < 32; t = 64 i + 32; y[t + j] for j < 31, then
        // y[t + 31 + j] for j < 1 (j heads loops of 32, 31 and 1 iterations).
        let mut p = Program::default();
        p.add_buffer("y", BufKind::Output(0), Ty::F32, 4096);
        let mut k = Kernel::new("k");
        let (i, j, t) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let st = |off: i64| store(0, add(add(v(t), int(off)), v(j)), Expr::Float(1.0, Ty::F32));
        let set = |c: i64| Stmt::Set {
            var: t,
            value: add(mul(v(i), int(64)), int(c)),
        };
        k.body = vec![for_(
            i,
            64,
            vec![
                set(0),
                for_(j, 32, vec![st(0)]),
                set(32),
                for_(j, 31, vec![st(0)]),
                for_(j, 1, vec![st(31)]),
            ],
        )];
        assert_eq!(parallel_loops(&k, &p, 64), HashSet::from([i]));
        // One element further and the last store reaches the next row.
        if let Stmt::For { body, .. } = &mut k.body[0] {
            body[4] = for_(j, 1, vec![st(32)]);
        }
        assert!(parallel_loops(&k, &p, 64).is_empty());
    }

    #[test]
    fn loops_around_a_while_stay_serial() {
        // y[i, j] = x[i, j] after a string-style walk of unknown length.
        let got = parallel(|i, j| {
            let walk = Stmt::While {
                cond: Expr::cmp(
                    crate::kir::CmpOp::Lt,
                    v(j),
                    Expr::cast(Ty::I64, Expr::load(X, row(i, 0))),
                ),
                body: vec![Stmt::Set {
                    var: j,
                    value: add(v(j), int(1)),
                }],
            };
            vec![for_(
                i,
                64,
                vec![
                    Stmt::Set {
                        var: j,
                        value: int(0),
                    },
                    walk,
                    store(Y, row(i, 0), Expr::load(X, row(i, 0))),
                ],
            )]
        });
        assert!(got.is_empty(), "{got:?}");
    }

    fn row_with(i: i64, j: VarId) -> Expr {
        add(mul(int(i), int(64)), v(j))
    }
}
