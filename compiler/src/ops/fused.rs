//! `onnxc.Fused`: a node that stands for a small graph of standard ONNX nodes (its `body`
//! attribute), made by the fusion passes. The body's inputs are the node's inputs, its
//! outputs the node's outputs, so evaluating the node is evaluating the body, and writing
//! standard ONNX is inlining it.
//!
//! Lowering, in order of preference:
//! - an anchor (Conv, Gemm or MatMul as the first body node) followed by a chain of
//!   elementwise steps on its output: the anchor's own lowering with the steps as its
//!   [`Epilogue`] (one kernel);
//! - a body of elementwise ops only: one loop nest over the output that computes the whole
//!   expression per element (one kernel);
//! - otherwise (or when the above are refused): each body node lowered on its own, with
//!   arena buffers for the values inside the body.

pub(crate) use super::elementwise::lower::{scalar_expr_fn, ExprFn};
use super::lowering::{
    broadcast_strides, index, kir_ty, lower_by_index_map, nest, strides, Act, EpStep, Epilogue,
    LowerCtx, TensorRef,
};
use super::{Lowering, OpCtx, Registry};
use crate::ir::{
    broadcast_shapes, Graph, InferInput, Node, Op, OpError, OpResult, Tensor, Value, ValueId,
    ValueType,
};
use crate::kir::{BufKind, Expr, Stmt, Ty};
use crate::{bail, ensure};
use std::collections::HashMap;
use std::sync::Arc;

/// The domain of onnxc's own ops.
pub const DOMAIN: &str = "onnxc";
/// The op type of fused nodes.
pub const FUSED: &str = "Fused";

pub fn register(r: &mut Registry) {
    r.add_builder(DOMAIN, FUSED, |ctx| {
        Ok(Arc::new(Fused {
            body: ctx.attrs.graph("body")?,
        }))
    });
    r.lower_in(DOMAIN, FUSED, Lowering::Custom(lower));
}

#[derive(Debug)]
pub struct Fused {
    body: Arc<Graph>,
}

impl Op for Fused {
    fn eval(&self, inputs: &[Option<&Value>]) -> OpResult<Vec<Value>> {
        eval_body(&self.body, inputs)
    }

    fn subgraphs(&self) -> Vec<&Graph> {
        vec![&self.body]
    }

    /// The body's output types, once the inputs match the body's input types.
    fn infer(&self, inputs: &[Option<InferInput>]) -> OpResult<Option<Vec<ValueType>>> {
        ensure!(
            inputs.len() == self.body.inputs.len(),
            "Fused: {} inputs for a body of {}",
            inputs.len(),
            self.body.inputs.len()
        );
        for (k, (inp, &b)) in inputs.iter().zip(&self.body.inputs).enumerate() {
            let Some(inp) = inp else {
                bail!("Fused: input {k} is missing")
            };
            let bt = &self.body.value(b).ty;
            if inp.ty.static_shape().is_none() {
                return Ok(None);
            }
            ensure!(
                inp.ty == *bt,
                "Fused: input {k} is {} but the body takes {bt}",
                inp.ty
            );
        }
        let tys: Vec<ValueType> = self
            .body
            .outputs
            .iter()
            .map(|&o| self.body.value(o).ty.clone())
            .collect();
        Ok(if tys.iter().all(|t| t.static_shape().is_some()) {
            Some(tys)
        } else {
            None
        })
    }
}

/// Evaluates a body graph of standard nodes on its inputs.
pub fn eval_body(g: &Graph, inputs: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    ensure!(
        inputs.len() == g.inputs.len(),
        "Fused: {} inputs for a body of {}",
        inputs.len(),
        g.inputs.len()
    );
    let mut env: HashMap<ValueId, Value> = HashMap::new();
    for (k, (&v, x)) in g.inputs.iter().zip(inputs).enumerate() {
        let x = x.ok_or_else(|| OpError::new(format!("Fused: input {k} is missing")))?;
        env.insert(v, x.clone());
    }
    for (&id, t) in &g.consts {
        env.insert(id, Value::Tensor(t.clone()));
    }
    let order = g
        .topo_order()
        .map_err(|c| OpError::new(format!("Fused body: cycle through {}", c.join(", "))))?;
    for n in order {
        let node = &g.nodes[n];
        let mut ins = Vec::with_capacity(node.inputs.len());
        for i in &node.inputs {
            match i {
                None => ins.push(None),
                Some(v) => ins.push(Some(env.get(v).ok_or_else(|| {
                    OpError::new(format!("Fused body: `{}` has no value", g.value(*v).name))
                })?)),
            }
        }
        let outs = node
            .op
            .eval(&ins)
            .map_err(|e| OpError::new(format!("in fused {}: {e}", g.node_label(n))))?;
        for (&o, v) in node.outputs.iter().zip(outs) {
            env.insert(o, v);
        }
    }
    g.outputs
        .iter()
        .map(|o| {
            env.get(o).cloned().ok_or_else(|| {
                OpError::new(format!(
                    "Fused body: output `{}` is never computed",
                    g.value(*o).name
                ))
            })
        })
        .collect()
}

/// The scalar expression builder of `node` in a fused elementwise kernel, if it has one
/// there (a Cast only to a type that is its own compute type).
pub(crate) fn scalar_expr_of(node: &Node, tys: &[Option<Ty>]) -> Option<ExprFn> {
    if node.op_type == "Cast" {
        crate::ops::cast::lower::fusible_target(&ctx_of(node))?;
    }
    scalar_expr_fn(&node.op_type, tys)
}

fn ctx_of(node: &Node) -> OpCtx {
    OpCtx {
        op_type: node.op_type.clone(),
        domain: node.domain.clone(),
        attrs: node.attrs.clone(),
        opset: node.opset,
        n_inputs: node.inputs.len(),
        n_outputs: node.outputs.len(),
    }
}

fn static_of(g: &Graph, v: ValueId) -> OpResult<(crate::ir::DType, Vec<usize>)> {
    let ty = &g.value(v).ty;
    match (ty.dtype(), ty.static_shape()) {
        (Some(dt), Some(s)) => Ok((dt, s)),
        _ => bail!(
            "Fused body: `{}` has no static tensor type",
            g.value(v).name
        ),
    }
}

fn lower(lw: &mut LowerCtx) -> OpResult<()> {
    let body = lw.op.attrs.graph("body")?;
    ensure!(
        body.inputs.len() == lw.inputs.len() && body.outputs.len() == lw.outputs.len(),
        "Fused: the body's signature does not match the node"
    );
    let order = body
        .topo_order()
        .map_err(|c| OpError::new(format!("Fused body: cycle through {}", c.join(", "))))?;
    let mut refs: HashMap<ValueId, TensorRef> = HashMap::new();
    for (k, &v) in body.inputs.iter().enumerate() {
        refs.insert(v, lw.input(k)?.clone());
    }
    for (k, &v) in body.outputs.iter().enumerate() {
        ensure!(
            !refs.contains_key(&v),
            "Fused: body output {k} is a body input"
        );
        refs.insert(v, lw.outputs[k].clone());
    }
    let mut consts: Vec<(&ValueId, &Tensor)> = body.consts.iter().collect();
    consts.sort_by_key(|(id, _)| **id);
    for (&id, t) in consts {
        let buf = lw.constant(&body.value(id).name, t)?;
        refs.insert(
            id,
            TensorRef {
                buf,
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
                value: Some(t.clone()),
            },
        );
    }
    let before = lw.program.kernels.len();
    if let Some(pool) = trailing_max_pool(&body, &order) {
        // Conv -> steps -> MaxPool(2x2, stride 2): the pool in the anchor's kernel where
        // its lowering can, else the anchor with its steps, then the pool on its own.
        let chain = &order[..order.len() - 1];
        let mid = body.nodes[pool].inputs[0].expect("a pool reads its input");
        if let Some(ep) = anchor_epilogue(lw, &body, chain, &refs, mid)? {
            let out = lw.outputs[0].clone();
            match lower_anchor(lw, &body, chain[0], &refs, ep.clone(), out, true) {
                Ok(true) => return Ok(()),
                Ok(false) | Err(_) => lw.program.kernels.truncate(before),
            }
            let t = arena_value(lw, &body, mid)?;
            refs.insert(mid, t.clone());
            match lower_anchor(lw, &body, chain[0], &refs, ep, t, false) {
                Ok(true) => return lower_nodes(lw, &body, &[pool], &mut refs),
                Ok(false) | Err(_) => lw.program.kernels.truncate(before),
            }
            refs.remove(&mid);
        }
    }
    let end = body.outputs[0];
    if let Some(ep) = anchor_epilogue(lw, &body, &order, &refs, end)? {
        let out = lw.outputs[0].clone();
        match lower_anchor(lw, &body, order[0], &refs, ep, out, false) {
            Ok(true) => return Ok(()),
            Ok(false) | Err(_) => lw.program.kernels.truncate(before),
        }
    }
    match lower_elementwise(lw, &body, &order, &refs) {
        Ok(true) => return Ok(()),
        Ok(false) | Err(_) => lw.program.kernels.truncate(before),
    }
    lower_nodes(lw, &body, &order, &mut refs)
}

/// The constant value of a body value, when it has one.
fn const_of(refs: &HashMap<ValueId, TensorRef>, v: Option<ValueId>) -> Option<&Tensor> {
    refs.get(&v?)?.value.as_ref()
}

fn scalar_f64(t: &Tensor) -> Option<f64> {
    let v = t.to_f64_vec()?;
    (v.len() == 1).then(|| v[0])
}

/// The last node of a body of the fusion pass's pooled form, Conv -> steps -> MaxPool
/// (see `passes::fuse_epilogue`): a MaxPool that reads one value and writes the body's
/// one output. None for other bodies.
fn trailing_max_pool(body: &Graph, order: &[crate::ir::NodeId]) -> Option<crate::ir::NodeId> {
    let (&last, rest) = order.split_last()?;
    let node = &body.nodes[last];
    let first = &body.nodes[*rest.first()?];
    (node.domain.is_empty()
        && node.op_type == "MaxPool"
        && first.domain.is_empty()
        && first.op_type == "Conv"
        && matches!(node.inputs[..], [Some(_)])
        && node.outputs[..] == body.outputs[..])
        .then_some(last)
}

/// An arena buffer for body value `v`.
fn arena_value(lw: &mut LowerCtx, body: &Graph, v: ValueId) -> OpResult<TensorRef> {
    let (dt, shape) = static_of(body, v)?;
    let ty =
        kir_ty(dt).ok_or_else(|| OpError::unsupported(format!("{dt} values in compiled code")))?;
    let buf = lw.program.add_buffer(
        format!("{}/{}", lw.name, body.value(v).name),
        BufKind::Arena { offset: 0 },
        ty,
        shape.iter().product::<usize>() as u64,
    );
    Ok(TensorRef {
        buf,
        dtype: dt,
        shape,
        value: None,
    })
}

/// The epilogue of an anchor chain: the first node of `order` is a Conv, Gemm or MatMul
/// and every other node is one step applied to the previous node's output, the last
/// writing `end` (the body's output, or the pooled form's pool input, where the chain may
/// be the anchor alone). None when the nodes do not have that form.
fn anchor_epilogue(
    lw: &mut LowerCtx,
    body: &Graph,
    order: &[crate::ir::NodeId],
    refs: &HashMap<ValueId, TensorRef>,
    end: ValueId,
) -> OpResult<Option<Epilogue>> {
    let Some(&first) = order.first() else {
        return Ok(None);
    };
    let anchor = &body.nodes[first];
    let pooled = end != body.outputs[0];
    if !anchor.domain.is_empty()
        || !matches!(anchor.op_type.as_str(), "Conv" | "Gemm" | "MatMul")
        || (order.len() < 2 && !pooled)
        || body.outputs.len() != 1
        || anchor.outputs.len() != 1
    {
        return Ok(None);
    }
    let mut cur = anchor.outputs[0];
    let (dt, out_shape) = static_of(body, cur)?;
    if !matches!(
        dt,
        crate::ir::DType::F32 | crate::ir::DType::F64 | crate::ir::DType::F16
    ) {
        return Ok(None);
    }
    let mut steps = Vec::new();
    let mut skip = false;
    for (j, &n) in order.iter().enumerate().skip(1) {
        if std::mem::take(&mut skip) {
            continue;
        }
        let node = &body.nodes[n];
        // SiLU as two nodes: Sigmoid(cur), then Mul(cur, that) (either order).
        if node.domain.is_empty() && node.op_type == "Sigmoid" && node.inputs[..] == [Some(cur)] {
            if let Some(&m) = order.get(j + 1) {
                let mn = &body.nodes[m];
                let s = node.outputs[0];
                if mn.domain.is_empty()
                    && mn.op_type == "Mul"
                    && (mn.inputs[..] == [Some(cur), Some(s)]
                        || mn.inputs[..] == [Some(s), Some(cur)])
                    && mn.outputs.len() == 1
                {
                    steps.push(EpStep::Act(Act::Silu));
                    cur = mn.outputs[0];
                    skip = true;
                    continue;
                }
            }
        }
        if !node.domain.is_empty() || node.outputs.len() != 1 {
            return Ok(None);
        }
        let pos: Vec<usize> = (0..node.inputs.len())
            .filter(|&i| node.inputs[i] == Some(cur))
            .collect();
        let (odt, oshape) = static_of(body, node.outputs[0])?;
        if odt != dt || oshape != out_shape {
            return Ok(None);
        }
        let attrs = &node.attrs;
        let f = |name: &str, d: f32| -> OpResult<f64> { Ok(attrs.float(name, d)? as f64) };
        let other = |i: usize| -> Option<TensorRef> {
            let t = refs.get(&node.inputs.get(i).copied().flatten()?)?;
            (t.dtype == dt
                && broadcast_shapes(&t.shape, &out_shape).as_deref() == Some(&out_shape[..]))
            .then(|| t.clone())
        };
        let step = match (node.op_type.as_str(), pos.as_slice()) {
            ("Add", [p]) => match other(1 - p) {
                Some(t) => EpStep::Add(t),
                None => return Ok(None),
            },
            ("Mul", [p]) => match other(1 - p) {
                Some(t) => EpStep::Mul(t),
                None => return Ok(None),
            },
            ("Div", [0]) => {
                // x / c for a constant c: x * (1 / c).
                let Some(c) = const_of(refs, node.inputs[1]) else {
                    return Ok(None);
                };
                let Some(t) = other(1) else { return Ok(None) };
                let Some(inv) = c
                    .to_f64()
                    .map(|a| Tensor::from_f64(dt, a.mapv(|x| 1.0 / x), false))
                else {
                    return Ok(None);
                };
                let buf = lw.constant("reciprocal", &inv)?;
                EpStep::Mul(TensorRef {
                    buf,
                    value: Some(inv),
                    ..t
                })
            }
            ("Relu", [0]) => EpStep::Act(Act::Relu),
            ("Sigmoid", [0]) => EpStep::Act(Act::Sigmoid),
            ("Tanh", [0]) => EpStep::Act(Act::Tanh),
            ("HardSwish", [0]) => EpStep::Act(Act::HardSwish),
            ("HardSigmoid", [0]) => {
                EpStep::Act(Act::HardSigmoid(f("alpha", 0.2)?, f("beta", 0.5)?))
            }
            ("LeakyRelu", [0]) => EpStep::Act(Act::LeakyRelu(f("alpha", 0.01)?)),
            ("Swish", [0]) if f("alpha", 1.0)? == 1.0 => EpStep::Act(Act::Silu),
            ("Gelu", [0]) => match attrs.string("approximate", "none".into())?.as_str() {
                "tanh" => EpStep::Act(Act::GeluTanh),
                _ => EpStep::Act(Act::GeluErf),
            },
            ("Clip", [0]) => {
                let (mut lo, mut hi) = (f64::NEG_INFINITY, f64::INFINITY);
                if node.opset < 11 {
                    lo = f("min", f32::MIN)?;
                    hi = f("max", f32::MAX)?;
                } else {
                    for (i, slot) in [(1, &mut lo), (2, &mut hi)] {
                        if let Some(Some(v)) = node.inputs.get(i) {
                            match const_of(refs, Some(*v)).and_then(scalar_f64) {
                                Some(x) => *slot = x,
                                None => return Ok(None),
                            }
                        }
                    }
                }
                EpStep::Act(Act::Clip(lo, hi))
            }
            _ => return Ok(None),
        };
        steps.push(step);
        cur = node.outputs[0];
    }
    if cur != end {
        return Ok(None);
    }
    Ok(Some(Epilogue { steps }))
}

/// Lowers the anchor with the epilogue into `out`, pooled by a 2x2 MaxPool where `pool`
/// ([`LowerCtx::max_pool_2x2`]). Ok(false) when its lowering did not take the epilogue
/// (a lowering that applies it takes it out of [`LowerCtx::epilogue`]) or the pool.
fn lower_anchor(
    lw: &mut LowerCtx,
    body: &Graph,
    anchor: crate::ir::NodeId,
    refs: &HashMap<ValueId, TensorRef>,
    ep: Epilogue,
    out: TensorRef,
    pool: bool,
) -> OpResult<bool> {
    let node = &body.nodes[anchor];
    let Some(Lowering::Custom(f)) = Registry::standard().lowering(&node.domain, &node.op_type)
    else {
        return Ok(false);
    };
    let ctx = ctx_of(node);
    let inputs = node
        .inputs
        .iter()
        .map(|i| i.and_then(|v| refs.get(&v).cloned()))
        .collect();
    let mut sub = LowerCtx {
        op: &ctx,
        node_op: node.op.as_ref(),
        name: lw.name.clone(),
        inputs,
        outputs: vec![out],
        program: &mut *lw.program,
        epilogue: Some(ep),
        max_pool_2x2: pool,
        narrow_loops: lw.narrow_loops,
    };
    f(&mut sub)?;
    Ok(sub.epilogue.is_none() && !sub.max_pool_2x2)
}

/// One loop nest for a body of elementwise ops whose outputs all have one shape.
/// Ok(false) when the body is not of that form.
fn lower_elementwise(
    lw: &mut LowerCtx,
    body: &Graph,
    order: &[crate::ir::NodeId],
    refs: &HashMap<ValueId, TensorRef>,
) -> OpResult<bool> {
    let out_shape = lw.outputs[0].shape.clone();
    if lw.outputs.iter().any(|o| o.shape != out_shape) {
        return Ok(false);
    }
    let mut fns = Vec::new();
    for &n in order {
        let node = &body.nodes[n];
        if !node.domain.is_empty() || node.outputs.len() != 1 {
            return Ok(false);
        }
        let mut tys = Vec::new();
        for i in &node.inputs {
            tys.push(match i {
                None => None,
                Some(v) => {
                    let (dt, s) = static_of(body, *v)?;
                    if broadcast_shapes(&s, &out_shape).as_deref() != Some(&out_shape[..]) {
                        return Ok(false);
                    }
                    match kir_ty(dt) {
                        Some(t) => Some(t.compute()),
                        None => return Ok(false),
                    }
                }
            });
        }
        let (odt, os) = static_of(body, node.outputs[0])?;
        if kir_ty(odt).is_none()
            || broadcast_shapes(&os, &out_shape).as_deref() != Some(&out_shape[..])
        {
            return Ok(false);
        }
        let Some(f) = scalar_expr_of(node, &tys) else {
            return Ok(false);
        };
        fns.push((n, f, tys));
    }
    let mut k = lw.kernel("");
    let mut err: Option<OpError> = None;
    let outs: Vec<TensorRef> = lw.outputs.clone();
    let kbody = nest(&mut k, &out_shape, |k, vars| {
        let mut stmts = Vec::new();
        let mut val: HashMap<ValueId, Expr> = HashMap::new();
        let load = |k: &mut crate::kir::Kernel,
                    stmts: &mut Vec<Stmt>,
                    val: &mut HashMap<ValueId, Expr>,
                    v: ValueId|
         -> Option<Expr> {
            if let Some(e) = val.get(&v) {
                return Some(e.clone());
            }
            let t = refs.get(&v)?;
            let var = k.var(t.ty().compute());
            stmts.push(Stmt::Set {
                var,
                value: Expr::load(t.buf, index(vars, &broadcast_strides(&t.shape, &out_shape))),
            });
            val.insert(v, Expr::Var(var));
            Some(Expr::Var(var))
        };
        for (n, f, tys) in &fns {
            let node = &body.nodes[*n];
            let mut args = Vec::new();
            for v in node.inputs.iter().flatten() {
                // Body inputs and constants are loaded; values of earlier nodes are in
                // variables already.
                match load(k, &mut stmts, &mut val, *v) {
                    Some(e) => args.push(e),
                    None => {
                        err = Some(OpError::new("Fused: a body value has no buffer"));
                        return Vec::new();
                    }
                }
            }
            let e = match f(&ctx_of(node), tys, &args) {
                Ok(e) => e,
                Err(e) => {
                    err = Some(e);
                    return Vec::new();
                }
            };
            let o = node.outputs[0];
            let Some(ty) = body.value(o).ty.dtype().and_then(kir_ty) else {
                err = Some(OpError::new("Fused: output type"));
                return Vec::new();
            };
            let var = k.var(ty.compute());
            stmts.push(Stmt::Set { var, value: e });
            val.insert(o, Expr::Var(var));
        }
        for (i, &o) in body.outputs.iter().enumerate() {
            let Some(e) = val.get(&o) else {
                err = Some(OpError::new("Fused: an output is not computed"));
                return Vec::new();
            };
            stmts.push(Stmt::Store {
                buf: outs[i].buf,
                index: index(vars, &strides(&out_shape)),
                value: e.clone(),
            });
        }
        inline_last_set(&mut stmts);
        stmts
    });
    if let Some(e) = err {
        return Err(e);
    }
    k.body = kbody;
    lw.push(k);
    Ok(true)
}

/// `set v = e; store buf[i] = v` as `store buf[i] = e` when the store is the body's only
/// one and nothing else reads `v`: the vector loops take a store of `u8(x)` (a fused
/// QuantizeLinear or Cast to bytes), not of a variable holding it, which left such
/// loops scalar.
fn inline_last_set(stmts: &mut Vec<Stmt>) {
    let stores = stmts
        .iter()
        .filter(|s| matches!(s, Stmt::Store { .. }))
        .count();
    let n = stmts.len();
    if stores != 1 || n < 2 {
        return;
    }
    let (
        Stmt::Set { var, value },
        Stmt::Store {
            index,
            value: Expr::Var(sv),
            ..
        },
    ) = (&stmts[n - 2], &stmts[n - 1])
    else {
        return;
    };
    let (var, e) = (*var, value.clone());
    if *sv != var
        || index.reads(var)
        || stmts[..n - 2].iter().any(|s| match s {
            Stmt::Set { value, .. } => value.reads(var),
            _ => true,
        })
    {
        return;
    }
    if let Stmt::Store { value, .. } = &mut stmts[n - 1] {
        *value = e;
    }
    stmts.remove(n - 2);
}

/// Lowers each body node on its own; values inside the body get arena buffers.
fn lower_nodes(
    lw: &mut LowerCtx,
    body: &Graph,
    order: &[crate::ir::NodeId],
    refs: &mut HashMap<ValueId, TensorRef>,
) -> OpResult<()> {
    let reg = Registry::standard();
    for (j, &n) in order.iter().enumerate() {
        let node = &body.nodes[n];
        let Some(lowering) = reg.lowering(&node.domain, &node.op_type) else {
            return Err(OpError::unsupported(format!(
                "no compiled implementation of {} (in a fused node)",
                node.op_type
            )));
        };
        let mut outputs = Vec::new();
        for &o in &node.outputs {
            if let Some(t) = refs.get(&o) {
                outputs.push(t.clone());
                continue;
            }
            let t = arena_value(lw, body, o)?;
            refs.insert(o, t.clone());
            outputs.push(t);
        }
        let inputs = node
            .inputs
            .iter()
            .map(|i| i.and_then(|v| refs.get(&v).cloned()))
            .collect();
        let ctx = ctx_of(node);
        let mut sub = LowerCtx {
            op: &ctx,
            node_op: node.op.as_ref(),
            name: format!("{}/{j}", lw.name),
            inputs,
            outputs,
            program: &mut *lw.program,
            epilogue: None,
            max_pool_2x2: false,
            narrow_loops: lw.narrow_loops,
        };
        match lowering {
            Lowering::Custom(f) => f(&mut sub)?,
            Lowering::Movement(data) => {
                let op = node.op.clone();
                let fill = sub
                    .outputs
                    .first()
                    .map(|o| super::lowering::lit(0.0, o.ty()));
                lower_by_index_map(&mut sub, &|ins| op.eval(ins), data, &[], fill)?
            }
        }
    }
    Ok(())
}

/// Replaces `group` (nodes of `g`, each reading only values computed before it or inside
/// the group) by one `onnxc.Fused` node whose body holds them. The body's inputs are the
/// values the group reads from outside, its outputs the values of the group that are
/// read outside it or are graph outputs. The fused node takes the place (and index) of
/// the group's first node, so the schedule keeps its order.
pub fn fuse_nodes(g: &mut Graph, group: &[crate::ir::NodeId], name: &str) -> OpResult<()> {
    use crate::ir::{Attr, Attrs, Source};
    ensure!(!group.is_empty(), "fuse_nodes: empty group");
    let in_group = |n: crate::ir::NodeId| group.contains(&n);
    let mut body = Graph::new(name);
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    let mut ext_inputs: Vec<ValueId> = Vec::new();
    let produced: Vec<ValueId> = group
        .iter()
        .flat_map(|&n| g.nodes[n].outputs.clone())
        .collect();
    for &n in group {
        for v in g.nodes[n]
            .inputs
            .iter()
            .flatten()
            .chain(&g.nodes[n].implicit)
        {
            if !produced.contains(v) && !map.contains_key(v) {
                let info = g.value(*v);
                let b = body.add_input(info.name.clone(), info.ty.clone());
                map.insert(*v, b);
                ext_inputs.push(*v);
            }
        }
    }
    for &v in &produced {
        let info = g.value(v);
        let b = body.add_value(info.name.clone(), info.ty.clone(), Source::Undefined);
        map.insert(v, b);
    }
    let mut outputs: Vec<ValueId> = Vec::new();
    for &v in &produced {
        let used_outside = g.outputs.contains(&v)
            || g.nodes.node_indices().any(|m| {
                !in_group(m)
                    && (g.nodes[m].inputs.contains(&Some(v)) || g.nodes[m].implicit.contains(&v))
            });
        if used_outside {
            outputs.push(v);
        }
    }
    ensure!(
        !outputs.is_empty(),
        "fuse_nodes: the group computes nothing used"
    );
    for &n in group {
        let mut node = g.nodes[n].clone();
        node.inputs = node.inputs.iter().map(|i| i.map(|v| map[&v])).collect();
        node.outputs = node.outputs.iter().map(|v| map[v]).collect();
        node.implicit = node.implicit.iter().map(|v| map[v]).collect();
        body.add_node(node);
    }
    body.outputs = outputs.iter().map(|v| map[v]).collect();
    body.rewire();
    let body = Arc::new(body);
    let mut attrs = Attrs::default();
    attrs.0.insert("body".into(), Attr::Graph(body.clone()));
    let ctx = OpCtx {
        op_type: FUSED.into(),
        domain: DOMAIN.into(),
        attrs: attrs.clone(),
        opset: 1,
        n_inputs: ext_inputs.len(),
        n_outputs: outputs.len(),
    };
    let op: Arc<dyn Op> = Arc::new(Fused { body });
    let node = Node {
        name: name.to_string(),
        op_type: ctx.op_type,
        domain: ctx.domain,
        opset: 1,
        attrs,
        op,
        inputs: ext_inputs.into_iter().map(Some).collect(),
        outputs: outputs.clone(),
        implicit: Vec::new(),
    };
    let first = group[0];
    for &n in &group[1..] {
        g.nodes.remove_node(n);
    }
    for &v in &produced {
        g.value_mut(v).source = Source::Undefined;
    }
    g.nodes[first] = node;
    for &v in &outputs {
        g.value_mut(v).source = Source::Node(first);
    }
    g.rewire();
    Ok(())
}
