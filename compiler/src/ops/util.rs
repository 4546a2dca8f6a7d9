//! Helpers shared by op implementations: input access, axes, broadcasting, and numeric
//! evaluation through f64 (floats) or i128 (integers).

use crate::ir::{broadcast_shapes, DType, Elem, OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{ArrayD, IxDyn, Zip};

/// The tensor at input `i` (required).
pub fn input<'a>(ins: &[Option<&'a Value>], i: usize) -> OpResult<&'a Tensor> {
    match ins.get(i).copied().flatten() {
        Some(Value::Tensor(t)) => Ok(t),
        Some(_) => bail!("input {i} should be a tensor but is a sequence or optional"),
        None => bail!("required input {i} is missing"),
    }
}

/// The tensor at input `i`, or None when omitted.
pub fn opt_input<'a>(ins: &[Option<&'a Value>], i: usize) -> OpResult<Option<&'a Tensor>> {
    match ins.get(i).copied().flatten() {
        Some(Value::Tensor(t)) => Ok(Some(t)),
        Some(Value::Optional { value: None, .. }) => Ok(None),
        Some(Value::Optional { value: Some(v), .. }) => match &**v {
            Value::Tensor(t) => Ok(Some(t)),
            _ => bail!("input {i} should be a tensor"),
        },
        Some(_) => bail!("input {i} should be a tensor but is a sequence"),
        None => Ok(None),
    }
}

/// One tensor output.
pub fn out(t: Tensor) -> OpResult<Vec<Value>> {
    Ok(vec![Value::Tensor(t)])
}

/// Several tensor outputs.
pub fn outs(ts: Vec<Tensor>) -> OpResult<Vec<Value>> {
    Ok(ts.into_iter().map(Value::Tensor).collect())
}

/// Normalises a possibly negative axis against `rank`.
pub fn axis(a: i64, rank: usize) -> OpResult<usize> {
    let r = rank as i64;
    ensure!(
        a >= -r && a < r.max(1),
        "axis {a} is out of range for rank {rank}"
    );
    Ok(if a < 0 { (a + r) as usize } else { a as usize })
}

/// Normalises a list of axes; rejects duplicates.
pub fn axes(v: &[i64], rank: usize) -> OpResult<Vec<usize>> {
    let mut out = Vec::with_capacity(v.len());
    for &a in v {
        let x = axis(a, rank)?;
        ensure!(!out.contains(&x), "axis {a} is repeated");
        out.push(x);
    }
    Ok(out)
}

/// A tensor's values as i64 (shape, axes, indices inputs).
pub fn ints(t: &Tensor) -> OpResult<Vec<i64>> {
    t.to_i64_vec()
        .ok_or_else(|| OpError::new(format!("expected an integer tensor, got {}", t.dtype())))
}

/// A scalar (or one-element) tensor's value as i64.
pub fn scalar_i64(t: &Tensor) -> OpResult<i64> {
    let v = ints(t)?;
    ensure!(
        v.len() == 1,
        "expected a single value, got shape {:?}",
        t.shape()
    );
    Ok(v[0])
}

/// A scalar (or one-element) tensor's value as f64.
pub fn scalar_f64(t: &Tensor) -> OpResult<f64> {
    let v = f64s(t)?;
    ensure!(
        v.len() == 1,
        "expected a single value, got shape {:?}",
        t.shape()
    );
    Ok(v.iter().copied().next().unwrap_or_default())
}

/// Elements as f64 (numeric and bool tensors).
pub fn f64s(t: &Tensor) -> OpResult<ArrayD<f64>> {
    t.to_f64()
        .ok_or_else(|| OpError::new(format!("expected a numeric tensor, got {}", t.dtype())))
}

/// Elements as i128 (integer and bool tensors).
pub fn i128s(t: &Tensor) -> OpResult<ArrayD<i128>> {
    t.to_i128()
        .ok_or_else(|| OpError::new(format!("expected an integer tensor, got {}", t.dtype())))
}

/// Checks that every input has the same dtype.
pub fn same_dtype(ts: &[&Tensor]) -> OpResult<DType> {
    let dt = ts[0].dtype();
    for (i, t) in ts.iter().enumerate().skip(1) {
        ensure!(
            t.dtype() == dt,
            "input {i} has dtype {} but input 0 has {dt}; they must match",
            t.dtype()
        );
    }
    Ok(dt)
}

/// Converts a shape given as i64 into usize dims, rejecting negatives and products that
/// would not fit in memory (at most 2^40 elements).
pub fn dims(v: &[i64]) -> OpResult<Vec<usize>> {
    let mut total: u128 = 1;
    let mut out = Vec::with_capacity(v.len());
    for &d in v {
        ensure!(d >= 0, "dimension {d} is negative");
        total = total.saturating_mul(d as u128);
        out.push(d as usize);
    }
    ensure!(
        total <= 1 << 40,
        "shape {v:?} has too many elements ({total})"
    );
    Ok(out)
}

/// Applies `f` elementwise to two broadcast arrays.
pub fn zip_broadcast<A: Clone, B: Clone, C>(
    a: &ArrayD<A>,
    b: &ArrayD<B>,
    f: impl Fn(A, B) -> C,
) -> OpResult<ArrayD<C>> {
    let shape = broadcast_shapes(a.shape(), b.shape()).ok_or_else(|| {
        OpError::new(format!(
            "shapes {:?} and {:?} do not broadcast",
            a.shape(),
            b.shape()
        ))
    })?;
    let av = a.broadcast(IxDyn(&shape)).expect("broadcastable");
    let bv = b.broadcast(IxDyn(&shape)).expect("broadcastable");
    Ok(Zip::from(&av)
        .and(&bv)
        .map_collect(|x, y| f(x.clone(), y.clone())))
}

/// Applies `f` elementwise to three broadcast arrays.
pub fn zip3_broadcast<A: Clone, B: Clone, C: Clone, D>(
    a: &ArrayD<A>,
    b: &ArrayD<B>,
    c: &ArrayD<C>,
    f: impl Fn(A, B, C) -> D,
) -> OpResult<ArrayD<D>> {
    let s = broadcast_shapes(a.shape(), b.shape())
        .and_then(|s| broadcast_shapes(&s, c.shape()))
        .ok_or_else(|| {
            OpError::new(format!(
                "shapes {:?}, {:?} and {:?} do not broadcast",
                a.shape(),
                b.shape(),
                c.shape()
            ))
        })?;
    let av = a.broadcast(IxDyn(&s)).expect("broadcastable");
    let bv = b.broadcast(IxDyn(&s)).expect("broadcastable");
    let cv = c.broadcast(IxDyn(&s)).expect("broadcastable");
    Ok(Zip::from(&av)
        .and(&bv)
        .and(&cv)
        .map_collect(|x, y, z| f(x.clone(), y.clone(), z.clone())))
}

/// A float op applied elementwise, computed in f64 and rounded back to the input dtype.
pub fn unary_float(t: &Tensor, f: impl Fn(f64) -> f64) -> OpResult<Tensor> {
    ensure!(
        t.dtype().is_float(),
        "expected a float tensor, got {}",
        t.dtype()
    );
    Ok(Tensor::from_f64(t.dtype(), f64s(t)?.mapv(f), false))
}

/// A numeric op applied elementwise: floats through `ff` in f64, integers through `fi`
/// in i128 (wrapping back to the dtype).
pub fn unary_num(
    t: &Tensor,
    ff: impl Fn(f64) -> f64,
    fi: impl Fn(i128) -> i128,
) -> OpResult<Tensor> {
    let dt = t.dtype();
    if dt.is_float() {
        Ok(Tensor::from_f64(dt, f64s(t)?.mapv(ff), false))
    } else if dt.is_int() {
        Ok(Tensor::from_i128(dt, i128s(t)?.mapv(fi)))
    } else {
        bail!("expected a numeric tensor, got {dt}")
    }
}

/// A binary numeric op with broadcasting; both inputs must share a dtype, which the
/// result keeps.
pub fn binary_num(
    a: &Tensor,
    b: &Tensor,
    ff: impl Fn(f64, f64) -> f64,
    fi: impl Fn(i128, i128) -> OpResult<i128>,
) -> OpResult<Tensor> {
    let dt = same_dtype(&[a, b])?;
    if dt.is_float() {
        Ok(Tensor::from_f64(
            dt,
            zip_broadcast(&f64s(a)?, &f64s(b)?, ff)?,
            false,
        ))
    } else if dt.is_int() {
        let r = zip_broadcast(&i128s(a)?, &i128s(b)?, fi)?;
        let mut v = Vec::with_capacity(r.len());
        for x in r.iter() {
            v.push(x.clone()?);
        }
        let shape = r.shape().to_vec();
        Ok(Tensor::from_i128(
            dt,
            ArrayD::from_shape_vec(IxDyn(&shape), v).expect("same count"),
        ))
    } else {
        bail!("expected numeric tensors, got {dt}")
    }
}

/// A comparison with broadcasting, producing bools. Floats compare as f64, integers as
/// i128, strings and bools by their natural order.
pub fn compare(
    a: &Tensor,
    b: &Tensor,
    ff: impl Fn(f64, f64) -> bool,
    fi: impl Fn(i128, i128) -> bool,
) -> OpResult<Tensor> {
    let dt = same_dtype(&[a, b])?;
    let r = if dt.is_float() {
        zip_broadcast(&f64s(a)?, &f64s(b)?, ff)?
    } else if dt == DType::Str {
        let (x, y) = (
            a.array::<String>().expect("str"),
            b.array::<String>().expect("str"),
        );
        zip_broadcast(x, y, |p, q| {
            let o = p.cmp(&q);
            fi(o as i128, 0)
        })?
    } else {
        zip_broadcast(&i128s(a)?, &i128s(b)?, fi)?
    };
    Ok(Tensor::from_array(r))
}

/// Gets an array of type `T` from a tensor, or a clear error.
pub fn arr<T: Elem>(t: &Tensor) -> OpResult<&ArrayD<T>> {
    t.array::<T>()
        .ok_or_else(|| OpError::new(format!("expected {} elements, got {}", T::DTYPE, t.dtype())))
}

/// The number of elements of a shape, as the product of its dims.
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Rounds f64 values to the precision of float dtype `dt` (identity for f64).
pub fn round_to(dt: DType, a: ArrayD<f64>) -> ArrayD<f64> {
    match dt {
        DType::F64 => a,
        DType::F32 => a.mapv(|v| v as f32 as f64),
        _ if dt.is_float() => Tensor::from_f64(dt, a.clone(), false).to_f64().unwrap_or(a),
        _ => a,
    }
}
