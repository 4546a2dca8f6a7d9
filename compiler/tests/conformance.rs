//! The ONNX backend node tests through the reference evaluator. The cases are generated
//! by `tests/conformance/gen_node_cases.py` (the test command does this) into
//! `tests/onnx-node/` (or `$ONNXC_NODE_CASES`). This test fails if the folder is missing
//! or incomplete, if any case in the checked-in pass list stops passing, or if
//! `docs/conformance.md` does not state the current count.

mod common;

use onnxc::conformance::{counts, run_suite, Status};
use std::collections::BTreeSet;

const EXPECTED_CASES: usize = 1884;

/// Ops that PyTorch exports of CNNs and transformers use: every one of their cases
/// (expanded function bodies included) must pass.
const REQUIRED_OPS: &[&str] = &[
    "Conv",
    "ConvTranspose",
    "Gemm",
    "MatMul",
    "BatchNormalization",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "LpPool",
    "Relu",
    "Sigmoid",
    "Tanh",
    "Clip",
    "HardSwish",
    "HardSigmoid",
    "Gelu",
    "Erf",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "Reshape",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Concat",
    "Split",
    "Slice",
    "Gather",
    "Expand",
    "Where",
    "Pad",
    "Resize",
    "ReduceMean",
    "ReduceSum",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
    "Cast",
    "CastLike",
    "Shape",
    "ConstantOfShape",
    "Range",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Sqrt",
    "Exp",
    "Log",
    "Neg",
    "Abs",
    "Reciprocal",
    "Min",
    "Max",
    "Equal",
    "Less",
    "Greater",
    "Not",
    "And",
    "Or",
    "Identity",
    "Dropout",
    "Constant",
    "Size",
    "Tile",
    "Floor",
    "Ceil",
    "Sin",
    "Cos",
    "Mod",
];

#[test]
fn node_tests_reference() {
    let root = common::repo_root();
    let dir = std::env::var_os("ONNXC_NODE_CASES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("tests/onnx-node"));
    assert!(
        dir.join("COUNT").is_file(),
        "node test cases not found in {}; generate them with `python3 tests/conformance/gen_node_cases.py {}` (onnx==1.23.2)",
        dir.display(),
        dir.display()
    );
    let results = run_suite(&dir, None).expect("read cases");
    let other_dir = root.join("tests/onnx-other");
    assert!(
        other_dir.join("light").is_dir(),
        "the wheel's other suites are missing from {}; run the generator with --other",
        other_dir.display()
    );
    let others = onnxc::conformance::run_other_suites(&other_dir).expect("read other suites");
    assert_eq!(
        results.len(),
        EXPECTED_CASES,
        "expected all {EXPECTED_CASES} ONNX 1.23.2 node test cases in {}",
        dir.display()
    );

    let pass_list = std::fs::read_to_string(root.join("tests/conformance/reference-pass.txt"))
        .expect("pass list");
    let must_pass: BTreeSet<&str> = pass_list
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let mut regressions = Vec::new();
    for r in results.iter().chain(&others) {
        if must_pass.contains(r.name.as_str()) && r.status != Status::Passed {
            regressions.push(format!("{}: {:?}", r.name, r.status));
        }
    }
    let mut required_failures = Vec::new();
    for r in &results {
        if REQUIRED_OPS.contains(&r.op.as_str()) && r.status != Status::Passed {
            required_failures.push(format!("{} ({}): {:?}", r.name, r.op, r.status));
        }
    }
    let (p, f, u) = counts(&results);
    println!(
        "node tests (reference): {p} passed, {f} failed, {u} unsupported of {}",
        results.len()
    );
    let (op, of, ou) = counts(&others);
    println!(
        "other suites (reference): {op} passed, {of} failed, {ou} unsupported of {}",
        others.len()
    );
    assert!(
        regressions.is_empty(),
        "{} cases of the pass list no longer pass:\n{}",
        regressions.len(),
        regressions.join("\n")
    );

    assert!(
        required_failures.is_empty(),
        "cases of ops that PyTorch CNN/transformer exports use must all pass:\n{}",
        required_failures.join("\n")
    );
    assert!(
        p * 10 >= results.len() * 9,
        "fewer than 90% of the node test cases pass ({p} of {})",
        results.len()
    );

    let doc =
        std::fs::read_to_string(root.join("docs/conformance.md")).expect("docs/conformance.md");
    let stated = format!("**{p} of {} passed", results.len());
    assert!(
        doc.contains(&stated),
        "docs/conformance.md does not state the current count ({stated}); regenerate it with `bash tests/conformance.sh --write`"
    );
}
