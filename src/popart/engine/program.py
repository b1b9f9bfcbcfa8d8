"""The step program: one compiled XLA program per session.

A ``run()`` is one call into it. Inside: a ``lax.scan`` over batchesPerStep, within each batch a
``lax.scan`` over the accumulationFactor micro-batches, replicas side by side (``vmap`` with a
named axis, so collectives work), the forward pass, and for training the backward pass
(``jax.value_and_grad``), gradient accumulation, the replica reduction and the optimizer update.
Weights, optimizer state and the RNG key live on the device between runs (donated buffers);
the host moves only the step's inputs and anchors.

The stages: :func:`trace_step` (the one abstract trace) -> ``step_plan.make_plan`` (the frozen
:class:`StepPlan`, in :meth:`StepProgram.plan`) -> ``step.py`` (the step's parts and the step
around a schedule: here the scan, placed ``pipeline.PipelineSchedule``) -> :meth:`compile` ->
:meth:`run`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import IrError, noted, popart_exception
from .._ir import recompute
from .._ir.graph import Graph
from ..tensorinfo import TensorInfo
from . import als as _als
from .config import EngineConfig
from .compiled import REPLICA_AXIS, CompiledStep, Facts, Placement, arg_specs, plan_trace
from .executable import EngineCache, compile_step
from .lower import CHECKS, raise_failed_checks, trace
from .packing import GlobalArrays, Packing
from .step import RECOMPUTE_ONE, StepParts
from .step import reduce_anchor, vector_chunk  # noqa: F401  (the sessions' and tests' names)
from .step_plan import (StepConfig, StepPlan, make_plan, optimizer_scalars,  # noqa: F401
                        split_variables)
from .step_plan import GRAD_PREFIX, missing_anchor  # noqa: F401  (session_checks' names)

# Automatic loss scaling (engine/als.py): the state and the anchorable tensors, PopART's names.
ALS_FACTOR = _als.FACTOR                 # lossScaleUpdateFactor (optimizer state, anchorable)
ALS_COUNTER = _als.COUNTER               # the updatePeriod counter (state, updatePeriod > 1)
ALS_FINAL = _als.FINAL                   # finalLossScale: the loss scale each batch runs with


def check_recompute_mixture(graph: Graph, config: EngineConfig) -> None:
    """Ir::prepare's check: automatic recomputation (autoRecomputation other than
    NoRecompute) with ops the user marked Recompute, unless there are execution phases."""
    if config.recompute != "NoRecompute" and config.execution_phases < 2 and any(
            int(n.annotations.get(recompute.RECOMPUTE_OUTPUT, 0) or 0) == recompute.RECOMPUTE
            for n in graph.nodes):
        raise popart_exception("A mixture of auto and manual recomputation is not supported")


def check_loss_shape(loss: str, shape: Any) -> None:
    """Ir::setFinalLoss: a training session's loss has one element (shape [], [1], [1, 1],
    ...), not more."""
    if int(np.prod(shape)) != 1:
        raise noted(IrError(f"Loss tensor, '{loss}', must be a scalar tensor"),
                    f"Its shape is {list(shape)}: reduce it with a loss op of reduction Sum or "
                    f"Mean (popart.ReductionType)")


def trace_step(graph: Graph, input_infos: Mapping[str, TensorInfo], anchors: Any, training: bool,
               loss: Optional[str], replication_factor: int, config: EngineConfig,
               platform: str) -> tuple[dict, dict]:
    """The step's ONE abstract trace (``plan_trace``: ``jax.eval_shape``, vmapped over the
    replicas' axis when there are several): the graph's forward pass as the step runs it
    (weights as arguments, training's ops), no compile. Returns (the ``anchors``' specs,
    the trace's facts as values: ``specs``, every tensor's type as one replica sees it,
    which also gives a session's TensorInfos; effects, checks, assignments, RNG use, ...).
    A training step's loss must be a tensor with one element (:func:`check_loss_shape`)."""
    variables, constants = split_variables(graph)
    consts = Graph(**{**graph.__dict__, "initializers": constants})   # StepProgram.graph_consts
    R = replication_factor
    specs = {k: jax.ShapeDtypeStruct(tuple(i.shape()), i.np_dtype()) for k, i in input_infos.items()}
    wspecs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in variables.items()}

    def probe(weights, feeds):   # -> (anchor specs, the trace's Facts)
        effects: set = set()   # id(node) of the nodes with side effects
        t = trace(consts, feeds, key=jax.random.key(0), training=training, weights=weights,
                  replica_axis=REPLICA_AXIS if R > 1 else None, replication_factor=R,
                  config=config, platform=platform, effects=effects, checks=[])
        env = t.env
        if training and loss not in env:
            raise popart_exception(f"The loss tensor '{loss}' is not a tensor of the model")
        shapes = {}
        for a in anchors:
            base = a[len(GRAD_PREFIX):] if a.startswith(GRAD_PREFIX) else a
            if base in env and env[base] is not None:
                shapes[a] = jax.ShapeDtypeStruct(jnp.shape(env[base]), jnp.result_type(env[base]))
        return shapes, Facts(
            effects=effects,
            traced={k for k, v in env.items() if isinstance(v, jax.core.Tracer)},
            known={k for k, v in env.items() if isinstance(v, (np.ndarray, np.generic))},
            ids=set(env), assigned=list(t.assignments), checks=list(t.checks),
            dtypes={o: getattr(env.get(o), "dtype", None) for o in graph.outputs},
            rng=t.used_rng(),
            act=sum(int(np.prod(jnp.shape(v))) * jnp.result_type(v).itemsize
                    for v in env.values() if isinstance(v, jax.core.Tracer)),
            # every tensor's type (one replica's): TensorInfos, tracked gradients (ALS),
            # recomputation, stages
            specs={k: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)) for k, v in env.items()
                   if isinstance(v, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))})

    if R > 1:   # under the replica axis, which collectives name
        rspecs = {k: jax.ShapeDtypeStruct((R,) + s.shape, s.dtype) for k, s in specs.items()}
        (per_replica,), out = plan_trace(jax.vmap(probe, in_axes=(None, 0), axis_name=REPLICA_AXIS,
                                                  axis_size=R), wspecs, rspecs)
        shapes = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in per_replica.items()}
    else:
        (shapes,), out = plan_trace(probe, wspecs, specs)
    if training:
        check_loss_shape(loss, out["specs"][loss].shape)
    return shapes, out


def _fact(name: str) -> property:
    """A field of the program's plan (:class:`StepPlan`), read-only."""
    return property(lambda self: getattr(self.facts, name), doc=f"The plan's ``{name}``.")


class StepProgram:
    """Builds, compiles and runs the step of one session. Its facts are its plan's
    (:class:`StepPlan`, :meth:`plan`); nothing is assigned after :meth:`plan` but the
    compiled step (:meth:`compile`)."""

    def __init__(self, graph: Graph, cfg: StepConfig, input_infos: Mapping[str, TensorInfo],
                 device: Any = None, stash_anchors: bool = False):
        """``stash_anchors``: a virtual-graph session's, whose anchors may name stashed and
        restored activations (``Stashed___X``, ``Restored___X``)."""
        self.graph, self.cfg, self.input_infos = graph, cfg, dict(input_infos)
        self.device_info = device
        self.stash_anchors = stash_anchors
        self.placement = Placement(cfg.replication_factor, device, processes=cfg.config.processes)
        self.variables, self.constants = split_variables(graph)
        self.graph_consts = Graph(**{**graph.__dict__, "initializers": self.constants})
        self.facts: Optional[StepPlan] = None    # the plan (plan() makes it)
        self.parts: Optional[StepParts] = None   # the step builder's parts of the plan
        # its IPUs on devices of their own: a pipeline.PlacedPlan (plan()'s ``place`` makes
        # it), which then holds the state's layout and the schedule
        self.placed: Any = None
        # the device state's packing (engine/packing.py): the placed plan's slots, or global
        # arrays by tensor id (plan() chooses it with the placement)
        self.packing: Optional[Packing] = None
        self.step: Optional[CompiledStep] = None   # compile() makes it

    # ------------------------------------------------------------------ the plan's facts
    @property
    def planned(self) -> bool:
        return self.facts is not None

    trainable = _fact("trainable")
    assigned = _fact("assigned")
    anchor_ids = _fact("anchor_ids")
    anchor_specs = _fact("anchor_specs")
    tensor_specs = _fact("tensor_specs")
    run_checks = _fact("run_checks")
    activation_bytes = _fact("activation_bytes")
    als = _fact("als")
    als_anchors = _fact("als_anchors")
    host_anchors = _fact("host_anchors")
    segments = _fact("segments")
    float32_loss = _fact("float32_loss")
    float32_region = _fact("float32_region")
    rts = _fact("rts")

    @property
    def uses_rng(self) -> bool:
        """The compiled step reads its key: the graph draws random numbers, or it runs placed
        (keys per micro-batch and replica, folded per stage)."""
        return self.parts.keyed

    @property
    def keyless(self) -> bool:
        """The compiled step takes no key (``packing.GlobalArrays.compiled_step``)."""
        return not self.parts.keyed

    def plan(self, traced: Optional[tuple] = None,
             place: Optional[Callable[[StepParts], Any]] = None,
             like: Optional["StepProgram"] = None) -> None:
        """Plan the step, once (``pipeline.plan_program`` plans a session's program), from
        the step's one abstract trace: ``traced``, what :func:`trace_step` returned for this
        program's graph and settings (a session traces at construction), or traced here.
        ``place(parts)`` gives the placed plan (``pipeline.PlacedPlan``) or None; ``like``, a
        planned program whose weights this one runs on, places it on their slots (the
        forward-only program of a placed training program, or IrError)."""
        if self.facts is not None:
            return
        cfg = self.cfg
        if cfg.als is not None:   # PopART's checks before it looks at gradients
            _als.check_settings(cfg.als, cfg.training, cfg.optimizer, cfg.config, self.graph)
        if traced is None:
            traced = trace_step(self.graph, self.input_infos, list(cfg.anchors), cfg.training,
                                cfg.loss, cfg.replication_factor, cfg.config,
                                self.placement.platform)
        facts = make_plan(self.graph, cfg, self.placement, traced, self.stash_anchors)
        parts = StepParts(facts, cfg, self.graph_consts, self.variables, self.input_infos,
                          self.placement.platform, keyed=facts.uses_rng)
        if like is not None and like.placed is not None:
            place = functools.partial(like.placed.place_forward, device=self.device_info)
        placed = place(parts) if place is not None else None
        if placed is not None:   # keys per micro-batch and replica, folded per stage
            parts = dataclasses.replace(parts, keyed=True)
        self.facts, self.parts, self.placed = facts, parts, placed
        self.packing = placed if placed is not None else GlobalArrays(self.placement, facts.rts)

    def scalar_values(self, optimizer: Any = None) -> dict[str, float]:
        """The optimizer's scalar tensors and their values (``optimizer_scalars``) for
        ``optimizer`` (default: the one the program was planned with)."""
        cfg = self.cfg
        return optimizer_scalars(optimizer or cfg.optimizer, self.variables, self.trainable,
                                 cfg.config, cfg.accumulation_factor, cfg.replication_factor)

    def updated_var_anchors(self) -> dict[str, str]:
        """Anchor -> weight: ``UpdatedVar___<w>`` (``step_plan.updated_var_anchors``)."""
        return dict(self.facts.updated_var)

    def accum_anchors(self) -> dict[str, str]:
        """Anchor -> weight: ``Accum___<w>`` (``step_plan.accum_anchors``)."""
        return dict(self.facts.accum)

    def init_opt_state(self) -> dict:
        """The initial optimizer state, keyed by PopART's reserved names (the plan's; the
        caller copies it before changing it)."""
        return self.facts.opt_state

    def opt_state_ids(self) -> list[str]:
        return list(self.init_opt_state())

    def raise_failed_checks(self, anchors: dict) -> None:
        """Remove the checks' record from a run's outputs; raise popart_runtime_error if a
        check failed."""
        flags = anchors.pop(CHECKS, None)
        if flags is not None:
            raise_failed_checks(self.to_host(flags), self.run_checks)


    # ------------------------------------------------------------------ state, compile, run
    def put(self, tree: Any) -> Any:
        """Place the RNG key or hyper-parameters on the replicas' device(s)."""
        return self.packing.put(tree)

    def put_state(self, named: Mapping[str, np.ndarray]) -> Any:
        """Weights or optimizer state (host arrays by tensor id) in the step's device layout
        (:attr:`packing`)."""
        return self.packing.put_state(named)

    def state_to_host(self, state: Any) -> dict[str, np.ndarray]:
        """The inverse of :meth:`put_state`: whole host arrays by tensor id."""
        return self.packing.state_to_host(state)

    def write_state(self, state: tuple, written: Mapping[str, np.ndarray]) -> tuple:
        """The device (weights, optimizer state) with the ``written`` host arrays (by tensor
        id) put in place of theirs: only those cross to the device, the rest stays there. A
        packing that is not by tensor id (placed slots pack several tensors each): a part
        with a written tensor goes through the host."""
        out, packing = [], self.packing
        for part, ids in zip(state, (self.variables, self.init_opt_state())):
            mine = {k: v for k, v in written.items() if k in ids}
            if mine and not packing.by_id:
                part = packing.put_state({**packing.state_to_host(part), **mine})
            elif mine:
                part = {**part, **packing.put_state(mine)}
            out.append(part)
        return tuple(out)

    def holds(self, state: Optional[tuple]) -> bool:
        """True when another program's device ``state`` (weights, optimizer state) is in this
        program's layout as it is (the same tensors, shapes, dtypes and shardings), so that a
        recompile keeps it on the device. Placed programs: never."""
        return state is not None and all(
            self.packing.holds(part, like)
            for part, like in zip(state, (self.variables, self.init_opt_state())))

    def state_specs(self, named: Mapping[str, Any]) -> Any:
        """The ShapeDtypeStruct tree of :meth:`put_state` for these host arrays."""
        return self.packing.state_specs(named)

    def put_feeds(self, feeds: Mapping[str, np.ndarray]) -> dict:
        """Move a step's inputs to the device(s): one transfer per input. In a distributed
        job each process gives its local replicas' data ([B, A, R_local, ...])."""
        return self.packing.put_feeds(feeds)

    to_host = staticmethod(Placement.to_host)

    @property
    def compiled(self) -> Any:
        """The compiled executable (None before :meth:`compile`)."""
        return None if self.step is None else self.step.compiled

    @property
    def compile_seconds(self) -> float:
        return 0.0 if self.step is None else self.step.compile_seconds

    def _arg_specs(self, weights, opt_state, key, hyper) -> tuple:
        cfg = self.cfg
        feed_specs = {k: jax.ShapeDtypeStruct((cfg.batches_per_step, cfg.accumulation_factor,
                                               cfg.replication_factor, *i.shape()), i.np_dtype())
                      for k, i in self.input_infos.items()}
        key_spec = () if self.keyless else (arg_specs(key),)
        return (self.state_specs(weights), self.state_specs(opt_state), *key_spec, feed_specs,
                arg_specs(self._step_hyper(hyper)))

    def _step_hyper(self, hyper: Mapping[str, Any]) -> dict:
        """The step's hyper-parameter argument: the optimizer's values, and recomputation's
        run-time true."""
        return {**hyper, RECOMPUTE_ONE: np.float32(1)} if self.segments else dict(hyper)

    def compile(self, weights: Mapping[str, Any], opt_state: Mapping[str, Any], key: Any,
                hyper: Mapping[str, Any], exported: Optional[bytes] = None,
                cache: Optional[EngineCache] = None) -> str:
        """Ahead-of-time compile the step for these argument shapes, from a serialized
        executable (``exported``, see :meth:`export`), through the engine ``cache``, or from
        the IR; returns where the program came from (``executable.compile_step``)."""
        step = self.packing.compiled_step(self.parts, arg_specs(key))
        source = compile_step(step, self._arg_specs(weights, opt_state, key, hyper), cache, exported)
        self.step = step
        return source

    def export(self) -> bytes:
        """The compiled step as a serialized StableHLO module (``jax.export``)."""
        return self.step.export()

    def put_hyper(self, hyper: Mapping[str, Any]) -> Any:
        """The step's hyper-parameter argument on the device(s), for :meth:`run` (placed
        once, until the optimizer changes)."""
        return self.put(self._step_hyper(hyper))

    def run(self, weights, opt_state, key, feeds, hyper, placed_hyper: bool = False):
        """One call of the step: ``feeds`` host arrays [B, A, R, ...] (moved by the call
        itself, to the step's input shardings; in a distributed job each process puts its
        own replicas' part first), ``hyper`` host values or, with ``placed_hyper``, what
        :meth:`put_hyper` returned."""
        if self.placement.across_processes:
            feeds = self.put_feeds(feeds)
        hyper = hyper if placed_hyper else self.put_hyper(hyper)
        if self.keyless:
            weights, opt_state, anchors = self.step(weights, opt_state, feeds, hyper)
            return weights, opt_state, key, anchors
        return self.step(weights, opt_state, key, feeds, hyper)
