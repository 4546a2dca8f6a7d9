//! Property test: mutated model bytes never panic the front end, shape inference or the
//! evaluator; they either import or give an error. Bounded: a fixed number of cases.

mod common;

use common::*;
use onnxc::ir::{Tensor, Value};
use onnxc::onnx::proto::{tensor_proto::DataType, GraphProto};
use proptest::prelude::*;
use prost::Message;

fn seed_models() -> Vec<Vec<u8>> {
    let mut v = vec![relu_model().encode_to_vec()];
    // A model with a constant initializer, a broadcast Add and a Reshape.
    let mut g = GraphProto {
        name: Some("g".into()),
        node: vec![
            node("Add", &["x", "b"], &["s"]),
            node("Reshape", &["s", "shape"], &["y"]),
        ],
        input: vec![value_info("x", DataType::Float, &[2, 3])],
        output: vec![value_info("y", DataType::Float, &[3, 2])],
        ..Default::default()
    };
    g.initializer.push(f32_tensor("b", &[3], &[1.0, 2.0, 3.0]));
    g.initializer.push(onnxc::onnx::proto::TensorProto {
        name: Some("shape".into()),
        dims: vec![2],
        data_type: Some(DataType::Int64 as i32),
        int64_data: vec![3, 2],
        ..Default::default()
    });
    v.push(model(g).encode_to_vec());
    v
}

fn exercise(bytes: &[u8]) {
    if let Ok(mut m) = onnxc::onnx::decode(bytes, None) {
        let _ = onnxc::ir::verify(&m.graph, false);
        let _ = onnxc::passes::infer_shapes(&mut m.graph);
        let _ = onnxc::ir::print_graph(&m.graph);
        // Evaluate on zeros when every input is a small static tensor.
        let mut inputs = Vec::new();
        for &id in &m.graph.inputs {
            let ty = &m.graph.value(id).ty;
            match (ty.dtype(), ty.static_shape()) {
                (Some(dt), Some(s))
                    if s.iter().product::<usize>() < 4096 && dt.storage().is_some() =>
                {
                    inputs.push(Value::Tensor(Tensor::zeros(dt, &s)))
                }
                _ => return,
            }
        }
        let _ = onnxc::eval::run(&m.graph, inputs);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_models_never_panic(which in 0usize..2, edits in prop::collection::vec((any::<usize>(), any::<u8>(), 0u8..4), 1..8)) {
        let mut bytes = seed_models()[which].clone();
        for (pos, val, kind) in edits {
            if bytes.is_empty() { break; }
            let i = pos % bytes.len();
            match kind {
                0 => bytes[i] = val,
                1 => bytes.truncate(i),
                2 => bytes.insert(i, val),
                _ => { bytes.remove(i); }
            }
        }
        exercise(&bytes);
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        exercise(&bytes);
    }
}
