"""Lower IR graphs to JAX by interpreting them once under tracing.

Each node's registered lowering runs on the values of its inputs. Values are jax arrays
(traced) or NumPy arrays (known at compile time). A node whose inputs are all known is
evaluated at trace time (``jax.ensure_compile_time_eval``): that is constant folding, and it
is what lets shape-computing subgraphs (Shape -> Gather -> Concat -> Reshape) feed ops whose
inputs must be static.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from ..errors import (ModelError, OutOfMemoryException, UnsupportedOperatorError, noted,
                      popart_exception, popart_runtime_error)
from .._ir.graph import Graph, Node, reads
from .._ir.interipucopy import COPIED_FROM
from .._ir.recompute import Segment
from ..logging import getLogger
from ..ops import registry
from ..ops.registry import GRAPHCORE_DOMAIN, ONNX_DOMAIN, is_static
from ..tensorinfo import to_datatype
from .backends import Backend, backend
from .config import EngineConfig
from .channels_last import ChannelsLast

_logger = getLogger("op")


CHECKS = "__popart_run_checks__"   # the run-time checks' record among a program's outputs
RECORD = registry.CHECK_RECORD_SIZE   # a check's record: int64 [failed, id, up to 4 values]


@dataclass(frozen=True)
class RunCheck:
    """A condition a lowering checks while the program runs (``NodeCtx.check``); when it
    fails, each ``{name}`` of ``message`` is replaced by its value on the host."""
    message: str
    names: tuple
    error: type = popart_runtime_error   # what the session raises when it fails

    def text(self, values: Any) -> str:
        msg = self.message
        for name, v in zip(self.names, values):
            msg = msg.replace("{" + name + "}", str(int(v)))
        return msg


def first_failure(records: Any) -> jax.Array:
    """The first failed record among ``records`` ([..., RECORD]); the first record when none
    failed, zeros when there are none."""
    rows = jnp.reshape(jnp.asarray(records, jnp.int64), (-1, RECORD))
    if rows.shape[0] == 0:
        return jnp.zeros(RECORD, jnp.int64)
    return rows[jnp.argmax(rows[:, 0] != 0)]


def check_flags(state: "TraceState") -> Optional[jax.Array]:
    """The record of a trace's first failed run-time check (None: the trace has no checks)."""
    return first_failure(jnp.stack(state.checks)) if state.checks else None


def raise_failed_checks(record: Any, registry: list) -> None:
    """Raise popart_runtime_error if the host value of a record (``check_flags``, maybe
    reduced over batches with ``first_failure``) is a failure of ``registry``'s checks."""
    if record is not None:
        rec = np.asarray(record).reshape(-1)
        if rec[0] and int(rec[1]) < len(registry):
            check = registry[int(rec[1])]
            raise check.error(check.text(rec[2:]))
        if rec[0]:   # a check the plan did not know (cannot fail: the plan folded its inputs)
            raise popart_runtime_error(f"A run-time check of the program failed (check {int(rec[1])})")


@dataclass
class TraceState:
    """What all nodes of one trace share (private to the engine: front-ends call
    :func:`trace`, lowerings see it only through their :class:`NodeCtx`)."""
    training: bool = False
    rng_key: Any = None                 # base PRNG key of this (micro-)batch
    replica_axis: Optional[str] = None
    replication_factor: int = 1
    config: Optional[EngineConfig] = None   # the session's option facts (None: ONNX's rules)
    platform: str = field(default_factory=jax.default_backend)  # where the program runs
    probes: Mapping[str, Any] = field(default_factory=dict)  # id -> zero probe (intermediate grads)
    taps: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)  # id -> identity fn
    assignments: dict = field(default_factory=dict)  # variable id -> new value (e.g. BN stats)
    remote_buffers: dict = field(default_factory=dict)  # RemoteStore / RemoteLoad, one execution
    checks: list = field(default_factory=list)     # records of NodeCtx.check in this trace
    registry: list = field(default_factory=list)   # RunCheck by id, shared with nested traces
    remat: Optional["Remat"] = None      # recomputation: the top graph's recompute segments
    float32_loss: Optional[str] = None   # a float16 loss whose gradient runs in float32 ...
    loss32: Any = None                   # ... and its value as float32, to scale and differentiate
    float32_region: frozenset = frozenset()   # ... with the nodes making these (als.py)
    effects: Optional[set] = None        # when a set: collects id(node) of nodes with side effects
    _counter: itertools.count = field(default_factory=itertools.count)
    rng_draws: int = 0
    scope_names: dict = field(default_factory=dict)  # id(node) -> its name in the program
    layout: ChannelsLast = field(default_factory=ChannelsLast)  # NHWC twins of NCHW values
    graph_reads: dict = field(default_factory=dict)  # id(graph) -> what its nodes read
    graph_readers: dict = field(default_factory=dict)  # id(graph) -> tensor -> reading nodes

    @property
    def backend(self) -> Backend:
        """The platform's backend: its lowering overrides and compiler facts."""
        return backend(self.platform)

    def footprint(self) -> tuple:
        """What a node with side effects changes (random draws, variable updates, run-time
        checks, remote buffers)."""
        return (self.rng_draws, len(self.checks), len(self.registry), len(self.assignments),
                len(self.remote_buffers))

    def used_rng(self) -> bool:
        """Whether any op of this trace drew a random key."""
        return self.rng_draws > 0

    def next_key(self) -> Any:
        self.rng_draws += 1
        if self.rng_key is None:
            self.rng_key = jax.random.key(0)
        return jax.random.fold_in(self.rng_key, next(self._counter))


# What NodeCtx.static's error says of a value only known at run time: callers that retry with
# more inputs compiled in (the ONNX backend, engine/segments.py) recognise the error by it.
NOT_STATIC = "must be known at compile time"


class NodeCtx:
    """The :class:`popart.ops.registry.LowerCtx` of one node."""

    def __init__(self, node: Node, version: int, env: Mapping[str, Any], state: TraceState,
                 graph: Optional[Graph] = None):
        self.node, self.version, self._env, self._state = node, version, env, state
        self._graph = graph
        self.op_type, self.domain, self.name = node.op_type, node.domain, node.name
        self.output_ids = node.outputs
        self.input_ids = node.inputs
        self.num_outputs = len(node.outputs)
        self.training = state.training
        self.replica_axis = state.replica_axis
        self.replication_factor = state.replication_factor
        self.config = state.config
        self.platform = state.platform
        self._loop_key = None

    def rng(self) -> Any:
        return self._state.next_key()

    @property
    def consumed(self) -> bool:
        if self._graph is None:
            return True
        read = self._state.graph_reads.get(id(self._graph))
        if read is None:
            read = self._state.graph_reads[id(self._graph)] = {
                t for n in self._graph.nodes for t in reads(n)}
        return any(o in read for o in self.output_ids if o)

    def readers(self, tensor_id: str) -> Optional[list]:
        if self._graph is None:
            return None
        table = self._state.graph_readers.get(id(self._graph))
        if table is None:
            table = self._state.graph_readers[id(self._graph)] = {}
            for n in self._graph.nodes:
                for t in reads(n):
                    table.setdefault(t, []).append(n)
            for t in self._graph.outputs:
                table.setdefault(t, []).append("output")
        return table.get(tensor_id, [])

    def static(self, x: Any, what: str) -> np.ndarray:
        if x is None:
            raise self.error(f"{what} is required")
        if is_static(x):
            return np.asarray(x)
        try:
            return np.asarray(x)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            raise self.error(f"{what} {NOT_STATIC} (a constant, initializer "
                             f"folded from constants, or computed from shapes), but it is "
                             f"computed from run-time data") from None

    def assign(self, tensor_id: str, value: Any) -> None:
        self._state.assignments[tensor_id] = value

    def discard_subgraph_traces(self) -> None:
        """Forget what earlier run_subgraph calls derived (the loop's random key), before the
        lowering traces its subgraph again in another way: an abandoned trace's values are
        tracers of that trace."""
        self._loop_key = None

    def run_subgraph(self, graph: Graph, inputs: list, iteration: Any = None,
                     state: Optional[TraceState] = None) -> list:
        if len(inputs) != len(graph.inputs):
            raise ModelError(f"{self.node.describe()}: subgraph '{graph.name}' has "
                             f"{len(graph.inputs)} input(s), but the node passes {len(inputs)}")
        # declared types must hold, as in ONNX Runtime; a PopART session's If / Loop / Scan /
        # Call bodies take the caller's tensor infos instead (loop.cpp, call.cpp, scan.cpp)
        for tid, x in zip(graph.inputs if self._state.config is None else (), inputs):
            info, shape = graph.tensor_info.get(tid), getattr(x, "shape", None)
            if info is not None and shape is not None and info._shape is not None and (
                    len(info._shape) != len(shape) or any(d not in (-1, s) for d, s in zip(info._shape, shape))):
                raise ModelError(f"{self.node.describe()}: subgraph '{graph.name}' declares input "
                                 f"'{tid}' of shape {info._shape}, but it is given {list(shape)}")
        state = state or self._state
        if iteration is not None:  # a loop body: fresh random numbers in every iteration
            if self._loop_key is None:
                self._loop_key = self._state.next_key()
            # Everything of the enclosing trace but its per-execution records, which a loop
            # body does not share (its assignments are ignored).
            state = dataclasses.replace(
                state, rng_key=jax.random.fold_in(self._loop_key, iteration), assignments={},
                remote_buffers={}, _counter=itertools.count())
        return run_graph(graph, inputs, state, outer=self._env)

    def run_body(self, graph: Graph, inputs: list, iteration: Any = None) -> tuple[list, jax.Array]:
        """``run_subgraph`` inside a function JAX traces on its own (a lax.cond branch, a
        scan or while_loop body). Also returns the record of the body's run-time checks
        (``first_failure``), which the body returns and the lowering passes to
        ``check_record`` outside it."""
        body = dataclasses.replace(self._state, checks=[])
        outs = self.run_subgraph(graph, inputs, iteration, body)
        return outs, first_failure(jnp.stack(body.checks) if body.checks else jnp.zeros((0, RECORD)))

    def check_record(self, records: Any) -> None:
        """Fail the run if a record that ``run_body`` returned (any leading dimensions: one
        per iteration, ...) is a failure. Lowerings trace nested functions (lax.cond
        branches, scan / while bodies, vjp) with ``run_body``, so a record is always a value
        of the trace this node's state belongs to."""
        self._state.checks.append(first_failure(records))

    def error(self, msg: str) -> Exception:
        return UnsupportedOperatorError(f"{self.node.describe()}: {msg}")

    def channels_last(self, x: Any, transpose: bool = False) -> Optional[Any]:
        layout = self._state.layout
        return layout.to_last(x) if transpose else layout.twin(x)

    def keep_channels_last(self, y_nhwc: Any) -> Any:
        return self._state.layout.keep(y_nhwc)

    def host_stream(self, stream_id: str) -> Any:
        """The value of host stream ``stream_id`` (a step input, or a tensor of this or an
        enclosing scope), or None."""
        return self._env.get(stream_id) if hasattr(self._env, "get") else None

    def store_host_stream(self, stream_id: str, value: Any) -> None:
        """Make ``value`` readable as ``stream_id`` (an anchor) unless a tensor has that name."""
        if stream_id not in self._env:
            self._env[stream_id] = value

    def remote_buffers(self) -> dict:
        """Remote buffer id -> [(offset, value)] stores of this graph execution."""
        return self._state.remote_buffers

    def check(self, failed: Any, message: str, error_class: Optional[type] = None,
              **values: Any) -> None:
        """Fail the run with ``message`` (naming this node; each ``{name}`` replaced by
        ``values[name]``, an int scalar; at most 4) when ``failed`` (a bool scalar) is true.
        Known at compile time: raises ModelError now. Otherwise its record becomes an output
        of the program (or of the control-flow body, see ``run_body``) and the session raises
        popart_runtime_error (or ``error_class``, which also defers a failure known at compile
        time to the run) after the run."""
        for copy, source in self.node.annotations.get(COPIED_FROM, {}).items():
            message = message.replace(f"'{copy}'", f"'{source}'")   # the plan's text
        check = RunCheck(f"{self.node.describe()}: {message}", tuple(values),
                         error_class or popart_runtime_error)
        if not isinstance(failed, jax.core.Tracer) and error_class is None:
            if bool(np.asarray(failed)):
                raise ModelError(check.text(np.asarray(v) for v in values.values()))
            return
        reg = self._state.registry   # a check the plan knows keeps the plan's id
        if check not in reg:
            reg.append(check)
        vals = [jnp.asarray(v).astype(jnp.int64).reshape(()) for v in values.values()]
        self.check_record(jnp.stack([jnp.asarray(failed).astype(jnp.int64).reshape(()),
                                     jnp.int64(reg.index(check)), *vals]
                                    + [jnp.int64(0)] * (RECORD - 2 - len(vals))))


def _to_static(o: Any) -> Any:
    """A folded output as NumPy (a sequence element by element). Some lowerings (custom_jvp
    functions under vmap) stay traced: those are kept as they are."""
    if o is None or isinstance(o, jax.core.Tracer):
        return o
    if isinstance(o, list):
        return [_to_static(e) for e in o]
    return np.asarray(o)


def _as_output_list(out: Any) -> list:
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


# The 'axis' attribute of ONNX ops indexes the first input's dimensions, [-rank, rank - 1],
# widened for ops whose output has more dimensions (below, above); some ignore it at times.
_AXIS_SLACK = {"Flatten": (0, 1), "OneHot": (1, 1)}
_AXIS_UNCHECKED = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}
# Integer attributes of ONNX ops that are flags: runtimes read other values differently.
_FLAGS = {"keepdims", "noop_with_empty_axes", "select_last_index", "largest", "sorted",
          "exclusive", "reverse", "ceil_mode", "count_include_pad", "transA", "transB", "allowzero"}


# PopART's text for an 'axis' out of range, where the op's setup or factory has its own
# (concat.cpp, gather.cpp, logsoftmax.cpp, split.cpp, reshape.cpp's flattenOpFactory); else
# util.cpp / argextrema.cpp's. {a}: the attribute, {n}: it counted from 0, {r}: the rank, {t}:
# the input tensor; Split's factory has its own for a negative axis.
_AXIS_TEXT = {
    "Concat": "Attribute 'axis' of ConcatOp, {a}, is outside of acceptable range [{lo}, {hi}]",
    "Gather": "GatherOp::setup axis = {a} is outside the acceptable range [{lo}, {hi}]",
    "LogSoftmax": "LogSoftmax axis, {a}, is outside of acceptable range [{lo}, {hi}]",
    "Split": "Axis {n} is out of range for tensor with {r} dims",
    "Split-": "Split op input tensor {t}, rank {r}, axis {a} is out of range",
    "Flatten": "invalid axis {n} in flattenOpFactory"}


def axis_problem(op_type: str, axis: int, rank: int, tensor: str = "") -> str:
    """PopART's error text for ONNX op ``op_type``'s 'axis' attribute when it is out of range
    for a first input ``tensor`` of ``rank`` dimensions ("" when it is valid)."""
    below, above = _AXIS_SLACK.get(op_type, (0, 0))
    lo, hi = -rank - below, rank + above - 1
    if op_type in _AXIS_UNCHECKED or lo <= axis <= hi:
        return ""
    key = op_type + "-" if axis < 0 and op_type + "-" in _AXIS_TEXT else op_type
    return _AXIS_TEXT.get(key, "Axis {a} is out of acceptable range [{lo}, {hi}]").format(
        a=axis, n=axis + rank if axis < 0 else axis, r=rank, t=tensor, lo=lo, hi=hi)


# Ops whose setup broadcasts inputs of one type as NumPy does (ElementWiseBinaryBaseOp).
_NP_TYPED = {"Add", "Sub", "Div", "Pow", "Mod", "PRelu"}
# Ops whose setup broadcasts their inputs as NumPy does (Op::prettyNpOut / npOut).
_NP_BROADCAST = {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Fmod", "And", "Or", "Xor", "Equal",
                 "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "BitShift", "Max", "Min",
                 "Mean", "Sum", "PRelu"}


def _np_broadcast(s0: tuple, s1: tuple) -> Optional[tuple]:
    """NumPy's broadcast shape of ``s0`` and ``s1`` (None when they are not aligned)."""
    try:
        return tuple(np.broadcast_shapes(tuple(s0), tuple(s1)))
    except ValueError:
        return None


def _op_str(node: Node, graph: Graph, version: int) -> str:
    """PopART's Op::str(): '<id> (<domain>.<type>:<version>)', the node's position as id."""
    schema = registry.onnx_schema(node.op_type, version) if node.domain == ONNX_DOMAIN else None
    domain = node.domain or "ai.onnx"
    pos = next((i for i, n in enumerate(graph.nodes) if n is node), 0)
    return f"{pos} ({domain}.{node.op_type}:{schema.since_version if schema else version})"


def info_text(x: Any, shape: Any = None) -> str:
    """PopART's TensorInfo text of array ``x`` (or of type name ``x`` and ``shape``): the
    type padded to 8, then the shape as '[2 3]'."""
    name = x if isinstance(x, str) else to_datatype(np.dtype(x.dtype)).name
    return f"{name:<8}[{' '.join(str(d) for d in (np.shape(x) if shape is None else shape))}]"


def _check_setup(node: Node, graph: Graph, version: int, inputs: list) -> None:
    """Shape rules PopART's op setup checks with its own texts: NumPy broadcasting of
    elementwise ops and of MatMul's batch dimensions (tensorinfo.cpp's npOut) and Nll's label
    shape (nll.cpp)."""
    shapes = [np.shape(x) for x in inputs if x is not None and hasattr(x, "shape")]
    legacy = node.domain == ONNX_DOMAIN and "broadcast" in getattr(
        registry.onnx_schema(node.op_type, version), "attributes", {})   # Add-6's rules
    def broadcast(frames: list) -> None:   # npOut's check and text
        out = frames[0]
        for s in frames[1:]:
            nxt = _np_broadcast(out, s)
            if nxt is None:
                fmt = lambda t: ", ".join(str(d) for d in t)
                raise noted(ModelError(
                    f"np broadcasting failed on 'Op {_op_str(node, graph, version)}', frames "
                    f"[{fmt(out)}] and [{fmt(s)}] are not aligned"),
                    f"{node.describe()}: inputs {list(node.inputs)} do not broadcast")
            out = nxt
    if node.domain == ONNX_DOMAIN and node.op_type in _NP_BROADCAST and len(shapes) > 1 \
            and not legacy:
        broadcast(shapes)
    if node.domain == ONNX_DOMAIN and node.op_type == "MatMul" and len(shapes) == 2 \
            and all(len(s) > 1 for s in shapes):   # npMatMulOut: the batch (group) frames
        broadcast([s[:-2] or (1,) for s in shapes])
    if node.domain == GRAPHCORE_DOMAIN and node.op_type == "Nll" and len(inputs) > 1 \
            and inputs[0] is not None and inputs[1] is not None:
        probs, label = inputs[0], inputs[1]
        op = _op_str(node, graph, version)
        if np.ndim(probs) == 0:
            raise noted(ModelError(f"Invalid shape for prob tensor ({info_text(probs)}) in "
                                   f"Op {op}. "), f"{node.describe()}: probs '{node.inputs[0]}'")
        want = tuple(np.shape(probs)[:-1])
        if tuple(np.shape(label)) != want:
            raise noted(ModelError(
                f"The label tensor ({info_text(label)}) must have shape "
                f"[{' '.join(map(str, want))}] to match all but the final dimension of the "
                f"probabilities tensor ({info_text(probs)}) in Op {op}. "),
                f"{node.describe()}: label '{node.inputs[1]}' has shape "
                f"{list(np.shape(label))}; expected {list(want)} (probs "
                f"'{node.inputs[0]}' {list(np.shape(probs))} without its class axis)")


def _type_str(dtype: Any) -> str:
    """ONNX's type string of a NumPy dtype, e.g. 'tensor(float)'."""
    try:
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        return f"tensor({onnx.TensorProto.DataType.Name(elem).lower()})"
    except (KeyError, TypeError, ValueError):
        return ""


def _type_kind(type_str: str) -> str:
    """'float' for ONNX's float types, else the type ('int64', 'bool', ...): ops computing in
    another float width than ONNX lists (float64 Celu) are deliberately supported."""
    name = type_str[7:-1]
    return "float" if name.startswith(("float", "bfloat", "double")) else name


@functools.lru_cache(maxsize=None)
def _allowed_types(schema: Any, type_str: str) -> frozenset:
    """The tensor types a schema's type parameter (or fixed type) allows; empty when it allows
    other kinds too (sequences, optionals), which are not checked."""
    allowed = next((set(c.allowed_type_strs) for c in schema.type_constraints
                    if c.type_param_str == type_str), {type_str})
    return frozenset(allowed) if all(t.startswith("tensor(") for t in allowed) else frozenset()


def _check_signature(node: Node, graph: Graph, version: int, inputs: list) -> None:
    """ONNX's schema rules that need the inputs' types (the importer checks the rest with
    onnx's checker): flags 0 or 1, an 'axis' attribute in range, inputs of a kind the op
    takes, and inputs bound to one type parameter of one dtype (no implicit promotion)."""
    schema = registry.onnx_schema(node.op_type, version)
    if schema is None:
        return
    for name in _FLAGS.intersection(node.attrs):
        if node.attrs[name] not in (0, 1):
            raise ModelError(f"{node.describe()}: attribute {name} is {node.attrs[name]}; it "
                             f"must be 0 or 1")
    axis, rank = node.attrs.get("axis"), getattr(inputs[0] if inputs else None, "ndim", None)
    if "broadcast" in schema.attributes and not node.attrs.get("broadcast"):
        axis = None   # Add-6 and the other legacy-broadcast ops ignore axis without broadcast
    if type(axis) is int and rank is not None:
        problem = axis_problem(node.op_type, axis, rank, node.inputs[0])
        if problem:
            raise noted(ModelError(problem), f"{node.describe()}: axis {axis} of input "
                        f"'{node.inputs[0]}' of rank {rank}")
    bound: dict[str, tuple[int, Any]] = {}
    for k, x in enumerate(inputs):
        formal = schema.inputs[min(k, len(schema.inputs) - 1)]
        dtype = getattr(x, "dtype", None)
        if dtype is None or isinstance(x, list) or not formal.is_homogeneous \
                or registry.popart_accepts(node.op_type, k, inputs):   # PopART's looser rules
            continue
        allowed = _allowed_types(schema, formal.type_str)
        if allowed and _type_kind(_type_str(dtype)) not in {_type_kind(t) for t in allowed}:
            raise ModelError(
                f"{node.describe()}: input {k} ('{node.inputs[k]}') is {dtype}, which "
                f"{node.op_type}-{schema.since_version} does not take (its {formal.type_str} is one "
                f"of {', '.join(sorted(t[7:-1] for t in allowed))})")
        first = bound.setdefault(formal.type_str, (k, dtype))
        if first[1] != dtype and node.op_type in _NP_TYPED:   # ElementWiseBinaryBaseOp::setup
            a, b = inputs[first[0]], x
            ta, tb = (to_datatype(np.dtype(v.dtype)).name for v in (a, b))
            sa, sb = (registry.shape_text(np.shape(v)) for v in (a, b))
            raise noted(ModelError(
                f"np broadcasting failed on Op {_op_str(node, graph, version)}, incompatible "
                f"types {ta} and {tb} (shapes {sa} and {sb})"),
                f"{node.describe()}: inputs '{node.inputs[first[0]]}' and '{node.inputs[k]}'; "
                f"insert a Cast")
        if first[1] != dtype:
            raise ModelError(
                f"{node.describe()}: input {k} ('{node.inputs[k]}') is {dtype} but input "
                f"{first[0]} ('{node.inputs[first[0]]}') is {first[1]}; {node.op_type} needs "
                f"both of one type ({formal.type_str}); insert a Cast")


def node_scope_name(node: Node, graph: Graph, names: Optional[dict] = None) -> str:
    """The name a node's ops carry in the compiled program (``jax.named_scope``): the node's
    name, else ``<OpType>_<n>`` with n its position in its graph, so that profiles and memory
    dumps of the compiled program name the user's nodes. ``names`` caches a graph's names."""
    if node.name:
        return node.name
    names = {} if names is None else names
    if id(node) not in names:
        names.update((id(n), f"{n.op_type}_{i}") for i, n in enumerate(graph.nodes))
    return names.get(id(node), node.op_type)


def lower_node(node: Node, graph: Graph, env: Mapping[str, Any], state: TraceState) -> list:
    """Run one node's lowering; returns its output values (None for absent optional outputs)."""
    version = graph.opsets.get(node.domain, 1)
    opdef = state.backend.lookup(node.domain, node.op_type, version)
    attrs = registry.node_attribute_defaults(node, version)
    attrs.update(node.attrs)
    try:
        inputs = [env[i] if i else None for i in node.inputs]
    except KeyError as e:
        raise popart_exception(f"{node.describe()}: input tensor {e} is not produced by any "
                               f"node, graph input or initializer") from None
    if node.domain == ONNX_DOMAIN:
        _check_signature(node, graph, version, inputs)
    _check_setup(node, graph, version, inputs)
    ctx = NodeCtx(node, version, env, state, graph)
    name = node_scope_name(node, graph, state.scope_names)
    scope = jax.named_scope(name) if name else contextlib.nullcontext()
    has_body = any(isinstance(v, Graph) or (isinstance(v, list) and v and isinstance(v[0], Graph))
                   for v in node.attrs.values())   # bodies may read traced outer tensors
    try:
        if not opdef.random and not has_body and all(is_static(x) for x in inputs):
            with jax.ensure_compile_time_eval(), scope:
                outs = _as_output_list(opdef.lower(ctx, *inputs, **attrs))
            outs = [_to_static(o) for o in outs]
        elif opdef.elementwise and (last := state.layout.elementwise_inputs(inputs)) is not None:
            with scope:   # channels-last inputs: the op runs on them, its output keeps a twin
                outs = [state.layout.keep(_as_output_list(opdef.lower(ctx, *last, **attrs))[0])]
        else:
            with scope:
                outs = _as_output_list(opdef.lower(ctx, *inputs, **attrs))
    except popart_exception:
        raise
    except Exception as e:   # a lowering's own error: the node's inputs or attributes are invalid
        msg = f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
        if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in msg:
            raise OutOfMemoryException(f"{node.describe()}: out of memory ({msg})") from e
        raise ctx.error(f"cannot be computed for these inputs and attributes ({msg})") from e
    if len(outs) < len([o for o in node.outputs if o]):
        outs += [None] * (len(node.outputs) - len(outs))
    return outs


def run_graph(graph: Graph, inputs: list, state: TraceState, outer: Optional[Mapping] = None,
              weights: Optional[Mapping[str, Any]] = None) -> list:
    """Execute ``graph`` on positional ``inputs``; returns the graph's outputs.

    ``weights`` add to / override initializer values (traced arguments in a session);
    ``outer`` is the enclosing scope for subgraphs."""
    env = execute(graph, dict(zip(graph.inputs, inputs)), state, outer, weights)
    try:
        return [env[o] for o in graph.outputs]
    except KeyError as e:
        raise popart_exception(f"Graph '{graph.name}': output {e} is never produced") from None


def execute(graph: Graph, feeds: Mapping[str, Any], state: TraceState,
            outer: Optional[Mapping] = None, weights: Optional[Mapping[str, Any]] = None) -> dict:
    """Execute ``graph`` and return the environment of every tensor it computes (lazily
    evaluated by XLA: only what is returned from the traced function is computed)."""
    local: dict[str, Any] = {}
    env = ChainMap(local, outer) if outer is not None else local
    local.update(graph.initializers)
    local.update(weights or {})
    local.update(feeds)
    for tid in list(local):
        local[tid] = _instrumented(tid, local[tid], state)
    remat = state.remat if state.remat is not None and state.remat.nodes is graph.nodes else None
    for i, node in enumerate(graph.nodes):
        if remat is not None and i in remat.members:   # runs with its segment, at its end
            if i in remat.at:
                local.update(run_segment(remat.at[i], graph, env, state))
            continue
        before = state.footprint() if state.effects is not None else None
        if state.float32_loss is not None and state.float32_loss in node.outputs:
            made = run_float32_loss(node, graph, env, state)
            local.update({t: v for t, v in made.items() if t not in node.outputs})
            outs = [made.get(t) for t in node.outputs]
        elif state.float32_region.intersection(node.outputs):
            continue   # runs with the float16 loss (run_float32_loss)
        else:
            outs = lower_node(node, graph, env, state)
        if before is not None and state.footprint() != before:
            state.effects.add(id(node))
        for tid, val in zip(node.outputs, outs):
            if tid:
                local[tid] = _instrumented(tid, val, state)
    return local


def _instrumented(tid: str, val: Any, state: TraceState) -> Any:
    """A tensor as the trace keeps it: its probe added, its tap applied (where it has them)."""
    if val is not None and tid in state.probes:
        val = val + state.probes[tid]
    if val is not None and tid in state.taps:
        val = state.taps[tid](val)
    return val


@dataclass
class Remat:
    """The recompute segments of one graph (``ir.recompute.segments``) and a run-time true
    value the compiler cannot fold (``one``, a step argument)."""
    nodes: list                      # the graph's node list (segments index into it)
    segments: list[Segment]
    one: Any = None

    def __post_init__(self) -> None:
        self.at = {s.nodes[-1]: s for s in self.segments}
        self.members = {i for s in self.segments for i in s.nodes}


def _split_reads(ids: Any, env: Mapping[str, Any]) -> tuple[list, dict, list]:
    """The traced tensors among ``ids`` (a custom_vjp's arguments), the rest (known at compile
    time, closed over) by id, and whether each traced one is differentiable (inexact)."""
    traced = [t for t in ids if isinstance(env[t], (jax.Array, jax.core.Tracer))]
    fixed = {t: env[t] for t in ids if t not in traced}
    return traced, fixed, [jnp.issubdtype(jnp.result_type(env[t]), jnp.inexact) for t in traced]


def run_segment(seg: Segment, graph: Graph, env: Mapping[str, Any], state: TraceState) -> dict:
    """Run a recompute segment's nodes as one function whose backward pass stores only the
    traced tensors it reads and runs the nodes again (a ``jax.custom_vjp``). The
    recomputation is kept apart from the forward pass, so that the compiler cannot merge the
    two back: behind an optimisation barrier, or on the CPU (whose compiler removes
    barriers) in a conditional on ``state.remat.one``. Returns ``seg.gives``' values."""
    nodes = [graph.nodes[i] for i in seg.nodes]
    traced, fixed, diff = _split_reads(seg.reads, env)
    known: dict = {}   # gives known at compile time (Shape, ...): they stay NumPy values

    def forward(*vals: Any) -> tuple:
        local = {**fixed, **dict(zip(traced, vals))}
        for node in nodes:
            for tid, val in zip(node.outputs, lower_node(node, graph, local, state)):
                if tid:
                    local[tid] = val
        known.update((t, local[t]) for t in seg.gives if is_static(local[t]))
        return tuple(local[t] for t in seg.gives if t not in known)

    def bwd(res: tuple, cts: tuple) -> tuple:
        vals, one = res
        # the float0 cotangents of integer outputs are constants, rebuilt where they are used
        real = tuple(c for c in cts if c.dtype != jax.dtypes.float0)
        zero = [None if c.dtype != jax.dtypes.float0 else np.zeros(c.shape, c.dtype) for c in cts]

        def gradients(vals: tuple, real: tuple) -> tuple:
            it = iter(real)
            _, vjp = jax.vjp(forward, *vals)
            g = vjp(tuple(next(it) if z is None else z for z in zero))
            return tuple(gi for gi, d in zip(g, diff) if d)

        if state.backend.keeps_barriers:   # keeps the recomputation apart; else a conditional
            grads = gradients(*jax.lax.optimization_barrier((vals, real)))
        else:
            grads = jax.lax.cond(one > 0, gradients, lambda v, c: tuple(
                jnp.zeros_like(x) for x, d in zip(v, diff) if d), vals, real)
        it = iter(grads)
        return tuple(next(it) if d else None for d in diff), None

    @jax.custom_vjp
    def segment(vals: tuple, one: Any) -> tuple:
        return forward(*vals)

    segment.defvjp(lambda vals, one: (forward(*vals), (vals, one)), bwd)
    out = segment(tuple(env[t] for t in traced), state.remat.one)
    return {**known, **dict(zip([t for t in seg.gives if t not in known], out))}


def run_float32_loss(node: Node, graph: Graph, env: Mapping[str, Any], state: TraceState) -> dict:
    """A float16 loss op as PopART runs its gradient under EnsureFp32LossScale, with the nodes
    of ``state.float32_region`` before it (none for Nll, SoftmaxNll, L1, whose
    mixed-precision grad ops take the float32 scale): the forward pass in float16 as usual,
    the backward pass in float32 from a float32 loss (``state.loss32``) with the region's
    float16 inputs cast up, so that a loss scale above float16's range reaches their
    gradients (then cast to float16) without overflowing. Returns every output of the
    region's nodes (the loss in float16, as without this)."""
    nodes = [n for n in graph.nodes if n is node or state.float32_region.intersection(n.outputs)]
    made = {o for n in nodes for o in n.outputs if o}
    traced, fixed, diff = _split_reads(
        list(dict.fromkeys(t for n in nodes for t in reads(n) if t not in made)), env)

    def run(vals: tuple, upcast: bool) -> dict:
        vals = [v.astype(jnp.float32) if upcast and d and v.dtype == jnp.float16 else v
                for v, d in zip(vals, diff)]
        local = {**fixed, **dict(zip(traced, vals))}
        for n in nodes:
            local.update((t, v) for t, v in zip(n.outputs, lower_node(n, graph, local, state)) if t)
        return local

    def loss(vals: tuple, upcast: bool) -> Any:
        return jnp.asarray(run(vals, upcast)[state.float32_loss]).astype(jnp.float32)

    def bwd(vals: tuple, ct: Any) -> tuple:
        _, vjp = jax.vjp(lambda *v: loss(v, True), *vals)
        grads = vjp(ct)
        return (tuple(g.astype(v.dtype) if d else None for g, v, d in zip(grads, vals, diff)),)

    @jax.custom_vjp
    def f(vals: tuple) -> Any:
        return loss(vals, False)

    f.defvjp(lambda vals: (loss(vals, False), vals), bwd)
    vals = tuple(env[t] for t in traced)
    state.loss32 = f(vals)
    out: dict = {}
    if made != set(node.outputs):   # the region's other tensors (anchors may read them)
        got = run(tuple(map(jax.lax.stop_gradient, vals)), False)
        out = {t: got[t] for t in made}
    return {**out, state.float32_loss: state.loss32.astype(jnp.float16)}


@dataclass
class Trace:
    """What tracing a graph once gives a front-end: every tensor's value (``env``) and the
    trace's records (``state``, engine-private)."""
    env: dict
    _state: TraceState

    @property
    def assignments(self) -> dict:
        """Variable id -> new value (``ctx.assign``: BatchNormalization statistics, ...)."""
        return self._state.assignments

    @property
    def checks(self) -> list:
        """The run-time checks of the trace (RunCheck by id), for ``raise_failed_checks``."""
        return self._state.registry

    def used_rng(self) -> bool:
        """Whether any op drew a random key."""
        return self._state.used_rng()

    def check_flags(self) -> Optional[jax.Array]:
        """The record of the first failed run-time check (None: the trace has no checks)."""
        return check_flags(self._state)

    def scalable_loss(self, loss: str) -> Any:
        """The loss to scale and differentiate: float32 where the trace runs its gradient in
        float32 (``float32_loss``), else the loss itself."""
        return self._state.loss32 if self._state.loss32 is not None else self.env[loss]


def trace(graph: Graph, feeds: Mapping[str, Any], *, key: Any = None, training: bool = False,
          weights: Optional[Mapping[str, Any]] = None, replica_axis: Optional[str] = None,
          replication_factor: int = 1, config: Optional[EngineConfig] = None, platform: Optional[str] = None,
          probes: Optional[Mapping[str, Any]] = None, remat: Optional[Remat] = None,
          effects: Optional[set] = None,
          taps: Optional[Mapping[str, Callable[[Any], Any]]] = None,
          float32_loss: Optional[str] = None, float32_region: frozenset = frozenset(),
          checks: Sequence[RunCheck] = ()) -> Trace:
    """Trace ``graph`` once on ``feeds`` (and ``weights``, which override initializers):
    the engine's one entry for front-ends. ``key`` is the base PRNG key (default key(0));
    ``replica_axis`` the vmap / shard_map axis replicas run under; ``probes`` zero tensors
    added to intermediate tensors whose gradients a session anchors; ``taps`` functions
    applied to tensors where they enter the trace (identities in value whose backward pass
    records statistics of the gradient, e.g. ``als.AlsPlan.tap``); ``remat`` the graph's
    recompute segments; ``effects`` a set that collects id(node) of the nodes with side
    effects (what a segment may not hold); ``float32_loss`` a float16 loss whose gradient
    runs in float32 (:func:`run_float32_loss`, :meth:`Trace.scalable_loss`) with the nodes
    making ``float32_region``; ``checks`` the
    run-time checks a plan found (``Trace.checks`` of its abstract trace): they keep their ids
    there, so records of this trace index the plan's registry (a step's facts come from its
    plan, never from tracing the step)."""
    state = TraceState(training=training, rng_key=key, replica_axis=replica_axis,
                       replication_factor=replication_factor, config=config,
                       probes=probes or {}, taps=taps or {},
                       platform=platform or jax.default_backend(), remat=remat, effects=effects,
                       float32_loss=float32_loss, float32_region=float32_region,
                       registry=list(checks))
    return Trace(execute(graph, feeds, state, weights=weights), state)


def trace_node(node: Node, graph: Graph, env: Mapping[str, Any], *,
               replica_axis: Optional[str] = None, replication_factor: int = 1) -> list:
    """One node's output values on ``env`` (for front-ends that infer shapes op by op)."""
    state = TraceState(rng_key=jax.random.key(0), replica_axis=replica_axis,
                       replication_factor=replication_factor)
    return lower_node(node, graph, env, state)
