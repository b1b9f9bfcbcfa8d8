"""Compile time of nested ``If`` models: depth d nests d Ifs, each in the then-branch of the
one above, on a run-time condition. Prints one row per depth: InferenceSession.prepareDevice
wall time, and how many times the innermost branch's Mul was lowered (traced).

    python bench/nested_if.py --max-depth 16 [--timeout 120]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

import popart
from popart.engine import lower

LOWERED = {"Mul": 0}


def _counting(real):
    def lower_node(node, *args, **kwargs):
        if node.op_type in LOWERED:
            LOWERED[node.op_type] += 1
        return real(node, *args, **kwargs)
    return lower_node


lower.lower_node = _counting(lower.lower_node)


def nested_if_model(depth: int) -> onnx.ModelProto:
    """``y = x*x`` through ``depth`` nested Ifs on input ``c`` (else branches: ``-x``)."""
    def branch(nodes: list, out: str, name: str) -> onnx.GraphProto:
        return helper.make_graph(nodes, name, [], [onnx.ValueInfoProto(name=out)])

    inner = branch([helper.make_node("Mul", ["x", "x"], ["t0"])], "t0", "then0")
    for d in range(1, depth + 1):
        els = branch([helper.make_node("Neg", ["x"], [f"e{d}"])], f"e{d}", f"else{d}")
        node = helper.make_node("If", ["c"], [f"t{d}"], then_branch=inner, else_branch=els)
        inner = branch([node], f"t{d}", f"then{d}")
    g = helper.make_graph(list(inner.node), "nested_if",
                          [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info(f"t{depth}", TensorProto.FLOAT, [4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 16)], ir_version=10)


def compile_seconds(depth: int) -> float:
    """Wall time of InferenceSession(...).prepareDevice() for the depth-``depth`` model."""
    model = nested_if_model(depth)
    out = model.graph.output[0].name
    session = popart.InferenceSession(model.SerializeToString(), popart.DataFlow(1, [out]),
                                      popart.DeviceManager().createCpuDevice())
    t0 = time.perf_counter()
    session.prepareDevice()
    seconds = time.perf_counter() - t0
    anchors = session.initAnchorArrays()
    x = np.arange(4, dtype=np.float32)
    session.run(popart.PyStepIO({"c": np.array(True), "x": x}, anchors))
    np.testing.assert_allclose(anchors[out], x * x)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-depth", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="stop at the first depth whose compile takes longer than this")
    args = ap.parse_args()
    print("| depth | prepareDevice (s) | innermost Mul lowered |\n|---|---|---|")
    for depth in range(1, args.max_depth + 1):
        LOWERED["Mul"] = 0
        s = compile_seconds(depth)
        print(f"| {depth} | {s:.3f} | {LOWERED['Mul']} |", flush=True)
        if s > args.timeout:
            print(f"(stopped: depth {depth} took over {args.timeout:.0f} s)")
            break


if __name__ == "__main__":
    main()
