//! Pattern fusion: subgraphs that exporters write out op by op become the one standard op
//! they compute, which has a single kernel (or joins an epilogue):
//! - GELU as `Div(x, sqrt 2) | Mul(x, 1/sqrt 2) -> Erf -> Add 1 -> Mul x -> Mul 0.5` (in
//!   either association, as PyTorch exports it) -> `Gelu` (opset 20), and its tanh form
//!   `Pow(x, 3) -> Mul 0.044715 -> Add x -> Mul sqrt(2/pi) -> Tanh -> Add 1 -> ...` ->
//!   `Gelu(approximate = "tanh")`;
//! - SiLU `Mul(x, Sigmoid(x))` -> `Swish` (alpha 1);
//! - softmax `Exp -> ReduceSum(last axis, keepdims) -> Div`, optionally after
//!   `Sub(x, ReduceMax(x))` -> `Softmax(axis = -1)`;
//! - layer norm `ReduceMean -> Sub -> Pow 2 -> ReduceMean -> Add eps -> Sqrt -> Div`, with
//!   an optional `Mul(gamma)` and `Add(beta)` -> `LayerNormalization(axis = -1)`;
//! - scaled dot-product attention on 4-D heads `MatMul(Q, K^T) -> Div | Mul (scale) ->
//!   Add mask (optional) -> Softmax(last axis) -> MatMul V` -> `Attention` (opset 23, one
//!   kernel); a `Transpose` that makes `K^T` gets its last two axes swapped back (or
//!   disappears when that makes it the identity).
//!
//! Every value inside a matched pattern must be read only inside it (the input `x` may
//! have other readers) and must not be a graph output.

use super::fuse_util::{const_scalar, fusible_output, known_values, users};
use crate::error::{Error, Result};
use crate::ir::{Attr, Attrs, Graph, Node, NodeId, Source, Tensor, Value, ValueId};
use crate::ops::{OpCtx, Registry};
use std::collections::{HashMap, HashSet};

type Known = HashMap<ValueId, Value>;

pub fn run(g: &mut Graph) -> Result<()> {
    // Sweeps of non-overlapping matches until one finds none.
    loop {
        let known = known_values(g)?;
        let order = g
            .topo_order()
            .map_err(|c| Error::model(format!("cycle through {}", c.join(", "))))?;
        let mut taken: HashSet<NodeId> = HashSet::new();
        let mut found = Vec::new();
        for &n in &order {
            if taken.contains(&n) {
                continue;
            }
            // A pattern only makes an op that the model's opset has, so the optimized
            // graph stays a valid model of the same opset (`--emit onnx`).
            let fits = |m: Option<Match>| {
                m.filter(|m| m.nodes.iter().all(|&x| g.nodes[x].opset >= m.opset))
            };
            let m = fits(gelu(g, &known, n))
                .or_else(|| fits(silu(g, n)))
                .or_else(|| fits(softmax(g, &known, n)))
                .or_else(|| fits(layer_norm(g, &known, n)))
                .or_else(|| fits(attention(g, &known, n)));
            if let Some(m) = m {
                if m.nodes.iter().all(|x| !taken.contains(x)) {
                    taken.extend(m.nodes.iter().copied());
                    found.push(m);
                }
            }
        }
        if found.is_empty() {
            return Ok(());
        }
        for m in found {
            replace(g, &order, m)?;
        }
    }
}

/// A match: the nodes to remove, and the node that replaces them.
struct Match {
    nodes: Vec<NodeId>,
    op_type: &'static str,
    opset: i64,
    inputs: Vec<Option<ValueId>>,
    output: ValueId,
    attrs: Attrs,
    /// A constant to add first (LayerNormalization's scale of ones), as input 1.
    ones: Option<Tensor>,
    /// A Transpose (outside the match) to give a new perm: its output changes shape.
    retranspose: Option<(NodeId, Vec<i64>)>,
}

fn is(g: &Graph, n: NodeId, op: &str) -> bool {
    let node = &g.nodes[n];
    node.domain.is_empty() && node.op_type == op
}

fn producer(g: &Graph, v: ValueId) -> Option<NodeId> {
    match g.value(v).source {
        Source::Node(n) => Some(n),
        _ => None,
    }
}

fn out(g: &Graph, n: NodeId) -> ValueId {
    g.nodes[n].outputs[0]
}

/// The only reader of node `n`'s (single) output, when it is an `op`.
fn next(g: &Graph, n: NodeId, op: &str) -> Option<NodeId> {
    if g.nodes[n].outputs.len() != 1 {
        return None;
    }
    let c = fusible_output(g, out(g, n))?;
    is(g, c, op).then_some(c)
}

/// For a binary node, the input other than `v` (`v` read once).
fn other(g: &Graph, n: NodeId, v: ValueId) -> Option<ValueId> {
    match g.nodes[n].inputs.as_slice() {
        [Some(a), Some(b)] if *a == v && *b != v => Some(*b),
        [Some(a), Some(b)] if *b == v && *a != v => Some(*a),
        _ => None,
    }
}

fn near(x: Option<f64>, want: f64) -> bool {
    x.is_some_and(|x| (x - want).abs() <= 1e-5 * want.abs().max(1.0))
}

fn is_float(g: &Graph, v: ValueId) -> bool {
    g.value(v).ty.dtype().is_some_and(|d| d.is_float())
}

fn gelu(g: &Graph, known: &Known, e: NodeId) -> Option<Match> {
    use std::f64::consts::{FRAC_1_SQRT_2, SQRT_2};
    let tanh = is(g, e, "Tanh");
    if !is(g, e, "Erf") && !tanh {
        return None;
    }
    let u = g.nodes[e].inputs.first().copied().flatten()?;
    let pu = producer(g, u)?;
    if fusible_output(g, u) != Some(e) {
        return None;
    }
    // The operand of a binary node other than a constant near `c`.
    let scaled = |n: NodeId, c: f64| -> Option<ValueId> {
        let [Some(a), Some(b)] = g.nodes[n].inputs[..] else {
            return None;
        };
        if near(const_scalar(known, b), c) {
            Some(a)
        } else if near(const_scalar(known, a), c) {
            Some(b)
        } else {
            None
        }
    };
    let mut nodes = vec![pu];
    let x = if tanh {
        // tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))
        if !is(g, pu, "Mul") {
            return None;
        }
        let w = scaled(pu, (2.0 / std::f64::consts::PI).sqrt())?;
        let aw = producer(g, w).filter(|&n| is(g, n, "Add"))?;
        if fusible_output(g, w) != Some(pu) {
            return None;
        }
        let [Some(a), Some(b)] = g.nodes[aw].inputs[..] else {
            return None;
        };
        let mut found = None;
        for (x, c3) in [(a, b), (b, a)] {
            let Some(mc) = producer(g, c3).filter(|&n| is(g, n, "Mul")) else {
                continue;
            };
            let Some(p3) = scaled(mc, 0.044715) else {
                continue;
            };
            let Some(pw) = producer(g, p3).filter(|&n| is(g, n, "Pow")) else {
                continue;
            };
            if g.nodes[pw].inputs.first() == Some(&Some(x))
                && near(
                    const_scalar(known, g.nodes[pw].inputs.get(1).copied().flatten()?),
                    3.0,
                )
                && fusible_output(g, c3) == Some(aw)
                && fusible_output(g, p3) == Some(mc)
            {
                found = Some((x, [aw, mc, pw]));
                break;
            }
        }
        let (x, more) = found?;
        nodes.extend(more);
        x
    } else if is(g, pu, "Div") {
        let [Some(x), Some(c)] = g.nodes[pu].inputs[..] else {
            return None;
        };
        near(const_scalar(known, c), SQRT_2).then_some(x)?
    } else if is(g, pu, "Mul") {
        scaled(pu, FRAC_1_SQRT_2)?
    } else {
        return None;
    };
    if !is_float(g, x) {
        return None;
    }
    let a = next(g, e, "Add")?;
    if !near(const_scalar(known, other(g, a, out(g, e))?), 1.0) {
        return None;
    }
    let m1 = next(g, a, "Mul")?;
    let o = other(g, m1, out(g, a))?;
    nodes.extend([e, a, m1]);
    let output = if o == x {
        // (x * (1 + erf)) * 0.5
        let m2 = next(g, m1, "Mul")?;
        if !near(const_scalar(known, other(g, m2, out(g, m1))?), 0.5) {
            return None;
        }
        nodes.push(m2);
        out(g, m2)
    } else {
        // (x * 0.5) * (1 + erf)
        let h = producer(g, o)?;
        if !is(g, h, "Mul") || fusible_output(g, o) != Some(m1) {
            return None;
        }
        if other(g, h, x).is_none_or(|c| !near(const_scalar(known, c), 0.5)) {
            return None;
        }
        nodes.push(h);
        out(g, m1)
    };
    if g.outputs.contains(&u) {
        return None;
    }
    let mut attrs = Attrs::default();
    if tanh {
        attrs
            .0
            .insert("approximate".into(), Attr::String("tanh".into()));
    }
    Some(Match {
        nodes,
        op_type: "Gelu",
        opset: 20,
        inputs: vec![Some(x)],
        output,
        attrs,
        ones: None,
        retranspose: None,
    })
}

fn silu(g: &Graph, m: NodeId) -> Option<Match> {
    if !is(g, m, "Mul") {
        return None;
    }
    let [Some(a), Some(b)] = g.nodes[m].inputs[..] else {
        return None;
    };
    for (x, s) in [(a, b), (b, a)] {
        let Some(p) = producer(g, s) else { continue };
        if is(g, p, "Sigmoid")
            && g.nodes[p].inputs.first() == Some(&Some(x))
            && fusible_output(g, s) == Some(m)
            && is_float(g, x)
        {
            return Some(Match {
                nodes: vec![p, m],
                op_type: "Swish",
                opset: 24,
                inputs: vec![Some(x)],
                output: out(g, m),
                attrs: Attrs::default(),
                ones: None,
                retranspose: None,
            });
        }
    }
    None
}

/// True when reduction node `r` reduces only the last axis of its input and keeps dims.
fn last_axis_keepdims(g: &Graph, known: &Known, r: NodeId) -> bool {
    let node = &g.nodes[r];
    let Some(Some(x)) = node.inputs.first() else {
        return false;
    };
    let Some(rank) = g.value(*x).ty.static_shape().map(|s| s.len() as i64) else {
        return false;
    };
    if node.attrs.int("keepdims", 1).unwrap_or(0) != 1 {
        return false;
    }
    let axes: Option<Vec<i64>> = match node.inputs.get(1).copied().flatten() {
        Some(a) => known
            .get(&a)
            .and_then(|v| v.as_tensor())
            .and_then(|t| t.to_i64_vec()),
        None => node.attrs.get_ints("axes").ok().flatten(),
    };
    matches!(axes.as_deref(), Some([a]) if *a == -1 || *a == rank - 1)
}

fn softmax(g: &Graph, known: &Known, d: NodeId) -> Option<Match> {
    if !is(g, d, "Div") {
        return None;
    }
    let [Some(ev), Some(sv)] = g.nodes[d].inputs[..] else {
        return None;
    };
    let (e, s) = (producer(g, ev)?, producer(g, sv)?);
    if !is(g, e, "Exp")
        || !is(g, s, "ReduceSum")
        || g.nodes[s].inputs.first() != Some(&Some(ev))
        || !last_axis_keepdims(g, known, s)
        || fusible_output(g, sv) != Some(d)
        || g.outputs.contains(&ev)
    {
        return None;
    }
    let mut eu = users(g, ev);
    eu.sort();
    let mut want = vec![s, d];
    want.sort();
    if eu != want {
        return None;
    }
    let mut x = g.nodes[e].inputs.first().copied().flatten()?;
    let mut nodes = vec![e, s, d];
    // x - max(x): Softmax subtracts the max itself.
    if let Some(sub) = producer(g, x).filter(|&p| is(g, p, "Sub")) {
        if let [Some(a), Some(mv)] = g.nodes[sub].inputs[..] {
            if let Some(mx) = producer(g, mv).filter(|&p| is(g, p, "ReduceMax")) {
                if g.nodes[mx].inputs.first() == Some(&Some(a))
                    && last_axis_keepdims(g, known, mx)
                    && fusible_output(g, mv) == Some(sub)
                    && fusible_output(g, x) == Some(e)
                {
                    nodes.insert(0, sub);
                    nodes.insert(0, mx);
                    x = a;
                }
            }
        }
    }
    if !is_float(g, x) {
        return None;
    }
    let mut attrs = Attrs::default();
    attrs.0.insert("axis".into(), Attr::Int(-1));
    Some(Match {
        nodes,
        op_type: "Softmax",
        opset: 13,
        inputs: vec![Some(x)],
        output: out(g, d),
        attrs,
        ones: None,
        retranspose: None,
    })
}

fn layer_norm(g: &Graph, known: &Known, m1: NodeId) -> Option<Match> {
    if !is(g, m1, "ReduceMean") || !last_axis_keepdims(g, known, m1) {
        return None;
    }
    let x = g.nodes[m1].inputs.first().copied().flatten()?;
    let shape = g.value(x).ty.static_shape()?;
    let c = *shape.last()?;
    if !is_float(g, x) {
        return None;
    }
    let sub = next(g, m1, "Sub")?;
    if g.nodes[sub].inputs[..] != [Some(x), Some(out(g, m1))] {
        return None;
    }
    let dv = out(g, sub);
    let du = users(g, dv);
    if du.len() != 2 || g.outputs.contains(&dv) {
        return None;
    }
    let pow = *du.iter().find(|&&n| is(g, n, "Pow"))?;
    let div = *du.iter().find(|&&n| is(g, n, "Div"))?;
    if g.nodes[pow].inputs.first() != Some(&Some(dv))
        || !near(
            const_scalar(known, g.nodes[pow].inputs.get(1).copied().flatten()?),
            2.0,
        )
    {
        return None;
    }
    let m2 = next(g, pow, "ReduceMean")?;
    if !last_axis_keepdims(g, known, m2) {
        return None;
    }
    let add = next(g, m2, "Add")?;
    let eps = const_scalar(known, other(g, add, out(g, m2))?)?;
    let sqrt = next(g, add, "Sqrt")?;
    if next(g, sqrt, "Div") != Some(div)
        || g.nodes[div].inputs[..] != [Some(dv), Some(out(g, sqrt))]
    {
        return None;
    }
    let mut nodes = vec![m1, sub, pow, m2, add, sqrt, div];
    let mut output = out(g, div);
    // A per-channel parameter: a constant of shape [C] (or broadcast-equivalent).
    let param = |v: ValueId| {
        known.contains_key(&v)
            && g.value(v)
                .ty
                .static_shape()
                .is_some_and(|s| s.iter().product::<usize>() == c && s.last() == Some(&c))
    };
    let mut scale = None;
    let mut bias = None;
    if let Some(mul) = next(g, div, "Mul") {
        if let Some(gm) = other(g, mul, output).filter(|&v| param(v)) {
            scale = Some(gm);
            nodes.push(mul);
            output = out(g, mul);
            if let Some(ad) = next(g, mul, "Add") {
                if let Some(b) = other(g, ad, output).filter(|&v| param(v)) {
                    bias = Some(b);
                    nodes.push(ad);
                    output = out(g, ad);
                }
            }
        }
    }
    let dt = g.value(x).ty.dtype()?;
    let ones = match scale {
        Some(_) => None,
        None => Some(Tensor::from_f64(
            dt,
            ndarray::ArrayD::ones(ndarray::IxDyn(&[c])),
            false,
        )),
    };
    let mut attrs = Attrs::default();
    attrs.0.insert("axis".into(), Attr::Int(-1));
    attrs.0.insert("epsilon".into(), Attr::Float(eps as f32));
    Some(Match {
        nodes,
        op_type: "LayerNormalization",
        opset: 17,
        inputs: vec![Some(x), scale, bias],
        output,
        attrs,
        ones,
        retranspose: None,
    })
}

fn attention(g: &Graph, known: &Known, mm2: NodeId) -> Option<Match> {
    if !is(g, mm2, "MatMul") {
        return None;
    }
    let [Some(pv), Some(v)] = g.nodes[mm2].inputs[..] else {
        return None;
    };
    let sm = producer(g, pv)?;
    if !is(g, sm, "Softmax") || fusible_output(g, pv) != Some(mm2) {
        return None;
    }
    let rank = |x: ValueId| g.value(x).ty.static_shape().map(|s| s.len());
    let axis = g.nodes[sm].attrs.int("axis", -1).ok()?;
    if rank(pv)? != 4 || !(axis == -1 || axis == 3) || (g.nodes[sm].opset < 13 && axis != 3) {
        return None;
    }
    let mut nodes = vec![sm, mm2];
    let mut cur = g.nodes[sm].inputs.first().copied().flatten()?;
    // The node reading `cur`.
    let mut reader = sm;
    let mut mask = None;
    let mut scale = 1.0f64;
    let mut p = producer(g, cur)?;
    if is(g, p, "Add") && fusible_output(g, cur) == Some(sm) {
        let [Some(a), Some(b)] = g.nodes[p].inputs[..] else {
            return None;
        };
        // The scores are the operand made by a Div, Mul or MatMul.
        let scores = |x: ValueId| {
            producer(g, x).is_some_and(|n| is(g, n, "Div") || is(g, n, "Mul") || is(g, n, "MatMul"))
        };
        let (sv, m) = if scores(a) { (a, b) } else { (b, a) };
        let out_shape = g.value(cur).ty.static_shape()?;
        let ms = g.value(m).ty.static_shape()?;
        if !is_float(g, m)
            || ms.is_empty()
            || ms.len() > 4
            || g.value(m).ty.dtype() != g.value(cur).ty.dtype()
            || crate::ir::broadcast_shapes(&ms, &out_shape).as_deref() != Some(&out_shape[..])
        {
            return None;
        }
        mask = Some(m);
        nodes.push(p);
        if fusible_output(g, sv) != Some(p) {
            return None;
        }
        reader = p;
        cur = sv;
        p = producer(g, cur)?;
    }
    if (is(g, p, "Div") || is(g, p, "Mul")) && fusible_output(g, cur) == Some(reader) {
        let [Some(a), Some(c)] = g.nodes[p].inputs[..] else {
            return None;
        };
        let (x, c) = match (const_scalar(known, c), const_scalar(known, a)) {
            (Some(c), _) => (a, c),
            (None, Some(c)) if is(g, p, "Mul") => (c_val(g, p, a)?, c),
            _ => return None,
        };
        scale = if is(g, p, "Div") { 1.0 / c } else { c };
        nodes.push(p);
        reader = p;
        cur = x;
        p = producer(g, cur)?;
    }
    if !is(g, p, "MatMul") || fusible_output(g, cur) != Some(reader) {
        return None;
    }
    let [Some(q), Some(kt)] = g.nodes[p].inputs[..] else {
        return None;
    };
    nodes.push(p);
    if rank(q)? != 4 || rank(kt)? != 4 || rank(v)? != 4 || !is_float(g, q) {
        return None;
    }
    // K from K^T: undo the swap of the last two axes in the Transpose that made it.
    let t = producer(g, kt)?;
    if !is(g, t, "Transpose") || fusible_output(g, kt) != Some(p) {
        return None;
    }
    let perm = g.nodes[t].attrs.get_ints("perm").ok()??;
    if perm.len() != 4 {
        return None;
    }
    let swapped = vec![perm[0], perm[1], perm[3], perm[2]];
    let (k, retranspose) = if swapped == [0, 1, 2, 3] {
        nodes.push(t);
        (g.nodes[t].inputs.first().copied().flatten()?, None)
    } else {
        (kt, Some((t, swapped)))
    };
    let mut attrs = Attrs::default();
    attrs.0.insert("scale".into(), Attr::Float(scale as f32));
    Some(Match {
        nodes,
        op_type: "Attention",
        opset: 23,
        inputs: vec![Some(q), Some(k), Some(v), mask],
        output: out(g, mm2),
        attrs,
        ones: None,
        retranspose,
    })
}

/// The non-constant operand of a binary node, given one operand `a` that is constant.
fn c_val(g: &Graph, n: NodeId, a: ValueId) -> Option<ValueId> {
    other(g, n, a)
}

/// Replaces the matched nodes by one node, placed at the earliest matched node's index.
fn replace(g: &mut Graph, order: &[NodeId], mut m: Match) -> Result<()> {
    if let Some(t) = m.ones.take() {
        let name = format!("{}/scale_ones", g.value(m.output).name);
        let id = g.add_const(name, t);
        m.inputs[1] = Some(id);
    }
    if let Some((t, perm)) = m.retranspose.take() {
        let node = &g.nodes[t];
        let mut attrs = node.attrs.clone();
        attrs.0.insert("perm".into(), Attr::Ints(perm.clone()));
        let ctx = OpCtx {
            op_type: node.op_type.clone(),
            domain: node.domain.clone(),
            attrs: attrs.clone(),
            opset: node.opset,
            n_inputs: node.inputs.len(),
            n_outputs: node.outputs.len(),
        };
        let op = Registry::standard()
            .build(ctx)
            .ok_or_else(|| Error::model("no Transpose op"))?
            .map_err(|e| Error::model(format!("building Transpose: {e}")))?;
        let o = node.outputs[0];
        let x = node.inputs[0].ok_or_else(|| Error::model("Transpose without input"))?;
        let xty = g.value(x).ty.clone();
        let (Some(dt), Some(xs)) = (xty.dtype(), xty.static_shape()) else {
            return Err(Error::model("Transpose input without a static type"));
        };
        let shape: Vec<usize> = perm
            .iter()
            .map(|&p| xs.get(p as usize).copied())
            .collect::<Option<_>>()
            .ok_or_else(|| Error::model("Transpose perm out of range"))?;
        g.value_mut(o).ty = crate::ir::ValueType::tensor(dt, &shape);
        let node = &mut g.nodes[t];
        node.attrs = attrs;
        node.op = op;
    }
    while m.inputs.last() == Some(&None) {
        m.inputs.pop();
    }
    let ctx = OpCtx {
        op_type: m.op_type.into(),
        domain: String::new(),
        attrs: m.attrs.clone(),
        opset: m.opset,
        n_inputs: m.inputs.len(),
        n_outputs: 1,
    };
    let op = Registry::standard()
        .build(ctx)
        .ok_or_else(|| Error::model(format!("no {} op", m.op_type)))?
        .map_err(|e| Error::model(format!("building {}: {e}", m.op_type)))?;
    m.nodes
        .sort_by_key(|n| order.iter().position(|o| o == n).unwrap_or(usize::MAX));
    let first = m.nodes[0];
    let name = {
        let last = g.nodes[*m.nodes.last().expect("a match has nodes")]
            .name
            .clone();
        if last.is_empty() {
            format!("{}_{}", m.op_type, first.index())
        } else {
            format!("{last}/{}", m.op_type)
        }
    };
    let removed: Vec<ValueId> = m
        .nodes
        .iter()
        .flat_map(|&n| g.nodes[n].outputs.clone())
        .collect();
    for &n in &m.nodes[1..] {
        g.nodes.remove_node(n);
    }
    for v in removed {
        g.value_mut(v).source = Source::Undefined;
    }
    g.nodes[first] = Node {
        name,
        op_type: m.op_type.into(),
        domain: String::new(),
        opset: m.opset,
        attrs: m.attrs,
        op,
        inputs: m.inputs,
        outputs: vec![m.output],
        implicit: Vec::new(),
    };
    g.value_mut(m.output).source = Source::Node(first);
    g.rewire();
    Ok(())
}
