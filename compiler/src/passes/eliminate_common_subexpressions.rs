//! Common subexpression elimination: equal small constants are merged, then nodes with
//! the same op, attributes and inputs (in schedule order, so merges cascade). Random
//! ops (Dropout included: in training mode it draws a mask), nodes with subgraphs and
//! nodes writing graph outputs are never merged.

use super::util::{order, tensor_key};
use crate::error::Result;
use crate::ir::{Attr, Graph, NodeId, Source, ValueId};
use std::collections::HashMap;

/// Constants up to this many elements are compared for merging.
const SMALL_CONST: usize = 1 << 16;

/// Op type, domain, opset and inputs: what two nodes must share to be compared.
type NodeKey = (String, String, i64, Vec<Option<ValueId>>);

pub fn run(g: &mut Graph) -> Result<()> {
    merge_constants(g);
    let mut seen: HashMap<NodeKey, Vec<NodeId>> = HashMap::new();
    for n in order(g)? {
        let node = &g.nodes[n];
        if !node.op.subgraphs().is_empty()
            || !node.implicit.is_empty()
            || node.op_type.starts_with("Random")
            || matches!(
                node.op_type.as_str(),
                "Multinomial" | "Bernoulli" | "Dropout"
            )
            || node.outputs.iter().any(|&o| g.is_pinned(o))
        {
            continue;
        }
        let key = (
            node.op_type.clone(),
            node.domain.clone(),
            node.opset,
            node.inputs.clone(),
        );
        let bucket = seen.entry(key).or_default();
        let twin = bucket.iter().copied().find(|&m| {
            let other = &g.nodes[m];
            other.outputs.len() == node.outputs.len() && attrs_equal(&other.attrs, &node.attrs)
        });
        match twin {
            Some(m) => {
                let pairs: Vec<(ValueId, ValueId)> = node
                    .outputs
                    .iter()
                    .copied()
                    .zip(g.nodes[m].outputs.iter().copied())
                    .collect();
                for (dup, keep) in pairs {
                    g.replace_uses(dup, keep);
                }
                g.remove_node(n);
            }
            None => bucket.push(n),
        }
    }
    g.rewire();
    Ok(())
}

fn merge_constants(g: &mut Graph) {
    let mut ids: Vec<ValueId> = g.consts.keys().copied().collect();
    ids.sort();
    let mut canon: HashMap<Vec<u8>, ValueId> = HashMap::new();
    for c in ids {
        let t = &g.consts[&c];
        if t.len() > SMALL_CONST || g.value(c).source != Source::Const {
            continue;
        }
        let Some(key) = tensor_key(t) else { continue };
        match canon.get(&key) {
            Some(&keep) if !g.is_pinned(c) => {
                g.replace_uses(c, keep);
                g.remove_const(c);
            }
            Some(_) => {}
            None => {
                canon.insert(key, c);
            }
        }
    }
}

fn attrs_equal(a: &crate::ir::Attrs, b: &crate::ir::Attrs) -> bool {
    a.0.len() == b.0.len()
        && a.0
            .iter()
            .zip(b.0.iter())
            .all(|((ka, va), (kb, vb))| ka == kb && attr_equal(va, vb))
}

fn attr_equal(a: &Attr, b: &Attr) -> bool {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    match (a, b) {
        (Attr::Float(x), Attr::Float(y)) => x.to_bits() == y.to_bits(),
        (Attr::Int(x), Attr::Int(y)) => x == y,
        (Attr::String(x), Attr::String(y)) => x == y,
        (Attr::Tensor(x), Attr::Tensor(y)) => {
            tensor_key(x).is_some_and(|k| Some(k) == tensor_key(y))
        }
        (Attr::Type(x), Attr::Type(y)) => x == y,
        (Attr::Floats(x), Attr::Floats(y)) => bits(x) == bits(y),
        (Attr::Ints(x), Attr::Ints(y)) => x == y,
        (Attr::Strings(x), Attr::Strings(y)) => x == y,
        (Attr::Types(x), Attr::Types(y)) => x == y,
        // Graphs and tensor lists are not compared: such nodes are never merged.
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::passes::testutil::*;

    #[test]
    fn merges_equal_nodes_and_constants() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 3]);
        let c1 = b.konst("c1", &[3], vec![1.0, 2.0, 3.0]);
        let c2 = b.konst("c2", &[3], vec![1.0, 2.0, 3.0]);
        let c3 = b.konst("c3", &[3], vec![1.0, 2.0, -3.0]);
        let a1 = b.node("Add", &[x, c1], &[2, 3]);
        let a2 = b.node("Add", &[x, c2], &[2, 3]);
        let a3 = b.node("Add", &[x, c3], &[2, 3]);
        let r1 = b.node("Relu", &[a1], &[2, 3]);
        let r2 = b.node("Relu", &[a2], &[2, 3]);
        let l1 = b.node_attrs(
            "LeakyRelu",
            &[a3],
            DType::F32,
            &[2, 3],
            &[("alpha", Attr::Float(0.1))],
        );
        let l2 = b.node_attrs(
            "LeakyRelu",
            &[a3],
            DType::F32,
            &[2, 3],
            &[("alpha", Attr::Float(0.2))],
        );
        let s1 = b.node("Add", &[r1, r2], &[2, 3]);
        let s2 = b.node("Add", &[l1, l2], &[2, 3]);
        let y = b.node("Mul", &[s1, s2], &[2, 3]);
        let mut g = b.finish(&[y]);
        check_pass(&mut g, |g| {
            run(g)?;
            super::super::eliminate_dead_code::run(g)
        });
        // a1 = a2, r1 = r2; the LeakyRelus differ in alpha.
        assert_eq!(g.node_count(), 8, "{}", crate::ir::print_graph(&g));
        assert!(!g.consts.contains_key(&c2));
    }

    #[test]
    fn graph_outputs_are_not_merged_away() {
        let mut b = Builder::new();
        let x = b.input("x", &[2]);
        let y1 = b.node("Relu", &[x], &[2]);
        let y2 = b.node("Relu", &[x], &[2]);
        let mut g = b.finish(&[y1, y2]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 2);
    }
}
