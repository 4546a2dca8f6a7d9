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
            let t = scalar(type_of(a, k, p)?, "unary operation")?;
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
            scalar(ta, "arithmetic")?;
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
            scalar(ta, "comparison (compare the bytes)")?;
            Ty::U8
        }
        Expr::Select(c, a, b) => {
            let tc = scalar(type_of(c, k, p)?, "select condition")?;
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
            scalar(type_of(a, k, p)?, "cast")?;
            if t.is_storage_only() {
                return Err("cast to a storage-only type".into());
            }
            scalar(*t, "cast")?
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
        Expr::StrByte(b, i, j) => {
            let buf = p
                .buffers
                .get(*b)
                .ok_or_else(|| format!("buffer b{b} does not exist"))?;
            if buf.elem != Ty::Str {
                return Err(format!("string byte of `{}` of {}", buf.name, buf.elem));
            }
            if type_of(i, k, p)? != Ty::I64 || type_of(j, k, p)? != Ty::I64 {
                return Err(format!("string byte index into b{b} is not i64"));
            }
            Ty::U8
        }
    })
}

/// `t`, or an error when it is a string pointer, which only moves (loads, stores,
/// selects, variables) and is read through [`Expr::StrByte`].
fn scalar(t: Ty, what: &str) -> Result<Ty, String> {
    if t == Ty::Str {
        Err(format!("{what} of a string pointer"))
    } else {
        Ok(t)
    }
}

/// Checks that constant string data holds `len` NUL-terminated strings.
fn check_str_data(data: &[u8], len: u64) -> bool {
    data.last().is_none_or(|&b| b == 0) && data.iter().filter(|&&b| b == 0).count() as u64 == len
}

/// Checks every kernel of a program; returns all errors.
pub fn verify_program(p: &Program) -> Result<(), Vec<String>> {
    let mut errs = Vec::new();
    for k in &p.kernels {
        verify_stmts(&k.body, k, p, &mut errs);
    }
    for b in &p.buffers {
        if let super::BufKind::Const { data } = &b.kind {
            if b.elem == Ty::Str {
                if !check_str_data(data, b.len) {
                    errs.push(format!(
                        "constant string buffer `{}` does not hold {} NUL-terminated strings",
                        b.name, b.len
                    ));
                }
            } else if data.len() as u64 != b.bytes() {
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

/// Type-checks one kernel against a program's buffers; returns all errors.
pub fn verify_kernel(k: &Kernel, p: &Program) -> Result<(), Vec<String>> {
    let mut errs = Vec::new();
    verify_stmts(&k.body, k, p, &mut errs);
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
                    let t = type_of(cond, k, p)?;
                    if t.is_float() || t == Ty::Str {
                        return Err(format!("if condition is a {t}"));
                    }
                    verify_stmts(then, k, p, errs);
                    verify_stmts(els, k, p, errs);
                }
                Stmt::Gemm(g) => verify_gemm(g, k, p)?,
                Stmt::While { cond, body } => {
                    let t = type_of(cond, k, p)?;
                    if t.is_float() || t == Ty::Str {
                        return Err(format!("while condition is a {t}"));
                    }
                    verify_stmts(body, k, p, errs);
                }
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
    if g.int8
        && (g.alpha != 1.0
            || g.add.is_some()
            || g.act != super::GemmAct::None
            || g.a.panel.is_some()
            || g.b.panel.is_some()
            || !g.k.is_multiple_of(4))
    {
        return Err(
            "int8 gemm with alpha, add, activation, panels or k not a multiple of 4".into(),
        );
    }
    // An 8-bit product multiplies one u8 operand by one i8.
    let a_elem = p.buffers.get(g.a.buf).map(|b| b.elem);
    let b8 = if a_elem == Some(Ty::I8) {
        Ty::U8
    } else {
        Ty::I8
    };
    for (what, v) in g.named_views() {
        let b = p
            .buffers
            .get(v.buf)
            .ok_or_else(|| format!("gemm {what} names missing buffer b{}", v.buf))?;
        let want = match (g.int8, what) {
            (false, _) => Ty::F32,
            (true, "A") if b8 == Ty::U8 => Ty::I8,
            (true, "A") => Ty::U8,
            (true, "B") => b8,
            (true, _) => Ty::I32,
        };
        if b.elem != want {
            return Err(format!(
                "gemm {what} `{}` is {}, not {want}",
                b.name, b.elem
            ));
        }
        if type_of(&v.offset, k, p)? != Ty::I64 {
            return Err(format!("gemm {what} offset into `{}` is not i64", b.name));
        }
        let (rows, cols) = match what {
            "A" => (g.m, g.k),
            "B" => (g.k, g.n),
            _ => (g.m, g.n),
        };
        // Panels (columns of B, rows of A): the extent within one panel, and the panels'
        // extent (whole panels).
        let (prows, pcols, pext) = match v.panel {
            // B's quads: rows k / 4 apart by rs, then 4 bytes.
            None if g.int8 && what == "B" => (rows / 4, cols, 3),
            None => (rows, cols, 0),
            Some((w, ps)) => {
                if what != "B" && what != "A" {
                    return Err(format!("gemm {what} view has panels (only A and B may)"));
                }
                if w == 0 {
                    return Err(format!("gemm {what} panels of width 0"));
                }
                if what == "B" {
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
    if g.add.as_ref().is_some_and(|r| r.buf == g.c.buf) {
        return Err("gemm C shares a buffer with its add view".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kir::{BufKind, CmpOp};

    /// A program with a string input `s` (b0, 2 strings), a u8 output `y` (b1) and a
    /// string output `o` (b2), and a kernel with one i64 variable (v0) and one string
    /// variable (v1) running `body`.
    fn check(body: impl Fn(VarId) -> Vec<Stmt>) -> Result<(), Vec<String>> {
        let mut p = Program::default();
        p.add_buffer("s", BufKind::Input(0), Ty::Str, 2);
        p.add_buffer("y", BufKind::Output(0), Ty::U8, 2);
        p.add_buffer("o", BufKind::Output(1), Ty::Str, 2);
        let mut k = Kernel::new("k");
        let i = k.var(Ty::I64);
        k.var(Ty::Str);
        k.body = body(i);
        p.kernels.push(k);
        verify_program(&p)
    }
    use crate::kir::VarId;

    #[test]
    fn string_pointers_move_and_their_bytes_are_read() {
        let r = check(|i| {
            let byte = Expr::str_byte(0, Expr::Var(i), Expr::Int(0));
            vec![Stmt::For {
                var: i,
                extent: 2,
                body: vec![
                    Stmt::Set {
                        var: 1,
                        value: Expr::load(0, Expr::Var(i)),
                    },
                    Stmt::Store {
                        buf: 2,
                        index: Expr::Var(i),
                        value: Expr::select(
                            Expr::cmp(CmpOp::Eq, byte.clone(), Expr::cast(Ty::U8, Expr::Int(97))),
                            Expr::Var(1),
                            Expr::load(0, Expr::Int(0)),
                        ),
                    },
                    Stmt::While {
                        cond: byte.clone(),
                        body: vec![],
                    },
                    Stmt::Store {
                        buf: 1,
                        index: Expr::Var(i),
                        value: byte,
                    },
                ],
            }]
        });
        assert_eq!(r, Ok(()));
    }

    #[test]
    fn string_pointers_have_no_arithmetic_comparison_or_cast() {
        let load = || Expr::load(0, Expr::Int(0));
        for bad in [
            Expr::cmp(CmpOp::Eq, load(), load()),
            Expr::cast(Ty::U8, load()),
            Expr::un(super::super::UnOp::Not, load()),
            Expr::str_byte(1, Expr::Int(0), Expr::Int(0)),
        ] {
            let r = check(|_| {
                vec![Stmt::Store {
                    buf: 1,
                    index: Expr::Int(0),
                    value: bad.clone(),
                }]
            });
            let e = r.expect_err("rejected").join("\n");
            assert!(e.contains("string"), "{e}");
        }
        // A while condition must be an integer (not a pointer).
        let r = check(|_| {
            vec![Stmt::While {
                cond: load(),
                body: vec![],
            }]
        });
        assert!(r.is_err());
    }

    #[test]
    fn constant_strings_hold_one_nul_per_element() {
        for (data, ok) in [
            (b"a\0bc\0".to_vec(), true),
            (b"\0\0".to_vec(), true),
            (b"a\0bc".to_vec(), false),
            (b"a\0".to_vec(), false),
        ] {
            let mut p = Program::default();
            p.add_buffer("c", BufKind::Const { data }, Ty::Str, 2);
            assert_eq!(verify_program(&p).is_ok(), ok);
        }
    }

    /// A GEMM's add view is bounds-checked under its own name and may not be C's buffer.
    #[test]
    fn gemm_add_views() {
        use crate::kir::{GemmAct, GemmCall, MatView};
        let mut p = Program::default();
        let a = p.add_buffer("a", BufKind::Input(0), Ty::F32, 16);
        let r = p.add_buffer("r", BufKind::Input(1), Ty::F32, 16);
        let c = p.add_buffer("c", BufKind::Output(0), Ty::F32, 16);
        let view = |buf, off| MatView::strided(buf, Expr::Int(off), 4, 1);
        let run = |add: MatView| {
            let mut k = Kernel::new("k");
            k.body = vec![Stmt::Gemm(Box::new(GemmCall {
                m: 4,
                n: 4,
                k: 4,
                a: view(a, 0),
                b: view(a, 0),
                c: view(c, 0),
                alpha: 1.0,
                init: None,
                add: Some(add),
                act: GemmAct::None,
                int8: false,
            }))];
            verify_kernel(&k, &p).map_err(|e| e.join("\n"))
        };
        assert_eq!(run(view(r, 0)), Ok(()));
        let e = run(view(r, 1)).expect_err("past the end");
        assert!(e.contains("gemm add view"), "{e}");
        let e = run(view(c, 0)).expect_err("C itself");
        assert!(e.contains("add view"), "{e}");
    }
}
