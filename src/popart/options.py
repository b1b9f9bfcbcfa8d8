"""SessionOptions, its nested settings structures and PopART's enums (API reference 13.1).

Every documented option is accepted with its documented default. Options that only mean
something on IPU hardware (tile counts, Poplar engine options, scheduling heuristics) are kept
and reported by :meth:`SessionOptions.summary` but change nothing.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import numpy as np

from .errors import OptionError, OptionTypeError, incompatible_arguments, noted


__all__ = [
    "AccumulateOuterFragmentSchedule", "AutodiffStitchStrategy", "BatchSerializationBatchSchedule",
    "BatchSerializationMethod", "BatchSerializationTransformContext", "CommGroupType",
    "ExecutionPhaseIOSchedule", "ExecutionPhaseSchedule", "GradientTensorTrackingMethod",
    "Instrumentation", "IrSerializationFormat", "MeanReductionStrategy", "MergeVarUpdateType",
    "RecomputationType", "RecomputeType", "ReductionType", "ReplicatedTensorSharding",
    "SubgraphCopyingStrategy", "SyntheticDataMode", "TileSet", "VariableRetrievalMode",
    "VirtualGraphMode", "TensorStorage", "ExchangeStrategy", "ReplicatedStreamMode", "InitType",
    "ScatterReduction", "TensorRemapType", "WeightDecayMode", "SGDAccumulatorAndMomentum",
    "AdamMode", "AdaptiveMode", "ReplicaGrouping", "CommGroup", "VariableSettings",
    "AccumulateOuterFragmentSettings", "AutodiffSettings", "AutomaticLossScalingSettings",
    "BatchSerializationSettings", "ExecutionPhaseSettings", "ReplicatedCollectivesSettings",
    "TensorLocation", "TensorLocationSettings", "ExperimentalSettings", "NumIOTiles",
    "SessionOptions",
]


class _Enum(enum.IntEnum):
    """A pybind11-style enum: compares equal to its int value, ``str()`` is ``Type.Member``."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def int_enum(name: str, members: str, **aliases: str) -> type[_Enum]:
    """A PopART-style enum whose members (space separated) take the values 0, 1, ... in order.

    ``aliases`` maps extra names onto existing members (pybind's second name for a value).
    Public (not in ``__all__``) for popxl's enums of PopART's IR."""
    values = {m: i for i, m in enumerate(members.split())}
    values.update({alias: values[target] for alias, target in aliases.items()})
    return _Enum(name, list(values.items()), module=__name__)  # type: ignore[return-value]


_enum = int_enum   # the short name of this module's tables (and devices.py's)


# --- enums, members in the order the API reference lists them -----------------------------
AccumulateOuterFragmentSchedule = _enum(
    "AccumulateOuterFragmentSchedule",
    "Scheduler Serial OverlapCycleOptimized OverlapMemoryOptimized")
AutodiffStitchStrategy = _enum(
    "AutodiffStitchStrategy",
    "RecomputeMinimal RecomputeAllNonInputs AddFwdOutputs SafeAddFwdOutputs")
BatchSerializationBatchSchedule = _enum(
    "BatchSerializationBatchSchedule", "Scheduler Isomorphic OverlapOnIo OverlapOnCompute")
BatchSerializationMethod = _enum("BatchSerializationMethod", "UnrollDynamic UnrollStatic Loop")
# Fwd / Bwd are PopART's second names for Forward / Backward (same value).
BatchSerializationTransformContext = _enum(
    "BatchSerializationTransformContext", "Forward Backward", Fwd="Forward", Bwd="Backward")
CommGroupType = _enum("CommGroupType", "All Consecutive Orthogonal Ungrouped")
ExecutionPhaseIOSchedule = _enum("ExecutionPhaseIOSchedule", "Preload OnDemand")
ExecutionPhaseSchedule = _enum("ExecutionPhaseSchedule", "Interleaving Batch BatchClusteredIO")
# Listed as the reference lists them, with PopART's values (sessionoptions.hpp: the default
# AllNonViewChangingGradientTensors is 0).
GradientTensorTrackingMethod = _Enum(
    "GradientTensorTrackingMethod",
    [("ConvAndMatmulGradients", 1), ("AllNonViewChangingGradientTensors", 0),
     ("GradientsOfUserSpecifiedTensors", 2)], module=__name__)
Instrumentation = _enum("Instrumentation", "Outer Inner")
IrSerializationFormat = _enum("IrSerializationFormat", "JSON")
MeanReductionStrategy = _enum("MeanReductionStrategy", "Running Post")
MergeVarUpdateType = _enum("MergeVarUpdateType", "Off All AutoTight AutoLoose")
RecomputationType = _enum(
    "RecomputationType", "NoRecompute Standard NormOnly RecomputeAll Pipeline")
RecomputeType = _enum("RecomputeType", "Undefined Checkpoint Recompute Recomputed")
ReductionType = _enum("ReductionType", "Sum Mean NoReduction")  # PopART values: Sum=0, Mean=1, NoReduction=2
ReplicatedTensorSharding = _enum("ReplicatedTensorSharding", "Off On")
SubgraphCopyingStrategy = _enum("SubgraphCopyingStrategy", "OnEnterAndExit JustInTime")
SyntheticDataMode = _enum("SyntheticDataMode", "Off Zeros RandomNormal RandomUniform")
TileSet = _enum("TileSet", "Compute IO")
VariableRetrievalMode = _enum("VariableRetrievalMode", "OnePerGroup AllReduceReplicas AllReplicas")
VirtualGraphMode = _enum("VirtualGraphMode", "Off Manual Auto ExecutionPhases")
TensorStorage = _enum("TensorStorage", "OnChip OffChip")
ExchangeStrategy = _enum(
    "ExchangeStrategy", "JustInTime OverlapInnerLoop OverlapLoops OverlapStep")
ReplicatedStreamMode = _enum("ReplicatedStreamMode", "Replicate Broadcast")
InitType = _enum("InitType", "NoInit Zero")
ScatterReduction = _enum("ScatterReduction", "Sum Max Min Mul NoReduction")
TensorRemapType = _enum("TensorRemapType", "FwdBwdReverse FwdBwd Fwd")
# Optimizer enums (13.4), imported by popart.optimizers.
WeightDecayMode = _enum("WeightDecayMode", "Decay L2Regularization")
SGDAccumulatorAndMomentum = _enum("SGDAccumulatorAndMomentum", "Combined Separate")
AdamMode = _enum("AdamMode", "Adam AdamNoBias Lamb LambNoBias AdaMax")
AdaptiveMode = _enum("AdaptiveMode", "AdaGrad RMSProp CenteredRMSProp AdaDelta")


def _as_enum(kind: type[_Enum], value: Any, what: str) -> _Enum:
    """``value`` (a member, its int value or its name) as a member of ``kind``."""
    try:
        return kind[value] if isinstance(value, str) else kind(value)
    except (KeyError, ValueError, TypeError):
        raise OptionError(f"{what}: expected a {kind.__name__} (one of "
                          f"{', '.join(kind.__members__)}), got {value!r}") from None


# --- replica groups ----------------------------------------------------------------------
class ReplicaGrouping:
    """``numReplicas`` replicas split into groups of ``groupSize`` replicas ``stride`` apart."""

    def __init__(self, numReplicas: int, stride: int = 1, groupSize: Optional[int] = None):
        groupSize = numReplicas if groupSize is None else groupSize
        if numReplicas < 1 or stride < 1 or groupSize < 1 or numReplicas % (stride * groupSize):
            raise OptionError(f"ReplicaGrouping(numReplicas={numReplicas}, stride={stride}, "
                              f"groupSize={groupSize}): stride * groupSize must divide "
                              "numReplicas and all must be positive")
        self._n, self._stride, self._size = int(numReplicas), int(stride), int(groupSize)

    def getNumReplicas(self) -> int:
        return self._n

    def getStride(self) -> int:
        return self._stride

    def getGroupSize(self) -> int:
        return self._size

    def getNumGroups(self) -> int:
        return self._n // self._size

    def getGroupAt(self, replica: int) -> int:
        s, k = self._stride, self._size
        return replica % s + (replica // (s * k)) * s

    def getIndexInGroupAt(self, replica: int) -> int:
        return (replica // self._stride) % self._size

    def getReplicaAt(self, group: int, index: int = 0) -> int:
        s, k = self._stride, self._size
        return group % s + (group // s) * s * k + index * s

    def getReplicasAt(self, group: int) -> list[int]:
        return [self.getReplicaAt(group, i) for i in range(self._size)]

    def groups(self) -> list[list[int]]:
        return [self.getReplicasAt(g) for g in range(self.getNumGroups())]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplicaGrouping) and (
            (self._n, self._stride, self._size) == (other._n, other._stride, other._size))

    def __repr__(self) -> str:
        return (f"ReplicaGrouping(numReplicas={self._n}, stride={self._stride}, "
                f"groupSize={self._size})")


@dataclasses.dataclass
class CommGroup:
    """A sub-group of replicas: ``CommGroup(CommGroupType.Consecutive, 2)``."""
    type: Any = CommGroupType.All
    replicaGroupSize: int = 0

    def __post_init__(self) -> None:
        self.type = _as_enum(CommGroupType, self.type, "CommGroup.type")
        self.replicaGroupSize = int(self.replicaGroupSize)

    def toReplicaGrouping(self, numReplicas: int) -> ReplicaGrouping:
        k = self.replicaGroupSize
        if self.type == CommGroupType.All:
            return ReplicaGrouping(numReplicas, 1, numReplicas)
        if self.type == CommGroupType.Ungrouped:
            return ReplicaGrouping(numReplicas, 1, 1)
        if k < 1 or numReplicas % k:
            raise OptionError(f"CommGroup({self.type}, {k}): replicaGroupSize must be a "
                              f"positive divisor of the replica count {numReplicas}")
        stride = 1 if self.type == CommGroupType.Consecutive else numReplicas // k
        return ReplicaGrouping(numReplicas, stride, k)


class VariableSettings:
    """How a variable is shared between replicas and how it is returned to the host.

    ``VariableSettings()``, ``(retrievalMode)``, ``(sharedVariableDomain: CommGroup)``,
    ``(sharedVariableDomain, retrievalMode)``, ``(stride, groupSize[, retrievalMode])``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        domain, mode, self._stride = CommGroup(), VariableRetrievalMode.OnePerGroup, 0
        self._use_comm_group = True
        args = list(args)
        if args and isinstance(args[0], numbers.Integral) and not isinstance(args[0], _Enum):
            self._use_comm_group = False
            self._stride, size = int(args.pop(0)), int(args.pop(0) if args
                                                         else kwargs.pop("groupSize"))
            domain = CommGroup(CommGroupType.Consecutive, size)
        elif args and isinstance(args[0], CommGroup):
            domain = args.pop(0)
        domain = kwargs.pop("sharedVariableDomain", domain)
        mode = args.pop(0) if args else kwargs.pop("retrievalMode", mode)
        if args or kwargs:
            raise OptionError(f"VariableSettings: unexpected arguments {args or kwargs!r}")
        self._domain = CommGroup(domain.type, domain.replicaGroupSize)
        self._mode = _as_enum(VariableRetrievalMode, mode, "VariableSettings.retrievalMode")
        self.verify()

    def verify(self) -> None:
        """Raise OptionError if the group size is not valid for the group type."""
        d = self._domain
        if not self._use_comm_group and (self._stride < 1 or d.replicaGroupSize < 1):
            raise OptionError(f"VariableSettings: stride ({self._stride}) and groupSize "
                              f"({d.replicaGroupSize}) must be positive integers")
        if d.type in (CommGroupType.Consecutive, CommGroupType.Orthogonal) \
                and d.replicaGroupSize < 1:
            raise OptionError(f"VariableSettings: a {d.type} CommGroup needs replicaGroupSize "
                              f">= 1, got {d.replicaGroupSize}")

    def isUsingCommGroup(self) -> bool:
        return self._use_comm_group

    def getSharedVariableDomain(self) -> CommGroup:
        if not self._use_comm_group:
            raise OptionError("VariableSettings were not created from a CommGroup")
        return CommGroup(self._domain.type, self._domain.replicaGroupSize)

    def getCommGroupType(self) -> _Enum:
        return self._domain.type

    def getRetrievalMode(self) -> _Enum:
        return self._mode

    def getGroupSize(self) -> int:
        return self._domain.replicaGroupSize

    def getReplicaGrouping(self, numReplicas: int) -> ReplicaGrouping:
        if self._use_comm_group:
            return self._domain.toReplicaGrouping(numReplicas)
        return ReplicaGrouping(numReplicas, self._stride, self._domain.replicaGroupSize)

    def getStride(self, replicaCount: Optional[int] = None) -> int:
        """Distance between replicas of one group (needs ``replicaCount`` for Orthogonal)."""
        if not self._use_comm_group:
            return self._stride
        if self._domain.type != CommGroupType.Orthogonal:
            return 1
        if replicaCount is None:
            raise OptionError("VariableSettings.getStride: an Orthogonal CommGroup's stride "
                              "depends on the replica count; pass it")
        return self.getReplicaGrouping(replicaCount).getStride()

    def getGroupCount(self, replicaCount: int) -> int:
        return self.getReplicaGrouping(replicaCount).getNumGroups()

    def getRealGroupSize(self, replicaCount: int) -> int:
        return self.getReplicaGrouping(replicaCount).getGroupSize()

    def getGroupRepresentative(self, group: int) -> int:
        """Lowest replica index in ``group``."""
        t, k = self._domain.type, self._domain.replicaGroupSize
        if not self._use_comm_group:
            return ReplicaGrouping(k * self._stride * (group + 1), self._stride,
                                   k).getReplicaAt(group)
        return {CommGroupType.All: 0, CommGroupType.Consecutive: k * group}.get(t, group)

    def numReplicasReturningVariable(self, replicaCount: int) -> int:
        if self._mode == VariableRetrievalMode.AllReplicas:
            return replicaCount
        return self.getGroupCount(replicaCount)

    def groups(self, replicaCount: int) -> list[list[int]]:
        return self.getReplicaGrouping(replicaCount).groups()

    def shapeOnHost(self, shape: Iterable[int], replicaCount: int) -> list[int]:
        """Host shape of a variable of per-replica ``shape``: a group dimension is prepended
        when there is more than one group."""
        n = self.getGroupCount(replicaCount)
        return [int(d) for d in shape] if n == 1 else [n, *map(int, shape)]

    def shapeOnReplica(self, shape: Iterable[int], replicaCount: int,
                       name: str = "") -> list[int]:
        """Inverse of :meth:`shapeOnHost`; raises if the outer dimension is not the group count."""
        shape, n = [int(d) for d in shape], self.getGroupCount(replicaCount)
        if n == 1:
            return shape
        if not shape or shape[0] != n:
            raise OptionError(f"Tensor '{name}': host shape {shape} should have an outer "
                              f"dimension equal to the number of replica groups ({n})")
        return shape[1:]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VariableSettings) and (
            (self._use_comm_group, self._stride, self._domain, self._mode)
            == (other._use_comm_group, other._stride, other._domain, other._mode))

    def __repr__(self) -> str:
        if not self._use_comm_group:
            return (f"VariableSettings(stride={self._stride}, "
                    f"groupSize={self._domain.replicaGroupSize}, {self._mode})")
        return f"VariableSettings({self._domain}, {self._mode})"


class UnknownOptionError(OptionError, AttributeError):
    """Assigning a name that is not an option: an ``AttributeError`` with pybind's text, as
    PopART's bindings raise it (and an OptionError, as this package raised before)."""


def _unknown(owner: str, name: str, note: str) -> UnknownOptionError:
    """PopART's bindings' AttributeError for setting ``name`` on ``owner``; ``note``: ours."""
    return noted(UnknownOptionError(f"'popart_core.{owner}' object has no attribute '{name}'"),
                 note)


# --- nested settings structures -----------------------------------------------------------
def _settings(cls: type) -> type:
    """A dataclass whose enum fields are coerced and whose unknown attributes raise."""
    cls = dataclasses.dataclass(cls)
    names = {f.name for f in dataclasses.fields(cls)}

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if name not in names:
            raise _unknown(type(self).__name__, name, f"{type(self).__name__} has no setting "
                           f"'{name}'; settings are: {', '.join(sorted(names))}")
        default = _FIELD_DEFAULTS[type(self)].get(name)
        if isinstance(default, _Enum):
            value = _as_enum(type(default), value, f"{type(self).__name__}.{name}")
        object.__setattr__(self, name, value)

    cls.__setattr__ = __setattr__
    _FIELD_DEFAULTS[cls] = {f.name: f.default for f in dataclasses.fields(cls)}
    return cls


_FIELD_DEFAULTS: dict[type, dict[str, Any]] = {}


@_settings
class AccumulateOuterFragmentSettings:
    schedule: Any = AccumulateOuterFragmentSchedule.Serial
    excludedVirtualGraphs: list = dataclasses.field(default_factory=list)


@_settings
class AutodiffSettings:
    stitchStrategy: Any = AutodiffStitchStrategy.RecomputeAllNonInputs


@_settings
class AutomaticLossScalingSettings:
    """PopART's automatic loss scaling settings (``sessionoptions.hpp``), in the order of its
    constructor: ``enabled``, ``toTrackTensors`` (None: unset), ``binEdgeLocation``,
    ``thresholdUpperCountProportion``, ``updatePeriod``, ``gradientTensorTrackingMethod``.
    What a training step does with them: ``engine/als.py`` (used by ``engine/program.py``)
    and ``docs/gradients.md`` (automatic loss scaling)."""
    enabled: bool = False
    toTrackTensors: Optional[list] = None
    binEdgeLocation: float = 0.125
    thresholdUpperCountProportion: float = 1e-7
    updatePeriod: int = 1
    gradientTensorTrackingMethod: Any = \
        GradientTensorTrackingMethod.AllNonViewChangingGradientTensors


@_settings
class BatchSerializationSettings:
    factor: int = 0
    concatOnVirtualGraphChange: bool = True
    concatOnExecutionPhaseChange: bool = True
    concatOnPipelineStageChange: bool = True
    transformContext: Any = BatchSerializationTransformContext.Fwd
    method: Any = BatchSerializationMethod.UnrollDynamic
    batchSchedule: Any = BatchSerializationBatchSchedule.Isomorphic


@_settings
class ExecutionPhaseSettings:
    phases: int = 0
    stages: int = 2
    weightIOSchedule: Any = ExecutionPhaseIOSchedule.Preload
    activationIOSchedule: Any = ExecutionPhaseIOSchedule.Preload
    optimizerStateIOSchedule: Any = ExecutionPhaseIOSchedule.OnDemand
    accumulatorIOSchedule: Any = ExecutionPhaseIOSchedule.Preload
    schedule: Any = ExecutionPhaseSchedule.Interleaving

    def __init__(self, phases: int = 0, stages: int = 2,
                 weightIOSchedule: Any = ExecutionPhaseIOSchedule.Preload,
                 activationIOSchedule: Any = ExecutionPhaseIOSchedule.Preload,
                 optimizerStateIOSchedule: Any = ExecutionPhaseIOSchedule.OnDemand,
                 accumulatorIOSchedule: Any = ExecutionPhaseIOSchedule.Preload,
                 optimizerSchedule: Any = ExecutionPhaseSchedule.Interleaving, *,
                 schedule: Any = None) -> None:
        """PopART's argument order; the last one (``optimizerSchedule`` in PopART's binding)
        sets the ``schedule`` field, which may also be given by that name."""
        values = dict(phases=phases, stages=stages, weightIOSchedule=weightIOSchedule,
                      activationIOSchedule=activationIOSchedule,
                      optimizerStateIOSchedule=optimizerStateIOSchedule,
                      accumulatorIOSchedule=accumulatorIOSchedule,
                      schedule=optimizerSchedule if schedule is None else schedule)
        for name, value in values.items():
            setattr(self, name, value)


@_settings
class ReplicatedCollectivesSettings:
    prepareScheduleForMergingCollectives: bool = False
    mergeAllReduceCollectives: bool = False
    mergeReduceScatterCollectives: bool = False
    mergeAllGatherCollectives: bool = False


@_settings
class TensorLocation:
    """Where a tensor lives. ``TensorLocation()``, ``(storage)``, ``(storage, rts)``,
    ``(storage, rts, shardingDomain)``, ``(storage, loadTileSet, storageTileSet, rts
    [, shardingDomain])``."""
    storage: Any = TensorStorage.OnChip
    loadTileSet: Any = TileSet.Compute
    storageTileSet: Any = TileSet.Compute
    replicatedTensorSharding: Any = ReplicatedTensorSharding.Off
    shardingDomain: CommGroup = dataclasses.field(default_factory=CommGroup)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = ["storage", "loadTileSet", "storageTileSet", "replicatedTensorSharding",
                 "shardingDomain"]
        if len(args) >= 2 and isinstance(args[1], ReplicatedTensorSharding):
            names = ["storage", "replicatedTensorSharding", "shardingDomain"]
        if len(args) > len(names):
            raise OptionError(f"TensorLocation: too many arguments {args!r}")
        values = {f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)
                  for f in dataclasses.fields(self)}
        values.update(zip(names, args), **kwargs)
        for name, value in values.items():
            setattr(self, name, value)


@_settings
class TensorLocationSettings:
    """``TensorLocationSettings(location | storage, minElementsForOffChip=2,
    minElementsForReplicatedTensorSharding=8192)``."""
    location: TensorLocation = dataclasses.field(default_factory=TensorLocation)
    minElementsForOffChip: int = 2
    minElementsForReplicatedTensorSharding: int = 8192

    def __post_init__(self) -> None:
        if not isinstance(self.location, TensorLocation):
            self.location = TensorLocation(self.location)


class ExperimentalSettings:
    """SessionOptions.experimentalSettings: ``customTransformApplierSettings`` (checkpoint
    name -> transform names, default {}) and ``createHostTransferableTensorWithOffset``
    (default False). Kept and reported by :meth:`SessionOptions.summary`; neither changes
    how a program runs on XLA (there is no tile mapping, and no custom IR transforms)."""

    __slots__ = ("_custom", "_offset")

    def __init__(self) -> None:
        object.__setattr__(self, "_custom", {})
        object.__setattr__(self, "_offset", False)

    @property
    def customTransformApplierSettings(self) -> dict[str, list[str]]:
        return self._custom

    @customTransformApplierSettings.setter
    def customTransformApplierSettings(self, value: Mapping[str, Iterable[str]]) -> None:
        what = "ExperimentalSettings.customTransformApplierSettings"
        if not isinstance(value, Mapping):
            raise OptionError(f"{what}: expected a dict of checkpoint name -> list of transform "
                              f"names, got {value!r} ({type(value).__name__})")
        out: dict[str, list[str]] = {}
        for key, names in value.items():
            if not isinstance(key, str) or isinstance(names, (str, bytes)) \
                    or not isinstance(names, Iterable):
                raise OptionError(f"{what}: expected str -> list of str, got {key!r}: {names!r}")
            names = list(names)
            if not all(isinstance(n, str) for n in names):
                raise OptionError(f"{what}['{key}']: expected transform names (str), got "
                                  f"{names!r}")
            out[key] = names
        object.__setattr__(self, "_custom", out)

    # PopART's binding name for the same field
    _customTransformApplierSettings = customTransformApplierSettings

    @property
    def createHostTransferableTensorWithOffset(self) -> bool:
        return self._offset

    @createHostTransferableTensorWithOffset.setter
    def createHostTransferableTensorWithOffset(self, value: bool) -> None:
        if not isinstance(value, (bool, np.bool_)) and value not in (0, 1):
            raise OptionError(f"ExperimentalSettings.createHostTransferableTensorWithOffset: "
                              f"expected a bool, got {value!r} ({type(value).__name__})")
        object.__setattr__(self, "_offset", bool(value))

    def __setattr__(self, name: str, value: Any) -> None:
        if not isinstance(getattr(type(self), name, None), property):
            raise _unknown("ExperimentalSettings", name, f"ExperimentalSettings has no setting "
                           f"'{name}'; settings are: createHostTransferableTensorWithOffset, "
                           "customTransformApplierSettings")
        object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExperimentalSettings) and \
            (self._custom, self._offset) == (other._custom, other._offset)

    __hash__ = None  # type: ignore[assignment]

    def __deepcopy__(self, memo: dict) -> "ExperimentalSettings":
        new = ExperimentalSettings()
        object.__setattr__(new, "_custom", copy.deepcopy(self._custom, memo))
        object.__setattr__(new, "_offset", self._offset)
        return new

    def __repr__(self) -> str:
        return (f"ExperimentalSettings(customTransformApplierSettings={self._custom!r}, "
                f"createHostTransferableTensorWithOffset={self._offset})")


class NumIOTiles:
    """PopART's wrapper of SessionOptions.numIOTiles: ``NumIOTiles()`` (unset: 0) or
    ``NumIOTiles(n)``; converts to int and compares equal to ints."""

    __slots__ = ("_value", "_assigned")

    def __init__(self, numIOTiles: Optional[int] = None) -> None:
        if numIOTiles is not None and (isinstance(numIOTiles, bool)
                                       or not isinstance(numIOTiles, numbers.Integral)):
            raise OptionError(f"NumIOTiles: expected an int, got {numIOTiles!r} "
                              f"({type(numIOTiles).__name__})")
        self._assigned = numIOTiles is not None
        self._value = int(numIOTiles) if self._assigned else 0

    def __int__(self) -> int:
        return self._value if self._assigned else 0

    __index__ = __int__

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NumIOTiles):
            return int(self) == int(other)
        if isinstance(other, numbers.Integral):
            return int(self) == int(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(int(self))

    def __repr__(self) -> str:
        return f"NumIOTiles({self._value})" if self._assigned else "NumIOTiles()"


# --- SessionOptions ------------------------------------------------------------------------
# Every option with its default (API reference 13.1.3 and PopART's sessionoptions.hpp).
_DEFAULTS: dict[str, Any] = {
    "accumulateOuterFragmentSettings": AccumulateOuterFragmentSettings(),
    "accumulationAndReplicationReductionType": ReductionType.Sum,
    "accumulationFactor": 1,
    "accumulatorTensorLocationSettings": TensorLocationSettings(),
    "activationTensorLocationSettings": TensorLocationSettings(),
    "aliasZeroCopy": False,
    "autoRecomputation": RecomputationType.NoRecompute,
    "autodiffSettings": AutodiffSettings(),
    "automaticLossScalingSettings": AutomaticLossScalingSettings(),
    "batchSerializationSettings": BatchSerializationSettings(),
    "bufferingDepthMap": {},
    "cachePath": "session_cache",
    "compilationProgressLogger": None,
    "compilationProgressTotal": 100,
    "compileEngine": True,
    "constantWeights": True,
    "convolutionOptions": {},
    "createImplicitPipeliningFwdOnlyProgram": False,
    "customCodeletCompileFlags": "",
    "customCodelets": [],
    "decomposeGradSum": False,
    "defaultBufferingDepth": 1,
    "defaultPrefetchBufferingDepth": 1,
    "delayVarUpdates": True,
    "disableGradAccumulationTensorStreams": False,
    "disableOptimizerStateTensorStreams": False,
    "dotChecks": set(),
    "dotOpNames": False,
    "enableConstantFoldingOfMultipleConsumers": True,
    "enableDistributedReplicatedGraphs": False,
    "enableEfficientOverlapIOTopoCons": False,
    "enableEngineCaching": False,
    "enableExplicitMainLoops": False,
    "enableFloatingPointChecks": False,
    "enableFullyConnectedPass": True,
    "enableGradientAccumulation": False,
    "enableInplaceAmbiguityChecking": False,
    "enableLoadAndOffloadRNGState": False,
    "enableMergeExchange": True,
    "enableNonStableSoftmax": False,
    "enableOutlining": True,
    "enableOutliningCopyCostPruning": True,
    "enablePipelining": False,
    "enablePrefetchDatastreams": True,
    "enableReplicatedGraphs": False,
    "enableSerializedMatmuls": True,
    "enableStableNorm": False,
    "enableStochasticRounding": False,
    "enableSupportedDataTypeCasting": True,
    "enableVariablesCaching": True,
    "engineOptions": {},
    "ensureFp32LossScaleTensor": False,
    "executionPhaseSettings": ExecutionPhaseSettings(),
    "experimentalSettings": ExperimentalSettings(),
    "explicitRecomputation": False,
    "exportPoplarComputationGraph": False,
    "exportPoplarVertexGraph": False,
    "finalDotOp": 10000,
    "firstDotOp": 0,
    "gclOptions": {},
    "globalReplicaOffset": 0,
    "globalReplicationFactor": 1,
    "groupHostSync": False,
    "groupNormStridedChannelGrouping": False,
    "hardwareInstrumentations": {Instrumentation.Outer},
    "hostAllReduce": False,
    "hostAllReduceRemoteBuffer": False,
    "hostWeightUpdate": False,
    "instrumentWithHardwareCycleCounter": False,
    "kahnTieBreaker": "greedy",
    "logDir": "",
    "looseThresholdAtPeak": 8000,
    "lstmOptions": {},
    "matmulOptions": {},
    "meanAccumulationAndReplicationReductionStrategy": MeanReductionStrategy.Post,
    "mergeVarUpdate": MergeVarUpdateType.Off,
    "mergeVarUpdateMemThreshold": 1000000,
    "numIOTiles": 0,
    "optimizerStateTensorLocationSettings": TensorLocationSettings(),
    "opxAliasChecking": False,
    "opxModifyChecking": False,
    "outlineSequenceBreakCost": 10000.0,
    "outlineThreshold": 1.0,
    "partialsTypeMatMuls": "",
    "prefetchBufferingDepthMap": {},
    "rearrangeAnchorsOnHost": True,
    "rearrangeStreamsOnHost": False,
    "replicatedCollectivesSettings": ReplicatedCollectivesSettings(),
    "replicatedGraphCount": 1,
    "reportOptions": {},
    "scheduleNonWeightUpdateGradientConsumersEarly": False,
    "separateCallOpPdfs": True,
    "serializedPoprithmsAnnealGraphsDir": "",
    "serializedPoprithmsShiftGraphsDir": "",
    "stashAllTensorsInferencePipeline": False,
    "strictOpVersions": True,
    "subgraphCopyingStrategy": SubgraphCopyingStrategy.OnEnterAndExit,
    "swapLimitScheduler": 1000000000,
    "syntheticDataMode": SyntheticDataMode.Off,
    "tensorLocationSettingsOverride": {},
    "throwIfLog2ScaleTensorNotInRange": True,
    "timeLimitScheduler": 1e9,
    "transitiveClosureOptimizationThreshold": 100000,
    "updatableNamedBuffers": [],
    "useHostCopyOps": False,
    "useLoopCandidateCreator": False,
    "virtualGraphMode": VirtualGraphMode.Off,
    "virtualGraphSplitRatios": [],
    "weightTensorLocationSettings": TensorLocationSettings(),
    # PopART's temporary, non-public switch for RNG state management (default off)
    "_enableRngStateManagement": False,
}

# Lower bounds checked on assignment (the rest are only type-checked).
_MINIMUM = {"accumulationFactor": 1, "replicatedGraphCount": 1, "globalReplicationFactor": 1,
            "globalReplicaOffset": 0, "numIOTiles": 0, "defaultBufferingDepth": 1,
            "defaultPrefetchBufferingDepth": 1}


# The C++ types pybind11 prints for the options whose default does not tell (popart.cpp,
# sessionoptions.hpp); the others: bool, int, float, str, popart_core.<enum / structure>,
# Dict[str, str], List[str].
_PYBIND_TYPES = {"bufferingDepthMap": "Dict[str, int]", "prefetchBufferingDepthMap": "Dict[str, int]",
                 "tensorLocationSettingsOverride": "Dict[str, popart_core.TensorLocationSettings]",
                 "virtualGraphSplitRatios": "List[float]", "dotChecks": "Set[str]",
                 "hardwareInstrumentations": "Set[popart_core.Instrumentation]"}


def _pybind_type(name: str) -> str:
    default = _DEFAULTS[name]
    if name in _PYBIND_TYPES:
        return _PYBIND_TYPES[name]
    if isinstance(default, _Enum):
        return f"popart_core.{type(default).__name__}"
    for kind, text in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"),
                       (dict, "Dict[str, str]"), (list, "List[str]")):
        if isinstance(default, kind):
            return text
    return f"popart_core.{type(default).__name__}"


def _setter_error(options: Any, name: str, value: Any, expected: str) -> OptionTypeError:
    """pybind11's TypeError for a value option ``name``'s setter (``def_readwrite``: an
    unnamed function of ``arg0``) cannot take; the option in a note."""
    return noted(incompatible_arguments(
        "", [f"(self: popart_core.SessionOptions, arg0: {_pybind_type(name)}) -> None"],
        (options, value), cls=OptionTypeError),
        f"SessionOptions.{name}: expected {expected}, got {value!r} ({type(value).__name__})")


def _coerce(name: str, value: Any, options: Any = None) -> Any:
    """``value`` converted to the type of option ``name``'s default; pybind11's TypeError
    (an OptionError too) for a value of another type, OptionError below a minimum."""
    default = _DEFAULTS[name]
    if name == "numIOTiles" and isinstance(value, NumIOTiles):
        value = int(value)

    def bad(expected: str) -> OptionTypeError:
        return _setter_error(options, name, value, expected)

    if default is None:
        out = value
    elif isinstance(default, _Enum):   # the package also takes a member's name or value
        try:
            out = _as_enum(type(default), value, f"SessionOptions.{name}")
        except OptionError:
            raise bad(f"a {type(default).__name__} (one of "
                      f"{', '.join(type(default).__members__)})") from None
    elif isinstance(default, bool):    # pybind11's bool caster: anything with nb_bool, None
        if not (value is None or isinstance(value, (bool, np.bool_, numbers.Number))):
            raise bad("a bool")
        out = bool(value)
    elif isinstance(default, int):
        if not isinstance(value, numbers.Integral):
            raise bad("an int")
        out = int(value)
    elif isinstance(default, float):
        if not isinstance(value, numbers.Real):
            raise bad("a float")
        out = float(value)
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise bad("a str")
        out = value
    elif isinstance(default, dict):
        if not isinstance(value, Mapping):
            raise bad("a dict")
        out = dict(value)
    elif isinstance(default, (list, set)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise bad(f"a {type(default).__name__}")
        out = type(default)(value)
    else:  # a settings structure
        if not isinstance(value, type(default)):
            raise bad(f"a {type(default).__name__}")
        out = value
    if name in _MINIMUM and out < _MINIMUM[name]:
        raise OptionError(f"SessionOptions.{name}: must be >= {_MINIMUM[name]}, got {value!r}")
    return out


class SessionOptions:
    """User options for a session. Every option of PopART's SessionOptions is an attribute
    with PopART's default; assigning a name that is not an option raises AttributeError."""

    def __init__(self) -> None:
        object.__setattr__(self, "_values", copy.deepcopy(_DEFAULTS))
        # As PopART: POPART_CACHE_DIR / POPXL_CACHE_DIR turn on executable caching.
        for var in ("POPART_CACHE_DIR", "POPXL_CACHE_DIR"):
            if os.environ.get(var):
                self._values.update(enableEngineCaching=True, cachePath=os.environ[var])

    def __setattr__(self, name: str, value: Any) -> None:
        name = _OPTION_ALIASES.get(name, name)
        if name not in _DEFAULTS:
            raise _unknown("SessionOptions", name, f"SessionOptions has no option '{name}' "
                           f"(assigned {value!r}); see the PopART API reference, section "
                           "13.1.3, for the options")
        self._values[name] = _coerce(name, value, self)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(_DEFAULTS))

    def getGlobalReplicationFactor(self) -> int:
        """globalReplicationFactor if distributed replication is on, else replicatedGraphCount
        if replication is on, else 1."""
        if self.enableDistributedReplicatedGraphs:
            return self.globalReplicationFactor
        if self.enableReplicatedGraphs:
            return self.replicatedGraphCount
        return 1

    def localReplicationFactor(self) -> int:
        """The replicas of this process: replicatedGraphCount if replication is on, else 1
        (the one place sessions read it from)."""
        return int(self.replicatedGraphCount) if self.enableReplicatedGraphs else 1

    def getAccumulationFactor(self) -> int:
        """accumulationFactor if gradient accumulation is enabled, else 1; as PopART, an error
        if accumulationFactor > 1 without enableGradientAccumulation."""
        if not self.enableGradientAccumulation:
            if self.accumulationFactor > 1:
                raise OptionError("enableGradientAccumulation is false, but accumulationFactor "
                                  "> 1. Either enable gradient accumulation, or set the "
                                  "accumulation factor to 1")
            return 1
        return int(self.accumulationFactor)

    def enableExplicitIR(self, enable: bool) -> None:
        """Turn the explicit IR code paths (host copy ops, main loops, recomputation) on/off."""
        for name in ("useHostCopyOps", "enableExplicitMainLoops", "explicitRecomputation"):
            setattr(self, name, enable)

    def summary(self) -> dict[str, Any]:
        """The options whose values differ from PopART's defaults."""
        return {k: v for k, v in self._values.items() if v != _DEFAULTS[k]}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SessionOptions) and self._values == other._values

    __hash__ = None  # type: ignore[assignment]

    def __copy__(self) -> "SessionOptions":
        new = SessionOptions.__new__(SessionOptions)
        object.__setattr__(new, "_values", copy.deepcopy(self._values))
        return new

    def __deepcopy__(self, memo: dict) -> "SessionOptions":
        return self.__copy__()

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self.summary().items())
        return f"SessionOptions({changed})"


def _option_property(name: str) -> property:
    return property(lambda self: self._values[name],
                    lambda self, value: SessionOptions.__setattr__(self, name, value),
                    doc=f"Session option {name} (default {_DEFAULTS[name]!r}).")


# Second names PopART's Python layer gives options (popart/__init__.py): alias -> option
_OPTION_ALIASES = {"updatableBuffers": "updatableNamedBuffers"}

for _name in _DEFAULTS:
    setattr(SessionOptions, _name, _option_property(_name))
for _alias, _name in _OPTION_ALIASES.items():
    setattr(SessionOptions, _alias, _option_property(_name))
del _name, _alias
