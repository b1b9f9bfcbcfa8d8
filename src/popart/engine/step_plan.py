"""The step's plan: every fact the step is built from, made once from the step's one abstract
trace (``program.trace_step``) by :func:`make_plan` and frozen (:class:`StepPlan`). The step
builder (``engine/step.py``) and the placed plan (``engine/pipeline.py``) read it; nothing
changes it."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import IrError, ModelError, popart_exception
from ..logging import getLogger
from .._ir import recompute
from .._ir.graph import Graph, reads
from .._ir.transforms import gradient_flow
from ..ops import registry
from ..tensornames import PREFIXES
from . import als as _als
from . import rts as _rts
from .compiled import Placement
from .config import AlsSettings, AnchorReturn, EngineConfig

GRAD_PREFIX = "Gradient___"
UPDATED_VAR_PREFIX = PREFIXES["UpdatedVar"]   # PopART's reservedUpdatedVarPrefix()
ACCUM_PREFIX = PREFIXES["Accum"]              # PopART's reservedAccumPrefix()
# Anchors of a pipeline's stashed / restored activations: the activation, per micro-batch.
STASH_PREFIXES = (PREFIXES["Stashed"], PREFIXES["Restored"])
_logger = getLogger("session")


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


@dataclass(frozen=True)
class StepPlan:
    """The facts of one session's step, from its one abstract trace (:func:`make_plan`):
    frozen, its sequences tuples and its mappings read-only (the optimizer state aside)."""
    anchor_ids: tuple                # the anchors, stash anchors last
    anchor_specs: Mapping[str, Any]  # anchor -> ShapeDtypeStruct of one micro-batch's value
    tensor_specs: Mapping[str, Any]  # every tensor's type as one replica sees it
    trainable: tuple                 # the weights the optimizer updates
    assigned: tuple                  # the variables ops write
    run_checks: tuple                # the run-time checks (RunCheck), by id
    uses_rng: bool                   # the graph draws random numbers
    activation_bytes: int            # every traced tensor of one micro-batch
    rts: Any                         # rts.StateSharding: replicated tensor sharding
    opt_state: Mapping[str, np.ndarray]   # the initial optimizer state, PopART's names (a
                                          # dict: the state's pytree; callers copy it)
    updated_var: Mapping[str, str] = field(default_factory=dict)   # UpdatedVar anchor -> weight
    accum: Mapping[str, str] = field(default_factory=dict)         # Accum anchor -> weight
    als: Optional[_als.AlsPlan] = None   # automatic loss scaling
    als_anchors: frozenset = frozenset()    # anchors the ALS step computes
    host_anchors: frozenset = frozenset()   # anchors the session writes (optimizer scalars)
    segments: tuple = ()                    # recomputation (ir.recompute.segments)
    float32_loss: Optional[str] = None      # ALS: a float16 loss differentiated in float32
    float32_region: frozenset = frozenset()   # ... with these tensors' nodes (als.py)

    @property
    def grad_ids(self) -> list[str]:
        """The tensors whose gradients are anchored (not ALS's)."""
        return [a[len(GRAD_PREFIX):] for a in self.anchor_ids
                if a.startswith(GRAD_PREFIX) and a not in self.als_anchors]

    @property
    def after_update(self) -> dict[str, str]:
        """The anchors a training batch's update gives (UpdatedVar, Accum) -> their weight."""
        return {**self.updated_var, **self.accum}

    @property
    def fwd_anchor_ids(self) -> list[str]:
        """The anchors the forward pass of a micro-batch computes."""
        skip = set(self.opt_state) | self.als_anchors | self.host_anchors | set(self.after_update)
        return [a for a in self.anchor_ids if a in self.anchor_specs
                and not a.startswith(GRAD_PREFIX) and a not in skip]

    @property
    def opt_anchor_ids(self) -> list[str]:
        """The anchors naming optimizer state (after the batch's update)."""
        return [a for a in self.anchor_ids if a in self.opt_state]

    @property
    def tracked(self) -> list[str]:
        """The tensors whose gradients automatic loss scaling tracks."""
        return list(self.als.tracked) if self.als is not None else []


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


def init_opt_state(cfg: StepConfig, variables: Mapping[str, Any], constants: Mapping[str, Any],
                   trainable: list, als: Optional[_als.AlsPlan]) -> dict:
    """The initial optimizer state, keyed by PopART's reserved names."""
    state = {}
    if cfg.training:
        for w in trainable:
            state.update(cfg.optimizer.init_state(w, variables[w]))
        if als is not None:
            state.update(als.init_state())
        # State saved in the model (modelToHost writes it as initializers of the same
        # names) is where training resumes, as PopART's optimizer patterns read it.
        state.update({k: np.asarray(v, np.asarray(state[k]).dtype)
                      for k, v in constants.items() if k in state})
    return {k: np.asarray(v) for k, v in state.items()}


def updated_var_anchors(anchor_ids: list, variables: Mapping[str, Any], trainable: list,
                        accumulation: int) -> dict[str, str]:
    """Anchor -> weight, for the anchors naming a trainable weight's VarUpdate output
    (PopART's ``UpdatedVar___<w>``) or, without gradient accumulation, a Variable itself:
    PopART copies a Variable's anchor in the backward fragment, after the update
    (IrLowering::getAnchorReturnFragment; accumulated updates run after it, in the
    accumulate outer fragment)."""
    variables = variables if accumulation == 1 else {}
    return {**{a: a for a in anchor_ids if a in variables}, **{
        a: a[len(UPDATED_VAR_PREFIX):] for a in anchor_ids
        if a.startswith(UPDATED_VAR_PREFIX) and a[len(UPDATED_VAR_PREFIX):] in trainable}}


def accum_anchors(anchor_ids: list, cfg: StepConfig, trainable: list) -> dict[str, str]:
    """Anchor -> weight, for the anchors naming a gradient accumulator (``Accum___<w>``):
    PopART has one per trainable weight when gradients accumulate (accumulationFactor > 1),
    except for SGD with momentum combined with its accumulator (SGD1, whose ``Accl___<w>``
    holds both)."""
    opt = cfg.optimizer
    if cfg.accumulation_factor < 2 or opt is None:
        return {}
    return {a: a[len(ACCUM_PREFIX):] for a in anchor_ids
            if a.startswith(ACCUM_PREFIX) and a[len(ACCUM_PREFIX):] in trainable
            and opt.has_accumulator(a[len(ACCUM_PREFIX):])}


def make_plan(graph: Graph, cfg: StepConfig, placement: Placement, traced: tuple,
              stash_anchors: bool) -> StepPlan:
    """The step's plan from ``traced``, what ``program.trace_step`` returned for ``graph``
    and ``cfg`` (its anchors' specs and the trace's facts): trainable and assigned weights,
    the anchors and which the ALS step, the update or the host give, RNG use, recompute
    segments, ALS, the float32 loss region, RTS, the run-time checks; PopART's errors for
    anchors that name nothing (``als.check_settings`` comes before the trace, the caller's). ``stash_anchors``: a virtual-graph session's, whose anchors
    may name stashed and restored activations (``Stashed___X``, ``Restored___X``)."""
    variables, constants = split_variables(graph)
    anchor_ids = list(cfg.anchors)
    stash = [a for a in anchor_ids if a.startswith(STASH_PREFIXES)] if stash_anchors else []
    anchor_ids = [a for a in anchor_ids if a not in stash]
    shapes, out = traced
    specs, effects = out["specs"], out["effects"]
    anchor_specs = {a: s for a, s in shapes.items() if a in anchor_ids}
    for o, dtype in out["dtypes"].items():   # ONNX Runtime rejects these models too
        info = graph.tensor_info.get(o)
        if info is not None and dtype is not None and np.dtype(dtype) != info.np_dtype() \
                and not any(o in n.outputs and n.op_type in registry.POPART_OUTPUT_TYPES
                            for n in graph.nodes):   # PopART's own output types
            raise ModelError(f"Graph output '{o}' is declared as {info.data_type()}, but the "
                             f"model computes {np.dtype(dtype)} for it")
    consts = Graph(**{**graph.__dict__, "initializers": constants})
    trainable: list = []
    als, als_anchors, float32_loss, float32_region, segments = None, frozenset(), None, frozenset(), ()
    if cfg.training:
        trainable = [k for k in variables if k not in out["assigned"]]
        if cfg.als is not None:
            als = _als.plan(cfg.als, graph, cfg.loss, list(variables), trainable, specs,
                            cfg.accumulation_factor, cfg.replication_factor)
            als_anchors = frozenset(a for a in anchor_ids if a in als.anchors)
            anchor_specs.update({a: als.anchors[a] for a in als_anchors})
            if np.dtype(specs[cfg.loss].dtype) == np.float16:
                float32_loss = cfg.loss   # EnsureFp32LossScale: a float32 loss scale
                keep = set(als.tracked) | {a[len(GRAD_PREFIX):] for a in anchor_ids
                                           if a.startswith(GRAD_PREFIX)}
                float32_region = _als.float32_loss_region(consts, cfg.loss, keep, effects)
        segments = _recompute_segments(graph, consts, cfg, anchor_ids, out, als, float32_loss,
                                       float32_region)
    opt_state = init_opt_state(cfg, variables, constants, trainable, als)
    rts = _rts.choose(cfg.config.locations, placement, variables, opt_state, trainable,
                      cfg.accumulation_factor)
    host_anchors, updated, accum = frozenset(), {}, {}
    if cfg.training:   # the optimizer's scalars: the session writes them from the host
        host_anchors = frozenset(a for a in optimizer_scalars(
            cfg.optimizer, variables, trainable, cfg.config, cfg.accumulation_factor,
            cfg.replication_factor) if a in anchor_ids)
        anchor_specs.update({a: jax.ShapeDtypeStruct((), np.float16 if a.endswith("FLOAT16")
                                                     else np.float32) for a in host_anchors})
        # UpdatedVar___<w>: a trainable weight after the batch's update
        updated = updated_var_anchors(anchor_ids, variables, trainable, cfg.accumulation_factor)
        anchor_specs.update({a: jax.ShapeDtypeStruct(variables[w].shape, variables[w].dtype)
                             for a, w in updated.items()})
        accum = accum_anchors(anchor_ids, cfg, trainable)   # Accum___<w>: accumulated gradient
        anchor_specs.update({a: jax.ShapeDtypeStruct(
            variables[w].shape, cfg.optimizer.accum_dtype(variables[w].dtype))
            for a, w in accum.items()})
    flows = gradient_flow(graph, cfg.loss, list(specs), lambda t: jnp.issubdtype(
        specs[t].dtype, jnp.floating) if t in specs else False)[0] if cfg.training else set()
    for a in anchor_ids:
        grad = a.startswith(GRAD_PREFIX) and a[len(GRAD_PREFIX):] in flows
        if (a in anchor_specs and (grad or not a.startswith(GRAD_PREFIX))) \
                or a in opt_state or a in als_anchors or a in host_anchors:
            continue
        raise missing_anchor(a, set(out["ids"]) | set(opt_state) | {GRAD_PREFIX + t for t in flows})
    _check_stash_anchors(stash, cfg, specs)
    anchor_specs.update({a: specs[unstash(a)] for a in stash})
    return StepPlan(anchor_ids=tuple(anchor_ids + stash), anchor_specs=MappingProxyType(anchor_specs),
                    tensor_specs=MappingProxyType(specs), trainable=tuple(trainable),
                    assigned=tuple(out["assigned"]), run_checks=tuple(out["checks"]),
                    uses_rng=bool(out["rng"]), activation_bytes=out["act"], rts=rts,
                    opt_state=opt_state, updated_var=MappingProxyType(updated),
                    accum=MappingProxyType(accum), als=als, als_anchors=als_anchors,
                    host_anchors=host_anchors, segments=tuple(segments),
                    float32_loss=float32_loss, float32_region=float32_region)


def _check_stash_anchors(stash: list, cfg: StepConfig, specs: Mapping[str, Any]) -> None:
    """``Stashed___X`` / ``Restored___X`` anchors: activation X of a pipelined training
    step, which PopART stashes from its forward stage until its backward stage."""
    if stash and not (cfg.training and cfg.config.pipelining):
        raise IrError(f"Anchor '{stash[0]}': stashed and restored tensors exist only in a "
                      f"pipelined TrainingSession")
    for a in stash:
        if unstash(a) not in specs:
            raise IrError(f"Anchor '{a}' names the stash of '{unstash(a)}', which is not "
                          f"a tensor of the model")


def _recompute_segments(graph: Graph, consts: Graph, cfg: StepConfig, anchor_ids: list, out: Mapping,
                        als: Optional[_als.AlsPlan], float32_loss: Optional[str],
                        float32_region: frozenset) -> list:
    """The recompute segments PopART's annotations ask for (``ir.recompute``): segments
    hold no node with side effects, none whose output is probed (anchored or ALS-tracked
    gradients) or is a float16 loss differentiated in float32, and none with outputs other
    than arrays (``traced``, or ``known`` at compile time); nodes that read and make only
    known values run in place."""
    specs, traced, known, effects = out["specs"], out["traced"], out["known"], out["effects"]
    nbytes = {k: int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for k, v in specs.items()}
    method = cfg.config.recompute
    marks = recompute.annotate(graph, cfg.loss, method, nbytes)
    if recompute.RECOMPUTE not in marks.values():
        return []
    probed = {a[len(GRAD_PREFIX):] for a in anchor_ids if a.startswith(GRAD_PREFIX)}
    probed |= set(als.tracked) if als is not None else set()
    probed |= {float32_loss} | float32_region if float32_loss else set()
    nodes = consts.nodes
    outs = [[o for o in n.outputs if o] for n in nodes]
    static = {i for i, n in enumerate(nodes) if id(n) not in effects
              and not any(t in traced for t in outs[i] + reads(n))}
    movable = {i for i, n in enumerate(nodes) if id(n) not in effects and i not in static
               and all((t in traced or t in known) and t not in probed for t in outs[i])}
    segments = recompute.segments(consts, marks, movable, static, {cfg.loss, *anchor_ids})
    _logger.info(f"Recomputation ({method} and recomputeOutput annotations): "
                 f"{len(segments)} segment(s) of "
                 f"{sum(len(g.nodes) for g in segments)} op(s) run again in the "
                 f"backward pass")
    return segments
