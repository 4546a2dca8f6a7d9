//! Readable text dumps of the graph IR (`onnxc MODEL --emit ir`).

use super::Graph;
use std::fmt::Write;

/// Prints a graph: signature, constants (summarised), then nodes in schedule order.
pub fn print_graph(g: &Graph) -> String {
    let mut s = String::new();
    print_into(g, 0, &mut s);
    s
}

fn print_into(g: &Graph, indent: usize, s: &mut String) {
    let pad = "  ".repeat(indent);
    let sig = |ids: &[usize]| -> String {
        ids.iter()
            .map(|&v| format!("%{}: {}", g.values[v].name, g.values[v].ty))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        s,
        "{pad}graph {}({}) -> ({}) {{",
        g.name,
        sig(&g.inputs),
        sig(&g.outputs)
    );
    let mut consts: Vec<_> = g.consts.keys().copied().collect();
    consts.sort();
    for c in consts {
        let _ = writeln!(
            s,
            "{pad}  const %{} = {}",
            g.values[c].name,
            g.consts[&c].summary(6)
        );
    }
    for v in g.outer_refs() {
        let _ = writeln!(s, "{pad}  outer %{}: {}", g.values[v].name, g.values[v].ty);
    }
    let order = g
        .topo_order()
        .unwrap_or_else(|_| g.nodes.node_indices().collect());
    for n in order {
        let node = &g.nodes[n];
        let outs: Vec<String> = node
            .outputs
            .iter()
            .map(|&o| format!("%{}: {}", g.values[o].name, g.values[o].ty))
            .collect();
        let ins: Vec<String> = node
            .inputs
            .iter()
            .map(|i| match i {
                Some(v) => format!("%{}", g.values[*v].name),
                None => "_".into(),
            })
            .collect();
        let mut attrs: Vec<String> = Vec::new();
        for (k, a) in node.attrs.iter() {
            if !matches!(a, super::Attr::Graph(_) | super::Attr::Graphs(_)) {
                attrs.push(format!("{k}={a}"));
            }
        }
        let op = if node.domain.is_empty() || node.domain == "ai.onnx" {
            node.op_type.clone()
        } else {
            format!("{}.{}", node.domain, node.op_type)
        };
        let attrs = if attrs.is_empty() {
            String::new()
        } else {
            format!("[{}]", attrs.join(", "))
        };
        let name = if node.name.is_empty() {
            String::new()
        } else {
            format!("  # {}", node.name)
        };
        let _ = writeln!(
            s,
            "{pad}  {} = {op}{attrs}({}){name}",
            outs.join(", "),
            ins.join(", ")
        );
        for sg in node.op.subgraphs() {
            print_into(sg, indent + 2, s);
        }
    }
    let _ = writeln!(s, "{pad}}}");
}
