//! Shorthands for building kernel IR in lowerings (`use crate::kir::build::*`).
use super::{BinOp, BufId, CmpOp, Expr, MathFn, Stmt, Ty, VarId};

pub fn add(a: Expr, b: Expr) -> Expr {
    Expr::add(a, b)
}

/// The largest divisor of `n` that is at most `cap` (1 when `cap` is 0): how many
/// equal runs or unrolled copies a loop of `n` iterations is cut into.
pub fn divisor_at_most(n: usize, cap: usize) -> usize {
    (1..=cap.min(n))
        .rev()
        .find(|d| n.is_multiple_of(*d))
        .unwrap_or(1)
}

/// Blocks per part when `n` equal blocks share out into parts of consecutive blocks (the
/// last part may have fewer), at most `most` parts (scratch slots): the count that ends
/// soonest on two threads taking parts in turn (as `onnxc_pool.h` does), then the
/// smallest. Cutting into equal groups of a divisor of `n` slots left 9 blocks as 3 jobs
/// of 3 parts (one thread doing two of each, the other one), 42 blocks as jobs of 7.
pub fn per_part(n: usize, most: usize) -> usize {
    let two = |per: usize| two_threads_end((0..n).step_by(per).map(|s| per.min(n - s)));
    (n.div_ceil(most.max(1)).max(1)..=n.max(1))
        .min_by_key(|&per| (two(per), per))
        .unwrap_or(1)
}

/// When two threads end that take parts of these costs in order, each next part going to
/// the thread that is free first (as `onnxc_pool.h`'s threads do once their own shares
/// are done, roughly).
pub fn two_threads_end(costs: impl IntoIterator<Item = usize>) -> usize {
    let mut t = [0usize; 2];
    for c in costs {
        t[usize::from(t[1] < t[0])] += c;
    }
    t[0].max(t[1])
}

/// The sum of `terms` as a balanced tree of additions (`((t0 + t1) + (t2 + t3))`): a
/// chain of n additions waits on n latencies, the tree on about log2 n. `None` when
/// there are no terms.
pub fn sum_tree(mut terms: Vec<Expr>) -> Option<Expr> {
    while terms.len() > 1 {
        let mut next = Vec::with_capacity(terms.len().div_ceil(2));
        let mut it = terms.into_iter();
        while let Some(a) = it.next() {
            next.push(match it.next() {
                Some(b) => add(a, b),
                None => a,
            });
        }
        terms = next;
    }
    terms.pop()
}

pub fn and(a: Expr, b: Expr) -> Expr {
    Expr::bin(BinOp::And, a, b)
}

pub fn bin(op: BinOp, a: Expr, b: Expr) -> Expr {
    Expr::bin(op, a, b)
}

pub fn call(f: MathFn, a: Expr) -> Expr {
    Expr::call(f, vec![a])
}

pub fn cmp(op: CmpOp, a: Expr, b: Expr) -> Expr {
    Expr::cmp(op, a, b)
}

pub fn div(a: Expr, b: Expr) -> Expr {
    Expr::bin(BinOp::Div, a, b)
}

pub fn f(x: f64) -> Expr {
    Expr::f(x, Ty::F64)
}

pub fn f64c(x: f64) -> Expr {
    Expr::f(x, Ty::F64)
}

pub fn for_(var: VarId, n: usize, body: Vec<Stmt>) -> Stmt {
    Stmt::For {
        var,
        extent: n as u64,
        body,
    }
}

pub fn iff(cond: Expr, then: Vec<Stmt>) -> Stmt {
    Stmt::If {
        cond,
        then,
        els: vec![],
    }
}

pub fn int(x: usize) -> Expr {
    Expr::Int(x as i64)
}

/// Linear index `sum(e * stride)` (constant terms folded: `(int(1), 116)` is `116`).
pub fn lin(terms: Vec<(Expr, usize)>) -> Expr {
    let mut acc: Option<Expr> = None;
    for (e, s) in terms {
        if s == 0 || e == Expr::Int(0) {
            continue;
        }
        let t = match e {
            Expr::Int(a) => Expr::Int(a * s as i64),
            e if s == 1 => e,
            e => mul(e, int(s)),
        };
        acc = Some(match acc {
            None => t,
            Some(a) => add(a, t),
        });
    }
    acc.unwrap_or(Expr::Int(0))
}

pub fn loops(dims: &[(VarId, usize)], mut body: Vec<Stmt>) -> Vec<Stmt> {
    for &(var, n) in dims.iter().rev() {
        body = vec![Stmt::For {
            var,
            extent: n as u64,
            body,
        }];
    }
    body
}

pub fn mul(a: Expr, b: Expr) -> Expr {
    Expr::mul(a, b)
}

pub fn sel(c: Expr, a: Expr, b: Expr) -> Expr {
    Expr::select(c, a, b)
}

/// `flag = 1.0` (f32) where `cond` holds, as the reduction `flag = s > flag ? s : flag`
/// of `s = cond ? 1 : 0`: the vectorisers' select reduction, one `vmaxps` on the
/// accumulator's chain. (As `max(flag, s)` it was kernel IR's NaN-propagating max: five
/// instructions and a chain of about ten cycles per vector, which bounded a ReduceMax
/// row at 16 elements per ten cycles.)
pub fn raise_flag(flag: VarId, cond: Expr) -> Stmt {
    let s = Expr::select(cond, Expr::f(1.0, Ty::F32), Expr::f(0.0, Ty::F32));
    set(
        flag,
        Expr::select(cmp(CmpOp::Gt, s.clone(), v(flag)), s, v(flag)),
    )
}

pub fn set(var: VarId, value: Expr) -> Stmt {
    Stmt::Set { var, value }
}

pub fn store(buf: BufId, index: Expr, value: Expr) -> Stmt {
    Stmt::Store { buf, index, value }
}

pub fn sub(a: Expr, b: Expr) -> Expr {
    Expr::bin(BinOp::Sub, a, b)
}

pub fn to64(e: Expr, t: Ty) -> Expr {
    if t == Ty::F64 {
        e
    } else {
        Expr::cast(Ty::F64, e)
    }
}

pub fn v(x: VarId) -> Expr {
    Expr::Var(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_end_soonest_on_two_threads() {
        // 9 blocks, 8 slots: parts of 2 (5 parts, 5 : 4 blocks), not 3 parts of 3.
        assert_eq!(per_part(9, 8), 2);
        // 42 blocks, 8 slots: 6 parts of 7 (21 : 21), not 7 parts of 6 (24 : 18).
        assert_eq!(per_part(42, 8), 7);
        // Even counts within the slots: one block a part.
        assert_eq!(per_part(6, 8), 1);
        assert_eq!(per_part(16, 8), 2);
        // One block, or no slots to spare.
        assert_eq!(per_part(1, 8), 1);
        assert_eq!(per_part(5, 1), 5);
    }
}
