//! If nodes whose condition is known at compile time are replaced by the nodes of the
//! branch they take (shape inference then sees ordinary nodes). Branch values get fresh
//! names (`IFNAME/name`); each branch output reaches the If's output through an Identity,
//! which the cleanup passes remove. Branches with nested subgraphs are left alone.

use crate::ir::{Attrs, Graph, Node, NodeId, Source, Value, ValueId, ValueType};
use crate::ops::{OpCtx, Registry};
use std::collections::HashMap;

/// Inlines every If whose condition is in `known`; returns how many were inlined.
pub fn inline_constant_ifs(g: &mut Graph, known: &HashMap<ValueId, Value>) -> usize {
    let ifs: Vec<NodeId> = g
        .nodes
        .node_indices()
        .filter(|&n| g.nodes[n].domain.is_empty() && g.nodes[n].op_type == "If")
        .collect();
    let mut done = 0;
    for n in ifs {
        let cond = match g.nodes[n].inputs.first() {
            Some(Some(c)) => *c,
            _ => continue,
        };
        let t = match known.get(&cond) {
            Some(Value::Tensor(t)) => t,
            _ => match g.consts.get(&cond) {
                Some(t) => t,
                None => continue,
            },
        };
        let taken = match (t.len(), t.to_f64_vec()) {
            (1, Some(x)) => x[0] != 0.0,
            _ => continue,
        };
        let name = if taken { "then_branch" } else { "else_branch" };
        let Ok(Some(body)) = g.nodes[n].attrs.get_graph(name) else {
            continue;
        };
        if inline(g, n, &body) {
            done += 1;
        }
    }
    if done > 0 {
        g.rewire();
    }
    done
}

/// Replaces If node `n` by `body`'s nodes; false (graph untouched) when it cannot.
fn inline(g: &mut Graph, n: NodeId, body: &Graph) -> bool {
    if !body.inputs.is_empty() {
        return false;
    }
    if body
        .nodes
        .node_indices()
        .any(|b| !body.nodes[b].op.subgraphs().is_empty())
    {
        return false;
    }
    let Ok(order) = body.topo_order() else {
        return false;
    };
    let if_outputs = g.nodes[n].outputs.clone();
    if if_outputs.len() != body.outputs.len() {
        return false;
    }
    // Outer references must name values of this graph.
    for v in body.outer_refs() {
        if g.find(&body.value(v).name).is_none() {
            return false;
        }
    }
    let Some(Ok(identity)) = Registry::standard().build(OpCtx {
        op_type: "Identity".into(),
        domain: String::new(),
        attrs: Attrs::default(),
        opset: 21,
        n_inputs: 1,
        n_outputs: 1,
    }) else {
        return false;
    };
    let prefix = if g.nodes[n].name.is_empty() {
        format!("If_{}", n.index())
    } else {
        g.nodes[n].name.clone()
    };
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    for v in 0..body.values.len() {
        let info = body.value(v);
        let id = match info.source {
            Source::Outer => g.find(&info.name).expect("checked above"),
            Source::Const => {
                let name = g.fresh_name(&format!("{prefix}/{}", info.name));
                g.add_const(name, body.consts[&v].clone())
            }
            Source::Node(_) => {
                let name = g.fresh_name(&format!("{prefix}/{}", info.name));
                g.add_value(name, info.ty.clone(), Source::Undefined)
            }
            _ => continue,
        };
        map.insert(v, id);
    }
    let opset = g.nodes[n].opset;
    g.nodes.remove_node(n);
    for b in order {
        let bn = &body.nodes[b];
        let node = Node {
            name: format!("{prefix}/{}", bn.name),
            op_type: bn.op_type.clone(),
            domain: bn.domain.clone(),
            opset: bn.opset,
            attrs: bn.attrs.clone(),
            op: bn.op.clone(),
            inputs: bn.inputs.iter().map(|i| i.map(|v| map[&v])).collect(),
            outputs: bn.outputs.iter().map(|v| map[v]).collect(),
            implicit: bn.implicit.iter().map(|v| map[v]).collect(),
        };
        g.add_node(node);
    }
    for (k, (&bo, &io)) in body.outputs.iter().zip(&if_outputs).enumerate() {
        g.value_mut(io).ty = match &g.value(io).ty {
            ValueType::Unknown => body.value(bo).ty.clone(),
            t => t.clone(),
        };
        g.add_node(Node {
            name: format!("{prefix}/output{k}"),
            op_type: "Identity".into(),
            domain: String::new(),
            opset,
            attrs: Attrs::default(),
            op: identity.clone(),
            inputs: vec![Some(map[&bo])],
            outputs: vec![io],
            implicit: vec![],
        });
    }
    true
}
