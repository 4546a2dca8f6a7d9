//! Copy elimination on kernel IR: a kernel that only copies a whole arena buffer into a
//! slice of another (`dst[c + j] = src[j]` for every element of `src`: Concat's inputs,
//! the copy of a value into a model output) goes away, and every access to `src` becomes
//! an access to `dst` at offset `c`, so the producer of `src` writes straight into its
//! place in `dst` (SqueezeNet's eight concatenations: 0.15 ms of copies).
//!
//! Safe because values never change once computed: `src` is written only before the
//! copy, and the slice of `dst` only by the copy (every kernel writing `dst` is such a
//! copy, each into its own slice), so the slice holds `src` from the moment `src` is
//! made. The memory plan then sees `dst` live from `src`'s first write. Offsets keep
//! 64-byte alignment (buffers start so aligned), element types must match, and strings
//! are left alone.

use super::writes;
use crate::kir::{BufId, BufKind, Expr, Kernel, Program, Stmt, Ty, VarId};

/// Alignment (bytes) an aliased buffer's offset into its destination keeps.
const ALIGN: u64 = 64;

/// `(constant, coefficient of var)` of an affine integer index, when it is one.
pub(super) fn affine(e: &Expr, var: VarId) -> Option<(i64, i64)> {
    match e {
        Expr::Int(c) => Some((*c, 0)),
        Expr::Var(v) if *v == var => Some((0, 1)),
        Expr::Bin(crate::kir::BinOp::Add, a, b) => {
            let (a, b) = (affine(a, var)?, affine(b, var)?);
            Some((a.0.checked_add(b.0)?, a.1.checked_add(b.1)?))
        }
        Expr::Bin(crate::kir::BinOp::Mul, a, b) => match (affine(a, var)?, affine(b, var)?) {
            ((c, 0), (d, k)) | ((d, k), (c, 0)) => Some((c.checked_mul(d)?, c.checked_mul(k)?)),
            _ => None,
        },
        _ => None,
    }
}

/// `(src, dst, offset)` when the kernel is exactly `for j in 0..len(src) { dst[c + j] =
/// src[j] }`.
fn as_copy(k: &Kernel, p: &Program) -> Option<(BufId, BufId, i64)> {
    let [Stmt::For { var, extent, body }] = k.body.as_slice() else {
        return None;
    };
    let [Stmt::Store {
        buf: dst,
        index,
        value: Expr::Load(src, sidx),
    }] = body.as_slice()
    else {
        return None;
    };
    let (c, 1) = affine(index, *var)? else {
        return None;
    };
    if affine(sidx, *var)? != (0, 1) || *extent != p.buffers[*src].len || src == dst {
        return None;
    }
    Some((*src, *dst, c))
}

/// `e` with every access to `from` made an access to `to` at `off` elements on.
fn expr(e: &mut Expr, from: BufId, to: BufId, off: i64) {
    for c in e.children_mut() {
        expr(c, from, to, off);
    }
    if let Expr::Load(b, i) = e {
        if *b == from {
            *b = to;
            **i = Expr::add(Expr::Int(off), (**i).clone());
        }
    }
}

fn stmts(body: &mut [Stmt], from: BufId, to: BufId, off: i64) {
    for s in body {
        match s {
            Stmt::For { body, .. } => stmts(body, from, to, off),
            Stmt::While { cond, body } => {
                expr(cond, from, to, off);
                stmts(body, from, to, off);
            }
            Stmt::Store { buf, index, value } => {
                expr(index, from, to, off);
                expr(value, from, to, off);
                if *buf == from {
                    *buf = to;
                    *index = Expr::add(Expr::Int(off), index.clone());
                }
            }
            Stmt::Set { value, .. } => expr(value, from, to, off),
            Stmt::If { cond, then, els } => {
                expr(cond, from, to, off);
                stmts(then, from, to, off);
                stmts(els, from, to, off);
            }
            Stmt::Gemm(g) => {
                for v in g.views_mut() {
                    expr(&mut v.offset, from, to, off);
                    if v.buf == from {
                        v.buf = to;
                        v.offset = Expr::add(Expr::Int(off), v.offset.clone());
                    }
                }
            }
        }
    }
}

/// Removes the copies that can go (see the module doc), in place; returns the indices
/// (in the program as it was) of the kernels removed.
pub fn copies(p: &mut Program) -> Vec<usize> {
    // Destinations that only copies write (decided on the program as it comes: once a
    // copy goes, its source's producer writes the destination too). Only the copies'
    // destinations are candidates, so only theirs are looked up.
    let mut clean = std::collections::HashMap::new();
    for k in &p.kernels {
        if let Some((_, dst, _)) = as_copy(k, p) {
            clean.entry(dst).or_insert_with(|| {
                p.kernels
                    .iter()
                    .filter(|k| writes(&k.body, dst))
                    .all(|k| as_copy(k, p).is_some_and(|(_, d, _)| d == dst))
            });
        }
    }
    let mut removed = Vec::new();
    let mut i = 0;
    let mut orig = 0;
    while i < p.kernels.len() {
        let ok = as_copy(&p.kernels[i], p).filter(|&(src, dst, c)| {
            let (s, d) = (&p.buffers[src], &p.buffers[dst]);
            let bytes = (c as u64).wrapping_mul(s.elem.bytes());
            matches!(s.kind, BufKind::Arena { .. })
                && matches!(d.kind, BufKind::Arena { .. } | BufKind::Output(_))
                && s.elem == d.elem
                && s.elem != Ty::Str
                && c >= 0
                && bytes.is_multiple_of(ALIGN)
                && p.kernels[i..].iter().all(|k| !writes(&k.body, src))
                && clean.get(&dst) == Some(&true)
        });
        match ok {
            Some((src, dst, c)) => {
                p.kernels.remove(i);
                for k in &mut p.kernels {
                    stmts(&mut k.body, src, dst, c);
                }
                removed.push(orig);
            }
            None => i += 1,
        }
        orig += 1;
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::build::{for_, store};

    /// `buf[j] = x[j] + 1` over `len`: a producer.
    fn produce(p: &mut Program, x: BufId, buf: BufId, len: u64) {
        let mut k = Kernel::new("produce");
        let j = k.var(Ty::I64);
        let one = Expr::f(1.0, Ty::F32);
        let val = Expr::add(Expr::load(x, Expr::Var(j)), one);
        k.body = vec![for_(j, len as usize, vec![store(buf, Expr::Var(j), val)])];
        p.kernels.push(k);
    }

    /// `dst[c + j] = src[j]` over all of src.
    fn copy(p: &mut Program, src: BufId, dst: BufId, c: i64) {
        let mut k = Kernel::new("copy");
        let j = k.var(Ty::I64);
        let len = p.buffers[src].len as usize;
        let at = Expr::add(Expr::Int(c), Expr::Var(j));
        k.body = vec![for_(
            j,
            len,
            vec![store(dst, at, Expr::load(src, Expr::Var(j)))],
        )];
        p.kernels.push(k);
    }

    /// Two producers, the concatenation of their outputs, a copy of it to the output.
    fn concat(len: u64) -> (Program, [BufId; 4]) {
        let mut p = Program::default();
        let x = p.add_buffer("x", BufKind::Input(0), Ty::F32, len);
        let a = p.add_buffer("a", BufKind::Arena { offset: 0 }, Ty::F32, len);
        let b = p.add_buffer("b", BufKind::Arena { offset: 0 }, Ty::F32, len);
        let cat = p.add_buffer("cat", BufKind::Arena { offset: 0 }, Ty::F32, 2 * len);
        let y = p.add_buffer("y", BufKind::Output(0), Ty::F32, 2 * len);
        produce(&mut p, x, a, len);
        produce(&mut p, x, b, len);
        copy(&mut p, a, cat, 0);
        copy(&mut p, b, cat, len as i64);
        copy(&mut p, cat, y, 0);
        (p, [a, b, cat, y])
    }

    #[test]
    fn concatenated_values_are_written_in_place() {
        let (mut p, [a, b, _, y]) = concat(32);
        assert_eq!(copies(&mut p), vec![2, 3, 4]);
        assert_eq!(p.kernels.len(), 2);
        // Both producers write the output, the second 32 elements on.
        let mut t = Vec::new();
        for k in &p.kernels {
            assert!(writes(&k.body, y) && !writes(&k.body, a) && !writes(&k.body, b));
            t.push(k.body.clone());
        }
        let Stmt::For { body, .. } = &t[1][0] else {
            panic!("a loop")
        };
        let Stmt::Store { index, .. } = &body[0] else {
            panic!("a store")
        };
        assert_eq!(affine(index, 0), Some((32, 1)));
    }

    #[test]
    fn copies_that_cannot_go_stay() {
        // An offset off the 64-byte alignment (9 floats).
        let (mut p, _) = concat(9);
        assert_eq!(copies(&mut p), vec![2, 4]);
        // A source written again after the copy.
        let (mut p, [a, ..]) = concat(32);
        let x = 0;
        produce(&mut p, x, a, 32);
        assert_eq!(copies(&mut p), vec![3, 4]);
        // A destination some other kernel writes (and so a source written after its
        // copy to the output).
        let (mut p, [_, _, cat, _]) = concat(32);
        produce(&mut p, 0, cat, 32);
        assert!(copies(&mut p).is_empty());
    }
}
