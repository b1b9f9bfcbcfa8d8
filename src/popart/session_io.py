"""A session's host side of ``run``: the general path's StepIO gathering and checks
(PopART's errors; ``run_plan.RunPlan`` is the common path), synthetic data, anchor arrays
and writing anchors back (stream callbacks, PyStepIOCallback, the optimizer's scalars);
PyWeightsIO's checks."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from . import dataflow as _df
from . import distributed
from .errors import (OutOfMemoryException, StepIOError, WeightsIOError, noted,
                     popart_exception)
from .logging import getLogger
from .tensorinfo import TensorInfo, shape_str

_logger = getLogger("session")


class HostIO:
    """What moves between the host and a session's step: inputs from a StepIO, anchors
    to it. ``options`` gives the factors at call time (``popart.horovod`` may change the
    replication); ``program`` (the session's ``StepProgram``) is passed where the anchors'
    layout matters. ``callbacks``: connectStreamToCallback's, by anchor."""

    def __init__(self, dataFlow: _df.DataFlow, options: Any, input_infos: Mapping[str, TensorInfo],
                 infos: Mapping[str, TensorInfo], onnx_inputs: set) -> None:
        self.dataFlow, self.options = dataFlow, options
        self.input_infos, self.infos, self.onnx_inputs = input_infos, infos, onnx_inputs
        self.callbacks: dict[str, Any] = {}
        self._synthetic: Optional[dict] = None
        self._check_synthetic_types()

    def factors(self) -> tuple[int, int, int]:
        """(batchesPerStep, accumulationFactor, replicationFactor)."""
        return (self.dataFlow.batchesPerStep(), self.options.getAccumulationFactor(),
                self.options.localReplicationFactor())

    # ------------------------------------------------------------------ anchors
    def anchor_arrays(self, program: Any) -> dict[str, np.ndarray]:
        """initAnchorArrays: one NumPy array per anchor, in the AnchorReturnType's shape."""
        bps, A, R = self.factors()
        out = {}
        for a in self.dataFlow.anchors():
            shape, dtype = self.anchor_info(program, a)
            host = _df.anchor_host_shape(shape, self.dataFlow.art(a), bps, A, R)
            try:
                out[a] = np.zeros(host, dtype=dtype)
            except MemoryError:
                raise OutOfMemoryException(f"initAnchorArrays: anchor '{a}' of shape {host} "
                                           f"({dtype}) does not fit in host memory") from None
        return out

    @staticmethod
    def anchor_info(program: Any, a: str) -> tuple[list, np.dtype]:
        """Anchor ``a``'s tensor shape (per sample) and dtype."""
        if a in program.anchor_specs:
            s = program.anchor_specs[a]
            return list(s.shape), np.dtype(s.dtype)
        v = program.init_opt_state()[a]
        return list(v.shape), v.dtype

    def check_outputs(self, stepio: Any, program: Any) -> dict:
        """A StepIO's output arrays, one per anchor, each of its anchor's dtype."""
        if isinstance(stepio, _df.PyStepIOCallback):
            return {}
        outs = getattr(stepio, "outputs", {}) or {}
        for a in self.dataFlow.anchors():
            if a not in outs:
                raise StepIOError(f"Anchor '{a}' has no output array in the StepIO; use "
                                  f"session.initAnchorArrays() to create them")
            _df.check_contiguous(outs[a], _df.noncontiguous_output(a))
            _check_anchor_dtype(a, outs[a], self.anchor_info(program, a)[1])
        return outs

    def write_anchors(self, stepio: Any, outs: dict, anchors: dict, program: Any) -> None:
        """A run's anchors to the StepIO's arrays (or its callbacks), and to the stream
        callbacks."""
        bps, A, R = self.factors()
        offset = distributed.process_index() * R
        for a, val in anchors.items():
            art = self.dataFlow.art(a)
            val = program.to_host(val)
            if program.cfg.replication_factor != R:   # global replication: our replicas
                axis = _df.device_lead_dims(art) - 1
                val = np.take(val, range(offset, offset + R), axis=axis)
            shape = list(val.shape[_df.device_lead_dims(art):])
            if a in self.callbacks:   # one replica's values, as PopART streams them
                callback, index = self.callbacks[a]
                one = np.take(val, index, axis=_df.device_lead_dims(art) - 1) if R > 1 else val
                callback(one.reshape(_df.anchor_host_shape(shape, art, bps, A, 1)))
            host = _df.anchor_host_shape(shape, art, bps, A, R)
            val = val.reshape(host)
            if isinstance(stepio, _df.PyStepIOCallback):
                self._write_callback_anchor(stepio, a, val, program)
                continue
            dst = outs[a]
            if not isinstance(dst, np.ndarray) or dst.size != val.size:
                raise StepIOError(f"Output array for anchor '{a}' has shape "
                                  f"{shape_str(np.shape(dst))}; expected {shape_str(host)}")
            np.copyto(dst, val.reshape(dst.shape), casting="unsafe")

    def host_anchor_values(self, program: Any, optimizer: Any) -> dict[str, np.ndarray]:
        """Anchors of the optimizer's scalar tensors (``program.optimizer_scalars``), from
        the session's current optimizer, in the step's layout [B, A, R] (ALL / EVERYN) or
        [R] (FINAL / SUM: the value, PopART's sum of one value per micro-batch for SUM)."""
        if not program.host_anchors:
            return {}
        values = program.scalar_values(optimizer)
        B, A, _ = self.factors()
        R = program.cfg.replication_factor   # every replica's, as the step's anchors
        out = {}
        for a in program.host_anchors:
            art = self.dataFlow.art(a).id().name
            v = np.float32(values[a]) * (B * A if art == "Sum" else 1)
            lead = (R,) if art in ("Final", "Sum") else \
                ((B // self.dataFlow.art(a).rp() if art == "EveryN" else B), A, R)
            out[a] = np.full(lead, v, program.anchor_specs[a].dtype)
        return out

    def _write_callback_anchor(self, cb: Any, a: str, val: np.ndarray, program: Any) -> None:
        shape = self.anchor_info(program, a)[0]
        flat = val.reshape((-1,) + val.shape[-len(shape):]) if shape else val.reshape(-1)
        for part in flat:
            dst = cb.output_callback(a)
            _df.check_contiguous(dst, _df.noncontiguous_output(a))
            _check_anchor_dtype(a, dst, val.dtype)
            np.copyto(dst, np.asarray(part).reshape(np.shape(dst)), casting="unsafe")
            cb.output_complete_callback(a)

    # ------------------------------------------------------------------ inputs
    def gather(self, stepio: Any) -> dict[str, np.ndarray]:
        """The step's feeds from a StepIO, with PopART's checks and errors."""
        bps, A, R = self.factors()
        if isinstance(stepio, _df.PyStepIOCallback):
            return self._gather_callback_inputs(stepio)
        inputs = getattr(stepio, "inputs", None)
        if inputs is None:
            raise StepIOError(f"run() expects a popart.PyStepIO or PyStepIOCallback, got "
                              f"{type(stepio).__name__}")
        asserts = getattr(stepio, "runtime_asserts", None)
        offsets = stepio.__dict__.setdefault("offsets", {}) if asserts is False else None
        feeds = {}
        for tid, info in self.input_infos.items():
            if tid not in inputs:
                raise StepIOError(
                    f"Input tensor '{tid}' is missing from the StepIO: expected an array of shape "
                    f"{shape_str(_df.input_host_shape(info.shape(), bps, A, R))} and dtype "
                    f"{info.data_type()}; the StepIO has inputs {sorted(inputs)}")
            _df.check_contiguous(inputs[tid], _df.noncontiguous_input(tid))
            feeds[tid] = _df.validate_input(tid, inputs[tid], info, bps, A, R, asserts is True,
                                            offsets)
        if asserts is not False:   # PopART's runtime asserts (CorrectnessAsserter::checkIn)
            for tid in sorted(set(inputs) - set(self.input_infos)):
                self._check_extra_input(tid, inputs[tid])
        return feeds

    def _check_extra_input(self, tid: str, array: Any) -> None:
        """A StepIO input that is no stream of the model, as PopART's runtime asserts see it:
        an ONNX graph input of the right size (a weight) is ignored; any other tensor of the
        model, or no tensor at all, raises PopART's error."""
        if tid in self.infos:
            if tid not in self.onnx_inputs:
                raise StepIOError(f"The tensor '{tid}' has been provided as one of the inputs to "
                                  f"the stepIO, but it is not registered as one of the inputs "
                                  f"to the model. Please check this tensor and your stepIO.")
            bps, A, R = self.factors()
            n = self.infos[tid].nelms()
            if np.size(array) != n * bps * A * R:
                raise StepIOError(
                    f"Unexpected number of input elements for Tensor {tid}. Expected "
                    f"{n * bps * A * R}, but received {np.size(array)}.\nTo disable this check "
                    f"at your own risk, use IStepIO::enableRuntimeAsserts.\nThis with, \n   "
                    f"replication  factor = {R}\n   accumulation factor = {A}\n   batches per "
                    f"step    = {bps}\n   Tensor nelms        = {n}")
        elif tid in self.onnx_inputs:
            _logger.warn(f"The input Tensor {tid} to the ONNX Model does not appear in the "
                         f"optimized PopART Ir, possibly due to constant folding. Therefore, the "
                         f"input buffer provided will not be used. ")
        else:
            raise noted(StepIOError(f"Testing that the buffer provided by user for input Tensor "
                                    f"{tid} has the correct number of elements, But there is no "
                                    f"Tensor named {tid} in the Ir's main Graph, and it does not "
                                    f"exist in the original ONNX Model."),
                        f"The model's inputs are {sorted(self.input_infos)}")

    def _gather_callback_inputs(self, cb: Any) -> dict[str, np.ndarray]:
        bps, A, R = self.factors()
        feeds = {}
        for tid, info in self.input_infos.items():
            parts = []
            for _ in range(bps * A):
                arr = cb.input_callback(tid, False)
                _df.check_contiguous(arr, _df.noncontiguous_input(tid))
                arr = np.asarray(arr)
                cb.input_complete_callback(tid)
                parts.append(_df.validate_input(tid, arr, info, 1, 1, R, False)[0, 0])
            feeds[tid] = np.stack(parts).reshape((bps, A, R, *info.shape()))
        return feeds

    def _mode(self) -> str:
        return getattr(getattr(self.options, "syntheticDataMode", None), "name", "Off")

    def _check_synthetic_types(self) -> None:
        """Ir::registerInputTensors: synthetic data exists for the float and 8- to 32-bit
        types only (convertFloatToDataType; generateSyntheticUniformData)."""
        mode = self._mode()
        for tid, info in ({} if mode == "Off" else self.input_infos).items():
            if info.np_dtype() not in _SYNTHETIC_TYPES:
                what = "generate synthetic data for" if mode == "RandomUniform" else \
                    "convert float to"
                raise noted(popart_exception(f"Can't {what} DataType {info.data_type()}"),
                            f"syntheticDataMode {mode}: input '{tid}' is {info.data_type()}")

    def synthetic(self) -> Optional[dict[str, np.ndarray]]:
        """SessionOptions.syntheticDataMode (Ir::useSyntheticData): None when Off; else
        every input's data, made once (Ir::registerInputTensors) and used for every
        micro-batch, the StepIO's inputs ignored and no anchor written: zeros, standard
        normal (rounded to the nearest integer for integer types, as convertFloatToDataType)
        or uniform over the type's range (floats: float16's +-65504, else float32's), each
        input from its own generator with one fixed seed (as PopART's; not bit-equal to its
        mt19937 draws)."""
        mode = self._mode()
        if mode == "Off":
            return None
        if self._synthetic is None:
            bps, A, R = self.factors()
            feeds = {}
            for tid, info in self.input_infos.items():
                shape, dtype, rng = info.shape(), info.np_dtype(), np.random.default_rng(0)
                integer = not np.issubdtype(dtype, np.floating) and dtype != np.bool_
                if mode == "Zeros":
                    one = np.zeros(shape, dtype)
                elif mode == "RandomNormal":
                    one = rng.standard_normal(shape).astype(np.float32)
                    one = np.rint(one).astype(np.int64).astype(dtype) if integer else one.astype(dtype)
                elif np.issubdtype(dtype, np.floating):
                    top = 65504.0 if dtype == np.float16 else float(np.finfo(np.float32).max)
                    one = rng.uniform(-top, top, shape).astype(dtype)
                else:
                    lim = (0, 1) if dtype == np.bool_ else (np.iinfo(dtype).min, np.iinfo(dtype).max)
                    one = rng.integers(lim[0], lim[1], shape, endpoint=True).astype(dtype)
                feeds[tid] = np.broadcast_to(one, (bps, A, R, *shape))
            self._synthetic = feeds
        return self._synthetic


# The types PopART makes synthetic data for (util.cpp convertFloatToDataType).
_SYNTHETIC_TYPES = {np.dtype(t) for t in (np.float32, np.float16, np.int32, np.uint32, np.int16,
                                          np.uint16, np.int8, np.uint8, np.bool_)}


def _check_anchor_dtype(a: str, dst: Any, dtype: np.dtype) -> None:
    """Anchors are written as they are, never cast: the output array must have the tensor's dtype."""
    if isinstance(dst, np.ndarray) and dst.dtype != dtype:
        raise StepIOError(f"Output array for anchor '{a}' has dtype {dst.dtype}, but the tensor is "
                          f"{np.dtype(dtype)}; anchors are not cast (session.initAnchorArrays() "
                          f"creates arrays of the right dtypes)")


def weights_to_io(weightsIo: Any, weights: Mapping[str, np.ndarray],
                  state: Mapping[str, np.ndarray]) -> None:
    """readWeights: copy host ``weights`` (and optimizer ``state``) into the arrays of a
    PyWeightsIO."""
    for tid, dst in _weights_dict(weightsIo).items():
        src = weights.get(tid, state.get(tid))
        if src is None:
            raise WeightsIOError(f"readWeights: '{tid}' is not a weight or optimizer state "
                                 f"tensor of the session (weights: {sorted(weights)})")
        _copy_checked(tid, dst, src)


def weights_from_io(weightsIo: Any, weights: dict, state: dict) -> dict[str, np.ndarray]:
    """writeWeights: the arrays of a PyWeightsIO into host ``weights`` / optimizer ``state``
    (by id, each of its tensor's shape; converted to its dtype). Returns the written arrays
    by id (checked first: nothing is written when one is wrong)."""
    written = {}
    for tid, src in _weights_dict(weightsIo).items():
        target = weights if tid in weights else state if tid in state else None
        if target is None:
            raise WeightsIOError(f"writeWeights: '{tid}' is not a weight of the session "
                                 f"(weights: {sorted(weights)})")
        if np.shape(src) != target[tid].shape:
            want, got = list(target[tid].shape), list(np.shape(src))
            raise WeightsIOError(
                f"The shape of the MutableVoidData for IO does not not match the expected "
                f"write region of this tensor. Tensor Write ({len(want)}): {want} != "
                f"MutableVoidData ({len(got)}): {got} (writeWeights: '{tid}' has shape "
                f"{shape_str(want)}, given {shape_str(got)})")
        written[tid] = np.array(src, dtype=target[tid].dtype)
    for tid, value in written.items():
        (weights if tid in weights else state)[tid] = value
    return written


def _weights_dict(weightsIo: Any) -> dict:
    """A PyWeightsIO's arrays by tensor id (a dict is taken as it is)."""
    d = getattr(weightsIo, "weights", weightsIo)
    if not isinstance(d, dict):
        raise popart_exception(f"Expected a popart.PyWeightsIO, got {type(weightsIo).__name__}")
    return d


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
