//! Loop and Scan nodes whose trip counts are known at compile time are unrolled: the
//! body's nodes are copied once per iteration (`LOOPNAME/iterK/name`), loop-carried
//! values flow from one copy to the next, and the per-iteration scan outputs are stacked
//! with Reshape + Concat.
//!
//! - A Loop's trip count follows from its `M` input and its condition input, which must be
//!   known at compile time, and from the condition the body computes each iteration,
//!   which must fold at compile time (from the iteration number, constants, and
//!   loop-carried values that are constant themselves). Otherwise the number of
//!   iterations, and so the scan outputs' shapes, depend on the data: the Loop is refused
//!   with that reason.
//! - A Scan runs once per slice of its scan inputs along their scan axes (static shapes),
//!   in either direction; opset 8's batched form runs once per batch entry.
//!
//! Loop-carried values (Loop and Scan state) must keep their type from one iteration to
//! the next, and scan outputs must have one static type. The unrolled size is capped at
//! [`MAX_UNROLLED_NODES`] nodes per loop.

use super::inline_if::node_prefix;
use super::inline_util::{
    add_op, empty_to, identity_to, inline_body, known_flag, rewrite_each, stack_into, typed_body,
    Budget,
};
use super::util::add_const;
use crate::error::Result;
use crate::ir::{Attr, DType, Graph, NodeId, Tensor, Value, ValueId, ValueType};
use std::collections::{BTreeMap, HashMap};

/// The most nodes one Loop or Scan may unroll into (each becomes at least one kernel).
pub const MAX_UNROLLED_NODES: usize = 20_000;

/// Unrolls every Loop and Scan whose trip count is known; `refused` gets, by node label,
/// why each other one is left alone. Returns how many were unrolled.
pub fn unroll_loops(
    g: &mut Graph,
    budget: &Budget,
    known: &HashMap<ValueId, Value>,
    refused: &mut BTreeMap<String, String>,
) -> Result<usize> {
    let loops: Vec<NodeId> = g
        .nodes
        .node_indices()
        .filter(|&n| {
            let node = &g.nodes[n];
            node.domain.is_empty() && matches!(node.op_type.as_str(), "Loop" | "Scan")
        })
        .collect();
    rewrite_each(g, loops, refused, |g, n| {
        if g.nodes[n].op_type == "Loop" {
            unroll_loop(g, budget, n, known)
        } else {
            unroll_scan(g, budget, n, known)
        }
    })
}

fn scalar_type(dt: DType) -> ValueType {
    ValueType::tensor(dt, &[])
}

fn too_big(nodes: usize) -> String {
    format!(
        "unrolling it would take more than {MAX_UNROLLED_NODES} nodes ({nodes} or more); \
         loops are compiled by unrolling, so only short ones are supported"
    )
}

/// The static type of input `i` of `n` (None when absent or not known yet).
fn static_input(g: &Graph, n: NodeId, i: usize) -> Option<(ValueId, ValueType)> {
    let v = (*g.nodes[n].inputs.get(i)?)?;
    let ty = g.value(v).ty.clone();
    ty.is_static().then_some((v, ty))
}

/// Unrolls one Loop; Some(reason) when it cannot (the graph is untouched).
fn unroll_loop(
    g: &mut Graph,
    budget: &Budget,
    n: NodeId,
    known: &HashMap<ValueId, Value>,
) -> Result<Option<String>> {
    let node = g.nodes[n].clone();
    let Ok(body) = node.attrs.graph("body") else {
        return Ok(Some("its body is missing".into()));
    };
    let trips = match node.inputs.first().copied().flatten() {
        None => None,
        Some(m) => match known.get(&m) {
            Some(Value::Tensor(t)) if t.len() == 1 => t.to_f64_vec().map(|x| x[0] as i64),
            _ => {
                return Ok(Some(
                    "its trip count M is not known at compile time, so the number of \
                     iterations depends on the data"
                        .into(),
                ))
            }
        },
    };
    let mut cond = match node.inputs.get(1).copied().flatten() {
        None => true,
        Some(c) => match known_flag(known, c) {
            Some(c) => c,
            None => {
                return Ok(Some(
                    "its condition is not known at compile time, so the number of \
                     iterations depends on the data"
                        .into(),
                ))
            }
        },
    };
    if trips.is_none() && node.inputs.get(1).copied().flatten().is_none() {
        return Ok(Some(
            "it has neither a trip count nor a condition (it never ends)".into(),
        ));
    }
    let n_carried = node.inputs.len().saturating_sub(2);
    let mut state: Vec<(ValueType, Option<Tensor>)> = Vec::with_capacity(n_carried);
    for i in 2..node.inputs.len() {
        let Some((v, ty)) = static_input(g, n, i) else {
            return Ok(Some(format!(
                "the type of its loop-carried input {} is not known",
                i - 2
            )));
        };
        let val = match known.get(&v) {
            Some(Value::Tensor(t)) => Some(t.clone()),
            _ => None,
        };
        state.push((ty, val));
    }
    if body.outputs.len() < 1 + n_carried || body.inputs.len() != 2 + n_carried {
        return Ok(Some(format!(
            "its body has {} inputs and {} outputs; it needs {} inputs and at least {} outputs",
            body.inputs.len(),
            body.outputs.len(),
            2 + n_carried,
            1 + n_carried
        )));
    }
    let n_scan = body.outputs.len() - 1 - n_carried;
    let per_iter = body.node_count() + 2 * n_scan + 1;
    // Run the condition at compile time, typing the body once per iteration.
    let mut conds = Vec::new();
    let mut scan_types: Option<Vec<ValueType>> = None;
    let mut k: i64 = 0;
    while cond && trips.is_none_or(|m| k < m) {
        let size = (k as usize + 1).saturating_mul(per_iter);
        if size > MAX_UNROLLED_NODES {
            return Ok(Some(too_big(size)));
        }
        let mut ins = vec![
            (scalar_type(DType::I64), Some(Tensor::scalar(k))),
            (scalar_type(DType::Bool), Some(Tensor::scalar(cond))),
        ];
        ins.extend(state.iter().cloned());
        let (tb, rep) = match typed_body(g, budget, known, &body, &ins) {
            Ok(x) => x,
            Err(e) => {
                return Ok(Some(format!(
                    "iteration {k} of its body cannot be compiled: {e}"
                )))
            }
        };
        conds.push(cond);
        cond = match known_flag(&rep.known, tb.outputs[0]) {
            Some(c) => c,
            None => {
                return Ok(Some(
                    "the condition its body computes is not known at compile time, so the \
                     number of iterations depends on the data"
                        .into(),
                ))
            }
        };
        for (j, s) in state.iter_mut().enumerate() {
            let o = tb.outputs[1 + j];
            let ty = &tb.value(o).ty;
            if *ty != s.0 {
                return Ok(Some(format!(
                    "loop-carried value {j} changes type from {} to {ty} in iteration {k}; \
                     only loops whose carried values keep a static type are compiled",
                    s.0
                )));
            }
            s.1 = match rep.known.get(&o) {
                Some(Value::Tensor(t)) => Some(t.clone()),
                _ => None,
            };
        }
        let tys: Vec<ValueType> = tb.outputs[1 + n_carried..]
            .iter()
            .map(|&o| tb.value(o).ty.clone())
            .collect();
        if let Some(t) = tys.iter().find(|t| !t.is_static()) {
            return Ok(Some(format!(
                "a scan output of its body has no static type ({t}) in iteration {k}"
            )));
        }
        match &scan_types {
            Some(prev) if *prev != tys => {
                return Ok(Some(format!(
                    "its scan outputs change type in iteration {k}, so they cannot be stacked"
                )))
            }
            _ => scan_types = Some(tys),
        }
        k += 1;
    }
    // Unroll.
    let prefix = node_prefix(g, n);
    let mut carried: Vec<ValueId> = node.inputs[2..]
        .iter()
        .map(|i| i.expect("checked"))
        .collect();
    let mut scans: Vec<Vec<ValueId>> = vec![Vec::new(); n_scan];
    for (k, &c) in conds.iter().enumerate() {
        let it = add_const(g, &format!("{prefix}/iter{k}/i"), Tensor::scalar(k as i64));
        let cv = add_const(g, &format!("{prefix}/iter{k}/cond"), Tensor::scalar(c));
        let mut args = vec![it, cv];
        args.extend(&carried);
        let outs = inline_body(g, budget, &format!("{prefix}/iter{k}"), &body, &args)?;
        carried = outs[1..1 + n_carried].to_vec();
        for (j, s) in scans.iter_mut().enumerate() {
            s.push(outs[1 + n_carried + j]);
        }
    }
    g.remove_node(n);
    for (j, &o) in node.outputs.iter().enumerate().take(n_carried) {
        identity_to(g, node.opset, format!("{prefix}/output{j}"), carried[j], o)?;
    }
    for (j, &o) in node.outputs.iter().enumerate().skip(n_carried) {
        let items = &scans[j - n_carried];
        if items.is_empty() {
            // No iteration: an empty [0] tensor of the body's dtype (as the evaluator).
            let dt = body
                .value(body.outputs[1 + j])
                .ty
                .dtype()
                .unwrap_or(DType::F32);
            let names = (format!("{prefix}/empty{j}"), format!("{prefix}/output{j}"));
            empty_to(g, node.opset, dt, names, o)?;
        } else {
            let item = scan_types
                .as_ref()
                .and_then(|t| t[j - n_carried].static_shape())
                .expect("typed in every iteration");
            stack_into(
                g,
                node.opset,
                &format!("{prefix}/scan{}", j - n_carried),
                items,
                &item,
                0,
                o,
            )?;
        }
    }
    Ok(None)
}

/// Scan attributes, with the scan axes not yet normalized.
struct ScanAttrs {
    n_scan_in: usize,
    in_axes: Vec<i64>,
    in_dirs: Vec<i64>,
    out_axes: Vec<i64>,
    out_dirs: Vec<i64>,
}

/// Unrolls one Scan; Some(reason) when it cannot (the graph is untouched).
fn unroll_scan(
    g: &mut Graph,
    budget: &Budget,
    n: NodeId,
    known: &HashMap<ValueId, Value>,
) -> Result<Option<String>> {
    let node = g.nodes[n].clone();
    let Ok(body) = node.attrs.graph("body") else {
        return Ok(Some("its body is missing".into()));
    };
    let batched = node.opset < 9;
    let at = &node.attrs;
    let attrs = (|| -> crate::ir::OpResult<ScanAttrs> {
        let mut in_dirs = at.ints("directions", &[])?;
        if in_dirs.is_empty() {
            in_dirs = at.ints("scan_input_directions", &[])?;
        }
        Ok(ScanAttrs {
            n_scan_in: at.req_int("num_scan_inputs")?.max(0) as usize,
            in_axes: at.ints("scan_input_axes", &[])?,
            in_dirs,
            out_axes: at.ints("scan_output_axes", &[])?,
            out_dirs: at.ints("scan_output_directions", &[])?,
        })
    })();
    let attrs = match attrs {
        Ok(a) => a,
        Err(e) => return Ok(Some(e.0)),
    };
    let first = usize::from(batched);
    if batched && node.inputs.first().copied().flatten().is_some() {
        return Ok(Some(
            "its sequence_lens input is not supported (per-batch lengths)".into(),
        ));
    }
    let mut ins = Vec::new();
    for i in first..node.inputs.len() {
        match static_input(g, n, i) {
            Some(x) => ins.push(x),
            None => {
                return Ok(Some(format!(
                    "the type of its input {i} is not known statically"
                )))
            }
        }
    }
    let m = attrs.n_scan_in;
    if m > ins.len() || body.inputs.len() != ins.len() {
        return Ok(Some(format!(
            "it has {} inputs, num_scan_inputs is {m} and its body takes {}",
            ins.len(),
            body.inputs.len()
        )));
    }
    let n_state = ins.len() - m;
    if body.outputs.len() < n_state || node.outputs.len() > body.outputs.len() {
        return Ok(Some(
            "its body gives fewer values than it has state variables and outputs".into(),
        ));
    }
    let n_scan_out = body.outputs.len() - n_state;
    // Shapes without the batch axis.
    let batch = if batched {
        match ins[0].1.static_shape().and_then(|s| s.first().copied()) {
            Some(b) => b,
            None => return Ok(Some("its inputs have no batch axis".into())),
        }
    } else {
        1
    };
    let per_entry = |ty: &ValueType| -> Option<(DType, Vec<usize>)> {
        let mut s = ty.static_shape()?;
        if batched {
            if s.first() != Some(&batch) {
                return None;
            }
            s.remove(0);
        }
        Some((ty.dtype()?, s))
    };
    let mut body_ins: Vec<(ValueType, Option<Tensor>)> = Vec::new();
    for (v, ty) in &ins[..n_state] {
        let Some((dt, s)) = per_entry(ty) else {
            return Ok(Some(format!(
                "state `{}` does not have the batch size {batch}",
                g.value(*v).name
            )));
        };
        body_ins.push((ValueType::tensor(dt, &s), None));
    }
    let mut len = None;
    let mut in_axes = Vec::new();
    for (j, (v, ty)) in ins[n_state..].iter().enumerate() {
        let Some((dt, mut s)) = per_entry(ty) else {
            return Ok(Some(format!(
                "scan input `{}` does not have the batch size {batch}",
                g.value(*v).name
            )));
        };
        let a = attrs.in_axes.get(j).copied().unwrap_or(0);
        let r = s.len() as i64;
        if a < -r || a >= r {
            return Ok(Some(format!("scan axis {a} is out of range for rank {r}")));
        }
        let a = if a < 0 { a + r } else { a } as usize;
        let l = s.remove(a);
        if len.is_some_and(|x| x != l) {
            return Ok(Some("its scan inputs have different lengths".into()));
        }
        len = Some(l);
        in_axes.push(a);
        body_ins.push((ValueType::tensor(dt, &s), None));
    }
    let len = len.unwrap_or(0);
    let per_iter = body.node_count() + m + n_scan_out + 1;
    let size = batch.saturating_mul(len).saturating_mul(per_iter);
    if size > MAX_UNROLLED_NODES {
        return Ok(Some(too_big(size)));
    }
    // The body's types are the same in every iteration (a Scan has no iteration input).
    let (tb, _) = match typed_body(g, budget, known, &body, &body_ins) {
        Ok(x) => x,
        Err(e) => return Ok(Some(format!("its body cannot be compiled: {e}"))),
    };
    for (j, (o, (want, _))) in tb.outputs.iter().zip(&body_ins).take(n_state).enumerate() {
        let ty = &tb.value(*o).ty;
        if ty != want {
            return Ok(Some(format!(
                "state {j} changes type from {want} to {ty}; only scans whose state keeps a \
                 static type are compiled"
            )));
        }
    }
    let mut items = Vec::new();
    for &o in &tb.outputs[n_state..] {
        let ty = &tb.value(o).ty;
        match ty.static_shape() {
            Some(s) if ty.is_static() => items.push(s),
            _ => {
                return Ok(Some(format!(
                    "a scan output of its body has no static type ({ty})"
                )))
            }
        }
    }
    // The shapes of one run's results: the states, then the stacked scan outputs.
    let mut run_shapes: Vec<Vec<usize>> = body_ins[..n_state]
        .iter()
        .map(|(t, _)| t.static_shape().expect("static"))
        .collect();
    for (j, item) in items.iter().enumerate() {
        let r = item.len() as i64;
        let a = attrs.out_axes.get(j).copied().unwrap_or(0);
        let a = if a < 0 { a + r + 1 } else { a };
        if !(0..=r).contains(&a) {
            return Ok(Some(format!("scan output axis {a} is out of range")));
        }
        let mut sh = item.clone();
        sh.insert(a as usize, len);
        run_shapes.push(sh);
    }
    // Unroll.
    let prefix = node_prefix(g, n);
    let states: Vec<ValueId> = ins[..n_state].iter().map(|x| x.0).collect();
    let xs: Vec<ValueId> = ins[n_state..].iter().map(|x| x.0).collect();
    let scan = Unroll {
        budget,
        opset: node.opset,
        items: &items,
        body: &body,
        attrs: &attrs,
        in_axes: &in_axes,
        len,
        n_state,
        n_scan_out,
    };
    if !batched {
        let outs = scan.once(g, &prefix, &states, &xs)?;
        g.remove_node(n);
        for (k, (&o, &v)) in node.outputs.iter().zip(&outs).enumerate() {
            identity_to(g, node.opset, format!("{prefix}/output{k}"), v, o)?;
        }
        return Ok(None);
    }
    // Opset 8: once per batch entry, then the results stacked along the batch axis.
    let mut per_out: Vec<Vec<ValueId>> = vec![Vec::new(); n_state + n_scan_out];
    for b in 0..batch {
        let p = format!("{prefix}/b{b}");
        let idx = add_const(g, &format!("{p}/index"), Tensor::scalar(b as i64));
        let take = |g: &mut Graph, k: usize, v: ValueId| {
            add_op(
                g,
                node.opset,
                &format!("{p}/entry{k}"),
                "Gather",
                &[("axis", Attr::Int(0))],
                &[v, idx],
            )
        };
        let mut sb = Vec::new();
        for (k, &v) in states.iter().enumerate() {
            sb.push(take(g, k, v)?);
        }
        let mut xb = Vec::new();
        for (k, &v) in xs.iter().enumerate() {
            xb.push(take(g, n_state + k, v)?);
        }
        let outs = scan.once(g, &p, &sb, &xb)?;
        for (k, v) in outs.into_iter().enumerate() {
            per_out[k].push(v);
        }
    }
    g.remove_node(n);
    for (k, &o) in node.outputs.iter().enumerate() {
        stack_into(
            g,
            node.opset,
            &format!("{prefix}/output{k}"),
            &per_out[k],
            &run_shapes[k],
            0,
            o,
        )?;
    }
    Ok(None)
}

/// What one run of a Scan over its scan axis needs.
struct Unroll<'a> {
    budget: &'a Budget,
    opset: i64,
    /// The shape of each scan output of one iteration.
    items: &'a [Vec<usize>],
    body: &'a Graph,
    attrs: &'a ScanAttrs,
    in_axes: &'a [usize],
    len: usize,
    n_state: usize,
    n_scan_out: usize,
}

impl Unroll<'_> {
    /// Copies the body once per slice; returns the final states, then the stacked scan
    /// outputs.
    fn once(
        &self,
        g: &mut Graph,
        prefix: &str,
        states: &[ValueId],
        xs: &[ValueId],
    ) -> Result<Vec<ValueId>> {
        let mut state = states.to_vec();
        let mut scans: Vec<Vec<ValueId>> = vec![Vec::new(); self.n_scan_out];
        for k in 0..self.len {
            let p = format!("{prefix}/iter{k}");
            let mut args = state.clone();
            for (j, &x) in xs.iter().enumerate() {
                let rev = self.attrs.in_dirs.get(j).copied().unwrap_or(0) == 1;
                let at = if rev { self.len - 1 - k } else { k };
                let idx = add_const(g, &format!("{p}/index{j}"), Tensor::scalar(at as i64));
                let axis = Attr::Int(self.in_axes[j] as i64);
                args.push(add_op(
                    g,
                    self.opset,
                    &format!("{p}/slice{j}"),
                    "Gather",
                    &[("axis", axis)],
                    &[x, idx],
                )?);
            }
            let outs = inline_body(g, self.budget, &p, self.body, &args)?;
            state = outs[..self.n_state].to_vec();
            for (j, s) in scans.iter_mut().enumerate() {
                s.push(outs[self.n_state + j]);
            }
        }
        let mut result = state;
        for (j, mut items) in scans.into_iter().enumerate() {
            let p = format!("{prefix}/scan{j}");
            let out = g.fresh_name(&p);
            let out = g.add_value(out, ValueType::Unknown, crate::ir::Source::Undefined);
            if items.is_empty() {
                let dt = self
                    .body
                    .value(self.body.outputs[self.n_state + j])
                    .ty
                    .dtype()
                    .unwrap_or(DType::F32);
                let names = (format!("{p}/empty"), format!("{p}/output"));
                empty_to(g, self.opset, dt, names, out)?;
            } else {
                if self.attrs.out_dirs.get(j).copied().unwrap_or(0) == 1 {
                    items.reverse();
                }
                let axis = self.attrs.out_axes.get(j).copied().unwrap_or(0);
                stack_into(g, self.opset, &p, &items, &self.items[j], axis, out)?;
            }
            result.push(out);
        }
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use crate::ir::{Attr, DType, Graph, Tensor, Value};
    use crate::passes::testutil::*;

    fn ys() -> Value {
        Value::Tensor(Tensor::from_vec(&[2], vec![1f32, -2.]))
    }

    /// Loop body (i, cond, y) -> (cond, y + i, y + i).
    fn counting_body() -> Attr {
        let mut s = Sub::new("body");
        let i = s.input("i", DType::I64, &[]);
        let c = s.input("cond", DType::Bool, &[]);
        let y = s.input("y", DType::F32, &[2]);
        let fi = s.node("Cast", &[i], &[("to", Attr::Int(1))]);
        let y2 = s.node("Add", &[y, fi], &[]);
        let c2 = s.node("Identity", &[c], &[]);
        s.finish(&[c2, y2, y2])
    }

    fn counting_loop(m_is_input: bool) -> Graph {
        let mut b = Builder::new();
        let m = if m_is_input {
            b.input_typed("m", DType::I64, &[])
        } else {
            b.konst_i64("m", &[], vec![3])
        };
        let y = b.input("y", &[2]);
        let outs = b.node_sub(
            "Loop",
            vec![Some(m), None, Some(y)],
            2,
            &[("body", counting_body())],
        );
        b.finish_untyped(&outs)
    }

    #[test]
    fn loop_with_a_constant_trip_count_unrolls() {
        let mut g = counting_loop(false);
        check_inlined(&mut g, &[vec![ys()]]);
        let out = g.outputs[1];
        assert_eq!(g.value(out).ty.static_shape(), Some(vec![3, 2]));
    }

    #[test]
    fn loop_with_a_runtime_trip_count_is_refused_with_the_reason() {
        let mut g = counting_loop(true);
        let rep = crate::passes::infer_and_inline(&mut g).unwrap();
        assert!(
            rep.unresolved[0].contains("(Loop): its trip count M is not known at compile time"),
            "{:?}",
            rep.unresolved
        );
    }

    #[test]
    fn while_loop_on_a_constant_counter_unrolls() {
        // j = 0; while j < 4 { j += 1; y *= 2 }: the condition folds every iteration.
        let mut s = Sub::new("body");
        s.input("i", DType::I64, &[]);
        s.input("cond", DType::Bool, &[]);
        let j = s.input("j", DType::I64, &[]);
        let y = s.input("y", DType::F32, &[2]);
        let one = s.konst("one", Tensor::scalar(1i64));
        let four = s.konst("four", Tensor::scalar(4i64));
        let two = s.konst("two", Tensor::scalar(2f32));
        let j1 = s.node("Add", &[j, one], &[]);
        let c = s.node("Less", &[j1, four], &[]);
        let y1 = s.node("Mul", &[y, two], &[]);
        let body = s.finish(&[c, j1, y1]);
        let mut b = Builder::new();
        let t = b.konst_t("t", Tensor::scalar(true));
        let j0 = b.konst_i64("j0", &[], vec![0]);
        let y = b.input("y", &[2]);
        let outs = b.node_sub(
            "Loop",
            vec![None, Some(t), Some(j0), Some(y)],
            2,
            &[("body", body)],
        );
        let mut g = b.finish_untyped(&outs);
        check_inlined(&mut g, &[vec![ys()]]);
    }

    #[test]
    fn scan_in_both_directions_and_on_other_axes_unrolls() {
        // State s: [2]; scan inputs a: [3, 2] (axis 0, reversed) and b: [2, 3] (axis 1);
        // body: s' = s + a_t * b_t; scan outputs s' (axis 1) and a_t (axis 0, reversed).
        let mut s = Sub::new("body");
        let st = s.input("s", DType::F32, &[2]);
        let a = s.input("a", DType::F32, &[2]);
        let bt = s.input("b", DType::F32, &[2]);
        let p = s.node("Mul", &[a, bt], &[]);
        let s1 = s.node("Add", &[st, p], &[]);
        let body = s.finish(&[s1, s1, a]);
        let mut b = Builder::new();
        let s0 = b.input("s0", &[2]);
        let xa = b.input("a", &[3, 2]);
        let xb = b.input("b", &[2, 3]);
        let outs = b.node_sub(
            "Scan",
            vec![Some(s0), Some(xa), Some(xb)],
            3,
            &[
                ("body", body),
                ("num_scan_inputs", Attr::Int(2)),
                ("scan_input_axes", Attr::Ints(vec![0, 1])),
                ("scan_input_directions", Attr::Ints(vec![1, 0])),
                ("scan_output_axes", Attr::Ints(vec![1, 0])),
                ("scan_output_directions", Attr::Ints(vec![0, 1])),
            ],
        );
        let mut g = b.finish_untyped(&outs);
        let ins = random_inputs(&g, 3);
        check_inlined(&mut g, &[ins]);
        assert_eq!(g.value(g.outputs[1]).ty.static_shape(), Some(vec![2, 3]));
    }

    #[test]
    fn nested_loops_stop_at_the_copy_budget() {
        // for 1000 { for 1000 { y += 1 } }: a million copies, refused with the reason.
        let mut s = Sub::new("inner");
        s.input("i", DType::I64, &[]);
        let c = s.input("cond", DType::Bool, &[]);
        let y = s.input("y", DType::F32, &[2]);
        let one = s.konst("one", Tensor::scalar(1f32));
        let y1 = s.node("Add", &[y, one], &[]);
        let inner = s.finish(&[c, y1]);
        let mut s = Sub::new("outer");
        s.input("i", DType::I64, &[]);
        let c = s.input("cond", DType::Bool, &[]);
        let y = s.input("y", DType::F32, &[2]);
        let m = s.konst("m", Tensor::scalar(1000i64));
        let y1 = s.node("Loop", &[m, c, y], &[("body", inner)]);
        let outer = s.finish(&[c, y1]);
        let mut b = Builder::new();
        let m = b.konst_i64("m", &[], vec![1000]);
        let t = b.konst_t("t", Tensor::scalar(true));
        let y = b.input("y", &[2]);
        let outs = b.node_sub(
            "Loop",
            vec![Some(m), Some(t), Some(y)],
            1,
            &[("body", outer)],
        );
        let mut g = b.finish_untyped(&outs);
        let t0 = std::time::Instant::now();
        let why = match crate::passes::infer_and_inline(&mut g) {
            Ok(rep) => rep.unresolved.join("\n"),
            Err(e) => e.to_string(),
        };
        assert!(why.contains("more than 200000 nodes in all"), "{why}");
        println!("{why}");
        assert!(t0.elapsed().as_secs() < 30, "took {:?}", t0.elapsed());
    }
}
