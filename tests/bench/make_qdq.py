#!/usr/bin/env python3
"""Writes a QDQ-quantized copy of an f32 model (QuantizeLinear/DequantizeLinear around
its convs and products: per-channel int8 weights, uint8 activations), as
`onnxruntime.quantization.quantize_static` makes it, calibrated on four random inputs:

    python3 tests/bench/make_qdq.py target/zoo/resnet18.onnx target/qdq/resnet18_qdq.onnx
    ./target/release/onnxc bench target/qdq/resnet18_qdq.onnx

With --qoperator, the operator format instead (QLinearConv, QLinearMatMul, QLinearAdd,
... from the com.microsoft domain where ONNX has none), as the ONNX model zoo's int8
models are written:

    python3 tests/bench/make_qdq.py --qoperator target/zoo/resnet18.onnx target/qop/resnet18_qop.onnx

(ONNX Runtime writes QLinearAdd, QLinearGlobalAveragePool and QGemm of its com.microsoft
domain into them; onnxc imports those as bodies of standard ops, compiler/src/onnx/contrib.rs.)
"""
import os
import sys

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process


class RandomInputs(CalibrationDataReader):
    def __init__(self, model):
        rng = np.random.default_rng(0)
        feeds = []
        for _ in range(4):
            feed = {}
            for i in model.graph.input:
                shape = [d.dim_value or 1 for d in i.type.tensor_type.shape.dim]
                feed[i.name] = rng.standard_normal(shape).astype(np.float32)
            feeds.append(feed)
        self.it = iter(feeds)

    def get_next(self):
        return next(self.it, None)


def main(src, dst, fmt=QuantFormat.QDQ):
    os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
    pre = dst + ".pre.onnx"
    quant_pre_process(src, pre, skip_symbolic_shape=True)
    quantize_static(pre, dst, RandomInputs(onnx.load(src)), quant_format=fmt,
                    per_channel=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    os.remove(pre)
    print("wrote", dst)


if __name__ == "__main__":
    args = sys.argv[1:]
    fmt = QuantFormat.QDQ
    if args[:1] == ["--qoperator"]:
        fmt, args = QuantFormat.QOperator, args[1:]
    if len(args) != 2:
        sys.exit(__doc__)
    main(args[0], args[1], fmt)
