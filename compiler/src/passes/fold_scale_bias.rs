//! Conv / ConvTranspose / Gemm / MatMul followed by Mul or Add with a constant that
//! broadcasts along the output channel (Conv: axis 1) or column (Gemm, MatMul: the last
//! axis) is folded into the weights and bias:
//! - Conv: `Mul(y, v)` scales the weights and bias of each output channel, `Add(y, v)`
//!   adds to the bias (created when absent);
//! - Gemm: `Mul(y, v)` scales B's columns and C, `Add(y, c)` with any `c` that
//!   broadcasts to the output joins C (beta becomes 1);
//! - MatMul with a constant 2-D B: `Mul(y, v)` scales B's columns; a following Add
//!   makes a Gemm when the input has rank 2 (see `matmul_add_to_gemm`), else stays.
//!
//! Only float32/float64 values whose intermediate has no other reader are rewritten.

use super::util::{
    absorb, add_const, along_axis, array, const_f64, dtype_of, fold_each, foldable_float, is_op,
    producer, rebuild, shape_of, sole_reader, tensor_f64, zip_broadcast, ConvWeights,
};
use crate::error::Result;
use crate::ir::{Attr, Graph, NodeId, ValueId};
use ndarray::ArrayD;

pub fn run(g: &mut Graph) -> Result<()> {
    fold_each(g, fold)
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Mul,
    Add,
}

fn fold(g: &mut Graph, f: NodeId) -> Result<bool> {
    let kind = if is_op(g, f, "Mul") {
        Kind::Mul
    } else if is_op(g, f, "Add") {
        Kind::Add
    } else {
        return Ok(false);
    };
    let node = &g.nodes[f];
    let (Some(Some(a)), Some(Some(b)), 1) = (
        node.inputs.first().copied(),
        node.inputs.get(1).copied(),
        node.outputs.len(),
    ) else {
        return Ok(false);
    };
    let z = node.outputs[0];
    let (y, c) = if g.const_of(b).is_some() && g.const_of(a).is_none() {
        (a, b)
    } else if g.const_of(a).is_some() && g.const_of(b).is_none() {
        (b, a)
    } else {
        return Ok(false);
    };
    let Some(anchor) = producer(g, y) else {
        return Ok(false);
    };
    if sole_reader(g, y) != Some(f)
        || g.value(y).ty != g.value(z).ty
        || !foldable_float(dtype_of(g, y))
        || dtype_of(g, c) != dtype_of(g, y)
        || g.nodes[anchor].outputs.len() != 1
    {
        return Ok(false);
    }
    let (Some(cv), Some(ys)) = (const_f64(g, Some(c)), shape_of(g, y)) else {
        return Ok(false);
    };
    let done = if is_op(g, anchor, "Conv") || is_op(g, anchor, "ConvTranspose") {
        fold_conv(g, anchor, kind, &cv, &ys)?
    } else if is_op(g, anchor, "Gemm") {
        fold_gemm(g, anchor, kind, &cv, &ys)?
    } else if is_op(g, anchor, "MatMul") && kind == Kind::Mul {
        fold_matmul(g, anchor, &cv, &ys)?
    } else if is_op(g, anchor, "MatMul") {
        // A bias after a (scaled) rank-2 MatMul: the pair becomes a Gemm.
        return super::matmul_add_to_gemm::fold(g, f);
    } else {
        false
    };
    if done {
        absorb(g, anchor, f);
    }
    Ok(done)
}

fn fold_conv(g: &mut Graph, n: NodeId, kind: Kind, c: &ArrayD<f64>, ys: &[usize]) -> Result<bool> {
    let (Some(mut cw), Some(v)) = (ConvWeights::of(g, n), along_axis(c, ys, 1)) else {
        return Ok(false);
    };
    let m = cw.m;
    let b0: Vec<f64> = match &cw.b {
        Some(b) => b.iter().copied().collect(),
        None => vec![0.0; m],
    };
    let b: Vec<f64> = match kind {
        Kind::Mul => {
            cw.scale(&v);
            b0.iter().zip(&v).map(|(b, s)| b * s).collect()
        }
        Kind::Add => b0.iter().zip(&v).map(|(b, s)| b + s).collect(),
    };
    cw.b = Some(array(&[m], b));
    cw.store(g, n)?;
    Ok(true)
}

fn fold_gemm(g: &mut Graph, n: NodeId, kind: Kind, c: &ArrayD<f64>, ys: &[usize]) -> Result<bool> {
    let node = &g.nodes[n];
    if node.opset < 7 || ys.len() != 2 {
        return Ok(false);
    }
    let Some(dt) = dtype_of(g, node.outputs[0]) else {
        return Ok(false);
    };
    let beta = node.attrs.float("beta", 1.0).unwrap_or(1.0) as f64;
    let trans_b = node.attrs.int("transB", 0).unwrap_or(0) != 0;
    let cin = node.inputs.get(2).copied().flatten();
    let old_c = match cin {
        Some(v) => match const_f64(g, Some(v)) {
            Some(a) => Some(a),
            None => return Ok(false),
        },
        None => None,
    };
    let base = if node.name.is_empty() {
        "gemm".to_string()
    } else {
        node.name.clone()
    };
    let mut new_b: Option<ValueId> = None;
    let new_c: ArrayD<f64> = match kind {
        Kind::Mul => {
            let Some(v) = along_axis(c, ys, 1) else {
                return Ok(false);
            };
            let Some(mut bw) = const_f64(g, node.inputs.get(1).copied().flatten()) else {
                return Ok(false);
            };
            if bw.ndim() != 2 {
                return Ok(false);
            }
            let cols = bw.shape()[1];
            for (i, x) in bw.iter_mut().enumerate() {
                let col = if trans_b { i / cols } else { i % cols };
                *x *= v[col];
            }
            let bdt = dtype_of(g, node.inputs[1].expect("checked")).unwrap_or(dt);
            new_b = Some(add_const(
                g,
                &format!("{base}_b_folded"),
                tensor_f64(bdt, bw),
            ));
            let va = array(&[v.len()], v);
            match old_c {
                Some(oc) => match zip_broadcast(&oc, &va, |x, s| x * s) {
                    Some(a) => a,
                    None => return Ok(false),
                },
                None => ArrayD::zeros(ndarray::IxDyn(&[0])), // no C: none needed
            }
        }
        Kind::Add => {
            let scaled = old_c.map(|a| a.mapv(|x| x * beta));
            match scaled {
                Some(sc) => match zip_broadcast(&sc, c, |x, y| x + y) {
                    Some(a) => a,
                    None => return Ok(false),
                },
                None => c.clone(),
            }
        }
    };
    let has_c = !(kind == Kind::Mul && cin.is_none());
    let cval = if has_c {
        Some(add_const(
            g,
            &format!("{base}_c_folded"),
            tensor_f64(dt, new_c),
        ))
    } else {
        None
    };
    let node = &mut g.nodes[n];
    if let Some(b) = new_b {
        node.inputs[1] = Some(b);
    }
    if let Some(cv) = cval {
        node.inputs.truncate(2);
        node.inputs.push(Some(cv));
        if kind == Kind::Add {
            node.attrs.0.insert("beta".into(), Attr::Float(1.0));
        }
    }
    rebuild(node)?;
    Ok(true)
}

fn fold_matmul(g: &mut Graph, n: NodeId, c: &ArrayD<f64>, ys: &[usize]) -> Result<bool> {
    let node = &g.nodes[n];
    let Some(bv) = node.inputs.get(1).copied().flatten() else {
        return Ok(false);
    };
    let Some(mut bw) = const_f64(g, Some(bv)) else {
        return Ok(false);
    };
    if bw.ndim() != 2 || ys.is_empty() {
        return Ok(false);
    }
    let Some(v) = along_axis(c, ys, ys.len() - 1) else {
        return Ok(false);
    };
    let cols = bw.shape()[1];
    if cols != v.len() {
        return Ok(false);
    }
    for (i, x) in bw.iter_mut().enumerate() {
        *x *= v[i % cols];
    }
    let Some(dt) = dtype_of(g, bv) else {
        return Ok(false);
    };
    let base = if node.name.is_empty() {
        "matmul".to_string()
    } else {
        node.name.clone()
    };
    let nb = add_const(g, &format!("{base}_b_folded"), tensor_f64(dt, bw));
    g.nodes[n].inputs[1] = Some(nb);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::passes::testutil::*;

    fn vals(n: usize, k: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 5 % 7) as f32 - 3.0) * k + 0.25)
            .collect()
    }

    #[test]
    fn conv_mul_add_fold() {
        let mut b = Builder::new();
        let x = b.input("x", &[1, 3, 5, 5]);
        let w = b.konst("w", &[4, 3, 3, 3], vals(108, 0.1));
        let c = b.node("Conv", &[x, w], &[1, 4, 3, 3]);
        let s = b.konst("s", &[4, 1, 1], vals(4, 0.5));
        let m = b.node("Mul", &[s, c], &[1, 4, 3, 3]);
        let t = b.konst("t", &[1, 4, 1, 1], vals(4, 1.5));
        let a = b.node("Add", &[m, t], &[1, 4, 3, 3]);
        let k = b.konst("k", &[], vec![2.0]);
        let m2 = b.node("Mul", &[a, k], &[1, 4, 3, 3]);
        // Varies along the width: not foldable.
        let u = b.konst("u", &[3], vals(3, 1.0));
        let a2 = b.node("Add", &[m2, u], &[1, 4, 3, 3]);
        let mut g = b.finish(&[a2]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 2, "{}", crate::ir::print_graph(&g));
    }

    #[test]
    fn gemm_mul_add_fold() {
        for trans_b in [0, 1] {
            let mut b = Builder::new();
            let x = b.input("x", &[2, 3]);
            let wshape = if trans_b == 1 { [4, 3] } else { [3, 4] };
            let w = b.konst("w", &wshape, vals(12, 0.3));
            let bias = b.konst("bias", &[1, 4], vals(4, 0.7));
            let y = b.node_full(
                "Gemm",
                vec![Some(x), Some(w), Some(bias)],
                1,
                DType::F32,
                &[2, 4],
                &[("transB", Attr::Int(trans_b)), ("beta", Attr::Float(0.5))],
            )[0];
            let s = b.konst("s", &[4], vals(4, 0.9));
            let m = b.node("Mul", &[y, s], &[2, 4]);
            let t = b.konst("t", &[2, 1], vals(2, 1.1));
            let a = b.node("Add", &[m, t], &[2, 4]);
            let mut g = b.finish(&[a]);
            check_pass(&mut g, run);
            assert_eq!(g.node_count(), 1, "{}", crate::ir::print_graph(&g));
        }
    }

    #[test]
    fn matmul_mul_folds_but_add_stays() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 5, 3]);
        let w = b.konst("w", &[3, 4], vals(12, 0.3));
        let y = b.node("MatMul", &[x, w], &[2, 5, 4]);
        let s = b.konst("s", &[1, 4], vals(4, 0.9));
        let m = b.node("Mul", &[y, s], &[2, 5, 4]);
        let t = b.konst("t", &[4], vals(4, 0.2));
        let a = b.node("Add", &[m, t], &[2, 5, 4]);
        let mut g = b.finish(&[a]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 2, "{}", crate::ir::print_graph(&g));
    }

    #[test]
    fn rank2_matmul_mul_add_mul_becomes_one_gemm() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 3]);
        let w = b.konst("w", &[3, 4], vals(12, 0.3));
        let y = b.node("MatMul", &[x, w], &[2, 4]);
        let s = b.konst("s", &[4], vals(4, 0.9));
        let m = b.node("Mul", &[y, s], &[2, 4]);
        let t = b.konst("t", &[4], vals(4, 0.2));
        let a = b.node("Add", &[m, t], &[2, 4]);
        let s2 = b.konst("s2", &[1, 4], vals(4, -0.4));
        let m2 = b.node("Mul", &[s2, a], &[2, 4]);
        let mut g = b.finish(&[m2]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 1, "{}", crate::ir::print_graph(&g));
    }

    #[test]
    fn shared_values_stay() {
        let mut b = Builder::new();
        let x = b.input("x", &[1, 3, 5, 5]);
        let w = b.konst("w", &[4, 3, 3, 3], vals(108, 0.1));
        let c = b.node("Conv", &[x, w], &[1, 4, 3, 3]);
        let s = b.konst("s", &[4, 1, 1], vals(4, 0.5));
        let m = b.node("Mul", &[c, s], &[1, 4, 3, 3]);
        let r = b.node("Relu", &[c], &[1, 4, 3, 3]);
        let mut g = b.finish(&[m, r]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 3);
    }
}
