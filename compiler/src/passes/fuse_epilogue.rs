//! Epilogue fusion: a Conv, Gemm or MatMul followed by a chain of elementwise steps on
//! its output (bias or residual Add, Mul by a broadcast tensor, division by a constant,
//! Relu, Clip with constant bounds, Sigmoid, HardSigmoid, HardSwish, Swish/SiLU, Gelu,
//! LeakyRelu, Tanh) becomes one `onnxc.Fused` node, lowered as one kernel that applies
//! the steps before it stores each output element. A step joins only when the value it
//! reads has no other consumer and is not a graph output. A Conv's group also takes a
//! 2x2 MaxPool of stride 2 on the last step's output ([`is_max_pool_2x2`]).

use super::fuse_util::{const_scalar, fusible_output, known_values, users};
use crate::error::{Error, Result};
use crate::ir::{broadcast_shapes, DType, Graph, NodeId, ValueId};
use crate::ops::fused::fuse_nodes;
use std::collections::HashMap;

pub fn run(g: &mut Graph) -> Result<()> {
    let known = known_values(g)?;
    let order = g
        .topo_order()
        .map_err(|c| Error::model(format!("cycle through {}", c.join(", "))))?;
    for n in order {
        if !g.nodes.contains_node(n) {
            continue;
        }
        let node = &g.nodes[n];
        if !node.domain.is_empty()
            || !matches!(node.op_type.as_str(), "Conv" | "Gemm" | "MatMul")
            || node.outputs.len() != 1
            || known.contains_key(&node.outputs[0])
        {
            continue;
        }
        let out = node.outputs[0];
        let ty = &g.value(out).ty;
        let (Some(dt), Some(shape)) = (ty.dtype(), ty.static_shape()) else {
            continue;
        };
        if !matches!(dt, DType::F32 | DType::F64 | DType::F16) {
            continue;
        }
        let mut group = vec![n];
        let mut cur = out;
        loop {
            if let Some((sg, m)) = silu_pair(g, cur) {
                group.extend([sg, m]);
                cur = g.nodes[m].outputs[0];
                continue;
            }
            let Some(c) = fusible_output(g, cur) else {
                break;
            };
            if !is_step(g, &known, c, cur, dt, &shape) {
                break;
            }
            group.push(c);
            cur = g.nodes[c].outputs[0];
        }
        if g.nodes[n].op_type == "Conv" {
            if let Some(p) = fusible_output(g, cur).filter(|&p| is_max_pool_2x2(g, p, dt)) {
                group.push(p);
            }
        }
        if group.len() > 1 {
            let name = fused_name(g, n);
            fuse_nodes(g, &group, &name).map_err(|e| Error::model(e.0))?;
        }
    }
    Ok(())
}

/// True when node `p` is a MaxPool whose windows are the 2x2 blocks of its input (kernel
/// 2x2, strides 2, no padding, dilation 1, floor rounding; an NCHW input of `dt` with even
/// sides), its one output the pooled values: a Winograd F(2x2) or F(4x4) conv can pool
/// its output tiles before it stores them (`lower::gemm::winograd`); where the conv's
/// lowering does not, the fused node runs the pool as its own kernel.
fn is_max_pool_2x2(g: &Graph, p: NodeId, dt: DType) -> bool {
    let node = &g.nodes[p];
    let a = &node.attrs;
    let ints = |name: &str, d: &[i64]| a.ints(name, d).ok();
    let even_nchw = node.inputs.first().copied().flatten().is_some_and(|x| {
        let t = &g.value(x).ty;
        t.dtype() == Some(dt)
            && t.static_shape()
                .is_some_and(|s| s.len() == 4 && s[2] % 2 == 0 && s[3] % 2 == 0 && s[2] > 0)
    });
    node.domain.is_empty()
        && node.op_type == "MaxPool"
        && node.outputs.len() == 1
        && node.inputs.len() == 1
        && even_nchw
        && ints("kernel_shape", &[]).as_deref() == Some(&[2, 2])
        && ints("strides", &[1, 1]).as_deref() == Some(&[2, 2])
        && ints("dilations", &[1, 1]).as_deref() == Some(&[1, 1])
        && ints("pads", &[0, 0, 0, 0]).as_deref() == Some(&[0, 0, 0, 0])
        && matches!(
            a.string("auto_pad", "NOTSET".into()).as_deref(),
            Ok("NOTSET" | "VALID")
        )
        && a.int("ceil_mode", 0).ok() == Some(0)
}

/// SiLU as exported before opset 24: `v` read only by `s = Sigmoid(v)` and `Mul(v, s)`
/// (either order), `s` read only by that Mul. Returns (the Sigmoid, the Mul).
fn silu_pair(g: &Graph, v: ValueId) -> Option<(NodeId, NodeId)> {
    if g.outputs.contains(&v) {
        return None;
    }
    let us = users(g, v);
    let [a, b] = us[..] else { return None };
    let plain = |n: NodeId, op: &str| g.nodes[n].domain.is_empty() && g.nodes[n].op_type == op;
    let (sg, m) = if plain(a, "Sigmoid") { (a, b) } else { (b, a) };
    if !plain(sg, "Sigmoid") || !plain(m, "Mul") || g.nodes[sg].outputs.len() != 1 {
        return None;
    }
    let s = g.nodes[sg].outputs[0];
    let ins = &g.nodes[m].inputs;
    let pair = ins.len() == 2
        && (ins[..] == [Some(v), Some(s)] || ins[..] == [Some(s), Some(v)])
        && g.nodes[sg].inputs[..] == [Some(v)];
    (pair && !g.outputs.contains(&s) && users(g, s) == [m] && g.nodes[m].outputs.len() == 1)
        .then_some((sg, m))
}

pub(crate) fn fused_name(g: &Graph, n: NodeId) -> String {
    let node = &g.nodes[n];
    if node.name.is_empty() {
        format!("fused_{}_{}", node.op_type, n.index())
    } else {
        format!("{}+fused", node.name)
    }
}

/// True when node `c` is one epilogue step on `cur` (dtype `dt`, shape `shape`), with the
/// result of the same type and shape.
fn is_step(
    g: &Graph,
    known: &HashMap<ValueId, crate::ir::Value>,
    c: NodeId,
    cur: ValueId,
    dt: DType,
    shape: &[usize],
) -> bool {
    let node = &g.nodes[c];
    if !node.domain.is_empty() || node.outputs.len() != 1 {
        return false;
    }
    let oty = &g.value(node.outputs[0]).ty;
    if oty.dtype() != Some(dt) || oty.static_shape().as_deref() != Some(shape) {
        return false;
    }
    let pos: Vec<usize> = (0..node.inputs.len())
        .filter(|&i| node.inputs[i] == Some(cur))
        .collect();
    let other_ok = |i: usize| {
        node.inputs.get(i).copied().flatten().is_some_and(|v| {
            let t = &g.value(v).ty;
            t.dtype() == Some(dt)
                && t.static_shape()
                    .and_then(|s| broadcast_shapes(&s, shape))
                    .as_deref()
                    == Some(shape)
        })
    };
    let attr_f = |name: &str, d: f32| node.attrs.float(name, d).unwrap_or(f32::NAN);
    match (node.op_type.as_str(), pos.as_slice()) {
        ("Add" | "Mul", [p]) if node.inputs.len() == 2 => other_ok(1 - p),
        ("Div", [0]) => other_ok(1) && node.inputs[1].is_some_and(|v| known.contains_key(&v)),
        ("Relu" | "Sigmoid" | "Tanh" | "HardSwish" | "HardSigmoid" | "LeakyRelu" | "Gelu", [0]) => {
            true
        }
        ("Swish", [0]) => attr_f("alpha", 1.0) == 1.0,
        ("Clip", [0]) => {
            node.opset < 11
                || node.inputs[1..]
                    .iter()
                    .all(|i| i.is_none_or(|v| const_scalar(known, v).is_some()))
        }
        _ => false,
    }
}
