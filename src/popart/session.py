"""InferenceSession and TrainingSession: compile a graph once, run many batches per call."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import threading
import time
from importlib import metadata
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import onnx
from onnx import numpy_helper

from . import dataflow as _df
from . import distributed
from . import logging as _log
from .engine.program import GRAD_PREFIX, StepConfig, StepProgram
from .engine import in_x64, x64
from .engine.progress import compile_progress
from .engine.shapes import infer_graph, input_specs
from .ir.transforms import fuse_softmax_nll
from .errors import OptimizerError, OutOfMemoryException, StepIOError, popart_exception
from .fileio import atomic_write, load_npz_bounded
from .ir.onnx_import import ModelLike, import_model, load_model, tensor_to_numpy
from .patterns import for_session
from .options import MeanReductionStrategy, ReductionType, SessionOptions
from .tensorinfo import TensorInfo, shape_str, to_datatype

_logger = _log.getLogger("session")


def _key_data(seed: int) -> np.ndarray:
    """The raw state of the session's PRNG key for ``seed`` (what getRNGState returns)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return np.asarray(jax.random.key_data(jax.random.key(seed)))


# Options that do not shape the compiled program (where it is cached, how compilation is
# reported, debugging output): left out of the executable's signature.
_NOT_IN_SIGNATURE = {"cachePath", "enableEngineCaching", "compilationProgressLogger",
                     "compilationProgressTotal", "compileEngine", "logDir", "dotChecks",
                     "dotOpNames", "firstDotOp", "finalDotOp", "reportOptions"}
EXECUTABLE_SLACK = 64 << 20   # bytes an executable file may hold beyond the session's tensors


def _package_version() -> str:
    try:
        return metadata.version("popart-xla")
    except metadata.PackageNotFoundError:
        return "unknown"


def _canonical(v: Any) -> Any:
    """``v`` as JSON-able data that is the same in every process (sets sorted)."""
    if isinstance(v, dict):
        return {str(k): _canonical(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (set, frozenset)):
        return sorted(repr(x) for x in v)
    if isinstance(v, (list, tuple)):
        return [_canonical(x) for x in v]
    return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)


def _options_signature(options: Any) -> dict:
    """The options that shape the compiled program and differ from the defaults."""
    summary = options.summary() if callable(getattr(options, "summary", None)) else {}
    return _canonical({k: v for k, v in summary.items() if k not in _NOT_IN_SIGNATURE})


def _optimizer_signature(opt: Any) -> Any:
    """The optimizer's type, settings and const hyper-parameters (compiled into the
    program); non-const ones are fed at run time and left out."""
    if opt is None:
        return None
    const = lambda ov: repr(ov) if ov.isConst() else "non-const"
    maps = {n: [const(m.getDefault()), {w: const(v) for w, v in m.getSpecifics().items()}]
            for n, m in getattr(opt, "_maps", {}).items()}
    return _canonical({"type": opt.type_name(), "settings": opt.settings(), "const": maps,
                       "lossScaling": const(opt.loss_scaling())})


def _signature_diff(saved: dict, mine: dict) -> list[str]:
    """What differs between a saved signature and the session's, one item per field (per
    option for the options)."""
    out = []
    for k, b in mine.items():
        a = saved.get(k)
        if a == b:
            continue
        if k == "options" and isinstance(a, dict):
            for n in sorted(set(a) | set(b)):
                if a.get(n) != b.get(n):
                    out.append(f"option {n} (file: {a.get(n, 'default')}, session: {b.get(n, 'default')})")
        else:
            out.append(f"{k} (file: {a}, session: {b})")
    return out


_XLA_CACHE_FLAGS = {"jax_compilation_cache_dir": None,
                    "jax_persistent_cache_min_compile_time_secs": 0.0,
                    "jax_persistent_cache_min_entry_size_bytes": 0}
_XLA_CACHE_LOCK = threading.Lock()


@contextlib.contextmanager
def _xla_cache(folder: Optional[str]) -> Iterator[None]:
    """JAX's persistent compilation cache (XLA executables) in ``folder`` for the compile in
    this block only; ``folder`` None: JAX's own settings. JAX's config is process-wide, so
    it is set and put back under a lock that every session's compile takes."""
    from jax._src import compilation_cache
    with _XLA_CACHE_LOCK:
        if folder is None:
            yield
            return
        saved = {k: getattr(jax.config, k) for k in _XLA_CACHE_FLAGS}
        try:
            for k, v in {**_XLA_CACHE_FLAGS, "jax_compilation_cache_dir": folder}.items():
                jax.config.update(k, v)
            compilation_cache.reset_cache()
            yield
        finally:
            for k, v in saved.items():
                jax.config.update(k, v)
            compilation_cache.reset_cache()


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
            raise popart_exception("No device given: pass deviceInfo, for example "
                                   "popart.DeviceManager().createCpuDevice()")
        if not isinstance(dataFlow, _df.DataFlow):
            raise popart_exception(f"dataFlow must be a popart.DataFlow, got {type(dataFlow).__name__}")
        self.name, self._device = name, deviceInfo
        self.patterns = for_session(patterns)
        self._dataFlow = dataFlow
        self.options = userOptions if userOptions is not None else SessionOptions()
        self._graph, self._proto = import_model(fnModel, inputShapeInfo)
        self._input_infos = self._resolve_inputs(inputShapeInfo)
        self._loss, self._optimizer = loss, optimizer
        self._program: Optional[StepProgram] = None
        self._host_weights: dict[str, np.ndarray] = {}
        self._host_in_sync = True
        self._dev = None          # (weights, opt_state) on device
        self._seed = 0
        self._key = None
        self._summary: dict[str, Any] = {}
        self._stream_callbacks: dict[str, Any] = {}
        self._loaded: Optional[dict] = None   # contents of a loadExecutable() file
        self._lock = threading.RLock()       # see the class docstring
        if self._training:
            self._check_training_args()
        _logger.info(f"{type(self).__name__} '{name}': {len(self._graph.nodes)} ops, inputs "
                     f"{list(self._input_infos)}, anchors {dataFlow.anchors()}")

    # ------------------------------------------------------------------ set-up
    def _resolve_inputs(self, isi: Any) -> dict[str, TensorInfo]:
        overrides = {}
        if isi is not None:
            for tid in self._graph.inputs:
                if isi.has(tid):
                    overrides[tid] = isi.get(tid)
        specs = input_specs(self._graph, overrides)
        return {k: TensorInfo(to_datatype(v.dtype), list(v.shape)) for k, v in specs.items()}

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
            als=o.automaticLossScalingSettings if self._training and o.automaticLossScalingSettings.enabled else None,
            options=o)

    def _jax_device(self):
        devs = getattr(self._device, "jax_devices", None)
        return devs[0] if devs else jax.local_devices()[0]

    # ------------------------------------------------------------------ compile
    @_serialised
    def prepareDevice(self, loadEngine: bool = True) -> None:
        """Trace the whole step and compile it once with XLA (once per session: a second call
        does nothing)."""
        if self._prepared:
            return
        program = self._plan()
        self._host_weights = {k: np.array(v) for k, v in program.variables.items()}
        opt_state = dict(program.init_opt_state())
        with jax.default_device(self._jax_device()):
            if self._key is None:
                self._key = _key_data(self._seed)
            _logger.info(f"Compiling '{self.name}' ...")
            cache_entry = self._use_engine_cache()
            exported = self._loaded.get("executable") if self._loaded else None
            with compile_progress(f"'{self.name}'"):
                if cache_entry:   # compile the module the entry stores: XLA's cache key next time
                    exported = program.export_step(self._host_weights, opt_state, self._key, self._hyper())
                with _xla_cache(self._xla_cache_folder()):
                    program.compile(self._host_weights, opt_state, self._key, self._hyper(),
                                    exported=exported)
        _logger.info(f"Compiled '{self.name}' in {program.compile_seconds:.2f} s")
        if cache_entry:
            try:
                os.makedirs(self.options.cachePath, exist_ok=True)
                atomic_write(cache_entry, self._executable_bytes(False, exported))
                _logger.info(f"Engine cache: wrote '{cache_entry}'")
            except (OSError, popart_exception) as e:   # the session works without its entry
                _logger.warn(f"Engine cache: cannot write '{cache_entry}': {e}")
        self._summary["compile_seconds"] = program.compile_seconds
        if self._loaded and "variables" in self._loaded:
            self._host_weights.update(self._loaded["variables"])
            opt_state.update(self._loaded["optimizer_state"])
        self._dev = (self._put(self._host_weights), self._put(opt_state))
        self._key = self._program.put(self._key)
        self._host_in_sync = True

    def _xla_cache_folder(self) -> Optional[str]:
        o = self.options
        return os.path.join(os.path.abspath(o.cachePath), "xla") \
            if o.enableEngineCaching and o.cachePath else None

    def _use_engine_cache(self) -> Optional[str]:
        """SessionOptions.enableEngineCaching + cachePath, for this session only: load this
        session's entry (named by a hash of its signature) if there is a valid one; returns
        the entry to write after compiling, or None."""
        o = self.options
        if self._loaded or not (o.enableEngineCaching and o.cachePath):
            return None
        digest = hashlib.sha256(json.dumps(self._signature(), sort_keys=True).encode()).hexdigest()
        entry = os.path.join(o.cachePath, f"{type(self).__name__}-{digest[:32]}.popef")
        if not os.path.exists(entry):
            _logger.info(f"Engine cache: no entry '{entry}', compiling")
            return entry
        try:
            self._loaded = self._read_executable(entry, with_variables=False)
        except popart_exception as e:
            _logger.warn(f"Engine cache: entry not used, recompiling: {e}")
            return entry
        _logger.info(f"Engine cache: using '{entry}'")
        return None

    def _plan(self) -> StepProgram:
        """The session's step program, planned (anchors, trainable weights) but maybe not
        compiled yet."""
        if self._program is None:
            graph = self._graph
            if self._training:
                graph = fuse_softmax_nll(graph, self._loss, self.patterns.isPatternEnabled)
            program = StepProgram(graph, self._config(), self._input_infos, self._device)
            program.plan()
            self._program = program
        return self._program

    @property
    def _prepared(self) -> bool:
        return self._program is not None and self._program.compiled is not None

    def _put(self, tree: Mapping[str, Any]) -> dict:
        return self._program.put(dict(tree))

    def _hyper(self) -> dict:
        if not self._training:
            return {}
        return {k: np.float32(v) for k, v in
                self._optimizer.non_const_feed(self._program.trainable).items()}

    def _require_prepared(self, what: str) -> StepProgram:
        if not self._prepared:
            raise popart_exception(f"{what}: the session is not prepared; call prepareDevice() first")
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
        strict = bool(getattr(stepio, "runtime_asserts", True))
        feeds = {}
        for tid, info in self._input_infos.items():
            if tid not in inputs:
                raise StepIOError(
                    f"Input tensor '{tid}' is missing from the StepIO: expected an array of shape "
                    f"{shape_str(_df.input_host_shape(info.shape(), bps, A, R))} and dtype "
                    f"{info.data_type()}; the StepIO has inputs {sorted(inputs)}")
            feeds[tid] = _df.validate_input(tid, inputs[tid], info, bps, A, R, strict)
        extra = set(inputs) - set(self._input_infos)
        if extra:
            raise StepIOError(f"StepIO inputs {sorted(extra)} are not inputs of the model "
                              f"(its inputs are {sorted(self._input_infos)})")
        return feeds

    def _gather_callback_inputs(self, cb: Any) -> dict[str, np.ndarray]:
        bps, A, R = self._dataFlow.batchesPerStep(), self.accumulationFactor, self.replicationFactor
        feeds = {}
        for tid, info in self._input_infos.items():
            parts = []
            for _ in range(bps * A):
                arr = np.asarray(cb.input_callback(tid, False))
                cb.input_complete_callback(tid)
                parts.append(_df.validate_input(tid, arr, info, 1, 1, R, False)[0, 0])
            feeds[tid] = np.stack(parts).reshape((bps, A, R, *info.shape()))
        return feeds

    @_serialised
    def run(self, stepio: Any, debugName: str = "") -> None:
        """Run batchesPerStep batches: one call into the compiled program."""
        if isinstance(stepio, str):  # run(programHandle, stepio, debugName) overload
            raise popart_exception("Named programs are not supported; call run(stepio)")
        if not self._prepared:
            self.prepareDevice()
        if getattr(self._device, "offline", False):
            raise popart_exception(f"Session '{self.name}' was compiled for an offline device, "
                                   f"which cannot run programs; use createCpuDevice(), "
                                   f"createIpuModelDevice() or acquireAvailableDevice()")
        feeds = self._gather_inputs(stepio)
        outs = self._check_outputs(stepio)
        weights, opt_state = self._dev
        with jax.default_device(self._jax_device()):
            t0 = time.perf_counter()
            weights, opt_state, self._key, anchors = self._program.run(
                weights, opt_state, self._key, feeds, self._hyper())
            self._dev = (weights, opt_state)
            self._program.raise_failed_checks(anchors)   # e.g. an index out of range
            self._write_anchors(stepio, outs, anchors)
            self._summary["last_run_seconds"] = time.perf_counter() - t0
        if self._training:
            self._host_in_sync = False
        _logger.debug(f"run {debugName!r} done")

    def _check_outputs(self, stepio: Any) -> dict:
        if isinstance(stepio, _df.PyStepIOCallback):
            return {}
        outs = getattr(stepio, "outputs", {}) or {}
        for a in self._dataFlow.anchors():
            if a not in outs:
                raise StepIOError(f"Anchor '{a}' has no output array in the StepIO; use "
                                  f"session.initAnchorArrays() to create them")
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

    def _write_callback_anchor(self, cb: Any, a: str, val: np.ndarray) -> None:
        flat = val.reshape((-1,) + val.shape[-len(self._anchor_tensor_info(a)[0]):]) \
            if self._anchor_tensor_info(a)[0] else val.reshape(-1)
        for part in flat:
            dst = cb.output_callback(a)
            _check_anchor_dtype(a, dst, val.dtype)
            np.copyto(dst, np.asarray(part).reshape(np.shape(dst)), casting="unsafe")
            cb.output_complete_callback(a)

    # ------------------------------------------------------------------ weights
    @_serialised
    def weightsFromHost(self) -> None:
        """Copy the host weights to the device."""
        self._require_prepared("weightsFromHost")
        self._dev = (self._put(self._host_weights), self._dev[1])
        self._host_in_sync = True

    @_serialised
    def weightsToHost(self) -> None:
        """Copy the device weights to the host."""
        self._require_prepared("weightsToHost")
        to_host = self._program.to_host
        self._host_weights = {k: to_host(v) for k, v in self._dev[0].items()}
        self._host_opt_state = {k: to_host(v) for k, v in self._dev[1].items()}
        self._host_in_sync = True

    def areHostWeightsInSync(self) -> bool:
        return self._host_in_sync

    @_serialised
    def readWeights(self, weightsIo: Any) -> None:
        """Copy host weights (and optimizer state) into the arrays of a PyWeightsIO."""
        self._require_prepared("readWeights")
        state = getattr(self, "_host_opt_state", None) or \
            {k: self._program.to_host(v) for k, v in self._dev[1].items()}
        for tid, dst in _weights_dict(weightsIo).items():
            src = self._host_weights.get(tid, state.get(tid))
            if src is None:
                raise popart_exception(f"readWeights: '{tid}' is not a weight or optimizer state "
                                       f"tensor of the session (weights: {sorted(self._host_weights)})")
            _copy_checked(tid, dst, src)

    @_serialised
    def writeWeights(self, weightsIo: Any) -> None:
        """Write the arrays of a PyWeightsIO to the host weights (and the device)."""
        self._require_prepared("writeWeights")
        opt = {k: self._program.to_host(v) for k, v in self._dev[1].items()}
        for tid, src in _weights_dict(weightsIo).items():
            target = self._host_weights if tid in self._host_weights else opt if tid in opt else None
            if target is None:
                raise popart_exception(f"writeWeights: '{tid}' is not a weight of the session")
            if np.shape(src) != target[tid].shape:
                raise popart_exception(f"writeWeights: '{tid}' has shape {shape_str(target[tid].shape)}, "
                                       f"given {shape_str(np.shape(src))}")
            target[tid] = np.asarray(src, dtype=target[tid].dtype).copy()
        self._dev = (self._put(self._host_weights), self._put(opt))

    @_serialised
    def resetHostWeights(self, modelProtoOrFilename: ModelLike,
                         ignoreWeightsInModelWithoutCorrespondingHostWeight: bool = False) -> None:
        """Replace host weights with the initializers of another model (then weightsFromHost)."""
        self._require_prepared("resetHostWeights")
        proto, base = load_model(modelProtoOrFilename)
        for t in proto.graph.initializer:
            if t.name not in self._host_weights:
                if t.name in self._program.constants or ignoreWeightsInModelWithoutCorrespondingHostWeight:
                    continue
                raise popart_exception(f"resetHostWeights: initializer '{t.name}' of the given model "
                                       f"has no corresponding weight in the session")
            val = tensor_to_numpy(t, base)
            cur = self._host_weights[t.name]
            if val.shape != cur.shape or val.dtype != cur.dtype:
                raise popart_exception(f"resetHostWeights: '{t.name}' is {val.dtype}{shape_str(val.shape)} "
                                       f"in the given model, expected {cur.dtype}{shape_str(cur.shape)}")
            self._host_weights[t.name] = val.copy()
        self._host_in_sync = False

    @_serialised
    def modelToHost(self, fn: str) -> None:
        """Write the model with the current weights to an ONNX file (atomically)."""
        self._require_prepared("modelToHost")
        self.weightsToHost()
        atomic_write(fn, self.model_proto().SerializeToString())

    @_serialised
    def model_proto(self) -> onnx.ModelProto:
        """The session's model with the host weights as initializers."""
        model = onnx.ModelProto()
        model.CopyFrom(self._proto)
        for t in model.graph.initializer:
            if t.name in self._host_weights:
                new = numpy_helper.from_array(self._host_weights[t.name], t.name)
                t.CopyFrom(new)
        return model

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
                "patterns": None if self.patterns is None else _canonical(self.patterns.getSettings()),
                "popart_xla": _package_version(), "jax": jax.__version__,
                "backend": jax.default_backend()}

    def _executable_bytes(self, saveVariables: bool, executable: Optional[bytes] = None) -> bytes:
        """The .popef file: an .npz of the exported step (``executable``, else the compiled
        program's), its signature and the variables."""
        executable = executable if executable is not None else self._program.export()
        entries = {"executable": np.frombuffer(executable, np.uint8),
                   "metadata": np.frombuffer(json.dumps(self._signature()).encode(), np.uint8)}
        if saveVariables:
            self.weightsToHost()
            entries.update({"var/" + k: v for k, v in self._host_weights.items()})
            entries.update({"opt/" + k: v for k, v in self._host_opt_state.items()})
        buf = io.BytesIO()
        np.savez(buf, **entries)
        return buf.getvalue()

    def _read_executable(self, filename: str, with_variables: bool = True) -> dict:
        """A .popef file's executable (and variables), read with every size bounded by this
        session's tensors and checked against its signature (popart_exception naming what
        differs)."""
        program = self._plan()
        arrays = {**{"var/" + k: v for k, v in program.variables.items()},
                  **{"opt/" + k: v for k, v in program.init_opt_state().items()}}
        expected = {"executable": None, "metadata": None,
                    **{k: (np.shape(v), np.asarray(v).dtype) for k, v in arrays.items()}}
        tensors = sum(np.asarray(v).nbytes for v in arrays.values())
        tensors += sum(np.asarray(v).nbytes for v in self._graph.initializers.values())
        data = load_npz_bounded(filename, expected, max_bytes=EXECUTABLE_SLACK + 2 * tensors,
                                required=("executable", "metadata"))
        try:
            saved = json.loads(bytes(data["metadata"]).decode())
        except (UnicodeDecodeError, ValueError):
            raise popart_exception(f"'{filename}' has unreadable metadata") from None
        diff = _signature_diff(saved, self._signature())
        if diff:
            raise popart_exception(f"'{filename}' was compiled for something else: "
                                   + "; ".join(diff))
        loaded = {"executable": bytes(data["executable"])}
        if with_variables and any(k.startswith("var/") for k in data):
            loaded["variables"] = {k[4:]: v for k, v in data.items() if k.startswith("var/")}
            loaded["optimizer_state"] = {k[4:]: v for k, v in data.items() if k.startswith("opt/")}
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
        """Compile the step and export it (with metadata and variables) to ``filename``."""
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
        infos = infer_graph(self._graph, [id], self._input_infos)
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
        self._seed = int(seedValue)
        self._set_key(_key_data(self._seed))

    def _set_key(self, key: Any) -> None:
        self._key = self._program.put(key) if self._prepared else key

    def getRandomSeed(self) -> int:
        return self._seed

    @_serialised
    def getRNGState(self) -> list[int]:
        key = self._key if self._key is not None else _key_data(self._seed)
        return [int(v) for v in np.asarray(key).ravel()]

    @_serialised
    def setRNGState(self, rngValue: Iterable[int]) -> None:
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
        lines.append("Execution profiling not enabled")
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
    if not isinstance(dst, np.ndarray) or dst.size != src.size:
        raise popart_exception(f"Weight '{tid}': destination array has shape "
                               f"{shape_str(np.shape(dst))}, expected {shape_str(src.shape)}")
    np.copyto(dst, src.reshape(dst.shape), casting="unsafe")


class InferenceSession(_Session):
    """Session for running inference (reference 13.1.2)."""

    def __init__(self, fnModel: ModelLike, dataFlow: _df.DataFlow, deviceInfo: Any,
                 inputShapeInfo: Optional[_df.InputShapeInfo] = None, patterns: Any = None,
                 userOptions: Optional[SessionOptions] = None, name: str = "inference") -> None:
        super().__init__(fnModel, dataFlow, deviceInfo, inputShapeInfo, patterns, userOptions, name)


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
