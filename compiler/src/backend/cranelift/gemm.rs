//! How the native back end runs `Stmt::Gemm`: on x86_64 with AVX-512 or AVX2+FMA, a call
//! to a shape-specialised machine-code function (backend/x86/gemm.rs) with constant
//! operands prepacked into its panel layout at compile time; elsewhere (or for views the
//! microkernel cannot read), the call expands to a kernel-IR loop nest. A B view in column
//! panels of the microkernel's width is read in place; other panel widths run as one call
//! per panel.

use crate::backend::x86::gemm::{self as x86, Isa, Spec};
use crate::kir::{BinOp, BufKind, CmpOp, Expr, GemmAct, GemmCall, Kernel, MatView, Program};
use crate::kir::{Stmt, Ty};
use cranelift_codegen::ir::{types, AbiParam, Signature};
use cranelift_module::{DataDescription, DataId, FuncId, Linkage, Module};
use cranelift_object::ObjectModule;
use std::collections::HashMap;

/// Where the microkernel finds an operand.
#[derive(Clone, Copy, Debug)]
pub enum Operand {
    /// The view itself (base + offset).
    Direct,
    /// A prepacked copy in the object.
    Packed(DataId),
}

/// How one kept `Stmt::Gemm` runs.
#[derive(Clone, Debug)]
pub enum Plan {
    /// A call to a machine-code function.
    Asm {
        func: FuncId,
        a: Operand,
        b: Operand,
    },
    /// f32x4 register tiles in Cranelift IR (NEON); n is a multiple of [`VEC_NR`].
    Vec4,
}

/// Columns of a Cranelift f32x4 tile (two vectors) and its rows.
pub const VEC_NR: u64 = 8;
pub const VEC_MR: u64 = 4;

/// Per-object state: the microkernel ISA and blocking, and the functions and packed
/// constants made so far (shared by calls of one shape or one weight).
pub struct GemmCtx {
    isa: Option<Isa>,
    /// aarch64: f32x4 tiles from Cranelift.
    vec4: bool,
    l1_kib: u32,
    l2_kib: u32,
    prefix: String,
    funcs: HashMap<Spec, FuncId>,
    packs: HashMap<PackKey, DataId>,
}

type R<T> = Result<T, String>;

/// A packed constant: buffer, offset, strides, the two sizes, alpha's bits, B or A.
type PackKey = (usize, i64, i64, i64, usize, usize, u32, bool);

impl GemmCtx {
    pub fn new(prefix: &str, triple: &str, features: &[String], l1_kib: u32, l2_kib: u32) -> Self {
        let isa = if triple.starts_with("x86_64") && std::env::var_os("ONNXC_NO_ASM_GEMM").is_none()
        {
            Isa::from_features(features)
        } else {
            None
        };
        GemmCtx {
            isa,
            vec4: triple.starts_with("aarch64"),
            l1_kib,
            l2_kib,
            prefix: prefix.to_string(),
            funcs: HashMap::new(),
            packs: HashMap::new(),
        }
    }

    /// Rewrites `k` for this target: GEMMs the microkernel takes stay (their plans are
    /// returned in statement order), the others become loops.
    pub fn prepare(
        &mut self,
        module: &mut ObjectModule,
        k: &Kernel,
        p: &Program,
    ) -> R<(Kernel, Vec<Plan>)> {
        let mut out = k.clone();
        let mut calls = Vec::new();
        let body = std::mem::take(&mut out.body);
        out.body = self.stmts(module, body, &mut out.vars, p, &mut calls)?;
        Ok((out, calls))
    }

    fn stmts(
        &mut self,
        module: &mut ObjectModule,
        body: Vec<Stmt>,
        vars: &mut Vec<Ty>,
        p: &Program,
        calls: &mut Vec<Plan>,
    ) -> R<Vec<Stmt>> {
        let mut out = Vec::with_capacity(body.len());
        for s in body {
            match s {
                Stmt::For { var, extent, body } => out.push(Stmt::For {
                    var,
                    extent,
                    body: self.stmts(module, body, vars, p, calls)?,
                }),
                Stmt::If { cond, then, els } => out.push(Stmt::If {
                    cond,
                    then: self.stmts(module, then, vars, p, calls)?,
                    els: self.stmts(module, els, vars, p, calls)?,
                }),
                Stmt::Gemm(g) => self.gemm(module, g, vars, p, calls, &mut out)?,
                s => out.push(s),
            }
        }
        Ok(out)
    }

    /// One GEMM: a microkernel call, f32x4 tiles, or loops; a B in panels the microkernel
    /// cannot read runs as one call per panel.
    fn gemm(
        &mut self,
        module: &mut ObjectModule,
        g: Box<GemmCall>,
        vars: &mut Vec<Ty>,
        p: &Program,
        calls: &mut Vec<Plan>,
        out: &mut Vec<Stmt>,
    ) -> R<()> {
        if let Some(c) = self.plan(module, &g, p)? {
            calls.push(c);
            out.push(Stmt::Gemm(g));
            return Ok(());
        }
        if g.b.panel.is_some() {
            for part in unpanel(&g) {
                self.gemm(module, Box::new(part), vars, p, calls, out)?;
            }
            return Ok(());
        }
        match self.vec4_split(&g) {
            Some((main, rest)) => {
                calls.push(Plan::Vec4);
                out.push(Stmt::Gemm(Box::new(main)));
                if let Some(r) = rest {
                    out.extend(expand(&r, vars));
                }
            }
            None => out.extend(expand(&g, vars)),
        }
        Ok(())
    }

    /// For f32x4 tiles: the columns that fill whole tiles, and the rest (as loops).
    fn vec4_split(&self, g: &GemmCall) -> Option<(GemmCall, Option<GemmCall>)> {
        let init_ok = g.init.as_ref().is_none_or(|v| v.cs == 0 || v.cs == 1);
        if !self.vec4 || g.b.cs != 1 || g.c.cs != 1 || !init_ok || g.n < VEC_NR {
            return None;
        }
        let n8 = g.n / VEC_NR * VEC_NR;
        let mut main = g.clone();
        main.n = n8;
        if n8 == g.n {
            return Some((main, None));
        }
        let shift = |v: &MatView| MatView {
            offset: Expr::add(v.offset.clone(), Expr::Int(n8 as i64 * v.cs)),
            ..v.clone()
        };
        let mut rest = g.clone();
        rest.n = g.n - n8;
        rest.b = shift(&g.b);
        rest.c = shift(&g.c);
        rest.init = g.init.as_ref().map(shift);
        Some((main, Some(rest)))
    }

    /// The microkernel plan for `g`, or None when it must run as loops.
    fn plan(&mut self, module: &mut ObjectModule, g: &GemmCall, p: &Program) -> R<Option<Plan>> {
        let Some(isa) = self.isa else {
            return Ok(None);
        };
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (mr, nr) = (isa.mr() as i64, isa.nr() as i64);
        let konst = |v: &MatView| match (p.buffers.get(v.buf).map(|b| &b.kind), &v.offset) {
            (Some(BufKind::Const { data }), Expr::Int(off)) => Some((data, *off)),
            _ => None,
        };
        if g.c.cs != 1 {
            return Ok(None);
        }
        let ca = konst(&g.a);
        let cb = konst(&g.b);
        if g.alpha != 1.0 && ca.is_none() && cb.is_none() {
            return Ok(None);
        }
        // alpha goes into one packed operand (B when both are).
        let alpha_in_b = cb.is_some();
        let init = match &g.init {
            None => None,
            Some(v) if v.cs == 0 || v.cs == 1 => Some((v.rs * 4, v.cs * 4)),
            Some(_) => return Ok(None),
        };
        let init_is_c = g.init.as_ref() == Some(&g.c);
        let (a_tile, a_row, a_k, a_op) = match ca {
            Some((data, off)) => {
                let alpha = if alpha_in_b { 1.0 } else { g.alpha };
                let key = (g.a.buf, off, g.a.rs, g.a.cs, m, k, alpha.to_bits(), false);
                let id = self.pack(module, key, || {
                    x86::pack_a(isa, &floats(data), off, g.a.rs, g.a.cs, m, k, alpha)
                })?;
                (k as i64 * mr * 4, 4, mr * 4, Operand::Packed(id))
            }
            None => (mr * g.a.rs * 4, g.a.rs * 4, g.a.cs * 4, Operand::Direct),
        };
        let mut b_group = 1;
        let (b_panel, b_k, b_padded, b_op) = match (cb, g.b.panel) {
            // Panels of a multiple of the microkernel's width, padding included: read in
            // place.
            (None, Some((w, ps))) if w > 0 && w as i64 % nr == 0 && g.b.cs == 1 => {
                b_group = (w as i64 / nr) as usize;
                (ps * 4, g.b.rs * 4, true, Operand::Direct)
            }
            (_, Some(_)) => return Ok(None),
            (Some((data, off)), None) => {
                let key = (g.b.buf, off, g.b.rs, g.b.cs, k, n, g.alpha.to_bits(), true);
                let id = self.pack(module, key, || {
                    x86::pack_b(isa, &floats(data), off, g.b.rs, g.b.cs, k, n, g.alpha)
                })?;
                (k as i64 * nr * 4, nr * 4, true, Operand::Packed(id))
            }
            (None, None) if g.b.cs == 1 => (nr * 4, g.b.rs * 4, false, Operand::Direct),
            (None, None) => return Ok(None),
        };
        let (kc, nc) = x86::blocking(isa, k, n, self.l1_kib, self.l2_kib);
        // Column blocks start at whole B panels.
        let gw = b_group * nr as usize;
        let nc = nc.div_ceil(gw) * gw;
        let spec = Spec {
            isa,
            m,
            n,
            k,
            a_tile,
            a_row,
            a_k,
            b_panel,
            b_k,
            b_padded,
            b_group,
            c_rs: g.c.rs * 4,
            init,
            init_is_c,
            act: g.act.into(),
            kc,
            nc,
        };
        let func = match self.funcs.get(&spec) {
            Some(f) => *f,
            None => {
                let code = match x86::generate(&spec) {
                    Ok(c) => c,
                    // Shapes the generator refuses (huge strides) run as loops.
                    Err(_) => return Ok(None),
                };
                let mut sig = Signature::new(module.isa().default_call_conv());
                for _ in 0..4 {
                    sig.params.push(AbiParam::new(types::I64));
                }
                let name = format!("{}__gemm{}", self.prefix, self.funcs.len());
                let id = module
                    .declare_function(&name, Linkage::Local, &sig)
                    .map_err(|e| format!("declare {name}: {e}"))?;
                module
                    .define_function_bytes(id, 64, &code, &[])
                    .map_err(|e| format!("define {name}: {e}"))?;
                self.funcs.insert(spec, id);
                id
            }
        };
        Ok(Some(Plan::Asm {
            func,
            a: a_op,
            b: b_op,
        }))
    }

    fn pack(
        &mut self,
        module: &mut ObjectModule,
        key: PackKey,
        f: impl FnOnce() -> Vec<f32>,
    ) -> R<DataId> {
        if let Some(id) = self.packs.get(&key) {
            return Ok(*id);
        }
        let bytes: Vec<u8> = f().iter().flat_map(|x| x.to_le_bytes()).collect();
        let name = format!("{}__gemm_pack{}", self.prefix, self.packs.len());
        let id = module
            .declare_data(&name, Linkage::Local, false, false)
            .map_err(|e| format!("declare {name}: {e}"))?;
        let mut dd = DataDescription::new();
        dd.define(bytes.into_boxed_slice());
        dd.set_align(64);
        module
            .define_data(id, &dd)
            .map_err(|e| format!("define {name}: {e}"))?;
        self.packs.insert(key, id);
        Ok(id)
    }
}

fn floats(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `v.offset + r * rs + c * cs`.
fn at(v: &MatView, r: usize, c: usize) -> Expr {
    let term = |x: usize, s: i64| match s {
        0 => None,
        1 => Some(Expr::Var(x)),
        s => Some(Expr::mul(Expr::Var(x), Expr::Int(s))),
    };
    let mut e = v.offset.clone();
    for t in [term(r, v.rs), term(c, v.cs)].into_iter().flatten() {
        e = match e {
            Expr::Int(0) => t,
            e => Expr::add(e, t),
        };
    }
    e
}

/// A GEMM whose B is in panels as one GEMM per panel, each with a plain B view.
pub fn unpanel(g: &GemmCall) -> Vec<GemmCall> {
    let Some((w, ps)) = g.b.panel else {
        return vec![g.clone()];
    };
    let shift = |v: &MatView, by: i64| MatView {
        offset: match (by, &v.offset) {
            (0, _) => v.offset.clone(),
            (_, Expr::Int(o)) => Expr::Int(o + by),
            _ => Expr::add(v.offset.clone(), Expr::Int(by)),
        },
        panel: None,
        ..v.clone()
    };
    let w = w.max(1);
    (0..g.n.div_ceil(w))
        .map(|q| {
            let j0 = (q * w) as i64;
            GemmCall {
                n: w.min(g.n - q * w),
                b: shift(&g.b, q as i64 * ps),
                c: shift(&g.c, j0 * g.c.cs),
                init: g.init.as_ref().map(|v| shift(v, j0 * v.cs)),
                ..g.clone()
            }
        })
        .collect()
}

/// The GEMM as a scalar loop nest (new variables are added to `vars`).
pub fn expand(g: &GemmCall, vars: &mut Vec<Ty>) -> Vec<Stmt> {
    if g.b.panel.is_some() {
        return unpanel(g)
            .iter()
            .flat_map(|part| expand(part, vars))
            .collect();
    }
    let mut var = |t: Ty| {
        vars.push(t);
        vars.len() - 1
    };
    let (i, j, p) = (var(Ty::I64), var(Ty::I64), var(Ty::I64));
    let acc = var(Ty::F32);
    let f = |x: f32| Expr::f(x as f64, Ty::F32);
    let prod = Expr::mul(
        Expr::load(g.a.buf, at(&g.a, i, p)),
        Expr::load(g.b.buf, at(&g.b, p, j)),
    );
    let mut val = Expr::Var(acc);
    if g.alpha != 1.0 {
        val = Expr::mul(val, f(g.alpha));
    }
    if let Some(v) = &g.init {
        val = Expr::add(Expr::load(v.buf, at(v, i, j)), val);
    }
    val = act_expr(g.act, val);
    let inner = vec![
        Stmt::Set {
            var: acc,
            value: f(0.0),
        },
        Stmt::For {
            var: p,
            extent: g.k,
            body: vec![Stmt::Set {
                var: acc,
                value: Expr::add(Expr::Var(acc), prod),
            }],
        },
        Stmt::Store {
            buf: g.c.buf,
            index: at(&g.c, i, j),
            value: val,
        },
    ];
    vec![Stmt::For {
        var: i,
        extent: g.m,
        body: vec![Stmt::For {
            var: j,
            extent: g.n,
            body: inner,
        }],
    }]
}

/// A GEMM activation as a scalar f32 expression.
pub fn act_expr(a: GemmAct, x: Expr) -> Expr {
    let f = |x: f32| Expr::f(x as f64, Ty::F32);
    match a {
        GemmAct::None => x,
        GemmAct::Relu => Expr::bin(BinOp::Max, x, f(0.0)),
        GemmAct::Clip(lo, hi) => Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, x, f(lo)), f(hi)),
        GemmAct::Leaky(al) => Expr::select(
            Expr::cmp(CmpOp::Lt, x.clone(), f(0.0)),
            Expr::mul(x.clone(), f(al)),
            x,
        ),
    }
}
