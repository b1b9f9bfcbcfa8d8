"""Which operators this runtime implements: :class:`OperatorIdentifier`,
:class:`OpDefinition`, :func:`getSupportedOperations`,
:func:`getSupportedOperationsDefinition` and :func:`getUnsupportedOperations`.

As PopART, an operator version is the opset version in which its ONNX schema last changed
(``Add-7``, ``Add-13``, ...): an ai.onnx / ai.onnx.ml operator is listed at every schema
version from the first one this package's op registry lowers (``popart.ops.registry``);
operators of other domains at the versions they are registered at. Internal operators (the
``ai.popxl`` domain, which popxl's own transforms create) are listed only on request.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import onnx
import onnx.defs

from .errors import popart_exception
from .ops import registry as _registry
from .tensorinfo import DataType, to_datatype

__all__ = [
    "NumInputs", "OperatorIdentifier", "OpDefinition", "getSupportedOperations",
    "getSupportedOperationsDefinition", "getUnsupportedOperations",
] + [f"OpDefinition::{_n}" for _n in ("Input", "Output", "Attribute")]  # PopART's binding names

# Domains whose operators only the runtime itself creates (PopART's non-public ops).
INTERNAL_DOMAINS = frozenset({"ai.popxl"})
_ONNX_SCHEMA_DOMAINS = {"ai.onnx": "", "ai.onnx.ml": "ai.onnx.ml",
                        "ai.onnx.preview.training": "ai.onnx.preview.training",
                        "ai.onnx.preview": "ai.onnx.preview"}
_VARIADIC = 2 ** 31 - 1   # onnx.defs' "no upper bound"


def _check_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise popart_exception(f"{what}: expected a str, got {value!r} ({type(value).__name__})")
    return value


def _check_int(value: Any, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise popart_exception(f"{what}: expected an int >= {minimum}, got {value!r} "
                               f"({type(value).__name__})")
    return int(value)


class NumInputs:
    """How many inputs an operator takes: ``min`` to ``max`` (-1: no upper bound)."""

    __slots__ = ("min", "max")

    def __init__(self, min: int = 0, max: Optional[int] = None) -> None:  # noqa: A002
        self.min = _check_int(min, "NumInputs.min", 0)
        self.max = self.min if max is None else _check_int(max, "NumInputs.max", -1)
        if self.max != -1 and self.max < self.min:
            raise popart_exception(f"NumInputs: max ({self.max}) must be -1 (no upper bound) "
                                   f"or >= min ({self.min})")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, int) and not isinstance(other, bool):
            return self.min == self.max == other
        return isinstance(other, NumInputs) and (self.min, self.max) == (other.min, other.max)

    def __hash__(self) -> int:
        return hash((self.min, self.max))

    def __repr__(self) -> str:
        return f"NumInputs({self.min}, {self.max})"


class OperatorIdentifier:
    """An operator: ``domain`` ("" means "ai.onnx"), ``type`` and ``version``; optionally how
    many inputs (``numInputs``: an int, a (min, max) pair or :class:`NumInputs`; max -1 for no
    upper bound) and outputs (``numOutputs``, -1 for a variable count) it has. Identifiers
    compare and hash by (domain, type, version), as PopART's."""

    __slots__ = ("_domain", "_type", "_version", "_num_inputs", "_num_outputs")

    def __init__(self, domain: str, type: str, version: int,  # noqa: A002
                 numInputs: Union[int, Sequence[int], NumInputs, None] = None,
                 numOutputs: int = 0) -> None:
        self._domain = _check_str(domain, "OperatorIdentifier domain") or _registry.ONNX_DOMAIN
        self._type = _check_str(type, "OperatorIdentifier type")
        if not self._type:
            raise popart_exception("OperatorIdentifier type: expected a non-empty op type, "
                                   "got ''")
        self._version = _check_int(version, "OperatorIdentifier version", 0)
        if numInputs is None:
            self._num_inputs = NumInputs()
        elif isinstance(numInputs, NumInputs):
            self._num_inputs = numInputs
        elif isinstance(numInputs, int) and not isinstance(numInputs, bool):
            self._num_inputs = NumInputs(numInputs)
        elif isinstance(numInputs, (tuple, list)) and len(numInputs) == 2:
            self._num_inputs = NumInputs(*numInputs)
        else:
            raise popart_exception(f"OperatorIdentifier numInputs: expected an int, a (min, max) "
                                   f"pair or NumInputs, got {numInputs!r}")
        self._num_outputs = _check_int(numOutputs, "OperatorIdentifier numOutputs", -1)

    domain = property(lambda self: self._domain, doc="The operator's domain.")
    type = property(lambda self: self._type, doc="The operator's type (name).")
    version = property(lambda self: self._version, doc="The operator's version.")
    numInputs = property(lambda self: self._num_inputs, doc="How many inputs it takes.")
    numOutputs = property(lambda self: self._num_outputs,
                          doc="How many outputs it has (-1: variable).")

    def _key(self) -> tuple:
        return (self._domain, self._type, self._version)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OperatorIdentifier) and self._key() == other._key()

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __lt__(self, other: "OperatorIdentifier") -> bool:
        if not isinstance(other, OperatorIdentifier):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        return f"{self._domain}.{self._type}:{self._version}"

    def __repr__(self) -> str:
        return f"OperatorIdentifier({self._domain!r}, {self._type!r}, {self._version})"


class _Input:
    """An operator input: its ``name``, the data types it accepts (``supportedTensors``)
    and whether its value must be known when the model is compiled (``constant``)."""

    __slots__ = ("name", "supportedTensors", "constant")

    def __init__(self, name: str, supportedTensors: Iterable[Any] = (),
                 constant: bool = False) -> None:
        self.name = _check_str(name, "OpDefinition.Input name")
        self.supportedTensors = [to_datatype(t) for t in supportedTensors]
        self.constant = bool(constant)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Input) and (self.name, self.supportedTensors, self.constant) \
            == (other.name, other.supportedTensors, other.constant)

    def __repr__(self) -> str:
        types = ", ".join(t.value for t in self.supportedTensors)
        return f"Input({self.name!r}, [{types}]{', constant' if self.constant else ''})"


class _Output:
    """An operator output: its ``name`` and the data types it can have."""

    __slots__ = ("name", "supportedTensors")

    def __init__(self, name: str, supportedTensors: Iterable[Any] = ()) -> None:
        self.name = _check_str(name, "OpDefinition.Output name")
        self.supportedTensors = [to_datatype(t) for t in supportedTensors]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Output) and (self.name, self.supportedTensors) == \
            (other.name, other.supportedTensors)

    def __repr__(self) -> str:
        return f"Output({self.name!r}, [{', '.join(t.value for t in self.supportedTensors)}])"


class _Attribute:
    """An operator attribute: the values it accepts, as a pattern (``"*"``: any)."""

    __slots__ = ("supportedValuesRegex",)

    def __init__(self, supportedValuesRegex: str = "*") -> None:
        self.supportedValuesRegex = _check_str(supportedValuesRegex,
                                               "OpDefinition.Attribute supportedValuesRegex")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Attribute) and \
            self.supportedValuesRegex == other.supportedValuesRegex

    def __repr__(self) -> str:
        return f"Attribute({self.supportedValuesRegex!r})"


class OpDefinition:
    """What an operator takes and gives: ``inputs`` (list of :class:`OpDefinition.Input`),
    ``outputs`` (list of :class:`OpDefinition.Output`) and ``attributes`` (attribute name ->
    :class:`OpDefinition.Attribute`)."""

    Input = _Input
    Output = _Output
    Attribute = _Attribute

    def __init__(self, inputs: Iterable[_Input] = (), outputs: Iterable[_Output] = (),
                 attributes: Optional[Mapping[str, _Attribute]] = None) -> None:
        self._inputs = list(inputs)
        self._outputs = list(outputs)
        self._attributes = dict(attributes or {})
        for what, items, kind in (("inputs", self._inputs, _Input),
                                  ("outputs", self._outputs, _Output),
                                  ("attributes", list(self._attributes.values()), _Attribute)):
            for item in items:
                if not isinstance(item, kind):
                    raise popart_exception(f"OpDefinition {what}: expected OpDefinition."
                                           f"{kind.__name__.strip('_')} items, got {item!r}")

    inputs = property(lambda self: list(self._inputs), doc="The operator's inputs.")
    outputs = property(lambda self: list(self._outputs), doc="The operator's outputs.")
    attributes = property(lambda self: dict(self._attributes),
                          doc="Attribute name -> OpDefinition.Attribute.")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpDefinition) and (self._inputs, self._outputs,
                                                    self._attributes) == \
            (other._inputs, other._outputs, other._attributes)

    def __repr__(self) -> str:
        return (f"OpDefinition(inputs={self._inputs}, outputs={self._outputs}, "
                f"attributes={self._attributes})")


_Input.__qualname__ = "OpDefinition.Input"
_Output.__qualname__ = "OpDefinition.Output"
_Attribute.__qualname__ = "OpDefinition.Attribute"
# PopART binds the nested classes under these module-level names.
globals()["OpDefinition::Input"] = _Input
globals()["OpDefinition::Output"] = _Output
globals()["OpDefinition::Attribute"] = _Attribute


# ---------------------------------------------------------------------------------------
# From the registry

@functools.lru_cache(maxsize=None)
def _schema_versions(domain: str) -> dict[str, list]:
    """op type -> its ONNX schemas in ``domain``, oldest first (deprecated ones left out)."""
    onnx_domain = _ONNX_SCHEMA_DOMAINS.get(domain)
    out: dict[str, list] = {}
    if onnx_domain is None:
        return out
    for s in onnx.defs.get_all_schemas_with_history():
        if s.domain == onnx_domain and not s.deprecated:
            out.setdefault(s.name, []).append(s)
    for schemas in out.values():
        schemas.sort(key=lambda s: s.since_version)
    return out


def _registered() -> list[tuple[str, str, list]]:
    """(domain, op type, [registry OpDef, ...]) for every registered lowering."""
    return [(d, t, list(defs)) for (d, t), defs in sorted(_registry._REGISTRY.items())]


def _count(n: int) -> int:
    return -1 if n >= _VARIADIC else int(n)


def _type_list(type_str: str, constraints: dict) -> list[DataType]:
    """The DataTypes a formal parameter's type string (or constraint name) allows."""
    allowed = constraints.get(type_str, [type_str])
    out: list[DataType] = []
    for t in allowed:
        if not (t.startswith("tensor(") and t.endswith(")")):
            continue    # sequences, optionals, maps: no DataType
        name = t[len("tensor("):-1].upper()
        try:
            dt = to_datatype(onnx.TensorProto.DataType.Value(name))
        except (ValueError, popart_exception):
            continue
        if dt not in out:
            out.append(dt)
    return out


def _onnx_definition(schema: Any, static_inputs: tuple) -> OpDefinition:
    constraints = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    inputs = [_Input(f.name, _type_list(f.type_str, constraints), i in static_inputs)
              for i, f in enumerate(schema.inputs)]
    outputs = [_Output(f.name, _type_list(f.type_str, constraints)) for f in schema.outputs]
    attributes = {name: _Attribute("*") for name in sorted(schema.attributes)}
    return OpDefinition(inputs, outputs, attributes)


# ai.graphcore and other domains without ONNX schemas: numeric types are not constrained.
_ANY_NUMERIC = [DataType.UINT8, DataType.INT8, DataType.UINT16, DataType.INT16, DataType.INT32,
                DataType.INT64, DataType.UINT32, DataType.UINT64, DataType.BOOL, DataType.FLOAT16,
                DataType.BFLOAT16, DataType.FLOAT, DataType.DOUBLE]


def _graphcore_table(op_type: str) -> tuple[Optional[list[str]], Optional[int]]:
    """(attribute names, output count or -1) of an ai.graphcore op from the Builder's op
    table, or (None, None) when the table does not describe it."""
    from ._ir import graphcore_schema
    spec = graphcore_schema.NODE_ATTRS.get(op_type)
    if spec is None:
        return None, None
    outs = [s.outputs for s in graphcore_schema.SCHEMAS if s.op_type == op_type]
    n_out = outs[0] if outs else None
    return list(spec), (-1 if n_out == "n" else n_out)


def _signature_definition(op: Any) -> tuple[OpDefinition, NumInputs, int]:
    """An OpDefinition from a lowering's Python signature ``fn(ctx, *inputs, **attrs)``
    (and the Builder's table of ai.graphcore attributes where it has the op)."""
    fn = getattr(op.lower, "__wrapped__", op.lower)
    attr_names, n_out = (_graphcore_table(op.op_type) if op.domain == _registry.GRAPHCORE_DOMAIN
                         else (None, None))
    inputs: list[_Input] = []
    attributes: dict[str, _Attribute] = {}
    n_min, n_max = 0, 0
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]   # after ctx
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind == p.VAR_KEYWORD:
            continue
        if p.kind == p.VAR_POSITIONAL:
            inputs.append(_Input(p.name, _ANY_NUMERIC))
            n_max = -1
            continue
        is_attr = (p.name in attr_names if attr_names is not None else
                   p.kind == p.KEYWORD_ONLY or p.default not in (inspect.Parameter.empty, None))
        if is_attr or p.kind == p.KEYWORD_ONLY:
            attributes[p.name] = _Attribute("*")
            continue
        inputs.append(_Input(p.name, _ANY_NUMERIC, len(inputs) in op.static_inputs))
        if p.default is inspect.Parameter.empty:
            n_min += 1
        if n_max != -1:
            n_max += 1
    for name in attr_names or ():
        attributes.setdefault(name, _Attribute("*"))
    n_outputs = 1 if n_out is None else int(n_out)
    outputs = [_Output(f"output{i}" if n_outputs != 1 else "output", _ANY_NUMERIC)
               for i in range(max(n_outputs, 1 if n_outputs == -1 else 0))]
    return (OpDefinition(inputs, outputs, dict(sorted(attributes.items()))),
            NumInputs(n_min, n_max), n_outputs)


@functools.lru_cache(maxsize=None)
def _catalogue(count: int) -> tuple[tuple[OperatorIdentifier, OpDefinition, bool], ...]:
    """(identifier, definition, internal) for every supported operator version; ``count``
    (the registry's size) makes a later registration show up."""
    out = []
    for domain, op_type, defs in _registered():
        internal = domain in INTERNAL_DOMAINS
        schemas = _schema_versions(domain).get(op_type)
        if schemas:
            first = defs[0].since
            for s in schemas:
                if s.since_version < first:
                    continue
                op = _registry.lookup(domain, op_type, s.since_version)
                n_out = s.max_output if s.min_output == s.max_output else _VARIADIC
                opid = OperatorIdentifier(domain, op_type, s.since_version,
                                          NumInputs(s.min_input, _count(s.max_input)),
                                          _count(n_out))
                out.append((opid, _onnx_definition(s, op.static_inputs), internal))
        else:
            for op in defs:
                definition, num_inputs, n_outputs = _signature_definition(op)
                opid = OperatorIdentifier(domain, op_type, op.since, num_inputs, n_outputs)
                out.append((opid, definition, internal))
    return tuple(sorted(out, key=lambda e: e[0]._key()))


def _entries(includeInternal: Any, where: str) -> list:
    if not isinstance(includeInternal, (bool, int)):
        raise popart_exception(f"{where}: includeInternal must be a bool, got "
                               f"{includeInternal!r} ({type(includeInternal).__name__})")
    return [e for e in _catalogue(len(_registry._REGISTRY)) if includeInternal or not e[2]]


def getSupportedOperations(includeInternal: bool) -> list[OperatorIdentifier]:
    """Every operator version this runtime can run, sorted by (domain, type, version);
    with ``includeInternal`` also the operators only the runtime's own transforms create."""
    return [opid for opid, _, _ in _entries(includeInternal, "getSupportedOperations")]


def getSupportedOperationsDefinition(includeInternal: bool) -> dict[OperatorIdentifier,
                                                                      OpDefinition]:
    """:func:`getSupportedOperations` with each operator's :class:`OpDefinition`."""
    return {opid: d for opid, d, _ in _entries(includeInternal,
                                               "getSupportedOperationsDefinition")}


def getUnsupportedOperations(opsetVersion: int) -> list[OperatorIdentifier]:
    """The ai.onnx operators of opset ``opsetVersion`` (each at the version that opset
    uses) that this runtime cannot run."""
    latest = onnx.defs.onnx_opset_version()
    if isinstance(opsetVersion, bool) or not isinstance(opsetVersion, int) \
            or not 1 <= opsetVersion <= latest:
        raise popart_exception(f"getUnsupportedOperations: opsetVersion must be an int in "
                               f"1..{latest} (the ai.onnx opsets onnx {onnx.__version__} "
                               f"defines), got {opsetVersion!r}")
    out = []
    for op_type, schemas in sorted(_schema_versions(_registry.ONNX_DOMAIN).items()):
        current = [s for s in schemas if s.since_version <= opsetVersion]
        if not current:
            continue
        # a schema deprecated at or before this opset is not part of it
        newest = onnx.defs.get_schema(op_type, opsetVersion, "")
        if newest.deprecated or newest.since_version != current[-1].since_version:
            continue
        s = current[-1]
        try:
            _registry.lookup(_registry.ONNX_DOMAIN, op_type, s.since_version)
            continue
        except popart_exception:
            pass
        n_out = s.max_output if s.min_output == s.max_output else _VARIADIC
        out.append(OperatorIdentifier(_registry.ONNX_DOMAIN, op_type, s.since_version,
                                      NumInputs(s.min_input, _count(s.max_input)),
                                      _count(n_out)))
    return out
