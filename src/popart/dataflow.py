"""DataFlow, anchors, StepIO classes (API reference 13.2, 13.6) and the host buffer shapes.

Host buffers follow the glossary (user guide 11.8): inputs are
``[batchesPerStep, accumulationFactor, replicationFactor, *tensor_shape]`` and anchors have the
shapes the AnchorReturnTypeId docs give, each with its size-1 leading dimensions dropped.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from .errors import ArgumentError, DataFlowError, StepIOError, WeightsIOError, popart_exception
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


class AnchorReturnType:
    """How an anchor is returned: ``AnchorReturnType("ALL")``, ``("FINAL")``, ``("SUM")`` or
    ``("EVERYN", N)`` (case-insensitive)."""

    def __init__(self, artString: str, returnPeriod: Any = None, tileSet: Any = TileSet.Compute,
                 exchangeStrategy: Any = ExchangeStrategy.JustInTime) -> None:
        if isinstance(returnPeriod, _Enum):  # the (artString, tileSet, exchangeStrategy) form
            if isinstance(tileSet, ExchangeStrategy):
                exchangeStrategy = tileSet
            returnPeriod, tileSet = None, returnPeriod
        ids = {name.upper(): member for name, member in AnchorReturnTypeId.__members__.items()}
        if not isinstance(artString, str) or artString.upper() not in ids:
            raise DataFlowError(f"Invalid anchor return type ID supplied: {artString} (expected "
                                "one of 'ALL', 'FINAL', 'SUM' or 'EVERYN' with a return period)")
        self._id = ids[artString.upper()]
        self._str = artString
        if self._id == AnchorReturnTypeId.EveryN:
            if returnPeriod is None:
                raise DataFlowError(f"Must specify return period with option 'EVERYN': use "
                                    f"AnchorReturnType('{artString}', N)")
            self._rp = _integer(returnPeriod, "AnchorReturnType: returnPeriod")
            if self._rp <= 0:
                raise DataFlowError(f"Anchor return period must be greater than zero, got "
                                    f"{returnPeriod!r}")
        elif returnPeriod is not None:
            raise DataFlowError(f"A return period should not be supplied for this anchor return "
                                f"type ('{artString}' was given return period {returnPeriod!r})")
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
            raise DataFlowError(f"'Batches per step' must be greater than zero (DataFlow: "
                                f"batchesPerStep must be an integer >= 1, got {batchesPerStep!r})")
        for tid, art in self._anchors.items():
            if art.id() != AnchorReturnTypeId.EveryN:
                continue
            if art.rp() > bps:
                raise DataFlowError(
                    f"Return period must be <= to the number of batches per step (DataFlow: "
                    f"anchor '{tid}' has return period {art.rp()}, batchesPerStep is {bps})")
            if bps % art.rp():
                raise DataFlowError(
                    f"Return period must be a factor of the number of batches per step "
                    f"(DataFlow: anchor '{tid}' has return period {art.rp()}, batchesPerStep "
                    f"is {bps})")
        self._bps = bps

    def anchors(self) -> list[str]:
        return list(self._anchors)

    def art(self, anchorId: str) -> AnchorReturnType:
        if anchorId not in self._anchors:
            raise DataFlowError(f"Tensor '{anchorId}' is not an anchor of this DataFlow; "
                                f"anchors are {self.anchors()}")
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
            raise popart_exception(f"No input shape info for Tensor `{tensorId}' in "
                                   f"InputShapeInfo::get (InputShapeInfo has no entry for "
                                   f"tensor '{tensorId}')")
        return self._infos[tensorId]

    def has(self, tensorId: str) -> bool:
        return tensorId in self._infos

    def getInfos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)


class PyStepIO:
    """Input and anchor buffers for one ``session.run``: dicts from tensor id to array.

    With runtime asserts enabled (off by default here: PopART's own asserts only count
    elements, which is always checked), inputs must also have exactly the host shape. As
    PopART's, NumPy arrays must be C-contiguous (StepIOError otherwise: no hidden copy)."""

    def __init__(self, inputs: Mapping[str, Any], outputs: Mapping[str, np.ndarray]) -> None:
        for tid, array in inputs.items():
            check_contiguous(array, noncontiguous_input(tid))
        for tid, array in outputs.items():
            check_contiguous(array, noncontiguous_output(tid))
        self.inputs = inputs
        self.outputs = outputs
        self.runtime_asserts = False

    def enableRuntimeAsserts(self, enable: bool) -> None:
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


def validate_input(tensor_id: str, array: Any, tensor_info: TensorInfo, bps: int, accl: int,
                   repl: int, strict: bool = False) -> np.ndarray:
    """Check a StepIO input against its tensor and return it as ``[bps, accl, repl, *shape]``.

    Raises StepIOError when the dtype differs (never casts) or the element count differs; with
    ``strict`` (runtime asserts) also when the shape is neither the host shape (size-1 leading
    dims dropped) nor the full ``[bps, accl, repl, *shape]``."""
    array = np.asarray(array)
    shape = tensor_info.shape()
    full = [bps, accl, repl, *shape]
    host = input_host_shape(shape, bps, accl, repl)
    dtype = tensor_info.np_dtype()

    def fail(problem: str) -> StepIOError:
        return StepIOError(
            f"Input tensor '{tensor_id}': {problem}. Expected {tensor_info.data_type()} data of "
            f"shape {shape_str(host)} ({int(np.prod(full))} elements: batchesPerStep={bps}, "
            f"accumulationFactor={accl}, replicationFactor={repl}, tensor shape "
            f"{shape_str(shape)}); got {array.dtype} data of shape {shape_str(array.shape)} "
            f"({array.size} elements)")

    if array.dtype != dtype:
        raise fail(f"data type {array.dtype} does not match {dtype}")
    expected = int(np.prod(full, dtype=np.int64))
    if array.size != expected:
        raise fail(f"Unexpected number of input elements for Tensor {tensor_id}. Expected "
                   f"{expected}, but received {array.size}")
    if strict and list(array.shape) not in (host, full):
        raise fail("shape does not match (runtime asserts are enabled)")
    return array.reshape(full)
