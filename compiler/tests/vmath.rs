//! The inline f32 `exp`, `log`, `erf`, `tanh` (and `Sigmoid` and `Softplus`, built on them)
//! of the native back end (backend/cranelift/vmath.rs, and the AVX-512 loops' versions in
//! backend/cranelift/wide.rs), compiled for the host, x86_64-avx512, x86_64-avx2, x86_64-sse4 and
//! aarch64-neon (under qemu), element by element against the reference evaluator (f64 math
//! rounded to f32) over a sweep from -120 to 120 plus special values: within 4 ulp-ish
//! relative error (8e-7) on normal results, exact on infinities, NaN where the reference is
//! NaN, and within 1e-37 absolutely where the result is subnormal. SiLU too, fused, as a
//! GEMM epilogue and as a depthwise conv's, to the same bounds (within 1e-35 where it is
//! below 1e-30).

mod common;

use common::{model, node, value_info};
use onnxc::conformance::CompiledEnv;
use onnxc::ir::{DType, Tensor, Value};
use onnxc::onnx::proto::{tensor_proto::DataType, GraphProto, NodeProto};
use onnxc::{eval, onnx};

/// The sweep: a dense grid over [-120, 120], a fine one over [-2, 2], tiny and special
/// values. The length is not a multiple of 4, so scalar remainders run too.
fn inputs() -> Vec<f32> {
    let mut v: Vec<f32> = (0..4801).map(|i| -120.0 + i as f32 * 0.05).collect();
    v.extend((0..2001).map(|i| -2.0 + i as f32 * 0.002));
    v.extend([
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        1e-8,
        -3e-5,
        5e-4,
        f32::MIN_POSITIVE,
        88.72,
        88.73,
        -87.3,
        -103.9,
        -104.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MAX,
        f32::MIN,
    ]);
    v.push(0.125);
    v
}

const OPS: [&str; 6] = ["Exp", "Log", "Erf", "Tanh", "Sigmoid", "Softplus"];
/// Also SiLU, `x * Sigmoid(x)`: fused into one elementwise loop, as the epilogue of a 1x1
/// convolution (weight 1, bias 0: a GEMM computing x exactly) where the back end has a
/// GEMM microkernel, and as the epilogue of a depthwise one (one channel per element,
/// weight 1, bias 0: a loop computing x exactly, the AVX-512 loops' own SiLU).
const SILUS: [&str; 3] = ["Silu", "ConvSilu", "DwSilu"];

fn check_target(target: &str) {
    let scratch = tempfile::tempdir().unwrap();
    let env = match CompiledEnv::new(target, scratch.path()) {
        Ok(e) => e,
        Err(e) => panic!("{e}; tests/run.sh installs the cross toolchain and qemu"),
    };
    let t = onnxc::targets::Target::load(target).unwrap();
    let host = onnxc::targets::Target::host().unwrap();
    if t.is_x86() && !t.features.iter().all(|f| host.has(f)) {
        eprintln!("skip {target}: this CPU lacks its features");
        return;
    }
    let xs = inputs();
    let n = xs.len() as i64;
    // The depthwise conv's channels: rows of n / groups elements (19 x 359), so that the
    // row loop is long enough for the AVX-512 loops.
    let groups = (2..n).find(|d| n % d == 0).unwrap_or(n);
    let mut nodes: Vec<_> = OPS
        .iter()
        .map(|op| node(op, &["x"], &[&format!("y_{op}")]))
        .collect();
    nodes.extend([
        node("Sigmoid", &["x"], &["s"]),
        node("Mul", &["x", "s"], &["y_Silu"]),
        node("Reshape", &["x", "shape3"], &["x3"]),
        node("Conv", &["x3", "w1", "b0"], &["c"]),
        node("Sigmoid", &["c"], &["cs"]),
        node("Mul", &["c", "cs"], &["c_silu"]),
        node("Reshape", &["c_silu", "shape1"], &["y_ConvSilu"]),
        node("Reshape", &["x", "shape_dw"], &["xd"]),
        NodeProto {
            attribute: vec![common::int_attr("group", groups)],
            ..node("Conv", &["xd", "w_dw", "b_dw"], &["d"])
        },
        node("Sigmoid", &["d"], &["ds"]),
        node("Mul", &["d", "ds"], &["d_silu"]),
        node("Reshape", &["d_silu", "shape1"], &["y_DwSilu"]),
    ]);
    let g = GraphProto {
        name: Some("vmath".into()),
        node: nodes,
        input: vec![value_info("x", DataType::Float, &[n])],
        output: OPS
            .iter()
            .chain(&SILUS)
            .map(|op| value_info(&format!("y_{op}"), DataType::Float, &[n]))
            .collect(),
        initializer: vec![
            common::i64_tensor("shape3", &[1, 1, n]),
            common::i64_tensor("shape1", &[n]),
            common::f32_tensor("w1", &[1, 1, 1], &[1.0]),
            common::f32_tensor("b0", &[1], &[0.0]),
            common::i64_tensor("shape_dw", &[1, groups, 1, n / groups]),
            common::f32_tensor("w_dw", &[groups, 1, 1, 1], &vec![1.0; groups as usize]),
            common::f32_tensor("b_dw", &[groups], &vec![0.0; groups as usize]),
        ],
        ..Default::default()
    };
    let path = common::write_model(scratch.path(), "vmath.onnx", &model(g));
    let m = onnx::load(&path).unwrap();
    let x = Tensor::from_vec(&[xs.len()], xs.clone());
    let want = eval::run(&m.graph, vec![Value::Tensor(x.clone())]).unwrap();
    let opts = onnxc::driver::Options {
        target: target.to_string(),
        ..Default::default()
    };
    let c = onnxc::driver::compile_graph(m.graph.clone(), "model", &opts).unwrap();
    let obj = scratch.path().join("vmath.o");
    let exe = scratch.path().join("vmath.exe");
    std::fs::write(&obj, &c.artifacts.object).unwrap();
    onnxc::runner::link(&env.toolchain, &env.harness, &obj, &exe).unwrap();
    let outs = vec![(DType::F32, vec![xs.len()]); OPS.len() + SILUS.len()];
    let got = onnxc::runner::execute(&env.toolchain, &exe, scratch.path(), &[x], &outs).unwrap();
    let mut bad = Vec::new();
    for (k, op) in OPS.iter().chain(&SILUS).enumerate() {
        let g = got[k].to_f64().unwrap();
        let w = want[k].clone().into_tensor().unwrap().to_f64().unwrap();
        let mut worst = 0f64;
        for ((&xi, &gi), &wi) in xs.iter().zip(g.iter()).zip(w.iter()) {
            let ok = if wi.is_nan() {
                gi.is_nan()
            } else if wi.is_infinite() {
                gi == wi
            } else if wi.abs() < f32::MIN_POSITIVE as f64 {
                (gi - wi).abs() <= 1e-37
            } else if SILUS.contains(op) && wi.abs() < 1e-30 {
                // x below about -87: f32's sigmoid is subnormal or 0 there (the
                // reference computes x * sigmoid(x) in f64).
                (gi - wi).abs() <= 1e-35
            } else {
                let e = (gi - wi).abs() / wi.abs();
                worst = worst.max(e);
                e <= 8e-7
            };
            if !ok {
                bad.push(format!("{op}({xi:e}) = {gi:e}, want {wi:e}"));
            }
        }
        eprintln!("{target} {op}: worst relative error {worst:e}");
    }
    assert!(
        bad.is_empty(),
        "{target}: {} wrong values, first: {:?}",
        bad.len(),
        &bad[..bad.len().min(10)]
    );
}

#[test]
fn vmath_host() {
    check_target("host");
}

/// The AVX-512 loops' shorter exp/erf/tanh (fused multiply-adds, vscalefps), to the
/// same bounds.
#[test]
fn vmath_x86_64_avx512() {
    check_target("x86_64-avx512");
}

/// The AVX2 GEMM's own SiLU epilogue (machine code, 2^n from the exponent bits): on an
/// AVX-512 host `host` runs the AVX-512 one instead.
#[test]
fn vmath_x86_64_avx2() {
    check_target("x86_64-avx2");
}

#[test]
fn vmath_x86_64_sse4() {
    check_target("x86_64-sse4");
}

#[test]
fn vmath_aarch64_neon_qemu() {
    check_target("aarch64-neon");
}
