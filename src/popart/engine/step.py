"""The step builder: a :class:`StepPlan` (``engine/step_plan.py``), the step's config and
the optimizer turned into the step's parts (one micro-batch's trace, gradient accumulation
and its mean reduction, automatic loss scaling, the anchors the update gives, the anchors'
reduction) and into the step itself, around a schedule:

- :class:`Schedule`: how a batch's micro-batches run and how the state is packed; the
  unplaced one (:class:`ScanSchedule`: a scan over the micro-batches, replicas side by side)
  is here, the placed one (PopART's pipeline ticks over the IPUs' devices) is
  ``pipeline.PipelineSchedule``;
- :func:`train_step` / :func:`infer_step`: the step ``(weights, opt_state, key, feeds,
  hyper) -> (weights, opt_state, key, anchors)`` over ``batchesPerStep``, the same for both;
- :func:`state_step`: popxl's step ``(state, feeds) -> (new state, outputs)`` (its IR holds
  its gradients and updates as ops: no accumulation or optimizer here) around its schedule
  (replicated over the replicas, or placed over IPUs in program order with repeat loops).

Every step runs one replica's graph with one part, :class:`GraphRun` (popart's micro-batch,
its pipeline stages, popxl's replica and its placed stages): no other module traces a graph
for a step.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from .._ir.graph import Graph
from . import als as _als
from .backends import backend
from .compiled import REPLICA_AXIS, Facts, Placement
from .config import AnchorReturn, EngineConfig
from .lower import CHECKS, RECORD, Remat, Trace, first_failure, trace
from .step_plan import GRAD_PREFIX, StepConfig, StepPlan, unstash

# Recomputation's run-time true (engine/lower.py: run_segment), a step argument among the
# optimizer's values so that the compiler cannot fold it.
RECOMPUTE_ONE = "__recompute_one"


def scan(f, init, xs):
    """``lax.scan``, or a direct call for a single step (XLA optimises straight-line code
    better than a loop of one iteration)."""
    n = jax.tree_util.tree_leaves(xs)[0].shape[0]
    if n != 1:
        return jax.lax.scan(f, init, xs)
    carry, y = f(init, jax.tree_util.tree_map(lambda a: a[0], xs))
    return carry, jax.tree_util.tree_map(lambda a: a[None], y)


def vector_chunk(n: int, bytes_per_item: int, budget: int = 1 << 26) -> int:
    """The largest divisor of ``n`` whose chunk of micro-batches keeps its activations within
    ``budget`` bytes."""
    cap = max(1, budget // max(1, bytes_per_item))
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= cap)


def reduce_anchor(ret: AnchorReturn, v: Any) -> Any:
    """One anchor's values [B, A, R, *shape] (batches, accumulation micro-batches, replicas)
    as its AnchorReturnType returns them: all, every Nth micro-batch (PopART's batch counter
    counts micro-batches), the last one, or their sum."""
    if ret.kind == "All":
        return v
    if ret.kind == "EveryN":
        B, A, n = v.shape[0], v.shape[1], ret.period
        return v.reshape((B * A,) + v.shape[2:])[n - 1::n].reshape((B // n, A) + v.shape[2:])
    if ret.kind == "Final":
        return v[-1, -1]
    return v.sum(axis=(0, 1))


def with_checks(vals: dict, t: Trace) -> dict:
    """``vals`` (a replica's outputs) and, under ``CHECKS``, the record of the trace's first
    failed run-time check (of the checks the plan found)."""
    flags = t.check_flags()
    return vals if flags is None else {**vals, CHECKS: flags}


@dataclass(frozen=True)
class GraphRun:
    """One replica's graph run on its state and feeds, the part every step builds from:
    the trace with the replica axis (with replicas) and the plan's run-time checks (a step's
    keep their ids: ``lower.trace``), the values of the state it writes, its outputs with
    their checks' record; ``planning``: the step is the plan's abstract trace, its stages'
    run-time checks follow as ``Facts`` (:meth:`result`)."""
    platform: str
    replication_factor: int
    checks: Sequence = ()
    config: Optional[EngineConfig] = None
    planning: bool = False

    def __call__(self, graph: Graph, feeds: Mapping[str, Any], weights: Mapping[str, Any],
                 key: Any = None, **kw: Any) -> Trace:
        """The trace of ``graph`` (``kw``: ``lower.trace``'s training options); ``key``: the
        base PRNG key (None: key(0), popxl's, whose random ops take their seeds as inputs).
        The key is made here, before the graph runs: one made lazily by the first random op
        inside a repeat or conditional body became a constant argument of the compiled step."""
        R = self.replication_factor
        key = jax.random.key(0) if key is None else key
        return trace(graph, feeds, key=key, weights=weights,
                     replica_axis=REPLICA_AXIS if R > 1 else None, replication_factor=R,
                     config=self.config, platform=self.platform, checks=self.checks, **kw)

    @staticmethod
    def written(t: Trace, slots: Mapping[str, str], like: Mapping[str, Any]) -> dict:
        """The state it wrote: per key, the value of tensor ``slots[key]`` in ``like[key]``'s
        dtype."""
        return {k: jnp.asarray(t.env[out]).astype(like[k].dtype) for k, out in slots.items()}

    @staticmethod
    def outputs(t: Trace, ids: Mapping[str, str]) -> dict:
        """Per name, the value of tensor ``ids[name]``, with the checks' record (:func:`with_checks`)."""
        return with_checks({k: jnp.asarray(t.env[tid]) for k, tid in ids.items()}, t)

    @staticmethod
    def record(t: Trace) -> Any:
        """The record of the trace's first failed check (zeros: none failed, or no checks)."""
        flags = t.check_flags()
        return jnp.zeros(RECORD, jnp.int64) if flags is None else flags

    def result(self, t: Trace, *out: Any) -> tuple:
        """``out``, and when planning the trace's run-time checks as ``Facts``."""
        return (*out, Facts(checks=list(t.checks))) if self.planning else out


@dataclass(frozen=True)
class StepParts:
    """A planned step's parts, for every schedule: the plan, the config, the graph (its
    constants only: weights are arguments), the weights' host values (shapes, dtypes), the
    platform, and whether keys are split per micro-batch and replica (``keyed``: the graph
    draws random numbers, or a placed schedule folds keys per stage)."""
    plan: StepPlan
    cfg: StepConfig
    graph: Graph                 # graph_consts: the initializers are the constants
    variables: Mapping[str, Any]
    input_infos: Mapping[str, Any]
    platform: str
    keyed: bool

    # -------------------------------------------------------------- one micro-batch
    def trace_graph(self, weights, feeds, key, probes=None, training=False, remat=None,
                    graph: Optional[Graph] = None, effects: Optional[set] = None,
                    taps: Optional[Mapping[str, Any]] = None) -> Trace:
        """One trace of the session's graph (or of ``graph``, a part of it) as the step runs it
        (:attr:`run`)."""
        plan = self.plan
        return self.run(self.graph if graph is None else graph, feeds, weights, key,
                        training=training, probes=probes, remat=remat, effects=effects, taps=taps,
                        float32_loss=plan.float32_loss if training else None,
                        float32_region=plan.float32_region if training else frozenset())

    @property
    def run(self) -> GraphRun:
        """The step's graph run: its replicas, platform, config and the plan's checks."""
        cfg = self.cfg
        return GraphRun(self.platform, cfg.replication_factor, self.plan.run_checks, cfg.config)

    @staticmethod
    def anchor_value(env, tid):
        return jnp.asarray(env[unstash(tid)])   # the plan checked every anchor names a tensor

    def hyper_value(self, hyper, name):
        if name in hyper:
            return hyper[name]
        return self.cfg.optimizer.loss_scaling().val() if self.cfg.optimizer is not None else 1.0

    def scaled_loss(self, t: Trace, hyper) -> Any:
        """The trace's loss (one element: [1] too) times the loss scaling (with ALS: the
        batch's finalLossScale)."""
        loss = t.scalable_loss(self.cfg.loss).reshape(())
        return loss * jnp.asarray(self.hyper_value(hyper, "lossScaling"), loss.dtype)

    def split_key(self, key, n: int):
        """``n`` keys from ``key``; when no key is read (not ``keyed``), ``n`` copies (no
        threefry work in the compiled program)."""
        if self.keyed:
            return jax.random.split(key, n)
        return jax.random.wrap_key_data(jnp.broadcast_to(jax.random.key_data(key),
                                                         (n,) + jax.random.key_data(key).shape))

    def micro_fn(self):
        """One replica's micro-batch: (weights, feeds, key, hyper) -> (anchor values, the
        trainable weights' gradients, assignments); with ALS, the tracked gradients'
        statistics [tracked, *STAT_SHAPE] under ``als.STATS`` (:meth:`als_batch` reads them)."""
        cfg, plan = self.cfg, self.plan
        fwd_ids = {a: unstash(a) for a in plan.fwd_anchor_ids}   # the plan checked each names a tensor
        if not cfg.training:
            def micro(weights, feeds, key, hyper):
                t = self.trace_graph(weights, feeds, key)
                return GraphRun.outputs(t, fwd_ids), {}, {}
            return micro

        grad_ids, trainable, tracked = plan.grad_ids, plan.trainable, plan.tracked
        probe_specs = {p: plan.anchor_specs[GRAD_PREFIX + p] for p in grad_ids if p not in trainable}

        def micro(weights, feeds, key, hyper):
            remat = Remat(self.graph.nodes, plan.segments, hyper[RECOMPUTE_ONE]) \
                if plan.segments else None
            train_w = {k: weights[k] for k in trainable}
            other_w = {k: v for k, v in weights.items() if k not in train_w}
            probes0 = {p: jnp.zeros(s.shape, s.dtype) for p, s in probe_specs.items()}
            stats0 = {t: jnp.zeros(_als.STAT_SHAPE, jnp.float32) for t in tracked}

            def loss_fn(tw, probes, stats):
                taps = {t: functools.partial(plan.als.tap, stat=stats[t]) for t in tracked}
                t = self.trace_graph({**other_w, **tw}, feeds, key, probes, training=True,
                                     remat=remat, taps=taps)
                vals = GraphRun.outputs(t, fwd_ids)
                return self.scaled_loss(t, hyper), (vals, dict(t.assignments))

            (_, (vals, assigns)), (gw, gp, gs) = jax.value_and_grad(
                loss_fn, argnums=(0, 1, 2), has_aux=True)(train_w, probes0, stats0)
            for g in grad_ids:
                vals[GRAD_PREFIX + g] = gw[g] if g in gw else gp[g]
            if tracked:   # ALS: the tap gradients of every tracked gradient
                vals[_als.STATS] = jnp.stack([gs[t] for t in tracked])
            return vals, gw, assigns
        return micro

    # -------------------------------------------------------------- accumulation
    def accumulate(self, acc: Mapping, count: Any, g: Mapping, running: bool) -> dict:
        """The accumulated gradients after one more micro-batch's (replica-reduced) ``g``:
        their sum, or with ``running`` (MeanReductionStrategy.Running) their running mean."""
        if running:
            n, R = count + 1.0, self.cfg.replication_factor
            return {k: acc[k] * (count / n) + g[k] / (R * n) for k in g}
        return {k: acc[k] + g[k] for k in g}

    def running(self) -> bool:
        """The accumulation keeps a running mean (Mean reduction, Running strategy)."""
        return self.cfg.mean_reduction and self.cfg.running_mean

    def mean_reduce(self, grads: Mapping, running: bool) -> dict:
        """A batch's accumulated gradients reduced as the session's reduction says: Mean
        divides a sum by the micro-batches and replicas (a running mean is one already)."""
        cfg = self.cfg
        if cfg.mean_reduction and not running:
            n = cfg.accumulation_factor * cfg.replication_factor
            return jax.tree_util.tree_map(lambda g: g / n, grads)
        return dict(grads)

    def accum_values(self, acc: Mapping[str, Any], lead: tuple) -> dict:
        """The ``Accum___<w>`` anchors from the accumulators (whole, by weight), broadcast
        over ``lead``."""
        specs = self.plan.anchor_specs
        return {a: jnp.broadcast_to(acc[w].astype(specs[a].dtype), lead + specs[a].shape)
                for a, w in self.plan.accum.items()}

    def after_update(self, vals: dict, weights: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        """The anchors a batch's update gives (``UpdatedVar___<w>``, the optimizer state),
        from the whole new ``weights`` and ``state`` by id, broadcast over the batch's [A, R]."""
        A, R = self.cfg.accumulation_factor, self.cfg.replication_factor
        after = {**{a: state[a] for a in self.plan.opt_anchor_ids},
                 **{a: weights[w] for a, w in self.plan.updated_var.items()}}
        vals.update({a: jnp.broadcast_to(v, (A, R) + jnp.shape(v)) for a, v in after.items()})

    # -------------------------------------------------------------- automatic loss scaling
    def als_micro(self, stats: Any, stats_acc: Any) -> tuple[Any, dict]:
        """Automatic loss scaling in a micro-batch (all replicas): add the sum of the tracked
        gradients' histograms ``stats`` [R, tracked, 2] (cast to float32) to the batch's
        statistics accumulator [R, 2]; (the accumulator, the statistics anchors of this
        micro-batch, each [R, ...])."""
        plan = self.plan
        summed = jnp.sum(stats, axis=1, dtype=jnp.uint32)               # summedHistograms
        casted = summed.astype(jnp.float32)                             # summedCastedHistograms
        stats_acc = stats_acc + casted                                  # Accum___autoLossScaleStats
        R = self.cfg.replication_factor
        per_micro = {_als.SUMMED: summed, _als.CASTED: casted, _als.ACCUM: stats_acc}
        if self.cfg.accumulation_factor == 1:   # the all-reduce runs every micro-batch
            per_micro[_als.REDUCED] = jnp.broadcast_to(jnp.sum(casted, axis=0), (R, 2))
        for k, t in enumerate(plan.als.tracked):
            per_micro[plan.als.stats_anchor(t)] = stats[:, k]
        return stats_acc, {a: v for a, v in per_micro.items() if a in plan.als_anchors}

    def als_batch(self, vals: dict, glob: dict, final: Any, static: Any, on: Any) -> dict:
        """Automatic loss scaling after a batch's micro-batches: the tap gradients [A, R,
        tracked, *STAT_SHAPE] (``vals``' ``als.STATS``) as histograms accumulated micro-batch
        by micro-batch, the ALS anchors added to ``vals`` (per micro-batch, and per batch
        broadcast over [A, R]: ``finalLossScale``, the optimizer's loss scaling and, with
        accumulation, the all-reduced accumulated statistics); returns the ALS state
        ``glob`` with the factor ``LossScaleUpdateOpx`` gives from the statistics summed over
        the replicas (``als.AlsPlan.update``)."""
        als, A, R = self.plan.als, self.cfg.accumulation_factor, self.cfg.replication_factor
        stats = als.gate(als.counts(vals.pop(_als.STATS)), on)
        stats_acc, per_micro = scan(lambda acc, st: self.als_micro(st, acc),
                                    jnp.zeros((R, 2), jnp.float32), stats)
        vals.update(per_micro)
        per_batch = {_als.FINAL: final, als.loss_scaling_id: static}
        if A > 1:
            per_batch[_als.REDUCED] = jnp.sum(stats_acc, axis=0)
        for a, v in per_batch.items():
            if a in self.plan.als_anchors and a not in vals:
                vals[a] = jnp.broadcast_to(v, (A, R) + jnp.shape(v))
        return {**glob, _als.FACTOR: als.update(glob[_als.FACTOR], jnp.sum(stats_acc, axis=0), on)}

    # -------------------------------------------------------------- anchors
    def reduce_anchors(self, vals: dict) -> dict:
        """Each anchor's values [B, A, R, *shape] as its AnchorReturnType returns them
        (``dataflow.device_lead_dims`` gives the leading dims each kind keeps)."""
        return {a: first_failure(v) if a == CHECKS   # the run-time checks' record
                else reduce_anchor(self.cfg.anchors[a], v) for a, v in vals.items()}


class Schedule:
    """How a training batch's micro-batches run and where the state lives (the unplaced
    :class:`ScanSchedule`, the placed ``pipeline.PipelineSchedule``). State arguments are
    in the schedule's packing; what :func:`train_step` hands the parts is by tensor id."""
    running: bool = False   # the accumulation keeps a running mean

    def split_state(self, opt_state: Any) -> tuple[dict, Any]:
        """(the ALS state by id, the rest in the packing)."""
        raise NotImplementedError

    def join_state(self, local: Any, glob: dict) -> Any:
        raise NotImplementedError

    def micro_batches(self, weights: Any, feeds: dict, key: Any, hyper: dict
                      ) -> tuple[Any, dict, dict]:
        """A batch's micro-batches (feeds [A, R, ...]): (accumulated gradients, anchors
        [A, R, ...], the variables ops wrote: the last micro-batch's, over the replicas)."""
        raise NotImplementedError

    def batch_anchors(self, vals: dict, grads: Any) -> None:
        """Anchors of the reduced gradients (none by default)."""

    def update(self, weights: Any, opt_state: Any, grads: Any, assigns: dict, hyper: dict
               ) -> tuple[Any, Any]:
        """The optimizer on the trainable weights, and the ops' assignments stored."""
        raise NotImplementedError

    def whole(self, weights: Any, opt_state: Any, weight_ids: list, state_ids: list
              ) -> tuple[dict, dict]:
        """These weights and state tensors, whole, by id."""
        raise NotImplementedError


class ScanSchedule(Schedule):
    """The unplaced schedule: a scan over the micro-batches, each running every replica
    (``Placement.replicate``: shard_map or vmap); the state as global arrays by tensor id
    in their RTS form (``rts.StateSharding``)."""

    def __init__(self, parts: StepParts, placement: Placement) -> None:
        self.parts, self.rts, self.running = parts, parts.plan.rts, parts.running()
        self.replicas = replicated(placement, parts.micro_fn())

    def split_state(self, opt_state):
        glob = {k: v for k, v in opt_state.items() if k in (_als.FACTOR, _als.COUNTER)}
        return glob, {k: v for k, v in opt_state.items() if k not in glob}

    def join_state(self, local, glob):
        return {**local, **glob}

    def micro_batches(self, weights, feeds, key, hyper):
        parts, rts, plan = self.parts, self.rts, self.parts.plan
        R = parts.cfg.replication_factor
        whole = rts.gather(weights)                          # RTS: all-gathered

        def micro_batch(acc, xa):
            grads_acc, count, w_assign = acc
            f, akey = xa                                     # f: [R, ...]
            vals, grads, assigns = self.replicas(whole, f, parts.split_key(akey, R), hyper)
            grads_acc = parts.accumulate(grads_acc, count, rts.reduce_replicas(grads), self.running)
            if plan.accum:   # the accumulators after this micro-batch
                vals.update(parts.accum_values({w: self._whole_accum(w, grads_acc[w])
                                                for w in plan.accum.values()}, (R,)))
            w_assign = {k: jnp.mean(v, axis=0).astype(whole[k].dtype)
                        for k, v in assigns.items() if k in whole}
            return (grads_acc, count + 1.0, w_assign), vals

        zeros = rts.accumulators({k: whole[k] for k in plan.trainable})
        assign0 = {k: whole[k] for k in plan.assigned if k in whole}
        (grads, _, w_assign), vals = scan(
            micro_batch, (zeros, 0.0, assign0),
            (feeds, parts.split_key(key, parts.cfg.accumulation_factor)))
        return grads, vals, w_assign

    def _whole_accum(self, w: str, v: Any) -> Any:
        rts = self.rts
        v = rts.unshard(v, rts.shapes[w]) if w in rts.scattered else v
        return jnp.sum(v, axis=0) if w in rts.sharded_update else v

    def update(self, weights, opt_state, grads, assigns, hyper):
        new_w, new_state = self.rts.update(
            self.parts.cfg.optimizer.apply, {k: weights[k] for k in self.parts.plan.trainable},
            grads, opt_state, hyper)
        return {**weights, **self.rts.store(assigns), **new_w}, {**opt_state, **new_state}

    def whole(self, weights, opt_state, weight_ids, state_ids):
        return (self.rts.gather({w: weights[w] for w in weight_ids}),
                self.rts.gather({k: opt_state[k] for k in state_ids}))


def replicated(placement: Placement, micro: Callable) -> Callable:
    """``micro`` for every replica (weights and hyper-parameters shared, feeds and keys per
    replica): see :meth:`Placement.replicate`."""
    return placement.replicate(micro, in_axes=(None, 0, 0, None))


def train_step(parts: StepParts, schedule: Schedule) -> Callable:
    """The training step ``(weights, opt_state, key, feeds, hyper) -> (weights, opt_state,
    key, anchors)``: a scan over the batches, each ALS's start, the schedule's micro-batches,
    the mean reduction, ALS's statistics and factor, the update and its anchors."""
    plan, B = parts.plan, parts.cfg.batches_per_step

    def step(weights, opt_state, key_data, feeds, hyper):
        key = jax.random.wrap_key_data(key_data)

        def batch(carry, xs):
            weights, opt_state = carry
            bfeeds, bkey = xs                                    # feeds: [A, R, ...]
            glob, local = schedule.split_state(opt_state)
            h = hyper
            if plan.als is not None:   # ALS: this batch's counter and finalLossScale
                glob, h, final, static = plan.als.begin(glob, hyper)
            grads, vals, assigns = schedule.micro_batches(weights, bfeeds, bkey, h)
            grads = parts.mean_reduce(grads, schedule.running)
            schedule.batch_anchors(vals, grads)
            if plan.als is not None:   # the update uses the batch's finalLossScale
                glob = parts.als_batch(vals, glob, final, static, h[_als.UPDATE])
            weights, local = schedule.update(weights, local, grads, assigns, h)
            opt_state = schedule.join_state(local, glob)
            if plan.opt_anchor_ids or plan.updated_var:   # after the update
                parts.after_update(vals, *schedule.whole(
                    weights, opt_state, list(plan.updated_var.values()), plan.opt_anchor_ids))
            return (weights, opt_state), vals

        key, sub = parts.split_key(key, 2)
        (weights, opt_state), vals = scan(batch, (weights, opt_state), (feeds, parts.split_key(sub, B)))
        return weights, opt_state, jax.random.key_data(key), parts.reduce_anchors(vals)
    return step


def infer_step(parts: StepParts, run: Callable) -> Callable:
    """The inference step (same signature as :func:`train_step`): ``run(weights, feeds
    [B, A, R, ...], key) -> anchors [B, A, R, ...]``, the schedule's, reduced."""
    def step(weights, opt_state, key_data, feeds, hyper):
        key, sub = parts.split_key(jax.random.wrap_key_data(key_data), 2)
        vals = run(weights, feeds, sub, hyper)
        return weights, opt_state, jax.random.key_data(key), parts.reduce_anchors(vals)
    return step


def state_step(schedule: Callable[[GraphRun, Mapping], Callable], platform: str,
               replication_factor: int, planned: Optional[Mapping[str, Any]] = None) -> Callable:
    """A step over a state the graph updates itself (popxl's): ``schedule(run, planned)``,
    the step ``(state, feeds) -> (new state, outputs)`` the schedule builds around the graph
    run ``run`` (popxl's ``ReplicaSlots.schedule``: replicated over the replicas;
    ``MainPlan.schedule``: placed over IPUs in program order, with repeat loops), as
    :func:`train_step` / :func:`infer_step` take theirs. ``planned``: the facts of its plan
    (``checks``: the run-time checks, numbered; the schedule's own); None: the step is the
    plan's abstract trace, its facts follow as ``Facts``."""
    checks = tuple(planned.get("checks", ())) if planned else ()
    run = GraphRun(platform, replication_factor, checks, planning=planned is None)
    return schedule(run, planned or {})


def vectorised_inference(parts: StepParts, placement: Placement) -> Callable:
    """The unplaced inference schedule for :func:`infer_step`: micro-batches have no state
    between them, so chunks of them run as one wider batch (vmap), the chunks in a scan.
    Bigger matmuls and convolutions are what XLA's CPU and GPU backends run fastest."""
    cfg = parts.cfg
    R, A, B = cfg.replication_factor, cfg.accumulation_factor, cfg.batches_per_step
    n = B * A
    chunk = vector_chunk(n, parts.plan.activation_bytes * R, vector_budget(parts))
    replicas = replicated(placement, parts.micro_fn())

    def run(weights, feeds, key, hyper):
        whole = parts.plan.rts.gather(weights)

        def one(f, k):
            return replicas(whole, f, parts.split_key(k, R), hyper)[0]

        flat = jax.tree_util.tree_map(lambda a: a.reshape((n // chunk, chunk) + a.shape[2:]), feeds)
        keys = parts.split_key(key, n).reshape((n // chunk, chunk))
        _, vals = scan(lambda c, xs: (c, jax.vmap(one)(*xs)), None, (flat, keys))
        return jax.tree_util.tree_map(lambda v: v.reshape((B, A) + v.shape[2:]), vals)
    return run


def vector_budget(parts: StepParts) -> int:
    """Activation bytes a vectorised chunk may hold: the platform backend's rule (conv
    nets on the CPU run micro-batch by micro-batch). POPART_VECTOR_BYTES overrides."""
    if "POPART_VECTOR_BYTES" in os.environ:
        return int(os.environ["POPART_VECTOR_BYTES"])
    return backend(parts.platform).vector_budget({n.op_type for n in parts.graph.nodes})
