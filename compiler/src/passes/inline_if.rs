//! If nodes become ordinary nodes before lowering.
//!
//! - [`inline_constant_ifs`]: an If whose condition is known at compile time is replaced
//!   by the nodes of the branch it takes.
//! - [`select_runtime_ifs`]: an If whose condition is only known at run time, when both
//!   branches give tensors of the same dtypes and static shapes, is replaced by both
//!   branches and one `Where` per output, selecting by the condition. Branches have no
//!   side effects (integer division guards its divisor, gathers and scatters clamp
//!   their indices), so computing the branch not taken costs time but cannot change the
//!   result.
//!
//! Branch values get fresh names (`IFNAME/name`, `IFNAME/then/name`); nested subgraphs are
//! renamed to follow (see `inline_util`). Shape inference then sees ordinary nodes.

use super::inline_util::{
    add_node_to, add_op, identity_to, inline_body, known_flag, rewrite_each, typed_body, Budget,
};
use crate::error::Result;
use crate::ir::{Graph, NodeId, Tensor, Value, ValueId, ValueType};
use std::collections::{BTreeMap, HashMap};

/// If nodes of the default domain.
fn if_nodes(g: &Graph) -> Vec<NodeId> {
    g.nodes
        .node_indices()
        .filter(|&n| g.nodes[n].domain.is_empty() && g.nodes[n].op_type == "If")
        .collect()
}

/// The name the copies of `n`'s subgraph values are prefixed with.
pub fn node_prefix(g: &Graph, n: NodeId) -> String {
    let node = &g.nodes[n];
    if node.name.is_empty() {
        format!("{}_{}", node.op_type, n.index())
    } else {
        node.name.clone()
    }
}

/// Inlines every If whose condition is in `known` (or a constant); returns how many.
pub fn inline_constant_ifs(
    g: &mut Graph,
    budget: &Budget,
    known: &HashMap<ValueId, Value>,
) -> Result<usize> {
    let mut done = 0;
    for n in if_nodes(g) {
        let Some(Some(cond)) = g.nodes[n].inputs.first().copied() else {
            continue;
        };
        let taken = match known_flag(known, cond) {
            Some(c) => c,
            None => match g.consts.get(&cond) {
                Some(t) if t.len() == 1 => match t.to_f64_vec() {
                    Some(x) => x[0] != 0.0,
                    None => continue,
                },
                _ => continue,
            },
        };
        let attr = if taken { "then_branch" } else { "else_branch" };
        let Ok(Some(body)) = g.nodes[n].attrs.get_graph(attr) else {
            continue;
        };
        if !body.inputs.is_empty() || body.outputs.len() != g.nodes[n].outputs.len() {
            continue;
        }
        let prefix = node_prefix(g, n);
        let node = g.nodes[n].clone();
        let outs = inline_body(g, budget, &prefix, &body, &[])?;
        g.remove_node(n);
        for (k, (&bo, &io)) in outs.iter().zip(&node.outputs).enumerate() {
            identity_to(g, node.opset, format!("{prefix}/output{k}"), bo, io)?;
        }
        done += 1;
    }
    if done > 0 {
        g.rewire();
    }
    Ok(done)
}

/// Rewrites every If whose condition is only known at run time into both branches and a
/// `Where` per output, when the branches give the same static tensor types; `refused`
/// gets, by node label, why each other If is left alone. Returns how many were rewritten.
pub fn select_runtime_ifs(
    g: &mut Graph,
    budget: &Budget,
    known: &HashMap<ValueId, Value>,
    refused: &mut BTreeMap<String, String>,
) -> Result<usize> {
    let nodes = if_nodes(g);
    rewrite_each(g, nodes, refused, |g, n| select_one(g, budget, n, known))
}

/// Rewrites one If into a select; Some(reason) when it cannot (the graph is untouched).
fn select_one(
    g: &mut Graph,
    budget: &Budget,
    n: NodeId,
    known: &HashMap<ValueId, Value>,
) -> Result<Option<String>> {
    let node = g.nodes[n].clone();
    let Some(Some(cond)) = node.inputs.first().copied() else {
        return Ok(Some("its condition input is missing".into()));
    };
    let Some(cond_shape) = g.value(cond).ty.static_shape() else {
        return Ok(Some("the type of its condition is not known".into()));
    };
    if cond_shape.iter().product::<usize>() != 1 {
        return Ok(Some(format!(
            "its condition must hold one value, has shape {cond_shape:?}"
        )));
    }
    let (Ok(Some(then_b)), Ok(Some(else_b))) = (
        node.attrs.get_graph("then_branch"),
        node.attrs.get_graph("else_branch"),
    ) else {
        return Ok(Some("a branch is missing".into()));
    };
    if then_b.outputs.len() != node.outputs.len() || else_b.outputs.len() != node.outputs.len() {
        return Ok(Some("its branches do not give one value per output".into()));
    }
    // Both branches must give the same static tensor types.
    let mut types = Vec::new();
    for b in [&then_b, &else_b] {
        let (tb, _) = match typed_body(g, budget, known, b, &[]) {
            Ok(x) => x,
            Err(e) => return Ok(Some(format!("branch `{}` cannot be compiled: {e}", b.name))),
        };
        types.push(
            tb.outputs
                .iter()
                .map(|&o| tb.value(o).ty.clone())
                .collect::<Vec<_>>(),
        );
    }
    for (k, (t, e)) in types[0].iter().zip(&types[1]).enumerate() {
        let tensor = |ty: &ValueType| matches!(ty, ValueType::Tensor { .. });
        let unknown = |ty: &ValueType| *ty == ValueType::Unknown;
        if !unknown(t) && !unknown(e) && (!tensor(t) || !tensor(e)) {
            return Ok(Some(format!(
                "its condition is only known at run time and output {k} is not a tensor \
                 (then: {t}, else: {e}); only tensors can be selected"
            )));
        }
        if !t.is_static() || !e.is_static() {
            return Ok(Some(format!(
                "its condition is only known at run time and the type of output {k} is not \
                 known statically (then: {t}, else: {e})"
            )));
        }
        if t != e {
            return Ok(Some(format!(
                "its condition is only known at run time and its branches give different \
                 types for output {k} (then: {t}, else: {e}), so the output's shape depends \
                 on the data"
            )));
        }
    }
    let prefix = node_prefix(g, n);
    let then_outs = inline_body(g, budget, &format!("{prefix}/then"), &then_b, &[])?;
    let else_outs = inline_body(g, budget, &format!("{prefix}/else"), &else_b, &[])?;
    g.remove_node(n);
    let flag = if cond_shape.is_empty() {
        cond
    } else {
        let scalar = super::util::add_const(
            g,
            &format!("{prefix}/scalar_shape"),
            Tensor::from_vec(&[0], Vec::<i64>::new()),
        );
        add_op(
            g,
            node.opset,
            &format!("{prefix}/cond"),
            "Reshape",
            &[],
            &[cond, scalar],
        )?
    };
    for (k, ((&t, &e), &o)) in then_outs
        .iter()
        .zip(&else_outs)
        .zip(&node.outputs)
        .enumerate()
    {
        add_node_to(
            g,
            node.opset,
            format!("{prefix}/select{k}"),
            "Where",
            &[],
            vec![Some(flag), Some(t), Some(e)],
            vec![o],
        )?;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use crate::ir::{DType, Tensor, Value};
    use crate::passes::testutil::*;

    fn flag(b: bool) -> Value {
        Value::Tensor(Tensor::scalar(b))
    }

    fn xs() -> Value {
        Value::Tensor(Tensor::from_vec(&[2, 3], vec![1f32, -2., 3., -4., 5., 6.]))
    }

    #[test]
    fn runtime_condition_selects_between_both_branches() {
        let mut b = Builder::new();
        let c = b.input_typed("c", DType::Bool, &[]);
        let x = b.input("x", &[2, 3]);
        let mut t = Sub::new("then");
        let (xo, two) = (t.outer("x"), t.konst("two", Tensor::scalar(2f32)));
        let y = t.node("Mul", &[xo, two], &[]);
        let then_b = t.finish(&[y]);
        let mut e = Sub::new("else");
        let xo = e.outer("x");
        let y = e.node("Neg", &[xo], &[]);
        let else_b = e.finish(&[y]);
        let attrs = [("then_branch", then_b), ("else_branch", else_b)];
        let out = b.node_sub("If", vec![Some(c)], 1, &attrs)[0];
        let mut g = b.finish_untyped(&[out, x]);
        check_inlined(&mut g, &[vec![flag(true), xs()], vec![flag(false), xs()]]);
        let ops: Vec<&str> = g.nodes.node_weights().map(|n| n.op_type.as_str()).collect();
        assert!(ops.contains(&"Where"), "{ops:?}");
    }

    #[test]
    fn nested_ifs_read_the_inlined_values() {
        // The outer If's condition is known only at run time; the then-branch holds an If
        // on a constant whose branch reads a value of the then-branch by name.
        let mut b = Builder::new();
        let c = b.input_typed("c", DType::Bool, &[]);
        b.input("x", &[2, 3]);
        let mut inner = Sub::new("inner_then");
        let yo = inner.outer("y");
        let z = inner.node("Add", &[yo, yo], &[]);
        let inner_then = inner.finish(&[z]);
        let mut inner = Sub::new("inner_else");
        let yo = inner.outer("y");
        let inner_else = inner.finish(&[yo]);
        let mut t = Sub::new("then");
        let (xo, two) = (t.outer("x"), t.konst("two", Tensor::scalar(2f32)));
        let y = t.node("Mul", &[xo, two], &[]);
        t.rename(y, "y");
        let k = t.konst("k", Tensor::scalar(true));
        let attrs = [("then_branch", inner_then), ("else_branch", inner_else)];
        let r = t.node("If", &[k], &attrs);
        let then_b = t.finish(&[r]);
        let mut e = Sub::new("else");
        let xo = e.outer("x");
        let else_b = e.finish(&[xo]);
        let attrs = [("then_branch", then_b), ("else_branch", else_b)];
        let out = b.node_sub("If", vec![Some(c)], 1, &attrs)[0];
        let mut g = b.finish_untyped(&[out]);
        check_inlined(&mut g, &[vec![flag(true), xs()], vec![flag(false), xs()]]);
    }

    #[test]
    fn branches_of_different_shapes_are_refused_with_the_reason() {
        let mut b = Builder::new();
        let c = b.input_typed("c", DType::Bool, &[]);
        b.input("x", &[2, 3]);
        let mut t = Sub::new("then");
        let xo = t.outer("x");
        let then_b = t.finish(&[xo]);
        let mut e = Sub::new("else");
        let k = e.konst("k", Tensor::from_vec(&[3], vec![1f32, 2., 3.]));
        let else_b = e.finish(&[k]);
        let attrs = [("then_branch", then_b), ("else_branch", else_b)];
        let out = b.node_sub("If", vec![Some(c)], 1, &attrs)[0];
        let mut g = b.finish_untyped(&[out]);
        let rep = crate::passes::infer_and_inline(&mut g).unwrap();
        assert_eq!(rep.unresolved.len(), 1, "{:?}", rep.unresolved);
        assert!(
            rep.unresolved[0].contains("(If): its condition is only known at run time")
                && rep.unresolved[0].contains("different types for output 0"),
            "{}",
            rep.unresolved[0]
        );
    }
}
