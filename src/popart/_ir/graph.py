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


def free_ids(graph: Graph) -> set[str]:
    """The ids ``graph`` (with the graphs its nodes call) reads from enclosing scopes."""
    defined = set(graph.inputs) | set(graph.initializers)
    free: set[str] = set()
    for n in graph.nodes:
        free |= {i for i in reads(n) if i not in defined}
        defined |= {o for o in n.outputs if o}
    return free


def outer_reads(node: Node) -> set[str]:
    """The ids the graphs ``node`` calls (If / Loop / Scan bodies, Call's callee) read from
    ``node``'s graph."""
    out: set[str] = set()
    for v in node.attrs.values():
        for g in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(g, Graph):
                out |= free_ids(g)
    return out


def reads(node: Node) -> list[str]:
    """Every id ``node`` reads from its graph: its inputs, then its called graphs' reads."""
    return list(dict.fromkeys([i for i in node.inputs if i] + sorted(outer_reads(node))))


def fingerprint(graph: Graph) -> str:
    """A hash of everything about ``graph`` that shapes its compiled program: nodes (types,
    tensors, attributes with nested graphs, annotations), inputs, outputs, declared types,
    opsets and initializers (values of those compiled in as constants, shape and dtype of
    the float ones that are program arguments). Equal graphs give equal hashes in every
    process."""
    import hashlib
    h = hashlib.sha256()

    def put(*parts: Any) -> None:
        for p in parts:
            h.update(repr(p).encode() if not isinstance(p, bytes) else p)
            h.update(b"\0")

    def value(v: Any) -> None:
        if isinstance(v, Graph):
            put("graph")
            walk(v)
        elif isinstance(v, np.ndarray):
            put("array", v.dtype.str, v.shape, np.ascontiguousarray(v).tobytes())
        elif isinstance(v, (list, tuple)):
            put("list", len(v))
            for x in v:
                value(x)
        elif isinstance(v, dict):
            put("dict", len(v))
            for k in sorted(v, key=repr):
                put(k)
                value(v[k])
        else:
            put(type(v).__name__, v)

    def walk(g: Graph) -> None:
        put(g.name, g.inputs, g.outputs, sorted(g.opsets.items()), sorted(g.constants))
        for tid in sorted(g.tensor_info):
            info = g.tensor_info[tid]
            put(tid, info.data_type(), info._shape)
        for tid in sorted(g.initializers):
            v = np.asarray(g.initializers[tid])
            if np.issubdtype(v.dtype, np.floating) and tid not in g.constants:
                put(tid, v.dtype.str, v.shape)
            else:
                value(v)
        for n in g.nodes:
            put(n.domain, n.op_type, n.inputs, n.outputs)
            value(n.attrs)
            value(n.annotations)

    walk(graph)
    return h.hexdigest()
