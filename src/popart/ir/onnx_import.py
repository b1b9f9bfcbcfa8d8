"""ONNX -> IR: read a model (path, bytes or ModelProto) into a :class:`Graph`."""
from __future__ import annotations

import functools
import heapq
import math
import os
from typing import Any, Optional, Union

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import ModelError, UnsupportedOperatorError, popart_exception
from ..fileio import read_exact
from ..ops.registry import GRAPHCORE_DOMAIN, ONNX_DOMAIN, canonical_domain, decode_attr
from ..tensorinfo import TensorInfo, to_datatype
from .graph import Graph, Node

ModelLike = Union[str, bytes, onnx.ModelProto, os.PathLike]
MIN_ONNX_OPSET = 1   # PopART started at 6; older models import too


def load_model(model: ModelLike) -> tuple[onnx.ModelProto, Optional[str]]:
    """The ModelProto of a file path, serialized bytes or ModelProto, and the folder external
    data is relative to (None when the model did not come from a file)."""
    if isinstance(model, onnx.ModelProto):
        return model, None
    if isinstance(model, (bytes, bytearray)):
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(model))
        except Exception as e:
            raise ModelError(f"Could not parse the given bytes as an ONNX ModelProto: {e}") from None
        return proto, None
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise ModelError(f"ONNX model file '{path}' does not exist (expected a path to an "
                             f".onnx file, serialized ModelProto bytes or a ModelProto)")
        try:
            proto = onnx.load(path, load_external_data=False)
        except Exception as e:
            raise ModelError(f"Could not read ONNX model file '{path}': {e}") from None
        return proto, os.path.dirname(os.path.abspath(path))
    raise ModelError(f"Expected an ONNX model as a file path, bytes or ModelProto, "
                     f"got {type(model).__name__}")


def tensor_to_numpy(t: onnx.TensorProto, base_dir: Optional[str]) -> np.ndarray:
    """An initializer's value; external data must stay inside the model's folder."""
    if t.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if base_dir is None:
            raise ModelError(f"Initializer '{t.name}' stores its data externally in '{loc}', "
                             f"but the model was not loaded from a file, so there is no folder "
                             f"to resolve it against")
        full = os.path.realpath(os.path.join(base_dir, loc))
        root = os.path.realpath(base_dir)
        if os.path.isabs(loc) or os.path.commonpath([full, root]) != root:
            raise ModelError(f"Initializer '{t.name}': external data location '{loc}' leaves "
                             f"the model's folder '{base_dir}'")
        if not os.path.isfile(full):
            raise ModelError(f"Initializer '{t.name}': external data file '{full}' does not exist")
        t = onnx.TensorProto.FromString(t.SerializeToString())
        t.raw_data = _read_external(t, full, info)
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]
    if any(d < 0 for d in t.dims):
        raise ModelError(f"Tensor '{t.name}' has negative dims {list(t.dims)}")
    try:
        return numpy_helper.to_array(t)
    except Exception as e:   # data that does not fit the type and dims, an unknown type
        raise ModelError(f"Tensor '{t.name}' (data type {t.data_type}, dims {list(t.dims)}) "
                         f"cannot be read: {' '.join(str(e).split())}") from None


# Sub-byte types: bits per element in raw (and external) data, packed little-end first.
_PACKED_BITS = {getattr(onnx.TensorProto, n): b for n, b in (
    ("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2),
    ("FLOAT6E2M3", 6), ("FLOAT6E3M2", 6)) if hasattr(onnx.TensorProto, n)}


def _raw_nbytes(t: onnx.TensorProto) -> int:
    """How many bytes of raw data a tensor's type and dims take."""
    if t.data_type in (onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING) or any(d < 0 for d in t.dims):
        raise ModelError(f"Initializer '{t.name}': external data needs a fixed-size type and "
                         f"non-negative dims, got type {t.data_type} dims {list(t.dims)}")
    count = math.prod(t.dims)
    bits = _PACKED_BITS.get(t.data_type)
    if bits:
        return (count * bits + 7) // 8
    try:
        return count * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"Initializer '{t.name}': unknown data type {t.data_type}") from None


def _read_external(t: onnx.TensorProto, path: str, info: dict) -> bytes:
    """The bytes of an external-data tensor: exactly what its type and dims need, from the
    entry's ``offset``, never more of the file (a ``length`` that disagrees, or a file too
    short, is a ModelError)."""
    need = _raw_nbytes(t)
    try:
        offset, length = int(info.get("offset", 0)), int(info.get("length", need))
    except ValueError:
        raise ModelError(f"Initializer '{t.name}': external data offset / length "
                         f"{info.get('offset')!r} / {info.get('length')!r} are not integers") from None
    if length != need:
        raise ModelError(f"Initializer '{t.name}': external data length {length} does not match "
                         f"its type and shape {list(t.dims)} ({need} bytes)")
    try:
        return read_exact(path, offset, need)
    except popart_exception as e:
        raise ModelError(f"Initializer '{t.name}': external data {e}") from None


def value_info_to_tensorinfo(vi: onnx.ValueInfoProto) -> Optional[TensorInfo]:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or tt.elem_type == 0:
        return None
    shape: list = []
    if tt.HasField("shape"):
        for d in tt.shape.dim:
            shape.append(d.dim_value if d.HasField("dim_value") else -1)
    else:
        shape = None  # unknown rank
    info = TensorInfo(to_datatype(tt.elem_type), [])
    info._shape = shape  # may contain -1 (unknown) or be None (unknown rank)
    return info


def _attr_value(a: onnx.AttributeProto, opsets: dict, base_dir, parent: Graph) -> Any:
    if a.type == onnx.AttributeProto.GRAPH:
        return graph_from_onnx(a.g, opsets, base_dir, parent)
    if a.type == onnx.AttributeProto.GRAPHS:
        return [graph_from_onnx(g, opsets, base_dir, parent) for g in a.graphs]
    if a.type == onnx.AttributeProto.TENSOR:
        return tensor_to_numpy(a.t, base_dir)
    if a.type == onnx.AttributeProto.TENSORS:
        return [tensor_to_numpy(t, base_dir) for t in a.tensors]
    if a.type == onnx.AttributeProto.SPARSE_TENSOR:
        raise UnsupportedOperatorError(f"Sparse tensor attribute '{a.name}' is not supported")
    return decode_attr(onnx.helper.get_attribute_value(a))


@functools.lru_cache(maxsize=64)
def _checker_context(opsets: tuple) -> Any:
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = onnx.IR_VERSION
    ctx.opset_imports = {"" if d == ONNX_DOMAIN else d: v for d, v in opsets}
    return ctx


def check_node(n: onnx.NodeProto, opsets: dict, k: int = 0) -> None:
    """onnx's checker on one node (its op and opset, input and output counts, attribute names
    and types; subgraphs are checked node by node when imported): a ModelError naming it."""
    if n.domain == ONNX_DOMAIN or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                      for a in n.attribute):
        n = onnx.NodeProto.FromString(n.SerializeToString())
        n.domain = "" if n.domain == ONNX_DOMAIN else n.domain
        for a in n.attribute:   # the checker cannot see enclosing scopes from here
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                sub.CopyFrom(onnx.GraphProto(name=sub.name))
    try:
        onnx.checker.check_node(n, _checker_context(tuple(sorted(opsets.items()))))
    except Exception as e:   # ValidationError, or bytes that are not UTF-8 in a name
        msg = " ".join(str(e).split("==>")[0].split())
        if "is deprecated" in msg:   # deprecated ops (GroupNormalization-18, ...) still run
            return
        raise ModelError(f"{canonical_domain(n.domain)}::{n.op_type} node "
                         f"'{n.name or f'{n.op_type}_{k}'}': {msg}") from None


def _uses(n: onnx.NodeProto) -> set[str]:
    """The tensors a node reads: its inputs and those its subgraphs read from outside."""
    names = {i for i in n.input if i}
    for a in n.attribute:
        for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            inner = ({v.name for v in sub.input} | {t.name for t in sub.initializer}
                     | {o for m in sub.node for o in m.output})
            names |= {u for m in sub.node for u in _uses(m)} - inner
    return names


def _node_order(g: onnx.GraphProto) -> list[int]:
    """Indices of ``g``'s nodes, each after the producers of what it reads: the file's order
    when it is topologically sorted (as ONNX requires), else sorted as ONNX Runtime does. A
    tensor produced twice (ONNX graphs are single assignment) or a cycle is a ModelError."""
    label = lambda k: f"'{g.node[k].name or g.node[k].op_type + '_' + str(k)}' ({g.node[k].op_type})"
    producer: dict[str, int] = {}
    defined = {vi.name for vi in g.input} | {t.name for t in g.initializer}
    for k, n in enumerate(g.node):
        for o in n.output:
            if o and (o in producer or o in defined):
                first = f"node {label(producer[o])}" if o in producer else "a graph input or initializer"
                raise ModelError(f"Graph '{g.name}': tensor '{o}' is written by node {label(k)} "
                                 f"and by {first}; every tensor must have one producer")
            if o:
                producer[o] = k
    deps = [{producer[i] for i in _uses(n) if i in producer} for n in g.node]
    if all(d < k for k, ds in enumerate(deps) for d in ds):
        return list(range(len(g.node)))
    users: dict[int, list[int]] = {}
    for k, ds in enumerate(deps):
        for d in ds:
            users.setdefault(d, []).append(k)
    waiting = [len(ds) for ds in deps]
    ready = [k for k, w in enumerate(waiting) if w == 0]
    order: list[int] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for u in users.get(k, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(g.node):
        stuck = [label(k) for k, w in enumerate(waiting) if w > 0]
        raise ModelError(f"Graph '{g.name}' has a cycle: nodes {', '.join(stuck[:6])} each "
                         f"wait for another's output")
    return order


def graph_from_onnx(g: onnx.GraphProto, opsets: dict, base_dir: Optional[str] = None,
                    parent: Optional[Graph] = None) -> Graph:
    graph = Graph(name=g.name or "graph", opsets=opsets, parent=parent)
    for t in g.initializer:
        graph.initializers[t.name] = tensor_to_numpy(t, base_dir)
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        info = value_info_to_tensorinfo(vi)
        if info is not None:
            graph.tensor_info[vi.name] = info
    # Older exporters list initializers among the inputs too: those are not streams.
    graph.inputs = [vi.name for vi in g.input if vi.name not in graph.initializers]
    graph.outputs = [vi.name for vi in g.output]
    for k in _node_order(g):
        n = g.node[k]
        check_node(n, opsets, k)
        attrs, ann = {}, {}
        for a in n.attribute:
            target = ann if a.name.startswith("__") else attrs
            try:
                target[a.name] = _attr_value(a, opsets, base_dir, graph)
            except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
                raise ModelError(f"Node '{n.name or n.op_type}' ({n.op_type}): attribute "
                                 f"'{a.name}' cannot be read: {e}") from None
        graph.nodes.append(Node(op_type=n.op_type, inputs=list(n.input), outputs=list(n.output),
                                attrs=attrs, domain=canonical_domain(n.domain),
                                name=n.name or f"{n.op_type}_{k}", annotations=ann))
    return graph


def model_opsets(model: onnx.ModelProto) -> dict[str, int]:
    """The model's opset version per (canonical) domain, checked, as is its IR version."""
    if model.ir_version > onnx.IR_VERSION:
        raise ModelError(f"The model's IR version {model.ir_version} is newer than the newest "
                         f"supported ({onnx.IR_VERSION})")
    opsets = {canonical_domain(o.domain): int(o.version) for o in model.opset_import}
    opsets.setdefault(GRAPHCORE_DOMAIN, 1)
    if not opsets.keys() - {GRAPHCORE_DOMAIN} and not model.opset_import:
        raise ModelError("The model imports no opset (opset_import is empty)")
    # A model of other domains only (ai.onnx.ml, ...) has no ai.onnx nodes to version.
    opsets.setdefault(ONNX_DOMAIN, onnx.defs.onnx_opset_version())
    if opsets[ONNX_DOMAIN] < MIN_ONNX_OPSET:
        raise UnsupportedOperatorError(
            f"The model imports ai.onnx opset {opsets[ONNX_DOMAIN]}; opsets {MIN_ONNX_OPSET} "
            f"to {onnx.defs.onnx_opset_version()} are supported")
    if opsets[ONNX_DOMAIN] > onnx.defs.onnx_opset_version():
        raise UnsupportedOperatorError(
            f"The model imports ai.onnx opset {opsets[ONNX_DOMAIN]}, newer than the newest "
            f"supported ({onnx.defs.onnx_opset_version()})")
    return opsets


def import_model(model: ModelLike, input_shape_info: Any = None) -> tuple[Graph, onnx.ModelProto]:
    """Import an ONNX model into an IR main graph (and return the ModelProto it came from).

    ``input_shape_info`` (a popart.InputShapeInfo or dict id -> TensorInfo) gives the shapes
    of inputs the model leaves open."""
    proto, base_dir = load_model(model)
    if not proto.HasField("graph"):
        raise ModelError("The model has no graph")
    graph = graph_from_onnx(proto.graph, model_opsets(proto), base_dir)
    graph.name = proto.graph.name or "main"
    overrides = _shape_overrides(input_shape_info)
    for tid, info in overrides.items():
        graph.tensor_info[tid] = info
    return graph, proto


def _shape_overrides(info: Any) -> dict[str, TensorInfo]:
    if info is None:
        return {}
    if isinstance(info, dict):
        return dict(info)
    return dict(getattr(info, "_infos", None) or getattr(info, "infos", {}) or {})
