//! Inline f32 `exp`, `log`, `erf`, `tanh`, `atan`, `sin`, `cos` and `tan` for scalars and
//! f32x4 vectors, so vectorised loops (softmax, GELU, sigmoid, SiLU, tanh, softplus, Mish,
//! trigonometry) do not call libm lane by lane. The same code serves scalar remainders, so
//! every lane of a loop gets the same answer.
//!
//! Only plain arithmetic, compare-and-select and integer bit operations are used (no FMA, no
//! rounding instructions), so the results are identical on every target.
//!
//! - `exp`: Cephes' `expf` (the polynomial of sse_mathfun): `x = n ln2 + r` with n
//!   rounded by the 1.5 * 2^23 trick, a degree-5 polynomial for `e^r`, and `2^n` built in
//!   the exponent bits as two factors, so results from the smallest normal up
//!   to overflow come out right. About 1 ulp on the normal range; results that would be
//!   subnormal flush to 0 (so `exp(-inf) = 0`), `exp(inf) = inf`, NaN stays NaN.
//! - `log`: Cephes' `logf`: `x = m 2^e` with `m` in `[sqrt(1/2), sqrt(2))` (taken from
//!   the bits; subnormals are scaled by 2^23 first), `log(m)` as `m - m^2/2 + m^3 P(m)`
//!   for `m - 1`, plus `e ln 2` in two parts. About 1 ulp; `log(0) = -inf`,
//!   `log(inf) = inf`, negative arguments give NaN, NaN stays NaN.
//! - `erf`: the rational approximation of Eigen and XLA on `[-4, 4]` (beyond it erf is
//!   +-1 in f32), a few ulp.
//! - `tanh`: Eigen's rational approximation on `[-7.905, 7.905]` (beyond it tanh is
//!   +-1 in f32), a few ulp; odd, so small arguments keep their relative accuracy.
//! - `sin`, `cos`, `tan`: Cephes' `sinf` / `cosf` (tan as their quotient): `|x| = j pi/4 + r` with `j` even (`|x| 4/pi`
//!   truncated, rounded up to even) and `r` by three-part Cody-Waite subtraction (exact
//!   products for `|x| <=` [`SINCOS_MAX`]), the sine or cosine polynomial of `r` by the
//!   octant, the sign from the octant (and, for sin, `x`). A few ulp up to
//!   [`SINCOS_MAX`] (sin keeps its relative accuracy near 0); beyond it the products lose
//!   bits, so callers take libm's `sinf` / `cosf` / `tanf` there (`Gen::guarded_trig`: a branch
//!   per value or vector, not taken on ordinary arguments). NaN stays NaN.
//! - `atan`: Cephes' `atanf`: `|x|` above `tan(3 pi / 8)` as `pi/2 + atan(-1/|x|)`,
//!   above `tan(pi / 8)` as `pi/4 + atan((|x| - 1) / (|x| + 1))` (one division either
//!   way), then `t + t z P(z)` for `z = t^2`, the sign restored; about 2 ulp over the
//!   whole range, `atan(+-inf) = +-pi/2`, zeros keep their sign, NaN stays NaN.

use crate::kir::MathFn;
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{types, InstBuilder, MemFlagsData, Type, Value};
use cranelift_frontend::FunctionBuilder;

/// Whether `f` on f32 is generated inline (by [`emit`]) instead of calling libm.
pub fn is_inline(f: MathFn) -> bool {
    matches!(
        f,
        MathFn::Exp
            | MathFn::Log
            | MathFn::Erf
            | MathFn::Tanh
            | MathFn::Atan
            | MathFn::Sin
            | MathFn::Cos
            | MathFn::Tan
    )
}

/// `f(x)` for an f32 or f32x4 `x`; `None` when `f` is not generated inline.
pub fn emit(b: &mut FunctionBuilder, f: MathFn, x: Value) -> Option<Value> {
    let ty = b.func.dfg.value_type(x);
    debug_assert!(ty == types::F32 || ty == types::F32X4);
    let mut m = M { b, ty };
    Some(match f {
        MathFn::Exp => m.exp(x),
        MathFn::Log => m.log(x),
        MathFn::Erf => m.erf(x),
        MathFn::Tanh => m.tanh(x),
        MathFn::Atan => m.atan(x),
        MathFn::Sin | MathFn::Cos | MathFn::Tan => m.trig(x, f),
        _ => return None,
    })
}

struct M<'a, 'b> {
    b: &'a mut FunctionBuilder<'b>,
    ty: Type,
}

/// Cephes `expf` polynomial for `e^r - 1 - r` over `r^2`, highest power first.
pub(super) const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    5e-1,
];
/// `ln 2` split so that `n * LN2_HI` is exact.
pub(super) const LN2_HI: f32 = 0.693_359_4;
pub(super) const LN2_LO: f32 = -2.121_944_4e-4;
/// ln of the smallest normal f32 (2^-126), rounded up: exp is 0 below it.
pub(super) const EXP_MIN: f32 = -87.336_54;
/// 1.5 * 2^23: adding it rounds to an integer, kept in the low mantissa bits.
pub(super) const MAGIC: f32 = 12_582_912.0;

/// Cephes `logf` polynomial `P` (for `m` in `[sqrt(1/2) - 1, sqrt(2) - 1)`,
/// `log(1 + m) = m - m^2 / 2 + m^3 P(m)`), highest power first.
pub(super) const LOG_P: [f32; 9] = [
    0.070_376_836,
    -0.115_146_1,
    0.116_769_984,
    -0.124_201_41,
    0.142_493_23,
    -0.166_680_57,
    0.200_007_14,
    -0.249_999_94,
    0.333_333_3,
];
/// Mantissas below this are doubled (and the exponent lowered), so `m - 1` stays small.
pub(super) const SQRT_HALF: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `MAGIC + 126`: a biased exponent `E` added to `MAGIC`'s bits reads as `MAGIC + E`;
/// subtracting this leaves `E - 126`, the exponent of a mantissa in `[1/2, 1)`.
pub(super) const LOG_EXP_BIAS: f32 = 12_583_038.0;

/// erf(x) = x P(x^2) / Q(x^2) on [-4, 4] (Eigen, XLA), highest power first.
pub(super) const ERF_P: [f32; 7] = [
    -2.726_142_3e-10,
    2.770_681_4e-8,
    -2.101_024e-6,
    -5.692_506_4e-5,
    -7.349_906_3e-4,
    -2.954_6e-3,
    -1.609_603_3e-2,
];
pub(super) const ERF_Q: [f32; 5] = [
    -1.456_607_2e-5,
    -2.133_740_5e-4,
    -1.682_827e-3,
    -7.373_329e-3,
    -1.426_473_9e-2,
];

/// tanh(x) = x P(x^2) / Q(x^2) on [-7.905, 7.905] (Eigen), highest power first.
pub(super) const TANH_P: [f32; 7] = [
    -2.760_768_5e-16,
    2.000_188e-13,
    -8.604_672e-11,
    5.122_297e-8,
    1.485_722_4e-5,
    6.372_619_3e-4,
    4.893_524_6e-3,
];
pub(super) const TANH_Q: [f32; 4] = [1.198_258_4e-6, 1.185_347_1e-4, 2.268_434_6e-3, 4.893_525e-3];
pub(super) const TANH_CLAMP: f32 = 7.905_311;

/// The largest `|x|` for which the inline `sin` / `cos` hold their accuracy (Cephes'
/// `lossth`): `j DP1` and `j DP2` are exact products up to it.
pub const SINCOS_MAX: f32 = 8192.0;
/// `pi/4` in three parts (Cephes `DP1`, `DP2`, `DP3`).
pub(super) const SINCOS_DP: [f32; 3] = [0.785_156_25, 2.418_756_5e-4, 3.774_895e-8];
/// Cephes `sinf`: `sin(r) = r + r z P(z)`, `z = r^2`, highest power first.
pub(super) const SIN_P: [f32; 3] = [-1.951_529_6e-4, 8.332_161e-3, -1.666_665_5e-1];
/// Cephes `cosf`: `cos(r) = 1 - z/2 + z^2 P(z)`, highest power first.
pub(super) const COS_P: [f32; 3] = [2.443_315_7e-5, -1.388_731_6e-3, 4.166_664_6e-2];

/// Cephes `atanf`: `atan(t) = t + t z P(z)`, `z = t^2`, for `|t| <= tan(pi / 8)`,
/// highest power first.
pub(super) const ATAN_P: [f32; 4] = [
    8.053_744_5e-2,
    -1.387_768_6e-1,
    1.997_771_1e-1,
    -3.333_295e-1,
];
/// `tan(3 pi / 8)` and `tan(pi / 8)`: the bounds of `atan`'s three ranges.
pub(super) const ATAN_HI: f32 = 2.414_213_6;
pub(super) const ATAN_MID: f32 = 0.414_213_57;

impl M<'_, '_> {
    fn ity(&self) -> Type {
        if self.ty == types::F32 {
            types::I32
        } else {
            types::I32X4
        }
    }

    fn c(&mut self, x: f32) -> Value {
        let s = self.b.ins().f32const(x);
        if self.ty == types::F32 {
            s
        } else {
            self.b.ins().splat(self.ty, s)
        }
    }

    fn ci(&mut self, x: i32) -> Value {
        let s = self.b.ins().iconst(types::I32, x as i64);
        if self.ty == types::F32 {
            s
        } else {
            self.b.ins().splat(types::I32X4, s)
        }
    }

    fn add(&mut self, x: Value, y: Value) -> Value {
        self.b.ins().fadd(x, y)
    }

    fn mul(&mut self, x: Value, y: Value) -> Value {
        self.b.ins().fmul(x, y)
    }

    /// `c ? a : b` for an f32 comparison result `c`.
    fn select(&mut self, c: Value, a: Value, b: Value) -> Value {
        if self.ty == types::F32 {
            self.b.ins().select(c, a, b)
        } else {
            let m = self.b.ins().bitcast(self.ty, MemFlagsData::new(), c);
            self.b.ins().bitselect(m, a, b)
        }
    }

    /// `x` clamped to `[lo, hi]` by compare-and-select (a blend on x86, cheaper than
    /// Cranelift's NaN-propagating fmin/fmax sequences); NaN stays NaN.
    fn clamp(&mut self, x: Value, lo: f32, hi: f32) -> Value {
        let h = self.c(hi);
        let l = self.c(lo);
        let above = self.b.ins().fcmp(FloatCC::GreaterThan, x, h);
        let x = self.select(above, h, x);
        let below = self.b.ins().fcmp(FloatCC::LessThan, x, l);
        self.select(below, l, x)
    }

    /// Horner's rule, coefficients highest power first.
    fn poly(&mut self, x: Value, cs: &[f32]) -> Value {
        let mut p = self.c(cs[0]);
        for &k in &cs[1..] {
            let t = self.mul(p, x);
            let k = self.c(k);
            p = self.add(t, k);
        }
        p
    }

    fn as_int(&mut self, x: Value) -> Value {
        let t = self.ity();
        self.b.ins().bitcast(t, MemFlagsData::new(), x)
    }

    fn as_float(&mut self, x: Value) -> Value {
        self.b.ins().bitcast(self.ty, MemFlagsData::new(), x)
    }

    /// 2^n for an integer n in [-126, 127], as a float.
    fn pow2(&mut self, n: Value) -> Value {
        let bias = self.ci(127);
        let e = self.b.ins().iadd(n, bias);
        let sh = self.b.ins().iconst(types::I32, 23);
        let e = self.b.ins().ishl(e, sh);
        self.as_float(e)
    }

    fn exp(&mut self, x: Value) -> Value {
        // Results below the smallest normal flush to zero: subnormal arithmetic takes
        // microcode assists on x86 (a hundred cycles per operation), and a softmax over
        // widely spread scores would hit them on every row.
        let lim = self.c(EXP_MIN);
        let tiny = self.b.ins().fcmp(FloatCC::LessThan, x, lim);
        // e^89 overflows f32.
        let x = self.clamp(x, EXP_MIN, 89.0);
        let log2e = self.c(std::f32::consts::LOG2_E);
        let magic = self.c(MAGIC);
        let t = self.mul(x, log2e);
        let t = self.add(t, magic);
        let nf = self.b.ins().fsub(t, magic);
        let hi = self.c(LN2_HI);
        let lo = self.c(LN2_LO);
        let a = self.mul(nf, hi);
        let r = self.b.ins().fsub(x, a);
        let a = self.mul(nf, lo);
        let r = self.b.ins().fsub(r, a);
        // e^r = 1 + r + r^2 P(r).
        let p = self.poly(r, &EXP_P);
        let r2 = self.mul(r, r);
        let y = self.mul(p, r2);
        let y = self.add(y, r);
        let one = self.c(1.0);
        let y = self.add(y, one);
        // n = t - MAGIC as an integer, in [-159, 129]; 2^n = 2^(n >> 1) 2^(n - (n >> 1)).
        let tb = self.as_int(t);
        let mb = self.ci(MAGIC.to_bits() as i32);
        let n = self.b.ins().isub(tb, mb);
        let one_i = self.b.ins().iconst(types::I32, 1);
        let n1 = self.b.ins().sshr(n, one_i);
        let n2 = self.b.ins().isub(n, n1);
        let s1 = self.pow2(n1);
        let s2 = self.pow2(n2);
        let y = self.mul(y, s1);
        let y = self.mul(y, s2);
        let zero = self.c(0.0);
        self.select(tiny, zero, y)
    }

    fn log(&mut self, x: Value) -> Value {
        // Subnormals: scaled into the normal range (the exponent corrected below).
        let min = self.c(f32::MIN_POSITIVE);
        let tiny = self.b.ins().fcmp(FloatCC::LessThan, x, min);
        let scale = self.c(8_388_608.0);
        let xs = self.mul(x, scale);
        let xn = self.select(tiny, xs, x);
        // The biased exponent E and the mantissa with exponent -1 (in [1/2, 1)), from
        // the bits of a positive float (other arguments are replaced at the end).
        let bits = self.as_int(xn);
        let sh = self.b.ins().iconst(types::I32, 23);
        let big_e = self.b.ins().sshr(bits, sh);
        let top = self.b.ins().ishl(big_e, sh);
        let mant = self.b.ins().isub(bits, top);
        let half = self.ci(0x3f00_0000);
        let mb = self.b.ins().iadd(mant, half);
        let m = self.as_float(mb);
        let magic = self.ci(MAGIC.to_bits() as i32);
        let ef = self.b.ins().iadd(big_e, magic);
        let ef = self.as_float(ef);
        let bias = self.c(LOG_EXP_BIAS);
        let e = self.b.ins().fsub(ef, bias);
        let t23 = self.c(23.0);
        let zero = self.c(0.0);
        let adj = self.select(tiny, t23, zero);
        let e = self.b.ins().fsub(e, adj);
        // m in [sqrt(1/2), sqrt(2)), less 1.
        let sq = self.c(SQRT_HALF);
        let small = self.b.ins().fcmp(FloatCC::LessThan, m, sq);
        let one = self.c(1.0);
        let e1 = self.b.ins().fsub(e, one);
        let e = self.select(small, e1, e);
        let m2 = self.add(m, m);
        let m = self.select(small, m2, m);
        let m = self.b.ins().fsub(m, one);
        // log(1 + m) + e ln 2 = m + (m^3 P(m) + e LN2_LO - m^2 / 2) + e LN2_HI.
        let z = self.mul(m, m);
        let p = self.poly(m, &LOG_P);
        let y = self.mul(p, m);
        let y = self.mul(y, z);
        let lo = self.c(LN2_LO);
        let t = self.mul(e, lo);
        let y = self.add(y, t);
        let mhalf = self.c(-0.5);
        let t = self.mul(z, mhalf);
        let y = self.add(y, t);
        let r = self.add(m, y);
        let hi = self.c(LN2_HI);
        let t = self.mul(e, hi);
        let r = self.add(r, t);
        // inf -> inf, +-0 -> -inf, negative -> NaN, NaN -> NaN.
        let inf = self.c(f32::INFINITY);
        let is_inf = self.b.ins().fcmp(FloatCC::Equal, x, inf);
        let r = self.select(is_inf, inf, r);
        let is_zero = self.b.ins().fcmp(FloatCC::Equal, x, zero);
        let ninf = self.c(f32::NEG_INFINITY);
        let r = self.select(is_zero, ninf, r);
        let neg = self.b.ins().fcmp(FloatCC::LessThan, x, zero);
        let nan = self.c(f32::NAN);
        let r = self.select(neg, nan, r);
        let is_nan = self.b.ins().fcmp(FloatCC::Unordered, x, x);
        self.select(is_nan, x, r)
    }

    /// `f(x)` for `f` sin, cos or tan, for `|x| <=` [`SINCOS_MAX`] (see the module doc).
    fn trig(&mut self, x: Value, f: MathFn) -> Value {
        let cos = f == MathFn::Cos;
        let a = self.b.ins().fabs(x);
        let fopi = self.c(std::f32::consts::FRAC_PI_4.recip());
        let t = self.mul(a, fopi);
        // j = trunc(|x| 4/pi), rounded up to even (NaN: 0, and r below is NaN).
        let it = self.ity();
        let j = self.b.ins().fcvt_to_sint_sat(it, t);
        let one = self.ci(1);
        let odd = self.b.ins().band(j, one);
        let j = self.b.ins().iadd(j, odd);
        let y = self.b.ins().fcvt_from_sint(self.ty, j);
        let mut r = a;
        for dp in SINCOS_DP {
            let d = self.c(dp);
            let p = self.mul(y, d);
            r = self.b.ins().fsub(r, p);
        }
        let z = self.mul(r, r);
        // r + r z P(z).
        let p = self.poly(z, &SIN_P);
        let p = self.mul(p, z);
        let p = self.mul(p, r);
        let ps = self.add(p, r);
        // 1 - z/2 + z^2 P(z).
        let p = self.poly(z, &COS_P);
        let p = self.mul(p, z);
        let p = self.mul(p, z);
        let mhalf = self.c(-0.5);
        let h = self.mul(z, mhalf);
        let p = self.add(p, h);
        let one_f = self.c(1.0);
        let pc = self.add(p, one_f);
        // Octant j (even): the other polynomial at j = 2, 6 (mod 8); the sign flips for
        // sin at j = 4, 6 (and with x's sign), for cos at j = 2, 4.
        let two = self.ci(2);
        let q = self.b.ins().band(j, two);
        let zero_i = self.ci(0);
        let swap = self.b.ins().icmp(IntCC::NotEqual, q, zero_i);
        if f == MathFn::Tan {
            // sin / cos, or -cos / sin in the odd octant pairs; odd in x.
            let num = self.select(swap, pc, ps);
            let den = self.select(swap, ps, pc);
            let t = self.b.ins().fdiv(num, den);
            let nt = self.b.ins().fneg(t);
            let t = self.select(swap, nt, t);
            let top = self.ci(i32::MIN);
            let xb = self.as_int(x);
            let xs = self.b.ins().band(xb, top);
            let tb = self.as_int(t);
            let tb = self.b.ins().bxor(tb, xs);
            return self.as_float(tb);
        }
        let v = if cos {
            self.select(swap, ps, pc)
        } else {
            self.select(swap, pc, ps)
        };
        let js = if cos { self.b.ins().iadd(j, two) } else { j };
        let sh = self.b.ins().iconst(types::I32, 29);
        let sign = self.b.ins().ishl(js, sh);
        let top = self.ci(i32::MIN);
        let mut sign = self.b.ins().band(sign, top);
        if !cos {
            let xb = self.as_int(x);
            let xs = self.b.ins().band(xb, top);
            sign = self.b.ins().bxor(sign, xs);
        }
        let vb = self.as_int(v);
        let vb = self.b.ins().bxor(vb, sign);
        self.as_float(vb)
    }

    fn atan(&mut self, x: Value) -> Value {
        let a = self.b.ins().fabs(x);
        let hi = self.c(ATAN_HI);
        let big = self.b.ins().fcmp(FloatCC::GreaterThan, a, hi);
        let mid_c = self.c(ATAN_MID);
        let mid = self.b.ins().fcmp(FloatCC::GreaterThan, a, mid_c);
        // t = -1 / a, (a - 1) / (a + 1) or a: one division.
        let one = self.c(1.0);
        let am1 = self.b.ins().fsub(a, one);
        let num = self.select(mid, am1, a);
        let mone = self.c(-1.0);
        let num = self.select(big, mone, num);
        let ap1 = self.add(a, one);
        let den = self.select(mid, ap1, one);
        let den = self.select(big, a, den);
        let t = self.b.ins().fdiv(num, den);
        let zero = self.c(0.0);
        let q = self.c(std::f32::consts::FRAC_PI_4);
        let base = self.select(mid, q, zero);
        let h = self.c(std::f32::consts::FRAC_PI_2);
        let base = self.select(big, h, base);
        let z = self.mul(t, t);
        let p = self.poly(z, &ATAN_P);
        let y = self.mul(p, z);
        let y = self.mul(y, t);
        let y = self.add(y, t);
        let r = self.add(base, y);
        // The sign of x; zeros as they are.
        let nr = self.b.ins().fneg(r);
        let neg = self.b.ins().fcmp(FloatCC::LessThan, x, zero);
        let r = self.select(neg, nr, r);
        let is_zero = self.b.ins().fcmp(FloatCC::Equal, x, zero);
        self.select(is_zero, x, r)
    }

    fn erf(&mut self, x: Value) -> Value {
        let x = self.clamp(x, -4.0, 4.0);
        let x2 = self.mul(x, x);
        // x (P / Q), not (x P) / Q: x P underflows for tiny x.
        let p = self.poly(x2, &ERF_P);
        let q = self.poly(x2, &ERF_Q);
        let r = self.b.ins().fdiv(p, q);
        let y = self.mul(x, r);
        self.clamp(y, -1.0, 1.0)
    }

    fn tanh(&mut self, x: Value) -> Value {
        let x = self.clamp(x, -TANH_CLAMP, TANH_CLAMP);
        let x2 = self.mul(x, x);
        // x (P / Q), not (x P) / Q: x P underflows for tiny x.
        let p = self.poly(x2, &TANH_P);
        let q = self.poly(x2, &TANH_Q);
        let r = self.b.ins().fdiv(p, q);
        let y = self.mul(x, r);
        self.clamp(y, -1.0, 1.0)
    }
}
