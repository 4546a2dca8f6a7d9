//! Writes a graph back as a standard ONNX model (`onnxc MODEL --emit onnx -o OUT.onnx`):
//! constants become initializers, the model's opset imports are kept, and `onnxc.Fused`
//! nodes are written by inlining their `body` graph, so only standard ops remain. Graph
//! outputs that are constants are written as an initializer plus an Identity node.
//! onnxc's own attributes ([`INTERNAL_PREFIX`]) are left out.

use crate::ir::{Attr, Graph, Node, Source, ValueId, ValueType, INTERNAL_PREFIX};
use crate::onnx::proto::{
    attribute_proto::AttributeType as T, tensor_shape_proto, type_proto, AttributeProto,
    GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorShapeProto, TypeProto,
    ValueInfoProto,
};
use crate::onnx::tensor::to_proto;
use crate::onnx::Opsets;
use prost::Message;
use std::collections::HashMap;

/// The domain and op type of fused nodes (see the passes): their `body` is inlined.
pub const FUSED_DOMAIN: &str = "onnxc";
pub const FUSED_OP: &str = "Fused";

/// The model as a ModelProto.
pub fn model_proto(g: &Graph, opsets: &Opsets, ir_version: i64) -> ModelProto {
    let mut w = Writer { counter: 0 };
    let graph = w.graph(g);
    let mut opset_import: Vec<OperatorSetIdProto> = opsets
        .iter()
        .filter(|(d, _)| d.as_str() != FUSED_DOMAIN)
        .map(|(d, v)| OperatorSetIdProto {
            domain: Some(d.clone()),
            version: Some(*v),
        })
        .collect();
    if !opsets.contains_key("") {
        opset_import.push(OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(13),
        });
    }
    ModelProto {
        // Initializers need not be graph inputs from IR version 4 on.
        ir_version: Some(ir_version.max(4)),
        opset_import,
        producer_name: Some("onnxc".into()),
        producer_version: Some(env!("CARGO_PKG_VERSION").into()),
        graph: Some(graph),
        ..Default::default()
    }
}

/// The model as protobuf bytes.
pub fn model_bytes(g: &Graph, opsets: &Opsets, ir_version: i64) -> Vec<u8> {
    model_proto(g, opsets, ir_version).encode_to_vec()
}

struct Writer {
    counter: usize,
}

impl Writer {
    fn graph(&mut self, g: &Graph) -> GraphProto {
        let name = |v: ValueId| g.value(v).name.clone();
        let mut gp = GraphProto {
            name: Some(g.name.clone()),
            input: g
                .inputs
                .iter()
                .map(|&v| value_info(&name(v), &g.value(v).ty))
                .collect(),
            output: g
                .outputs
                .iter()
                .map(|&v| value_info(&name(v), &g.value(v).ty))
                .collect(),
            ..Default::default()
        };
        let names: HashMap<ValueId, String> = (0..g.values.len()).map(|v| (v, name(v))).collect();
        self.body(g, &names, &mut gp);
        // Graph outputs held as constants: an initializer under another name + Identity.
        let mut done = Vec::new();
        for &o in &g.outputs {
            if g.value(o).source == Source::Const && !done.contains(&o) {
                done.push(o);
                let init = self.fresh(&format!("{}__const", name(o)));
                for t in gp.initializer.iter_mut() {
                    if t.name() == name(o) {
                        t.name = Some(init.clone());
                    }
                }
                gp.node.push(identity(&init, &name(o)));
            }
        }
        gp
    }

    /// Writes `g`'s constants and nodes into `gp`, naming each value by `names`.
    fn body(&mut self, g: &Graph, names: &HashMap<ValueId, String>, gp: &mut GraphProto) {
        let mut consts: Vec<ValueId> = g
            .consts
            .keys()
            .copied()
            .filter(|&c| g.value(c).source == Source::Const)
            .collect();
        consts.sort();
        for c in consts {
            gp.initializer.push(to_proto(&g.consts[&c], &names[&c]));
        }
        let order = g
            .topo_order()
            .unwrap_or_else(|_| g.nodes.node_indices().collect());
        for n in order {
            let node = &g.nodes[n];
            if node.domain == FUSED_DOMAIN && node.op_type == FUSED_OP {
                if let Ok(Some(b)) = node.attrs.get_graph("body") {
                    self.inline(node, &b, names, gp);
                    continue;
                }
            }
            gp.node.push(self.node(node, names));
        }
    }

    /// A fused node's body, with its inputs and outputs renamed to the node's.
    fn inline(
        &mut self,
        node: &Node,
        body: &Graph,
        outer: &HashMap<ValueId, String>,
        gp: &mut GraphProto,
    ) {
        self.counter += 1;
        let prefix = format!(
            "{}__fused{}/",
            if node.name.is_empty() {
                "node"
            } else {
                &node.name
            },
            self.counter
        );
        let mut names: HashMap<ValueId, String> = HashMap::new();
        for (v, info) in body.values.iter().enumerate() {
            let n = match info.source {
                Source::Outer => info.name.clone(),
                _ => format!("{prefix}{}", info.name),
            };
            names.insert(v, n);
        }
        for (i, &v) in body.inputs.iter().enumerate() {
            let n = node
                .inputs
                .get(i)
                .copied()
                .flatten()
                .map(|x| outer[&x].clone())
                .unwrap_or_default();
            names.insert(v, n);
        }
        // Body outputs produced by body nodes take the fused node's output names; those
        // that are body inputs or constants are copied by an Identity.
        let mut copies = Vec::new();
        for (j, &v) in body.outputs.iter().enumerate() {
            let Some(&out) = node.outputs.get(j) else {
                continue;
            };
            match body.value(v).source {
                Source::Node(_) => {
                    names.insert(v, outer[&out].clone());
                }
                _ => copies.push((v, outer[&out].clone())),
            }
        }
        self.body(body, &names, gp);
        for (v, out) in copies {
            gp.node.push(identity(&names[&v], &out));
        }
    }

    fn node(&mut self, node: &Node, names: &HashMap<ValueId, String>) -> NodeProto {
        NodeProto {
            name: Some(node.name.clone()),
            op_type: Some(node.op_type.clone()),
            domain: Some(node.domain.clone()),
            input: node
                .inputs
                .iter()
                .map(|i| i.map(|v| names[&v].clone()).unwrap_or_default())
                .collect(),
            output: node.outputs.iter().map(|&o| names[&o].clone()).collect(),
            attribute: node
                .attrs
                .iter()
                .filter(|(k, _)| !k.starts_with(INTERNAL_PREFIX))
                .map(|(k, a)| self.attr(k, a))
                .collect(),
            ..Default::default()
        }
    }

    fn attr(&mut self, name: &str, a: &Attr) -> AttributeProto {
        let mut p = AttributeProto {
            name: Some(name.to_string()),
            ..Default::default()
        };
        let ty = match a {
            Attr::Float(x) => {
                p.f = Some(*x);
                T::Float
            }
            Attr::Int(x) => {
                p.i = Some(*x);
                T::Int
            }
            Attr::String(s) => {
                p.s = Some(s.as_bytes().to_vec());
                T::String
            }
            Attr::Tensor(t) => {
                p.t = Some(to_proto(t, ""));
                T::Tensor
            }
            Attr::Graph(g) => {
                p.g = Some(self.graph(g));
                T::Graph
            }
            Attr::Type(t) => {
                p.tp = Some(type_proto_of(t));
                T::TypeProto
            }
            Attr::Floats(v) => {
                p.floats = v.clone();
                T::Floats
            }
            Attr::Ints(v) => {
                p.ints = v.clone();
                T::Ints
            }
            Attr::Strings(v) => {
                p.strings = v.iter().map(|s| s.as_bytes().to_vec()).collect();
                T::Strings
            }
            Attr::Tensors(v) => {
                p.tensors = v.iter().map(|t| to_proto(t, "")).collect();
                T::Tensors
            }
            Attr::Graphs(v) => {
                p.graphs = v.iter().map(|g| self.graph(g)).collect();
                T::Graphs
            }
            Attr::Types(v) => {
                p.type_protos = v.iter().map(type_proto_of).collect();
                T::TypeProtos
            }
        };
        p.r#type = Some(ty as i32);
        p
    }

    fn fresh(&mut self, base: &str) -> String {
        self.counter += 1;
        format!("{base}{}", self.counter)
    }
}

fn identity(from: &str, to: &str) -> NodeProto {
    NodeProto {
        name: Some(format!("{to}__copy")),
        op_type: Some("Identity".into()),
        input: vec![from.to_string()],
        output: vec![to.to_string()],
        ..Default::default()
    }
}

fn value_info(name: &str, ty: &ValueType) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.to_string()),
        r#type: Some(type_proto_of(ty)),
        ..Default::default()
    }
}

fn type_proto_of(ty: &ValueType) -> TypeProto {
    use tensor_shape_proto::dimension::Value as D;
    let value = match ty {
        ValueType::Tensor { dt, shape } => {
            Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(dt.onnx_code()),
                shape: shape.as_ref().map(|s| TensorShapeProto {
                    dim: s
                        .iter()
                        .map(|d| tensor_shape_proto::Dimension {
                            value: match d {
                                crate::ir::Dim::Fixed(n) => Some(D::DimValue(*n as i64)),
                                crate::ir::Dim::Sym(s) if s != "?" => Some(D::DimParam(s.clone())),
                                crate::ir::Dim::Sym(_) => None,
                            },
                            ..Default::default()
                        })
                        .collect(),
                }),
            }))
        }
        ValueType::Sequence(e) => Some(type_proto::Value::SequenceType(Box::new(
            type_proto::Sequence {
                elem_type: Some(Box::new(type_proto_of(e))),
            },
        ))),
        ValueType::Optional(e) => Some(type_proto::Value::OptionalType(Box::new(
            type_proto::Optional {
                elem_type: Some(Box::new(type_proto_of(e))),
            },
        ))),
        ValueType::Unknown => None,
    };
    TypeProto {
        value,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, DType, Op, OpError, OpResult, Tensor, Value};
    use crate::passes::util::new_node;
    use std::sync::Arc;

    /// Stands in for the fusion passes' op: evaluating a fused node = evaluating its body.
    #[derive(Debug)]
    struct BodyOp(Arc<Graph>);

    impl Op for BodyOp {
        fn eval(&self, inputs: &[Option<&Value>]) -> OpResult<Vec<Value>> {
            let ins = inputs
                .iter()
                .map(|i| i.cloned().expect("present"))
                .collect();
            crate::eval::run(&self.0, ins).map_err(|e| OpError::new(e.to_string()))
        }
    }

    fn f32s(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 5 % 9) as f32 - 4.0) * 0.25).collect()
    }

    #[test]
    fn fused_nodes_are_inlined_and_constant_outputs_copied() {
        // body(bx, bw) = (Relu(Conv(bx, bw) + bias), bx)
        let mut b = Graph::new("body");
        let bx = b.add_input("bx", ValueType::tensor(DType::F32, &[1, 2, 4, 4]));
        let bw = b.add_input("bw", ValueType::tensor(DType::F32, &[3, 2, 3, 3]));
        let bias = b.add_const("bias", Tensor::from_vec(&[3], vec![0.5f32, -0.5, 0.25]));
        let bc = b.add_value("bc", ValueType::Unknown, Source::Undefined);
        let by = b.add_value("by", ValueType::Unknown, Source::Undefined);
        let conv = new_node(
            "conv".into(),
            "Conv",
            Attrs::default(),
            13,
            vec![Some(bx), Some(bw), Some(bias)],
            vec![bc],
        );
        b.add_node(conv.unwrap());
        b.add_node(
            new_node(
                "relu".into(),
                "Relu",
                Attrs::default(),
                13,
                vec![Some(bc)],
                vec![by],
            )
            .unwrap(),
        );
        b.outputs = vec![by, bx];
        b.rewire();
        crate::passes::infer_shapes(&mut b).unwrap();
        let body = Arc::new(b);

        let mut g = Graph::new("main");
        let x = g.add_input("x", ValueType::tensor(DType::F32, &[1, 2, 4, 4]));
        let w = g.add_const("w", Tensor::from_vec(&[3, 2, 3, 3], f32s(54)));
        let k = g.add_const("k", Tensor::from_vec(&[2], vec![1i64, 2]));
        let y = g.add_value(
            "y",
            ValueType::tensor(DType::F32, &[1, 3, 2, 2]),
            Source::Undefined,
        );
        let y2 = g.add_value(
            "y2",
            ValueType::tensor(DType::F32, &[1, 2, 4, 4]),
            Source::Undefined,
        );
        let mut attrs = Attrs::default();
        attrs.0.insert("body".into(), Attr::Graph(body.clone()));
        g.add_node(Node {
            name: "fused0".into(),
            op_type: FUSED_OP.into(),
            domain: FUSED_DOMAIN.into(),
            opset: 1,
            attrs,
            op: Arc::new(BodyOp(body)),
            inputs: vec![Some(x), Some(w)],
            outputs: vec![y, y2],
            implicit: Vec::new(),
        });
        g.outputs = vec![y, y2, k];
        g.rewire();

        let mut opsets = Opsets::new();
        opsets.insert(String::new(), 13);
        opsets.insert(FUSED_DOMAIN.into(), 1);
        let proto = model_proto(&g, &opsets, 8);
        let gp = proto.graph.as_ref().unwrap();
        assert!(gp.node.iter().all(|n| n.domain() != FUSED_DOMAIN));
        assert!(proto
            .opset_import
            .iter()
            .all(|o| o.domain() != FUSED_DOMAIN));
        let back = crate::onnx::decode(&proto.encode_to_vec(), None).unwrap();
        let names = |g: &Graph| -> Vec<String> {
            g.inputs
                .iter()
                .chain(&g.outputs)
                .map(|&v| g.value(v).name.clone())
                .collect()
        };
        assert_eq!(names(&back.graph), names(&g));
        let xin = Value::Tensor(Tensor::from_vec(&[1, 2, 4, 4], f32s(32)));
        let want = crate::eval::run(&g, vec![xin.clone()]).unwrap();
        let got = crate::eval::run(&back.graph, vec![xin]).unwrap();
        assert_eq!(got, want);
    }
}
