"""InferenceSession and TrainingSession: compile a graph once, run many batches per call."""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import io
import json
import os
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional

import jax
import numpy as np
import onnx
from onnx import numpy_helper

from . import dataflow as _df
from . import distributed
from . import logging as _log
from . import report
from .engine.als import check_settings as check_als_settings, snapshot as als_snapshot
from .engine.als import check_tracked as check_als_tracked
from .engine.executable import (EXECUTABLE_SLACK, EngineCache, canonical, executable_bytes,
                                read_executable, runtime_signature)
from .engine.pipeline import auto_virtual_graphs, program_class
from .run_plan import RunPlan
from .engine.program import (GRAD_PREFIX, StepConfig, StepProgram, check_recompute_mixture,
                             missing_anchor)
from .engine import in_x64, x64
from .engine.progress import compile_progress
from .engine.shapes import infer_graph, input_specs
from ._ir.transforms import fuse_softmax_nll, gradient_flow
from .errors import (ArgumentError, IrError, OptimizerError, OptionError, OutOfMemoryException,
                     StepIOError, WeightsIOError, noted, popart_exception, popart_runtime_error)
from .ops import registry as _registry
from ._ir.graph import PIPELINE_STAGE, VIRTUAL_GRAPH, Graph
from .tensornames import PREFIXES as _RESERVED_PREFIXES
from .fileio import atomic_patch, atomic_write, initializer_proto, note_own_file, read_exact
from ._ir.onnx_import import (OPTIMIZER_STATE_PREFIXES, ModelLike, external_data_path,
                             external_info, external_sources, import_model, is_external, load_model,
                             raw_bytes, set_external, sparse_to_numpy, tensor_to_numpy)
from .patterns import for_session
from .options import IrSerializationFormat, MeanReductionStrategy, ReductionType, SessionOptions
from .session_ir import SessionIr, serialize_ir
from .tensorinfo import TensorInfo, shape_str, to_datatype

_logger = _log.getLogger("session")


# PopART's errors for calls that need the compiled program, before prepareDevice.
_NOT_PREPARED = {
    "loadEngineAndConnectStreams": "Trying to load an engine but no compiled engine. Did you "
                                   "forget to call prepareDevice()?",
    "weightsToHost": "Devicex::prepare() must be called before Devicex::weightsToHost(const "
                     "std::map<TensorId, MutableVoidData> &) is called.",
    "getRNGState": "Devicex::prepare() must be called before Devicex::getRngStateToHost is "
                   "called.",
    "setRNGState": "Devicex::prepare() must be called before Devicex::setRngStateFromHost is "
                   "called.",
}


def _key_data(seed: int) -> np.ndarray:
    """The raw state of the session's PRNG key for ``seed`` (what getRNGState returns)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return np.asarray(jax.random.key_data(jax.random.key(seed)))


# Options that do not shape the compiled program (where it is cached, how compilation is
# reported, debugging output): left out of the executable's signature.
_NOT_IN_SIGNATURE = {"cachePath", "enableEngineCaching", "compilationProgressLogger",
                     "compilationProgressTotal", "compileEngine", "logDir", "dotChecks",
                     "dotOpNames", "firstDotOp", "finalDotOp", "reportOptions"}


def _options_signature(options: Any) -> dict:
    """The options that shape the compiled program and differ from the defaults."""
    summary = options.summary() if callable(getattr(options, "summary", None)) else {}
    return canonical({k: v for k, v in summary.items() if k not in _NOT_IN_SIGNATURE})


def _optimizer_signature(opt: Any) -> Any:
    """The optimizer's type, settings and const hyper-parameters (compiled into the
    program); non-const ones are fed at run time and left out."""
    if opt is None:
        return None
    const = lambda ov: repr(ov) if ov.isConst() else "non-const"
    maps = {n: [const(m.getDefault()), {w: const(v) for w, v in m.getSpecifics().items()}]
            for n, m in getattr(opt, "_maps", {}).items()}
    return canonical({"type": opt.type_name(), "settings": opt.settings(), "const": maps,
                       "lossScaling": const(opt.loss_scaling())})


def _serialised(method: Callable) -> Callable:
    """Run ``method`` holding the session's lock (see _Session), with the package's 64-bit
    JAX scope (``engine.x64``)."""
    @functools.wraps(method)
    def locked(self: "_Session", *args: Any, **kwargs: Any) -> Any:
        with self._lock, x64():
            return method(self, *args, **kwargs)
    return locked


class _Session:
    """What InferenceSession and TrainingSession share.

    Thread safety: a session serialises its calls. Every method that compiles, runs or
    moves weights (prepareDevice, initAnchorArrays, run, weightsFromHost, weightsToHost,
    readWeights, writeWeights, resetHostWeights, modelToHost, saveExecutable,
    loadExecutable, the RNG state methods, updateOptimizerFromHost, broadcastWeights) holds
    the session's re-entrant lock, so two threads using one session take turns, each call
    seeing the state the previous one left; for parallel work, use one session per thread."""

    _training = False

    @in_x64
    def __init__(self, fnModel: ModelLike, dataFlow: _df.DataFlow, deviceInfo: Any,
                 inputShapeInfo: Optional[_df.InputShapeInfo] = None, patterns: Any = None,
                 userOptions: Optional[SessionOptions] = None, name: str = "session",
                 loss: Optional[str] = None, optimizer: Any = None) -> None:
        if deviceInfo is None:
            raise popart_exception(f"Must pass a valid deviceInfo to {type(self).__name__}::"
                                   f"createFromOnnxModel (no device given: pass deviceInfo, for "
                                   f"example popart.DeviceManager().createCpuDevice())")
        if not isinstance(dataFlow, _df.DataFlow):
            raise ArgumentError(f"dataFlow must be a popart.DataFlow, got "
                                f"{type(dataFlow).__name__}")
        self.name, self._device = name, deviceInfo
        self.patterns = for_session(patterns)
        self._dataFlow = dataFlow
        self.options = userOptions if userOptions is not None else SessionOptions()
        self._graph, self._proto = import_model(fnModel, inputShapeInfo)
        self._base_dir = os.path.dirname(os.path.abspath(fnModel)) \
            if isinstance(fnModel, (str, os.PathLike)) else None   # external data's folder
        _check_model(self._proto, dataFlow, inputShapeInfo, self._training)
        self._input_infos = self._resolve_inputs(inputShapeInfo)
        self._loss, self._optimizer = loss, optimizer
        self._program: Optional[StepProgram] = None
        self._host_weights: dict[str, np.ndarray] = {}
        self._host_in_sync = True
        self._dev = None          # (weights, opt_state) on device
        self._weights_written = False   # weightsFromHost called (Session::weightsFromHostCalled)
        self._seed = 0
        self._key = None
        self._summary: dict[str, Any] = {}
        self._stream_callbacks: dict[str, Any] = {}
        self._loaded: Optional[dict] = None   # contents of a loadExecutable() file
        self._fwd_program: Optional[StepProgram] = None   # "implicitPipeliningFwdOnly"
        self._lock = threading.RLock()       # see the class docstring
        self._run_plan: Optional[RunPlan] = None   # run()'s per-call work (run_plan.py)
        if self._training:
            self._check_training_args()
        als = self.options.automaticLossScalingSettings
        if als.enabled:   # PopART checks these when it builds the IR, at construction
            check_als_settings(als_snapshot(als), self._training, self._optimizer, self.options,
                               self._graph)
        self._verify_ir()
        self._infos = self._infer_shapes()
        if self.options.virtualGraphMode.name == "Auto":   # AutoVirtualGraph (Ir::prepare)
            sizes = {**{k: int(np.size(v)) for k, v in self._graph.initializers.items()},
                     **{k: i.nelms() for k, i in self._infos.items()}}
            auto_virtual_graphs(self._graph, _num_virtual_graphs(
                self.options, self._device, self.replicationFactor), sizes)
        if als.enabled and self._training:   # the ALS transform's checks (Ir::prepare)
            check_als_tracked(als, self._graph, self._loss, list(self._graph.initializers),
                              self._infos)
        self._check_anchors()
        _logger.info(f"{type(self).__name__} '{name}': {len(self._graph.nodes)} ops, inputs "
                     f"{list(self._input_infos)}, anchors {dataFlow.anchors()}")
        report.session_built(self)   # progress 0, dotChecks, POPART_IR_DUMP

    # ------------------------------------------------------------------ set-up
    def _resolve_inputs(self, isi: Any) -> dict[str, TensorInfo]:
        overrides = {}
        if isi is not None:
            for tid in self._graph.inputs:
                if isi.has(tid):
                    overrides[tid] = isi.get(tid)
        specs = input_specs(self._graph, overrides)
        return {k: TensorInfo(to_datatype(v.dtype), list(v.shape)) for k, v in specs.items()}

    def _verify_ir(self) -> None:
        """PopART's checks when it builds the IR (``Ir::prepare``), made at construction,
        before anything is traced or compiled: options, the loss, virtual graph and pipeline
        annotations, and (inference) a graph that pruning would leave empty."""
        o = self.options
        if not self._training and o.enableGradientAccumulation:
            raise OptionError("Gradient Accumulation only available when training.")
        o.getAccumulationFactor()   # accumulationFactor > 1 needs enableGradientAccumulation
        _check_replication_options(o)
        if self._training and self._loss not in set(self._graph.all_tensor_ids()):
            raise IrError(f"Could not find loss tensor '{self._loss}' in main graph tensors")
        _check_virtual_graphs(self._graph, o, self._device, self.replicationFactor)
        _check_pipeline_settings(self._graph, o, self._device, self.replicationFactor,
                                 self._dataFlow.batchesPerStep())
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
        check_recompute_mixture(self._graph, o)
        if not self._training:
            _check_not_pruned_empty(self._graph, self._dataFlow.anchors())
        _check_no_seed_attributes(self._graph)

    def _infer_shapes(self) -> dict[str, TensorInfo]:
        """Every tensor's TensorInfo, inferred at construction as PopART's Ir::prepare does
        (each op's setup): invalid axes, shapes that do not broadcast, Nll labels that do not
        match and the rest of shape inference raise here, not in prepareDevice. A training
        session's loss may have one element (shape [], [1], [1, 1], ...), not more
        (Ir::setFinalLoss)."""
        infos = {**self._input_infos,
                 **infer_graph(self._graph, overrides=self._input_infos, training=self._training,
                               options=self.options)}
        loss = infos.get(self._loss) if self._training else None
        if loss is not None and loss.nelms() > 1:
            raise noted(IrError(f"Loss tensor, '{self._loss}', must be a scalar tensor"),
                        f"Its shape is {loss.shape()}: reduce it with a loss op of reduction "
                        f"Sum or Mean (popart.ReductionType)")
        return infos

    def _check_anchors(self) -> None:
        """Ir::validateAnchors at construction: every anchor names a tensor of the IR; a
        gradient only where one is computed (its tensor is floating point and leads to the
        loss). Tensors the training program adds (optimizer state, hyper-parameters, ...:
        PopART's reserved prefixes; automatic loss scaling's) are checked when it is
        planned."""
        ids = set(self._infos) | set(self._graph.initializers) | {   # HostStore's streams
            n.attrs["streamid"] for n in self._graph.nodes
            if n.op_type == "HostStore" and "streamid" in n.attrs}
        flows = None
        als = self.options.automaticLossScalingSettings.enabled   # ALS adds tensors of its own
        for a in self._dataFlow.anchors():
            if a in ids or (any(a.startswith(p) for p in _RESERVED_PREFIXES.values())
                            and not a.startswith(GRAD_PREFIX)) or (als and self._training):
                continue
            if a.startswith(GRAD_PREFIX) and self._training:
                if flows is None:
                    is_float = lambda t: t in self._infos and \
                        jax.numpy.issubdtype(self._infos[t].np_dtype(), jax.numpy.floating)
                    flows = gradient_flow(self._graph, self._loss, list(self._infos), is_float)[0]
                if a[len(GRAD_PREFIX):] in flows or a[len(GRAD_PREFIX):] not in ids:
                    continue   # e.g. ALS's Gradient___<t>_statistics: checked when planned
            raise missing_anchor(a, ids)

    def _check_training_args(self) -> None:
        if not isinstance(self._loss, str) or not self._loss:
            raise popart_exception(f"TrainingSession needs the id of the loss tensor, got {self._loss!r}")
        if self._optimizer is None or not hasattr(self._optimizer, "apply"):
            raise OptimizerError(f"TrainingSession needs a popart optimizer (SGD, ConstSGD, Adam, "
                                 f"Adaptive), got {type(self._optimizer).__name__}")

    @property
    def replicationFactor(self) -> int:
        return self.options.localReplicationFactor()

    @property
    def accumulationFactor(self) -> int:
        return self.options.getAccumulationFactor()

    @property
    def dataFlow(self) -> _df.DataFlow:
        return self._dataFlow

    def _config(self) -> StepConfig:
        o = self.options
        anchors = {a: self._dataFlow.art(a) for a in self._dataFlow.anchors()}
        bps = self._dataFlow.batchesPerStep()   # DataFlow checks EVERYN periods divide it
        return StepConfig(
            batches_per_step=bps, accumulation_factor=self.accumulationFactor,
            replication_factor=distributed.check_options(o, self.replicationFactor),
            anchors=anchors, training=self._training,
            loss=self._loss, optimizer=self._optimizer,
            mean_reduction=o.accumulationAndReplicationReductionType == ReductionType.Mean,
            running_mean=o.meanAccumulationAndReplicationReductionStrategy == MeanReductionStrategy.Running,
            # ALS in an inference session too: StepProgram raises PopART's error for it.
            als=o.automaticLossScalingSettings if o.automaticLossScalingSettings.enabled else None,
            options=o)

    def _jax_device(self):
        devs = getattr(self._device, "jax_devices", None)
        return devs[0] if devs else jax.local_devices()[0]

    # ------------------------------------------------------------------ compile
    def _recompile(self) -> None:
        """Plan and compile again for the current options (e.g. replication changed by
        ``popart.horovod``), keeping the current weights; nothing to do before prepareDevice."""
        if not self._prepared:
            return
        self.weightsToHost()
        weights = dict(self._host_weights)
        self._program = None
        self.prepareDevice()
        self._host_weights.update(weights)
        self.weightsFromHost()

    @_serialised
    def prepareDevice(self, loadEngine: bool = True) -> None:
        """Trace the whole step and compile it once with XLA (once per session: a second call
        does nothing)."""
        if self._prepared:
            return
        _check_virtual_graph_range(self._graph, self.options, self._device, self.replicationFactor)
        if getattr(self.options, "enablePipelining", False) and any(   # IrLowering's check
                self._dataFlow.art(a).id().name == "EveryN" for a in self._dataFlow.anchors()):
            raise popart_exception("AnchorReturnType::EVERYN is not valid for pipelined models")
        program = self._plan()
        self._host_weights = {k: np.array(v) for k, v in program.variables.items()}
        opt_state = dict(program.init_opt_state())
        with jax.default_device(self._jax_device()):
            if self._key is None:
                self._key = _key_data(self._seed)
            _logger.info(f"Compiling '{self.name}' ...")
            exported = self._loaded.get("executable") if self._loaded else None
            with compile_progress(f"'{self.name}'"), report.session_compiling(self):
                source = program.compile(self._host_weights, opt_state, self._key, self._hyper(),
                                         exported=exported, cache=self._engine_cache())
        _logger.info(f"Compiled '{self.name}' in {program.compile_seconds:.2f} s")
        self._summary["compile_seconds"] = program.compile_seconds
        self._summary["executable_source"] = source
        if self._loaded and "variables" in self._loaded:
            self._host_weights.update(self._loaded["variables"])
            opt_state.update(self._loaded["optimizer_state"])
        self._host_opt_state = opt_state
        self._key = self._program.put(self._key)
        self._host_in_sync = True
        self._dev = None
        if loadEngine:
            self._load_engine()

    def _load_engine(self) -> None:
        """Put the host weights and optimizer state on the device."""
        self._dev = (self._put(self._host_weights), self._put(self._host_opt_state))
        self._host_in_sync = True
        _log.getLogger("devicex").info("Engine loaded")

    def _device_to_host(self, which: int) -> dict:
        """The device weights (0) or optimizer state (1) as host arrays by tensor id."""
        return self._program.state_to_host(self._device_state()[which])

    def _device_state(self) -> tuple:
        """(weights, optimizer state) on the device, loading the engine if it is not."""
        if self._dev is None:
            self._load_engine()
        return self._dev

    def _engine_cache(self, ignore_loaded: bool = False) -> Optional[EngineCache]:
        """SessionOptions.enableEngineCaching + cachePath (or POPART_CACHE_DIR): this
        session's entry, unless it runs a loaded executable."""
        o = self.options
        if (self._loaded and not ignore_loaded) or not (o.enableEngineCaching and o.cachePath):
            return None
        return EngineCache(o.cachePath, type(self).__name__, self._signature(),
                           max_bytes=self._file_bytes_bound())

    def _plan(self) -> StepProgram:
        """The session's step program, planned (anchors, trainable weights) but maybe not
        compiled yet."""
        if self._program is None:
            graph = self._graph
            if self._training:
                graph = fuse_softmax_nll(graph, self._loss, self.patterns.isPatternEnabled)
            program = program_class(self.options, self._device)(graph, self._config(), self._input_infos,
                                                                 self._device)
            program.plan()
            self._program = program
        return self._program

    @property
    def _prepared(self) -> bool:
        return self._program is not None and self._program.compiled is not None

    def _put(self, tree: Mapping[str, Any]) -> Any:
        """Weights or optimizer state in the program's device layout."""
        return self._program.put_state(tree)

    def _hyper(self) -> dict:
        if not self._training:
            return {}
        return {k: np.float32(v) for k, v in
                self._optimizer.non_const_feed(self._program.trainable).items()}

    def _require_writable_weights(self, what: str) -> None:
        """A prepared session whose weights may change: PopART freezes an inference session's
        weights when SessionOptions.constantWeights is True (its default)."""
        self._require_prepared(what)
        if not self._training and getattr(self.options, "constantWeights", True):
            how = "" if what == "resetHostWeights" else (
                ". Set `constantWeights` to False in the `SessionOption`s when initialising the "
                "session to enable this behaviour.")
            raise noted(OptionError(f"Cannot call {what} when constantWeights is set{how}"),
                        "SessionOptions.constantWeights is True for this InferenceSession")

    def _require_prepared(self, what: str) -> StepProgram:
        """The compiled program; before prepareDevice, PopART's error for ``what`` where it
        has one (Devicex / Session), the package's otherwise."""
        if not self._prepared:
            hint = f"{what}: the session is not prepared; call prepareDevice() first"
            if what not in _NOT_PREPARED:
                raise popart_exception(hint)
            raise noted(popart_runtime_error(_NOT_PREPARED[what]), hint)
        return self._program

    # ------------------------------------------------------------------ run
    @_serialised
    def initAnchorArrays(self) -> dict[str, np.ndarray]:
        """One NumPy array per anchor, in the shape the AnchorReturnType docs give."""
        self._plan()
        out = {}
        for a in self._dataFlow.anchors():
            shape, dtype = self._anchor_tensor_info(a)
            host = _df.anchor_host_shape(shape, self._dataFlow.art(a), self._dataFlow.batchesPerStep(),
                                         self.accumulationFactor, self.replicationFactor)
            try:
                out[a] = np.zeros(host, dtype=dtype)
            except MemoryError:
                raise OutOfMemoryException(f"initAnchorArrays: anchor '{a}' of shape {host} "
                                           f"({dtype}) does not fit in host memory") from None
        return out

    def _anchor_tensor_info(self, a: str) -> tuple[list, np.dtype]:
        program = self._program
        if a in program.anchor_specs:
            s = program.anchor_specs[a]
            return list(s.shape), np.dtype(s.dtype)
        v = program.init_opt_state()[a]
        return list(v.shape), v.dtype

    def _gather_inputs(self, stepio: Any) -> dict[str, np.ndarray]:
        bps, A, R = self._dataFlow.batchesPerStep(), self.accumulationFactor, self.replicationFactor
        if isinstance(stepio, _df.PyStepIOCallback):
            return self._gather_callback_inputs(stepio)
        inputs = getattr(stepio, "inputs", None)
        if inputs is None:
            raise StepIOError(f"run() expects a popart.PyStepIO or PyStepIOCallback, got "
                              f"{type(stepio).__name__}")
        asserts = getattr(stepio, "runtime_asserts", None)
        offsets = stepio.__dict__.setdefault("offsets", {}) if asserts is False else None
        feeds = {}
        for tid, info in self._input_infos.items():
            if tid not in inputs:
                raise StepIOError(
                    f"Input tensor '{tid}' is missing from the StepIO: expected an array of shape "
                    f"{shape_str(_df.input_host_shape(info.shape(), bps, A, R))} and dtype "
                    f"{info.data_type()}; the StepIO has inputs {sorted(inputs)}")
            _df.check_contiguous(inputs[tid], _df.noncontiguous_input(tid))
            feeds[tid] = _df.validate_input(tid, inputs[tid], info, bps, A, R, asserts is True,
                                            offsets)
        if asserts is not False:   # PopART's runtime asserts (CorrectnessAsserter::checkIn)
            for tid in sorted(set(inputs) - set(self._input_infos)):
                self._check_extra_input(tid, inputs[tid])
        return feeds

    def _check_extra_input(self, tid: str, array: Any) -> None:
        """A StepIO input that is no stream of the model, as PopART's runtime asserts see it:
        an ONNX graph input of the right size (a weight) is ignored; any other tensor of the
        model, or no tensor at all, raises PopART's error."""
        onnx_inputs = {v.name for v in self._proto.graph.input}
        if tid in self._infos:
            if tid not in onnx_inputs:
                raise StepIOError(f"The tensor '{tid}' has been provided as one of the inputs to "
                                  f"the stepIO, but it is not registered as one of the inputs "
                                  f"to the model. Please check this tensor and your stepIO.")
            bps, A, R = self._dataFlow.batchesPerStep(), self.accumulationFactor, \
                self.replicationFactor
            n = self._infos[tid].nelms()
            if np.size(array) != n * bps * A * R:
                raise StepIOError(
                    f"Unexpected number of input elements for Tensor {tid}. Expected "
                    f"{n * bps * A * R}, but received {np.size(array)}.\nTo disable this check "
                    f"at your own risk, use IStepIO::enableRuntimeAsserts.\nThis with, \n   "
                    f"replication  factor = {R}\n   accumulation factor = {A}\n   batches per "
                    f"step    = {bps}\n   Tensor nelms        = {n}")
        elif tid in onnx_inputs:
            _logger.warn(f"The input Tensor {tid} to the ONNX Model does not appear in the "
                         f"optimized PopART Ir, possibly due to constant folding. Therefore, the "
                         f"input buffer provided will not be used. ")
        else:
            raise noted(StepIOError(f"Testing that the buffer provided by user for input Tensor "
                                    f"{tid} has the correct number of elements, But there is no "
                                    f"Tensor named {tid} in the Ir's main Graph, and it does not "
                                    f"exist in the original ONNX Model."),
                        f"The model's inputs are {sorted(self._input_infos)}")

    def _synthetic_feeds(self) -> Optional[dict[str, np.ndarray]]:
        """SessionOptions.syntheticDataMode (Ir::useSyntheticData): None when Off; else
        every input's data, made once (Ir::registerInputTensors) and used for every
        micro-batch, the StepIO's inputs ignored and no anchor written: zeros, standard
        normal or uniform over the type's range (floats: float16's +-65504, else float32's),
        from a fixed generator (not bit-equal to PopART's mt19937 draws)."""
        mode = getattr(self.options, "syntheticDataMode", None)
        mode = getattr(mode, "name", "Off")
        if mode == "Off":
            return None
        if getattr(self, "_synthetic", None) is None:
            bps, A, R = self._dataFlow.batchesPerStep(), self.accumulationFactor, \
                self.replicationFactor
            rng = np.random.default_rng(0)
            feeds = {}
            for tid, info in self._input_infos.items():
                shape, dtype = info.shape(), info.np_dtype()
                if mode == "Zeros":
                    one = np.zeros(shape, dtype)
                elif mode == "RandomNormal":
                    one = rng.standard_normal(shape).astype(dtype)
                elif np.issubdtype(dtype, np.floating):
                    top = 65504.0 if dtype == np.float16 else float(np.finfo(np.float32).max)
                    one = rng.uniform(-top, top, shape).astype(dtype)
                elif dtype == np.bool_:
                    one = rng.integers(0, 2, shape).astype(dtype)
                else:
                    lim = np.iinfo(dtype)
                    one = rng.integers(lim.min, lim.max, shape, dtype=dtype, endpoint=True)
                feeds[tid] = np.broadcast_to(one, (bps, A, R, *shape))
            self._synthetic = feeds
        return self._synthetic

    def _gather_callback_inputs(self, cb: Any) -> dict[str, np.ndarray]:
        bps, A, R = self._dataFlow.batchesPerStep(), self.accumulationFactor, self.replicationFactor
        feeds = {}
        for tid, info in self._input_infos.items():
            parts = []
            for _ in range(bps * A):
                arr = cb.input_callback(tid, False)
                _df.check_contiguous(arr, _df.noncontiguous_input(tid))
                arr = np.asarray(arr)
                cb.input_complete_callback(tid)
                parts.append(_df.validate_input(tid, arr, info, 1, 1, R, False)[0, 0])
            feeds[tid] = np.stack(parts).reshape((bps, A, R, *info.shape()))
        return feeds

    def run(self, *args: Any, **kwargs: Any) -> None:
        """``run(stepio, debugName="")`` runs batchesPerStep batches: one call into the
        compiled program. ``run(programHandle, stepio, debugName="")`` runs a named program:
        the session's programs are its main step only (PopART's custom programs,
        "implicitPipeliningFwdOnly" and "copyNamedBuffers", are not built here).
        Serialised as the other methods (see the class docstring); the 64-bit JAX scope is
        left out where a planned run moves no 64-bit host data (``RunPlan.x64``)."""
        with self._lock:
            plan = self._run_plan
            if plan is not None and not plan.x64 and plan.program is self._program \
                    and self._dev is not None and len(args) == 1 and not kwargs:
                return self._run(args, kwargs)
            with x64():
                return self._run(args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> None:
        handle, stepio, debugName = _run_arguments(args, kwargs)
        if handle is not None:
            self._run_forward_only(handle, stepio, debugName)
            return
        plan = self._run_plan   # the per-call work, planned once per program and optimizer
        if plan is None or plan.program is not self._program:
            if getattr(self._device, "offline", False):
                raise noted(popart_runtime_error(
                    "Offline IPU device is not configured for execution"),
                            f"Session '{self.name}' was compiled for an offline device, which "
                            f"cannot run programs; use createCpuDevice(), createIpuModelDevice() "
                            f"or acquireAvailableDevice()")
            self._require_weights_written()
            if not self._prepared:
                self.prepareDevice()
            plan = self._run_plan = RunPlan(self)
        else:   # a planned session: prepared, on a device that runs programs
            self._require_weights_written()
        synthetic = plan.synthetic
        fast = False
        if synthetic is not None:
            feeds, outs = synthetic, {}
        else:   # the plan's checks, else the general path (PopART's errors)
            feeds = plan.feeds(stepio)
            if feeds is None:
                feeds = self._gather_inputs(stepio)
            outs = plan.outputs(stepio, self._stream_callbacks)
            fast = outs is not None
            if not fast:
                outs = self._check_outputs(stepio)
        weights, opt_state = self._device_state()
        t0 = time.perf_counter()
        weights, opt_state, self._key, anchors = self._program.run(
            weights, opt_state, self._key, feeds, plan.hyper, placed_hyper=True)
        self._dev = (weights, opt_state)
        if fast:
            plan.write(outs, anchors)   # raises a failed run-time check first
        else:
            self._program.raise_failed_checks(anchors)   # e.g. an index out of range
            if synthetic is None:   # synthetic data: nothing streams to or from the host
                self._write_anchors(stepio, outs, {**anchors, **self._host_anchor_values()})
        self._summary["last_run_seconds"] = time.perf_counter() - t0
        if self._training:
            self._host_in_sync = False

    def _require_weights_written(self) -> None:
        """Session::run: a training session whose model has initializers needs
        weightsFromHost first (after construction and after resetHostWeights)."""
        if self._training and not self._weights_written and len(self._proto.graph.initializer):
            raise noted(popart_runtime_error("Must call weightsFromHost before run as the model "
                                             "has initializers and the session has been created "
                                             "in training mode"),
                        "Call session.weightsFromHost() after prepareDevice()")

    def _run_forward_only(self, handle: str, stepio: Any, debugName: str) -> None:
        """``run("implicitPipeliningFwdOnly", stepio)``: the forward pass of a pipelined
        TrainingSession made with ``createImplicitPipeliningFwdOnlyProgram``, on the current
        weights (nothing is trained; gradient and optimizer-state anchors are not written).
        PopART's only other program, "copyNamedBuffers", is not built here."""
        if handle != FWD_ONLY_PROGRAM or not (
                self._training and getattr(self.options, "createImplicitPipeliningFwdOnlyProgram", False)):
            raise popart_exception(f"[Devicex::run] Program {handle} not found.")
        self._require_weights_written()
        if not self._prepared:
            self.prepareDevice()
        if self._fwd_program is None:
            train = self._program
            skip = set(train.opt_state_ids()) | set(train.als_anchors)
            anchors = {a: art for a, art in train.cfg.anchors.items()
                       if not a.startswith(GRAD_PREFIX) and a not in skip}
            cfg = dataclasses.replace(train.cfg, training=False, loss=None, optimizer=None,
                                      als=None, anchors=anchors)
            program = type(train)(self._graph, cfg, self._input_infos, self._device)
            program.plan()
            program.share_state_layout(train)   # it runs on the training program's weights
            with jax.default_device(self._jax_device()):
                program.compile(self._host_weights, {}, self._key, {})
            self._fwd_program = program
        feeds = self._gather_inputs(stepio)
        outs = self._check_outputs(stepio)
        weights, opt_state = self._device_state()
        with jax.default_device(self._jax_device()):
            weights, _, self._key, anchors = self._fwd_program.run(weights, {}, self._key, feeds, {})
            self._dev = (weights, opt_state)
            self._fwd_program.raise_failed_checks(anchors)
            self._write_anchors(stepio, outs, anchors)
        _logger.debug(f"run {handle!r} {debugName!r} done")

    def _check_outputs(self, stepio: Any) -> dict:
        if isinstance(stepio, _df.PyStepIOCallback):
            return {}
        outs = getattr(stepio, "outputs", {}) or {}
        for a in self._dataFlow.anchors():
            if a not in outs:
                raise StepIOError(f"Anchor '{a}' has no output array in the StepIO; use "
                                  f"session.initAnchorArrays() to create them")
            _df.check_contiguous(outs[a], _df.noncontiguous_output(a))
            _check_anchor_dtype(a, outs[a], self._anchor_tensor_info(a)[1])
        return outs

    def _write_anchors(self, stepio: Any, outs: dict, anchors: dict) -> None:
        bps, A, R = self._dataFlow.batchesPerStep(), self.accumulationFactor, self.replicationFactor
        offset = distributed.process_index() * R
        for a, val in anchors.items():
            art = self._dataFlow.art(a)
            val = self._program.to_host(val)
            if self._program.cfg.replication_factor != R:   # global replication: our replicas
                axis = _df.device_lead_dims(art) - 1
                val = np.take(val, range(offset, offset + R), axis=axis)
            shape = list(val.shape[_df.device_lead_dims(art):])
            if a in self._stream_callbacks:   # one replica's values, as PopART streams them
                callback, index = self._stream_callbacks[a]
                one = np.take(val, index, axis=_df.device_lead_dims(art) - 1) if R > 1 else val
                callback(one.reshape(_df.anchor_host_shape(shape, art, bps, A, 1)))
            host = _df.anchor_host_shape(shape, art, bps, A, R)
            val = val.reshape(host)
            if isinstance(stepio, _df.PyStepIOCallback):
                self._write_callback_anchor(stepio, a, val)
                continue
            dst = outs[a]
            if not isinstance(dst, np.ndarray) or dst.size != val.size:
                raise StepIOError(f"Output array for anchor '{a}' has shape "
                                  f"{shape_str(np.shape(dst))}; expected {shape_str(host)}")
            np.copyto(dst, val.reshape(dst.shape), casting="unsafe")

    def _host_anchor_values(self) -> dict[str, np.ndarray]:
        """Anchors of the optimizer's scalar tensors (``program.optimizer_scalars``), from
        the session's current optimizer, in the step's layout [B, A, R] (ALL / EVERYN) or
        [R] (FINAL / SUM: the value, PopART's sum of one value per micro-batch for SUM)."""
        program = self._program
        if not program.host_anchors:
            return {}
        values = program._scalar_values(self._optimizer)
        B, A, R = self._dataFlow.batchesPerStep(), self.accumulationFactor, \
            program.cfg.replication_factor   # every replica's, as the step's anchors
        out = {}
        for a in program.host_anchors:
            art = self._dataFlow.art(a).id().name
            v = np.float32(values[a]) * (B * A if art == "Sum" else 1)
            lead = (R,) if art in ("Final", "Sum") else \
                ((B // self._dataFlow.art(a).rp() if art == "EveryN" else B), A, R)
            out[a] = np.full(lead, v, program.anchor_specs[a].dtype)
        return out

    def _write_callback_anchor(self, cb: Any, a: str, val: np.ndarray) -> None:
        flat = val.reshape((-1,) + val.shape[-len(self._anchor_tensor_info(a)[0]):]) \
            if self._anchor_tensor_info(a)[0] else val.reshape(-1)
        for part in flat:
            dst = cb.output_callback(a)
            _df.check_contiguous(dst, _df.noncontiguous_output(a))
            _check_anchor_dtype(a, dst, val.dtype)
            np.copyto(dst, np.asarray(part).reshape(np.shape(dst)), casting="unsafe")
            cb.output_complete_callback(a)

    # ------------------------------------------------------------------ weights
    @_serialised
    def weightsFromHost(self) -> None:
        """Copy the host weights to the device."""
        self._require_prepared("weightsFromHost")
        self._dev = (self._put(self._host_weights), self._device_state()[1])
        self._host_in_sync = True
        self._weights_written = True

    @_serialised
    def weightsToHost(self) -> None:
        """Copy the device weights to the host."""
        self._require_prepared("weightsToHost")
        if self._dev is None:   # engine not loaded: the host values are the latest
            return
        self._host_weights = self._device_to_host(0)
        self._host_opt_state = self._device_to_host(1)
        self._host_in_sync = True

    def areHostWeightsInSync(self) -> bool:
        return self._host_in_sync

    @_serialised
    def readWeights(self, weightsIo: Any) -> None:
        """Copy host weights (and optimizer state) into the arrays of a PyWeightsIO."""
        self._require_prepared("readWeights")
        state = getattr(self, "_host_opt_state", None) or self._device_to_host(1)
        for tid, dst in _weights_dict(weightsIo).items():
            src = self._host_weights.get(tid, state.get(tid))
            if src is None:
                raise WeightsIOError(f"readWeights: '{tid}' is not a weight or optimizer state "
                                     f"tensor of the session (weights: "
                                     f"{sorted(self._host_weights)})")
            _copy_checked(tid, dst, src)

    @_serialised
    def writeWeights(self, weightsIo: Any) -> None:
        """Write the arrays of a PyWeightsIO to the host weights (and the device)."""
        self._require_writable_weights("writeWeights")
        opt = self._device_to_host(1)
        for tid, src in _weights_dict(weightsIo).items():
            target = self._host_weights if tid in self._host_weights else opt if tid in opt else None
            if target is None:
                raise WeightsIOError(f"writeWeights: '{tid}' is not a weight of the session "
                                     f"(weights: {sorted(self._host_weights)})")
            if np.shape(src) != target[tid].shape:
                want, got = list(target[tid].shape), list(np.shape(src))
                raise WeightsIOError(
                    f"The shape of the MutableVoidData for IO does not not match the expected "
                    f"write region of this tensor. Tensor Write ({len(want)}): {want} != "
                    f"MutableVoidData ({len(got)}): {got} (writeWeights: '{tid}' has shape "
                    f"{shape_str(want)}, given {shape_str(got)})")
            target[tid] = np.asarray(src, dtype=target[tid].dtype).copy()
        self._dev = (self._put(self._host_weights), self._put(opt))

    @_serialised
    def resetHostWeights(self, modelProtoOrFilename: ModelLike,
                         ignoreWeightsInModelWithoutCorrespondingHostWeight: bool = False) -> None:
        """Replace the host weights, and optimizer state saved with them (modelToHost of a
        training session), with the initializers of another model (a file, bytes or a
        ModelProto; external and sparse data read as for a session's model); weightsFromHost
        then puts the weights on the device (optimizer state goes there now). As PopART's
        (executablex.cpp resetWeights): an initializer the session has no tensor for is an
        error unless ``ignoreWeightsInModelWithoutCorrespondingHostWeight``, one whose type or
        shape differs always is; nothing changes when one is raised. Saved optimizer state
        this session has none of (an inference session) is skipped."""
        self._require_writable_weights("resetHostWeights")
        proto, base = load_model(modelProtoOrFilename)
        state = getattr(self, "_host_opt_state", None) or {}
        new_weights, new_state = {}, {}
        tensors = [(t.name, t, tensor_to_numpy) for t in proto.graph.initializer] + \
            [(s.values.name, s, sparse_to_numpy) for s in proto.graph.sparse_initializer]
        for name, t, to_numpy in tensors:
            target = (new_weights if name in self._host_weights else
                      new_state if name in state else None)
            if target is None:
                if (name in self._program.constants or name.startswith(OPTIMIZER_STATE_PREFIXES)
                        or ignoreWeightsInModelWithoutCorrespondingHostWeight):
                    continue
                raise noted(popart_runtime_error(f"resetWeights, no tensor '{name}' in tensors"),
                            f"The given model's initializer '{name}' is no weight or optimizer "
                            f"state of the session (pass "
                            f"ignoreWeightsInModelWithoutCorrespondingHostWeight=True to skip "
                            f"such)")
            val = to_numpy(t, base)
            cur = self._host_weights[name] if target is new_weights else np.asarray(state[name])
            if val.shape != cur.shape or val.dtype != cur.dtype:
                raise noted(popart_runtime_error(f"Trying to reset weights using tensor with non "
                                                 f"matching tensor info. Tensor ID: {name}"),
                            f"{val.dtype}{shape_str(val.shape)} in the given model, "
                            f"{cur.dtype}{shape_str(cur.shape)} in the session")
            target[name] = val.copy()
        self._host_weights.update(new_weights)
        if new_state:
            self._host_opt_state = {**state, **new_state}
            if self._dev is not None:
                self._dev = (self._dev[0], self._put(self._host_opt_state))
        self._host_in_sync = False
        self._weights_written = False   # PopART: they must be written to the device again

    @_serialised
    def modelToHost(self, fn: str) -> None:
        """Write the model with the current weights to the ONNX file ``fn`` (atomically), as
        PopART's Session::modelToHost:

        * every initializer keeps the storage form it came in (``raw_data``, a typed field
          such as ``float_data`` / ``int32_data``, sparse, or external); one whose value did
          not change keeps its bytes;
        * external data is written back to its file, at the offsets the model gives (each
          file rewritten atomically, any other bytes in it kept). An absolute location is
          that file, as in PopART; a relative one is relative to ``fn``'s folder, as ONNX
          reads it, so that ``fn`` loads from anywhere: the file the session read when ``fn``
          is in the model's folder (the working directory for a model given in memory), a
          copy of it with the new values otherwise;
        * a training session adds its optimizer state as initializers (PopART's additional
          model-proto tensors: ``Accl___<w>``, ``Accl1___<w>``, ``Step___<w>``, ...), in its
          weight's external file, after the data already there, when the weight is external.
          A session made from such a model starts from that state."""
        self._require_prepared("modelToHost")
        self.weightsToHost()
        model = self.model_proto()
        values = self._current_values()
        folder = os.path.dirname(os.path.abspath(fn))
        if not os.path.isdir(folder):
            raise popart_exception(f"modelToHost: cannot write '{fn}': folder '{folder}' does "
                                   f"not exist")
        external: dict[str, list] = {}
        for t in model.graph.initializer:
            if is_external(t):
                external.setdefault(external_info(t).get("location", ""), []).append(t)
        sources = self._ext_sources()
        for location, tensors in external.items():
            target = self._external_path(location, folder)
            source = sources.get(location)
            source = source if source and os.path.isfile(source) else None
            writes = []
            for t in tensors:
                info = external_info(t)
                if t.name in values:
                    raw = numpy_helper.from_array(np.asarray(values[t.name])).raw_data
                    if "length" in info and int(info["length"]) != len(raw):
                        raise popart_exception(
                            f"modelToHost: initializer '{t.name}' takes {len(raw)} bytes, its "
                            f"external data entry says {info['length']}")
                    writes.append((int(info.get("offset", 0)), raw))
                elif source is None:
                    raise popart_exception(f"Trying to update initializer {t.name}, stored in file "
                                           f"{location}, when writing modelToHost. Failed to open "
                                           f"file: the file the session read it from is gone")
            if not os.path.isdir(os.path.dirname(os.path.abspath(target))):
                raise popart_exception(f"Trying to update initializer {tensors[0].name}, stored in "
                                       f"file {location}, when writing modelToHost. Failed to open "
                                       f"file: the folder of '{target}' does not exist")
            atomic_patch(target, writes, base=source)
            note_own_file(target)
        atomic_write(fn, model.SerializeToString())

    @_serialised
    def model_proto(self) -> onnx.ModelProto:
        """The session's model with its host weights (and, once prepared, a training
        session's optimizer state) as initializers, each in the storage form it came in;
        external ones refer to their files, which modelToHost writes."""
        model = onnx.ModelProto()
        model.CopyFrom(self._saved_model())
        values = self._current_values()
        for t in model.graph.initializer:
            if t.name in values and not is_external(t):
                _Session._store_like(t, values[t.name])
        for sp in model.graph.sparse_initializer:
            if sp.values.name in values and not is_external(sp.values) \
                    and not is_external(sp.indices):
                _Session._store_sparse_like(sp, values[sp.values.name])
        return model

    def _current_values(self) -> dict:
        """Host values by id: the weights and (training, once prepared) optimizer state."""
        return {**(getattr(self, "_host_opt_state", None) or {}), **self._host_weights}

    def _ext_sources(self) -> dict:
        """Location -> the file the session's external data for it is in (what the import
        read, then what updateExternallySavedTensorLocations wrote)."""
        if getattr(self, "_ext_files", None) is None:
            files = external_sources(self._graph)
            for t in self._proto.graph.initializer:   # not recorded: resolved as the import does
                loc = external_info(t).get("location", "") if is_external(t) else None
                if loc is not None and loc not in files:
                    try:
                        files[loc] = external_data_path(t, self._base_dir)
                    except popart_exception:
                        pass
            self._ext_files = files
        return self._ext_files

    def _saved_model(self) -> onnx.ModelProto:
        """The model modelToHost writes (PopART's Ir model): the session's, with external
        locations as updateExternallySavedTensorLocations moved them and, once a training
        session is prepared, its optimizer state as further initializers (PopART's
        Ir::addAdditionalModelProtoTensors): external, after the data already in its weight's
        file, when the weight is external, else in ``raw_data``. Their offsets are decided
        once, so every modelToHost writes the same layout."""
        if getattr(self, "_out_model", None) is not None:
            return self._out_model
        if not self._prepared:
            return self._proto
        model = onnx.ModelProto()
        model.CopyFrom(self._proto)
        inits = {t.name: t for t in model.graph.initializer}
        sparse = {sp.values.name for sp in model.graph.sparse_initializer}
        ends: dict[str, int] = {}
        for t in model.graph.initializer:
            if is_external(t):
                info = external_info(t)
                end = int(info.get("offset", 0)) + int(info.get("length", 0))
                ends[info.get("location", "")] = max(ends.get(info.get("location", ""), 0), end)
        sources = self._ext_sources()
        for loc in ends:
            src = sources.get(loc)
            if src and os.path.isfile(src):
                ends[loc] = max(ends[loc], os.path.getsize(src))
        order = {name: k for k, name in enumerate(list(inits) + sorted(sparse))}
        state = []   # by prefix, then weight (the layout PopART's tests read back)
        for sid, value in (getattr(self, "_host_opt_state", None) or {}).items():
            prefix = next((p for p in OPTIMIZER_STATE_PREFIXES if sid.startswith(p)), None)
            if prefix is not None:
                state.append((OPTIMIZER_STATE_PREFIXES.index(prefix),
                              order.get(sid[len(prefix):], -1), sid, prefix, value))
        for _, _, sid, prefix, value in sorted(state, key=lambda e: e[:3]):
            base = sid[len(prefix):]
            if (base not in inits and base not in sparse) or sid in inits or sid in sparse:
                continue
            weight = inits.get(base)
            t = initializer_proto(value, sid)   # PopART's typed field, as its Builder's
            if weight is not None and is_external(weight):
                loc = external_info(weight).get("location", "")
                set_external(t, loc, ends[loc], len(raw_bytes(t)))
                ends[loc] += int(external_info(t)["length"])
            model.graph.initializer.append(t)
            inits[sid] = t
        self._out_model = model
        return model

    _TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                     "string_data")

    @staticmethod
    def _store_like(t: onnx.TensorProto, value: Any) -> None:
        """Tensor ``t``'s data := ``value``, in ``t``'s storage form (``raw_data`` stays
        ``raw_data``, otherwise PopART's typed field, ``fileio.initializer_proto``);
        unchanged when the value is."""
        value = np.asarray(value)
        try:
            old = tensor_to_numpy(t, None)
        except popart_exception:
            old = None
        if old is not None:
            value = value.astype(old.dtype, copy=False)
            if old.shape == value.shape and old.tobytes() == np.ascontiguousarray(value).tobytes():
                return
        if t.HasField("raw_data"):
            t.raw_data = numpy_helper.from_array(value, t.name).raw_data
            return
        new = initializer_proto(value, t.name)   # PopART's typed field, one value per entry
        for f in _Session._TYPED_FIELDS:
            t.ClearField(f)
            getattr(t, f).extend(getattr(new, f))

    @staticmethod
    def _store_sparse_like(sp: onnx.SparseTensorProto, value: Any) -> None:
        """A sparse initializer := ``value`` (its non-zeros), its indices in the layout they
        had (linear or coordinates), its values in their storage form; unchanged when the
        value is."""
        value = np.asarray(value)
        try:
            old = sparse_to_numpy(sp, None)
            if old.shape == value.shape and old.tobytes() == \
                    np.ascontiguousarray(value.astype(old.dtype, copy=False)).tobytes():
                return
            value = value.astype(old.dtype, copy=False)
        except popart_exception:
            pass
        flat = np.flatnonzero(value.reshape(-1))
        vals = value.reshape(-1)[flat]
        idx = np.stack(np.unravel_index(flat, value.shape), axis=1) \
            if len(sp.indices.dims) == 2 else flat
        typed = not sp.values.HasField("raw_data") and \
            any(len(getattr(sp.values, f)) for f in _Session._TYPED_FIELDS)
        new = (initializer_proto(vals, sp.values.name) if typed
               else numpy_helper.from_array(vals, sp.values.name))
        sp.values.CopyFrom(new)
        sp.indices.CopyFrom(numpy_helper.from_array(idx.astype(np.int64), sp.indices.name))

    # ------------------------------------------------------------------ IR, reports, sync state
    def getIr(self) -> SessionIr:
        """A view of the session's IR (graph, data flow, options, patterns)."""
        return SessionIr(self)

    @_serialised
    def _serializeIr(self, format: Any = IrSerializationFormat.JSON) -> str:
        """The session's IR as PopART's JSON (see ``popart.session_ir``)."""
        if format != IrSerializationFormat.JSON:
            raise popart_exception(f"_serializeIr: format must be IrSerializationFormat.JSON, got {format!r}")
        program = self._plan()
        infos = dict(self._infos)
        training = None
        if self._training:
            training = {"loss": self._loss, "trainable": program.trainable, "optimizer": self._optimizer,
                        "program": program, "options": self.options}
        name = self._proto.graph.name
        main = name if name and not name.startswith("BuilderGraph") else "maingraph"
        return serialize_ir(self._graph, infos, main, training)

    def _compiled(self, what: str) -> Any:
        return self._require_prepared(what).compiled

    @_serialised
    def getReport(self) -> str:
        """What XLA knows of the compiled program, as JSON: per device its FLOPs, bytes
        accessed, argument / output / temporary / code sizes, and the compile time."""
        compiled = self._compiled("getReport")
        try:
            cost = compiled.cost_analysis() or {}
        except Exception:   # a backend without cost analysis
            cost = {}
        cost = cost[0] if isinstance(cost, list) and cost else cost
        mem = compiled.memory_analysis()
        sizes = {k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in
                 ("argument", "output", "temp", "alias", "generated_code")} if mem is not None else {}
        program = self._program
        devices = program.placement.devices or [program.placement.device]
        per_device = {"flops": float(cost.get("flops", 0.0)),
                      "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                      **{f"{k}_bytes": v for k, v in sizes.items()}}
        return json.dumps({"session": self.name, "compile_seconds": program.compile_seconds,
                           "executable_source": self._summary.get("executable_source"),
                           "replication_factor": self.replicationFactor,
                           "devices": [{"device": str(d), "platform": d.platform, **per_device}
                                       for d in devices]})

    @_serialised
    def getSerializedGraph(self) -> bytes:
        """The compiled program's text (XLA's optimised HLO module)."""
        return self._compiled("getSerializedGraph").as_text().encode()

    def checkInplacingAmbiguity(self) -> None:
        """PopART checks that its in-place ops leave no ambiguous aliasing. XLA programs have
        value semantics (buffers are aliased only by XLA's own analysis), so no model can
        have such an ambiguity: the check always passes."""
        _logger.debug(f"checkInplacingAmbiguity '{self.name}': no in-place aliasing on XLA")

    @_serialised
    def loadEngineAndConnectStreams(self) -> None:
        """Load the compiled program and the weights onto the device (prepareDevice does
        this unless given loadEngine=False; run() does it when needed)."""
        self._require_prepared("loadEngineAndConnectStreams")
        if self._dev is None:
            self._load_engine()

    def setEngineIsLoaded(self, isLoaded: bool) -> None:
        """Mark the engine loaded or not: a session whose engine is not loaded loads it (and
        the host weights) before its next run."""
        if not isLoaded:
            if self._dev is not None:
                self.weightsToHost()   # nothing of the device's state is lost
            self._dev = None
        elif self._dev is None:
            self.loadEngineAndConnectStreams()

    @_serialised
    def copyDeviceWeightsToHost(self) -> None:
        """Copy the device's weights to the host (weightsToHost)."""
        self.weightsToHost()

    def markHostWeightsInSync(self) -> None:
        """Declare the host weights equal to the device's (the next weightsToHost copies nothing)."""
        self._host_in_sync = True

    def markHostWeightsOutOfSync(self) -> None:
        """Declare the device's weights newer than the host's."""
        self._host_in_sync = False

    @_serialised
    def saveVariables(self, path: str) -> None:
        """Save the variables (weights and optimizer state) to one file, written atomically;
        a directory gets ``<path>/variables.popef``. ``loadVariables``-style reading is
        ``resetHostWeights`` for ONNX files; this file is an .npz (``var/<id>``, ``opt/<id>``)."""
        self._require_prepared("saveVariables")
        if os.path.isdir(path):
            path = os.path.join(path, "variables.popef")
        self.weightsToHost()
        arrays = {**{"var/" + k: v for k, v in self._host_weights.items()},
                  **{"opt/" + k: v for k, v in self._host_opt_state.items()}}
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write(path, buf.getvalue())

    @_serialised
    def updateEngineCache(self) -> None:
        """Write the compiled program to this session's engine-cache entry (with
        enableEngineCaching and cachePath), replacing an older one."""
        self._require_prepared("updateEngineCache")
        cache = self._engine_cache(ignore_loaded=True)
        if cache is None:
            raise popart_exception("updateEngineCache: engine caching is off; set "
                                   "SessionOptions.enableEngineCaching = True and cachePath")
        cache.store(self._program.export())

    @_serialised
    def updateExternallySavedTensorLocations(self, fromLocation: str, toLocation: str) -> None:
        """Tensors of the model saved externally in ``fromLocation`` are from now on saved in
        ``toLocation``, which must not exist: it is written now with their current values
        (one after the other), and modelToHost writes the model referring to it. A relative
        ``toLocation`` is relative to the working directory, where PopART writes it
        (session.cpp). PopART's errors: ``toLocation`` already exists; no
        initializer is saved in ``fromLocation``. As PopART's, it may be called before
        prepareDevice (the file then gets the model's values)."""
        if os.path.exists(self._external_path(toLocation, os.getcwd())):
            raise popart_runtime_error(f"Updating externally saved tensor location from file "
                                       f"'{fromLocation}' to file '{toLocation}', but file "
                                       f"'{toLocation}' already exists")
        moved = [t for t in self._saved_model().graph.initializer
                 if is_external(t) and external_info(t).get("location") == fromLocation]
        if not moved:
            if not os.path.exists(self._external_path(fromLocation)):
                raise noted(popart_runtime_error(f"Updating externally saved tensor location "
                                                 f"from file '{fromLocation}' to file "
                                                 f"'{toLocation}', but file '{fromLocation}' does "
                                                 f"not exist"),
                            f"'{fromLocation}': no tensor of the model is saved externally there")
            raise noted(popart_runtime_error(f"No ONNX model initializers have external "
                                             f"location set to '{fromLocation}'"),
                        f"'{fromLocation}': no tensor of the model is saved externally there")
        if self._prepared:
            self.weightsToHost()
        self._write_external(toLocation, moved, os.getcwd())

    def _external_path(self, location: str, folder: Optional[str] = None) -> str:
        """The file a relative ``location`` names in ``folder`` (default: the model's folder,
        the working directory for a model given in memory); an absolute one as it is."""
        folder = folder or self._base_dir or os.getcwd()
        return location if os.path.isabs(location) else os.path.join(folder, location)

    def _write_external(self, location: str, tensors: list, folder: Optional[str] = None) -> None:
        """Write ``tensors``' host values (the file's bytes for those without) to
        ``location`` (atomically), one after another, and point their external_data there
        (location, length, offset, as PopART)."""
        values, sources = self._current_values(), self._ext_sources()
        chunks, offset = [], 0
        for t in tensors:
            if t.name in values:
                raw = numpy_helper.from_array(np.asarray(values[t.name])).raw_data
            else:
                src = sources.get(external_info(t).get("location", ""))
                raw = read_exact(src, int(external_info(t).get("offset", 0)),
                                 int(external_info(t)["length"])) if src else \
                    raw_bytes(t, self._base_dir)
            chunks.append((t, offset, raw))
            offset += len(raw)
        path = self._external_path(location, folder)
        atomic_write(path, b"".join(raw for _, _, raw in chunks))
        note_own_file(path)
        for t, off, raw in chunks:
            set_external(t, location, off, len(raw))
        sources[location] = os.path.realpath(path)

    # ------------------------------------------------------------------ executables
    def _signature(self) -> dict:
        """What a saved executable or engine-cache entry must agree on with the session
        using it: the model, the configuration and options that shape the compiled program,
        and the versions that compiled it."""
        cfg = self._config()
        return {"model_sha256": hashlib.sha256(self._proto.SerializeToString()).hexdigest(),
                "session": type(self).__name__, "batchesPerStep": cfg.batches_per_step,
                "accumulationFactor": cfg.accumulation_factor,
                "replicationFactor": cfg.replication_factor,
                "anchors": {k: repr(v) for k, v in cfg.anchors.items()},
                "inputs": {k: [v.data_type(), v.shape()] for k, v in self._input_infos.items()},
                "loss": cfg.loss, "optimizer": _optimizer_signature(cfg.optimizer),
                "options": _options_signature(self.options),
                "patterns": None if self.patterns is None else canonical(self.patterns.getSettings()),
                **runtime_signature()}

    def _executable_bytes(self, saveVariables: bool) -> bytes:
        """The .popef file: the compiled step, its signature and (optionally) the variables
        and optimizer state."""
        arrays = {}
        if saveVariables:
            self.weightsToHost()
            arrays.update({"var/" + k: v for k, v in self._host_weights.items()})
            arrays.update({"opt/" + k: v for k, v in self._host_opt_state.items()})
        return executable_bytes(self._program.export(), self._signature(), arrays)

    def _saved_arrays(self) -> dict:
        """The arrays an executable file of this session may hold, by name."""
        program = self._plan()
        return {**{"var/" + k: v for k, v in program.variables.items()},
                **{"opt/" + k: v for k, v in program.init_opt_state().items()}}

    def _file_bytes_bound(self, arrays: Optional[Mapping[str, Any]] = None) -> int:
        """The most bytes an executable file of this session may hold (``arrays``: its
        ``_saved_arrays()``, when the caller has them)."""
        arrays = self._saved_arrays() if arrays is None else arrays
        tensors = sum(np.asarray(v).nbytes for v in arrays.values())
        tensors += sum(np.asarray(v).nbytes for v in self._graph.initializers.values())
        return EXECUTABLE_SLACK + 2 * tensors

    def _read_executable(self, filename: str) -> dict:
        """A .popef file's executable and variables, every size bounded by this session's
        tensors and its signature checked (popart_exception naming what differs)."""
        like = self._saved_arrays()
        executable, arrays = read_executable(filename, self._signature(), like,
                                             self._file_bytes_bound(like))
        loaded = {"executable": executable}
        if any(k.startswith("var/") for k in arrays):
            loaded["variables"] = {k[4:]: v for k, v in arrays.items() if k.startswith("var/")}
            loaded["optimizer_state"] = {k[4:]: v for k, v in arrays.items() if k.startswith("opt/")}
        return loaded

    @_serialised
    def saveExecutable(self, path: str, savePopartMetadata: bool = True, saveVariables: bool = True) -> None:
        """Save the compiled step (StableHLO), its signature (see loadExecutable) and
        (optionally) the variables to one file, written atomically; a directory gets
        ``<path>/executable.popef``."""
        self._require_prepared("saveExecutable")
        if os.path.isdir(path):
            path = os.path.join(path, "executable.popef")
        atomic_write(path, self._executable_bytes(saveVariables))

    @_serialised
    def compileAndExport(self, filename: str) -> None:
        """Compile the step and export it (with metadata and variables) to ``filename``
        (``~`` expanded; its folder made first, as PopART's, OSError if it is not writable)."""
        filename = os.path.expanduser(filename)
        makedirsAndCheckWritable(filename if os.path.isdir(filename) else
                                 os.path.dirname(os.path.abspath(filename)))
        self.prepareDevice(loadEngine=False)
        self.saveExecutable(filename)

    @_serialised
    def loadExecutable(self, filename: str) -> None:
        """Use the executable saved by saveExecutable / compileAndExport for this session
        instead of compiling from the IR; its variables, if saved, become the session's
        weights. Call before (or instead of) prepareDevice. The file must have been saved
        for the same model, configuration, program-shaping options, package and JAX
        versions (popart_exception naming what differs), and its sizes must fit the
        session's tensors: nothing larger is read."""
        if os.path.isdir(filename):
            filename = os.path.join(filename, "executable.popef")
        _logger.info(f"Loading serialized PopART executable from {filename}")
        try:
            self._loaded = self._read_executable(filename)
        except popart_exception as e:
            raise popart_exception(f"loadExecutable: {e}") from None
        self.prepareDevice()

    # ------------------------------------------------------------------ info
    @_serialised
    def getInfo(self, id: str) -> TensorInfo:
        if id in self._input_infos:
            return self._input_infos[id]
        infos = self._infos
        if id not in infos:
            raise popart_exception(f"getInfo: '{id}' is not a tensor of the model")
        return infos[id]

    @_serialised
    def getTensorIds(self) -> set[str]:
        ids = set(self._graph.all_tensor_ids())
        if self._training and self._program is not None:
            ids |= {GRAD_PREFIX + w for w in self._program.trainable}
            ids |= set(self._program.init_opt_state())
        return ids

    getAllTensorIds = getTensorIds

    @_serialised
    def setRandomSeed(self, seedValue: int) -> None:
        """Seed the session's random ops: an unsigned 64-bit integer (PopART's uint64_t;
        ArgumentError, a TypeError, for anything else, the seed unchanged)."""
        if isinstance(seedValue, bool) or not isinstance(seedValue, (int, np.integer)) \
                or not 0 <= int(seedValue) < 2 ** 64:
            raise ArgumentError(f"setRandomSeed(): incompatible function arguments: seedValue "
                                f"must be an unsigned 64-bit integer (0 <= seed < 2**64), got "
                                f"{seedValue!r}")
        if not self._requires_random_seed():
            _logger.warn("Trying to set the random seed, but this session has no random "
                         "behaviour. Doing nothing.")
            return
        self._assert_executable_loaded()
        seed = int(seedValue)
        self._set_key(_key_data(seed - 2 ** 64 if seed >= 2 ** 63 else seed))   # int64 bits
        self._seed = seed

    def _set_key(self, key: Any) -> None:
        self._key = self._program.put(key) if self._prepared else key

    def getRandomSeed(self) -> int:
        """The seed last set (Session::getRandomSeed: 0, with a warning, in a session with
        no random behaviour; a prepared session needed otherwise)."""
        if not self._requires_random_seed():
            _logger.warn("Trying to get the random seed, but this session has no random "
                         "behaviour. Doing nothing.")
            return 0
        self._assert_executable_loaded()
        return self._seed

    def _requires_random_seed(self) -> bool:
        """RandomSetup::requiresRandomSeed: the IR has random ops (what the compiled step
        draws, once planned; before that, the graph's random ops: Dropout only when
        training), or enableStochasticRounding."""
        if getattr(self.options, "enableStochasticRounding", False):
            return True
        if self._program is not None:
            return bool(self._program.uses_rng)
        return any(_lookup(g, n).random and (self._training or n.op_type != "Dropout")
                   for g, n in _all_nodes(self._graph))

    def _assert_executable_loaded(self) -> None:
        if not self._prepared:
            raise noted(popart_runtime_error("There is no executatable. Try calling "
                                             "Session::prepareDevice first."),
                        "(PopART's text, its spelling included.) Call prepareDevice() before "
                        "setRandomSeed / getRandomSeed.")

    def _require_rng_state(self, what: str, verb: str) -> None:
        """PopART's checks of get/setRNGState: the option that enables them, then a prepared
        session (before anything changes)."""
        if not getattr(self.options, "enableLoadAndOffloadRNGState", False):
            raise noted(OptionError(f"Trying to {verb} the RNG state, but the session option "
                                    f"enableLoadAndOffloadRNGState must be set to True."),
                        f"{what}: SessionOptions.enableLoadAndOffloadRNGState is False")
        self._require_prepared(what)

    @_serialised
    def getRNGState(self) -> list[int]:
        """The state of the random number generator (enableLoadAndOffloadRNGState, prepared)."""
        self._require_rng_state("getRNGState", "get")
        if getattr(getattr(self.options, "syntheticDataMode", None), "name", "Off") != "Off":
            return []   # Devicex::getRngStateToHost copies nothing with synthetic data
        key = self._key if self._key is not None else _key_data(self._seed)
        return [int(v) for v in np.asarray(key).ravel()]

    @_serialised
    def setRNGState(self, rngValue: Iterable[int]) -> None:
        """Set the random number generator's state (as getRNGState returned it)."""
        self._require_rng_state("setRNGState", "set")
        data = np.asarray(list(rngValue), dtype=np.uint32)
        expected = _key_data(0).shape
        if data.size != int(np.prod(expected)):
            raise popart_exception(f"setRNGState: expected {int(np.prod(expected))} values (as "
                                   f"getRNGState returns), got {data.size}")
        self._set_key(data.reshape(expected))

    @property
    def constantWeights(self) -> bool:
        return bool(getattr(self.options, "constantWeights", True))

    def getSummaryReport(self, resetProfile: bool = True) -> str:
        lines = [f"Session '{self.name}' ({type(self).__name__})",
                 f"  device: {self._device!r}",
                 f"  batchesPerStep={self._dataFlow.batchesPerStep()} accumulationFactor="
                 f"{self.accumulationFactor} replicationFactor={self.replicationFactor}",
                 f"  ops: {len(self._graph.nodes)}  variables: {len(self._host_weights)}"]
        for k, v in self._summary.items():
            lines.append(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
        summary = getattr(self.options, "summary", None)
        if callable(summary):
            lines.append(f"  options differing from default: {summary()}")
        lines += report.summary_lines(self._program.step if self._program else None)
        return "\n".join(lines)

    def getCycleCount(self, id: str = "") -> int:
        raise popart_exception("getCycleCount: there is no cycle counter on XLA devices; "
                               "use getSummaryReport() for timings")

    def __enter__(self) -> "_Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        detach = getattr(self._device, "detach", None)
        if callable(detach):
            detach()


FWD_ONLY_PROGRAM = "implicitPipeliningFwdOnly"   # PopART's custom program handle


def _run_arguments(args: tuple, kwargs: dict) -> tuple:
    """(programHandle or None, stepio, debugName) of ``run``'s two overloads:
    ``(stepio, debugName="")`` and ``(programHandle, stepio, debugName="")``."""
    if len(args) == 1 and not kwargs and not isinstance(args[0], str):
        return None, args[0], ""   # run(stepio): the common call
    names = ("programHandle", "stepio", "debugName")
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"run() got unexpected keyword argument(s) {sorted(unknown)}")
    if (args and isinstance(args[0], str)) or "programHandle" in kwargs:
        bound = dict(zip(names, args), **kwargs)
    else:
        bound = dict(zip(names[1:], args), **kwargs)
    if "stepio" not in bound:
        raise TypeError("run() needs a stepio (a popart.PyStepIO or PyStepIOCallback)")
    if len(args) > 3 or (bound.get("programHandle") is None and len(args) > 2):
        raise TypeError(f"run() takes (stepio, debugName) or (programHandle, stepio, debugName), "
                        f"got {len(args)} positional arguments")
    return bound.get("programHandle"), bound["stepio"], bound.get("debugName", "")


def _weights_dict(weightsIo: Any) -> dict:
    d = getattr(weightsIo, "weights", weightsIo)
    if not isinstance(d, dict):
        raise popart_exception(f"Expected a popart.PyWeightsIO, got {type(weightsIo).__name__}")
    return d


def _check_anchor_dtype(a: str, dst: Any, dtype: np.dtype) -> None:
    """Anchors are written as they are, never cast: the output array must have the tensor's dtype."""
    if isinstance(dst, np.ndarray) and dst.dtype != dtype:
        raise StepIOError(f"Output array for anchor '{a}' has dtype {dst.dtype}, but the tensor is "
                          f"{np.dtype(dtype)}; anchors are not cast (session.initAnchorArrays() "
                          f"creates arrays of the right dtypes)")


def _copy_checked(tid: str, dst: np.ndarray, src: np.ndarray) -> None:
    """Copy a weight into a PyWeightsIO array: C-contiguous, with the weight's element count
    (PopART's hostStreamToHost check, with its message). Unlike PopART, which compares byte
    sizes, an array of another dtype gets the values converted."""
    if not isinstance(dst, np.ndarray):
        raise WeightsIOError(f"Weight '{tid}': the destination must be a NumPy array, got "
                             f"{type(dst).__name__}")
    _df.check_weights_contiguous(tid, dst)
    if dst.size != src.size:
        raise WeightsIOError(
            f"sizes (in bytes) of src ({src.nbytes}) and dst ({dst.nbytes}) differ in "
            f"hostStreamToHost for {tid} (weight '{tid}' is {src.dtype} of shape "
            f"{shape_str(src.shape)}; the destination array is {dst.dtype} of shape "
            f"{shape_str(dst.shape)})")
    np.copyto(dst, src.reshape(dst.shape), casting="unsafe")


# ---------------------------------------------------------------------------------------
# PopART's checks of a program when the session is created (Ir::prepare and the session
# options it reads), raised before anything is traced or compiled.

def _shape_info_ids(isi: Any) -> set:
    """The tensor ids an InputShapeInfo (or a dict id -> TensorInfo) gives shapes for."""
    if isi is None:
        return set()
    if isinstance(isi, Mapping):
        return set(isi)
    return set(getattr(isi, "_infos", None) or getattr(isi, "infos", {}) or {})


def _check_model(proto: onnx.ModelProto, dataFlow: _df.DataFlow, isi: Any, training: bool) -> None:
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


def _num_virtual_graphs(o: Any, device: Any, replicas: int) -> int:
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


def _check_virtual_graph_range(graph: Graph, o: Any, device: Any, replicas: int) -> None:
    """IrLowering's check once the device is known (prepareDevice): every virtual graph id
    names an IPU of the device (per replica)."""
    if o.virtualGraphMode.name == "Off":
        return
    n = _num_virtual_graphs(o, device, replicas)
    for op in _main_ops(graph):
        v = op.annotations.get(VIRTUAL_GRAPH)
        if v is not None and not 0 <= int(v) < n:
            raise IrError(f"{_op_str(graph, op)} has been assigned to an invalid virtual graph "
                          f"{int(v)}. numIPUs = {n}.")


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
    n = _num_virtual_graphs(o, device, replicas)
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


def makedirsAndCheckWritable(path: str) -> None:
    """Make the folder ``path`` (and its parents) if needed; OSError if it is not writable
    (PopART's helper for compileAndExport)."""
    os.makedirs(path, exist_ok=True)
    if not os.access(path, os.W_OK):
        raise OSError(f"Unable to write to {path}")


class InferenceSession(_Session):
    """Session for running inference (reference 13.1.2)."""

    def __init__(self, fnModel: ModelLike, dataFlow: _df.DataFlow, deviceInfo: Any,
                 inputShapeInfo: Optional[_df.InputShapeInfo] = None, patterns: Any = None,
                 userOptions: Optional[SessionOptions] = None, name: str = "inference") -> None:
        super().__init__(fnModel, dataFlow, deviceInfo, inputShapeInfo, patterns, userOptions, name)

    @classmethod
    def fromIr(cls, ir: SessionIr, deviceInfo: Any, name: str = "fromIr") -> "InferenceSession":
        """An InferenceSession for the IR of another session (``session.getIr()``): its
        model with the current host weights, data flow, options, patterns and input shapes
        (a TrainingSession's IR gives its forward pass)."""
        if not isinstance(ir, SessionIr):
            raise popart_exception(f"InferenceSession.fromIr: expected the Ir of a session "
                                   f"(session.getIr()), got {type(ir).__name__}")
        src = ir._session
        shapes = _df.InputShapeInfo()
        for tid, info in src._input_infos.items():
            shapes.add(tid, info)
        options = src.options
        if options.enableGradientAccumulation:   # a training session's: inference has none
            options = copy.copy(options)
            options.enableGradientAccumulation, options.accumulationFactor = False, 1
        return cls(ir.getModel(), src.dataFlow, deviceInfo, shapes, src.patterns,
                   options, name)


class TrainingSession(_Session):
    """Session for training: forward, backward and optimizer update in one program."""

    _training = True

    def __init__(self, fnModel: ModelLike, dataFlow: _df.DataFlow, loss: str, optimizer: Any,
                 deviceInfo: Any, inputShapeInfo: Optional[_df.InputShapeInfo] = None,
                 patterns: Any = None, userOptions: Optional[SessionOptions] = None,
                 name: str = "training") -> None:
        super().__init__(fnModel, dataFlow, deviceInfo, inputShapeInfo, patterns, userOptions,
                         name, loss=loss, optimizer=optimizer)

    @_serialised
    def updateOptimizerFromHost(self, optimizer: Any) -> None:
        """Replace the optimizer's non-const hyper-parameters; no recompilation."""
        trainable = self._program.trainable if self._program else []
        self._optimizer.check_compatible(optimizer, trainable)
        # The compiled program keeps the original optimizer for its const values (which the
        # check guarantees are unchanged); the non-const ones are fed from this one each run.
        self._optimizer = optimizer
        self._run_plan = None   # its values go to the device with the next run

    @_serialised
    def broadcastWeights(self, rootRank: int = 0) -> None:
        """Copy the weights of instance (process) ``rootRank`` to every instance; with one
        instance there is nothing to do."""
        n = distributed.process_count()
        if not 0 <= rootRank < n:
            raise popart_exception(f"broadcastWeights: rootRank {rootRank} does not exist "
                                   f"(there are {n} instance(s))")
        if n == 1:
            return
        from jax.experimental import multihost_utils
        self.weightsToHost()
        self._host_weights = {k: np.asarray(v) for k, v in multihost_utils.broadcast_one_to_all(
            self._host_weights, is_source=distributed.process_index() == rootRank).items()}
        self.weightsFromHost()

    def connectStreamToCallback(self, streamHandle: str, callback: Any, index: int = 0) -> None:
        """After every run, call ``callback(array)`` with replica ``index``'s values of anchor
        ``streamHandle``, shaped as that anchor's host array of one replica."""
        if streamHandle not in self._dataFlow.anchors():
            raise popart_exception(f"connectStreamToCallback: '{streamHandle}' is not an anchor "
                                   f"(anchors: {self._dataFlow.anchors()})")
        if not 0 <= index < self.replicationFactor:
            raise popart_exception(f"connectStreamToCallback: replica index {index} for "
                                   f"'{streamHandle}' does not exist (replicas: 0 to "
                                   f"{self.replicationFactor - 1})")
        self._stream_callbacks[streamHandle] = (callback, index)
