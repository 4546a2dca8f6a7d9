//! Shape-op elimination: `Shape` and `Size` of statically shaped values, and
//! `ConstantOfShape` of a constant shape, become constants. (What reads them then folds
//! in `fold_constants`.)

use super::infer_shapes::fold_shape_op;
use super::util::order;
use crate::error::Result;
use crate::ir::{Graph, InferInput, Value};

pub fn run(g: &mut Graph) -> Result<()> {
    for n in order(g)? {
        let node = &g.nodes[n];
        if !node.domain.is_empty() || node.outputs.len() != 1 {
            continue;
        }
        let Some(Some(x)) = node.inputs.first().copied() else {
            continue;
        };
        let t = match node.op_type.as_str() {
            "Shape" | "Size" => {
                let inp = [Some(InferInput {
                    ty: g.value(x).ty.clone(),
                    value: None,
                })];
                fold_shape_op(&node.op_type, &node.attrs, &inp)
                    .and_then(|v| v.into_iter().next())
                    .and_then(Value::into_tensor)
            }
            "ConstantOfShape" => match g.const_of(x) {
                Some(s) => node
                    .op
                    .eval(&[Some(&Value::Tensor(s.clone()))])
                    .ok()
                    .and_then(|v| v.into_iter().next())
                    .and_then(Value::into_tensor),
                None => None,
            },
            _ => None,
        };
        if let Some(t) = t {
            let o = node.outputs[0];
            g.set_const(o, t);
            g.remove_node(n);
        }
    }
    g.rewire();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Tensor;
    use crate::passes::testutil::*;

    #[test]
    fn shape_size_and_constant_of_shape_fold() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 3, 4]);
        let s = b.node_typed("Shape", &[x], crate::ir::DType::I64, &[3]);
        let s2 = b.node_attrs(
            "Shape",
            &[x],
            crate::ir::DType::I64,
            &[2],
            &[("start", crate::ir::Attr::Int(1))],
        );
        let n = b.node_typed("Size", &[x], crate::ir::DType::I64, &[]);
        let shp = b.konst_i64("shp", &[2], vec![2, 2]);
        let z = b.node_typed("ConstantOfShape", &[shp], crate::ir::DType::F32, &[2, 2]);
        let mut g = b.finish(&[s, s2, n, z]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 0);
        assert_eq!(g.consts[&s], Tensor::from_vec(&[3], vec![2i64, 3, 4]));
        assert_eq!(g.consts[&s2], Tensor::from_vec(&[2], vec![3i64, 4]));
        assert_eq!(g.consts[&n], Tensor::scalar(24i64));
        assert_eq!(g.consts[&z], Tensor::zeros(crate::ir::DType::F32, &[2, 2]));
    }
}
