"""popart.Builder: writes ONNX models (ModelProto) through ``onnx.helper``.

``aiOnnx`` / ``aiOnnxOpsetN`` / ``aiOnnxMl`` are derived from the ``onnx.defs`` schemas,
``aiGraphcore`` from the table in ``popart._ir.graphcore_schema``; attributes and annotations
are written under PopART's names and encodings. See docs/builder.md. The list of ai.graphcore
op types and attributes is appended to this docstring at import time.
"""
from __future__ import annotations

import enum
import functools
import inspect
import keyword
import operator
import os
import re
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import onnx
import onnx.defs
from onnx import AttributeProto, helper, numpy_helper

from . import debug_info as _debug_info
from .debug_info import DebugContext, DebugInfo
from .errors import (ArgumentError, BuilderError, ModelError, UnsupportedOperatorError,
                     incompatible_arguments, integral, noted, popart_exception, real,
                     sequence_of)
from .fileio import atomic_write, initializer_proto
from ._ir.graph import PIPELINE_STAGE, VIRTUAL_GRAPH
from .logging import getLogger
from ._ir.graphcore_schema import BY_METHOD as _GRAPHCORE_METHODS
from ._ir.graphcore_schema import COLLECTIVE_OPS as _COLLECTIVE_OPS
from ._ir.graphcore_schema import COMM_GROUP_TYPES as _COMM_GROUP_TYPES
from ._ir.graphcore_schema import REDUCTIONS, REQUIRED, SCATTER_REDUCTIONS, OpSchema
from ._ir.graphcore_schema import describe as _describe_graphcore_ops
from ._ir.graphcore_schema import enum_index as _enum_index
from .fileio import note_own_file
from ._ir.onnx_import import (external_data_path, external_info, for_checker, is_external,
                             save_initializers_externally)
from .ops.registry import GRAPHCORE_DOMAIN, ONNX_DOMAIN, ONNX_ML_DOMAIN, decode_attr
from .tensorinfo import DataType, TensorInfo, np_dtype, onnx_dtype, to_datatype

# Annotation attribute names (the placement ones are the IR's: ir.graph)
EXECUTION_PHASE = "__execution_phase"
DEBUG_INFO_ID = "__debug_info_id"
RECOMPUTE_OUTPUT = "__recompute_output"
SCHEDULE_PRIORITY = "__schedule_priority"
OUTLINE_ATTRIBUTES = "__outline_attributes"
PARTIALS_TYPE = "__partials_type"
AVAILABLE_MEMORY_PROPORTION = "__available_memory_proportion"
SERIALIZE_MATMUL_MODE = "__serialize_matmul_mode"
SERIALIZE_MATMUL_FACTOR = "__serialize_matmul_factor"
SERIALIZE_MATMUL_PRECISION = "__serialize_matmul_precision"
EXCLUDE_PATTERNS = "__exclude_patterns"
INPLACE_OP_NAMES = "__inplace_op_names"
INPLACE_OP_PRIORITIES = "__inplace_op_priorities"
ENABLE_CONV_DITHERING = "__enable_conv_dithering"
OUTPUT_TENSOR_LOCATION = "__output_tensor_location"
COLLECTIVE_COMM_GROUP = "__collectiveCommGroup"
COLLECTIVE_OPERATOR = "__collectiveOperator"
# Builder arguments PopART writes under reserved attribute names (builder.cpp)
_POPART_ATTR_NAMES = {"commGroup": COLLECTIVE_COMM_GROUP, "collectiveOperator": COLLECTIVE_OPERATOR}

DEFAULT_AI_ONNX_OPSET = 10      # PopART's defaultAiOnnxOpset (graphcoreoperators.hpp)
DEFAULT_AI_GRAPHCORE_OPSET = 1
MIN_AI_ONNX_OPSET = 6
MAX_AI_ONNX_OPSET = onnx.defs.onnx_opset_version()
POPART_MAX_AI_ONNX_OPSET = 11   # PopART's opsets (6..11) keep ops ONNX deprecated since


class RecomputeType(enum.IntEnum):
    Undefined = 0
    Checkpoint = 1
    Recompute = 2
    Recomputed = 3


_DEBUG_KEYWORDS = ("debugContext", "debugPrefix", "debugName", "debug_context", "name")
_DTYPE_ATTRIBUTES = ("to", "dtype")
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                onnx.TensorProto.DOUBLE}

I, F, S = AttributeProto.INT, AttributeProto.FLOAT, AttributeProto.STRING
INTS, FLOATS, STRINGS = AttributeProto.INTS, AttributeProto.FLOATS, AttributeProto.STRINGS
T, G = AttributeProto.TENSOR, AttributeProto.GRAPH


# ---------------------------------------------------------------------------------------
# Small helpers

def _debug_name(value: Any) -> str:
    """The name of a debug context given as a str, a DebugContext-like object or None."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    name = getattr(value, "name", "")
    return name() if callable(name) else str(name or "")


_BUILDER_LOG = getLogger("builder")


def _BuilderDebugInfo(debug: Any, op_type: str, inputs: Sequence[str]) -> Optional[DebugInfo]:
    """PopART's BuilderDebugInfo: a "popartbuilder" DebugInfo for one Builder call, while a
    debug-info file is being recorded (initializePoplarDebugInfo); else None."""
    if getattr(_debug_info, "_stream", None) is None:
        return None
    context = debug if isinstance(debug, DebugContext) else DebugContext._from(
        _debug_name(debug), "Builder", depth=2)
    info = DebugInfo(context, "popartbuilder")
    info.setValue("category", "api")
    info.setValue("api", op_type)
    if len(inputs):
        info.setValue("inputs", list(inputs))
    return info


def _as_id_set(names: Union[str, Iterable[str]]) -> list[str]:
    return [names] if isinstance(names, str) else list(names)


def _is_unset(value: Any) -> bool:
    return value is None or (isinstance(value, (list, tuple)) and len(value) == 0)


_ATTR_KIND_TEXT = {I: "an integer", INTS: "an integer vector", F: "a float",
                   FLOATS: "a float vector", S: "a string", STRINGS: "a string vector"}


def _check_call(args: list, n_out: int, callee: Any, debug: Any) -> None:
    """PopART's Builder check (builder.cpp, aiGraphcore call): the Call's inputs and outputs
    are as many as the callee's."""
    for dir, n, m in (("input", len(args), len(callee.input)),
                      ("output", n_out, len(callee.output))):
        if n != m:
            name = getattr(debug, "getPathName", lambda: debug or "")()
            raise popart_exception(f"For CallOp '{name}', number of {dir}s ({n}) does not "
                                   f"match that of the callee subgraph ({m})")


def _make_attr(op: str, name: str, value: Any, attr_type: Optional[int] = None) -> AttributeProto:
    """An AttributeProto from a Python / NumPy value, coerced to ``attr_type`` when known.
    A sub-graph Builder becomes a GraphProto; a NumPy array a TensorProto."""
    try:
        if isinstance(value, Builder):
            value, attr_type = value._subgraph_proto(
                captures=re.search(r"::If(-\d+)?$", op) is not None), G
        elif isinstance(value, onnx.GraphProto):
            attr_type = G
        elif isinstance(value, np.ndarray) and attr_type in (I, F, S):
            value = value.item()             # a 0-d array as a scalar, as pybind11 takes it
        elif isinstance(value, np.ndarray) and attr_type in (INTS, FLOATS, STRINGS):
            value = value.tolist()
        elif attr_type == T or isinstance(value, np.ndarray):   # PopART's storage fields
            value, attr_type = initializer_proto(np.asarray(value), name), T
        elif (attr_type == I and name in _DTYPE_ATTRIBUTES
              and not isinstance(value, (int, np.integer))):
            value = onnx_dtype(value)
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, enum.Enum) and attr_type in (S, None):
            value = value.name
        if attr_type == I:
            value = operator.index(value)
        elif attr_type == F:
            value = float(value)
        elif attr_type == S:
            if not isinstance(value, (str, bytes)):
                raise TypeError(f"expected a string, got {type(value).__name__}")
        elif attr_type == INTS:
            value = [operator.index(v) for v in value]
        elif attr_type == FLOATS:
            value = [float(v) for v in value]
        elif attr_type == STRINGS:
            value = [v if isinstance(v, (str, bytes)) else str(v) for v in value]
        elif attr_type is None:
            if isinstance(value, bool):
                value = int(value)
            elif isinstance(value, (list, tuple)):
                value = [v.item() if isinstance(v, np.generic) else v for v in value]
                if value and all(isinstance(v, bool) for v in value):
                    value = [int(v) for v in value]
        return helper.make_attribute(name, value, attr_type=attr_type)
    except popart_exception:
        raise
    except (TypeError, ValueError, AttributeError) as e:
        kind = AttributeProto.AttributeType.Name(attr_type) if attr_type else "attribute"
        raise ArgumentError(f"Op {op}: invalid value {value!r} for attribute '{name}' "
                            f"(expected {kind}): {e}") from None


def _bind(what: str, params: Sequence[str], required: set, positional: Sequence[Any],
          keywords: dict, keyword_only: Sequence[str] = ()) -> dict:
    """Bind an op method's arguments (after ``args``) to ``params``; ``debugContext`` is
    one of them. Accepts ``debugPrefix`` / ``name`` / ``debugName`` for the debug name
    (positional arguments bind in order, as pybind11 binds them). ``keyword_only`` params
    take no positional argument. Arguments the op cannot take raise TypeError (ArgumentError), as
    PopART's bindings do."""
    positional = list(positional)
    values: dict[str, Any] = {}
    debug = next((p for p in params if p == "debugContext" or p in _DEBUG_KEYWORDS), "debugContext")
    by_position = [p for p in params if p not in keyword_only]
    if len(positional) > len(by_position):
        raise ArgumentError(f"{what} takes at most {len(by_position)} positional argument(s) "
                            f"after the inputs ({', '.join(by_position)}), got {len(positional)}")
    values.update(zip(by_position, positional))
    for key, value in keywords.items():
        if key not in params and (key in _DEBUG_KEYWORDS or key == "debugContext"):
            key = debug
        elif key not in params and key.endswith("_") and key[:-1] in params:
            key = key[:-1]  # e.g. lambda_ for the attribute "lambda"
        if key not in params:
            known = ", ".join(p for p in params if p != debug) or "none"
            raise ArgumentError(f"{what} has no attribute '{key}'; its attributes are: {known}")
        if key in values:
            raise ArgumentError(f"{what} got more than one value for '{key}'")
        values[key] = value
    for name in params:
        if name in required and values.get(name) is None:
            raise ArgumentError(f"{what} requires attribute '{name}', which was not given")
    return values


def _signature(params: Sequence[str], defaults: dict, with_args: bool = True,
               keyword_only: Sequence[str] = ()) -> inspect.Signature:
    """The signature _bind implements. It shows ``**keywords`` where a parameter's own name
    is a Python keyword (``lambda``, shown as ``lambda_``: both are accepted) or the debug
    parameter is not ``debugContext`` (which is accepted too)."""
    p = [inspect.Parameter("args", inspect.Parameter.POSITIONAL_OR_KEYWORD)] if with_args else []
    for name in [n for n in params if n not in keyword_only] + list(keyword_only):
        d = defaults.get(name, inspect.Parameter.empty)
        p.append(inspect.Parameter(name + "_" if keyword.iskeyword(name) else name,
                                   inspect.Parameter.KEYWORD_ONLY if name in keyword_only
                                   else inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                   default=inspect.Parameter.empty if d is REQUIRED else d))
    if any(keyword.iskeyword(n) for n in params) or "debugContext" not in params:
        p.append(inspect.Parameter("keywords", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(p)


# ---------------------------------------------------------------------------------------
# pybind11's view of the op methods. PopART's op methods are pybind11 bindings (the aiOnnx
# ones generated by gen_operators.py into popart_opsetN.gen.cpp, AiGraphcoreOpset1's in
# popart.cpp): an argument the parameter's C++ type cannot load from makes pybind11 raise
# its "incompatible function arguments" TypeError, which names the signature.

def _text(v: Any) -> bool:
    return isinstance(v, (str, bytes))


def _scalar(ok: Any) -> Any:
    """A scalar caster's test, taking a 0-d array as its value (pybind11 converts those)."""
    return lambda v: ok(v.item() if isinstance(v, np.ndarray) and v.ndim == 0 else v)


# AttributeProto type -> (the Python type pybind11 prints, what its caster loads; None: not
# checked here)
_CASTERS = {I: ("int", _scalar(integral)), F: ("float", _scalar(real)), S: ("str", _text),
            INTS: ("List[int]", lambda v: sequence_of(v, integral)),
            FLOATS: ("List[float]", lambda v: sequence_of(v, real)),
            STRINGS: ("List[str]", lambda v: sequence_of(v, _text)),
            T: ("numpy.ndarray", None), G: ("popart_core._BuilderCore", None)}
_TENSOR_IDS = ("List[str]", lambda v: sequence_of(v, _text))
_DEBUG_CONTEXT = ("popart_core.DebugContext", lambda v: isinstance(v, (str, DebugContext)))
# ai.graphcore attributes whose Python value is a PopART enum or object (not checked here:
# the package takes their names too)
_ENUM_TYPES = {"reduction": ("ReductionType", REDUCTIONS),
               "scatter_reduction": ("ScatterReduction", SCATTER_REDUCTIONS),
               "collective_op": ("CollectiveOperator", _COLLECTIVE_OPS),
               "comm_group": ("CommGroup", ())}


_ONE_ID = {"reshape"}   # AiGraphcoreOpset1 methods taking one tensor id (builder.hpp)


def _one_id(v: Any) -> bool:
    """One tensor id; the package also takes it as a list of one, as the other ops'."""
    return _text(v) or (sequence_of(v, _text) and len(v) == 1)


class _Pybind:
    """One op method as its binding declares it: ``params`` (name, printed type, caster
    test or None, printed default or None) in order, after ``self: self_type``."""

    def __init__(self, method: str, self_type: str, params: list, returns: str) -> None:
        self.method, self.params = method, params
        shown = [f"{n}: {t}" + ("" if d is None else f" = {d}") for n, t, _, d in params]
        self.text = f"({', '.join([f'self: {self_type}'] + shown)}) -> {returns}"

    def error(self, opset: Any, positional: tuple, keywords: dict) -> ArgumentError:
        return incompatible_arguments(self.method, [self.text], (opset, *positional),
                                      kwargs=keywords)

    def bind(self, opset: Any, bind: Any, positional: tuple, keywords: dict) -> dict:
        """``bind()``'s values (with ``args``: ``positional[0]``), or pybind11's TypeError
        when the call does not fit the signature (the package's reason as a note): a
        parameter's caster cannot load the value given (None: the default, here), too many
        or unknown arguments."""
        try:
            values = bind()
        except ArgumentError as e:
            raise noted(self.error(opset, positional, keywords), str(e)) from None
        if self.params and self.params[0][0] == "args":
            values["args"] = positional[0]
        for name, kind, ok, _ in self.params:
            v = values.get(name)
            if v is not None and ok is not None and not ok(v):
                raise noted(self.error(opset, positional, keywords),
                            f"{self.method}: '{name}' must be {kind}, got {v!r}")
        return values


def _pyfloat(v: float) -> str:
    """A C++ float default as pybind11 prints it (gen_operators.py rounds it to 5 places)."""
    return repr(float(np.float32(np.round(v, 5))))


def _onnx_pybind(schema: Any, method: str, self_type: str, params: list, types: dict,
                 defaults: dict, debug: str) -> _Pybind:
    """gen_operators.py's binding of ``schema``: ``args`` (ops with inputs), ``num_outputs``
    (variadic ops), the attributes (``Attribute.CppType`` / ``DefaultValue``: no default
    when required; an ONNX default as it is; else ``Optional[...] = None`` for a scalar and
    ``[]`` for a list, ``None`` for a Reduce op's ``axes``), ``debugContext``."""
    out = [("args", *_TENSOR_IDS, None)] if schema.max_input > 0 else []
    for name in params:
        if name == debug:
            out.append((debug, *_DEBUG_CONTEXT, "''"))
            continue
        if name == "num_outputs" and name not in types:
            out.append((name, "int", _scalar(integral), None))
            continue
        kind = types[name]
        shown, ok = _CASTERS[kind]
        if name in _DTYPE_ATTRIBUTES:    # Cast's `to` is a str there; the package takes any form
            shown, ok = ("str" if schema.name == "Cast" else shown), None
        d = defaults.get(name)
        if d is REQUIRED:
            default = None
        elif kind in (INTS, FLOATS, STRINGS):
            reduce_axes = name == "axes" and "reduce" in schema.name.lower()
            shown, default = (f"Optional[{shown}]", "None") if reduce_axes else (shown, "[]")
        elif d is None or kind not in (I, F, S):
            shown, default = (f"Optional[{shown}]", "None") if kind in (I, F, S) else (shown, None)
        else:
            default = _pyfloat(d) if kind == F else repr(d.decode() if isinstance(d, bytes) else d)
        out.append((name, shown, ok, default))
    return _Pybind(method, self_type, out, "str" if schema.max_output == 1 else "List[str]")


def _graphcore_pybind(schema: OpSchema, params: list, debug: str) -> _Pybind:
    """An AiGraphcoreOpset1 method's binding from the one table (``ir.graphcore_schema``):
    enums as ``popart_core`` types, a default ``None`` as ``Optional[...] = None``."""
    attrs = {a.name: a for a in schema.attrs}
    out = [("args", "str", _one_id, None) if schema.method in _ONE_ID else ("args", *_TENSOR_IDS, None)]
    for name in params:
        a = attrs.get(name)
        if name == debug:
            out.append((debug, *_DEBUG_CONTEXT, "''"))
        elif a is None:      # num_outputs
            out.append((name, "int", _scalar(integral), None))
        elif isinstance(a.kind, str):
            enum, names = _ENUM_TYPES.get(a.kind, ("", ()))
            shown = f"popart_core.{enum}" if enum else "str"
            default = None if a.default is REQUIRED else (   # pybind11's enum repr
                f"<{enum}.{a.default}: {names.index(a.default)}>" if a.default in names
                else repr(a.default))
            out.append((name, shown, None, default))
        else:
            shown, ok = _CASTERS[a.kind]
            if a.default is REQUIRED:
                default = None
            elif a.default is None:
                shown, default = f"Optional[{shown}]", "None"
            else:
                default = _pyfloat(a.default) if a.kind == F else repr(
                    list(a.default) if isinstance(a.default, tuple) else a.default)
            out.append((name, shown, ok, default))
    returns = {0: "None", 1: "str"}.get(schema.outputs, "List[str]")
    return _Pybind(schema.method, "popart_core.AiGraphcoreOpset1", out, returns)


# ---------------------------------------------------------------------------------------
# ai.onnx / ai.onnx.ml interfaces derived from onnx.defs

# The reference names the debug parameter of these aiOnnx methods differently.
_DEBUG_PARAMETER = {"If": "name"}
_ONNX_METHOD_NAMES = {"If": "logical_if", "And": "logical_and", "Or": "logical_or",
                      "Not": "logical_not", "Xor": "logical_xor"}
_LATE_ATTRIBUTES = ("auto_pad",)  # not in PopART's bindings: keyword-only, after the others


class _UnknownOpError(UnsupportedOperatorError, AttributeError):
    """An op that does not exist at the interface's opset version."""


@functools.lru_cache(maxsize=None)
def _all_schemas() -> tuple:
    return tuple(onnx.defs.get_all_schemas_with_history())


@functools.lru_cache(maxsize=None)
def _schema_table(domain: str, version: int) -> dict:
    """Method name -> newest schema of ``domain`` with since_version <= ``version``."""
    best: dict[str, Any] = {}
    for s in _all_schemas():
        if s.domain == domain and s.since_version <= version:
            name = _ONNX_METHOD_NAMES.get(s.name, s.name.lower())
            if name not in best or best[name].since_version < s.since_version:
                best[name] = s
    # PopART's generated opsets (6..11) keep ops ONNX deprecated (Upsample-10, Scatter-11)
    return {k: s for k, s in best.items()
            if not s.deprecated or version <= POPART_MAX_AI_ONNX_OPSET}


class Opset:
    """Minimal base class for the opsets."""

    def __init__(self, builder: "Builder", version: int) -> None:
        self._builder = builder
        self.version = int(version)


class _SchemaOpset(Opset):
    """Methods made on first use from the schemas ``_schemas`` gives: ONNX's, of ``_domain``
    at ``version``, unless a subclass says otherwise."""

    _domain = ""

    def _schemas(self) -> dict:
        return _schema_table(self._domain, self.version)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        schema = self._schemas().get(name)
        if schema is None:
            raise _UnknownOpError(f"Operator '{name}' does not exist in "
                                  f"{self._domain or ONNX_DOMAIN} opset {self.version}")
        method = self._make_method(schema)
        self.__dict__[name] = method
        return method

    def __dir__(self) -> list:
        return sorted(set(super().__dir__()) | set(self._schemas()))

    def _pybind_type(self) -> str:
        """The binding's class as pybind11 names it in a signature."""
        return f"popart_core.AiOnnxMlOpset{self.version}"

    def _make_method(self, schema: Any) -> Any:
        op = f"{schema.domain or ONNX_DOMAIN}::{schema.name}-{schema.since_version}"
        attrs = sorted(schema.attributes.values(),
                       key=lambda a: (not a.required, a.name in _LATE_ATTRIBUTES, a.name))
        types = {a.name: int(a.type) for a in attrs}
        defaults = {a.name: (REQUIRED if a.required else
                             decode_attr(helper.get_attribute_value(a.default_value))
                             if a.default_value.type else None) for a in attrs}
        variadic = schema.min_output != schema.max_output
        debug = _DEBUG_PARAMETER.get(schema.name, "debugContext")
        # Split-18 has a num_outputs attribute of its own: the one parameter sets both
        params = (["num_outputs"] if variadic and "num_outputs" not in types else []) + \
            [a.name for a in attrs] + [debug]
        required = {a.name for a in attrs if a.required} | ({"num_outputs"} if variadic else set())
        late = tuple(n for n in _LATE_ATTRIBUTES if n in types)
        builder = self._builder
        opset = self.version
        name = _ONNX_METHOD_NAMES.get(schema.name, schema.name.lower())
        pybind = _onnx_pybind(schema, name, self._pybind_type(), [
            n for n in params if n not in late], types, defaults, debug)

        def method(args: Sequence[str], *positional: Any, **keywords: Any) -> Any:
            v = pybind.bind(self, lambda: _bind(op, params, required, positional,
                                                keywords, late), (args, *positional), keywords)
            args = list(args)
            if not schema.min_input <= len(args) <= schema.max_input:
                high = "inf" if schema.max_input >= 2 ** 31 - 1 else schema.max_input
                raise noted(popart_exception(f"{schema.name} has invalid number of inputs "
                                             f"{len(args)}. Must be between "
                                             f"{schema.min_input}..{high}"),
                            f"The inputs given: {args}")
            n_out = schema.min_output
            if variadic:
                n_out = int(v["num_outputs"])
                if not schema.min_output <= n_out <= schema.max_output:
                    raise popart_exception(f"Op {op}: num_outputs must be in "
                                           f"{schema.min_output}..{schema.max_output}, got {n_out}")
            attributes = [_make_attr(op, k, v[k], types[k]) for k in types
                          if not _is_unset(v.get(k)) or (   # PopART's optional Reduce axes
                              k == "axes" and schema.name.startswith("Reduce") and v.get(k) is not None)]
            if types.get("axis") == I and not _is_unset(v.get("axis")) and args and (
                    "broadcast" not in types or v.get("broadcast")):   # else axis is ignored
                builder._check_axis(op, schema.name, args[0], int(v["axis"]))
            _check_window(builder, schema.name, args, v)
            outs = builder._add_node(schema.name, schema.domain, args, attributes, n_out,
                                     v.get(debug), (schema.since_version, opset))
            return outs[0] if schema.max_output == 1 else outs

        if schema.max_input == 0:   # no inputs: no args parameter (RandomUniform, ...)
            def no_inputs(*positional: Any, **keywords: Any) -> Any:
                pybind.bind(self, lambda: _bind(op, params, required, positional,
                                                keywords, late), positional, keywords)
                return method([], *positional, **keywords)
            final = no_inputs
        else:
            final = method
        final.__name__ = schema.name.lower()
        final.__doc__ = f"Add an {op} node (see the ONNX operator documentation)."
        final.__signature__ = _signature(params, {**defaults, debug: ""},
                                         with_args=schema.max_input > 0, keyword_only=late)
        return final


class AiOnnx(_SchemaOpset):
    """The ai.onnx operators at one opset version (methods derived from onnx.defs)."""

    def __init__(self, builder: "Builder", version: int) -> None:
        if not MIN_AI_ONNX_OPSET <= int(version) <= MAX_AI_ONNX_OPSET:
            raise ValueError(f"Unsupported or unrecognized ai.onnx version: {version} "
                             f"(supported: {MIN_AI_ONNX_OPSET}..{MAX_AI_ONNX_OPSET})")
        super().__init__(builder, version)
        self.aiOnnx = self   # PopART's delegate attribute (there, the C++ opset object)

    def __str__(self) -> str:
        return f"AiOnnx{self.version}"

    def _pybind_type(self) -> str:
        return f"popart_opset{self.version}.AiOnnxOpset{self.version}"

    def constant(self, value: Any, is_value_sparse: Any = False, debugContext: Any = "") -> str:
        """Add a Constant node holding the NumPy value ``value``. From opset 11,
        ``(value, is_value_sparse=False, debugContext="")``: ``is_value_sparse`` stores the
        non-zeros of ``value`` as the ``sparse_value`` attribute (a SparseTensorProto with
        linear indices); opsets 6-10 take ``(value, debugContext="")``, as PopART's."""
        array = np.asarray(value)
        if not is_value_sparse:
            attr = _make_attr("Constant", "value", array, T)
        elif self.version < 11:
            raise popart_exception(f"Constant: is_value_sparse needs ai.onnx opset 11 or later "
                                   f"(the sparse_value attribute); this model is at {self.version}")
        else:
            flat = np.flatnonzero(array.reshape(-1)).astype(np.int64)
            attr = helper.make_attribute("sparse_value", helper.make_sparse_tensor(
                numpy_helper.from_array(array.reshape(-1)[flat], "values"),
                numpy_helper.from_array(flat, "indices"), list(array.shape)))
        return self._builder._add_node("Constant", "", [], [attr], 1, debugContext)[0]


def _constant_before_11(self: AiOnnx, value: Any, debugContext: Any = "") -> str:
    """Add a Constant node holding the NumPy value ``value`` (opsets 6-10: the second
    positional argument is the debug name, as PopART's)."""
    if not isinstance(debugContext, str) and type(debugContext).__name__ != "DebugContext":
        raise ArgumentError(f"constant(): debugContext must be a str or DebugContext, got "
                            f"{debugContext!r} (ai.onnx opset {self.version} has no "
                            f"is_value_sparse; it is opset 11's)")
    return AiOnnx.constant(self, value, False, debugContext)


class AiOnnxMl(_SchemaOpset):
    """The ai.onnx.ml operators at one opset version."""

    _domain = ONNX_ML_DOMAIN

    def __init__(self, builder: "Builder", version: int) -> None:
        super().__init__(builder, version)
        self.aiOnnxMl = self   # PopART's delegate attribute


# PopART's class names: AiOnnx6 .. AiOnnxN (and AiOnnxOpsetN aliases).
for _v in range(MIN_AI_ONNX_OPSET, MAX_AI_ONNX_OPSET + 1):
    globals()[f"AiOnnx{_v}"] = globals()[f"AiOnnxOpset{_v}"] = type(
        f"AiOnnx{_v}", (AiOnnx,), {"__doc__": f"Builder interface for ai.onnx version {_v}.",
                                   **({"constant": _constant_before_11} if _v < 11 else {})})
del _v


# ---------------------------------------------------------------------------------------
# ai.graphcore interface, from the table in ir.graphcore_schema

# The name PopART's Python layer (builder.py) gives the debug parameter of these methods
_GRAPHCORE_DEBUG_PARAMETER = {"call": "debugName", "packedDataBlock": "debugName"}


class AiGraphcore(_SchemaOpset):
    """The ai.graphcore operators (opset 1); methods come from ``ir.graphcore_schema``."""

    _domain = GRAPHCORE_DOMAIN

    def __init__(self, builder: "Builder", version: int = DEFAULT_AI_GRAPHCORE_OPSET) -> None:
        if int(version) != 1:
            raise ValueError(f"Unsupported or unrecognized ai.graphcore version: {version}")
        super().__init__(builder, version)
        self.aiGraphcore = self   # PopART's delegate attribute

    def _schemas(self) -> dict:
        return _GRAPHCORE_METHODS

    def _make_method(self, schema: OpSchema) -> Any:
        op = f"{GRAPHCORE_DOMAIN}::{schema.op_type}"
        variadic = schema.outputs == "n"
        names = [a.name for a in schema.attrs]
        debug = _GRAPHCORE_DEBUG_PARAMETER.get(schema.method, schema.debug_name)
        names.insert(len(names) if schema.debug_at is None else schema.debug_at, debug)
        params = (["num_outputs"] if variadic else []) + names
        required = {a.name for a in schema.attrs if a.default is REQUIRED} | (
            {"num_outputs"} if variadic else set())
        builder = self._builder
        pybind = _graphcore_pybind(schema, params, debug)

        def method(args: Sequence[str] = (), *positional: Any, **keywords: Any) -> Any:
            v = pybind.bind(self, lambda: _bind(op, params, required, positional,
                                                keywords), (args, *positional), keywords)
            attributes = []
            for a in schema.attrs:
                value = v.get(a.name, a.default)
                # an empty list is written for attributes every node has (as PopART does)
                if value is None or value is REQUIRED or (
                        _is_unset(value) and a.absent is not REQUIRED):
                    continue
                name, value, kind = a.name, a.encode(value), a.attr_type
                if name in _POPART_ATTR_NAMES:   # builder.cpp's reserved names
                    name = _POPART_ATTR_NAMES[name]
                    if name == COLLECTIVE_OPERATOR:   # an INT, the CollectiveOperator's index
                        value, kind = _COLLECTIVE_OPS.index(value), I
                attributes.append(_make_attr(op, name, value, kind))
            count = int(v["num_outputs"]) if variadic else schema.outputs
            args = [args] if _text(args) else list(args)
            if schema.op_type == "Call":
                _check_call(args, count, next(a.g for a in attributes if a.name == "callee"),
                            v.get(debug))
            outs = builder._add_node(schema.op_type, GRAPHCORE_DOMAIN, args, attributes,
                                     count, v.get(debug), (self.version, self.version))
            return outs[0] if schema.outputs == 1 else (None if schema.outputs == 0 else outs)

        method.__name__ = schema.method
        method.__doc__ = f"Add an {op} node."
        method.__signature__ = _signature(
            params, {debug: "", **{a.name: a.default for a in schema.attrs}})
        return method

    def init(self, shape: Sequence[int], data_type: Any, init_type: Any,
             batch_axis: Optional[int] = None, debugContext: Any = "") -> str:
        """Add an Init node: a new tensor of ``shape`` / ``data_type``, zeroed or not."""
        if isinstance(batch_axis, str):  # init(shape, dtype, init_type, debugContext)
            batch_axis, debugContext = None, batch_axis
        attrs = [_make_attr("Init", "shape", list(shape), INTS),
                 _make_attr("Init", "data_type", data_type, I) if isinstance(data_type, int)
                 else _make_attr("Init", "data_type", onnx_dtype(data_type), I),
                 _make_attr("Init", "init_type", _enum_index(init_type, ("NoInit", "Zero"),
                                                             "InitType"), I)]
        if batch_axis is not None:
            attrs.append(_make_attr("Init", "batch_axis", batch_axis, I))
        return self._builder._add_node("Init", GRAPHCORE_DOMAIN, [], attrs, 1, debugContext)[0]

    def zeros(self, shape: Sequence[int], dtype: Any = "FLOAT", debugContext: Any = "") -> str:
        """Add a Zeros node: a zero tensor of ``shape`` / ``dtype``."""
        attrs = [_make_attr("Zeros", "shape", list(shape), INTS),
                 _make_attr("Zeros", "dtype", onnx_dtype(dtype), I)]
        return self._builder._add_node("Zeros", GRAPHCORE_DOMAIN, [], attrs, 1, debugContext)[0]

    def multiconv(self, args: Sequence[Sequence[str]], dilations: Sequence = (),
                  inDilations: Sequence = (), pads: Sequence = (), outPads: Sequence = (),
                  strides: Sequence = (), availableMemoryProportions: Sequence[float] = (),
                  partialsTypes: Sequence[str] = (), planType: Optional[str] = None,
                  perConvReservedTiles: Optional[int] = None,
                  cycleBackOff: Optional[float] = None,
                  enableConvDithering: Sequence[int] = (), debugContext: Any = "") -> list[str]:
        """Add a MultiConv node: one convolution per entry of ``args`` ([data, weight, bias?])."""
        n, name = len(args), _debug_name(debugContext)
        if n < 1:
            raise BuilderError(f"MultiConvOp '{name}' has no input tensors. Provide at least "
                               f"one set of inputs")
        inputs: list[str] = []
        for conv in args:
            if len(conv) < 2:
                raise BuilderError(f"Each convolution of MultiConvOp '{name}' must have at least "
                                   f"two inputs - data and weights")
            if len(conv) > 3:
                raise BuilderError(f"Each convolution of MultiConvOp '{name}' can have at most "
                                   f"three inputs - data, weights, and bias")
            inputs += list(conv) + [""] * (3 - len(conv))
        per_conv = {"dilations": dilations, "inDilations": inDilations, "pads": pads,
                    "outPads": outPads, "strides": strides}
        for key, value in (*per_conv.items(),
                           ("availableMemoryProportions", availableMemoryProportions),
                           ("partialsTypes", partialsTypes),
                           ("enableConvDithering", enableConvDithering)):
            if len(value) not in (0, n):
                raise BuilderError(f"For MultiConvOp '{name}', number of {key} parameter sets "
                                   f"({len(value)}) does not match the number of input sets "
                                   f"({n})")
        for i, conv in enumerate(args):   # each conv as a Conv (builder_helper's verifyConvBase)
            _check_conv(self._builder, list(conv), {k: list(v[i]) if len(v) else []
                                                    for k, v in per_conv.items()})
        attrs = []
        for key, value in per_conv.items():
            if len(value):
                attrs.append(_make_attr("MultiConv", key, [x for c in value for x in c], INTS))
        for key, value, kind in (("availableMemoryProportions", availableMemoryProportions, FLOATS),
                                 ("partialsTypes", partialsTypes, STRINGS),
                                 ("enableConvDithering", enableConvDithering, INTS),
                                 ("planType", planType, S),
                                 ("perConvReservedTiles", perConvReservedTiles, I),
                                 ("cycleBackOff", cycleBackOff, F)):
            if not _is_unset(value):
                attrs.append(_make_attr("MultiConv", key, value, kind))
        return self._builder._add_node("MultiConv", GRAPHCORE_DOMAIN, inputs, attrs, n,
                                       debugContext)


class AiGraphcoreOpset1(AiGraphcore):
    """Sub-class for backwards compatibility; same as AiGraphcore."""


if __doc__ is not None:
    __doc__ += _describe_graphcore_ops()


# ---------------------------------------------------------------------------------------
# Context managers

class _AttributeContext:
    """Applies node attributes to every node created inside a ``with`` block."""

    def __init__(self, builder: "Builder", values: dict) -> None:
        self._builder, self._values = builder, values

    def __enter__(self) -> "_AttributeContext":
        for key, value in self._values.items():
            self._builder._context.setdefault(key, []).append(value)
        return self

    def __exit__(self, *exc: Any) -> None:
        for key in self._values:
            stack = self._builder._context[key]
            stack.pop()
            if not stack:
                del self._builder._context[key]


class _NameScope:
    def __init__(self, builder: "Builder", name: str) -> None:
        self._builder, self._name = builder, name

    def __enter__(self) -> "_NameScope":
        self._builder._scope.append(self._name)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._builder._scope.pop()


# ---------------------------------------------------------------------------------------
# Builder

class _Model:
    """What the root builder and its sub-graph builders share."""

    def __init__(self) -> None:
        self.template = onnx.ModelProto()      # metadata, producer, opset imports of a loaded model
        self.onnx_version: Optional[int] = None
        self.opsets: dict[str, int] = {}       # other domains
        self.used_ids: set[str] = set()
        self.node_names: set[str] = set()
        self.id_counts: dict[tuple, int] = {}
        self.revision = 0                      # bumped on every change (shape cache key)
        self.shape_cache: tuple = (-1, {}, False)   # (revision, types, engine part done)
        self.shape_error = ""                  # why the engine's inference failed, if it did
        self.subgraph_count = 0
        self.node_count = 0                    # nodes added (their __debug_info_id)


# What Builder::getVirtualGraph / getPipelineStage / getExecutionPhase call their attribute
_SCOPE_NAMES = {"virtualGraph": "Virtual graph", "pipelineStage": "Pipeline stage",
                "executionPhase": "Execution phase"}


class Builder:
    """Build an ONNX model: inputs, weights, ops (``aiOnnx``, ``aiGraphcore``), outputs and
    PopART's annotations. ``Builder(model)`` extends an existing model (file path, bytes or
    ModelProto)."""

    def __init__(self, modelProtoOrFilename: Union[str, bytes, onnx.ModelProto, None] = None,
                 opsets: Optional[dict] = None, builderCore: Optional["Builder"] = None) -> None:
        if builderCore is not None:  # share the state of an existing builder
            self.__dict__ = builderCore.__dict__
            return
        self._shared = _Model()
        self._parent: Optional[Builder] = None
        self._graph = onnx.GraphProto(name="BuilderGraph")
        self._known: set[str] = set()
        self._order: list[str] = []   # graph inputs and initializers, as added (PopART's inputs)
        self._from_parent: set[str] = set()   # inputs added by addInputTensorFromParentGraph
        self._context: dict[str, list] = {}
        self._scope: list[str] = []
        self._scope_prefix = ""
        if modelProtoOrFilename is not None:
            self._load(modelProtoOrFilename)
        for domain, version in (opsets or {}).items():
            if domain in ("ai.onnx", ""):
                self._select_onnx_version(int(version))
            else:
                self._shared.opsets[domain] = int(version)
        if GRAPHCORE_DOMAIN in self._shared.opsets:
            AiGraphcore(self, self._shared.opsets[GRAPHCORE_DOMAIN])  # validates the version

    def _load(self, source: Union[str, bytes, onnx.ModelProto]) -> None:
        try:
            if isinstance(source, onnx.ModelProto):
                model = source
            elif isinstance(source, (bytes, bytearray)):
                model = onnx.ModelProto()
                model.ParseFromString(bytes(source))
            elif os.path.exists(str(source)):
                model = onnx.load(str(source), load_external_data=False)
                _keep_external_data(model, os.path.dirname(os.path.abspath(str(source))))
            else:
                raise ModelError(f"Builder: '{source}' is neither an existing ONNX file nor a "
                                 f"serialized ModelProto")
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"Builder: cannot read ONNX model from {str(source)[:200]!r}: {e}") \
                from None
        shared = self._shared
        shared.template.CopyFrom(model)
        shared.template.ClearField("graph")
        self._graph.CopyFrom(model.graph)
        for op in model.opset_import:
            if op.domain in ("", ONNX_DOMAIN):
                shared.onnx_version = op.version
            else:
                shared.opsets[op.domain] = op.version
        g = self._graph
        self._order = list(dict.fromkeys([v.name for v in g.input]
                                         + [t.name for t in g.initializer]))
        self._known = ({v.name for v in g.input} | {t.name for t in g.initializer}
                       | {o for n in g.node for o in n.output if o})
        shared.used_ids |= _all_names(g)
        shared.node_names |= {n.name for sub in _all_graphs(g) for n in sub.node}

    # -- opsets -------------------------------------------------------------------------

    def _select_onnx_version(self, version: int, name: str = "") -> None:
        """The first ai.onnx opset a Builder uses wins (PopART's builder.py); another one
        after it raises PopART's RuntimeError."""
        chosen = self._shared.onnx_version
        if chosen is not None and chosen != version:
            raise BuilderError(f"Invalid opset '{name or f'aiOnnxOpset{version}'}' selected. "
                               f"Opset for domain ai.onnx already defined as {chosen}")
        AiOnnx(self, version)  # validates the version
        self._shared.onnx_version = version

    @property
    def aiOnnx(self) -> AiOnnx:
        """The chosen ai.onnx opset; opset 10 (``popart.defaultAiOnnxOpset``) if none is."""
        return self._onnx_opset(self._shared.onnx_version or DEFAULT_AI_ONNX_OPSET, "aiOnnx")

    def _onnx_opset(self, version: int, name: str = "") -> AiOnnx:
        self._select_onnx_version(version, name)
        key = f"_aiOnnx{version}"
        if key not in self.__dict__:
            self.__dict__[key] = globals()[f"AiOnnx{version}"](self, version)
        return self.__dict__[key]

    def __getattr__(self, name: str) -> Any:
        m = re.fullmatch(r"aiOnnxOpset(\d+)", name)
        if m:
            return self._onnx_opset(int(m.group(1)), name)
        raise AttributeError(f"'Builder' object has no attribute '{name}'")

    def aiOnnxOpsetVersion(self, version: int) -> None:
        """Check that ai.onnx opset ``version`` exists (ValueError if not). As in PopART, it
        chooses nothing: ``aiOnnx`` is still the opset chosen by the constructor or the
        first ``aiOnnxOpsetN`` used, else opset 10."""
        if not isinstance(version, (int, np.integer)) or not (
                MIN_AI_ONNX_OPSET <= int(version) <= MAX_AI_ONNX_OPSET):
            raise ValueError(f"Unsupported or unrecognized ai.Onnx version: {version}")

    @property
    def aiGraphcore(self) -> AiGraphcore:
        if "_aiGraphcore" not in self.__dict__:
            version = self._shared.opsets.get(GRAPHCORE_DOMAIN, DEFAULT_AI_GRAPHCORE_OPSET)
            self.__dict__["_aiGraphcore"] = AiGraphcoreOpset1(self, version)
        return self.__dict__["_aiGraphcore"]

    aiGraphcoreOpset1 = aiGraphcore

    @property
    def aiOnnxMl(self) -> AiOnnxMl:
        if "_aiOnnxMl" not in self.__dict__:
            version = self._shared.opsets.setdefault(ONNX_ML_DOMAIN, 1)
            self.__dict__["_aiOnnxMl"] = AiOnnxMl(self, version)
        return self.__dict__["_aiOnnxMl"]

    aiOnnxMlOpset1 = aiOnnxMl

    # -- tensors ------------------------------------------------------------------------

    def _has_tensor(self, tensor_id: str) -> bool:
        b: Optional[Builder] = self
        while b is not None:
            if tensor_id in b._known:
                return True
            b = b._parent
        return False

    def _new_id(self, base: str, used: Optional[set] = None) -> str:
        """``base``, or ``base/1``, ``base/2``, ... : the first not in ``used`` (tensor ids)."""
        shared = self._shared
        used = shared.used_ids if used is None else used
        uid, n = base, shared.id_counts.get((id(used), base), 0)
        while uid in used:
            n += 1
            uid = f"{base}/{n}"
        shared.id_counts[(id(used), base)] = n
        used.add(uid)
        return uid

    def _changed(self) -> None:
        self._shared.revision += 1

    def addInputTensor(self, tensorInfo: Any, *args: Any, **kwargs: Any) -> str:
        """Add a graph input: ``(TensorInfo, [settings], debugContext='')`` or
        ``(dtype, shape, [settings], debugContext='')``."""
        args = list(args)
        if isinstance(tensorInfo, TensorInfo):
            info = tensorInfo
        else:
            shape = kwargs.pop("shape", None)
            if shape is None:
                if not args:
                    raise popart_exception(f"addInputTensor: a shape is needed with data type "
                                           f"{tensorInfo!r}")
                shape = args.pop(0)
            info = TensorInfo(tensorInfo, shape)
        kwargs.pop("settings", None)
        debug = next((kwargs.pop(k) for k in _DEBUG_KEYWORDS if k in kwargs), "")
        if kwargs:
            raise popart_exception(f"addInputTensor: unexpected argument(s) {sorted(kwargs)}")
        for a in args:  # optional InputSettings (ignored), then a debug name
            if isinstance(a, str) or type(a).__name__ == "DebugContext":
                debug = a
        tid = self._new_id(self.getNameScope(_debug_name(debug) or "input"))
        self._graph.input.append(helper.make_tensor_value_info(tid, info.onnx_dtype(),
                                                               info.shape()))
        self._known.add(tid)
        self._order.append(tid)
        self._changed()
        return tid

    def addUntypedInputTensor(self, debugContext: Any = "") -> str:
        """Add an input without type or shape: sub-graphs only (the main graph's inputs
        need a type, as ONNX and PopART require)."""
        if self._parent is None:
            raise BuilderError("Can not add untyped tensors to the top-level graph. Use "
                               "Builder::addInputTensor(const TensorInfo &tensorInfo, const "
                               "std::string &debugPrefix) instead.")
        tid = self._new_id(self.getNameScope(_debug_name(debugContext) or "input"))
        self._graph.input.append(onnx.ValueInfoProto(name=tid))
        self._known.add(tid)
        self._order.append(tid)
        self._changed()
        return tid

    def addInputTensorFromParentGraph(self, tensorId: str) -> None:
        """Add an input of this sub-graph named as the parent graph's tensor ``tensorId``."""
        if self._parent is None or not self._parent._has_tensor(tensorId):
            raise popart_exception(f"addInputTensorFromParentGraph: tensor '{tensorId}' is not "
                                   f"in a parent graph of this builder")
        value = onnx.ValueInfoProto(name=tensorId)
        found = self._parent._find_value_info(tensorId)
        if found is not None:
            value.CopyFrom(found)
        self._graph.input.append(value)
        self._known.add(tensorId)
        self._order.append(tensorId)
        self._from_parent.add(tensorId)
        self._changed()

    def addInitializedInputTensor(self, initVal: Any, *args: Any, **kwargs: Any) -> str:
        """Add a weight initialised to the NumPy array ``initVal``:
        ``(initVal, [variableSettings], debugContext='')``."""
        kwargs.pop("variableSettings", None)
        debug = next((kwargs.pop(k) for k in _DEBUG_KEYWORDS if k in kwargs), "")
        if kwargs:
            raise popart_exception(f"addInitializedInputTensor: unexpected argument(s) "
                                   f"{sorted(kwargs)}")
        for a in args:
            if isinstance(a, str) or type(a).__name__ == "DebugContext":
                debug = a
        array = np.asarray(initVal)
        if array.dtype == np.float64 and not isinstance(initVal, np.ndarray):
            array = array.astype(np.float32)
        tid = self._new_id(self.getNameScope(_debug_name(debug) or "init_input"))
        try:
            tensor = initializer_proto(array, tid, pack_half=True)   # PopART's storage form
        except Exception as e:
            raise popart_exception(f"addInitializedInputTensor: cannot store an array of dtype "
                                   f"{array.dtype} ({e})") from None
        # BuilderImpl::addInitializedInputTensor: a graph input too, then its initializer
        self._graph.input.append(helper.make_tensor_value_info(tid, tensor.data_type,
                                                               list(array.shape)))
        self._graph.initializer.append(tensor)
        self._known.add(tid)
        self._order.append(tid)
        self._changed()
        return tid

    def addOutputTensor(self, outputName: str) -> None:
        """Mark ``outputName`` as an output of this graph."""
        if not self._has_tensor(outputName):
            raise popart_exception(f"addOutputTensor: tensor '{outputName}' does not exist in "
                                   f"this graph")
        if outputName in {o.name for o in self._graph.output}:
            return
        value = self._find_value_info(outputName)
        self._graph.output.append(value if value is not None
                                  else onnx.ValueInfoProto(name=outputName))
        self._changed()

    def _find_value_info(self, tensor_id: str) -> Optional[onnx.ValueInfoProto]:
        b: Optional[Builder] = self
        while b is not None:
            for v in list(b._graph.input) + list(b._graph.output) + list(b._graph.value_info):
                if v.name == tensor_id and v.type.HasField("tensor_type"):
                    return v
            for t in b._graph.initializer:
                if t.name == tensor_id:
                    return helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
            b = b._parent
        return None

    def _check_axis(self, op: str, op_type: str, tensor_id: str, axis: int) -> None:
        """Raise for an 'axis' out of range of ``tensor_id`` when its rank is declared (other
        ranks are checked when the session compiles)."""
        from .engine.lower import axis_problem
        vi = self._find_value_info(tensor_id) if tensor_id else None
        if vi is not None and vi.type.tensor_type.HasField("shape"):
            problem = axis_problem(op_type, axis, len(vi.type.tensor_type.shape.dim), tensor_id)
            if problem:
                raise noted(popart_exception(problem), f"Op {op}: axis {axis} of input "
                             f"'{tensor_id}'")

    # -- nodes --------------------------------------------------------------------------

    def _add_node(self, op_type: str, domain: str, inputs: Sequence[str],
                  attributes: Sequence[AttributeProto], num_outputs: int,
                  debug: Any = "", versions: Optional[tuple] = None) -> list[str]:
        """Append a node; returns its output ids. ``attributes`` are AttributeProtos;
        ``versions`` = (the op's version, the opset's) for the DEBUG line, found if None.
        As PopART's, the node gets a ``__debug_info_id``: the id of the "popartbuilder"
        DebugInfo recording the call while a debug-info file is recorded, else the node's
        number in the model (so that building the same model twice gives the same bytes,
        which the engine cache compares)."""
        domain = "" if domain in ("", ONNX_DOMAIN) else domain
        what = f"{domain or ONNX_DOMAIN}::{op_type}"
        if isinstance(inputs, str):
            raise ArgumentError(f"Op {what}: inputs must be a list of tensor ids, got the "
                                f"string '{inputs}'")
        for tid in inputs:
            if not isinstance(tid, str):
                raise ArgumentError(f"Op {what}: inputs must be tensor ids (str), got "
                                    f"{tid!r}")
            if tid and not self._has_tensor(tid):
                raise popart_exception(f"Op {what}: input tensor '{tid}' does not exist in this "
                                       f"graph or an enclosing one")
        info = _BuilderDebugInfo(debug, op_type, inputs)
        if _BUILDER_LOG.isEnabledFor("DEBUG"):
            op_version, opset = versions or self._op_versions(op_type, domain)
            path = debug.getPathName() if isinstance(debug, DebugContext) else _debug_name(debug)
            _BUILDER_LOG.debug("Adding {}.{}:{} to builder opset:{}, numInputs:{} numOutputs:{} "
                               "numAttributes:{} name:{}", domain or ONNX_DOMAIN, op_type,
                               op_version, opset, len(inputs), num_outputs,
                               len(attributes) + 1, path)
        base = self.getNameScope(_debug_name(debug) or op_type)
        outputs = [self._new_id(f"{base}:{i}") for i in range(num_outputs)]
        self._shared.node_count += 1
        if info is not None:
            info.setValue("outputs", outputs)
        name = self._new_id(base, self._shared.node_names)
        node = helper.make_node(op_type, list(inputs), outputs, name=name, domain=domain)
        node.attribute.extend(attributes)
        node.attribute.append(helper.make_attribute(
            DEBUG_INFO_ID, info.getId() if info is not None else self._shared.node_count))
        names = {a.name for a in attributes}
        for key, stack in self._context.items():
            if key not in names:
                value = ([f"{k}:{v}" for d in stack for k, v in d.items()]
                         if key == OUTLINE_ATTRIBUTES else stack[-1])
                node.attribute.append(helper.make_attribute(key, value))
        self._graph.node.append(node)
        self._known.update(outputs)
        self._changed()
        return outputs

    def _op_versions(self, op_type: str, domain: str) -> tuple[int, int]:
        """(the op's since-version, the opset's version) of a node about to be added."""
        if domain in ("", ONNX_DOMAIN, ONNX_ML_DOMAIN):
            opset = (self._shared.onnx_version or DEFAULT_AI_ONNX_OPSET if not domain
                     else self._shared.opsets.get(domain, 1))
            try:
                return onnx.defs.get_schema(op_type, opset, domain).since_version, opset
            except Exception:
                return opset, opset
        version = self._shared.opsets.get(domain, DEFAULT_AI_GRAPHCORE_OPSET)
        return version, version

    def customOp(self, opName: str, opVersion: int, domain: str, inputs: Sequence[str],
                 attributes: Optional[dict] = None, numOutputs: int = 1,
                 name: str = "") -> list[str]:
        """Add a node of any op type / domain; attribute types are inferred from the values."""
        domain = "" if domain in ("", ONNX_DOMAIN) else domain
        if domain:
            self._shared.opsets[domain] = max(self._shared.opsets.get(domain, 0), int(opVersion))
        attrs = [_make_attr(opName, k, v) for k, v in (attributes or {}).items()
                 if not _is_unset(v)]
        return self._add_node(opName, domain, list(inputs), attrs, int(numOutputs), name)

    def reshape_const(self, aiOnnx: Opset, args: Sequence[str], shape: Iterable[int],
                      debugContext: str = "") -> str:
        """Reshape ``args[0]`` to ``shape`` through a Constant shape tensor."""
        debug = _debug_name(debugContext)
        new_shape = aiOnnx.constant(np.array(list(shape), dtype=np.int64),
                                    debug + "_const" if debug else "")
        return aiOnnx.reshape([args[0], new_shape], debugContext)

    def createSubgraphBuilder(self) -> "Builder":
        """A child builder whose graph becomes a GraphProto attribute (If / Loop / Scan /
        Call); it can read this graph's tensors."""
        child = Builder.__new__(Builder)
        child.__dict__.update(_shared=self._shared, _parent=self, _known=set(), _order=[], _from_parent=set(), _context={},
                              _scope=[], _scope_prefix=self.getNameScope())
        self._shared.subgraph_count += 1
        child._graph = onnx.GraphProto(name=f"subgraph_{self._shared.subgraph_count}")
        return child

    def _subgraph_proto(self, captures: bool = False) -> onnx.GraphProto:
        """This sub-graph as a GraphProto. ``captures`` (an If branch, which ONNX gives no
        inputs): the inputs added by addInputTensorFromParentGraph are left out, so the
        branch reads those tensors of the enclosing graph by name, as PopART's If does. A
        Call body keeps them: its inputs bind to the Call's inputs by position."""
        if self._parent is None:
            raise popart_exception("A main graph builder cannot be used as a sub-graph: "
                                   "use createSubgraphBuilder()")
        g = onnx.GraphProto()
        g.CopyFrom(self._graph)
        if captures:
            kept = [v for v in g.input if v.name not in self._from_parent]
            del g.input[:]
            g.input.extend(kept)
        return g

    # -- the model ----------------------------------------------------------------------

    def _root(self) -> "Builder":
        b = self
        while b._parent is not None:
            b = b._parent
        return b

    def _model(self, external: bool = True, typed: bool = True) -> onnx.ModelProto:
        """The ModelProto; ``typed``: give untyped graph outputs their inferred types.
        Initializers saved externally (saveInitializersExternally, or external in a loaded
        model) stay external either way (``external`` is kept for callers)."""
        shared = self._shared
        model = onnx.ModelProto()
        model.CopyFrom(shared.template)
        model.graph.CopyFrom(self._root()._graph)
        versions = {"": shared.onnx_version or DEFAULT_AI_ONNX_OPSET}
        for domain in sorted(_node_domains(model.graph)):
            if domain not in versions:
                versions[domain] = shared.opsets.get(domain, 1)
        for op in model.opset_import:  # keep the loaded model's other imports
            if op.domain not in ("", ONNX_DOMAIN):
                versions.setdefault(op.domain, op.version)
        del model.opset_import[:]
        model.opset_import.extend(helper.make_opsetid(d, v) for d, v in versions.items())
        # IR >= 4: initializers need not be graph inputs (7 = ONNX 1.8, read by every runtime)
        model.ir_version = max(model.ir_version, 7,
                               helper.find_min_ir_version_for(list(model.opset_import), True))
        if not model.producer_name:
            model.producer_name = "popart-xla"
        if typed:
            self._type_outputs(model)
        return model

    def _type_outputs(self, model: onnx.ModelProto) -> None:
        untyped = [v for g in _all_graphs(model.graph) for v in g.output
                   if not v.type.HasField("tensor_type")]
        if not untyped:
            return
        types = self._inferred_types()
        for v in untyped:
            if v.name in types:
                elem, shape = types[v.name]
                v.CopyFrom(helper.make_tensor_value_info(
                    v.name, elem, [d if d >= 0 else None for d in shape]))

    def getModelProto(self, humanReadable: bool = False) -> bytes:
        """The serialized ModelProto (bytes)."""
        model = self._model()
        return str(model).encode() if humanReadable else model.SerializeToString()

    def saveModelProto(self, filename: str) -> None:
        """Check the model with ``onnx.checker`` and write it to ``filename`` atomically.
        Externally saved initializers stay where saveInitializersExternally put them (their
        locations as given, absolute or relative to the working directory, as in PopART:
        the checker is not asked about their files)."""
        model = self._model()
        try:
            onnx.checker.check_model(for_checker(model))
        except onnx.checker.ValidationError as e:
            raise ModelError(f"saveModelProto: the model is not valid ONNX: {e}") from None
        atomic_write(filename, model.SerializeToString())

    def saveInitializersExternally(self, ids: Sequence[str], filename: str) -> None:
        """Save the data of the initializers ``ids`` to the file ``filename`` now, one after
        the other (PopART's onnxutil::saveInitializersExternally): ``filename`` is absolute
        or relative to the working directory, and the model's initializers refer to it as
        given (location, length, offset). Errors (each before anything is written): the
        parent directory does not exist, a tensor is not an initializer, already has an
        external data_location, or has no data. Initializers saved to the same file by an
        earlier call keep their data: the new ones are appended."""
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(filename, (str, os.PathLike)) or not os.fspath(filename):
            raise popart_exception(f"saveInitializersExternally: filename must be a non-empty "
                                   f"path, got {filename!r}")
        save_initializers_externally(self._root()._graph, list(dict.fromkeys(ids)),
                                     os.fspath(filename))
        self._changed()

    def embedReplicationFactor(self, replicationFactor: int) -> None:
        """Record the replication factor in the model's metadata ("replicationFactor")."""
        helper.set_model_props(self._shared.template, {
            **{p.key: p.value for p in self._shared.template.metadata_props},
            "replicationFactor": str(int(replicationFactor))})

    def setGraphName(self, name: str) -> None:
        self._graph.name = name

    def getInputTensorIds(self) -> list[str]:
        """The graph's inputs, initializers (weights) included, in the order they were
        added: PopART's Builder makes every initializer a graph input too."""
        return list(self._order)

    def getOutputTensorIds(self) -> list[str]:
        return [v.name for v in self._graph.output]

    def getValueTensorIds(self) -> list[str]:
        """Ids of every node's outputs, graph outputs included (PopART's value_info, which
        its Builder fills for each node output as the node is added)."""
        return [o for n in self._graph.node for o in n.output if o]

    def getTrainableTensorIds(self) -> list[str]:
        """Initializers of a floating-point type."""
        return [t.name for t in self._graph.initializer if t.data_type in _FLOAT_TYPES]

    def isInitializer(self, id: str) -> bool:
        return any(t.name == id for t in self._graph.initializer)

    def _inferred_types(self, engine: bool = True) -> dict:
        """Tensor id -> (ONNX elem type, shape) for every tensor whose type is known, from
        declarations, ONNX shape inference, PopART's Builder-time rules and (``engine``: for
        ops ONNX does not know) the engine."""
        shared = self._shared
        revision, cache, complete = shared.shape_cache
        if revision == shared.revision and (complete or not engine):
            return cache
        model = self._model(external=False, typed=False)
        if revision != shared.revision:
            cache = self._onnx_types(model)
        if engine and any(o not in cache for g in _all_graphs(model.graph) for n in g.node
                          for o in n.output if o):
            try:  # best effort: the engine may not lower every op
                from .engine.shapes import infer_tensor_infos
                for tid, info in infer_tensor_infos(model).items():
                    cache.setdefault(tid, (info.onnx_dtype(), info.shape()))
            except Exception as e:
                shared.shape_error = f"{type(e).__name__}: {e}"
        shared.shape_cache = (shared.revision, cache, engine)
        return cache

    def _onnx_types(self, model: onnx.ModelProto) -> dict:
        """The types ONNX shape inference and PopART's Builder-time rules (defs.cpp) find."""
        cache: dict = {}
        self._shared.shape_error = ""
        for g in _all_graphs(model.graph):   # ONNX reads a Constant's other attribute as
            for n in g.node:                  # its value: only 'value' (a copy of the model)
                if n.op_type == "Constant" and any(a.name == DEBUG_INFO_ID for a in n.attribute):
                    kept = [a for a in n.attribute if a.name != DEBUG_INFO_ID]
                    del n.attribute[:]
                    n.attribute.extend(kept)
        try:
            model = onnx.shape_inference.infer_shapes(model)
        except Exception:
            pass
        for g in _all_graphs(model.graph):
            for t in g.initializer:
                cache[t.name] = (t.data_type, list(t.dims))
            for v in list(g.input) + list(g.output) + list(g.value_info):
                tt = v.type.tensor_type
                if tt.elem_type and tt.HasField("shape"):
                    cache[v.name] = (tt.elem_type, [d.dim_value if d.HasField("dim_value")
                                                    else -1 for d in tt.shape.dim])
        for g in _all_graphs(model.graph):   # PopART's Builder-time rules (defs.cpp)
            for n in g.node:
                rule = _BUILDER_SHAPE_RULES.get(n.op_type) if n.domain == GRAPHCORE_DOMAIN \
                    else None
                types = [cache.get(i) for i in n.input]
                if rule and n.output and types and types[0] is not None:
                    found = rule(n, types)
                    if found is not None:
                        cache[n.output[0]] = found
        return cache

    def _known_shape(self, tensor_id: str) -> Optional[list[int]]:
        """The shape of ``tensor_id`` where it is known now (declared or inferred, every
        dimension known), else None: PopART's Builder checks only such shapes."""
        if not tensor_id or not self._has_tensor(tensor_id):
            return None
        declared = self._find_value_info(tensor_id)
        if declared is not None and declared.type.tensor_type.HasField("shape"):
            dims = declared.type.tensor_type.shape.dim
            shape = [d.dim_value if d.HasField("dim_value") else -1 for d in dims]
        else:   # ONNX's inference and PopART's rules only: as PopART's Builder knows them
            shape = self._inferred_types(engine=False).get(tensor_id, (0, [-1]))[1]
        return None if any(d < 0 for d in shape) else list(shape)

    def _tensor_type(self, tensor_id: str) -> tuple[int, list[int]]:
        if not self._has_tensor(tensor_id):
            raise popart_exception(f"Tensor '{tensor_id}' does not exist in this graph")
        declared = self._find_value_info(tensor_id)
        if declared is not None and declared.type.tensor_type.HasField("shape"):
            tt = declared.type.tensor_type
            return tt.elem_type, [d.dim_value if d.HasField("dim_value") else -1
                                  for d in tt.shape.dim]
        cache = self._inferred_types()
        if tensor_id not in cache:
            raise popart_exception(f"The type and shape of tensor '{tensor_id}' are not known: "
                                   f"shape inference could not determine them "
                                   f"{self._shared.shape_error}".rstrip())
        return cache[tensor_id]

    def getTensorShape(self, id: str) -> list[int]:
        return list(self._tensor_type(id)[1])

    def getTensorDtypeString(self, id: str) -> str:
        """Lower-case dtype name as PopART: "float32", "float16", "int32", "bool", ..."""
        dtype = to_datatype(self._tensor_type(id)[0])
        return "string" if dtype == DataType.STRING else np_dtype(dtype).name

    # -- name scopes and annotations -----------------------------------------------------

    def nameScope(self, name: str) -> _NameScope:
        """Context manager: node names and new tensor ids get the prefix ``name/``."""
        return _NameScope(self, name)

    def getNameScope(self, name: str = "") -> str:
        return self._scope_prefix + "".join(s + "/" for s in self._scope) + name

    def _find_node(self, nodeOutputNames: Union[str, Iterable[str]]) -> onnx.NodeProto:
        names = _as_id_set(nodeOutputNames)
        found = [n for n in self._graph.node if names and all(o in n.output for o in names)]
        if len(found) != 1:
            raise noted(BuilderError(f"Could not find a node with outputs "
                                      f"{' ,'.join(sorted(set(names)))}. Must specify all "
                                      "outputs of a node"),
                         f"No unique node has output(s) {names}: found {len(found)}")
        return found[0]

    def _add_attributes(self, nodeOutputNames: Union[str, Iterable[str]], values: dict) -> None:
        """Add attributes (name -> already-encoded value) to one node, all or none: as
        PopART's, an attribute the node already has is an error."""
        node = self._find_node(nodeOutputNames)
        have = {a.name for a in node.attribute}
        for name in values:
            if name in have:
                raise noted(BuilderError(f"Node already has attribute {name}."),
                             f"Node '{node.name}' ({node.op_type}); remove it first with "
                             "removeNodeAttribute")
        attrs = [_make_attr(node.op_type, k, v) for k, v in values.items()]
        node.attribute.extend(attrs)
        self._changed()

    def addNodeAttribute(self, attributeName: str, attributeValue: Any,
                         nodeOutputNames: Union[str, Iterable[str]]) -> None:
        """Add an attribute to the node producing ``nodeOutputNames`` (all of them outputs
        of that one node); BuilderError if it already has one of that name."""
        self._add_attributes(nodeOutputNames, {attributeName: attributeValue})

    def nodeHasAttribute(self, attributeName: str,
                         nodeOutputNames: Union[str, Iterable[str]]) -> bool:
        return any(a.name == attributeName for a in self._find_node(nodeOutputNames).attribute)

    def _get_attr(self, name: str, names: Union[str, Iterable[str]], kind: Optional[int],
                  bool_: bool = False) -> Any:
        node = self._find_node(names)
        for a in node.attribute:
            if a.name == name:
                if kind is not None and a.type != kind:   # builder_impl.cpp's texts
                    what = "a int" if bool_ else _ATTR_KIND_TEXT[kind]
                    raise noted(popart_exception(f"Attribute {name} is not {what}."),
                                 f"Attribute '{name}' of node '{node.name}' is "
                                 f"{AttributeProto.AttributeType.Name(a.type)}")
                value = helper.get_attribute_value(a)
                return ([v.decode() for v in value] if a.type == STRINGS
                        else value.decode() if a.type == S else
                        list(value) if a.type in (INTS, FLOATS) else value)
        raise noted(popart_exception(f"Node does not have an attribute {name}."),
                     f"Node '{node.name}' ({node.op_type}) has attributes "
                     f"{[a.name for a in node.attribute]}")

    def getInt64NodeAttribute(self, attributeName: str, nodeOutputNames: Any) -> int:
        return self._get_attr(attributeName, nodeOutputNames, I)

    def getInt64VectorNodeAttribute(self, attributeName: str, nodeOutputNames: Any) -> list[int]:
        return self._get_attr(attributeName, nodeOutputNames, INTS)

    def getFloatNodeAttribute(self, attributeName: str, nodeOutputNames: Any) -> float:
        return self._get_attr(attributeName, nodeOutputNames, F)

    def getFloatVectorNodeAttribute(self, attributeName: str, nodeOutputNames: Any) -> list[float]:
        return self._get_attr(attributeName, nodeOutputNames, FLOATS)

    def getStringNodeAttribute(self, attributeName: str, nodeOutputNames: Any) -> str:
        return self._get_attr(attributeName, nodeOutputNames, S)

    def getStringVectorNodeAttribute(self, attributeName: str, nodeOutputNames: Any) -> list[str]:
        return self._get_attr(attributeName, nodeOutputNames, STRINGS)

    def getBoolNodeAttribute(self, attributeName: str, nodeOutputNames: Any) -> bool:
        return bool(self._get_attr(attributeName, nodeOutputNames, I, bool_=True))

    def removeNodeAttribute(self, attributeName: str, nodeOutputNames: Any) -> None:
        node = self._find_node(nodeOutputNames)
        kept = [a for a in node.attribute if a.name != attributeName]
        if len(kept) == len(node.attribute):
            raise noted(BuilderError(f"Cannot remove attribute {attributeName} as it does "
                                      "not exist."),
                         f"Node '{node.name}' has attributes {[a.name for a in node.attribute]}")
        del node.attribute[:]
        node.attribute.extend(kept)
        self._changed()

    def getAllNodeAttributeNames(self, nodeOutputNames: Any) -> list[str]:
        return [a.name for a in self._find_node(nodeOutputNames).attribute]

    def _annotate(self, attr: str, target: Any, value: Any,
                  encode: Any) -> Optional[_AttributeContext]:
        """Setter on the node whose outputs ``target`` names (as PopART's, an error if it is
        set already) or context manager (``target`` = value)."""
        if isinstance(target, (str, list, tuple, set, frozenset)):
            self.addNodeAttribute(attr, encode(value), _as_id_set(target))
            return None
        return _AttributeContext(self, {attr: encode(value if target is None else target)})

    def virtualGraph(self, nodeOutputNames: Any = None,
                     value: int = 0) -> Optional[_AttributeContext]:
        """``virtualGraph(ids, n)`` places nodes on virtual graph n; ``with virtualGraph(n)``."""
        return self._annotate(VIRTUAL_GRAPH, nodeOutputNames, value, int)

    def pipelineStage(self, nodeOutputNames: Any = None,
                      value: int = 0) -> Optional[_AttributeContext]:
        return self._annotate(PIPELINE_STAGE, nodeOutputNames, value, int)

    def executionPhase(self, nodeOutputNames: Any = None,
                       value: int = 0) -> Optional[_AttributeContext]:
        return self._annotate(EXECUTION_PHASE, nodeOutputNames, value, int)

    def schedulePriority(self, value: float = 0.0) -> _AttributeContext:
        """``with schedulePriority(p)``: nodes added inside get schedule priority ``p``."""
        return self._annotate(SCHEDULE_PRIORITY, None, value, float)

    def recomputeOutput(self, nodeOutputNames: Any = None,
                        value: Any = RecomputeType.Undefined) -> Optional[_AttributeContext]:
        return self._annotate(RECOMPUTE_OUTPUT, nodeOutputNames, value, _recompute_value)

    def recomputeOutputInBackwardPass(self, nodeOutputNames: Any,
                                      value: Any = RecomputeType.Recompute) -> None:
        self._annotate(RECOMPUTE_OUTPUT, _as_id_set(nodeOutputNames), value, _recompute_value)

    def getRecomputeOutputInBackwardPass(self, nodeOutputNames: Any) -> bool:
        return (self.nodeHasAttribute(RECOMPUTE_OUTPUT, nodeOutputNames) and
                self.getInt64NodeAttribute(RECOMPUTE_OUTPUT, nodeOutputNames)
                == RecomputeType.Recompute)

    def checkpointOutput(self, nodeOutputNames: Sequence[str]) -> list[str]:
        """Add an Identity marked Checkpoint after each tensor; returns the new ids."""
        with self.recomputeOutput(RecomputeType.Checkpoint):
            return [self._add_node("Identity", "", [t], [], 1, "Checkpoint")[0]
                    for t in _as_id_set(nodeOutputNames)]

    def outputTensorLocation(self, nodeOutputNames: Any = None,
                             value: Any = None) -> Optional[_AttributeContext]:
        """Where the output is stored: INTS [storage, loadTileSet, storageTileSet, rts]."""
        return self._annotate(OUTPUT_TENSOR_LOCATION, nodeOutputNames, value, _tensor_location)

    def commGroup(self, type: Any = 0, groupSize: int = 0) -> _AttributeContext:
        """Context manager: nodes get ``__collectiveCommGroup`` INTS [type, groupSize], as
        PopART's Builder writes it (collectives read it when they have no commGroup)."""
        return _AttributeContext(self, {COLLECTIVE_COMM_GROUP: [
            _enum_index(type, _COMM_GROUP_TYPES, "CommGroupType"), int(groupSize)]})

    def outlineAttributes(self, attributes: dict) -> _AttributeContext:
        """Context manager adding "key:value" strings to ``__outline_attributes``."""
        return _AttributeContext(self, {OUTLINE_ATTRIBUTES: {str(k): str(v)
                                                             for k, v in attributes.items()}})

    def _context_value(self, attr: str, nodeOutputNames: Any, what: str) -> int:
        if nodeOutputNames is not None:
            return self.getInt64NodeAttribute(attr, nodeOutputNames)
        if attr not in self._context:   # Builder::get<what>'s text (builder.cpp)
            raise noted(popart_exception(f"{_SCOPE_NAMES[what]} not set in current scope."),
                        f"call get{what[0].upper()}{what[1:]} inside a 'with builder.{what}(n)' "
                        f"block, or pass node output names")
        return self._context[attr][-1]

    def getVirtualGraph(self, nodeOutputNames: Any = None) -> int:
        return self._context_value(VIRTUAL_GRAPH, nodeOutputNames, "virtualGraph")

    def getPipelineStage(self, nodeOutputNames: Any = None) -> int:
        return self._context_value(PIPELINE_STAGE, nodeOutputNames, "pipelineStage")

    def getExecutionPhase(self, nodeOutputNames: Any = None) -> int:
        return self._context_value(EXECUTION_PHASE, nodeOutputNames, "executionPhase")

    def _has(self, attr: str, nodeOutputNames: Any) -> bool:
        if nodeOutputNames is not None:
            return self.nodeHasAttribute(attr, nodeOutputNames)
        return attr in self._context

    def hasVirtualGraph(self, nodeOutputNames: Any = None) -> bool:
        return self._has(VIRTUAL_GRAPH, nodeOutputNames)

    def hasPipelineStage(self, nodeOutputNames: Any = None) -> bool:
        return self._has(PIPELINE_STAGE, nodeOutputNames)

    def hasExecutionPhase(self, nodeOutputNames: Any = None) -> bool:
        return self._has(EXECUTION_PHASE, nodeOutputNames)

    def setPartialsType(self, nodeOutputName: Any, partialsType: str) -> None:
        self._annotate(PARTIALS_TYPE, _as_id_set(nodeOutputName), partialsType, str)

    def getPartialsType(self, nodeOutputName: Any) -> str:
        if not self.nodeHasAttribute(PARTIALS_TYPE, nodeOutputName):
            return ""
        return self.getStringNodeAttribute(PARTIALS_TYPE, nodeOutputName)

    def setAvailableMemoryProportion(self, nodeOutputName: Any,
                                     availableMemoryProportion: float) -> None:
        """Set the node's available memory proportion, in (0, 1]; as PopART's, a value set
        before is replaced."""
        value = float(availableMemoryProportion)
        if not 0.0 < value <= 1.0:
            raise BuilderError(f"availableMemoryProportion must be in (0,1] (got "
                               f"{availableMemoryProportion})")
        ids = _as_id_set(nodeOutputName)
        if self.nodeHasAttribute(AVAILABLE_MEMORY_PROPORTION, ids):
            self.removeNodeAttribute(AVAILABLE_MEMORY_PROPORTION, ids)
        self._add_attributes(ids, {AVAILABLE_MEMORY_PROPORTION: value})

    def setSerializeMatMul(self, nodeOutputName: Any, mode: str, factor: int = 0,
                           keep_precision: bool = False) -> None:
        """Serialise a MatMul ("input_channels", "reducing_dim" or "output_channels" with
        ``factor``); "none" sets nothing. Each attribute may be set once per node."""
        modes = ("input_channels", "reducing_dim", "output_channels")
        if mode == "none":
            return
        if mode not in modes:
            raise BuilderError(f"Unsupported mat mul serialization mode '{mode}'. Supported "
                               f"modes are 'input_channels', 'reducing_dim', "
                               f"'output_channels' or 'none'")
        self._add_attributes(_as_id_set(nodeOutputName), {
            SERIALIZE_MATMUL_MODE: str(mode), SERIALIZE_MATMUL_FACTOR: int(factor),
            SERIALIZE_MATMUL_PRECISION: int(bool(keep_precision))})

    def excludePatterns(self, nodeOutputName: Any, patternNames: Sequence[str]) -> None:
        self._annotate(EXCLUDE_PATTERNS, _as_id_set(nodeOutputName), patternNames,
                       lambda v: [str(p) for p in v])

    def setInplacePreferences(self, nodeOutputName: Any, prefs: dict) -> None:
        self._add_attributes(_as_id_set(nodeOutputName), {
            INPLACE_OP_NAMES: [str(p) for p in prefs],
            INPLACE_OP_PRIORITIES: [float(p) for p in prefs.values()]})

    def setEnableConvDithering(self, nodeOutputName: Any, enableConvDithering: int) -> None:
        """Set the node's enableConvDithering flag: 0 or 1."""
        if enableConvDithering not in (0, 1):
            raise BuilderError(f"enableConvDithering must be a bool value (0 or 1, got "
                               f"{enableConvDithering!r})")
        op_type = self._find_node(_as_id_set(nodeOutputName)).op_type
        if op_type != "Conv":
            raise BuilderError(f"Builder::setEnableConvDithering should only be called on "
                               f"convolutions but was given: {op_type}")
        self._annotate(ENABLE_CONV_DITHERING, _as_id_set(nodeOutputName),
                       int(enableConvDithering), int)


# ---------------------------------------------------------------------------------------
# Module helpers used by the Builder

def _seq(values: Iterable) -> str:
    """A sequence as PopART prints one: [1 2 3]."""
    return "[" + " ".join(str(v) for v in values) + "]"


def _spatial_out_shape(in_shape: Sequence[int], kernel: Sequence[int], attrs: dict,
                       ceil_mode: bool) -> list[int]:
    """HasReceptiveFieldOp::getSpatialOutShape (willow/src/op/receptive.cpp)."""
    n = len(in_shape)
    pads = attrs.get("pads") or [0] * 2 * n
    out_pads = attrs.get("outPads") or [0] * 2 * n
    strides = attrs.get("strides") or [1] * n
    dil = attrs.get("dilations") or [1] * n
    in_dil = attrs.get("inDilations") or [1] * n
    auto_pad = attrs.get("auto_pad") or "NOTSET"
    rnd = np.ceil if ceil_mode else np.floor
    out = []
    for d in range(n):
        size = in_dil[d] * (in_shape[d] - 1) + 1
        if auto_pad == "VALID":
            size = int(np.ceil((size - (kernel[d] - 1)) / strides[d]))
        elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            size = int(np.ceil(size / strides[d]))
        else:
            size += pads[d] + pads[n + d] - 1 - dil[d] * (kernel[d] - 1)
            size = int(rnd(size / strides[d])) + 1
        out.append(size + out_pads[d] + out_pads[n + d])
    return out


def _check_window_parameters(shape: Optional[list], kernel: Sequence[int], attrs: dict,
                             ceil_mode: bool = False) -> None:
    """builder_helper.cpp's verifyWindowParameters, where the input's shape is known."""
    if shape is None:
        return
    n = len(shape) - 2
    if n < 1:
        raise BuilderError("Input tensor has no spatial dimensions")
    lengths = (("strides", n, "Length of strides vector {} != number of spatial dimensions {}"),
               ("pads", 2 * n, "Padding vector (length {}) does not have 2 values for each "
                               "spatial dimension {}"),
               ("dilations", n, "Length of dilations vector {} != number of spatial dimensions "
                                "{}"),
               ("inDilations", n, "Length of inDilations vector {} != number of spatial "
                                  "dimensions {}"))
    for key, expected, message in lengths:
        given = attrs.get(key) or []
        if given and len(given) != expected:
            raise BuilderError(message.format(len(given), n))
    if len(kernel):
        out = _spatial_out_shape(shape[2:], kernel, attrs, ceil_mode)
        if any(d < 0 for d in out):
            raise BuilderError(f"Window parameter values combine to give invalid spatial "
                               f"output shape: {_seq(out)}")


def _check_conv(builder: "Builder", inputs: Sequence[str], attrs: dict) -> None:
    """builder_helper.cpp's verifyConvBase: the kernel_shape attribute against the weights'
    shape, then the window parameters."""
    if len(inputs) < 2:
        raise BuilderError(f"Conv requires at least two inputs: data, and weights. "
                           f"{len(inputs)} inputs provided.")
    weights = builder._known_shape(inputs[1])
    kernel: list[int] = []
    if weights is not None:
        kernel = list(weights[2:])
        given = attrs.get("kernel_shape")
        if given and list(given) != kernel:
            raise BuilderError(f"kernel_shape, {_seq(given)}, does not match inferred shape "
                               f"from weight input '{inputs[1]}', {_seq(kernel)}")
    _check_window_parameters(builder._known_shape(inputs[0]), kernel, attrs)


def _check_window(builder: "Builder", op_type: str, inputs: Sequence[str], values: dict) -> None:
    """The Builder-time checks PopART's generated Builder makes (builder_helper.cpp) on
    Conv, AveragePool, MaxPool and Pad-2."""
    if op_type == "Conv":
        _check_conv(builder, inputs, values)
    elif op_type in ("AveragePool", "MaxPool") and inputs:
        _check_window_parameters(builder._known_shape(inputs[0]), values.get("kernel_shape")
                                 or [], values, bool(values.get("ceil_mode") or 0))
    elif op_type == "Pad" and values.get("pads") is not None and inputs:
        shape = builder._known_shape(inputs[0])
        if shape is not None and len(values["pads"]) != 2 * len(shape):
            raise BuilderError(f"Padding vector (length {len(values['pads'])}) doesn't contain "
                               f"2 entries per input dimension {len(shape)}")


def _nll_like_rule(label_index: int) -> Any:
    """defs.cpp's LossShapeInference<i>: input 0's type; shape of input i when reduction
    is "None", else a scalar."""
    def rule(node: onnx.NodeProto, types: list) -> Optional[tuple]:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        reduction = attrs.get("reduction", b"Mean")
        reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
        if reduction != "None":
            return types[0][0], []
        if len(types) > label_index and types[label_index] is not None:
            return types[0][0], list(types[label_index][1])
        return None
    return rule


def _subsample_rule(node: onnx.NodeProto, types: list) -> Optional[tuple]:
    """defs.cpp's SubsampleShapeInference: each dimension divided by its stride, rounded
    down (the IR's setup rounds up, as Poplar does)."""
    strides = next((list(a.ints) for a in node.attribute if a.name == "strides"), None)
    elem, shape = types[0]
    strides = strides or [1] * len(shape)
    if len(strides) != len(shape) or 0 in strides:
        return None
    return elem, [d // s if d >= 0 else -1 for d, s in zip(shape, strides)]


# ai.graphcore ops whose Builder-time shape inference (PopART's defs.cpp, run as the ops are
# added) differs from the engine's: (node, [input (elem, shape) or None]) -> (elem, shape)
_BUILDER_SHAPE_RULES = {"Subsample": _subsample_rule, "Nll": _nll_like_rule(1),
                        "L1": _nll_like_rule(0), "IdentityLoss": _nll_like_rule(0)}

def _recompute_value(value: Any) -> int:
    if isinstance(value, bool):  # the old API: True = recompute, False = checkpoint
        return int(RecomputeType.Recompute if value else RecomputeType.Checkpoint)
    return _enum_index(value, tuple(RecomputeType.__members__), "RecomputeType")


def _tensor_location(loc: Any) -> list[int]:
    if isinstance(loc, (list, tuple)):
        return [int(v) for v in loc]
    if loc is None:
        return [0, 0, 0, 0]
    return [_enum_index(getattr(loc, "storage", 0), ("OnChip", "OffChip"), "TensorStorage"),
            _enum_index(getattr(loc, "loadTileSet", 0), ("Compute", "IO"), "TileSet"),
            _enum_index(getattr(loc, "storageTileSet", 0), ("Compute", "IO"), "TileSet"),
            _enum_index(getattr(loc, "replicatedTensorSharding", 0), ("Off", "On"),
                        "ReplicatedTensorSharding")]


def _all_graphs(graph: onnx.GraphProto) -> Iterable[onnx.GraphProto]:
    """``graph`` and every sub-graph nested in its nodes' attributes."""
    yield graph
    for node in graph.node:
        for a in node.attribute:
            for g in ([a.g] if a.type == G else list(a.graphs)):
                yield from _all_graphs(g)


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names: set[str] = set()
    for g in _all_graphs(graph):
        names |= {v.name for v in g.input} | {t.name for t in g.initializer}
        names |= {o for n in g.node for o in n.output}
    return names


def _node_domains(graph: onnx.GraphProto) -> set[str]:
    return {n.domain for g in _all_graphs(graph) for n in g.node
            if n.domain not in ("", ONNX_DOMAIN)}


def _keep_external_data(model: onnx.ModelProto, folder: str) -> None:
    """A model file's external initializers stay external in the Builder. Their locations
    are relative to the model's folder (ONNX), which this checks (_ir.onnx_import); PopART
    reads them relative to the working directory, as the Builder's getModelProto bytes
    will be: a relative location is made absolute when the two folders differ."""
    same = os.path.realpath(folder) == os.path.realpath(os.getcwd())
    for t in model.graph.initializer:
        if not is_external(t):
            continue
        path = external_data_path(t, folder)   # ModelError: leaves the folder, no such file
        note_own_file(path)                    # the session reads it as the Builder's own
        loc = external_info(t).get("location", "")
        if not same and not os.path.isabs(loc):
            for e in t.external_data:
                if e.key == "location":
                    e.value = path
