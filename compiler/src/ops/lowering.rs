//! What an op's lowering to kernel IR sees ([`LowerCtx`]), and the shared lowering
//! helpers: elementwise loops with broadcasting, and data movement through index tables
//! computed at compile time by running the op's own reference evaluation on index tensors.

use super::OpCtx;
use crate::ir::{DType, Op, OpError, OpResult, Tensor, Value};
use crate::kir::{BufId, BufKind, Expr, Kernel, Program, Stmt, Ty, VarId};
use crate::{bail, ensure};
use ndarray::{ArrayD, IxDyn};

/// An input or output of the node being lowered.
#[derive(Clone, Debug)]
pub struct TensorRef {
    pub buf: BufId,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// The value, when known at compile time.
    pub value: Option<Tensor>,
}

impl TensorRef {
    pub fn ty(&self) -> Ty {
        kir_ty(self.dtype).expect("lowered tensors have a kernel type")
    }
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The kernel IR type that holds a dtype, if compiled code supports it.
pub fn kir_ty(dt: DType) -> Option<Ty> {
    Some(match dt {
        DType::F32 => Ty::F32,
        DType::F64 => Ty::F64,
        DType::F16 => Ty::F16,
        DType::BF16 => Ty::BF16,
        DType::I8 => Ty::I8,
        DType::I16 => Ty::I16,
        DType::I32 => Ty::I32,
        DType::I64 => Ty::I64,
        DType::U8 | DType::Bool => Ty::U8,
        DType::U16 => Ty::U16,
        DType::U32 => Ty::U32,
        DType::U64 => Ty::U64,
        DType::F8E4M3FN => Ty::F8E4M3FN,
        DType::F8E4M3FNUZ => Ty::F8E4M3FNUZ,
        DType::F8E5M2 => Ty::F8E5M2,
        DType::F8E5M2FNUZ => Ty::F8E5M2FNUZ,
        DType::F8E8M0 => Ty::F8E8M0,
        DType::F4E2M1 => Ty::F4E2M1,
        DType::I4 => Ty::I4,
        DType::U4 => Ty::U4,
        DType::I2 => Ty::I2,
        DType::U2 => Ty::U2,
        DType::Str => Ty::Str,
        _ => return None,
    })
}

/// Raw little-endian bytes of a tensor in its kernel storage type; for a string tensor,
/// [`string_bytes`].
pub fn tensor_bytes(t: &Tensor) -> OpResult<Vec<u8>> {
    if t.dtype() == DType::Str {
        return string_bytes(t);
    }
    ensure!(
        kir_ty(t.dtype()).is_some(),
        "{} tensors are not supported by compiled code",
        t.dtype()
    );
    let p = crate::onnx::tensor::to_proto(t, "");
    Ok(p.raw_data.unwrap_or_default())
}

/// The strings of a string tensor, row-major, each followed by a NUL: the data of a
/// constant string buffer in kernel IR, and how the compiled-model harness passes string
/// tensors through files. A string holding a NUL byte has no C-string form: an error.
pub fn string_bytes(t: &Tensor) -> OpResult<Vec<u8>> {
    let a = super::util::arr::<String>(t)?;
    let mut out = Vec::new();
    for s in a.iter() {
        ensure!(
            !s.contains('\0'),
            "the string {s:?} holds a NUL byte, which a C string cannot"
        );
        out.extend_from_slice(s.as_bytes());
        out.push(0);
    }
    Ok(out)
}

/// The refusal of an op whose input `i` must be known at compile time.
fn not_constant(i: usize) -> OpError {
    OpError::unsupported(format!(
        "input {i} must be a constant to compile this op: its values decide the output's \
         shape or which elements move, and here they are only known at run time (make it an \
         initializer)"
    ))
}

/// The node being lowered and the program it adds kernels to.
pub struct LowerCtx<'a> {
    pub op: &'a OpCtx,
    /// The node's op (its reference evaluation drives index-map lowerings).
    pub node_op: &'a dyn Op,
    pub name: String,
    pub inputs: Vec<Option<TensorRef>>,
    pub outputs: Vec<TensorRef>,
    pub program: &'a mut Program,
    /// Elementwise work fused into this node's kernel (set by the fusion passes through
    /// `onnxc.Fused` nodes). Only lowerings listed as epilogue anchors see one, and they
    /// must apply it to every element of output 0 before it is stored.
    pub epilogue: Option<Epilogue>,
    /// Set for a fused Conv whose epilogue's output goes through a 2x2 MaxPool of stride
    /// 2 (no padding, even output sides) inside the same `onnxc.Fused` node: output 0 is
    /// then the pooled tensor. A lowering that pools clears it; the Conv's lowering adds
    /// no kernel when it cannot, and the fused node lowers the pool on its own.
    pub max_pool_2x2: bool,
    /// The graph's [`Graph::narrow_loops`](crate::ir::Graph::narrow_loops).
    pub narrow_loops: bool,
}

/// An activation an epilogue applies.
#[derive(Clone, Debug, PartialEq)]
pub enum Act {
    Relu,
    /// `min(max(x, lo), hi)` (Relu6 is `Clip(0, 6)`).
    Clip(f64, f64),
    LeakyRelu(f64),
    Sigmoid,
    /// `max(0, min(1, alpha * x + beta))`.
    HardSigmoid(f64, f64),
    /// `x * max(0, min(1, x / 6 + 1 / 2))`.
    HardSwish,
    /// `x * sigmoid(x)`.
    Silu,
    /// `0.5 x (1 + erf(x / sqrt 2))`.
    GeluErf,
    /// `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`.
    GeluTanh,
    Tanh,
}

/// One step of an epilogue, applied to the accumulated value in order.
#[derive(Clone, Debug)]
pub enum EpStep {
    /// `acc + t`, `t` broadcast (NumPy rules) to output 0's shape: a bias or a residual.
    Add(TensorRef),
    /// `acc * t`, `t` broadcast to output 0's shape.
    Mul(TensorRef),
    Act(Act),
}

/// Elementwise work applied inside the kernel that produces a value, while the value is
/// still in registers, instead of a second pass over memory.
#[derive(Clone, Debug, Default)]
pub struct Epilogue {
    pub steps: Vec<EpStep>,
}

impl Epilogue {
    /// The epilogue applied to `acc` (of compute type `ty`) at output position `vars`
    /// (one loop variable per dim of `out_shape`).
    pub fn apply(&self, acc: Expr, ty: Ty, vars: &[VarId], out_shape: &[usize]) -> Expr {
        let coords: Vec<Expr> = vars.iter().map(|&v| Expr::Var(v)).collect();
        self.apply_at(acc, ty, &coords, out_shape)
    }

    /// Same, at output position `coords` (one index expression per dim of `out_shape`).
    pub fn apply_at(&self, acc: Expr, ty: Ty, coords: &[Expr], out_shape: &[usize]) -> Expr {
        let at = |t: &TensorRef| {
            let bs = broadcast_strides(&t.shape, out_shape);
            let terms = coords.iter().zip(&bs).filter(|(_, &s)| s != 0);
            let idx = terms.fold(None, |acc: Option<Expr>, (c, &s)| {
                let term = if s == 1 {
                    c.clone()
                } else {
                    Expr::mul(c.clone(), Expr::Int(s as i64))
                };
                Some(match acc {
                    None => term,
                    Some(a) => Expr::add(a, term),
                })
            });
            load_as(t, ty, idx.unwrap_or(Expr::Int(0)))
        };
        let mut x = acc;
        for s in &self.steps {
            x = match s {
                EpStep::Add(t) => Expr::add(x, at(t)),
                EpStep::Mul(t) => Expr::mul(x, at(t)),
                EpStep::Act(a) => act_expr(a, x, ty),
            };
        }
        x
    }

    /// Same, at a flat (row-major) output index: for kernels that do not keep one loop
    /// variable per dim. Broadcast operands are indexed by div/rem of the flat index.
    pub fn apply_flat(&self, acc: Expr, ty: Ty, flat: Expr, out_shape: &[usize]) -> Expr {
        let os = strides(out_shape);
        let mut x = acc;
        for s in &self.steps {
            let idx = |t: &TensorRef| {
                let bs = broadcast_strides(&t.shape, out_shape);
                if t.shape.iter().product::<usize>() == out_shape.iter().product::<usize>() {
                    return flat.clone();
                }
                let mut e: Option<Expr> = None;
                for d in 0..out_shape.len() {
                    if bs[d] == 0 {
                        continue;
                    }
                    let coord = Expr::bin(
                        crate::kir::BinOp::Rem,
                        Expr::bin(
                            crate::kir::BinOp::Div,
                            flat.clone(),
                            Expr::Int(os[d] as i64),
                        ),
                        Expr::Int(out_shape[d] as i64),
                    );
                    let term = Expr::mul(coord, Expr::Int(bs[d] as i64));
                    e = Some(match e {
                        None => term,
                        Some(a) => Expr::add(a, term),
                    });
                }
                e.unwrap_or(Expr::Int(0))
            };
            x = match s {
                EpStep::Add(t) => Expr::add(x, load_as(t, ty, idx(t))),
                EpStep::Mul(t) => Expr::mul(x, load_as(t, ty, idx(t))),
                EpStep::Act(a) => act_expr(a, x, ty),
            };
        }
        x
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

fn load_as(t: &TensorRef, ty: Ty, idx: Expr) -> Expr {
    let v = Expr::load(t.buf, idx);
    if t.ty().compute() == ty {
        v
    } else {
        Expr::cast(ty, v)
    }
}

/// The scalar expression of an activation at compute type `ty` (F32 or F64).
pub fn act_expr(a: &Act, x: Expr, ty: Ty) -> Expr {
    use crate::kir::{BinOp, CmpOp, MathFn};
    let c = |v: f64| Expr::f(v, ty);
    let max = |a: Expr, b: Expr| Expr::bin(BinOp::Max, a, b);
    let min = |a: Expr, b: Expr| Expr::bin(BinOp::Min, a, b);
    let sigmoid = |x: Expr| {
        Expr::bin(
            BinOp::Div,
            c(1.0),
            Expr::add(
                c(1.0),
                Expr::call(MathFn::Exp, vec![Expr::un(crate::kir::UnOp::Neg, x)]),
            ),
        )
    };
    match a {
        Act::Relu => max(x, c(0.0)),
        Act::Clip(lo, hi) => min(max(x, c(*lo)), c(*hi)),
        Act::LeakyRelu(alpha) => Expr::select(
            Expr::cmp(CmpOp::Ge, x.clone(), c(0.0)),
            x.clone(),
            Expr::mul(x, c(*alpha)),
        ),
        Act::Sigmoid => sigmoid(x),
        Act::HardSigmoid(alpha, beta) => min(
            max(Expr::add(Expr::mul(x, c(*alpha)), c(*beta)), c(0.0)),
            c(1.0),
        ),
        Act::HardSwish => Expr::mul(
            x.clone(),
            min(
                max(Expr::add(Expr::mul(x, c(1.0 / 6.0)), c(0.5)), c(0.0)),
                c(1.0),
            ),
        ),
        Act::Silu => Expr::mul(x.clone(), sigmoid(x)),
        Act::GeluErf => Expr::mul(
            Expr::mul(x.clone(), c(0.5)),
            Expr::add(
                c(1.0),
                Expr::call(
                    MathFn::Erf,
                    vec![Expr::mul(x, c(std::f64::consts::FRAC_1_SQRT_2))],
                ),
            ),
        ),
        Act::GeluTanh => {
            let inner = Expr::mul(
                c((2.0 / std::f64::consts::PI).sqrt()),
                Expr::add(
                    x.clone(),
                    Expr::mul(
                        c(0.044715),
                        Expr::mul(x.clone(), Expr::mul(x.clone(), x.clone())),
                    ),
                ),
            );
            Expr::mul(
                Expr::mul(x, c(0.5)),
                Expr::add(c(1.0), Expr::call(MathFn::Tanh, vec![inner])),
            )
        }
        Act::Tanh => Expr::call(MathFn::Tanh, vec![x]),
    }
}

impl LowerCtx<'_> {
    pub fn input(&self, i: usize) -> OpResult<&TensorRef> {
        self.inputs
            .get(i)
            .and_then(|x| x.as_ref())
            .ok_or_else(|| OpError::new(format!("required input {i} is missing")))
    }

    pub fn opt_input(&self, i: usize) -> Option<&TensorRef> {
        self.inputs.get(i).and_then(|x| x.as_ref())
    }

    /// The compile-time value of input `i` (an error naming the input when it is not
    /// constant).
    pub fn const_input(&self, i: usize) -> OpResult<&Tensor> {
        let t = self.input(i)?;
        t.value.as_ref().ok_or_else(|| not_constant(i))
    }

    /// Adds read-only data and returns its buffer.
    pub fn constant(&mut self, what: &str, t: &Tensor) -> OpResult<BufId> {
        let ty = kir_ty(t.dtype())
            .ok_or_else(|| OpError::unsupported(format!("{} constants", t.dtype())))?;
        let data = tensor_bytes(t)?;
        Ok(self.program.add_buffer(
            format!("{}/{what}", self.name),
            BufKind::Const { data },
            ty,
            t.len() as u64,
        ))
    }

    pub fn kernel(&self, suffix: &str) -> Kernel {
        if suffix.is_empty() {
            Kernel::new(self.name.clone())
        } else {
            Kernel::new(format!("{}/{suffix}", self.name))
        }
    }

    pub fn push(&mut self, k: Kernel) {
        self.program.kernels.push(k);
    }
}

/// Row-major strides of a shape.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// `sum(vars[d] * strides[d])` over the dims where the stride is not zero.
pub fn index(vars: &[VarId], strides: &[usize]) -> Expr {
    let mut e: Option<Expr> = None;
    for (&v, &s) in vars.iter().zip(strides) {
        if s == 0 {
            continue;
        }
        let term = if s == 1 {
            Expr::Var(v)
        } else {
            Expr::mul(Expr::Var(v), Expr::Int(s as i64))
        };
        e = Some(match e {
            None => term,
            Some(x) => Expr::add(x, term),
        });
    }
    e.unwrap_or(Expr::Int(0))
}

/// Strides to read an input of shape `ins` broadcast to `out` (0 on broadcast dims).
pub fn broadcast_strides(ins: &[usize], out: &[usize]) -> Vec<usize> {
    let s = strides(ins);
    let off = out.len() - ins.len();
    (0..out.len())
        .map(|d| {
            if d < off || ins[d - off] == 1 {
                0
            } else {
                s[d - off]
            }
        })
        .collect()
}

/// Wraps `body` in loops over `shape`; returns the loop variables through `f`.
pub fn nest(
    k: &mut Kernel,
    shape: &[usize],
    f: impl FnOnce(&mut Kernel, &[VarId]) -> Vec<Stmt>,
) -> Vec<Stmt> {
    let vars: Vec<VarId> = shape.iter().map(|_| k.var(Ty::I64)).collect();
    let mut body = f(k, &vars);
    for (d, &n) in shape.iter().enumerate().rev() {
        body = vec![Stmt::For {
            var: vars[d],
            extent: n as u64,
            body,
        }];
    }
    body
}

/// Walks two strings (element `a.1` of string buffer `a.0`, element `b.1` of `b.0`) to
/// their first difference: the statements, and the two bytes where they stop (equal
/// only when both are the terminating NUL). The strings are equal when the bytes are,
/// and the first sorts before the second (bytewise, as Rust's `str` does) when its
/// byte is the smaller. Reads no byte past either string's NUL.
pub fn str_diff(k: &mut Kernel, a: (BufId, Expr), b: (BufId, Expr)) -> (Vec<Stmt>, Expr, Expr) {
    use crate::kir::{BinOp, CmpOp};
    let j = k.var(Ty::I64);
    let x = Expr::str_byte(a.0, a.1, Expr::Var(j));
    let y = Expr::str_byte(b.0, b.1, Expr::Var(j));
    let stmts = vec![
        Stmt::Set {
            var: j,
            value: Expr::Int(0),
        },
        Stmt::While {
            cond: Expr::bin(
                BinOp::And,
                Expr::cmp(CmpOp::Eq, x.clone(), y.clone()),
                Expr::cmp(CmpOp::Ne, x.clone(), Expr::cast(Ty::U8, Expr::Int(0))),
            ),
            body: vec![Stmt::Set {
                var: j,
                value: Expr::add(Expr::Var(j), Expr::Int(1)),
            }],
        },
    ];
    (stmts, x, y)
}

/// Lowers an elementwise op with NumPy broadcasting: output `o` gets
/// `f(kernel, [input values])` at every position. Omitted inputs are skipped.
pub fn elementwise(
    lw: &mut LowerCtx,
    o: usize,
    f: impl FnOnce(&mut Kernel, Vec<Expr>) -> OpResult<Expr>,
) -> OpResult<()> {
    let out = lw.outputs[o].clone();
    let ins: Vec<TensorRef> = lw.inputs.iter().flatten().cloned().collect();
    let mut k = lw.kernel("");
    let mut err = None;
    let body = nest(&mut k, &out.shape, |k, vars| {
        let args: Vec<Expr> = ins
            .iter()
            .map(|t| Expr::load(t.buf, index(vars, &broadcast_strides(&t.shape, &out.shape))))
            .collect();
        match f(k, args) {
            Ok(v) => vec![Stmt::Store {
                buf: out.buf,
                index: index(vars, &strides(&out.shape)),
                value: v,
            }],
            Err(e) => {
                err = Some(e);
                vec![]
            }
        }
    });
    if let Some(e) = err {
        return Err(e);
    }
    k.body = body;
    lw.push(k);
    Ok(())
}

/// An op's reference evaluation, run by [`lower_by_index_map`] on index tensors.
pub type EvalFn<'a> = dyn Fn(&[Option<&Value>]) -> OpResult<Vec<Value>> + 'a;

/// Lowers a pure data-movement op (every output element is a copy of one input element,
/// or a fill value) through index tables. The op's reference evaluation runs on index
/// tensors: data input k becomes `(k << 40) + flat_index + 1` (int64), the other inputs
/// keep their constant values, and 0 in the result marks a fill. `data_inputs` lists the
/// inputs that carry data; `fill` is the fill value as an expression of the output type
/// (string outputs always fill with the empty string).
pub fn lower_by_index_map(
    lw: &mut LowerCtx,
    eval: &EvalFn,
    data_inputs: &[usize],
    replace: &[(usize, Tensor)],
    fill: Option<Expr>,
) -> OpResult<()> {
    lower_by_index_map_at(lw, eval, data_inputs, replace, fill, &|_| true)
}

/// [`lower_by_index_map`] for the output positions `keep` accepts (flat, in every
/// output); another kernel writes the others (Pad's interior, see `pad_by_borders` in
/// `ops/shape.rs`).
pub fn lower_by_index_map_at(
    lw: &mut LowerCtx,
    eval: &EvalFn,
    data_inputs: &[usize],
    replace: &[(usize, Tensor)],
    fill: Option<Expr>,
    keep: &dyn Fn(usize) -> bool,
) -> OpResult<()> {
    let mut vals: Vec<Option<Value>> = Vec::new();
    for (i, inp) in lw.inputs.iter().enumerate() {
        let v = match inp {
            None => None,
            Some(t) if data_inputs.contains(&i) => {
                let n = t.len();
                ensure!(n < (1 << 39), "tensor too large for an index map");
                let v: Vec<i64> = (0..n).map(|j| ((i as i64) << 40) + j as i64 + 1).collect();
                Some(Value::Tensor(Tensor::from_array(
                    ArrayD::from_shape_vec(IxDyn(&t.shape), v)
                        .map_err(|e| OpError::new(e.to_string()))?,
                )))
            }
            Some(_) if replace.iter().any(|(r, _)| *r == i) => Some(Value::Tensor(
                replace
                    .iter()
                    .find(|(r, _)| *r == i)
                    .expect("found")
                    .1
                    .clone(),
            )),
            Some(t) => match &t.value {
                Some(v) => Some(Value::Tensor(v.clone())),
                None => return Err(not_constant(i)),
            },
        };
        vals.push(v);
    }
    let refs: Vec<Option<&Value>> = vals.iter().map(|v| v.as_ref()).collect();
    let results = eval(&refs)?;
    for (o, r) in results.iter().enumerate() {
        if o >= lw.outputs.len() {
            break;
        }
        let out = lw.outputs[o].clone();
        let map = r
            .as_tensor()
            .and_then(|t| t.to_i64_vec())
            .ok_or_else(|| OpError::new("index map evaluation gave no integer tensor"))?;
        ensure!(
            map.len() == out.len(),
            "index map has {} entries for {} outputs",
            map.len(),
            out.len()
        );
        // Group output positions by source input.
        let mut per_input: Vec<(usize, Vec<i64>, Vec<i64>)> = Vec::new();
        let mut fills: Vec<i64> = Vec::new();
        for (pos, &m) in map.iter().enumerate() {
            if !keep(pos) {
                continue;
            }
            if m == 0 {
                fills.push(pos as i64);
                continue;
            }
            let src = ((m - 1) >> 40) as usize;
            let idx = (m - 1) & ((1 << 40) - 1);
            match per_input.iter_mut().find(|(s, _, _)| *s == src) {
                Some((_, p, i)) => {
                    p.push(pos as i64);
                    i.push(idx);
                }
                None => per_input.push((src, vec![pos as i64], vec![idx])),
            }
        }
        for (src, pos, idx) in per_input {
            let inp = lw.input(src)?.clone();
            let mut k = lw.kernel(&format!("copy{src}"));
            let n = pos.len();
            // Identity map: a plain copy loop.
            let identity = pos.iter().zip(&idx).all(|(p, i)| p == i) && n == out.len();
            let j = k.var(Ty::I64);
            // Source index affine in the output's multi-index (Transpose, Slice, Expand,
            // Split...), or both the output position and the source index affine in the
            // input's (Concat, Pad): a loop nest instead of two index tables.
            let affine = if identity {
                None
            } else if n == out.len() && pos.iter().enumerate().all(|(j, &p)| p == j as i64) {
                affine_map(&out.shape, &idx).map(|(base, st)| {
                    let ost = strides(&out.shape).iter().map(|&s| s as i64).collect();
                    (out.shape.clone(), 0, ost, base, st)
                })
            } else if n == inp.len() {
                match (affine_map(&inp.shape, &pos), affine_map(&inp.shape, &idx)) {
                    (Some((pb, pst)), Some((ib, ist))) => {
                        Some((inp.shape.clone(), pb, pst, ib, ist))
                    }
                    _ => None,
                }
            } else {
                None
            };
            if let Some((shape, pbase, pst, base, st)) = affine {
                let dims = merge_dims(&shape, &pst, &st);
                let mut dst = Expr::Int(pbase);
                let mut srcx = Expr::Int(base);
                let mut loops = Vec::new();
                for (ext, ps, ss) in dims {
                    let vd = k.var(Ty::I64);
                    dst = Expr::add(dst, Expr::mul(Expr::Var(vd), Expr::Int(ps)));
                    srcx = Expr::add(srcx, Expr::mul(Expr::Var(vd), Expr::Int(ss)));
                    loops.push((vd, ext));
                }
                let mut body = vec![Stmt::Store {
                    buf: out.buf,
                    index: dst,
                    value: Expr::load(inp.buf, srcx),
                }];
                for &(vd, ext) in loops.iter().rev() {
                    body = vec![Stmt::For {
                        var: vd,
                        extent: ext as u64,
                        body,
                    }];
                }
                k.body = body;
            } else if identity {
                k.body = vec![Stmt::For {
                    var: j,
                    extent: n as u64,
                    body: vec![Stmt::Store {
                        buf: out.buf,
                        index: Expr::Var(j),
                        value: Expr::load(inp.buf, Expr::Var(j)),
                    }],
                }];
            } else {
                let (pt, it) = (table(lw, "pos", &pos)?, table(lw, "idx", &idx)?);
                let p = Expr::cast(Ty::I64, Expr::load(pt, Expr::Var(j)));
                let i = Expr::cast(Ty::I64, Expr::load(it, Expr::Var(j)));
                k.body = vec![Stmt::For {
                    var: j,
                    extent: n as u64,
                    body: vec![Stmt::Store {
                        buf: out.buf,
                        index: p,
                        value: Expr::load(inp.buf, i),
                    }],
                }];
            }
            lw.push(k);
        }
        if !fills.is_empty() {
            let fill = if out.dtype == DType::Str {
                // A string fill is the empty string, placed as a constant.
                let b = lw.constant("empty", &Tensor::from_vec(&[1], vec![String::new()]))?;
                Expr::load(b, Expr::Int(0))
            } else {
                let Some(fill) = fill.clone() else {
                    bail!("the index map has fill positions but no fill value")
                };
                fill
            };
            let pt = table(lw, "fill", &fills)?;
            let mut k = lw.kernel("fill");
            let j = k.var(Ty::I64);
            k.body = vec![Stmt::For {
                var: j,
                extent: fills.len() as u64,
                body: vec![Stmt::Store {
                    buf: out.buf,
                    index: Expr::cast(Ty::I64, Expr::load(pt, Expr::Var(j))),
                    value: fill,
                }],
            }];
            lw.push(k);
        }
    }
    Ok(())
}

/// The dims of a loop nest over `shape` that writes at `sum i_d pst_d` and reads at
/// `sum i_d ist_d`, as (extent, write stride, read stride): dims of extent 1 dropped,
/// neighbours merged where both strides continue each other (a contiguous Concat part
/// is one loop).
fn merge_dims(shape: &[usize], pst: &[i64], ist: &[i64]) -> Vec<(usize, i64, i64)> {
    let mut out: Vec<(usize, i64, i64)> = Vec::new();
    for d in 0..shape.len() {
        if shape[d] == 1 {
            continue;
        }
        match out.last_mut() {
            Some((ext, ps, is))
                if *ps == pst[d] * shape[d] as i64 && *is == ist[d] * shape[d] as i64 =>
            {
                *ext *= shape[d];
                *ps = pst[d];
                *is = ist[d];
            }
            _ => out.push((shape[d], pst[d], ist[d])),
        }
    }
    out
}

/// `(base, strides)` when `idx[flat(i)] = base + sum_d i_d * strides[d]` for every
/// multi-index `i` of `shape` (row-major), else None.
fn affine_map(shape: &[usize], idx: &[i64]) -> Option<(i64, Vec<i64>)> {
    let n: usize = shape.iter().product();
    if n == 0 || idx.len() != n {
        return None;
    }
    let ost = strides(shape);
    let base = idx[0];
    let st: Vec<i64> = shape
        .iter()
        .zip(&ost)
        .map(|(&ext, &os)| if ext > 1 { idx[os] - base } else { 0 })
        .collect();
    // Walk every position with an odometer, keeping the expected source index.
    let mut at = vec![0usize; shape.len()];
    let mut want = base;
    for &got in idx {
        if got != want {
            return None;
        }
        for d in (0..shape.len()).rev() {
            at[d] += 1;
            want += st[d];
            if at[d] < shape[d] {
                break;
            }
            want -= st[d] * shape[d] as i64;
            at[d] = 0;
        }
    }
    Some((base, st))
}

/// An index table as constant data (int32 when it fits).
fn table(lw: &mut LowerCtx, what: &str, v: &[i64]) -> OpResult<BufId> {
    let fits = v.iter().all(|&x| x <= i32::MAX as i64);
    let t = if fits {
        Tensor::from_vec(
            &[v.len()],
            v.iter().map(|&x| x as i32).collect::<Vec<i32>>(),
        )
    } else {
        Tensor::from_vec(&[v.len()], v.to_vec())
    };
    lw.constant(what, &t)
}

/// A literal of the given compute type.
pub fn lit(x: f64, t: Ty) -> Expr {
    match t.compute() {
        Ty::F32 => Expr::Float(x, Ty::F32),
        Ty::F64 => Expr::Float(x, Ty::F64),
        it => Expr::cast(it, Expr::Int(x as i64)),
    }
}
