//! f32 MatMul, Gemm and Conv through `Stmt::Gemm`, compiled for each native target
//! (AVX-512 and AVX2 microkernels, the SSE4 and aarch64 loop expansions; aarch64 under
//! qemu), at awkward sizes, against the reference evaluator: max|out - ref| / max|ref|
//! within 1e-4.

mod common;

use common::{f32_tensor, int_attr, ints_attr, model, node, value_info};
use onnxc::conformance::CompiledEnv;
use onnxc::ir::{DType, Tensor, Value};
use onnxc::onnx::proto::{tensor_proto::DataType, AttributeProto, GraphProto, ModelProto};
use onnxc::{eval, onnx};

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

fn float_attr(name: &str, v: f32) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(1),
        f: Some(v),
        ..Default::default()
    }
}

/// One test model: its graph inputs (name, shape) and constant weights.
struct Case {
    name: String,
    model: ModelProto,
    inputs: Vec<Vec<usize>>,
}

fn dims(s: &[usize]) -> Vec<i64> {
    s.iter().map(|&d| d as i64).collect()
}

/// `y = op(inputs...)`: `ins` are (name, shape, constant?) in the node's input order.
fn one_node(
    name: &str,
    op: &str,
    ins: &[(&str, &[usize], bool)],
    out: &[usize],
    attrs: Vec<AttributeProto>,
    post: &[&str],
) -> Case {
    let mut n = node(op, &ins.iter().map(|x| x.0).collect::<Vec<_>>(), &["y0"]);
    n.attribute = attrs;
    let mut nodes = vec![n];
    let mut inits = Vec::new();
    let mut inputs = Vec::new();
    let mut graph_ins = Vec::new();
    for (i, (nm, sh, konst)) in ins.iter().enumerate() {
        if *konst {
            let len = sh.iter().product();
            inits.push(f32_tensor(nm, &dims(sh), &rand(len, 100 + i as u64)));
        } else {
            graph_ins.push(value_info(nm, DataType::Float, &dims(sh)));
            inputs.push(sh.to_vec());
        }
    }
    // Elementwise steps after the anchor (fusable into its epilogue).
    let mut last = "y0".to_string();
    for (i, p) in post.iter().enumerate() {
        let o = format!("y{}", i + 1);
        let mut nd = match *p {
            "bias_row" | "bias_col" => {
                let (bn, bs) = if *p == "bias_row" {
                    ("br", vec![out[out.len() - 1]])
                } else {
                    ("bc", vec![out[out.len() - 2], 1])
                };
                inits.push(f32_tensor(bn, &dims(&bs), &rand(bs.iter().product(), 7)));
                node("Add", &[&last, bn], &[&o])
            }
            // A 1x1 conv with a bias, as many channels out as in (a MobileNetV2
            // block's projection after its depthwise conv).
            "conv1x1" => {
                let c = out[1];
                inits.push(f32_tensor("pw", &dims(&[c, c, 1, 1]), &rand(c * c, 11)));
                inits.push(f32_tensor("pwb", &dims(&[c]), &rand(c, 12)));
                node("Conv", &[&last, "pw", "pwb"], &[&o])
            }
            // A residual the model reads as an input (not folded into a constant bias).
            "residual_input" => {
                graph_ins.push(value_info("res", DataType::Float, &dims(out)));
                inputs.push(out.to_vec());
                node("Add", &[&last, "res"], &[&o])
            }
            // A residual: a tensor of the output's shape (a ResNet block's skip).
            "residual" => {
                inits.push(f32_tensor(
                    "res",
                    &dims(out),
                    &rand(out.iter().product(), 9),
                ));
                node("Add", &[&last, "res"], &[&o])
            }
            // SiLU as exported before opset 24: Sigmoid, then Mul with its input.
            "Silu" => {
                let s = format!("s{}", i + 1);
                nodes.push(node("Sigmoid", &[&last], &[&s]));
                node("Mul", &[&s, &last], &[&o])
            }
            op => node(op, &[&last], &[&o]),
        };
        if *p == "LeakyRelu" {
            nd.attribute = vec![float_attr("alpha", 0.1)];
        }
        // A 2x2 max pool of stride 2 (the last step: `out` is then the pooled shape).
        if *p == "MaxPool" {
            nd.attribute = vec![
                ints_attr("kernel_shape", &[2, 2]),
                ints_attr("strides", &[2, 2]),
            ];
        }
        nodes.push(nd);
        last = o;
    }
    let g = GraphProto {
        name: Some(name.into()),
        node: nodes,
        input: graph_ins,
        output: vec![value_info(&last, DataType::Float, &dims(out))],
        initializer: inits,
        ..Default::default()
    };
    Case {
        name: name.into(),
        model: model(g),
        inputs,
    }
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    // MatMul, B constant (prepacked) and B an input, at awkward sizes.
    let sizes = [
        (1, 1, 1),
        (3, 1, 17),
        (17, 31, 33),
        (31, 65, 100),
        (33, 129, 65),
        (100, 17, 129),
        (65, 3, 1),
        (129, 100, 31),
        (13, 600, 40),
        // Two k blocks and two column blocks: the microkernel fetches the next B block
        // ahead, across the column blocks too.
        (40, 600, 1000),
        // Up to four rows: one column block, k blocks of up to 1024 (two and three of
        // them here), no B prefetch, column edges masked.
        (1, 1031, 70),
        (2, 37, 97),
        (4, 2050, 48),
    ];
    for &(m, k, n) in &sizes {
        for konst in [true, false] {
            v.push(one_node(
                &format!(
                    "matmul_{m}x{k}x{n}_{}",
                    if konst { "const" } else { "input" }
                ),
                "MatMul",
                &[("a", &[m, k], false), ("b", &[k, n], konst)],
                &[m, n],
                vec![],
                &[],
            ));
        }
    }
    // A constant, B an input.
    v.push(one_node(
        "matmul_const_a",
        "MatMul",
        &[("a", &[33, 17], true), ("b", &[17, 31], false)],
        &[33, 31],
        vec![],
        &[],
    ));
    // Batched and broadcast batch dims, 1-D operands.
    v.push(one_node(
        "matmul_batched_fold",
        "MatMul",
        &[("a", &[2, 3, 17, 31], false), ("b", &[31, 33], true)],
        &[2, 3, 17, 33],
        vec![],
        &[],
    ));
    v.push(one_node(
        "matmul_batched_both",
        "MatMul",
        &[("a", &[2, 17, 31], false), ("b", &[2, 31, 33], false)],
        &[2, 17, 33],
        vec![],
        &[],
    ));
    v.push(one_node(
        "matmul_broadcast_a",
        "MatMul",
        &[("a", &[17, 31], false), ("b", &[3, 31, 33], false)],
        &[3, 17, 33],
        vec![],
        &[],
    ));
    v.push(one_node(
        "matmul_broadcast_b_const",
        "MatMul",
        &[("a", &[3, 1, 5, 9], false), ("b", &[2, 9, 20], true)],
        &[3, 2, 5, 20],
        vec![],
        &[],
    ));
    v.push(one_node(
        "matmul_vec_a",
        "MatMul",
        &[("a", &[31], false), ("b", &[31, 33], true)],
        &[33],
        vec![],
        &[],
    ));
    v.push(one_node(
        "matmul_vec_b",
        "MatMul",
        &[("a", &[5, 31], false), ("b", &[31], false)],
        &[5],
        vec![],
        &[],
    ));
    // Epilogues (fused by the passes where they can be).
    for post in [
        &["bias_row", "Relu"][..],
        &["bias_col", "LeakyRelu"],
        &["Relu", "bias_row"],
        &["Sigmoid"],
        &["bias_row", "Silu"],
        &["Silu"],
    ] {
        v.push(one_node(
            &format!("matmul_ep_{}", post.join("_")),
            "MatMul",
            &[("a", &[2, 17, 65], false), ("b", &[65, 33], true)],
            &[2, 17, 33],
            vec![],
            post,
        ));
    }
    // Gemm: transA / transB, alpha, bias C of each broadcast shape.
    for (ta, tb, alpha, cshape, konst) in [
        (0, 0, 1.0, vec![33], true),
        (1, 0, 1.0, vec![17, 1], true),
        (0, 1, 0.5, vec![17, 33], true),
        (1, 1, 2.0, vec![], false),
        (0, 1, 1.0, vec![1], false),
        (0, 0, 0.25, vec![33], false),
    ] {
        let (m, k, n) = (17, 65, 33);
        let ash = if ta == 1 { [k, m] } else { [m, k] };
        let bsh = if tb == 1 { [n, k] } else { [k, n] };
        let mut ins: Vec<(&str, &[usize], bool)> = vec![("a", &ash, false), ("b", &bsh, konst)];
        if !cshape.is_empty() {
            ins.push(("c", &cshape, true));
        }
        v.push(one_node(
            &format!("gemm_t{ta}{tb}_a{alpha}_c{cshape:?}_{konst}"),
            "Gemm",
            &ins,
            &[m, n],
            vec![
                int_attr("transA", ta),
                int_attr("transB", tb),
                float_attr("alpha", alpha),
            ],
            &["Relu"],
        ));
    }
    // Conv: 1x1 (direct), KxK through im2col (pads, strides, dilations), 1-D; with bias.
    // Also: output-row blocks with a tail and panels padded (3x3 on 64 channels), one
    // row spanning many panels (long 1-D), 1x1 stride 2 (a ResNet downsample), 1x1 with
    // rows not whole vectors apart and many output channels (copied into panels); deep
    // kernels on small planes, with pixels as the GEMM's rows (channels in the lanes; the
    // im2col as an A operand in row panels), batch 2 and stride 2; small planes through
    // zero-padded planes (conv_padded), dilated and with uneven pads.
    // 3x3 stride-1 convs through Winograd F(2x2, 3x3): odd output sizes (tiles that
    // lose a column or a row), uneven pads, and enough channels for a loop of blocks of
    // tile rows and a tail block ending in a tile row of one output row.
    let convs: [ConvCase; 25] = [
        (
            "wino3x3_odd",
            vec![2, 6, 17, 13],
            vec![24, 6, 3, 3],
            vec![ints_attr("pads", &[1, 1, 1, 1])],
            vec![2, 24, 17, 13],
        ),
        (
            "wino3x3_uneven_pads",
            vec![1, 8, 20, 18],
            vec![16, 8, 3, 3],
            vec![ints_attr("pads", &[0, 1, 2, 1])],
            vec![1, 16, 20, 18],
        ),
        (
            "wino3x3_blocks",
            vec![1, 64, 31, 27],
            vec![72, 64, 3, 3],
            vec![ints_attr("pads", &[1, 1, 1, 1])],
            vec![1, 72, 31, 27],
        ),
        (
            "conv1x1",
            vec![2, 17, 9, 11],
            vec![33, 17, 1, 1],
            vec![],
            vec![2, 33, 9, 11],
        ),
        (
            "conv3x3_pad",
            vec![1, 5, 13, 7],
            vec![20, 5, 3, 3],
            vec![ints_attr("pads", &[1, 1, 1, 1])],
            vec![1, 20, 13, 7],
        ),
        (
            "conv3x3_stride2_dil",
            vec![2, 3, 17, 16],
            vec![7, 3, 3, 3],
            vec![
                ints_attr("pads", &[2, 1, 0, 2]),
                ints_attr("strides", &[2, 2]),
                ints_attr("dilations", &[2, 1]),
            ],
            vec![2, 7, 9, 9],
        ),
        (
            "conv5x5",
            vec![1, 4, 12, 12],
            vec![35, 4, 5, 5],
            vec![],
            vec![1, 35, 8, 8],
        ),
        (
            "conv1d",
            vec![3, 6, 40],
            vec![9, 6, 3],
            vec![],
            vec![3, 9, 38],
        ),
        (
            "conv3x3_blocks",
            vec![2, 64, 29, 23],
            vec![13, 64, 3, 3],
            vec![
                ints_attr("pads", &[1, 1, 1, 1]),
                ints_attr("strides", &[1, 2]),
            ],
            vec![2, 13, 29, 12],
        ),
        (
            "conv1d_long",
            vec![1, 3, 300],
            vec![4, 3, 5],
            vec![ints_attr("pads", &[2, 2])],
            vec![1, 4, 300],
        ),
        (
            "conv1x1_copied",
            vec![2, 8, 7, 9],
            vec![50, 8, 1, 1],
            vec![],
            vec![2, 50, 7, 9],
        ),
        (
            "conv1x1_stride2",
            vec![1, 8, 15, 15],
            vec![16, 8, 1, 1],
            vec![ints_attr("strides", &[2, 2])],
            vec![1, 16, 8, 8],
        ),
        (
            "conv3x3_deep_small",
            vec![2, 128, 7, 5],
            vec![48, 128, 3, 3],
            vec![ints_attr("pads", &[1, 1, 1, 1])],
            vec![2, 48, 7, 5],
        ),
        (
            "conv3x3_small_plane",
            vec![2, 12, 8, 14],
            vec![24, 12, 3, 3],
            vec![ints_attr("pads", &[1, 1, 1, 1])],
            vec![2, 24, 8, 14],
        ),
        (
            "conv3x2_small_plane_dil",
            vec![1, 10, 15, 16],
            vec![17, 10, 3, 2],
            vec![
                ints_attr("pads", &[2, 1, 2, 0]),
                ints_attr("dilations", &[2, 1]),
            ],
            vec![1, 17, 15, 16],
        ),
        (
            // Weights past 1 MiB: the panel copy of X in larger blocks.
            "conv1x1_big_weights",
            vec![1, 300, 15, 17],
            vec![900, 300, 1, 1],
            vec![],
            vec![1, 900, 15, 17],
        ),
        (
            // A 7x7 pointwise conv: channels in the lanes (49 pixels would fill 49 of
            // 64), X transposed into row panels.
            "conv1x1_channels_in_lanes",
            vec![2, 160, 7, 7],
            vec![96, 160, 1, 1],
            vec![],
            vec![2, 96, 7, 7],
        ),
        (
            // Channels in the lanes on 20 and 36 pixels: X's panels of 12 pixels with a
            // partial last panel, and whole panels only.
            "conv1x1_lanes_20px",
            vec![1, 128, 4, 5],
            vec![48, 128, 1, 1],
            vec![],
            vec![1, 48, 4, 5],
        ),
        (
            "conv1x1_lanes_36px",
            vec![1, 128, 6, 6],
            vec![48, 128, 1, 1],
            vec![],
            vec![1, 48, 6, 6],
        ),
        (
            // Squeeze-excitation's expanding 1x1 conv on one pixel: channels in the
            // lanes at a shallow depth, the output copied out without a pixel loop.
            "conv1x1_one_pixel",
            vec![2, 48, 1, 1],
            vec![1152, 48, 1, 1],
            vec![],
            vec![2, 1152, 1, 1],
        ),
        // Few input channels on a large plane (an image model's stem): directly, taps
        // from zero-bordered phase planes, blocks of 8, 2 and 1 output channels, with
        // stride 2, asymmetric padding and dilation.
        (
            "stem3x3_stride2",
            vec![1, 3, 130, 130],
            vec![16, 3, 3, 3],
            vec![
                ints_attr("pads", &[1, 1, 1, 1]),
                ints_attr("strides", &[2, 2]),
            ],
            vec![1, 16, 65, 65],
        ),
        (
            "stem3x3_one_channel_pads",
            vec![1, 1, 64, 70],
            vec![5, 1, 3, 3],
            vec![ints_attr("pads", &[2, 0, 0, 1])],
            vec![1, 5, 64, 69],
        ),
        (
            // An MNIST-sized first conv: one channel, 784 output pixels.
            "stem3x3_mnist",
            vec![1, 1, 28, 28],
            vec![16, 1, 3, 3],
            vec![ints_attr("pads", &[1, 1, 1, 1])],
            vec![1, 16, 28, 28],
        ),
        (
            "stem3x3_dilated",
            vec![1, 2, 66, 66],
            vec![6, 2, 3, 3],
            vec![
                ints_attr("pads", &[2, 2, 2, 2]),
                ints_attr("dilations", &[2, 2]),
            ],
            vec![1, 6, 66, 66],
        ),
        (
            "conv3x3_deep_stride2",
            vec![1, 120, 9, 9],
            vec![40, 120, 3, 3],
            vec![
                ints_attr("pads", &[1, 1, 1, 1]),
                ints_attr("strides", &[2, 2]),
            ],
            vec![1, 40, 5, 5],
        ),
    ];
    // Winograd with a ResNet block's epilogue: bias, a residual read at every other
    // column, Relu.
    v.push(one_node(
        "wino3x3_residual",
        "Conv",
        &[
            ("x", &[1, 48, 29, 31], false),
            ("w", &[64, 48, 3, 3], true),
            ("bias", &[64], true),
        ],
        &[1, 64, 29, 31],
        vec![ints_attr("pads", &[1, 1, 1, 1])],
        &["residual", "Relu"],
    ));
    // Grouped convs with enough channels per group run one conv per group between a
    // Split and a Concat (`split_grouped_conv`): 3x3 in 4 groups with bias and Relu
    // (Winograd per group), 1x1 stride 2 in 2 groups of two images (GEMM per group).
    v.push(one_node(
        "conv3x3_4_groups",
        "Conv",
        &[
            ("x", &[1, 16, 12, 12], false),
            ("w", &[32, 4, 3, 3], true),
            ("bias", &[32], true),
        ],
        &[1, 32, 12, 12],
        vec![ints_attr("pads", &[1, 1, 1, 1]), int_attr("group", 4)],
        &["Relu"],
    ));
    v.push(one_node(
        "conv1x1_2_groups_stride2",
        "Conv",
        &[("x", &[2, 8, 9, 9], false), ("w", &[16, 4, 1, 1], true)],
        &[2, 16, 5, 5],
        vec![ints_attr("strides", &[2, 2]), int_attr("group", 2)],
        &[],
    ));
    // Dilated 3x3 convs run undilated over the input's phase planes (stacked in the
    // batch, `split_dilated_conv`): dilation 2 with "same" pads and Relu on 32x32; two
    // images with dilations (2, 3) and uneven pads (multiples of each).
    v.push(dilated_case());
    v.push(one_node(
        "wino_dilated_2x3_two_images",
        "Conv",
        &[("x", &[2, 8, 16, 24], false), ("w", &[8, 8, 3, 3], true)],
        &[2, 8, 14, 21],
        vec![
            ints_attr("pads", &[0, 3, 2, 0]),
            ints_attr("dilations", &[2, 3]),
        ],
        &[],
    ));
    v.push(wino5_case());
    v.extend(pooled_cases().into_iter().map(|(c, _)| c));
    // Winograd F(2x2, 5x5) with "same" pads on an odd plane (the last tile row and
    // column one wide), two images, no bias; and uneven pads (output 18 x 17).
    v.push(one_node(
        "wino5x5_odd_two_images",
        "Conv",
        &[("x", &[2, 6, 19, 15], false), ("w", &[16, 6, 5, 5], true)],
        &[2, 16, 19, 15],
        vec![ints_attr("pads", &[2, 2, 2, 2])],
        &[],
    ));
    v.push(one_node(
        "wino5x5_uneven_pads",
        "Conv",
        &[
            ("x", &[1, 8, 20, 18], false),
            ("w", &[12, 8, 5, 5], true),
            ("bias", &[12], true),
        ],
        &[1, 12, 18, 17],
        vec![ints_attr("pads", &[0, 1, 2, 2])],
        &["Relu"],
    ));
    // Winograd F(4x4, 3x3) (planes of at least 32 4x4 tiles): a residual block's
    // epilogue on a plane whose last tile row has 3 output rows and last tile column 3
    // columns; two images, no bias and uneven pads with a last tile of 2 rows and 1
    // column.
    v.push(one_node(
        "wino4_residual",
        "Conv",
        &[
            ("x", &[1, 112, 27, 27], false),
            ("w", &[112, 112, 3, 3], true),
            ("bias", &[112], true),
        ],
        &[1, 112, 27, 27],
        vec![ints_attr("pads", &[1, 1, 1, 1])],
        &["residual", "Relu"],
    ));
    // A residual after a bias the call's init takes (the call's add view): Gemm with
    // its C, and a 1x1 conv copied into panels in blocks of output rows (rows of 100
    // pixels, 48 output channels), its add view shifted with each block.
    v.push(one_node(
        "gemm_c_residual",
        "Gemm",
        &[
            ("a", &[37, 50], false),
            ("b", &[50, 45], true),
            ("c", &[45], true),
        ],
        &[37, 45],
        vec![],
        &["residual_input", "Relu"],
    ));
    v.push(one_node(
        "conv1x1_panels_residual",
        "Conv",
        &[
            ("x", &[1, 16, 10, 10], false),
            ("w", &[48, 16, 1, 1], true),
            ("bias", &[48], true),
        ],
        &[1, 48, 10, 10],
        vec![],
        &["residual"],
    ));
    v.push(one_node(
        "wino4_uneven_pads",
        "Conv",
        &[("x", &[2, 40, 30, 30], false), ("w", &[48, 40, 3, 3], true)],
        &[2, 48, 30, 29],
        vec![ints_attr("pads", &[0, 1, 2, 0])],
        &["Relu"],
    ));
    // Depthwise convs (3x3 unless noted), each with a bias and an activation:
    // - planes wide enough that the phase planes' rows are padded to whole vectors and
    //   every copied row starts on one: stride 2 with all four phases copied by one loop
    //   (equal runs), asymmetric pads that give the column phases runs of 35 and 34
    //   (separate loops), a stride-1 5x5;
    // - channels in the lanes (`dw_lanes`, 7x7 planes): the planes transposed in and out
    //   through 16x16 register tiles, whole and masked, stored straight from the
    //   registers; a 14x14 plane, now with pixels in the lanes.
    // (name, N C H W, kernel, pads t l b r, stride, activation)
    type Dw = (&'static str, [usize; 4], usize, [i64; 4], i64, &'static str);
    let dws: [Dw; 7] = [
        ("dw3x3_s2_wide", [1, 5, 21, 70], 3, [1, 1, 1, 1], 2, "Relu"),
        (
            "dw3x3_s2_wide_uneven",
            [1, 3, 9, 69],
            3,
            [1, 0, 0, 1],
            2,
            "Silu",
        ),
        ("dw5x5_wide", [1, 2, 7, 45], 5, [2, 2, 2, 2], 1, "Relu"),
        ("dw3x3_lanes", [1, 32, 7, 7], 3, [1, 1, 1, 1], 1, "Relu"),
        ("dw3x3_lanes_s2", [1, 48, 7, 7], 3, [1, 1, 1, 1], 2, "Silu"),
        ("dw3x3_flat_14", [1, 32, 14, 14], 3, [1, 1, 1, 1], 1, "Relu"),
        // Stride 2 onto 7x7: channels in the lanes, from a 15x15 padded plane.
        (
            "dw3x3_lanes_s2_14",
            [1, 32, 14, 14],
            3,
            [1, 1, 1, 1],
            2,
            "Relu",
        ),
    ];
    for (name, xs, k, pads, stride, act) in dws {
        let c = xs[1];
        let out = |i: usize, pb: i64, pe: i64| {
            (i as i64 + pb + pe - k as i64) as usize / stride as usize + 1
        };
        let ys = [
            1,
            c,
            out(xs[2], pads[0], pads[2]),
            out(xs[3], pads[1], pads[3]),
        ];
        v.push(one_node(
            name,
            "Conv",
            &[
                ("x", &xs, false),
                ("w", &[c, 1, k, k], true),
                ("bias", &[c], true),
            ],
            &ys,
            vec![
                ints_attr("pads", &pads),
                ints_attr("strides", &[stride, stride]),
                int_attr("group", c as i64),
            ],
            &[act],
        ));
    }
    for (name, xs, ws, attrs, ys) in convs {
        for bias in [true, false] {
            let bs = [ws[0]];
            let mut ins: Vec<(&str, &[usize], bool)> = vec![("x", &xs, false), ("w", &ws, true)];
            if bias {
                ins.push(("bias", &bs, true));
            }
            v.push(one_node(
                &format!("{name}_{}", if bias { "bias" } else { "nobias" }),
                "Conv",
                &ins,
                &ys,
                attrs.clone(),
                if bias { &["Relu"] } else { &["Silu"] },
            ));
        }
    }
    // ConvTranspose (2-D, one group: a GEMM, then each kernel tap's columns added into
    // the output): 2x2 stride-2 upsampling (no overlap), overlapping 3x3 and 4x4 taps at
    // strides 2 and 3, pads, dilations, output_padding, SAME_UPPER, two images, with and
    // without a bias.
    let transposed: Vec<ConvCase> = vec![
        (
            "convT_2x2_s2",
            vec![1, 24, 9, 10],
            vec![24, 16, 2, 2],
            vec![ints_attr("strides", &[2, 2])],
            vec![1, 16, 18, 20],
        ),
        (
            "convT_3x3_s2_pads",
            vec![2, 8, 7, 9],
            vec![8, 5, 3, 3],
            vec![
                ints_attr("strides", &[2, 2]),
                ints_attr("pads", &[1, 0, 0, 2]),
            ],
            vec![2, 5, 14, 17],
        ),
        (
            "convT_4x4_s3_dil_outpad",
            vec![1, 6, 5, 6],
            vec![6, 7, 4, 3],
            vec![
                ints_attr("strides", &[3, 2]),
                ints_attr("dilations", &[1, 2]),
                ints_attr("output_padding", &[2, 1]),
                ints_attr("pads", &[2, 1, 1, 3]),
            ],
            vec![1, 7, 15, 12],
        ),
        (
            "convT_same_upper",
            vec![1, 4, 6, 5],
            vec![4, 3, 3, 3],
            vec![
                ints_attr("strides", &[2, 2]),
                AttributeProto {
                    name: Some("auto_pad".into()),
                    r#type: Some(3),
                    s: Some(b"SAME_UPPER".to_vec()),
                    ..Default::default()
                },
            ],
            vec![1, 3, 12, 10],
        ),
    ];
    for (name, xs, ws, attrs, ys) in transposed {
        for bias in [true, false] {
            let bs = [ws[1]];
            let mut ins: Vec<(&str, &[usize], bool)> = vec![("x", &xs, false), ("w", &ws, true)];
            if bias {
                ins.push(("bias", &bs, true));
            }
            v.push(one_node(
                &format!("{name}_{}", if bias { "bias" } else { "nobias" }),
                "ConvTranspose",
                &ins,
                &ys,
                attrs.clone(),
                &[],
            ));
        }
    }
    v
}

/// Name, X shape, W shape, attributes, Y shape.
type ConvCase = (
    &'static str,
    Vec<usize>,
    Vec<usize>,
    Vec<AttributeProto>,
    Vec<usize>,
);

/// max|got - want| / max|want|.
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

fn check_target(target: &str) {
    check(target, cases(), &[1]);
}

/// Products big enough that the microkernel call is split into tasks for the
/// `parallel_for` hook: by columns (wide N), by rows (tall M, narrow N), with both
/// operands inputs, with a fused epilogue, as a convolution (five blocks of output rows:
/// four in slots that threads take whole, one split), and with an uneven N.
fn split_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (m, k, n, konst) in [
        (256, 256, 256, true),
        (600, 128, 24, true),
        (200, 300, 150, false),
        (96, 160, 1000, true),
    ] {
        v.push(one_node(
            &format!("split_matmul_{m}x{k}x{n}_{konst}"),
            "MatMul",
            &[("a", &[m, k], false), ("b", &[k, n], konst)],
            &[m, n],
            vec![],
            &[],
        ));
    }
    v.push(one_node(
        "split_gemm_bias_relu",
        "Gemm",
        &[
            ("a", &[128, 256], false),
            ("b", &[256, 200], true),
            ("c", &[200], true),
        ],
        &[128, 200],
        vec![],
        &["Relu"],
    ));
    // 3x2, not 3x3: a 3x3 stride-1 conv goes through Winograd, not im2col blocks.
    v.push(one_node(
        "split_conv3x2",
        "Conv",
        &[
            ("x", &[1, 16, 40, 40], false),
            ("w", &[64, 16, 3, 2], true),
            ("bias", &[64], true),
        ],
        &[1, 64, 40, 40],
        vec![ints_attr("pads", &[1, 1, 1, 0])],
        &["Relu"],
    ));
    // Zero-padded planes (conv_padded) cut into runs of panels, each a parallel task
    // (4 panels: runs of one), on a plane of too few tiles for Winograd.
    v.push(one_node(
        "split_conv3x3_small_plane",
        "Conv",
        &[
            ("x", &[1, 16, 8, 14], false),
            ("w", &[32, 16, 3, 3], true),
            ("bias", &[32], true),
        ],
        &[1, 32, 8, 14],
        vec![ints_attr("pads", &[1, 1, 1, 1])],
        &["Relu"],
    ));
    // Winograd F(4x4): blocks in two parts, each a parallel task.
    v.push(one_node(
        "split_wino4",
        "Conv",
        &[
            ("x", &[1, 96, 32, 32], false),
            ("w", &[96, 96, 3, 3], true),
            ("bias", &[96], true),
        ],
        &[1, 96, 32, 32],
        vec![ints_attr("pads", &[1, 1, 1, 1])],
        &["Relu"],
    ));
    // Winograd F(2x2) pooling 2x2 blocks (see [`pooled_cases`]) on 7 tile rows with 4
    // times as many output channels as input: on threads the parts split the channels.
    v.push(one_node(
        "split_wino_pool_channels",
        "Conv",
        &[
            ("x", &[1, 16, 14, 14], false),
            ("w", &[64, 16, 3, 3], true),
            ("bias", &[64], true),
        ],
        &[1, 64, 7, 7],
        vec![ints_attr("pads", &[1, 1, 1, 1])],
        &["Relu", "MaxPool"],
    ));
    // Winograd: blocks in two parts, each a parallel task.
    v.push(one_node(
        "split_wino3x3",
        "Conv",
        &[
            ("x", &[1, 32, 40, 40], false),
            ("w", &[64, 32, 3, 3], true),
            ("bias", &[64], true),
        ],
        &[1, 64, 40, 40],
        vec![ints_attr("pads", &[1, 1, 1, 1])],
        &["Relu"],
    ));
    // im2col in two blocks of output rows (7 and 6), one parallel part each, on a plane
    // too wide for padded planes (SqueezeNet's 13x13 3x3 convs ran as 11 rows and 2;
    // now they run through Winograd: dilated here to stay in im2col).
    v.push(one_node(
        "split_conv3x3_im2col_parts",
        "Conv",
        &[
            ("x", &[1, 16, 13, 13], false),
            ("w", &[32, 16, 3, 3], true),
            ("bias", &[32], true),
        ],
        &[1, 32, 13, 13],
        vec![
            ints_attr("pads", &[2, 2, 2, 2]),
            ints_attr("dilations", &[2, 2]),
        ],
        &["Relu"],
    ));
    // Depthwise convs in parts of consecutive channel blocks, the last part shorter
    // (skipping what it lacks): 144 channels in lanes on 7x7 (9 blocks of 16: 4 parts of
    // 2 and one of 1), and 9 channels on 64x64 planes in phase planes (parts of 2
    // groups).
    v.push(one_node(
        "split_dw_lanes_parts",
        "Conv",
        &[
            ("x", &[1, 144, 7, 7], false),
            ("w", &[144, 1, 3, 3], true),
            ("bias", &[144], true),
        ],
        &[1, 144, 7, 7],
        vec![ints_attr("pads", &[1, 1, 1, 1]), int_attr("group", 144)],
        &["Relu"],
    ));
    v.push(one_node(
        "split_dw_flat_parts",
        "Conv",
        &[
            ("x", &[1, 9, 64, 64], false),
            ("w", &[9, 1, 3, 3], true),
            ("bias", &[9], true),
        ],
        &[1, 9, 64, 64],
        vec![ints_attr("pads", &[1, 1, 1, 1]), int_attr("group", 9)],
        &["Relu"],
    ));
    // Depthwise convs in bands of output rows, every channel in each (`Bands`: four
    // bands, each reading at least 1568 pixels of a plane): stride 1 (the first band's
    // top padding row and the last's bottom one zeroed per channel), and stride 2 5x5
    // with uneven pads (phases whose bands start at different rows).
    v.push(one_node(
        "split_dw_bands",
        "Conv",
        &[
            ("x", &[1, 3, 56, 128], false),
            ("w", &[3, 1, 3, 3], true),
            ("bias", &[3], true),
        ],
        &[1, 3, 56, 128],
        vec![ints_attr("pads", &[1, 1, 1, 1]), int_attr("group", 3)],
        &["Relu"],
    ));
    v.push(one_node(
        "split_dw_bands_s2",
        "Conv",
        &[
            ("x", &[1, 5, 64, 120], false),
            ("w", &[5, 1, 5, 5], true),
            ("bias", &[5], true),
        ],
        &[1, 5, 32, 60],
        vec![
            ints_attr("pads", &[2, 1, 1, 2]),
            ints_attr("strides", &[2, 2]),
            int_attr("group", 5),
        ],
        &["Silu"],
    ));
    // A global average pool, each plane's partial sums in their own scratch row (the
    // planes a parallel loop; 97 chunks after the first: 24 groups and one more).
    v.push(one_node(
        "split_gap_planes",
        "GlobalAveragePool",
        &[("x", &[1, 96, 56, 56], false)],
        &[1, 96, 1, 1],
        vec![],
        &[],
    ));
    // Winograd F(4x4) on 14 tile rows, the last of 3 output rows (SqueezeNet's 55x55
    // layers): two halves of 7 tile rows, each a block of 4 and one of 3, the second's
    // ending in the short tile row.
    v.push(one_node(
        "split_wino3x3_tail",
        "Conv",
        &[
            ("x", &[1, 16, 55, 55], false),
            ("w", &[64, 16, 3, 3], true),
            ("bias", &[64], true),
        ],
        &[1, 64, 55, 55],
        vec![ints_attr("pads", &[1, 1, 1, 1])],
        &["Relu"],
    ));
    // Winograd F(2x2) on 7 tile rows, the last of one output row, and 64 = 4 x 16
    // channels (SqueezeNet's 13x13 layers): on threads the two parts split the output
    // channels (each half's GEMMs, output transform and stores), on one thread the tile
    // rows (4 and 3), each matrix's GEMM in two halves of 32 channels either way.
    v.push(one_node(
        "split_wino3x3_channels",
        "Conv",
        &[
            ("x", &[1, 16, 13, 13], false),
            ("w", &[64, 16, 3, 3], true),
            ("bias", &[64], true),
        ],
        &[1, 64, 13, 13],
        vec![ints_attr("pads", &[1, 1, 1, 1])],
        &["Relu"],
    ));
    // Winograd F(4x4) on rows too wide for two in one block (113 tiles a row): each
    // half of 4 tile rows a loop of one-row blocks.
    v.push(one_node(
        "split_wino4_row_blocks",
        "Conv",
        &[
            ("x", &[1, 40, 16, 452], false),
            ("w", &[40, 40, 3, 3], true),
            ("bias", &[40], true),
        ],
        &[1, 40, 16, 452],
        vec![ints_attr("pads", &[1, 1, 1, 1])],
        &["Relu"],
    ));
    // Winograd F(2x2, 5x5) on 14 tile rows, the last of one output row: two halves of
    // 7, each a parallel task.
    v.push(one_node(
        "split_wino5x5_tail",
        "Conv",
        &[
            ("x", &[1, 16, 27, 27], false),
            ("w", &[32, 16, 5, 5], true),
            ("bias", &[32], true),
        ],
        &[1, 32, 27, 27],
        vec![ints_attr("pads", &[2, 2, 2, 2])],
        &["Relu"],
    ));
    // A max pool separable over whole planes: parts of consecutive planes, each in its
    // own scratch slot, the last part short (99 planes).
    v.push(one_node(
        "split_maxpool_planes",
        "MaxPool",
        &[("x", &[1, 99, 27, 27], false)],
        &[1, 99, 13, 13],
        vec![
            ints_attr("kernel_shape", &[3, 3]),
            ints_attr("strides", &[2, 2]),
        ],
        &[],
    ));
    // A padded max pool done separably per plane (ResNet's 3x3 stride-2 pool): parts of
    // consecutive planes, each with its own scratch rows, the last part short.
    v.push(one_node(
        "split_maxpool_sep",
        "MaxPool",
        &[("x", &[1, 67, 30, 30], false)],
        &[1, 67, 15, 15],
        vec![
            ints_attr("kernel_shape", &[3, 3]),
            ints_attr("strides", &[2, 2]),
            ints_attr("pads", &[1, 1, 1, 1]),
        ],
        &[],
    ));
    // A stem conv on few channels: its parts of output rows (four of 20) are the loop
    // the threads share, each copying its own band of the phase planes (see
    // `stem_parts_copy_their_own_bands`).
    v.push(one_node(
        "split_stem3x3_stride2",
        "Conv",
        &[
            ("x", &[1, 3, 160, 160], false),
            ("w", &[24, 3, 3, 3], true),
            ("bias", &[24], true),
        ],
        &[1, 24, 80, 80],
        vec![
            ints_attr("pads", &[1, 1, 1, 1]),
            ints_attr("strides", &[2, 2]),
        ],
        &["Silu"],
    ));
    v.push(one_node(
        "split_conv1x1_silu",
        "Conv",
        &[
            ("x", &[1, 48, 30, 30], false),
            ("w", &[64, 48, 1, 1], true),
            ("bias", &[64], true),
        ],
        &[1, 64, 30, 30],
        vec![],
        &["Silu"],
    ));
    // Residuals read by the microkernel (the call's add view, beside the bias its init
    // takes): a 1x1 conv on X in place (900 columns: a masked edge in every part), then
    // Relu as in a ResNet block; a MatMul with a bias row, as in a transformer block.
    v.push(one_node(
        "split_conv1x1_residual_relu",
        "Conv",
        &[
            ("x", &[1, 144, 30, 30], false),
            ("w", &[32, 144, 1, 1], true),
            ("bias", &[32], true),
        ],
        &[1, 32, 30, 30],
        vec![],
        &["residual", "Relu"],
    ));
    // An odd count of column panels, each in two halves of rows (tasks by panel and
    // half): five whole panels on 49 rows (MobileNetV2's 7x7 projections) with a bias
    // and a residual, and three on 30 rows whose last panel is half empty.
    v.push(one_node(
        "split_matmul_panel_halves",
        "MatMul",
        &[("a", &[49, 576], false), ("b", &[576, 160], true)],
        &[49, 160],
        vec![],
        &["bias_row", "residual"],
    ));
    v.push(one_node(
        "split_matmul_panel_halves_edge",
        "MatMul",
        &[("a", &[30, 256], false), ("b", &[256, 80], true)],
        &[30, 80],
        vec![],
        &["Relu"],
    ));
    v.push(one_node(
        "split_matmul_bias_residual",
        "MatMul",
        &[("a", &[197, 192], false), ("b", &[192, 192], true)],
        &[197, 192],
        vec![],
        &["bias_row", "residual"],
    ));
    v
}

/// Compiles each case for `target`, runs it on a pool of each of `threads` (1 runs the
/// serial entry point), and checks every run against the reference evaluator (1e-4) and
/// every threaded run bit for bit against the serial one.
fn check(target: &str, cases: Vec<Case>, threads: &[usize]) {
    check_tasks(target, cases, threads, b"model__gemm_task")
}

/// [`check`], with threaded runs requiring a function whose name contains `task` in the
/// object (the hook must have been used).
fn check_tasks(target: &str, cases: Vec<Case>, threads: &[usize], task: &[u8]) {
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
    let mut failures = Vec::new();
    for (ci, case) in cases.into_iter().enumerate() {
        let path = common::write_model(scratch.path(), &format!("{}.onnx", case.name), &case.model);
        let m = onnx::load(&path).unwrap();
        let inputs: Vec<Tensor> = case
            .inputs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = s.iter().product();
                Tensor::from_vec(s, rand(n, 1000 + 17 * ci as u64 + i as u64))
            })
            .collect();
        let want = eval::run(
            &m.graph,
            inputs.iter().cloned().map(Value::Tensor).collect(),
        )
        .unwrap();
        // Small as these cases are, their loops go to the threads.
        let mut opts = onnxc::driver::Options {
            target: target.to_string(),
            min_program_work: 0,
            ..Default::default()
        };
        for (&id, t) in m.graph.inputs.iter().zip(&inputs) {
            opts.shapes
                .push((m.graph.value(id).name.clone(), t.shape().to_vec()));
        }
        let c = onnxc::driver::compile_graph(m.graph.clone(), "model", &opts)
            .unwrap_or_else(|e| panic!("{}: compile: {e}", case.name));
        let dir = scratch.path().join(format!("c{ci}"));
        std::fs::create_dir_all(&dir).unwrap();
        let obj = dir.join("model.o");
        let exe = dir.join("model.exe");
        std::fs::write(&obj, &c.artifacts.object).unwrap();
        if threads.len() > 1 && !c.artifacts.object.windows(task.len()).any(|w| w == task) {
            failures.push(format!(
                "{}: no {} function in the object",
                case.name,
                String::from_utf8_lossy(task)
            ));
        }
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
        let want = want[0].clone().into_tensor().unwrap();
        let mut serial: Option<Vec<f32>> = None;
        for &th in threads {
            let got =
                onnxc::runner::execute_threads(&env.toolchain, &exe, &dir, &inputs, &outs, th)
                    .unwrap_or_else(|e| panic!("{} ({th} threads): run: {e}", case.name));
            let err = rel_err(&got[0], &want);
            if err.is_nan() || err > 1e-4 {
                failures.push(format!(
                    "{} ({th} threads): relative error {err:e}",
                    case.name
                ));
            }
            let bits = got[0].to_f64().unwrap().iter().map(|&x| x as f32).collect();
            match &serial {
                None => serial = Some(bits),
                Some(s) if *s != bits => failures.push(format!(
                    "{} ({th} threads): differs from the serial run",
                    case.name
                )),
                Some(_) => {}
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{target}: wrong results:\n{}",
        failures.join("\n")
    );
}

/// The split microkernel calls on a pool of 2 and 3 threads, where the microkernel
/// exists (the task functions must be in the object, or the hook was never used).
fn check_split(target: &str) {
    // The padded-planes conv, the im2col parts, the Winograd convs, the depthwise and
    // stem convs and the pools split by their own loops (their tasks are the kernel's,
    // not a GEMM's).
    let (padded, gemms): (Vec<Case>, Vec<Case>) = split_cases().into_iter().partition(|c| {
        ["split_conv3x3_small_plane", "split_conv3x3_im2col_parts"].contains(&c.name.as_str())
            || c.name.starts_with("split_wino")
            || c.name.starts_with("split_dw")
            || c.name.starts_with("split_stem")
            || c.name == "split_gap_planes"
            || c.name == "split_maxpool_planes"
            || c.name == "split_maxpool_sep"
    });
    check(target, gemms, &[1, 2, 3]);
    check_tasks(target, padded, &[1, 2, 3], b"_task0");
}

#[test]
fn gemm_split_threads_x86_64_avx512() {
    check_split("x86_64-avx512");
}

#[test]
fn gemm_split_threads_x86_64_avx2() {
    check_split("x86_64-avx2");
}

/// Convs with their output channels in the lanes: a 1x1 (384 -> 64 on 14x14, 196
/// pixels) in parts that threads take whole (each part's row panels packed, multiplied
/// and copied out by one task: 8, 8 and 1 panels, the last of 4 pixels), and a 3x3
/// stride-2 conv of 128 -> 256 onto 14x14, whole (its im2col and copy loops beside the
/// split GEMM). (The short panel's copy once reused the full panels' loop variables,
/// and a loop whose variables another loop reuses stays on one thread: the copy ran
/// serially.)
#[test]
fn pointwise_lanes_panels_threads_x86_64_avx512() {
    let strided = one_node(
        "split_conv3x3_s2_lanes",
        "Conv",
        &[
            ("x", &[1, 128, 28, 28], false),
            ("w", &[256, 128, 3, 3], true),
            ("bias", &[256], true),
        ],
        &[1, 256, 14, 14],
        vec![
            ints_attr("pads", &[1, 1, 1, 1]),
            ints_attr("strides", &[2, 2]),
        ],
        &["Relu"],
    );
    let case = one_node(
        "split_conv1x1_lanes",
        "Conv",
        &[
            ("x", &[1, 384, 14, 14], false),
            ("w", &[64, 384, 1, 1], true),
            ("bias", &[64], true),
        ],
        &[1, 64, 14, 14],
        vec![],
        &["Relu"],
    );
    check_tasks(
        "x86_64-avx512",
        vec![case, strided],
        &[1, 2, 3],
        b"Conv_y0_fused_task0",
    );
}

/// A convolution whose blocks of output rows run in slots, one parallel task each, with
/// a GEMM inside every task (Cranelift's f32x4 tiles on aarch64), one through padded
/// planes in runs of panels, on 1-3 threads under qemu, Winograd F(2x2), F(4x4) and
/// F(2x2, 5x5) convs (strided stores, GEMMs and transforms in tasks; one pooling 2x2
/// blocks as it stores, its parts splitting the channels), and depthwise convs in bands
/// of output rows (f32x4 loops): every run against the reference, threaded runs bit for
/// bit against the serial.
#[test]
fn gemm_conv_blocks_threads_aarch64_neon_qemu() {
    let conv: Vec<Case> = split_cases()
        .into_iter()
        .filter(|c| {
            c.name.starts_with("split_conv3x")
                || c.name.starts_with("split_wino")
                || c.name.starts_with("split_dw_bands")
        })
        .collect();
    assert_eq!(conv.len(), 12);
    check_tasks("aarch64-neon", conv, &[1, 2, 3], b"_task0");
}

/// A depthwise conv in bands followed by a 1x1 conv (then a residual): the 1x1 conv's
/// GEMM runs inside each band (`lower::bands`), on two images, checked against the
/// reference at 1-3 threads on AVX-512 and on NEON under qemu, threaded runs bit for bit
/// against the serial one.
#[test]
fn dw_bands_then_pointwise_fused() {
    let case = || {
        one_node(
            "dw_bands_pointwise",
            "Conv",
            &[
                ("x", &[2, 6, 56, 128], false),
                ("w", &[6, 1, 3, 3], true),
                ("bias", &[6], true),
            ],
            &[2, 6, 56, 128],
            vec![ints_attr("pads", &[1, 1, 1, 1]), int_attr("group", 6)],
            &["Relu", "conv1x1", "residual"],
        )
    };
    // The fusion happened: one kernel for both convs, with the GEMM inside its loops.
    let c = compile_case(&case(), onnxc::kir::parallel::MIN_PROGRAM_WORK);
    let kernels = &c.lowered.program.kernels;
    assert_eq!(kernels.len(), 1, "{:?}", c.lowered.kernel_nodes);
    assert!(c.lowered.kernel_nodes[0].contains(" + "));
    let nested = |b: &[onnxc::kir::Stmt]| {
        b.iter()
            .any(|s| matches!(s, onnxc::kir::Stmt::For { .. }) && !s_gemms(s).is_empty())
    };
    assert!(nested(&kernels[0].body));
    check_tasks("x86_64-avx512", vec![case()], &[1, 2, 3], b"_task0");
    check_tasks("aarch64-neon", vec![case()], &[1, 2, 3], b"_task0");
}

/// The stem conv is one parallel loop over its parts of output rows, whose body copies
/// the part's band of the phase planes and computes the part (no copy or zeroing outside
/// it, on the calling thread or in jobs of their own); its results at 1-3 threads are
/// in `check_split`'s table (`split_stem3x3_stride2`).
#[test]
fn stem_parts_copy_their_own_bands() {
    use onnxc::kir::Stmt;
    let case = split_cases()
        .into_iter()
        .find(|c| c.name == "split_stem3x3_stride2")
        .expect("the stem case");
    let c = compile_case(&case, 0);
    let p = &c.lowered.program;
    let k = p
        .kernels
        .iter()
        .find(|k| k.name.contains("Conv"))
        .expect("the conv kernel");
    // for n in 0..1 { for part in 0..4 { copies; rows } }, the part loop parallel.
    let [Stmt::For { body, .. }] = k.body.as_slice() else {
        panic!("one image loop, not {} statements", k.body.len());
    };
    let [Stmt::For {
        var,
        extent: 4,
        body: part,
    }] = body.as_slice()
    else {
        panic!(
            "one loop of four parts in the image loop, not {} statements",
            body.len()
        );
    };
    let par = onnxc::kir::parallel::parallel_loops(k, p, onnxc::kir::parallel::MIN_WORK);
    assert_eq!(par.into_iter().collect::<Vec<_>>(), vec![*var]);
    // Per input channel the band's copies, then the output channels' blocks.
    assert!(matches!(
        part.as_slice(),
        [Stmt::For { extent: 3, .. }, Stmt::For { .. }]
    ));
}

/// `case` compiled for AVX-512 (through a model file, as the CLI reads it), handing out
/// loops in programs of at least `min_program_work` element operations.
fn compile_case(case: &Case, min_program_work: u64) -> onnxc::driver::Compiled {
    let scratch = tempfile::tempdir().unwrap();
    let path = common::write_model(scratch.path(), "m.onnx", &case.model);
    let m = onnx::load(&path).unwrap();
    let opts = onnxc::driver::Options {
        target: "x86_64-avx512".into(),
        min_program_work,
        ..Default::default()
    };
    onnxc::driver::compile_graph(m.graph, "model", &opts).unwrap()
}

/// A 16 -> 16 3x3 conv with dilation 2, "same" pads, bias and Relu on 32x32.
fn dilated_case() -> Case {
    one_node(
        "wino_dilated2_phases",
        "Conv",
        &[
            ("x", &[1, 16, 32, 32], false),
            ("w", &[16, 16, 3, 3], true),
            ("bias", &[16], true),
        ],
        &[1, 16, 32, 32],
        vec![
            ints_attr("pads", &[2, 2, 2, 2]),
            ints_attr("dilations", &[2, 2]),
        ],
        &["Relu"],
    )
}

/// A 96 -> 96 5x5 conv with bias, a residual and Relu on 21x21 ("same" pads): Winograd
/// F(2x2, 5x5) in blocks of tile rows (11 of them, the last one output row high; 3 to a
/// block within the budget), its epilogue in the output transform.
fn wino5_case() -> Case {
    one_node(
        "wino5x5_residual_blocks",
        "Conv",
        &[
            ("x", &[1, 96, 21, 21], false),
            ("w", &[96, 96, 5, 5], true),
            ("bias", &[96], true),
        ],
        &[1, 96, 21, 21],
        vec![ints_attr("pads", &[2, 2, 2, 2])],
        &["residual", "Relu"],
    )
}

/// Convs followed by a 2x2 max pool of stride 2, and whether the conv's kernel pools (its
/// Winograd output transform stores each 2x2 block's largest value), or the pool runs as
/// a kernel of its own: F(2x2) on 14x14 (the zoo's small CNN: bias and Relu), F(4x4) on
/// 32x32 without bias or steps, F(4x4) whose last tile row is 2 output rows high (30x32,
/// two images, LeakyRelu: the pool's windows mix signs), F(2x2, 5x5) with bias; and the
/// convs that cannot pool: F(4x4) with a last tile 2 columns wide (30x30), a 1-channel
/// conv (not Winograd).
fn pooled_cases() -> Vec<(Case, bool)> {
    // "Same" pads: the conv's output is the input's size.
    let case = |name: &str, x: [usize; 4], w: [usize; 2], bias: bool, post: &[&str]| {
        let ([n, c, h, wd], [m, k]) = (x, w);
        let (ws, bs) = ([m, c, k, k], [m]);
        let mut ins: Vec<(&str, &[usize], bool)> = vec![("x", &x, false), ("w", &ws, true)];
        if bias {
            ins.push(("bias", &bs, true));
        }
        let p = (k / 2) as i64;
        let pads = vec![ints_attr("pads", &[p, p, p, p])];
        one_node(name, "Conv", &ins, &[n, m, h / 2, wd / 2], pads, post)
    };
    let relu = ["Relu", "MaxPool"];
    vec![
        (
            case("pool_wino2_relu", [1, 16, 14, 14], [32, 3], true, &relu),
            true,
        ),
        (
            case(
                "pool_wino4_bare",
                [1, 8, 32, 32],
                [16, 3],
                false,
                &["MaxPool"],
            ),
            true,
        ),
        (
            case(
                "pool_wino4_short_rows",
                [2, 8, 30, 32],
                [12, 3],
                true,
                &["LeakyRelu", "MaxPool"],
            ),
            true,
        ),
        (
            case("pool_wino5", [1, 8, 16, 16], [16, 5], true, &relu),
            true,
        ),
        (
            case("pool_wino4_narrow", [1, 8, 30, 30], [16, 3], true, &relu),
            false,
        ),
        (
            case("pool_one_channel", [1, 1, 28, 28], [16, 3], true, &relu),
            false,
        ),
    ]
}

/// A 2x2 max pool after a conv joins the conv's fused node; the Winograd convs of
/// [`pooled_cases`] pool in their output transform (one kernel, no pool loop, the conv's
/// output never stored), the others run the conv with its steps and then the pool (the
/// cases' values are checked on every target by `check_target`).
#[test]
fn max_pools_join_winograd_convs() {
    for (case, pooled) in pooled_cases() {
        let c = compile_case(&case, 0);
        let fused = c
            .graph
            .nodes
            .node_weights()
            .filter(|n| n.op_type == "Fused")
            .count();
        assert_eq!(fused, 1, "{}: one fused node", case.name);
        let kernels = &c.lowered.program.kernels;
        let wino = c
            .lowered
            .program
            .buffers
            .iter()
            .any(|b| b.name.contains("wino_u"));
        assert_eq!(wino, case.name.contains("wino"), "{}: Winograd", case.name);
        assert_eq!(
            kernels.len(),
            if pooled { 1 } else { 2 },
            "{}: {:?}",
            case.name,
            kernels.iter().map(|k| &k.name).collect::<Vec<_>>()
        );
    }
}

/// The 5x5 conv of [`wino5_case`] runs through Winograd F(2x2, 5x5): 36 transformed
/// weight matrices, one GEMM over the 96 input channels for each in every block, and no
/// im2col buffer (the cases above check its values on every target).
#[test]
fn conv5x5_runs_through_winograd() {
    let c = compile_case(&wino5_case(), 0);
    let names: Vec<&str> = c
        .lowered
        .program
        .buffers
        .iter()
        .map(|b| b.name.as_str())
        .collect();
    let u = names.iter().filter(|n| n.contains("wino_u")).count();
    assert_eq!(u, 36, "{names:?}");
    assert!(!names.iter().any(|n| n.contains("im2col")), "{names:?}");
    let gemms: Vec<_> = c
        .lowered
        .program
        .kernels
        .iter()
        .flat_map(|k| k.body.iter().flat_map(s_gemms))
        .collect();
    assert!(
        !gemms.is_empty() && gemms.len() % 36 == 0,
        "{} GEMMs",
        gemms.len()
    );
    assert!(gemms.iter().all(|g| g.k == 96 && g.m == 96));
}

/// The dilated conv of [`dilated_case`] compiles to an undilated one over four phase
/// planes (the cases above check its values on every target).
#[test]
fn dilated_conv_splits_into_phase_planes() {
    let c = compile_case(&dilated_case(), 0);
    let convs: Vec<_> = c
        .graph
        .nodes
        .node_weights()
        .filter(|n| n.op_type.starts_with("Conv"))
        .map(|n| (n.name.clone(), n.attrs.ints("dilations", &[1, 1]).unwrap()))
        .collect();
    assert_eq!(convs.len(), 1, "{convs:?}");
    assert!(convs[0].0.contains("dilation_phases"), "{convs:?}");
    assert_eq!(convs[0].1, vec![1, 1]);
}

/// The GEMMs in `s` and the statements inside it.
fn s_gemms(s: &onnxc::kir::Stmt) -> Vec<&onnxc::kir::GemmCall> {
    use onnxc::kir::Stmt;
    match s {
        Stmt::Gemm(g) => vec![g],
        Stmt::For { body, .. } | Stmt::While { body, .. } => {
            body.iter().flat_map(s_gemms).collect()
        }
        Stmt::If { then, els, .. } => then.iter().chain(els).flat_map(s_gemms).collect(),
        _ => vec![],
    }
}

/// A constant B that the GEMM reads prepacked is in the object once, as its panels: the
/// weights as stored are not emitted beside them (an MLP's object was twice its weights).
#[test]
fn prepacked_weights_once() {
    let case = one_node(
        "matmul_1x256x512_const",
        "MatMul",
        &[("a", &[1, 256], false), ("b", &[256, 512], true)],
        &[1, 512],
        vec![],
        &[],
    );
    let scratch = tempfile::tempdir().unwrap();
    let path = common::write_model(scratch.path(), "m.onnx", &case.model);
    let m = onnx::load(&path).unwrap();
    let weights = 256 * 512 * 4;
    for target in ["x86_64-avx512", "x86_64-avx2", "aarch64-neon"] {
        let opts = onnxc::driver::Options {
            target: target.to_string(),
            ..Default::default()
        };
        let c = onnxc::driver::compile_graph(m.graph.clone(), "model", &opts).unwrap();
        let size = c.artifacts.object.len();
        assert!(
            size > weights && size < weights * 5 / 4,
            "{target}: a {size}-byte object for {weights} bytes of weights"
        );
    }
}

#[test]
fn gemm_host() {
    check_target("host");
}

#[test]
fn gemm_x86_64_avx512() {
    check_target("x86_64-avx512");
}

#[test]
fn gemm_x86_64_avx2() {
    check_target("x86_64-avx2");
}

#[test]
fn gemm_x86_64_sse4() {
    check_target("x86_64-sse4");
}

#[test]
fn gemm_aarch64_neon_qemu() {
    check_target("aarch64-neon");
}

/// `Stmt::Gemm` with every epilogue the call carries (bias views broadcast by rows, by
/// columns or full; a residual add view at an offset into its buffer; Relu, Clip,
/// LeakyRelu, SiLU; alpha; B constant or an input), compiled
/// straight from kernel IR for `target` and checked against a scalar computation.
fn check_calls(target: &str) {
    use onnxc::backend::cranelift::{compile_object, ObjectSpec, TensorDesc};
    use onnxc::kir::{BufKind, Expr, GemmAct, GemmCall, Kernel, MatView, Program, Stmt, Ty};
    let scratch = tempfile::tempdir().unwrap();
    let env = CompiledEnv::new(target, scratch.path()).unwrap();
    let t = onnxc::targets::Target::load(target).unwrap();
    let host = onnxc::targets::Target::host().unwrap();
    if t.is_x86() && !t.features.iter().all(|f| host.has(f)) {
        eprintln!("skip {target}: this CPU lacks its features");
        return;
    }
    let acts = [
        GemmAct::None,
        GemmAct::Relu,
        GemmAct::Clip(-0.3, 0.4),
        GemmAct::Leaky(0.1),
        GemmAct::Silu,
    ];
    let mut failures = Vec::new();
    let mut case = 0u64;
    for (m, n, k) in [(13, 37, 19), (5, 8, 3), (17, 33, 65), (1, 70, 2)] {
        for init_kind in 0..4 {
            case += 1;
            let act = acts[case as usize % acts.len()];
            let alpha = if case.is_multiple_of(3) { 0.5 } else { 1.0 };
            let b_const = case.is_multiple_of(2);
            // A B input in column panels: of the AVX-512 microkernel's width (read in
            // place there) or of 8 (one call per panel everywhere).
            let panel = match (b_const, case % 4) {
                (false, 1) => Some(32usize),
                (false, _) => Some(8),
                _ => None,
            };
            let a = rand(m * k, case);
            let b = rand(k * n, case + 50);
            // B as stored: plain, or `[n / w][k][w]` with NaN in the padding columns
            // (which must not reach the result).
            let b_stored: Vec<f32> = match panel {
                None => b.clone(),
                Some(w) => {
                    let mut v = vec![f32::NAN; n.div_ceil(w) * k * w];
                    for p in 0..k {
                        for j in 0..n {
                            v[(j / w) * k * w + p * w + j % w] = b[p * n + j];
                        }
                    }
                    v
                }
            };
            // init: none, per row (m), per column (n), full (m x n).
            let (ilen, irs, ics) = match init_kind {
                0 => (0, 0, 0),
                1 => (m, 1, 0),
                2 => (n, 0, 1),
                _ => (m * n, n as i64, 1),
            };
            let init = rand(ilen, case + 99);
            // The residual: in two cases of three, 3 elements into its buffer.
            let radd = (!case.is_multiple_of(3)).then(|| rand(m * n + 3, case + 7));
            let mut p = Program::default();
            let ab = p.add_buffer("a", BufKind::Input(0), Ty::F32, (m * k) as u64);
            let bb = if b_const {
                let data = b.iter().flat_map(|x| x.to_le_bytes()).collect();
                p.add_buffer("b", BufKind::Const { data }, Ty::F32, (k * n) as u64)
            } else {
                p.add_buffer("b", BufKind::Input(1), Ty::F32, b_stored.len() as u64)
            };
            let mut ins = vec![(vec![m, k], a.clone())];
            if !b_const {
                ins.push((vec![b_stored.len()], b_stored.clone()));
            }
            let ib = (ilen > 0).then(|| {
                let id = p.add_buffer("init", BufKind::Input(ins.len()), Ty::F32, ilen as u64);
                ins.push((vec![ilen], init.clone()));
                id
            });
            let rb = radd.as_ref().map(|r| {
                let id = p.add_buffer("add", BufKind::Input(ins.len()), Ty::F32, r.len() as u64);
                ins.push((vec![r.len()], r.clone()));
                id
            });
            let cb = p.add_buffer("c", BufKind::Output(0), Ty::F32, (m * n) as u64);
            p.inputs = (0..ins.len()).collect();
            p.outputs = vec![cb];
            let view = |buf, rs, cs| MatView::strided(buf, Expr::Int(0), rs, cs);
            let mut kern = Kernel::new("g");
            kern.body = vec![Stmt::Gemm(Box::new(GemmCall {
                m: m as u64,
                n: n as u64,
                k: k as u64,
                a: view(ab, k as i64, 1),
                b: match panel {
                    None => view(bb, n as i64, 1),
                    Some(w) => MatView {
                        panel: Some((w as u64, (k * w) as i64)),
                        ..view(bb, w as i64, 1)
                    },
                },
                c: view(cb, n as i64, 1),
                alpha,
                init: ib.map(|i| view(i, irs, ics)),
                add: rb.map(|r| MatView::strided(r, Expr::Int(3), n as i64, 1)),
                act,
                int8: false,
            }))];
            p.kernels = vec![kern];
            let desc = |name: &str, shape: Vec<usize>| TensorDesc {
                name: name.into(),
                dtype: 1,
                bytes: 4 * shape.iter().product::<usize>() as u64,
                shape: shape.iter().map(|&d| d as u64).collect(),
            };
            let in_desc: Vec<TensorDesc> = ins
                .iter()
                .enumerate()
                .map(|(i, (s, _))| desc(&format!("in{i}"), s.clone()))
                .collect();
            let out_desc = vec![desc("c", vec![m, n])];
            let obj = compile_object(&ObjectSpec {
                prefix: "model",
                program: &p,
                inputs: &in_desc,
                outputs: &out_desc,
                triple: &t.triple,
                features: &t.features,
                exact_math: false,
                kernel_table: false,
                min_program_work: 0,
            })
            .unwrap();
            // The microkernel is taken where the target has one (AVX-512 or AVX2+FMA)
            // and alpha can go into a packed operand.
            let has = |f: &str| t.features.iter().any(|x| x == f);
            let asm = t.is_x86()
                && (has("avx512f") || (has("avx2") && has("fma")))
                && (alpha == 1.0 || b_const)
                && std::env::var_os("ONNXC_NO_ASM_GEMM").is_none();
            let named = obj.windows(12).any(|w| w == b"model__gemm0");
            if asm != named {
                failures.push(format!(
                    "{m}x{n}x{k} case {case} panel {panel:?}: microkernel expected {asm}, in object {named}"
                ));
            }
            let dir = scratch.path().join(format!("k{case}"));
            std::fs::create_dir_all(&dir).unwrap();
            let (o, exe) = (dir.join("model.o"), dir.join("model.exe"));
            std::fs::write(&o, obj).unwrap();
            onnxc::runner::link(&env.toolchain, &env.harness, &o, &exe).unwrap();
            let tensors: Vec<Tensor> = ins
                .iter()
                .map(|(s, v)| Tensor::from_vec(s, v.clone()))
                .collect();
            let got = onnxc::runner::execute(
                &env.toolchain,
                &exe,
                &dir,
                &tensors,
                &[(DType::F32, vec![m, n])],
            )
            .unwrap();
            let mut want = vec![0f32; m * n];
            for i in 0..m {
                for j in 0..n {
                    let s: f32 = (0..k).map(|q| a[i * k + q] * b[q * n + j]).sum();
                    let mut x = alpha * s;
                    if ilen > 0 {
                        x += init[(i as i64 * irs + j as i64 * ics) as usize];
                    }
                    if let Some(r) = &radd {
                        x += r[3 + i * n + j];
                    }
                    want[i * n + j] = match act {
                        GemmAct::None => x,
                        GemmAct::Relu => x.max(0.0),
                        GemmAct::Clip(lo, hi) => x.max(lo).min(hi),
                        GemmAct::Leaky(al) => {
                            if x < 0.0 {
                                al * x
                            } else {
                                x
                            }
                        }
                        GemmAct::Silu => (x as f64 / (1.0 + (-x as f64).exp())) as f32,
                    };
                }
            }
            let err = rel_err(&got[0], &Tensor::from_vec(&[m, n], want));
            if err.is_nan() || err > 1e-4 {
                failures.push(format!(
                    "{m}x{n}x{k} init {init_kind} add {} {act:?} alpha {alpha} b_const {b_const} panel {panel:?}: {err:e}",
                    radd.is_some()
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{target}: wrong gemm calls:\n{}",
        failures.join("\n")
    );
}

#[test]
fn gemm_calls_x86_64_avx512() {
    check_calls("x86_64-avx512");
}

#[test]
fn gemm_calls_x86_64_avx2() {
    check_calls("x86_64-avx2");
}

#[test]
fn gemm_calls_x86_64_sse4() {
    check_calls("x86_64-sse4");
}

#[test]
fn gemm_calls_aarch64_neon_qemu() {
    check_calls("aarch64-neon");
}
