//! Linear quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear.

use super::util::{f64s, input, opt_input, outs, round_to, zip_broadcast};
use super::{OpCtx, Registry};
use crate::ir::{DType, OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{ArrayD, IxDyn};

pub fn register(r: &mut Registry) {
    r.add("QuantizeLinear", quantize_linear);
    r.add("DequantizeLinear", dequantize_linear);
    r.add("DynamicQuantizeLinear", dynamic_quantize_linear);
    lower::register(r);
}

fn err(e: impl std::fmt::Display) -> OpError {
    OpError::new(format!("internal shape error: {e}"))
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
            odt.bits() <= 16,
            "QuantizeLinear does not support output dtype {odt}"
        );
        let r = zip_broadcast(&q, &z, |v, zz| {
            // Saturating: an infinite `v` is i128::MAX here (it wrapped to the low end).
            (v.round_ties_even() as i128)
                .saturating_add(zz as i128)
                .clamp(lo, hi)
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

/// Lowerings: per-tensor, per-axis and blocked scales and zero points, integer targets.
pub(crate) mod lower {
    use crate::ir::{DType, OpError, OpResult};
    use crate::kir::{BinOp, CmpOp, Expr, Stmt, Ty, UnOp, VarId};
    use crate::ops::lowering::{index, nest, strides, LowerCtx, TensorRef};
    use crate::ops::{Lowering, OpCtx, Registry};
    use crate::{bail, ensure};

    fn f64e(e: Expr, t: Ty) -> Expr {
        if t.compute() == Ty::F64 {
            e
        } else {
            Expr::cast(Ty::F64, e)
        }
    }

    /// The index of a scale or zero point for the element at `v` (input shape `xs`).
    fn param_index(
        p: &TensorRef,
        xs: &[usize],
        axis: i64,
        block: i64,
        v: &[VarId],
    ) -> OpResult<Expr> {
        if p.len() == 1 {
            return Ok(Expr::Int(0));
        }
        let r = xs.len() as i64;
        ensure!(
            axis >= -r && axis < r,
            "axis {axis} is out of range for rank {r}"
        );
        let ax = if axis < 0 { axis + r } else { axis } as usize;
        if block <= 0 {
            ensure!(
                p.shape.len() == 1 && p.len() == xs[ax],
                "parameter of shape {:?} does not match axis {ax} of {xs:?}",
                p.shape
            );
            return Ok(Expr::Var(v[ax]));
        }
        let bs = block as usize;
        ensure!(
            p.shape.len() == xs.len()
                && (0..xs.len()).all(|d| if d == ax {
                    p.shape[d] == xs[d].div_ceil(bs)
                } else {
                    p.shape[d] == xs[d]
                }),
            "parameter of shape {:?} does not block {xs:?}",
            p.shape
        );
        let ps = strides(&p.shape);
        let mut e = Expr::Int(0);
        for d in 0..xs.len() {
            let i = if d == ax {
                Expr::bin(BinOp::Div, Expr::Var(v[d]), Expr::Int(bs as i64))
            } else {
                Expr::Var(v[d])
            };
            e = Expr::add(e, Expr::mul(i, Expr::Int(ps[d] as i64)));
        }
        Ok(e)
    }

    /// Builds one loop nest over `shape`; `f` gives the body (errors propagate).
    fn run(
        lw: &mut LowerCtx,
        shape: &[usize],
        f: impl FnOnce(&[VarId]) -> OpResult<Vec<Stmt>>,
    ) -> OpResult<()> {
        // Empty shapes still get a (zero-trip) loop, so the output counts as written.
        let mut k = lw.kernel("");
        let mut res = Ok(());
        k.body = nest(&mut k, shape, |_, v| match f(v) {
            Ok(b) => b,
            Err(e) => {
                res = Err(e);
                vec![]
            }
        });
        res?;
        lw.push(k);
        Ok(())
    }

    fn quantize(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let sc = lw.input(1)?.clone();
        let zp = lw.opt_input(2).cloned();
        let out = lw.outputs[0].clone();
        let axis = lw.op.attrs.int("axis", 1)?;
        let block = lw.op.attrs.int("block_size", 0)?;
        let precision = lw.op.attrs.int("precision", 0)?;
        if precision != 0 && DType::from_onnx(precision as i32) != Some(x.dtype) {
            return Err(OpError::unsupported(
                "QuantizeLinear with another precision",
            ));
        }
        ensure!(x.dtype.is_float(), "QuantizeLinear expects a float input");
        let (lo, hi) = match out.dtype {
            DType::U8 => (0.0, 255.0),
            DType::I8 => (-128.0, 127.0),
            DType::U16 => (0.0, 65535.0),
            DType::I16 => (-32768.0, 32767.0),
            DType::I32 => (i32::MIN as f64, i32::MAX as f64),
            DType::U4 => (0.0, 15.0),
            DType::I4 => (-8.0, 7.0),
            DType::U2 => (0.0, 3.0),
            DType::I2 => (-2.0, 1.0),
            DType::F8E4M3FN
            | DType::F8E4M3FNUZ
            | DType::F8E5M2
            | DType::F8E5M2FNUZ
            | DType::F4E2M1 => return quantize_float(lw, x, sc, zp, out, axis, block),
            d => return Err(OpError::unsupported(format!("QuantizeLinear to {d}"))),
        };
        if let Some(z) = &zp {
            ensure!(
                z.dtype == out.dtype,
                "zero point dtype differs from the output"
            );
        }
        let ct = x.ty().compute();
        let xs = strides(&x.shape);
        let shape = x.shape.clone();
        let ot = out.ty().compute();
        // The sum and clamp in f64, or in f32 for f32 inputs and outputs of 16 bits or
        // fewer: `round(x / s)` is an integer (or inf, NaN) and adding an integer zero
        // point is exact in f32 below 2^24, and past that it rounds to values that clamp
        // as the exact ones do.
        let at = if ct == Ty::F32 && hi <= 65535.0 {
            Ty::F32
        } else {
            Ty::F64
        };
        run(lw, &shape, |v| {
            let si = param_index(&sc, &shape, axis, block, v)?;
            let mut s = Expr::load(sc.buf, si);
            if sc.ty().compute() != ct {
                s = Expr::cast(ct, s);
            }
            let z = match &zp {
                Some(z) => Some(Expr::load(z.buf, param_index(z, &shape, axis, block, v)?)),
                None => None,
            };
            let x = Expr::load(x.buf, index(v, &xs));
            Ok(vec![Stmt::Store {
                buf: out.buf,
                index: index(v, &xs),
                value: quantized(x, s, z, (ct, at, ot), (lo, hi)),
            }])
        })
    }

    /// `ot(clamp(round(x / s) + z, lo, hi))`: the quotient in `ct` (x's and the scale's
    /// compute type), the rest in `at`; the standalone loop's and a fused kernel's.
    fn quantized(x: Expr, s: Expr, z: Option<Expr>, tys: (Ty, Ty, Ty), range: (f64, f64)) -> Expr {
        let (ct, at, ot) = tys;
        let mut y = Expr::un(UnOp::Nearest, Expr::bin(BinOp::Div, x, s));
        if at != ct {
            y = Expr::cast(at, y);
        }
        if let Some(z) = z {
            y = Expr::add(y, Expr::cast(at, z));
        }
        let y = Expr::bin(
            BinOp::Max,
            Expr::bin(BinOp::Min, y, Expr::f(range.1, at)),
            Expr::f(range.0, at),
        );
        Expr::cast(ot, y)
    }

    /// QuantizeLinear in a fused elementwise kernel: f32 `x` by one f32 scale and zero
    /// point to an 8-bit integer (`fuse_elementwise` fuses no other), the expression the
    /// standalone loop above stores (`round(x / s)` in f32, the zero point added, clamped).
    pub(crate) fn quantize_expr(_: &OpCtx, tys: &[Option<Ty>], a: &[Expr]) -> OpResult<Expr> {
        let zt = tys.get(2).copied().flatten();
        ensure!(
            tys.first() == Some(&Some(Ty::F32)) && tys.get(1) == Some(&Some(Ty::F32)),
            "fused QuantizeLinear of f32 by an f32 scale"
        );
        let (out, lo, hi) = match zt {
            None | Some(Ty::U8) => (Ty::U8, 0.0, 255.0),
            Some(Ty::I8) => (Ty::I8, -128.0, 127.0),
            Some(t) => bail!("fused QuantizeLinear to {t}"),
        };
        let z = match zt {
            Some(_) => Some(
                a.get(2)
                    .cloned()
                    .ok_or_else(|| OpError::new("zero point missing"))?,
            ),
            None => None,
        };
        let (f32t, range) = (Ty::F32, (lo, hi));
        Ok(quantized(
            a[0].clone(),
            a[1].clone(),
            z,
            (f32t, f32t, out),
            range,
        ))
    }

    /// QuantizeLinear to an 8- or 4-bit float: `x / scale` (plus the zero point for
    /// float4), clamped to the largest finite value when saturating, rounded by the store.
    fn quantize_float(
        lw: &mut LowerCtx,
        x: TensorRef,
        sc: TensorRef,
        zp: Option<TensorRef>,
        out: TensorRef,
        axis: i64,
        block: i64,
    ) -> OpResult<()> {
        let saturate = lw.op.attrs.int("saturate", 1)? != 0 || out.dtype == DType::F4E2M1;
        let max = match out.dtype {
            DType::F8E4M3FN => 448.0,
            DType::F8E4M3FNUZ => 240.0,
            DType::F4E2M1 => 6.0,
            _ => 57344.0,
        };
        let ct = x.ty().compute();
        let xs = strides(&x.shape);
        let shape = x.shape.clone();
        run(lw, &shape, |v| {
            let si = param_index(&sc, &shape, axis, block, v)?;
            let mut s = Expr::load(sc.buf, si);
            if sc.ty().compute() != ct {
                s = Expr::cast(ct, s);
            }
            let mut y = Expr::bin(BinOp::Div, Expr::load(x.buf, index(v, &xs)), s);
            if let (Some(z), DType::F4E2M1) = (&zp, out.dtype) {
                let zi = param_index(z, &shape, axis, block, v)?;
                y = Expr::add(y, Expr::cast(ct, Expr::load(z.buf, zi)));
            }
            if saturate {
                y = Expr::bin(
                    BinOp::Min,
                    Expr::bin(BinOp::Max, y, Expr::f(-max, ct)),
                    Expr::f(max, ct),
                );
            }
            if ct != Ty::F32 {
                y = Expr::cast(Ty::F32, y);
            }
            Ok(vec![Stmt::Store {
                buf: out.buf,
                index: index(v, &xs),
                value: y,
            }])
        })
    }

    fn dequantize(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        let sc = lw.input(1)?.clone();
        let zp = lw.opt_input(2).cloned();
        let out = lw.outputs[0].clone();
        let axis = lw.op.attrs.int("axis", 1)?;
        let block = lw.op.attrs.int("block_size", 0)?;
        let float_in = x.ty().is_float();
        if !x.dtype.is_int() && !float_in {
            return Err(OpError::unsupported(format!(
                "DequantizeLinear of {}",
                x.dtype
            )));
        }
        // Float inputs ignore their zero point (it must be zero for float8).
        let zp = if float_in { None } else { zp };
        if let Some(z) = &zp {
            ensure!(
                z.dtype == x.dtype,
                "zero point dtype differs from the input"
            );
        }
        let ot = out.ty().compute();
        ensure!(ot.is_float(), "DequantizeLinear output must be a float");
        let xs = strides(&x.shape);
        let shape = x.shape.clone();
        // In f64, or in f32 for integers of 16 bits or fewer, an f32 (or narrower) scale
        // and output: `x - zero_point` is exact in f32 and its product by the scale
        // exact in f64, so f32's one rounding of the product is f64's final one.
        let small = x.dtype.is_int() && x.dtype.bits() <= 16;
        let at = if small && sc.ty().compute() == Ty::F32 && ot == Ty::F32 {
            Ty::F32
        } else {
            Ty::F64
        };
        run(lw, &shape, |v| {
            let mut d = Expr::cast(at, Expr::load(x.buf, index(v, &xs)));
            if let Some(z) = &zp {
                let zi = param_index(z, &shape, axis, block, v)?;
                d = Expr::bin(BinOp::Sub, d, Expr::cast(at, Expr::load(z.buf, zi)));
            }
            let si = param_index(&sc, &shape, axis, block, v)?;
            let s = Expr::load(sc.buf, si);
            let s = if at == Ty::F64 { f64e(s, sc.ty()) } else { s };
            let y = Expr::mul(d, s);
            Ok(vec![Stmt::Store {
                buf: out.buf,
                index: index(v, &xs),
                value: if ot == at { y } else { Expr::cast(ot, y) },
            }])
        })
    }

    fn dynamic_quantize(lw: &mut LowerCtx) -> OpResult<()> {
        let x = lw.input(0)?.clone();
        ensure!(
            x.dtype.is_float(),
            "DynamicQuantizeLinear expects a float input"
        );
        ensure!(
            lw.outputs.len() == 3,
            "DynamicQuantizeLinear needs its three outputs"
        );
        let (y, ys, yz) = (
            lw.outputs[0].clone(),
            lw.outputs[1].clone(),
            lw.outputs[2].clone(),
        );
        if ys.ty().compute() != x.ty().compute() {
            bail!("DynamicQuantizeLinear: scale type differs from the input");
        }
        let ct = x.ty().compute();
        let l = |v: f64| Expr::f(v, ct);
        let n = x.len() as u64;
        let mut k = lw.kernel("");
        let (mx, mn, sc, zp) = (k.var(ct), k.var(ct), k.var(ct), k.var(ct));
        let (j, j2) = (k.var(Ty::I64), k.var(Ty::I64));
        let xj = Expr::load(x.buf, Expr::Var(j));
        let v = |e| Expr::Var(e);
        let mut body = vec![
            Stmt::Set {
                var: mx,
                value: l(0.0),
            },
            Stmt::Set {
                var: mn,
                value: l(0.0),
            },
            Stmt::For {
                var: j,
                extent: n,
                body: vec![
                    Stmt::Set {
                        var: mx,
                        value: Expr::bin(BinOp::Max, v(mx), xj.clone()),
                    },
                    Stmt::Set {
                        var: mn,
                        value: Expr::bin(BinOp::Min, v(mn), xj),
                    },
                ],
            },
            Stmt::Set {
                var: sc,
                value: Expr::bin(
                    BinOp::Div,
                    Expr::select(
                        Expr::cmp(CmpOp::Eq, v(mx), v(mn)),
                        l(1.0),
                        Expr::bin(BinOp::Sub, v(mx), v(mn)),
                    ),
                    l(255.0),
                ),
            },
            Stmt::Set {
                var: zp,
                value: Expr::un(
                    UnOp::Nearest,
                    Expr::bin(
                        BinOp::Max,
                        Expr::bin(
                            BinOp::Min,
                            Expr::bin(BinOp::Sub, l(0.0), Expr::bin(BinOp::Div, v(mn), v(sc))),
                            l(255.0),
                        ),
                        l(0.0),
                    ),
                ),
            },
            Stmt::Store {
                buf: ys.buf,
                index: Expr::Int(0),
                value: v(sc),
            },
            Stmt::Store {
                buf: yz.buf,
                index: Expr::Int(0),
                value: Expr::cast(Ty::U8, v(zp)),
            },
        ];
        let q = Expr::add(
            Expr::un(
                UnOp::Nearest,
                Expr::bin(BinOp::Div, Expr::load(x.buf, Expr::Var(j2)), v(sc)),
            ),
            v(zp),
        );
        body.push(Stmt::For {
            var: j2,
            extent: n,
            body: vec![Stmt::Store {
                buf: y.buf,
                index: Expr::Var(j2),
                value: Expr::cast(
                    Ty::U8,
                    Expr::bin(BinOp::Max, Expr::bin(BinOp::Min, q, l(255.0)), l(0.0)),
                ),
            }],
        });
        k.body = body;
        lw.push(k);
        Ok(())
    }

    pub fn register(r: &mut Registry) {
        r.lower("QuantizeLinear", Lowering::Custom(quantize));
        r.lower("DequantizeLinear", Lowering::Custom(dequantize));
        r.lower("DynamicQuantizeLinear", Lowering::Custom(dynamic_quantize));
    }
}
