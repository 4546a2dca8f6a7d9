//! Loop collapsing on kernel IR: an elementwise kernel keeps its tensor's loop nest
//! (`for c { for h { for w { y[...] = f(x[...]) } } }`), so a `[1, 64, 56, 56]` tensor
//! ran rows of 56 (three vectors and a half-empty masked one each). Where every access
//! is contiguous across two nested loops (the outer variable's coefficient is the inner
//! extent times the inner's, in every index), the pair becomes one loop over their
//! product, inside out: such a kernel ends as one loop over the whole tensor. Only whole
//! kernels that are one perfect nest of loops around straight-line statements (stores,
//! and sets of locals set before they are read), so that reductions and the nests the
//! back ends match by shape (convolutions, pools, transforms) stay as they are.

use crate::kir::{BinOp, Expr, Stmt, VarId};

/// The coefficient of `var` in `e` when `e` is linear in it (a sum of terms, products of
/// a constant and a linear term, or terms without `var`); `None` otherwise.
fn coef(e: &Expr, var: VarId) -> Option<i64> {
    if !mentions(e, var) {
        return Some(0);
    }
    match e {
        Expr::Var(v) if *v == var => Some(1),
        Expr::Bin(BinOp::Add, a, b) => coef(a, var)?.checked_add(coef(b, var)?),
        Expr::Bin(BinOp::Mul, a, b) => match (&**a, &**b) {
            (Expr::Int(k), x) | (x, Expr::Int(k)) => coef(x, var)?.checked_mul(*k),
            _ => None,
        },
        _ => None,
    }
}

fn mentions(e: &Expr, var: VarId) -> bool {
    let mut seen = false;
    crate::kir::parallel::expr_vars(e, &mut |v| seen |= v == var);
    seen
}

/// Whether `var` appears in `e` only inside load indices, each linear in it, pushing
/// those indices' coefficient pairs `(of a, of b)` for the caller's test.
fn value_ok(e: &Expr, vars: [VarId; 2], out: &mut Vec<(i64, i64)>) -> bool {
    match e {
        Expr::Var(v) => !vars.contains(v),
        Expr::Int(_) | Expr::Float(..) => true,
        Expr::Load(_, i) => index_ok(i, vars, out),
        Expr::Un(_, a) | Expr::Cast(_, a) => value_ok(a, vars, out),
        Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => value_ok(a, vars, out) && value_ok(b, vars, out),
        Expr::Select(c, a, b) => {
            value_ok(c, vars, out) && value_ok(a, vars, out) && value_ok(b, vars, out)
        }
        Expr::Call(_, args) => args.iter().all(|a| value_ok(a, vars, out)),
        Expr::StrByte(..) => false,
    }
}

/// Whether index `i` is linear in both variables and loads nothing (gathers stay),
/// pushing its coefficients.
fn index_ok(i: &Expr, [a, b]: [VarId; 2], out: &mut Vec<(i64, i64)>) -> bool {
    match (coef(i, a), coef(i, b)) {
        (Some(ca), Some(cb)) if no_loads(i) => {
            out.push((ca, cb));
            true
        }
        _ => false,
    }
}

/// Whether `e` holds no load.
fn no_loads(e: &Expr) -> bool {
    match e {
        Expr::Load(..) | Expr::StrByte(..) => false,
        Expr::Var(_) | Expr::Int(_) | Expr::Float(..) => true,
        Expr::Un(_, a) | Expr::Cast(_, a) => no_loads(a),
        Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => no_loads(a) && no_loads(b),
        Expr::Select(c, a, b) => no_loads(c) && no_loads(a) && no_loads(b),
        Expr::Call(_, args) => args.iter().all(no_loads),
    }
}

/// Whether `leaf` is straight-line code whose every access is contiguous across `a`
/// (outer) and `b` (inner, extent `nb`), and whose sets are of locals set before read.
fn mergeable(leaf: &[Stmt], a: VarId, b: VarId, nb: u64) -> bool {
    let mut coefs = Vec::new();
    let mut set: Vec<VarId> = Vec::new();
    let mut read_before_set = false;
    let mut note_reads = |e: &Expr, set: &[VarId]| {
        crate::kir::parallel::expr_vars(e, &mut |v| {
            if !set.contains(&v)
                && leaf
                    .iter()
                    .any(|s| matches!(s, Stmt::Set { var, .. } if *var == v))
            {
                read_before_set = true;
            }
        });
    };
    for s in leaf {
        let ok = match s {
            Stmt::Store { index, value, .. } => {
                note_reads(index, &set);
                note_reads(value, &set);
                index_ok(index, [a, b], &mut coefs) && value_ok(value, [a, b], &mut coefs)
            }
            Stmt::Set { var, value } => {
                note_reads(value, &set);
                set.push(*var);
                *var != a && *var != b && value_ok(value, [a, b], &mut coefs)
            }
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    let Ok(nb) = i64::try_from(nb) else {
        return false;
    };
    !read_before_set
        && !coefs.is_empty()
        && coefs.iter().all(|&(ca, cb)| cb.checked_mul(nb) == Some(ca))
}

/// `body` with the contiguous loop pairs of a perfect nest merged, inside out; other
/// bodies unchanged.
pub fn collapse(body: &[Stmt]) -> Vec<Stmt> {
    let [Stmt::For {
        var,
        extent,
        body: inner,
    }] = body
    else {
        return body.to_vec();
    };
    let inner = collapse(inner);
    if let [Stmt::For {
        var: b,
        extent: nb,
        body: leaf,
    }] = inner.as_slice()
    {
        let total = extent.checked_mul(*nb);
        if let Some(total) = total.filter(|_| mergeable(leaf, *var, *b, *nb)) {
            // a b-th step of the merged variable is a step of b; a's terms are its
            // multiples (a = 0).
            let leaf = crate::kir::parallel::subst(leaf, *var, &Expr::Int(0));
            return vec![Stmt::For {
                var: *b,
                extent: total,
                body: leaf,
            }];
        }
    }
    vec![Stmt::For {
        var: *var,
        extent: *extent,
        body: inner,
    }]
}

#[cfg(test)]
mod tests {
    use super::collapse;
    use crate::kir::build::{add, for_, int, mul, set, store, v};
    use crate::kir::{Expr, Stmt};

    fn at(terms: &[(usize, usize)]) -> Expr {
        terms
            .iter()
            .map(|&(var, k)| mul(v(var), int(k)))
            .reduce(add)
            .expect("terms")
    }

    /// The extents of the perfect nest `body` starts with.
    fn extents(body: &[Stmt]) -> Vec<u64> {
        match body {
            [Stmt::For { extent, body, .. }] => {
                let mut e = vec![*extent];
                e.extend(extents(body));
                e
            }
            _ => vec![],
        }
    }

    /// `y[12 a + 4 b + c] = x[12 a + 4 b + c] + 1` over 2 x 3 x 4 becomes one loop of 24
    /// reading and writing element `c`; a loop of one outside stays.
    #[test]
    fn contiguous_nests_merge_inside_out() {
        let (o, a, b, c, t) = (0, 1, 2, 3, 4);
        let idx = at(&[(a, 12), (b, 4), (c, 1)]);
        let leaf = vec![
            set(t, Expr::load(5, idx.clone())),
            store(6, idx, add(v(t), Expr::f(1.0, crate::kir::Ty::F32))),
        ];
        let nest = vec![for_(
            o,
            1,
            vec![for_(a, 2, vec![for_(b, 3, vec![for_(c, 4, leaf)])])],
        )];
        let out = collapse(&nest);
        assert_eq!(extents(&out), vec![1, 24], "{out:?}");
        // The merged loop's variable is the innermost one's, the others 0.
        let Stmt::For { body, .. } = &out[0] else {
            unreachable!()
        };
        let Stmt::For { var, body, .. } = &body[0] else {
            unreachable!()
        };
        assert_eq!(*var, c);
        let zero = crate::kir::parallel::subst(
            &crate::kir::parallel::subst(
                &[store(6, at(&[(a, 12), (b, 4), (c, 1)]), int(0))],
                a,
                &int(0),
            ),
            b,
            &int(0),
        );
        let Stmt::Store { index, .. } = &body[1] else {
            panic!("{body:?}")
        };
        let Stmt::Store { index: want, .. } = &zero[0] else {
            unreachable!()
        };
        assert_eq!(index, want);
    }

    /// A transpose (`y[2 b + a] = x[3 a + b]`), a broadcast (`g[a]` beside `x[4 a +
    /// b]`), a reduction into a variable set outside the nest, and a gather keep their
    /// loops.
    #[test]
    fn other_nests_stay() {
        let (a, b, s) = (1, 2, 3);
        let two = |leaf: Vec<Stmt>, nb| vec![for_(a, 3, vec![for_(b, nb, leaf)])];
        let transpose = two(
            vec![store(
                6,
                at(&[(b, 3), (a, 1)]),
                Expr::load(5, at(&[(a, 2), (b, 1)])),
            )],
            2,
        );
        let broadcast = two(
            vec![store(
                6,
                at(&[(a, 4), (b, 1)]),
                mul(Expr::load(5, at(&[(a, 4), (b, 1)])), Expr::load(7, v(a))),
            )],
            4,
        );
        let reduction = two(
            vec![set(s, add(v(s), Expr::load(5, at(&[(a, 4), (b, 1)]))))],
            4,
        );
        let gather = two(
            vec![store(
                6,
                at(&[(a, 4), (b, 1)]),
                Expr::load(5, Expr::load(8, at(&[(a, 4), (b, 1)]))),
            )],
            4,
        );
        // (The gather's store alone would merge: the load in its value's index keeps it.)
        for nest in [transpose, broadcast, reduction, gather] {
            assert_eq!(collapse(&nest), nest);
        }
    }
}
