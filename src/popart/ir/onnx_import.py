"""ONNX -> IR: read a model (path, bytes or ModelProto) into a :class:`Graph`."""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import ModelError, UnsupportedOperatorError
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
        onnx.external_data_helper.load_external_data_for_tensor(t, base_dir)
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]
    return numpy_helper.to_array(t)


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
    for k, n in enumerate(g.node):
        attrs, ann = {}, {}
        for a in n.attribute:
            target = ann if a.name.startswith("__") else attrs
            target[a.name] = _attr_value(a, opsets, base_dir, graph)
        graph.nodes.append(Node(op_type=n.op_type, inputs=list(n.input), outputs=list(n.output),
                                attrs=attrs, domain=canonical_domain(n.domain),
                                name=n.name or f"{n.op_type}_{k}", annotations=ann))
    return graph


def model_opsets(model: onnx.ModelProto) -> dict[str, int]:
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
