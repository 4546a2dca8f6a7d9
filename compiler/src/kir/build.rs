//! Shorthands for building kernel IR in lowerings (`use crate::kir::build::*`).
use super::{BinOp, BufId, CmpOp, Expr, MathFn, Stmt, Ty, VarId};

pub fn add(a: Expr, b: Expr) -> Expr {
    Expr::add(a, b)
}

/// The largest divisor of `n` that is at most `cap` (1 when `cap` is 0): how many
/// equal slots, runs or unrolled copies a loop of `n` iterations is cut into.
pub fn divisor_at_most(n: usize, cap: usize) -> usize {
    (1..=cap.min(n))
        .rev()
        .find(|d| n.is_multiple_of(*d))
        .unwrap_or(1)
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
