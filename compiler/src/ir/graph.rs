//! The graph IR: op nodes in a petgraph graph, connected by tensor-valued edges.
//!
//! Values (edges in ONNX's sense) live in a table; each node lists the value ids it reads
//! and writes, and the petgraph edges mirror those data dependencies (producer ->
//! consumer, weighted by the value id) so that ordering and cycle checks are graph
//! algorithms.

use super::{Attrs, Op, Tensor, ValueType};
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences};
use std::collections::HashMap;
use std::sync::Arc;

pub type ValueId = usize;
pub type NodeId = NodeIndex;

/// Where a value comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A formal input of the graph.
    Input,
    /// A constant (initializer or folded value) held in [`Graph::consts`].
    Const,
    /// Named by a subgraph but defined in an enclosing graph.
    Outer,
    /// The output of a node.
    Node(NodeId),
    /// Declared but not yet wired (only while building).
    Undefined,
}

#[derive(Clone, Debug)]
pub struct ValueInfo {
    pub name: String,
    pub ty: ValueType,
    pub source: Source,
}

#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    pub op_type: String,
    pub domain: String,
    /// The opset version of `domain` the node was imported under.
    pub opset: i64,
    pub attrs: Attrs,
    pub op: Arc<dyn Op>,
    /// Inputs in order; None for an omitted optional input.
    pub inputs: Vec<Option<ValueId>>,
    pub outputs: Vec<ValueId>,
    /// Values of this graph that the node's subgraphs read by name (If/Loop/Scan bodies
    /// naming enclosing values): dependencies for scheduling and liveness.
    pub implicit: Vec<ValueId>,
}

#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: String,
    pub nodes: StableDiGraph<Node, ValueId>,
    pub values: Vec<ValueInfo>,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    pub consts: HashMap<ValueId, Tensor>,
    /// The target multiplies 8-bit integers in hardware (x86 AVX-512 VNNI), set by the
    /// driver from the target's features: `passes::widen_integer` then leaves the
    /// integer products that the 8-bit GEMM runs as integer products.
    pub int8_dot: bool,
    /// The target's innermost f32 loops are 128-bit code (x86 without AVX-512: Cranelift's
    /// f32x4, no FMA) while its GEMM is AVX2 machine code, set by the driver: lowerings
    /// that beat the GEMM only as 16-lane loops leave their convs to it.
    pub narrow_loops: bool,
    by_name: HashMap<String, ValueId>,
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Graph {
        Graph {
            name: name.into(),
            ..Default::default()
        }
    }

    pub fn value(&self, id: ValueId) -> &ValueInfo {
        &self.values[id]
    }

    pub fn value_mut(&mut self, id: ValueId) -> &mut ValueInfo {
        &mut self.values[id]
    }

    pub fn find(&self, name: &str) -> Option<ValueId> {
        self.by_name.get(name).copied()
    }

    /// Gives value `id` a new name (unique within the graph: the caller checks).
    pub fn rename_value(&mut self, id: ValueId, name: impl Into<String>) {
        let name = name.into();
        let old = std::mem::replace(&mut self.values[id].name, name.clone());
        if self.by_name.get(&old) == Some(&id) {
            self.by_name.remove(&old);
        }
        self.by_name.insert(name, id);
    }

    /// Adds a value; names must be unique within a graph (the caller checks).
    pub fn add_value(&mut self, name: impl Into<String>, ty: ValueType, source: Source) -> ValueId {
        let name = name.into();
        let id = self.values.len();
        self.by_name.insert(name.clone(), id);
        self.values.push(ValueInfo { name, ty, source });
        id
    }

    pub fn add_input(&mut self, name: impl Into<String>, ty: ValueType) -> ValueId {
        let id = self.add_value(name, ty, Source::Input);
        self.inputs.push(id);
        id
    }

    pub fn add_const(&mut self, name: impl Into<String>, t: Tensor) -> ValueId {
        let ty = ValueType::tensor(t.dtype(), t.shape());
        let id = self.add_value(name, ty, Source::Const);
        self.consts.insert(id, t);
        id
    }

    /// Adds a node whose output values already exist (as `Undefined`); marks them as
    /// produced by it. Edges are wired by [`Graph::rewire`].
    pub fn add_node(&mut self, node: Node) -> NodeId {
        let outs = node.outputs.clone();
        let id = self.nodes.add_node(node);
        for o in outs {
            self.values[o].source = Source::Node(id);
        }
        id
    }

    /// Rebuilds every data-dependency edge from the nodes' input lists.
    pub fn rewire(&mut self) {
        self.nodes.clear_edges();
        let ids: Vec<NodeId> = self.nodes.node_indices().collect();
        for n in ids {
            let node = &self.nodes[n];
            let inputs: Vec<ValueId> = node
                .inputs
                .iter()
                .flatten()
                .chain(&node.implicit)
                .copied()
                .collect();
            for v in inputs {
                if let Source::Node(p) = self.values[v].source {
                    self.nodes.add_edge(p, n, v);
                }
            }
        }
    }

    /// Nodes in an order where producers come before consumers (stable with respect to
    /// insertion order), or the names of nodes on a cycle.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, Vec<String>> {
        // Kahn's algorithm, always taking the earliest-inserted ready node, so the
        // schedule follows the model's own order when it is already topological.
        let mut indeg: HashMap<NodeId, usize> = self.nodes.node_indices().map(|n| (n, 0)).collect();
        for e in self.nodes.edge_references() {
            *indeg.get_mut(&e.target()).expect("edge target exists") += 1;
        }
        let mut ready: std::collections::BTreeSet<NodeId> = indeg
            .iter()
            .filter(|(_, d)| **d == 0)
            .map(|(n, _)| *n)
            .collect();
        let mut order = Vec::with_capacity(indeg.len());
        while let Some(n) = ready.pop_first() {
            order.push(n);
            for e in self.nodes.edges(n) {
                let d = indeg.get_mut(&e.target()).expect("edge target exists");
                *d -= 1;
                if *d == 0 {
                    ready.insert(e.target());
                }
            }
        }
        if order.len() == self.nodes.node_count() {
            Ok(order)
        } else {
            let mut stuck: Vec<NodeId> = indeg
                .iter()
                .filter(|(_, d)| **d > 0)
                .map(|(n, _)| *n)
                .collect();
            stuck.sort();
            Err(stuck.into_iter().map(|n| self.node_label(n)).collect())
        }
    }

    /// `name (OpType)` for messages.
    pub fn node_label(&self, n: NodeId) -> String {
        let node = &self.nodes[n];
        if node.name.is_empty() {
            format!("#{} ({})", n.index(), node.op_type)
        } else {
            format!("`{}` ({})", node.name, node.op_type)
        }
    }

    /// Nodes that read value `v`.
    pub fn consumers(&self, v: ValueId) -> Vec<NodeId> {
        self.nodes
            .node_indices()
            .filter(|&n| self.nodes[n].inputs.contains(&Some(v)))
            .collect()
    }

    /// Names this graph (or any subgraph inside it) reads from enclosing scopes.
    pub fn free_names(&self) -> std::collections::BTreeSet<String> {
        let mut out: std::collections::BTreeSet<String> = self
            .outer_refs()
            .into_iter()
            .map(|v| self.values[v].name.clone())
            .collect();
        for n in self.nodes.node_indices() {
            for sg in self.nodes[n].op.subgraphs() {
                for name in sg.free_names() {
                    match self.find(&name) {
                        Some(id) if self.values[id].source != Source::Outer => {}
                        _ => {
                            out.insert(name);
                        }
                    }
                }
            }
        }
        out
    }

    /// Values named from enclosing scopes.
    pub fn outer_refs(&self) -> Vec<ValueId> {
        (0..self.values.len())
            .filter(|&v| self.values[v].source == Source::Outer)
            .collect()
    }

    pub fn node_count(&self) -> usize {
        self.nodes.node_count()
    }
}

/// Editing helpers for passes. Value ids are never reused: a removed node's outputs and a
/// removed constant become `Undefined` entries of the value table.
impl Graph {
    /// Removes a node; its outputs become `Undefined` (call [`Graph::rewire`] when done
    /// editing).
    pub fn remove_node(&mut self, n: NodeId) -> Option<Node> {
        let node = self.nodes.remove_node(n)?;
        for &o in &node.outputs {
            if self.values[o].source == Source::Node(n) {
                self.values[o].source = Source::Undefined;
            }
        }
        Some(node)
    }

    /// Drops a constant's data; the value becomes `Undefined`.
    pub fn remove_const(&mut self, v: ValueId) -> Option<Tensor> {
        let t = self.consts.remove(&v)?;
        self.values[v].source = Source::Undefined;
        Some(t)
    }

    /// Turns a node output into a constant holding `t` (the node keeps running until it
    /// is removed; the caller removes it once all its outputs are constants).
    pub fn set_const(&mut self, v: ValueId, t: Tensor) {
        self.values[v].ty = ValueType::tensor(t.dtype(), t.shape());
        self.values[v].source = Source::Const;
        self.consts.insert(v, t);
    }

    /// Makes every node input that reads `old` read `new` instead (graph outputs and
    /// subgraph reads by name are not touched). Returns how many inputs changed.
    pub fn replace_uses(&mut self, old: ValueId, new: ValueId) -> usize {
        let mut count = 0;
        let ids: Vec<NodeId> = self.nodes.node_indices().collect();
        for n in ids {
            for inp in self.nodes[n].inputs.iter_mut() {
                if *inp == Some(old) {
                    *inp = Some(new);
                    count += 1;
                }
            }
        }
        count
    }

    /// A value name not used yet in this graph, derived from `base`.
    pub fn fresh_name(&self, base: &str) -> String {
        if self.find(base).is_none() {
            return base.to_string();
        }
        (1..)
            .map(|k| format!("{base}_{k}"))
            .find(|n| self.find(n).is_none())
            .expect("some suffix is free")
    }

    /// Nodes that read `v` through an input or through a subgraph (implicitly).
    pub fn readers(&self, v: ValueId) -> Vec<NodeId> {
        self.nodes
            .node_indices()
            .filter(|&n| {
                let node = &self.nodes[n];
                node.inputs.contains(&Some(v)) || node.implicit.contains(&v)
            })
            .collect()
    }

    /// True when a subgraph of some node names `v` (so `v` must keep its name and
    /// identity) or `v` is a graph output.
    pub fn is_pinned(&self, v: ValueId) -> bool {
        self.outputs.contains(&v)
            || self
                .nodes
                .node_indices()
                .any(|n| self.nodes[n].implicit.contains(&v))
    }

    /// The constant held by `v`, if any.
    pub fn const_of(&self, v: ValueId) -> Option<&Tensor> {
        self.consts.get(&v)
    }
}
