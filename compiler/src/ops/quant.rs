//! Linear quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear.

use super::util::{f64s, input, opt_input, outs, zip_broadcast};
use super::{OpCtx, Registry};
use crate::ir::{DType, OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{ArrayD, IxDyn};

pub fn register(r: &mut Registry) {
    r.add("QuantizeLinear", quantize_linear);
    r.add("DequantizeLinear", dequantize_linear);
    r.add("DynamicQuantizeLinear", dynamic_quantize_linear);
}

fn err(e: impl std::fmt::Display) -> OpError {
    OpError::new(format!("internal shape error: {e}"))
}

/// Rounds f64 values to the precision of float dtype `dt` (identity for f64).
fn round_to(dt: DType, a: ArrayD<f64>) -> ArrayD<f64> {
    match dt {
        DType::F64 => a,
        DType::F32 => a.mapv(|v| v as f32 as f64),
        _ if dt.is_float() => Tensor::from_f64(dt, a.clone(), false).to_f64().unwrap_or(a),
        _ => a,
    }
}

/// Makes a scale or zero point broadcastable to `xshape`: scalars stay scalars, 1-D
/// parameters apply along `axis` (per-axis), and with `block_size` > 0 each parameter
/// covers `block_size` consecutive elements along `axis` (blocked).
fn expand_param(
    p: ArrayD<f64>,
    xshape: &[usize],
    axis: i64,
    block_size: i64,
    what: &str,
) -> OpResult<ArrayD<f64>> {
    if p.len() == 1 {
        let v = p.iter().copied().next().unwrap_or(0.0);
        return Ok(ArrayD::from_elem(IxDyn(&[]), v));
    }
    let rank = xshape.len();
    let ax = super::util::axis(axis, rank)?;
    ensure!(ax < rank, "axis {axis} is out of range for rank {rank}");
    if block_size <= 0 {
        ensure!(
            p.ndim() == 1 && p.len() == xshape[ax],
            "{what} of shape {:?} does not match axis {ax} of input shape {xshape:?}",
            p.shape()
        );
        let mut d = vec![1usize; rank];
        d[ax] = p.len();
        return p.into_shape_with_order(IxDyn(&d)).map_err(err);
    }
    let bs = block_size as usize;
    let ps = p.shape().to_vec();
    ensure!(
        ps.len() == rank
            && (0..rank).all(|d| if d == ax {
                ps[d] == xshape[d].div_ceil(bs)
            } else {
                ps[d] == xshape[d]
            }),
        "{what} of shape {ps:?} does not block input shape {xshape:?} along axis {ax} with block size {bs}"
    );
    let outer: usize = xshape[..ax].iter().product();
    let inner: usize = xshape[ax + 1..].iter().product();
    let (n, nb) = (xshape[ax], ps[ax]);
    let pv: Vec<f64> = p.iter().copied().collect();
    let mut v = Vec::with_capacity(outer * n * inner);
    for o in 0..outer {
        for j in 0..n {
            let base = (o * nb + j / bs) * inner;
            v.extend_from_slice(&pv[base..base + inner]);
        }
    }
    ArrayD::from_shape_vec(IxDyn(xshape), v).map_err(err)
}

fn is_fp8(dt: DType) -> bool {
    matches!(
        dt,
        DType::F8E4M3FN | DType::F8E4M3FNUZ | DType::F8E5M2 | DType::F8E5M2FNUZ
    )
}

fn quantize_linear(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let scale = input(ins, 1)?;
    let zp = opt_input(ins, 2)?;
    let axis = ctx.attrs.int("axis", 1)?;
    let saturate = ctx.attrs.int("saturate", 1)? != 0;
    let block_size = ctx.attrs.int("block_size", 0)?;
    let output_dtype = ctx.attrs.int("output_dtype", 0)?;
    let precision = ctx.attrs.int("precision", 0)?;
    let attr_dt = if output_dtype != 0 {
        Some(
            DType::from_onnx(output_dtype as i32)
                .ok_or_else(|| OpError::new(format!("unknown output_dtype {output_dtype}")))?,
        )
    } else {
        None
    };
    let odt = match (zp, attr_dt) {
        (Some(z), Some(a)) => {
            ensure!(
                z.dtype() == a,
                "output_dtype {a} does not match the zero point's dtype {}",
                z.dtype()
            );
            a
        }
        (Some(z), None) => z.dtype(),
        (None, Some(a)) => a,
        (None, None) => DType::U8,
    };
    ensure!(
        x.dtype().is_float(),
        "QuantizeLinear expects a float input, got {}",
        x.dtype()
    );
    let cdt = if precision != 0 {
        DType::from_onnx(precision as i32)
            .ok_or_else(|| OpError::new(format!("unknown precision {precision}")))?
    } else {
        x.dtype()
    };
    let xshape = x.shape().to_vec();
    let s = expand_param(f64s(scale)?, &xshape, axis, block_size, "y_scale")?;
    let q = round_to(
        cdt,
        zip_broadcast(&round_to(cdt, f64s(x)?), &round_to(cdt, s), |a, b| a / b)?,
    );
    let z = match zp {
        Some(z) => expand_param(f64s(z)?, &xshape, axis, block_size, "y_zero_point")?,
        None => ArrayD::from_elem(IxDyn(&[]), 0.0),
    };
    if let Some((lo, hi)) = odt.int_range() {
        ensure!(
            matches!(
                odt,
                DType::U8
                    | DType::I8
                    | DType::U16
                    | DType::I16
                    | DType::U4
                    | DType::I4
                    | DType::U2
                    | DType::I2
            ),
            "QuantizeLinear does not support output dtype {odt}"
        );
        let r = zip_broadcast(&q, &z, |v, zz| {
            ((v.round_ties_even() as i128) + zz as i128).clamp(lo, hi)
        })?;
        return outs(vec![Tensor::from_i128(odt, r)]);
    }
    if is_fp8(odt) {
        return outs(vec![Tensor::from_f64(odt, q, saturate)]);
    }
    if odt == DType::F4E2M1 {
        let r = zip_broadcast(&q, &z, |v, zz| v + zz)?;
        return outs(vec![Tensor::from_f64(odt, round_to(cdt, r), true)]);
    }
    bail!("QuantizeLinear does not support output dtype {odt}")
}

fn dequantize_linear(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let scale = input(ins, 1)?;
    let zp = opt_input(ins, 2)?;
    let axis = ctx.attrs.int("axis", 1)?;
    let block_size = ctx.attrs.int("block_size", 0)?;
    let output_dtype = ctx.attrs.int("output_dtype", 0)?;
    let odt = if output_dtype != 0 {
        DType::from_onnx(output_dtype as i32)
            .ok_or_else(|| OpError::new(format!("unknown output_dtype {output_dtype}")))?
    } else {
        scale.dtype()
    };
    ensure!(
        odt.is_float(),
        "DequantizeLinear output dtype must be a float, got {odt}"
    );
    let xdt = x.dtype();
    ensure!(
        xdt.is_numeric(),
        "DequantizeLinear expects a numeric input, got {xdt}"
    );
    let xshape = x.shape().to_vec();
    let mut dx = f64s(x)?;
    let float_in = is_fp8(xdt) || xdt == DType::F4E2M1;
    if let Some(z) = zp {
        let zv = f64s(z)?;
        if is_fp8(xdt) {
            ensure!(
                zv.iter().all(|&v| v == 0.0),
                "the zero point must be zero for float8 inputs"
            );
        } else if !float_in {
            ensure!(
                z.dtype() == xdt,
                "zero point dtype {} differs from input dtype {xdt}",
                z.dtype()
            );
            let zz = expand_param(zv, &xshape, axis, block_size, "x_zero_point")?;
            dx = zip_broadcast(&dx, &zz, |a, b| a - b)?;
        }
    }
    let s = expand_param(f64s(scale)?, &xshape, axis, block_size, "x_scale")?;
    let y = zip_broadcast(&dx, &s, |a, b| a * b)?;
    outs(vec![Tensor::from_f64(odt, y, false)])
}

fn dynamic_quantize_linear(_ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let dt = x.dtype();
    ensure!(
        dt.is_float(),
        "DynamicQuantizeLinear expects a float input, got {dt}"
    );
    let f = |v: f64| v as f32 as f64;
    let xv = f64s(x)?.mapv(f);
    let maxx = xv.iter().fold(0.0f64, |m, &v| m.max(v));
    let minx = xv.iter().fold(0.0f64, |m, &v| m.min(v));
    let (qmin, qmax) = (0.0f64, 255.0f64);
    let scale = f(if maxx == minx { 1.0 } else { f(maxx - minx) } / (qmax - qmin));
    let initial_zp = f(qmin - f(minx / scale));
    let zp = initial_zp.clamp(qmin, qmax).round_ties_even();
    let y = xv.mapv(|v| (f(v / scale).round_ties_even() + zp).clamp(qmin, qmax) as u8);
    let scale_t = Tensor::from_f64(dt, ArrayD::from_elem(IxDyn(&[]), scale), false);
    outs(vec![
        Tensor::from_array(y),
        scale_t,
        Tensor::scalar(zp as u8),
    ])
}
