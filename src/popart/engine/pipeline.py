"""Virtual graphs and pipelining for popart sessions: a :class:`PlacedPlan` (data, held by
``StepProgram.placed``) and :func:`placed_step` run a step's stages on the devices of their
IPUs under PopART's pipeline (or sharding) schedule, with the parts of ``placed.py``. The
specification (stages, slots, the schedule, RTS, ALS, what falls back) is
docs/model_parallelism.md."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import IrError, noted
from .._ir.graph import PIPELINE_STAGE, VIRTUAL_GRAPH, Graph, outer_reads, reads
from ..logging import getLogger
from .compiled import CompiledStep, Placement, arg_specs
from .lower import CHECKS, RECORD
from .compiled import REPLICA_AXIS
from .config import EngineConfig
from .norms import GradientNorms, local_sum_squares
from .placed import (IPU_AXIS, Executor, ExecutorPlan, IpuSlots, StagePlan, Unplaceable, copied,
                     per_ipu, placed_mesh, placed_or_none, plan_stages, this_ipu)
from .state import Home
from . import als as _als
from .program import StepConfig, StepProgram
from .step import GraphRun, Schedule, StepParts, infer_step, scan, train_step
from .step_plan import GRAD_PREFIX, unstash

EXECUTION_PHASE = "__execution_phase"
ASSIGN = "__assign__"  # a stage's new value of a variable an op writes, passed like an anchor
PROBE = "__probe__"    # zeros added to a tensor whose gradient is anchored, passed like a feed
TAP = "__tap__"        # ALS: zeros whose gradient is a tracked gradient's histogram, like a feed
_logger = getLogger("session")
P = jax.sharding.PartitionSpec


# ---------------------------------------------------------------------------- stages
def auto_virtual_graphs(graph: Graph, n: int, sizes: Mapping[str, int]) -> list[int]:
    """VirtualGraphMode.Auto: contiguous runs of ops of about equal cost (the elements of
    the weights an op reads plus those of its outputs), one per IPU, written on the nodes as
    their ``__ipu_number`` (as PopART's AutoVirtualGraph transform sets each op's virtual
    graph). Fewer runs than IPUs raise PopART's error."""
    cost = [sum(sizes.get(t, 0) for t in list(nd.inputs) + list(nd.outputs) if t) or 1
            for nd in graph.nodes]
    total, acc, out = float(sum(cost)), 0.0, []
    for c in cost:
        out.append(min(n - 1, int(n * (acc + c / 2) / total)))
        acc += c
    found = len(set(out)) - 1   # splits between runs
    if found != n - 1:
        raise noted(IrError(f"[AutoVirtualGraph] Couldn't find enough splits for {n} IPUs. "
                            f"Only found {found}"),
                    f"The main graph's {len(out)} op(s) fill {found + 1} of the device's {n} IPUs "
                    "per replica: use a device with fewer IPUs, or VirtualGraphMode.Manual")
    for nd, v in zip(graph.nodes, out):
        nd.annotations[VIRTUAL_GRAPH] = v
    return out


def popart_stages(graph: Graph, variables: Mapping[str, np.ndarray], config: EngineConfig,
                  num_ipus: int, sizes: Mapping[str, int]) -> StagePlan:
    """A popart session's stages (``placed.plan_stages``): each op's IPU as the session's
    ``virtualGraphMode`` says (execution phase p on IPU p mod ``num_ipus``, the phases in
    order); with pipelining the pipeline stages (an op without one: its virtual graph's)."""
    nodes = graph.nodes
    mode = config.virtual_graph_mode
    if mode == "Auto":
        vgs = auto_virtual_graphs(graph, num_ipus, sizes)
    elif mode == "ExecutionPhases":   # phase p on IPU p mod n, the phases in order
        nodes = sorted(nodes, key=lambda nd: int(nd.annotations.get(EXECUTION_PHASE, 0)))
        vgs = [int(nd.annotations.get(EXECUTION_PHASE, 0)) % num_ipus for nd in nodes]
    else:
        vgs = [int(nd.annotations.get(VIRTUAL_GRAPH, 0)) for nd in nodes]
    ipu = {id(nd): v for nd, v in zip(nodes, vgs)}
    stage_of = None
    if config.pipelining:
        stage_of = (lambda nd: nd.annotations[PIPELINE_STAGE]) \
            if all(PIPELINE_STAGE in nd.annotations for nd in nodes) else (lambda nd: ipu[id(nd)])
    return plan_stages(nodes, lambda nd: ipu[id(nd)], variables, stage_of)


# ---------------------------------------------------------------------------- the program
class _BlockNorms(GradientNorms):
    """Clipping's view of a placed step's unscaled gradient blocks (this device's; the
    replica's shards of those in ``sharded``): a group's squares summed over the IPUs (and
    the shards over the replicas), its factor applied to its elements."""

    def __init__(self, layout: IpuSlots, ipus: int, sharded: frozenset) -> None:
        self.layout, self.ipus, self.sharded = layout, ipus, sharded

    def _mine(self, ids: list[str]) -> dict:
        masks = {k: np.zeros(self.ipus, bool) for k in self.layout.blocks}
        for i in ids:
            ipu, key, _ = self.layout.slots[i]
            masks[key][ipu] = True   # the rest of a block is zero
        dev = this_ipu()
        return {k: jnp.asarray(m)[dev] for k, m in masks.items()}

    def sum_squares(self, ids: list[str], g: Mapping[str, Any]) -> Any:
        mine = self._mine(ids)
        parts = {k: jnp.where(mine[k], jnp.sum(jnp.square(v.astype(jnp.float32))), 0.0)
                 for k, v in g.items()}
        part = sum(v for k, v in parts.items() if k not in self.sharded)
        if self.sharded & set(g):
            part = part + jax.lax.psum(sum(v for k, v in parts.items() if k in self.sharded),
                                       REPLICA_AXIS)
        return jax.lax.psum(part, IPU_AXIS)

    def scale(self, ids: list[str], g: Mapping[str, Any], factor: Any) -> dict:
        mine = self._mine(ids)
        return {k: jnp.where(mine[k], v * factor.astype(v.dtype), v) for k, v in g.items()}


@dataclass
class PlacedPlan(ExecutorPlan):
    """A popart step's stages on the devices of their IPUs (docs/model_parallelism.md), data:
    the executor (stage plan and mesh), the slots of the weights and of the optimizer state,
    and which slots are updated on shards or with sharded accumulators (the slots say which
    live off chip or sharded over the replicas, from their tensors' homes).
    ``StepProgram.placed`` holds it; :func:`placed_step` builds the step from it and the
    program; its methods put the state in its slots and take it back."""
    weight_layout: IpuSlots
    state_layout: IpuSlots
    variables: frozenset          # the program's weights (the ids of weight_layout's tensors)
    rts: Any                      # the program's rts.StateSharding (shards in the step)
    accumulation: int             # micro-batches per batch (the schedule)
    has_checks: bool              # the whole graph's trace has run-time checks
    update_slots: frozenset = frozenset()  # slots the update takes as shards
    tick_slots: frozenset = frozenset()    # weight slots with sharded accumulators
    row_weights: dict = field(default_factory=dict)   # weight slot -> representative (_row_weights)

    @property
    def rts_slots(self) -> frozenset:
        """The slots stored sharded over the replicas."""
        return self.weight_layout.sharded | self.state_layout.sharded

    @property
    def off_chip(self) -> frozenset:
        """The slots kept in host memory."""
        return self.host_slots(self.weight_layout) | self.host_slots(self.state_layout)

    @property
    def schedule(self) -> list[list[tuple[int, int]]]:
        """Per tick, the (stage, micro-batch) pairs that run (one batch of a training or
        inference step): PopART's ramp-up, main and ramp-down phases."""
        S, A = self.stages.num_stages, self.accumulation
        if not self.stages.pipelined:
            return [[(s, m)] for m in range(A) for s in range(S)]
        return [[(s, t - s) for s in range(S) if 0 <= t - s < A] for t in range(A + S - 1)]

    @property
    def view_slots(self) -> frozenset:
        """The weight slots the stages take as this replica's shards (all-gathered before
        use, their gradients reduce-scattered): those stored sharded, updated on shards, or
        with sharded accumulators."""
        return (self.rts_slots | self.update_slots | self.tick_slots) & set(self.weight_layout.blocks)

    def place_forward(self, parts: StepParts, device: Any) -> "PlacedPlan":
        """The placed plan of ``parts``, the forward-only program of this plan's training
        program, on its weights' slots (sharded or off chip too)."""
        try:
            plan = plan_placed(parts, device)
        except Unplaceable:
            plan = None
        if plan is None:
            raise IrError("The forward-only program cannot run placed on the IPUs' devices as "
                          "the training program does: they cannot share the weights")
        return dataclasses.replace(plan, weight_layout=self.weight_layout)

    # -------------------------------------------------------------- state layout
    def layout_for(self, names: Any) -> IpuSlots:
        """The layout of the weights or the optimizer state, told apart by their ids or
        their slots' keys."""
        ids = set(names)
        if ids == set(self.variables) or {k.split("/")[0] for k in ids} == {"weights"}:
            return self.weight_layout
        if ids == self.state_layout.ids or ids == set(self.state_layout.specs()):
            return self.state_layout
        raise IrError(f"Internal error: {sorted(ids)[:5]} are neither the weights nor the "
                      f"optimizer state of the placed program")

    def state_sharding(self, layout: Optional[IpuSlots] = None) -> Any:
        """Slots split over the IPU axis; with a layout, per slot, off-chip ones in host
        memory (the step's arguments and results there: the compiled program moves them to
        the device and back)."""
        sharding = self.executor.sharding(IPU_AXIS)
        if layout is None or not (self.off_chip or self.rts_slots or layout.globals):
            return sharding

        return self.slot_shardings(layout, self.slot_spec)

    def slot_spec(self, key: str, sharded: Optional[frozenset] = None) -> Any:
        """A slot's partition: over the IPUs, and over the replicas for the slots in
        ``sharded`` (default: those stored sharded)."""
        sharded = self.rts_slots if sharded is None else sharded
        return P(IPU_AXIS, REPLICA_AXIS) if key in sharded else P(IPU_AXIS)

    def block(self, key: str) -> tuple:
        """The block shape of a weight or state slot."""
        return (self.weight_layout if key.startswith("weights/") else self.state_layout).blocks[key][0]

    def gather(self, blocks: Mapping[str, Any], keys: frozenset) -> dict:
        """This device's blocks, those of the slots in ``keys`` all-gathered from shards."""
        return {k: self.rts.shards(self.block(k)).gather_local(v) if k in keys else v
                for k, v in blocks.items()}

    def put_state(self, named: Mapping[str, np.ndarray]) -> Any:
        layout = self.layout_for(named)
        return jax.device_put(self.pack(named, layout), self.state_sharding(layout))

    def state_to_host(self, state: Any) -> dict[str, np.ndarray]:
        bufs = {k: Placement.to_host(v) for k, v in state.items()}
        return {k: np.array(v) for k, v in self.unpack(bufs).items()}

    def state_specs(self, named: Mapping[str, Any]) -> Any:
        return self.slot_specs(self.layout_for(named))

    def put(self, tree: Any) -> Any:
        return jax.device_put(tree, self.executor.sharding())

    def put_feeds(self, feeds: Mapping[str, np.ndarray]) -> dict:
        return jax.device_put(dict(feeds), self.executor.sharding(None, None, REPLICA_AXIS))

    by_id = False   # slots pack several tensors each (engine/packing.py)

    def holds(self, part: Any, like: Mapping[str, Any]) -> bool:
        """Another program's state is never in this plan's slots as it is."""
        return False

    def compiled_step(self, parts: StepParts, key_spec: Any = None) -> CompiledStep:
        """The step of ``parts`` (:func:`placed_step`), jitted with this plan's shardings
        (always with the key)."""
        w, s = self.state_sharding(self.weight_layout), self.state_sharding(self.state_layout)
        rep, feeds = self.executor.sharding(), self.executor.sharding(None, None, REPLICA_AXIS)
        return CompiledStep(placed_step(self, parts), donate_argnums=(0, 1, 2),
                            in_shardings=(w, s, rep, feeds, rep), out_shardings=(w, s, rep, rep))


# ---------------------------------------------------------------------------- planning
def plan_placed(parts: StepParts, device: Any) -> Optional[PlacedPlan]:
    """The planned step ``parts`` cut into stages on the mesh of ``device``, with its state
    laid out; None when its ops are all on one IPU; Unplaceable for what the placed program
    does not do."""
    plan, cfg = parts.plan, parts.cfg
    sizes = {k: int(np.prod(s.shape)) for k, s in plan.tensor_specs.items()}
    R = cfg.replication_factor
    n = ipus_per_replica(device, R)
    if cfg.config.pipelining and plan.accum:
        raise Unplaceable("anchoring a gradient accumulator (Accum___) of a pipelined model")
    stages = popart_stages(parts.graph, parts.variables, cfg.config, n, sizes)
    ipus = max(stages.stage_ipu) + 1
    if stages.num_stages < 2 or ipus < 2:
        return None
    mesh = placed_mesh(device.jax_devices, R, ipus)
    layouts = _plan_layouts(parts, stages, ipus)
    executor = Executor(stages, mesh, copied(stages))
    plan = PlacedPlan(executor=executor, variables=frozenset(parts.variables), rts=plan.rts,
                      accumulation=cfg.accumulation_factor, has_checks=bool(plan.run_checks),
                      **layouts)
    per_ipu_weights = [[w for w in parts.variables if stages.ipu_of(w) == i] for i in range(ipus)]
    _logger.info(f"Virtual graphs: {stages.num_stages} stage(s) on {ipus} device(s) "
                 f"({'pipelined' if stages.pipelined else 'sharded'}); weights per IPU "
                 f"{[len(w) for w in per_ipu_weights]}; slots sharded over the "
                 f"replicas {sorted(plan.rts_slots)}, with sharded accumulators "
                 f"{sorted(plan.tick_slots)}")
    return plan


def _plan_layouts(parts: StepParts, stages: StagePlan, ipus: int) -> dict:
    """The slots of the weights and of the optimizer state (each state tensor beside its
    weight's slot; each tensor's home: the program's ``rts.homes`` on its stage's IPU, the
    state on its weight's), and how the optimizer updates them (``PlacedPlan``'s fields)."""
    cfg, trainable, variables = parts.cfg, parts.plan.trainable, parts.variables
    owner = {k: w for w in trainable
             for k in (cfg.optimizer.init_state(w, variables[w]) if cfg.training else {})}
    rts = parts.plan.rts   # weights stored or updated on replica shards in slots of their own
    homes = {t: dataclasses.replace(rts.homes.get(t, Home()), ipu=stages.ipu_of(owner.get(t, t)))
             for t in [*variables, *owner]}
    tags = {w: ("" if w in trainable else "f") +
            ("s" if w in rts.stored | rts.sharded_update else "") for w in variables}
    R = cfg.replication_factor
    weight_layout = IpuSlots("weights", variables, homes, ipus, tags, R)
    row_weights = _row_weights(parts, weight_layout)
    state = parts.plan.opt_state
    state_layout = IpuSlots("state", {}, homes, ipus, replicas=R)
    beside = {weight_layout.slots[w][1]: set() for w in trainable}
    for k, w in owner.items():
        weight = weight_layout.slots[w]
        dt = np.dtype(state[k].dtype).name
        state_layout.align(k, homes[k], weight, weight_layout.blocks[weight[1]][0],
                           f"state/{k[:-len(w)]}/{dt}/{weight[1]}", np.shape(state[k]), dt)
        if np.shape(state[k]) == weight[2]:   # elementwise state: updated as the weight is
            beside[weight[1]].add(state_layout.slots[k][1])
    for k in [k for k in state if k not in owner]:   # no weight's: automatic loss scaling's
        state_layout.add_global(k, state[k])

    # Off-chip slots are kept in host memory between steps and moved to the device for each
    # step (not per phase: JAX's shard_map does not carry memory spaces into its body).
    rts_slots = weight_layout.sharded | state_layout.sharded
    scattered = {}   # weight slot -> all its weights have sharded accumulators
    for tid, (_, key, _) in weight_layout.slots.items():
        scattered[key] = scattered.get(key, True) and tid in rts.scattered
    return dict(weight_layout=weight_layout, state_layout=state_layout, row_weights=row_weights,
                tick_slots=frozenset(k for k, v in scattered.items() if v) & set(beside),
                update_slots=frozenset(k for w, ss in beside.items()
                                       if ({w} | ss) & rts_slots for k in {w} | ss))


def _row_weights(parts: StepParts, weight_layout: IpuSlots) -> dict[str, str]:
    """Elementwise updates of whole blocks (or their shards): per weight slot, a weight
    whose optimizer values every weight of the slot shares (empty when the update needs
    each weight apart: Lamb's norms, per-weight values)."""
    opt = parts.cfg.optimizer   # clipping runs before, over all blocks (_BlockNorms)
    if not parts.cfg.training or not opt.elementwise_rule:
        return {}
    reps: dict[str, str] = {}
    for w in parts.plan.trainable:
        key = weight_layout.slots[w][1]
        r = reps.setdefault(key, w)
        if any(opt.hyper_value(w, n) != opt.hyper_value(r, n) for n in opt.hyper_names()):
            return {}
    return reps


# ---------------------------------------------------------------------------- the step
def _stage_fn(pp: PlacedPlan, prog: StepParts, s: int):
    """Stage s on one micro-batch: (weights, feeds, received tensors, key) -> (the
    tensors it sends on, its anchor values, its loss or 0). Its ops read what earlier stages
    sent by the ids of the graph's IpuCopy outputs (``Executor.graph``); it sends by its own
    ids; the graphs its ops call read by the tensors' ids."""
    st, cfg, graph = pp.stages, prog.cfg, pp.executor.graph
    sub = Graph(name=f"{prog.graph.name}/stage{s}", nodes=list(graph.ops[s]),
                initializers=prog.graph.initializers, tensor_info=prog.graph.tensor_info,
                opsets=prog.graph.opsets, constants=prog.graph.constants)
    sends = [graph.local(s, t) for t in st.boundary[s]] if s < st.num_stages - 1 else []
    outer = {t: graph.local(s, t) for nd in st.nodes[s] for t in outer_reads(nd)
             if graph.local(s, t) != t}
    anchors = [a for a in prog.plan.fwd_anchor_ids if _anchor_stage(pp, a) == s]
    check = f"{CHECKS}/{s}"   # the stage's run-time checks: a record, like an anchor
    if pp.has_checks:
        anchors.append(check)
    assigns = [f"{ASSIGN}/{v}" for v in prog.plan.assigned
               if v in prog.variables and st.produced_at.get(v) == s] \
        if cfg.training else []
    anchors += assigns
    has_loss = cfg.training and st.produced_at.get(cfg.loss) == s

    def run(weights, feeds, received, key, hyper):
        probes = {k[len(PROBE) + 1:]: v for k, v in feeds.items() if k.startswith(PROBE + "/")}
        taps = {k[len(TAP) + 1:]: functools.partial(prog.plan.als.tap, stat=v)
                for k, v in feeds.items() if k.startswith(TAP + "/")}
        feeds = {k: v for k, v in feeds.items() if not k.startswith((PROBE + "/", TAP + "/"))}
        received = {**received, **{t: received[x] for t, x in outer.items()}}
        t = prog.trace_graph(weights, {**feeds, **received}, jax.random.fold_in(key, s), probes,
                        training=cfg.training, graph=sub, taps=taps)
        env = t.env
        out = {k: jnp.asarray(env[k]) for k in sends}
        anc = {a: prog.anchor_value(env, a) for a in anchors if a != check and a not in assigns}
        for a in assigns:   # the variable's new value (unchanged when the op did not run)
            v = a.split("/", 1)[1]
            anc[a] = jnp.asarray(t.assignments.get(v, env[v]), prog.variables[v].dtype)
        if pp.has_checks:
            anc[check] = GraphRun.record(t)
        loss = jnp.zeros((), jnp.float32)
        if has_loss:
            loss = prog.scaled_loss(t, hyper).astype(jnp.float32)
        return out, anc, loss
    return run, sends, anchors


def _anchor_stage(pp: PlacedPlan, a: str) -> int:
    """The stage whose trace has anchor ``a``: its producer (or owner, for a weight), for
    a graph input its first reader."""
    st, a = pp.stages, unstash(a)
    if a.startswith(CHECKS + "/"):
        return int(a.split("/")[-1])
    if a.startswith(ASSIGN + "/"):
        return st.produced_at[a.split("/", 1)[1]]
    if a in st.produced_at:
        return st.produced_at[a]
    return next((s for s in range(st.num_stages) for nd in st.nodes[s] if a in reads(nd)), 0)


def _probes(prog: StepParts) -> list[str]:
    """The tensors (not weights) whose gradients are anchored."""
    return [g for g in prog.plan.grad_ids if g not in prog.variables] if prog.cfg.training else []


def _probe_stages(pp: PlacedPlan, x: str) -> list[int]:
    """Where tensor x's probe is added: the stage computing it, or every stage reading
    it (a graph input, fed to each)."""
    st = pp.stages
    if x in st.produced_at:
        return [st.produced_at[x]]
    return [s for s in range(st.num_stages) if any(x in reads(nd) for nd in st.nodes[s])]


def _zeros(prog: StepParts, ids, source: Mapping[str, str] = {}) -> dict:
    """Zeros shaped as the tensors ``ids`` (a copy's as the tensor it copies, ``source``)."""
    def spec(k: str) -> Any:
        if k.startswith(CHECKS + "/"):
            return jax.ShapeDtypeStruct((RECORD,), jnp.int64)
        if k.startswith(ASSIGN + "/"):
            return arg_specs(prog.variables[k.split("/", 1)[1]])
        return prog.plan.tensor_specs[unstash(source.get(k, k))]
    return {k: jnp.zeros(spec(k).shape, spec(k).dtype) for k in ids}


def _pipeline(pp: PlacedPlan, prog: StepParts, wlayout: IpuSlots):
    """(weight blocks of this device, feeds [M, 1, ...], keys [M, 1], hyper) -> (loss sum,
    anchors {id: [1, 1, T, ...]}) for M micro-batches of one replica through the stages,
    inside shard_map. Sharded weights are all-gathered once, those with sharded
    accumulators in every tick (the backward pass reduce-scatters each tick's gradient
    into their shards). The tensors whose gradients automatic loss scaling tracks are
    tapped (``als.AlsPlan.tap``) in the stage that computes (or owns) them, where the
    cotangent is the total gradient."""
    st = pp.stages
    S = st.num_stages
    stage_fns = [_stage_fn(pp, prog, s) for s in range(S)]
    source = pp.executor.graph.source   # a copy's id -> the tensor it copies
    feed_ids = {s: sorted({t for nd in st.nodes[s] for t in reads(nd) if t in prog.input_infos} |
                          {a for a in stage_fns[s][2] if a in prog.input_infos} |
                          {f"{PROBE}/{x}" for x in _probes(prog) if s in _probe_stages(pp, x)} |
                          {f"{TAP}/{x}" for x in prog.plan.tracked if st.produced_at[x] == s})
                for s in range(S)}

    def body(blocks, feeds, keys, hyper):   # feeds [M, 1, ...], keys [M, 1]: one replica's
        M = keys.shape[0]
        blocks = pp.gather({k: v[0] for k, v in blocks.items()}, pp.view_slots - pp.tick_slots)
        feeds, keys = {k: v[:, 0] for k, v in feeds.items()}, keys[:, 0]

        def stage(s, weights, recv, mc):
            run = stage_fns[s][0]
            f = {k: feeds[k][mc] for k in feed_ids[s]}
            # a tensor passed through a stage on the same device comes straight in
            w = {k: weights[k] for k in st.weights[s]}
            return lambda: run(w, f, recv, keys[mc], hyper)

        def zeros(s):
            _, sends, anc_ids = stage_fns[s]
            return _zeros(prog, sends, source), _zeros(prog, anc_ids), jnp.zeros((), jnp.float32)

        loss, anchors = pp.executor.pipeline(
            M, stage, zeros, lambda d, bufs: wlayout.read(bufs, d),
            lambda: pp.gather(blocks, pp.tick_slots))
        return loss[None, None], {a: v[None, None] for a, v in anchors.items()}
    return body


def _micro_groups(pp: PlacedPlan, prog: StepParts) -> tuple[int, int]:
    """(groups, micro-batches per group): pipelining sends a batch's A micro-batches
    (inference: all the step's) through the pipeline together, sharding one at a time."""
    n = prog.cfg.accumulation_factor
    if not prog.cfg.training:   # inference: every micro-batch of the step
        n *= prog.cfg.batches_per_step
    return (1, n) if pp.stages.pipelined else (n, 1)


class PipelineSchedule(Schedule):
    """The placed schedule for ``step.train_step``: each group of micro-batches through
    PopART's pipeline ticks over the IPUs' devices (``Executor.pipeline``), the state in
    the plan's slots (``IpuSlots``: the weights' and the optimizer state's blocks; ALS's
    state, which no IPU owns, replicated beside them); the accumulation sums (the mean
    reduction divides once)."""
    running = False

    def __init__(self, pp: PlacedPlan, parts: StepParts) -> None:
        self.pp, self.parts = pp, parts
        self.G, self.M = _micro_groups(pp, parts)
        self.wlayout, self.slayout = pp.weight_layout, pp.state_layout
        self.run_group = _group_runner(pp, parts)
        self.grad_anchors = [a for a in parts.plan.anchor_ids if a.startswith(GRAD_PREFIX)
                             and a[len(GRAD_PREFIX):] in parts.variables]

    def split_state(self, sbufs):
        glob = {t: sbufs[k] for t, k in self.slayout.globals.items()}
        return glob, {k: v for k, v in sbufs.items() if k not in self.slayout.global_specs}

    def join_state(self, local, glob):
        return {**local, **{self.slayout.globals[t]: v for t, v in glob.items()}}

    def micro_batches(self, wbufs, bfeeds, bkey, h):
        pp, parts, wlayout, G, M = self.pp, self.parts, self.wlayout, self.G, self.M
        plan, R = parts.plan, parts.cfg.replication_factor
        bfeeds = {k: v.reshape((G, M) + v.shape[1:]) for k, v in bfeeds.items()}
        keys = parts.split_key(bkey, parts.cfg.accumulation_factor * R).reshape((G, M, R))

        def group(gacc, x):
            probes = {f"{PROBE}/{p}": jnp.zeros((M, R) + plan.tensor_specs[p].shape,
                                                plan.tensor_specs[p].dtype)
                      for p in _probes(parts)}   # gradients of activations: per micro-batch
            probes.update({f"{TAP}/{t}": jnp.zeros((M, R) + _als.STAT_SHAPE, jnp.float32)
                           for t in plan.tracked})   # ALS: histograms per micro-batch
            (_, anchors), (grads, pgrads) = jax.value_and_grad(
                lambda w, pr: self.run_group(w, wlayout, {**x[0], **pr}, x[1], h),
                argnums=(0, 1), has_aux=True)(wview, probes)
            anchors.update({GRAD_PREFIX + k[len(PROBE) + 1:]: v for k, v in pgrads.items()
                            if k.startswith(PROBE + "/")})
            if plan.tracked:   # [M, R, tracked, *STAT_SHAPE]
                anchors[_als.STATS] = jnp.stack([pgrads[f"{TAP}/{t}"] for t in plan.tracked],
                                                axis=2)
            gacc = parts.accumulate(gacc, None, grads, running=False)
            if plan.accum:   # one micro-batch per group (pipelined: the plain program)
                anchors.update(parts.accum_values(
                    wlayout.read(wlayout.whole_blocks(gacc, pp.view_slots)), (M, R)))
            return gacc, anchors
        # the stages' weights: shards where view_slots says; their gradients, and so the
        # accumulators, are shards too
        wview = wlayout.shard_blocks(wbufs, pp.view_slots - pp.rts_slots)
        gbufs, anchors = scan(group, jax.tree_util.tree_map(jnp.zeros_like, wview), (bfeeds, keys))
        vals = _per_micro(anchors)
        # variables ops write: the last micro-batch's value, averaged over the replicas
        written = {a.split("/", 1)[1]: jnp.mean(vals.pop(a)[-1], axis=0)
                   for a in list(vals) if a.startswith(ASSIGN + "/")}
        return gbufs, vals, written

    def batch_anchors(self, vals, gbufs):
        """Gradient___<w>: the accumulated gradient, as the plain program gives it."""
        if self.grad_anchors:
            A, R = self.parts.cfg.accumulation_factor, self.parts.cfg.replication_factor
            grads = self.wlayout.read(self.wlayout.whole_blocks(gbufs, self.pp.view_slots))
            for a in self.grad_anchors:
                vals[a] = jnp.broadcast_to(grads[a[len(GRAD_PREFIX):]],
                                           (A, R) + self.parts.plan.anchor_specs[a].shape)

    def update(self, wbufs, sbufs, gbufs, written, h):
        wlayout = self.wlayout
        trained = {wlayout.slots[k][1] for k in self.parts.plan.trainable}
        wbufs, sbufs = _update(self.pp, self.parts, wbufs, {k: gbufs[k] for k in trained},
                               sbufs, h)
        slots = frozenset(wlayout.slots[v][1] for v in written) & wlayout.sharded
        wbufs = wlayout.shard_blocks(wlayout.write(wlayout.whole_blocks(
            wbufs, slots), written), slots)
        return wbufs, sbufs

    def whole(self, wbufs, sbufs, weight_ids, state_ids):
        return (self.wlayout.unpack(wbufs) if weight_ids else {}), self.slayout.unpack(sbufs)


def _group_runner(pp: PlacedPlan, prog: StepParts):
    """(weight blocks, their layout, feeds [M, R, ...], keys [M, R], hyper) -> (loss sum,
    anchors {id: [M, R, ...]}): M micro-batches of every replica through the stages."""
    st, M = pp.stages, _micro_groups(pp, prog)[1]
    anchor_stage = {a: _anchor_stage(pp, a) for a in prog.plan.fwd_anchor_ids +
                    [f"{CHECKS}/{s}" for s in range(st.num_stages)] +
                    [f"{ASSIGN}/{v}" for v in prog.plan.assigned if v in prog.variables]}

    def run_group(wbufs, wlayout, feeds, keys, hyper):
        wspec = {k: pp.slot_spec(k, pp.view_slots) for k in wbufs}
        body = pp.executor.run(_pipeline(pp, prog, wlayout),
                               (wspec, P(None, REPLICA_AXIS), P(None, REPLICA_AXIS), P()),
                               (P(REPLICA_AXIS, IPU_AXIS),) * 2)
        losses, anchors = body(wbufs, feeds, keys, hyper)
        out = {a: jnp.swapaxes(v[:, st.stage_ipu[anchor_stage[a]],
                                 anchor_stage[a]:anchor_stage[a] + M], 0, 1)
               for a, v in anchors.items()}
        checks = [out.pop(a) for a in list(out) if a.startswith(CHECKS + "/")]
        if checks:   # every stage's records of each micro-batch: [M, R, stages, RECORD]
            out[CHECKS] = jnp.stack(checks, axis=2)
        return jnp.sum(losses), out
    return run_group


def _update(pp: PlacedPlan, prog: StepParts, wbufs, gbufs, sbufs, hyper):
    """The optimizer on each device's own weights and state: on this replica's shards for
    the slots in ``update_slots`` (gradients reduce-scattered, the rest sliced), else on
    whole blocks (sharded accumulators all-gathered)."""
    ipus, on, views = pp.ipus, pp.update_slots, pp.view_slots
    wlayout, slayout, trainable = pp.weight_layout, pp.state_layout, prog.plan.trainable

    def per_weight(rule, w, g, s):   # the optimizer's rule on this device's blocks
        w, s = ({k: pp.rts.shards(v.shape).local(v) if k in on - pp.rts_slots else v
                 for k, v in x.items()} for x in (w, s))
        g = pp.gather(g, views - on)
        if pp.row_weights:
            return _row_update(pp, prog, rule, w, g, s)

        def branch(d):
            def f(w, g, s):
                mine = [k for k in trainable if wlayout.slots[k][0] == d]
                ws, gs = wlayout.read(w, d, on), wlayout.read(g, d, on)
                ss, new_w, new_s = slayout.read(s, d, on), {}, {}
                for sharded in (False, True):
                    ids = [k for k in mine if (wlayout.slots[k][1] in on) == sharded]
                    if ids:
                        nw, ns = rule({k: ws[k] for k in ids}, {k: gs[k] for k in ids}, ss,
                                      _sum_squares(sharded))
                        new_w.update(nw)
                        new_s.update(ns)
                return wlayout.repack(w, d, new_w, on), slayout.repack(s, d, new_s, on)
            return f
        return per_ipu([branch(d) for d in range(ipus)], w, g, s)

    def body(w, g, s, h):
        w, g, s = ({k: v[0] for k, v in x.items()} for x in (w, g, s))   # own blocks
        w, s = prog.cfg.optimizer.apply(w, g, s, h, _BlockNorms(pp.weight_layout, ipus, views),
                                        per_weight, list(trainable))
        w, s = (pp.gather(x, on - pp.rts_slots) for x in (w, s))
        return {k: v[None] for k, v in w.items()}, {k: v[None] for k, v in s.items()}
    wspec, sspec = ({k: pp.slot_spec(k) for k in x} for x in (wbufs, sbufs))
    gspec = {k: pp.slot_spec(k, views) for k in gbufs}
    return pp.executor.run(body, (wspec, gspec, sspec, P()), (wspec, sspec))(
        wbufs, gbufs, sbufs, hyper)


def placed_step(pp: PlacedPlan, parts: StepParts):
    """The step of ``parts`` run by ``pp``'s executor: ``(weights, opt_state, key, feeds,
    hyper) -> (weights, opt_state, key, anchors)``, the state in ``pp``'s slots
    (docs/model_parallelism.md): ``step.train_step`` with the :class:`PipelineSchedule`,
    or inference's micro-batches group by group."""
    if parts.cfg.training:
        return train_step(parts, PipelineSchedule(pp, parts))
    cfg = parts.cfg
    G, M = _micro_groups(pp, parts)
    B, A, R = cfg.batches_per_step, cfg.accumulation_factor, cfg.replication_factor
    run_group = _group_runner(pp, parts)

    def run(weights, feeds, key, hyper):   # no updates: the step's B x A micro-batches in one go
        flat = {k: v.reshape((G, M) + v.shape[2:]) for k, v in feeds.items()}
        keys = parts.split_key(key, B * A * R).reshape((G, M, R))
        _, anchors = jax.lax.map(lambda x: run_group(weights, pp.weight_layout, x[0], x[1], hyper),
                                 (flat, keys))
        return {a: v.reshape((B, A) + v.shape[2:]) for a, v in anchors.items()}
    return infer_step(parts, run)


def _sum_squares(on_shards: bool):
    """How the update sums a tensor's squares (Lamb's norms): over the replicas' shards
    when it updates shards."""
    if not on_shards:
        return local_sum_squares
    return lambda x: jax.lax.psum(local_sum_squares(x), REPLICA_AXIS)


def _row_update(pp: PlacedPlan, prog: StepParts, rule: Any, w: dict, g: dict, s: dict
                ) -> tuple[dict, dict]:
    """The optimizer's per-weight ``rule`` on whole blocks (or their shards,
    ``update_slots``), in place: each weight slot updated as one weight (its
    representative's values), with the state slots beside it."""
    lay, w, s = pp.state_layout, dict(w), dict(s)
    for wkey, r in pp.row_weights.items():
        keys = {sid: lay.slots[sid][1]
                for sid in prog.cfg.optimizer.init_state(r, prog.variables[r])}
        new_w, new_s = rule({r: w[wkey]}, {r: g[wkey]}, {sid: s[key] for sid, key in keys.items()},
                            _sum_squares(wkey in pp.update_slots))
        w[wkey] = new_w[r]
        s.update({keys[sid]: v for sid, v in new_s.items()})
    return w, s


def _per_micro(anchors: dict) -> dict:
    """Anchors [G, M, R, ...] of a batch as [A, R, ...]."""
    return {a: v.reshape((-1,) + v.shape[2:]) for a, v in anchors.items()}


def ipus_per_replica(device: Any, replicas: int) -> int:
    return int(getattr(device, "numIpus", 1) or 1) // replicas


def plan_program(graph: Graph, cfg: StepConfig, input_infos: Mapping[str, Any],
                 device: Any = None, traced: Optional[tuple] = None) -> StepProgram:
    """The session's step program, planned (from ``traced``, the step's abstract trace,
    when the session made it: ``program.trace_step``) and placed (``StepProgram.placed``, a
    :class:`PlacedPlan`) when its virtual graphs (or execution phases) span several IPUs and
    the placed program can run it (``placed.placed_or_none`` logs why not)."""
    mode = cfg.config.virtual_graph_mode
    spans = mode in ("Manual", "Auto", "ExecutionPhases") and ipus_per_replica(device, 1) > 1

    def place(parts: StepParts) -> Optional[PlacedPlan]:
        if mode == "Auto":   # placed or not, as PopART
            auto_virtual_graphs(parts.graph, ipus_per_replica(device, cfg.replication_factor),
                                {k: int(np.prod(s.shape)) for k, s in parts.plan.tensor_specs.items()})
        return placed_or_none("Virtual graphs", lambda: plan_placed(parts, device))

    program = StepProgram(graph, cfg, input_infos, device, stash_anchors=spans)
    program.plan(traced, place=place if spans else None)
    return program
