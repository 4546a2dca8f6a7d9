#!/usr/bin/env python3
"""Writes OUT_DIR/NAME.onnx: single-op models (one node on random f32 data, weights
random with a fixed seed) for comparing onnxc and ONNX Runtime op by op
(tests/bench/ops.sh): the ops outside the zoo where a compiler most often falls back
to slow generic code.

    python3 tests/bench/make_ops.py OUT_DIR
"""
import sys

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

rng = np.random.default_rng(0)
S = [1, 64, 56, 56]


def w(shape, name, scale=0.05):
    return nh.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def save(out, name, nodes, ins, outs, inits=(), opset=17, out_type=T.FLOAT):
    g = h.make_graph(
        nodes, name,
        [h.make_tensor_value_info(i[0], i[2] if len(i) > 2 else T.FLOAT, i[1]) for i in ins],
        [h.make_tensor_value_info(o[0], o[2] if len(o) > 2 else out_type, o[1]) for o in outs],
        list(inits),
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.save(m, f"{out}/{name}.onnx")


def main(out):
    c = lambda v, n: nh.from_array(np.array(v, np.float32), n)
    save(out, "convtranspose_2x2_s2", [h.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2])],
         [("x", [1, 64, 28, 28])], [("y", [1, 32, 56, 56])], [w((64, 32, 2, 2), "w")])
    save(out, "convtranspose_unet", [h.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2, 2])],
         [("x", [1, 256, 32, 32])], [("y", [1, 128, 64, 64])], [w((256, 128, 2, 2), "w"), w((128,), "b", 1)])
    save(out, "convtranspose_4x4_s2", [h.make_node("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2, 2], pads=[1, 1, 1, 1])],
         [("x", [1, 128, 32, 32])], [("y", [1, 64, 64, 64])], [w((128, 64, 4, 4), "w"), w((64,), "b", 1)])
    save(out, "reducemean_last", [h.make_node("ReduceMean", ["x"], ["y"], axes=[-1])],
         [("x", [1, 128, 768])], [("y", [1, 128, 1])])
    save(out, "reducemax_last", [h.make_node("ReduceMax", ["x"], ["y"], axes=[-1])],
         [("x", [1, 128, 768])], [("y", [1, 128, 1])])
    save(out, "logsoftmax", [h.make_node("LogSoftmax", ["x"], ["y"], axis=-1)],
         [("x", [128, 1000])], [("y", [128, 1000])])
    save(out, "instancenorm", [h.make_node("InstanceNormalization", ["x", "s", "b"], ["y"])],
         [("x", S)], [("y", S)], [w((64,), "s", 1), w((64,), "b", 1)])
    save(out, "groupnorm", [h.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=8)],
         [("x", S)], [("y", S)], [w((64,), "s", 1), w((64,), "b", 1)], opset=21)
    save(out, "pow_2", [h.make_node("Pow", ["x", "e"], ["y"])], [("x", S)], [("y", S)], [c(2.0, "e")])
    save(out, "softplus", [h.make_node("Softplus", ["x"], ["y"])], [("x", S)], [("y", S)])
    save(out, "mish", [h.make_node("Mish", ["x"], ["y"])], [("x", S)], [("y", S)], opset=18)
    save(out, "log_abs", [h.make_node("Abs", ["x"], ["a"]), h.make_node("Log", ["a"], ["y"])],
         [("x", S)], [("y", S)])
    save(out, "pow_3", [h.make_node("Pow", ["x", "e"], ["y"])], [("x", S)], [("y", S)], [c(3.0, "e")])
    save(out, "pow_05", [h.make_node("Pow", ["x", "e"], ["y"])], [("x", S)], [("y", S)], [c(0.5, "e")])
    save(out, "max_scalar", [h.make_node("Max", ["x", "m"], ["y"])], [("x", S)], [("y", S)], [c(0.5, "m")])
    save(out, "softmax_last", [h.make_node("Softmax", ["x"], ["y"], axis=-1)],
         [("x", [1, 12, 128, 128])], [("y", [1, 12, 128, 128])])
    save(out, "resize_nearest_2x", [h.make_node("Resize", ["x", "", "sc"], ["y"], mode="nearest")],
         [("x", S)], [("y", [1, 64, 112, 112])], [c([1, 1, 2, 2], "sc")])
    save(out, "resize_linear_2x", [h.make_node("Resize", ["x", "", "sc"], ["y"], mode="linear")],
         [("x", S)], [("y", [1, 64, 112, 112])], [c([1, 1, 2, 2], "sc")])
    save(out, "conv5x5", [h.make_node("Conv", ["x", "w"], ["y"], pads=[2, 2, 2, 2])],
         [("x", [1, 32, 56, 56])], [("y", [1, 64, 56, 56])], [w((64, 32, 5, 5), "w")])
    save(out, "conv3x3_dilated", [h.make_node("Conv", ["x", "w"], ["y"], pads=[2, 2, 2, 2], dilations=[2, 2])],
         [("x", S)], [("y", S)], [w((64, 64, 3, 3), "w")])
    save(out, "conv3x3_8_groups", [h.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], group=8)],
         [("x", S)], [("y", S)], [w((64, 8, 3, 3), "w")])
    # ShuffleNet-style grouped pointwise conv.
    save(out, "conv1x1_3_groups", [h.make_node("Conv", ["x", "w"], ["y"], group=3)],
         [("x", [1, 240, 28, 28])], [("y", [1, 240, 28, 28])], [w((240, 80, 1, 1), "w")])

    for op in ["Sin", "Cos", "Tan", "Atan", "Sign"]:
        save(out, op.lower(), [h.make_node(op, ["x"], ["y"])], [("x", S)], [("y", S)])
    save(out, "argmax_channels", [h.make_node("ArgMax", ["x"], ["y"], axis=1, keepdims=0)],
         [("x", S)], [("y", [1, 56, 56])], out_type=T.INT64)
    save(out, "argmax_last", [h.make_node("ArgMax", ["x"], ["y"], axis=-1, keepdims=0)],
         [("x", [128, 1000])], [("y", [128])], out_type=T.INT64)
    save(out, "globalmaxpool_7x7", [h.make_node("GlobalMaxPool", ["x"], ["y"])],
         [("x", [1, 512, 7, 7])], [("y", [1, 512, 1, 1])])
    save(out, "reducelogsumexp_last", [h.make_node("ReduceLogSumExp", ["x"], ["y"], axes=[-1])],
         [("x", [128, 1000])], [("y", [128, 1])])
    # A BatchNormalization no conv folds (DenseNet's, after a Concat).
    save(out, "batchnorm", [h.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])],
         [("x", S)], [("y", S)],
         [nh.from_array((rng.random(64) + 0.5).astype(np.float32), n) for n in "sbmv"])
    # A reflect pad of one (before a 3x3 conv in style-transfer and super-resolution nets).
    save(out, "pad_reflect", [h.make_node("Pad", ["x", "p"], ["y"], mode="reflect")],
         [("x", S)], [("y", [1, 64, 58, 58])],
         [nh.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], dtype=np.int64), "p")])
    # Top-5 of 1000 classes (per row of a batch of 128).
    save(out, "topk_1000", [h.make_node("TopK", ["x", "k"], ["y", "i"])],
         [("x", [128, 1000])], [("y", [128, 5]), ("i", [128, 5], T.INT64)],
         [nh.from_array(np.array([5], dtype=np.int64), "k")])
    # f16 at a model's edges (a half-precision input or output cast) and inside it.
    save(out, "cast_to_f16", [h.make_node("Cast", ["x"], ["y"], to=T.FLOAT16)],
         [("x", S)], [("y", S)], out_type=T.FLOAT16)
    save(out, "cast_from_f16", [h.make_node("Cast", ["x"], ["y"], to=T.FLOAT)],
         [("x", S, T.FLOAT16)], [("y", S)])
    save(out, "mul_f16", [h.make_node("Mul", ["a", "b"], ["y"])],
         [("a", S, T.FLOAT16), ("b", S, T.FLOAT16)], [("y", S)], out_type=T.FLOAT16)
    # 8-bit quantized convs and products (static: QLinear*, dynamic: *Integer), with
    # per-channel weight scales, int8 weights and uint8 activations.
    i8 = lambda shape, n: nh.from_array(rng.integers(-127, 128, shape).astype(np.int8), n)
    u8 = lambda v, n: nh.from_array(np.array(v, np.uint8), n)
    scales = lambda m, n: nh.from_array((rng.random(m) * 0.01 + 0.001).astype(np.float32), n)
    qc = [c(0.02, "xs"), u8(128, "xz"), i8((64, 64, 3, 3), "w"), scales(64, "ws"),
          nh.from_array(np.zeros(64, np.int8), "wz"), c(0.05, "ys"), u8(128, "yz"),
          nh.from_array(rng.integers(-5000, 5000, 64).astype(np.int32), "b")]
    save(out, "qlinear_conv", [h.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
                                           ["y"], pads=[1, 1, 1, 1])],
         [("x", S, T.UINT8)], [("y", S, T.UINT8)], qc)
    save(out, "conv_integer", [h.make_node("ConvInteger", ["x", "w", "xz"], ["y"], pads=[1, 1, 1, 1])],
         [("x", S, T.UINT8)], [("y", S, T.INT32)], [i8((64, 64, 3, 3), "w"), u8(128, "xz")])
    qm = [c(0.02, "as"), u8(128, "az"), i8((768, 768), "b"), scales(768, "bs"),
          nh.from_array(np.zeros(768, np.int8), "bz"), c(0.05, "ys"), u8(128, "yz")]
    save(out, "qlinear_matmul", [h.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])],
         [("a", [128, 768], T.UINT8)], [("y", [128, 768], T.UINT8)], qm)
    save(out, "matmul_integer", [h.make_node("MatMulInteger", ["a", "b", "az"], ["y"])],
         [("a", [128, 768], T.UINT8)], [("y", [128, 768], T.INT32)], [i8((768, 768), "b"), u8(128, "az")])
    # QDQ models' activations: QuantizeLinear and DequantizeLinear on every tensor.
    save(out, "quantize_linear", [h.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])],
         [("x", S)], [("y", S, T.UINT8)], [c(0.02, "s"), u8(128, "z")], opset=13)
    save(out, "dequantize_linear", [h.make_node("DequantizeLinear", ["x", "s", "z"], ["y"])],
         [("x", S, T.UINT8)], [("y", S)], [c(0.02, "s"), u8(128, "z")], opset=13)
    save(out, "cast_from_u8", [h.make_node("Cast", ["x"], ["y"], to=T.FLOAT)],
         [("x", S, T.UINT8)], [("y", S)])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
