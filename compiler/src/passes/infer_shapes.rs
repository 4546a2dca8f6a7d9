//! Shape and type inference with partial evaluation: every node whose inputs are all
//! known constants is evaluated (so PyTorch's Shape -> Gather -> Concat -> Reshape
//! chains become constants), `Shape`/`Size` of a statically shaped value is a constant,
//! and every other node gets its output types from its op's `infer`.

use crate::error::{Error, Result};
use crate::ir::{Dim, Graph, InferInput, Node, Source, Tensor, Value, ValueId, ValueType};
use std::collections::HashMap;

/// What inference learned.
#[derive(Debug, Default)]
pub struct InferReport {
    /// Values known at compile time (constants and folded values).
    pub known: HashMap<ValueId, Value>,
    /// Nodes whose outputs could not be typed, with the reason.
    pub unresolved: Vec<String>,
}

/// Binds graph input shapes from `name=1x3x224x224` bindings; symbolic dims with the
/// same name elsewhere are bound consistently.
pub fn bind_input_shapes(g: &mut Graph, bindings: &[(String, Vec<usize>)]) -> Result<()> {
    let mut syms: HashMap<String, usize> = HashMap::new();
    for (name, dims) in bindings {
        let id = g
            .inputs
            .iter()
            .copied()
            .find(|&i| g.value(i).name == *name)
            .ok_or_else(|| {
                let names: Vec<&str> = g.inputs.iter().map(|&i| g.value(i).name.as_str()).collect();
                Error::Usage(format!(
                    "--shape names `{name}`, which is not an input; inputs: {}",
                    names.join(", ")
                ))
            })?;
        let info = g.value_mut(id);
        let ValueType::Tensor { dt, shape } = &info.ty else {
            return Err(Error::Usage(format!(
                "input `{name}` is not a tensor; --shape cannot bind it"
            )));
        };
        if let Some(old) = shape {
            if old.len() != dims.len() {
                return Err(Error::Usage(format!(
                    "--shape {name}: the input has rank {} ({}) but {} dims were given",
                    old.len(),
                    info.ty,
                    dims.len()
                )));
            }
            for (d, &n) in old.iter().zip(dims) {
                match d {
                    Dim::Fixed(f) if *f != n => {
                        return Err(Error::Usage(format!(
                        "--shape {name}: dim {f} of {} is fixed by the model and cannot become {n}",
                        info.ty
                    )))
                    }
                    Dim::Sym(s) if s != "?" => {
                        if let Some(prev) = syms.insert(s.clone(), n) {
                            if prev != n {
                                return Err(Error::Usage(format!(
                                    "symbolic dim `{s}` is bound to both {prev} and {n}"
                                )));
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        info.ty = ValueType::tensor(*dt, dims);
    }
    // Propagate symbol bindings to the other inputs.
    for &id in &g.inputs.clone() {
        if let ValueType::Tensor { shape: Some(s), .. } = &mut g.value_mut(id).ty {
            for d in s.iter_mut() {
                if let Dim::Sym(name) = d {
                    if let Some(&n) = syms.get(name.as_str()) {
                        *d = Dim::Fixed(n);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Lists every input dim that is still symbolic, or Ok when all are fixed.
pub fn check_static_inputs(g: &Graph) -> Result<()> {
    let free = free_input_dims(g);
    if free.is_empty() {
        Ok(())
    } else {
        Err(Error::Shape(format!(
            "these dims are not fixed; bind them with --shape NAME=DxDxD:\n  {}",
            free.join("\n  ")
        )))
    }
}

/// Every graph-input dim that is not a number, described with where it comes from.
pub fn free_input_dims(g: &Graph) -> Vec<String> {
    let mut free = Vec::new();
    for &id in &g.inputs {
        let info = g.value(id);
        match &info.ty {
            ValueType::Tensor { shape: Some(s), .. } => {
                for (i, d) in s.iter().enumerate() {
                    if let Dim::Sym(name) = d {
                        free.push(format!(
                            "input `{}` dim {i} (`{name}`) of {}",
                            info.name, info.ty
                        ));
                    }
                }
            }
            ValueType::Tensor { shape: None, .. } => {
                free.push(format!("input `{}` has no declared shape", info.name))
            }
            _ => {}
        }
    }
    free
}

/// Infers the types of every value; folds what is computable at compile time.
pub fn infer_shapes(g: &mut Graph) -> Result<InferReport> {
    let mut rep = InferReport::default();
    for (&id, t) in &g.consts {
        rep.known.insert(id, Value::Tensor(t.clone()));
    }
    let order = g
        .topo_order()
        .map_err(|c| Error::model(format!("cycle through {}", c.join(", "))))?;
    for n in order {
        let node = g.nodes[n].clone();
        let inputs: Vec<Option<InferInput>> = node
            .inputs
            .iter()
            .map(|i| {
                i.map(|v| InferInput {
                    ty: g.value(v).ty.clone(),
                    value: rep.known.get(&v).cloned(),
                })
            })
            .collect();
        // Partial evaluation.
        let folded = partial_eval(g, &node, &inputs, &rep.known);
        if let Some(vals) = folded {
            for (&o, v) in node.outputs.iter().zip(vals) {
                g.value_mut(o).ty = v.value_type();
                rep.known.insert(o, v);
            }
            continue;
        }
        match node.op.infer(&inputs) {
            Ok(Some(types)) => {
                for (&o, t) in node.outputs.iter().zip(types) {
                    g.value_mut(o).ty = t;
                }
            }
            Ok(None) => {
                let non_tensor = inputs.iter().enumerate().find_map(|(i, x)| {
                    let ty = &x.as_ref()?.ty;
                    matches!(ty, ValueType::Sequence(_) | ValueType::Optional(_))
                        .then(|| format!("input {i} is {ty}"))
                });
                let why = if let Some(what) = non_tensor {
                    format!(
                        "{what}: compiled code holds tensors only (sequences and optionals \
                         have run-time lengths and presence); keep them outside the model"
                    )
                } else if !node.op.subgraphs().is_empty() {
                    "control flow (a node with subgraphs): its output types are not inferred statically yet".to_string()
                } else if node.op.data_dependent_shape() {
                    "its output shape depends on the input data".to_string()
                } else if node.op.shape_inputs().iter().any(|&i| {
                    inputs
                        .get(i)
                        .is_some_and(|x| x.as_ref().is_some_and(|x| x.value.is_none()))
                }) {
                    format!(
                        "inputs {:?} decide its output shape and are not constant",
                        node.op.shape_inputs()
                    )
                } else {
                    "an input's shape is not known".to_string()
                };
                rep.unresolved.push(format!("{}: {why}", g.node_label(n)));
            }
            Err(e) => {
                return Err(Error::Shape(format!("{}: {e}", g.node_label(n))));
            }
        }
    }
    Ok(rep)
}

/// The outputs of `node` when they are computable at compile time: every input is known
/// (and the op is not random, has no subgraph), or it is `Shape`/`Size` of a statically
/// shaped value.
fn partial_eval(
    g: &Graph,
    node: &Node,
    inputs: &[Option<InferInput>],
    known: &HashMap<ValueId, Value>,
) -> Option<Vec<Value>> {
    let all_known = node.inputs.iter().flatten().all(|v| known.contains_key(v))
        && node.op.subgraphs().is_empty()
        && !node
            .inputs
            .iter()
            .flatten()
            .any(|v| g.value(*v).source == Source::Outer);
    if all_known && !is_random(&node.op_type) {
        let refs: Vec<Option<&Value>> = inputs
            .iter()
            .map(|i| i.as_ref().and_then(|i| i.value.as_ref()))
            .collect();
        node.op.eval(&refs).ok()
    } else if matches!(node.op_type.as_str(), "Shape" | "Size") && node.domain.is_empty() {
        fold_shape_op(&node.op_type, &node.attrs, inputs)
    } else {
        None
    }
}

/// What partial evaluation knows at compile time (constants and the values
/// [`infer_shapes`] folds) on a graph whose types are already inferred, without running
/// type inference again (for the passes).
pub fn known_values(g: &Graph) -> Result<HashMap<ValueId, Value>> {
    let mut known: HashMap<ValueId, Value> = g
        .consts
        .iter()
        .map(|(&id, t)| (id, Value::Tensor(t.clone())))
        .collect();
    let order = g
        .topo_order()
        .map_err(|c| Error::model(format!("cycle through {}", c.join(", "))))?;
    for n in order {
        let node = &g.nodes[n];
        let inputs: Vec<Option<InferInput>> = node
            .inputs
            .iter()
            .map(|i| {
                i.map(|v| InferInput {
                    ty: g.value(v).ty.clone(),
                    value: known.get(&v).cloned(),
                })
            })
            .collect();
        if let Some(vals) = partial_eval(g, node, &inputs, &known) {
            for (&o, v) in node.outputs.iter().zip(vals) {
                known.insert(o, v);
            }
        }
    }
    Ok(known)
}

fn is_random(op: &str) -> bool {
    matches!(
        op,
        "RandomNormal"
            | "RandomUniform"
            | "RandomNormalLike"
            | "RandomUniformLike"
            | "Multinomial"
            | "Bernoulli"
    )
}

pub(crate) fn fold_shape_op(
    op: &str,
    attrs: &crate::ir::Attrs,
    inputs: &[Option<InferInput>],
) -> Option<Vec<Value>> {
    let shape = inputs.first()?.as_ref()?.ty.static_shape()?;
    let t = if op == "Size" {
        Tensor::scalar(shape.iter().product::<usize>() as i64)
    } else {
        let r = shape.len() as i64;
        let clamp = |x: i64| {
            if x < 0 {
                (x + r).clamp(0, r)
            } else {
                x.clamp(0, r)
            }
        };
        let start = clamp(attrs.int("start", 0).ok()?);
        let end = clamp(attrs.int("end", r).ok()?);
        let v: Vec<i64> = shape[start as usize..end.max(start) as usize]
            .iter()
            .map(|&d| d as i64)
            .collect();
        Tensor::from_vec(&[v.len()], v)
    };
    Some(vec![Value::Tensor(t)])
}
