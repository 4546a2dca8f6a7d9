//! Constant folding: every node whose outputs are all known at compile time (shape
//! inference's partial evaluation computes them) is replaced by graph constants.
//! Random ops are never folded; control flow is left alone.

use super::infer_shapes::known_values;
use super::util::order;
use crate::error::Result;
use crate::ir::{Graph, Tensor, Value};

pub fn run(g: &mut Graph) -> Result<()> {
    let known = known_values(g)?;
    for n in order(g)? {
        let node = &g.nodes[n];
        if node.outputs.is_empty() || !node.op.subgraphs().is_empty() {
            continue;
        }
        let vals: Option<Vec<Tensor>> = node
            .outputs
            .iter()
            .map(|o| known.get(o).and_then(Value::as_tensor).cloned())
            .collect();
        let Some(vals) = vals else { continue };
        let outs = node.outputs.clone();
        for (o, t) in outs.into_iter().zip(vals) {
            g.set_const(o, t);
        }
        g.remove_node(n);
    }
    g.rewire();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::passes::testutil::*;

    #[test]
    fn folds_constant_subgraphs_and_keeps_the_rest() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 2]);
        let a = b.konst("a", &[2], vec![1.0, 2.0]);
        let c = b.konst("c", &[2], vec![3.0, 4.0]);
        let s = b.node("Add", &[a, c], &[2]);
        let t = b.node("Mul", &[s, s], &[2]);
        let y = b.node("Add", &[x, t], &[2, 2]);
        let shp = b.node_typed("Shape", &[x], DType::I64, &[2]);
        let mut g = b.finish(&[y, shp, t]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 1);
        assert_eq!(g.consts[&t], Tensor::from_vec(&[2], vec![16f32, 36.0]));
        assert_eq!(g.consts[&shp], Tensor::from_vec(&[2], vec![2i64, 2]));
    }

    #[test]
    fn random_ops_are_not_folded() {
        let mut b = Builder::new();
        let x = b.input("x", &[2]);
        let r = b.node_attrs(
            "RandomUniform",
            &[],
            DType::F32,
            &[2],
            &[
                ("shape", crate::ir::Attr::Ints(vec![2])),
                ("seed", crate::ir::Attr::Float(3.0)),
            ],
        );
        let y = b.node("Add", &[x, r], &[2]);
        let mut g = b.finish(&[y]);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 2);
    }
}
