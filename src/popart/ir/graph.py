"""The IR: graphs of nodes over named tensors.

Both front-ends build it: ONNX import (``onnx_import.py``, used by the Builder's protos and by
model files) and popxl. The engine lowers it to one XLA program per session.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..tensorinfo import TensorInfo


# PopART's placement annotations on nodes (the Builder's and popxl's attribute names).
VIRTUAL_GRAPH = "__ipu_number"
PIPELINE_STAGE = "__pipeline_stage"


@dataclass
class Node:
    """One op. ``inputs`` may contain "" for an omitted optional input. ``attrs`` hold Python
    values; a graph-valued attribute (If / Loop / Scan bodies, Call's callee) holds a Graph.
    ``annotations`` hold PopART's placement attributes (virtual graph, pipeline stage, ...)."""
    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = "ai.onnx"
    name: str = ""
    annotations: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.domain}::{self.op_type} node '{self.name or self.outputs[0]}'"


@dataclass
class Graph:
    """A graph. ``inputs`` are the ids fed from outside (host streams for the main graph,
    arguments for a subgraph); ``initializers`` are weights / constants with values."""
    name: str = "main"
    nodes: list[Node] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    # Declared types of inputs / outputs / value_info (shapes may contain None for unknown).
    tensor_info: dict[str, TensorInfo] = field(default_factory=dict)
    # Opset version per (canonical) domain, e.g. {"ai.onnx": 11, "ai.graphcore": 1}.
    opsets: dict[str, int] = field(default_factory=dict)
    # Initializers that must never be trained or changed (e.g. ONNX Constant-like weights).
    constants: set[str] = field(default_factory=set)
    parent: Optional["Graph"] = None

    def producer(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def all_tensor_ids(self) -> list[str]:
        ids = list(self.inputs) + list(self.initializers)
        for n in self.nodes:
            ids += [o for o in n.outputs if o]
        return list(dict.fromkeys(ids))

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    out.setdefault(i, []).append(n)
        return out
