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
            let w = inp(if node.op_type == "QLinearConv" { 3 } else { 1 })?;
            2 * out_elems * w.get(1..)?.iter().product::<usize>() as u64
        }
        "ConvTranspose" => {
            let x = inp(0)?;
            let w = inp(1)?;
            2 * x.iter().product::<usize>() as u64 * w.get(1..)?.iter().product::<usize>() as u64
        }
        "MatMul" | "MatMulInteger" | "QLinearMatMul" => {
            let k = *inp(0)?.last()?;
            2 * out_elems * k as u64
        }
        "Gemm" => {
            let a = inp(0)?;
            let trans_a = node.attrs.int("transA", 0).ok()? != 0;
            let k = *a.get(if trans_a { 0 } else { 1 })?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Tensor, ValueType};
    use crate::passes::testutil::Builder;

    #[test]
    fn flops_read_each_ops_weight_and_never_index_past_a_shape() {
        let mut b = Builder::new();
        let x = b.input_typed("x", DType::U8, &[1, 4, 5, 5]);
        let s = b.konst("s", &[], vec![0.1]);
        let z = b.konst_t("z", Tensor::scalar(0u8));
        let w = b.konst_t("w", Tensor::from_vec(&[6, 4, 3, 3], vec![1i8; 216]));
        let wz = b.konst_t("wz", Tensor::scalar(0i8));
        let q = b.node_typed(
            "QLinearConv",
            &[x, s, z, w, s, wz, s, z],
            DType::U8,
            &[1, 6, 3, 3],
        );
        let a = b.input("a", &[2, 2]);
        let m = b.node("MatMul", &[a, a], &[2, 2]);
        let mut g = b.finish_untyped(&[q, m]);
        // A scalar operand (inference rejects one; a corrupt graph must not panic here).
        g.values[a].ty = ValueType::tensor(DType::F32, &[]);
        let flops: Vec<Option<u64>> = g.nodes.node_indices().map(|n| node_flops(&g, n)).collect();
        assert!(flops.contains(&Some(2 * 6 * 9 * 4 * 9)), "{flops:?}");
        assert!(flops.contains(&None), "{flops:?}");
    }
}
