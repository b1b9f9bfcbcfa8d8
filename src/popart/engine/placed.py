"""The placed executor: a program's IPUs on the devices of a (replica, ipu) mesh.

Both front-ends run placed programs with it (docs/model_parallelism.md): popart sessions
(``pipeline.PlacedPlan``, data) and ``popxl.Session`` (``popxl._placement``: a ``MainPlan``,
data). Here: the cut of a graph's ops into stages (:func:`plan_stages`, a :class:`StagePlan`),
the stages with PopART's IpuCopy nodes (:func:`copied`: ``_ir/interipucopy.py``, chained for
the pipeline, straight for an in-order run), where each IPU's variables live
(:class:`IpuSlots`), the mesh (:func:`placed_mesh`), the one decision "placed or not" with its
log line (:func:`placed_or_none`), and :class:`Executor`: the one ``shard_map``
(:func:`run_on_mesh`), the schedules, PopART's (:func:`pipeline_ticks`) and popxl's
(:class:`InOrder`) and an in-order program's compiled step; and :class:`ExecutorPlan`, the
one packing of IPU-slot state (specs, shardings, pack / unpack, host-memory slots) that both
front-ends' placed plans are.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import IrError
from .._ir.graph import Node, reads
from .._ir.interipucopy import CopiedStages, inter_ipu_copy
from ..logging import getLogger
from .compiled import REPLICA_AXIS, Facts
from .state import ReplicaShards

IPU_AXIS = "ipu"
P = jax.sharding.PartitionSpec
T = TypeVar("T")
_logger = getLogger("session")


# ---------------------------------------------------------------------------- placed or not
class Unplaceable(Exception):
    """What a placed program does not do (raised while planning it; the message says what)."""


def placed_or_none(who: str, plan: Callable[[], Optional[T]]) -> Optional[T]:
    """The placed plan that ``plan`` makes (None: nothing to place), or None when it raises
    :class:`Unplaceable`: the one place that logs why a program runs unplaced."""
    try:
        return plan()
    except Unplaceable as e:
        _logger.info(f"{who}: {e} is not supported by the placed program; the whole model "
                     f"runs on one device per replica")
        return None


def device_grid(devices: Sequence[Any], replicas: int, ipus: int) -> np.ndarray:
    """[replicas, ipus] devices: replica r's IPUs are the device's IPUs r*n, r*n + 1, ...
    (n: the device's IPUs per replica). Raises Unplaceable unless they are distinct."""
    devs = list(devices)
    n = len(devs) // max(replicas, 1)
    grid = np.array(devs[:replicas * n], dtype=object).reshape(replicas, n)[:, :ipus] \
        if n >= ipus else None
    if grid is None or len(set(grid.flat)) != grid.size:
        share = ": its IPUs share devices" if len(set(devs)) < len(devs) else ""
        raise Unplaceable(f"a device of {len(devs)} IPU(s) on {len(set(devs))} device(s) for "
                          f"{replicas} replica(s) of {ipus} IPUs{share}")
    return grid


def placed_mesh(devices: Sequence[Any], replicas: int, ipus: int) -> jax.sharding.Mesh:
    """The (``REPLICA_AXIS``, ``IPU_AXIS``) mesh of :func:`device_grid`."""
    return jax.sharding.Mesh(device_grid(devices, replicas, ipus), (REPLICA_AXIS, IPU_AXIS))


def mesh_sharding(mesh: jax.sharding.Mesh, *spec: Any,
                  memory_kind: Optional[str] = None) -> jax.sharding.NamedSharding:
    """Arrays of the mesh partitioned as ``spec`` (in memory ``memory_kind``, e.g. host)."""
    sh = jax.sharding.NamedSharding(mesh, P(*spec))
    return sh.with_memory_kind(memory_kind) if memory_kind else sh


# ---------------------------------------------------------------------------- inside the mesh
def run_on_mesh(fn: Callable, mesh: jax.sharding.Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """``fn`` on every device of the mesh, each on its blocks: the one ``shard_map`` outside
    ``compiled.Placement`` (placed programs; RTS's reduce-scatter over the replicas)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def this_ipu() -> Any:
    """The IPU of the device running (inside :func:`run_on_mesh`)."""
    return jax.lax.axis_index(IPU_AXIS)


def on_ipu(ipu: int, fn: Callable, otherwise: Callable, *args: Any) -> Any:
    """``fn(*args)`` on the devices of ``ipu``, ``otherwise(*args)`` (zeros) elsewhere."""
    return jax.lax.cond(this_ipu() == ipu, fn, otherwise, *args)


def per_ipu(branches: Sequence[Callable], *args: Any) -> Any:
    """``branches[i](*args)`` on the devices of IPU i (each device traces only its own)."""
    return jax.lax.switch(this_ipu(), list(branches), *args)


def ipu_copy(x: Any, src: int, dst: int) -> Any:
    """PopART's IpuCopy: ``x`` (any tree) of IPU ``src``'s devices to ``dst``'s, within each
    replica (the devices of other IPUs get zeros); unchanged when ``src == dst``."""
    return x if src == dst else jax.lax.ppermute(x, IPU_AXIS, [(src, dst)])


def pipeline_ticks(plan: "StagePlan", graph: CopiedStages, ipus: int, M: int, stage: Callable,
                   zeros: Callable[[int], tuple], own: Callable[[int, Any], Any],
                   per_tick: Callable[[], Any]) -> tuple[Any, dict]:
    """PopART's pipeline schedule (and its sharding schedule: a plan of one micro-batch per
    call) for ``M`` micro-batches of one replica, inside :func:`run_on_mesh`: in tick t stage s
    runs micro-batch t - s on its IPU's devices (:func:`per_ipu`: each device traces only its
    own stages), then the graph's IpuCopy nodes (``graph``: the stages after InterIpuCopy,
    chained) move each boundary to the next stage's devices, as their outputs. So
    the pipeline fills (ramp-up), runs every stage at once, and drains (ramp-down) in
    M + S - 1 ticks.

    ``stage(s, mine, received, m)`` returns the thunk running stage s on micro-batch ``m``
    (a traced index; ``received``: by the ids stage s reads them, the copies') -> (tensors it
    sends on, by its ids, its anchors, its loss); ``zeros(s)`` those
    outputs' zeros (devices and ticks where s does not run); ``own(d, shared)`` device d's
    part of what ``per_tick()`` gives each tick (its weights), taken in its branch. Returns
    (the loss summed over ticks, anchors {id: [T, ...]})."""
    S = plan.num_stages

    def device_branch(d: int) -> Callable:
        def branch(bufs: list, t: Any, shared: Any) -> tuple:
            mine = own(d, shared)   # sliced in the branch: only d's
            sent = [zeros(s)[0] for s in range(S - 1)]
            anchors, loss = {}, jnp.zeros((), jnp.float32)
            for s in range(S):
                zero = zeros(s)
                if plan.stage_ipu[s] != d:
                    anchors.update(zero[1])
                    continue
                m = t - s
                run = stage(s, mine, bufs[s - 1] if s > 0 else {}, jnp.clip(m, 0, M - 1))
                out, anc, l_s = jax.lax.cond((m >= 0) & (m < M), run, lambda zero=zero: zero)
                if s < S - 1:
                    sent[s] = out
                anchors.update(anc)
                loss = loss + l_s
            return sent, anchors, loss
        return branch

    branches = [device_branch(d) for d in range(ipus)]

    def tick(carry: tuple, t: Any) -> tuple:
        bufs, loss_acc = carry
        sent, anchors, loss = per_ipu(branches, bufs, t, per_tick())
        moved = [_run_copies(graph.copies[s + 1], sent[s]) for s in range(S - 1)]
        return (moved, loss_acc + loss), anchors

    # The backward pass keeps each tick's received tensors (PopART's stash) and runs the
    # tick's stages again (RecomputationType.Pipeline): residuals saved inside the switch
    # would hold a copy of the device's weights per tick.
    tick = jax.checkpoint(tick, policy=jax.checkpoint_policies.nothing_saveable)
    bufs0 = [_received(graph.copies[s + 1], zeros(s)[0]) for s in range(S - 1)]
    (_, loss), anchors = jax.lax.scan(tick, (bufs0, jnp.zeros((), jnp.float32)), jnp.arange(M + S - 1))
    return loss, anchors


def _received(copies: Sequence[Node], sent: dict) -> dict:
    """What the stage after a pipeline boundary receives, by its ids: the outputs of the
    boundary's IpuCopy nodes (what crosses on one IPU: as it was sent)."""
    return {c.outputs[0]: sent[c.inputs[0]] for c in copies} if copies else sent


def _run_copies(copies: Sequence[Node], sent: dict) -> dict:
    """A pipeline boundary's IpuCopy nodes run at once (one IPU pair, :func:`_received`)."""
    if not copies:
        return sent
    return ipu_copy(_received(copies, sent), copies[0].attrs["sourceIpu"], copies[0].attrs["destIpu"])


def zeros_like_specs(specs: Any) -> Any:
    """Zeros shaped as a tree of ShapeDtypeStructs (what a device that does not run a
    stage gives for its outputs)."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), specs)


class InOrder:
    """popxl's schedule inside :func:`run_on_mesh`: the plan's stages one after the other in
    program order, each on its IPU's devices (:func:`on_ipu`, zeros elsewhere). A tensor is
    held by the devices of the IPUs it was computed on or copied to. Before a stage, the
    graph's IpuCopy nodes for it (``graph``: the stages after InterIpuCopy, straight) move
    the tensors it reads from earlier stages to its IPU, as their outputs, which the stage
    reads. :meth:`read` moves the tensors that no stage computes (a repeat's inputs, carried
    values and outputs; variables written back at the end of the run) to the IPUs that need
    them. ``source(t)`` gives a tensor nothing computes (a feed, a constant: on every
    device)."""

    def __init__(self, plan: "StagePlan", ipus: int, graph: CopiedStages,
                 source: Callable[[str], Any]) -> None:
        self.plan, self.graph, self.everywhere, self.source = plan, graph, set(range(ipus)), source
        self.env: dict = {}                  # tensor -> its value (on the devices in at)
        self.at: dict[str, set[int]] = {}    # tensor -> the IPUs whose devices hold it
        self.staged: set[str] = set()        # the tensors stages computed (moved by copies)

    def fork(self) -> "InOrder":
        """A view for a loop's body: the same values, its own copies."""
        other = InOrder(self.plan, len(self.everywhere), self.graph, self.source)
        other.env, other.at = dict(self.env), {k: set(v) for k, v in self.at.items()}
        other.staged = set(self.staged)
        return other

    def copy(self, node: Node) -> None:
        """Run an IpuCopy node: its output, its input on the devices of ``destIpu`` (as it is
        where a repeat's inputs moved it there already)."""
        (t,), (out,), src, dst = node.inputs, node.outputs, node.attrs["sourceIpu"], node.attrs["destIpu"]
        v = jnp.asarray(self.env[t])
        self.env[out] = v if dst in self.at[t] else ipu_copy(v, src, dst)
        self.at[out] = {dst}
        self.staged.add(out)

    def holds(self, t: str) -> bool:
        return t in self.env

    def where(self, t: str, default: Optional[set] = None) -> set:
        return set(self.at.get(t, default if default is not None else set()))

    def set(self, t: str, value: Any, ipus: Iterable[int]) -> None:
        self.env[t], self.at[t] = value, set(ipus)

    def read(self, t: str, ipus: Iterable[int]) -> Any:
        """``t`` on the devices of ``ipus`` too (copied from the lowest IPU holding it)."""
        if t not in self.env:
            self.env[t], self.at[t] = self.source(t), set(self.everywhere)
        v = self.env[t] = jnp.asarray(self.env[t])
        for b in sorted(set(ipus) - self.at[t]):
            v = jnp.where(this_ipu() == b, ipu_copy(v, min(self.at[t]), b), v)
        self.env[t], self.at[t] = v, self.at[t] | set(ipus)
        return v

    def run(self, s: int, fn: Callable, shapes: Any, state: Any, *args: Any) -> tuple:
        """Stage ``s``: its IpuCopy nodes, then ``fn(state, received, *args) -> (state,
        {tensor: value}, *rest)`` on the devices of its IPU (``received``: the tensors its
        nodes read that the run holds, on its IPU, by the ids its ops read them: a copy's
        output, ``graph.local``); the other devices
        keep their state and give zeros shaped as ``shapes``, the plan's shapes of the
        outputs after the state. Planning (``shapes`` None: the program is only traced
        abstractly, for its facts), ``fn`` runs on every device, once. Its tensors are then
        held on its IPU. Returns (state, *rest, the shapes)."""
        ipu = self.plan.stage_ipu[s]
        for node in self.graph.copies[s]:
            self.copy(node)
        local = {t: self.graph.local(s, t) for t in self.plan.reads(s)}
        missed = sorted(t for t, x in local.items() if t in self.staged and ipu not in self.at.get(x, ()))
        if missed:
            raise RuntimeError(f"Internal error: no IpuCopy of {missed} to IPU {ipu} before stage {s}")
        received = {x: self.read(x, [ipu]) for x in local.values() if x in self.env}
        if shapes is None:   # planning: facts (a trailing compiled.Facts) are not outputs
            state, out, *rest = fn(state, received, *args)
            shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                            (out, *(r for r in rest if not isinstance(r, Facts))))
        else:
            state, out, *rest = on_ipu(ipu, fn, lambda st, *_: (st, *zeros_like_specs(shapes)),
                                       state, received, *args)
        for t, v in out.items():
            self.set(t, v, [ipu])
        self.staged |= set(out)
        return (state, *rest, shapes)


# ---------------------------------------------------------------------------- stages
@dataclass
class StagePlan:
    """How the graph's top-level ops split into stages, and what crosses between them."""
    nodes: list                     # per stage: its nodes, in graph order
    stage_ipu: list                 # per stage: the IPU (mesh index) it runs on
    weights: list                   # per stage: the variables it owns
    boundary: list                  # per stage s < S-1: tensor ids sent from s to s+1
    produced_at: dict               # tensor id -> stage computing (or owning) it
    pipelined: bool
    group: list = field(default_factory=list)   # per stage: its nodes' group (plan_stages)

    @property
    def num_stages(self) -> int:
        return len(self.nodes)

    def ipu_of(self, tid: str) -> int:
        return self.stage_ipu[self.produced_at.get(tid, 0)]

    def reads(self, s: int) -> set[str]:
        """The tensors stage s's nodes read."""
        return {t for nd in self.nodes[s] for t in reads(nd) if t}


def copied(plan: StagePlan, gives: Optional[Sequence[Iterable[str]]] = None) -> CopiedStages:
    """``plan``'s stages after PopART's InterIpuCopy (``_ir/interipucopy.py``): chained
    stage to stage over its boundaries (the pipeline schedule), or (``gives[s]``: the
    tensors stage s makes for later stages) straight to each IPU reading them (in order)."""
    if gives is None:
        return inter_ipu_copy(plan.nodes, plan.stage_ipu, plan.boundary, chained=True)
    return inter_ipu_copy(plan.nodes, plan.stage_ipu, gives, chained=False)


def plan_stages(nodes: Sequence[Node], ipu_of: Callable[[Node], int], variables: Iterable[str] = (),
                stage_of: Optional[Callable[[Node], int]] = None,
                group_of: Optional[Callable[[Node], int]] = None) -> StagePlan:
    """Cut ``nodes`` (in the order they run) into stages: with ``stage_of`` (pipelining) the
    nodes of each pipeline stage, else the runs of consecutive nodes on one IPU (``ipu_of``)
    and of one group (``group_of``: nodes of different groups, e.g. inside and outside a
    loop, never share a stage). A stage runs on its nodes' IPU; a variable lives on the
    stage that reads it first (one never read: stage 0); a stage can only read tensors of
    its own or earlier stages."""
    nodes = list(nodes)
    vgs = [int(ipu_of(nd)) for nd in nodes]
    groups = [int(group_of(nd)) if group_of is not None else 0 for nd in nodes]
    if stage_of is not None:
        keys = [int(stage_of(nd)) for nd in nodes]
    else:   # runs of consecutive nodes on one IPU and group
        keys, run = [], -1
        for i, v in enumerate(zip(vgs, groups)):
            run += i == 0 or v != (vgs[i - 1], groups[i - 1])
            keys.append(run)
    order = sorted(set(keys))
    stage_of_node = [order.index(k) for k in keys]
    S = len(order)
    staged: list[list[Node]] = [[] for _ in range(S)]
    stage_ipu, stage_group = [0] * S, [0] * S
    for nd, s, v, g in zip(nodes, stage_of_node, vgs, groups):
        staged[s].append(nd)
        stage_ipu[s], stage_group[s] = v, g
    variables = list(variables)
    known = set(variables)
    produced_at: dict[str, int] = {}
    consumed: dict[str, set] = {}
    weights: list[list[str]] = [[] for _ in range(S)]
    for nd, s in zip(nodes, stage_of_node):
        for t in reads(nd):
            if not t:
                continue
            if t in known and t not in produced_at:   # a weight lives where first read
                produced_at[t] = s
                weights[s].append(t)
            if produced_at.get(t, -1) > s:
                raise IrError(f"{nd.describe()} in pipeline stage {s} reads '{t}', which stage "
                              f"{produced_at[t]} computes: a stage can only use tensors of "
                              f"its own or earlier stages")
            consumed.setdefault(t, set()).add(s)
        for t in nd.outputs:
            if t:
                produced_at[t] = s
    for w in variables:   # weights no op reads stay on the first stage's IPU
        if w not in produced_at:
            produced_at[w] = 0
            weights[0].append(w)
    boundary = [sorted(t for t, at in produced_at.items() if at <= s and
                       any(c > s for c in consumed.get(t, ())))
                for s in range(S - 1)]
    return StagePlan(staged, stage_ipu, weights, boundary, produced_at, stage_of is not None,
                     stage_group)


# ---------------------------------------------------------------------------- the executor
@dataclass
class Executor:
    """A stage plan on its (replica, ipu) mesh: what runs a placed program, for popart
    sessions (:meth:`pipeline`: PopART's schedules) and popxl (:meth:`in_order_program`:
    the stages in program order, repeat loops around some). The front-ends give data: the
    plan, its stages with their IpuCopy nodes, and their stage functions / schedule (the
    state's packing: :class:`ExecutorPlan`)."""
    plan: StagePlan
    mesh: jax.sharding.Mesh
    graph: CopiedStages                   # the plan's stages after InterIpuCopy (copied)

    @property
    def ipus(self) -> int:
        return int(self.mesh.devices.shape[1])

    def sharding(self, *spec: Any, memory_kind: Optional[str] = None) -> jax.sharding.NamedSharding:
        """Arrays of the mesh partitioned as ``spec`` (:func:`mesh_sharding`)."""
        return mesh_sharding(self.mesh, *spec, memory_kind=memory_kind)

    def run(self, fn: Callable, in_specs: Any, out_specs: Any) -> Callable:
        """``fn`` on every device of the mesh (:func:`run_on_mesh`)."""
        return run_on_mesh(fn, self.mesh, in_specs, out_specs)

    def pipeline(self, M: int, stage: Callable, zeros: Callable, own: Callable,
                 per_tick: Callable) -> tuple[Any, dict]:
        """PopART's pipeline schedule of the plan's stages (:func:`pipeline_ticks`)."""
        return pipeline_ticks(self.plan, self.graph, self.ipus, M, stage, zeros, own, per_tick)

    def in_order(self, source: Callable[[str], Any]) -> "InOrder":
        """popxl's in-order run of the plan's stages, moving tensors by the graph's IpuCopy
        nodes (:class:`InOrder`)."""
        return InOrder(self.plan, self.ipus, self.graph, source)

    # ------------------------------------------------------------------ in-order programs
    # Their state: slots per replica, [replicas, ipus, *block] arrays, each device holding
    # its (replica, IPU) block; their feeds and outputs [replicas, ...].
    @property
    def replicas(self) -> int:
        return int(self.mesh.devices.shape[0])

    def in_order_program(self, schedule: Callable, outputs: Sequence[str],
                         planning: bool = False) -> Callable:
        """The program (slots [replicas, ipus, *block], feeds [replicas, ...]) -> (new slots,
        outputs [replicas, ...]): on every device, ``schedule(blocks, feeds) -> (blocks,
        {output: value}, facts)`` on its own blocks and feeds (the stages in order:
        :meth:`in_order`), ``facts`` a ``compiled.Facts`` whose ``out_ipu`` gives an IPU
        holding each output. Each output comes from the devices of that IPU; those not in
        ``outputs`` (run-time check records) from every device, as they are. ``planning``:
        the schedule's facts follow the outputs."""
        def body(blocks: dict, feeds: dict) -> tuple:   # this device's [1, 1, *block], [1, ...]
            blocks = {k: v[0, 0] for k, v in blocks.items()}
            feeds = {k: v[0] for k, v in feeds.items()}
            blocks, outs, facts = schedule(blocks, feeds)
            return ({k: v[None, None] for k, v in blocks.items()},
                    {k: v[None, None] for k, v in outs.items()}, facts)

        def program(state: dict, feeds: dict) -> tuple:
            spec = P(REPLICA_AXIS, IPU_AXIS)
            state, outs, facts = self.run(body, (spec, P(REPLICA_AXIS)), (spec, spec, P()))(state, feeds)
            where = facts["out_ipu"]
            outs = {t: v[:, where[t]] if t in outputs else v for t, v in outs.items()}
            return (state, outs, facts) if planning else (state, outs)
        return program


@dataclass
class ExecutorPlan:
    """A front-end's placed plan: its own data around the one :class:`Executor` (popart's
    ``pipeline.PlacedPlan``, popxl's ``_placement.MainPlan``), and the one packing of a
    placed program's state in IPU slots (:class:`IpuSlots`): specs, shardings, pack /
    unpack and the host-memory slots of a layout, for both front-ends. popart's state is
    ``[ipus, *block]`` (one value for all replicas, or RTS shards in the blocks); popxl's
    (``per_replica``) ``[replicas, ipus, *block]``, each replica's own values."""
    executor: Executor
    per_replica: ClassVar[bool] = False

    def layout_for(self, names: Any) -> "IpuSlots":
        """The layout whose tensors (ids) or slots (keys) ``names`` are."""
        raise NotImplementedError

    def slot_specs(self, layout: "IpuSlots") -> dict:
        """ShapeDtypeStruct of each stored slot (``[replicas, ...]`` per replica)."""
        lead = (self.executor.replicas,) if self.per_replica else ()
        return {k: jax.ShapeDtypeStruct(lead + s.shape, s.dtype) for k, s in layout.specs().items()}

    def slot_shardings(self, layout: "IpuSlots", spec: Callable[[str], Any]) -> dict:
        """Per slot of ``layout`` (popart's weights or optimizer state, or an in-order
        program's variables), its sharding: partitioned as ``spec(key)``, in the slot's
        memory kind (host for off-chip slots); the layout's global tensors replicated."""
        kinds = layout.memory_kinds
        return {k: self.executor.sharding() if k in layout.global_specs else
                self.executor.sharding(*spec(k), memory_kind=kinds.get(k)) for k in layout.specs()}

    @staticmethod
    def host_slots(layout: "IpuSlots") -> frozenset:
        """The slots kept in host memory between runs."""
        return frozenset(layout.memory_kinds)

    def pack(self, named: Any, layout: Optional["IpuSlots"] = None) -> dict:
        """The stored slots (host arrays) of host tensors: by id, or (``per_replica``) a
        list of each replica's, stacked."""
        if not self.per_replica:
            return (layout or self.layout_for(named)).pack(named)
        layout = layout or self.layout_for(named[0])
        per = [layout.pack(one) for one in named]
        return {k: np.stack([p[k] for p in per]) for k in per[0]}

    def unpack(self, bufs: Mapping[str, Any], layout: Optional["IpuSlots"] = None) -> Any:
        """The tensors (host arrays) of stored slots, the inverse of :meth:`pack`."""
        layout = layout or self.layout_for(bufs)
        if not self.per_replica:
            return layout.unpack(bufs)
        return [layout.unpack({k: b[r] for k, b in bufs.items()}) for r in range(self.executor.replicas)]

    @property
    def stages(self) -> StagePlan:
        return self.executor.plan

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.executor.mesh

    @property
    def ipus(self) -> int:
        return self.executor.ipus


# ---------------------------------------------------------------------------- state slots
class IpuSlots:
    """A named set of tensors (the weights, the optimizer state, popxl's variables) packed in
    slots by IPU, from each tensor's :class:`~.rts.Home` (its IPU, replica sharding and memory
    kind). The tensors of one dtype, rank and tag are numbered per IPU; slot j holds every
    IPU's j-th such tensor in one array ``[ipus, *block]`` sharded over the IPU axis (key
    ``"<kind>/<dtype>/r<rank><tag>/<j>"``), ``block`` the largest extent of each dimension,
    the rest zero. Uniform stages (a transformer's layers) need no padding: each device's
    block is its tensor, and an elementwise update runs on whole blocks. A slot all of whose
    tensors are replica-sharded (:attr:`sharded`) is stored ``[ipus, padded]``: each block
    as ``rts.ReplicaShards`` stores a tensor over the ``replicas``; one all of whose tensors
    are kept in one memory kind stays there (:attr:`memory_kinds`).

    :meth:`pack` / :meth:`unpack`: host tensors <-> stored slots; :meth:`read`,
    :meth:`write`, :meth:`repack`: inside the step, on whole blocks."""

    def __init__(self, kind: str, specs: Mapping[str, Any], homes: Mapping[str, Any], num_ipus: int,
                 tags: Mapping[str, str] = {}, replicas: int = 1) -> None:
        self.num_ipus, self.kind, self.replicas = num_ipus, kind, replicas
        self.slots: dict[str, tuple] = {}    # id -> (ipu, key, shape)
        self.blocks: dict[str, tuple] = {}   # key -> (block shape, dtype name)
        self.homes: dict[str, Any] = {}      # id -> its rts.Home
        self.globals: dict[str, str] = {}    # id -> key of a replicated tensor (add_global)
        self.global_specs: dict[str, Any] = {}   # key -> ShapeDtypeStruct
        count: dict[tuple, int] = {}
        for tid, spec in specs.items():   # tagged tensors (frozen, sharded) in slots of their own
            dt, shape, ipu = np.dtype(spec.dtype).name, tuple(np.shape(spec)), homes[tid].ipu
            group = (dt, len(shape), tags.get(tid, ""))
            j = count[group + (ipu,)] = count.get(group + (ipu,), -1) + 1
            self._place(tid, homes[tid], f"{kind}/{dt}/r{len(shape)}{group[2]}/{j}", shape, shape, dt)

    def _place(self, tid: str, home: Any, key: str, shape: tuple, block: tuple, dt: str) -> None:
        self.slots[tid], self.homes[tid] = (home.ipu, key, shape), home
        old = self.blocks.get(key, (block, dt))[0]
        self.blocks[key] = (tuple(max(a, b) for a, b in zip(old, block)), dt)

    def align(self, tid: str, home: Any, weight: tuple, weight_block: tuple, key: str,
              shape: tuple, dt: str) -> None:
        """Place optimizer state ``tid`` (kept as ``home`` says, on its weight's IPU) in slot
        ``key`` beside its weight's slot (``weight``: (ipu, key, shape)): the weight's block
        when it has the weight's shape (an elementwise update then runs on both blocks at
        once), else its own shape."""
        self._place(tid, home, key, shape, weight_block if shape == weight[2] else shape, dt)

    def add_global(self, tid: str, value: Any) -> None:
        """A tensor no IPU owns (automatic loss scaling's factor and counter): stored whole,
        replicated on every device, under its own key."""
        key = self.globals[tid] = f"{self.kind}/global/{tid}"
        self.global_specs[key] = jax.ShapeDtypeStruct(np.shape(value), np.asarray(value).dtype)

    @property
    def ids(self) -> set:
        return set(self.slots) | set(self.globals)

    def _all(self, has: Callable[[Any], Any]) -> dict:
        """Per slot, ``has(home)`` when all its tensors' homes give one value, else None."""
        out: dict = {}
        for tid, (_, key, _) in self.slots.items():
            v = has(self.homes[tid])
            out[key] = v if out.get(key, v) == v else None
        return {k: v for k, v in out.items() if v is not None}

    @property
    def sharded(self) -> frozenset:
        """The slots stored sharded over the replicas (all their tensors are)."""
        return frozenset(k for k, v in self._all(lambda h: h.shards is not None).items() if v)

    @property
    def memory_kinds(self) -> dict:
        """Slot -> the memory kind all its tensors are kept in (the off-chip slots)."""
        return self._all(lambda h: h.memory_kind)

    def block_shards(self, key: str) -> ReplicaShards:
        """The replica shards of a block of slot ``key``."""
        return ReplicaShards.over_all(self.blocks[key][0], self.replicas)

    def specs(self) -> dict:
        """ShapeDtypeStruct of each stored slot."""
        sharded = self.sharded
        return {**{key: jax.ShapeDtypeStruct(
                    (self.num_ipus, self.block_shards(key).padded) if key in sharded else
                    (self.num_ipus,) + block, np.dtype(dt))
                   for key, (block, dt) in self.blocks.items()}, **self.global_specs}

    # ------------------------------------------------------------------ host <-> stored
    def pack(self, named: Mapping[str, Any]) -> dict:
        """The stored slots of host tensors (every tensor of the set)."""
        bufs = {key: np.zeros((self.num_ipus,) + block, np.dtype(dt))
                for key, (block, dt) in self.blocks.items()}
        bufs.update({key: np.zeros(s.shape, s.dtype) for key, s in self.global_specs.items()})
        for tid, (ipu, key, shape) in self.slots.items():
            bufs[key][(ipu,) + self._part(shape)] = named[tid]
        for tid, key in self.globals.items():
            bufs[key][...] = named[tid]
        return self.shard_blocks(bufs)

    def unpack(self, bufs: Mapping[str, Any]) -> dict:
        """Tensors from the stored slots (host or device arrays; the inverse of :meth:`pack`)."""
        return self.read(self.whole_blocks(bufs))

    def shard_blocks(self, bufs: Mapping[str, Any], keys: Optional[frozenset] = None) -> dict:
        """Slots ``[ipus, *block]`` with those in ``keys`` (default: :attr:`sharded`) as
        replica-sharded ``[ipus, padded]``; host or traced (global) arrays."""
        keys = self.sharded if keys is None else keys
        return {k: self.block_shards(k).flat(v, 1) if k in keys else v for k, v in bufs.items()}

    def whole_blocks(self, bufs: Mapping[str, Any], keys: Optional[frozenset] = None) -> dict:
        """The inverse of :meth:`shard_blocks`."""
        keys = self.sharded if keys is None else keys
        return {k: self.block_shards(k).whole(v, 1) if k in keys else v for k, v in bufs.items()}

    # ------------------------------------------------------------------ in the step
    @staticmethod
    def _part(shape: tuple) -> tuple:
        return tuple(slice(0, n) for n in shape)

    def read(self, bufs: Mapping[str, Any], ipu: Optional[int] = None,
             shards: frozenset = frozenset()) -> dict:
        """Tensors from whole blocks: all of them from global ``[ipus, *block]`` arrays (host
        or device), or (``ipu`` given) that IPU's tensors from its own blocks (the blocks of
        the slots in ``shards``, a replica's shards of whole blocks, as they are); the global
        tensors with all of them."""
        out = {} if ipu is not None else {tid: bufs[key] for tid, key in self.globals.items()}
        for tid, (i, key, shape) in self.slots.items():
            if ipu is None:
                out[tid] = bufs[key][(i,) + self._part(shape)]
            elif i == ipu:
                block = bufs[key]
                out[tid] = block if tuple(block.shape) == shape or key in shards else \
                    block[self._part(shape)]
        return out

    def write(self, bufs: Mapping[str, Any], named: Mapping[str, Any]) -> dict:
        """Global ``[ipus, *block]`` arrays with the tensors in ``named`` written in."""
        bufs = dict(bufs)
        for tid, v in named.items():
            if tid in self.globals:
                key = self.globals[tid]
                bufs[key] = jnp.asarray(v, bufs[key].dtype)
                continue
            ipu, key, shape = self.slots[tid]
            bufs[key] = bufs[key].at[(ipu,) + self._part(shape)].set(jnp.asarray(v, bufs[key].dtype))
        return bufs

    def repack(self, blocks: Mapping[str, Any], ipu: int, named: Mapping[str, Any],
               shards: frozenset = frozenset()) -> dict:
        """An IPU's blocks with its tensors in ``named`` written in (the inverse of
        :meth:`read` with ``ipu``)."""
        blocks = dict(blocks)
        for tid, v in named.items():
            i, key, shape = self.slots[tid]
            if i == ipu:
                v = jnp.asarray(v).astype(blocks[key].dtype)
                blocks[key] = v if tuple(blocks[key].shape) == shape or key in shards else \
                    blocks[key].at[self._part(shape)].set(v)
        return blocks
