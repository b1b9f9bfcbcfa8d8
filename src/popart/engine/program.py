"""The step program: one compiled XLA program per session.

A ``run()`` is one call into it. Inside: a ``lax.scan`` over batchesPerStep, within each batch a
``lax.scan`` over the accumulationFactor micro-batches, replicas side by side (``vmap`` with a
named axis, so collectives work), the forward pass, and for training the backward pass
(``jax.value_and_grad``), gradient accumulation, the replica reduction and the optimizer update.
Weights, optimizer state and the RNG key live on the device between runs (donated buffers);
the host moves only the step's inputs and anchors.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import IrError, ModelError, noted, popart_exception
from ..logging import getLogger
from .._ir import recompute
from .._ir.graph import Graph, reads
from .._ir.transforms import gradient_flow
from ..ops import registry
from ..tensorinfo import TensorInfo
from ..tensornames import PREFIXES
from . import als as _als
from . import rts as _rts
from .backends import backend
from .config import AlsSettings, AnchorReturn, EngineConfig
from .compiled import REPLICA_AXIS, CompiledStep, Facts, Placement, arg_specs, plan_trace
from .executable import EngineCache, compile_step
from .hoist import HoistedStep, wanted as hoist_wanted
from .lower import CHECKS, Remat, Trace, first_failure, raise_failed_checks, trace

GRAD_PREFIX = "Gradient___"
_logger = getLogger("session")
# Automatic loss scaling (engine/als.py): the state and the anchorable tensors, PopART's names.
ALS_FACTOR = _als.FACTOR                 # lossScaleUpdateFactor (optimizer state, anchorable)
ALS_COUNTER = _als.COUNTER               # the updatePeriod counter (state, updatePeriod > 1)
ALS_FINAL = _als.FINAL                   # finalLossScale: the loss scale each batch runs with
# Recomputation's run-time true (engine/lower.py: run_segment), a step argument among the
# optimizer's values so that the compiler cannot fold it.
RECOMPUTE_ONE = "__recompute_one"
FEED_REPLICA_DIM = 2   # a step's inputs are [batches_per_step, accumulation, replicas, ...]


@dataclass
class StepConfig:
    """Everything that shapes the compiled step."""
    batches_per_step: int
    accumulation_factor: int = 1
    replication_factor: int = 1
    anchors: dict[str, AnchorReturn] = field(default_factory=dict)
    training: bool = False
    loss: Optional[str] = None
    optimizer: Any = None
    als: Optional[AlsSettings] = None               # automatic loss scaling when enabled
                                                    # (also in inference, which PopART rejects)
    config: EngineConfig = EngineConfig()           # the options' facts

    @property
    def mean_reduction(self) -> bool:
        """Accumulation / replication reduction is Mean."""
        return self.config.mean_reduction

    @property
    def running_mean(self) -> bool:
        """... with MeanReductionStrategy.Running."""
        return self.config.running_mean


def split_variables(graph: Graph) -> tuple[dict, dict]:
    """(variables, constants): float initializers are device-resident variables; the rest
    (integer shape tensors and declared constants) are compile-time constants."""
    variables, constants = {}, {}
    for tid, v in graph.initializers.items():
        if np.issubdtype(v.dtype, np.floating) and tid not in graph.constants or \
                v.dtype.name in ("bfloat16", "float8_e4m3fnuz", "float8_e5m2fnuz"):
            variables[tid] = v
        else:
            constants[tid] = v
    return variables, constants


def _scan(f, init, xs):
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


UPDATED_VAR_PREFIX = PREFIXES["UpdatedVar"]   # PopART's reservedUpdatedVarPrefix()
ACCUM_PREFIX = PREFIXES["Accum"]              # PopART's reservedAccumPrefix()
# Anchors of a pipeline's stashed / restored activations: the activation, per micro-batch.
STASH_PREFIXES = (PREFIXES["Stashed"], PREFIXES["Restored"])


def unstash(tid: str) -> str:
    """The activation a stash / restore anchor names (other ids unchanged)."""
    return tid.split("___", 1)[1] if tid.startswith(STASH_PREFIXES) else tid


def optimizer_scalars(optimizer: Any, variables: Mapping[str, Any], trainable: list,
                      config: EngineConfig, accumulation: int, replication: int) -> dict[str, float]:
    """PopART's optimizer scalar tensors, by their tensor ids (the optimizer's
    ``scalar_rows``):
    ``<prefix>___default___<FLOAT|FLOAT16>``, or ``<prefix>___specific___<w>`` for a weight
    with its own values, and the loss's ``lossScaling_<dtype>``; each exists, as in PopART,
    only when one of its terms is non-const. Sessions with automatic loss scaling: none here
    (it owns the loss scale tensors)."""
    if optimizer is None or config.als.enabled:
        return {}
    ga = config.gradient_accumulation and accumulation > 1
    mean = config.mean_reduction
    post = mean and not config.running_mean
    f = {"ga": ga, "mean": mean, "A": float(accumulation), "R": float(replication),
         "paf": float(accumulation) if post and ga else 1.0,
         "prf": float(replication) if post else 1.0}
    ls = optimizer.loss_scaling()
    out: dict[str, float] = {}
    for w in trainable:
        dtype = {np.dtype(np.float16): "FLOAT16"}.get(np.dtype(variables[w].dtype), "FLOAT")
        specific = optimizer.has_specific(w)
        suffix = f"___specific___{w}" if specific else f"___default___{dtype}"
        for prefix, value, terms in optimizer.scalar_rows(
                lambda n: optimizer.hyper_value(w, n), ls, f):
            if not all(t.isConst() for t in terms):
                out[prefix + suffix] = value
        if not ls.isConst():
            out[f"lossScaling_{dtype}"] = ls.val()
    return out


def check_recompute_mixture(graph: Graph, config: EngineConfig) -> None:
    """Ir::prepare's check: automatic recomputation (autoRecomputation other than
    NoRecompute) with ops the user marked Recompute, unless there are execution phases."""
    if config.recompute != "NoRecompute" and config.execution_phases < 2 and any(
            int(n.annotations.get(recompute.RECOMPUTE_OUTPUT, 0) or 0) == recompute.RECOMPUTE
            for n in graph.nodes):
        raise popart_exception("A mixture of auto and manual recomputation is not supported")


def missing_anchor(anchor: str, tensor_ids: set) -> popart_exception:
    """PopART's error for an anchor that names no tensor of the IR (Ir::validateAnchors): a
    gradient that is never computed (its tensor does not lead to the loss, is not floating
    point, or the session does not train) among them."""
    msg = f"Anchor tensor `{anchor}' not in Ir Tensors. "
    base = anchor[len(GRAD_PREFIX):] if anchor.startswith(GRAD_PREFIX) else None
    if base is not None:
        if base in tensor_ids:
            msg += (f"\nInterestingly, `{base}' IS in tensors.\nNote that not all tensors can "
                    f"have their gradients anchored:\nif an activation tensor does not lead to "
                    f"the loss,\nits gradient is zero and never computed.")
    else:
        msg += "The tensors are:\n[" + " ".join(sorted(tensor_ids)) + "]"
    return popart_exception(msg)


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


class StepProgram:
    """Builds, compiles and runs the step of one session."""

    def __init__(self, graph: Graph, cfg: StepConfig, input_infos: Mapping[str, TensorInfo],
                 device: Any = None, stash_anchors: bool = False):
        """``stash_anchors``: a virtual-graph session's, whose anchors may name stashed and
        restored activations (``Stashed___X``, ``Restored___X``)."""
        self.graph, self.cfg, self.input_infos = graph, cfg, dict(input_infos)
        self.device_info = device
        self.stash_anchors = stash_anchors
        self.planned = False
        self.placement = Placement(cfg.replication_factor, device, processes=cfg.config.processes)
        self.variables, self.constants = split_variables(graph)
        self.graph_consts = Graph(**{**graph.__dict__, "initializers": self.constants})
        self.trainable: list[str] = []
        self.assigned: list[str] = []
        self.anchor_ids = list(cfg.anchors)
        self.step: Optional[CompiledStep] = None
        self._opt_state: Optional[dict] = None
        self.uses_rng = True
        self.keyless = False   # the compiled step takes no key (see _compiled_step)
        self._key_spec: Any = None   # the RNG key's ShapeDtypeStruct (compile sets it)
        self.als: Optional[_als.AlsPlan] = None   # automatic loss scaling (plan() makes it)
        self.als_anchors: set = set()             # anchors the ALS step computes
        self.host_anchors: set = set()            # anchors the session writes (optimizer scalars)
        self.segments: list = []                  # recomputation (ir.recompute.segments)
        self.float32_loss: Optional[str] = None   # ALS: a float16 loss differentiated in float32
        self.float32_region: frozenset = frozenset()   # ... with these tensors' nodes (als.py)
        self.run_checks: list = []   # RunCheck of every ctx.check by id (the trace's registry)
        self.rts = _rts.StateSharding(self.placement)    # replicated tensor sharding (plan() chooses)
        # its IPUs on devices of their own: a pipeline.PlacedPlan (pipeline.plan_program makes
        # it), which then holds the state's layout and builds the step
        self.placed: Any = None

    # ------------------------------------------------------------------ tracing helpers
    def trace_graph(self, weights, feeds, key, probes=None, training=False, remat=None,
               graph: Optional[Graph] = None, effects: Optional[set] = None,
               taps: Optional[Mapping[str, Any]] = None) -> Trace:
        """One trace of the session's graph (or of ``graph``, a part of it) as the step runs it."""
        axis = REPLICA_AXIS if self.cfg.replication_factor > 1 else None
        return trace(self.graph_consts if graph is None else graph, feeds, key=key, training=training, weights=weights,
                     replica_axis=axis, replication_factor=self.cfg.replication_factor,
                     config=self.cfg.config, probes=probes, platform=self.placement.platform,
                     remat=remat, effects=effects, taps=taps,
                     float32_loss=self.float32_loss if training else None,
                     float32_region=self.float32_region if training else frozenset(),
                     checks=self.run_checks)   # plan()'s: the step's checks keep their ids

    @staticmethod
    def anchor_value(env, tid):
        return jnp.asarray(env[unstash(tid)])   # plan() has checked every anchor names a tensor

    def plan(self, traced: Optional[tuple] = None) -> None:
        """Decide trainable variables and gradient anchors, once (``pipeline.plan_program``
        plans a session's program), from the step's one abstract trace: ``traced``, what
        :func:`trace_step` returned for this program's graph and settings (a session traces
        at construction), or traced here."""
        if self.planned:
            return
        stash = [a for a in self.anchor_ids if a.startswith(STASH_PREFIXES)] if self.stash_anchors else []
        self.anchor_ids = [a for a in self.anchor_ids if a not in stash]
        self._plan(traced)
        self._plan_stash_anchors(stash)
        self.planned = True

    def _plan_stash_anchors(self, stash: list) -> None:
        """``Stashed___X`` / ``Restored___X`` anchors: activation X of a pipelined training
        step, which PopART stashes from its forward stage until its backward stage."""
        if not stash:
            return
        if not (self.cfg.training and self.cfg.config.pipelining):
            raise IrError(f"Anchor '{stash[0]}': stashed and restored tensors exist only in a "
                          f"pipelined TrainingSession")
        specs = self.tensor_specs
        for a in stash:
            if unstash(a) not in specs:
                raise IrError(f"Anchor '{a}' names the stash of '{unstash(a)}', which is not "
                              f"a tensor of the model")
            self.anchor_specs[a] = specs[unstash(a)]
        self.anchor_ids += stash

    def _plan(self, traced: Optional[tuple] = None) -> None:
        cfg = self.cfg
        if cfg.als is not None:   # PopART's checks before it looks at gradients
            _als.check_settings(cfg.als, cfg.training, cfg.optimizer, cfg.config, self.graph)
        if traced is None:
            traced = trace_step(self.graph, self.input_infos, self.anchor_ids, cfg.training, cfg.loss,
                                cfg.replication_factor, cfg.config, self.placement.platform)
        shapes, out = traced
        self.anchor_specs = {a: s for a, s in shapes.items() if a in self.anchor_ids}
        effects = out["effects"]
        self.assigned = out["assigned"]
        self.tensor_specs: dict = out["specs"]
        self.run_checks = out["checks"]
        for o, dtype in out["dtypes"].items():   # ONNX Runtime rejects these models too
            info = self.graph.tensor_info.get(o)
            if info is not None and dtype is not None and np.dtype(dtype) != info.np_dtype() \
                    and not any(o in n.outputs and n.op_type in registry.POPART_OUTPUT_TYPES
                                for n in self.graph.nodes):   # PopART's own output types
                raise ModelError(f"Graph output '{o}' is declared as {info.data_type()}, but the "
                                 f"model computes {np.dtype(dtype)} for it")
        self.uses_rng = out["rng"]
        self.activation_bytes = out["act"]   # every traced tensor of one micro-batch
        if cfg.training:
            self.trainable = [k for k in self.variables if k not in self.assigned]
            if cfg.als is not None:
                self._plan_als(out["specs"])
                if np.dtype(out["specs"][cfg.loss].dtype) == np.float16:
                    self.float32_loss = cfg.loss   # EnsureFp32LossScale: a float32 loss scale
                    keep = set(self.als.tracked) | {a[len(GRAD_PREFIX):] for a in self.anchor_ids
                                                    if a.startswith(GRAD_PREFIX)}
                    self.float32_region = _als.float32_loss_region(self.graph_consts, cfg.loss,
                                                                   keep, effects)
            self._plan_recompute(out["specs"], out["traced"], out["known"], effects)
        opt_ids = set(self.opt_state_ids())
        self.rts = _rts.choose(cfg.config.locations, self.placement, self.variables, self.init_opt_state(),
                               self.trainable, cfg.accumulation_factor)
        if cfg.training:   # the optimizer's scalars: the session writes them from the host
            self.host_anchors = {a for a in self.scalar_values() if a in self.anchor_ids}
            self.anchor_specs = {**self.anchor_specs, **{
                a: jax.ShapeDtypeStruct((), np.float16 if a.endswith("FLOAT16") else np.float32)
                for a in self.host_anchors}}
        if cfg.training:   # UpdatedVar___<w>: a trainable weight after the batch's update
            self.anchor_specs = {**self.anchor_specs, **{
                a: jax.ShapeDtypeStruct(self.variables[w].shape, self.variables[w].dtype)
                for a, w in self.updated_var_anchors().items()}}
            self.anchor_specs = {**self.anchor_specs, **{   # Accum___<w>: accumulated gradient
                a: jax.ShapeDtypeStruct(self.variables[w].shape,
                                        cfg.optimizer.accum_dtype(self.variables[w].dtype))
                for a, w in self.accum_anchors().items()}}
        flows = gradient_flow(self.graph, cfg.loss, list(out["specs"]), lambda t: jnp.issubdtype(
            out["specs"][t].dtype, jnp.floating) if t in out["specs"] else False)[0] \
            if cfg.training else set()
        for a in self.anchor_ids:
            grad = a.startswith(GRAD_PREFIX) and a[len(GRAD_PREFIX):] in flows
            if (a in self.anchor_specs and (grad or not a.startswith(GRAD_PREFIX))) \
                    or a in opt_ids or a in self.als_anchors or a in self.host_anchors:
                continue
            raise missing_anchor(a, set(out["ids"]) | opt_ids | (
                {GRAD_PREFIX + t for t in flows}))

    def scalar_values(self, optimizer: Any = None) -> dict[str, float]:
        """The optimizer's scalar tensors and their values (``optimizer_scalars``) for
        ``optimizer`` (default: the one the program was planned with)."""
        cfg = self.cfg
        return optimizer_scalars(optimizer or cfg.optimizer, self.variables, self.trainable,
                                 cfg.config, cfg.accumulation_factor, cfg.replication_factor)

    def updated_var_anchors(self) -> dict[str, str]:
        """Anchor -> weight, for the anchors naming a trainable weight's VarUpdate output
        (PopART's ``UpdatedVar___<w>``) or, without gradient accumulation, a Variable itself:
        PopART copies a Variable's anchor in the backward fragment, after the update
        (IrLowering::getAnchorReturnFragment; accumulated updates run after it, in the
        accumulate outer fragment)."""
        variables = self.variables if self.cfg.accumulation_factor == 1 else {}
        return {**{a: a for a in self.anchor_ids if a in variables}, **{
            a: a[len(UPDATED_VAR_PREFIX):] for a in self.anchor_ids
            if a.startswith(UPDATED_VAR_PREFIX) and a[len(UPDATED_VAR_PREFIX):] in self.trainable}}

    def accum_anchors(self) -> dict[str, str]:
        """Anchor -> weight, for the anchors naming a gradient accumulator
        (``Accum___<w>``): PopART has one per trainable weight when gradients accumulate
        (accumulationFactor > 1), except for SGD with momentum combined with its accumulator
        (SGD1, whose ``Accl___<w>`` holds both)."""
        cfg, opt = self.cfg, self.cfg.optimizer
        if cfg.accumulation_factor < 2 or opt is None:
            return {}
        return {a: a[len(ACCUM_PREFIX):] for a in self.anchor_ids
                if a.startswith(ACCUM_PREFIX) and a[len(ACCUM_PREFIX):] in self.trainable
                and opt.has_accumulator(a[len(ACCUM_PREFIX):])}

    def _plan_recompute(self, specs: dict, traced: set, known: set, effects: set) -> None:
        """The recompute segments PopART's annotations ask for (``ir.recompute``): segments
        hold no node with side effects, none whose output is probed (anchored or ALS-tracked
        gradients) or is a float16 loss differentiated in float32, and none with outputs other
        than arrays (``traced``, or ``known`` at compile
        time); nodes that read and make only known values run in place."""
        cfg = self.cfg
        nbytes = {k: int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for k, v in specs.items()}
        method = cfg.config.recompute
        marks = recompute.annotate(self.graph, cfg.loss, method, nbytes)
        if recompute.RECOMPUTE not in marks.values():
            return
        probed = {a[len(GRAD_PREFIX):] for a in self.anchor_ids if a.startswith(GRAD_PREFIX)}
        probed |= set(self.als.tracked) if self.als is not None else set()
        probed |= {self.float32_loss} | self.float32_region if self.float32_loss else set()
        nodes = self.graph_consts.nodes
        outs = [[o for o in n.outputs if o] for n in nodes]
        static = {i for i, n in enumerate(nodes) if id(n) not in effects
                  and not any(t in traced for t in outs[i] + reads(n))}
        movable = {i for i, n in enumerate(nodes) if id(n) not in effects and i not in static
                   and all((t in traced or t in known) and t not in probed for t in outs[i])}
        keep = {cfg.loss, *self.anchor_ids}
        self.segments = recompute.segments(self.graph_consts, marks, movable, static, keep)
        _logger.info(f"Recomputation ({method} and recomputeOutput annotations): "
                     f"{len(self.segments)} segment(s) of "
                     f"{sum(len(g.nodes) for g in self.segments)} op(s) run again in the "
                     f"backward pass")

    def _plan_als(self, specs: dict) -> None:
        """Automatic loss scaling: the tracked gradients (``als.tracked_tensors``), PopART's
        errors once they are known, and the ALS tensors the anchors name."""
        cfg = self.cfg
        self.als = _als.plan(cfg.als, self.graph, cfg.loss, list(self.variables), self.trainable,
                             specs, cfg.accumulation_factor, cfg.replication_factor)
        self.als_anchors = {a for a in self.anchor_ids if a in self.als.anchors}
        self.anchor_specs = {**self.anchor_specs,
                             **{a: self.als.anchors[a] for a in self.als_anchors}}

    # ------------------------------------------------------------------ optimizer state
    def init_opt_state(self) -> dict:
        """The initial optimizer state, keyed by PopART's reserved names (computed once; the
        caller copies it before changing it)."""
        if self._opt_state is None:
            state = {}
            if self.cfg.training:
                for w in self.trainable:
                    state.update(self.cfg.optimizer.init_state(w, self.variables[w]))
                if self.als is not None:
                    state.update(self.als.init_state())
                # State saved in the model (modelToHost writes it as initializers of the same
                # names) is where training resumes, as PopART's optimizer patterns read it.
                state.update({k: np.asarray(v, np.asarray(state[k]).dtype)
                              for k, v in self.constants.items() if k in state})
            self._opt_state = {k: np.asarray(v) for k, v in state.items()}
        return self._opt_state

    def opt_state_ids(self) -> list[str]:
        return list(self.init_opt_state())

    # ------------------------------------------------------------------ the step
    def _micro_fn(self):
        """(weights, feeds_per_replica, key) -> (anchor values, grads, assignments)."""
        cfg = self.cfg
        grad_ids = [a[len(GRAD_PREFIX):] for a in self.anchor_ids
                    if a.startswith(GRAD_PREFIX) and a not in self.als_anchors]
        after_update = {**self.updated_var_anchors(), **self.accum_anchors()} \
            if cfg.training else {}
        fwd_ids = [a for a in self.anchor_ids if a in self.anchor_specs
                   and not a.startswith(GRAD_PREFIX) and a not in self.als_anchors
                   and a not in after_update and a not in self.host_anchors]

        if not cfg.training:
            def micro(weights, feeds, key, hyper):
                t = self.trace_graph(weights, feeds, key)
                return self._with_checks({a: self.anchor_value(t.env, a) for a in fwd_ids}, t), {}, {}
            return micro

        trainable = self.trainable
        probe_ids = [g for g in grad_ids if g not in trainable]
        tracked = self.als.tracked if self.als is not None else []   # ALS: gradients of these
        probe_specs = {p: self.anchor_specs[GRAD_PREFIX + p] for p in probe_ids}

        def micro(weights, feeds, key, hyper):
            remat = Remat(self.graph_consts.nodes, self.segments, hyper[RECOMPUTE_ONE]) \
                if self.segments else None
            train_w = {k: weights[k] for k in trainable}
            other_w = {k: v for k, v in weights.items() if k not in train_w}
            probes0 = {p: jnp.zeros(s.shape, s.dtype) for p, s in probe_specs.items()}
            stats0 = {t: jnp.zeros(_als.STAT_SHAPE, jnp.float32) for t in tracked}

            def loss_fn(tw, probes, stats):
                taps = {t: functools.partial(self.als.tap, stat=stats[t]) for t in tracked}
                t = self.trace_graph({**other_w, **tw}, feeds, key, probes, training=True, remat=remat,
                                taps=taps)
                loss = t.scalable_loss(cfg.loss).reshape(())   # one element: [1] too
                ls = self.hyper_value(hyper, "lossScaling")   # with ALS: finalLossScale
                scaled = loss * jnp.asarray(ls, loss.dtype)
                vals = self._with_checks({a: self.anchor_value(t.env, a) for a in fwd_ids}, t)
                return scaled, (vals, dict(t.assignments))

            (_, (vals, assigns)), (gw, gp, gs) = jax.value_and_grad(
                loss_fn, argnums=(0, 1, 2), has_aux=True)(train_w, probes0, stats0)
            for g in grad_ids:
                vals[GRAD_PREFIX + g] = gw[g] if g in gw else gp[g]
            if tracked:   # ALS: the Histogram of every tracked gradient of this micro-batch
                vals[_als.STATS] = self.als.gate(self.als.counts(
                    jnp.stack([gs[t] for t in tracked])), hyper[_als.UPDATE])
            return vals, gw, assigns
        return micro

    def _with_checks(self, vals: dict, t: Trace) -> dict:
        """The anchor values of a micro-batch and, under ``CHECKS``, the record of its
        first failed run-time check (of the checks plan() found)."""
        flags = t.check_flags()
        return vals if flags is None else {**vals, CHECKS: flags}

    def raise_failed_checks(self, anchors: dict) -> None:
        """Remove the checks' record from a run's outputs; raise popart_runtime_error if a
        check failed."""
        flags = anchors.pop(CHECKS, None)
        if flags is not None:
            raise_failed_checks(self.to_host(flags), self.run_checks)

    def als_micro(self, stats: Any, stats_acc: Any) -> tuple[Any, dict]:
        """Automatic loss scaling in a micro-batch (all replicas): add the sum of the tracked
        gradients' histograms ``stats`` [R, tracked, 2] (cast to float32) to the batch's
        statistics accumulator [R, 2]; (the accumulator, the statistics anchors of this
        micro-batch, each [R, ...])."""
        summed = jnp.sum(stats, axis=1, dtype=jnp.uint32)               # summedHistograms
        casted = summed.astype(jnp.float32)                             # summedCastedHistograms
        stats_acc = stats_acc + casted                                  # Accum___autoLossScaleStats
        R = self.cfg.replication_factor
        per_micro = {_als.SUMMED: summed, _als.CASTED: casted, _als.ACCUM: stats_acc}
        if self.cfg.accumulation_factor == 1:   # the all-reduce runs every micro-batch
            per_micro[_als.REDUCED] = jnp.broadcast_to(jnp.sum(casted, axis=0), (R, 2))
        for k, t in enumerate(self.als.tracked):
            per_micro[self.als.stats_anchor(t)] = stats[:, k]
        return stats_acc, {a: v for a, v in per_micro.items() if a in self.als_anchors}

    def auto_loss_scale(self, stats_acc: Any, opt_state: dict, on: Any) -> dict:
        """Automatic loss scaling after a batch's micro-batches: the statistics summed over
        the replicas (the ReplicatedAllReduce) drive ``LossScaleUpdateOpx`` on the factor
        (``als.AlsPlan.update``); returns the optimizer state with the new factor."""
        total = jnp.sum(stats_acc, axis=0)
        new = self.als.update(opt_state[ALS_FACTOR], total, on)
        return {**opt_state, ALS_FACTOR: new}

    def als_batch_anchors(self, vals: dict, stats_acc: Any, final: Any, static: Any) -> None:
        """The per-batch ALS anchors, broadcast over the batch's [A, R]: ``finalLossScale``,
        the optimizer's loss scaling (``lossScaling_FLOAT16`` / ``_FLOAT``) and, with
        accumulation and replication, the all-reduced accumulated statistics."""
        A, R = self.cfg.accumulation_factor, self.cfg.replication_factor
        per_batch = {ALS_FINAL: final, self.als.loss_scaling_id: static}
        if A > 1:
            per_batch[_als.REDUCED] = jnp.sum(stats_acc, axis=0)
        for a, v in per_batch.items():
            if a in self.als_anchors and a not in vals:
                vals[a] = jnp.broadcast_to(v, (A, R) + jnp.shape(v))

    def hyper_value(self, hyper, name):
        if name in hyper:
            return hyper[name]
        return self.cfg.optimizer.loss_scaling().val() if self.cfg.optimizer is not None else 1.0

    def split_key(self, key, n: int):
        """``n`` keys from ``key``; when the graph draws no random numbers, ``n`` copies
        (no threefry work in the compiled program)."""
        if self.uses_rng:
            return jax.random.split(key, n)
        return jax.random.wrap_key_data(jnp.broadcast_to(jax.random.key_data(key),
                                                         (n,) + jax.random.key_data(key).shape))

    def _replicated(self, micro):
        """``micro`` for every replica (weights and hyper-parameters shared, feeds and keys
        per replica): see :meth:`Placement.replicate`."""
        return self.placement.replicate(micro, in_axes=(None, 0, 0, None))

    def _inference_step_fn(self):
        """Inference has no state between micro-batches, so they are vectorised: chunks of
        micro-batches run as one wider batch (vmap), the chunks in a scan. Bigger matmuls and
        convolutions are what XLA's CPU and GPU backends run fastest."""
        cfg = self.cfg
        R, A, B = cfg.replication_factor, cfg.accumulation_factor, cfg.batches_per_step
        n = B * A
        chunk = vector_chunk(n, self.activation_bytes * R, self._vector_budget())
        replicas = self._replicated(self._micro_fn())

        def step(weights, opt_state, key_data, feeds, hyper):
            key = jax.random.wrap_key_data(key_data)
            whole = self.rts.gather(weights)

            def one(f, k):
                return replicas(whole, f, self.split_key(k, R), hyper)[0]

            key, sub = self.split_key(key, 2)
            flat = jax.tree_util.tree_map(lambda a: a.reshape((n // chunk, chunk) + a.shape[2:]), feeds)
            keys = self.split_key(sub, n).reshape((n // chunk, chunk))
            _, vals = _scan(lambda c, xs: (c, jax.vmap(one)(*xs)), None, (flat, keys))
            vals = jax.tree_util.tree_map(lambda v: v.reshape((B, A) + v.shape[2:]), vals)
            return weights, opt_state, jax.random.key_data(key), self.reduce_anchors(vals)

        return step

    def _vector_budget(self) -> int:
        """Activation bytes a vectorised chunk may hold: the platform backend's rule (conv
        nets on the CPU run micro-batch by micro-batch). POPART_VECTOR_BYTES overrides."""
        if "POPART_VECTOR_BYTES" in os.environ:
            return int(os.environ["POPART_VECTOR_BYTES"])
        return backend(self.placement.platform).vector_budget({n.op_type for n in self.graph.nodes})

    def _step_fn(self):
        cfg = self.cfg
        if not cfg.training:
            return self._inference_step_fn()
        R, A, B = cfg.replication_factor, cfg.accumulation_factor, cfg.batches_per_step
        replicas = self._replicated(self._micro_fn())
        anchor_opt = [a for a in self.anchor_ids if a in self.opt_state_ids()]
        updated_var = self.updated_var_anchors()
        accum = self.accum_anchors()

        def accumulate(grads_acc, count, grads):
            g = self.rts.reduce_replicas(grads)                            # replica reduction
            if cfg.mean_reduction and cfg.running_mean:
                n = count + 1.0
                return {k: grads_acc[k] * (count / n) + g[k] / (R * n) for k in g}
            return {k: grads_acc[k] + g[k] for k in g}

        def step(weights, opt_state, key_data, feeds, hyper):
            key = jax.random.wrap_key_data(key_data)

            def batch(carry, xs):
                weights, opt_state = carry
                feeds, bkey = xs                                          # feeds: [A, R, ...]
                whole = self.rts.gather(weights)                          # RTS: all-gathered

                h = hyper
                if self.als is not None:   # ALS: this batch's counter and finalLossScale
                    opt_state, h, final, static = self.als.begin(opt_state, hyper)

                def micro_batch(acc, xa):
                    grads_acc, count, w_assign, stats_acc = acc
                    f, akey = xa                                          # f: [R, ...]
                    vals, grads, assigns = replicas(whole, f, self.split_key(akey, R), h)
                    if self.als is not None:
                        stats_acc, als_vals = self.als_micro(vals.pop(_als.STATS), stats_acc)
                        vals.update(als_vals)
                    if cfg.training:
                        grads_acc = accumulate(grads_acc, count, grads)
                        for a, w in accum.items():   # the accumulator after this micro-batch
                            v = self.rts.unshard(grads_acc[w], self.rts.shapes[w]) \
                                if w in self.rts.scattered else grads_acc[w]
                            v = jnp.sum(v, axis=0) if w in self.rts.sharded_update else v
                            vals[a] = jnp.broadcast_to(v.astype(self.anchor_specs[a].dtype),
                                                       (R,) + jnp.shape(v))
                        w_assign = {k: jnp.mean(v, axis=0).astype(whole[k].dtype)
                                    for k, v in assigns.items() if k in whole}
                    return (grads_acc, count + 1.0, w_assign, stats_acc), vals

                zeros = self.rts.accumulators({k: whole[k] for k in self.trainable})
                assign0 = {k: whole[k] for k in self.assigned if k in whole and cfg.training}
                stats0 = jnp.zeros((R, 2), jnp.float32) if self.als is not None else None
                (grads, _, w_assign, stats_acc), vals = _scan(
                    micro_batch, (zeros, 0.0, assign0, stats0), (feeds, self.split_key(bkey, A)))
                if cfg.training:
                    if cfg.mean_reduction and not cfg.running_mean:
                        grads = {k: v / (A * R) for k, v in grads.items()}
                    if self.als is not None:   # the update uses the batch's finalLossScale
                        self.als_batch_anchors(vals, stats_acc, final, static)
                        opt_state = self.auto_loss_scale(stats_acc, opt_state, h[_als.UPDATE])
                    new_w, new_state = self.rts.update(
                        cfg.optimizer.apply, {k: weights[k] for k in self.trainable}, grads,
                        opt_state, h)
                    opt_state = {**opt_state, **new_state}
                    weights = {**weights, **self.rts.store(w_assign), **new_w}
                    after = {**{a: opt_state[a] for a in anchor_opt},
                             **{a: weights[w] for a, w in updated_var.items()}}
                    for a, v in self.rts.gather(after).items():
                        vals[a] = jnp.broadcast_to(v, (A, R) + jnp.shape(v))   # after the update
                return (weights, opt_state), vals

            key, sub = self.split_key(key, 2)
            (weights, opt_state), vals = _scan(
                batch, (weights, opt_state), (feeds, self.split_key(sub, B)))
            return weights, opt_state, jax.random.key_data(key), self.reduce_anchors(vals)

        return step

    def reduce_anchors(self, vals: dict) -> dict:
        """Each anchor's values [B, A, R, *shape] as its AnchorReturnType returns them
        (``dataflow.device_lead_dims`` gives the leading dims each kind keeps)."""
        return {a: first_failure(v) if a == CHECKS   # the run-time checks' record
                else reduce_anchor(self.cfg.anchors[a], v) for a, v in vals.items()}

    # ------------------------------------------------------------------ placement, compile, run
    def put(self, tree: Any) -> Any:
        """Place the RNG key or hyper-parameters on the replicas' device(s)."""
        if self.placed is not None:
            return self.placed.put(tree)
        return self.placement.put(tree)

    def put_state(self, named: Mapping[str, np.ndarray]) -> Any:
        """Weights or optimizer state (host arrays by tensor id) in the step's device layout.
        Here: one array per tensor on every replica's device, or its shards with replicated
        tensor sharding (``engine/rts.py``); placed, in the slots of the placed plan (virtual
        graphs: ``pipeline.PlacedPlan``)."""
        if self.placed is not None:
            return self.placed.put_state(named)
        return self.rts.put(named)

    def state_to_host(self, state: Any) -> dict[str, np.ndarray]:
        """The inverse of :meth:`put_state`: whole host arrays by tensor id."""
        if self.placed is not None:
            return self.placed.state_to_host(state)
        return self.rts.to_host(state)

    def write_state(self, state: tuple, written: Mapping[str, np.ndarray]) -> tuple:
        """The device (weights, optimizer state) with the ``written`` host arrays (by tensor
        id) put in place of theirs: only those cross to the device, the rest stays there. A
        placed program's slots pack several tensors each: a part with a written tensor goes
        through the host."""
        out = []
        for part, ids in zip(state, (self.variables, self.init_opt_state())):
            mine = {k: v for k, v in written.items() if k in ids}
            if mine and self.placed is not None:
                part = self.put_state({**self.state_to_host(part), **mine})
            elif mine:
                part = {**part, **self.put_state(mine)}
            out.append(part)
        return tuple(out)

    def holds(self, state: Optional[tuple]) -> bool:
        """True when another program's device ``state`` (weights, optimizer state) is in this
        program's layout as it is (the same tensors, shapes, dtypes and shardings), so that a
        recompile keeps it on the device. Placed programs: never."""
        if state is None or self.placed is not None:
            return False
        for part, like in zip(state, (self.variables, self.init_opt_state())):
            specs, shardings = self.state_specs(like), self.state_shardings(like)
            if set(part) != set(specs):
                return False
            for k, x in part.items():
                where = shardings[k] if isinstance(shardings, dict) else shardings
                if not (isinstance(x, jax.Array) and (x.shape, x.dtype) == (specs[k].shape, specs[k].dtype)
                        and x.sharding.is_equivalent_to(where, x.ndim)):
                    return False
        return True

    def share_state_layout(self, other: "StepProgram") -> None:
        """Take ``other``'s device layout of the weights (a program run on its weights):
        placed on its slots when ``other`` is placed (or IrError)."""
        if other.placed is not None:
            self.placed = other.placed.place_forward(self)

    def state_specs(self, named: Mapping[str, Any]) -> Any:
        """The ShapeDtypeStruct tree of :meth:`put_state` for these host arrays."""
        if self.placed is not None:
            return self.placed.state_specs(named)
        return self.rts.specs(named)

    def state_shardings(self, names: Any) -> Any:
        """The step's sharding of the weights or optimizer state with these ids."""
        return self.rts.shardings(names)

    def put_feeds(self, feeds: Mapping[str, np.ndarray]) -> dict:
        """Move a step's inputs to the device(s): one transfer per input. In a distributed
        job each process gives its local replicas' data ([B, A, R_local, ...])."""
        if self.placed is not None:
            return self.placed.put_feeds(feeds)
        return self.placement.put(dict(feeds), FEED_REPLICA_DIM)

    to_host = staticmethod(Placement.to_host)

    @property
    def compiled(self) -> Any:
        """The compiled executable (None before :meth:`compile`)."""
        return None if self.step is None else self.step.compiled

    @property
    def compile_seconds(self) -> float:
        return 0.0 if self.step is None else self.step.compile_seconds

    def _compiled_step(self) -> CompiledStep:
        """The step, jitted: ``(weights, opt_state, key, feeds, hyper) -> (weights,
        opt_state, key, anchors)``; for a graph that draws no random numbers (``uses_rng``)
        the key stays outside (``keyless``: ``(weights, opt_state, feeds, hyper) ->
        (weights, opt_state, anchors)``), one buffer fewer in and out of every run. Placed:
        the placed plan's step (``pipeline.placed_step``), always with the key."""
        if self.placed is not None:
            return self.placed.compiled_step(self)
        state, feeds = self.placement.sharding(), self.placement.sharding(FEED_REPLICA_DIM)
        w, s = self.state_shardings(self.variables), self.state_shardings(self.init_opt_state())
        step = self._step_fn()
        spec = self._key_spec
        self.keyless = not self.uses_rng and spec is not None
        Step = HoistedStep if hoist_wanted(self.cfg.training, self.cfg.replication_factor) else CompiledStep
        if not self.keyless:
            return Step(step, donate_argnums=(0, 1, 2), in_shardings=(w, s, state, feeds, state),
                        out_shardings=(w, s, state, state))

        def keyless(weights, opt_state, feeds, hyper):   # any key: the graph never reads it
            weights, opt_state, _, anchors = step(weights, opt_state, jnp.zeros(spec.shape, spec.dtype),
                                                  feeds, hyper)
            return weights, opt_state, anchors
        return Step(keyless, donate_argnums=(0, 1), in_shardings=(w, s, feeds, state),
                    out_shardings=(w, s, state))

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
        self._key_spec = arg_specs(key)
        step = self._compiled_step()
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
