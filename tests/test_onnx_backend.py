"""ONNX's node conformance cases through popart.onnx_backend, one test per case.

Cases listed in tests/onnx_node_expected_failures.txt (name | reason) are xfail (non-strict):
every other case must pass, so a regression fails the suite. By default a representative subset
runs: the first case of every distinct (op types, opset, attribute names) combination;
POPART_FULL_CONFORMANCE=1 runs all of them. Regenerate the list with
``PYTHONPATH=src python tools/conformance.py --write-expected tests/onnx_node_expected_failures.txt``.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from popart import onnx_backend
from popart.onnx_backend import check_case, node_cases

FULL = os.environ.get("POPART_FULL_CONFORMANCE") == "1"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _expected_failures() -> dict:
    out = {}
    with open(os.path.join(_HERE, "onnx_node_expected_failures.txt")) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, _, reason = line.partition("|")
                out[name.strip()] = reason.strip()
    return out


EXPECTED = _expected_failures()
CASES = node_cases()


def _selected(cases: list) -> list:
    if FULL:
        return cases
    seen, out = set(), []
    for c in cases:
        nodes = c.model.graph.node
        ops = (frozenset(n.op_type for n in nodes), onnx_backend.case_opset(c),
               frozenset(a.name for n in nodes for a in n.attribute))
        if ops not in seen:
            seen.add(ops)
            out.append(c)
    return out


def _param(c):
    marks = [pytest.mark.xfail(reason=EXPECTED[c.name], strict=False)] if c.name in EXPECTED else []
    return pytest.param(c, id=c.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in _selected(CASES)])
def test_node_case(case):
    check_case(case)


def test_expected_failure_list_is_current():
    names = {c.name for c in CASES}
    stale = sorted(set(EXPECTED) - names)
    assert not stale, f"expected-failure entries that are not onnx node cases: {stale[:10]}"


def test_backend_interface():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    node = onnx.helper.make_node("Relu", ["x"], ["y"])
    model = onnx.helper.make_model(onnx.helper.make_graph([node], "g", [x], [y]),
                                   opset_imports=[onnx.helper.make_opsetid("", 13)])
    assert onnx_backend.supports_device("CPU")
    assert onnx_backend.is_compatible(model)
    a = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    rep = onnx_backend.prepare(model, "CPU")
    np.testing.assert_array_equal(rep.run([a])[0], np.maximum(a, 0))
    np.testing.assert_array_equal(rep.run({"x": -a})[0], np.maximum(-a, 0))
    (out,) = onnx_backend.run_node(node, [a])
    assert out.dtype == np.float32 and out.shape == (2, 3)


def test_backend_specializes_shape_inputs():
    """A shape given as a graph input is specialized on (recompiled per value)."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    s = onnx.helper.make_tensor_value_info("s", onnx.TensorProto.INT64, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Reshape", ["x", "s"], ["y"])], "g", [x, s], [y]),
        opset_imports=[onnx.helper.make_opsetid("", 14)])
    rep = onnx_backend.prepare(model)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert rep.run([a, np.array([3, 2])])[0].shape == (3, 2)
    assert rep.run([a, np.array([-1, 1])])[0].shape == (6, 1)
