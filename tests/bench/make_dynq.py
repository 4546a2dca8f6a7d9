#!/usr/bin/env python3
"""Writes a dynamically quantized copy of an f32 model, as
`onnxruntime.quantization.quantize_dynamic` makes it (int8 weights; each product's input
quantized to uint8 at run time by DynamicQuantizeLinear, then MatMulInteger):

    python3 tests/bench/make_dynq.py target/zoo/bert6_seq128.onnx target/dynq/bert6_dynq.onnx
    ./target/release/onnxc bench target/dynq/bert6_dynq.onnx
"""
import os
import sys

from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.shape_inference import quant_pre_process


def main(src, dst):
    os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
    pre = dst + ".pre.onnx"
    quant_pre_process(src, pre, skip_symbolic_shape=True)
    quantize_dynamic(pre, dst, weight_type=QuantType.QInt8)
    os.remove(pre)
    print("wrote", dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
