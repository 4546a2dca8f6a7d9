//! Copying a subgraph's nodes into the graph that holds it (If branches, Loop and Scan
//! bodies, FlexAttention's modifiers), typing a subgraph in the context of the graph
//! around it, and small node builders for the rewrites that do so (`inline_if`,
//! `unroll_loops`, `expand_flex_attention`).

use super::infer_shapes::InferReport;
use super::util::{new_node, order, rebuild};
use crate::error::{Error, Result};
use crate::ir::{
    Attr, Attrs, DType, Graph, Node, NodeId, Source, Tensor, Value, ValueId, ValueType,
};
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Node copies the control-flow rewrites of one compile may make in all (typing a body and
/// inlining it both count), so nested loops cannot grow the graph without bound.
pub const MAX_COPIED_NODES: usize = 200_000;

/// What is left of [`MAX_COPIED_NODES`] for one compile.
pub struct Budget(Cell<usize>);

impl Default for Budget {
    fn default() -> Budget {
        Budget(Cell::new(MAX_COPIED_NODES))
    }
}

impl Budget {
    /// Takes the copies of `body`'s nodes, or fails saying where.
    fn spend(&self, body: &Graph, at: &str) -> Result<()> {
        let n = body.node_count().max(1);
        let left = self.0.get();
        if n > left {
            return Err(Error::Shape(format!(
                "{at}: inlining and unrolling control flow would copy more than \
                 {MAX_COPIED_NODES} nodes in all; loops are compiled by unrolling, so only \
                 short ones are supported"
            )));
        }
        self.0.set(left - n);
        Ok(())
    }
}

/// Rewrites each of `nodes` with `rewrite` (`None`: rewritten; `Some(why)`: left alone,
/// `refused` gets the reason by node label), then rewires `g` when any was rewritten.
/// Returns how many were rewritten. The driver of the control-flow rewrites.
pub fn rewrite_each(
    g: &mut Graph,
    nodes: Vec<NodeId>,
    refused: &mut BTreeMap<String, String>,
    mut rewrite: impl FnMut(&mut Graph, NodeId) -> Result<Option<String>>,
) -> Result<usize> {
    let mut done = 0;
    for n in nodes {
        match rewrite(g, n)? {
            None => done += 1,
            Some(why) => {
                refused.insert(g.node_label(n), why);
            }
        }
    }
    if done > 0 {
        g.rewire();
    }
    Ok(done)
}

/// Copies `body`'s nodes into `g`. Every body value gets a fresh name `prefix/name`;
/// body input k is `args[k]`; values the body reads from enclosing scopes are `g`'s
/// values of the same name, and nested subgraphs (an If inside a Loop body) are renamed
/// to read the copies. Returns the values of `g` that hold the body's outputs (a body
/// output may be an argument or a value of `g` itself); the caller rewires. Fails before
/// changing `g` when the body does not fit (argument count, a name `g` does not define,
/// a cycle).
pub fn inline_body(
    g: &mut Graph,
    budget: &Budget,
    prefix: &str,
    body: &Graph,
    args: &[ValueId],
) -> Result<Vec<ValueId>> {
    if args.len() != body.inputs.len() {
        return Err(Error::model(format!(
            "subgraph `{}` takes {} inputs but {} were given",
            body.name,
            body.inputs.len(),
            args.len()
        )));
    }
    budget.spend(body, prefix)?;
    let body_order = order(body)?;
    for v in body.outer_refs() {
        if g.find(&body.value(v).name).is_none() {
            return Err(Error::model(format!(
                "subgraph `{}` reads `{}`, which the enclosing graph does not define",
                body.name,
                body.value(v).name
            )));
        }
    }
    let mut map: HashMap<ValueId, ValueId> = body
        .inputs
        .iter()
        .copied()
        .zip(args.iter().copied())
        .collect();
    for v in 0..body.values.len() {
        if map.contains_key(&v) {
            continue;
        }
        let info = body.value(v);
        let id = match info.source {
            Source::Outer => g.find(&info.name).expect("checked above"),
            Source::Const => {
                let name = g.fresh_name(&format!("{prefix}/{}", info.name));
                g.add_const(name, body.consts[&v].clone())
            }
            Source::Node(_) => {
                let name = g.fresh_name(&format!("{prefix}/{}", info.name));
                g.add_value(name, ValueType::Unknown, Source::Undefined)
            }
            _ => continue,
        };
        map.insert(v, id);
    }
    // Old name -> new name of every body value, for nested subgraphs that read them.
    let renames: HashMap<String, String> = map
        .iter()
        .filter(|(&v, _)| body.value(v).source != Source::Outer)
        .map(|(&v, &id)| (body.value(v).name.clone(), g.value(id).name.clone()))
        .collect();
    for b in body_order {
        let bn = &body.nodes[b];
        let name = if bn.name.is_empty() {
            format!("{prefix}/{}{}", bn.op_type, b.index())
        } else {
            format!("{prefix}/{}", bn.name)
        };
        let mut node = Node {
            name,
            op_type: bn.op_type.clone(),
            domain: bn.domain.clone(),
            opset: bn.opset,
            attrs: bn.attrs.clone(),
            op: bn.op.clone(),
            inputs: bn.inputs.iter().map(|i| i.map(|v| map[&v])).collect(),
            outputs: bn.outputs.iter().map(|v| map[v]).collect(),
            implicit: bn.implicit.iter().map(|v| map[v]).collect(),
        };
        if !bn.op.subgraphs().is_empty() {
            rename_node_subgraphs(&mut node, &renames)?;
        }
        g.add_node(node);
    }
    Ok(body.outputs.iter().map(|o| map[o]).collect())
}

/// Renames, in the subgraphs a node holds, the values they read from enclosing scopes
/// (old name -> new name), then rebuilds the node's op from the edited attributes.
fn rename_node_subgraphs(node: &mut Node, renames: &HashMap<String, String>) -> Result<()> {
    for a in node.attrs.0.values_mut() {
        match a {
            Attr::Graph(sg) => *sg = Arc::new(rename_refs(sg, renames)?),
            Attr::Graphs(v) => {
                for sg in v.iter_mut() {
                    *sg = Arc::new(rename_refs(sg, renames)?);
                }
            }
            _ => {}
        }
    }
    rebuild(node)
}

/// `sg` with its references to enclosing values renamed, through nested subgraphs too
/// (each nested graph lists the names it reads from outside as `Outer` values).
fn rename_refs(sg: &Graph, renames: &HashMap<String, String>) -> Result<Graph> {
    let mut out = sg.clone();
    let mut inner = HashMap::new();
    for v in sg.outer_refs() {
        let old = &sg.value(v).name;
        let Some(new) = renames.get(old) else {
            continue;
        };
        if sg.find(new).is_some_and(|w| w != v) {
            return Err(Error::model(format!(
                "subgraph `{}` already names a value `{new}`; cannot inline around it",
                sg.name
            )));
        }
        out.rename_value(v, new.clone());
        inner.insert(old.clone(), new.clone());
    }
    if inner.is_empty() {
        return Ok(out);
    }
    let ids: Vec<_> = out.nodes.node_indices().collect();
    for n in ids {
        if !out.nodes[n].op.subgraphs().is_empty() {
            rename_node_subgraphs(&mut out.nodes[n], &inner)?;
        }
    }
    Ok(out)
}

/// A copy of `body` typed in the context of `g`: input k gets `inputs[k]` (a type, and
/// a value when known at compile time, which makes it a constant of the copy); values
/// the body reads from `g` take their types from `g` and, when `known` holds them, their
/// values. Shape inference (with partial evaluation) then runs on the copy, inlining
/// and unrolling the control flow inside it as [`super::infer_and_inline`] does.
pub fn typed_body(
    g: &Graph,
    budget: &Budget,
    known: &HashMap<ValueId, Value>,
    body: &Graph,
    inputs: &[(ValueType, Option<Tensor>)],
) -> Result<(Graph, InferReport)> {
    budget.spend(body, &format!("subgraph `{}`", body.name))?;
    let mut b = body.clone();
    for (&v, (ty, val)) in body.inputs.iter().zip(inputs) {
        match val {
            Some(t) => b.set_const(v, t.clone()),
            None => b.value_mut(v).ty = ty.clone(),
        }
    }
    for v in body.outer_refs() {
        let Some(o) = g.find(&body.value(v).name) else {
            continue;
        };
        match known.get(&o) {
            Some(Value::Tensor(t)) => b.set_const(v, t.clone()),
            _ => b.value_mut(v).ty = g.value(o).ty.clone(),
        }
    }
    // Control flow inside the body (an If on a constant) is resolved in the copy too.
    let rep = super::infer_and_inline_within(&mut b, budget)?;
    Ok((b, rep))
}

/// The value `v` holds at compile time as one boolean (a one-element tensor), if known.
pub fn known_flag(known: &HashMap<ValueId, Value>, v: ValueId) -> Option<bool> {
    match known.get(&v) {
        Some(Value::Tensor(t)) if t.len() == 1 => t.to_f64_vec().map(|x| x[0] != 0.0),
        _ => None,
    }
}

/// Adds a node of the default domain writing the existing values `outputs`. The rewrites
/// add nodes at the opset of the node they replace and only ops whose meaning is the same
/// at every opset they use (no Unsqueeze, whose axes moved to an input), so the graph
/// written back as ONNX stays valid under the model's opset imports.
pub fn add_node_to(
    g: &mut Graph,
    opset: i64,
    name: String,
    op: &str,
    attrs: &[(&str, Attr)],
    inputs: Vec<Option<ValueId>>,
    outputs: Vec<ValueId>,
) -> Result<()> {
    let mut a = Attrs::default();
    for (k, v) in attrs {
        a.0.insert(k.to_string(), v.clone());
    }
    let node = new_node(name, op, a, opset, inputs, outputs)?;
    g.add_node(node);
    Ok(())
}

/// Adds `Identity(from) -> to` named `name`: how a rewrite hands a value it computed to
/// an output of the node it replaces.
pub fn identity_to(
    g: &mut Graph,
    opset: i64,
    name: String,
    from: ValueId,
    to: ValueId,
) -> Result<()> {
    add_node_to(g, opset, name, "Identity", &[], vec![Some(from)], vec![to])
}

/// Hands `to` an empty `[0]` tensor of `dt` (a scan output of no iterations, as the
/// evaluator gives): a constant named `names.0`, through [`identity_to`] named `names.1`.
pub fn empty_to(
    g: &mut Graph,
    opset: i64,
    dt: DType,
    names: (String, String),
    to: ValueId,
) -> Result<()> {
    let e = super::util::add_const(g, &names.0, Tensor::zeros(dt, &[0]));
    identity_to(g, opset, names.1, e, to)
}

/// Adds a one-output node of the default domain (see [`add_node_to`]); its output is a
/// new value named after the node (typed later by shape inference).
pub fn add_op(
    g: &mut Graph,
    opset: i64,
    name: &str,
    op: &str,
    attrs: &[(&str, Attr)],
    inputs: &[ValueId],
) -> Result<ValueId> {
    let out = g.fresh_name(name);
    let out = g.add_value(out, ValueType::Unknown, Source::Undefined);
    add_node_to(
        g,
        opset,
        name.to_string(),
        op,
        attrs,
        inputs.iter().map(|&i| Some(i)).collect(),
        vec![out],
    )?;
    Ok(out)
}

/// A Reshape of `x` to the constant shape `shape`.
pub fn reshape(
    g: &mut Graph,
    opset: i64,
    name: &str,
    x: ValueId,
    shape: &[usize],
) -> Result<ValueId> {
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let s = super::util::add_const(
        g,
        &format!("{name}/shape"),
        Tensor::from_vec(&[dims.len()], dims),
    );
    add_op(g, opset, name, "Reshape", &[], &[x, s])
}

/// Writes `items`, each of shape `item`, stacked along a new axis `axis` (in
/// `-(rank+1)..=rank`) into the existing value `out`: each reshaped with a 1 there, then
/// concatenated.
pub fn stack_into(
    g: &mut Graph,
    opset: i64,
    prefix: &str,
    items: &[ValueId],
    item: &[usize],
    axis: i64,
    out: ValueId,
) -> Result<()> {
    let r = item.len() as i64;
    let a = if axis < 0 { axis + r + 1 } else { axis };
    if !(0..=r).contains(&a) {
        return Err(Error::model(format!(
            "{prefix}: axis {axis} is out of range to stack values of rank {r}"
        )));
    }
    let mut shape = item.to_vec();
    shape.insert(a as usize, 1);
    let mut parts = Vec::with_capacity(items.len());
    for (k, &v) in items.iter().enumerate() {
        parts.push(reshape(g, opset, &format!("{prefix}/item{k}"), v, &shape)?);
    }
    add_node_to(
        g,
        opset,
        format!("{prefix}/concat"),
        "Concat",
        &[("axis", Attr::Int(a))],
        parts.into_iter().map(Some).collect(),
        vec![out],
    )
}
