//! Small helpers shared by the graph passes: rewiring values around removed nodes,
//! building nodes, constants and broadcast arithmetic on constant tensors.

use crate::error::{Error, Result};
use crate::ir::{Attrs, DType, Graph, Node, NodeId, Source, Tensor, ValueId, ValueType};
use crate::ops::{OpCtx, Registry};
use ndarray::{ArrayD, IxDyn, Zip};

/// Rewrites, in schedule order, every node that `plan` accepts (skipping nodes an earlier
/// rewrite removed), then rewires the graph: the driver of the passes that match a
/// pattern anchored at one node and replace it.
pub fn rewrite_planned<P>(
    g: &mut Graph,
    plan: impl Fn(&Graph, NodeId) -> Option<P>,
    mut rewrite: impl FnMut(&mut Graph, NodeId, P) -> Result<()>,
) -> Result<()> {
    for n in order(g)? {
        if !g.nodes.contains_node(n) {
            continue;
        }
        if let Some(p) = plan(g, n) {
            rewrite(g, n, p)?;
        }
    }
    g.rewire();
    Ok(())
}

/// Runs `fold` on every node in schedule order (skipping nodes an earlier rewrite
/// removed), rewires the graph, and prunes dead nodes when any rewrite happened: the
/// driver of the passes that fold one node at a time into its neighbours.
pub fn fold_each(g: &mut Graph, fold: fn(&mut Graph, NodeId) -> Result<bool>) -> Result<()> {
    let mut changed = false;
    for n in order(g)? {
        if g.nodes.contains_node(n) && fold(g, n)? {
            changed = true;
        }
    }
    g.rewire();
    if changed {
        super::eliminate_dead_code::prune(g)?;
    }
    Ok(())
}

/// Nodes in schedule order, or an error naming a cycle.
pub fn order(g: &Graph) -> Result<Vec<NodeId>> {
    g.topo_order()
        .map_err(|c| Error::model(format!("cycle through {}", c.join(", "))))
}

/// Readers of `out` (produced by a node about to be removed) are made to read `with`
/// instead. When `out` is a graph output, its name must survive: the producer of `with`
/// then writes `out` directly. Returns false (and changes nothing) when that is not
/// possible; the caller then keeps the node.
pub fn bypass(g: &mut Graph, out: ValueId, with: ValueId) -> bool {
    if out == with || g.value(out).ty != g.value(with).ty {
        return false;
    }
    let implicit = |g: &Graph, v| {
        g.nodes
            .node_indices()
            .any(|n| g.nodes[n].implicit.contains(&v))
    };
    if implicit(g, out) {
        return false;
    }
    if !g.outputs.contains(&out) {
        g.replace_uses(out, with);
        return true;
    }
    // `out` is a graph output: rename `with` into it.
    let Source::Node(p) = g.value(with).source else {
        return false;
    };
    if g.outputs.contains(&with) || implicit(g, with) {
        return false;
    }
    for o in g.nodes[p].outputs.iter_mut() {
        if *o == with {
            *o = out;
        }
    }
    g.replace_uses(with, out);
    g.value_mut(out).source = Source::Node(p);
    g.value_mut(with).source = Source::Undefined;
    true
}

/// The one node that reads `v` (through exactly one input slot), when `v` is not a graph
/// output and no subgraph names it.
pub fn sole_reader(g: &Graph, v: ValueId) -> Option<NodeId> {
    if g.is_pinned(v) {
        return None;
    }
    let readers = g.readers(v);
    if readers.len() != 1 {
        return None;
    }
    let n = readers[0];
    let uses = g.nodes[n].inputs.iter().filter(|i| **i == Some(v)).count();
    (uses == 1).then_some(n)
}

/// The node producing `v`, if `v` is a node output.
pub fn producer(g: &Graph, v: ValueId) -> Option<NodeId> {
    match g.value(v).source {
        Source::Node(n) if g.nodes.contains_node(n) => Some(n),
        _ => None,
    }
}

/// True for a node of the default ONNX domain with this op type.
pub fn is_op(g: &Graph, n: NodeId, op: &str) -> bool {
    let node = &g.nodes[n];
    node.op_type == op && node.domain.is_empty()
}

/// `anchor` takes over the first output of `follower`, which is removed; the anchor's old
/// output (read only by the follower) becomes undefined.
pub fn absorb(g: &mut Graph, anchor: NodeId, follower: NodeId) {
    let old = g.nodes[anchor].outputs[0];
    let new = g.nodes[follower].outputs[0];
    g.nodes[anchor].outputs[0] = new;
    g.remove_node(follower);
    g.value_mut(new).source = Source::Node(anchor);
    g.value_mut(old).source = Source::Undefined;
}

/// For a DequantizeLinear or QuantizeLinear (`op`) node of the default domain, not
/// blocked: (x, scale, zero point, axis).
pub fn quant_operands(
    g: &Graph,
    n: NodeId,
    op: &str,
) -> Option<(ValueId, ValueId, Option<ValueId>, i64)> {
    if !is_op(g, n, op) {
        return None;
    }
    let node = &g.nodes[n];
    if node.attrs.int("block_size", 0).ok()? != 0 {
        return None;
    }
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    Some((
        input(0)?,
        input(1)?,
        input(2),
        node.attrs.int("axis", 1).ok()?,
    ))
}

/// The node's inputs `(x, scale, zero point)` when it is a per-tensor, unblocked
/// DequantizeLinear or QuantizeLinear (`op`) with a constant scale of one value and a
/// constant zero point of one value, or none.
pub fn per_tensor_quant(
    g: &Graph,
    n: NodeId,
    op: &str,
) -> Option<(ValueId, ValueId, Option<ValueId>)> {
    let (x, s, z, _) = quant_operands(g, n, op)?;
    let one = |v: ValueId| g.const_of(v).is_some_and(|t| t.len() == 1);
    (one(s) && z.is_none_or(one)).then_some((x, s, z))
}

/// Whether two constants hold the same values of the same type.
pub fn same_const(g: &Graph, a: ValueId, b: ValueId) -> bool {
    match (g.const_of(a), g.const_of(b)) {
        (Some(x), Some(y)) => x.dtype() == y.dtype() && x.to_f64() == y.to_f64(),
        _ => false,
    }
}

/// Whether two optional zero points are the same: both absent, or equal constants.
pub fn same_zero_point(g: &Graph, a: Option<ValueId>, b: Option<ValueId>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => same_const(g, a, b),
        _ => false,
    }
}

/// Builds the op of a node from its (possibly edited) attributes and input count.
pub fn rebuild(node: &mut Node) -> Result<()> {
    let ctx = OpCtx {
        op_type: node.op_type.clone(),
        domain: node.domain.clone(),
        attrs: node.attrs.clone(),
        opset: node.opset,
        n_inputs: node.inputs.len(),
        n_outputs: node.outputs.len(),
    };
    node.op = match Registry::standard().build(ctx) {
        Some(Ok(op)) => op,
        Some(Err(e)) => return Err(Error::model(format!("rebuilding {}: {e}", node.op_type))),
        None => return Err(Error::model(format!("no op {}", node.op_type))),
    };
    Ok(())
}

/// A new node of the default domain (outputs must exist already).
pub fn new_node(
    name: String,
    op_type: &str,
    attrs: Attrs,
    opset: i64,
    inputs: Vec<Option<ValueId>>,
    outputs: Vec<ValueId>,
) -> Result<Node> {
    let mut node = Node {
        name,
        op_type: op_type.to_string(),
        domain: String::new(),
        opset,
        attrs,
        op: Registry::standard()
            .build(OpCtx {
                op_type: "Identity".into(),
                domain: String::new(),
                attrs: Attrs::default(),
                opset,
                n_inputs: 1,
                n_outputs: 1,
            })
            .and_then(|r| r.ok())
            .ok_or_else(|| Error::model("no Identity op"))?,
        inputs,
        outputs,
        implicit: Vec::new(),
    };
    rebuild(&mut node)?;
    Ok(node)
}

/// Adds a constant under a fresh name derived from `base`.
pub fn add_const(g: &mut Graph, base: &str, t: Tensor) -> ValueId {
    let name = g.fresh_name(base);
    g.add_const(name, t)
}

/// The static shape of a value.
pub fn shape_of(g: &Graph, v: ValueId) -> Option<Vec<usize>> {
    g.value(v).ty.static_shape()
}

/// `v`'s type with dtype `dt` (same shape): the type of a cast of it.
pub fn retyped(g: &Graph, v: ValueId, dt: DType) -> ValueType {
    match &g.value(v).ty {
        ValueType::Tensor { shape, .. } => ValueType::Tensor {
            dt,
            shape: shape.clone(),
        },
        t => t.clone(),
    }
}

/// The dtype of a value.
pub fn dtype_of(g: &Graph, v: ValueId) -> Option<DType> {
    g.value(v).ty.dtype()
}

/// Float dtypes the algebraic folds rewrite (computing in f64 and rounding once is at
/// least as exact as the unfolded graph for these).
pub fn foldable_float(dt: Option<DType>) -> bool {
    matches!(dt, Some(DType::F32 | DType::F64))
}

/// A constant as f64 elements.
pub fn const_f64(g: &Graph, v: Option<ValueId>) -> Option<ArrayD<f64>> {
    g.const_of(v?)?.to_f64()
}

/// `f(a, b)` elementwise with NumPy broadcasting.
pub fn zip_broadcast(
    a: &ArrayD<f64>,
    b: &ArrayD<f64>,
    f: impl Fn(f64, f64) -> f64,
) -> Option<ArrayD<f64>> {
    let shape = crate::ir::broadcast_shapes(a.shape(), b.shape())?;
    let av = a.broadcast(IxDyn(&shape))?;
    let bv = b.broadcast(IxDyn(&shape))?;
    Some(Zip::from(&av).and(&bv).map_collect(|&x, &y| f(x, y)))
}

/// When `c` broadcast against a value of shape `y` leaves `y`'s shape unchanged and
/// varies only along `axis` of `y`, the vector of its values along that axis (length
/// `y[axis]`).
pub fn along_axis(c: &ArrayD<f64>, y: &[usize], axis: usize) -> Option<Vec<f64>> {
    let r = y.len();
    if c.ndim() > r || axis >= r {
        return None;
    }
    let off = r - c.ndim();
    for (i, &d) in c.shape().iter().enumerate() {
        let ax = off + i;
        if d != 1 && (ax != axis || d != y[axis]) {
            return None;
        }
    }
    let flat: Vec<f64> = c.iter().copied().collect();
    Some(if flat.len() == 1 {
        vec![flat[0]; y[axis]]
    } else {
        flat
    })
}

/// A tensor of dtype `dt` from f64 values.
pub fn tensor_f64(dt: DType, a: ArrayD<f64>) -> Tensor {
    Tensor::from_f64(dt, a, false)
}

/// Bytes that identify a tensor's dtype, shape and exact elements (floats by bit
/// pattern), or None for strings.
pub fn tensor_key(t: &Tensor) -> Option<Vec<u8>> {
    let mut k = Vec::new();
    k.extend_from_slice(&t.dtype().onnx_code().to_le_bytes());
    k.extend_from_slice(&(t.rank() as u64).to_le_bytes());
    for &d in t.shape() {
        k.extend_from_slice(&(d as u64).to_le_bytes());
    }
    if t.dtype().is_float() {
        for x in t.to_f64()?.iter() {
            k.extend_from_slice(&x.to_bits().to_le_bytes());
        }
    } else {
        for x in t.to_i128()?.iter() {
            k.extend_from_slice(&x.to_le_bytes());
        }
    }
    Some(k)
}

/// `[dims]` as an int64 tensor (for Reshape shapes).
pub fn shape_tensor(dims: &[usize]) -> Tensor {
    Tensor::from_vec(&[dims.len()], dims.iter().map(|&d| d as i64).collect())
}

/// Reads a constant input of a node as i64 values.
pub fn const_ints(g: &Graph, v: Option<ValueId>) -> Option<Vec<i64>> {
    g.const_of(v?)?.to_i64_vec()
}

/// Same static type (dtype and shape).
pub fn same_type(g: &Graph, a: ValueId, b: ValueId) -> bool {
    let (ta, tb) = (&g.value(a).ty, &g.value(b).ty);
    ta == tb && matches!(ta, ValueType::Tensor { .. }) && ta.is_static()
}

/// A unique-enough node name for a node derived from `base`.
pub fn derived_name(base: &str, suffix: &str) -> String {
    if base.is_empty() {
        suffix.to_string()
    } else {
        format!("{base}/{suffix}")
    }
}

/// Builds an f64 array of `shape` from a flat vector (shape checked by the caller).
pub fn array(shape: &[usize], v: Vec<f64>) -> ArrayD<f64> {
    ArrayD::from_shape_vec(IxDyn(shape), v).expect("element count matches shape")
}

/// A Conv or ConvTranspose node whose weight (and bias, if any) are float constants:
/// what the algebraic folds need to rewrite it.
pub struct ConvWeights {
    pub w: ArrayD<f64>,
    pub b: Option<ArrayD<f64>>,
    pub dt: DType,
    /// Output channels.
    pub m: usize,
    transpose: bool,
    group: usize,
}

impl ConvWeights {
    pub fn of(g: &Graph, n: NodeId) -> Option<ConvWeights> {
        let node = &g.nodes[n];
        let transpose = is_op(g, n, "ConvTranspose");
        if !(transpose || is_op(g, n, "Conv")) || node.outputs.len() != 1 {
            return None;
        }
        let y = node.outputs[0];
        let wv = node.inputs.get(1).copied().flatten()?;
        let dt = dtype_of(g, y);
        if !foldable_float(dt) || dtype_of(g, wv) != dt {
            return None;
        }
        let w = const_f64(g, Some(wv))?;
        let b = match node.inputs.get(2).copied().flatten() {
            Some(bv) => Some(const_f64(g, Some(bv))?),
            None => None,
        };
        let m = *shape_of(g, y)?.get(1)?;
        let group = node.attrs.int("group", 1).ok()?.max(1) as usize;
        if w.ndim() < 2 || b.as_ref().is_some_and(|b| b.len() != m) {
            return None;
        }
        let ok = if transpose {
            w.shape()[1] * group == m && w.shape()[0] % group == 0
        } else {
            w.shape()[0] == m
        };
        ok.then_some(ConvWeights {
            w,
            b,
            dt: dt?,
            m,
            transpose,
            group,
        })
    }

    /// Multiplies every weight of output channel `o` by `s[o]`.
    pub fn scale(&mut self, s: &[f64]) {
        let sh = self.w.shape().to_vec();
        let k: usize = sh[2..].iter().product();
        let (c_in, per_group_out) = (sh[0], sh[1]);
        let m = self.m;
        let transpose = self.transpose;
        let group = self.group;
        for (i, x) in self.w.iter_mut().enumerate() {
            let o = if transpose {
                let c = i / (per_group_out * k);
                let j = (i / k) % per_group_out;
                (c / (c_in / group)) * per_group_out + j
            } else {
                i / (sh[1] * k)
            };
            *x *= s[o.min(m - 1)];
        }
    }

    /// Writes the weight and bias back into node `n` as new constants.
    pub fn store(self, g: &mut Graph, n: NodeId) -> Result<()> {
        let name = g.nodes[n].name.clone();
        let base = if name.is_empty() {
            "conv".to_string()
        } else {
            name
        };
        let w = add_const(g, &format!("{base}_w_folded"), tensor_f64(self.dt, self.w));
        let b = self.b.unwrap_or_else(|| ArrayD::zeros(IxDyn(&[self.m])));
        let b = add_const(g, &format!("{base}_b_folded"), tensor_f64(self.dt, b));
        let node = &mut g.nodes[n];
        node.inputs.truncate(1);
        node.inputs.push(Some(w));
        node.inputs.push(Some(b));
        rebuild(node)
    }
}
