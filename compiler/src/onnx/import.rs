//! ModelProto -> graph IR: values, constants, nodes (with model-local functions inlined),
//! subgraphs, and the op objects from the registry. Unsupported ops are collected and
//! reported all at once.

use super::external::ExternalData;
use super::proto::{self, AttributeProto, FunctionProto, GraphProto, NodeProto, TypeProto};
use super::tensor::from_proto;
use crate::error::{Error, Result};
use crate::ir::{Attr, Attrs, DType, Dim, Graph, Node, Source, Tensor, ValueType};
use crate::ops::{OpCtx, Registry};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

/// Opset versions by domain ("" is the default ONNX domain).
pub type Opsets = BTreeMap<String, i64>;

/// Deepest nesting of subgraphs and function calls accepted (hostile models recurse).
const MAX_DEPTH: usize = 64;

pub struct Importer<'a> {
    pub registry: &'static Registry,
    pub functions: HashMap<(String, String), &'a FunctionProto>,
    pub ext: Option<&'a ExternalData>,
    /// Every node that could not be built, as `node (domain.Op): reason`.
    pub unsupported: Vec<String>,
    counter: usize,
}

/// A node after function inlining, with the opsets its body was written against.
struct FlatNode {
    proto: NodeProto,
    opsets: Arc<Opsets>,
}

pub fn domain_key(d: &str) -> &str {
    if d == "ai.onnx" {
        ""
    } else {
        d
    }
}

impl<'a> Importer<'a> {
    pub fn new(functions: &'a [FunctionProto], ext: Option<&'a ExternalData>) -> Importer<'a> {
        let functions = functions
            .iter()
            .map(|f| {
                (
                    (domain_key(f.domain()).to_string(), f.name().to_string()),
                    f,
                )
            })
            .collect();
        Importer {
            registry: Registry::standard(),
            functions,
            ext,
            unsupported: Vec::new(),
            counter: 0,
        }
    }

    /// Imports a graph. `outer` holds the names visible from enclosing graphs.
    pub fn graph(
        &mut self,
        gp: &GraphProto,
        opsets: &Arc<Opsets>,
        outer: &HashSet<String>,
        depth: usize,
    ) -> Result<Graph> {
        if depth > MAX_DEPTH {
            return Err(Error::model(format!(
                "subgraphs or functions nest deeper than {MAX_DEPTH} levels"
            )));
        }
        let mut g = Graph::new(gp.name().to_string());
        let dup = |name: &str, g: &Graph| -> Result<()> {
            if g.find(name).is_some() {
                Err(Error::model(format!(
                    "graph `{}`: the name `{name}` is defined twice",
                    gp.name()
                )))
            } else {
                Ok(())
            }
        };
        for t in &gp.initializer {
            let name = t.name().to_string();
            dup(&name, &g)?;
            let tensor = from_proto(t, self.ext, &format!("initializer `{name}`"))?;
            g.add_const(name, tensor);
        }
        for st in &gp.sparse_initializer {
            let name = st
                .values
                .as_ref()
                .map(|v| v.name().to_string())
                .unwrap_or_default();
            dup(&name, &g)?;
            let tensor = sparse_to_dense(st, self.ext, &name)?;
            g.add_const(name, tensor);
        }
        for vi in &gp.input {
            let name = vi.name();
            if g.find(name).is_some()
                && g.value(g.find(name).expect("found")).source == Source::Const
            {
                // An input with an initializer of the same name: the initializer is its
                // default, and onnxc treats it as a constant (a weight).
                continue;
            }
            dup(name, &g)?;
            let ty = vi
                .r#type
                .as_ref()
                .map(value_type)
                .transpose()?
                .unwrap_or(ValueType::Unknown);
            g.add_input(name.to_string(), ty);
        }
        // Flatten function calls, then declare every output so use-before-def works.
        let mut flat = Vec::new();
        for n in &gp.node {
            self.flatten(n.clone(), opsets.clone(), &mut flat, depth)?;
        }
        for fnode in &flat {
            for o in &fnode.proto.output {
                if o.is_empty() {
                    continue;
                }
                dup(o, &g)?;
                g.add_value(o.clone(), ValueType::Unknown, Source::Undefined);
            }
        }
        // Names visible to subgraphs of this graph.
        let mut scope: HashSet<String> = outer.clone();
        scope.extend(g.values.iter().map(|v| v.name.clone()));

        for fnode in flat {
            let np = fnode.proto;
            let label = node_label(&np);
            let mut inputs = Vec::with_capacity(np.input.len());
            for name in &np.input {
                if name.is_empty() {
                    inputs.push(None);
                    continue;
                }
                let id = match g.find(name) {
                    Some(id) => id,
                    None if outer.contains(name) => g.add_value(name.clone(), ValueType::Unknown, Source::Outer),
                    None => {
                        return Err(Error::model(format!(
                            "node {label}: input `{name}` is not produced by any node, graph input or initializer"
                        )))
                    }
                };
                inputs.push(Some(id));
            }
            let mut outputs = Vec::with_capacity(np.output.len());
            for name in &np.output {
                let id = if name.is_empty() {
                    self.counter += 1;
                    let n = format!("__unused_{}", self.counter);
                    g.add_value(n, ValueType::Unknown, Source::Undefined)
                } else {
                    g.find(name).expect("declared above")
                };
                outputs.push(id);
            }
            let attrs = self.attrs(&np.attribute, &fnode.opsets, &scope, depth, &label)?;
            let domain = domain_key(np.domain()).to_string();
            // Constant nodes become constants of the graph.
            if domain.is_empty() && np.op_type() == "Constant" {
                let t = constant_value(&attrs)
                    .map_err(|e| Error::model(format!("node {label}: {e}")))?;
                let id = outputs[0];
                g.value_mut(id).source = Source::Const;
                g.value_mut(id).ty = ValueType::tensor(t.dtype(), t.shape());
                g.consts.insert(id, t);
                continue;
            }
            let opset = match fnode.opsets.get(&domain) {
                Some(v) => *v,
                None => {
                    self.unsupported.push(format!(
                        "{label}: its domain `{}` is not imported by the model (no opset_import entry)",
                        np.domain()
                    ));
                    -1
                }
            };
            let ctx = OpCtx {
                op_type: np.op_type().to_string(),
                domain: domain.clone(),
                attrs: attrs.clone(),
                opset,
                n_inputs: inputs.len(),
                n_outputs: outputs.len(),
            };
            let op = match self.registry.build(ctx) {
                Some(Ok(op)) => op,
                Some(Err(e)) => {
                    self.unsupported.push(format!("{label}: {e}"));
                    continue;
                }
                None => {
                    let d = if domain.is_empty() {
                        String::new()
                    } else {
                        format!(" in domain `{domain}`")
                    };
                    self.unsupported.push(format!(
                        "{label}: operator `{}`{d} is not implemented",
                        np.op_type()
                    ));
                    continue;
                }
            };
            let mut implicit = Vec::new();
            for sg in op.subgraphs() {
                for name in sg.free_names() {
                    let id = match g.find(&name) {
                        Some(id) => id,
                        None if outer.contains(&name) => g.add_value(name.clone(), ValueType::Unknown, Source::Outer),
                        None => {
                            return Err(Error::model(format!(
                                "node {label}: a subgraph reads `{name}`, which no enclosing graph defines"
                            )))
                        }
                    };
                    if !implicit.contains(&id) {
                        implicit.push(id);
                    }
                }
            }
            g.add_node(Node {
                implicit,
                opset,
                name: np.name().to_string(),
                op_type: np.op_type().to_string(),
                domain,
                attrs,
                op,
                inputs,
                outputs,
            });
        }
        for vi in &gp.output {
            let name = vi.name();
            let id = match g.find(name) {
                Some(id) => id,
                None if outer.contains(name) => {
                    g.add_value(name.to_string(), ValueType::Unknown, Source::Outer)
                }
                None => {
                    return Err(Error::model(format!(
                        "graph output `{name}` is not produced by any node, input or initializer"
                    )))
                }
            };
            if let Some(t) = vi.r#type.as_ref() {
                let ty = value_type(t)?;
                if g.value(id).ty == ValueType::Unknown {
                    g.value_mut(id).ty = ty;
                }
            }
            g.outputs.push(id);
        }
        for vi in &gp.value_info {
            if let (Some(id), Some(t)) = (g.find(vi.name()), vi.r#type.as_ref()) {
                if g.value(id).ty == ValueType::Unknown {
                    if let Ok(ty) = value_type(t) {
                        g.value_mut(id).ty = ty;
                    }
                }
            }
        }
        g.rewire();
        Ok(g)
    }

    /// Expands calls to model-local functions (recursively) into plain nodes.
    fn flatten(
        &mut self,
        n: NodeProto,
        opsets: Arc<Opsets>,
        out: &mut Vec<FlatNode>,
        depth: usize,
    ) -> Result<()> {
        let key = (domain_key(n.domain()).to_string(), n.op_type().to_string());
        let Some(f) = self.functions.get(&key).copied() else {
            if key.0 == super::contrib::DOMAIN
                && opsets.contains_key(&key.0)
                && super::contrib::OPS.contains(&n.op_type())
            {
                self.counter += 1;
                let prefix = format!("{}__{}_{}/", n.name(), n.op_type(), self.counter);
                let body = super::contrib::body(&n, &prefix)
                    .map_err(|e| Error::model(format!("node {}: {e}", node_label(&n))))?;
                let mut ops = (*opsets).clone();
                ops.insert(String::new(), super::contrib::body_opset(n.op_type()));
                let ops = Arc::new(ops);
                out.extend(body.into_iter().map(|proto| FlatNode {
                    proto,
                    opsets: ops.clone(),
                }));
                return Ok(());
            }
            out.push(FlatNode { proto: n, opsets });
            return Ok(());
        };
        if depth > MAX_DEPTH {
            return Err(Error::model(format!(
                "function `{}` calls itself (or nests deeper than {MAX_DEPTH})",
                f.name()
            )));
        }
        self.counter += 1;
        let prefix = format!("{}__{}_{}/", n.name(), f.name(), self.counter);
        let mut rename: HashMap<String, String> = HashMap::new();
        for (i, formal) in f.input.iter().enumerate() {
            rename.insert(formal.clone(), n.input.get(i).cloned().unwrap_or_default());
        }
        for (i, formal) in f.output.iter().enumerate() {
            rename.insert(formal.clone(), n.output.get(i).cloned().unwrap_or_default());
        }
        // Attribute values: the call's, else the function's defaults.
        let mut attr_vals: HashMap<String, AttributeProto> = HashMap::new();
        for a in &f.attribute_proto {
            attr_vals.insert(a.name().to_string(), a.clone());
        }
        for a in &n.attribute {
            attr_vals.insert(a.name().to_string(), a.clone());
        }
        let mut fops = (*opsets).clone();
        for o in &f.opset_import {
            fops.insert(domain_key(o.domain()).to_string(), o.version());
        }
        let fops = Arc::new(fops);
        for body in &f.node {
            let mut b = body.clone();
            for name in b.input.iter_mut().chain(b.output.iter_mut()) {
                if name.is_empty() {
                    continue;
                }
                *name = rename
                    .entry(name.clone())
                    .or_insert_with(|| format!("{prefix}{name}"))
                    .clone();
            }
            if !b.name().is_empty() {
                b.name = Some(format!("{prefix}{}", b.name()));
            }
            let mut attrs = Vec::new();
            for a in b.attribute {
                match a.ref_attr_name.as_deref() {
                    Some(r) if !r.is_empty() => {
                        if let Some(v) = attr_vals.get(r) {
                            let mut v = v.clone();
                            v.name = a.name.clone();
                            attrs.push(v);
                        }
                    }
                    _ => attrs.push(a),
                }
            }
            b.attribute = attrs;
            self.flatten(b, fops.clone(), out, depth + 1)?;
        }
        Ok(())
    }

    fn attrs(
        &mut self,
        list: &[AttributeProto],
        opsets: &Arc<Opsets>,
        scope: &HashSet<String>,
        depth: usize,
        label: &str,
    ) -> Result<Attrs> {
        let mut out = BTreeMap::new();
        for a in list {
            let v = self.attr(a, opsets, scope, depth).map_err(|e| match e {
                Error::Model(m) => {
                    Error::model(format!("node {label}, attribute `{}`: {m}", a.name()))
                }
                other => other,
            })?;
            out.insert(a.name().to_string(), v);
        }
        Ok(Attrs(out))
    }

    fn attr(
        &mut self,
        a: &AttributeProto,
        opsets: &Arc<Opsets>,
        scope: &HashSet<String>,
        depth: usize,
    ) -> Result<Attr> {
        use proto::attribute_proto::AttributeType as T;
        let what = format!("attribute `{}`", a.name());
        let ty = a
            .r#type
            .and_then(|t| T::try_from(t).ok())
            .unwrap_or(T::Undefined);
        let ty = if ty == T::Undefined {
            guess_attr_type(a)
        } else {
            ty
        };
        Ok(match ty {
            T::Float => Attr::Float(a.f()),
            T::Int => Attr::Int(a.i()),
            T::String => Attr::String(String::from_utf8_lossy(a.s()).into_owned()),
            T::Tensor => Attr::Tensor(from_proto(
                a.t.as_ref()
                    .ok_or_else(|| Error::model("tensor attribute without a tensor"))?,
                self.ext,
                &what,
            )?),
            T::SparseTensor => Attr::Tensor(sparse_to_dense(
                a.sparse_tensor
                    .as_ref()
                    .ok_or_else(|| Error::model("sparse tensor attribute without a tensor"))?,
                self.ext,
                a.name(),
            )?),
            T::Graph => {
                let gp =
                    a.g.as_ref()
                        .ok_or_else(|| Error::model("graph attribute without a graph"))?;
                Attr::Graph(Arc::new(self.graph(gp, opsets, scope, depth + 1)?))
            }
            T::Floats => Attr::Floats(a.floats.clone()),
            T::Ints => Attr::Ints(a.ints.clone()),
            T::Strings => Attr::Strings(
                a.strings
                    .iter()
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect(),
            ),
            T::Tensors => Attr::Tensors(
                a.tensors
                    .iter()
                    .map(|t| from_proto(t, self.ext, &what))
                    .collect::<Result<_>>()?,
            ),
            T::Graphs => Attr::Graphs(
                a.graphs
                    .iter()
                    .map(|g| self.graph(g, opsets, scope, depth + 1).map(Arc::new))
                    .collect::<Result<_>>()?,
            ),
            T::TypeProto => Attr::Type(value_type(
                a.tp.as_ref()
                    .ok_or_else(|| Error::model("type attribute without a type"))?,
            )?),
            T::TypeProtos => Attr::Types(
                a.type_protos
                    .iter()
                    .map(value_type)
                    .collect::<Result<_>>()?,
            ),
            T::SparseTensors | T::Undefined => {
                return Err(Error::model(format!(
                    "{what} has an unsupported attribute type"
                )))
            }
        })
    }
}

fn guess_attr_type(a: &AttributeProto) -> proto::attribute_proto::AttributeType {
    use proto::attribute_proto::AttributeType as T;
    if a.f.is_some() {
        T::Float
    } else if a.i.is_some() {
        T::Int
    } else if a.s.is_some() {
        T::String
    } else if a.t.is_some() {
        T::Tensor
    } else if a.g.is_some() {
        T::Graph
    } else if !a.floats.is_empty() {
        T::Floats
    } else if !a.ints.is_empty() {
        T::Ints
    } else if !a.strings.is_empty() {
        T::Strings
    } else if !a.tensors.is_empty() {
        T::Tensors
    } else if !a.graphs.is_empty() {
        T::Graphs
    } else {
        T::Undefined
    }
}

pub fn node_label(n: &NodeProto) -> String {
    if n.name().is_empty() {
        let out = n.output.first().cloned().unwrap_or_default();
        format!("({} -> `{out}`)", n.op_type())
    } else {
        format!("`{}` ({})", n.name(), n.op_type())
    }
}

/// The value of a Constant node in any of its attribute forms.
pub fn constant_value(attrs: &Attrs) -> std::result::Result<Tensor, String> {
    let (name, a) = attrs
        .iter()
        .next()
        .ok_or("Constant has no value attribute")?;
    if attrs.0.len() != 1 {
        return Err("Constant must have exactly one value attribute".into());
    }
    Ok(match (name.as_str(), a) {
        ("value" | "sparse_value", Attr::Tensor(t)) => t.clone(),
        ("value_float", Attr::Float(x)) => Tensor::scalar(*x),
        ("value_floats", Attr::Floats(v)) => Tensor::from_vec(&[v.len()], v.clone()),
        ("value_int", Attr::Int(x)) => Tensor::scalar(*x),
        ("value_ints", Attr::Ints(v)) => Tensor::from_vec(&[v.len()], v.clone()),
        ("value_string", Attr::String(s)) => Tensor::scalar(s.clone()),
        ("value_strings", Attr::Strings(v)) => Tensor::from_vec(&[v.len()], v.clone()),
        (n, a) => {
            return Err(format!(
                "Constant attribute `{n}` = {a} is not a valid value form"
            ))
        }
    })
}

fn sparse_to_dense(
    st: &proto::SparseTensorProto,
    ext: Option<&ExternalData>,
    name: &str,
) -> Result<Tensor> {
    let what = format!("sparse tensor `{name}`");
    let values = from_proto(
        st.values
            .as_ref()
            .ok_or_else(|| Error::model(format!("{what} has no values")))?,
        ext,
        &what,
    )?;
    let indices = from_proto(
        st.indices
            .as_ref()
            .ok_or_else(|| Error::model(format!("{what} has no indices")))?,
        ext,
        &what,
    )?;
    let (shape, n) = super::tensor::checked_shape(&st.dims, &what)?;
    let vals = values
        .to_f64()
        .ok_or_else(|| Error::model(format!("{what}: non-numeric values")))?;
    let idx = indices
        .to_i64_vec()
        .ok_or_else(|| Error::model(format!("{what}: indices must be integers")))?;
    let nnz = vals.len();
    let mut dense = vec![0f64; n];
    let rank = shape.len();
    for k in 0..nnz {
        let flat = if indices.rank() == 1 {
            idx[k]
        } else {
            let mut f = 0i64;
            for (d, &dim) in shape.iter().enumerate() {
                f = f * dim as i64 + idx.get(k * rank + d).copied().unwrap_or(-1);
            }
            f
        };
        if flat < 0 || flat as usize >= n {
            return Err(Error::model(format!(
                "{what}: index {flat} is out of range"
            )));
        }
        dense[flat as usize] = vals.iter().nth(k).copied().unwrap_or(0.0);
    }
    Ok(Tensor::from_f64(
        values.dtype(),
        ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&shape), dense).expect("count"),
        false,
    ))
}

/// TypeProto -> ValueType.
pub fn value_type(t: &TypeProto) -> Result<ValueType> {
    use proto::type_proto::Value as V;
    Ok(match &t.value {
        Some(V::TensorType(tt)) => {
            let code = tt.elem_type();
            let dt = DType::from_onnx(code)
                .ok_or_else(|| Error::model(format!("unknown element type code {code}")))?;
            let shape = tt.shape.as_ref().map(|s| {
                s.dim
                    .iter()
                    .map(|d| match &d.value {
                        Some(proto::tensor_shape_proto::dimension::Value::DimValue(v))
                            if *v >= 0 =>
                        {
                            Dim::Fixed(*v as usize)
                        }
                        Some(proto::tensor_shape_proto::dimension::Value::DimParam(p))
                            if !p.is_empty() =>
                        {
                            Dim::Sym(p.clone())
                        }
                        _ => Dim::Sym("?".into()),
                    })
                    .collect()
            });
            ValueType::Tensor { dt, shape }
        }
        Some(V::SequenceType(s)) => ValueType::Sequence(Box::new(
            s.elem_type
                .as_ref()
                .map(|e| value_type(e))
                .transpose()?
                .unwrap_or(ValueType::Unknown),
        )),
        Some(V::OptionalType(o)) => ValueType::Optional(Box::new(
            o.elem_type
                .as_ref()
                .map(|e| value_type(e))
                .transpose()?
                .unwrap_or(ValueType::Unknown),
        )),
        _ => ValueType::Unknown,
    })
}
