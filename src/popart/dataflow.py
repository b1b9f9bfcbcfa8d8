"""DataFlow, anchors, StepIO classes (API reference 13.2, 13.6) and the host buffer shapes.

Host buffers follow the glossary (user guide 11.8): inputs are
``[batchesPerStep, accumulationFactor, replicationFactor, *tensor_shape]`` and anchors have the
shapes the AnchorReturnTypeId docs give, each with its size-1 leading dimensions dropped.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from .errors import (ArgumentError, DataFlowError, StepIOError, WeightsIOError, noted,
                     check_arguments, integral, sequence_of,
                     popart_exception)
from .options import ExchangeStrategy, ReplicatedStreamMode, TileSet, _Enum, _enum
from .tensorinfo import TensorInfo, shape_str

__all__ = ["AnchorReturnTypeId", "AnchorReturnType", "DataFlow", "InputSettings",
           "InputShapeInfo", "PyStepIO", "PyStepIOCallback", "PyWeightsIO"]

AnchorReturnTypeId = _enum("AnchorReturnTypeId", "Final EveryN All Sum")


def _integer(value: Any, what: str) -> int:
    """``value`` as an int; ArgumentError (a TypeError, as PopART's bindings raise) for a bool,
    a float or anything else that is not an integer."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentError(f"{what} must be an integer, got {value!r}")
    return int(value)


def check_contiguous(array: Any, message: str) -> None:
    """Raise StepIOError(``message``) if ``array`` is a NumPy array that is not C-contiguous
    (PopART's bindings read host buffers in place and refuse to convert them)."""
    if isinstance(array, np.ndarray) and not array.flags.c_contiguous:
        raise StepIOError(message)


def noncontiguous_input(tensor_id: str) -> str:
    return (f"PyStepIO is unable to use the numpy input array for tensor '{tensor_id}' as it "
            "is not c-contiguous (a data conversion here could have a significant impact on "
            "performance and hence is not allowed)")


def check_weights_contiguous(tensor_id: str, array: Any) -> None:
    """WeightsIOError, PopART's PyWeightsIO message, if ``array`` is not C-contiguous."""
    if isinstance(array, np.ndarray) and not array.flags.c_contiguous:
        raise WeightsIOError(
            f"PyWeightsIO is unable to use the provided numpy output array for tensor "
            f"'{tensor_id}' as it is not c-contiguous. Please use a function like "
            f"`numpy.ascontiguousarray()` to make contiguous before passing to PyWeightsIO")


def noncontiguous_output(tensor_id: str) -> str:
    return (f"PyStepIO is unable to use the numpy output array for tensor '{tensor_id}' as it "
            "is not c-contiguous (a data conversion here could have a significant impact on "
            "performance and hence is not allowed)")


# pybind11's signatures of popart_core's AnchorReturnType and DataFlow constructors
# (popart.cpp); a default argument as pybind11 shows it, less the address.
_ART_FORMS = [f"popart_core.AnchorReturnType(anchorReturnTypeString: str, {rp}tileSet: "
              "popart_core.TileSet = <TileSet.Compute: 0>, exchangeStrategy: "
              "popart_core.ExchangeStrategy = <ExchangeStrategy.JustInTime: 0>)"
              for rp in ("", "returnPeriod: int, ")]
_DF_MAP = "anchorTensors: Dict[str, popart_core.AnchorReturnType]"
_DF_FORMS = [f"popart_core.DataFlow(batchesPerStep: int, {_DF_MAP})"] * 2 + [
    "popart_core.DataFlow(batchesPerStep: int, anchorIds: List[str], anchorReturnType: "
    "popart_core.AnchorReturnType = <popart_core.AnchorReturnType object>)"]


class AnchorReturnType:
    """How an anchor is returned: ``AnchorReturnType("ALL")``, ``("FINAL")``, ``("SUM")`` or
    ``("EVERYN", N)`` (case-insensitive)."""

    def __init__(self, anchorReturnTypeString: str, returnPeriod: Any = None,
                 tileSet: Any = TileSet.Compute, exchangeStrategy: Any = ExchangeStrategy.JustInTime) -> None:
        check_arguments(isinstance(anchorReturnTypeString, str) and (
            returnPeriod is None or integral(returnPeriod) or isinstance(returnPeriod, _Enum)),
            "__init__", _ART_FORMS, tuple(a for a in (anchorReturnTypeString, returnPeriod)
                                          if a is not None), True)
        if isinstance(returnPeriod, _Enum):  # the (anchorReturnTypeString, tileSet, exchangeStrategy) form
            if isinstance(tileSet, ExchangeStrategy):
                exchangeStrategy = tileSet
            returnPeriod, tileSet = None, returnPeriod
        ids = {name.upper(): member for name, member in AnchorReturnTypeId.__members__.items()}
        if not isinstance(anchorReturnTypeString, str) or anchorReturnTypeString.upper() not in ids:
            raise noted(DataFlowError(
                f"Invalid anchor return type ID supplied: {anchorReturnTypeString}"),
                "Expected one of 'ALL', 'FINAL', 'SUM' or 'EVERYN' with a return period")
        self._id = ids[anchorReturnTypeString.upper()]
        self._str = anchorReturnTypeString
        if self._id == AnchorReturnTypeId.EveryN:
            if returnPeriod is None:
                raise noted(DataFlowError("Must specify return period with option 'EVERYN'"),
                            f"Use AnchorReturnType('{anchorReturnTypeString}', N)")
            self._rp = _integer(returnPeriod, "AnchorReturnType: returnPeriod")
            if self._rp <= 0:
                raise noted(DataFlowError("Anchor return period must be greater than zero"),
                            f"Got {returnPeriod!r}")
        elif returnPeriod is not None:
            raise noted(DataFlowError("A return period should not be supplied for this "
                                      "anchor return type"),
                        f"'{anchorReturnTypeString}' was given return period {returnPeriod!r}")
        else:
            self._rp = 0
        self._tile_set = TileSet(tileSet)
        self._exchange = ExchangeStrategy(exchangeStrategy)

    def id(self) -> Any:
        return self._id

    def rp(self) -> int:
        return self._rp

    def tileSet(self) -> Any:
        return self._tile_set

    def exchangeStrategy(self) -> Any:
        return self._exchange

    def str(self) -> str:
        return self._str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnchorReturnType) and (
            (self._id, self._rp, self._tile_set, self._exchange)
            == (other._id, other._rp, other._tile_set, other._exchange))

    def __hash__(self) -> int:
        return hash((self._id, self._rp))

    def __repr__(self) -> str:
        rp = f", {self._rp}" if self._id == AnchorReturnTypeId.EveryN else ""
        return f'AnchorReturnType("{self._str}"{rp})'

    __str__ = str


def device_lead_dims(art: AnchorReturnType) -> int:
    """Leading dimensions of an anchor's device value: [B, A, R] for All / EveryN (the
    engine keeps every, or every N-th, batch), [R] for Final / Sum."""
    return 3 if art.id() in (AnchorReturnTypeId.All, AnchorReturnTypeId.EveryN) else 1


class DataFlow:
    """Batches per step and the anchored tensors with their return types.

    ``DataFlow(batchesPerStep, {id: AnchorReturnType})`` or
    ``DataFlow(batchesPerStep, [ids], anchorReturnType=AnchorReturnType("All"))``."""

    def __init__(self, batchesPerStep: int, anchorTensors: Any = None,
                 anchorReturnType: Optional[AnchorReturnType] = None, *,
                 anchorIds: Optional[Sequence[str]] = None) -> None:
        anchors = anchorIds if anchorTensors is None else anchorTensors
        if anchors is None:
            anchors = {}
        check_arguments(integral(batchesPerStep) and (
            (isinstance(anchors, Mapping) and all(isinstance(k, str) and isinstance(
                v, AnchorReturnType) for k, v in anchors.items()))
            or (sequence_of(anchors, lambda t: isinstance(t, str))
                and isinstance(anchorReturnType, (AnchorReturnType, type(None))))),
            "__init__", _DF_FORMS, (batchesPerStep, anchors) + (
                () if anchorReturnType is None else (anchorReturnType,)), True)
        if not isinstance(anchors, Mapping):
            ids = list(anchors)
            if len(set(ids)) != len(ids):
                dup = sorted({i for i in ids if ids.count(i) > 1})
                raise DataFlowError(f"DataFlow: anchor ids must be unique, {dup} repeated")
            art = anchorReturnType if anchorReturnType is not None else AnchorReturnType("All")
            anchors = {i: art for i in ids}
        for tid, art in anchors.items():
            if not isinstance(art, AnchorReturnType):
                raise DataFlowError(f"DataFlow: anchor '{tid}' needs an AnchorReturnType, "
                                    f"got {art!r}")
        self._anchors: dict[str, AnchorReturnType] = dict(anchors)
        self.setBatchesPerStep(batchesPerStep)

    def setBatchesPerStep(self, batchesPerStep: int) -> None:
        """Set batches per step: an integer > 0 that every EVERYN return period divides
        (PopART's checks and messages); the DataFlow is unchanged when it raises."""
        bps = _integer(batchesPerStep, "DataFlow: batchesPerStep")
        if bps <= 0:
            raise noted(DataFlowError("'Batches per step' must be greater than zero"),
                        f"DataFlow: batchesPerStep must be an integer >= 1, got "
                        f"{batchesPerStep!r}")
        for tid, art in self._anchors.items():
            if art.id() != AnchorReturnTypeId.EveryN:
                continue
            if art.rp() > bps:
                raise noted(DataFlowError("Return period must be <= to the number of "
                                          "batches per step"),
                            f"DataFlow: anchor '{tid}' has return period {art.rp()}, "
                            f"batchesPerStep is {bps}")
            if bps % art.rp():
                raise noted(DataFlowError("Return period must be a factor of the number of "
                                          "batches per step"),
                            f"DataFlow: anchor '{tid}' has return period {art.rp()}, "
                            f"batchesPerStep is {bps}")
        self._bps = bps

    def anchors(self) -> list[str]:
        return list(self._anchors)

    def art(self, anchorId: str) -> AnchorReturnType:
        if anchorId not in self._anchors:
            raise noted(DataFlowError(f"Tensor {anchorId} is not an anchor"),
                        f"The DataFlow's anchors are {self.anchors()}")
        return self._anchors[anchorId]

    def batchesPerStep(self) -> int:
        return self._bps

    def isAnchored(self, anchorId: str) -> bool:
        return anchorId in self._anchors

    def nAnchors(self) -> int:
        return len(self._anchors)

    def __repr__(self) -> str:
        return f"DataFlow({self._bps}, {self._anchors!r})"


class InputSettings:
    """Per-input stream settings: ``InputSettings(tileSet, exchangeStrategy)`` or
    ``InputSettings(replicatedStreamMode)``."""

    def __init__(self, tileSet: Any = TileSet.Compute,
                 exchangeStrategy: Any = ExchangeStrategy.JustInTime,
                 replicatedStreamMode: Any = ReplicatedStreamMode.Replicate) -> None:
        if isinstance(tileSet, ReplicatedStreamMode):
            replicatedStreamMode, tileSet = tileSet, TileSet.Compute
        self._tile_set = TileSet(tileSet)
        self._exchange = ExchangeStrategy(exchangeStrategy)
        self._mode = ReplicatedStreamMode(replicatedStreamMode)

    def tileSet(self) -> Any:
        return self._tile_set

    def exchangeStrategy(self) -> Any:
        return self._exchange

    def replicatedStreamMode(self) -> Any:
        return self._mode

    def setTileSet(self, tileSet: Any) -> None:
        self._tile_set = TileSet(tileSet)

    def setExchangeStrategy(self, exchangeStrategy: Any) -> None:
        self._exchange = ExchangeStrategy(exchangeStrategy)

    def setReplicatedStreamMode(self, mode: Any) -> None:
        self._mode = ReplicatedStreamMode(mode)

    def __repr__(self) -> str:
        return f"InputSettings({self._tile_set}, {self._exchange}, {self._mode})"


class InputShapeInfo:
    """Shapes of inputs the model leaves unspecified."""

    def __init__(self) -> None:
        self._infos: dict[str, TensorInfo] = {}

    def add(self, tensorId: str, info: TensorInfo) -> None:
        self._infos[tensorId] = info

    def get(self, tensorId: str) -> TensorInfo:
        if tensorId not in self._infos:
            raise noted(popart_exception(f"No input shape info for Tensor `{tensorId}' in "
                                         f"InputShapeInfo::get"),
                        f"InputShapeInfo has no entry for tensor '{tensorId}'")
        return self._infos[tensorId]

    def has(self, tensorId: str) -> bool:
        return tensorId in self._infos

    def getInfos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)


class PyStepIO:
    """Input and anchor buffers for one ``session.run``: dicts from tensor id to array.

    By default element counts are checked (PopART's runtime asserts); enableRuntimeAsserts(True)
    also checks the exact host shape, enableRuntimeAsserts(False) turns the checks off and
    reads inputs as PopART's StepIO does, wrapping around at a buffer's end. As
    PopART's, NumPy arrays must be C-contiguous (StepIOError otherwise: no hidden copy)."""

    def __init__(self, inputs: Mapping[str, Any], outputs: Mapping[str, np.ndarray]) -> None:
        check_arguments(all(isinstance(d, Mapping) and all(isinstance(k, str) for k in d)
                            for d in (inputs, outputs)), "__init__", [
            "popart_core.PyStepIO(inputs: Dict[str, numpy.ndarray], outputs: "
            "Dict[str, numpy.ndarray])"], (inputs, outputs), True)
        for tid, array in inputs.items():
            check_contiguous(array, noncontiguous_input(tid))
        for tid, array in outputs.items():
            check_contiguous(array, noncontiguous_output(tid))
        self.inputs = inputs
        self.outputs = outputs
        self.runtime_asserts: Optional[bool] = None   # PopART's default: element counts checked
        self.offsets: dict[str, int] = {}   # where each input's next read starts (wrap-around)

    def enableRuntimeAsserts(self, enable: bool) -> None:
        """True: also the exact host shape; False: no size check, inputs read as PopART's
        StepIO reads them (one micro-batch at a time, wrapping around at the buffer's end)."""
        self.runtime_asserts = bool(enable)


class PyStepIOCallback:
    """StepIO backed by callbacks: ``input_callback(id, prefetch) -> array``,
    ``input_complete_callback(id)``, ``output_callback(id) -> array``,
    ``output_complete_callback(id)``."""

    def __init__(self, input_callback: Callable[[str, bool], np.ndarray],
                 input_complete_callback: Callable[[str], None],
                 output_callback: Callable[[str], np.ndarray],
                 output_complete_callback: Callable[[str], None]) -> None:
        self.input_callback = input_callback
        self.input_complete_callback = input_complete_callback
        self.output_callback = output_callback
        self.output_complete_callback = output_complete_callback
        self.runtime_asserts = False

    def enableRuntimeAsserts(self, enable: bool) -> None:
        self.runtime_asserts = bool(enable)


class PyWeightsIO:
    """Host buffers for weights (``session.readWeights`` / ``writeWeights``); NumPy arrays
    must be C-contiguous, as PopART's (WeightsIOError otherwise)."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        for tid, array in weights.items():
            check_weights_contiguous(tid, array)
        self.weights = weights


# --- host buffer shapes -------------------------------------------------------------------
def _drop_ones(leading: Iterable[int], tensor_shape: Iterable[int]) -> list[int]:
    return [int(d) for d in leading if d != 1] + [int(d) for d in tensor_shape]


def input_host_shape(tensor_shape: Sequence[int], batches_per_step: int,
                     accumulation_factor: int, replication_factor: int) -> list[int]:
    """``[bps, accl, repl, *tensor_shape]`` with the size-1 ones among the first three dropped."""
    return _drop_ones((batches_per_step, accumulation_factor, replication_factor), tensor_shape)


def anchor_host_shape(tensor_shape: Sequence[int], art: Any, batches_per_step: int,
                      accumulation_factor: int, replication_factor: int) -> list[int]:
    """Host buffer shape of an anchor (AnchorReturnTypeId docs), size-1 leading dims dropped.

    All: ``[bps, accl, repl, *shape]``; EveryN: ``[bps // N, accl, repl, *shape]``;
    Final and Sum: ``[repl, *shape]``. ``art`` is an AnchorReturnType or an AnchorReturnTypeId
    (EveryN then needs an AnchorReturnType for N)."""
    kind = art.id() if isinstance(art, AnchorReturnType) else AnchorReturnTypeId(art)
    if kind == AnchorReturnTypeId.All:
        leading = (batches_per_step, accumulation_factor, replication_factor)
    elif kind == AnchorReturnTypeId.EveryN:
        if not isinstance(art, AnchorReturnType):
            raise popart_exception("anchor_host_shape: EveryN needs an AnchorReturnType "
                                   "carrying its return period")
        leading = (batches_per_step // art.rp(), accumulation_factor, replication_factor)
    else:  # Final, Sum
        leading = (replication_factor,)
    return _drop_ones(leading, tensor_shape)


_warned_int64 = False   # PopART warns once per process (Devicex::InputDatastream::read)


def _type_name(dtype: np.dtype) -> str:
    from .tensorinfo import to_datatype
    try:
        d = to_datatype(dtype)
        return getattr(d, "name", str(d))
    except Exception:
        return str(dtype)


def validate_input(tensor_id: str, array: Any, tensor_info: TensorInfo, bps: int, accl: int,
                   repl: int, strict: bool = False,
                   offsets: Optional[dict] = None) -> np.ndarray:
    """Check a StepIO input against its tensor and return it as ``[bps, accl, repl, *shape]``.

    As PopART's stepio and Devicex: INT64 data for an INT32 input is narrowed (a warning, once
    per process; StepIOError if a value does not fit, which PopART would wrap); any other
    data type that differs raises PopART's "Type discrepancy" error (never cast). An element
    count that differs raises PopART's runtime-assert error, unless ``offsets`` is given (the
    StepIO's runtime asserts are disabled): then the buffer is read as PopART's StepIO reads
    it, one tensor's elements per micro-batch and replica from the StepIO's offset
    (``offsets[tensor_id]``, kept between runs), wrapping around at its end. With ``strict``
    (runtime asserts enabled) the shape must also be the host shape or the full one."""
    global _warned_int64
    array = np.asarray(array)
    shape = tensor_info.shape()
    full = [bps, accl, repl, *shape]
    host = input_host_shape(shape, bps, accl, repl)
    dtype = tensor_info.np_dtype()

    def fail(problem: str, popart_message: Optional[str] = None) -> StepIOError:
        """PopART's message where it has one, this context in a note; else the context."""
        context = (f"Input tensor '{tensor_id}': {problem}. Expected {tensor_info.data_type()} "
                   f"data of shape {shape_str(host)} ({int(np.prod(full))} elements: "
                   f"batchesPerStep={bps}, accumulationFactor={accl}, replicationFactor={repl}, "
                   f"tensor shape {shape_str(shape)}); got {array.dtype} data of shape "
                   f"{shape_str(array.shape)} ({array.size} elements)")
        if popart_message is None:
            return StepIOError(context)
        return noted(StepIOError(popart_message), context)

    if array.dtype == np.int64 and dtype == np.int32:
        if array.size and (array.min() < -2 ** 31 or array.max() >= 2 ** 31):
            raise fail("an INT64 value does not fit INT32 (PopART would wrap it around)")
        if not _warned_int64:
            from .logging import getLogger
            getLogger("devicex").warn(f"Copying (host) tensor {tensor_id} from INT64 to INT32. "
                                      f"Will only warn once")
            _warned_int64 = True
        array = array.astype(np.int32)
    if array.dtype != dtype:
        raise fail(f"data type {array.dtype} does not match {dtype}",
                   f"Type discrepancy for tensor {tensor_id}. User provided : "
                   f"{_type_name(array.dtype)} and expected : {tensor_info.data_type()}. "
                   f"Consider a custom copy here (as memcpy cannot be used)")
    expected = int(np.prod(full, dtype=np.int64))
    if array.size != expected:
        chunk = max(int(np.prod(shape, dtype=np.int64)), 1)
        if offsets is None or array.size == 0 or array.size % chunk:
            raise fail(
                "its element count does not match",
                f"Unexpected number of input elements for Tensor {tensor_id}. Expected "
                f"{expected}, but received {array.size}.\nTo disable this check at your own "
                f"risk, use IStepIO::enableRuntimeAsserts.\nThis with, \n   replication  "
                f"factor = {repl}\n   accumulation factor = {accl}\n   batches per step    "
                f"= {bps}\n   Tensor nelms        = {chunk}")
        chunks = array.reshape(-1, *shape)   # the StepIO's reads, wrapping around at its end
        start = offsets.get(tensor_id, 0)
        need = bps * accl * repl
        offsets[tensor_id] = (start + need) % len(chunks)
        return chunks[(start + np.arange(need)) % len(chunks)].reshape(full)
    if offsets is not None:   # a whole buffer read: the StepIO's offset is back at its start
        offsets[tensor_id] = 0
    if strict and list(array.shape) not in (host, full):
        raise fail("shape does not match (runtime asserts are enabled)")
    return array.reshape(full)
