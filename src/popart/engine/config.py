"""The engine's configuration: every option fact the engine reads, as one frozen, typed value
that each front-end fills in (popart from its ``SessionOptions``: ``popart.session_config``;
popxl directly). The engine never reads a front-end's options object.

A trace with no config (``config=None``: the ONNX backend, one-shot runs, popxl) follows
ONNX's rules where PopART's sessions differ (``ops.registry.onnx_semantics``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# The three kinds of tensor whose location the options set.
WEIGHTS, STATE, ACCUM = "weights", "optimizer state", "accumulators"
# What the engine's errors call the location settings, unless a front-end names them
# (``Locations.names``: popart gives PopART's option names).
LOCATION_NAMES = {WEIGHTS: "the weights' location settings",
                  STATE: "the optimizer state's location settings",
                  ACCUM: "the accumulators' location settings",
                  "sharded": "replica sharding on",
                  "min_sharded": "the minimum elements for replica sharding",
                  "replicas": "the number of replicas"}


@dataclass(frozen=True)
class AnchorReturn:
    """How an anchor's values come back (PopART's AnchorReturnType): ``kind`` one of
    "Final", "EveryN", "All", "Sum"; ``period`` EveryN's return period."""
    kind: str
    period: int = 0


@dataclass(frozen=True)
class AlsSettings:
    """Automatic loss scaling's settings as a step compiles with them (the fields and names of
    PopART's AutomaticLossScalingSettings; ``gradientTensorTrackingMethod`` by name).
    ``toTrackTensors`` is kept as given: ``als.check_settings`` checks it."""
    enabled: bool = False
    toTrackTensors: Any = None
    binEdgeLocation: float = 0.125
    thresholdUpperCountProportion: float = 1e-7
    updatePeriod: int = 1
    gradientTensorTrackingMethod: str = "AllNonViewChangingGradientTensors"


@dataclass(frozen=True)
class Location:
    """Where one tensor is asked to live: replica-sharded, off-chip; ``error`` the text of an
    OptionError for a location that cannot be honoured (raised only where a tensor takes it)."""
    sharded: bool = False
    off_chip: bool = False
    error: Optional[str] = None


@dataclass(frozen=True)
class LocationRule:
    """One kind's location and the sizes from which it applies (PopART's
    TensorLocationSettings); ``text``: the settings as the user wrote them (for errors)."""
    location: Location = Location()
    min_sharded: int = 8192
    min_off_chip: int = 2
    text: str = ""


@dataclass(frozen=True)
class Locations:
    """The location rule of each kind (:data:`WEIGHTS`, :data:`STATE`, :data:`ACCUM`), the
    per-tensor overrides, and what the front-end calls the settings (for errors)."""
    rules: Mapping[str, LocationRule]
    overrides: Mapping[str, Location] = field(default_factory=dict)
    names: Mapping[str, str] = field(default_factory=dict)   # the front-end's option names

    def name(self, key: str) -> str:
        """What errors call a kind's settings or a setting (:data:`LOCATION_NAMES`' keys):
        the front-end's name, else the engine's."""
        return self.names.get(key, LOCATION_NAMES[key])


@dataclass(frozen=True)
class EngineConfig:
    """The option facts a step is planned, compiled and cached with."""
    gradient_accumulation: bool = False   # enableGradientAccumulation
    mean_reduction: bool = False          # accumulation / replication reduction is Mean
    running_mean: bool = False            # ... with the Running strategy (else Post)
    pipelining: bool = False              # enablePipelining
    virtual_graph_mode: str = "Off"       # Off, Manual, Auto, ExecutionPhases
    recompute: str = "NoRecompute"        # autoRecomputation's method
    execution_phases: int = 0             # executionPhaseSettings.phases
    processes: int = 1                    # processes the replicas span (global replication)
    group_norm_strided: bool = False      # groupNormStridedChannelGrouping
    als: AlsSettings = AlsSettings()
    locations: Optional[Locations] = None   # None: every tensor whole, on the device
    cache_path: Optional[str] = None      # the engine cache's folder (None: no cache)
    signature: Mapping[str, Any] = field(default_factory=dict)   # what a cached program
                                          # must agree on (options that shape it)
