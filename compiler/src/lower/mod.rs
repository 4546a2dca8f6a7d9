//! Graph IR -> kernel IR: every node (in schedule order) lowers itself through its op's
//! lowering; values get buffers (model inputs and outputs, constants, arena slices), and
//! the memory plan fixes the arena offsets.

pub mod alias;
pub mod bands;
pub mod collapse;
pub mod gemm;
pub mod plan;

use crate::error::{Error, Result};
use crate::ir::{Graph, Source, Tensor, Value, ValueId, ValueType};
use crate::kir::{BufId, BufKind, Expr, Kernel, Program, Stmt, Ty};
use crate::ops::lowering::{kir_ty, lower_by_index_map, LowerCtx, TensorRef};
use crate::ops::{Lowering, OpCtx, Registry};
use std::collections::HashMap;

/// The lowered program plus what the memory plan measured.
pub struct Lowered {
    pub program: Program,
    pub plan: plan::PlanReport,
    /// Node name for each kernel (for reports).
    pub kernel_nodes: Vec<String>,
}

fn static_ref(
    g: &Graph,
    v: ValueId,
) -> std::result::Result<(crate::ir::DType, Vec<usize>), String> {
    let info = g.value(v);
    match (&info.ty, info.ty.static_shape()) {
        (ValueType::Tensor { dt, .. }, Some(s)) => Ok((*dt, s)),
        _ => Err(format!(
            "`{}` has no static tensor type ({})",
            info.name, info.ty
        )),
    }
}

/// Lowers a shape-inferred graph. `known` holds the values inference folded.
pub fn lower(g: &Graph, known: &HashMap<ValueId, Value>) -> Result<Lowered> {
    let reg = Registry::standard();
    let mut p = Program::default();
    let mut bufs: HashMap<ValueId, BufId> = HashMap::new();
    let mut errors: Vec<String> = Vec::new();
    let mut kernel_nodes: Vec<String> = Vec::new();

    let ty_of = |dt: crate::ir::DType, what: &str| -> std::result::Result<Ty, String> {
        kir_ty(dt)
            .ok_or_else(|| format!("{what}: {dt} tensors are not supported by compiled code yet"))
    };
    for (k, &v) in g.inputs.iter().enumerate() {
        let (dt, shape) = static_ref(g, v).map_err(Error::Shape)?;
        let ty = ty_of(dt, &format!("input `{}`", g.value(v).name))
            .map_err(|e| Error::Unsupported(vec![e]))?;
        let id = p.add_buffer(
            g.value(v).name.clone(),
            BufKind::Input(k),
            ty,
            shape.iter().product::<usize>() as u64,
        );
        p.inputs.push(id);
        bufs.insert(v, id);
    }
    let mut out_bufs: Vec<BufId> = Vec::new();
    for (k, &v) in g.outputs.iter().enumerate() {
        let (dt, shape) = static_ref(g, v).map_err(Error::Shape)?;
        let ty = ty_of(dt, &format!("output `{}`", g.value(v).name))
            .map_err(|e| Error::Unsupported(vec![e]))?;
        let id = p.add_buffer(
            g.value(v).name.clone(),
            BufKind::Output(k),
            ty,
            shape.iter().product::<usize>() as u64,
        );
        p.outputs.push(id);
        out_bufs.push(id);
        // A value that is both an input and an output keeps its input buffer; it is copied.
        bufs.entry(v).or_insert(id);
    }

    let order = g
        .topo_order()
        .map_err(|c| Error::model(format!("cycle through {}", c.join(", "))))?;
    for n in order {
        let node = &g.nodes[n];
        let label = g.node_label(n);
        if node.outputs.iter().all(|o| known.contains_key(o)) {
            continue; // folded at compile time
        }
        if let Some(b) = view_of(g, node, &bufs, &p) {
            // A reshape of an arena tensor: the output is the same memory, no kernel.
            bufs.insert(node.outputs[0], b);
            continue;
        }
        let Some(lowering) = reg.lowering(&node.domain, &node.op_type) else {
            errors.push(format!(
                "{label}: no compiled implementation of {} yet",
                node.op_type
            ));
            continue;
        };
        // Inputs.
        let mut inputs = Vec::with_capacity(node.inputs.len());
        let mut bad = None;
        for inp in &node.inputs {
            let Some(v) = inp else {
                inputs.push(None);
                continue;
            };
            let value = known.get(v).and_then(|x| x.as_tensor()).cloned();
            let (dt, shape) = match static_ref(g, *v) {
                Ok(x) => x,
                Err(e) => {
                    bad = Some(e);
                    break;
                }
            };
            let buf = match bufs.get(v) {
                Some(b) => *b,
                None => match (&value, g.value(*v).source) {
                    (Some(t), _) => match const_buffer(&mut p, &g.value(*v).name, t) {
                        Ok(b) => {
                            bufs.insert(*v, b);
                            b
                        }
                        Err(e) => {
                            bad = Some(e);
                            break;
                        }
                    },
                    (None, Source::Const) => {
                        let t = &g.consts[v];
                        match const_buffer(&mut p, &g.value(*v).name, t) {
                            Ok(b) => {
                                bufs.insert(*v, b);
                                b
                            }
                            Err(e) => {
                                bad = Some(e);
                                break;
                            }
                        }
                    }
                    _ => {
                        bad = Some(format!("input `{}` has no buffer", g.value(*v).name));
                        break;
                    }
                },
            };
            inputs.push(Some(TensorRef {
                buf,
                dtype: dt,
                shape,
                value,
            }));
        }
        if let Some(e) = bad {
            errors.push(format!("{label}: {e}"));
            continue;
        }
        // Outputs.
        let mut outputs = Vec::new();
        for &o in &node.outputs {
            let (dt, shape) = match static_ref(g, o) {
                Ok(x) => x,
                Err(e) => {
                    bad = Some(e);
                    break;
                }
            };
            let Some(ty) = kir_ty(dt) else {
                bad = Some(format!(
                    "output `{}`: {dt} is not supported by compiled code yet",
                    g.value(o).name
                ));
                break;
            };
            let buf = match bufs.get(&o) {
                Some(b) => *b,
                None => {
                    let len = shape.iter().product::<usize>() as u64;
                    let b = p.add_buffer(
                        g.value(o).name.clone(),
                        BufKind::Arena { offset: 0 },
                        ty,
                        len,
                    );
                    bufs.insert(o, b);
                    b
                }
            };
            outputs.push(TensorRef {
                buf,
                dtype: dt,
                shape,
                value: None,
            });
        }
        if let Some(e) = bad {
            errors.push(format!("{label}: {e}"));
            continue;
        }
        let ctx = OpCtx {
            op_type: node.op_type.clone(),
            domain: node.domain.clone(),
            attrs: node.attrs.clone(),
            opset: node.opset,
            n_inputs: node.inputs.len(),
            n_outputs: node.outputs.len(),
        };
        let name = if node.name.is_empty() {
            format!("{}_{}", node.op_type, n.index())
        } else {
            node.name.clone()
        };
        let before = p.kernels.len();
        let strings = inputs
            .iter()
            .flatten()
            .map(|t| t.dtype)
            .chain(outputs.iter().map(|t| t.dtype))
            .any(|d| d == crate::ir::DType::Str);
        let mut lw = LowerCtx {
            op: &ctx,
            node_op: node.op.as_ref(),
            name: name.clone(),
            inputs,
            outputs,
            program: &mut p,
            epilogue: None,
            max_pool_2x2: false,
            narrow_loops: g.narrow_loops,
        };
        let r = match lowering {
            Lowering::Custom(f) => f(&mut lw),
            Lowering::Movement(data) => {
                let op = node.op.clone();
                // (String outputs fill with the empty string; lower_by_index_map
                // places it.)
                let fill = lw
                    .outputs
                    .first()
                    .filter(|o| o.dtype != crate::ir::DType::Str)
                    .map(|o| crate::ops::lowering::lit(0.0, o.ty()));
                lower_by_index_map(&mut lw, &|ins| op.eval(ins), data, &[], fill)
            }
        };
        if let Err(e) = r {
            p.kernels.truncate(before);
            errors.push(format!("{label}: {e}"));
            continue;
        }
        // String pointers only move and are read byte by byte: a lowering written for
        // numbers that reaches them (arithmetic, casts, comparisons) fails the type
        // check, and the node is reported rather than the whole program.
        if strings {
            let bad: Vec<String> = p.kernels[before..]
                .iter()
                .filter_map(|k| crate::kir::verify::verify_kernel(k, &p).err())
                .flatten()
                .collect();
            if !bad.is_empty() {
                p.kernels.truncate(before);
                errors.push(format!(
                    "{label}: {} is not compiled for string tensors ({})",
                    node.op_type,
                    bad.join("; ")
                ));
                continue;
            }
        }
        for _ in before..p.kernels.len() {
            kernel_nodes.push(name.clone());
        }
    }

    // Graph outputs not written by a kernel: copies from inputs or constants.
    for (k, &v) in g.outputs.iter().enumerate() {
        let ob = out_bufs[k];
        let written = p.buffers[ob].len == 0 || p.kernels.iter().any(|kern| writes(&kern.body, ob));
        if written {
            continue;
        }
        let src = match bufs.get(&v) {
            Some(&b) if b != ob => b,
            _ => {
                let t = known
                    .get(&v)
                    .and_then(|x| x.as_tensor())
                    .cloned()
                    .or_else(|| g.consts.get(&v).cloned());
                match t {
                    Some(t) => match const_buffer(&mut p, &g.value(v).name, &t) {
                        Ok(b) => b,
                        Err(e) => {
                            errors.push(format!("output `{}`: {e}", g.value(v).name));
                            continue;
                        }
                    },
                    // (When a node failed, its message says why.)
                    None if !errors.is_empty() => continue,
                    None => {
                        errors.push(format!("output `{}` is never computed", g.value(v).name));
                        continue;
                    }
                }
            }
        };
        p.kernels.push(copy_kernel(
            &format!("output{k}"),
            src,
            ob,
            p.buffers[ob].len,
        ));
        kernel_nodes.push(format!("output {k}"));
    }
    if !errors.is_empty() {
        return Err(Error::Unsupported(errors));
    }
    for k in alias::copies(&mut p).into_iter().rev() {
        kernel_nodes.remove(k);
    }
    if std::env::var_os("ONNXC_NO_BAND_FUSION").is_none() {
        for k in bands::fuse(&mut p).into_iter().rev() {
            let after = kernel_nodes.remove(k);
            kernel_nodes[k - 1] = format!("{} + {after}", kernel_nodes[k - 1]);
        }
    }
    for k in &mut p.kernels {
        k.body = collapse::collapse(&unit_leaves(&k.body));
    }
    let plan = plan::plan(&mut p);
    if let Err(e) = crate::kir::verify::verify_program(&p) {
        return Err(Error::model(format!(
            "kernel IR verifier:\n{}",
            e.join("\n")
        )));
    }
    Ok(Lowered {
        program: p,
        plan,
        kernel_nodes,
    })
}

/// `body` with every innermost loop of one iteration replaced by its body (its variable
/// 0), inside out: an elementwise kernel over `[40, 240, 1, 1]` then ends in the loop of
/// 240, which the back ends vectorise, instead of two loops of one. (EfficientNet-B0's
/// squeeze-excitation scales folded into the next convs' weights ran as scalar code:
/// up to 8.6 us for 9600 products, 20.7 -> 5.8 us for the five.) Outer loops of one
/// stay: the loop nests the back ends match keep their shape.
fn unit_leaves(body: &[Stmt]) -> Vec<Stmt> {
    fn has_loop(s: &Stmt) -> bool {
        match s {
            Stmt::For { .. } | Stmt::While { .. } => true,
            Stmt::If { then, els, .. } => then.iter().chain(els).any(has_loop),
            _ => false,
        }
    }
    let mut out = Vec::with_capacity(body.len());
    for s in body {
        match s {
            Stmt::For { var, extent, body } => {
                let inner = unit_leaves(body);
                if *extent == 1 && !inner.iter().any(has_loop) {
                    out.extend(crate::kir::parallel::subst(&inner, *var, &Expr::Int(0)));
                } else {
                    out.push(Stmt::For {
                        var: *var,
                        extent: *extent,
                        body: inner,
                    });
                }
            }
            Stmt::If { cond, then, els } => out.push(Stmt::If {
                cond: cond.clone(),
                then: unit_leaves(then),
                els: unit_leaves(els),
            }),
            Stmt::While { cond, body } => out.push(Stmt::While {
                cond: cond.clone(),
                body: unit_leaves(body),
            }),
            s => out.push(s.clone()),
        }
    }
    out
}

/// The arena buffer a node's output can share with its input: the node only reshapes
/// (Reshape, Flatten, Squeeze, Unsqueeze, Identity), its input lives in the arena (not a
/// model input, output or constant) and its output is not a model output (those have
/// buffers of their own). Values never change once computed, so the alias is safe; the
/// memory plan sees the buffer live until the alias's last use.
fn view_of(
    g: &Graph,
    node: &crate::ir::Node,
    bufs: &HashMap<ValueId, BufId>,
    p: &Program,
) -> Option<BufId> {
    if !node.domain.is_empty()
        || !matches!(
            node.op_type.as_str(),
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" | "Identity"
        )
        || node.outputs.len() != 1
    {
        return None;
    }
    let x = (*node.inputs.first()?)?;
    let o = node.outputs[0];
    let b = *bufs.get(&x)?;
    if bufs.contains_key(&o) || !matches!(p.buffers[b].kind, BufKind::Arena { .. }) {
        return None;
    }
    let (xd, xs) = static_ref(g, x).ok()?;
    let (od, os) = static_ref(g, o).ok()?;
    (xd == od && xs.iter().product::<usize>() == os.iter().product::<usize>()).then_some(b)
}

fn const_buffer(p: &mut Program, name: &str, t: &Tensor) -> std::result::Result<BufId, String> {
    let ty = kir_ty(t.dtype()).ok_or_else(|| {
        format!(
            "constant `{name}`: {} is not supported by compiled code yet",
            t.dtype()
        )
    })?;
    let data = crate::ops::lowering::tensor_bytes(t).map_err(|e| e.0)?;
    Ok(p.add_buffer(
        name.to_string(),
        BufKind::Const { data },
        ty,
        t.len() as u64,
    ))
}

fn copy_kernel(name: &str, src: BufId, dst: BufId, len: u64) -> Kernel {
    let mut k = Kernel::new(name);
    let j = k.var(Ty::I64);
    k.body = vec![Stmt::For {
        var: j,
        extent: len,
        body: vec![Stmt::Store {
            buf: dst,
            index: Expr::Var(j),
            value: Expr::load(src, Expr::Var(j)),
        }],
    }];
    k
}

/// Whether `body` stores into `buf` (a GEMM's C included).
pub(super) fn writes(body: &[Stmt], buf: BufId) -> bool {
    body.iter().any(|s| match s {
        Stmt::Store { buf: b, .. } => *b == buf,
        Stmt::For { body, .. } => writes(body, buf),
        Stmt::If { then, els, .. } => writes(then, buf) || writes(els, buf),
        Stmt::While { body, .. } => writes(body, buf),
        Stmt::Set { .. } => false,
        Stmt::Gemm(g) => g.c.buf == buf,
    })
}

#[cfg(test)]
mod tests {
    use super::unit_leaves;
    use crate::kir::build::{add, for_, int, mul, store, v};
    use crate::kir::{Expr, Stmt};

    /// `for a in 0..1 { for i in 0..n { for u in 0..1 { for w in 0..1 { b[i + u + w] =
    /// 1 } } } }`: the two innermost loops of one go (their variable 0), the outer one of
    /// one stays, around the loop of `n`.
    #[test]
    fn innermost_loops_of_one_iteration_inline() {
        let (a, i, u, w) = (0, 1, 2, 3);
        let st = store(7, add(add(v(i), v(u)), v(w)), Expr::Int(1));
        let nest = vec![for_(
            a,
            1,
            vec![for_(i, 240, vec![for_(u, 1, vec![for_(w, 1, vec![st])])])],
        )];
        let out = unit_leaves(&nest);
        let Stmt::For {
            var,
            extent: 1,
            body,
        } = &out[0]
        else {
            panic!("the outer loop of one is kept: {out:?}");
        };
        assert_eq!(*var, a);
        let Stmt::For {
            extent: 240, body, ..
        } = &body[0]
        else {
            panic!("the loop of 240 is kept: {body:?}");
        };
        let want = store(7, add(add(v(i), int(0)), int(0)), Expr::Int(1));
        assert_eq!(body, &vec![want]);
        // A loop of one around a loop of two stays whole.
        let two = vec![for_(
            u,
            1,
            vec![for_(i, 2, vec![store(7, mul(v(i), v(u)), Expr::Int(0))])],
        )];
        assert_eq!(unit_leaves(&two), two);
    }
}
