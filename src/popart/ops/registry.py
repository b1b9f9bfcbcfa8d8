"""The one op registry: (domain, op type, opset range) -> lowering to jax.numpy / jax.lax.

A lowering is ``fn(ctx, *inputs, **attrs)`` returning one array or a tuple (one per output);
``attrs`` come with ONNX's / PopART's defaults filled in, shapes and dtypes from tracing it.
Register with ``@register("Relu", since=6)`` or, for a family, ``add`` from a table; with
``platform="cpu"``, an override used only where the program runs on that platform (the
generic lowering elsewhere: engine/backends.py). See docs/op_registry.md."""
from __future__ import annotations

import bisect
import functools
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import numpy as np
import onnx
import onnx.defs

from ..errors import ModelError, UnsupportedOperatorError, noted
from .._ir.graphcore_schema import node_defaults as _graphcore_node_defaults

ONNX_DOMAIN = "ai.onnx"
GRAPHCORE_DOMAIN = "ai.graphcore"
ONNX_ML_DOMAIN = "ai.onnx.ml"
CHECK_RECORD_SIZE = 6   # a run-time check's record: int64 [failed, check id, up to 4 values]


def canonical_domain(domain: str) -> str:
    return ONNX_DOMAIN if domain in ("", "ai.onnx", None) else domain


class LowerCtx(Protocol):
    """What a lowering may ask of the engine while it is traced."""

    op_type: str          # e.g. "Conv"
    domain: str
    version: int          # opset version the model imports for this op's domain
    name: str             # node name (for error messages)
    num_outputs: int      # how many outputs the node declares
    output_ids: list      # the node's output tensor ids
    input_ids: list       # the node's input tensor ids ("" for omitted optional inputs)
    training: bool        # True inside a TrainingSession's forward pass
    consumed: bool        # a node of the graph (or of a graph it calls) reads an output
    replica_axis: Optional[str]   # vmap / shard_map axis name of replicas, or None
    replication_factor: int
    config: Any           # the session's engine.config.EngineConfig (None: ONNX's rules)
    platform: str         # where the program runs: "cpu", "gpu", ... (never compared in a
                          # lowering: register a platform override, engine/backends.py)

    def rng(self) -> Any:
        """A fresh jax PRNG key derived from the session seed (for random ops)."""

    def readers(self, tensor_id: str) -> Optional[list]:
        """The nodes of this node's graph that read ``tensor_id``, with ``"output"`` for a
        graph output; None where the graph is not known (a lowering that matches a pattern
        over its neighbours then keeps to the plain form)."""

    def static(self, x: Any, what: str) -> np.ndarray:
        """``x`` as a NumPy array; raises a popart error naming ``what`` if ``x`` is only
        known at run time (for inputs such as Reshape's shape that must be constant)."""

    def assign(self, tensor_id: str, value: Any) -> None:
        """Write ``value`` to variable ``tensor_id`` at the end of the step (training-mode
        BatchNormalization running statistics, in-place variable updates). Ignored in
        inference and for tensors that are not variables."""

    def run_subgraph(self, graph: Any, inputs: list, iteration: Any = None) -> list:
        """Lower an IR subgraph (attribute of If / Loop / Scan / Call) on ``inputs``;
        tensors of enclosing scopes are visible inside it. Returns its outputs. Loop bodies
        pass their ``iteration`` index so random ops draw new numbers each iteration
        (``ctx.assign`` inside such a body is ignored). Only in the lowering's own trace:
        inside a function JAX traces separately, use ``run_body``."""

    def run_body(self, graph: Any, inputs: list, iteration: Any = None) -> tuple:
        """``run_subgraph`` inside a function JAX traces separately (lax.cond branch, scan /
        while_loop body): returns (outputs, record of the body's run-time checks), the record
        to be returned from the body and passed to ``check_record`` outside it."""

    def check_record(self, records: Any) -> None:
        """Fail the run if a record from ``run_body`` (any leading dimensions) failed."""

    def discard_subgraph_traces(self) -> None:
        """Forget what earlier ``run_subgraph`` calls derived, before tracing the subgraph
        again another way (a Loop that falls back to unrolling)."""

    def error(self, msg: str) -> Exception:
        """An UnsupportedOperatorError whose message names this node."""

    def channels_last(self, x: Any, transpose: bool = False) -> Optional[Any]:
        """The NHWC form of the 4-D NCHW input ``x`` where a lowering computed one (the CPU's
        oneDNN convolutions and what follows them), else None; with ``transpose``, else a
        transpose of ``x`` that other consumers share (engine/channels_last.py)."""

    def keep_channels_last(self, y_nhwc: Any) -> Any:
        """The NCHW output of a lowering that computed ``y_nhwc`` channels-last: a transpose
        that XLA drops where every consumer takes the NHWC form."""

    def host_stream(self, stream_id: str) -> Any:
        """The value of host stream ``stream_id``, or None (HostLoad)."""

    def store_host_stream(self, stream_id: str, value: Any) -> None:
        """Make ``value`` readable as host stream ``stream_id`` (HostStore)."""

    def remote_buffers(self) -> dict:
        """Remote buffer id -> [(offset, value)] stores of this graph execution."""

    def check(self, failed: Any, message: str, error_class: Optional[type] = None,
              **values: Any) -> None:
        """A run-time check: when ``failed`` (bool scalar) is true the run raises
        popart_runtime_error (or ``error_class``) with ``message`` (naming this node;
        ``{name}`` replaced by the int scalar ``values[name]``); known at compile time,
        ModelError now (with ``error_class``: still at run time)."""


def is_static(x: Any) -> bool:
    """True for a value known at compile time (NumPy / Python), or an omitted input."""
    return x is None or isinstance(x, (np.ndarray, np.generic, int, float, bool))


@dataclass
class OpDef:
    op_type: str
    domain: str
    since: int
    lower: Callable[..., Any]
    # Inputs whose values must be known at compile time (documentation and import checks).
    static_inputs: tuple = ()
    # True for ops that draw random numbers (never constant-folded).
    random: bool = False
    # True for elementwise ops with NumPy broadcasting: they run channels-last on inputs that
    # have a channels-last form (engine/channels_last.py).
    elementwise: bool = False
    # Inputs whose values decide the output shape (NonZero's 0, Compress's condition 1, ...):
    # where one is a run-time value the node runs on the host between compiled segments
    # (engine/segments.py); known at compile time, it folds as any node.
    data_dependent: tuple = ()


# (domain, op type) -> generic lowerings; (platform, domain, op type) -> that platform's
# overrides. Each list is sorted by ``since``.
_REGISTRY: dict[tuple[str, str], list[OpDef]] = {}
_OVERRIDES: dict[tuple[str, str, str], list[OpDef]] = {}


def register(op_type: str, *, domain: str = ONNX_DOMAIN, since: int = 1,
             static_inputs: tuple = (), random: bool = False,
             elementwise: bool = False, platform: Optional[str] = None,
             data_dependent: tuple = ()) -> Callable:
    """Decorator registering ``fn`` as the lowering of ``op_type`` from opset ``since`` on
    (until the next registered version of the same op); with ``platform``, as that platform's
    override of the generic lowering."""
    def deco(fn: Callable) -> Callable:
        add(op_type, fn, domain=domain, since=since, static_inputs=static_inputs, random=random,
            elementwise=elementwise, platform=platform, data_dependent=data_dependent)
        return fn
    return deco


def add(op_type: str, fn: Callable, *, domain: str = ONNX_DOMAIN, since: int = 1,
        static_inputs: tuple = (), random: bool = False, elementwise: bool = False,
        platform: Optional[str] = None, data_dependent: tuple = ()) -> None:
    """Register ``fn`` (non-decorator form, for tables). The registry keeps a copy of ``fn``
    named ``<op_type>_<since>`` (``Softmax_13``), so a traceback through a table row's lambda
    or a family's shared lowering names the op; ``platform`` as in :func:`register`."""
    domain = canonical_domain(domain)
    defs = (_REGISTRY.setdefault((domain, op_type), []) if platform is None
            else _OVERRIDES.setdefault((platform, domain, op_type), []))
    defs[:] = [d for d in defs if d.since != since]
    bisect.insort(defs, OpDef(op_type, domain, since, _named(fn, f"{op_type}_{since}"),
                              tuple(static_inputs), random, elementwise,
                              tuple(data_dependent)),
                 key=lambda d: d.since)


def _named(fn: Callable, name: str) -> Callable:
    """``fn`` under ``name``, in tracebacks too (its code object renamed)."""
    if not isinstance(fn, types.FunctionType):
        return fn
    code = fn.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):   # Python 3.11+
        code = code.replace(co_qualname=name)
    named = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    named.__kwdefaults__, named.__doc__ = fn.__kwdefaults__, fn.__doc__
    named.__wrapped__ = fn
    return named


def lookup(domain: str, op_type: str, version: int, platform: Optional[str] = None) -> OpDef:
    """The lowering for ``op_type`` as of opset ``version`` of ``domain``: ``platform``'s
    override where one covers that version, else the generic lowering."""
    domain = canonical_domain(domain)
    overrides = [d for d in _OVERRIDES.get((platform, domain, op_type), ()) if d.since <= version]
    if overrides:
        return overrides[-1]
    defs = _REGISTRY.get((domain, op_type))
    if not defs:
        custom = not domain.startswith(("ai.onnx", "ai.graphcore", "ai.popxl"))
        raise UnsupportedOperatorError(
            f"Operator {domain}::{op_type} is not supported by this runtime "
            f"(requested at opset {version})" + (
                f": a custom op runs as its Python equivalent, registered with "
                f"@popart.custom_ops.register_op('{op_type}', '{domain}', {version}) "
                f"(docs/custom_ops.md)" if custom else ""))
    usable = [d for d in defs if d.since <= version]
    if not usable:
        raise UnsupportedOperatorError(
            f"Operator {domain}::{op_type} at opset {version} is not supported: "
            f"the earliest supported version is {defs[0].since}")
    return usable[-1]


def platform_lowering(ctx: LowerCtx, op_type: str, domain: str = ONNX_DOMAIN) -> Callable:
    """The latest lowering of ``op_type`` as ``ctx``'s platform runs it (its override, else the
    generic one), for ops computed by another op's lowering (MultiConv by Conv's)."""
    return lookup(domain, op_type, 1 << 30, platform=ctx.platform).lower


def is_registered(domain: str, op_type: str) -> bool:
    return (canonical_domain(domain), op_type) in _REGISTRY


def registered_ops() -> list[tuple[str, str, list[int]]]:
    """(domain, op type, registered since-versions) for every op."""
    return sorted((d, t, [o.since for o in defs]) for (d, t), defs in _REGISTRY.items())


# ---------------------------------------------------------------------------------------
# Attribute defaults from the ONNX schemas

@functools.lru_cache(maxsize=None)
def onnx_schema(op_type: str, version: int, domain: str = ONNX_DOMAIN) -> Optional[onnx.defs.OpSchema]:
    d = "" if canonical_domain(domain) == ONNX_DOMAIN else domain
    try:
        return onnx.defs.get_schema(op_type, version, d)
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def attribute_defaults(op_type: str, version: int, domain: str = ONNX_DOMAIN) -> dict:
    """ONNX's default attribute values for ``op_type`` at opset ``version``."""
    schema = onnx_schema(op_type, version, domain)
    if schema is None:
        return {}
    out = {}
    for name, attr in schema.attributes.items():
        if attr.default_value is not None and attr.default_value.type != 0:
            out[name] = decode_attr(onnx.helper.get_attribute_value(attr.default_value))
    return out


def node_attribute_defaults(node: Any, version: int) -> dict:
    """A new dict of default values for the attributes ``node`` (an IR node: ``op_type``,
    ``domain``, ``attrs``, ``describe()``) lacks: ONNX's schema defaults for ai.onnx nodes,
    the ai.graphcore table's for ai.graphcore nodes, none for other domains. Raises
    ModelError naming the node, op and attribute when an ai.graphcore node lacks a required
    attribute."""
    domain = canonical_domain(node.domain)
    if domain == ONNX_DOMAIN:
        return dict(attribute_defaults(node.op_type, version))
    if domain == GRAPHCORE_DOMAIN:
        return _graphcore_node_defaults(node.op_type, node.attrs, node.describe())
    return {}


def decode_attr(value: Any) -> Any:
    """ONNX attribute values as plain Python: bytes -> str, repeated -> list."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, (list, tuple)):
        return [decode_attr(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------
# PopART's own rules where they differ from ONNX's schemas

def opid(ctx: LowerCtx) -> str:
    """The node's operator as PopART prints an OperatorIdentifier: ``ai.onnx.Dropout:10``, the
    version the op's definition has at the model's opset (Dropout-10 in an opset-11 model)."""
    schema = onnx_schema(ctx.op_type, ctx.version) if canonical_domain(ctx.domain) == ONNX_DOMAIN \
        else None
    return f"{canonical_domain(ctx.domain)}.{ctx.op_type}:{schema.since_version if schema else ctx.version}"


def onnx_semantics(ctx: LowerCtx) -> bool:
    """True outside PopART's sessions (the ONNX backend, one-shot runs: no engine config),
    where ONNX's own rules apply where PopART's differ (ArgMax's INT64, Scan's stacked
    outputs)."""
    return getattr(ctx, "config", None) is None


def debug_name(ctx: LowerCtx) -> str:
    """The node as PopART's Op::debugName prints it: ``Op(name (opid), inputs=[..], outputs=[..])``."""
    return (f"Op({ctx.name + ' (' + opid(ctx) + ')' if ctx.name else opid(ctx)}, inputs=["
            f"{', '.join(i for i in ctx.input_ids if i)}], outputs=[{', '.join(ctx.output_ids)}])")


def shape_text(shape: Any) -> str:
    """A shape as PopART's messages print one (operator<< of a Shape): [2 3]."""
    return f"[{' '.join(str(int(d)) for d in shape)}]"


def fmt_float(v: float) -> str:
    """A float attribute as PopART's messages print it (the shortest float32 form: 1, 0.5)."""
    return np.format_float_positional(np.float32(v), trim="-")


def popart_error(ctx: LowerCtx, message: str, note: str = "") -> ModelError:
    """A popart_exception whose message is PopART's own text (``message``); the node and
    ``note`` (what is valid, what to do) go in an exception note."""
    return noted(ModelError(message), f"node '{ctx.name}' ({ctx.domain}::{ctx.op_type}-"
                 f"{ctx.version})" + (f": {note}" if note else ""))


def _fp16_with_fp32_scalar(inputs: list) -> bool:
    """MulOp::setup: fp16 with an fp32 tensor of one element (either side) gives fp16."""
    kinds = [(np.dtype(x.dtype), int(np.prod(np.shape(x)))) for x in inputs[:2]]
    ok = [(d == np.float16) or (d == np.float32 and n == 1) for d, n in kinds]
    return len(kinds) == 2 and all(ok) and kinds[0][0] != kinds[1][0]


_FLOATS = {np.dtype(np.float16), np.dtype(np.float32)}
_SHAPE_INTS = {np.dtype(np.int32), np.dtype(np.int64)}
# (op type, input position) -> the dtypes PopART takes there whatever ONNX's type parameter
# says, from each op's creator / setup(); a callable decides from all the inputs.
POPART_INPUT_TYPES: dict[tuple[str, int], Any] = {
    **{("BatchNormalization", k): _FLOATS for k in (1, 2, 3, 4)},   # statistics of their own type
    ("Expand", 1): _SHAPE_INTS, ("ConstantOfShape", 0): _SHAPE_INTS,
    ("Clip", 1): "f", ("Clip", 2): "f",          # read as float scalars at construction
    ("If", 0): "biuf",                           # any scalar; non-zero is true
    ("Gather", 1): "iu",                         # GatherOp never checks the index type
    ("Tile", 1): "iu",                           # TileOp raises its own message
    ("Mul", 0): _fp16_with_fp32_scalar, ("Mul", 1): _fp16_with_fp32_scalar,
    # BinaryComparisonOp::setup checks no type (equal.cpp's definition takes FLOAT too)
    **{(op, k): "biuf" for op in ("Equal", "Greater", "Less") for k in (0, 1)},
    ("TopK", 0): "iuf",                          # topk.cpp's T: integers too (TopK-10)
    ("TopK", 1): "iu",                           # read with getInputScalarValue
    ("Sqrt", 0): "iu",                           # an integer square root
    ("Scatter", 1): "iu", ("ScatterElements", 1): "iu",   # indices of any integer type
    ("Resize", 3): "iu",                         # sizes read as INT64 or INT32
    ("MatMul", 1): _FLOATS,                      # MatMulOp::setup: the lhs's type, any rhs
}


# Ops whose output type PopART decides otherwise than ONNX's inference (which the Builder
# declares): ArgMax / ArgMin give INT32, Mul float16 with a float32 scalar, BatchNormalization
# its statistics in their own type.
POPART_OUTPUT_TYPES = {"ArgMax", "ArgMin", "Mul", "BatchNormalization"}


def popart_accepts(op_type: str, k: int, inputs: list) -> bool:
    """True when PopART takes input ``k`` of an ai.onnx ``op_type`` node with the given
    ``inputs`` (arrays) where ONNX's schema would not (its type or a type bound to another
    input's)."""
    rule = POPART_INPUT_TYPES.get((op_type, k))
    if rule is None:
        return False
    if callable(rule):
        return rule(inputs)
    dtype = np.dtype(getattr(inputs[k], "dtype", np.float32))
    return dtype in rule if isinstance(rule, set) else dtype.kind in rule
