#!/usr/bin/env python3
"""Writes the ONNX backend node test cases as folders.

Since onnx 1.23 the wheel builds the node cases in Python instead of shipping them as
files. This script builds them with onnx.backend.test.loader.load_model_tests(kind="node")
and writes each as CASE/model.onnx plus CASE/test_data_set_N/{input,output}_K.pb, the
layout (and proto kinds: TensorProto, SequenceProto, OptionalProto) of ONNX's own
`backend-test-tools generate-data`. It also writes OUT/ops.tsv, mapping each case to the
operator it tests, and OUT/COUNT with the number of cases.

With --other OTHER_DIR it also lays out the wheel's other suites (pytorch-converted,
pytorch-operator, simple: copied as they are; light: model plus the dummy input that
ONNX's runner generates, arange(n)/n, and the stored expected output) as
OTHER_DIR/<suite>/<case>/.

usage: gen_node_cases.py OUT_DIR [--other OTHER_DIR]
"""
import os
import re
import shutil
import sys
import warnings

import onnx
from onnx import numpy_helper, TensorProto
from onnx.backend.test.loader import load_model_tests


ALIASES = {"nllloss": "NegativeLogLikelihoodLoss", "sce": "SoftmaxCrossEntropyLoss", "mvn": "MeanVarianceNormalization"}


def snake(name):
    s = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", s).lower()


def proto_for(value, vi):
    t = vi.type
    if t.HasField("sequence_type"):
        return numpy_helper.from_list(value, vi.name)
    if t.HasField("optional_type"):
        return numpy_helper.from_optional(value, vi.name)
    if t.HasField("map_type"):
        return numpy_helper.from_dict(value, vi.name)
    if isinstance(value, TensorProto):
        return value
    return numpy_helper.from_array(value, vi.name)


def main():
    out = sys.argv[1]
    warnings.simplefilter("ignore")
    cases = load_model_tests(kind="node")
    schemas = sorted({s.name for s in onnx.defs.get_all_schemas_with_history()}, key=len, reverse=True)
    snakes = [(snake(n), n) for n in schemas]
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    ops = []
    for case in cases:
        d = os.path.join(out, case.name)
        os.makedirs(d)
        model = case.model
        with open(os.path.join(d, "model.onnx"), "wb") as f:
            f.write(model.SerializeToString())
        graph_inputs = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
        for n, (inputs, outputs) in enumerate(case.data_sets):
            ds = os.path.join(d, f"test_data_set_{n}")
            os.makedirs(ds)
            for j, v in enumerate(inputs):
                with open(os.path.join(ds, f"input_{j}.pb"), "wb") as f:
                    f.write(proto_for(v, graph_inputs[j]).SerializeToString())
            for j, v in enumerate(outputs):
                with open(os.path.join(ds, f"output_{j}.pb"), "wb") as f:
                    f.write(proto_for(v, model.graph.output[j]).SerializeToString())
        base = case.name[len("test_"):]
        for alias, name in ALIASES.items():
            if base == alias or base.startswith(alias + "_"):
                base = snake(name) + base[len(alias):]
        op = next((name for s, name in snakes if base == s or base.startswith(s + "_")), None)
        if op is None:
            op = next((name for s, name in snakes if base.startswith(name.lower() + "_") or base == name.lower()), None)
        if op is None:
            kinds = {nd.op_type for nd in model.graph.node}
            op = kinds.pop() if len(kinds) == 1 else "?"
        ops.append(f"{case.name}\t{op}\n")
    with open(os.path.join(out, "ops.tsv"), "w") as f:
        f.writelines(sorted(ops))
    with open(os.path.join(out, "COUNT"), "w") as f:
        f.write(f"{len(cases)}\n")
    print(f"wrote {len(cases)} node test cases to {out}")
    if "--other" in sys.argv:
        write_other(sys.argv[sys.argv.index("--other") + 1])


def write_other(out):
    import numpy as np

    data = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
    if os.path.exists(out):
        shutil.rmtree(out)
    for suite in ("pytorch-converted", "pytorch-operator", "simple"):
        shutil.copytree(os.path.join(data, suite), os.path.join(out, suite))
    light = os.path.join(data, "light")
    for f in sorted(os.listdir(light)):
        if not f.endswith(".onnx"):
            continue
        name = f[: -len(".onnx")]
        d = os.path.join(out, "light", "test_" + name[len("light_"):])
        ds = os.path.join(d, "test_data_set_0")
        os.makedirs(ds)
        shutil.copy(os.path.join(light, f), os.path.join(d, "model.onnx"))
        model = onnx.load(os.path.join(light, f))
        inits = {i.name for i in model.graph.initializer}
        k = 0
        for x in model.graph.input:
            if x.name in inits:
                continue
            shape = tuple(dd.dim_value if dd.HasField("dim_value") else 1 for dd in x.type.tensor_type.shape.dim)
            n = int(np.prod(shape))
            value = (np.arange(n).reshape(shape) / n).astype(np.float32)
            with open(os.path.join(ds, f"input_{k}.pb"), "wb") as fh:
                fh.write(numpy_helper.from_array(value).SerializeToString())
            k += 1
        shutil.copy(os.path.join(light, name + "_output_0.pb"), os.path.join(ds, "output_0.pb"))
    print(f"wrote the other suites to {out}")


if __name__ == "__main__":
    main()
