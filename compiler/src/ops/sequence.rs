//! Sequences and optionals: SequenceEmpty/Construct/Insert/At/Erase/Length,
//! ConcatFromSequence, SplitToSequence, SequenceMap, Optional, OptionalHasElement,
//! OptionalGetElement.

use super::control::stack_tensors;
use super::util::{axis, input, ints, opt_input, out, scalar_i64};
use super::{OpCtx, Registry, ONNX};
use crate::ir::{
    Attr, DType, Graph, Op, OpError, OpResult, SubgraphRunner, Tensor, Value, ValueType,
};
use crate::{bail, ensure};
use ndarray::{ArrayD, Axis, Slice};
use std::sync::Arc;

pub fn register(r: &mut Registry) {
    r.add("SequenceEmpty", seq_empty);
    r.add("SequenceConstruct", seq_construct);
    r.add("SequenceInsert", seq_insert);
    r.add("SequenceAt", seq_at);
    r.add("SequenceErase", seq_erase);
    r.add("SequenceLength", seq_length);
    r.add("ConcatFromSequence", concat_from_sequence);
    r.add_shaped("SplitToSequence", split_to_sequence, &[1]);
    r.add("Optional", optional);
    r.add("OptionalHasElement", optional_has_element);
    r.add("OptionalGetElement", optional_get_element);
    r.add_builder(ONNX, "SequenceMap", |ctx| {
        Ok(Arc::new(SequenceMap {
            body: ctx.attrs.graph("body")?,
        }))
    });
}

fn seq<'a>(ins: &[Option<&'a Value>], i: usize) -> OpResult<(Option<DType>, &'a Vec<Value>)> {
    match ins.get(i).copied().flatten() {
        Some(Value::Sequence { elem, items }) => Ok((*elem, items)),
        Some(Value::Optional { value: Some(v), .. }) => match &**v {
            Value::Sequence { elem, items } => Ok((*elem, items)),
            _ => bail!("input {i} should be a sequence"),
        },
        Some(_) => bail!("input {i} should be a sequence"),
        None => bail!("required input {i} is missing"),
    }
}

fn sequence(elem: Option<DType>, items: Vec<Value>) -> OpResult<Vec<Value>> {
    Ok(vec![Value::Sequence { elem, items }])
}

fn seq_empty(ctx: &OpCtx, _: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let code = ctx.attrs.int("dtype", DType::F32 as i64)?;
    let dt = DType::from_onnx(code as i32)
        .ok_or_else(|| OpError::new(format!("unknown dtype {code}")))?;
    sequence(Some(dt), Vec::new())
}

fn seq_construct(_: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let items: Vec<Value> = (0..ins.len())
        .map(|i| input(ins, i).map(|t| Value::Tensor(t.clone())))
        .collect::<OpResult<_>>()?;
    let elem = items.first().and_then(|v| v.as_tensor()).map(|t| t.dtype());
    for v in &items {
        ensure!(
            v.as_tensor().map(|t| t.dtype()) == elem,
            "SequenceConstruct: all tensors must share a dtype"
        );
    }
    sequence(elem, items)
}

/// Normalises a sequence position; `len_ok` allows position == len (insert at end).
fn position(p: i64, len: usize, len_ok: bool) -> OpResult<usize> {
    let l = len as i64;
    let q = if p < 0 { p + l } else { p };
    let hi = if len_ok { l } else { l - 1 };
    ensure!(
        q >= 0 && q <= hi,
        "position {p} is out of range for a sequence of {len}"
    );
    Ok(q as usize)
}

fn seq_insert(_: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let (elem, items) = seq(ins, 0)?;
    let t = input(ins, 1)?;
    ensure!(
        elem.is_none_or(|e| e == t.dtype()),
        "SequenceInsert: tensor dtype {} differs from the sequence's",
        t.dtype()
    );
    let mut items = items.clone();
    let pos = match opt_input(ins, 2)? {
        Some(p) => position(scalar_i64(p)?, items.len(), true)?,
        None => items.len(),
    };
    items.insert(pos, Value::Tensor(t.clone()));
    sequence(Some(t.dtype()), items)
}

fn seq_at(_: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let (_, items) = seq(ins, 0)?;
    let pos = position(scalar_i64(input(ins, 1)?)?, items.len(), false)?;
    Ok(vec![items[pos].clone()])
}

fn seq_erase(_: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let (elem, items) = seq(ins, 0)?;
    let mut items = items.clone();
    ensure!(!items.is_empty(), "SequenceErase: the sequence is empty");
    let pos = match opt_input(ins, 1)? {
        Some(p) => position(scalar_i64(p)?, items.len(), false)?,
        None => items.len() - 1,
    };
    items.remove(pos);
    sequence(elem, items)
}

fn seq_length(_: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let (_, items) = seq(ins, 0)?;
    out(Tensor::scalar(items.len() as i64))
}

fn tensors(items: &[Value]) -> OpResult<Vec<Tensor>> {
    items
        .iter()
        .map(|v| {
            v.as_tensor()
                .cloned()
                .ok_or_else(|| OpError::new("sequence items must be tensors"))
        })
        .collect()
}

/// Concatenates tensors along an existing axis.
fn concat(ts: &[Tensor], ax: usize) -> OpResult<Tensor> {
    let first = &ts[0];
    let st = first
        .dtype()
        .storage()
        .ok_or_else(|| OpError::new("unsupported dtype"))?;
    for t in ts {
        ensure!(
            t.dtype() == first.dtype(),
            "cannot concatenate {} with {}",
            t.dtype(),
            first.dtype()
        );
        ensure!(
            t.rank() == first.rank(),
            "cannot concatenate rank {} with rank {}",
            t.rank(),
            first.rank()
        );
    }
    crate::with_storage_type!(st, T => {
        let views: Vec<_> = ts.iter().map(|t| t.array::<T>().expect("same dtype").view()).collect();
        let a: ArrayD<T> = ndarray::concatenate(Axis(ax), &views).map_err(|e| OpError::new(format!("shapes do not match for concatenation: {e}")))?;
        Ok(Tensor::from_array_as(first.dtype(), a))
    })
}

fn concat_from_sequence(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let (_, items) = seq(ins, 0)?;
    let ts = tensors(items)?;
    ensure!(!ts.is_empty(), "ConcatFromSequence: the sequence is empty");
    let new_axis = ctx.attrs.int("new_axis", 0)? != 0;
    let a = ctx.attrs.req_int("axis")?;
    let rank = ts[0].rank();
    if new_axis {
        out(stack_tensors(&ts, axis(a, rank + 1)?)?)
    } else {
        out(concat(&ts, axis(a, rank)?)?)
    }
}

fn split_to_sequence(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let t = input(ins, 0)?;
    let ax = axis(ctx.attrs.int("axis", 0)?, t.rank())?;
    let len = t.shape()[ax];
    let keepdims = ctx.attrs.int("keepdims", 1)? != 0;
    let (sizes, squeeze): (Vec<usize>, bool) = match opt_input(ins, 1)? {
        None => (vec![1; len], !keepdims),
        Some(s) if s.rank() == 0 => {
            let n = scalar_i64(s)?;
            ensure!(n > 0, "SplitToSequence: split must be positive");
            let n = n as usize;
            let mut v = vec![n; len / n];
            if len % n != 0 {
                v.push(len % n);
            }
            (v, false)
        }
        Some(s) => {
            let v = ints(s)?;
            ensure!(
                v.iter().all(|&x| x >= 0),
                "SplitToSequence: split sizes must not be negative"
            );
            ensure!(
                v.iter().sum::<i64>() as usize == len,
                "SplitToSequence: split sizes {v:?} do not sum to {len}"
            );
            (v.into_iter().map(|x| x as usize).collect(), false)
        }
    };
    let mut items = Vec::new();
    let mut start = 0;
    for s in sizes {
        let piece = crate::map_data!(t, a => {
            let v = a.slice_axis(Axis(ax), Slice::from(start..start + s)).to_owned();
            if squeeze { v.index_axis(Axis(ax), 0).to_owned() } else { v }
        });
        items.push(Value::Tensor(piece));
        start += s;
    }
    sequence(Some(t.dtype()), items)
}

fn optional(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let ty = match ctx.attrs.0.get("type") {
        Some(Attr::Type(t)) => t.clone(),
        _ => ValueType::Unknown,
    };
    let value = ins.first().copied().flatten().cloned().map(Box::new);
    let ty = match &value {
        Some(v) => v.value_type(),
        None => ty,
    };
    Ok(vec![Value::Optional {
        ty: Box::new(ty),
        value,
    }])
}

fn optional_has_element(_: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let has = match ins.first().copied().flatten() {
        None => false,
        Some(Value::Optional { value, .. }) => value.is_some(),
        Some(_) => true,
    };
    out(Tensor::scalar(has))
}

fn optional_get_element(_: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    match ins.first().copied().flatten() {
        Some(Value::Optional { value: Some(v), .. }) => Ok(vec![(**v).clone()]),
        Some(Value::Optional { value: None, .. }) => {
            bail!("OptionalGetElement: the optional is empty")
        }
        Some(v) => Ok(vec![v.clone()]),
        None => bail!("OptionalGetElement: input is missing"),
    }
}

#[derive(Debug)]
struct SequenceMap {
    body: Arc<Graph>,
}

impl Op for SequenceMap {
    fn eval(&self, _: &[Option<&Value>]) -> OpResult<Vec<Value>> {
        bail!("SequenceMap needs the evaluator's subgraph runner")
    }

    fn eval_with(
        &self,
        ins: &[Option<&Value>],
        sub: &mut dyn SubgraphRunner,
    ) -> OpResult<Vec<Value>> {
        let (_, first) = seq(ins, 0)?;
        let n = first.len();
        let n_out = self.body.outputs.len();
        let mut results: Vec<Vec<Value>> = vec![Vec::new(); n_out];
        for i in 0..n {
            let mut args = Vec::with_capacity(ins.len());
            for (k, v) in ins.iter().enumerate() {
                match v {
                    Some(Value::Sequence { items, .. }) => {
                        ensure!(
                            items.len() == n,
                            "SequenceMap: input {k} has {} items, input 0 has {n}",
                            items.len()
                        );
                        args.push(items[i].clone());
                    }
                    Some(v) => args.push((*v).clone()),
                    None => bail!("SequenceMap: input {k} is missing"),
                }
            }
            let outs = sub.run(&self.body, args)?;
            for (k, o) in outs.into_iter().enumerate() {
                results[k].push(o);
            }
        }
        results
            .into_iter()
            .enumerate()
            .map(|(k, items)| {
                let elem = items
                    .first()
                    .and_then(|v| v.as_tensor())
                    .map(|t| t.dtype())
                    .or_else(|| self.body.value(self.body.outputs[k]).ty.dtype());
                Ok(Value::Sequence { elem, items })
            })
            .collect()
    }

    fn subgraphs(&self) -> Vec<&Graph> {
        vec![&self.body]
    }
}
