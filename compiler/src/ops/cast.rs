//! Type conversion ops: Cast, CastLike (value conversion with ONNX's saturation and
//! rounding rules) and BitCast (reinterpretation of the bits).

use super::util::*;
use super::{OpCtx, Registry};
use crate::ir::{DType, Data, OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use half::{bf16, f16};
use ndarray::ArrayD;

type Ins<'a, 'b> = &'a [Option<&'b Value>];

pub fn register(r: &mut Registry) {
    r.add("Cast", cast);
    r.add("CastLike", cast_like);
    r.add("BitCast", bitcast);
    lower::register(r);
}

/// The dtype named by an integer attribute holding a `TensorProto.DataType` code.
fn dtype_attr(c: &OpCtx, name: &str) -> OpResult<DType> {
    let code = c.attrs.req_int(name)?;
    let dt = i32::try_from(code)
        .ok()
        .and_then(DType::from_onnx)
        .ok_or_else(|| OpError::new(format!("attribute `{name}` = {code} is not a known dtype")))?;
    ensure!(dt.storage().is_some(), "{dt} tensors are not supported");
    Ok(dt)
}

/// `saturate` (opset 19+, default 1; earlier versions always saturate) and `round_mode`
/// (from `round_mode_since`, default "up").
fn cast_options(c: &OpCtx, round_mode_since: i64) -> OpResult<(bool, String)> {
    let saturate = if c.opset >= 19 {
        c.attrs.int("saturate", 1)? != 0
    } else {
        true
    };
    let mode = if c.opset >= round_mode_since {
        c.attrs.string("round_mode", "up".into())?
    } else {
        "up".into()
    };
    ensure!(
        matches!(mode.as_str(), "up" | "down" | "nearest"),
        "round_mode must be up, down or nearest, got {mode:?}"
    );
    Ok((saturate, mode))
}

fn cast(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let to = dtype_attr(c, "to")?;
    let (saturate, mode) = cast_options(c, 24)?;
    out(cast_tensor(input(ins, 0)?, to, saturate, &mode)?)
}

fn cast_like(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let to = input(ins, 1)?.dtype();
    let (saturate, mode) = cast_options(c, 25)?;
    out(cast_tensor(input(ins, 0)?, to, saturate, &mode)?)
}

/// Converts with ONNX `Cast` semantics.
pub(crate) fn cast_tensor(x: &Tensor, to: DType, saturate: bool, mode: &str) -> OpResult<Tensor> {
    let from = x.dtype();
    ensure!(
        from.storage().is_some() && to.storage().is_some(),
        "cannot cast {from} to {to}"
    );
    if to == DType::F8E8M0 && from != to {
        // Rounded from the float32 bit pattern, as ONNX's reference does.
        let v = if from == DType::Str {
            x.cast(DType::F32, saturate)
                .and_then(|t| t.to_f64())
                .ok_or_else(|| OpError::new(format!("cannot cast {from} to {to}")))?
        } else {
            f64s(x)?
        };
        let mut codes = Vec::with_capacity(v.len());
        for &e in v.iter() {
            codes.push(encode_e8m0(e, saturate, mode)?);
        }
        let a = ArrayD::from_shape_vec(v.raw_dim(), codes)
            .map_err(|e| OpError::new(format!("internal shape error: {e}")))?;
        return Ok(Tensor::from_array_as(to, a));
    }
    if from != to && from != DType::Str && from != DType::Bool && !from.is_int() {
        match to {
            // Truncate toward zero, then wrap to the width (as ml_dtypes does); NaN and
            // infinities give 0.
            DType::I4 | DType::U4 | DType::I2 | DType::U2 => {
                let v = f64s(x)?.mapv(|e| if e.is_finite() { e.trunc() as i128 } else { 0 });
                return Ok(Tensor::from_i128(to, v));
            }
            // Saturation clips to the largest finite value first (infinities included, in
            // every format), as `onnx.numpy_helper.saturate_cast` does.
            DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ if saturate => {
                let max = match to {
                    DType::F8E4M3FN => 448.0,
                    DType::F8E4M3FNUZ => 240.0,
                    _ => 57344.0,
                };
                let v = f64s(x)?.mapv(|e| if e.is_nan() { e } else { e.clamp(-max, max) });
                return Ok(Tensor::from_f64(to, v, true));
            }
            // float4e2m1 has no NaN: ml_dtypes turns NaN into a zero of the opposite sign.
            DType::F4E2M1 => {
                let v = f64s(x)?;
                let nan_code = |e: f64| if e.is_sign_negative() { 0u8 } else { 0x8 };
                let t = Tensor::from_f64(to, v.clone(), saturate);
                let codes = arr::<u8>(&t)?;
                let fixed = ndarray::Zip::from(codes).and(&v).map_collect(|&c, &e| {
                    if e.is_nan() {
                        nan_code(e)
                    } else {
                        c
                    }
                });
                return Ok(Tensor::from_array_as(to, fixed));
            }
            _ => {}
        }
    }
    x.cast(to, saturate)
        .ok_or_else(|| OpError::new(format!("cannot cast {from} to {to}")))
}

/// float8e8m0 code of `x` (a power-of-two exponent), from its float32 bits like
/// `onnx.numpy_helper.to_float8e8m0`: the sign is ignored, NaN and infinities give 0xFF.
fn encode_e8m0(x: f64, saturate: bool, mode: &str) -> OpResult<u8> {
    let bits = (x as f32).to_bits();
    let exp = (bits >> 23) & 0xFF;
    if exp == 0xFF {
        return Ok(0xFF);
    }
    let round_up = match mode {
        "up" => bits & 0x7F_FFFF != 0,
        "down" => false,
        "nearest" => {
            let g = bits & 0x40_0000 != 0;
            let r = bits & 0x20_0000 != 0;
            let s = bits & 0x1F_FFFF != 0;
            let lsb = exp > 0;
            g && (r || s || lsb)
        }
        _ => bail!("round_mode must be up, down or nearest, got {mode:?}"),
    };
    let e = if round_up && !(saturate && exp == 0xFE) {
        exp + 1
    } else {
        exp
    };
    Ok(e.min(0xFF) as u8)
}

/// Each element's bit pattern (the low `dtype.bits()` bits).
fn to_bits(t: &Tensor) -> OpResult<ArrayD<u64>> {
    let a = match t.data() {
        Data::F32(a) => a.mapv(|x| x.to_bits() as u64),
        Data::F64(a) => a.mapv(f64::to_bits),
        Data::F16(a) => a.mapv(|x| x.to_bits() as u64),
        Data::BF16(a) => a.mapv(|x| x.to_bits() as u64),
        Data::I8(a) => a.mapv(|x| x as u8 as u64),
        Data::I16(a) => a.mapv(|x| x as u16 as u64),
        Data::I32(a) => a.mapv(|x| x as u32 as u64),
        Data::I64(a) => a.mapv(|x| x as u64),
        Data::U8(a) => a.mapv(|x| x as u64),
        Data::U16(a) => a.mapv(|x| x as u64),
        Data::U32(a) => a.mapv(|x| x as u64),
        Data::U64(a) => a.clone(),
        Data::Bool(a) => a.mapv(|x| x as u64),
        Data::Str(_) => bail!("BitCast from string is not supported"),
    };
    let bits = t.dtype().bits();
    let mask = if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    };
    Ok(a.mapv(|b| b & mask))
}

/// A tensor of dtype `dt` whose elements have the given bit patterns.
fn from_bits(dt: DType, a: ArrayD<u64>) -> OpResult<Tensor> {
    Ok(match dt {
        DType::F32 => Tensor::from_array(a.mapv(|b| f32::from_bits(b as u32))),
        DType::F64 => Tensor::from_array(a.mapv(f64::from_bits)),
        DType::F16 => Tensor::from_array(a.mapv(|b| f16::from_bits(b as u16))),
        DType::BF16 => Tensor::from_array(a.mapv(|b| bf16::from_bits(b as u16))),
        DType::I8 => Tensor::from_array(a.mapv(|b| b as u8 as i8)),
        DType::I16 => Tensor::from_array(a.mapv(|b| b as u16 as i16)),
        DType::I32 => Tensor::from_array(a.mapv(|b| b as u32 as i32)),
        DType::I64 => Tensor::from_array(a.mapv(|b| b as i64)),
        DType::U8 => Tensor::from_array(a.mapv(|b| b as u8)),
        DType::U16 => Tensor::from_array(a.mapv(|b| b as u16)),
        DType::U32 => Tensor::from_array(a.mapv(|b| b as u32)),
        DType::U64 => Tensor::from_array(a),
        DType::I4 => Tensor::from_array_as(dt, a.mapv(|b| ((b as u8 as i8) << 4) >> 4)),
        DType::I2 => Tensor::from_array_as(dt, a.mapv(|b| ((b as u8 as i8) << 6) >> 6)),
        DType::U4
        | DType::U2
        | DType::F8E4M3FN
        | DType::F8E4M3FNUZ
        | DType::F8E5M2
        | DType::F8E5M2FNUZ
        | DType::F4E2M1
        | DType::F8E8M0 => Tensor::from_array_as(dt, a.mapv(|b| b as u8)),
        DType::Bool => Tensor::from_array(a.mapv(|b| b != 0)),
        DType::Str | DType::C64 | DType::C128 => bail!("BitCast to {dt} is not supported"),
    })
}

fn bitcast(c: &OpCtx, ins: Ins) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let to = dtype_attr(c, "to")?;
    let from = x.dtype();
    ensure!(
        from != DType::Str && to != DType::Str,
        "BitCast does not support strings ({from} to {to})"
    );
    ensure!(
        from.bits() == to.bits(),
        "BitCast needs dtypes of the same bit width, got {from} ({} bits) and {to} ({} bits)",
        from.bits(),
        to.bits()
    );
    out(from_bits(to, to_bits(x)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_rounding() {
        assert_eq!(encode_e8m0(1.0, true, "up").unwrap(), 127);
        assert_eq!(encode_e8m0(1.1, true, "up").unwrap(), 128);
        assert_eq!(encode_e8m0(1.1, true, "down").unwrap(), 127);
        assert_eq!(encode_e8m0(1.6, true, "nearest").unwrap(), 128);
        assert_eq!(encode_e8m0(0.0, true, "up").unwrap(), 0);
        assert_eq!(encode_e8m0(f64::NAN, true, "up").unwrap(), 0xFF);
    }

    #[test]
    fn bitcast_roundtrip() {
        let t = Tensor::from_vec(&[2], vec![1.0f32, -2.5]);
        let b = from_bits(DType::I32, to_bits(&t).unwrap()).unwrap();
        assert_eq!(
            b.to_i64_vec().unwrap(),
            vec![0x3F80_0000, 0xC020_0000u32 as i32 as i64]
        );
    }
}

/// Lowering of Cast and CastLike between the dtypes compiled code holds.
pub(crate) mod lower {
    use crate::ensure;
    use crate::ir::{DType, OpResult};
    use crate::kir::build::*;
    use crate::kir::{BinOp, CmpOp, Expr, Kernel, MathFn, Stmt, Ty, UnOp, VarId};
    use crate::ops::lowering::{elementwise, kir_ty, lit, LowerCtx};
    use crate::ops::{Lowering, OpCtx, Registry};

    fn cast(lw: &mut LowerCtx) -> OpResult<()> {
        let from = lw.input(0)?.ty().compute();
        let out = &lw.outputs[0];
        let to = out.ty().compute();
        let to_bool = out.dtype == crate::ir::DType::Bool;
        // CastLike's second input only names the type.
        if lw.inputs.len() > 1 {
            lw.inputs.truncate(1);
        }
        // Saturating casts to the 8/4-bit floats clamp to the largest finite value first
        // (the store then rounds to nearest even).
        let sat_max = match out.ty() {
            Ty::F8E4M3FN => Some(448.0),
            Ty::F8E4M3FNUZ => Some(240.0),
            Ty::F8E5M2 | Ty::F8E5M2FNUZ => Some(57344.0),
            Ty::F8E8M0 => Some(2f64.powi(127)),
            _ => None,
        }
        .filter(|_| lw.op.attrs.int("saturate", 1).unwrap_or(1) != 0);
        let sat_max = match out.ty() {
            Ty::F4E2M1 => Some(6.0), // no Inf or NaN: always saturates
            _ => sat_max,
        };
        if out.ty() == Ty::F8E8M0 {
            let mode = lw
                .op
                .attrs
                .string("round_mode", "up".to_string())
                .unwrap_or_default();
            crate::ensure!(
                mode == "up",
                "Cast to float8e8m0 with round_mode `{mode}`: only `up` is compiled"
            );
        }
        elementwise(lw, 0, |_, a| {
            Ok(convert(from, to, to_bool, sat_max, a[0].clone()))
        })
    }

    /// `x` of compute type `from` converted to compute type `to` as Cast converts it
    /// (`to_bool`: to bool; `sat_max`: clamped to +-this first, for the small floats).
    fn convert(from: Ty, to: Ty, to_bool: bool, sat_max: Option<f64>, x: Expr) -> Expr {
        let x = match sat_max {
            Some(m) if from.is_float() => {
                let c = |v: f64| Expr::f(v, from);
                Expr::bin(BinOp::Min, Expr::bin(BinOp::Max, x, c(-m)), c(m))
            }
            _ => x,
        };
        if to_bool {
            Expr::cmp(CmpOp::Ne, x, lit(0.0, from))
        } else if from.is_float() && !to.is_float() && to != Ty::I64 && to.bytes() < 8 {
            // Truncate to i64, then wrap to the width, like the reference.
            Expr::cast(to, Expr::cast(Ty::I64, x))
        } else {
            Expr::cast(to, x)
        }
    }

    /// The target of a Cast node that a fused elementwise kernel computes: one whose
    /// type is its own compute type (a narrower float would have to round in between),
    /// from and to anything but strings.
    pub(crate) fn fusible_target(c: &OpCtx) -> Option<DType> {
        if c.op_type != "Cast" || !c.domain.is_empty() {
            return None;
        }
        let to = super::dtype_attr(c, "to").ok()?;
        let t = kir_ty(to)?;
        (t == t.compute() && to != DType::Str).then_some(to)
    }

    /// Cast's scalar expression in a fused kernel (see [`fusible_target`]).
    pub(crate) fn cast_expr(c: &OpCtx, tys: &[Option<Ty>], a: &[Expr]) -> OpResult<Expr> {
        let to = fusible_target(c)
            .ok_or_else(|| crate::ir::OpError::new("Cast to a narrow type in a fused kernel"))?;
        let from = tys
            .first()
            .copied()
            .flatten()
            .ok_or_else(|| crate::ir::OpError::new("Cast without an input"))?;
        let x = a
            .first()
            .cloned()
            .ok_or_else(|| crate::ir::OpError::new("Cast without an input"))?;
        let t = kir_ty(to).expect("checked");
        Ok(convert(from, t, to == DType::Bool, None, x))
    }

    /// (mantissa bits, exponent bias, total bits) of a float storage type.
    fn fparams(t: Ty) -> Option<(i64, i64, i64)> {
        match t {
            Ty::F32 => Some((23, 127, 32)),
            Ty::F64 => Some((52, 1023, 64)),
            Ty::F16 => Some((10, 15, 16)),
            Ty::BF16 => Some((7, 127, 16)),
            _ => None,
        }
    }

    fn i(x: i64) -> Expr {
        Expr::Int(x)
    }
    fn pow2(e: Expr) -> Expr {
        Expr::call(MathFn::Pow, vec![f(2.0), Expr::cast(Ty::F64, e)])
    }

    /// Statements that leave the bit pattern of float `x` (F32 or F64 value of a float
    /// of `params`) in the returned i64 variable. NaN payloads become the quiet NaN.
    fn float_to_bits(
        k: &mut Kernel,
        x: Expr,
        (mb, bias, w): (i64, i64, i64),
    ) -> (Vec<Stmt>, VarId) {
        let (fx, a) = (k.var(Ty::F64), k.var(Ty::F64));
        let (s, e, bits) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let emask = (1i64 << (w - 1 - mb)) - 1;
        let neg = bin(
            BinOp::Or,
            Expr::cmp(CmpOp::Lt, v(fx), f(0.0)),
            Expr::cmp(CmpOp::Lt, bin(BinOp::Div, f(1.0), v(fx)), f(0.0)),
        );
        let or = |a, b| bin(BinOp::Or, a, b);
        let normal = vec![
            set(
                e,
                Expr::cast(
                    Ty::I64,
                    Expr::un(
                        UnOp::Floor,
                        bin(
                            BinOp::Div,
                            Expr::call(MathFn::Log, vec![v(a)]),
                            f(std::f64::consts::LN_2),
                        ),
                    ),
                ),
            ),
            Stmt::If {
                cond: Expr::cmp(CmpOp::Lt, v(a), pow2(v(e))),
                then: vec![set(e, bin(BinOp::Sub, v(e), i(1)))],
                els: vec![],
            },
            Stmt::If {
                cond: Expr::cmp(CmpOp::Ge, v(a), pow2(Expr::add(v(e), i(1)))),
                then: vec![set(e, Expr::add(v(e), i(1)))],
                els: vec![],
            },
            set(
                bits,
                or(
                    or(v(s), bin(BinOp::Shl, Expr::add(v(e), i(bias)), i(mb))),
                    Expr::cast(
                        Ty::I64,
                        Expr::mul(
                            bin(BinOp::Sub, bin(BinOp::Div, v(a), pow2(v(e))), f(1.0)),
                            f((mb as f64).exp2()),
                        ),
                    ),
                ),
            ),
        ];
        let sub = vec![set(
            bits,
            or(
                v(s),
                Expr::cast(
                    Ty::I64,
                    Expr::mul(
                        Expr::mul(v(a), f(((bias - 1) as f64).exp2())),
                        f((mb as f64).exp2()),
                    ),
                ),
            ),
        )];
        let stmts = vec![
            set(fx, x),
            set(a, Expr::un(UnOp::Abs, v(fx))),
            set(s, bin(BinOp::Shl, Expr::cast(Ty::I64, neg), i(w - 1))),
            Stmt::If {
                cond: Expr::cmp(CmpOp::Ne, v(a), v(a)),
                then: vec![set(bits, i((emask << mb) | (1i64 << (mb - 1))))],
                els: vec![Stmt::If {
                    cond: Expr::cmp(CmpOp::Eq, v(a), f(f64::INFINITY)),
                    then: vec![set(bits, or(v(s), i(emask << mb)))],
                    els: vec![Stmt::If {
                        cond: Expr::cmp(CmpOp::Lt, v(a), f(((1 - bias) as f64).exp2())),
                        then: sub,
                        els: normal,
                    }],
                }],
            },
        ];
        (stmts, bits)
    }

    /// Statements that leave the F64 value of the bit pattern `b` (i64) of a float of
    /// `params` in the returned variable.
    fn bits_to_float(
        k: &mut Kernel,
        b: Expr,
        (mb, bias, w): (i64, i64, i64),
    ) -> (Vec<Stmt>, VarId) {
        let (bu, e, m) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let (mf, val) = (k.var(Ty::F64), k.var(Ty::F64));
        let emask = (1i64 << (w - 1 - mb)) - 1;
        let b = if w < 64 {
            bin(BinOp::And, b, i((1i64 << w) - 1))
        } else {
            b
        };
        let sign_bit = if w == 64 { i64::MIN } else { 1i64 << (w - 1) };
        let frac = Expr::mul(v(mf), f((-mb as f64).exp2()));
        let value = Expr::select(
            Expr::cmp(CmpOp::Eq, v(e), i(emask)),
            Expr::select(
                Expr::cmp(CmpOp::Eq, v(m), i(0)),
                f(f64::INFINITY),
                f(f64::NAN),
            ),
            Expr::select(
                Expr::cmp(CmpOp::Eq, v(e), i(0)),
                Expr::mul(frac.clone(), f(((1 - bias) as f64).exp2())),
                Expr::mul(
                    Expr::add(f(1.0), frac),
                    pow2(bin(BinOp::Sub, v(e), i(bias))),
                ),
            ),
        );
        let stmts = vec![
            set(bu, b),
            set(e, bin(BinOp::And, bin(BinOp::Shr, v(bu), i(mb)), i(emask))),
            set(m, bin(BinOp::And, v(bu), i((1i64 << mb) - 1))),
            set(mf, Expr::cast(Ty::F64, v(m))),
            set(val, value),
            Stmt::If {
                cond: Expr::cmp(CmpOp::Ne, bin(BinOp::And, v(bu), i(sign_bit)), i(0)),
                then: vec![set(val, Expr::un(UnOp::Neg, v(val)))],
                els: vec![],
            },
        ];
        (stmts, val)
    }

    fn bitcast(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let out = lw.outputs[0].clone();
        let (ft, tt) = (x.ty(), out.ty());
        ensure!(
            ft.bytes() == tt.bytes() || out.dtype == DType::Bool || x.dtype == DType::Bool,
            "BitCast needs one bit width"
        );
        let mut k = lw.kernel("");
        let j = k.var(Ty::I64);
        let xj = Expr::load(x.buf, v(j));
        let mut body = Vec::new();
        // The bit pattern as i64.
        let bits = match fparams(ft) {
            Some(p) => {
                let xf = if ft.compute() == Ty::F64 {
                    xj
                } else {
                    Expr::cast(Ty::F64, xj)
                };
                let (st, b) = float_to_bits(&mut k, xf, p);
                body.extend(st);
                v(b)
            }
            None => {
                if ft == Ty::I64 {
                    xj
                } else {
                    Expr::cast(Ty::I64, xj)
                }
            }
        };
        let value = match fparams(tt) {
            Some(p) => {
                let (st, val) = bits_to_float(&mut k, bits, p);
                body.extend(st);
                let c = tt.compute();
                if c == Ty::F64 {
                    v(val)
                } else {
                    Expr::cast(c, v(val))
                }
            }
            None if out.dtype == DType::Bool => Expr::cmp(CmpOp::Ne, bits, i(0)),
            None if tt == Ty::I64 => bits,
            None => Expr::cast(tt, bits),
        };
        body.push(Stmt::Store {
            buf: out.buf,
            index: v(j),
            value,
        });
        k.body = vec![Stmt::For {
            var: j,
            extent: out.len() as u64,
            body,
        }];
        lw.push(k);
        Ok(())
    }

    pub fn register(r: &mut Registry) {
        r.lower("BitCast", Lowering::Custom(bitcast));
        r.lower("Cast", Lowering::Custom(cast));
        r.lower("CastLike", Lowering::Custom(cast));
    }
}
