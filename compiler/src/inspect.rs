//! `onnxc inspect`: a model's opsets, signature, op histogram, parameters, FLOPs and
//! every unsupported op at once.

use crate::ir::{Graph, Source, ValueType};
use crate::onnx::Opsets;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Summary numbers of a model.
#[derive(Debug, Default, serde::Serialize)]
pub struct Summary {
    pub nodes: usize,
    pub op_histogram: BTreeMap<String, usize>,
    pub parameters: u64,
    pub parameter_bytes: u64,
    /// Multiply-adds count twice; None when some shapes are unknown.
    pub flops: Option<u64>,
}

pub fn summarize(g: &Graph) -> Summary {
    let mut s = Summary {
        nodes: g.node_count(),
        ..Default::default()
    };
    for n in g.nodes.node_indices() {
        *s.op_histogram
            .entry(g.nodes[n].op_type.clone())
            .or_default() += 1;
    }
    for t in g.consts.values() {
        s.parameters += t.len() as u64;
        s.parameter_bytes += (t.len() * t.dtype().size_bytes()) as u64;
    }
    let mut total = 0u64;
    let mut complete = true;
    for n in g.nodes.node_indices() {
        match node_flops(g, n) {
            Some(f) => total += f,
            None => complete = false,
        }
    }
    s.flops = complete.then_some(total);
    s
}

fn shape(g: &Graph, v: Option<usize>) -> Option<Vec<usize>> {
    g.value(v?).ty.static_shape()
}

/// FLOPs of one node (2 per multiply-add; 1 per element for elementwise work).
pub fn node_flops(g: &Graph, n: crate::ir::NodeId) -> Option<u64> {
    let node = &g.nodes[n];
    let out = shape(g, node.outputs.first().copied())?;
    let out_elems: u64 = out.iter().product::<usize>() as u64;
    let inp = |i: usize| shape(g, node.inputs.get(i).copied().flatten());
    Some(match node.op_type.as_str() {
        "Conv" | "ConvInteger" | "QLinearConv" => {
            let w = inp(1)?;
            2 * out_elems * w[1..].iter().product::<usize>() as u64
        }
        "ConvTranspose" => {
            let x = inp(0)?;
            let w = inp(1)?;
            2 * x.iter().product::<usize>() as u64 * w[1..].iter().product::<usize>() as u64
        }
        "MatMul" | "MatMulInteger" | "QLinearMatMul" => {
            let a = inp(0)?;
            let k = if a.len() == 1 { a[0] } else { a[a.len() - 1] };
            2 * out_elems * k as u64
        }
        "Gemm" => {
            let a = inp(0)?;
            let trans_a = node.attrs.int("transA", 0).ok()? != 0;
            let k = if trans_a { a[0] } else { a[1] };
            2 * out_elems * k as u64
        }
        _ => out_elems,
    })
}

/// The human-readable inspect report.
pub fn report(
    path: &str,
    g: &Graph,
    opsets: &Opsets,
    producer: &str,
    unsupported: &[String],
    unresolved: &[String],
) -> String {
    let s = summarize(g);
    let mut r = String::new();
    let _ = writeln!(r, "model: {path}");
    if !producer.is_empty() {
        let _ = writeln!(r, "producer: {producer}");
    }
    let ops: Vec<String> = opsets
        .iter()
        .map(|(d, v)| format!("{}={v}", if d.is_empty() { "ai.onnx" } else { d }))
        .collect();
    let _ = writeln!(r, "opsets: {}", ops.join(", "));
    let sig = |ids: &[usize]| {
        ids.iter()
            .map(|&v| format!("  {}: {}", g.value(v).name, g.value(v).ty))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let _ = writeln!(r, "inputs:\n{}", sig(&g.inputs));
    let _ = writeln!(r, "outputs:\n{}", sig(&g.outputs));
    let _ = writeln!(r, "nodes: {}", s.nodes);
    let mut hist: Vec<_> = s.op_histogram.iter().collect();
    hist.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    for (op, c) in hist {
        let _ = writeln!(r, "  {c:6}  {op}");
    }
    let consts = g
        .values
        .iter()
        .filter(|v| v.source == Source::Const)
        .count();
    let _ = writeln!(
        r,
        "parameters: {} in {consts} tensors ({})",
        s.parameters,
        human_bytes(s.parameter_bytes)
    );
    match s.flops {
        Some(f) => {
            let _ = writeln!(r, "FLOPs: {f} ({:.3} GFLOP)", f as f64 / 1e9);
        }
        None => {
            let _ = writeln!(
                r,
                "FLOPs: unknown (some shapes are not static; bind them with --shape)"
            );
        }
    }
    let free = crate::passes::free_input_dims(g);
    if !free.is_empty() {
        let _ = writeln!(
            r,
            "free dims (bind them with --shape NAME=DxDxD to infer every shape):"
        );
        for f in &free {
            let _ = writeln!(r, "  {f}");
        }
    } else if !unresolved.is_empty() {
        let _ = writeln!(r, "shapes not inferred ({}):", unresolved.len());
        for u in unresolved {
            let _ = writeln!(r, "  {u}");
        }
    }
    if unsupported.is_empty() {
        let _ = writeln!(r, "unsupported ops: none");
    } else {
        let _ = writeln!(r, "unsupported ops ({} nodes):", unsupported.len());
        for u in unsupported {
            let _ = writeln!(r, "  {u}");
        }
    }
    r
}

pub fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.2} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// True when every graph input and output has a fully static tensor type.
pub fn is_static(g: &Graph) -> bool {
    g.inputs
        .iter()
        .chain(&g.outputs)
        .all(|&v| matches!(g.value(v).ty, ValueType::Tensor { .. }) && g.value(v).ty.is_static())
}
