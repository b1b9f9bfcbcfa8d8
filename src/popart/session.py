"""InferenceSession and TrainingSession: compile a graph once, run many batches per call.

The sessions are facades: PopART's methods live here with PopART's names, signatures and
texts, and the work is done by one collaborator each: ``session_checks`` (PopART's checks
at construction), ``session_io.HostIO`` (StepIO gathering, anchors), ``writeback.WriteBack``
(the ONNX model and its external files), ``engine.executable.SessionFiles`` (executable
files, the engine cache), ``session_rng.Rng`` (seed and RNG state), ``session_report``.
PopART's file methods (modelToHost, executables, ...) are grouped in ``_FileMethods``, a
part of ``_Session``."""
from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
from typing import Any, Iterable, Mapping, Optional

import jax
import numpy as np
import onnx

from . import dataflow as _df
from . import distributed
from . import logging as _log
from . import report
from ._ir.onnx_import import ModelLike, import_model
from .engine import in_x64, serialised, x64
from .engine.executable import SessionFiles, state_arrays
from .engine.pipeline import plan_program
from .engine.program import GRAD_PREFIX, StepConfig, StepProgram
from .engine.progress import compile_progress
from .errors import (ArgumentError, OptionError, OutOfMemoryException,  # noqa: F401
                     noted, popart_exception, popart_runtime_error)
from .fileio import atomic_write
from .options import IrSerializationFormat, SessionOptions, SyntheticDataMode
from .patterns import for_session
from .run_plan import RunPlan
from .session_config import anchor_returns, engine_config
from .segmented_session import SegmentedRuns
from .session_checks import (StepTrace, check_argument_types, check_ir, check_model,
                             check_seed_type, check_virtual_graph_range, resolve_inputs)
from .session_io import HostIO, weights_from_io, weights_to_io
from .ir_json import SessionIr, serialize_ir
from .session_report import summary_report, xla_report
from .session_rng import Rng, check_rng_state_enabled, requires_random_seed
from .tensorinfo import TensorInfo
from .writeback import WriteBack, model_weights, save_variables

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


class _FileMethods:
    """PopART's session methods that read or write files: the ONNX model with the current
    weights (``writeback.WriteBack``), variables, executables and the engine cache
    (``engine.executable.SessionFiles``); a part of ``_Session``, which holds the state."""

    @serialised
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
        state = self._host_opt_state
        new_weights, new_state = model_weights(
            modelProtoOrFilename, self._host_weights, state, self._program.constants,
            ignoreWeightsInModelWithoutCorrespondingHostWeight, self._infos)
        self._host_weights.update(new_weights)
        if new_state:
            self._host_opt_state = {**state, **new_state}
            if self._dev is not None:
                self._dev = (self._dev[0], self._put(self._host_opt_state))
        self._host_in_sync = False
        self._weights_written = False   # PopART: they must be written to the device again

    # ------------------------------------------------------------------ ONNX write-back
    @serialised
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
        self._writeback.write(fn, self.model_proto(), self._current_values())

    @serialised
    def model_proto(self) -> onnx.ModelProto:
        """The session's model with its host weights (and, once prepared, a training
        session's optimizer state) as initializers, each in the storage form it came in;
        external ones refer to their files, which modelToHost writes."""
        return self._writeback.model(self._current_values(), self._saved_state())

    def _current_values(self) -> dict:
        """Host values by id: the weights and (training, once prepared) optimizer state."""
        return {**self._host_opt_state, **self._host_weights}

    def _saved_state(self) -> Optional[dict]:
        """The optimizer state modelToHost saves (None before prepareDevice)."""
        return self._host_opt_state if self._prepared else None

    @serialised
    def updateExternallySavedTensorLocations(self, fromLocation: str, toLocation: str) -> None:
        """Tensors of the model saved externally in ``fromLocation`` are from now on saved in
        ``toLocation``, which must not exist: it is written now with their current values
        (one after the other), and modelToHost writes the model referring to it. A relative
        ``toLocation`` is relative to the working directory, where PopART writes it
        (session.cpp). PopART's errors: ``toLocation`` already exists; no
        initializer is saved in ``fromLocation``. As PopART's, it may be called before
        prepareDevice (the file then gets the model's values)."""
        moved = self._writeback.moving(fromLocation, toLocation, self._saved_state())
        if self._prepared:
            self.weightsToHost()
        self._writeback.move(toLocation, moved, self._current_values(), os.getcwd())

    @serialised
    def saveVariables(self, path: str) -> None:
        """Save the variables (weights and optimizer state) to one file, written atomically;
        a directory gets ``<path>/variables.popef``. ``loadVariables``-style reading is
        ``resetHostWeights`` for ONNX files; this file is an .npz (``var/<id>``, ``opt/<id>``)."""
        self._require_prepared("saveVariables")
        self.weightsToHost()
        save_variables(path, self._host_weights, self._host_opt_state)

    # ------------------------------------------------------------------ executables
    def _saved_arrays(self) -> dict:
        """The arrays an executable file of this session may hold, by name."""
        program = self._plan()
        return state_arrays(program.variables, program.init_opt_state())

    def _engine_cache(self, ignore_loaded: bool = False) -> Any:
        """This session's engine-cache entry (``SessionFiles.cache``), unless it runs a
        loaded executable."""
        if self._loaded and not ignore_loaded:
            return None
        return self._files.cache(self._config(), self._saved_arrays)

    def _cache_hit(self) -> bool:
        """Whether the engine cache holds this session's program (PopART's hashMatched)."""
        cache = self._engine_cache()
        return cache is not None and cache.matching_entry() is not None

    @serialised
    def updateEngineCache(self) -> None:
        """Write the compiled program to this session's engine-cache entry (with
        enableEngineCaching and cachePath), replacing an older one."""
        self._require_prepared("updateEngineCache")
        cache = self._engine_cache(ignore_loaded=True)
        if cache is None:
            raise popart_exception("updateEngineCache: engine caching is off; set "
                                   "SessionOptions.enableEngineCaching = True and cachePath")
        cache.store(self._program.export())

    @serialised
    def saveExecutable(self, path: str, savePopartMetadata: bool = True, saveVariables: bool = True) -> None:
        """Save the compiled step (StableHLO), its signature (see loadExecutable) and
        (optionally) the variables to one file, written atomically; a directory gets
        ``<path>/executable.popef``."""
        self._require_prepared("saveExecutable")
        if os.path.isdir(path):
            path = os.path.join(path, "executable.popef")
        arrays = {}
        if saveVariables:
            self.weightsToHost()
            arrays = state_arrays(self._host_weights, self._host_opt_state)
        atomic_write(path, self._files.file_bytes(self._program.export(), self._config(), arrays))

    @serialised
    def compileAndExport(self, filename: str) -> None:
        """Compile the step and export it (with metadata and variables) to ``filename``
        (``~`` expanded; its folder made first, as PopART's, OSError if it is not writable)."""
        filename = os.path.expanduser(filename)
        makedirsAndCheckWritable(filename if os.path.isdir(filename) else
                                 os.path.dirname(os.path.abspath(filename)))
        self.prepareDevice(loadEngine=False)
        self.saveExecutable(filename)

    @serialised
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
            like = self._saved_arrays()
            self._loaded = self._files.read(filename, self._config(), like)
        except popart_exception as e:
            raise popart_exception(f"loadExecutable: {e}") from None
        self.prepareDevice()


class _Session(_FileMethods):
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
        check_argument_types(self._training, fnModel, dataFlow, loss, optimizer, deviceInfo,
                             inputShapeInfo, userOptions, patterns, name)
        if deviceInfo is None:
            raise noted(popart_exception(f"Must pass a valid deviceInfo to "
                                         f"{type(self).__name__}::createFromOnnxModel"),
                        "no device given: pass deviceInfo, for example "
                        "popart.DeviceManager().createCpuDevice()")
        self.name, self._device = name, deviceInfo
        self.patterns = for_session(patterns)
        self._dataFlow = dataFlow
        # a copy, as Ir::setUserOptions: changing userOptions later leaves the session alone
        self.options = copy.copy(userOptions) if userOptions is not None else SessionOptions()
        self._graph, self._proto = import_model(fnModel, inputShapeInfo)
        base_dir = os.path.dirname(os.path.abspath(fnModel)) \
            if isinstance(fnModel, (str, os.PathLike)) else None   # external data's folder
        check_model(self._proto, dataFlow, inputShapeInfo, self._training)
        self._input_infos = resolve_inputs(self._graph, inputShapeInfo)
        self._loss, self._optimizer = loss, optimizer
        self._program: Optional[StepProgram] = None
        self._host_weights: dict[str, np.ndarray] = {}
        self._host_opt_state: dict[str, np.ndarray] = {}   # once prepared
        self._host_in_sync = True
        self._dev = None          # (weights, opt_state) on device
        self._weights_written = False   # weightsFromHost called (Session::weightsFromHostCalled)
        self._rng = Rng()
        self._summary: dict[str, Any] = {}
        self._loaded: Optional[dict] = None   # contents of a loadExecutable() file
        self._fwd_program: Optional[StepProgram] = None   # "implicitPipeliningFwdOnly"
        self._lock = threading.RLock()       # see the class docstring
        self._run_plan: Optional[RunPlan] = None   # run()'s per-call work (run_plan.py)
        self._step = StepTrace(self._graph, self._input_infos, dataFlow.anchors(), self._training,
                               loss, self.patterns, self._jax_device().platform)
        self._infos = check_ir(self._graph, self.options, self._training, loss, optimizer,
                               deviceInfo, self.replicationFactor, dataFlow, self._input_infos,
                               self._step)
        # the collaborators (see the module docstring)
        self._io = HostIO(dataFlow, self.options, self._input_infos, self._infos,
                          {v.name for v in self._proto.graph.input})
        self._writeback = WriteBack(self._proto, self._graph, base_dir)
        self._files = SessionFiles(type(self).__name__, self._proto, self._input_infos,
                                   self.patterns, self._graph.initializers)
        _logger.info(f"{type(self).__name__} '{name}': {len(self._graph.nodes)} ops, inputs "
                     f"{list(self._input_infos)}, anchors {dataFlow.anchors()}")
        report.session_built(self.options, self._graph, self._serializeIr)   # dotChecks, ...

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
        anchors = anchor_returns({a: self._dataFlow.art(a) for a in self._dataFlow.anchors()})
        bps = self._dataFlow.batchesPerStep()   # DataFlow checks EVERYN periods divide it
        config = engine_config(o)
        return StepConfig(
            batches_per_step=bps, accumulation_factor=self.accumulationFactor,
            replication_factor=distributed.check_options(o, self.replicationFactor),
            anchors=anchors, training=self._training,
            loss=self._loss, optimizer=self._optimizer,
            # ALS in an inference session too: StepProgram raises PopART's error for it.
            als=config.als if config.als.enabled else None, config=config)

    def _jax_device(self):
        devs = getattr(self._device, "jax_devices", None)
        return devs[0] if devs else jax.local_devices()[0]

    # ------------------------------------------------------------------ compile
    def _recompile(self) -> None:
        """Plan and compile again for the current options (``popart.horovod``), keeping the
        weights and optimizer state: on the device where the layout is the same."""
        if not self._prepared:
            return
        old, dev, in_sync = self._program, self._dev, self._host_in_sync
        self._program = None
        self.prepareDevice(loadEngine=False)
        if self._program.holds(dev):
            self._dev, self._host_in_sync = dev, in_sync
        elif dev is not None:   # through the host, in the old program's layout
            weights, state = (old.state_to_host(part) for part in dev)
            self._host_weights.update(weights)
            self._host_opt_state.update({k: v for k, v in state.items() if k in self._host_opt_state})
            self._load_engine()

    @serialised
    def prepareDevice(self, loadEngine: bool = True) -> None:
        """Trace the whole step and compile it once with XLA (once per session: a second call
        does nothing)."""
        if self._prepared:
            return
        check_virtual_graph_range(self._graph, self.options, self._device, self.replicationFactor)
        if getattr(self.options, "enablePipelining", False) and any(   # IrLowering's check
                self._dataFlow.art(a).id().name == "EveryN" for a in self._dataFlow.anchors()):
            raise popart_exception("AnchorReturnType::EVERYN is not valid for pipelined models")
        program = self._plan()
        self._host_weights = self._unprepared_weights(program)
        opt_state = dict(program.init_opt_state())
        with jax.default_device(self._jax_device()):
            key = self._rng.host_key()
            exported = self._loaded.get("executable") if self._loaded else None
            with compile_progress(f"'{self.name}'"), report.session_compiling(
                    self.options, self._graph, self._training, self.name, type(self).__name__,
                    report.samples_per_run(self._input_infos, self._io.factors())):
                source = program.compile(self._host_weights, opt_state, key, self._hyper(),
                                         exported=exported, cache=self._engine_cache())
        done = "Compiled" if source.startswith("compiled") else f"Loaded (from the {source})"
        _logger.info(f"{done} '{self.name}' in {program.compile_seconds:.2f} s")
        self._summary["compile_seconds"] = program.compile_seconds
        self._summary["executable_source"] = source
        if self._loaded and "variables" in self._loaded:
            self._host_weights.update(self._loaded["variables"])
            opt_state.update(self._loaded["optimizer_state"])
        self._host_opt_state = opt_state
        self._rng.place(self._program)
        self._host_in_sync = True
        self._dev = None
        if loadEngine:
            self._load_engine()

    def _unprepared_weights(self, program: StepProgram) -> dict:
        """The host weights before prepareDevice: the model's, or broadcastWeights' ones."""
        return {k: np.array(self._host_weights.get(k, v)) for k, v in program.variables.items()}

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

    def _plan(self) -> StepProgram:
        """The session's step program, planned (anchors, trainable weights), maybe not compiled."""
        if self._program is None:
            cfg = self._config()
            self._program = plan_program(self._step.graph, cfg, self._input_infos, self._device,
                                         self._step.result(cfg.replication_factor, cfg.config))
        return self._program

    @property
    def _prepared(self) -> bool:
        return self._program is not None and self._program.compiled is not None

    def _compiled_program(self) -> Optional[StepProgram]:
        """The program once compiled (prepareDevice), else None."""
        return self._program if self._prepared else None

    def _put(self, tree: Mapping[str, Any]) -> Any:
        """Weights or optimizer state in the program's device layout."""
        return self._program.put_state(tree)

    def _hyper(self) -> dict:
        feed = self._optimizer.non_const_feed(self._program.trainable) if self._training else {}
        return {k: np.float32(v) for k, v in feed.items()}

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
    @serialised
    def initAnchorArrays(self) -> dict[str, np.ndarray]:
        """One NumPy array per anchor, in the shape the AnchorReturnType docs give."""
        return self._io.anchor_arrays(self._plan())

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
            plan = self._run_plan = RunPlan(self._program, self._io, self._hyper())
        else:   # a planned session: prepared, on a device that runs programs
            self._require_weights_written()
        hio, program = self._io, self._program
        synthetic = plan.synthetic
        fast = False
        if synthetic is not None:
            feeds, outs = synthetic, {}
        else:   # the plan's checks, else the general path (PopART's errors)
            feeds = plan.feeds(stepio)
            if feeds is None:
                feeds = hio.gather(stepio)
            outs = plan.outputs(stepio, hio.callbacks)
            fast = outs is not None
            if not fast:
                outs = hio.check_outputs(stepio, program)
        weights, opt_state = self._device_state()
        t0 = time.perf_counter()
        weights, opt_state, self._rng.key, anchors = program.run(
            weights, opt_state, self._rng.key, feeds, plan.hyper, placed_hyper=True)
        self._dev = (weights, opt_state)
        if fast:
            plan.write(outs, anchors)   # raises a failed run-time check first
        else:
            program.raise_failed_checks(anchors)   # e.g. an index out of range
            if synthetic is None:   # synthetic data: nothing streams to or from the host
                hio.write_anchors(stepio, outs, {**anchors, **hio.host_anchor_values(
                    program, self._optimizer)}, program)
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
            program = _forward_only(self._program, self._graph, self._input_infos, self._device)
            with jax.default_device(self._jax_device()):
                program.compile(self._host_weights, {}, self._rng.key, {})
            self._fwd_program = program
        feeds = self._io.gather(stepio)
        outs = self._io.check_outputs(stepio, self._program)
        weights, opt_state = self._device_state()
        with jax.default_device(self._jax_device()):
            weights, _, self._rng.key, anchors = self._fwd_program.run(
                weights, {}, self._rng.key, feeds, {})
            self._dev = (weights, opt_state)
            self._fwd_program.raise_failed_checks(anchors)
            self._io.write_anchors(stepio, outs, anchors, self._program)
        _logger.debug(f"run {handle!r} {debugName!r} done")

    # ------------------------------------------------------------------ weights
    @serialised
    def weightsFromHost(self) -> None:
        """Copy the host weights to the device."""
        self._require_prepared("weightsFromHost")
        state = self._put(self._host_opt_state) if self._dev is None else self._dev[1]   # engine loaded
        self._dev = (self._put(self._host_weights), state)
        self._host_in_sync = True
        self._weights_written = True

    @serialised
    def weightsToHost(self) -> None:
        """Copy the device weights to the host."""
        self._require_prepared("weightsToHost")
        if self._dev is None:   # engine not loaded: the host values are the latest
            return
        log = _log.getLogger("devicex").debug if self.options.syntheticDataMode == \
            SyntheticDataMode.Off else (lambda _: None)   # Devicex::weightsToHost's lines
        log("Writing weights to host")
        if not self._host_in_sync:   # in sync: the host has the device's values already
            self._host_weights, self._host_opt_state = self._device_to_host(0), self._device_to_host(1)
        log("Writing weights to host complete.")
        self._host_in_sync = True

    def areHostWeightsInSync(self) -> bool:
        return self._host_in_sync

    @serialised
    def readWeights(self, weightsIo: Any) -> None:
        """Copy host weights (and optimizer state) into the arrays of a PyWeightsIO."""
        self._require_prepared("readWeights")
        weights_to_io(weightsIo, self._host_weights, self._host_opt_state or self._device_to_host(1))

    @serialised
    def writeWeights(self, weightsIo: Any) -> None:
        """Write the arrays of a PyWeightsIO to the host weights / optimizer state and, when
        the engine is loaded, to the device: only those tensors cross."""
        self._require_writable_weights("writeWeights")
        written = weights_from_io(weightsIo, self._host_weights, self._host_opt_state)
        self._dev = self._dev and self._program.write_state(self._dev, written)

    # ------------------------------------------------------------------ IR, reports, sync state
    def getIr(self) -> SessionIr:
        """A view of the session's IR (graph, data flow, options, patterns)."""
        return SessionIr(self)

    @serialised
    def _serializeIr(self, format: Any = IrSerializationFormat.JSON) -> str:
        """The session's IR as PopART's JSON (see ``popart.ir_json``)."""
        if format != IrSerializationFormat.JSON:
            raise popart_exception(f"_serializeIr: format must be IrSerializationFormat.JSON, got {format!r}")
        program = self._plan()
        training = None
        if self._training:
            training = {"loss": self._loss, "trainable": program.trainable, "optimizer": self._optimizer,
                        "program": program, "options": self.options}
        name = self._proto.graph.name
        main = name if name and not name.startswith("BuilderGraph") else "maingraph"
        inplace = not self._training and self.patterns.isInPlaceEnabled()
        anchors = set(self._dataFlow.anchors())
        return serialize_ir(self._graph, dict(self._infos), main, training, anchors if inplace else None,
                            self.patterns, anchors, options=self.options, program=program)

    @serialised
    def getReport(self) -> str:
        """What XLA knows of the compiled program, as JSON: per device its FLOPs, bytes
        accessed, argument / output / temporary / code sizes, and the compile time."""
        return xla_report(self.name, self._require_prepared("getReport"),
                          self._summary.get("executable_source"), self.replicationFactor)

    @serialised
    def getSerializedGraph(self) -> bytes:
        """The compiled program's text (XLA's optimised HLO module)."""
        return self._require_prepared("getSerializedGraph").compiled.as_text().encode()

    def checkInplacingAmbiguity(self) -> None:
        """PopART checks that its in-place ops leave no ambiguous aliasing. XLA programs have
        value semantics (buffers are aliased only by XLA's own analysis), so no model can
        have such an ambiguity: the check always passes."""
        _logger.debug(f"checkInplacingAmbiguity '{self.name}': no in-place aliasing on XLA")

    @serialised
    def loadEngineAndConnectStreams(self) -> None:
        """Load the compiled program and the weights onto the device (prepareDevice does
        this unless given loadEngine=False; run() does it when needed)."""
        self._require_prepared("loadEngineAndConnectStreams")
        self._device_state()   # loads the engine when it is not loaded

    def setEngineIsLoaded(self, isLoaded: bool) -> None:
        """Mark the engine loaded or not: a session whose engine is not loaded loads it (and
        the host weights) before its next run."""
        if not isLoaded:
            if self._dev is not None:
                self.weightsToHost()   # nothing of the device's state is lost
            self._dev = None
        elif self._dev is None:
            self.loadEngineAndConnectStreams()

    @serialised
    def copyDeviceWeightsToHost(self) -> None:
        """Copy the device's weights to the host (weightsToHost)."""
        self.weightsToHost()

    def markHostWeightsInSync(self) -> None:
        """Declare the host weights equal to the device's (the next weightsToHost copies nothing)."""
        self._host_in_sync = True

    def markHostWeightsOutOfSync(self) -> None:
        """Declare the device's weights newer than the host's."""
        self._host_in_sync = False

    # ------------------------------------------------------------------ info
    @serialised
    def getInfo(self, id: str) -> TensorInfo:
        if id in self._input_infos:
            return self._input_infos[id]
        infos = self._infos
        if id not in infos:
            raise popart_exception(f"getInfo: '{id}' is not a tensor of the model")
        return infos[id]

    @serialised
    def getTensorIds(self) -> set[str]:
        ids = set(self._graph.all_tensor_ids())
        if self._training and self._program is not None:
            ids |= {GRAD_PREFIX + w for w in self._program.trainable}
            ids |= set(self._program.init_opt_state())
        return ids

    getAllTensorIds = getTensorIds

    # ------------------------------------------------------------------ random numbers
    def _requires_random_seed(self) -> bool:
        return requires_random_seed(self.options, self._program, self._graph, self._training)

    @serialised
    def setRandomSeed(self, seedValue: int) -> None:
        """Seed the session's random ops: an unsigned 64-bit integer (PopART's uint64_t;
        ArgumentError, a TypeError, for anything else, the seed unchanged)."""
        check_seed_type(self, seedValue, self._training)
        self._rng.set_seed(seedValue, self._requires_random_seed(), self._compiled_program(),
                           self._cache_hit)

    def getRandomSeed(self) -> int:
        """The seed last set (Session::getRandomSeed: 0, with a warning, in a session with
        no random behaviour; a prepared session needed otherwise)."""
        return self._rng.get_seed(self._requires_random_seed(), self._compiled_program(),
                                  self._cache_hit)

    @serialised
    def getRNGState(self) -> list[int]:
        """The state of the random number generator (enableLoadAndOffloadRNGState, prepared)."""
        check_rng_state_enabled(self.options, "getRNGState", "get")
        self._require_prepared("getRNGState")
        return self._rng.state(self.options)

    @serialised
    def setRNGState(self, rngValue: Iterable[int]) -> None:
        """Set the random number generator's state (as getRNGState returned it)."""
        check_rng_state_enabled(self.options, "setRNGState", "set")
        self._rng.set_state(rngValue, self._require_prepared("setRNGState"))

    @property
    def constantWeights(self) -> bool:
        return bool(getattr(self.options, "constantWeights", True))

    def getSummaryReport(self, resetProfile: bool = True) -> str:
        return summary_report(f"Session '{self.name}' ({type(self).__name__})", self._device,
                              self._io.factors(), len(self._graph.nodes), len(self._host_weights),
                              self._summary, self.options, self._program)

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


def _forward_only(train: StepProgram, graph: Any, input_infos: Mapping[str, TensorInfo],
                  device: Any) -> StepProgram:
    """The forward pass of training program ``train`` (no gradient, optimizer-state or ALS
    anchors), planned to run on its weights."""
    skip = set(train.opt_state_ids()) | set(train.als_anchors)
    anchors = {a: art for a, art in train.cfg.anchors.items()
               if not a.startswith(GRAD_PREFIX) and a not in skip}
    cfg = dataclasses.replace(train.cfg, training=False, loss=None, optimizer=None,
                              als=None, anchors=anchors)
    program = StepProgram(graph, cfg, input_infos, device, stash_anchors=train.placed is not None)
    program.plan(like=train)   # it runs on the training program's weights
    return program


def makedirsAndCheckWritable(path: str) -> None:
    """Make the folder ``path`` (and its parents) if needed; OSError if it is not writable
    (PopART's helper for compileAndExport)."""
    os.makedirs(path, exist_ok=True)
    if not os.access(path, os.W_OK):
        raise OSError(f"Unable to write to {path}")


class InferenceSession(SegmentedRuns, _Session):   # SegmentedRuns: data-dependent shapes
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

    @serialised
    def updateOptimizerFromHost(self, optimizer: Any) -> None:
        """Replace the optimizer's non-const hyper-parameters; no recompilation."""
        trainable = self._program.trainable if self._program else []
        self._optimizer.check_compatible(optimizer, trainable)
        # The compiled program keeps the original optimizer for its const values (which the
        # check guarantees are unchanged); the non-const ones are fed from this one each run.
        self._optimizer = optimizer
        self._run_plan = None   # its values go to the device with the next run

    @serialised
    def broadcastWeights(self, rootRank: int = 0) -> None:
        """Copy the weights of instance (process) ``rootRank`` to every instance; with one
        instance there is nothing to do. Before prepareDevice, the host weights (the model's)
        are broadcast, and prepareDevice keeps them (Session::broadcastWeights reads the
        executable's host tensor data)."""
        n = distributed.process_count()
        if not 0 <= rootRank < n:
            raise popart_exception(f"broadcastWeights: rootRank {rootRank} does not exist "
                                   f"(there are {n} instance(s))")
        if n == 1:
            return
        from jax.experimental import multihost_utils
        prepared = self._prepared
        if prepared:
            self.weightsToHost()
        else:
            self._host_weights = self._unprepared_weights(self._plan())
        self._host_weights = {k: np.asarray(v) for k, v in multihost_utils.broadcast_one_to_all(
            self._host_weights, is_source=distributed.process_index() == rootRank).items()}
        if prepared:
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
        self._io.callbacks[streamHandle] = (callback, index)
