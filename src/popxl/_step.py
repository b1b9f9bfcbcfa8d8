"""popxl.Session's step: the Ir's main graph as one compiled program, (state, feeds) ->
(new state, device-to-host values and run-time checks), replicated (``Placement``) or
placed on the devices of its IPUs (``_placement.main_step``): the state packing, chosen
with the placement (:func:`packing`: :class:`ReplicaSlots` or ``_placement.MainPlan``), gives
its schedule, its arguments and their shardings; the step is ``step.state_step`` of that
schedule (one replica's graph run by ``step.GraphRun``, popart's part too); its facts from
one abstract trace (``compiled.plan_trace``), compiled through the engine cache when there
is one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from popart import report
from popart.engine.compiled import CompiledStep, Placement, plan_trace
from popart.engine.config import EngineConfig
from popart.engine.executable import EngineCache, compile_step, runtime_signature
from popart.engine.graph_api import Graph as IRGraph, fingerprint
from popart.engine.step import GraphRun, state_step
from popart.ir_json import serialize_ir

from ._placement import MainPlan

if TYPE_CHECKING:
    from .ir import Ir


@dataclass(frozen=True)
class Program:
    """What a session's step is made of, fixed when the session is made: the Ir, its main
    graph lowered (``main_ir``), the state arrays (``_state.StateArray``), the host-to-device
    and device-to-host streams with their tensors ((stream, tensor) pairs), each
    device-to-host stream's last stored tensor, ``n`` host transfers per run, ``r`` replicas
    in all and ``local_r`` of this instance."""
    ir: "Ir"
    main_ir: IRGraph
    slots: tuple
    h2d: tuple
    d2h: tuple
    d2h_final: dict
    n: int
    r: int
    local_r: int


class Built(NamedTuple):
    """A compiled step: the program, its run-time checks (their ids), its plan's facts and
    where the executable came from (``compile_step``)."""
    step: CompiledStep
    checks: list
    facts: dict
    source: str


def _to_device_memory(x: Any) -> Any:
    """``x`` moved to device memory inside a jitted function."""
    space = getattr(getattr(jax, "memory", None), "Space", None)
    if space is not None:
        return jax.device_put(x, space.Device)
    return jax.device_put(x, jax.sharding.TransferToMemoryKind("device"))  # type: ignore[attr-defined]


def _in_device_memory(fn: Any, keys: list) -> Any:
    """``fn(state, feeds)`` with the state arrays ``keys`` (kept in host memory between
    runs) moved to device memory for the step; the step's out_shardings put their new values
    back in host memory."""
    def step(state: dict, feeds: dict) -> tuple:
        return fn({k: _to_device_memory(v) if k in keys else v for k, v in state.items()}, feeds)
    return step


def replica_fn(p: Program, run: GraphRun) -> Callable:
    """One replica's main graph, run by ``run`` (``step.GraphRun``): (its state: variables
    and remote buffers, its streams' [N, ...] inputs) -> (the new state, device-to-host
    values and run-time checks; planning: their ``Facts``)."""
    n = p.n
    inputs = {s.key: s.graph_in for s in p.slots}
    new = {s.key: s.graph_out._ir_id if s.graph_out is not None else s.graph_in for s in p.slots}
    d2h = {t.id: p.d2h_final[s]._ir_id for s, t in p.d2h}
    zeros = {t.id: jax.ShapeDtypeStruct((n,) + s.shape, s.dtype.as_device_numpy()) for s, t in p.d2h}

    def replica(state: dict, feeds: dict) -> tuple:
        feeds = {**feeds, **{k: jnp.zeros(z.shape, z.dtype) for k, z in zeros.items()}}
        t = run(p.main_ir, feeds, {gin: state[key] for key, gin in inputs.items()})
        return run.result(t, run.written(t, new, state), run.outputs(t, d2h))
    return replica


class ReplicaSlots:
    """The unplaced packing of a popxl step's state (the placed one is ``_placement.MainPlan``:
    ``[replicas, ipus, *block]`` slots packed by ``placed.ExecutorPlan``, as popart's are;
    both answer the same questions, as popart's ``engine/packing.py``): one array per state
    slot, ``[replicas, *shape]``, a slice on each replica's device, in the slot's memory
    kind; the step is one replica's :func:`replica_fn`, replicated (``Placement.replicate``)."""

    ipus = 1   # IPUs per replica

    def __init__(self, p: Program, placement: Placement) -> None:
        self.p, self.placement = p, placement

    def state_specs(self) -> dict:
        return {s.key: jax.ShapeDtypeStruct((self.p.r,) + tuple(s.shape), s.dtype) for s in self.p.slots}

    def state_shardings(self) -> dict:
        split = self.placement.sharding(0)   # [replicas, ...]: one slice per replica's device
        return {s.key: split.with_memory_kind(s.memory_kind) if s.memory_kind else split
                for s in self.p.slots}

    @property
    def feed_sharding(self) -> jax.sharding.Sharding:
        """[replicas, ...] arrays: one slice per replica's device."""
        return self.placement.sharding(0)

    @property
    def host_keys(self) -> list:
        """The state arrays kept in host memory between runs."""
        return [s.key for s in self.p.slots if s.memory_kind]

    def schedule(self, p: Program) -> Callable:
        """The schedule (``step.state_step``): one replica's :func:`replica_fn`, replicated."""
        return lambda run, planned: self.placement.replicate(replica_fn(p, run), in_axes=(0, 0))


def packing(p: Program, placement: Placement, placed: Optional[MainPlan]) -> Any:
    """The state packing of the step: the placed plan's, or :class:`ReplicaSlots`."""
    return placed if placed else ReplicaSlots(p, placement)


def specs(p: Program, packed: Any) -> tuple:
    """The step's abstract arguments: the state (the packing's) and the feeds
    ([replicas, N, *shape])."""
    fspecs = {t.id: jax.ShapeDtypeStruct((p.r, p.n) + s.shape, s.dtype.as_device_numpy())
              for s, t in p.h2d}
    return packed.state_specs(), fspecs


def state_shardings(p: Program, placement: Placement, placed: Optional[MainPlan]) -> dict:
    """Where the state arrays live (the packing's)."""
    return packing(p, placement, placed).state_shardings()


def engine_cache(p: Program, config: EngineConfig, placement: Placement,
                 placed: Optional[MainPlan], memory_kind: str) -> Optional[EngineCache]:
    """The engine cache of the step (None without a cache folder), its key everything that
    shapes the program."""
    if config.cache_path is None:
        return None
    ir, hidden = p.ir, p.ir.main_graph._hidden
    signature = {"session": "popxl.Session", "graph": fingerprint(p.main_ir),
                 "replication": p.r, "instance_replication": p.local_r,
                 "num_host_transfers": p.n, "devices": len(placement.devices),
                 "ipus": packing(p, placement, placed).ipus,
                 "variables": {v.id: [list(v.shape), v.dtype.name] for v in ir._variables},
                 "remote": {str(b.remote_buffer_id): [b.entries, list(b.tensor_shape), b.tensor_dtype.name]
                            for b in ir._remote_buffers.values() if b._state_key in hidden},
                 "remote_memory_kind": memory_kind,
                 "h2d": {t.id: [list(s.shape), s.dtype.name] for s, t in p.h2d},
                 "d2h": {t.id: [list(s.shape), s.dtype.name] for s, t in p.d2h},
                 **runtime_signature()}
    return EngineCache(config.cache_path, "popxl", signature)


def compile_program(p: Program, placement: Placement, placed: Optional[MainPlan],
                    cache: Optional[EngineCache]) -> Built:
    """The step planned (one abstract trace: its run-time checks, ...) and compiled (or
    loaded from ``cache``), reporting as the Ir's options ask (``report.popxl_compiling``)."""
    packed = packing(p, placement, placed)
    split, state = packed.feed_sharding, packed.state_shardings()
    args = specs(p, packed)
    facts = plan_trace(state_step(packed.schedule(p), placement.platform, p.r), *args)[1]
    fn = state_step(packed.schedule(p), placement.platform, p.r, facts)
    host = packed.host_keys
    if host:
        fn = _in_device_memory(fn, host)
    step = CompiledStep(fn, in_shardings=(state, split), out_shardings=(state, split),
                        donate_argnums=(0,))
    ir = p.ir
    with report.popxl_compiling(   # autoReport.*, dotChecks, progress logger
            ir._options, p.main_ir, f"popxl.Ir {ir.id}", p.r * p.n,
            lambda: serialize_ir(p.main_ir, {}, "maingraph")):
        source = compile_step(step, args, cache)
    return Built(step, facts["checks"], facts, source)
