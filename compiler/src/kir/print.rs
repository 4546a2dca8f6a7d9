//! Readable text of kernel IR (`onnxc MODEL --emit kir`).

use super::{BufKind, Expr, Program, Stmt};
use std::fmt::Write;

pub fn print_program(p: &Program) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "program arena={}B", p.arena_bytes);
    for (i, b) in p.buffers.iter().enumerate() {
        let kind = match &b.kind {
            BufKind::Input(k) => format!("input {k}"),
            BufKind::Output(k) => format!("output {k}"),
            BufKind::Arena { offset } => format!("arena @{offset}"),
            BufKind::Const { data } if b.elem == super::Ty::Str => {
                format!("const strings {}B", data.len())
            }
            BufKind::Const { data } => format!("const {}B", data.len()),
        };
        let _ = writeln!(s, "  b{i}: {}[{}] {kind}  # {}", b.elem, b.len, b.name);
    }
    for k in &p.kernels {
        let _ = writeln!(s, "kernel {} {{", k.name);
        if let Some(v) = k.threaded {
            let _ = writeln!(s, "  v{v} = threaded  # 1 with a parallel_for hook");
        }
        stmts(&k.body, 1, &mut s);
        let _ = writeln!(s, "}}");
    }
    s
}

fn stmts(body: &[Stmt], depth: usize, s: &mut String) {
    let pad = "  ".repeat(depth);
    for st in body {
        match st {
            Stmt::For { var, extent, body } => {
                let _ = writeln!(s, "{pad}for v{var} in 0..{extent} {{");
                stmts(body, depth + 1, s);
                let _ = writeln!(s, "{pad}}}");
            }
            Stmt::Store { buf, index, value } => {
                let _ = writeln!(s, "{pad}b{buf}[{}] = {}", expr(index), expr(value));
            }
            Stmt::Set { var, value } => {
                let _ = writeln!(s, "{pad}v{var} = {}", expr(value));
            }
            Stmt::If { cond, then, els } => {
                let _ = writeln!(s, "{pad}if {} {{", expr(cond));
                stmts(then, depth + 1, s);
                if !els.is_empty() {
                    let _ = writeln!(s, "{pad}}} else {{");
                    stmts(els, depth + 1, s);
                }
                let _ = writeln!(s, "{pad}}}");
            }
            Stmt::While { cond, body } => {
                let _ = writeln!(s, "{pad}while {} {{", expr(cond));
                stmts(body, depth + 1, s);
                let _ = writeln!(s, "{pad}}}");
            }
            Stmt::Gemm(g) => {
                let mut rhs = format!("{} x {}", view(&g.a), view(&g.b));
                if g.alpha != 1.0 {
                    rhs = format!("{:?} * {rhs}", g.alpha);
                }
                if let Some(i) = &g.init {
                    rhs = format!("{} + {rhs}", view(i));
                }
                if let Some(r) = &g.add {
                    rhs = format!("({rhs}) + {}", view(r));
                }
                match g.act {
                    super::GemmAct::None => {}
                    super::GemmAct::Relu => rhs = format!("relu({rhs})"),
                    super::GemmAct::Clip(lo, hi) => rhs = format!("clip({rhs}, {lo:?}, {hi:?})"),
                    super::GemmAct::Leaky(a) => rhs = format!("leaky({rhs}, {a:?})"),
                    super::GemmAct::Silu => rhs = format!("silu({rhs})"),
                }
                let _ = writeln!(
                    s,
                    "{pad}gemm{} {}x{}x{} {} = {rhs}",
                    if g.int8 {
                        " 8-bit->i32 (B in quads)"
                    } else {
                        ""
                    },
                    g.m,
                    g.n,
                    g.k,
                    view(&g.c)
                );
            }
        }
    }
}

fn view(v: &super::MatView) -> String {
    match v.panel {
        None => format!("b{}[{}; {}, {}]", v.buf, expr(&v.offset), v.rs, v.cs),
        Some((w, ps)) => format!(
            "b{}[{}; {}, {}; panels {w} x {ps}]",
            v.buf,
            expr(&v.offset),
            v.rs,
            v.cs
        ),
    }
}

pub fn expr(e: &Expr) -> String {
    match e {
        Expr::Var(v) => format!("v{v}"),
        Expr::Int(i) => i.to_string(),
        Expr::Float(x, t) => format!("{x:?}{t}"),
        Expr::Load(b, i) => format!("b{b}[{}]", expr(i)),
        Expr::Un(op, a) => format!("{op:?}({})", expr(a)).to_lowercase(),
        Expr::Bin(op, a, b) => format!(
            "{}({}, {})",
            format!("{op:?}").to_lowercase(),
            expr(a),
            expr(b)
        ),
        Expr::Cmp(op, a, b) => format!(
            "{}({}, {})",
            format!("{op:?}").to_lowercase(),
            expr(a),
            expr(b)
        ),
        Expr::Select(c, a, b) => format!("select({}, {}, {})", expr(c), expr(a), expr(b)),
        Expr::Cast(t, a) => format!("{t}({})", expr(a)),
        Expr::Call(f, args) => format!(
            "{}({})",
            format!("{f:?}").to_lowercase(),
            args.iter().map(expr).collect::<Vec<_>>().join(", ")
        ),
        Expr::StrByte(b, i, j) => format!("byte(b{b}[{}], {})", expr(i), expr(j)),
    }
}
