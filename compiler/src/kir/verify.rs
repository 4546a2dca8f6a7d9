//! Type checking of kernel IR: every error names the kernel and the offending piece.

use super::{BinOp, Expr, Kernel, Program, Stmt, Ty};

/// The type an expression yields in `k` (errors describe the mismatch).
pub fn type_of(e: &Expr, k: &Kernel, p: &Program) -> Result<Ty, String> {
    Ok(match e {
        Expr::Var(v) => *k
            .vars
            .get(*v)
            .ok_or_else(|| format!("variable v{v} is not declared"))?,
        Expr::Int(_) => Ty::I64,
        Expr::Float(_, t) => {
            if !matches!(t, Ty::F32 | Ty::F64) {
                return Err(format!("float literal of type {t}"));
            }
            *t
        }
        Expr::Load(b, idx) => {
            let buf = p
                .buffers
                .get(*b)
                .ok_or_else(|| format!("buffer b{b} does not exist"))?;
            if type_of(idx, k, p)? != Ty::I64 {
                return Err(format!("index into b{b} is not i64"));
            }
            buf.elem.compute()
        }
        Expr::Un(op, a) => {
            let t = type_of(a, k, p)?;
            use super::UnOp::*;
            match op {
                Sqrt | Floor | Ceil | Nearest | Trunc if !t.is_float() => {
                    return Err(format!("{op:?} of integer type {t}"))
                }
                Not if t.is_float() => return Err("bitwise not of a float".into()),
                _ => t,
            }
        }
        Expr::Bin(op, a, b) => {
            let (ta, tb) = (type_of(a, k, p)?, type_of(b, k, p)?);
            if ta != tb {
                return Err(format!("{op:?} of {ta} and {tb}"));
            }
            if ta.is_float()
                && matches!(
                    op,
                    BinOp::And | BinOp::Or | BinOp::Xor | BinOp::Shl | BinOp::Shr | BinOp::Rem
                )
            {
                return Err(format!("{op:?} of floats"));
            }
            ta
        }
        Expr::Cmp(op, a, b) => {
            let (ta, tb) = (type_of(a, k, p)?, type_of(b, k, p)?);
            if ta != tb {
                return Err(format!("{op:?} of {ta} and {tb}"));
            }
            Ty::U8
        }
        Expr::Select(c, a, b) => {
            let tc = type_of(c, k, p)?;
            if tc.is_float() {
                return Err("select condition is a float".into());
            }
            let (ta, tb) = (type_of(a, k, p)?, type_of(b, k, p)?);
            if ta != tb {
                return Err(format!("select of {ta} and {tb}"));
            }
            ta
        }
        Expr::Cast(t, a) => {
            type_of(a, k, p)?;
            if t.is_storage_only() {
                return Err("cast to a storage-only type".into());
            }
            *t
        }
        Expr::Call(f, args) => {
            if args.len() != f.arity() {
                return Err(format!("{f:?} takes {} arguments", f.arity()));
            }
            let t = type_of(&args[0], k, p)?;
            for a in args {
                if type_of(a, k, p)? != t || !matches!(t, Ty::F32 | Ty::F64) {
                    return Err(format!("{f:?} needs f32 or f64 arguments of one type"));
                }
            }
            t
        }
    })
}

/// Checks every kernel of a program; returns all errors.
pub fn verify_program(p: &Program) -> Result<(), Vec<String>> {
    let mut errs = Vec::new();
    for k in &p.kernels {
        verify_stmts(&k.body, k, p, &mut errs);
    }
    for b in &p.buffers {
        if let super::BufKind::Const { data } = &b.kind {
            if data.len() as u64 != b.bytes() {
                errs.push(format!(
                    "constant buffer `{}` holds {} bytes, needs {}",
                    b.name,
                    data.len(),
                    b.bytes()
                ));
            }
        }
        if let super::BufKind::Arena { offset } = b.kind {
            if offset + b.bytes() > p.arena_bytes {
                errs.push(format!("arena buffer `{}` ends past the arena", b.name));
            }
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

fn verify_stmts(body: &[Stmt], k: &Kernel, p: &Program, errs: &mut Vec<String>) {
    for s in body {
        let r: Result<(), String> = (|| {
            match s {
                Stmt::For { var, body, .. } => {
                    if k.vars.get(*var) != Some(&Ty::I64) {
                        return Err(format!("loop variable v{var} is not an i64"));
                    }
                    verify_stmts(body, k, p, errs);
                }
                Stmt::Store { buf, index, value } => {
                    let b = p
                        .buffers
                        .get(*buf)
                        .ok_or_else(|| format!("store to missing buffer b{buf}"))?;
                    if matches!(
                        b.kind,
                        super::BufKind::Const { .. } | super::BufKind::Input(_)
                    ) {
                        return Err(format!("store to read-only buffer `{}`", b.name));
                    }
                    if type_of(index, k, p)? != Ty::I64 {
                        return Err(format!("store index into `{}` is not i64", b.name));
                    }
                    let t = type_of(value, k, p)?;
                    if t != b.elem.compute() {
                        return Err(format!("store of {t} into `{}` of {}", b.name, b.elem));
                    }
                }
                Stmt::Set { var, value } => {
                    let t = type_of(value, k, p)?;
                    if k.vars.get(*var) != Some(&t) {
                        return Err(format!("v{var} set to a {t}"));
                    }
                }
                Stmt::If { cond, then, els } => {
                    if type_of(cond, k, p)?.is_float() {
                        return Err("if condition is a float".into());
                    }
                    verify_stmts(then, k, p, errs);
                    verify_stmts(els, k, p, errs);
                }
                Stmt::Gemm(g) => verify_gemm(g, k, p)?,
            }
            Ok(())
        })();
        if let Err(e) = r {
            errs.push(format!("kernel `{}`: {e}", k.name));
        }
    }
}

/// A GEMM call: f32 views with i64 offsets, a writable C, and (where the offsets are
/// literals) every element inside its buffer.
fn verify_gemm(g: &super::GemmCall, k: &Kernel, p: &Program) -> Result<(), String> {
    if g.m == 0 || g.n == 0 || g.k == 0 {
        return Err(format!("gemm of empty size {}x{}x{}", g.m, g.n, g.k));
    }
    for (what, v) in ["A", "B", "C", "init"].iter().zip(g.views()) {
        let b = p
            .buffers
            .get(v.buf)
            .ok_or_else(|| format!("gemm {what} names missing buffer b{}", v.buf))?;
        if b.elem != Ty::F32 {
            return Err(format!("gemm {what} `{}` is {}, not f32", b.name, b.elem));
        }
        if type_of(&v.offset, k, p)? != Ty::I64 {
            return Err(format!("gemm {what} offset into `{}` is not i64", b.name));
        }
        let (rows, cols) = match *what {
            "A" => (g.m, g.k),
            "B" => (g.k, g.n),
            _ => (g.m, g.n),
        };
        // Panels (columns of B, rows of A): the extent within one panel, and the panels'
        // extent (whole panels).
        let (prows, pcols, pext) = match v.panel {
            None => (rows, cols, 0),
            Some((w, ps)) => {
                if *what != "B" && *what != "A" {
                    return Err(format!("gemm {what} view has panels (only A and B may)"));
                }
                if w == 0 {
                    return Err(format!("gemm {what} panels of width 0"));
                }
                if *what == "B" {
                    (rows, w, (cols.div_ceil(w) as i64 - 1) * ps)
                } else {
                    (w, cols, (rows.div_ceil(w) as i64 - 1) * ps)
                }
            }
        };
        if let super::Expr::Int(off) = v.offset {
            let corners = [
                0,
                (prows as i64 - 1) * v.rs,
                (pcols as i64 - 1) * v.cs,
                pext,
            ];
            let lo = off + corners[1].min(0) + corners[2].min(0) + corners[3].min(0);
            let hi = off + corners[1].max(0) + corners[2].max(0) + corners[3].max(0);
            if lo < 0 || hi >= b.len as i64 {
                return Err(format!(
                    "gemm {what} view [{lo}, {hi}] is outside `{}` of {} elements",
                    b.name, b.len
                ));
            }
        }
    }
    let c = &p.buffers[g.c.buf];
    if matches!(
        c.kind,
        super::BufKind::Const { .. } | super::BufKind::Input(_)
    ) {
        return Err(format!("gemm stores to read-only buffer `{}`", c.name));
    }
    if g.c.buf == g.a.buf || g.c.buf == g.b.buf {
        return Err("gemm C shares a buffer with A or B".into());
    }
    Ok(())
}
