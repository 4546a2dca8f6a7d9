//! Matrix products: MatMul, Gemm, Einsum, Det, MatMulInteger, QLinearMatMul.

use super::util::{f64s, i128s, input, opt_input, out};
use super::{OpCtx, Registry};
use crate::ir::{broadcast_shapes, DType, OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{Array2, ArrayD, ArrayView2, ArrayViewD, Axis, Ix2, IxDyn};

pub fn register(r: &mut Registry) {
    r.add("MatMul", matmul);
    r.add("Gemm", gemm);
    r.add("Einsum", einsum);
    r.add("Det", det);
    r.add("MatMulInteger", matmul_integer);
    r.add("QLinearMatMul", qlinear_matmul);
    lower::register(r);
}

fn err(e: impl std::fmt::Display) -> OpError {
    OpError::new(format!("internal shape error: {e}"))
}

// ---------------------------------------------------------------------------------------
// Batched matrix product with NumPy semantics

/// A 2-D matrix product.
type MatFn<T> = dyn Fn(ArrayView2<T>, ArrayView2<T>) -> Array2<T>;

/// `a @ b` with NumPy's `matmul` rules (1-D operands, broadcast batch dims), using `mm`
/// for each 2-D product.
fn batched<T: Clone + Default>(
    a: ArrayViewD<T>,
    b: ArrayViewD<T>,
    mm: &MatFn<T>,
) -> OpResult<ArrayD<T>> {
    ensure!(
        a.ndim() >= 1 && b.ndim() >= 1,
        "MatMul operands must have rank >= 1, got shapes {:?} and {:?}",
        a.shape(),
        b.shape()
    );
    let (a_vec, b_vec) = (a.ndim() == 1, b.ndim() == 1);
    let a = if a_vec { a.insert_axis(Axis(0)) } else { a };
    let b = if b_vec { b.insert_axis(Axis(1)) } else { b };
    let (ra, rb) = (a.ndim(), b.ndim());
    let (m, k) = (a.shape()[ra - 2], a.shape()[ra - 1]);
    let (k2, n) = (b.shape()[rb - 2], b.shape()[rb - 1]);
    ensure!(
        k == k2,
        "MatMul inner dimensions differ: {:?} @ {:?}",
        a.shape(),
        b.shape()
    );
    let abatch = &a.shape()[..ra - 2];
    let bbatch = &b.shape()[..rb - 2];
    let batch = broadcast_shapes(abatch, bbatch).ok_or_else(|| {
        OpError::new(format!(
            "MatMul batch dimensions {abatch:?} and {bbatch:?} do not broadcast"
        ))
    })?;
    let nb: usize = batch.iter().product();
    let mut oshape = batch.clone();
    oshape.push(m);
    oshape.push(n);
    let result: ArrayD<T> = if rb == 2 {
        // The common case (activations times weights): one big product.
        let a_std = a.as_standard_layout();
        let rows = abatch.iter().product::<usize>() * m;
        let a2 = a_std.view().into_shape_with_order((rows, k)).map_err(err)?;
        let b2 = b.into_dimensionality::<Ix2>().map_err(err)?;
        let r = mm(a2, b2);
        r.into_dyn()
            .into_shape_with_order(IxDyn(&oshape))
            .map_err(err)?
    } else {
        let mut v: Vec<T> = Vec::with_capacity(nb * m * n);
        let mut idx = vec![0usize; batch.len()];
        for _ in 0..nb {
            let av = sub_view(&a, &idx, batch.len())?;
            let bv = sub_view(&b, &idx, batch.len())?;
            let r = mm(av, bv);
            v.extend(r.iter().cloned());
            // Advance the odometer.
            for d in (0..batch.len()).rev() {
                idx[d] += 1;
                if idx[d] < batch[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        ArrayD::from_shape_vec(IxDyn(&oshape), v).map_err(err)?
    };
    let mut fshape = batch;
    if !a_vec {
        fshape.push(m);
    }
    if !b_vec {
        fshape.push(n);
    }
    result.into_shape_with_order(IxDyn(&fshape)).map_err(err)
}

/// The 2-D matrix of `x` at (broadcast) batch index `idx` of a batch of rank `nbatch`.
fn sub_view<'a, T>(
    x: &ArrayViewD<'a, T>,
    idx: &[usize],
    nbatch: usize,
) -> OpResult<ArrayView2<'a, T>> {
    let xb = x.ndim() - 2;
    let mut v = x.clone();
    // Batch dims of x align to the right of the full batch.
    for d in 0..xb {
        let full = idx[nbatch - xb + d];
        let i = if v.shape()[0] == 1 { 0 } else { full };
        v = v.index_axis_move(Axis(0), i);
    }
    v.into_dimensionality::<Ix2>().map_err(err)
}

fn mm_f32(a: ArrayView2<f32>, b: ArrayView2<f32>) -> Array2<f32> {
    a.dot(&b)
}

fn mm_f64(a: ArrayView2<f64>, b: ArrayView2<f64>) -> Array2<f64> {
    a.dot(&b)
}

/// Integer product with wrapping arithmetic (exact in the low bits of any width).
fn mm_i64(a: ArrayView2<i64>, b: ArrayView2<i64>) -> Array2<i64> {
    let (m, k) = a.dim();
    let n = b.dim().1;
    let mut r = Array2::<i64>::zeros((m, n));
    for i in 0..m {
        for p in 0..k {
            let x = a[(i, p)];
            if x == 0 {
                continue;
            }
            for j in 0..n {
                r[(i, j)] = r[(i, j)].wrapping_add(x.wrapping_mul(b[(p, j)]));
            }
        }
    }
    r
}

/// A numeric matrix product keeping the dtype of `a` (both must match).
fn matmul_tensors(a: &Tensor, b: &Tensor) -> OpResult<Tensor> {
    let dt = a.dtype();
    ensure!(
        b.dtype() == dt,
        "MatMul inputs have dtypes {dt} and {}; they must match",
        b.dtype()
    );
    match dt {
        DType::F32 => {
            let (x, y) = (a.array::<f32>(), b.array::<f32>());
            let (Some(x), Some(y)) = (x, y) else {
                bail!("float tensors expected")
            };
            Ok(Tensor::from_array(batched(x.view(), y.view(), &mm_f32)?))
        }
        _ if dt.is_float() => {
            let (x, y) = (f64s(a)?, f64s(b)?);
            let r = batched(x.view(), y.view(), &mm_f64)?;
            Ok(Tensor::from_f64(dt, r, false))
        }
        _ if dt.is_int() => {
            let x = i128s(a)?.mapv(|v| v as i64);
            let y = i128s(b)?.mapv(|v| v as i64);
            let r = batched(x.view(), y.view(), &mm_i64)?;
            Ok(Tensor::from_i128(dt, r.mapv(|v| v as i128)))
        }
        _ => bail!("MatMul expects numeric tensors, got {dt}"),
    }
}

fn matmul(_ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    out(matmul_tensors(input(ins, 0)?, input(ins, 1)?)?)
}

// ---------------------------------------------------------------------------------------
// Gemm

fn as2<T: Clone>(a: &ArrayD<T>, trans: bool, what: &str) -> OpResult<Array2<T>> {
    ensure!(
        a.ndim() == 2,
        "Gemm input {what} must be 2-D, got shape {:?}",
        a.shape()
    );
    let v = a.view().into_dimensionality::<Ix2>().map_err(err)?;
    Ok(if trans {
        v.t().to_owned()
    } else {
        v.to_owned()
    })
}

fn gemm(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let a = input(ins, 0)?;
    let b = input(ins, 1)?;
    let c = opt_input(ins, 2)?;
    let dt = a.dtype();
    ensure!(
        b.dtype() == dt,
        "Gemm inputs A and B have dtypes {dt} and {}",
        b.dtype()
    );
    let ta = ctx.attrs.int("transA", 0)? != 0;
    let tb = ctx.attrs.int("transB", 0)? != 0;
    let alpha = ctx.attrs.float("alpha", 1.0)?;
    let beta = ctx.attrs.float("beta", 1.0)?;
    let check = |m: (usize, usize), n: (usize, usize)| -> OpResult<()> {
        ensure!(
            m.1 == n.0,
            "Gemm inner dimensions differ: {:?} and {:?} (after transA/transB)",
            m,
            n
        );
        Ok(())
    };
    if dt == DType::F32 {
        let (Some(x), Some(y)) = (a.array::<f32>(), b.array::<f32>()) else {
            bail!("float tensors expected")
        };
        let x = as2(x, ta, "A")?;
        let y = as2(y, tb, "B")?;
        check(x.dim(), y.dim())?;
        let mut r = x.dot(&y);
        if alpha != 1.0 {
            r.mapv_inplace(|v| v * alpha);
        }
        if let Some(c) = c {
            if beta != 0.0 {
                let cv = c.cast(DType::F32, false).unwrap_or_else(|| c.clone());
                let Some(cv) = cv.array::<f32>() else {
                    bail!("C must be numeric")
                };
                let cb = cv.broadcast(IxDyn(r.shape())).ok_or_else(|| {
                    OpError::new(format!(
                        "C of shape {:?} does not broadcast to {:?}",
                        cv.shape(),
                        r.shape()
                    ))
                })?;
                let mut rd = r.into_dyn();
                rd.zip_mut_with(&cb, |o, &cc| *o += beta * cc);
                return out(Tensor::from_array(rd));
            }
        }
        return out(Tensor::from_array(r.into_dyn()));
    }
    ensure!(dt.is_numeric(), "Gemm expects numeric tensors, got {dt}");
    let x = as2(&f64s(a)?, ta, "A")?;
    let y = as2(&f64s(b)?, tb, "B")?;
    check(x.dim(), y.dim())?;
    let (alpha, beta) = (alpha as f64, beta as f64);
    let mut r = x.dot(&y).into_dyn();
    r.mapv_inplace(|v| v * alpha);
    if let Some(c) = c {
        let cv = f64s(c)?;
        let cb = cv.broadcast(IxDyn(r.shape())).ok_or_else(|| {
            OpError::new(format!(
                "C of shape {:?} does not broadcast to {:?}",
                cv.shape(),
                r.shape()
            ))
        })?;
        r.zip_mut_with(&cb, |o, &cc| *o += beta * cc);
    }
    if dt.is_int() {
        return out(Tensor::from_i128(dt, r.mapv(|v| v as i128)));
    }
    out(Tensor::from_f64(dt, r, false))
}

// ---------------------------------------------------------------------------------------
// Einsum

/// A term's labels; `None` marks the ellipsis.
fn parse_term(s: &str) -> OpResult<Vec<Option<char>>> {
    let mut v = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("...") {
            ensure!(!v.contains(&None), "term `{s}` has more than one ellipsis");
            v.push(None);
            rest = r;
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            ensure!(
                c.is_ascii_alphabetic(),
                "unexpected character `{c}` in einsum term `{s}`"
            );
            v.push(Some(c));
            rest = &rest[c.len_utf8()..];
        }
    }
    Ok(v)
}

/// Label ids: letters map to 0..52, ellipsis dims to 52.. (one per broadcast dim).
fn letter_id(c: char) -> usize {
    if c.is_ascii_lowercase() {
        c as usize - 'a' as usize
    } else {
        26 + c as usize - 'A' as usize
    }
}

fn einsum_plan(eq: &str, shapes: &[&[usize]]) -> OpResult<EinsumPlan> {
    let nin = shapes.len();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (eq.to_string(), None),
    };
    let terms: Vec<Vec<Option<char>>> = lhs.split(',').map(parse_term).collect::<OpResult<_>>()?;
    ensure!(
        terms.len() == nin,
        "equation `{eq}` names {} operands but {nin} were given",
        terms.len()
    );
    // Ellipsis rank: the largest over operands.
    let mut ell_rank = 0usize;
    for (t, x) in terms.iter().zip(shapes) {
        let named = t.iter().filter(|l| l.is_some()).count();
        if t.contains(&None) {
            ensure!(
                x.len() >= named,
                "operand of rank {} is too small for term with {named} labels",
                x.len()
            );
            ell_rank = ell_rank.max(x.len() - named);
        } else {
            ensure!(
                x.len() == named,
                "operand of rank {} does not match a term with {named} labels",
                x.len()
            );
        }
    }
    const NL: usize = 52;
    let nlabels = NL + ell_rank;
    let mut size: Vec<Option<usize>> = vec![None; nlabels];
    // Per operand: label id of each of its axes.
    let mut axis_labels: Vec<Vec<usize>> = Vec::new();
    let mut count = vec![0usize; nlabels];
    for (t, x) in terms.iter().zip(shapes) {
        let named = t.iter().filter(|l| l.is_some()).count();
        let er = x.len() - named;
        let mut labs = Vec::new();
        for l in t {
            match l {
                Some(c) => labs.push(letter_id(*c)),
                None => {
                    for j in 0..er {
                        labs.push(NL + ell_rank - er + j);
                    }
                }
            }
        }
        for (ax, &l) in labs.iter().enumerate() {
            let d = x[ax];
            count[l] += 1;
            size[l] = Some(match size[l] {
                None => d,
                Some(s) if s == d => s,
                Some(1) if l >= NL => d,
                Some(s) if l >= NL && d == 1 => s,
                Some(s) => bail!("Einsum label sizes disagree ({s} vs {d}) in equation `{eq}`"),
            });
        }
        axis_labels.push(labs);
    }
    let out_labels: Vec<usize> = match &rhs {
        Some(r) => {
            let mut v = Vec::new();
            for l in parse_term(r)? {
                match l {
                    Some(c) => {
                        let id = letter_id(c);
                        ensure!(
                            size[id].is_some(),
                            "output label `{c}` does not appear in the inputs"
                        );
                        ensure!(!v.contains(&id), "output label `{c}` is repeated");
                        v.push(id);
                    }
                    None => v.extend(NL..NL + ell_rank),
                }
            }
            v
        }
        None => {
            let mut v: Vec<usize> = (NL..NL + ell_rank).collect();
            // Letters used exactly once, in alphabetical order (upper case first, as in
            // NumPy, which sorts by character code).
            let mut letters: Vec<usize> = (0..NL).filter(|&l| count[l] == 1).collect();
            letters.sort_by_key(|&l| if l < 26 { l + 26 } else { l - 26 });
            v.extend(letters);
            v
        }
    };
    let used: Vec<usize> = (0..nlabels).filter(|&l| size[l].is_some()).collect();
    let sizes: Vec<usize> = used.iter().map(|&l| size[l].unwrap_or(0)).collect();
    let oshape: Vec<usize> = out_labels.iter().map(|&l| size[l].unwrap_or(0)).collect();
    // Strides per used label for each operand (summed for repeated labels: diagonals;
    // zero for broadcast dims of size 1) and for the output.
    let pos = |l: usize| used.iter().position(|&u| u == l).unwrap_or(0);
    let mut in_strides: Vec<Vec<isize>> = Vec::new();
    for (labs, x) in axis_labels.iter().zip(shapes) {
        let mut st = vec![0isize; used.len()];
        let shape = *x;
        let mut s = 1isize;
        for ax in (0..labs.len()).rev() {
            if !(shape[ax] == 1 && sizes[pos(labs[ax])] != 1) {
                st[pos(labs[ax])] += s;
            }
            s *= shape[ax] as isize;
        }
        in_strides.push(st);
    }
    let mut out_st = vec![0isize; used.len()];
    let mut s = 1isize;
    for &l in out_labels.iter().rev() {
        out_st[pos(l)] = s;
        s *= size[l].unwrap_or(0) as isize;
    }
    Ok(EinsumPlan {
        in_strides,
        out_st,
        sizes,
        oshape,
    })
}

/// How an einsum runs: per used label its size, each operand's stride (summed over
/// repeated labels, zero on broadcast dims) and the output's stride.
struct EinsumPlan {
    in_strides: Vec<Vec<isize>>,
    out_st: Vec<isize>,
    sizes: Vec<usize>,
    oshape: Vec<usize>,
}

fn einsum_equation(ctx: &OpCtx) -> OpResult<String> {
    Ok(ctx
        .attrs
        .string("equation", String::new())?
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect())
}

fn einsum(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let eq = einsum_equation(ctx)?;
    let nin = ins.len();
    ensure!(nin >= 1, "Einsum needs at least one input");
    let tensors: Vec<&Tensor> = (0..nin).map(|i| input(ins, i)).collect::<OpResult<_>>()?;
    let dt = tensors[0].dtype();
    for t in &tensors {
        ensure!(
            t.dtype() == dt,
            "Einsum inputs must share a dtype ({dt} vs {})",
            t.dtype()
        );
    }
    let shapes: Vec<&[usize]> = tensors.iter().map(|t| t.shape()).collect();
    let EinsumPlan {
        in_strides,
        out_st,
        sizes,
        oshape,
    } = einsum_plan(&eq, &shapes)?;
    let total: usize = sizes.iter().product();
    let onum: usize = oshape.iter().product();
    if dt.is_float() {
        let data: Vec<Vec<f64>> = tensors
            .iter()
            .map(|t| f64s(t).map(|a| a.iter().copied().collect()))
            .collect::<OpResult<_>>()?;
        let r = einsum_loop(
            &data,
            &in_strides,
            &out_st,
            &sizes,
            total,
            onum,
            0.0,
            1.0,
            |a, b| a + b,
            |a, b| a * b,
        );
        let r = ArrayD::from_shape_vec(IxDyn(&oshape), r).map_err(err)?;
        out(Tensor::from_f64(dt, r, false))
    } else if dt.is_int() {
        let data: Vec<Vec<i128>> = tensors
            .iter()
            .map(|t| i128s(t).map(|a| a.iter().copied().collect()))
            .collect::<OpResult<_>>()?;
        let r = einsum_loop(
            &data,
            &in_strides,
            &out_st,
            &sizes,
            total,
            onum,
            0i128,
            1i128,
            |a, b| a.wrapping_add(b),
            |a, b| a.wrapping_mul(b),
        );
        let r = ArrayD::from_shape_vec(IxDyn(&oshape), r).map_err(err)?;
        out(Tensor::from_i128(dt, r))
    } else {
        bail!("Einsum expects numeric tensors, got {dt}")
    }
}

#[allow(clippy::too_many_arguments)]
fn einsum_loop<T: Copy>(
    data: &[Vec<T>],
    in_strides: &[Vec<isize>],
    out_st: &[isize],
    sizes: &[usize],
    total: usize,
    onum: usize,
    zero: T,
    one: T,
    add: impl Fn(T, T) -> T,
    mul: impl Fn(T, T) -> T,
) -> Vec<T> {
    let mut r = vec![zero; onum];
    if total == 0 {
        return r;
    }
    let nl = sizes.len();
    let mut idx = vec![0usize; nl];
    let mut offs = vec![0isize; data.len()];
    let mut ooff = 0isize;
    for _ in 0..total {
        let mut p = one;
        for (d, &o) in data.iter().zip(&offs) {
            p = mul(p, d[o as usize]);
        }
        r[ooff as usize] = add(r[ooff as usize], p);
        // Advance the odometer, keeping offsets in step.
        for l in (0..nl).rev() {
            idx[l] += 1;
            ooff += out_st[l];
            for (o, st) in offs.iter_mut().zip(in_strides) {
                *o += st[l];
            }
            if idx[l] < sizes[l] {
                break;
            }
            let back = sizes[l] as isize;
            ooff -= out_st[l] * back;
            for (o, st) in offs.iter_mut().zip(in_strides) {
                *o -= st[l] * back;
            }
            idx[l] = 0;
        }
    }
    r
}

// ---------------------------------------------------------------------------------------
// Det

fn det2(n: usize, m: &mut [f64]) -> f64 {
    let mut d = 1.0;
    for c in 0..n {
        let mut p = c;
        for r in c + 1..n {
            if m[r * n + c].abs() > m[p * n + c].abs() {
                p = r;
            }
        }
        if m[p * n + c] == 0.0 {
            return 0.0;
        }
        if p != c {
            for j in 0..n {
                m.swap(p * n + j, c * n + j);
            }
            d = -d;
        }
        let piv = m[c * n + c];
        d *= piv;
        for r in c + 1..n {
            let f = m[r * n + c] / piv;
            if f != 0.0 {
                for j in c..n {
                    m[r * n + j] -= f * m[c * n + j];
                }
            }
        }
    }
    d
}

fn det(_ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = input(ins, 0)?;
    let dt = x.dtype();
    ensure!(dt.is_float(), "Det expects a float tensor, got {dt}");
    let shape = x.shape().to_vec();
    let r = shape.len();
    ensure!(
        r >= 2 && shape[r - 1] == shape[r - 2],
        "Det expects [..., M, M], got shape {shape:?}"
    );
    let n = shape[r - 1];
    let v: Vec<f64> = f64s(x)?.iter().copied().collect();
    let mut res = Vec::new();
    if n == 0 {
        let nb: usize = shape[..r - 2].iter().product();
        res = vec![1.0; nb];
    } else {
        for chunk in v.chunks(n * n) {
            let mut m = chunk.to_vec();
            res.push(det2(n, &mut m));
        }
    }
    let a = ArrayD::from_shape_vec(IxDyn(&shape[..r - 2]), res).map_err(err)?;
    out(Tensor::from_f64(dt, a, false))
}

// ---------------------------------------------------------------------------------------
// MatMulInteger, QLinearMatMul

/// `x - zero_point` as i64, where a 1-D zero point of length > 1 applies per row of A
/// (`row_axis`) or per column of B.
fn sub_zero_point(x: &Tensor, zp: Option<&Tensor>, per_row: bool) -> OpResult<ArrayD<i64>> {
    let xv = i128s(x)?.mapv(|v| v as i64);
    let Some(zp) = zp else { return Ok(xv) };
    ensure!(
        zp.dtype() == x.dtype(),
        "zero point dtype {} differs from input dtype {}",
        zp.dtype(),
        x.dtype()
    );
    let z = i128s(zp)?.mapv(|v| v as i64);
    if z.len() == 1 {
        let z0 = z.iter().copied().next().unwrap_or(0);
        return Ok(xv.mapv(|v| v - z0));
    }
    let rank = xv.ndim();
    ensure!(rank >= 1, "per-axis zero point needs an input of rank >= 1");
    // Per-row of A: shape [..., M, 1]; per-column of B: shape [..., N] (broadcast).
    let zz = if per_row && z.ndim() == 1 {
        z.insert_axis(Axis(1))
    } else {
        z
    };
    super::util::zip_broadcast(&xv, &zz, |a, b| a - b)
}

fn matmul_integer(_ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let a = input(ins, 0)?;
    let b = input(ins, 1)?;
    let ai = sub_zero_point(a, opt_input(ins, 2)?, true)?;
    let bi = sub_zero_point(b, opt_input(ins, 3)?, false)?;
    let r = batched(ai.view(), bi.view(), &mm_i64)?;
    out(Tensor::from_array(r.mapv(|v| v as i32)))
}

/// A scale or zero point of QLinearMatMul as an array broadcastable to the product:
/// one value, or one per row (`per_row`, shape [M, 1]) or per column (shape [N]).
fn qparam(t: &Tensor, per_row: bool) -> OpResult<ArrayD<f64>> {
    let v = f64s(t)?;
    if v.len() == 1 {
        return Ok(ArrayD::from_elem(
            IxDyn(&[]),
            v.iter().copied().next().unwrap_or(0.0),
        ));
    }
    Ok(if per_row && v.ndim() == 1 {
        v.insert_axis(Axis(1))
    } else {
        v
    })
}

fn qlinear_matmul(_ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let a = input(ins, 0)?;
    let b = input(ins, 3)?;
    let y_scale_t = input(ins, 6)?;
    let y_zp = opt_input(ins, 7)?;
    let ai = sub_zero_point(a, opt_input(ins, 2)?, true)?;
    let bi = sub_zero_point(b, opt_input(ins, 5)?, false)?;
    let c = batched(ai.view(), bi.view(), &mm_i64)?.mapv(|v| v as f64);
    // The reference computes a_scale * b_scale / y_scale in the scales' dtype.
    let sdt = y_scale_t.dtype();
    let round = |v: f64| match sdt {
        DType::F32 => v as f32 as f64,
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        _ => v,
    };
    let sa = qparam(input(ins, 1)?, true)?;
    let sb = qparam(input(ins, 4)?, false)?;
    let sy = qparam(y_scale_t, true)?;
    let ab = super::util::zip_broadcast(&sa, &sb, |x, y| round(x * y))?;
    let factor = super::util::zip_broadcast(&ab, &sy, |x, y| round(x / y))?;
    let (odt, zp) = match y_zp {
        Some(z) => (z.dtype(), qparam(z, true)?),
        None => (a.dtype(), ArrayD::from_elem(IxDyn(&[]), 0.0)),
    };
    let (lo, hi) = odt
        .int_range()
        .ok_or_else(|| OpError::new(format!("unsupported output dtype {odt}")))?;
    let d = super::util::zip_broadcast(&c, &factor, |x, f| x * f)?;
    let r = super::util::zip_broadcast(&d, &zp, |x, z| {
        ((x + z).round_ties_even() as i128).clamp(lo, hi)
    })?;
    ensure!(
        r.shape() == c.shape(),
        "QLinearMatMul scales or zero points of shape {:?} change the output shape {:?}",
        r.shape(),
        c.shape()
    );
    out(Tensor::from_i128(odt, r))
}

// ---------------------------------------------------------------------------------------
// Lowering to kernel IR (plain loop nests with an accumulator)

mod lower {
    use super::{einsum_equation, einsum_plan, EinsumPlan};
    use crate::ir::{broadcast_shapes, OpError, OpResult};
    use crate::kir::build::*;
    use crate::kir::{Expr, Stmt, Ty, VarId};
    use crate::ops::lowering::{
        broadcast_strides, index, nest, strides, Epilogue, LowerCtx, TensorRef,
    };
    use crate::ops::{Lowering, Registry};
    use crate::{bail, ensure};

    fn set(x: VarId, e: Expr) -> Stmt {
        Stmt::Set { var: x, value: e }
    }
    fn zero(t: Ty) -> Expr {
        if t.is_float() {
            Expr::f(0.0, t)
        } else {
            Expr::cast(t, Expr::Int(0))
        }
    }
    /// `e + t` that drops a literal 0 on either side.
    fn add(e: Expr, t: Expr) -> Expr {
        match (e, t) {
            (Expr::Int(0), t) => t,
            (e, Expr::Int(0)) => e,
            (e, t) => Expr::add(e, t),
        }
    }
    fn scaled(x: VarId, s: usize) -> Expr {
        match s {
            0 => Expr::Int(0),
            1 => v(x),
            s => Expr::mul(v(x), Expr::Int(s as i64)),
        }
    }

    /// A batched product `out[b, i, j] = sum_p f(a[b, i, p], b[b, p, j], i, j)` with NumPy
    /// matmul rules (1-D operands, broadcast batch dims). `elem(k, a, b, i, j)` gives the
    /// term added to an accumulator of type `at`; `fin(acc, i, j)` the stored value.
    #[allow(clippy::type_complexity)]
    fn batched(
        lw: &mut LowerCtx,
        a: &TensorRef,
        b: &TensorRef,
        at: Ty,
        term: &dyn Fn(Expr, Expr, VarId, VarId) -> Expr,
        fin: &dyn Fn(Expr, VarId, VarId) -> Expr,
        epilogue: Option<&Epilogue>,
    ) -> OpResult<()> {
        let out = lw.outputs[0].clone();
        let ot = out.ty().compute();
        ensure!(
            !a.shape.is_empty() && !b.shape.is_empty(),
            "MatMul operands must have rank >= 1"
        );
        let mut ash = a.shape.clone();
        if ash.len() == 1 {
            ash.insert(0, 1);
        }
        let mut bsh = b.shape.clone();
        if bsh.len() == 1 {
            bsh.push(1);
        }
        let (ra, rb) = (ash.len(), bsh.len());
        let (m, kd) = (ash[ra - 2], ash[ra - 1]);
        let (k2, n) = (bsh[rb - 2], bsh[rb - 1]);
        ensure!(
            kd == k2,
            "MatMul inner dimensions differ: {ash:?} @ {bsh:?}"
        );
        let abatch = &ash[..ra - 2];
        let bbatch = &bsh[..rb - 2];
        let batch = broadcast_shapes(abatch, bbatch)
            .ok_or_else(|| OpError::new("MatMul batch dimensions do not broadcast"))?;
        ensure!(
            out.len() == batch.iter().product::<usize>() * m * n,
            "MatMul output size mismatch"
        );
        let ab = broadcast_strides(abatch, &batch)
            .into_iter()
            .map(|s| s * m * kd)
            .collect::<Vec<_>>();
        let bb = broadcast_strides(bbatch, &batch)
            .into_iter()
            .map(|s| s * kd * n)
            .collect::<Vec<_>>();
        let mut oshape = batch.clone();
        oshape.extend([m, n]);
        let ostr = strides(&oshape);
        let mut k = lw.kernel("");
        let acc = k.var(at);
        let p = k.var(Ty::I64);
        let body = nest(&mut k, &oshape, |_, vars| {
            let nb = batch.len();
            let (bv, i, j) = (&vars[..nb], vars[nb], vars[nb + 1]);
            let aidx = add(add(index(bv, &ab), scaled(i, kd)), v(p));
            let bidx = add(add(index(bv, &bb), scaled(p, n)), v(j));
            let x = Expr::load(a.buf, aidx);
            let y = Expr::load(b.buf, bidx);
            vec![
                set(acc, zero(at)),
                Stmt::For {
                    var: p,
                    extent: kd as u64,
                    body: vec![set(acc, Expr::add(v(acc), term(x, y, i, j)))],
                },
                Stmt::Store {
                    buf: out.buf,
                    index: index(vars, &ostr),
                    value: match epilogue {
                        Some(ep) if oshape == out.shape => {
                            ep.apply(fin(v(acc), i, j), ot, vars, &out.shape)
                        }
                        Some(ep) => {
                            ep.apply_flat(fin(v(acc), i, j), ot, index(vars, &ostr), &out.shape)
                        }
                        None => fin(v(acc), i, j),
                    },
                },
            ]
        });
        k.body = body;
        lw.push(k);
        Ok(())
    }

    fn matmul(lw: &mut LowerCtx) -> OpResult<()> {
        if crate::lower::gemm::matmul(lw)? {
            return Ok(());
        }
        let a = lw.input(0)?.clone();
        let b = lw.input(1)?.clone();
        ensure!(a.dtype == b.dtype, "MatMul inputs must share a dtype");
        let t = a.ty().compute();
        let ot = lw.outputs[0].ty().compute();
        // Fused elementwise work (float products only), applied before the store.
        let epilogue = if ot.is_float() {
            lw.epilogue.take()
        } else {
            None
        };
        batched(
            lw,
            &a,
            &b,
            t,
            &|x, y, _, _| Expr::mul(x, y),
            &|acc, _, _| if ot == t { acc } else { Expr::cast(ot, acc) },
            epilogue.as_ref(),
        )
    }

    fn matmul_integer(lw: &mut LowerCtx) -> OpResult<()> {
        if crate::lower::gemm::matmul_int8(lw)? {
            return Ok(());
        }
        let a = lw.input(0)?.clone();
        let b = lw.input(1)?.clone();
        // Zero points: one value, or one per row of A / per column of B.
        let zp = |lw: &LowerCtx, i: usize, len: usize| -> OpResult<Option<(usize, bool)>> {
            Ok(match lw.opt_input(i) {
                None => None,
                Some(z) if z.len() == 1 => Some((z.buf, false)),
                Some(z) if z.shape.len() == 1 && z.len() == len => Some((z.buf, true)),
                Some(z) => {
                    return Err(OpError::unsupported(format!(
                        "zero point of shape {:?}",
                        z.shape
                    )))
                }
            })
        };
        let m = if a.shape.len() >= 2 {
            a.shape[a.shape.len() - 2]
        } else {
            1
        };
        let n = if b.shape.len() >= 2 {
            b.shape[b.shape.len() - 1]
        } else {
            1
        };
        let za = zp(lw, 2, m)?;
        let zb = zp(lw, 3, n)?;
        let w = |e: Expr| Expr::cast(Ty::I32, e);
        batched(
            lw,
            &a,
            &b,
            Ty::I32,
            &|x, y, i, j| {
                let x = match za {
                    None => w(x),
                    Some((buf, per)) => Expr::bin(
                        crate::kir::BinOp::Sub,
                        w(x),
                        w(Expr::load(buf, if per { v(i) } else { Expr::Int(0) })),
                    ),
                };
                let y = match zb {
                    None => w(y),
                    Some((buf, per)) => Expr::bin(
                        crate::kir::BinOp::Sub,
                        w(y),
                        w(Expr::load(buf, if per { v(j) } else { Expr::Int(0) })),
                    ),
                };
                Expr::mul(x, y)
            },
            &|acc, _, _| acc,
            None,
        )
    }

    fn gemm(lw: &mut LowerCtx) -> OpResult<()> {
        if crate::lower::gemm::gemm(lw)? {
            return Ok(());
        }
        let a = lw.input(0)?.clone();
        let b = lw.input(1)?.clone();
        let c = lw.opt_input(2).cloned();
        let out = lw.outputs[0].clone();
        ensure!(a.dtype == b.dtype, "Gemm inputs A and B must share a dtype");
        ensure!(
            a.shape.len() == 2 && b.shape.len() == 2,
            "Gemm inputs must be 2-D"
        );
        let ta = lw.op.attrs.int("transA", 0)? != 0;
        let tb = lw.op.attrs.int("transB", 0)? != 0;
        let alpha = lw.op.attrs.float("alpha", 1.0)? as f64;
        let beta = lw.op.attrs.float("beta", 1.0)? as f64;
        let (m, kd) = if ta {
            (a.shape[1], a.shape[0])
        } else {
            (a.shape[0], a.shape[1])
        };
        let (k2, n) = if tb {
            (b.shape[1], b.shape[0])
        } else {
            (b.shape[0], b.shape[1])
        };
        ensure!(kd == k2, "Gemm inner dimensions differ");
        ensure!(out.shape == [m, n], "Gemm output shape mismatch");
        let t = a.ty().compute();
        // The reference computes f32 in f32 and everything else in f64.
        let at = if t == Ty::F32 { Ty::F32 } else { Ty::F64 };
        let ot = out.ty().compute();
        let (asi, ask) = if ta { (1, m) } else { (kd, 1) };
        let (bsk, bsj) = if tb { (1, kd) } else { (n, 1) };
        let cst = match &c {
            Some(c) if beta != 0.0 || t != Ty::F32 => {
                ensure!(c.shape.len() <= 2, "C must have rank <= 2");
                let s = broadcast_strides(&c.shape, &[m, n]);
                ensure!(
                    c.shape
                        .iter()
                        .rev()
                        .zip([n, m])
                        .all(|(&d, o)| d == 1 || d == o),
                    "C of shape {:?} does not broadcast to [{m}, {n}]",
                    c.shape
                );
                Some((c.buf, c.ty().compute(), s))
            }
            _ => None,
        };
        // Fused elementwise work (float outputs only), applied before the store.
        let epilogue = if ot.is_float() {
            lw.epilogue.take()
        } else {
            None
        };
        let mut k = lw.kernel("");
        let acc = k.var(at);
        let p = k.var(Ty::I64);
        let f = |x: f64| Expr::f(x, at);
        let cv = |e: Expr, from: Ty| if from == at { e } else { Expr::cast(at, e) };
        let body = nest(&mut k, &[m, n], |_, vars| {
            let (i, j) = (vars[0], vars[1]);
            let x = Expr::load(a.buf, add(scaled(i, asi), scaled(p, ask)));
            let y = Expr::load(b.buf, add(scaled(p, bsk), scaled(j, bsj)));
            let mut r = v(acc);
            if alpha != 1.0 || at != Ty::F32 {
                r = Expr::mul(r, f(alpha));
            }
            if let Some((cb, ct, s)) = &cst {
                let cval = cv(Expr::load(*cb, index(&[i, j], s)), *ct);
                r = Expr::add(r, Expr::mul(f(beta), cval));
            }
            vec![
                set(acc, zero(at)),
                Stmt::For {
                    var: p,
                    extent: kd as u64,
                    body: vec![set(acc, Expr::add(v(acc), Expr::mul(cv(x, t), cv(y, t))))],
                },
                Stmt::Store {
                    buf: out.buf,
                    index: index(&[i, j], &[n, 1]),
                    value: {
                        let r = if ot == at { r } else { Expr::cast(ot, r) };
                        match &epilogue {
                            Some(ep) => ep.apply(r, ot, &[i, j], &out.shape),
                            None => r,
                        }
                    },
                },
            ]
        });
        k.body = body;
        lw.push(k);
        Ok(())
    }

    fn einsum(lw: &mut LowerCtx) -> OpResult<()> {
        let eq = einsum_equation(lw.op)?;
        let ins: Vec<TensorRef> = (0..lw.inputs.len())
            .map(|i| lw.input(i).cloned())
            .collect::<OpResult<_>>()?;
        ensure!(!ins.is_empty(), "Einsum needs at least one input");
        let t = ins[0].ty().compute();
        if ins.iter().any(|x| x.dtype != ins[0].dtype) {
            bail!("Einsum inputs must share a dtype");
        }
        let out = lw.outputs[0].clone();
        let ot = out.ty().compute();
        let shapes: Vec<&[usize]> = ins.iter().map(|x| x.shape.as_slice()).collect();
        let EinsumPlan {
            in_strides,
            out_st,
            sizes,
            oshape,
        } = einsum_plan(&eq, &shapes)?;
        ensure!(out.shape == oshape, "Einsum output shape mismatch");
        if out.is_empty() {
            // Nothing to compute (a loop that never runs marks the output as written).
            let mut k = lw.kernel("");
            let j = k.var(Ty::I64);
            k.body = vec![Stmt::For {
                var: j,
                extent: 0,
                body: vec![Stmt::Store {
                    buf: out.buf,
                    index: v(j),
                    value: zero(ot),
                }],
            }];
            lw.push(k);
            return Ok(());
        }
        // Accumulate floats in f64 like the reference; integers wrap in their type.
        let at = if t.is_float() { Ty::F64 } else { t };
        // Output labels outside (in output order), summed labels inside.
        let mut outer: Vec<usize> = (0..sizes.len()).filter(|&l| out_st[l] != 0).collect();
        outer.sort_by_key(|&l| std::cmp::Reverse(out_st[l]));
        let inner: Vec<usize> = (0..sizes.len()).filter(|&l| out_st[l] == 0).collect();
        let osz: Vec<usize> = outer.iter().map(|&l| sizes[l]).collect();
        let isz: Vec<usize> = inner.iter().map(|&l| sizes[l]).collect();
        let mut k = lw.kernel("");
        let acc = k.var(at);
        let one = if at.is_float() {
            Expr::f(1.0, at)
        } else {
            Expr::cast(at, Expr::Int(1))
        };
        let body = nest(&mut k, &osz, |k, ov| {
            let ivs = nest(k, &isz, |_, iv| {
                let mut lv: Vec<VarId> = vec![0; sizes.len()];
                for (x, &l) in ov.iter().zip(&outer) {
                    lv[l] = *x;
                }
                for (x, &l) in iv.iter().zip(&inner) {
                    lv[l] = *x;
                }
                let mut prod: Option<Expr> = None;
                for (x, st) in ins.iter().zip(&in_strides) {
                    let s: Vec<usize> = st.iter().map(|&z| z as usize).collect();
                    let e = Expr::load(x.buf, index(&lv, &s));
                    let e = if at == t { e } else { Expr::cast(at, e) };
                    prod = Some(match prod {
                        None => e,
                        Some(p) => Expr::mul(p, e),
                    });
                }
                let term = prod.unwrap_or_else(|| one.clone());
                vec![set(acc, Expr::add(v(acc), term))]
            });
            let ostr: Vec<usize> = outer.iter().map(|&l| out_st[l] as usize).collect();
            let mut s = vec![set(acc, zero(at))];
            s.extend(ivs);
            s.push(Stmt::Store {
                buf: out.buf,
                index: index(ov, &ostr),
                value: if ot == at {
                    v(acc)
                } else {
                    Expr::cast(ot, v(acc))
                },
            });
            s
        });
        k.body = body;
        lw.push(k);
        Ok(())
    }

    mod det {
        use crate::ensure;
        use crate::ir::OpError;
        use crate::ir::OpResult;
        use crate::kir::{BinOp, CmpOp, Expr, Stmt, Ty, UnOp};
        use crate::ops::lowering::LowerCtx;
        use crate::ops::{Lowering, Registry};

        /// Gaussian elimination with row pivoting, unrolled over vars (small matrices).
        fn det(lw: &mut LowerCtx) -> OpResult<()> {
            let x = lw.input(0)?.clone();
            let out = lw.outputs[0].clone();
            let r = x.shape.len();
            ensure!(r >= 2 && x.shape[r - 1] == x.shape[r - 2], "Det: shape");
            let n = x.shape[r - 1];
            if n > 6 {
                return Err(OpError::unsupported("Det of matrices larger than 6x6"));
            }
            let nb = out.len();
            let t = x.ty();
            let ot = out.ty().compute();
            let mut k = lw.kernel("");
            let b = k.var(Ty::I64);
            let m: Vec<usize> = (0..n * n).map(|_| k.var(Ty::F64)).collect();
            let (d, tmp, c0, f) = (
                k.var(Ty::F64),
                k.var(Ty::F64),
                k.var(Ty::U8),
                k.var(Ty::F64),
            );
            let v = Expr::Var;
            let fl = |x: f64| Expr::Float(x, Ty::F64);
            let mut body = Vec::new();
            for (i, &mv) in m.iter().enumerate() {
                let e = Expr::load(
                    x.buf,
                    Expr::add(
                        Expr::mul(v(b), Expr::Int((n * n) as i64)),
                        Expr::Int(i as i64),
                    ),
                );
                let e = if t.compute() == Ty::F64 {
                    e
                } else {
                    Expr::cast(Ty::F64, e)
                };
                body.push(Stmt::Set { var: mv, value: e });
            }
            body.push(Stmt::Set {
                var: d,
                value: fl(1.0),
            });
            for c in 0..n {
                for rr in c + 1..n {
                    body.push(Stmt::Set {
                        var: c0,
                        value: Expr::cmp(
                            CmpOp::Gt,
                            Expr::un(UnOp::Abs, v(m[rr * n + c])),
                            Expr::un(UnOp::Abs, v(m[c * n + c])),
                        ),
                    });
                    for jj in c..n {
                        let (a, bb) = (m[c * n + jj], m[rr * n + jj]);
                        body.push(Stmt::Set {
                            var: tmp,
                            value: v(a),
                        });
                        body.push(Stmt::Set {
                            var: a,
                            value: Expr::select(v(c0), v(bb), v(a)),
                        });
                        body.push(Stmt::Set {
                            var: bb,
                            value: Expr::select(v(c0), v(tmp), v(bb)),
                        });
                    }
                    body.push(Stmt::Set {
                        var: d,
                        value: Expr::select(v(c0), Expr::un(UnOp::Neg, v(d)), v(d)),
                    });
                }
                let piv = v(m[c * n + c]);
                body.push(Stmt::Set {
                    var: d,
                    value: Expr::mul(v(d), piv.clone()),
                });
                for rr in c + 1..n {
                    body.push(Stmt::Set {
                        var: f,
                        value: Expr::select(
                            Expr::cmp(CmpOp::Eq, piv.clone(), fl(0.0)),
                            fl(0.0),
                            Expr::bin(BinOp::Div, v(m[rr * n + c]), piv.clone()),
                        ),
                    });
                    for jj in c..n {
                        let a = m[rr * n + jj];
                        body.push(Stmt::Set {
                            var: a,
                            value: Expr::bin(BinOp::Sub, v(a), Expr::mul(v(f), v(m[c * n + jj]))),
                        });
                    }
                }
            }
            let res = if ot == Ty::F64 {
                v(d)
            } else {
                Expr::cast(ot, v(d))
            };
            body.push(Stmt::Store {
                buf: out.buf,
                index: v(b),
                value: res,
            });
            k.body = vec![Stmt::For {
                var: b,
                extent: nb as u64,
                body,
            }];
            lw.push(k);
            Ok(())
        }

        pub fn register(r: &mut Registry) {
            r.lower("Det", Lowering::Custom(det));
        }
    }

    mod qlinear {
        use crate::ensure;
        use crate::ir::{OpError, OpResult};
        use crate::kir::{BinOp, CmpOp, Expr, Stmt, Ty, UnOp};
        use crate::ops::lowering::{broadcast_strides, nest, strides, LowerCtx, TensorRef};
        use crate::ops::{Lowering, Registry};

        fn f64e(t: &TensorRef) -> Expr {
            let e = Expr::load(t.buf, Expr::Int(0));
            if t.ty().compute() == Ty::F64 {
                e
            } else {
                Expr::cast(Ty::F64, e)
            }
        }

        /// Rounds an f64 to the precision of the scale type (as the reference does).
        fn round_to(e: Expr, t: Ty) -> Expr {
            let bits = match t {
                Ty::F32 => return Expr::cast(Ty::F64, Expr::cast(Ty::F32, e)),
                Ty::F16 => 11,
                Ty::BF16 => 8,
                _ => return e,
            };
            // Veltkamp splitting: the high part has `bits` significant bits.
            let c = Expr::Float((1u64 << (53 - bits)) as f64 + 1.0, Ty::F64);
            let sigma = Expr::mul(e.clone(), c);
            Expr::bin(BinOp::Sub, sigma.clone(), Expr::bin(BinOp::Sub, sigma, e))
        }

        fn qlinear_matmul(lw: &mut LowerCtx) -> OpResult<()> {
            let a = lw.input(0)?.clone();
            let b = lw.input(3)?.clone();
            let (sa, sb, sy) = (
                lw.input(1)?.clone(),
                lw.input(4)?.clone(),
                lw.input(6)?.clone(),
            );
            let (za, zb, zy) = (
                lw.opt_input(2).cloned(),
                lw.opt_input(5).cloned(),
                lw.opt_input(7).cloned(),
            );
            for p in [
                Some(&sa),
                Some(&sb),
                Some(&sy),
                za.as_ref(),
                zb.as_ref(),
                zy.as_ref(),
            ]
            .into_iter()
            .flatten()
            {
                if p.len() != 1 {
                    return Err(OpError::unsupported(
                        "QLinearMatMul with per-axis scales or zero points",
                    ));
                }
            }
            let out = lw.outputs[0].clone();
            let (ra, rb, ro) = (a.shape.len(), b.shape.len(), out.shape.len());
            if ra < 2 || rb < 2 {
                return Err(OpError::unsupported("QLinearMatMul of 1-D inputs"));
            }
            let kk = a.shape[ra - 1];
            ensure!(b.shape[rb - 2] == kk, "QLinearMatMul: inner dims differ");
            let (m, n) = (out.shape[ro - 2], out.shape[ro - 1]);
            let ob = &out.shape[..ro - 2];
            let abs = broadcast_strides(&a.shape[..ra - 2], ob);
            let bbs = broadcast_strides(&b.shape[..rb - 2], ob);
            let ot = out.ty();
            let (lo, hi) = match ot {
                Ty::U8 => (0.0, 255.0),
                Ty::I8 => (-128.0, 127.0),
                Ty::U16 => (0.0, 65535.0),
                Ty::I16 => (-32768.0, 32767.0),
                _ => return Err(OpError::unsupported(format!("QLinearMatMul to {ot}"))),
            };
            let st = sy.ty();
            let factor = round_to(
                Expr::bin(
                    BinOp::Div,
                    round_to(Expr::mul(f64e(&sa), f64e(&sb)), st),
                    f64e(&sy),
                ),
                st,
            );
            let zpe = |z: &Option<TensorRef>| match z {
                Some(z) => Expr::cast(Ty::I64, Expr::load(z.buf, Expr::Int(0))),
                None => Expr::Int(0),
            };
            let (zae, zbe) = (zpe(&za), zpe(&zb));
            let zye = match &zy {
                Some(z) => f64e(z),
                None => Expr::Float(0.0, Ty::F64),
            };
            let os = strides(&out.shape);
            let mut k = lw.kernel("");
            let (acc, fv, j) = (k.var(Ty::I64), k.var(Ty::F64), k.var(Ty::I64));
            let body = nest(&mut k, &out.shape, |_, v| {
                let mut ab = Expr::Int(0);
                let mut bb = Expr::Int(0);
                let mut oi = Expr::Int(0);
                for d in 0..ro - 2 {
                    ab = Expr::add(
                        ab,
                        Expr::mul(
                            Expr::Var(v[d]),
                            Expr::Int((abs[d] * a.shape[ra - 2] * kk) as i64),
                        ),
                    );
                    bb = Expr::add(
                        bb,
                        Expr::mul(Expr::Var(v[d]), Expr::Int((bbs[d] * kk * n) as i64)),
                    );
                }
                for d in 0..ro {
                    oi = Expr::add(oi, Expr::mul(Expr::Var(v[d]), Expr::Int(os[d] as i64)));
                }
                let (vm, vn) = (v[ro - 2], v[ro - 1]);
                let ai = Expr::add(
                    ab,
                    Expr::add(Expr::mul(Expr::Var(vm), Expr::Int(kk as i64)), Expr::Var(j)),
                );
                let bi = Expr::add(
                    bb,
                    Expr::add(Expr::mul(Expr::Var(j), Expr::Int(n as i64)), Expr::Var(vn)),
                );
                let av = Expr::bin(
                    BinOp::Sub,
                    Expr::cast(Ty::I64, Expr::load(a.buf, ai)),
                    zae.clone(),
                );
                let bv = Expr::bin(
                    BinOp::Sub,
                    Expr::cast(Ty::I64, Expr::load(b.buf, bi)),
                    zbe.clone(),
                );
                let x = Expr::add(
                    Expr::mul(Expr::cast(Ty::F64, Expr::Var(acc)), factor.clone()),
                    zye.clone(),
                );
                let r = Expr::un(UnOp::Nearest, x);
                let lo_e = Expr::Float(lo, Ty::F64);
                let hi_e = Expr::Float(hi, Ty::F64);
                vec![
                    Stmt::Set {
                        var: acc,
                        value: Expr::Int(0),
                    },
                    Stmt::For {
                        var: j,
                        extent: kk as u64,
                        body: vec![Stmt::Set {
                            var: acc,
                            value: Expr::add(Expr::Var(acc), Expr::mul(av, bv)),
                        }],
                    },
                    Stmt::Set { var: fv, value: r },
                    Stmt::Set {
                        var: fv,
                        value: Expr::select(
                            Expr::cmp(CmpOp::Lt, Expr::Var(fv), lo_e.clone()),
                            lo_e,
                            Expr::select(
                                Expr::cmp(CmpOp::Gt, Expr::Var(fv), hi_e.clone()),
                                hi_e,
                                Expr::Var(fv),
                            ),
                        ),
                    },
                    Stmt::Store {
                        buf: out.buf,
                        index: oi,
                        value: Expr::cast(ot, Expr::Var(fv)),
                    },
                ]
            });
            let _ = m;
            k.body = body;
            lw.push(k);
            Ok(())
        }

        pub fn register(r: &mut Registry) {
            r.lower("QLinearMatMul", Lowering::Custom(qlinear_matmul));
        }
    }

    pub fn register(r: &mut Registry) {
        qlinear::register(r);
        det::register(r);
        r.lower("MatMul", Lowering::Custom(matmul));
        r.lower("MatMulInteger", Lowering::Custom(matmul_integer));
        r.lower("Gemm", Lowering::Custom(gemm));
        r.lower("Einsum", Lowering::Custom(einsum));
    }
}
