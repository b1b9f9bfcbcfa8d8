"""The ai.graphcore (opset 1) operator signatures: the one table that the Builder's
``aiGraphcore`` methods and the engine's attribute defaults are both read from.

Each :class:`OpSchema` is one Builder method: its op type, its attributes in PopART's
argument order, and its outputs. Each :class:`Attr` holds

* ``default``: the Builder's default as PopART's Python API gives it (``REQUIRED``: the
  caller must pass it; ``None``: optional, not written when not given);
* ``node_default``: the value an op takes when a node lacks the attribute (a model written
  by another tool). ``SAME`` (the usual case) is the encoded ``default``; it differs only for
  attributes the Builder requires but PopART's ops do not (Slice ``axes``, DepthToSpace
  ``mode``). ``REQUIRED``: a node without it is an error (:func:`node_defaults` raises).

Values are written as PopART writes them: reduction types as PopART's strings ("Sum",
"Mean", "None"; scatter: "sum", "max", "min", "mul", "none"), Ctc ``outDataType`` as the ONNX
data type, PrintTensor's ``separator`` / brackets as character codes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
from onnx import AttributeProto

from ..errors import ModelError, popart_exception
from ..tensorinfo import onnx_dtype, to_datatype

I, F, S = AttributeProto.INT, AttributeProto.FLOAT, AttributeProto.STRING
INTS, FLOATS, STRINGS = AttributeProto.INTS, AttributeProto.FLOATS, AttributeProto.STRINGS
G = AttributeProto.GRAPH


class _Marker:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


REQUIRED: Any = _Marker("REQUIRED")  # no default: the attribute must be given
SAME: Any = _Marker("SAME")          # node_default: the (encoded) Builder default

REDUCTIONS = ("Sum", "Mean", "NoReduction")                  # popart.ReductionType
SCATTER_REDUCTIONS = ("Sum", "Max", "Min", "Mul", "NoReduction")  # popart.ScatterReduction
COLLECTIVE_OPS = ("Undefined", "Add", "Mean", "Mul", "Min", "Max", "LogicalAnd", "LogicalOr",
                  "SquareAdd", "Local")                      # popart.CollectiveOperator
COMM_GROUP_TYPES = ("All", "Consecutive", "Orthogonal", "Ungrouped")
_LOSS_REDUCTION_STRINGS = ("Sum", "Mean", "None")            # LossOp::reductionTypeToString
_SCATTER_REDUCTION_STRINGS = ("sum", "max", "min", "mul", "none")


def enum_index(value: Any, names: Sequence[str], what: str,
               aliases: Optional[dict] = None) -> int:
    """Index in ``names`` of an enum given as a member (by its ``.name``), a name, or an
    index; ``aliases`` maps other accepted names to indices."""
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if isinstance(name, str):
        if name in names:
            return names.index(name)
        if aliases and name in aliases:
            return aliases[name]
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if 0 <= int(value) < len(names):
            return int(value)
    raise popart_exception(f"Invalid {what} {value!r}: expected one of {', '.join(names)} "
                           f"(or its index)")


def _loss_reduction(v: Any) -> str:
    return _LOSS_REDUCTION_STRINGS[enum_index(v, REDUCTIONS, "ReductionType", {"None": 2})]


def _scatter_reduction(v: Any) -> str:
    aliases = {s: i for i, s in enumerate(_SCATTER_REDUCTION_STRINGS)} | {"None": 4}
    return _SCATTER_REDUCTION_STRINGS[enum_index(v, SCATTER_REDUCTIONS, "ScatterReduction",
                                                 aliases)]


def _collective_op(v: Any) -> str:
    return COLLECTIVE_OPS[enum_index(v, COLLECTIVE_OPS, "CollectiveOperator")]


def _comm_group(v: Any) -> list:
    """CommGroup-like (``.type``, ``.replicaGroupSize``) or (type, size) -> [type, size]."""
    kind, size = (v if isinstance(v, (tuple, list)) else
                  (getattr(v, "type"), getattr(v, "replicaGroupSize")))
    return [enum_index(kind, COMM_GROUP_TYPES, "CommGroupType"), int(size)]


def _data_type(v: Any) -> int:
    """A PopART data type (name, DataType, ONNX enum) -> its ONNX enum (UNDEFINED: 0)."""
    return onnx_dtype(to_datatype(v))


def _char(v: Any) -> int:
    """A one-character string (or its code) -> its character code."""
    if isinstance(v, (str, bytes)) and len(v) == 1:
        return ord(v)
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= int(v) < 256:
        return int(v)
    raise popart_exception(f"Invalid character {v!r}: expected a one-character string")


# Attributes whose Python value is an enum, an object or a character: kind -> (type, encode).
ENCODINGS: dict[str, tuple[int, Callable[[Any], Any]]] = {
    "reduction": (S, _loss_reduction),
    "scatter_reduction": (S, _scatter_reduction),
    "collective_op": (S, _collective_op),
    "comm_group": (INTS, _comm_group),
    "data_type": (I, _data_type),
    "char": (I, _char),
}


@dataclass(frozen=True)
class Attr:
    """One attribute of an ai.graphcore op (see the module docstring)."""
    name: str
    kind: Union[int, str]     # an AttributeProto type, or a key of ENCODINGS
    default: Any = REQUIRED
    node_default: Any = SAME

    @property
    def attr_type(self) -> int:
        """The AttributeProto type the attribute is written as."""
        return ENCODINGS[self.kind][0] if isinstance(self.kind, str) else self.kind

    def encode(self, value: Any) -> Any:
        """The Python value ``value`` as written to a node (enums to PopART's encoding)."""
        return ENCODINGS[self.kind][1](value) if isinstance(self.kind, str) else value

    @property
    def absent(self) -> Any:
        """What a node without the attribute means: an encoded value, ``REQUIRED``, or
        ``None`` (the op's own "not given" case)."""
        if self.node_default is not SAME:
            return self.node_default
        d = self.default
        if d is REQUIRED or d is None:
            return d
        d = self.encode(d)
        # a FLOAT attribute holds a float32: the value a node written with the default has
        return float(np.float32(d)) if self.attr_type == F else d


@dataclass(frozen=True)
class OpSchema:
    """One ``aiGraphcore`` Builder method and the op it writes."""
    method: str
    op_type: str
    attrs: tuple[Attr, ...]
    outputs: Union[int, str]          # count, or "n": a num_outputs argument gives it
    debug_at: Optional[int] = None    # position of debugContext among the attributes
    debug_name: str = "debugContext"  # the reference's name for it (a few methods differ)

    def attr(self, name: str) -> Attr:
        return next(a for a in self.attrs if a.name == name)


def _op(method: str, op_type: str, outputs: Union[int, str] = 1, *attrs: Attr,
        debug_at: Optional[int] = None, debug_name: str = "debugContext") -> OpSchema:
    return OpSchema(method, op_type, tuple(attrs), outputs, debug_at, debug_name)


A = Attr
_REDUCTION_MEAN = A("reduction", "reduction", "Mean")
_AXES_SIZES = (A("axes", INTS), A("sizes", INTS))

# PopART's AiGraphcoreOpset1 methods (Python API reference; willow/include/popart/builder.hpp),
# in its argument order. histogram and replicatedallgather are PopART ops it has no Python
# builder method for; init, zeros and multiconv are Builder methods of their own.
SCHEMAS: tuple[OpSchema, ...] = (
    _op("abort", "Abort", 0),
    _op("atan2", "Atan2"),
    _op("batchnormalization", "BatchNormalization", "n",
        A("epsilon", F, 1e-5), A("momentum", F, 0.9)),
    _op("bitwiseand", "BitwiseAnd"),
    _op("bitwisenot", "BitwiseNot"),
    _op("bitwiseor", "BitwiseOr"),
    _op("bitwisexnor", "BitwiseXnor"),
    _op("bitwisexor", "BitwiseXor"),
    _op("bucketize", "Bucketize", 1, A("right", I, 0)),
    _op("call", "Call", "n", A("callee", G)),   # also takes debugName= (Builder.py's name)
    _op("copyvarupdate", "CopyVarUpdate"),
    _op("ctcbeamsearchdecoder", "CtcBeamSearchDecoder", 3,
        A("blank", I, 0), A("beam_width", I, 100), A("top_paths", I, 1),
        debug_name="debug_context"),
    _op("ctcloss", "Ctc", 1, _REDUCTION_MEAN, A("blank", I, 0),
        A("outDataType", "data_type", "UNDEFINED"), A("zeroInfinity", I, 0)),
    _op("depthtospace", "DepthToSpace", 1, A("blocksize", I), A("mode", S, REQUIRED, "DCR")),
    _op("detach", "Detach"),
    _op("dynamicadd", "DynamicAdd", 1, *_AXES_SIZES),
    _op("dynamicslice", "DynamicSlice", 1, *_AXES_SIZES, A("noOverlap", I, 0)),
    _op("dynamicupdate", "DynamicUpdate", 1, *_AXES_SIZES, A("noOverlap", I, 0)),
    _op("dynamiczero", "DynamicZero", 1, *_AXES_SIZES),
    _op("expm1", "Expm1"),
    _op("fmod", "Fmod"),
    _op("gelu", "Gelu"),
    _op("geluerf", "GeluErf"),
    _op("groupedgather", "GroupedGather", 1, A("axis", I, 0), A("group_size", I, 1)),
    # PopART writes a ScatterReduce node with group_size (builder.cpp)
    _op("groupedscatterreduce", "ScatterReduce", 1,
        A("axis_size", I), A("axis", I, -1), A("reduction", "scatter_reduction", "Sum"),
        A("group_size", I, 1), A("enable_index_broadcast", I, 1)),
    _op("groupnormalization", "GroupNormalization", 3,
        A("num_groups", I), A("epsilon", F, 1e-5)),
    _op("histogram", "Histogram", 1, A("levels", FLOATS), A("absoluteOfInput", I, 0)),
    _op("identityloss", "IdentityLoss", 1, _REDUCTION_MEAN),
    _op("incrementmod", "IncrementMod", 1, A("increment", F), A("modulus", F)),
    _op("l1loss", "L1", 1, A("lambda", F), _REDUCTION_MEAN),
    _op("log1p", "Log1p"),
    _op("lstm", "LSTM", 2, A("outputFullSequence", I, 1)),
    _op("nearbyint", "NearbyInt"),
    _op("nllloss", "Nll", 1, _REDUCTION_MEAN, A("ignoreIndex", I, None),
        A("inputIsLogProbability", I, 0)),
    _op("nop", "Nop"),
    _op("normalize_image", "NormalizeImage", 1, A("scale", F, 1.0)),
    _op("packedDataBlock", "PackedDataBlock", 1,
        A("maxSequenceLengths", INTS), A("resultSize", I), A("callbackBatchSize", I),
        A("callback", G)),
    _op("printtensor", "PrintTensor", 1,
        A("print_gradient", I, 1), A("title", S, ""), A("summariseThreshold", I, 1000),
        A("edgeItems", I, 3), A("maxLineWidth", I, 75), A("digits", I, 8),
        A("floatFormat", I, 0), A("separator", "char", " "), A("openBracket", "char", "["),
        A("closeBracket", "char", "]"), debug_at=1),
    _op("reducemedian", "ReduceMedian", 2, A("axes", INTS, None), A("keepdims", I, 1)),
    _op("remainder", "Remainder"),
    _op("replicatedallgather", "ReplicatedAllGather", 1, A("commGroup", "comm_group", None)),
    _op("replicatedallreduce", "ReplicatedAllReduce", 1,
        A("collectiveOperator", "collective_op", None), A("commGroup", "comm_group", None)),
    _op("replicatedreducescatter", "ReplicatedReduceScatter", 1,
        A("collectiveOperator", "collective_op", None), A("commGroup", "comm_group", None)),
    _op("reshape", "Reshape", 1, A("shape", INTS)),
    _op("reverse", "Reverse", 1, A("dimensions", INTS)),
    _op("round", "Round"),
    _op("scale", "Scale", 1, A("scale", F)),
    _op("scaledadd", "ScaledAdd", 1, A("scale0", F, 1.0), A("scale1", F, 1.0)),
    _op("scatterreduce", "ScatterReduce", 1,
        A("axis_size", I), A("axis", I, -1), A("reduction", "scatter_reduction", "Sum"),
        A("enable_index_broadcast", I, 1)),
    _op("sequenceslice", "SequenceSlice", 1, A("zeroUnused", I, 0)),
    _op("shapeddropout", "ShapedDropout", 1, A("shape", INTS), A("ratio", F, 0.5)),
    # PopART's builder leaves an empty ``axes`` out; its op then slices the leading axes
    _op("slice", "Slice", 1, A("ends", INTS), A("starts", INTS), A("axes", INTS, REQUIRED, None)),
    _op("sort", "Sort", 2, A("axis", I, -1), A("descending", I, 0), A("stable", I, 0)),
    _op("splinebasis", "SplineBasis", 2, A("degree", I)),
    _op("splineweighting", "SplineWeighting"),
    _op("square", "Square"),
    _op("subsample", "Subsample", 1, A("strides", INTS)),
    _op("swish", "Swish"),
    _op("tensorremap", "TensorRemap", 1, A("remap_type", I, 0), debug_name="debugPrefix"),   # TensorRemapType.FwdBwdReverse
    _op("zeroslike", "ZerosLike"),
)
del A

BY_METHOD: dict[str, OpSchema] = {s.method: s for s in SCHEMAS}

# Op types that take another's attributes: spellings earlier versions of the Builder wrote,
# and SoftmaxNll (the training pass's Nll fused with its Softmax, ir.transforms).
_OP_TYPE_ALIASES = {"Normalize_Image": "NormalizeImage", "GroupedScatterReduce": "ScatterReduce",
                    "SoftmaxNll": "Nll"}


def _node_attrs() -> dict[str, dict[str, Attr]]:
    """Op type -> attribute name -> Attr, merged over the methods writing that op type."""
    out: dict[str, dict[str, Attr]] = {}
    for s in SCHEMAS:
        merged = out.setdefault(s.op_type, {})
        for a in s.attrs:
            if a.name in merged and merged[a.name].absent != a.absent:
                raise AssertionError(f"{s.op_type}.{a.name}: methods disagree on its default")
            merged[a.name] = a
    for alias, target in _OP_TYPE_ALIASES.items():
        out[alias] = out[target]
    return out


NODE_ATTRS: dict[str, dict[str, Attr]] = _node_attrs()


def node_defaults(op_type: str, attrs: Any, where: str) -> dict[str, Any]:
    """The default attribute values of an ai.graphcore ``op_type`` node (from the table) for
    the attributes ``attrs`` (the node's, a mapping or names) lacks. Raises ModelError naming
    ``where`` (the node), the op and the attribute when a required attribute is missing.
    Op types the table does not describe get no defaults."""
    spec = NODE_ATTRS.get(op_type)
    if not spec:
        return {}
    out = {}
    for name, a in spec.items():
        if name in attrs:
            continue
        value = a.absent
        if value is REQUIRED:
            raise ModelError(f"{where}: ai.graphcore::{op_type} requires attribute '{name}' "
                             f"({AttributeProto.AttributeType.Name(a.attr_type)}), which the "
                             f"node does not have")
        if value is not None:
            out[name] = value
    return out


def describe() -> str:
    """The table as text: ``method: OpType(attribute:TYPE=default, ...) -> outputs``."""
    lines = ["", "ai.graphcore ops (method: OpType(attribute:type=default, ...) -> outputs)",
             "-" * 72]
    for s in sorted(SCHEMAS, key=lambda s: s.method):
        parts = [f"{a.name}:{AttributeProto.AttributeType.Name(a.attr_type)}"
                 + ("" if a.default is REQUIRED else f"={a.default!r}")
                 + ("" if a.node_default is SAME else " (optional on a node)"
                    if a.node_default is None else f" (node default {a.node_default!r})")
                 for a in s.attrs]
        outs = "num_outputs" if s.outputs == "n" else s.outputs
        lines.append(f"* {s.method}: {s.op_type}({', '.join(parts)}) -> {outs}")
    lines += ["* init: Init(shape:INTS, data_type:INT, init_type:INT, batch_axis:INT) -> 1",
              "* zeros: Zeros(shape:INTS, dtype:INT) -> 1",
              "* multiconv: MultiConv(see above) -> one per convolution"]
    return "\n".join(lines) + "\n"


__all__ = ["REQUIRED", "SAME", "Attr", "OpSchema", "SCHEMAS", "BY_METHOD", "NODE_ATTRS",
           "ENCODINGS", "node_defaults", "describe", "enum_index"]
