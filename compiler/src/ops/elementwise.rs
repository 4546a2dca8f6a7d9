//! Elementwise ops: unary math, binary arithmetic with broadcasting, logic and bitwise
//! ops, comparisons, variadic Max/Min/Sum/Mean, Where, Clip, activations and Identity.
//!
//! Floats are computed in f64 and rounded back to the input dtype; integers in i128,
//! wrapping back to the dtype's width like NumPy does.

use super::util::*;
use super::{OpCtx, Registry};
use crate::ir::{DType, OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::ArrayD;

type Ins<'a, 'b> = &'a [Option<&'b Value>];

pub fn register(r: &mut Registry) {
    // Unary math.
    r.add("Abs", abs);
    r.add("Neg", neg);
    r.add("Sign", sign);
    r.add("Ceil", ceil);
    r.add("Floor", floor);
    r.add("Round", round);
    r.add("Reciprocal", reciprocal);
    r.add("Sqrt", sqrt);
    r.add("Exp", exp);
    r.add("Log", log);
    r.add("Sin", sin);
    r.add("Cos", cos);
    r.add("Tan", tan);
    r.add("Asin", asin);
    r.add("Acos", acos);
    r.add("Atan", atan);
    r.add("Sinh", sinh);
    r.add("Cosh", cosh);
    r.add("Tanh", tanh);
    r.add("Asinh", asinh);
    r.add("Acosh", acosh);
    r.add("Atanh", atanh);
    r.add("Erf", erf_op);
    r.add("IsNaN", isnan);
    r.add("IsInf", isinf);
    r.add("Not", not);
    // Binary arithmetic.
    r.add("Add", add);
    r.add("Sub", sub);
    r.add("Mul", mul);
    r.add("Div", div);
    r.add("Pow", pow);
    r.add("Mod", modulo);
    // Bitwise and logic.
    r.add("BitShift", bitshift);
    r.add("BitwiseAnd", bitwise_and);
    r.add("BitwiseOr", bitwise_or);
    r.add("BitwiseXor", bitwise_xor);
    r.add("BitwiseNot", bitwise_not);
    r.add("And", and);
    r.add("Or", or);
    r.add("Xor", xor);
    // Comparisons.
    r.add("Equal", equal);
    r.add("Less", less);
    r.add("Greater", greater);
    r.add("LessOrEqual", less_or_equal);
    r.add("GreaterOrEqual", greater_or_equal);
    // Variadic.
    r.add("Max", max);
    r.add("Min", min);
    r.add("Sum", sum);
    r.add("Mean", mean);
    r.add("Where", where_op);
    r.add("Clip", clip);
    // Activations.
    r.add("Relu", relu);
    r.add("LeakyRelu", leaky_relu);
    r.add("Elu", elu);
    r.add("Selu", selu);
    r.add("Celu", celu);
    r.add("Sigmoid", sigmoid_op);
    r.add("HardSigmoid", hard_sigmoid);
    r.add("HardSwish", hard_swish);
    r.add("Softplus", softplus_op);
    r.add("Softsign", softsign);
    r.add("Gelu", gelu);
    r.add("ThresholdedRelu", thresholded_relu);
    r.add("PRelu", prelu);
    r.add("Shrink", shrink);
    r.add("Mish", mish);
    r.add("Swish", swish);
    r.add("SwiGLU", swiglu);
    r.add("Identity", identity);
    lower::register(r);
}

// ---------------------------------------------------------------------------------------
// Helpers

/// A float attribute as f64 (attributes are stored as f32, as ONNX holds them).
fn fattr(c: &OpCtx, name: &str, default: f32) -> OpResult<f64> {
    Ok(c.attrs.float(name, default)? as f64)
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// log(1 + exp(x)) without overflow (NumPy's `logaddexp(0, x)`).
fn softplus(x: f64) -> f64 {
    if x.is_nan() {
        x
    } else if x > 0.0 {
        x + (-x).exp().ln_1p()
    } else {
        x.exp().ln_1p()
    }
}

/// The error function, accurate to about 1e-15 relative.
pub(crate) fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    let r = if a < 3.0 {
        // Maclaurin series: 2/sqrt(pi) * sum (-1)^n x^(2n+1) / (n! (2n+1)).
        let x2 = a * a;
        let mut term = a; // x^(2n+1) (-1)^n / n!
        let mut s = a;
        let mut n = 0.0f64;
        loop {
            n += 1.0;
            term *= -x2 / n;
            let add = term / (2.0 * n + 1.0);
            s += add;
            if add.abs() < 1e-17 * s.abs() || n > 200.0 {
                break;
            }
        }
        s * std::f64::consts::FRAC_2_SQRT_PI
    } else {
        1.0 - erfc_large(a)
    };
    if x < 0.0 {
        -r
    } else {
        r
    }
}

/// erfc(x) for x >= 3 by its continued fraction (Lentz's method).
fn erfc_large(x: f64) -> f64 {
    if x > 27.0 {
        return 0.0;
    }
    // erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + 1/2/(x + 1/(x + 3/2/(x + 2/(x + ...)))))
    let tiny = 1e-300;
    let mut f = x;
    let mut c = x;
    let mut d = 0.0f64;
    for k in 1..300 {
        let a = k as f64 / 2.0;
        d = x + a * d;
        if d.abs() < tiny {
            d = tiny;
        }
        c = x + a / c;
        if c.abs() < tiny {
            c = tiny;
        }
        d = 1.0 / d;
        let delta = c * d;
        f *= delta;
        if (delta - 1.0).abs() < 1e-16 {
            break;
        }
    }
    (-x * x).exp() / std::f64::consts::PI.sqrt() / f
}

/// NumPy's float `mod` (Python semantics: the result takes the divisor's sign).
fn py_fmod(a: f64, b: f64) -> f64 {
    let m = a % b;
    if b == 0.0 {
        return m;
    }
    if m != 0.0 {
        if (b < 0.0) != (m < 0.0) {
            m + b
        } else {
            m
        }
    } else {
        0.0f64.copysign(b)
    }
}

fn int_pow(base: i128, exp: i128) -> i128 {
    if exp < 0 {
        return match base {
            1 => 1,
            -1 => {
                if exp % 2 == 0 {
                    1
                } else {
                    -1
                }
            }
            _ => 0,
        };
    }
    let mut result: i128 = 1;
    let mut b = base;
    let mut e = exp;
    while e > 0 {
        if e & 1 == 1 {
            result = result.wrapping_mul(b);
        }
        b = b.wrapping_mul(b);
        e >>= 1;
    }
    result
}

fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

fn nan_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

fn bools(t: &Tensor) -> OpResult<&ArrayD<bool>> {
    arr::<bool>(t)
}

fn int_only(t: &Tensor) -> OpResult<DType> {
    let dt = t.dtype();
    ensure!(dt.is_int(), "expected an integer tensor, got {dt}");
    Ok(dt)
}

// ---------------------------------------------------------------------------------------
// Unary math

macro_rules! unary_f {
    ($($fname:ident($x:ident) = $e:expr;)*) => {$(
        fn $fname(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
            out(unary_float(input(ins, 0)?, |$x: f64| $e)?)
        }
    )*};
}

unary_f! {
    ceil(x) = x.ceil();
    floor(x) = x.floor();
    round(x) = x.round_ties_even();
    reciprocal(x) = 1.0 / x;
    sqrt(x) = x.sqrt();
    exp(x) = x.exp();
    log(x) = x.ln();
    sin(x) = x.sin();
    cos(x) = x.cos();
    tan(x) = x.tan();
    asin(x) = x.asin();
    acos(x) = x.acos();
    atan(x) = x.atan();
    sinh(x) = x.sinh();
    cosh(x) = x.cosh();
    tanh(x) = x.tanh();
    asinh(x) = x.asinh();
    acosh(x) = x.acosh();
    atanh(x) = x.atanh();
    erf_op(x) = erf(x);
    sigmoid_op(x) = sigmoid(x);
    softplus_op(x) = softplus(x);
    softsign(x) = x / (1.0 + x.abs());
    mish(x) = x * softplus(x).tanh();
    hard_swish(x) = x * (x / 6.0 + 0.5).clamp(0.0, 1.0);
}

fn abs(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(unary_num(input(ins, 0)?, f64::abs, |x| x.abs())?)
}

fn neg(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(unary_num(input(ins, 0)?, |x| -x, |x| x.wrapping_neg())?)
}

fn sign(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(unary_num(
        input(ins, 0)?,
        |x| {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                x // 0, -0 and NaN as they are
            }
        },
        |x| x.signum(),
    )?)
}

fn isnan(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    ensure!(
        t.dtype().is_float(),
        "IsNaN expects a float tensor, got {}",
        t.dtype()
    );
    out(Tensor::from_array(f64s(t)?.mapv(|x| x.is_nan())))
}

fn isinf(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    ensure!(
        t.dtype().is_float(),
        "IsInf expects a float tensor, got {}",
        t.dtype()
    );
    let neg = c.attrs.int("detect_negative", 1)? != 0;
    let pos = c.attrs.int("detect_positive", 1)? != 0;
    out(Tensor::from_array(f64s(t)?.mapv(|x| {
        (x == f64::INFINITY && pos) || (x == f64::NEG_INFINITY && neg)
    })))
}

fn not(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(Tensor::from_array(bools(input(ins, 0)?)?.mapv(|x| !x)))
}

// ---------------------------------------------------------------------------------------
// Binary arithmetic

fn add(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(binary_num(
        input(ins, 0)?,
        input(ins, 1)?,
        |a, b| a + b,
        |a, b| Ok(a.wrapping_add(b)),
    )?)
}

fn sub(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(binary_num(
        input(ins, 0)?,
        input(ins, 1)?,
        |a, b| a - b,
        |a, b| Ok(a.wrapping_sub(b)),
    )?)
}

fn mul(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(binary_num(
        input(ins, 0)?,
        input(ins, 1)?,
        |a, b| a * b,
        |a, b| Ok(a.wrapping_mul(b)),
    )?)
}

fn div(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    // Integer division truncates toward zero (C-style); division by zero gives 0 as in
    // NumPy.
    out(binary_num(
        input(ins, 0)?,
        input(ins, 1)?,
        |a, b| a / b,
        |a, b| Ok(if b == 0 { 0 } else { a.wrapping_div(b) }),
    )?)
}

fn pow(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let a = input(ins, 0)?;
    let b = input(ins, 1)?;
    let dt = a.dtype();
    ensure!(
        dt.is_numeric() && b.dtype().is_numeric(),
        "Pow expects numeric tensors, got {} and {}",
        dt,
        b.dtype()
    );
    if dt.is_int() && b.dtype().is_int() {
        let r = zip_broadcast(&i128s(a)?, &i128s(b)?, int_pow)?;
        out(Tensor::from_i128(dt, r))
    } else {
        let r = zip_broadcast(&f64s(a)?, &f64s(b)?, f64::powf)?;
        out(Tensor::from_f64(dt, r, false))
    }
}

fn modulo(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let fmod = c.attrs.int("fmod", 0)? != 0;
    let a = input(ins, 0)?;
    let b = input(ins, 1)?;
    if fmod {
        out(binary_num(
            a,
            b,
            |x, y| x % y,
            |x, y| Ok(if y == 0 { 0 } else { x % y }),
        )?)
    } else {
        out(binary_num(a, b, py_fmod, |x, y| {
            Ok(if y == 0 {
                0
            } else {
                let r = x % y;
                if r != 0 && ((r < 0) != (y < 0)) {
                    r + y
                } else {
                    r
                }
            })
        })?)
    }
}

// ---------------------------------------------------------------------------------------
// Bitwise and logic

fn bitshift(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let dir = c.attrs.string("direction", String::new())?;
    let left = match dir.as_str() {
        "LEFT" => true,
        "RIGHT" => false,
        _ => bail!("BitShift direction must be LEFT or RIGHT, got {dir:?}"),
    };
    let a = input(ins, 0)?;
    let b = input(ins, 1)?;
    let dt = same_dtype(&[a, b])?;
    int_only(a)?;
    let width = dt.bits() as i128;
    let r = zip_broadcast(&i128s(a)?, &i128s(b)?, |x, s| {
        if s < 0 || s >= width {
            if left || x >= 0 {
                0
            } else {
                -1
            }
        } else if left {
            x << s
        } else {
            x >> s
        }
    })?;
    out(Tensor::from_i128(dt, r))
}

fn bitwise(ins: Ins, f: fn(i128, i128) -> i128) -> OpResult<Vec<Value>> {
    let a = input(ins, 0)?;
    let b = input(ins, 1)?;
    let dt = same_dtype(&[a, b])?;
    int_only(a)?;
    out(Tensor::from_i128(
        dt,
        zip_broadcast(&i128s(a)?, &i128s(b)?, f)?,
    ))
}

fn bitwise_and(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    bitwise(ins, |a, b| a & b)
}

fn bitwise_or(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    bitwise(ins, |a, b| a | b)
}

fn bitwise_xor(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    bitwise(ins, |a, b| a ^ b)
}

fn bitwise_not(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let a = input(ins, 0)?;
    let dt = int_only(a)?;
    out(Tensor::from_i128(dt, i128s(a)?.mapv(|x| !x)))
}

fn logic(ins: Ins, f: fn(bool, bool) -> bool) -> OpResult<Vec<Value>> {
    let a = bools(input(ins, 0)?)?;
    let b = bools(input(ins, 1)?)?;
    out(Tensor::from_array(zip_broadcast(a, b, f)?))
}

fn and(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    logic(ins, |a, b| a && b)
}

fn or(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    logic(ins, |a, b| a || b)
}

fn xor(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    logic(ins, |a, b| a != b)
}

// ---------------------------------------------------------------------------------------
// Comparisons

fn equal(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(compare(
        input(ins, 0)?,
        input(ins, 1)?,
        |a, b| a == b,
        |a, b| a == b,
    )?)
}

fn less(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(compare(
        input(ins, 0)?,
        input(ins, 1)?,
        |a, b| a < b,
        |a, b| a < b,
    )?)
}

fn greater(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(compare(
        input(ins, 0)?,
        input(ins, 1)?,
        |a, b| a > b,
        |a, b| a > b,
    )?)
}

fn less_or_equal(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(compare(
        input(ins, 0)?,
        input(ins, 1)?,
        |a, b| a <= b,
        |a, b| a <= b,
    )?)
}

fn greater_or_equal(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(compare(
        input(ins, 0)?,
        input(ins, 1)?,
        |a, b| a >= b,
        |a, b| a >= b,
    )?)
}

// ---------------------------------------------------------------------------------------
// Variadic ops

/// The present tensor inputs of a variadic op (at least one), all of one dtype.
fn variadic_inputs<'a>(ins: Ins<'_, 'a>) -> OpResult<(DType, Vec<&'a Tensor>)> {
    let mut ts = Vec::new();
    for i in 0..ins.len() {
        if let Some(t) = opt_input(ins, i)? {
            ts.push(t);
        }
    }
    ensure!(!ts.is_empty(), "expected at least one input");
    let dt = same_dtype(&ts)?;
    ensure!(dt.is_numeric(), "expected numeric tensors, got {dt}");
    Ok((dt, ts))
}

/// Folds the inputs with broadcasting: floats in f64 (rounded back after each step, as
/// NumPy computes in the dtype), integers in i128.
fn fold_variadic(
    ins: Ins,
    ff: fn(f64, f64) -> f64,
    fi: fn(i128, i128) -> i128,
) -> OpResult<(DType, Tensor)> {
    let (dt, ts) = variadic_inputs(ins)?;
    if dt.is_float() {
        let mut acc = f64s(ts[0])?;
        for t in &ts[1..] {
            acc = zip_broadcast(&acc, &f64s(t)?, ff)?;
            if dt != DType::F64 {
                acc = f64s(&Tensor::from_f64(dt, acc, false))?;
            }
        }
        Ok((dt, Tensor::from_f64(dt, acc, false)))
    } else {
        let mut acc = i128s(ts[0])?;
        for t in &ts[1..] {
            acc = zip_broadcast(&acc, &i128s(t)?, fi)?;
        }
        Ok((dt, Tensor::from_i128(dt, acc)))
    }
}

fn max(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(fold_variadic(ins, nan_max, |a, b| a.max(b))?.1)
}

fn min(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(fold_variadic(ins, nan_min, |a, b| a.min(b))?.1)
}

fn sum(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(fold_variadic(ins, |a, b| a + b, |a, b| a.wrapping_add(b))?.1)
}

fn mean(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let n = ins.iter().filter(|v| v.is_some()).count().max(1) as f64;
    let (dt, s) = fold_variadic(ins, |a, b| a + b, |a, b| a.wrapping_add(b))?;
    ensure!(dt.is_float(), "Mean expects float tensors, got {dt}");
    out(Tensor::from_f64(dt, f64s(&s)?.mapv(|x| x / n), false))
}

fn where_op(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let cond = bools(input(ins, 0)?)?;
    let x = input(ins, 1)?;
    let y = input(ins, 2)?;
    let dt = same_dtype(&[x, y])?;
    let st = dt
        .storage()
        .ok_or_else(|| OpError::new(format!("Where does not support {dt}")))?;
    let t = crate::with_storage_type!(st, T => {
        let xa = arr::<T>(x)?;
        let ya = arr::<T>(y)?;
        Tensor::from_array_as(dt, zip3_broadcast(cond, xa, ya, |c, a, b| if c { a } else { b })?)
    });
    out(t)
}

fn clip(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let dt = x.dtype();
    ensure!(dt.is_numeric(), "Clip expects a numeric tensor, got {dt}");
    if c.opset < 11 {
        let lo = fattr(c, "min", f32::MIN)?;
        let hi = fattr(c, "max", f32::MAX)?;
        return out(unary_float(x, |v| {
            if v.is_nan() {
                v
            } else {
                v.max(lo).min(hi)
            }
        })?);
    }
    let lo = opt_input(ins, 1)?;
    let hi = opt_input(ins, 2)?;
    for b in [lo, hi].into_iter().flatten() {
        ensure!(
            b.dtype() == dt,
            "Clip bounds must have the input's dtype {dt}, got {}",
            b.dtype()
        );
        ensure!(
            b.len() == 1,
            "Clip bounds must be scalars, got shape {:?}",
            b.shape()
        );
    }
    if dt.is_float() {
        let lo = lo.map(scalar_f64).transpose()?;
        let hi = hi.map(scalar_f64).transpose()?;
        out(unary_float(x, |v| {
            let mut v = v;
            if let Some(l) = lo {
                v = nan_max(v, l);
            }
            if let Some(h) = hi {
                v = nan_min(v, h);
            }
            v
        })?)
    } else {
        let one = |t: &Tensor| -> OpResult<i128> {
            Ok(i128s(t)?.iter().copied().next().unwrap_or_default())
        };
        let lo = lo.map(one).transpose()?;
        let hi = hi.map(one).transpose()?;
        out(Tensor::from_i128(
            dt,
            i128s(x)?.mapv(|v| {
                let mut v = v;
                if let Some(l) = lo {
                    v = v.max(l);
                }
                if let Some(h) = hi {
                    v = v.min(h);
                }
                v
            }),
        ))
    }
}

// ---------------------------------------------------------------------------------------
// Activations

fn relu(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    out(unary_num(
        input(ins, 0)?,
        |x| if x.is_nan() || x > 0.0 { x } else { 0.0 },
        |x| x.max(0),
    )?)
}

fn leaky_relu(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let alpha = fattr(c, "alpha", 0.01)?;
    out(unary_float(input(ins, 0)?, |x| {
        if x > 0.0 {
            x
        } else {
            x * alpha
        }
    })?)
}

fn elu(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let alpha = fattr(c, "alpha", 1.0)?;
    out(unary_float(input(ins, 0)?, |x| {
        if x < 0.0 {
            alpha * x.exp_m1()
        } else {
            x
        }
    })?)
}

fn selu(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let alpha = fattr(c, "alpha", 1.673_263_2)?;
    let gamma = fattr(c, "gamma", 1.050_701)?;
    out(unary_float(input(ins, 0)?, |x| {
        if x > 0.0 {
            gamma * x
        } else {
            gamma * (alpha * x.exp() - alpha)
        }
    })?)
}

fn celu(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let alpha = fattr(c, "alpha", 1.0)?;
    out(unary_float(input(ins, 0)?, |x| {
        x.max(0.0) + (alpha * (x / alpha).exp_m1()).min(0.0)
    })?)
}

fn hard_sigmoid(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let alpha = fattr(c, "alpha", 0.2)?;
    let beta = fattr(c, "beta", 0.5)?;
    out(unary_float(input(ins, 0)?, |x| {
        (alpha * x + beta).clamp(0.0, 1.0)
    })?)
}

fn gelu(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let approx = c.attrs.string("approximate", "none".into())?;
    match approx.as_str() {
        "none" => out(unary_float(input(ins, 0)?, |x| {
            0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
        })?),
        "tanh" => {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            out(unary_float(input(ins, 0)?, |x| {
                0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
            })?)
        }
        _ => bail!("Gelu approximate must be none or tanh, got {approx:?}"),
    }
}

fn thresholded_relu(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let alpha = fattr(c, "alpha", 1.0)?;
    out(unary_float(input(ins, 0)?, |x| {
        if x > alpha {
            x
        } else {
            0.0
        }
    })?)
}

fn prelu(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let slope = input(ins, 1)?;
    let dt = same_dtype(&[x, slope])?;
    ensure!(dt.is_numeric(), "PRelu expects numeric tensors, got {dt}");
    // The slope broadcasts to X (unidirectionally). As ONNX's reference does, a 1-D slope
    // whose length matches exactly one dim of X applies along that dim.
    let xs = x.shape().to_vec();
    let slope_shape: Vec<usize> = match crate::ir::broadcast_shapes(&xs, slope.shape()) {
        Some(s) if s == xs => slope.shape().to_vec(),
        _ => {
            let ok = slope.rank() == 1 && xs.iter().filter(|&&d| d == slope.len()).count() == 1;
            ensure!(
                ok,
                "PRelu slope of shape {:?} does not broadcast to X of shape {:?}",
                slope.shape(),
                xs
            );
            xs.iter()
                .map(|&d| if d == slope.len() { d } else { 1 })
                .collect()
        }
    };
    let slope = slope
        .reshape(&slope_shape)
        .ok_or_else(|| OpError::new("PRelu slope reshape failed"))?;
    if dt.is_float() {
        let r = zip_broadcast(
            &f64s(x)?,
            &f64s(&slope)?,
            |v, s| if v > 0.0 { v } else { v * s },
        )?;
        out(Tensor::from_f64(dt, r, false))
    } else {
        let r = zip_broadcast(&i128s(x)?, &i128s(&slope)?, |v, s| {
            if v > 0 {
                v
            } else {
                v.wrapping_mul(s)
            }
        })?;
        out(Tensor::from_i128(dt, r))
    }
}

fn shrink(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let bias = fattr(c, "bias", 0.0)?;
    let lambd = fattr(c, "lambd", 0.5)?;
    let x = input(ins, 0)?;
    ensure!(
        x.dtype().is_numeric(),
        "Shrink expects a numeric tensor, got {}",
        x.dtype()
    );
    let r = f64s(x)?.mapv(|v| {
        if v < -lambd {
            v + bias
        } else if v > lambd {
            v - bias
        } else {
            0.0
        }
    });
    out(Tensor::from_f64(x.dtype(), r, false))
}

fn swish(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let alpha = fattr(c, "alpha", 1.0)?;
    out(unary_float(input(ins, 0)?, |x| x * sigmoid(alpha * x))?)
}

fn swiglu(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let alpha = fattr(c, "alpha", 1.0)?;
    let a = input(ins, 0)?;
    let b = input(ins, 1)?;
    let dt = same_dtype(&[a, b])?;
    ensure!(dt.is_float(), "SwiGLU expects float tensors, got {dt}");
    ensure!(
        a.shape() == b.shape(),
        "SwiGLU inputs must have the same shape, got {:?} and {:?}",
        a.shape(),
        b.shape()
    );
    let r = zip_broadcast(&f64s(a)?, &f64s(b)?, |x, y| x * sigmoid(alpha * x) * y)?;
    out(Tensor::from_f64(dt, r, false))
}

fn identity(_c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    match ins.first().copied().flatten() {
        Some(v) => Ok(vec![v.clone()]),
        None => bail!("Identity: required input 0 is missing"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_values() {
        let cases = [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.0, 0.999_977_909_503_001_4),
            (4.0, 0.999_999_984_582_742_1),
            (-1.5, -0.966_105_146_475_310_7),
        ];
        for (x, want) in cases {
            let got = erf(x);
            assert!((got - want).abs() < 1e-14, "erf({x}) = {got}, want {want}");
        }
    }

    #[test]
    fn python_mod() {
        assert_eq!(py_fmod(-1.0, 3.0), 2.0);
        assert_eq!(py_fmod(1.0, -3.0), -2.0);
        assert_eq!(py_fmod(-1.0, f64::INFINITY), f64::INFINITY);
        assert!(py_fmod(1.0, 0.0).is_nan());
    }
}

// ---------------------------------------------------------------------------------------
// Lowering to kernel IR.

/// Lowerings; [`lower::scalar_expr_fn`] also serves the fused elementwise kernels.
pub(crate) mod lower {
    use crate::ir::{OpError, OpResult};
    use crate::kir::build::*;
    use crate::kir::{BinOp, CmpOp, Expr, MathFn, Stmt, Ty, UnOp};
    use crate::ops::lowering::{
        broadcast_strides, elementwise, index, lit, nest, strides, LowerCtx,
    };
    use crate::ops::{Lowering, OpCtx, Registry};
    use crate::{bail, ensure};

    fn un(op: UnOp, a: Expr) -> Expr {
        Expr::un(op, a)
    }
    fn sigmoid(x: Expr, t: Ty) -> Expr {
        bin(
            BinOp::Div,
            lit(1.0, t),
            bin(BinOp::Add, lit(1.0, t), call(MathFn::Exp, un(UnOp::Neg, x))),
        )
    }
    fn is_nan(x: Expr) -> Expr {
        Expr::cmp(CmpOp::Ne, x.clone(), x)
    }
    /// `softplus(x) = max(x, 0) + log1p(e^-|x|)` in `t`, as the reference computes it:
    /// `log(1 + e^x)` overflows for large `x` and rounds to 0 for negative `x` (f32:
    /// softplus(95) came out inf, softplus(-20) 0). `log1p(u)` is `log(w) - ((w - 1) - u)
    /// / w` for `w = 1 + u`: the rounding error of `w` corrected, to a few ulp.
    pub(crate) fn softplus(x: Expr, t: Ty) -> Expr {
        let u = call(MathFn::Exp, un(UnOp::Neg, un(UnOp::Abs, x.clone())));
        let w = bin(BinOp::Add, u.clone(), lit(1.0, t));
        let err = bin(BinOp::Sub, bin(BinOp::Sub, w.clone(), lit(1.0, t)), u);
        let log1p = bin(
            BinOp::Sub,
            call(MathFn::Log, w.clone()),
            bin(BinOp::Div, err, w),
        );
        // max(x, 0) that keeps NaN.
        let pos = Expr::select(Expr::cmp(CmpOp::Lt, x.clone(), lit(0.0, t)), lit(0.0, t), x);
        bin(BinOp::Add, pos, log1p)
    }

    /// Float attribute `name` (default `d`).
    fn fattr(c: &OpCtx, name: &str, d: f32) -> OpResult<f64> {
        Ok(c.attrs.float(name, d)? as f64)
    }

    /// The compute type of input `i`.
    fn in_ty(tys: &[Option<Ty>], i: usize) -> OpResult<Ty> {
        tys.get(i)
            .copied()
            .flatten()
            .ok_or_else(|| OpError::new(format!("required input {i} is missing")))
    }

    /// Argument `i` of the present inputs.
    fn arg(a: &[Expr], i: usize) -> OpResult<Expr> {
        a.get(i)
            .cloned()
            .ok_or_else(|| OpError::new(format!("required input {i} is missing")))
    }

    /// A builder of an op's scalar expression: (node, compute type of each input slot
    /// (None when omitted), the values of the present inputs) -> the output value.
    pub type ExprFn = fn(&OpCtx, &[Option<Ty>], &[Expr]) -> OpResult<Expr>;

    /// The scalar expression builder of an elementwise op of the default domain, if it
    /// has one. Every op the elementwise lowerings compile as one expression per element
    /// is here (Pow of integers, which needs a loop, is not).
    pub fn scalar_expr_fn(op_type: &str, tys: &[Option<Ty>]) -> Option<ExprFn> {
        // String pointers only move (Identity copies and Where selects them); Equal of
        // strings compares bytes in a loop (`string_equal`), not as one expression.
        if !matches!(op_type, "Where" | "Identity" | "OptionalGetElement")
            && tys.contains(&Some(Ty::Str))
        {
            return None;
        }
        Some(match op_type {
            "Where" => where_expr,
            // Only where `cast::lower::fusible_target` holds (see `fused::scalar_expr_of`).
            "Cast" => crate::ops::cast::lower::cast_expr,
            "Clip" => clip_expr,
            // Only as `fuse_elementwise::elementwise` takes it (one scale and zero point).
            "QuantizeLinear" => crate::ops::quant::lower::quantize_expr,
            "IsInf" => isinf_expr,
            "SwiGLU" => swiglu_expr,
            "Max" | "Min" | "Sum" | "Mean" => variadic_expr,
            "Pow" if tys.first().copied().flatten().is_some_and(|t| t.is_float()) => binary_expr,
            op if UNARY.contains(&op) => unary_expr,
            op if BINARY.contains(&op) => binary_expr,
            _ => return None,
        })
    }

    /// Equal of two string tensors (broadcasting): per output element, the bytes are
    /// compared up to the first difference or the end.
    fn string_equal(lw: &mut LowerCtx) -> OpResult<()> {
        let (a, b) = (lw.input(0)?.clone(), lw.input(1)?.clone());
        let out = lw.outputs[0].clone();
        let mut k = lw.kernel("");
        let body = nest(&mut k, &out.shape, |k, vars| {
            let ia = index(vars, &broadcast_strides(&a.shape, &out.shape));
            let ib = index(vars, &broadcast_strides(&b.shape, &out.shape));
            let (mut s, x, y) = crate::ops::lowering::str_diff(k, (a.buf, ia), (b.buf, ib));
            s.push(Stmt::Store {
                buf: out.buf,
                index: index(vars, &strides(&out.shape)),
                value: Expr::cmp(CmpOp::Eq, x, y),
            });
            s
        });
        k.body = body;
        lw.push(k);
        Ok(())
    }

    /// Lowers an elementwise op through its scalar expression builder.
    fn scalar(lw: &mut LowerCtx) -> OpResult<()> {
        if lw.op.op_type == "Equal" && lw.input(0)?.dtype == crate::ir::DType::Str {
            return string_equal(lw);
        }
        let c = lw.op.clone();
        let tys: Vec<Option<Ty>> = lw
            .inputs
            .iter()
            .map(|i| i.as_ref().map(|t| t.ty().compute()))
            .collect();
        let Some(f) = scalar_expr_fn(&c.op_type, &tys) else {
            bail!("no lowering for {}", c.op_type)
        };
        elementwise(lw, 0, |_, a| f(&c, &tys, &a))
    }

    fn unary_expr(c: &OpCtx, tys: &[Option<Ty>], a: &[Expr]) -> OpResult<Expr> {
        let t = in_ty(tys, 0)?;
        let f = t.is_float();
        let op = c.op_type.clone();
        let alpha = |c: &OpCtx, d| fattr(c, "alpha", d);
        let (a1, a2, g1) = match op.as_str() {
            "LeakyRelu" => (alpha(c, 0.01)?, 0.0, 0.0),
            "Elu" | "Celu" | "ThresholdedRelu" => (alpha(c, 1.0)?, 0.0, 0.0),
            "Selu" => (alpha(c, 1.673_263_2)?, 0.0, fattr(c, "gamma", 1.050_701)?),
            "HardSigmoid" => (alpha(c, 0.2)?, fattr(c, "beta", 0.5)?, 0.0),
            "Shrink" => (fattr(c, "bias", 0.0)?, fattr(c, "lambd", 0.5)?, 0.0),
            "Swish" => (alpha(c, 1.0)?, 0.0, 0.0),
            _ => (0.0, 0.0, 0.0),
        };
        let approximate = if op == "Gelu" {
            c.attrs.string("approximate", "none".into())?
        } else {
            String::new()
        };
        let float_only = !matches!(
            op.as_str(),
            "Abs"
                | "Neg"
                | "Sign"
                | "Not"
                | "BitwiseNot"
                | "Relu"
                | "Identity"
                | "OptionalGetElement"
        );
        ensure!(f || !float_only, "{op} of {t} is not compiled");
        {
            let x = arg(a, 0)?;
            let l = |v: f64| lit(v, t);
            Ok(match op.as_str() {
                // OptionalGetElement of a tensor (an optional input is refused earlier)
                // is that tensor.
                "Identity" | "OptionalGetElement" => x,
                "Abs" => un(UnOp::Abs, x),
                "Neg" => un(UnOp::Neg, x),
                "Not" => bin(BinOp::Xor, x, lit(1.0, Ty::U8)),
                "BitwiseNot" => un(UnOp::Not, x),
                "Sign" => {
                    let pos = Expr::cast(t, Expr::cmp(CmpOp::Gt, x.clone(), l(0.0)));
                    let neg = Expr::cast(t, Expr::cmp(CmpOp::Lt, x.clone(), l(0.0)));
                    let s = bin(BinOp::Sub, pos, neg);
                    if f {
                        // Zeros (of either sign) and NaN as they are, as the reference.
                        let same = Expr::bin(
                            BinOp::Or,
                            Expr::cmp(CmpOp::Eq, x.clone(), l(0.0)),
                            is_nan(x.clone()),
                        );
                        Expr::select(same, x, s)
                    } else {
                        s
                    }
                }
                "Relu" => {
                    if f {
                        // max(x, 0) that keeps NaN.
                        Expr::select(Expr::cmp(CmpOp::Lt, x.clone(), l(0.0)), l(0.0), x)
                    } else {
                        bin(BinOp::Max, x, l(0.0))
                    }
                }
                "Ceil" => un(UnOp::Ceil, x),
                "Floor" => un(UnOp::Floor, x),
                "Round" => un(UnOp::Nearest, x),
                "Sqrt" => un(UnOp::Sqrt, x),
                "Reciprocal" => bin(BinOp::Div, l(1.0), x),
                "Exp" => call(MathFn::Exp, x),
                "Log" => call(MathFn::Log, x),
                "Sin" => call(MathFn::Sin, x),
                "Cos" => call(MathFn::Cos, x),
                "Tan" => call(MathFn::Tan, x),
                "Asin" => call(MathFn::Asin, x),
                "Acos" => call(MathFn::Acos, x),
                "Atan" => call(MathFn::Atan, x),
                "Sinh" => call(MathFn::Sinh, x),
                "Cosh" => call(MathFn::Cosh, x),
                "Tanh" => call(MathFn::Tanh, x),
                "Asinh" => call(MathFn::Asinh, x),
                "Acosh" => call(MathFn::Acosh, x),
                "Atanh" => call(MathFn::Atanh, x),
                "Erf" => call(MathFn::Erf, x),
                "Sigmoid" => sigmoid(x, t),
                "Swish" => bin(BinOp::Mul, x.clone(), sigmoid(bin(BinOp::Mul, l(a1), x), t)),
                "HardSigmoid" => bin(
                    BinOp::Max,
                    l(0.0),
                    bin(
                        BinOp::Min,
                        l(1.0),
                        bin(BinOp::Add, bin(BinOp::Mul, l(a1), x), l(a2)),
                    ),
                ),
                "HardSwish" => bin(
                    BinOp::Mul,
                    x.clone(),
                    bin(
                        BinOp::Max,
                        l(0.0),
                        bin(
                            BinOp::Min,
                            l(1.0),
                            bin(BinOp::Add, bin(BinOp::Mul, l(1.0 / 6.0), x), l(0.5)),
                        ),
                    ),
                ),
                "LeakyRelu" => Expr::select(
                    Expr::cmp(CmpOp::Lt, x.clone(), l(0.0)),
                    bin(BinOp::Mul, l(a1), x.clone()),
                    x,
                ),
                "ThresholdedRelu" => {
                    Expr::select(Expr::cmp(CmpOp::Gt, x.clone(), l(a1)), x, l(0.0))
                }
                "Elu" => Expr::select(
                    Expr::cmp(CmpOp::Lt, x.clone(), l(0.0)),
                    bin(
                        BinOp::Mul,
                        l(a1),
                        bin(BinOp::Sub, call(MathFn::Exp, x.clone()), l(1.0)),
                    ),
                    x,
                ),
                "Celu" => bin(
                    BinOp::Add,
                    bin(BinOp::Max, l(0.0), x.clone()),
                    bin(
                        BinOp::Min,
                        l(0.0),
                        bin(
                            BinOp::Mul,
                            l(a1),
                            bin(
                                BinOp::Sub,
                                call(MathFn::Exp, bin(BinOp::Div, x, l(a1))),
                                l(1.0),
                            ),
                        ),
                    ),
                ),
                "Selu" => Expr::select(
                    Expr::cmp(CmpOp::Le, x.clone(), l(0.0)),
                    bin(
                        BinOp::Mul,
                        l(g1 * a1),
                        bin(BinOp::Sub, call(MathFn::Exp, x.clone()), l(1.0)),
                    ),
                    bin(BinOp::Mul, l(g1), x),
                ),
                "Softplus" => softplus(x, t),
                "Softsign" => bin(
                    BinOp::Div,
                    x.clone(),
                    bin(BinOp::Add, l(1.0), un(UnOp::Abs, x)),
                ),
                "Mish" => bin(BinOp::Mul, x.clone(), call(MathFn::Tanh, softplus(x, t))),
                "Shrink" => Expr::select(
                    Expr::cmp(CmpOp::Lt, x.clone(), l(-a2)),
                    bin(BinOp::Add, x.clone(), l(a1)),
                    Expr::select(
                        Expr::cmp(CmpOp::Gt, x.clone(), l(a2)),
                        bin(BinOp::Sub, x, l(a1)),
                        l(0.0),
                    ),
                ),
                "Gelu" if approximate == "tanh" => {
                    let inner = bin(
                        BinOp::Mul,
                        l((2.0 / std::f64::consts::PI).sqrt()),
                        bin(
                            BinOp::Add,
                            x.clone(),
                            bin(
                                BinOp::Mul,
                                l(0.044715),
                                bin(BinOp::Mul, x.clone(), bin(BinOp::Mul, x.clone(), x.clone())),
                            ),
                        ),
                    );
                    bin(
                        BinOp::Mul,
                        bin(BinOp::Mul, l(0.5), x),
                        bin(BinOp::Add, l(1.0), call(MathFn::Tanh, inner)),
                    )
                }
                "Gelu" => bin(
                    BinOp::Mul,
                    bin(BinOp::Mul, l(0.5), x.clone()),
                    bin(
                        BinOp::Add,
                        l(1.0),
                        call(
                            MathFn::Erf,
                            bin(BinOp::Mul, x, l(std::f64::consts::FRAC_1_SQRT_2)),
                        ),
                    ),
                ),
                "IsNaN" => is_nan(x),
                _ => bail!("no lowering for {op}"),
            })
        }
    }

    fn binary_expr(c: &OpCtx, tys: &[Option<Ty>], a: &[Expr]) -> OpResult<Expr> {
        let t = in_ty(tys, 0)?;
        let f = t.is_float();
        let op = c.op_type.clone();
        let fmod = if op == "Mod" {
            c.attrs.int("fmod", 0)? != 0
        } else {
            false
        };
        let direction = if op == "BitShift" {
            c.attrs.string("direction", String::new())?
        } else {
            String::new()
        };
        for x in tys.iter().skip(1).flatten() {
            ensure!(
                *x == t || op == "Pow",
                "{op}: mixed input types are not compiled"
            );
        }
        let t1 = tys.get(1).copied().flatten().unwrap_or(t);
        {
            let (x, y) = (arg(a, 0)?, a.get(1).cloned().unwrap_or(Expr::Int(0)));
            Ok(match op.as_str() {
                "Add" => bin(BinOp::Add, x, y),
                "Sub" => bin(BinOp::Sub, x, y),
                "Mul" => bin(BinOp::Mul, x, y),
                "Div" => bin(BinOp::Div, x, y),
                "Pow" if f => {
                    let y = if t1 == t { y } else { Expr::cast(t, y) };
                    Expr::call(MathFn::Pow, vec![x, y])
                }
                "Mod" if f && fmod => Expr::call(MathFn::Fmod, vec![x, y]),
                "Mod" if f => {
                    // Python-style: the result takes the divisor's sign.
                    let r = Expr::call(MathFn::Fmod, vec![x, y.clone()]);
                    let adjust = Expr::cmp(
                        CmpOp::Ne,
                        Expr::cmp(CmpOp::Lt, r.clone(), lit(0.0, t)),
                        Expr::cmp(CmpOp::Lt, y.clone(), lit(0.0, t)),
                    );
                    let nz = Expr::cmp(CmpOp::Ne, r.clone(), lit(0.0, t));
                    Expr::select(
                        bin(BinOp::And, adjust, nz),
                        bin(BinOp::Add, r.clone(), y),
                        r,
                    )
                }
                "Mod" if fmod || !t.is_signed() => bin(BinOp::Rem, x, y),
                "Mod" => {
                    let r = bin(BinOp::Rem, x, y.clone());
                    let adjust = Expr::cmp(
                        CmpOp::Ne,
                        Expr::cmp(CmpOp::Lt, r.clone(), lit(0.0, t)),
                        Expr::cmp(CmpOp::Lt, y.clone(), lit(0.0, t)),
                    );
                    let nz = Expr::cmp(CmpOp::Ne, r.clone(), lit(0.0, t));
                    Expr::select(
                        bin(BinOp::And, adjust, nz),
                        bin(BinOp::Add, r.clone(), y),
                        r,
                    )
                }
                "And" | "BitwiseAnd" => bin(BinOp::And, x, y),
                "Or" | "BitwiseOr" => bin(BinOp::Or, x, y),
                "Xor" | "BitwiseXor" => bin(BinOp::Xor, x, y),
                "BitShift" => {
                    // Shifts by a negative amount or by the width or more give 0 (or -1
                    // for a right shift of a negative value), as the reference does.
                    let width = lit((t.bytes() * 8) as f64, t);
                    let shifted = if direction == "LEFT" {
                        bin(BinOp::Shl, x.clone(), y.clone())
                    } else {
                        bin(BinOp::Shr, x.clone(), y.clone())
                    };
                    let out_of_range = bin(
                        BinOp::Or,
                        Expr::cmp(CmpOp::Ge, y.clone(), width),
                        if t.is_signed() {
                            Expr::cmp(CmpOp::Lt, y, lit(0.0, t))
                        } else {
                            lit(0.0, Ty::U8)
                        },
                    );
                    let sat = if direction != "LEFT" && t.is_signed() {
                        Expr::select(
                            Expr::cmp(CmpOp::Lt, x, lit(0.0, t)),
                            lit(-1.0, t),
                            lit(0.0, t),
                        )
                    } else {
                        lit(0.0, t)
                    };
                    Expr::select(out_of_range, sat, shifted)
                }
                "Equal" => Expr::cmp(CmpOp::Eq, x, y),
                "Less" => Expr::cmp(CmpOp::Lt, x, y),
                "LessOrEqual" => Expr::cmp(CmpOp::Le, x, y),
                "Greater" => Expr::cmp(CmpOp::Gt, x, y),
                "GreaterOrEqual" => Expr::cmp(CmpOp::Ge, x, y),
                "PRelu" => Expr::select(
                    Expr::cmp(CmpOp::Lt, x.clone(), lit(0.0, t)),
                    bin(BinOp::Mul, x.clone(), y),
                    x,
                ),
                _ => bail!("no lowering for {op} on {t}"),
            })
        }
    }

    /// Pow with an integer base: repeated squaring (integer exponent) or a float pow
    /// (float exponent); float bases go through `binary`.
    fn pow(lw: &mut LowerCtx) -> OpResult<()> {
        let t = lw.input(0)?.ty().compute();
        // f32 powers by the constants 2, 3 and 0.5, as products and a square root the
        // loops vectorise (a call per element took 2.4 ms for 200k elements):
        // - `x * x` (RMSNorm's and L2 norms' squares) is `powf(x, 2)`'s correctly rounded
        //   value, NaN, infinities and -0 included;
        // - `(x * x) * x` (the tanh GELU's cube) rounds twice: within 1.5 ulp, with the
        //   same NaN, infinities, signed zeros and overflow;
        // - `sqrt(x + 0)` is `powf(x, 0.5)` except at -inf (+inf, where sqrt gives NaN);
        //   the `+ 0` makes -0 +0, as pow does.
        let exponent = lw
            .opt_input(1)
            .and_then(|e| e.value.as_ref())
            .and_then(|e| e.to_f64_vec())
            .filter(|v| v.len() == 1)
            .map(|v| v[0]);
        if let Some(e) = exponent.filter(|e| [2.0, 3.0, 0.5].contains(e)) {
            if lw.input(0)?.ty() == Ty::F32 {
                return elementwise(lw, 0, move |_, a| {
                    let x = a[0].clone();
                    let f = |v: f64| lit(v, Ty::F32);
                    Ok(if e == 2.0 {
                        mul(x.clone(), x)
                    } else if e == 3.0 {
                        mul(mul(x.clone(), x.clone()), x)
                    } else {
                        Expr::select(
                            Expr::cmp(CmpOp::Eq, x.clone(), f(f64::NEG_INFINITY)),
                            f(f64::INFINITY),
                            un(UnOp::Sqrt, bin(BinOp::Add, x, f(0.0))),
                        )
                    })
                });
            }
        }
        if t.is_float() {
            return scalar(lw);
        }
        let t1 = lw.input(1)?.ty().compute();
        if t1.is_float() {
            return elementwise(lw, 0, |_, a| {
                let x = Expr::cast(Ty::F64, a[0].clone());
                let y = Expr::cast(Ty::F64, a[1].clone());
                Ok(Expr::cast(t, Expr::call(MathFn::Pow, vec![x, y])))
            });
        }
        let out = lw.outputs[0].clone();
        let (a, b) = (lw.input(0)?.clone(), lw.input(1)?.clone());
        let mut k = lw.kernel("");
        let (base, e, r, it) = (
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
            k.var(Ty::I64),
        );
        let body = nest(&mut k, &out.shape, |_, vars| {
            let v = |x| Expr::Var(x);
            let la = Expr::cast(
                Ty::I64,
                Expr::load(a.buf, index(vars, &broadcast_strides(&a.shape, &out.shape))),
            );
            let lb = Expr::cast(
                Ty::I64,
                Expr::load(b.buf, index(vars, &broadcast_strides(&b.shape, &out.shape))),
            );
            let odd =
                |x: Expr| Expr::cmp(CmpOp::Ne, bin(BinOp::And, x, Expr::Int(1)), Expr::Int(0));
            // Negative exponents: 1 for base 1, +-1 for base -1, else 0.
            let neg = Expr::select(
                Expr::cmp(CmpOp::Eq, v(base), Expr::Int(1)),
                Expr::Int(1),
                Expr::select(
                    Expr::cmp(CmpOp::Eq, v(base), Expr::Int(-1)),
                    Expr::select(odd(v(e)), Expr::Int(-1), Expr::Int(1)),
                    Expr::Int(0),
                ),
            );
            vec![
                Stmt::Set {
                    var: base,
                    value: la,
                },
                Stmt::Set { var: e, value: lb },
                Stmt::If {
                    cond: Expr::cmp(CmpOp::Lt, v(e), Expr::Int(0)),
                    then: vec![Stmt::Set { var: r, value: neg }],
                    els: vec![
                        Stmt::Set {
                            var: r,
                            value: Expr::Int(1),
                        },
                        Stmt::For {
                            var: it,
                            extent: 63,
                            body: vec![
                                Stmt::Set {
                                    var: r,
                                    value: Expr::select(
                                        odd(v(e)),
                                        bin(BinOp::Mul, v(r), v(base)),
                                        v(r),
                                    ),
                                },
                                Stmt::Set {
                                    var: base,
                                    value: bin(BinOp::Mul, v(base), v(base)),
                                },
                                Stmt::Set {
                                    var: e,
                                    value: bin(BinOp::Shr, v(e), Expr::Int(1)),
                                },
                            ],
                        },
                    ],
                },
                Stmt::Store {
                    buf: out.buf,
                    index: index(vars, &strides(&out.shape)),
                    value: Expr::cast(t, v(r)),
                },
            ]
        });
        k.body = body;
        lw.push(k);
        Ok(())
    }

    fn isinf_expr(c: &OpCtx, tys: &[Option<Ty>], a: &[Expr]) -> OpResult<Expr> {
        let t = in_ty(tys, 0)?;
        ensure!(t.is_float(), "IsInf of {t}");
        let neg = c.attrs.int("detect_negative", 1)? != 0;
        let pos = c.attrs.int("detect_positive", 1)? != 0;
        let x = arg(a, 0)?;
        let p = if pos {
            Expr::cmp(CmpOp::Eq, x.clone(), Expr::Float(f64::INFINITY, t))
        } else {
            lit(0.0, Ty::U8)
        };
        let n = if neg {
            Expr::cmp(CmpOp::Eq, x, Expr::Float(f64::NEG_INFINITY, t))
        } else {
            lit(0.0, Ty::U8)
        };
        Ok(bin(BinOp::Or, p, n))
    }

    fn swiglu_expr(c: &OpCtx, tys: &[Option<Ty>], a: &[Expr]) -> OpResult<Expr> {
        let t = in_ty(tys, 0)?;
        ensure!(t.is_float(), "SwiGLU of {t}");
        ensure!(in_ty(tys, 1)? == t, "SwiGLU: mixed types");
        let alpha = fattr(c, "alpha", 1.0)?;
        let x = arg(a, 0)?;
        let s = sigmoid(bin(BinOp::Mul, lit(alpha, t), x.clone()), t);
        Ok(bin(BinOp::Mul, bin(BinOp::Mul, x, s), arg(a, 1)?))
    }

    fn variadic_expr(c: &OpCtx, tys: &[Option<Ty>], a: &[Expr]) -> OpResult<Expr> {
        let t = in_ty(tys, 0)?;
        let op = c.op_type.as_str();
        let n = a.len();
        let mut acc = arg(a, 0)?;
        for x in &a[1..] {
            acc = match op {
                "Max" if t.is_float() => {
                    // NaN-propagating.
                    Expr::select(
                        is_nan(x.clone()),
                        x.clone(),
                        Expr::select(Expr::cmp(CmpOp::Lt, acc.clone(), x.clone()), x.clone(), acc),
                    )
                }
                "Min" if t.is_float() => Expr::select(
                    is_nan(x.clone()),
                    x.clone(),
                    Expr::select(Expr::cmp(CmpOp::Gt, acc.clone(), x.clone()), x.clone(), acc),
                ),
                "Max" => bin(BinOp::Max, acc, x.clone()),
                "Min" => bin(BinOp::Min, acc, x.clone()),
                _ => bin(BinOp::Add, acc, x.clone()),
            };
        }
        if op == "Mean" {
            acc = bin(BinOp::Div, acc, lit(n as f64, t));
        }
        Ok(acc)
    }

    fn where_expr(_: &OpCtx, _: &[Option<Ty>], a: &[Expr]) -> OpResult<Expr> {
        Ok(Expr::select(arg(a, 0)?, arg(a, 1)?, arg(a, 2)?))
    }

    fn clip_expr(c: &OpCtx, tys: &[Option<Ty>], a: &[Expr]) -> OpResult<Expr> {
        let t = in_ty(tys, 0)?;
        let (lo, hi) = if c.opset < 11 {
            (
                Some(fattr(c, "min", f32::MIN)?),
                Some(fattr(c, "max", f32::MAX)?),
            )
        } else {
            (None, None)
        };
        let has_min = tys.get(1).copied().flatten().is_some();
        let has_max = tys.get(2).copied().flatten().is_some();
        let mut x = arg(a, 0)?;
        let mut k = 1;
        let min = if has_min {
            k += 1;
            Some(arg(a, 1)?)
        } else {
            lo.map(|v| lit(v, t))
        };
        let max = if has_max {
            Some(arg(a, k)?)
        } else {
            hi.map(|v| lit(v, t))
        };
        if let Some(m) = min {
            x = Expr::select(Expr::cmp(CmpOp::Lt, x.clone(), m.clone()), m, x);
        }
        if let Some(m) = max {
            x = Expr::select(Expr::cmp(CmpOp::Gt, x.clone(), m.clone()), m, x);
        }
        Ok(x)
    }

    /// Unary elementwise ops with a scalar expression.
    const UNARY: &[&str] = &[
        "Identity",
        "OptionalGetElement",
        "Abs",
        "Neg",
        "Sign",
        "Not",
        "BitwiseNot",
        "Relu",
        "Ceil",
        "Floor",
        "Round",
        "Sqrt",
        "Reciprocal",
        "Exp",
        "Log",
        "Sin",
        "Cos",
        "Tan",
        "Asin",
        "Acos",
        "Atan",
        "Sinh",
        "Cosh",
        "Tanh",
        "Asinh",
        "Acosh",
        "Atanh",
        "Erf",
        "Sigmoid",
        "Swish",
        "HardSigmoid",
        "HardSwish",
        "LeakyRelu",
        "ThresholdedRelu",
        "Elu",
        "Celu",
        "Selu",
        "Softplus",
        "Softsign",
        "Mish",
        "Shrink",
        "Gelu",
        "IsNaN",
    ];

    /// Binary elementwise ops with a scalar expression (broadcasting; Pow only of floats).
    const BINARY: &[&str] = &[
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Mod",
        "And",
        "Or",
        "Xor",
        "BitwiseAnd",
        "BitwiseOr",
        "BitwiseXor",
        "BitShift",
        "Equal",
        "Less",
        "LessOrEqual",
        "Greater",
        "GreaterOrEqual",
        "PRelu",
    ];

    pub fn register(r: &mut Registry) {
        for op in UNARY.iter().chain(BINARY) {
            r.lower(op, Lowering::Custom(scalar));
        }
        for op in [
            "Max", "Min", "Sum", "Mean", "Where", "Clip", "IsInf", "SwiGLU",
        ] {
            r.lower(op, Lowering::Custom(scalar));
        }
        r.lower("Pow", Lowering::Custom(pow));
    }
}
