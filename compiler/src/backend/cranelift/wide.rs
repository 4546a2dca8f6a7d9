//! Innermost loops as AVX-512 machine code: a loop the f32x4 vectoriser accepts
//! ([`Gen::qualifies`]) whose loads are all unit-stride f32 streams or loop-invariant,
//! and whose operations the x86 loop generator knows (`backend/x86/wide.rs`), becomes a
//! call to a generated function that runs it 16 lanes at a time with a masked tail.
//! Anything else keeps the 128-bit code.
//!
//! Streams: each access is `buf[var + key + c]` with `key` loop-invariant; accesses of one
//! buffer with the same `key` share a base pointer (computed here at iteration 0) and
//! differ by the displacement `c`, so a depthwise convolution row's nine taps are one
//! stream. Loop-invariant f32 subexpressions ("uniforms") are computed here and read by
//! the loop as broadcast memory operands.

use super::vectorize::{at_zero, count_reads, split_const, stride, varies, Plan, RedKind};
use super::Gen;
use crate::backend::x86::wide::{self as x, Builder, Inst, V};
use crate::kir::{BinOp, BufId, CmpOp, Expr, MathFn, Stmt, Ty, UnOp, VarId};
use cranelift_codegen::ir::StackSlotKind;
use cranelift_codegen::ir::{types, AbiParam, InstBuilder, Signature, StackSlotData};
use cranelift_module::{FuncId, Linkage, Module};
use cranelift_object::ObjectModule;
use std::collections::HashMap;

/// The AVX-512 code of `lp`, or `None` when the generator cannot take it (too many
/// registers live, say) and the loop stays 128-bit code. With `ONNXC_WIDE_LOG` set, says
/// on stderr which function keeps such a loop and why: a diagnostic for kernel writers,
/// since such a loop runs about 4x slower.
fn generate_logged(func: &str, lp: &x::Loop, avx2: bool) -> Option<Vec<u8>> {
    let code = if avx2 {
        crate::backend::x86::wide_avx2::generate(lp)
    } else {
        x::generate(lp)
    };
    code.map_err(|why| {
        if std::env::var_os("ONNXC_WIDE_LOG").is_some() {
            eprintln!("onnxc: {func}: a loop stays 128-bit: {why}");
        }
    })
    .ok()
}

/// Loops shorter than this keep the 128-bit code (the call costs about what two 128-bit
/// iterations do).
const MIN_EXTENT: u64 = 8;
/// Rows shorter than this keep the 128-bit code when a loop over rows is made one call.
const MIN_ROW: u64 = 4;

/// Per object: whether the target takes the wide loops, whether they compute exactly
/// kernel IR's operations, and the functions made so far (identical loops share one).
pub struct WideFuncs {
    enabled: bool,
    /// The loops are AVX2 code (`backend/x86/wide_avx2.rs`: 8 lanes, a subset of the
    /// instructions), the target having AVX2 and FMA but not AVX-512.
    avx2: bool,
    exact: bool,
    /// AVX-512DQ (`vrangeps` for NaN-skipping max/min).
    dq: bool,
    prefix: String,
    funcs: HashMap<Vec<u8>, FuncId>,
}

impl WideFuncs {
    /// Whether this object's loops may be AVX-512 code.
    pub(super) fn avx512(&self) -> bool {
        self.enabled && !self.avx2
    }

    /// Enabled for x86_64 targets with AVX-512F (AVX-512 loops) or with AVX2 and FMA
    /// (AVX2 loops), unless `ONNXC_NO_WIDE` is set (for comparisons).
    pub fn new(prefix: &str, triple: &str, features: &[String], exact: bool) -> WideFuncs {
        let has = |f: &str| features.iter().any(|g| g == f);
        let x86 = triple.starts_with("x86_64") && std::env::var_os("ONNXC_NO_WIDE").is_none();
        let avx512 = x86 && has("avx512f");
        let avx2 = x86 && !avx512 && has("avx2") && has("fma");
        WideFuncs {
            enabled: avx512 || avx2,
            avx2,
            exact,
            dq: avx512 && has("avx512dq"),
            prefix: prefix.to_string(),
            funcs: HashMap::new(),
        }
    }

    /// The function for `code`, made (named after the kernel `user`, for profiles) the
    /// first time.
    fn func(
        &mut self,
        module: &mut ObjectModule,
        code: Vec<u8>,
        user: &str,
    ) -> Result<FuncId, String> {
        if let Some(f) = self.funcs.get(&code) {
            return Ok(*f);
        }
        let mut sig = Signature::new(module.isa().default_call_conv());
        sig.params.push(AbiParam::new(module.isa().pointer_type()));
        let user = user
            .strip_prefix(&format!("{}__", self.prefix))
            .unwrap_or(user);
        let name = format!("{}__wide{}_{user}", self.prefix, self.funcs.len());
        let id = module
            .declare_function(&name, Linkage::Local, &sig)
            .map_err(|e| format!("declare {name}: {e}"))?;
        module
            .define_function_bytes(id, 64, &code, &[])
            .map_err(|e| format!("define {name}: {e}"))?;
        self.funcs.insert(code, id);
        Ok(id)
    }
}

/// A loop body being translated.
struct Tr {
    b: Builder,
    /// Only kernel IR's own operations (see `driver::Options::exact_math`).
    exact: bool,
    /// `vrangeps` available.
    dq: bool,
    /// The loops are AVX2 code ([`WideFuncs`]).
    avx2: bool,
    var: VarId,
    locals: Vec<VarId>,
    vals: HashMap<VarId, V>,
    /// Locals holding `sigmoid(x)` for a local `x` that are read only as `x *` them (an
    /// elementwise SiLU): not computed; their products take [`Tr::silu_fast`].
    gates: HashMap<VarId, VarId>,
    /// (buffer, loop-invariant part of the index) per stream.
    streams: Vec<(BufId, Expr)>,
    /// Per stream, its buffer's elements.
    elem: Vec<x::Elem>,
    unis: Vec<Expr>,
    /// Arguments of the inline sin, cos and tan, which hold only up to `vmath::SINCOS_MAX`
    /// (see [`Gen::wide_for`]).
    trig: Vec<V>,
    /// Locals of other types than f32 (an int32 or byte load, say), by their
    /// definitions: the body's expressions are translated with the definitions in
    /// their place (inlined where each Set, reduction or Store is taken) (`f32(v)` of `v = i32 load` reads an int32 stream; of a
    /// loop-invariant `v = zero point`, a uniform).
    defs: Vec<(VarId, Expr)>,
    /// The loop-invariant f32 locals' definitions (as inlined), for
    /// [`Gen::wexpr_rounded`]'s divisor.
    f32_defs: HashMap<VarId, Expr>,
}

/// `e` with each variable defined in `defs` replaced by its definition.
fn inline(e: &Expr, defs: &[(VarId, Expr)]) -> Expr {
    match e {
        Expr::Var(v) => match defs.iter().find(|(d, _)| d == v) {
            Some((_, x)) => x.clone(),
            None => e.clone(),
        },
        Expr::Bin(op, a, b) => Expr::bin(*op, inline(a, defs), inline(b, defs)),
        Expr::Un(op, a) => Expr::un(*op, inline(a, defs)),
        Expr::Cast(t, a) => Expr::cast(*t, inline(a, defs)),
        Expr::Cmp(op, a, b) => Expr::cmp(*op, inline(a, defs), inline(b, defs)),
        Expr::Select(c, a, b) => Expr::select(inline(c, defs), inline(a, defs), inline(b, defs)),
        Expr::Load(buf, i) => Expr::load(*buf, inline(i, defs)),
        Expr::Call(f, args) => Expr::call(*f, args.iter().map(|a| inline(a, defs)).collect()),
        Expr::StrByte(buf, i, j) => Expr::str_byte(*buf, inline(i, defs), inline(j, defs)),
        Expr::Int(_) | Expr::Float(..) => e.clone(),
    }
}

/// `e` when `d` is `1 + exp(e)` or `exp(e) + 1` (f32): the divisor of sigmoid and SiLU.
fn exp_of_one_plus(d: &Expr) -> Option<&Expr> {
    let one = |e: &Expr| matches!(e, Expr::Float(x, Ty::F32) if *x == 1.0);
    let Expr::Bin(BinOp::Add, a, b) = d else {
        return None;
    };
    match (&**a, &**b) {
        (Expr::Call(MathFn::Exp, e), o) | (o, Expr::Call(MathFn::Exp, e))
            if one(o) && e.len() == 1 =>
        {
            Some(&e[0])
        }
        _ => None,
    }
}

/// `x` when `e` is sigmoid as the lowerings write it, `1 / (1 + exp(-x))` (f32).
fn sigmoid_of(e: &Expr) -> Option<&Expr> {
    match e {
        Expr::Bin(BinOp::Div, one, d) if matches!(**one, Expr::Float(c, Ty::F32) if c == 1.0) => {
            match exp_of_one_plus(d) {
                Some(Expr::Un(UnOp::Neg, x)) => Some(x),
                _ => None,
            }
        }
        _ => None,
    }
}

/// `x` when `a * b` is SiLU as the epilogues write it, `x * (1 / (1 + exp(-x)))` (either
/// factor first, f32).
fn silu_of<'e>(a: &'e Expr, b: &'e Expr) -> Option<&'e Expr> {
    let gate_of = |x: &Expr, g: &Expr| sigmoid_of(g) == Some(x);
    if gate_of(a, b) {
        Some(a)
    } else if gate_of(b, a) {
        Some(b)
    } else {
        None
    }
}

/// `x` when `a * b` is `x * s` (either order) for a gate `s` of [`silu_gates`].
fn gate_product(gates: &HashMap<VarId, VarId>, a: &Expr, b: &Expr) -> Option<VarId> {
    match (a, b) {
        (Expr::Var(p), Expr::Var(q)) => match (gates.get(p), gates.get(q)) {
            (_, Some(x)) if x == p => Some(*p),
            (Some(x), _) if x == q => Some(*q),
            _ => None,
        },
        _ => None,
    }
}

/// The locals of a loop body that hold `sigmoid(x)` (`1 / (1 + exp(-x))`) of another
/// local `x`, each set once, and are read only in products `x * s` (either order): an
/// elementwise SiLU, as fusing Sigmoid and Mul makes it. Each maps to its `x`.
fn silu_gates(body: &[Stmt]) -> HashMap<VarId, VarId> {
    let sets = |v: VarId| {
        body.iter()
            .filter(|st| matches!(st, Stmt::Set { var, .. } if *var == v))
            .count()
    };
    fn products(e: &Expr, x: VarId, s: VarId) -> usize {
        match e {
            Expr::Bin(BinOp::Mul, a, b)
                if matches!((&**a, &**b), (Expr::Var(p), Expr::Var(q))
                    if (*p, *q) == (x, s) || (*p, *q) == (s, x)) =>
            {
                1
            }
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => products(a, x, s) + products(b, x, s),
            Expr::Un(_, a) | Expr::Cast(_, a) | Expr::Load(_, a) => products(a, x, s),
            Expr::Select(c, a, b) => products(c, x, s) + products(a, x, s) + products(b, x, s),
            Expr::Call(_, args) => args.iter().map(|a| products(a, x, s)).sum(),
            _ => 0,
        }
    }
    let mut gates = HashMap::new();
    for st in body {
        let Stmt::Set { var: s, value } = st else {
            continue;
        };
        let Some(&Expr::Var(x)) = sigmoid_of(value) else {
            continue;
        };
        let in_products: usize = body
            .iter()
            .map(|st| match st {
                Stmt::Set { value, .. } => products(value, x, *s),
                Stmt::Store { index, value, .. } => products(index, x, *s) + products(value, x, *s),
                _ => 0,
            })
            .sum();
        if x != *s
            && sets(x) == 1
            && sets(*s) == 1
            && in_products > 0
            && in_products == count_reads(body, *s)
        {
            gates.insert(*s, x);
        }
    }
    gates
}

/// Whether `c ? a : b` is `a > b || b != b ? a : b` (`Some(true)`: the larger, NaN
/// skipped, ties to `b`) or the same with `<` (`Some(false)`): maxNum / minNum up to
/// which zero a tie of +0 and -0 gives (pools' NaN-skipping max).
fn nan_skip(c: &Expr, a: &Expr, b: &Expr) -> Option<bool> {
    let Expr::Bin(BinOp::Or, p, q) = c else {
        return None;
    };
    let pick = |cmp: &Expr, nan: &Expr| -> Option<bool> {
        let max = match cmp {
            Expr::Cmp(CmpOp::Gt, x, y) if **x == *a && **y == *b => true,
            Expr::Cmp(CmpOp::Lt, x, y) if **x == *a && **y == *b => false,
            _ => return None,
        };
        matches!(nan, Expr::Cmp(CmpOp::Ne, x, y) if **x == *b && **y == *b).then_some(max)
    };
    pick(p, q).or_else(|| pick(q, p))
}

/// Kernel IR's unary float operation as the loops' (`Not` is none of theirs).
fn wide_un(op: UnOp) -> Option<x::Un> {
    Some(match op {
        UnOp::Neg => x::Un::Neg,
        UnOp::Abs => x::Un::Abs,
        UnOp::Sqrt => x::Un::Sqrt,
        UnOp::Floor => x::Un::Floor,
        UnOp::Ceil => x::Un::Ceil,
        UnOp::Nearest => x::Un::Nearest,
        UnOp::Trunc => x::Un::Trunc,
        UnOp::Not => return None,
    })
}

/// Kernel IR's comparison as the loops'.
fn wide_cmp(op: CmpOp) -> x::Cmp {
    match op {
        CmpOp::Eq => x::Cmp::Eq,
        CmpOp::Ne => x::Cmp::Ne,
        CmpOp::Lt => x::Cmp::Lt,
        CmpOp::Le => x::Cmp::Le,
        CmpOp::Gt => x::Cmp::Gt,
        CmpOp::Ge => x::Cmp::Ge,
    }
}

/// `select(a > b, a, b)` and its three mirror images are x86's max and min exactly:
/// `vmaxps(p, q)` is `p > q ? p : q` and `vminps(p, q)` is `p < q ? p : q`, an ordered
/// compare, so a NaN or an equal pair (+0 and -0) gives `q` as the select does. One
/// instruction instead of a compare and a blend (a depthwise layer's clamp was four of
/// its fifteen vector operations). `Some(true)` for `MaxX(a, b)`, `Some(false)` for
/// `MinX(a, b)`.
fn select_minmax(c: &Expr, a: &Expr, b: &Expr) -> Option<bool> {
    let Expr::Cmp(op @ (CmpOp::Gt | CmpOp::Lt), x, y) = c else {
        return None;
    };
    let gt = *op == CmpOp::Gt;
    if **x == *a && **y == *b {
        // a > b ? a : b, a < b ? a : b.
        Some(gt)
    } else if **x == *b && **y == *a {
        // b < a ? a : b is a > b ? a : b; b > a ? a : b is a < b ? a : b.
        Some(!gt)
    } else {
        None
    }
}

impl Tr {
    /// The stream and displacement of `buf[idx]` (idx of stride 1 in the loop variable).
    /// The stream of `buf` (elements `elem`) at `idx` and the byte displacement.
    fn stream(&mut self, buf: BufId, idx: &Expr, elem: x::Elem) -> Option<(u16, i32)> {
        let (rest, c) = split_const(&at_zero(idx, self.var));
        let key = rest.unwrap_or(Expr::Int(0));
        // (One stream per buffer, offset and element type: an i32 buffer may be both
        // copied as f32 lanes and converted.)
        let s = match self
            .streams
            .iter()
            .zip(&self.elem)
            .position(|((b, k), e)| *b == buf && *k == key && *e == elem)
        {
            Some(s) => s,
            None => {
                self.streams.push((buf, key));
                self.elem.push(elem);
                self.streams.len() - 1
            }
        };
        let disp = i32::try_from(c.checked_mul(elem.bytes())?).ok()?;
        Some((u16::try_from(s).ok()?, disp))
    }

    /// The loop-invariant `e` as a uniform (computed once by the caller; one slot per
    /// distinct expression).
    fn uniform(&mut self, e: &Expr) -> Option<V> {
        let u = match self.unis.iter().position(|x| x == e) {
            Some(u) => u,
            None => {
                self.unis.push(e.clone());
                self.unis.len() - 1
            }
        };
        Some(self.b.push(Inst::Uni(u16::try_from(u).ok()?)))
    }

    /// `a and b` (else `a or b`) of two masks; `None` when either is a vector.
    fn mask_logic(&mut self, and: bool, a: V, b: V) -> Option<V> {
        if !self.is_mask(a) || !self.is_mask(b) {
            return None;
        }
        Some(self.b.push(if and {
            Inst::MAnd(a, b)
        } else {
            Inst::MOr(a, b)
        }))
    }

    fn is_mask(&self, v: V) -> bool {
        matches!(
            self.b.lp.insts[v as usize],
            Inst::Cmp(..) | Inst::MAnd(..) | Inst::MOr(..)
        )
    }

    fn clamp(&mut self, v: V, lo: f32, hi: f32) -> V {
        let h = self.b.c(hi);
        let l = self.b.c(lo);
        let above = self.b.cmp(x::Cmp::Gt, v, h);
        let v = self.b.select(above, h, v);
        let below = self.b.cmp(x::Cmp::Lt, v, l);
        self.b.select(below, l, v)
    }

    fn poly(&mut self, v: V, cs: &[f32]) -> V {
        let mut p = self.b.c(cs[0]);
        for &k in &cs[1..] {
            let t = self.b.mul(p, v);
            let k = self.b.c(k);
            p = self.b.add(t, k);
        }
        p
    }

    /// 2^n for i32 lanes n in [-126, 127].
    fn pow2(&mut self, n: V) -> V {
        let bias = self.b.ci(127);
        let e = self.b.push(Inst::IAdd(n, bias));
        self.b.push(Inst::Shl(e, 23))
    }

    /// vmath's `exp`, operation for operation.
    fn exp(&mut self, v: V) -> V {
        use crate::backend::cranelift::vmath::{EXP_MIN, EXP_P, LN2_HI, LN2_LO, MAGIC};
        let lim = self.b.c(EXP_MIN);
        let tiny = self.b.cmp(x::Cmp::Lt, v, lim);
        let v = self.clamp(v, EXP_MIN, 89.0);
        let log2e = self.b.c(std::f32::consts::LOG2_E);
        let magic = self.b.c(MAGIC);
        let t = self.b.mul(v, log2e);
        let t = self.b.add(t, magic);
        let nf = self.b.sub(t, magic);
        let hi = self.b.c(LN2_HI);
        let lo = self.b.c(LN2_LO);
        let a = self.b.mul(nf, hi);
        let r = self.b.sub(v, a);
        let a = self.b.mul(nf, lo);
        let r = self.b.sub(r, a);
        let p = self.poly(r, &EXP_P);
        let r2 = self.b.mul(r, r);
        let y = self.b.mul(p, r2);
        let y = self.b.add(y, r);
        let one = self.b.c(1.0);
        let y = self.b.add(y, one);
        let mb = self.b.ci(MAGIC.to_bits() as i32);
        let n = self.b.push(Inst::ISub(t, mb));
        let n1 = self.b.push(Inst::Sra(n, 1));
        let n2 = self.b.push(Inst::ISub(n, n1));
        let s1 = self.pow2(n1);
        let s2 = self.pow2(n2);
        let y = self.b.mul(y, s1);
        let y = self.b.mul(y, s2);
        let zero = self.b.c(0.0);
        self.b.select(tiny, zero, y)
    }

    /// vmath's `log`, operation for operation (with `fast`, its polynomial and sums as
    /// fused multiply-adds).
    fn log(&mut self, v: V, fast: bool) -> V {
        use crate::backend::cranelift::vmath::{
            LN2_HI, LN2_LO, LOG_EXP_BIAS, LOG_P, MAGIC, SQRT_HALF,
        };
        let min = self.b.c(f32::MIN_POSITIVE);
        let tiny = self.b.cmp(x::Cmp::Lt, v, min);
        let scale = self.b.c(8_388_608.0);
        let xs = self.b.mul(v, scale);
        let xn = self.b.select(tiny, xs, v);
        let big_e = self.b.push(Inst::Sra(xn, 23));
        let top = self.b.push(Inst::Shl(big_e, 23));
        let mant = self.b.push(Inst::ISub(xn, top));
        let half = self.b.ci(0x3f00_0000);
        let m = self.b.push(Inst::IAdd(mant, half));
        let magic = self.b.ci(MAGIC.to_bits() as i32);
        let ef = self.b.push(Inst::IAdd(big_e, magic));
        let bias = self.b.c(LOG_EXP_BIAS);
        let e = self.b.sub(ef, bias);
        let t23 = self.b.c(23.0);
        let zero = self.b.c(0.0);
        let adj = self.b.select(tiny, t23, zero);
        let e = self.b.sub(e, adj);
        let sq = self.b.c(SQRT_HALF);
        let small = self.b.cmp(x::Cmp::Lt, m, sq);
        let one = self.b.c(1.0);
        let e1 = self.b.sub(e, one);
        let e = self.b.select(small, e1, e);
        let m2 = self.b.add(m, m);
        let m = self.b.select(small, m2, m);
        let m = self.b.sub(m, one);
        let z = self.b.mul(m, m);
        let (lo, mhalf, hi) = (self.b.c(LN2_LO), self.b.c(-0.5), self.b.c(LN2_HI));
        let r = if fast {
            let p = self.poly_fast(m, &LOG_P);
            let pm = self.b.mul(p, m);
            let y = self.b.mul(e, lo);
            let y = self.b.push(Inst::Fma(x::FmaKind::Add, pm, z, y));
            let y = self.b.push(Inst::Fma(x::FmaKind::Add, z, mhalf, y));
            let r = self.b.add(m, y);
            self.b.push(Inst::Fma(x::FmaKind::Add, e, hi, r))
        } else {
            let p = self.poly(m, &LOG_P);
            let y = self.b.mul(p, m);
            let y = self.b.mul(y, z);
            let t = self.b.mul(e, lo);
            let y = self.b.add(y, t);
            let t = self.b.mul(z, mhalf);
            let y = self.b.add(y, t);
            let r = self.b.add(m, y);
            let t = self.b.mul(e, hi);
            self.b.add(r, t)
        };
        let inf = self.b.c(f32::INFINITY);
        let is_inf = self.b.cmp(x::Cmp::Eq, v, inf);
        let r = self.b.select(is_inf, inf, r);
        let is_zero = self.b.cmp(x::Cmp::Eq, v, zero);
        let ninf = self.b.c(f32::NEG_INFINITY);
        let r = self.b.select(is_zero, ninf, r);
        let neg = self.b.cmp(x::Cmp::Lt, v, zero);
        let nan = self.b.c(f32::NAN);
        let r = self.b.select(neg, nan, r);
        let is_nan = self.b.cmp(x::Cmp::Ne, v, v);
        self.b.select(is_nan, v, r)
    }

    /// `x` clamped to `[lo, hi]` in two instructions; a NaN `x` stays NaN.
    fn clamp_fast(&mut self, v: V, lo: f32, hi: f32) -> V {
        let h = self.b.c(hi);
        let l = self.b.c(lo);
        let v = self.b.bin(x::Bin::MinX, h, v);
        self.b.bin(x::Bin::MaxX, l, v)
    }

    /// Horner's rule with fused multiply-adds.
    fn poly_fast(&mut self, v: V, cs: &[f32]) -> V {
        let mut p = self.b.c(cs[0]);
        for &k in &cs[1..] {
            let k = self.b.c(k);
            p = self.b.push(Inst::Fma(x::FmaKind::Add, p, v, k));
        }
        p
    }

    /// `exp` with the same reduction and polynomial as vmath's, in fused multiply-adds,
    /// the rounding instruction and `vscalefps` for `2^n`; results below the smallest
    /// normal are 0, NaN stays NaN.
    fn exp_fast(&mut self, v: V) -> V {
        use crate::backend::cranelift::vmath::EXP_MIN;
        let y = self.exp_fast_raw(v);
        let lim = self.b.c(EXP_MIN);
        let tiny = self.b.cmp(x::Cmp::Lt, v, lim);
        let zero = self.b.c(0.0);
        self.b.select(tiny, zero, y)
    }

    /// [`Tr::exp_fast`] without its flush of results below the smallest normal to 0
    /// (they come out subnormal or 0): `e^r 2^n` for `r = x - n ln 2`, `e^r` as
    /// `1 + r (1 + r P(r))`, one Horner chain of fused multiply-adds.
    fn exp_fast_raw(&mut self, v: V) -> V {
        use crate::backend::cranelift::vmath::{EXP_MIN, EXP_P, LN2_HI, LN2_LO};
        let t = self.clamp_fast(v, EXP_MIN, 89.0);
        let log2e = self.b.c(std::f32::consts::LOG2_E);
        let n = self.b.mul(t, log2e);
        let n = self.b.push(Inst::Un(x::Un::Nearest, n));
        let hi = self.b.c(LN2_HI);
        let lo = self.b.c(LN2_LO);
        let r = self.b.push(Inst::Fma(x::FmaKind::NegMulAdd, n, hi, t));
        let r = self.b.push(Inst::Fma(x::FmaKind::NegMulAdd, n, lo, r));
        let mut cs = EXP_P.to_vec();
        cs.extend([1.0, 1.0]);
        let y = self.poly_fast(r, &cs);
        self.b.push(Inst::Scalef(y, n))
    }

    /// `1 / d` for a finite `d` of magnitude in [2^-126, 2^126]: the 14-bit reciprocal
    /// and one Newton step (about 2^-28 relative, before the final rounding), instead
    /// of a division (whose unit takes several cycles per vector).
    fn recip_fast(&mut self, d: V) -> V {
        let r = self.b.push(Inst::Rcp14(d));
        let one = self.b.c(1.0);
        let e = self.b.push(Inst::Fma(x::FmaKind::NegMulAdd, d, r, one));
        self.b.push(Inst::Fma(x::FmaKind::Add, r, e, r))
    }

    /// SiLU, `x / (1 + e^-x)`, in 15 instructions, as the GEMM epilogue computes it: one
    /// clamp of `x` from above (so that `e^-x` stays a normal float; a NaN `x` comes out
    /// of the clamp as the bound, and the quotient is NaN all the same), `-x` folded
    /// into the reduction's multiplications, and `x / d` by the division instruction.
    /// The general form (`x * (1 / d)` with `-x` clamped on both sides, 19 instructions)
    /// took 15-21 cycles a vector on the Intel VM against 12.5-13.6 for this one (the
    /// division alone 10.5), and its `1 / d` came out subnormal (a microcode assist)
    /// below `x = -87`.
    fn silu_fast(&mut self, x: V) -> V {
        use crate::backend::cranelift::vmath::{EXP_MIN, EXP_P, LN2_HI, LN2_LO};
        let hi = self.b.c(-EXP_MIN);
        let mut t = self.b.bin(x::Bin::MinX, x, hi);
        if self.avx2 {
            // Below about -2.4e38, -t log2 e overflows: n = inf makes the reduction
            // inf - inf = NaN, and AVX2 has no vscalefps to take it. (x / d stays x's.)
            let lo = self.b.c(-1e30);
            t = self.b.bin(x::Bin::MaxX, t, lo);
        }
        let nlog2e = self.b.c(-std::f32::consts::LOG2_E);
        let n = self.b.mul(t, nlog2e);
        let n = self.b.push(Inst::Un(x::Un::Nearest, n));
        // r = -t - n ln 2, in two parts.
        let nhi = self.b.c(-LN2_HI);
        let r = self.b.push(Inst::Fma(x::FmaKind::Sub, n, nhi, t));
        let lo = self.b.c(LN2_LO);
        let r = self.b.push(Inst::Fma(x::FmaKind::NegMulAdd, n, lo, r));
        let mut cs = EXP_P.to_vec();
        cs.extend([1.0, 1.0]);
        let y = self.poly_fast(r, &cs);
        let e = self.b.push(Inst::Scalef(y, n));
        let one = self.b.c(1.0);
        let d = self.b.add(e, one);
        self.b.bin(x::Bin::Div, x, d)
    }

    /// [`Tr::rational`] in fused multiply-adds and two-instruction clamps; `Q` has no
    /// root on the clamped range, so `P / Q` takes [`Tr::recip_fast`].
    fn rational_fast(&mut self, v: V, lim: f32, p: &[f32], q: &[f32]) -> V {
        let v = self.clamp_fast(v, -lim, lim);
        let v2 = self.b.mul(v, v);
        let p = self.poly_fast(v2, p);
        let q = self.poly_fast(v2, q);
        let rq = self.recip_fast(q);
        let r = self.b.mul(p, rq);
        let y = self.b.mul(v, r);
        self.clamp_fast(y, -1.0, 1.0)
    }

    /// vmath's `sin` / `cos` / `tan` (for `|x| <= SINCOS_MAX`): the same reduction and
    /// polynomials, so the same bits; the octant's integer tests as float arithmetic on
    /// the even integer `j` (exact below 2^22), the sign by negations.
    fn trig_fn(&mut self, x: V, f: MathFn) -> V {
        let cos = f == MathFn::Cos;
        use crate::backend::cranelift::vmath::{COS_P, SINCOS_DP, SIN_P};
        let a = self.b.push(Inst::Un(x::Un::Abs, x));
        let fopi = self.b.c(std::f32::consts::FRAC_PI_4.recip());
        let t = self.b.mul(a, fopi);
        let j = self.b.push(Inst::Un(x::Un::Trunc, t));
        // h = j / 2 rounded up: the octant pair; y = 2 h.
        let half = self.b.c(0.5);
        let h = self.b.mul(j, half);
        let h = self.b.push(Inst::Un(x::Un::Ceil, h));
        let y = self.b.add(h, h);
        let mut r = a;
        for dp in SINCOS_DP {
            let d = self.b.c(dp);
            let p = self.b.mul(y, d);
            r = self.b.sub(r, p);
        }
        let z = self.b.mul(r, r);
        let p = self.poly(z, &SIN_P);
        let p = self.b.mul(p, z);
        let p = self.b.mul(p, r);
        let ps = self.b.add(p, r);
        let p = self.poly(z, &COS_P);
        let p = self.b.mul(p, z);
        let p = self.b.mul(p, z);
        let mhalf = self.b.c(-0.5);
        let hz = self.b.mul(z, mhalf);
        let p = self.b.add(p, hz);
        let one = self.b.c(1.0);
        let pc = self.b.add(p, one);
        // q = h mod 4 (j / 2 mod 4 in vmath's integers).
        let quarter = self.b.c(0.25);
        let fl = self.b.mul(h, quarter);
        let fl = self.b.push(Inst::Un(x::Un::Floor, fl));
        let four = self.b.c(4.0);
        let f4 = self.b.mul(fl, four);
        let q = self.b.sub(h, f4);
        let two = self.b.c(2.0);
        let odd = {
            let g = self.b.mul(q, half);
            let g = self.b.push(Inst::Un(x::Un::Floor, g));
            let g2 = self.b.add(g, g);
            self.b.sub(q, g2)
        };
        let swap = self.b.cmp(x::Cmp::Eq, odd, one);
        let zero = self.b.c(0.0);
        if f == MathFn::Tan {
            let num = self.b.select(swap, pc, ps);
            let den = self.b.select(swap, ps, pc);
            let t = self.b.bin(x::Bin::Div, num, den);
            let nt = self.b.push(Inst::Un(x::Un::Neg, t));
            let t = self.b.select(swap, nt, t);
            let nt = self.b.push(Inst::Un(x::Un::Neg, t));
            let neg = self.b.cmp(x::Cmp::Lt, x, zero);
            let t = self.b.select(neg, nt, t);
            let is_zero = self.b.cmp(x::Cmp::Eq, x, zero);
            return self.b.select(is_zero, x, t);
        }
        let v = if cos {
            self.b.select(swap, ps, pc)
        } else {
            self.b.select(swap, pc, ps)
        };
        let nv = self.b.push(Inst::Un(x::Un::Neg, v));
        if cos {
            // Negative in octant pairs 1 and 2.
            let q1 = self.b.cmp(x::Cmp::Eq, q, one);
            let q2 = self.b.cmp(x::Cmp::Eq, q, two);
            let flip = self.b.push(Inst::MOr(q1, q2));
            self.b.select(flip, nv, v)
        } else {
            // Negative in pairs 2 and 3, and again for a negative x; zeros as they are.
            let upper = self.b.cmp(x::Cmp::Ge, q, two);
            let v = self.b.select(upper, nv, v);
            let nv = self.b.push(Inst::Un(x::Un::Neg, v));
            let neg = self.b.cmp(x::Cmp::Lt, x, zero);
            let v = self.b.select(neg, nv, v);
            let is_zero = self.b.cmp(x::Cmp::Eq, x, zero);
            self.b.select(is_zero, x, v)
        }
    }

    /// vmath's `atan`, operation for operation.
    fn atan(&mut self, x: V) -> V {
        use crate::backend::cranelift::vmath::{ATAN_HI, ATAN_MID, ATAN_P};
        let a = self.b.push(Inst::Un(x::Un::Abs, x));
        let hi = self.b.c(ATAN_HI);
        let big = self.b.cmp(x::Cmp::Gt, a, hi);
        let mid_c = self.b.c(ATAN_MID);
        let mid = self.b.cmp(x::Cmp::Gt, a, mid_c);
        let one = self.b.c(1.0);
        let am1 = self.b.sub(a, one);
        let num = self.b.select(mid, am1, a);
        let mone = self.b.c(-1.0);
        let num = self.b.select(big, mone, num);
        let ap1 = self.b.add(a, one);
        let den = self.b.select(mid, ap1, one);
        let den = self.b.select(big, a, den);
        let t = self.b.bin(x::Bin::Div, num, den);
        let zero = self.b.c(0.0);
        let q = self.b.c(std::f32::consts::FRAC_PI_4);
        let base = self.b.select(mid, q, zero);
        let h = self.b.c(std::f32::consts::FRAC_PI_2);
        let base = self.b.select(big, h, base);
        let z = self.b.mul(t, t);
        let p = self.poly(z, &ATAN_P);
        let y = self.b.mul(p, z);
        let y = self.b.mul(y, t);
        let y = self.b.add(y, t);
        let r = self.b.add(base, y);
        let nr = self.b.push(Inst::Un(x::Un::Neg, r));
        let neg = self.b.cmp(x::Cmp::Lt, x, zero);
        let r = self.b.select(neg, nr, r);
        let is_zero = self.b.cmp(x::Cmp::Eq, x, zero);
        self.b.select(is_zero, x, r)
    }

    /// vmath's `erf` / `tanh`: `x (P(x^2) / Q(x^2))` on the clamped argument, clamped.
    fn rational(&mut self, v: V, lim: f32, p: &[f32], q: &[f32]) -> V {
        let v = self.clamp(v, -lim, lim);
        let v2 = self.b.mul(v, v);
        let p = self.poly(v2, p);
        let q = self.poly(v2, q);
        let r = self.b.bin(x::Bin::Div, p, q);
        let y = self.b.mul(v, r);
        self.clamp(y, -1.0, 1.0)
    }
}

impl Gen<'_, '_> {
    /// Emits `for var in 0..extent` (which [`Gen::qualifies`] accepted as `plan`) as a call
    /// to an AVX-512 loop when the target has one and the body translates; returns whether
    /// it did.
    pub(super) fn wide_for(
        &mut self,
        var: VarId,
        extent: u64,
        body: &[Stmt],
        plan: &Plan,
    ) -> Result<bool, String> {
        if !self.wide.enabled || extent < MIN_EXTENT {
            return Ok(false);
        }
        let Some(mut tr) = self.wide_translate(var, extent, body, plan) else {
            return Ok(false);
        };
        // Inline sin, cos and tan: one more reduction, the largest magnitude of their
        // arguments; where it exceeds vmath::SINCOS_MAX (or is NaN), the loop runs again
        // in 128-bit code, whose sin, cos and tan take libm's for such lanes. Only where a
        // second run computes the same: no reductions, and no buffer both read and
        // written (kernels' buffers never overlap in the arena otherwise).
        let guard = !tr.trig.is_empty();
        if guard {
            let stored: Vec<u16> =
                tr.b.lp
                    .insts
                    .iter()
                    .filter_map(|i| match i {
                        Inst::Store { s, .. } => Some(*s),
                        _ => None,
                    })
                    .collect();
            let loaded = tr.b.lp.insts.iter().any(|i| match i {
                Inst::Load { s, .. } | Inst::Load2 { s, .. } | Inst::LoadS { s, .. } => stored
                    .iter()
                    .any(|&w| tr.streams[w as usize].0 == tr.streams[*s as usize].0),
                _ => false,
            });
            if !plan.reds.is_empty() || loaded {
                return Ok(false);
            }
            let mut m = None;
            for v in tr.trig.clone() {
                let av = tr.b.push(Inst::Un(x::Un::Abs, v));
                m = Some(match m {
                    None => av,
                    Some(m) => tr.b.bin(x::Bin::Max, m, av),
                });
            }
            let r = tr.b.lp.reds.len();
            tr.b.lp.reds.push(x::Red::Max);
            let v = m.expect("a trig argument");
            tr.b.push(Inst::Reduce { r: r as u16, v });
        }
        // A body the generator cannot take (too many registers live, say) stays narrow.
        let Some(extra) = self.wide_emit(&tr, plan, guard)? else {
            return Ok(false);
        };
        if let Some(m) = extra {
            use crate::backend::cranelift::vmath::SINCOS_MAX;
            use cranelift_codegen::ir::condcodes::FloatCC;
            let lim = self.b.ins().f32const(SINCOS_MAX);
            let ok = self.b.ins().fcmp(FloatCC::LessThanOrEqual, m, lim);
            let again = self.b.create_block();
            let done = self.b.create_block();
            self.b.ins().brif(ok, done, &[], again, &[]);
            self.b.switch_to_block(again);
            self.wide.enabled = false;
            let r = self.serial_loop(var, extent, body);
            self.wide.enabled = true;
            r?;
            self.b.ins().jump(done, &[]);
            self.b.switch_to_block(done);
        }
        Ok(true)
    }

    /// `for r in 0..rows { var = ...; for q in 0..n { inner } }` (sets of loop-local
    /// variables, then one inner loop the 1-D path takes without reductions) as one call
    /// that walks the rows: each stream's index must be affine in `r` once the sets are
    /// substituted, and the uniforms must not depend on `r`.
    pub(super) fn wide_rows(&mut self, r: VarId, rows: u64, body: &[Stmt]) -> Result<bool, String> {
        if !self.wide.enabled || rows < 2 {
            return Ok(false);
        }
        let Some((
            Stmt::For {
                var: q,
                extent: n,
                body: inner,
            },
            sets,
        )) = body.split_last()
        else {
            return Ok(false);
        };
        if *n < MIN_ROW {
            return Ok(false);
        }
        // The sets, each in terms of what was defined before the outer loop.
        let mut defs: Vec<(VarId, Expr)> = Vec::new();
        for st in sets {
            let Stmt::Set { var: t, value } = st else {
                return Ok(false);
            };
            if *t == r || *t == *q || count_reads(&self.k.body, *t) != count_reads(body, *t) {
                return Ok(false);
            }
            let value = inline(value, &defs);
            defs.retain(|(u, _)| u != t);
            defs.push((*t, value));
        }
        // f32 lanes, or else f64 ones (a body computing in f64 may store f32 values).
        let usable = |p: &Plan| {
            p.reds.is_empty() && !p.locals.iter().any(|l| defs.iter().any(|(d, _)| d == l))
        };
        let f32 = self
            .qualifies(*q, *n, inner)
            .filter(usable)
            .and_then(|p| Some((self.wide_translate(*q, *n, inner, &p)?, p)));
        let f64 = || {
            // (Only for bodies computing in f64: an f32 body the f32 lanes refuse keeps
            // the f32x4 code, as in `vectorize_for`.)
            if !self.computes_f64(inner) {
                return None;
            }
            let p = self.qualifies_as(*q, *n, inner, Ty::F64).filter(usable)?;
            Some((self.wide_translate64(*q, *n, inner, &p)?, p))
        };
        let Some((mut tr, plan)) = f32.or_else(|| if self.wide.dq { f64() } else { None }) else {
            return Ok(false);
        };
        // Inline sin, cos and tan need their guard (one row at a time, `wide_for`).
        if !tr.trig.is_empty() {
            return Ok(false);
        }
        let mut steps = Vec::new();
        for ((_, key), elem) in tr.streams.iter_mut().zip(&tr.elem) {
            let k = inline(key, &defs);
            let Some(step) = stride(&k, r, &[]) else {
                return Ok(false);
            };
            let Some(bytes) = step.checked_mul(elem.bytes()) else {
                return Ok(false);
            };
            steps.push(bytes);
            *key = at_zero(&k, r);
        }
        for u in tr.unis.iter_mut() {
            let e = inline(u, &defs);
            if varies(&e, r, &[]) {
                return Ok(false);
            }
            *u = e;
        }
        tr.b.lp.rows = rows;
        tr.b.lp.row_step = steps;
        Ok(self.wide_emit(&tr, &plan, false)?.is_some())
    }

    /// `for var in 0..extent` whose stores are of f64 values (into f64 buffers, or
    /// converted to bytes: QLinearConv's and QLinearMatMul's requantization, which the
    /// reference computes in f64) as an AVX-512 f64 loop, 8 lanes at a time; returns
    /// whether it did. (Nothing else vectorises f64: such a loop is otherwise scalar.)
    pub(super) fn wide64_for(
        &mut self,
        var: VarId,
        extent: u64,
        body: &[Stmt],
    ) -> Result<bool, String> {
        if !self.wide.enabled || !self.wide.dq || extent < MIN_EXTENT {
            return Ok(false);
        }
        let Some(plan) = self.qualifies_as(var, extent, body, Ty::F64) else {
            return Ok(false);
        };
        let Some(tr) = self.wide_translate64(var, extent, body, &plan) else {
            return Ok(false);
        };
        Ok(self.wide_emit(&tr, &plan, false)?.is_some())
    }

    /// [`Gen::wide_translate`] for a loop of f64 lanes ([`Gen::qualifies_as`] F64).
    fn wide_translate64(&self, var: VarId, extent: u64, body: &[Stmt], plan: &Plan) -> Option<Tr> {
        if !plan.reds.is_empty() {
            return None;
        }
        let mut t = Tr {
            b: Builder::new(extent),
            exact: true,
            dq: self.wide.dq,
            avx2: self.wide.avx2,
            var,
            locals: plan.locals.clone(),
            vals: HashMap::new(),
            gates: HashMap::new(),
            streams: Vec::new(),
            elem: Vec::new(),
            unis: Vec::new(),
            trig: Vec::new(),
            defs: Vec::new(),
            f32_defs: HashMap::new(),
        };
        t.b.lp.f64 = true;
        for s in body {
            match s {
                Stmt::Set { var: local, value }
                    if matches!(self.ty(value).ok()?, Ty::F64 | Ty::F32) =>
                {
                    let value = inline(value, &t.defs);
                    let v = self.wexpr64(&mut t, &value)?;
                    t.vals.insert(*local, v);
                }
                // Integer locals (the i32 product an element converts) are inlined.
                Stmt::Set { var: local, value } => {
                    let def = inline(value, &t.defs);
                    t.defs.push((*local, def));
                }
                Stmt::Store { buf, index, value } => {
                    let to = self.p.buffers[*buf].elem;
                    let value = &inline(value, &t.defs);
                    let (elem, x) = match to {
                        Ty::F64 => (x::Elem::F64, value),
                        Ty::F32 if self.ty(value).ok()? == Ty::F32 => (x::Elem::F32, value),
                        Ty::U8 => (x::Elem::U8, self.byte_store_value(to, value, Ty::F64)?),
                        Ty::I8 => (x::Elem::I8, self.byte_store_value(to, value, Ty::F64)?),
                        _ => return None,
                    };
                    let v = self.wexpr64(&mut t, x)?;
                    if t.is_mask(v) || stride(index, var, &t.locals)? != 1 {
                        return None;
                    }
                    let (s, disp) = t.stream(*buf, index, elem)?;
                    t.b.push(Inst::Store {
                        s,
                        disp,
                        v,
                        step: 1,
                    });
                }
                _ => return None,
            }
        }
        t.b.lp.streams = u16::try_from(t.streams.len()).ok()?;
        t.b.lp.elem = t.elem.clone();
        t.b.lp.unis = u16::try_from(t.unis.len()).ok()?;
        Some(t)
    }

    /// `e` as a value of an f64 loop: f64 vectors (loop-invariant ones as uniforms,
    /// computed by the caller) and masks; `None` for what the f64 loops do not do. f32
    /// values are f64 lanes holding f32 values: each f32 operation is done in f64 and
    /// rounded to f32 ([`x::Un::ToF32`]), which gives the f32 operation's bits.
    fn wexpr64(&self, t: &mut Tr, e: &Expr) -> Option<V> {
        let ty = self.ty(e).ok()?;
        if !varies(e, t.var, &t.locals) {
            return match ty {
                Ty::F64 => t.uniform(e),
                Ty::F32 => t.uniform(&Expr::cast(Ty::F64, e.clone())),
                _ => None,
            };
        }
        let float = matches!(ty, Ty::F64 | Ty::F32);
        let to_f32 = |t: &mut Tr, v: V| {
            if ty == Ty::F32 {
                t.b.push(Inst::Un(x::Un::ToF32, v))
            } else {
                v
            }
        };
        // Operands that must be vectors, not masks.
        let vec = |t: &mut Tr, e: &Expr| -> Option<V> {
            let v = self.wexpr64(t, e)?;
            (!t.is_mask(v)).then_some(v)
        };
        Some(match e {
            Expr::Var(v) => *t.vals.get(v)?,
            Expr::Load(buf, idx) if self.p.buffers[*buf].elem == Ty::F64 => {
                self.wload(t, *buf, idx, x::Elem::F64)?
            }
            Expr::Load(buf, idx) if self.p.buffers[*buf].elem == Ty::F32 => {
                self.wload(t, *buf, idx, x::Elem::F32)?
            }
            Expr::Cast(Ty::F64, a) if matches!(self.ty(a).ok()?, Ty::F64 | Ty::F32) => {
                self.wexpr64(t, a)?
            }
            Expr::Cast(Ty::F32, a) if matches!(self.ty(a).ok()?, Ty::F64 | Ty::F32) => {
                let v = vec(t, a)?;
                to_f32(t, v)
            }
            // A byte made from an f64 (`u8(i64(x))`, as a byte store takes it), as a float.
            // (No other arm takes such a cast: `None` here is the answer.)
            Expr::Cast(Ty::F64 | Ty::F32, a) if matches!(&**a, Expr::Cast(Ty::U8 | Ty::I8, _)) => {
                let to = self.ty(a).ok()?;
                let x = self.byte_store_value(to, a, Ty::F64)?;
                let v = vec(t, x)?;
                let op = if to == Ty::U8 {
                    x::Un::ByteU8
                } else {
                    x::Un::ByteI8
                };
                t.b.push(Inst::Un(op, v))
            }
            // 32-bit and 8-bit integers read at unit stride, converted (exactly).
            Expr::Cast(Ty::F64, a) => {
                let Expr::Load(buf, idx) = &**a else {
                    return None;
                };
                let elem = match self.p.buffers[*buf].elem {
                    Ty::I32 => x::Elem::I32,
                    Ty::U8 => x::Elem::U8,
                    Ty::I8 => x::Elem::I8,
                    _ => return None,
                };
                self.wload(t, *buf, idx, elem)?
            }
            Expr::Un(op, a) if float => {
                let op = wide_un(*op)?;
                let v = vec(t, a)?;
                let v = t.b.push(Inst::Un(op, v));
                if op == x::Un::Sqrt {
                    to_f32(t, v)
                } else {
                    v
                }
            }
            Expr::Bin(op, a, b) if float => {
                let op = match op {
                    BinOp::Add => x::Bin::Add,
                    BinOp::Sub => x::Bin::Sub,
                    BinOp::Mul => x::Bin::Mul,
                    BinOp::Div => x::Bin::Div,
                    _ => return None,
                };
                let va = vec(t, a)?;
                let vb = vec(t, b)?;
                let v = t.b.bin(op, va, vb);
                to_f32(t, v)
            }
            Expr::Select(c, a, b) if float => {
                let va = vec(t, a)?;
                let vb = vec(t, b)?;
                if let Some(max) = select_minmax(c, a, b) {
                    let op = if max { x::Bin::MaxX } else { x::Bin::MinX };
                    return Some(t.b.bin(op, va, vb));
                }
                let vc = self.wexpr64(t, c)?;
                if !t.is_mask(vc) {
                    return None;
                }
                t.b.select(vc, va, vb)
            }
            Expr::Cmp(op, a, b) if matches!(self.ty(a).ok()?, Ty::F64 | Ty::F32) => {
                let op = wide_cmp(*op);
                let va = vec(t, a)?;
                let vb = vec(t, b)?;
                t.b.cmp(op, va, vb)
            }
            Expr::Bin(op @ (BinOp::And | BinOp::Or), a, b) if ty == Ty::U8 => {
                let va = self.wexpr64(t, a)?;
                let vb = self.wexpr64(t, b)?;
                t.mask_logic(*op == BinOp::And, va, vb)?
            }
            _ => return None,
        })
    }

    /// The loop `tr` translated as a function (named after this kernel; identical loops
    /// share one) and a call to it, or `None` (nothing emitted) when the generator
    /// cannot take the body; with `guard`, the call's extra reduction (see
    /// [`Gen::wide_call`]).
    fn wide_emit(
        &mut self,
        tr: &Tr,
        plan: &Plan,
        guard: bool,
    ) -> Result<Option<Option<cranelift_codegen::ir::Value>>, String> {
        let Some(code) = generate_logged(&self.fname, &tr.b.lp, self.wide.avx2) else {
            return Ok(None);
        };
        let func = self.wide.func(self.module, code, &self.fname)?;
        let extra = self.wide_call(func, &tr.b.lp, &tr.streams, &tr.unis, plan, guard)?;
        Ok(Some(extra))
    }

    /// Calls `func` (made for `lp`) with its args block: the streams' base addresses, the
    /// uniforms, the reductions' starting values; then folds the reductions. With
    /// `guard`, `lp` has one reduction past the plan's (a maximum from 0), whose result
    /// it returns.
    fn wide_call(
        &mut self,
        func: FuncId,
        lp: &x::Loop,
        streams: &[(BufId, Expr)],
        unis: &[Expr],
        plan: &Plan,
        guard: bool,
    ) -> Result<Option<cranelift_codegen::ir::Value>, String> {
        let lay = lp.layout();
        let ptr = self.module.isa().pointer_type();
        let ss = self.b.create_sized_stack_slot(StackSlotData::new(
            StackSlotKind::ExplicitSlot,
            lay.bytes.max(8) as u32,
            6,
        ));
        for (s, (buf, key)) in streams.iter().enumerate() {
            let a = self.addr(*buf, key)?;
            self.b.ins().stack_store(ptr, a, ss, lay.stream(s) as i32);
        }
        for (u, e) in unis.iter().enumerate() {
            let v = self.expr(e)?;
            self.b.ins().stack_store(ptr, v, ss, lay.uni(u) as i32);
        }
        for (r, red) in plan.reds.iter().enumerate() {
            let init = if red.kind == RedKind::Add {
                self.b.ins().f32const(0.0)
            } else {
                self.b.use_var(self.vars[red.acc])
            };
            self.b.ins().stack_store(ptr, init, ss, lay.red(r) as i32);
        }
        let g = plan.reds.len();
        if guard {
            let zero = self.b.ins().f32const(0.0);
            self.b.ins().stack_store(ptr, zero, ss, lay.red(g) as i32);
        }
        let args = self.b.ins().stack_addr(ptr, ss, 0);
        let fr = self.module.declare_func_in_func(func, self.b.func);
        self.b.ins().call(fr, &[args]);
        // Each reduction's lanes, folded by the loop into lane 0, into its variable.
        for (r, red) in plan.reds.iter().enumerate() {
            let lane = self
                .b
                .ins()
                .stack_load(ptr, types::F32, ss, lay.red(r) as i32);
            let acc = self.b.use_var(self.vars[red.acc]);
            let acc = self.combine(red.kind, acc, lane);
            self.b.def_var(self.vars[red.acc], acc);
        }
        Ok(guard.then(|| {
            self.b
                .ins()
                .stack_load(ptr, types::F32, ss, lay.red(g) as i32)
        }))
    }

    fn wide_translate(&self, var: VarId, extent: u64, body: &[Stmt], plan: &Plan) -> Option<Tr> {
        let mut t = Tr {
            b: Builder::new(extent),
            exact: self.wide.exact,
            dq: self.wide.dq,
            avx2: self.wide.avx2,
            var,
            locals: plan.locals.clone(),
            vals: HashMap::new(),
            gates: if self.wide.exact {
                HashMap::new()
            } else {
                silu_gates(body)
            },
            streams: Vec::new(),
            elem: Vec::new(),
            unis: Vec::new(),
            trig: Vec::new(),
            defs: Vec::new(),
            f32_defs: HashMap::new(),
        };
        for s in body {
            match s {
                Stmt::Set { var: acc, .. } if plan.reds.iter().any(|r| r.acc == *acc) => {
                    let r = plan.reds.iter().position(|r| r.acc == *acc)?;
                    let red = &plan.reds[r];
                    let e = inline(&red.e, &t.defs);
                    let v = self.wexpr(&mut t, &e)?;
                    if t.is_mask(v) {
                        return None;
                    }
                    // Reductions are numbered in plan order.
                    while t.b.lp.reds.len() <= r {
                        t.b.lp.reds.push(x::Red::Add);
                    }
                    t.b.lp.reds[r] = match red.kind {
                        RedKind::Add => x::Red::Add,
                        RedKind::Max => x::Red::Max,
                        RedKind::Min => x::Red::Min,
                        RedKind::SelGt => x::Red::SelGt,
                        RedKind::SelLt => x::Red::SelLt,
                    };
                    t.b.push(Inst::Reduce { r: r as u16, v });
                }
                Stmt::Set { var: local, .. } if t.gates.contains_key(local) => {}
                Stmt::Set { var: local, value }
                    if !matches!(self.ty(value).ok()?, Ty::F32 | Ty::I64) =>
                {
                    let def = inline(value, &t.defs);
                    t.defs.push((*local, def));
                }
                Stmt::Set { var: local, value } => {
                    let value = inline(value, &t.defs);
                    let v = self.wexpr(&mut t, &value)?;
                    t.vals.insert(*local, v);
                    if !varies(&value, t.var, &t.locals) {
                        t.f32_defs.insert(*local, value);
                    }
                }
                Stmt::Store { buf, index, value } => {
                    let to = self.p.buffers[*buf].elem;
                    let value = &inline(value, &t.defs);
                    let (elem, v) = match self.int_copy_value(to, value) {
                        // Bytes through f32 lanes, exactly (Plan::int_copy).
                        Some((src, sidx)) if matches!(to, Ty::U8 | Ty::I8) => {
                            let e = self.stream_elem(*buf)?;
                            (e, self.wload(&mut t, src, sidx, e)?)
                        }
                        // 32-bit integers moved as f32 lanes, bit for bit (Plan::int_copy).
                        Some((src, sidx)) => {
                            (x::Elem::F32, self.wload(&mut t, src, sidx, x::Elem::F32)?)
                        }
                        None => {
                            let elem = self.stream_elem(*buf)?;
                            // Bytes: the f32 value converted (truncated: a rounding).
                            let v = match elem {
                                x::Elem::F32 | x::Elem::F16 => self.wexpr(&mut t, value)?,
                                _ => {
                                    let value = self.byte_store_value(to, value, Ty::F32)?;
                                    self.wexpr_rounded(&mut t, value, true)?
                                }
                            };
                            if t.is_mask(v) {
                                return None;
                            }
                            (elem, v)
                        }
                    };
                    let byte = matches!(elem, x::Elem::U8 | x::Elem::I8);
                    let step = match stride(index, var, &t.locals)? {
                        st @ (1 | 2 | 4) if elem == x::Elem::F32 || st == 1 => st as u8,
                        4 if byte => 4,
                        _ => return None,
                    };
                    let (s, disp) = t.stream(*buf, index, elem)?;
                    t.b.push(Inst::Store { s, disp, v, step });
                }
                _ => return None,
            }
        }
        // Every reduction of the plan must have been met (it always is: qualifies found
        // them in this body).
        if t.b.lp.reds.len() != plan.reds.len() {
            return None;
        }
        t.b.lp.streams = u16::try_from(t.streams.len()).ok()?;
        t.b.lp.elem = t.elem.clone();
        t.b.lp.unis = u16::try_from(t.unis.len()).ok()?;
        Some(t)
    }

    /// The value of uniform `v` when it is an f32 element of a constant buffer at a
    /// constant index (a scalar weight), read from the object's data.
    fn const_uniform(&self, t: &Tr, v: V) -> Option<f32> {
        let Inst::Uni(u) = t.b.lp.insts[v as usize] else {
            return None;
        };
        self.const_f32(&t.unis[u as usize])
    }

    /// The value of `e` when it is an f32 literal or an f32 element of a constant buffer
    /// at a constant index.
    fn const_f32(&self, e: &Expr) -> Option<f32> {
        let (buf, idx) = match e {
            Expr::Float(c, Ty::F32) => return Some(*c as f32),
            Expr::Load(buf, idx) => (buf, idx),
            _ => return None,
        };
        let (Expr::Int(i), crate::kir::BufKind::Const { data }) =
            (&**idx, &self.p.buffers[*buf].kind)
        else {
            return None;
        };
        if self.p.buffers[*buf].elem != Ty::F32 {
            return None;
        }
        let at = usize::try_from(*i).ok()?.checked_mul(4)?;
        let bytes = data.get(at..at + 4)?;
        Some(f32::from_le_bytes(bytes.try_into().ok()?))
    }

    /// The value of an f32 comparison of two constants ([`Gen::const_f32`]): a Max or
    /// Min node's NaN test of its scalar weight, `c != c`.
    fn const_cmp(&self, c: &Expr) -> Option<bool> {
        let Expr::Cmp(op, a, b) = c else {
            return None;
        };
        let (a, b) = (self.const_f32(a)?, self.const_f32(b)?);
        Some(match op {
            CmpOp::Eq => a == b,
            CmpOp::Ne => a != b,
            CmpOp::Lt => a < b,
            CmpOp::Le => a <= b,
            CmpOp::Gt => a > b,
            CmpOp::Ge => a >= b,
        })
    }

    /// For `a (+|-) b` with a loop-varying f32 product on one side: (whether the product
    /// is `b`, its factors, the other operand). The right side is preferred (sum chains
    /// are `(... + x y) + x' y'`).
    fn product<'e>(
        &self,
        t: &Tr,
        a: &'e Expr,
        b: &'e Expr,
    ) -> Option<(bool, &'e Expr, &'e Expr, &'e Expr)> {
        let prod = |e: &'e Expr| match e {
            Expr::Bin(BinOp::Mul, x, y)
                if varies(e, t.var, &t.locals) && self.ty(e).ok() == Some(Ty::F32) =>
            {
                Some((&**x, &**y))
            }
            _ => None,
        };
        if let Some((x, y)) = prod(b) {
            return Some((true, x, y, a));
        }
        prod(a).map(|(x, y)| (false, x, y, b))
    }

    /// `e` as the operand of a rounding (floor, ceil, nearest, trunc, a conversion to
    /// bytes): a quotient there is the division's own, never the product by the
    /// divisor's reciprocal, whose last-bit difference moves a value across a rounding
    /// boundary (QuantizeLinear's `round(x / 0.02)` of x = 2.21: 110.50001 rounds to
    /// 111, 2.21 * 50 = 110.49999 to 110, a step off the reference).
    ///
    /// Under `near` (a Nearest, a Trunc or a byte conversion), by a divisor the loop does
    /// not change and known to lie in [2^-100, 2^100] in magnitude (a quantization
    /// scale), the quotient is Markstein's: with `r = 1 / d` (rounded, once per call),
    /// `q0 = a r`, the residual `e = a - q0 d` (exact, by an FMA) and `q = q0 + e r` (one
    /// FMA) is the correctly rounded `a / d` (Markstein's theorem: `r` within half an ulp
    /// of `1 / d`, `q0` within an ulp of `a / d`). Where `e` is 0 (`q0` is exact, and
    /// keeps the sign of a zero) or `q` NaN (`a` or `q0` infinite), `q0`. Only a residual
    /// below the normal range makes it an ulp off, for `|a| < 2^-100` and `|a / d| <
    /// 2^-2` (measured: `tests::markstein_quotient_is_the_division`), which Nearest and
    /// Trunc take to the same signed zero (a subnormal quotient may become 0, which
    /// Floor and Ceil would not take alike). A product, two FMAs, two compares and a blend instead of `vdivps`:
    /// QuantizeLinear on 64x56x56 0.038-0.041 -> 0.034-0.036 ms.
    fn wexpr_rounded(&self, t: &mut Tr, e: &Expr, near: bool) -> Option<V> {
        match e {
            Expr::Bin(BinOp::Div, a, d) if self.ty(e).ok()? == Ty::F32 => {
                let va = self.wexpr(t, a)?;
                let vd = self.wexpr(t, d)?;
                if t.is_mask(va) || t.is_mask(vd) {
                    return None;
                }
                // A local divisor by its definition (QuantizeLinear's `s = scale[0]`).
                let d = match &**d {
                    Expr::Var(v) => t.f32_defs.get(v).cloned().unwrap_or_else(|| (**d).clone()),
                    _ => (**d).clone(),
                };
                if !near || varies(&d, t.var, &t.locals) || !self.divisor_in_range(&d) {
                    return Some(t.b.bin(x::Bin::Div, va, vd));
                }
                let r = match self.const_f32(&d) {
                    Some(c) => t.b.c(1.0 / c),
                    None => t.uniform(&Expr::bin(BinOp::Div, Expr::f(1.0, Ty::F32), d))?,
                };
                let q0 = t.b.mul(va, r);
                let res = t.b.push(Inst::Fma(x::FmaKind::NegMulAdd, q0, vd, va));
                let q = t.b.push(Inst::Fma(x::FmaKind::Add, res, r, q0));
                let zero = t.b.c(0.0);
                let exact = t.b.cmp(x::Cmp::Eq, res, zero);
                let nan = t.b.cmp(x::Cmp::Ne, q, q);
                let keep = t.mask_logic(false, exact, nan)?;
                Some(t.b.select(keep, q0, q))
            }
            _ => self.wexpr(t, e),
        }
    }

    /// Whether every value `d` can take is an f32 of magnitude in [2^-100, 2^100]: a
    /// literal, or an element of a constant buffer whose elements all are (see
    /// [`Gen::wexpr_rounded`]).
    fn divisor_in_range(&self, d: &Expr) -> bool {
        let ok = |x: f32| (2f32.powi(-100)..=2f32.powi(100)).contains(&x.abs());
        match d {
            Expr::Float(c, Ty::F32) => ok(*c as f32),
            Expr::Load(buf, _) => match &self.p.buffers[*buf].kind {
                crate::kir::BufKind::Const { data } if self.p.buffers[*buf].elem == Ty::F32 => {
                    !data.is_empty()
                        && data
                            .chunks_exact(4)
                            .all(|b| ok(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                }
                _ => false,
            },
            _ => false,
        }
    }

    /// The stream element type of `buf`'s elements, if the wide loops read and write
    /// such streams.
    fn stream_elem(&self, buf: BufId) -> Option<x::Elem> {
        Some(match self.p.buffers[buf].elem {
            Ty::F32 => x::Elem::F32,
            Ty::F16 => x::Elem::F16,
            Ty::U8 => x::Elem::U8,
            Ty::I8 => x::Elem::I8,
            _ => return None,
        })
    }

    /// `buf[idx]` as a wide value, its elements read as `elem` (f16 only at unit stride,
    /// bytes at strides 1 and 2).
    fn wload(&self, t: &mut Tr, buf: BufId, idx: &Expr, elem: x::Elem) -> Option<V> {
        let byte = matches!(elem, x::Elem::U8 | x::Elem::I8);
        Some(match stride(idx, t.var, &t.locals)? {
            1 => {
                let (s, disp) = t.stream(buf, idx, elem)?;
                t.b.load(s, disp)
            }
            2 if byte || elem == x::Elem::F32 => {
                let (s, disp) = t.stream(buf, idx, elem)?;
                t.b.load2(s, disp)
            }
            _ if elem != x::Elem::F32 => return None,
            st => {
                let st = i32::try_from(st).ok()?;
                let (s, disp) = t.stream(buf, idx, x::Elem::F32)?;
                t.b.load_strided(s, disp, st)
            }
        })
    }

    /// `e` as a wide value: f32 vectors, masks for f32 comparisons; `None` for what the
    /// generator does not do (gathers, integer arithmetic, libm calls).
    fn wexpr(&self, t: &mut Tr, e: &Expr) -> Option<V> {
        if !varies(e, t.var, &t.locals) {
            if let Expr::Float(c, Ty::F32) = e {
                return Some(t.b.c(*c as f32));
            }
            if self.ty(e).ok()? != Ty::F32 {
                return None;
            }
            return t.uniform(e);
        }
        let ty = self.ty(e).ok()?;
        Some(match e {
            Expr::Var(v) => *t.vals.get(v)?,
            Expr::Load(buf, idx) => {
                let elem = self.stream_elem(*buf)?;
                if ty != Ty::F32 || !matches!(elem, x::Elem::F32 | x::Elem::F16) {
                    return None;
                }
                self.wload(t, *buf, idx, elem)?
            }
            Expr::Un(op, a) if ty == Ty::F32 => {
                // Nearest and Trunc (as bytes do) take a tiny quotient's last-ulp
                // difference without a change (see [`Gen::wexpr_rounded`]); Floor and
                // Ceil of a tiny quotient are 0 or +-1 by its zero-ness.
                let near = matches!(op, UnOp::Nearest | UnOp::Trunc);
                let op = wide_un(*op)?;
                let v = self.wexpr_rounded(t, a, near)?;
                if t.is_mask(v) {
                    return None;
                }
                t.b.push(Inst::Un(op, v))
            }
            Expr::Bin(op @ (BinOp::Add | BinOp::Sub), a, b)
                if ty == Ty::F32 && !t.exact && self.product(t, a, b).is_some() =>
            {
                // a + x y, x y + b, a - x y, x y - b: one fused multiply-add.
                let (prod_right, x, y, other) = self.product(t, a, b)?;
                let vx = self.wexpr(t, x)?;
                let vy = self.wexpr(t, y)?;
                let vo = self.wexpr(t, other)?;
                if t.is_mask(vx) || t.is_mask(vy) || t.is_mask(vo) {
                    return None;
                }
                let kind = match (op, prod_right) {
                    (BinOp::Add, _) => x::FmaKind::Add,
                    (_, true) => x::FmaKind::NegMulAdd,
                    (_, false) => x::FmaKind::Sub,
                };
                t.b.push(Inst::Fma(kind, vx, vy, vo))
            }
            Expr::Bin(BinOp::Mul, a, b)
                if ty == Ty::F32
                    && (gate_product(&t.gates, a, b).is_some()
                        || !t.exact && silu_of(a, b).is_some()) =>
            {
                // SiLU: an elementwise one's `x * s` (a gate local), or the epilogues'
                // inline `x * (1 / (1 + exp(-x)))`.
                let vx = match gate_product(&t.gates, a, b) {
                    Some(x) => self.wexpr(t, &Expr::Var(x))?,
                    None => self.wexpr(t, silu_of(a, b)?)?,
                };
                if t.is_mask(vx) {
                    return None;
                }
                t.silu_fast(vx)
            }
            Expr::Bin(BinOp::Div, a, d)
                if ty == Ty::F32 && !t.exact && exp_of_one_plus(d).is_some() =>
            {
                // a / (1 + exp(e)) (sigmoid, SiLU): e^e below the smallest normal needs
                // no flush (1 + it is 1), and the division instruction: on Zen 4 its
                // unit runs beside the FMA pipes, where a 14-bit reciprocal and a Newton
                // step took four instructions.
                let e = exp_of_one_plus(d)?;
                let va = self.wexpr(t, a)?;
                let ve = self.wexpr(t, e)?;
                if t.is_mask(va) || t.is_mask(ve) {
                    return None;
                }
                let ex = t.exp_fast_raw(ve);
                let one = t.b.c(1.0);
                let vd = t.b.add(ex, one);
                t.b.bin(x::Bin::Div, va, vd)
            }
            Expr::Bin(op, a, b) if ty == Ty::F32 => {
                let op = match op {
                    BinOp::Add => x::Bin::Add,
                    BinOp::Sub => x::Bin::Sub,
                    BinOp::Mul => x::Bin::Mul,
                    BinOp::Div => x::Bin::Div,
                    BinOp::Min => x::Bin::Min,
                    BinOp::Max => x::Bin::Max,
                    _ => return None,
                };
                let va = self.wexpr(t, a)?;
                let vb = self.wexpr(t, b)?;
                if t.is_mask(va) || t.is_mask(vb) {
                    return None;
                }
                // A division by a weight known at compile time (GELU's `x / sqrt(2)`):
                // a multiplication by its reciprocal, within an ulp or so of the quotient,
                // instead of a division (several cycles per vector on Zen 4's divider).
                if op == x::Bin::Div && !t.exact {
                    if let Some(r) = self.const_uniform(t, vb).map(|c| 1.0 / c) {
                        if r.is_normal() {
                            let vr = t.b.c(r);
                            return Some(t.b.bin(x::Bin::Mul, va, vr));
                        }
                    }
                }
                t.b.bin(op, va, vb)
            }
            Expr::Cmp(op, a, b) if self.ty(a).ok()? == Ty::F32 => {
                let op = wide_cmp(*op);
                let va = self.wexpr(t, a)?;
                let vb = self.wexpr(t, b)?;
                if t.is_mask(va) || t.is_mask(vb) {
                    return None;
                }
                t.b.cmp(op, va, vb)
            }
            Expr::Bin(op @ (BinOp::And | BinOp::Or), a, b) if ty == Ty::U8 => {
                let va = self.wexpr(t, a)?;
                let vb = self.wexpr(t, b)?;
                t.mask_logic(*op == BinOp::And, va, vb)?
            }
            Expr::Select(c, a, b) if ty == Ty::F32 && !varies(c, t.var, &t.locals) => {
                // A loop-invariant condition (a Max or Min node's NaN test of a scalar
                // operand): the branch it takes where it compares constants, else a mask
                // from the condition as a uniform 1 or 0 (computed once per call).
                if let Some(take) = self.const_cmp(c) {
                    return self.wexpr(t, if take { a } else { b });
                }
                let one_zero =
                    Expr::select((**c).clone(), Expr::f(1.0, Ty::F32), Expr::f(0.0, Ty::F32));
                let vu = self.wexpr(t, &one_zero)?;
                let va = self.wexpr(t, a)?;
                let vb = self.wexpr(t, b)?;
                if t.is_mask(va) || t.is_mask(vb) || t.is_mask(vu) {
                    return None;
                }
                let zero = t.b.c(0.0);
                let vc = t.b.cmp(x::Cmp::Ne, vu, zero);
                t.b.select(vc, va, vb)
            }
            Expr::Select(c, a, b) if ty == Ty::F32 => {
                let va = self.wexpr(t, a)?;
                let vb = self.wexpr(t, b)?;
                if t.is_mask(va) || t.is_mask(vb) {
                    return None;
                }
                if let Some(max) = nan_skip(c, a, b).filter(|_| !t.exact && t.dq) {
                    let op = if max { x::Bin::MaxNum } else { x::Bin::MinNum };
                    return Some(t.b.bin(op, va, vb));
                }
                if let Some(max) = select_minmax(c, a, b) {
                    let op = if max { x::Bin::MaxX } else { x::Bin::MinX };
                    return Some(t.b.bin(op, va, vb));
                }
                let vc = self.wexpr(t, c)?;
                if !t.is_mask(vc) {
                    return None;
                }
                t.b.select(vc, va, vb)
            }
            Expr::Cast(Ty::F32, a) if self.ty(a).ok()? == Ty::F32 => self.wexpr(t, a)?,
            // Bytes read at unit stride or every other one, widened.
            Expr::Cast(Ty::F32, a)
                if matches!(&**a, Expr::Load(buf, idx)
                    if matches!(self.stream_elem(*buf), Some(x::Elem::U8 | x::Elem::I8))
                        && matches!(stride(idx, t.var, &t.locals), Some(1 | 2))) =>
            {
                let Expr::Load(buf, idx) = &**a else {
                    return None;
                };
                self.wload(t, *buf, idx, self.stream_elem(*buf)?)?
            }
            // 32-bit integers read at unit stride, converted.
            Expr::Cast(Ty::F32, a) if matches!(&**a, Expr::Load(buf, _) if self.p.buffers[*buf].elem == Ty::I32) =>
            {
                let Expr::Load(buf, idx) = &**a else {
                    return None;
                };
                if stride(idx, t.var, &t.locals) != Some(1) {
                    return None;
                }
                let (s, disp) = t.stream(*buf, idx, x::Elem::I32)?;
                t.b.load(s, disp)
            }
            Expr::Cast(Ty::F32, a) if self.ty(a).ok()? == Ty::U8 => {
                // A comparison as 1.0 or 0.0 (Sign's `(x > 0) - (x < 0)`).
                let m = self.wexpr(t, a)?;
                if !t.is_mask(m) {
                    return None;
                }
                let one = t.b.c(1.0);
                let zero = t.b.c(0.0);
                t.b.select(m, one, zero)
            }
            Expr::Call(f, args) if ty == Ty::F32 && args.len() == 1 => {
                use crate::backend::cranelift::vmath::{ERF_P, ERF_Q, TANH_CLAMP, TANH_P, TANH_Q};
                let v = self.wexpr(t, &args[0])?;
                if t.is_mask(v) {
                    return None;
                }
                match (f, t.exact) {
                    (MathFn::Exp, true) => t.exp(v),
                    (MathFn::Exp, false) => t.exp_fast(v),
                    (MathFn::Log, exact) => t.log(v, !exact),
                    (MathFn::Erf, true) => t.rational(v, 4.0, &ERF_P, &ERF_Q),
                    (MathFn::Erf, false) => t.rational_fast(v, 4.0, &ERF_P, &ERF_Q),
                    (MathFn::Tanh, true) => t.rational(v, TANH_CLAMP, &TANH_P, &TANH_Q),
                    (MathFn::Tanh, false) => t.rational_fast(v, TANH_CLAMP, &TANH_P, &TANH_Q),
                    (MathFn::Atan, _) => t.atan(v),
                    (MathFn::Sin | MathFn::Cos | MathFn::Tan, _) => {
                        t.trig.push(v);
                        t.trig_fn(v, *f)
                    }
                    _ => return None,
                }
            }
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    /// [`super::Gen::wexpr_rounded`]'s quotient by a divisor in [2^-100, 2^100], as the
    /// loop computes it (the AVX-512 FMAs round once, as `mul_add`).
    fn quotient(a: f32, d: f32) -> f32 {
        let r = 1.0 / d;
        let q0 = a * r;
        let e = (-q0).mul_add(d, a);
        let q = e.mul_add(r, q0);
        if e == 0.0 || q.is_nan() {
            q0
        } else {
            q
        }
    }

    /// The quotient is the division's, bit for bit, for divisors of either sign in the
    /// range and dividends of every exponent, zero, infinity and NaN, except for
    /// dividends below 2^-100, whose quotients (below 2^-2) may be an ulp off with the
    /// same sign: Nearest and Trunc give the same signed zero.
    #[test]
    fn markstein_quotient_is_the_division() {
        let mut st: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st
        };
        let special = [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            1e-45,
        ];
        for i in 0..2_000_000u64 {
            let (x, y) = (next(), next());
            // Biased exponents 27..=227: magnitudes 2^-100 ..= 2^100 (and below 2^101).
            let exp = (y >> 40) % 201 + 27;
            let d = f32::from_bits(
                ((y >> 63) as u32) << 31 | (exp as u32) << 23 | (y as u32 & 0x7f_ffff),
            );
            let a = match i % 16 {
                0 => special[(x % special.len() as u64) as usize],
                // Quantization-like: an integer times a scale.
                1..=4 => ((x % 2_000_001) as f32 - 1e6) * d * 0.5,
                _ => f32::from_bits(x as u32),
            };
            let (want, got) = (a / d, quotient(a, d));
            let same = want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan());
            let tiny = a.abs() < 2f32.powi(-100)
                && want.abs() < 0.25
                && got.abs() < 0.25
                && want.is_sign_negative() == got.is_sign_negative();
            assert!(same || tiny, "{a:e} / {d:e}: {want:e}, got {got:e}");
        }
    }
}
