"""PopART's checks of a program when a session is created (``Ir::prepare`` and the session
options it reads), raised before anything is traced or compiled; ``check_virtual_graph_range``
is IrLowering's, once the device is known (prepareDevice)."""
from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping, Optional

import jax
import numpy as np
import onnx

from . import dataflow as _df
from ._ir.graph import PIPELINE_STAGE, VIRTUAL_GRAPH, Graph
from ._ir.transforms import fuse_softmax_nll, gradient_flow, overwrite_no_overlap_grads
from .engine.als import check_settings as check_als_settings
from .engine.als import check_tracked as check_als_tracked
from .engine.pipeline import auto_virtual_graphs
from .engine.config import EngineConfig
from .engine.program import (GRAD_PREFIX, check_loss_shape, check_recompute_mixture,
                             missing_anchor, trace_step)
from .engine.segments import has_data_dependent
from .engine.shapes import infer_graph, input_specs
from .devices import DeviceInfo
from .errors import (IrError, OptimizerError, OptionError, check_arguments,
                     incompatible_arguments, noted, popart_exception)
from .logging import getLogger
from .optimizers import Optimizer
from .session_config import engine_config
from .options import SessionOptions
from .ops import registry as _registry
from .tensorinfo import TensorInfo, to_datatype
from .tensornames import PREFIXES as _RESERVED_PREFIXES

_logger = getLogger("session")


def check_ir(graph: Graph, options: Any, training: bool, loss: Optional[str], optimizer: Any,
             device: Any, replicas: int, dataFlow: _df.DataFlow,
             input_infos: Mapping[str, TensorInfo],
             step: Optional["StepTrace"] = None) -> dict[str, TensorInfo]:
    """A session's checks at construction, in PopART's order (Ir::prepare): the training
    arguments, automatic loss scaling's settings, ``verify_ir``, shape inference,
    AutoVirtualGraph (which annotates ``graph``), ALS's tracked tensors and the anchors.
    ``step``: the session's :class:`StepTrace`, traced in shape inference's place (without
    one, ``infer_shapes`` traces). Returns every tensor's TensorInfo."""
    if training:
        check_training_args(loss, optimizer)
    config = engine_config(options)
    als = config.als
    if als.enabled:   # PopART checks these when it builds the IR, at construction
        check_als_settings(als, training, optimizer, config, graph)
    verify_ir(graph, options, training, loss, device, replicas, dataFlow, config)
    infos = infer_shapes(graph, input_infos, training, config, loss,
                         step.specs(replicas, config) if step is not None else None)
    if options.virtualGraphMode.name == "Auto":   # AutoVirtualGraph (Ir::prepare)
        sizes = {**{k: int(np.size(v)) for k, v in graph.initializers.items()},
                 **{k: i.nelms() for k, i in infos.items()}}
        auto_virtual_graphs(graph, num_virtual_graphs(options, device, replicas), sizes)
    if als.enabled and training:   # the ALS transform's checks (Ir::prepare)
        check_als_tracked(als, graph, loss, list(graph.initializers), infos)
    check_anchors(graph, infos, dataFlow.anchors(), options, training, loss)
    return infos


def resolve_inputs(graph: Graph, isi: Any) -> dict[str, TensorInfo]:
    """Every stream input's TensorInfo: the model's, or InputShapeInfo's where it has one."""
    overrides = {}
    if isi is not None:
        for tid in graph.inputs:
            if isi.has(tid):
                overrides[tid] = isi.get(tid)
    specs = input_specs(graph, overrides)
    return {k: TensorInfo(to_datatype(v.dtype), list(v.shape)) for k, v in specs.items()}


def check_training_args(loss: Any, optimizer: Any) -> None:
    if not isinstance(loss, str) or not loss:
        raise popart_exception(f"TrainingSession needs the id of the loss tensor, got {loss!r}")
    if optimizer is None or not hasattr(optimizer, "apply"):
        raise OptimizerError(f"TrainingSession needs a popart optimizer (SGD, ConstSGD, Adam, "
                             f"Adaptive), got {type(optimizer).__name__}")


def verify_ir(graph: Graph, o: Any, training: bool, loss: Optional[str], device: Any,
              replicas: int, dataFlow: _df.DataFlow, config: EngineConfig) -> None:
    """PopART's checks when it builds the IR (``Ir::prepare``), made at construction,
    before anything is traced or compiled: options, the loss, virtual graph and pipeline
    annotations, and (inference) a graph that pruning would leave empty."""
    if not training and o.enableGradientAccumulation:
        raise OptionError("Gradient Accumulation only available when training.")
    o.getAccumulationFactor()   # accumulationFactor > 1 needs enableGradientAccumulation
    _check_replication_options(o)
    if training and loss not in set(graph.all_tensor_ids()):
        raise IrError(f"Could not find loss tensor '{loss}' in main graph tensors")
    _check_virtual_graphs(graph, o, device, replicas)
    _check_pipeline_settings(graph, o, device, replicas, dataFlow.batchesPerStep())
    if getattr(o, "createImplicitPipeliningFwdOnlyProgram", False):
        _logger.warn("Implicit pipelining forward-only program is deprecated and will be "
                     "removed in future releases.")
        explicit = bool(getattr(o, "useHostCopyOps", False) and
                        getattr(o, "enableExplicitMainLoops", False))
        if o.enablePipelining and explicit:
            raise IrError("Implicit pipelining forward-only program is not supported with "
                          "explicit pipelining.")
        if not o.enablePipelining:
            raise IrError("Implicit pipelining forward-only program is not supported "
                          "without implicit pipelining.")
        if not o.enableGradientAccumulation or o.accumulationFactor < 1:
            raise IrError("Implicit pipelining forward-only program is not supported "
                          "without gradient accumulation.")
    phases = getattr(getattr(o, "executionPhaseSettings", None), "phases", 0)
    if phases > 1 and o.virtualGraphMode.name != "ExecutionPhases":
        raise OptionError("> 1 execution phases requires VirtualGraphMode::ExecutionPhases")
    check_recompute_mixture(graph, config)
    if not training:
        _check_not_pruned_empty(graph, dataFlow.anchors())
    _check_no_seed_attributes(graph)


class StepTrace:
    """A session's step and its ONE abstract trace (``program.trace_step``): made at
    construction in shape inference's place (``check_ir`` calls :meth:`specs`), then
    planned from (``plan_program``) while the settings it was made with hold."""

    def __init__(self, graph: Graph, input_infos: Mapping[str, TensorInfo], anchors: list,
                 training: bool, loss: Optional[str], patterns: Any, platform: str) -> None:
        self._graph, self.input_infos, self.anchors = graph, input_infos, list(anchors)
        self.training, self.loss, self.patterns, self.platform = training, loss, patterns, platform
        self._traced: Optional[tuple] = None   # (replicas, config), trace_step's result

    @functools.cached_property
    def graph(self) -> Graph:
        """The graph the step runs: a training session's with PopART's patterns applied."""
        if not self.training:
            return self._graph
        return overwrite_no_overlap_grads(fuse_softmax_nll(
            self._graph, self.loss, self.patterns.isPatternEnabled, self.anchors))

    def specs(self, replicas: int, config: EngineConfig) -> Optional[dict]:
        """Trace the step: every tensor's type (one replica's), or None (not traced) for a
        graph whose shapes may depend on data."""
        if has_data_dependent(self._graph):
            return None
        traced = trace_step(self.graph, self.input_infos, self.anchors, self.training,
                            self.loss, replicas, config, self.platform)
        self._traced = (replicas, config), traced
        return traced[1]["specs"]

    def result(self, replicas: int, config: EngineConfig) -> Optional[tuple]:
        """``trace_step``'s result when it was made with these settings, else None."""
        return self._traced[1] if self._traced and self._traced[0] == (replicas, config) else None


def infer_shapes(graph: Graph, input_infos: Mapping[str, TensorInfo], training: bool,
                 config: EngineConfig, loss: Optional[str],
                 specs: Optional[Mapping[str, Any]] = None) -> dict[str, TensorInfo]:
    """Every tensor's TensorInfo, inferred at construction as PopART's Ir::prepare does
    (each op's setup): invalid axes, shapes that do not broadcast, Nll labels that do not
    match and the rest of shape inference raise here, not in prepareDevice. ``specs``:
    every tensor's type from the step's abstract trace (``program.trace_step``, which also
    checks a training loss's shape); without them (a graph whose shapes depend on data) the
    graph is traced here and a training session's loss must have one element
    (``check_loss_shape``)."""
    if specs is not None:
        ids = set(graph.all_tensor_ids())
        return {**input_infos, **{k: TensorInfo(to_datatype(v.dtype), list(v.shape))
                                  for k, v in specs.items() if k in ids}}
    infos = {**input_infos,
             **infer_graph(graph, overrides=input_infos, training=training, config=config)}
    info = infos.get(loss) if training else None
    if info is not None and -1 not in info.shape():   # -1: known when the step runs
        check_loss_shape(loss, info.shape())
    return infos


def check_anchors(graph: Graph, infos: Mapping[str, TensorInfo], anchors: Iterable[str],
                  options: Any, training: bool, loss: Optional[str]) -> None:
    """Ir::validateAnchors at construction: every anchor names a tensor of the IR; a
    gradient only where one is computed (its tensor is floating point and leads to the
    loss). Tensors the training program adds (optimizer state, hyper-parameters, ...:
    PopART's reserved prefixes; automatic loss scaling's) are checked when it is
    planned."""
    ids = set(infos) | set(graph.initializers) | {   # HostStore's streams
        n.attrs["streamid"] for n in graph.nodes
        if n.op_type == "HostStore" and "streamid" in n.attrs}
    flows = None
    als = options.automaticLossScalingSettings.enabled   # ALS adds tensors of its own
    for a in anchors:
        if a in ids or (any(a.startswith(p) for p in _RESERVED_PREFIXES.values())
                        and not a.startswith(GRAD_PREFIX)) or (als and training):
            continue
        if a.startswith(GRAD_PREFIX) and training:
            if flows is None:
                is_float = lambda t: t in infos and \
                    jax.numpy.issubdtype(infos[t].np_dtype(), jax.numpy.floating)
                flows = gradient_flow(graph, loss, list(infos), is_float)[0]
            if a[len(GRAD_PREFIX):] in flows or a[len(GRAD_PREFIX):] not in ids:
                continue   # e.g. ALS's Gradient___<t>_statistics: checked when planned
        raise missing_anchor(a, ids)


def _shape_info_ids(isi: Any) -> set:
    """The tensor ids an InputShapeInfo (or a dict id -> TensorInfo) gives shapes for."""
    if isi is None:
        return set()
    if isinstance(isi, Mapping):
        return set(isi)
    return set(getattr(isi, "_infos", None) or getattr(isi, "infos", {}) or {})


def check_argument_types(training: bool, model: Any, dataFlow: Any, loss: Any, optimizer: Any,
                         deviceInfo: Any, isi: Any, options: Any, patterns: Any,
                         name: Any) -> None:
    """pybind11's TypeError where PopART's binding of the session's constructor
    (``_InferenceSessionCore`` / ``_TrainingSessionCore``) takes none of the arguments'
    types (a None that defaults here is taken)."""
    expected = [(dataFlow, _df.DataFlow), (deviceInfo, (DeviceInfo, type(None))),
                (isi, (_df.InputShapeInfo, type(None))),
                (options, (SessionOptions, type(None))), (name, str)]
    if training:
        expected += [(loss, str), (optimizer, Optimizer)]
    if all(isinstance(v, t) for v, t in expected):
        return
    kind = "training" if training else "inference"
    train = "loss: str, optimizer: popart_core.Optimizer, " if training else ""
    core = f"popart_core._{kind.capitalize()}SessionCore"
    forms = [f"{core}(model: str, dataFlow: popart_core.DataFlow, {train}deviceInfo: "
             f"popart_core.DeviceInfo, inputShapeInfo: popart_core.InputShapeInfo, "
             f"userOptions: popart_core.SessionOptions, patterns: popart_core.Patterns, "
             f"name: str = '{kind}')"]
    if not training:
        forms.append(f"{core}(ir: popart_core.Ir, deviceInfo: popart_core.DeviceInfo, "
                     f"name: str = 'fromIr')")
    given = (model, dataFlow, *((loss, optimizer) if training else ()), deviceInfo, isi,
             options, patterns, name)
    raise incompatible_arguments("__init__", forms, given, constructor=True)


def check_seed_type(session: Any, seedValue: Any, training: bool) -> None:
    """pybind11's TypeError for a seed ``setRandomSeed(uint64_t)`` cannot take."""
    kind = "Training" if training else "Inference"
    check_arguments(not isinstance(seedValue, bool) and isinstance(seedValue, (int, np.integer))
                    and 0 <= int(seedValue) < 2 ** 64, "setRandomSeed",
                    [f"(self: popart_core._{kind}SessionCore, seedValue: int) -> None"],
                    (session, seedValue))


def check_model(proto: onnx.ModelProto, dataFlow: _df.DataFlow, isi: Any, training: bool) -> None:
    """Ir::setDataFlow, confirmNoReservedIds and registerInputTensors: inference needs an
    anchor; graph inputs, outputs and InputShapeInfo ids must not use a reserved prefix;
    input names are unique; every stream input has a known shape (from the model or
    InputShapeInfo)."""
    if not training and dataFlow.nAnchors() == 0:
        raise IrError("User must specify an anchor tensor when doing inference.")
    g = proto.graph
    given = _shape_info_ids(isi)
    names = [v.name for v in g.input]
    for tid in names + [v.name for v in g.output] + sorted(given):
        for prefix in _RESERVED_PREFIXES.values():
            if prefix in tid:
                raise IrError(f"Provided tensor {tid} has an invalid name: clash with reserved "
                              f"prefix {prefix}")
    seen: set = set()
    for tid in names:
        if tid in seen:
            raise IrError(f"Invalid ONNX Model : repeated name: ({tid}) in input list")
        seen.add(tid)
    initializers = {t.name for t in g.initializer}
    for v in g.input:
        if v.name in initializers or v.name in given:
            continue
        how = (f" Give it with inputShapeInfo (popart.InputShapeInfo().add('{v.name}', "
               f"popart.TensorInfo(dtype, shape))).")
        if not (v.HasField("type") and v.type.HasField("tensor_type")
                and v.type.tensor_type.HasField("shape")):
            raise IrError(f"Could not find tensor {v.name} in InputShapeInfo, but no shape is "
                          f"specified in the onnx model." + how)
        dims = v.type.tensor_type.shape.dim
        text = "[" + ", ".join(d.dim_param if d.HasField("dim_param") else str(d.dim_value)
                               for d in dims) + "]"
        for d in dims:
            unknown = d.dim_param if d.HasField("dim_param") else \
                str(d.dim_value) if d.dim_value < 0 else None
            if unknown is not None:
                raise IrError(f"Input tensor '{v.name}' must be specified in InputShapeInfo, as "
                              f"it has shape {text}, which uses an unknown value '{unknown}'."
                              + how)


def _check_replication_options(o: Any) -> None:
    """PopART's replication option checks (IrLowering::getReplicationFactor,
    Ir::verifyDistributedReplicatedGraphSettings)."""
    if not o.enableReplicatedGraphs and int(o.replicatedGraphCount) > 1:
        raise OptionError("enableReplicatedGraphs is false, but replicatedGraphCount > 1. Either "
                          "enable replication, or set the replicated graph count to 1")
    if not getattr(o, "enableDistributedReplicatedGraphs", False):
        return
    g, offset = int(o.globalReplicationFactor), int(o.globalReplicaOffset)
    if g < 1:
        raise OptionError(f"Invalid globalReplicationFactor value: {g}, must be greater or "
                          f"equal than 1")
    if offset < 0:
        raise OptionError(f"Invalid globalReplicaOffset value: {offset}, must be greater or "
                          f"equal than 0")
    if offset > g:
        raise OptionError(f"Global replica offset: {offset}, is larger than global replication "
                          f"factor: {g}")
    if o.enableReplicatedGraphs and int(o.replicatedGraphCount) > g:
        raise OptionError(f"Invalid local replication factor: {int(o.replicatedGraphCount)}, "
                          f"larger than global replication factor: {g}")


def _all_nodes(graph: Graph) -> Iterable[tuple[Graph, Any]]:
    """(graph, node) for every node of ``graph`` and of the subgraphs its nodes hold."""
    for n in graph.nodes:
        yield graph, n
        for v in n.attrs.values():
            for sub in (v if isinstance(v, list) else [v]):
                if isinstance(sub, Graph):
                    yield from _all_nodes(sub)


def _lookup(graph: Graph, node: Any) -> Any:
    return _registry.lookup(node.domain, node.op_type, graph.opsets.get(node.domain, 1))


# The random ops whose ONNX ``seed`` attribute PopART refuses (RandomBaseOp::errorIfSeedIsSet).
_SEEDED_RANDOM_OPS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike")


def _check_no_seed_attributes(graph: Graph) -> None:
    """PopART's random ops take their seed from the session (setRandomSeed), never from an
    ONNX ``seed`` attribute (the ONNX backend, popart.onnx_backend, keeps accepting it)."""
    for g, n in _all_nodes(graph):
        if n.domain == "ai.onnx" and n.op_type in _SEEDED_RANDOM_OPS and "seed" in n.attrs:
            since = onnx.defs.get_schema(n.op_type, g.opsets.get("ai.onnx", 1)).since_version
            raise noted(popart_exception(f"ai.onnx.{n.op_type}:{since}: Optional seed attribute "
                                         f"is not supported. Use session::setRandomSeed "
                                         f"instead."),
                        f"{n.describe()} has seed={n.attrs['seed']}")


def _main_ops(graph: Graph) -> list:
    """The main graph's nodes PopART counts as ops (its Constant nodes become tensors)."""
    return [n for n in graph.nodes if not (n.op_type == "Constant" and n.domain == "ai.onnx")]


def _op_str(graph: Graph, node: Any) -> str:
    """A node as PopART's Op::str names it: ``name (domain.Type:version)``."""
    return f"{node.name} ({node.domain}.{node.op_type}:{graph.opsets.get(node.domain, '?')})"


def _op_debug_name(graph: Graph, node: Any) -> str:
    """A node as PopART's Op::debugName names it: ``Op(<Op::str>, inputs=[..], outputs=[..])``."""
    return (f"Op({_op_str(graph, node)}, inputs=[{', '.join(t for t in node.inputs if t)}], "
            f"outputs=[{', '.join(t for t in node.outputs if t)}])")


def num_virtual_graphs(o: Any, device: Any, replicas: int) -> int:
    """IPUs per replica (Ir::getNumVirtualGraphIds)."""
    n = int(getattr(device, "numIpus", 1) or 1)
    if o.enableReplicatedGraphs:
        if n % max(replicas, 1):
            raise OptionError("For replicated graphs, the number of IPUs must be divisible by "
                              "the replication factor.")
        return n // max(replicas, 1)
    return n


def _check_virtual_graphs(graph: Graph, o: Any, device: Any, replicas: int) -> None:
    """Ir::verifyVirtualGraphIds: with virtual graphs on, either every op has a virtual
    graph id or none does; Manual mode needs them, each naming an IPU of the device."""
    mode = o.virtualGraphMode.name
    if mode == "Off":   # PopART removes the annotations
        return
    ops = _main_ops(graph)
    ids = [n.annotations.get(VIRTUAL_GRAPH) for n in ops]
    missing = [n for n, v in zip(ops, ids) if v is None]
    if missing and len(missing) < len(ops):
        counts: dict[int, int] = {}
        for v in ids:
            counts[-1 if v is None else int(v)] = counts.get(-1 if v is None else int(v), 0) + 1
        lines = ["Either all Ops must have their virtual graph ids set, or none must. Op count "
                 "per virtual graph id"]
        lines += [f"  {k} : {counts[k]}" for k in sorted(counts)]
        lines.append("Ops with no virtual graph id :  ")
        lines += [f"  {_op_str(graph, n)}" for n in missing]
        raise IrError("\n".join(lines) + "\n")
    if mode != "Manual" or not ops:
        return
    if missing:
        raise IrError("SessionOptions flag virtualGraphMode is VirtualGraphMode::Manual, but no "
                      "Ops have been annotated with virtual graph information. This is an "
                      "inconsistent combination. ")


def check_virtual_graph_range(graph: Graph, o: Any, device: Any, replicas: int) -> None:
    """IrLowering's check once the device is known (prepareDevice): every virtual graph id
    names an IPU of the device (per replica)."""
    if o.virtualGraphMode.name == "Off":
        return
    n = num_virtual_graphs(o, device, replicas)
    for op in _main_ops(graph):
        v = op.annotations.get(VIRTUAL_GRAPH)
        if v is not None and not 0 <= int(v) < n:
            raise IrError(f"{_op_debug_name(graph, op)} has been assigned to an invalid "
                          f"virtual graph {int(v)}. numIPUs = {n}.")


def _check_pipeline_settings(graph: Graph, o: Any, device: Any, replicas: int,
                             batches_per_step: int) -> None:
    """Ir::verifyPipelineSettings: implicit pipelining needs virtual graphs over more than one
    IPU; pipeline stages are set on every op or none, each stage on one virtual graph, with
    no stage missing (Ir::getNumPipelineStages), and enough micro-batches to fill the pipeline
    (the Pipeline transform's depth check)."""
    if not getattr(o, "enablePipelining", False):
        return
    explicit = bool(getattr(o, "useHostCopyOps", False) and
                    getattr(o, "enableExplicitMainLoops", False))
    n = num_virtual_graphs(o, device, replicas)
    if not explicit and (o.virtualGraphMode.name == "Off" or n == 1):
        raise IrError(f"Pipelining requires more than 1 IPU (currently {n}) and the "
                      f"'virtualGraphMode' session option to not be VirtualGraphMode::Off "
                      f"(currently VirtualGraphMode::{o.virtualGraphMode.name}).")
    ops = _main_ops(graph)
    unset = [op for op in ops if PIPELINE_STAGE not in op.annotations]
    if unset and len(unset) < len(ops):
        raise IrError("Only some ops have had their pipeline stage set. Ops missing the pipeline "
                      "stage:" + "".join(f"\n  {_op_str(graph, op)}" for op in unset))
    auto = bool(unset) and o.virtualGraphMode.name == "Auto"   # AutoVirtualGraph: one per IPU
    stages: dict[int, list] = {i: [] for i in range(n)} if auto else {}
    key = VIRTUAL_GRAPH if unset else PIPELINE_STAGE   # none set: an op's stage is its IPU
    for op in [] if auto else ops:
        stages.setdefault(int(op.annotations.get(key, 0)), []).append(op)
    for ps, members in sorted(stages.items()):
        vgraphs = sorted({int(op.annotations.get(VIRTUAL_GRAPH, -1)) for op in members})
        if len(vgraphs) > 1:
            raise IrError(f"Ops {[_op_str(graph, op) for op in members]} have the same pipeline "
                          f"stage {ps}, but different virtual graph ids {vgraphs}. All ops with "
                          f"the same pipeline stage must also have the same virtual graph id")
    if not auto:
        _check_stage_order(graph, ops, key)
    n_stages = len(stages)
    missing = [i for i in range(n_stages) if i not in stages]
    if missing:
        raise IrError(f"The set of pipeline stages for all Ops contains {n_stages} stages, "
                      f"but stage {missing[0]} is missing")
    if getattr(o, "enableGradientAccumulation", False):
        if o.accumulationFactor < n_stages:
            raise IrError(f"For pipelining, depth (gradient accumulation factor) must equal at "
                          f"least the number of pipeline stages ({n_stages})")
    elif batches_per_step < n_stages:
        raise IrError(f"For pipelining, depth (batchesPerStep) must equal at least the number "
                      f"of pipeline stages ({n_stages})")


def _check_stage_order(graph: Graph, ops: list, key: str) -> None:
    """InferPipelineStages' checkOrder: no op reads a tensor an op of a later pipeline stage
    (annotation ``key``) produces."""
    stage = lambda op: int(op.annotations.get(key, 0))
    producer = {t: op for op in ops for t in op.outputs if t}
    debug = lambda op: _op_debug_name(graph, op)
    for op in ops:
        for t in op.inputs:
            p = producer.get(t)
            if p is not None and stage(p) > stage(op):
                raise IrError(f"Tensor {t} is consumed in an earlier pipeline stage than it is "
                              f"produced\nProducer {debug(p)} has pipeline stage {stage(p)}\n"
                              f"Consumer {debug(op)} has pipeline stage {stage(op)}")


# Ops PopART never prunes (side effects, variable updates) or that may hold anchors in a
# subgraph: a graph with one of them is never pruned empty.
_UNPRUNABLE = {"Abort", "CopyVarUpdate", "PrintTensor", "BatchNormalization", "HostLoad",
               "HostStore", "RemoteLoad", "RemoteStore", "Sync", "Init"}


def _check_not_pruned_empty(graph: Graph, anchors: Iterable[str]) -> None:
    """The Prune transform of an inference IR: ops that compute no anchor are removed, and
    PopART refuses a main graph left with no op at all."""
    for n in graph.nodes:
        if n.op_type in _UNPRUNABLE or any(
                isinstance(v, Graph) or (isinstance(v, list) and any(isinstance(x, Graph) for x in v))
                for v in n.attrs.values()):
            return
    produced, anchors = graph.producer(), list(anchors)
    if any(a in produced for a in anchors):
        return
    known = set(graph.all_tensor_ids())
    unknown = [a for a in anchors if a not in known]
    why = (f"the anchors {unknown} name no tensor of the model" if unknown else
           f"no op computes the anchors {anchors}")
    raise IrError(f"All operations in the main graph were pruned, nothing to compute ({why})")



def has_random_ops(graph: Graph, training: bool) -> bool:
    """The graph (its subgraphs included) has random ops; Dropout only when training."""
    return any(_lookup(g, n).random and (training or n.op_type != "Dropout")
               for g, n in _all_nodes(graph))
