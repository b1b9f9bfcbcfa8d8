"""A popart session's engine configuration (``engine.config.EngineConfig``), read from its
``SessionOptions`` in one place: the engine never reads SessionOptions itself."""
from __future__ import annotations

import numbers
from typing import Any, Mapping

from . import distributed
from ._ir import recompute
from .engine.config import (ACCUM, STATE, WEIGHTS, AlsSettings, AnchorReturn, EngineConfig,
                            Location, LocationRule, Locations)
from .engine.executable import canonical
from .errors import OptionError
from .options import (CommGroupType, MeanReductionStrategy, ReductionType,
                      ReplicatedTensorSharding, SessionOptions, TensorLocation,
                      TensorLocationSettings)

# Options that do not shape the compiled program (where it is cached, how compilation is
# reported, debugging output): left out of the executable's signature.
_NOT_IN_SIGNATURE = {"cachePath", "enableEngineCaching", "compilationProgressLogger",
                     "compilationProgressTotal", "compileEngine", "logDir", "dotChecks",
                     "dotOpNames", "firstDotOp", "finalDotOp", "reportOptions"}


def engine_config(options: SessionOptions) -> EngineConfig:
    """The facts of ``options`` the engine plans, compiles and caches a step with
    (OptionError for tensor location settings that are not PopART's types)."""
    o = options
    als = o.automaticLossScalingSettings
    track = als.toTrackTensors
    return EngineConfig(
        gradient_accumulation=bool(o.enableGradientAccumulation),
        mean_reduction=o.accumulationAndReplicationReductionType == ReductionType.Mean,
        running_mean=o.meanAccumulationAndReplicationReductionStrategy
        == MeanReductionStrategy.Running,
        pipelining=bool(o.enablePipelining),
        virtual_graph_mode=o.virtualGraphMode.name,
        recompute=recompute.method_name(o.autoRecomputation),
        execution_phases=int(o.executionPhaseSettings.phases),
        processes=distributed.process_count() if o.enableDistributedReplicatedGraphs else 1,
        group_norm_strided=bool(o.groupNormStridedChannelGrouping),
        als=AlsSettings(
            enabled=bool(als.enabled),
            toTrackTensors=tuple(track) if isinstance(track, (list, tuple)) else track,
            binEdgeLocation=als.binEdgeLocation,
            thresholdUpperCountProportion=als.thresholdUpperCountProportion,
            updatePeriod=als.updatePeriod,
            gradientTensorTrackingMethod=getattr(als.gradientTensorTrackingMethod, "name",
                                                 str(als.gradientTensorTrackingMethod))),
        locations=locations(o),
        cache_path=o.cachePath if o.enableEngineCaching and o.cachePath else None,
        signature=canonical({k: v for k, v in o.summary().items() if k not in _NOT_IN_SIGNATURE}))


def anchor_returns(arts: Mapping[str, Any]) -> dict[str, AnchorReturn]:
    """Each anchor's ``AnchorReturnType`` as the engine reads it."""
    return {a: AnchorReturn(art.id().name, int(art.rp())) for a, art in arts.items()}


# ---------------------------------------------------------------------- tensor locations
def _location(loc: Any, where: str) -> Location:
    """``loc`` (a TensorLocation) as the engine reads it; the OptionError's text for what
    cannot be honoured."""
    if not isinstance(loc, TensorLocation):
        return Location(error=f"{where}: expected a TensorLocation, got {loc!r}")
    on = loc.replicatedTensorSharding == ReplicatedTensorSharding.On
    if on and loc.shardingDomain.type != CommGroupType.All:
        return Location(error=f"{where}.shardingDomain: replicated tensor sharding over replica "
                              f"sub-groups is not supported; expected CommGroup(CommGroupType.All), "
                              f"got {loc.shardingDomain}")
    return Location(sharded=on, off_chip=getattr(loc.storage, "name", "") == "OffChip")


# SessionOptions' tensor location settings of each kind, and PopART's names in the engine's
# errors (engine/config.py LOCATION_NAMES)
_LOCATION_OPTIONS = {WEIGHTS: "weightTensorLocationSettings",
                     STATE: "optimizerStateTensorLocationSettings",
                     ACCUM: "accumulatorTensorLocationSettings"}
LOCATION_NAMES = {**{k: f"SessionOptions.{n}" for k, n in _LOCATION_OPTIONS.items()},
                  "sharded": "replicatedTensorSharding On",
                  "min_sharded": "minElementsForReplicatedTensorSharding",
                  "replicas": "replicatedGraphCount"}


def _rule(options: SessionOptions, name: str) -> LocationRule:
    tls = getattr(options, name)
    where = f"SessionOptions.{name}"
    if not isinstance(tls, TensorLocationSettings):
        raise OptionError(f"{where}: expected a TensorLocationSettings, got {tls!r}")
    loc = _location(tls.location, f"{where}.location")
    if loc.error:
        raise OptionError(loc.error)
    for n in ("minElementsForReplicatedTensorSharding", "minElementsForOffChip"):
        m = getattr(tls, n)
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
            raise OptionError(f"{where}.{n}: expected an int >= 0, got {m!r}")
    return LocationRule(loc, int(tls.minElementsForReplicatedTensorSharding),
                        int(tls.minElementsForOffChip), str(tls))


def locations(options: SessionOptions) -> Locations:
    """The three kinds' tensor location settings and the per-tensor overrides."""
    overrides = dict(options.tensorLocationSettingsOverride or {})
    return Locations({k: _rule(options, n) for k, n in _LOCATION_OPTIONS.items()}, {
        t: _location(loc, f"SessionOptions.tensorLocationSettingsOverride['{t}']")
        for t, loc in overrides.items()}, names=LOCATION_NAMES)
