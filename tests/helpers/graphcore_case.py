"""What test_builder and test_graphcore_signatures share: a Builder to make every ai.graphcore
table op in, with a sample value for each of the ops' required attributes."""
from __future__ import annotations

from typing import Any

import onnx

import popart
from popart._ir.graphcore_schema import REQUIRED, OpSchema

P = onnx.AttributeProto


def graphcore_op_builder() -> tuple[popart.Builder, str, dict[int, Any]]:
    """(builder, x, samples): a Builder with a FLOAT [2, 2] input ``x`` to give the ops, and a
    value of each attribute type the table's required attributes have (GRAPH: a subgraph of 1
    input and 2 outputs, as a Call given ``x`` makes: PopART checks)."""
    b = popart.Builder()
    x = b.addInputTensor("FLOAT", [2, 2])
    sub = b.createSubgraphBuilder()
    a = sub.addInputTensor("FLOAT", [2, 2])
    sub.addOutputTensor(sub.aiOnnx.identity([a]))
    sub.addOutputTensor(sub.aiOnnx.neg([a]))
    samples = {P.INT: 1, P.FLOAT: 0.5, P.INTS: [1], P.FLOATS: [0.5], P.STRING: "DCR", P.GRAPH: sub}
    return b, x, samples


def required_attrs(schema: OpSchema, samples: dict[int, Any]) -> dict[str, Any]:
    """A sample value for each of ``schema``'s required attributes."""
    return {a.name: samples[a.attr_type] for a in schema.attrs if a.default is REQUIRED}
