//! Conv, ConvTranspose, Gemm and MatMul on f16 run on the f32 kernels: the node computes
//! in f32 between a Cast of each f16 input to f32 (a constant weight is converted here,
//! once) and a Cast of its output back to f16. Kernel IR treats f16 as storage only, so
//! the f16 node already accumulated in f32 and rounded once on the store; only the
//! packed GEMM microkernels and the Winograd and depthwise kernels are f32-only, and
//! without this an f16 convolution ran as a scalar loop nest (a 64-channel 3x3 one on
//! 56 x 56: 649 ms, ONNX Runtime 1.3 ms, which inserts the same casts on CPU).

use super::inline_util::add_node_to;
use super::util::{add_const, dtype_of, order, retyped};
use crate::error::Result;
use crate::ir::{Attr, DType, Graph, NodeId, Source, ValueId};
use std::collections::HashMap;

/// The ops that take the f32 path, with which of their inputs are float tensors.
fn float_inputs(op: &str) -> Option<&'static [usize]> {
    match op {
        "Conv" | "ConvTranspose" | "Gemm" => Some(&[0, 1, 2]),
        "MatMul" => Some(&[0, 1]),
        _ => None,
    }
}

pub fn run(g: &mut Graph) -> Result<()> {
    // Each f16 input's f32 form (a constant's copy or a Cast), shared by its readers.
    let mut widened: HashMap<ValueId, ValueId> = HashMap::new();
    for n in order(g)? {
        if g.nodes.contains_node(n) && qualifies(g, n) {
            widen(g, n, &mut widened)?;
        }
    }
    g.rewire();
    Ok(())
}

/// An op of [`float_inputs`] in the default domain whose float inputs and one output
/// are all f16.
fn qualifies(g: &Graph, n: NodeId) -> bool {
    let node = &g.nodes[n];
    let Some(floats) = float_inputs(&node.op_type) else {
        return false;
    };
    let f16 = |v: ValueId| dtype_of(g, v) == Some(DType::F16);
    node.domain.is_empty()
        && node.outputs.len() == 1
        && f16(node.outputs[0])
        && node.inputs.first().copied().flatten().is_some()
        && node
            .inputs
            .iter()
            .enumerate()
            .all(|(i, v)| !floats.contains(&i) || (*v).is_none_or(f16))
}

fn cast_node(
    g: &mut Graph,
    name: String,
    opset: i64,
    to: DType,
    from: ValueId,
    out: ValueId,
) -> Result<()> {
    let to = Attr::Int(i64::from(to.onnx_code()));
    add_node_to(
        g,
        opset.max(6),
        name,
        "Cast",
        &[("to", to)],
        vec![Some(from)],
        vec![out],
    )
}

fn widen(g: &mut Graph, n: NodeId, widened: &mut HashMap<ValueId, ValueId>) -> Result<()> {
    let floats = float_inputs(&g.nodes[n].op_type).unwrap_or(&[]);
    let name = g.nodes[n].name.clone();
    let opset = g.nodes[n].opset;
    let inputs = g.nodes[n].inputs.clone();
    for (i, v) in inputs.iter().enumerate() {
        let Some(v) = *v else { continue };
        if !floats.contains(&i) {
            continue;
        }
        let wide = if let Some(w) = widened.get(&v) {
            *w
        } else if let Some(t) = g.const_of(v) {
            let t = t
                .cast(DType::F32, false)
                .ok_or_else(|| crate::error::Error::model(format!("{name}: f16 weight to f32")))?;
            let w = add_const(g, &format!("{}_f32", g.value(v).name), t);
            widened.insert(v, w);
            w
        } else {
            let vname = g.fresh_name(&format!("{}_f32", g.value(v).name));
            let ty = retyped(g, v, DType::F32);
            let w = g.add_value(vname, ty, Source::Undefined);
            cast_node(g, format!("{name}/in{i}_f32"), opset, DType::F32, v, w)?;
            widened.insert(v, w);
            w
        };
        g.nodes[n].inputs[i] = Some(wide);
    }
    let out = g.nodes[n].outputs[0];
    let oname = g.fresh_name(&format!("{}_f32", g.value(out).name));
    let ty = retyped(g, out, DType::F32);
    let wide = g.add_value(oname, ty, Source::Node(n));
    g.nodes[n].outputs[0] = wide;
    cast_node(g, format!("{name}/out_f16"), opset, DType::F16, wide, out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Tensor;
    use crate::passes::testutil::*;

    #[test]
    fn f16_conv_computes_in_f32_between_casts() {
        let mut b = Builder::new();
        let x = b.input_typed("x", DType::F16, &[1, 2, 5, 5]);
        let w: Vec<f32> = (0..72).map(|i| i as f32 * 0.0625 - 2.0).collect();
        let w = Tensor::from_vec(&[4, 2, 3, 3], w)
            .cast(DType::F16, false)
            .unwrap();
        let w = b.konst_t("w", w);
        let y = b.node_typed("Conv", &[x, w], DType::F16, &[1, 4, 3, 3]);
        let mut g = b.finish(&[y]);
        check_pass(&mut g, run);
        let ops: Vec<(String, Vec<DType>)> = order(&g)
            .unwrap()
            .into_iter()
            .map(|n| {
                let node = &g.nodes[n];
                let dts = node
                    .inputs
                    .iter()
                    .flatten()
                    .map(|v| dtype_of(&g, *v).unwrap());
                (node.op_type.clone(), dts.collect())
            })
            .collect();
        assert_eq!(
            ops,
            [
                ("Cast".to_string(), vec![DType::F16]),
                ("Conv".to_string(), vec![DType::F32, DType::F32]),
                ("Cast".to_string(), vec![DType::F32]),
            ]
        );
    }

    #[test]
    fn a_shared_f16_weight_is_widened_once() {
        let mut b = Builder::new();
        let x = b.input_typed("x", DType::F16, &[2, 3]);
        let w: Vec<f32> = (0..9).map(|i| i as f32 * 0.25 - 1.0).collect();
        let w = Tensor::from_vec(&[3, 3], w)
            .cast(DType::F16, false)
            .unwrap();
        let w = b.konst_t("w", w);
        let y = b.node_typed("MatMul", &[x, w], DType::F16, &[2, 3]);
        let z = b.node_typed("MatMul", &[y, w], DType::F16, &[2, 3]);
        let mut g = b.finish(&[z]);
        check_pass(&mut g, run);
        let weights: Vec<ValueId> = g
            .nodes
            .node_indices()
            .filter(|&n| g.nodes[n].op_type == "MatMul")
            .map(|n| g.nodes[n].inputs[1].unwrap())
            .collect();
        assert_eq!(weights.len(), 2);
        assert_eq!(weights[0], weights[1]);
        assert_eq!(dtype_of(&g, weights[0]), Some(DType::F32));
        assert_eq!(g.node_count(), 6);
    }
}
