//! Vectorised innermost loops (f32x4 with a scalar remainder; on AVX-512, zmm loops with
//! masked tails) and the depthwise and grouped convolutions, compiled for the host,
//! x86_64-avx512, x86_64-sse4 and aarch64-neon (under qemu), at awkward lengths
//! (1, 3, 4, 5, 17, 33), against the reference evaluator: max|out - ref| / max|ref|
//! within 1e-4; and the AVX-512 loops bit for bit against the 128-bit code.

mod common;

use common::{f32_tensor, int_attr, ints_attr, model, node, value_info};
use onnxc::conformance::CompiledEnv;
use onnxc::ir::{DType, Tensor, Value};
use onnxc::onnx::proto::{tensor_proto::DataType, GraphProto, ModelProto};
use onnxc::{eval, onnx};

const LENS: [usize; 6] = [1, 3, 4, 5, 17, 33];

/// Deterministic values in [-1, 1).
fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn dims(s: &[usize]) -> Vec<i64> {
    s.iter().map(|&d| d as i64).collect()
}

struct Case {
    name: String,
    model: ModelProto,
    inputs: Vec<Vec<usize>>,
}

/// A constant: name, shape, values (random when None).
type Const = (&'static str, Vec<usize>, Option<Vec<f32>>);

/// A model of `nodes`: graph inputs (name, shape), constants (name, shape, values or
/// random), output `y` of shape `out`.
fn graph(
    name: String,
    inputs: &[(&str, Vec<usize>)],
    consts: Vec<Const>,
    nodes: Vec<onnxc::onnx::proto::NodeProto>,
    out: &[usize],
) -> Case {
    let inits = consts
        .into_iter()
        .enumerate()
        .map(|(i, (n, s, vals))| {
            let vals = vals.unwrap_or_else(|| rand(s.iter().product(), 300 + i as u64));
            f32_tensor(n, &dims(&s), &vals)
        })
        .collect();
    let g = GraphProto {
        name: Some(name.clone()),
        node: nodes,
        input: inputs
            .iter()
            .map(|(n, s)| value_info(n, DataType::Float, &dims(s)))
            .collect(),
        output: vec![value_info("y", DataType::Float, &dims(out))],
        initializer: inits,
        ..Default::default()
    };
    Case {
        name,
        model: model(g),
        inputs: inputs.iter().map(|(_, s)| s.clone()).collect(),
    }
}

/// Elementwise chains (fused into one loop by the passes where they can be): vector
/// arithmetic, rounding, comparisons and selects, math calls lane by lane, broadcasts.
fn elementwise(len: usize) -> Vec<Case> {
    let s = vec![len];
    let one = |n: &'static str, v: f32| (n, vec![1], Some(vec![v]));
    let mut v = vec![graph(
        format!("chain_{len}"),
        &[("x", s.clone())],
        vec![
            one("k3", 3.0),
            one("k02", 0.2),
            one("km", -0.5),
            one("k2", 2.0),
        ],
        vec![
            node("Mul", &["x", "k3"], &["t1"]),
            node("Floor", &["t1"], &["t2"]),
            node("Neg", &["t2"], &["t3"]),
            node("Abs", &["x"], &["t4"]),
            node("Sqrt", &["t4"], &["t5"]),
            node("Greater", &["x", "k02"], &["g"]),
            node("Where", &["g", "t5", "t3"], &["t6"]),
            node("Ceil", &["x"], &["t7"]),
            node("Max", &["x", "km"], &["t8"]),
            node("Min", &["t8", "t7"], &["t9"]),
            node("Add", &["t6", "t9"], &["t10"]),
            node("Round", &["t1"], &["t11"]),
            node("Sub", &["t10", "t11"], &["t12"]),
            node("Sigmoid", &["x"], &["t13"]),
            node("Tanh", &["x"], &["t14"]),
            node("Erf", &["t14"], &["t15"]),
            node("Add", &["t15", "k2"], &["t16"]),
            node("Div", &["t13", "t16"], &["t17"]),
            node("Add", &["t12", "t17"], &["t18"]),
            node("Log", &["t4"], &["t19"]),
            node("Softplus", &["x"], &["t20"]),
            node("Mish", &["t18"], &["t21"]),
            node("Add", &["t19", "t20"], &["t22"]),
            node("Add", &["t21", "t22"], &["y"]),
        ],
        &s,
    )];
    // Row and column broadcasts, two inputs, an activation.
    v.push(graph(
        format!("broadcast_{len}"),
        &[("a", vec![3, len]), ("b", vec![3, len])],
        vec![("r", vec![len], None), ("c", vec![3, 1], None)],
        vec![
            node("Mul", &["a", "b"], &["t1"]),
            node("Add", &["t1", "r"], &["t2"]),
            node("Sub", &["t2", "c"], &["t3"]),
            node("Exp", &["t3"], &["t4"]),
            node("Relu", &["t3"], &["t5"]),
            node("Add", &["t4", "t5"], &["y"]),
        ],
        &[3, len],
    ));
    // Reductions (vector accumulators): softmax rows, LayerNorm rows, whole-tensor max,
    // min and sum.
    v.push(graph(
        format!("reduce_{len}"),
        &[("x", vec![3, len])],
        vec![("sc", vec![len], None), ("bi", vec![len], None)],
        vec![
            node("Softmax", &["x"], &["s"]),
            node("ReduceMax", &["x"], &["mx"]),
            node("ReduceMin", &["x"], &["mn"]),
            node("ReduceSum", &["x"], &["sm"]),
            node("LayerNormalization", &["x", "sc", "bi"], &["ln"]),
            node("Mul", &["s", "mx"], &["t1"]),
            node("Sub", &["t1", "mn"], &["t2"]),
            node("Add", &["t2", "sm"], &["t3"]),
            node("Add", &["t3", "ln"], &["y"]),
        ],
        &[3, len],
    ));
    // A transpose feeding arithmetic: strided (gathered) loads.
    v.push(graph(
        format!("gather_{len}"),
        &[("a", vec![len, 3])],
        vec![("r", vec![3, len], None)],
        vec![
            {
                let mut n = node("Transpose", &["a"], &["t"]);
                n.attribute = vec![ints_attr("perm", &[1, 0])];
                n
            },
            node("Mul", &["t", "r"], &["t2"]),
            node("Abs", &["t2"], &["y"]),
        ],
        &[3, len],
    ));
    v
}

/// Output length of a convolution or pool along one dim.
fn out_len(i: usize, k: usize, s: usize, d: usize, pb: usize, pe: usize) -> usize {
    (i + pb + pe - ((k - 1) * d + 1)) / s + 1
}

/// Grouped and depthwise convolutions (bias, epilogue, pads, strides, dilations, 1-D
/// and 2-D) whose output rows have length `w` (or input width `w`).
fn grouped_convs(w: usize) -> Vec<Case> {
    let mut v = Vec::new();
    // (name, channels, group, kernel, pads (b, e), stride, dilation, post op)
    type G = (
        &'static str,
        usize,
        usize,
        usize,
        (usize, usize),
        usize,
        usize,
        Option<&'static str>,
    );
    let geoms: [G; 13] = [
        ("dw3x3_pad", 4, 4, 3, (1, 1), 1, 1, Some("Relu")),
        // 16 and 32 channels: channels in the vector lanes (`dw_lanes`), its transposes
        // through 16x16 register tiles on AVX-512 (whole and partial row blocks).
        ("dwl3x3_sig", 32, 32, 3, (1, 1), 1, 1, Some("Sigmoid")),
        ("dwl3x3_res", 16, 16, 3, (1, 1), 1, 1, Some("AddX")),
        ("dwl5x5_s2", 16, 16, 5, (2, 2), 2, 1, Some("Relu")),
        ("dwl3x3_dil", 16, 16, 3, (2, 1), 1, 2, None),
        // A residual Add fused after the convolution (an epilogue that reads a tensor).
        ("dw3x3_res", 3, 3, 3, (1, 1), 1, 1, Some("AddX")),
        ("dw3x3_s2", 3, 3, 3, (2, 0), 2, 1, None),
        ("grouped_dil", 4, 2, 3, (2, 2), 1, 2, Some("Sigmoid")),
        ("dw5_wide", 2, 2, 5, (2, 3), 1, 1, None),
        // Channel multiplier 2 (one input channel per group, two outputs), stride 2,
        // dilation 2.
        ("dw_mult_s2_dil", 2, 2, 3, (2, 1), 2, 2, Some("Relu")),
        // Stride 3: three column phases.
        ("dw3x3_s3", 3, 3, 3, (1, 2), 3, 1, None),
        // Stride 4: every fourth element (permutes on AVX-512, not gathers).
        ("dw3x3_s4", 3, 3, 3, (1, 2), 4, 1, Some("Relu")),
        // Tall: many interior rows between the border rows.
        ("dw3x3_tall", 2, 2, 3, (1, 1), 1, 1, None),
    ];
    for (name, c, group, k, (pb, pe), s, d, post) in geoms {
        let h = if name == "dw3x3_tall" { 19 } else { 5 };
        // Stride 4 on rows of 52 to 436: its phase planes copy rows of 13 to 109 every
        // fourth element (AVX-512: permutes; masked tails of 3, 6, 9 and 13 lanes).
        let w = if name == "dw3x3_s4" { 12 * w + 40 } else { w };
        if w + pb + pe < (k - 1) * d + 1 {
            continue;
        }
        let (oh, ow) = (out_len(h, k, s, d, pb, pe), out_len(w, k, s, d, pb, pe));
        let m = if name == "dw_mult_s2_dil" { 2 * c } else { c };
        let mut conv = node("Conv", &["x", "w", "b"], &["c0"]);
        conv.attribute = vec![
            int_attr("group", group as i64),
            ints_attr("pads", &[pb as i64, pb as i64, pe as i64, pe as i64]),
            ints_attr("strides", &[s as i64, s as i64]),
            ints_attr("dilations", &[d as i64, d as i64]),
        ];
        conv.output = vec![if post.is_some() { "c0" } else { "y" }.into()];
        let mut nodes = vec![conv];
        match post {
            Some("AddX") => nodes.push(node("Add", &["c0", "x"], &["y"])),
            Some(p) => nodes.push(node(p, &["c0"], &["y"])),
            None => {}
        }
        v.push(graph(
            format!("{name}_{w}"),
            &[("x", vec![2, c, h, w])],
            vec![("w", vec![m, c / group, k, k], None), ("b", vec![m], None)],
            nodes,
            &[2, m, oh, ow],
        ));
    }
    // 1-D depthwise, no bias.
    let ow = out_len(w, 3, 1, 1, 2, 1);
    let mut conv = node("Conv", &["x", "w"], &["y"]);
    conv.attribute = vec![int_attr("group", 3), ints_attr("pads", &[2, 1])];
    v.push(graph(
        format!("dw1d_{w}"),
        &[("x", vec![2, 3, w])],
        vec![("w", vec![3, 1, 3], None)],
        vec![conv],
        &[2, 3, ow],
    ));
    v
}

/// MaxPool and AveragePool (pads, strides, dilations, ceil_mode, count_include_pad,
/// 1-D and 2-D) over inputs of width `w`.
fn pools(w: usize) -> Vec<Case> {
    let mut v = Vec::new();
    // (name, op, kernel, pads (b, e), stride, dilation, ceil_mode, count_include_pad)
    type P = (
        &'static str,
        &'static str,
        usize,
        (usize, usize),
        usize,
        usize,
        i64,
        i64,
    );
    let geoms: [P; 9] = [
        ("max3_s2_pad", "MaxPool", 3, (1, 1), 2, 1, 0, 0),
        // Every window inside (separable over whole planes).
        ("max3_s2", "MaxPool", 3, (0, 0), 2, 1, 0, 0),
        ("max3_s2_ceil", "MaxPool", 3, (0, 0), 2, 1, 1, 0),
        ("avg3_s3_ceil", "AveragePool", 3, (1, 0), 3, 1, 1, 0),
        ("max2_ceil", "MaxPool", 2, (0, 0), 2, 1, 1, 0),
        ("max3_dil", "MaxPool", 3, (2, 1), 1, 2, 0, 0),
        ("avg3_pad", "AveragePool", 3, (1, 1), 1, 1, 0, 0),
        ("avg3_incl_s2", "AveragePool", 3, (1, 2), 2, 1, 0, 1),
        ("avg2_ceil_incl", "AveragePool", 2, (1, 0), 2, 1, 1, 1),
    ];
    for (name, op, k, (pb, pe), s, d, ceil, incl) in geoms {
        let h = 6;
        let o = |i: usize| {
            let span = i + pb + pe - ((k - 1) * d + 1);
            let n = if ceil != 0 {
                span.div_ceil(s)
            } else {
                span / s
            } + 1;
            // With ceil_mode, a window must start inside the input or the left pad.
            if ceil != 0 && (n - 1) * s >= i + pb {
                n - 1
            } else {
                n
            }
        };
        if w + pb + pe < (k - 1) * d + 1 {
            continue;
        }
        let mut p = node(op, &["x"], &["y"]);
        p.attribute = vec![
            ints_attr("kernel_shape", &[k as i64, k as i64]),
            ints_attr("pads", &[pb as i64, pb as i64, pe as i64, pe as i64]),
            ints_attr("strides", &[s as i64, s as i64]),
            int_attr("ceil_mode", ceil),
        ];
        if op == "MaxPool" {
            p.attribute
                .push(ints_attr("dilations", &[d as i64, d as i64]));
        } else {
            p.attribute.push(int_attr("count_include_pad", incl));
        }
        v.push(graph(
            format!("{name}_{w}"),
            &[("x", vec![1, 3, h, w])],
            vec![],
            vec![p],
            &[1, 3, o(h), o(w)],
        ));
    }
    // 1-D max pool with a NaN-free random input.
    let mut p = node("MaxPool", &["x"], &["y"]);
    p.attribute = vec![ints_attr("kernel_shape", &[3]), ints_attr("pads", &[1, 1])];
    v.push(graph(
        format!("max1d_{w}"),
        &[("x", vec![2, 3, w])],
        vec![],
        vec![p],
        &[2, 3, w],
    ));
    v
}

/// GlobalAveragePool and GlobalMaxPool over planes of 7 x `w` (folded into lanes of
/// partials from 64 elements on) and one of 13 x 13.
fn global_pools(w: usize) -> Vec<Case> {
    let mut v = Vec::new();
    for op in ["GlobalAveragePool", "GlobalMaxPool"] {
        let mut planes = vec![(7, w)];
        if w == 4 {
            planes.push((13, 13));
        }
        for (h, w) in planes {
            v.push(graph(
                format!("{op}_{h}x{w}"),
                &[("x", vec![2, 3, h, w])],
                vec![],
                vec![node(op, &["x"], &["y"])],
                &[2, 3, 1, 1],
            ));
        }
    }
    v
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for len in LENS {
        v.extend(elementwise(len));
        v.extend(grouped_convs(len));
        v.extend(pools(len));
        v.extend(global_pools(len * 4));
    }
    v
}

/// max|got - want| / max|want|.
/// A string attribute.
fn str_attr(n: &str, v: &str) -> onnxc::onnx::proto::AttributeProto {
    onnxc::onnx::proto::AttributeProto {
        name: Some(n.into()),
        r#type: Some(3),
        s: Some(v.as_bytes().to_vec()),
        ..Default::default()
    }
}

/// Asserts each f32 of `got` within `ulps` relative ulps of the reference's `want` (0:
/// the same bits), NaN where it is NaN; `what` and the input `x[i]` name a failure.
fn assert_elements(what: &str, x: &[f32], got: &Tensor, want: &ndarray::ArrayD<f64>, ulps: f32) {
    for (i, (g, w)) in got.to_f64().unwrap().iter().zip(want).enumerate() {
        let (g, w) = (*g as f32, *w as f32);
        let ok = (g.is_nan() && w.is_nan())
            || g.to_bits() == w.to_bits()
            || (ulps > 0.0 && (g == w || (g - w).abs() <= ulps * f32::EPSILON * w.abs()));
        assert!(
            ok,
            "{what}: x = {:?} gives {g:?}, the reference {w:?}",
            x[i]
        );
    }
}

/// A Resize of `xs` (4-D) by `sh` and `sw` on its last two axes in `mode`, with `attrs`.
fn resize_case(
    name: &str,
    mode: &str,
    xs: &[usize],
    [sh, sw]: [f32; 2],
    mut attrs: Vec<onnxc::onnx::proto::AttributeProto>,
) -> Case {
    let ys = vec![
        xs[0],
        xs[1],
        (xs[2] as f32 * sh) as usize,
        (xs[3] as f32 * sw) as usize,
    ];
    let mut n = node("Resize", &["x", "", "sc"], &["y"]);
    attrs.push(str_attr("mode", mode));
    n.attribute = attrs;
    graph(
        name.into(),
        &[("x", xs.to_vec())],
        vec![("sc", vec![4], Some(vec![1.0, 1.0, sh, sw]))],
        vec![n],
        &ys,
    )
}

fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    let (g, w) = (got.to_f64().unwrap(), want.to_f64().unwrap());
    assert_eq!(g.shape(), w.shape());
    let scale = w.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    g.iter()
        .zip(w.iter())
        .map(|(x, y)| common::abs_diff(*x, *y))
        .fold(0f64, f64::max)
        / scale
}

/// A compiled-code run environment for `target`, or None (with a note) when this CPU
/// cannot run the target's code.
fn env_for(target: &str, scratch: &std::path::Path) -> Option<CompiledEnv> {
    let env = match CompiledEnv::new(target, scratch) {
        Ok(e) => e,
        Err(e) => panic!("{e}; tests/run.sh installs the cross toolchain and qemu"),
    };
    let t = onnxc::targets::Target::load(target).unwrap();
    let host = onnxc::targets::Target::host().unwrap();
    if t.is_x86() && !t.features.iter().all(|f| host.has(f)) {
        eprintln!("skip {target}: this CPU lacks its features");
        return None;
    }
    Some(env)
}

/// The inputs of case `ci`.
fn inputs_of(case: &Case, ci: usize) -> Vec<Tensor> {
    case.inputs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.iter().product();
            Tensor::from_vec(s, rand(n, 1000 + 17 * ci as u64 + i as u64))
        })
        .collect()
}

/// Compiles `case` for `target`, runs it on `inputs` and returns the object and the
/// first output.
fn compile_run(
    env: &CompiledEnv,
    target: &str,
    case: &Case,
    inputs: &[Tensor],
    dir: &std::path::Path,
    exact_math: bool,
) -> (Vec<u8>, Tensor) {
    std::fs::create_dir_all(dir).unwrap();
    let path = common::write_model(dir, &format!("{}.onnx", case.name), &case.model);
    let m = onnx::load(&path).unwrap();
    let mut opts = onnxc::driver::Options {
        target: target.to_string(),
        exact_math,
        ..Default::default()
    };
    for (&id, t) in m.graph.inputs.iter().zip(inputs) {
        opts.shapes
            .push((m.graph.value(id).name.clone(), t.shape().to_vec()));
    }
    let c = onnxc::driver::compile_graph(m.graph.clone(), "model", &opts)
        .unwrap_or_else(|e| panic!("{}: compile: {e}", case.name));
    let obj = dir.join("model.o");
    let exe = dir.join("model.exe");
    std::fs::write(&obj, &c.artifacts.object).unwrap();
    onnxc::runner::link(&env.toolchain, &env.harness, &obj, &exe).unwrap();
    let outs: Vec<(DType, Vec<usize>)> = c
        .graph
        .outputs
        .iter()
        .map(|&o| {
            let ty = &c.graph.value(o).ty;
            (ty.dtype().unwrap(), ty.static_shape().unwrap())
        })
        .collect();
    let got = onnxc::runner::execute(&env.toolchain, &exe, dir, inputs, &outs)
        .unwrap_or_else(|e| panic!("{}: run: {e}", case.name));
    (c.artifacts.object, got[0].clone())
}

fn check_target(target: &str) {
    let scratch = tempfile::tempdir().unwrap();
    let Some(env) = env_for(target, scratch.path()) else {
        return;
    };
    let mut failures = Vec::new();
    for (ci, case) in cases().into_iter().enumerate() {
        let m = onnx::load(&common::write_model(
            scratch.path(),
            &format!("{}.onnx", case.name),
            &case.model,
        ))
        .unwrap();
        let inputs = inputs_of(&case, ci);
        let want = eval::run(
            &m.graph,
            inputs.iter().cloned().map(Value::Tensor).collect(),
        )
        .unwrap_or_else(|e| panic!("{}: reference: {e}", case.name));
        let dir = scratch.path().join(format!("c{ci}"));
        let (_, got) = compile_run(&env, target, &case, &inputs, &dir, false);
        let want = want[0].clone().into_tensor().unwrap();
        let err = rel_err(&got, &want);
        if err.is_nan() || err > 1e-4 {
            failures.push(format!("{}: relative error {err:e}", case.name));
        }
    }
    assert!(
        failures.is_empty(),
        "{target}: wrong results:\n{}",
        failures.join("\n")
    );
}

/// With `exact_math`, the AVX-512 loops (16 lanes, masked tails) compute the same bits
/// as the 128-bit code wherever no reduction reorders a sum: every case but the
/// reductions, compiled for x86_64-avx512 and x86_64-sse4, gives identical outputs; and
/// the AVX-512 objects of the elementwise chains and the depthwise convolutions do
/// contain the loops. (Without it they contract multiply-adds: checked against the
/// reference like every target.)
#[test]
fn avx512_loops_match_128_bit_code_bit_for_bit() {
    let scratch = tempfile::tempdir().unwrap();
    let (Some(wide), Some(narrow)) = (
        env_for("x86_64-avx512", scratch.path()),
        env_for("x86_64-sse4", scratch.path()),
    ) else {
        return;
    };
    let mut failures = Vec::new();
    let mut with_loops = 0;
    for (ci, case) in cases().into_iter().enumerate() {
        let reduces = ["reduce_", "Global", "avg"]
            .iter()
            .any(|p| case.name.starts_with(p));
        if reduces {
            continue;
        }
        let inputs = inputs_of(&case, ci);
        let (obj, a) = compile_run(
            &wide,
            "x86_64-avx512",
            &case,
            &inputs,
            &scratch.path().join(format!("w{ci}")),
            true,
        );
        let (_, b) = compile_run(
            &narrow,
            "x86_64-sse4",
            &case,
            &inputs,
            &scratch.path().join(format!("n{ci}")),
            true,
        );
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_f64()
                .unwrap()
                .iter()
                .map(|x| (*x as f32).to_bits())
                .collect()
        };
        if bits(&a) != bits(&b) {
            failures.push(case.name.clone());
        }
        let has_loop = obj.windows(12).any(|w| w == b"model__wide0");
        let long = case.name.ends_with("_17") || case.name.ends_with("_33");
        if long && (case.name.starts_with("chain") || case.name.starts_with("dw3x3_pad")) {
            assert!(has_loop, "{}: no AVX-512 loop in the object", case.name);
            with_loops += 1;
        }
    }
    assert!(with_loops >= 4, "too few cases exercised the AVX-512 loops");
    assert!(
        failures.is_empty(),
        "AVX-512 and 128-bit code differ on: {failures:?}"
    );
}

#[test]
fn vectorize_host() {
    check_target("host");
}

#[test]
fn vectorize_x86_64_avx512() {
    check_target("x86_64-avx512");
}

/// The AVX2 loops (`backend/x86/wide_avx2.rs`: 8 lanes, masked tails, a subset of the
/// instructions; the rest stays 128-bit).
#[test]
fn vectorize_x86_64_avx2() {
    check_target("x86_64-avx2");
}

#[test]
fn vectorize_x86_64_sse4() {
    check_target("x86_64-sse4");
}

#[test]
fn vectorize_aarch64_neon_qemu() {
    check_target("aarch64-neon");
}

/// The parallel copy of a loop runs the same AVX-512 code as the serial one, also when
/// its rows do not divide evenly among the tasks (the last task's copy of the body once
/// shared its locals with the others', which left both copies scalar).
#[test]
fn parallel_tasks_run_avx512_loops() {
    let case = erf_rows();
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_model(dir.path(), "erf_rows.onnx", &case.model);
    let m = onnx::load(&path).unwrap();
    let opts = onnxc::driver::Options {
        target: "x86_64-avx512".to_string(),
        min_program_work: 0,
        ..Default::default()
    };
    let c = onnxc::driver::compile_graph(m.graph, "model", &opts).unwrap();
    let obj = dir.path().join("model.o");
    std::fs::write(&obj, &c.artifacts.object).unwrap();
    let nm = std::process::Command::new("nm").arg(&obj).output().unwrap();
    let syms = String::from_utf8_lossy(&nm.stdout).into_owned();
    let task_wide: Vec<&str> = syms
        .lines()
        .filter(|l| l.contains("__wide") && l.contains("_task"))
        .collect();
    assert!(
        syms.contains("_task0"),
        "the loop was not parallelised:\n{syms}"
    );
    assert!(
        task_wide.len() >= 2,
        "both copies of the task body (even share, last share) should call AVX-512 loops:\n{syms}"
    );
}

/// erf(x / s) * x + x on 1x197x767: one fused loop whose body sets locals (x is read
/// twice) and calls erf once per element. The nest collapses into one loop of 151099
/// iterations, which does not divide among the 16 tasks (the last task's share is
/// shorter, so the task body has two copies).
fn erf_rows() -> Case {
    graph(
        "erf_rows".into(),
        &[("x", vec![1, 197, 767])],
        vec![("s", vec![], Some(vec![std::f32::consts::SQRT_2]))],
        vec![
            node("Div", &["x", "s"], &["a"]),
            node("Erf", &["a"], &["b"]),
            node("Mul", &["b", "x"], &["c"]),
            node("Add", &["c", "x"], &["y"]),
        ],
        &[1, 197, 767],
    )
}

/// A program whose whole run is below `kir::parallel::MIN_PROGRAM_WORK` keeps its loops
/// on the calling thread, threads or not: `relu(x * s + t)` on 1x197x768 has no loop
/// task function in its object with the default options and some with
/// `min_program_work: 0`, and both runs on two threads give the reference's output.
/// `erf_rows`, about the same size but with a math call per element (counted as many
/// operations), is not small: its loop still goes to the threads.
#[test]
fn small_programs_keep_loops_on_the_calling_thread() {
    let cheap = graph(
        "affine_rows".into(),
        &[("x", vec![1, 197, 768])],
        vec![
            ("s", vec![], Some(vec![1.5])),
            ("t", vec![], Some(vec![-0.25])),
        ],
        vec![
            node("Mul", &["x", "s"], &["a"]),
            node("Add", &["a", "t"], &["b"]),
            node("Relu", &["b"], &["y"]),
        ],
        &[1, 197, 768],
    );
    let dir = tempfile::tempdir().unwrap();
    // Loop task functions are named `PREFIX__kN_NAME_taskM`.
    let loop_tasks = |obj: &[u8]| {
        String::from_utf8_lossy(obj)
            .split('\0')
            .filter(|s| s.contains("__k") && s.contains("_task"))
            .count()
    };
    let run = |case: &Case, min_program_work: u64| {
        let path = common::write_model(dir.path(), &format!("{}.onnx", case.name), &case.model);
        let m = onnx::load(&path).unwrap();
        let x = Tensor::from_vec(&case.inputs[0], rand(case.inputs[0].iter().product(), 7));
        let inputs = vec![Value::Tensor(x)];
        let want = eval::run(&m.graph, inputs.clone()).unwrap();
        let want = want[0].as_tensor().unwrap().to_f64().unwrap();
        let opts = onnxc::driver::Options {
            target: "host".to_string(),
            min_program_work,
            ..Default::default()
        };
        let c = onnxc::driver::compile_graph(m.graph, "model", &opts).unwrap();
        let out = dir.path().join(format!("{}_{min_program_work}", case.name));
        std::fs::create_dir_all(&out).unwrap();
        let got = onnxc::runner::run_compiled_threads(&c, &inputs, &out, 2).unwrap();
        let got = got[0].as_tensor().unwrap().to_f64().unwrap();
        let err = got
            .iter()
            .zip(want.iter())
            .map(|(g, w)| (g - w).abs())
            .fold(0.0, f64::max)
            / want.iter().map(|w| w.abs()).fold(0.0, f64::max);
        assert!(
            err <= 1e-4,
            "{} with min_program_work {min_program_work}: relative error {err:.3e}",
            case.name
        );
        let work = onnxc::kir::parallel::program_work(&c.lowered.program);
        (work, loop_tasks(&c.artifacts.object))
    };
    let small = onnxc::kir::parallel::MIN_PROGRAM_WORK;
    let (work, tasks) = run(&cheap, small);
    assert!(
        work < small,
        "affine_rows is no longer a small program ({work})"
    );
    assert_eq!(tasks, 0, "the small program's loop went to the threads");
    let (_, tasks) = run(&cheap, 0);
    assert!(tasks > 0, "with min_program_work 0 the loop stayed serial");
    let (work, tasks) = run(&erf_rows(), small);
    assert!(work >= small, "erf_rows counted as small ({work})");
    assert!(tasks > 0, "erf_rows' loop stayed serial");
}

/// NaN in max pools: a window with some NaN taps gives the largest number, one whose
/// taps are all NaN gives NaN (AVX-512's `vrangeps` path and the compare-and-select
/// code agree with the reference on where the NaNs are and on every other value).
#[test]
fn max_pools_skip_nan_like_the_reference() {
    let scratch = tempfile::tempdir().unwrap();
    let targets = ["host", "x86_64-sse4", "x86_64-avx512"];
    for (ci, case) in pools(17)
        .into_iter()
        .chain(global_pools(68))
        .filter(|c| c.name.starts_with("max") || c.name.starts_with("GlobalMax"))
        .enumerate()
    {
        let mut inputs = inputs_of(&case, ci);
        // NaN at every 5th element, and the whole first plane's first 3x3 corner
        // (every window there, where 3x3 windows cover it, is all NaN).
        let shape = inputs[0].shape().to_vec();
        let w = shape[shape.len() - 1];
        let mut vals: Vec<f32> = inputs[0]
            .to_f64()
            .unwrap()
            .iter()
            .map(|&x| x as f32)
            .collect();
        for (i, x) in vals.iter_mut().enumerate() {
            if i % 5 == 0 || (i / w < 3 && i % w < 3) {
                *x = f32::NAN;
            }
        }
        inputs[0] = Tensor::from_vec(&shape, vals);
        let m = onnx::load(&common::write_model(
            scratch.path(),
            &format!("{}.onnx", case.name),
            &case.model,
        ))
        .unwrap();
        let want = eval::run(
            &m.graph,
            inputs.iter().cloned().map(Value::Tensor).collect(),
        )
        .unwrap()[0]
            .clone()
            .into_tensor()
            .unwrap()
            .to_f64()
            .unwrap();
        if !case.name.starts_with("Global") {
            assert!(
                want.iter().any(|x| x.is_nan()),
                "{}: no all-NaN window",
                case.name
            );
        }
        for target in &targets {
            let Some(env) = env_for(target, scratch.path()) else {
                continue;
            };
            let dir = scratch.path().join(format!("nan{ci}_{target}"));
            let (_, got) = compile_run(&env, target, &case, &inputs, &dir, false);
            let got = got.to_f64().unwrap();
            for (g, w) in got.iter().zip(want.iter()) {
                assert!(
                    g.is_nan() == w.is_nan() && (w.is_nan() || (g - w).abs() <= 1e-6),
                    "{} on {target}: got {g}, want {w}",
                    case.name
                );
            }
        }
    }
}

/// `max(x, c)` / `min(x, c)` with a constant `c` (the Relu, Clip and HardSwish of fused
/// epilogues), both orders, on signed zeros, NaNs, infinities and values either side of
/// `c`: the AVX-512 loops take a short path there (one instruction with the constant
/// first; for max with +0 an added +0, which turns -0 into +0), so their bits must be the
/// kernel IR's meaning exactly (NaN where an operand is NaN, -0 below +0), as the
/// 128-bit code's are.
#[test]
fn min_max_with_constants_keep_signed_zeros_and_nans() {
    use onnxc::backend::cranelift::{compile_object, ObjectSpec, TensorDesc};
    use onnxc::kir::build::{add, for_, int, mul, store, v};
    use onnxc::kir::{BinOp, BufKind, Expr, Kernel, Program, Ty};
    let scratch = tempfile::tempdir().unwrap();
    let len = 37usize;
    let specials = [
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1.5,
        -2.0,
        6.0,
        -1e-30,
        1e-30,
    ];
    let x: Vec<f32> = (0..len)
        .map(|i| specials.get(i % 13).copied().unwrap_or(i as f32 - 20.0))
        .collect();
    // (max?, constant, constant first?)
    let ops = [
        (true, 0.0f32, false),
        (true, 0.0, true),
        (true, -0.0, false),
        (true, 1.5, true),
        (true, f32::NAN, false),
        (false, 0.0, false),
        (false, -0.0, true),
        (false, -0.0, false),
        (false, 6.0, true),
        (false, f32::NEG_INFINITY, false),
    ];
    let mut p = Program::default();
    let xb = p.add_buffer("x", BufKind::Input(0), Ty::F32, len as u64);
    let yb = p.add_buffer("y", BufKind::Output(0), Ty::F32, (ops.len() * len) as u64);
    p.inputs = vec![0];
    p.outputs = vec![yb];
    let mut k = Kernel::new("minmax");
    let i = k.var(Ty::I64);
    for (r, &(max, c, first)) in ops.iter().enumerate() {
        let (a, b) = (Expr::load(xb, v(i)), Expr::f(c as f64, Ty::F32));
        let (a, b) = if first { (b, a) } else { (a, b) };
        let op = if max { BinOp::Max } else { BinOp::Min };
        let at = add(mul(int(r), int(len)), v(i));
        k.body
            .push(for_(i, len, vec![store(yb, at, Expr::bin(op, a, b))]));
    }
    p.kernels = vec![k];
    // The meaning: NaN if either is NaN, -0 below +0.
    let want = |max: bool, a: f32, c: f32| -> f32 {
        if a.is_nan() || c.is_nan() {
            return f32::NAN;
        }
        let key = |z: f32| (z, z.is_sign_positive());
        let (ka, kc) = (key(a), key(c));
        let a_wins = if max {
            ka.0 > kc.0 || (ka.0 == kc.0 && ka.1 >= kc.1)
        } else {
            ka.0 < kc.0 || (ka.0 == kc.0 && ka.1 <= kc.1)
        };
        if a_wins {
            a
        } else {
            c
        }
    };
    let desc = |name: &str, n: usize| TensorDesc {
        name: name.into(),
        dtype: 1,
        bytes: 4 * n as u64,
        shape: vec![n as u64],
    };
    let mut ran = 0;
    for target in ["x86_64-avx512", "x86_64-sse4"] {
        let Some(env) = env_for(target, scratch.path()) else {
            continue;
        };
        let t = onnxc::targets::Target::load(target).unwrap();
        let obj = compile_object(&ObjectSpec {
            prefix: "model",
            program: &p,
            inputs: &[desc("x", len)],
            outputs: &[desc("y", ops.len() * len)],
            triple: &t.triple,
            features: &t.features,
            exact_math: true,
            kernel_table: false,
            min_program_work: 0,
        })
        .unwrap();
        if target == "x86_64-avx512" {
            assert!(
                obj.windows(12).any(|w| w == b"model__wide0"),
                "no AVX-512 loop in the object"
            );
        }
        let dir = scratch.path().join(target);
        std::fs::create_dir_all(&dir).unwrap();
        let (o, exe) = (dir.join("model.o"), dir.join("model.exe"));
        std::fs::write(&o, obj).unwrap();
        onnxc::runner::link(&env.toolchain, &env.harness, &o, &exe).unwrap();
        let got = onnxc::runner::execute(
            &env.toolchain,
            &exe,
            &dir,
            &[Tensor::from_vec(&[len], x.clone())],
            &[(DType::F32, vec![ops.len() * len])],
        )
        .unwrap();
        let got: Vec<f32> = got[0].to_f64().unwrap().iter().map(|&g| g as f32).collect();
        for (r, &(max, c, first)) in ops.iter().enumerate() {
            for (j, &a) in x.iter().enumerate() {
                let (g, w) = (got[r * len + j], want(max, a, c));
                assert!(
                    (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits(),
                    "{target}: {}({a:?}, {c:?}) (constant first: {first}) gives {g:?}, not {w:?}",
                    if max { "max" } else { "min" }
                );
            }
        }
        ran += 1;
    }
    if ran == 0 {
        eprintln!("skip: this CPU runs neither x86 target");
    }
}

/// The reference evaluator's first output of `case` on `inputs`.
fn reference(case: &Case, inputs: &[Tensor], scratch: &std::path::Path) -> Tensor {
    let m = onnx::load(&common::write_model(
        scratch,
        &format!("{}.onnx", case.name),
        &case.model,
    ))
    .unwrap();
    eval::run(
        &m.graph,
        inputs.iter().cloned().map(Value::Tensor).collect(),
    )
    .unwrap_or_else(|e| panic!("{}: reference: {e}", case.name))[0]
        .clone()
        .into_tensor()
        .unwrap()
}

/// `case` on x86_64-avx512, x86_64-avx2, x86_64-sse4 and aarch64-neon (those this CPU runs), exact
/// math and not, each output within `ulps` of the reference's ([`assert_elements`]; `x`
/// names a failing element's input) and, with `zeros`, the output of each zero input
/// that zero, sign included; how many runs there were.
fn within_ulps_on_targets(
    case: &Case,
    inputs: &[Tensor],
    scratch: &std::path::Path,
    x: &[f32],
    (ulps, zeros): (f32, bool),
) -> usize {
    let want = reference(case, inputs, scratch).to_f64().unwrap();
    on_every_target(case, inputs, scratch, |target, exact, got| {
        let what = format!("{} on {target} (exact {exact})", case.name);
        assert_elements(&what, x, got, &want, ulps);
        let got = got.to_f64().unwrap();
        for (&xi, g) in x.iter().zip(got.iter()) {
            let g = *g as f32;
            if zeros && xi == 0.0 {
                assert_eq!(g.to_bits(), xi.to_bits(), "{what}: x = {xi:?} gives {g:?}");
            }
        }
    })
}

/// [`on_targets`] on x86_64-avx512, x86_64-avx2, x86_64-sse4 and aarch64-neon, exact math and not:
/// `check(target, exact, output)`; how many runs there were.
fn on_every_target(
    case: &Case,
    inputs: &[Tensor],
    scratch: &std::path::Path,
    mut check: impl FnMut(&str, bool, &Tensor),
) -> usize {
    let targets = [
        "x86_64-avx512",
        "x86_64-avx2",
        "x86_64-sse4",
        "aarch64-neon",
    ];
    let mut ran = 0;
    for exact in [true, false] {
        ran += on_targets(case, inputs, scratch, &targets, exact, |target, got| {
            check(target, exact, got)
        });
    }
    ran
}

/// `case` compiled for each of `targets` this CPU runs and run on `inputs` (the
/// x86_64-avx512 object must hold an AVX-512 loop), each first output handed to `check`
/// with its target; how many targets ran.
fn on_targets(
    case: &Case,
    inputs: &[Tensor],
    scratch: &std::path::Path,
    targets: &[&str],
    exact_math: bool,
    mut check: impl FnMut(&str, &Tensor),
) -> usize {
    let mut ran = 0;
    for target in targets {
        let Some(env) = env_for(target, scratch) else {
            continue;
        };
        let dir = scratch.join(format!("{}_{target}", case.name));
        let (obj, got) = compile_run(&env, target, case, inputs, &dir, exact_math);
        if *target == "x86_64-avx512" {
            assert!(
                obj.windows(12).any(|w| w == b"model__wide0"),
                "{}: no AVX-512 loop in the object",
                case.name
            );
        }
        check(target, &got);
        ran += 1;
    }
    ran
}

/// [`on_targets`] on the host, AVX-512, AVX2 and SSE4 (not exact math), each output within
/// 1e-5 of the reference (relative to its largest value); how many targets ran.
fn within_1e5_on_x86(case: &Case, inputs: &[Tensor], scratch: &std::path::Path) -> usize {
    let want = reference(case, inputs, scratch);
    let targets = ["host", "x86_64-avx512", "x86_64-avx2", "x86_64-sse4"];
    on_targets(case, inputs, scratch, &targets, false, |target, got| {
        let err = rel_err(got, &want);
        assert!(
            err <= 1e-5,
            "{} on {target}: relative error {err:e}",
            case.name
        );
    })
}

/// Max and Min nodes with a scalar second operand, a weight or an input: their NaN test
/// of the scalar does not vary along the loop, and the AVX-512 loops take them (a weight's
/// test decided at compile time, an input's made a mask once per call). And `Pow(x, 2)`,
/// lowered as `x * x`, and `Pow(x, 0.5)` as `sqrt(x + 0)` (-inf apart). Every target gives the reference's bits on signed zeros, NaNs,
/// infinities and values that overflow when squared, the scalar NaN or not.
#[test]
fn scalar_operand_ops_run_as_avx512_loops() {
    let scratch = tempfile::tempdir().unwrap();
    let len = 37usize;
    let specials = [
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1.5,
        -2.0,
        3e20,
    ];
    let x: Vec<f32> = (0..len)
        .map(|i| {
            let r = rand(1, i as u64)[0] * 1e-3;
            specials.get(i % 11).copied().unwrap_or(i as f32 - 20.0 + r)
        })
        .collect();
    let mut cases = Vec::new();
    for (name, e) in [("Pow_2", 2.0), ("Pow_05", 0.5)] {
        let pow = graph(
            name.into(),
            &[("x", vec![len])],
            vec![("c", vec![], Some(vec![e]))],
            vec![node("Pow", &["x", "c"], &["y"])],
            &[len],
        );
        cases.push((pow, vec![Tensor::from_vec(&[len], x.clone())]));
    }
    for op in ["Max", "Min"] {
        for (si, s) in [0.0f32, -0.0, 1.5, f32::NAN].into_iter().enumerate() {
            // The scalar as a weight (either operand order) and as an input.
            for form in 0..3 {
                let name = format!("{op}_s{si}_f{form}");
                let ins: &[&str] = if form == 1 { &["c", "x"] } else { &["x", "c"] };
                let (inputs, consts): (Vec<(&str, Vec<usize>)>, Vec<Const>) = if form == 2 {
                    (vec![("x", vec![len]), ("c", vec![1])], vec![])
                } else {
                    (vec![("x", vec![len])], vec![("c", vec![1], Some(vec![s]))])
                };
                let case = graph(name, &inputs, consts, vec![node(op, ins, &["y"])], &[len]);
                let mut vals = vec![Tensor::from_vec(&[len], x.clone())];
                if form == 2 {
                    vals.push(Tensor::from_vec(&[1], vec![s]));
                }
                cases.push((case, vals));
            }
        }
    }
    let mut ran = 0;
    for (case, inputs) in cases {
        let want = reference(&case, &inputs, scratch.path()).to_f64().unwrap();
        let targets = ["x86_64-avx512", "x86_64-sse4"];
        ran += on_targets(
            &case,
            &inputs,
            scratch.path(),
            &targets,
            true,
            |target, got| {
                assert_elements(&format!("{} on {target}", case.name), &x, got, &want, 0.0)
            },
        );
    }
    if ran == 0 {
        eprintln!("skip: this CPU runs neither x86 target");
    }
}

/// Sums of f32 over the last axis (ReduceSum, ReduceMean, ReduceSumSquare, ReduceL1,
/// ReduceL2 over rows of 700) accumulate in f32 and run as AVX-512 reductions (an f64
/// accumulator ran one element at a time), within 1e-5 of the reference's f64 sums on
/// every x86 target.
#[test]
fn f32_sums_run_as_avx512_reductions() {
    let scratch = tempfile::tempdir().unwrap();
    let (rows, len) = (5usize, 700usize);
    let mut ran = 0;
    for (ci, op) in [
        "ReduceSum",
        "ReduceMean",
        "ReduceSumSquare",
        "ReduceL1",
        "ReduceL2",
    ]
    .into_iter()
    .enumerate()
    {
        // (Opset 21: the axes are an input, keepdims 1.)
        let mut case = graph(
            format!("{op}_rows"),
            &[("x", vec![rows, len])],
            vec![],
            vec![node(op, &["x", "axes"], &["y"])],
            &[rows, 1],
        );
        let g = case.model.graph.as_mut().unwrap();
        g.initializer.push(onnxc::onnx::proto::TensorProto {
            name: Some("axes".into()),
            dims: vec![1],
            data_type: Some(DataType::Int64 as i32),
            int64_data: vec![-1],
            ..Default::default()
        });
        ran += within_1e5_on_x86(&case, &inputs_of(&case, 500 + ci), scratch.path());
    }
    if ran == 0 {
        eprintln!("skip: this CPU runs no x86 target");
    }
}

/// LogSoftmax of f32 rows in f32 (AVX-512 loops: the max, the sum of exps, the outputs),
/// element by element within 1e-5 relative (plus 1e-6) of the reference, near-zero
/// outputs included: inputs up to +-50, so that each row's largest output is small.
#[test]
fn log_softmax_rows_in_f32() {
    let scratch = tempfile::tempdir().unwrap();
    let (rows, len) = (4usize, 300usize);
    let mut n = node("LogSoftmax", &["x"], &["y"]);
    n.attribute = vec![int_attr("axis", -1)];
    let case = graph(
        "log_softmax_rows".into(),
        &[("x", vec![rows, len])],
        vec![],
        vec![n],
        &[rows, len],
    );
    let x: Vec<f32> = rand(rows * len, 77).iter().map(|v| v * 50.0).collect();
    let inputs = vec![Tensor::from_vec(&[rows, len], x)];
    let want = reference(&case, &inputs, scratch.path()).to_f64().unwrap();
    let targets = ["host", "x86_64-avx512", "x86_64-avx2", "x86_64-sse4"];
    on_targets(
        &case,
        &inputs,
        scratch.path(),
        &targets,
        false,
        |target, got| {
            for (g, w) in got.to_f64().unwrap().iter().zip(want.iter()) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs() + 1e-6,
                    "{target}: {g} against the reference's {w}"
                );
            }
        },
    );
}

/// InstanceNormalization and GroupNormalization of f32 compute their statistics in f32
/// (AVX-512 reductions), within 1e-5 of the reference's f64 statistics on every x86
/// target: two images, planes of 700 pixels, 8 channels (4 groups).
#[test]
fn instance_and_group_norms_in_f32() {
    let scratch = tempfile::tempdir().unwrap();
    let shape = vec![2usize, 8, 20, 35];
    let mut ran = 0;
    for (ci, op) in ["InstanceNormalization", "GroupNormalization"]
        .into_iter()
        .enumerate()
    {
        let mut n = node(op, &["x", "s", "b"], &["y"]);
        if op == "GroupNormalization" {
            n.attribute = vec![int_attr("num_groups", 4)];
        }
        let case = graph(
            format!("{op}_f32"),
            &[("x", shape.clone())],
            vec![("s", vec![8], None), ("b", vec![8], None)],
            vec![n],
            &shape,
        );
        ran += within_1e5_on_x86(&case, &inputs_of(&case, 700 + ci), scratch.path());
    }
    if ran == 0 {
        eprintln!("skip: this CPU runs no x86 target");
    }
}

/// Nearest Resize by integer factors of the last two axes is one copy kernel (the tap
/// tables show each output copying input `o / k`): bit for bit the reference's on every
/// x86 target, under the default coordinate mode, `asymmetric` with `floor`, and modes or
/// factors that are not replication (align_corners, 1.5x), which keep the general path;
/// the 2x one is an AVX-512 loop.
#[test]
fn nearest_resize_by_integer_factors() {
    let scratch = tempfile::tempdir().unwrap();
    let xs = vec![2usize, 3, 5, 7];
    let cases = [
        ("default_2x", [2.0f32, 2.0], vec![]),
        (
            "asymmetric_3x2",
            [3.0, 2.0],
            vec![
                str_attr("coordinate_transformation_mode", "asymmetric"),
                str_attr("nearest_mode", "floor"),
            ],
        ),
        (
            "align_corners_2x",
            [2.0, 2.0],
            vec![str_attr("coordinate_transformation_mode", "align_corners")],
        ),
        ("default_1_5x", [1.5, 1.5], vec![]),
    ];
    for (ci, (name, [sh, sw], attrs)) in cases.into_iter().enumerate() {
        let case = resize_case(&format!("resize_{name}"), "nearest", &xs, [sh, sw], attrs);
        let inputs = inputs_of(&case, 800 + ci);
        let want = reference(&case, &inputs, scratch.path()).to_f64().unwrap();
        let targets: &[&str] = if name == "default_2x" {
            &["host", "x86_64-avx512", "x86_64-avx2", "x86_64-sse4"]
        } else {
            &["host", "x86_64-sse4"]
        };
        on_targets(
            &case,
            &inputs,
            scratch.path(),
            targets,
            true,
            |target, got| {
                let got = got.to_f64().unwrap();
                assert!(
                    got.iter().zip(want.iter()).all(|(g, w)| g == w),
                    "{name} on {target}: not the reference's values"
                );
            },
        );
    }
}

/// Log, Softplus and Mish on f32 compute `log` inline (vmath's, and the AVX-512 loops'
/// in plain or fused operations), not by a libm call per element, and `Pow(x, 3)` is
/// `(x * x) * x`: within 2 ulp of the reference's f64 values on every target, exact math
/// or not, with `log(+-0) = -inf`, `log(inf) = inf`, NaN for negative arguments and NaN,
/// subnormal arguments, and softplus exact where `log(1 + e^x)` overflows or rounds to 0.
#[test]
fn log_softplus_mish_and_cube_inline() {
    let scratch = tempfile::tempdir().unwrap();
    let len = 77usize;
    let specials = [
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -1.0,
        1.0,
        1e-40,
        f32::MIN_POSITIVE,
        f32::MAX,
        1.0 + f32::EPSILON,
        1.0 - f32::EPSILON / 2.0,
        std::f32::consts::FRAC_1_SQRT_2,
        std::f32::consts::SQRT_2,
        -20.0,
        95.0,
    ];
    let x: Vec<f32> = (0..len)
        .map(|i| match specials.get(i) {
            Some(&s) => s,
            // Magnitudes from 1e-6 to 1e6, both signs.
            None => {
                let r = rand(1, i as u64)[0];
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * 10f32.powf(12.0 * (r + 0.5).clamp(0.0, 1.0) - 6.0)
            }
        })
        .collect();
    let inputs = vec![Tensor::from_vec(&[len], x.clone())];
    let mut ran = 0;
    for op in ["Log", "Softplus", "Mish", "Pow"] {
        // Pow: the cube, `(x * x) * x`.
        let (ins, consts): (&[&str], _) = if op == "Pow" {
            (&["x", "c"], vec![("c", vec![], Some(vec![3.0]))])
        } else {
            (&["x"], vec![])
        };
        let case = graph(
            format!("{op}_inline"),
            &[("x", vec![len])],
            consts,
            vec![node(op, ins, &["y"])],
            &[len],
        );
        let want = reference(&case, &inputs, scratch.path()).to_f64().unwrap();
        let targets = ["x86_64-avx512", "x86_64-sse4", "aarch64-neon"];
        for exact in [true, false] {
            ran += on_targets(
                &case,
                &inputs,
                scratch.path(),
                &targets,
                exact,
                |target, got| {
                    let what = format!("{op} on {target} (exact {exact})");
                    assert_elements(&what, &x, got, &want, 2.0)
                },
            );
        }
    }
    if ran == 0 {
        eprintln!("skip: this CPU runs none of the targets");
    }
}

/// GlobalMaxPool of f32 planes under 64 elements runs as one f32 loop of two vector
/// reductions (the NaN-skipping maximum, and whether any element is a number): bit for
/// bit the reference's on every target, exact math or not, for a plane of NaN (NaN), NaN
/// among numbers (skipped), -inf alone, equal zeros, and random planes, at 5x5 and 7x7.
#[test]
fn global_max_pool_of_small_planes() {
    let scratch = tempfile::tempdir().unwrap();
    let mut ran = 0;
    for side in [5usize, 7] {
        let il = side * side;
        let planes = 6;
        let mut x = rand(planes * il, 77 + side as u64);
        for j in 0..il {
            x[il + j] = f32::NAN;
            if j % 3 == 0 {
                x[2 * il + j] = f32::NAN;
            }
            x[3 * il + j] = f32::NEG_INFINITY;
            x[4 * il + j] = if j % 2 == 0 { -0.0 } else { -1.0 };
        }
        x[3 * il + il / 2] = f32::NAN;
        x[5 * il + il - 1] = 7.0;
        let shape = vec![2usize, 3, side, side];
        let case = graph(
            format!("GlobalMaxPool_{side}x{side}"),
            &[("x", shape.clone())],
            vec![],
            vec![node("GlobalMaxPool", &["x"], &["y"])],
            &[2, 3, 1, 1],
        );
        let inputs = vec![Tensor::from_vec(&shape, x.clone())];
        let firsts: Vec<f32> = (0..planes).map(|p| x[p * il]).collect();
        ran += within_ulps_on_targets(&case, &inputs, scratch.path(), &firsts, (0.0, false));
    }
    if ran == 0 {
        eprintln!("skip: this CPU runs none of the targets");
    }
}

/// ReduceLogSumExp of f32 runs in f32 (the maximum by the NaN-skipping select, the sum
/// of `exp(x - max)` by the inline vector exp): within 8 ulp of the reference's f64
/// values on every target, exact math or not, for random rows, rows whose exponentials
/// would overflow unshifted (80-90), a NaN among numbers (NaN), +inf (inf) and a row of
/// -inf (-inf), over rows of 40.
#[test]
fn reduce_log_sum_exp_in_f32() {
    let scratch = tempfile::tempdir().unwrap();
    let (rows, cols) = (5usize, 40usize);
    let mut x: Vec<f32> = rand(rows * cols, 91).iter().map(|v| v * 10.0).collect();
    for j in 0..cols {
        x[4 * cols + j] = 85.0 + x[4 * cols + j] / 2.0;
        x[3 * cols + j] = f32::NEG_INFINITY;
    }
    x[cols + 7] = f32::NAN;
    x[2 * cols + 30] = f32::INFINITY;
    let inputs = vec![Tensor::from_vec(&[rows, cols], x.clone())];
    let mut n = node("ReduceLogSumExp", &["x"], &["y"]);
    n.attribute = vec![ints_attr("axes", &[-1])];
    let mut case = graph(
        "ReduceLogSumExp_rows".into(),
        &[("x", vec![rows, cols])],
        vec![],
        vec![n],
        &[rows, 1],
    );
    // axes as an attribute: opset 17.
    case.model.opset_import[0].version = Some(17);
    let firsts: Vec<f32> = (0..rows).map(|r| x[r * cols]).collect();
    if within_ulps_on_targets(&case, &inputs, scratch.path(), &firsts, (8.0, false)) == 0 {
        eprintln!("skip: this CPU runs none of the targets");
    }
}

/// ArgMax and ArgMin of f32 in vector lanes (over a contiguous axis of 40: the best by
/// a NaN-skipping reduction, then the first or last index holding it or a NaN; over an
/// axis of 5 with 20 positions beside it: each position's best and index in lanes):
/// exactly the reference's indices on every target, with and without
/// `select_last_index`, on values with many ties, NaN (it wins: the first or last
/// NaN), a row of -inf, one of +inf and equal zeros of both signs.
#[test]
fn arg_max_min_in_vector_lanes() {
    let scratch = tempfile::tempdir().unwrap();
    let mut ran = 0;
    // (name, shape, axis): rows (inner 1) and lanes (inner 20).
    let layouts: [(&str, Vec<usize>, i64); 2] =
        [("rows", vec![6, 40], 1), ("lanes", vec![6, 5, 20], 1)];
    for (name, shape, axis) in layouts {
        let len: usize = shape.iter().product();
        // Quarters in [-1, 1]: many ties.
        let mut x: Vec<f32> = rand(len, 123)
            .iter()
            .map(|v| (v * 4.0).round() / 4.0)
            .collect();
        if name == "rows" {
            // Rows 1 .. 4: two NaNs, -inf, +inf, equal zeros.
            for e in 0..40 {
                if e == 3 || e == 38 {
                    x[40 + e] = f32::NAN;
                }
                x[80 + e] = f32::NEG_INFINITY;
                x[120 + e] = f32::INFINITY;
                x[160 + e] = if e % 2 == 0 { 0.0 } else { -0.0 };
            }
        } else {
            // Position 0 of images 1 .. 4 of the lanes layout (stride 20 along the axis).
            let per = 5 * 20;
            for (img, e) in (1..5).flat_map(|i| (0..5).map(move |e| (i, e))) {
                let at = img * per + e * 20 + img;
                x[at] = match img {
                    1 if e == 1 || e == 3 => f32::NAN,
                    1 => x[at],
                    2 => f32::NEG_INFINITY,
                    3 => f32::INFINITY,
                    _ => {
                        if e % 2 == 0 {
                            0.0
                        } else {
                            -0.0
                        }
                    }
                };
            }
        }
        let mut out = shape.clone();
        out.remove(axis as usize);
        let inputs = vec![Tensor::from_vec(&shape, x.clone())];
        for op in ["ArgMax", "ArgMin"] {
            for last in [0, 1] {
                let mut n = node(op, &["x"], &["y"]);
                n.attribute = vec![
                    int_attr("axis", axis),
                    int_attr("keepdims", 0),
                    int_attr("select_last_index", last),
                ];
                let mut case = graph(
                    format!("{op}_{name}_{last}"),
                    &[("x", shape.clone())],
                    vec![],
                    vec![n],
                    &out,
                );
                case.model.graph.as_mut().unwrap().output[0] =
                    value_info("y", DataType::Int64, &dims(&out));
                let want = reference(&case, &inputs, scratch.path());
                ran += on_targets(
                    &case,
                    &inputs,
                    scratch.path(),
                    &["x86_64-avx512", "x86_64-sse4", "aarch64-neon"],
                    false,
                    |target, got| {
                        assert_eq!(
                            got.to_f64().unwrap(),
                            want.to_f64().unwrap(),
                            "{op} {name} select_last_index {last} on {target}"
                        );
                    },
                );
            }
        }
    }
    if ran == 0 {
        eprintln!("skip: this CPU runs none of the targets");
    }
}

/// Sin, Cos and Tan on f32 compute inline (vmath's Cephes `sinf` / `cosf`, tan as their
/// quotient) for `|x| <= 8192`, and take libm's for the lanes of a value or vector with a
/// larger magnitude: within 4 ulp of the reference's f64 values (or, near a zero of the
/// result, 2^-44 |x|, times 1 + tan^2 for tan) on every target, exact math or not, over octant bounds, multiples of pi/2, 8191-8193, 1e5, 1e30, `f32::MAX` and
/// random magnitudes from 1e-6 to 1e4; zeros keep their sign in sin and tan, infinities
/// and NaN give NaN.
#[test]
fn sin_cos_tan_inline() {
    let scratch = tempfile::tempdir().unwrap();
    let len = 93usize;
    let pi = std::f32::consts::PI;
    let specials = [
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-30,
        -1e-6,
        pi / 4.0,
        pi / 2.0,
        -pi,
        3.0 * pi / 4.0,
        1.5 * pi,
        2.0 * pi,
        100.0 * pi,
        8191.0,
        -8192.0,
        8193.0,
        1e5,
        -1e30,
        f32::MAX,
        f32::from_bits(std::f32::consts::FRAC_PI_4.to_bits() - 1),
        2.356_194_5,
    ];
    let x: Vec<f32> = (0..len)
        .map(|i| match specials.get(i) {
            Some(&s) => s,
            // Magnitudes from 1e-6 to 1e4, both signs.
            None => {
                let r = rand(1, 150 + i as u64)[0];
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * 10f32.powf(10.0 * (r + 0.5).clamp(0.0, 1.0) - 6.0)
            }
        })
        .collect();
    // Also: past 8192 without infinities, NaN or f32::MAX (whose magnitude alone trips
    // the AVX-512 loop's guard), the rest random.
    let big = [8193.0f32, -2e4, 1e5, -1e6, 12_345.678, 54_321.5, 3e7];
    let x2: Vec<f32> = (0..len)
        .map(|i| {
            big.get(i / 9)
                .copied()
                .filter(|_| i % 9 == 4)
                .unwrap_or(x[specials.len() + i % 50])
        })
        .collect();
    // And only magnitudes the inline code takes (the AVX-512 loop's own results: either
    // input above has it run again in 128-bit code).
    let x3: Vec<f32> = x
        .iter()
        .map(|&v| if v.abs() <= 8192.0 { v } else { 0.5 })
        .collect();
    let mut ran = 0;
    let cases = ["Sin", "Cos", "Tan"]
        .into_iter()
        .flat_map(|op| [(op, &x), (op, &x2), (op, &x3)]);
    for (k, (op, x)) in cases.into_iter().enumerate() {
        let inputs = vec![Tensor::from_vec(&[len], x.clone())];
        let case = graph(
            format!("{op}_inline_{k}"),
            &[("x", vec![len])],
            vec![],
            vec![node(op, &["x"], &["y"])],
            &[len],
        );
        let want = reference(&case, &inputs, scratch.path()).to_f64().unwrap();
        let targets = ["x86_64-avx512", "x86_64-sse4", "aarch64-neon"];
        for exact in [true, false] {
            ran += on_targets(
                &case,
                &inputs,
                scratch.path(),
                &targets,
                exact,
                |target, got| {
                    let what = format!("{op} on {target} (exact {exact})");
                    let got = got.to_f64().unwrap();
                    for (i, &xi) in x.iter().enumerate() {
                        let (g, w) = (got[i] as f32, want[i] as f32);
                        // 4 ulp, or near a zero of the result the inline reduction's
                        // absolute error (its last product's rounding, about 2^-48 |x|);
                        // past 8192, libm's.
                        let near = if xi.abs() <= 8192.0 {
                            // tan = sin / cos: the cosine's error times 1 + tan^2.
                            let pole = if op == "Tan" { 1.0 + w * w } else { 1.0 };
                            2f32.powi(-44) * xi.abs().max(1.0) * pole
                        } else {
                            0.0
                        };
                        let tol = 4.0 * f32::EPSILON * w.abs() + near;
                        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= tol;
                        assert!(ok, "{what}: x = {xi:?} gives {g:?}, the reference {w:?}");
                        if xi == 0.0 && op != "Cos" {
                            assert_eq!(g.to_bits(), xi.to_bits(), "{what}: x = {xi:?} gives {g:?}");
                        }
                    }
                },
            );
        }
    }
    if ran == 0 {
        eprintln!("skip: this CPU runs none of the targets");
    }
}

/// Atan on f32 computes inline (vmath's Cephes `atanf`, the same operations in the
/// AVX-512 loops), not by a libm call per element: within 2 ulp of the reference's f64
/// values on every target, exact math or not, across its three ranges and their bounds,
/// with `atan(+-inf) = +-pi/2`, signed zeros kept and NaN; Sign's comparisons turn into
/// 1.0 or 0.0 in vector code: bit for bit the reference's (NaN stays NaN, zeros keep
/// their sign).
#[test]
fn atan_and_sign_inline() {
    let scratch = tempfile::tempdir().unwrap();
    let len = 77usize;
    let specials = [
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1.0,
        -1.0,
        0.414_213_57,
        0.414_213_6,
        2.414_213_6,
        -2.414_213_4,
        1e-40,
        -1e-30,
        f32::MAX,
        -f32::MAX,
        1e20,
    ];
    let x: Vec<f32> = (0..len)
        .map(|i| match specials.get(i) {
            Some(&s) => s,
            // Magnitudes from 1e-6 to 1e6, both signs.
            None => {
                let r = rand(1, 50 + i as u64)[0];
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * 10f32.powf(12.0 * (r + 0.5).clamp(0.0, 1.0) - 6.0)
            }
        })
        .collect();
    let inputs = vec![Tensor::from_vec(&[len], x.clone())];
    let mut ran = 0;
    for (op, ulps) in [("Atan", 2.0), ("Sign", 0.0)] {
        let case = graph(
            format!("{op}_inline"),
            &[("x", vec![len])],
            vec![],
            vec![node(op, &["x"], &["y"])],
            &[len],
        );
        ran += within_ulps_on_targets(&case, &inputs, scratch.path(), &x, (ulps, true));
    }
    if ran == 0 {
        eprintln!("skip: this CPU runs none of the targets");
    }
}

/// Linear Resize of both last axes with the columns upsampled by an integer factor runs
/// as one f32 kernel (`bilinear`: each output row's two input rows, a unit-stride loop
/// per column phase, edge columns one by one): within 1e-6 of the reference's f64 sums
/// on every x86 target under the half-pixel, pytorch half-pixel and asymmetric modes, a
/// 1.5x row factor and 3x and 4x column factors; align_corners and downsampling (taps
/// not periodic) keep the general path. The 2x one is an AVX-512 loop.
#[test]
fn bilinear_resize_by_integer_column_factors() {
    let scratch = tempfile::tempdir().unwrap();
    let xs = vec![2usize, 3, 5, 40];
    let ctm = |v: &str| vec![str_attr("coordinate_transformation_mode", v)];
    let cases = [
        ("default_2x", [2.0f32, 2.0], vec![], true),
        ("pytorch_2x", [2.0, 2.0], ctm("pytorch_half_pixel"), true),
        ("asymmetric_2x", [2.0, 2.0], ctm("asymmetric"), true),
        ("rows_1_5x_cols_3x", [1.5, 3.0], vec![], true),
        ("cols_4x", [2.0, 4.0], vec![], true),
        ("align_corners_2x", [2.0, 2.0], ctm("align_corners"), false),
        ("down_half", [0.5, 0.5], vec![], false),
    ];
    for (ci, (name, [sh, sw], attrs, fast)) in cases.into_iter().enumerate() {
        let case = resize_case(&format!("linear_{name}"), "linear", &xs, [sh, sw], attrs);
        let inputs = inputs_of(&case, 900 + ci);
        let want = reference(&case, &inputs, scratch.path());
        let targets: &[&str] = if name == "default_2x" {
            &["host", "x86_64-avx512", "x86_64-avx2", "x86_64-sse4"]
        } else {
            &["host", "x86_64-sse4"]
        };
        for target in targets {
            let Some(env) = env_for(target, scratch.path()) else {
                continue;
            };
            let dir = scratch.path().join(format!("{name}_{target}"));
            let (obj, got) = compile_run(&env, target, &case, &inputs, &dir, false);
            let has = |s: &[u8]| obj.windows(s.len()).any(|w| w == s);
            assert_eq!(has(b"bilinear"), fast, "{name}: bilinear kernel");
            if *target == "x86_64-avx512" {
                assert!(has(b"model__wide0"), "{name}: no AVX-512 loop");
            }
            let err = rel_err(&got, &want);
            assert!(err <= 1e-6, "{name} on {target}: relative error {err:e}");
        }
    }
}

/// The AVX-512 loops fold a reduction's 16 lanes in registers (a tree, the lower lane
/// the accumulator) where the caller folded them lane by lane after the call: on rows
/// holding NaNs, infinities and zeros of both signs (as the max, row 0, and the min,
/// row 1), Softmax and LogSoftmax (a NaN-skipping max, then a sum) and ReduceSum stay
/// within 1e-6 (sums 1e-4) of the reference, and f32 ReduceMax and ReduceMin (in f32: a
/// NaN-skipping select and a NaN flag) give its values, NaN where it is NaN, on AVX-512
/// and the 128-bit code.
#[test]
fn reductions_fold_lanes_in_registers() {
    let scratch = tempfile::tempdir().unwrap();
    let (rows, len) = (6usize, 53usize);
    let x: Vec<f32> = (0..rows * len)
        .map(|i| {
            let v = rand(1, i as u64)[0];
            match (i / len, i % len) {
                // Equal zeros as the min (row 0) and the max (row 1).
                (0, 5) | (1, 30) => 0.0,
                (0, 40) | (1, 10) => -0.0,
                (0, _) => v.abs(),
                (1, _) => -v.abs(),
                (2, 17) => f32::NAN,
                (3, 50) => f32::INFINITY,
                (4, 3) => f32::NEG_INFINITY,
                (5, _) => v * 80.0,
                _ => v,
            }
        })
        .collect();
    let inputs = vec![Tensor::from_vec(&[rows, len], x)];
    let mut ran = 0;
    for op in [
        "Softmax",
        "LogSoftmax",
        "ReduceSum",
        "ReduceMax",
        "ReduceMin",
    ] {
        // (Reductions: opset 21, the axes an input.)
        let (ins, shape): (&[&str], _) = if op.starts_with("Reduce") {
            (&["x", "axes"], vec![rows, 1])
        } else {
            (&["x"], vec![rows, len])
        };
        let mut case = graph(
            format!("fold_{op}"),
            &[("x", vec![rows, len])],
            vec![],
            vec![node(op, ins, &["y"])],
            &shape,
        );
        case.model
            .graph
            .as_mut()
            .unwrap()
            .initializer
            .push(onnxc::onnx::proto::TensorProto {
                name: Some("axes".into()),
                dims: vec![1],
                data_type: Some(DataType::Int64 as i32),
                int64_data: vec![-1],
                ..Default::default()
            });
        let want = reference(&case, &inputs, scratch.path()).to_f64().unwrap();
        ran += on_targets(
            &case,
            &inputs,
            scratch.path(),
            &["x86_64-avx512", "x86_64-sse4"],
            true,
            |target, got| {
                for (a, b) in got.to_f64().unwrap().iter().zip(want.iter()) {
                    // (Sums of up to 53 values below 80 in f32: within 1e-4; max and min:
                    // the reference's values, a zero of either sign where equal zeros are
                    // the extreme: the lanes see the elements in another order.)
                    let tol = match op {
                        "ReduceSum" => 1e-4,
                        "ReduceMax" | "ReduceMin" => 0.0,
                        _ => 1e-6 * b.abs().max(1.0),
                    };
                    let ok = (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= tol;
                    assert!(ok, "{op} on {target}: {a} vs the reference's {b}");
                }
            },
        );
    }
    if ran == 0 {
        eprintln!("skip: this CPU runs neither x86 target");
    }
}

/// BatchNormalization in inference with constant statistics (one not folded into a
/// conv: its input is the graph's) runs as `(x - mean) * a + bias` in f32, `a = scale /
/// sqrt(var + eps)` folded at compile time: within 4e-7 of the largest output of the
/// reference (which computes in f64), on every target, exact math and not; and a
/// per-channel factor, not one for all (channels with scales and variances far apart).
#[test]
fn batch_norm_with_constant_statistics() {
    let scratch = tempfile::tempdir().unwrap();
    let c = 24;
    let pos = |seed: u64, lo: f32| -> Vec<f32> {
        rand(c, seed)
            .iter()
            .enumerate()
            .map(|(i, v)| lo + v.abs() * (1 + i % 5) as f32)
            .collect()
    };
    let n = node("BatchNormalization", &["x", "s", "b", "m", "v"], &["y"]);
    let case = graph(
        "batchnorm_const".into(),
        &[("x", vec![2, c, 9, 13])],
        vec![
            ("s", vec![c], Some(pos(71, -2.0))),
            ("b", vec![c], None),
            ("m", vec![c], None),
            ("v", vec![c], Some(pos(73, 0.01))),
        ],
        vec![n],
        &[2, c, 9, 13],
    );
    let inputs = inputs_of(&case, 5);
    let want = reference(&case, &inputs, scratch.path()).to_f64().unwrap();
    let top = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let ran = on_every_target(&case, &inputs, scratch.path(), |target, exact, got| {
        let got = got.to_f64().unwrap();
        let err = got
            .iter()
            .zip(want.iter())
            .map(|(g, w)| (g - w).abs())
            .fold(0.0, f64::max);
        assert!(
            err <= 4e-7 * top,
            "BatchNormalization on {target} (exact {exact}): error {err:e} of {top}"
        );
    });
    assert!(ran > 0, "this CPU runs none of the targets");
}
