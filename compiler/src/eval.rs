//! The reference evaluator: runs a graph node by node with the ops' ndarray
//! implementations. It is the oracle for tests, the engine of constant folding, and
//! `onnxc run --engine reference`.

use crate::error::{Error, Result};
use crate::ir::{Dim, Graph, OpError, OpResult, Source, SubgraphRunner, Value, ValueType};
use std::collections::HashMap;

/// Values visible from enclosing graphs, innermost first.
struct Scope<'a> {
    names: HashMap<&'a str, &'a Value>,
    parent: Option<&'a Scope<'a>>,
}

impl<'a> Scope<'a> {
    fn lookup(&self, name: &str) -> Option<&'a Value> {
        self.names
            .get(name)
            .copied()
            .or_else(|| self.parent.and_then(|p| p.lookup(name)))
    }
}

/// Runs `g` on `inputs` (one per graph input, in order) and returns its outputs.
pub fn run(g: &Graph, inputs: Vec<Value>) -> Result<Vec<Value>> {
    check_inputs(g, &inputs)?;
    run_scoped(g, inputs, None)
}

/// Checks that each input value matches the graph's declared dtype and fixed dims.
pub fn check_inputs(g: &Graph, inputs: &[Value]) -> Result<()> {
    if inputs.len() != g.inputs.len() {
        return Err(Error::Usage(format!(
            "the model has {} inputs but {} were given",
            g.inputs.len(),
            inputs.len()
        )));
    }
    for (&id, v) in g.inputs.iter().zip(inputs) {
        let info = g.value(id);
        if let (ValueType::Tensor { dt, shape }, Value::Tensor(t)) = (&info.ty, v) {
            if *dt != t.dtype() {
                return Err(Error::Usage(format!(
                    "input `{}` must be {dt} but {} was given",
                    info.name,
                    t.dtype()
                )));
            }
            if let Some(shape) = shape {
                let ok = shape.len() == t.rank()
                    && shape.iter().zip(t.shape()).all(|(d, &n)| match d {
                        Dim::Fixed(f) => *f == n,
                        Dim::Sym(_) => true,
                    });
                if !ok {
                    return Err(Error::Usage(format!(
                        "input `{}` must have shape {} but has {:?}",
                        info.name,
                        info.ty,
                        t.shape()
                    )));
                }
            }
        }
    }
    Ok(())
}

fn run_scoped(g: &Graph, inputs: Vec<Value>, outer: Option<&Scope>) -> Result<Vec<Value>> {
    let order = g
        .topo_order()
        .map_err(|c| Error::model(format!("cycle through {}", c.join(", "))))?;
    let mut env: Vec<Option<Value>> = vec![None; g.values.len()];
    for (&id, v) in g.inputs.iter().zip(inputs) {
        env[id] = Some(v);
    }
    for (id, info) in g.values.iter().enumerate() {
        match info.source {
            Source::Const => env[id] = Some(Value::Tensor(g.consts[&id].clone())),
            Source::Outer => {
                let v = outer.and_then(|s| s.lookup(&info.name)).ok_or_else(|| {
                    Error::model(format!(
                        "`{}` is not defined in any enclosing graph",
                        info.name
                    ))
                })?;
                env[id] = Some(v.clone());
            }
            _ => {}
        }
    }
    // Free each intermediate after its last use.
    let mut last_use: HashMap<usize, usize> = HashMap::new();
    for (step, &n) in order.iter().enumerate() {
        for v in g.nodes[n]
            .inputs
            .iter()
            .flatten()
            .chain(&g.nodes[n].implicit)
        {
            last_use.insert(*v, step);
        }
    }
    for &o in &g.outputs {
        last_use.insert(o, usize::MAX);
    }
    for (step, &n) in order.iter().enumerate() {
        let node = &g.nodes[n];
        let label = || g.node_label(n);
        let outs = {
            let mut ins = Vec::with_capacity(node.inputs.len());
            for (i, inp) in node.inputs.iter().enumerate() {
                match inp {
                    None => ins.push(None),
                    Some(v) => match env[*v].as_ref() {
                        Some(val) => ins.push(Some(val)),
                        None => {
                            return Err(Error::Eval {
                                node: label(),
                                msg: format!("input {i} `{}` has no value", g.value(*v).name),
                            })
                        }
                    },
                }
            }
            let needs_scope = !node.op.subgraphs().is_empty();
            let result = if needs_scope {
                let mut names = HashMap::new();
                for (id, val) in env.iter().enumerate() {
                    if let Some(val) = val {
                        names.insert(g.values[id].name.as_str(), val);
                    }
                }
                let scope = Scope {
                    names,
                    parent: outer,
                };
                let mut runner = Runner { scope: &scope };
                node.op.eval_with(&ins, &mut runner)
            } else {
                node.op.eval(&ins)
            };
            result.map_err(|e| Error::Eval {
                node: label(),
                msg: e.0,
            })?
        };
        if outs.len() < node.outputs.len() {
            // Trailing optional outputs an op did not produce are only an error if used.
            for &o in &node.outputs[outs.len()..] {
                if last_use.contains_key(&o) {
                    return Err(Error::Eval {
                        node: label(),
                        msg: format!("output `{}` was not produced", g.value(o).name),
                    });
                }
            }
        }
        for (&o, v) in node.outputs.iter().zip(outs) {
            env[o] = Some(v);
        }
        for v in node.inputs.iter().flatten().chain(&node.implicit) {
            if last_use.get(v) == Some(&step) && g.value(*v).source != Source::Const {
                env[*v] = None;
            }
        }
    }
    g.outputs
        .iter()
        .map(|&o| {
            env[o].clone().ok_or_else(|| {
                Error::model(format!("output `{}` was never computed", g.value(o).name))
            })
        })
        .collect()
}

struct Runner<'a> {
    scope: &'a Scope<'a>,
}

impl SubgraphRunner for Runner<'_> {
    fn run(&mut self, g: &Graph, inputs: Vec<Value>) -> OpResult<Vec<Value>> {
        if inputs.len() != g.inputs.len() {
            return Err(OpError::new(format!(
                "subgraph `{}` takes {} inputs but was given {}",
                g.name,
                g.inputs.len(),
                inputs.len()
            )));
        }
        run_scoped(g, inputs, Some(self.scope))
            .map_err(|e| OpError::new(format!("in subgraph `{}`: {e}", g.name)))
    }
}
