//! FlexAttention (ai.onnx.preview) becomes standard ops, as its ONNX function body
//! spells it: Q and K scaled by sqrt(scale) each, K and V heads repeated for grouped
//! queries (Reshape, Expand, Reshape), `Q K^T` (MatMul), a Cast to the softmax
//! precision, the `score_mod` subgraph inlined on the scores, Softmax over the last axis,
//! the `prob_mod` subgraph inlined on the probabilities, then MatMul with V and a Cast
//! back. Each step then lowers like any other node, and the modifiers, which see whole
//! score tensors, need no per-element machinery.

use super::inline_if::node_prefix;
use super::inline_util::{
    add_node_to, add_op, inline_body, reshape, rewrite_each, typed_body, Budget,
};
use super::util::add_const;
use crate::error::Result;
use crate::ir::{Attr, DType, Graph, NodeId, Tensor, Value, ValueId, ValueType};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

const DOMAIN: &str = "ai.onnx.preview";

/// The default-domain opset of the nodes the expansion adds (FlexAttention comes with
/// opset 26 models; the ops used mean the same at every opset since 13).
const OPSET: i64 = 21;

/// Expands every FlexAttention whose inputs have static types; `refused` gets, by node
/// label, why each other one is left alone. Returns how many were expanded.
pub fn expand_flex_attention(
    g: &mut Graph,
    budget: &Budget,
    known: &HashMap<ValueId, Value>,
    refused: &mut BTreeMap<String, String>,
) -> Result<usize> {
    let nodes: Vec<NodeId> = g
        .nodes
        .node_indices()
        .filter(|&n| g.nodes[n].domain == DOMAIN && g.nodes[n].op_type == "FlexAttention")
        .collect();
    rewrite_each(g, nodes, refused, |g, n| expand(g, budget, n, known))
}

/// The static (dtype, shape) of input `i` of `n`.
fn input_type(g: &Graph, n: NodeId, i: usize) -> Option<(ValueId, DType, Vec<usize>)> {
    let v = (*g.nodes[n].inputs.get(i)?)?;
    let ty = &g.value(v).ty;
    Some((v, ty.dtype()?, ty.static_shape()?))
}

/// Expands one FlexAttention; Some(reason) when it cannot (the graph is untouched).
fn expand(
    g: &mut Graph,
    budget: &Budget,
    n: NodeId,
    known: &HashMap<ValueId, Value>,
) -> Result<Option<String>> {
    let node = g.nodes[n].clone();
    let (Some((q, dt, qs)), Some((k, kdt, ks)), Some((v, vdt, vs))) = (
        input_type(g, n, 0),
        input_type(g, n, 1),
        input_type(g, n, 2),
    ) else {
        return Ok(Some(
            "the types of Q, K and V are not known statically".into(),
        ));
    };
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        return Ok(Some(format!(
            "Q, K and V must have rank 4, have shapes {qs:?}, {ks:?}, {vs:?}"
        )));
    }
    let (b, hq, l, e) = (qs[0], qs[1], qs[2], qs[3]);
    let (hkv, s, ev) = (ks[1], ks[2], vs[3]);
    if kdt != dt
        || vdt != dt
        || ks[0] != b
        || vs[0] != b
        || vs[1] != hkv
        || vs[2] != s
        || ks[3] != e
        || hkv == 0
        || hq % hkv != 0
    {
        return Ok(Some(format!(
            "Q, K and V do not fit together: {dt}{qs:?}, {kdt}{ks:?}, {vdt}{vs:?}"
        )));
    }
    let at = &node.attrs;
    let parsed = (|| -> crate::ir::OpResult<_> {
        Ok((
            at.get_float("scale")?,
            at.get_int("softmax_precision")?,
            at.get_graph("score_mod")?,
            at.get_graph("prob_mod")?,
        ))
    })();
    let (scale, precision, score_mod, prob_mod) = match parsed {
        Ok(x) => x,
        Err(e) => return Ok(Some(e.0)),
    };
    // The softmax precision, as the reference: the attribute, else f32 (f64 for f64).
    let cd = match precision {
        Some(c) => match DType::from_onnx(c as i32) {
            Some(d) if matches!(d, DType::F32 | DType::F16 | DType::BF16 | DType::F64) => d,
            _ => return Ok(Some(format!("unsupported softmax_precision {c}"))),
        },
        None if dt == DType::F64 => DType::F64,
        None => DType::F32,
    };
    let scores_ty = ValueType::tensor(cd, &[b, hq, l, s]);
    // The modifiers must give values that broadcast to the scores.
    for (what, m) in [("score_mod", &score_mod), ("prob_mod", &prob_mod)] {
        let Some(m) = m else { continue };
        if m.inputs.len() != 1 || m.outputs.len() != 1 {
            return Ok(Some(format!("{what} must take and give one tensor")));
        }
        let ty = match typed_body(g, budget, known, m, &[(scores_ty.clone(), None)]) {
            Ok((tb, _)) => tb.value(tb.outputs[0]).ty.clone(),
            Err(e) => return Ok(Some(format!("{what} cannot be compiled: {e}"))),
        };
        let fits = ty.dtype().is_some_and(|d| d.is_float())
            && ty.static_shape().is_some_and(|sh| {
                crate::ir::broadcast_shapes(&sh, &[b, hq, l, s]).as_deref()
                    == Some(&[b, hq, l, s][..])
            });
        if !fits {
            return Ok(Some(format!(
                "{what} gives {ty}, which does not broadcast to the scores {scores_ty}"
            )));
        }
    }
    let p = node_prefix(g, n);
    let i64s = |x: &[usize]| Tensor::from_vec(&[x.len()], x.iter().map(|&d| d as i64).collect());
    // sqrt(scale), rounded to f32 then to the input type, as the reference.
    let scale = scale.map(|x| x as f64).unwrap_or(1.0 / (e as f64).sqrt()) as f32;
    let ss = (scale as f64).sqrt() as f32 as f64;
    let ss = add_const(
        g,
        &format!("{p}/sqrt_scale"),
        Tensor::from_f64(dt, ndarray::arr0(ss).into_dyn(), false),
    );
    // K and V heads repeated for grouped queries.
    let rep = hq / hkv;
    let align = |g: &mut Graph, x: ValueId, what: &str, d: usize| -> Result<ValueId> {
        if rep == 1 {
            return Ok(x);
        }
        let u = reshape(
            g,
            OPSET,
            &format!("{p}/{what}_unsqueezed"),
            x,
            &[b, hkv, 1, s, d],
        )?;
        let es = add_const(
            g,
            &format!("{p}/{what}_expand_shape"),
            i64s(&[b, hkv, rep, s, d]),
        );
        let x = add_op(
            g,
            OPSET,
            &format!("{p}/{what}_expanded"),
            "Expand",
            &[],
            &[u, es],
        )?;
        let rs = add_const(
            g,
            &format!("{p}/{what}_aligned_shape"),
            i64s(&[b, hq, s, d]),
        );
        add_op(
            g,
            OPSET,
            &format!("{p}/{what}_aligned"),
            "Reshape",
            &[],
            &[x, rs],
        )
    };
    let ka = align(g, k, "k", e)?;
    let va = align(g, v, "v", ev)?;
    let qsc = add_op(g, OPSET, &format!("{p}/q_scaled"), "Mul", &[], &[q, ss])?;
    let ksc = add_op(g, OPSET, &format!("{p}/k_scaled"), "Mul", &[], &[ka, ss])?;
    let kt = add_op(
        g,
        OPSET,
        &format!("{p}/k_transposed"),
        "Transpose",
        &[("perm", Attr::Ints(vec![0, 1, 3, 2]))],
        &[ksc],
    )?;
    let score = add_op(g, OPSET, &format!("{p}/score"), "MatMul", &[], &[qsc, kt])?;
    let cast = |g: &mut Graph, x: ValueId, to: DType, name: &str| -> Result<ValueId> {
        add_op(
            g,
            OPSET,
            name,
            "Cast",
            &[("to", Attr::Int(to.onnx_code() as i64))],
            &[x],
        )
    };
    let mut score = cast(g, score, cd, &format!("{p}/score_cast"))?;
    let modify =
        |g: &mut Graph, x: ValueId, what: &str, m: &Option<Arc<Graph>>| -> Result<ValueId> {
            let Some(m) = m else { return Ok(x) };
            let y = inline_body(g, budget, &format!("{p}/{what}"), m, &[x])?[0];
            // Rounded to the softmax precision and broadcast to the scores, as the reference.
            let y = cast(g, y, cd, &format!("{p}/{what}_cast"))?;
            let full = add_const(g, &format!("{p}/{what}_shape"), i64s(&[b, hq, l, s]));
            add_op(
                g,
                OPSET,
                &format!("{p}/{what}_expanded"),
                "Expand",
                &[],
                &[y, full],
            )
        };
    score = modify(g, score, "score_mod", &score_mod)?;
    let prob = add_op(
        g,
        OPSET,
        &format!("{p}/prob"),
        "Softmax",
        &[("axis", Attr::Int(3))],
        &[score],
    )?;
    let prob = modify(g, prob, "prob_mod", &prob_mod)?;
    let vc = cast(g, va, cd, &format!("{p}/v_cast"))?;
    let y = add_op(g, OPSET, &format!("{p}/y"), "MatMul", &[], &[prob, vc])?;
    g.remove_node(n);
    add_node_to(
        g,
        OPSET,
        format!("{p}/output"),
        "Cast",
        &[("to", Attr::Int(dt.onnx_code() as i64))],
        vec![Some(y)],
        vec![node.outputs[0]],
    )?;
    Ok(None)
}

#[cfg(test)]
mod tests {
    use crate::ir::{Attr, DType, Tensor};
    use crate::passes::testutil::*;

    #[test]
    fn grouped_query_flex_attention_with_modifiers_expands() {
        // 4 query heads over 2 key/value heads; score_mod adds a bias, prob_mod scales.
        let mut b = Builder::new();
        let q = b.input("q", &[1, 4, 3, 8]);
        let k = b.input("k", &[1, 2, 5, 8]);
        let v = b.input("v", &[1, 2, 5, 6]);
        let mut s = Sub::new("score_mod");
        let x = s.input("scores", DType::F32, &[1, 4, 3, 5]);
        let bias = s.konst(
            "bias",
            Tensor::from_vec(&[5], vec![0.5f32, -1., 0., 2., 0.25]),
        );
        let y = s.node("Add", &[x, bias], &[]);
        let score_mod = s.finish(&[y]);
        let mut s = Sub::new("prob_mod");
        let x = s.input("probs", DType::F32, &[1, 4, 3, 5]);
        let half = s.konst("half", Tensor::scalar(0.5f32));
        let y = s.node("Mul", &[x, half], &[]);
        let prob_mod = s.finish(&[y]);
        let y = b.node_sub_in(
            "ai.onnx.preview",
            "FlexAttention",
            vec![Some(q), Some(k), Some(v)],
            1,
            &[
                ("score_mod", score_mod),
                ("prob_mod", prob_mod),
                ("scale", Attr::Float(0.3)),
            ],
        );
        let mut g = b.finish_untyped(&y);
        let ins = random_inputs(&g, 11);
        check_inlined_close(&mut g, &[ins], 1e-6);
        assert_eq!(
            g.value(g.outputs[0]).ty.static_shape(),
            Some(vec![1, 4, 3, 6])
        );
    }
}
