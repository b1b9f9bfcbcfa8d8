"""Automatic loss scaling (ALS) as PopART does it: the loss-scale factor's state, the
histograms of the tracked float16 gradients, and PopART's update rule, per batch.

See docs/loss_scaling.md (what a step does, the anchors) and docs/gradients.md (which
gradients are tracked)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import OptimizerError, OptionError, popart_exception
from .._ir.graph import PIPELINE_STAGE, VIRTUAL_GRAPH, Graph, reads
from .._ir.transforms import gradient_flow
from ..logging import getLogger
from ..tensorinfo import TensorInfo, to_datatype
from .config import AlsSettings, EngineConfig

_logger = getLogger("transform")

GRAD_PREFIX = "Gradient___"
FACTOR = "lossScaleUpdateFactor"            # reservedLossScaleUpdateFactorId()
COUNTER = "LossScaleUpdate_counter"         # executeOpNTimesEveryMTimes' counter (P > 1)
FINAL = "finalLossScale"
SUMMED = "summedHistograms"
CASTED = "summedCastedHistograms"
REDUCED = "summedHistograms_reduced"
ACCUM = "Accum___autoLossScaleStats"        # reservedAccumPrefix() + "autoLossScaleStats"
STATS_SUFFIX = "_statistics"                # a tracked gradient's Histogram output
LOSS_SCALING_PREFIX = "lossScaling_"        # the optimizer's loss-scaling tensor
STATS = "__als_statistics"                  # a micro-batch's per-tensor histograms (internal)
UPDATE = "__als_update"                     # hyper-parameter key: this batch updates (internal)
FP16_MAX = 65504.0

_T = "[AutomaticLossScale transform] "
_PRE = "[PreAutomaticLossScale] "

# Forward ops whose grad op is a view change (PopART's isOutplaceViewChange: ReshapeBaseOp,
# which Flatten / Squeeze / Unsqueeze are, TransposeOp, IdentityOp, NopOp, DetachOp).
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity",
                      "Nop", "Detach"})
# Forward ops whose gradient of input i is the output's gradient itself when input i has the
# output's shape: the grad op (a ReduceSum over no axes) becomes Identity (OpToIdentity) and
# PostNRepl removes it.
SAME_SHAPE_IDENTITY = {"Add": None, "Sum": None, "Sub": (0,)}
# Forward ops whose grad op for input i (after PopART's default patterns) reads these forward
# inputs directly; a Variable among them excludes the gradient (consumesVariableInput, "to
# prevent cycles"). For Mul / Div / Max / Min a broadcast input gets its gradient from a
# ReduceSum after that op, which reads no Variable.
READS_INPUTS = {
    "Mul": lambda i: (1 - i,), "Div": lambda i: (1,) if i == 0 else (),
    "Max": lambda i: (i,), "Min": lambda i: (i,),
    "Log": lambda i: (0,), "Erf": lambda i: (0,), "Gelu": lambda i: (0,),
    "GeluErf": lambda i: (0,), "LeakyRelu": lambda i: (0,), "Elu": lambda i: (0,),
    "Selu": lambda i: (0,), "HardSigmoid": lambda i: (0,), "Softplus": lambda i: (0,),
    "Softsign": lambda i: (0,), "Swish": lambda i: (0,),
    "BatchNormalization": lambda i: (0, 1, 3, 4),
    "GroupNormalization": lambda i: (0, 1), "InstanceNormalization": lambda i: (0, 1),
}
BROADCAST_REDUCED = frozenset({"Mul", "Div", "Max", "Min"})
# ConvAndMatmulGradients: the grad ops of these produce the gradients of inputs 0 and 1
# (MatMulLhs/RhsGrad become MatMul, ConvDataGrad becomes Conv, ConvWeightsGrad stays a
# MultiConvWeightsGradBaseOp; Gemm is decomposed into MatMul).
CONV_MATMUL_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "MultiConv"})
# EnsureFp32LossScale (applied with ALS) makes the loss-scale tensor float32. The loss ops
# whose grad ops take it as it is (isMixedPrecisionLossGradOp: NllGrad, the fused
# Softmax-Nll grads, L1Grad) still give float16 gradients; otherwise the grad ops from the
# loss that have a single input ("pass-through": those of these forward ops) give float32, and
# the next grad ops compute in float32 and are cast back to float16 by a Cast the transform
# adds, which is not a tracked grad op.
MPLGO_LOSS_OPS = frozenset({"Nll", "SoftmaxNll", "L1"})
PASS_THROUGH_GRAD_OPS = frozenset({
    "IdentityLoss", "ReduceSum", "ReduceMean", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
    "Transpose", "Identity", "Scale", "Neg", "Expand", "Slice", "Pad", "Sum", "Add", "Sub",
    "Mean", "Concat"})


def _dtype_name(dtype: Any) -> str:
    return TensorInfo(to_datatype(np.dtype(dtype)), []).data_type()


def check_settings(settings: AlsSettings, training: bool, optimizer: Any, config: EngineConfig,
                   graph: Graph) -> None:
    """The checks PopART makes before it looks at gradients, in its order:
    ``PreAutomaticLossScale`` (``toTrackTensors`` given: not empty, every name a tensor of the
    model), then ``AutomaticLossScale::apply`` (training only, non-const loss scaling, not
    pipelining without gradient accumulation) and ``getToTrackTensors`` (``toTrackTensors``
    and ``GradientsOfUserSpecifiedTensors`` go together)."""
    user = settings.toTrackTensors
    if user is not None:
        if isinstance(user, str) or not isinstance(user, Sequence):
            raise OptionError(f"automaticLossScalingSettings.toTrackTensors must be a list of "
                              f"tensor ids, got {user!r}")
        if len(user) == 0:
            raise OptionError(
                _PRE + "An empty list was set as the value of 'toTrackTensors'. To disable "
                "tensor tracking, please set 'automaticLossScalingSettings.enabled = False'. To "
                "track the default tensors, please leave "
                "'automaticLossScalingSettings.toTrackTensors' unset.")
        ids = set(graph.all_tensor_ids())
        seen = set()
        for t in user:
            if t in seen:
                _logger.warn(_PRE + "Tensor {} has been added more than once to the list of "
                             "'toTrackTensors'. Please consider removing the duplicates.", t)
            seen.add(t)
        missing = [t for t in dict.fromkeys(user) if t not in ids]
        for t in missing:
            _logger.err(_PRE + "Tensor {}, which was added to the "
                        "'automaticLossScalingSettings.toTrackTensors' list, does not exist in "
                        "the model.", t)
        if missing:
            raise OptionError(
                _PRE + "Some of the tensors in the 'automaticLossScalingSettings.toTrackTensors' "
                "list do not exist in the model. Please look at the error log. (Not in the "
                f"model: {', '.join(repr(t) for t in missing)}.)")
    if not training:
        raise popart_exception(_T + "Only compatible when doing training")
    if optimizer.loss_scaling().isConst():
        raise OptimizerError(_T + "The optimizer must have non-const loss scaling")
    if config.pipelining and not config.gradient_accumulation:
        raise OptionError(
            _T + "Automatic loss scaling is not currently supported when the "
            "'enablePipelining' SessionOption is set to 'true', but the "
            "'enableGradientAccumulation' SessionOption is set to 'false'")
    method = settings.gradientTensorTrackingMethod
    if user is not None and method != "GradientsOfUserSpecifiedTensors":
        raise OptionError(
            _T + "toTrackTensors has been set, but gradientTensorTrackingMethod has not been "
            "set to 'GradientTensorTrackingMethod::GradientsOfUserSpecifiedTensors'.")
    if method == "GradientsOfUserSpecifiedTensors" and user is None:
        raise OptionError(
            _T + "gradientTensorTrackingMethod set to "
            "'GradientTensorTrackingMethod::GradientsOfUserSpecifiedTensors' but "
            "'toTrackTensors' has not been set")


def _loss_scale_edges(graph: Graph, loss: str, specs: Mapping[str, Any], edges: set) -> set:
    """The gradient edges that give no tracked float16 grad-op output because of the loss
    scale: the loss op's (its grad op reads the loss-scaling optimizer tensor) and, for a
    float16 loss whose loss op is not in :data:`MPLGO_LOSS_OPS`, EnsureFp32LossScale's
    float32 region (through :data:`PASS_THROUGH_GRAD_OPS`) and the down-cast gradients of the
    first grad ops after it."""
    producer = {o: k for k, n in enumerate(graph.nodes) for o in n.outputs if o}
    if loss not in producer:
        return set()
    by_node: dict = {}
    for k, i in edges:
        by_node.setdefault(k, []).append(i)
    first = producer[loss]
    blocked = {(first, i) for i in by_node.get(first, [])}
    fp16 = loss in specs and np.dtype(specs[loss].dtype) == np.float16
    if not fp16 or graph.nodes[first].op_type in MPLGO_LOSS_OPS:
        return blocked
    frontier, seen = [first], set()
    while frontier:
        k = frontier.pop()
        if k in seen:
            continue
        seen.add(k)
        n = graph.nodes[k]
        blocked.update((k, i) for i in by_node.get(k, []))
        if n.op_type in PASS_THROUGH_GRAD_OPS:
            frontier.extend(producer[n.inputs[i]] for i in by_node.get(k, [])
                            if n.inputs[i] in producer)
    return blocked


def float32_loss_region(graph: Graph, loss: str, keep: set, effects: set) -> frozenset:
    """The outputs of the nodes whose gradients run in float32 with a float16 ``loss`` under
    EnsureFp32LossScale (ensurefp32lossscale.cpp): the loss op, the ops before it whose grad
    ops are pass-through (:data:`PASS_THROUGH_GRAD_OPS`: single input, float32 once the
    loss scale is) and the first other ops (their grad ops take their float16 inputs cast
    up and give float16 gradients cast down). For a loss op in :data:`MPLGO_LOSS_OPS` the
    loss op alone. The region runs as one function (``lower.run_float32_loss``), so it
    holds only nodes whose outputs nothing outside it reads, none in ``keep`` (probed or
    tracked tensors), none with side effects (``effects``: id(node)) and none placed
    elsewhere than the loss op (a placed program runs each stage's nodes apart)."""
    producer = {o: k for k, n in enumerate(graph.nodes) for o in n.outputs if o}
    if loss not in producer:
        return frozenset()
    first = producer[loss]
    region = {first}
    consumers, placed = graph.consumers(), (VIRTUAL_GRAPH, PIPELINE_STAGE)
    grows = lambda n: n.op_type in PASS_THROUGH_GRAD_OPS and \
        graph.nodes[first].op_type not in MPLGO_LOSS_OPS   # noqa: E731
    wanted = {producer[t] for t in reads(graph.nodes[first]) if t in producer} \
        if grows(graph.nodes[first]) else set()
    for k in range(first - 1, -1, -1):   # reverse graph order: a node's readers come first
        n = graph.nodes[k]
        outs = [o for o in n.outputs if o]
        if k not in wanted or id(n) in effects or keep.intersection(outs) or any(
                n.annotations.get(a) != graph.nodes[first].annotations.get(a) for a in placed):
            continue
        inside = {id(graph.nodes[r]) for r in region}
        if all(id(u) in inside for o in outs for u in consumers.get(o, [])):
            region.add(k)
            if grows(n):
                wanted |= {producer[t] for t in reads(n) if t in producer}
    return frozenset(o for k in region for o in graph.nodes[k].outputs if o)


def tracked_tensors(settings: Any, graph: Graph, loss: str, variables: Sequence[str],
                    trainable: Sequence[str], specs: Mapping[str, Any]) -> list[str]:
    """The forward tensors whose (total) gradients ALS tracks, in graph order.

    PopART picks gradient tensors of its backward graph; the backward pass here is JAX
    autodiff, so the choice is made on the forward graph ("the gradient of t" is forward t's
    total gradient). The rules per ``gradientTensorTrackingMethod`` are in docs/gradients.md.
    """
    has_grad, edges = gradient_flow(graph, loss, trainable, lambda t: t in specs and jnp.issubdtype(
        specs[t].dtype, jnp.floating))
    is_fp16 = lambda t: t in has_grad and np.dtype(specs[t].dtype) == np.float16   # noqa: E731
    method = settings.gradientTensorTrackingMethod
    if method == "GradientsOfUserSpecifiedTensors":
        out = []
        for t in dict.fromkeys(settings.toTrackTensors):
            if t in has_grad:
                out.append(t)
            else:
                _logger.warn(_T + "toTrackTensors: '{}' has no gradient in this model; its "
                             "statistics are not tracked.", t)
        return out
    variables = set(variables)
    blocked = _loss_scale_edges(graph, loss, specs, edges)
    chosen: set = set()
    partials: dict = {}
    for k, i in sorted(edges):
        n = graph.nodes[k]
        t = n.inputs[i]
        partials[t] = partials.get(t, 0) + 1
        if (k, i) in blocked:
            continue
        if method == "ConvAndMatmulGradients":
            if n.op_type in CONV_MATMUL_OPS and i in (0, 1):
                chosen.add(t)
            continue
        if n.op_type in VIEW_OPS:
            continue
        out_shape = tuple(specs[n.outputs[0]].shape) if n.outputs and n.outputs[0] in specs else None
        same_shape = out_shape is not None and tuple(specs[t].shape) == out_shape
        if n.op_type in SAME_SHAPE_IDENTITY and same_shape and (
                SAME_SHAPE_IDENTITY[n.op_type] is None or i in SAME_SHAPE_IDENTITY[n.op_type]):
            continue
        if n.op_type == "Cast" and n.outputs and n.outputs[0] in specs and \
                np.dtype(specs[n.outputs[0]].dtype) == np.dtype(specs[t].dtype):
            continue
        reads = READS_INPUTS.get(n.op_type)
        if reads is not None and not (n.op_type in BROADCAST_REDUCED and not same_shape):
            if any(j < len(n.inputs) and n.inputs[j] in variables for j in reads(i)):
                continue
        chosen.add(t)
    if method == "AllNonViewChangingGradientTensors":
        chosen.update(t for t, c in partials.items() if c >= 2)
    order = {t: k for k, t in enumerate(graph.all_tensor_ids())}
    return sorted((t for t in chosen if is_fp16(t)), key=lambda t: order.get(t, len(order)))


STAT_SHAPE = (2, 2)   # a tap's statistics: [lower, upper] x two base-4096 digits
_DIGIT = 4096


@dataclass
class AlsPlan:
    """What the step needs: the tracked forward tensors, the histogram level, the update's f,
    the period and the anchorable ALS tensors' specs."""
    tracked: list
    specs: dict                       # tracked id -> ShapeDtypeStruct
    level: np.float16                 # the Histogram's bin edge (float16, as PopART's levels)
    f: np.float32                     # t / (1 - t)
    period: int                       # updatePeriod (<= 1: every batch)
    loss_scaling_id: str              # lossScaling_FLOAT16 / lossScaling_FLOAT
    accumulation: int = 1
    replication: int = 1
    anchors: dict = field(default_factory=dict)   # anchorable id -> ShapeDtypeStruct

    def init_state(self) -> dict:
        state = {FACTOR: np.float32(1.0)}
        if self.period > 1:
            state[COUNTER] = np.int32(-1)
        return state

    def stats_anchor(self, t: str) -> str:
        return GRAD_PREFIX + t + STATS_SUFFIX

    # --------------------------------------------------------------- in the compiled step
    def begin(self, opt_state: dict, hyper: dict) -> tuple[dict, dict, Any, Any]:
        """A batch's start: advance the counter; (opt_state, hyper with the final loss scale
        and the update flag, the final loss scale, the optimizer's loss scaling)."""
        if self.period > 1:
            c = jnp.remainder(opt_state[COUNTER] + 1, self.period).astype(jnp.int32)
            on = c < 1
            opt_state = {**opt_state, COUNTER: c}
        else:
            on = jnp.asarray(True)
        static = jnp.asarray(hyper["lossScaling"], jnp.float32)
        final = static * opt_state[FACTOR]
        return opt_state, {**hyper, "lossScaling": final, UPDATE: on}, final, static

    def histogram(self, g: Any) -> Any:
        """[2] uint32: gradient g's [count |g| < level, count of the rest] (inf and NaN are
        not below the level)."""
        lower = jnp.sum(jnp.abs(g) < jnp.asarray(self.level, jnp.float16), dtype=jnp.uint32)
        return jnp.stack([lower, jnp.uint32(np.size(g)) - lower])

    @staticmethod
    def gate(stats: Any, on: Any) -> Any:
        """Statistics, or zeros in a batch that does not update."""
        return jnp.where(on, stats, jnp.zeros_like(stats))

    def tap(self, x: Any, stat: Any) -> Any:
        """x, with the :meth:`histogram` of its gradient as the gradient of ``stat`` (a
        float32 zero of :data:`STAT_SHAPE`; :meth:`counts` reads it): the statistics of a
        gradient that only autodiff forms (x's cotangent passes through unchanged). Each
        count goes as two float32 digits in base 4096, exact up to 2**36 elements."""
        @jax.custom_vjp
        def f(x: Any, stat: Any) -> Any:
            return x

        def bwd(_: Any, g: Any) -> tuple:
            h = self.histogram(g)
            return g, jnp.stack([h // _DIGIT, h % _DIGIT], axis=-1).astype(jnp.float32)

        f.defvjp(lambda x, stat: (x, None), bwd)
        return f(x, stat)

    @staticmethod
    def counts(stat_grads: Any) -> Any:
        """[..., 2] uint32 histograms from the gradients [..., *STAT_SHAPE] of :meth:`tap`."""
        digits = stat_grads.astype(jnp.uint32)
        return digits[..., 0] * _DIGIT + digits[..., 1]

    def update(self, factor: Any, stats: Any, on: Any) -> Any:
        """LossScaleUpdateOpx: halve when upper > f * lower, else double (float32 compare);
        unchanged in batches that do not update."""
        lower, upper = stats[0], stats[1]
        new = jnp.where(upper > lower * self.f, factor * 0.5, factor * 2.0).astype(factor.dtype)
        return jnp.where(on, new, factor)


def _check_tracked(settings: Any, tracked: Sequence[str]) -> np.float32:
    """``getToTrackTensorsAuto``'s "none found" and ``getLevels``' ``binEdgeLocation`` range,
    in PopART's order; returns the bin edge location."""
    if not tracked:
        if settings.gradientTensorTrackingMethod == "GradientsOfUserSpecifiedTensors":
            raise OptionError(_T + "None of the tensors in 'toTrackTensors' "
                              f"({', '.join(repr(t) for t in settings.toTrackTensors)}) has a "
                              "gradient in this model, so there are no tracked gradient tensors.")
        raise OptionError(_T + "No tracked gradient tensors of type fp16 were found.")
    edge = np.float32(settings.binEdgeLocation)
    if edge < 0 or edge > 1:
        raise OptionError(_T + "Out of range value for 'binEdgeLocation'. The current value is "
                          f"{float(edge):g}, but it should be in the range [0, 1].")
    return edge


def check_tracked(settings: Any, graph: Graph, loss: str, weights: Sequence[str],
                  infos: Mapping[str, Any]) -> None:
    """The checks of :func:`_check_tracked` at session construction, where PopART's
    ``Ir::prepare`` runs the ALS transform, from the inferred TensorInfos ``infos``. Every
    weight is taken as trained: that only adds gradients, so no tracked gradient here means
    none in the compiled program either (:func:`plan` checks again with the exact set)."""
    specs = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
             for k, v in graph.initializers.items()}
    specs.update({k: jax.ShapeDtypeStruct(tuple(i.shape()), i.np_dtype())
                  for k, i in infos.items()})
    _check_tracked(settings, tracked_tensors(settings, graph, loss, weights, weights, specs))


def plan(settings: Any, graph: Graph, loss: str, variables: Sequence[str],
         trainable: Sequence[str], specs: Mapping[str, Any], accumulation: int,
         replication: int) -> AlsPlan:
    """The tracked gradients and the errors PopART raises once it has them: none of float16
    (``getToTrackTensorsAuto``), ``binEdgeLocation`` out of [0, 1] and a user tensor that is
    not float16 (``getLevels``), ``thresholdUpperCountProportion`` out of [0, 1]
    (``LossScaleUpdateOpx``, at prepareDevice)."""
    tracked = tracked_tensors(settings, graph, loss, variables, trainable, specs)
    edge = _check_tracked(settings, tracked)
    for t in tracked:
        dt = np.dtype(specs[t].dtype)
        if dt != np.float16:
            raise OptionError(_T + f"Unsupported data type {_dtype_name(dt)} for to-track "
                              f"tensor '{GRAD_PREFIX + t}'")
    thr = np.float32(settings.thresholdUpperCountProportion)
    if thr < 0 or thr > 1:
        raise OptionError("Out of range value for 'thresholdUpperCountProportion'. The current "
                          f"value is {float(thr):g}, but it should be in the range [0, 1].")
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.float32(thr / (np.float32(1) - thr))
    loss_dt = np.dtype(specs[loss].dtype) if loss in specs else np.dtype(np.float32)
    p = AlsPlan(tracked=list(tracked), specs={t: specs[t] for t in tracked},
                level=np.float16(np.float32(FP16_MAX) * edge), f=f,
                period=max(int(settings.updatePeriod), 1),
                loss_scaling_id=LOSS_SCALING_PREFIX + _dtype_name(loss_dt),
                accumulation=int(accumulation), replication=int(replication))
    s2 = lambda dt: jax.ShapeDtypeStruct((2,), dt)   # noqa: E731
    scalar = jax.ShapeDtypeStruct((), np.float32)
    p.anchors = {FINAL: scalar, p.loss_scaling_id: scalar, SUMMED: s2(np.uint32),
                 CASTED: s2(np.float32)}
    if accumulation > 1:
        p.anchors[ACCUM] = s2(np.float32)
    if replication > 1:
        p.anchors[REDUCED] = s2(np.float32)
    p.anchors.update({p.stats_anchor(t): s2(np.uint32) for t in tracked})
    _logger.debug(_T + "tracking the gradients of {}", ", ".join(tracked))
    return p
