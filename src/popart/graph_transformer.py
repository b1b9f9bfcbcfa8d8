"""GraphTransformer: PopART's ONNX-model rewrites (data types, initializers, unused inputs,
training-mode BatchNormalization, external tensor data), done on the ONNX protobuf.

Like PopART's, a type conversion rewrites the model's initializers, the tensors in node
attributes (Constant ``value``, ConstantOfShape ``value``, ...) and the element types of the
graph's inputs and outputs. So that the result stays a valid model for any runtime, it also
rewrites what PopART's IR never needed rewritten: intermediate ``value_info`` types, the
target types of ai.onnx nodes (Cast ``to``, the ``dtype`` of RandomNormal, EyeLike, ...) and
sub-graphs (If / Loop / Scan bodies), where PopART raised. Every method either completes or
leaves the model as it was.
"""
from __future__ import annotations

import copy
import itertools
import os
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import ml_dtypes
import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, numpy_helper

from .errors import ModelError, noted, popart_exception
from ._ir.onnx_import import for_checker, load_model, save_initializers_externally, tensor_to_numpy

__all__ = ["GraphTransformer"]

ModelLike = Union[str, bytes, bytearray, os.PathLike, onnx.ModelProto]

_INT32 = np.iinfo(np.int32)
# Integer types PopART calls fixed point (DataTypeInfo::isFixedPoint), plus ONNX's sub-byte ones.
_FIXED_POINT = {TensorProto.UINT8, TensorProto.INT8, TensorProto.UINT16, TensorProto.INT16,
                TensorProto.INT32, TensorProto.INT64, TensorProto.UINT32, TensorProto.UINT64,
                TensorProto.BOOL} | {getattr(TensorProto, n) for n in ("INT4", "UINT4", "INT2",
                                                                        "UINT2")
                                     if hasattr(TensorProto, n)}
_training_output_counter = itertools.count()   # as PopART's: unique across transformers


def _type_name(data_type: int) -> str:
    try:
        return TensorProto.DataType.Name(data_type)
    except ValueError:
        return f"data type {data_type}"


def _subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every graph nested in its nodes' attributes, outermost first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                yield from _subgraphs(attr.g)
            elif attr.type == AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _subgraphs(g)


def _check_model(model: onnx.ModelProto, what: str) -> None:
    try:   # external data as PopART allows it (absolute, or relative to the working dir)
        onnx.checker.check_model(for_checker(model))
    except (onnx.checker.ValidationError, ValueError) as e:
        raise ModelError(f"{what}: the model is not a valid ONNX model: "
                         f"{' '.join(str(e).split())[:2000]}") from None


def _ids(ids: Any, what: str) -> list[str]:
    """``ids`` as a list of tensor ids (a single str is one id), duplicates dropped."""
    if isinstance(ids, str):
        ids = [ids]
    if isinstance(ids, (bytes, bytearray)) or not isinstance(ids, Iterable):
        raise popart_exception(f"{what}: expected a list of tensor ids (str), got {ids!r}")
    out: list[str] = []
    for i in ids:
        if not isinstance(i, str):
            raise popart_exception(f"{what}: expected tensor ids (str), got {i!r} "
                                   f"({type(i).__name__}) in {ids!r}")
        if i not in out:
            out.append(i)
    return out


class GraphTransformer:
    """Rewrites of an ONNX model: ``GraphTransformer(modelProtoOrFilename)`` (a path to an
    .onnx file, serialized ModelProto bytes or a ModelProto, which is copied, never
    modified), the transforms, then :meth:`getModelProto`."""

    def __init__(self, modelProtoOrFilename: ModelLike) -> None:
        model, base_dir = load_model(modelProtoOrFilename)
        self._model = copy.deepcopy(model) if model is modelProtoOrFilename else model
        self._base_dir: Optional[str] = base_dir
        _check_model(self._model, "GraphTransformer")

    # -- output -------------------------------------------------------------------------

    def getModelProto(self) -> bytes:
        """The transformed model, serialized (bytes)."""
        return self._model.SerializeToString()

    # -- helpers ------------------------------------------------------------------------

    def _transaction(self, fn: Callable[[onnx.ModelProto], None]) -> None:
        """Run ``fn`` on a copy of the model; keep the copy only if ``fn`` succeeds."""
        work = copy.deepcopy(self._model)
        fn(work)
        self._model = work

    def _array(self, t: onnx.TensorProto) -> np.ndarray:
        return tensor_to_numpy(t, self._base_dir)

    def _replace(self, t: onnx.TensorProto, value: np.ndarray, data_type: int) -> None:
        """Overwrite tensor ``t``'s data (kept in the model, not external) with ``value``."""
        new = numpy_helper.from_array(value, name=t.name)
        if new.data_type != data_type:
            raise popart_exception(f"internal: tensor '{t.name}' converted to "
                                   f"{_type_name(new.data_type)}, expected {_type_name(data_type)}")
        doc = t.doc_string
        t.CopyFrom(new)
        if doc:
            t.doc_string = doc

    def _convert_types(self, src: int, dst: int,
                       convert: Callable[[np.ndarray, onnx.TensorProto], np.ndarray]) -> None:
        """Every ``src``-typed tensor, type annotation and target-type attribute of the
        model (sub-graphs included) becomes ``dst``; tensor data goes through ``convert``."""
        def tensor(t: onnx.TensorProto) -> None:
            if t.data_type == src:
                self._replace(t, convert(self._array(t), t), dst)

        def type_proto(tp: onnx.TypeProto) -> None:
            which = tp.WhichOneof("value")
            if which == "tensor_type" and tp.tensor_type.elem_type == src:
                tp.tensor_type.elem_type = dst
            elif which == "sparse_tensor_type" and tp.sparse_tensor_type.elem_type == src:
                tp.sparse_tensor_type.elem_type = dst
            elif which == "sequence_type":
                type_proto(tp.sequence_type.elem_type)
            elif which == "optional_type":
                type_proto(tp.optional_type.elem_type)

        def run(model: onnx.ModelProto) -> None:
            for g in _subgraphs(model.graph):
                for t in g.initializer:
                    tensor(t)
                for s in g.sparse_initializer:
                    tensor(s.values)
                for vi in itertools.chain(g.input, g.output, g.value_info):
                    type_proto(vi.type)
                for node in g.node:
                    onnx_op = node.domain in ("", "ai.onnx")
                    for a in node.attribute:
                        if a.type == AttributeProto.TENSOR:
                            if a.t.data_type == TensorProto.UNDEFINED:
                                raise ModelError(f"Node '{node.name}' ({node.op_type}): attribute "
                                                 f"'{a.name}' is a tensor with no data type")
                            tensor(a.t)
                        elif a.type == AttributeProto.TENSORS:
                            for t in a.tensors:
                                tensor(t)
                        elif a.type == AttributeProto.SPARSE_TENSOR:
                            tensor(a.sparse_tensor.values)
                        elif a.type == AttributeProto.TYPE_PROTO:
                            type_proto(a.tp)
                        elif (a.type == AttributeProto.INT and onnx_op and a.i == src
                              and ((node.op_type == "Cast" and a.name == "to")
                                   or a.name == "dtype")):
                            a.i = dst

        self._transaction(run)

    def _widen(self, src: int, dst_np: type, dst: int) -> None:
        self._convert_types(src, dst, lambda a, t: a.astype(dst_np))

    # -- type conversions ---------------------------------------------------------------

    def convertFloatsToHalfs(self) -> None:
        """FLOAT (float32) -> FLOAT16 everywhere in the model (values rounded to nearest)."""
        self._widen(TensorProto.FLOAT, np.float16, TensorProto.FLOAT16)

    def convertUINT8ToINT32(self) -> None:
        """UINT8 -> INT32 everywhere in the model."""
        self._widen(TensorProto.UINT8, np.int32, TensorProto.INT32)

    def convertUINT16ToINT32(self) -> None:
        """UINT16 -> INT32 everywhere in the model."""
        self._widen(TensorProto.UINT16, np.int32, TensorProto.INT32)

    def convertINT8ToINT32(self) -> None:
        """INT8 -> INT32 everywhere in the model."""
        self._widen(TensorProto.INT8, np.int32, TensorProto.INT32)

    def convertINT16ToINT32(self) -> None:
        """INT16 -> INT32 everywhere in the model."""
        self._widen(TensorProto.INT16, np.int32, TensorProto.INT32)

    def convertINT64ToINT32(self, clip: bool = False) -> None:
        """INT64 -> INT32 everywhere in the model. Tensor data outside int32's range is an
        error, unless ``clip``: then it is clipped to int32's minimum / maximum."""
        if not isinstance(clip, (bool, np.bool_)):
            raise popart_exception(f"convertINT64ToINT32: clip must be a bool, got {clip!r} "
                                   f"({type(clip).__name__})")

        def convert(a: np.ndarray, t: onnx.TensorProto) -> np.ndarray:
            outside = (a < _INT32.min) | (a > _INT32.max)
            if not clip and outside.any():
                raise popart_exception(
                    f"convertINT64ToINT32: tensor '{t.name}' holds {int(outside.sum())} value(s) "
                    f"outside the int32 range [{_INT32.min}, {_INT32.max}], the first "
                    f"{int(a[outside].flat[0])}; pass clip=True to clip such values to that "
                    f"range")
            return np.clip(a, _INT32.min, _INT32.max).astype(np.int32)

        self._convert_types(TensorProto.INT64, TensorProto.INT32, convert)

    def convertDoublesToFloats(self) -> None:
        """DOUBLE (float64) -> FLOAT (float32) everywhere in the model."""
        self._widen(TensorProto.DOUBLE, np.float32, TensorProto.FLOAT)

    def convertDoublesToHalfs(self) -> None:
        """DOUBLE (float64) -> FLOAT16 everywhere in the model (rounded once, to nearest)."""
        self._widen(TensorProto.DOUBLE, np.float16, TensorProto.FLOAT16)

    def convertBFloats16ToFloat32(self) -> None:
        """BFLOAT16 -> FLOAT (float32) everywhere in the model (exact)."""
        self._convert_types(TensorProto.BFLOAT16, TensorProto.FLOAT,
                            lambda a, t: a.astype(ml_dtypes.bfloat16).astype(np.float32))

    # -- initializers -------------------------------------------------------------------

    def convertInitializersToConstants(self, ids: Sequence[str]) -> None:
        """Replace the initializers ``ids`` by Constant nodes (placed before every other
        node) of the same name and value; they stop being graph inputs."""
        ids = _ids(ids, "convertInitializersToConstants")

        def run(model: onnx.ModelProto) -> None:
            graph = model.graph
            inits = {t.name: t for t in graph.initializer}
            missing = [i for i in ids if i not in inits]
            if missing:   # PopART's text (graphtransformer_impl.cpp), its first missing id
                raise noted(popart_exception(f"TensorId {missing[0]} not in the model "
                                             f"initalizers"),
                            f"convertInitializersToConstants: not initializers: {missing}; the "
                            f"model's initializers: {sorted(inits)[:20]}")
            constants = []
            for i in ids:
                value = copy.deepcopy(inits[i])
                if value.data_location == TensorProto.EXTERNAL:
                    self._replace(value, self._array(value), value.data_type)
                node = onnx.helper.make_node("Constant", [], [i], name=i)
                attr = node.attribute.add()
                attr.name, attr.type = "value", AttributeProto.TENSOR
                attr.t.CopyFrom(value)
                constants.append(node)
            keep_inits = [t for t in graph.initializer if t.name not in ids]
            keep_inputs = [v for v in graph.input if v.name not in ids]
            nodes = constants + list(graph.node)
            for field, values in (("initializer", keep_inits), ("input", keep_inputs),
                                  ("node", nodes)):
                graph.ClearField(field)
                getattr(graph, field).extend(values)
            _check_model(model, "convertInitializersToConstants")

        self._transaction(run)

    def convertAllFixedPointInitializersToConstants(self) -> None:
        """:meth:`convertInitializersToConstants` for every integer / bool initializer."""
        self.convertInitializersToConstants(
            [t.name for t in self._model.graph.initializer if t.data_type in _FIXED_POINT])

    def saveInitializersExternally(self, ids: Sequence[str], filename: str) -> None:
        """Move the data of initializers ``ids`` to the file ``filename`` (absolute, or
        relative to the working directory; written now, atomically), one after the other;
        each initializer then refers to it by ONNX's external-data fields (location
        ``filename`` as given, length, offset), as PopART's. Initializers saved to the same
        file before keep their data there: the new ones are appended."""
        ids = _ids(ids, "saveInitializersExternally")
        if not isinstance(filename, (str, os.PathLike)) or not os.fspath(filename):
            raise popart_exception(f"saveInitializersExternally: filename must be a non-empty "
                                   f"path, got {filename!r}")
        work = copy.deepcopy(self._model)
        save_initializers_externally(work.graph, ids, os.fspath(filename), self._base_dir)
        self._model = work

    # -- graph structure ----------------------------------------------------------------

    def removeUnusedInputs(self) -> None:
        """Remove the graph inputs (and their initializers) that no node reads, and the
        initializers nothing reads. Tensors read inside sub-graphs or that are graph
        outputs count as read."""
        def run(model: onnx.ModelProto) -> None:
            graph = model.graph
            used = {o.name for o in graph.output}
            for g in _subgraphs(graph):
                for node in g.node:
                    used.update(node.input)
            inputs = [v for v in graph.input if v.name in used]
            inits = [t for t in graph.initializer if t.name in used]
            if len(inputs) == len(graph.input) and len(inits) == len(graph.initializer):
                return
            graph.ClearField("input")
            graph.input.extend(inputs)
            graph.ClearField("initializer")
            graph.initializer.extend(inits)

        self._transaction(run)

    def prepareNodesForTraining(self) -> None:
        """Give BatchNormalization nodes their training-mode outputs: up to 5 outputs (Y,
        mean, var, saved mean, saved var) as in ai.onnx opsets before 14; from opset 14 on,
        3 outputs (Y, running mean, running var) and ``training_mode=1``. The new outputs
        are named ``BatchNormalization_<node name>_oi<index>_<counter>`` as in PopART."""
        def run(model: onnx.ModelProto) -> None:
            onnx_version = next((o.version for o in model.opset_import
                                 if o.domain in ("", "ai.onnx")), 0)
            taken = {n for g in _subgraphs(model.graph) for node in g.node for n in node.output}
            taken |= {v.name for g in _subgraphs(model.graph)
                      for v in itertools.chain(g.input, g.initializer)}
            for g in _subgraphs(model.graph):
                for node in g.node:
                    if node.op_type != "BatchNormalization":
                        continue
                    onnx_op = node.domain in ("", "ai.onnx")
                    n_outputs = 3 if onnx_op and onnx_version >= 14 else 5
                    for index in range(len(node.output), n_outputs):
                        while True:
                            name = (f"{node.op_type}_{node.name}_oi{index}_"
                                    f"{next(_training_output_counter)}")
                            if name not in taken:
                                break
                        taken.add(name)
                        node.output.append(name)
                    if onnx_op and onnx_version >= 14:
                        mode = next((a for a in node.attribute if a.name == "training_mode"),
                                    None)
                        if mode is None:
                            node.attribute.append(onnx.helper.make_attribute("training_mode", 1))
                        else:
                            mode.i = 1

        self._transaction(run)
