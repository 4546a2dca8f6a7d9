//! Control flow: If, Loop, Scan. Each holds subgraphs that the evaluator runs through
//! [`SubgraphRunner`]; values the bodies name from the enclosing graph are resolved by it.

use super::util::{axis, input, opt_input, scalar_i64};
use super::{OpCtx, Registry, ONNX};
use crate::ir::{Graph, Op, OpError, OpResult, SubgraphRunner, Tensor, Value, ValueType};
use crate::{bail, ensure};
use ndarray::{ArrayD, Axis};
use std::sync::Arc;

pub fn register(r: &mut Registry) {
    r.add_builder(ONNX, "If", |ctx| {
        Ok(Arc::new(If {
            then_branch: ctx.attrs.graph("then_branch")?,
            else_branch: ctx.attrs.graph("else_branch")?,
        }))
    });
    r.add_builder(ONNX, "Loop", |ctx| {
        Ok(Arc::new(Loop {
            body: ctx.attrs.graph("body")?,
        }))
    });
    r.add_builder(ONNX, "Scan", build_scan);
}

#[derive(Debug)]
struct If {
    then_branch: Arc<Graph>,
    else_branch: Arc<Graph>,
}

impl Op for If {
    fn eval(&self, _: &[Option<&Value>]) -> OpResult<Vec<Value>> {
        bail!("If needs the evaluator's subgraph runner")
    }

    fn eval_with(
        &self,
        ins: &[Option<&Value>],
        sub: &mut dyn SubgraphRunner,
    ) -> OpResult<Vec<Value>> {
        let c = input(ins, 0)?;
        let cond = c
            .to_bool()
            .ok_or_else(|| OpError::new("If: cond must be a bool tensor"))?;
        ensure!(
            cond.len() == 1,
            "If: cond must hold one value, has shape {:?}",
            c.shape()
        );
        let branch = if cond.iter().next().copied().unwrap_or(false) {
            &self.then_branch
        } else {
            &self.else_branch
        };
        sub.run(branch, Vec::new())
    }

    fn subgraphs(&self) -> Vec<&Graph> {
        vec![&self.then_branch, &self.else_branch]
    }
}

#[derive(Debug)]
struct Loop {
    body: Arc<Graph>,
}

/// Hard upper bound on loop iterations the evaluator runs (a hostile trip count would
/// otherwise hang).
const MAX_TRIPS: i64 = 1 << 24;

impl Op for Loop {
    fn eval(&self, _: &[Option<&Value>]) -> OpResult<Vec<Value>> {
        bail!("Loop needs the evaluator's subgraph runner")
    }

    fn eval_with(
        &self,
        ins: &[Option<&Value>],
        sub: &mut dyn SubgraphRunner,
    ) -> OpResult<Vec<Value>> {
        let max_trips = opt_input(ins, 0)?.map(scalar_i64).transpose()?;
        let mut cond = match opt_input(ins, 1)? {
            Some(t) => truthy(t)?,
            None => true,
        };
        let mut carried: Vec<Value> = Vec::new();
        for (i, v) in ins.iter().enumerate().skip(2) {
            carried.push(
                v.ok_or_else(|| OpError::new(format!("Loop: loop-carried input {i} is missing")))?
                    .clone(),
            );
        }
        let n_carried = carried.len();
        let n_body_out = self.body.outputs.len();
        ensure!(
            n_body_out > n_carried,
            "Loop: the body has {n_body_out} outputs but needs the condition plus {n_carried} loop-carried values"
        );
        let n_scan = n_body_out - 1 - n_carried;
        let mut scans: Vec<Vec<Value>> = vec![Vec::new(); n_scan];
        let mut i = 0i64;
        while cond && max_trips.is_none_or(|m| i < m) {
            ensure!(
                i < MAX_TRIPS,
                "Loop: more than {MAX_TRIPS} iterations; refusing to run on"
            );
            let mut args = vec![
                Value::Tensor(Tensor::scalar(i)),
                Value::Tensor(Tensor::scalar(cond)),
            ];
            args.extend(carried.iter().cloned());
            let outs = sub.run(&self.body, args)?;
            ensure!(
                outs.len() == n_body_out,
                "Loop: the body returned {} values, expected {n_body_out}",
                outs.len()
            );
            let mut it = outs.into_iter();
            let c = it.next().expect("length checked");
            cond = truthy(
                c.as_tensor()
                    .ok_or_else(|| OpError::new("Loop: body condition must be a tensor"))?,
            )?;
            carried = it.by_ref().take(n_carried).collect();
            for (k, v) in it.enumerate() {
                scans[k].push(v);
            }
            i += 1;
        }
        let mut result = carried;
        for (k, items) in scans.into_iter().enumerate() {
            let body_ty = &self.body.value(self.body.outputs[1 + n_carried + k]).ty;
            result.push(stack(items, body_ty)?);
        }
        Ok(result)
    }

    /// The trip count and the condition decide how many iterations run, so the shapes
    /// of the scan outputs.
    fn shape_inputs(&self) -> &'static [usize] {
        &[0, 1]
    }

    fn subgraphs(&self) -> Vec<&Graph> {
        vec![&self.body]
    }
}

fn truthy(t: &Tensor) -> OpResult<bool> {
    let b = t
        .to_bool()
        .ok_or_else(|| OpError::new("condition must be a bool tensor"))?;
    ensure!(
        b.len() == 1,
        "condition must hold one value, has shape {:?}",
        t.shape()
    );
    Ok(b.iter().next().copied().unwrap_or(false))
}

/// Stacks per-iteration values along a new axis 0 (empty: a [0] tensor of the body's dtype).
fn stack(items: Vec<Value>, ty: &ValueType) -> OpResult<Value> {
    if items.is_empty() {
        let dt = ty.dtype().unwrap_or(crate::ir::DType::F32);
        return Ok(Value::Tensor(Tensor::zeros(dt, &[0])));
    }
    let ts: Vec<Tensor> = items
        .into_iter()
        .map(|v| {
            v.into_tensor()
                .ok_or_else(|| OpError::new("scan outputs must be tensors"))
        })
        .collect::<OpResult<_>>()?;
    Ok(Value::Tensor(stack_tensors(&ts, 0)?))
}

/// Stacks same-shaped tensors along a new axis `ax`.
pub fn stack_tensors(ts: &[Tensor], ax: usize) -> OpResult<Tensor> {
    let first = &ts[0];
    for t in ts {
        ensure!(
            t.dtype() == first.dtype() && t.shape() == first.shape(),
            "cannot stack {}{:?} with {}{:?}",
            t.dtype(),
            t.shape(),
            first.dtype(),
            first.shape()
        );
    }
    let st = first
        .dtype()
        .storage()
        .ok_or_else(|| OpError::new("unsupported dtype"))?;
    crate::with_storage_type!(st, T => {
        let views: Vec<_> = ts
            .iter()
            .map(|t| t.array::<T>().expect("same dtype").view().insert_axis(Axis(ax)))
            .collect();
        let a: ArrayD<T> = ndarray::concatenate(Axis(ax), &views).map_err(|e| OpError::new(e.to_string()))?;
        Ok(Tensor::from_array_as(first.dtype(), a))
    })
}

#[derive(Debug)]
struct Scan {
    body: Arc<Graph>,
    num_scan_inputs: usize,
    input_axes: Vec<i64>,
    input_dirs: Vec<i64>,
    output_axes: Vec<i64>,
    output_dirs: Vec<i64>,
    /// Opset 8: the first input is sequence_lens and axis 0 is a batch axis.
    batched: bool,
}

fn build_scan(ctx: &OpCtx) -> OpResult<Arc<dyn Op>> {
    let n = ctx.attrs.req_int("num_scan_inputs")?;
    ensure!(n >= 0, "Scan: num_scan_inputs must not be negative");
    Ok(Arc::new(Scan {
        body: ctx.attrs.graph("body")?,
        num_scan_inputs: n as usize,
        input_axes: ctx.attrs.ints("scan_input_axes", &[])?,
        input_dirs: ctx.attrs.ints("directions", &[]).and_then(|d| {
            if d.is_empty() {
                ctx.attrs.ints("scan_input_directions", &[])
            } else {
                Ok(d)
            }
        })?,
        output_axes: ctx.attrs.ints("scan_output_axes", &[])?,
        output_dirs: ctx.attrs.ints("scan_output_directions", &[])?,
        batched: ctx.opset < 9,
    }))
}

impl Op for Scan {
    fn eval(&self, _: &[Option<&Value>]) -> OpResult<Vec<Value>> {
        bail!("Scan needs the evaluator's subgraph runner")
    }

    fn eval_with(
        &self,
        ins: &[Option<&Value>],
        sub: &mut dyn SubgraphRunner,
    ) -> OpResult<Vec<Value>> {
        if self.batched {
            // Opset 8: run each batch entry separately, then stack the results.
            ensure!(
                opt_input(ins, 0)?.is_none(),
                "Scan-8: sequence_lens is not supported"
            );
            let rest: Vec<&Tensor> = (1..ins.len())
                .map(|i| input(ins, i))
                .collect::<OpResult<_>>()?;
            ensure!(!rest.is_empty(), "Scan: no inputs");
            let batch = rest[0].shape().first().copied().unwrap_or(0);
            let mut per_out: Vec<Vec<Tensor>> = Vec::new();
            for b in 0..batch {
                let slices: Vec<Value> = rest
                    .iter()
                    .map(|t| take_index(t, 0, b).map(Value::Tensor))
                    .collect::<OpResult<_>>()?;
                let refs: Vec<Option<&Value>> = slices.iter().map(Some).collect();
                let outs = self.scan_once(&refs, sub)?;
                for (k, o) in outs.into_iter().enumerate() {
                    if per_out.len() <= k {
                        per_out.push(Vec::new());
                    }
                    per_out[k].push(
                        o.into_tensor()
                            .ok_or_else(|| OpError::new("Scan outputs must be tensors"))?,
                    );
                }
            }
            return per_out
                .iter()
                .map(|ts| stack_tensors(ts, 0).map(Value::Tensor))
                .collect();
        }
        self.scan_once(ins, sub)
    }

    fn subgraphs(&self) -> Vec<&Graph> {
        vec![&self.body]
    }
}

impl Scan {
    fn scan_once(
        &self,
        ins: &[Option<&Value>],
        sub: &mut dyn SubgraphRunner,
    ) -> OpResult<Vec<Value>> {
        let m = self.num_scan_inputs;
        ensure!(
            ins.len() >= m,
            "Scan: {} inputs but num_scan_inputs is {m}",
            ins.len()
        );
        let n_state = ins.len() - m;
        let mut state: Vec<Value> = (0..n_state)
            .map(|i| {
                ins[i]
                    .cloned()
                    .ok_or_else(|| OpError::new(format!("Scan: state input {i} is missing")))
            })
            .collect::<OpResult<_>>()?;
        let scan_ins: Vec<&Tensor> = (n_state..ins.len())
            .map(|i| input(ins, i))
            .collect::<OpResult<_>>()?;
        let mut axes = Vec::with_capacity(m);
        let mut len = None;
        for (j, t) in scan_ins.iter().enumerate() {
            let a = axis(self.input_axes.get(j).copied().unwrap_or(0), t.rank())?;
            let l = t.shape()[a];
            ensure!(
                len.is_none_or(|x| x == l),
                "Scan: scan inputs have different lengths"
            );
            len = Some(l);
            axes.push(a);
        }
        let len = len.unwrap_or(0);
        let n_out = self.body.outputs.len();
        ensure!(
            n_out >= n_state,
            "Scan: the body returns fewer values than there are state variables"
        );
        let mut scans: Vec<Vec<Tensor>> = vec![Vec::new(); n_out - n_state];
        for it in 0..len {
            let mut args = state.clone();
            for (j, t) in scan_ins.iter().enumerate() {
                let rev = self.input_dirs.get(j).copied().unwrap_or(0) == 1;
                let idx = if rev { len - 1 - it } else { it };
                args.push(Value::Tensor(take_index(t, axes[j], idx)?));
            }
            let outs = sub.run(&self.body, args)?;
            ensure!(
                outs.len() == n_out,
                "Scan: the body returned {} values, expected {n_out}",
                outs.len()
            );
            let mut o = outs.into_iter();
            state = o.by_ref().take(n_state).collect();
            for (k, v) in o.enumerate() {
                scans[k].push(
                    v.into_tensor()
                        .ok_or_else(|| OpError::new("Scan outputs must be tensors"))?,
                );
            }
        }
        let mut result = state;
        for (k, mut items) in scans.into_iter().enumerate() {
            if self.output_dirs.get(k).copied().unwrap_or(0) == 1 {
                items.reverse();
            }
            if items.is_empty() {
                let dt = self
                    .body
                    .value(self.body.outputs[n_state + k])
                    .ty
                    .dtype()
                    .unwrap_or(crate::ir::DType::F32);
                result.push(Value::Tensor(Tensor::zeros(dt, &[0])));
                continue;
            }
            let rank = items[0].rank() + 1;
            let a = axis(self.output_axes.get(k).copied().unwrap_or(0), rank)?;
            result.push(Value::Tensor(stack_tensors(&items, a)?));
        }
        Ok(result)
    }
}

/// The slice `t[.., idx, ..]` along `ax`, with that axis removed.
pub fn take_index(t: &Tensor, ax: usize, idx: usize) -> OpResult<Tensor> {
    ensure!(
        ax < t.rank() && idx < t.shape()[ax],
        "index {idx} out of range on axis {ax} of {:?}",
        t.shape()
    );
    Ok(crate::map_data!(t, a => a.index_axis(Axis(ax), idx).to_owned()))
}
