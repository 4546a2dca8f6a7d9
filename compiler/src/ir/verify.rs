//! The graph IR verifier: checks structural invariants and returns every violation,
//! each naming the node or value involved. Run between passes in debug builds and tests.

use super::{Graph, Source, ValueType};
use std::collections::HashSet;

/// Checks `g` (and its subgraphs). `typed` also requires every value to have a type.
pub fn verify(g: &Graph, typed: bool) -> Result<(), Vec<String>> {
    let mut errs = Vec::new();
    verify_into(g, typed, &mut errs);
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

fn verify_into(g: &Graph, typed: bool, errs: &mut Vec<String>) {
    let mut produced = HashSet::new();
    for n in g.nodes.node_indices() {
        let node = &g.nodes[n];
        let label = g.node_label(n);
        for (i, inp) in node.inputs.iter().enumerate() {
            if let Some(v) = inp {
                if *v >= g.values.len() {
                    errs.push(format!(
                        "{label}: input {i} names value #{v}, which does not exist"
                    ));
                } else if g.values[*v].source == Source::Undefined {
                    errs.push(format!(
                        "{label}: input {i} `{}` is never defined",
                        g.values[*v].name
                    ));
                }
            }
        }
        for o in &node.outputs {
            if !produced.insert(*o) {
                errs.push(format!(
                    "{label}: output `{}` is produced twice",
                    g.values[*o].name
                ));
            }
            if g.values[*o].source != Source::Node(n) {
                errs.push(format!(
                    "{label}: output `{}` is not recorded as produced by this node",
                    g.values[*o].name
                ));
            }
        }
        for sg in node.op.subgraphs() {
            verify_into(sg, typed, errs);
        }
    }
    for (id, v) in g.values.iter().enumerate() {
        match v.source {
            Source::Const if !g.consts.contains_key(&id) => {
                errs.push(format!("constant `{}` has no data", v.name))
            }
            Source::Node(n) if !g.nodes.contains_node(n) => errs.push(format!(
                "value `{}` is produced by a node that was removed",
                v.name
            )),
            _ => {}
        }
        if let (Some(t), ValueType::Tensor { dt, shape: Some(s) }) = (g.consts.get(&id), &v.ty) {
            if t.dtype() != *dt
                || ValueType::tensor(t.dtype(), t.shape())
                    != (ValueType::Tensor {
                        dt: *dt,
                        shape: Some(s.clone()),
                    })
            {
                errs.push(format!(
                    "constant `{}` is typed {} but holds {}{:?}",
                    v.name,
                    v.ty,
                    t.dtype(),
                    t.shape()
                ));
            }
        }
    }
    for &o in &g.outputs {
        if g.values[o].source == Source::Undefined {
            errs.push(format!(
                "graph output `{}` is never defined",
                g.values[o].name
            ));
        }
    }
    if let Err(cycle) = g.topo_order() {
        errs.push(format!(
            "the graph has a cycle through {}",
            cycle.join(", ")
        ));
    }
    if typed {
        for n in g.nodes.node_indices() {
            for &o in &g.nodes[n].outputs {
                if g.values[o].ty == ValueType::Unknown {
                    errs.push(format!(
                        "{}: output `{}` has no inferred type",
                        g.node_label(n),
                        g.values[o].name
                    ));
                }
            }
        }
    }
}
