//! Dead-code elimination: nodes none of whose outputs is read (by a node, a subgraph or
//! the graph's outputs), and constants nobody reads.

use super::util::order;
use crate::error::Result;
use crate::ir::{Graph, Source};
use std::collections::HashSet;

pub fn run(g: &mut Graph) -> Result<()> {
    prune(g)
}

/// Removes dead nodes and unread constants; returns nothing but an error on a cycle.
pub fn prune(g: &mut Graph) -> Result<()> {
    let mut live: HashSet<usize> = g.outputs.iter().copied().collect();
    for n in order(g)?.into_iter().rev() {
        let node = &g.nodes[n];
        if node.outputs.iter().any(|o| live.contains(o)) {
            live.extend(node.inputs.iter().flatten().copied());
            live.extend(node.implicit.iter().copied());
        } else {
            g.remove_node(n);
        }
    }
    let dead: Vec<usize> = g
        .consts
        .keys()
        .copied()
        .filter(|c| !live.contains(c) && g.value(*c).source == Source::Const)
        .collect();
    for c in dead {
        g.remove_const(c);
    }
    g.rewire();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::*;

    #[test]
    fn removes_unread_nodes_and_constants() {
        let mut b = Builder::new();
        let x = b.input("x", &[2, 3]);
        let c = b.konst("c", &[3], vec![1.0, 2.0, 3.0]);
        let unused = b.konst("unused", &[1], vec![5.0]);
        let y = b.node("Add", &[x, c], &[2, 3]);
        let dead = b.node("Relu", &[x], &[2, 3]);
        let _dead2 = b.node("Neg", &[dead], &[2, 3]);
        let mut g = b.finish(&[y]);
        assert_eq!(g.node_count(), 3);
        check_pass(&mut g, run);
        assert_eq!(g.node_count(), 1);
        assert!(g.consts.contains_key(&c));
        assert!(!g.consts.contains_key(&unused));
    }
}
