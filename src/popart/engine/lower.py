"""Lower IR graphs to JAX by interpreting them once under tracing.

Each node's registered lowering runs on the values of its inputs. Values are jax arrays
(traced) or NumPy arrays (known at compile time). A node whose inputs are all known is
evaluated at trace time (``jax.ensure_compile_time_eval``): that is constant folding, and it
is what lets shape-computing subgraphs (Shape -> Gather -> Concat -> Reshape) feed ops whose
inputs must be static.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import UnsupportedOperatorError, popart_exception
from ..ir.graph import Graph, Node
from ..ops import registry
from ..ops.registry import ONNX_DOMAIN

jax.config.update("jax_enable_x64", True)


@dataclass
class TraceState:
    """What all nodes of one trace share."""
    training: bool = False
    rng_key: Any = None                 # base PRNG key of this (micro-)batch
    replica_axis: Optional[str] = None
    replication_factor: int = 1
    options: Any = None
    platform: str = field(default_factory=jax.default_backend)  # where the program runs
    probes: Mapping[str, Any] = field(default_factory=dict)  # id -> zero probe (intermediate grads)
    assignments: dict = field(default_factory=dict)  # variable id -> new value (e.g. BN stats)
    remote_buffers: dict = field(default_factory=dict)  # RemoteStore / RemoteLoad, one execution
    _counter: itertools.count = field(default_factory=itertools.count)

    def next_key(self) -> Any:
        if self.rng_key is None:
            self.rng_key = jax.random.key(0)
        return jax.random.fold_in(self.rng_key, next(self._counter))


def is_static(x: Any) -> bool:
    return x is None or isinstance(x, (np.ndarray, np.generic, int, float, bool))


class NodeCtx:
    """The :class:`popart.ops.registry.LowerCtx` of one node."""

    def __init__(self, node: Node, version: int, env: Mapping[str, Any], state: TraceState):
        self.node, self.version, self.env, self.state = node, version, env, state
        self.op_type, self.domain, self.name = node.op_type, node.domain, node.name
        self.output_ids = node.outputs
        self.input_ids = node.inputs
        self.num_outputs = len(node.outputs)
        self.training = state.training
        self.replica_axis = state.replica_axis
        self.replication_factor = state.replication_factor
        self.options = state.options
        self._loop_key = None

    def rng(self) -> Any:
        return self.state.next_key()

    def static(self, x: Any, what: str) -> np.ndarray:
        if x is None:
            raise self.error(f"{what} is required")
        if is_static(x):
            return np.asarray(x)
        try:
            return np.asarray(x)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            raise self.error(f"{what} must be known at compile time (a constant, initializer "
                             f"folded from constants, or computed from shapes), but it is "
                             f"computed from run-time data") from None

    def assign(self, tensor_id: str, value: Any) -> None:
        self.state.assignments[tensor_id] = value

    def discard_subgraph_traces(self) -> None:
        """Forget what earlier run_subgraph calls derived (the loop's random key), before the
        lowering traces its subgraph again in another way: an abandoned trace's values are
        tracers of that trace."""
        self._loop_key = None

    def run_subgraph(self, graph: Graph, inputs: list, iteration: Any = None) -> list:
        state = self.state
        if iteration is not None:  # a loop body: fresh random numbers in every iteration
            if self._loop_key is None:
                self._loop_key = self.state.next_key()
            # Everything of the enclosing trace but its per-execution records, which a loop
            # body does not share (its assignments are ignored).
            state = dataclasses.replace(
                state, rng_key=jax.random.fold_in(self._loop_key, iteration), assignments={},
                remote_buffers={}, _counter=itertools.count())
        return run_graph(graph, inputs, state, outer=self.env)

    def error(self, msg: str) -> Exception:
        return UnsupportedOperatorError(f"{self.node.describe()}: {msg}")


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


def lower_node(node: Node, graph: Graph, env: Mapping[str, Any], state: TraceState) -> list:
    """Run one node's lowering; returns its output values (None for absent optional outputs)."""
    version = graph.opsets.get(node.domain, 1)
    opdef = registry.lookup(node.domain, node.op_type, version)
    attrs = dict(registry.attribute_defaults(node.op_type, version)) if node.domain == ONNX_DOMAIN else {}
    attrs.update(node.attrs)
    try:
        inputs = [env[i] if i else None for i in node.inputs]
    except KeyError as e:
        raise popart_exception(f"{node.describe()}: input tensor {e} is not produced by any "
                               f"node, graph input or initializer") from None
    ctx = NodeCtx(node, version, env, state)
    has_body = any(isinstance(v, Graph) or (isinstance(v, list) and v and isinstance(v[0], Graph))
                   for v in node.attrs.values())   # bodies may read traced outer tensors
    try:
        if not opdef.random and not has_body and all(is_static(x) for x in inputs):
            with jax.ensure_compile_time_eval():
                outs = _as_output_list(opdef.lower(ctx, *inputs, **attrs))
            outs = [_to_static(o) for o in outs]
        else:
            outs = _as_output_list(opdef.lower(ctx, *inputs, **attrs))
    except popart_exception:
        raise
    except TypeError as e:
        if "unexpected keyword argument" in str(e) or "required positional" in str(e):
            raise UnsupportedOperatorError(f"{node.describe()}: {e}") from None
        raise
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
        if tid in state.probes:
            local[tid] = local[tid] + state.probes[tid]
    for node in graph.nodes:
        outs = lower_node(node, graph, env, state)
        for tid, val in zip(node.outputs, outs):
            if tid:
                if tid in state.probes and val is not None:
                    val = val + state.probes[tid]
                local[tid] = val
    return local
