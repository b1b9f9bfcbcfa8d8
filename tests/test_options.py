"""SessionOptions, settings structures and enums against the API reference (13.1)."""
import copy

import pytest

from popart.errors import OptionError, popart_exception
from popart import options as po
from popart.options import (CommGroup, CommGroupType, ReplicaGrouping, SessionOptions,
                            VariableRetrievalMode, VariableSettings)

# Every property the API reference lists for SessionOptions (13.1.3).
REFERENCE_PROPERTIES = """
accumulateOuterFragmentSettings accumulationAndReplicationReductionType accumulationFactor
accumulatorTensorLocationSettings activationTensorLocationSettings aliasZeroCopy
autoRecomputation batchSerializationSettings cachePath compileEngine constantWeights
createImplicitPipeliningFwdOnlyProgram customCodeletCompileFlags customCodelets
decomposeGradSum delayVarUpdates disableGradAccumulationTensorStreams
disableOptimizerStateTensorStreams dotChecks dotOpNames
enableConstantFoldingOfMultipleConsumers enableDistributedReplicatedGraphs
enableEfficientOverlapIOTopoCons enableEngineCaching enableExplicitMainLoops
enableFloatingPointChecks enableFullyConnectedPass enableGradientAccumulation
enableLoadAndOffloadRNGState enableMergeExchange enableNonStableSoftmax enableOutlining
enableOutliningCopyCostPruning enablePipelining enableReplicatedGraphs enableStableNorm
enableStochasticRounding enableSupportedDataTypeCasting enableVariablesCaching
ensureFp32LossScaleTensor executionPhaseSettings explicitRecomputation
exportPoplarComputationGraph exportPoplarVertexGraph finalDotOp firstDotOp globalReplicaOffset
globalReplicationFactor groupHostSync instrumentWithHardwareCycleCounter kahnTieBreaker logDir
meanAccumulationAndReplicationReductionStrategy mergeVarUpdate mergeVarUpdateMemThreshold
numIOTiles optimizerStateTensorLocationSettings opxAliasChecking opxModifyChecking
outlineSequenceBreakCost outlineThreshold partialsTypeMatMuls rearrangeAnchorsOnHost
rearrangeStreamsOnHost replicatedGraphCount separateCallOpPdfs
serializedPoprithmsAnnealGraphsDir serializedPoprithmsShiftGraphsDir
stashAllTensorsInferencePipeline strictOpVersions subgraphCopyingStrategy swapLimitScheduler
syntheticDataMode throwIfLog2ScaleTensorNotInRange timeLimitScheduler updatableNamedBuffers
useHostCopyOps useLoopCandidateCreator virtualGraphMode virtualGraphSplitRatios
weightTensorLocationSettings
""".split()

# Defaults stated in the reference text (and the user guide for the options it adds).
DOCUMENTED_DEFAULTS = {
    "accumulationAndReplicationReductionType": po.ReductionType.Sum,
    "autoRecomputation": po.RecomputationType.NoRecompute,
    "constantWeights": True,
    "decomposeGradSum": False,
    "dotOpNames": False,
    "enableConstantFoldingOfMultipleConsumers": True,
    "enableDistributedReplicatedGraphs": False,
    "enableEfficientOverlapIOTopoCons": False,
    "enableEngineCaching": False,
    "enableFloatingPointChecks": False,
    "enableGradientAccumulation": False,
    "enableLoadAndOffloadRNGState": False,
    "enableMergeExchange": True,
    "enableNonStableSoftmax": False,
    "enableOutlining": True,
    "enableOutliningCopyCostPruning": True,
    "enablePipelining": False,
    "enableReplicatedGraphs": False,
    "enableStochasticRounding": False,
    "enableSupportedDataTypeCasting": True,
    "enableVariablesCaching": True,
    "ensureFp32LossScaleTensor": False,
    "explicitRecomputation": False,
    "exportPoplarComputationGraph": False,
    "exportPoplarVertexGraph": False,
    "globalReplicationFactor": 1,
    "groupHostSync": False,
    "meanAccumulationAndReplicationReductionStrategy": po.MeanReductionStrategy.Post,
    "mergeVarUpdate": po.MergeVarUpdateType.Off,
    "mergeVarUpdateMemThreshold": 1000000,
    "opxAliasChecking": False,
    "opxModifyChecking": False,
    "outlineSequenceBreakCost": 10000.0,
    "outlineThreshold": 1.0,
    "partialsTypeMatMuls": "",
    "rearrangeAnchorsOnHost": True,
    "rearrangeStreamsOnHost": False,
    "separateCallOpPdfs": True,
    "stashAllTensorsInferencePipeline": False,
    "strictOpVersions": True,
    "subgraphCopyingStrategy": po.SubgraphCopyingStrategy.OnEnterAndExit,
    "syntheticDataMode": po.SyntheticDataMode.Off,
    "throwIfLog2ScaleTensorNotInRange": True,
    "useHostCopyOps": False,
    "useLoopCandidateCreator": False,
    "virtualGraphMode": po.VirtualGraphMode.Off,
    # options the user guide / common scripts use
    "replicatedGraphCount": 1,
    "accumulationFactor": 1,
    "hostAllReduce": False,
    "engineOptions": {},
    "convolutionOptions": {},
    "lstmOptions": {},
    "matmulOptions": {},
    "reportOptions": {},
    "gclOptions": {},
    "enablePrefetchDatastreams": True,
    "instrumentWithHardwareCycleCounter": False,
}

# Enum members exactly as the reference lists them.
ENUM_MEMBERS = {
    "AccumulateOuterFragmentSchedule":
        "Scheduler Serial OverlapCycleOptimized OverlapMemoryOptimized",
    "AutodiffStitchStrategy":
        "RecomputeMinimal RecomputeAllNonInputs AddFwdOutputs SafeAddFwdOutputs",
    "BatchSerializationBatchSchedule": "Scheduler Isomorphic OverlapOnIo OverlapOnCompute",
    "BatchSerializationMethod": "UnrollDynamic UnrollStatic Loop",
    "BatchSerializationTransformContext": "Forward Backward Fwd Bwd",
    "CommGroupType": "All Consecutive Orthogonal Ungrouped",
    "ExecutionPhaseIOSchedule": "Preload OnDemand",
    "ExecutionPhaseSchedule": "Interleaving Batch BatchClusteredIO",
    "GradientTensorTrackingMethod":
        "ConvAndMatmulGradients AllNonViewChangingGradientTensors GradientsOfUserSpecifiedTensors",
    "Instrumentation": "Outer Inner",
    "IrSerializationFormat": "JSON",
    "MeanReductionStrategy": "Running Post",
    "MergeVarUpdateType": "Off All AutoTight AutoLoose",
    "RecomputationType": "NoRecompute Standard NormOnly RecomputeAll Pipeline",
    "RecomputeType": "Undefined Checkpoint Recompute Recomputed",
    "ReductionType": "Sum Mean NoReduction",  # PopART's values (the reference lists them A-Z)
    "ReplicatedTensorSharding": "Off On",
    "SubgraphCopyingStrategy": "OnEnterAndExit JustInTime",
    "SyntheticDataMode": "Off Zeros RandomNormal RandomUniform",
    "TileSet": "Compute IO",
    "VariableRetrievalMode": "OnePerGroup AllReduceReplicas AllReplicas",
    "VirtualGraphMode": "Off Manual Auto ExecutionPhases",
    "TensorStorage": "OnChip OffChip",
    "ExchangeStrategy": "JustInTime OverlapInnerLoop OverlapLoops OverlapStep",
    "ReplicatedStreamMode": "Replicate Broadcast",
    "InitType": "NoInit Zero",
    "ScatterReduction": "Sum Max Min Mul NoReduction",
    "TensorRemapType": "FwdBwdReverse FwdBwd Fwd",
    "WeightDecayMode": "Decay L2Regularization",
    "SGDAccumulatorAndMomentum": "Combined Separate",
    "AdamMode": "Adam AdamNoBias Lamb LambNoBias AdaMax",
    "AdaptiveMode": "AdaGrad RMSProp CenteredRMSProp AdaDelta",
}


def test_every_reference_property_exists_with_a_default_and_is_assignable():
    opts = SessionOptions()
    for name in REFERENCE_PROPERTIES:
        value = getattr(opts, name)
        setattr(opts, name, value)  # assigning the current value is always accepted
        assert getattr(opts, name) == value, name
    assert opts.summary() == {}


@pytest.mark.parametrize("name,default", sorted(DOCUMENTED_DEFAULTS.items()))
def test_documented_default(name, default):
    value = getattr(SessionOptions(), name)
    assert value == default and type(value) is type(default)


def test_nested_settings_defaults():
    opts = SessionOptions()
    als = opts.automaticLossScalingSettings
    assert (als.enabled, als.binEdgeLocation, als.thresholdUpperCountProportion,
            als.updatePeriod, als.toTrackTensors) == (False, 0.125, 1e-7, 1, None)
    assert als.gradientTensorTrackingMethod == \
        po.GradientTensorTrackingMethod.AllNonViewChangingGradientTensors
    eps = opts.executionPhaseSettings
    assert (eps.phases, eps.stages) == (0, 2)
    assert eps.weightIOSchedule == po.ExecutionPhaseIOSchedule.Preload
    assert eps.optimizerStateIOSchedule == po.ExecutionPhaseIOSchedule.OnDemand
    bss = opts.batchSerializationSettings
    assert bss.factor == 0 and bss.concatOnVirtualGraphChange
    assert bss.method == po.BatchSerializationMethod.UnrollDynamic
    assert bss.batchSchedule == po.BatchSerializationBatchSchedule.Isomorphic
    assert opts.accumulateOuterFragmentSettings.schedule == \
        po.AccumulateOuterFragmentSchedule.Serial
    assert opts.accumulateOuterFragmentSettings.excludedVirtualGraphs == []
    assert opts.autodiffSettings.stitchStrategy == po.AutodiffStitchStrategy.RecomputeAllNonInputs
    tls = opts.weightTensorLocationSettings
    assert (tls.minElementsForOffChip, tls.minElementsForReplicatedTensorSharding) == (2, 8192)
    loc = tls.location
    assert loc.storage == po.TensorStorage.OnChip and loc.loadTileSet == po.TileSet.Compute
    assert loc.replicatedTensorSharding == po.ReplicatedTensorSharding.Off
    assert loc.shardingDomain == CommGroup(CommGroupType.All, 0)


def test_instances_do_not_share_mutable_defaults():
    a, b = SessionOptions(), SessionOptions()
    a.engineOptions["autoReport.all"] = "true"
    a.executionPhaseSettings.phases = 4
    assert b.engineOptions == {} and b.executionPhaseSettings.phases == 0
    assert a.summary()["engineOptions"] == {"autoReport.all": "true"}


def test_summary_lists_only_changed_options():
    opts = SessionOptions()
    opts.enableReplicatedGraphs = True
    opts.replicatedGraphCount = 2
    opts.virtualGraphMode = po.VirtualGraphMode.Manual
    opts.outlineThreshold = 1.0  # same as default: not listed
    assert opts.summary() == {"enableReplicatedGraphs": True, "replicatedGraphCount": 2,
                              "virtualGraphMode": po.VirtualGraphMode.Manual}


def test_unknown_option_raises_naming_it():
    opts = SessionOptions()
    with pytest.raises(OptionError, match="enableReplicatedGraph'"):
        opts.enableReplicatedGraph = True
    assert isinstance(OptionError("x"), popart_exception)


@pytest.mark.parametrize("name,value", [
    ("accumulationFactor", "two"), ("enableOutlining", "yes"), ("virtualGraphMode", 7),
    ("engineOptions", ["a"]), ("accumulationFactor", 0), ("replicatedGraphCount", -1),
    ("automaticLossScalingSettings", True), ("customCodelets", "file.cpp"),
])
def test_bad_values_raise(name, value):
    with pytest.raises(OptionError, match=name):
        setattr(SessionOptions(), name, value)


def test_values_are_coerced_to_the_option_type():
    opts = SessionOptions()
    opts.timeLimitScheduler = 10
    opts.virtualGraphMode = 1
    opts.enableOutlining = 0
    assert opts.timeLimitScheduler == 10.0 and type(opts.timeLimitScheduler) is float
    assert opts.virtualGraphMode is po.VirtualGraphMode.Manual
    assert opts.enableOutlining is False


def test_hardware_only_options_are_stored():
    opts = SessionOptions()
    opts.numIOTiles = 32
    opts.engineOptions = {"debug.instrument": "true"}
    opts.kahnTieBreaker = "fifo"
    opts.enableStochasticRounding = True
    assert (opts.numIOTiles, opts.kahnTieBreaker, opts.enableStochasticRounding) == \
        (32, "fifo", True)
    assert set(opts.summary()) == {"numIOTiles", "engineOptions", "kahnTieBreaker",
                                   "enableStochasticRounding"}


def test_global_replication_factor():
    opts = SessionOptions()
    opts.replicatedGraphCount = 2
    assert opts.getGlobalReplicationFactor() == 1  # replication not enabled
    opts.enableReplicatedGraphs = True
    assert opts.getGlobalReplicationFactor() == 2
    opts.globalReplicationFactor = 8
    opts.globalReplicaOffset = 2
    assert opts.getGlobalReplicationFactor() == 2
    opts.enableDistributedReplicatedGraphs = True
    assert opts.getGlobalReplicationFactor() == 8


def test_accumulation_factor_needs_gradient_accumulation():
    opts = SessionOptions()
    opts.accumulationFactor = 4
    with pytest.raises(OptionError, match="enableGradientAccumulation"):
        opts.getAccumulationFactor()
    opts.enableGradientAccumulation = True
    assert opts.getAccumulationFactor() == 4


def test_enable_explicit_ir():
    opts = SessionOptions()
    opts.enableExplicitIR(True)
    assert opts.useHostCopyOps and opts.enableExplicitMainLoops and opts.explicitRecomputation
    opts.enableExplicitIR(False)
    assert opts.summary() == {}


def test_copy_is_deep_and_equality_by_value():
    opts = SessionOptions()
    opts.engineOptions = {"a": "1"}
    other = copy.copy(opts)
    assert other == opts
    other.engineOptions["b"] = "2"
    other.accumulationFactor = 3
    assert opts.engineOptions == {"a": "1"} and opts.accumulationFactor == 1
    assert other != opts


def test_cache_dir_env_enables_engine_caching(monkeypatch, tmp_path):
    monkeypatch.setenv("POPART_CACHE_DIR", str(tmp_path))
    opts = SessionOptions()
    assert opts.enableEngineCaching and opts.cachePath == str(tmp_path)


# Enums whose PopART values (sessionoptions.hpp) differ from the reference's listing order.
POPART_VALUES = {"GradientTensorTrackingMethod": {"AllNonViewChangingGradientTensors": 0,
                                                  "ConvAndMatmulGradients": 1,
                                                  "GradientsOfUserSpecifiedTensors": 2}}


@pytest.mark.parametrize("name,members", sorted(ENUM_MEMBERS.items()))
def test_enum_members_in_listed_order(name, members):
    kind = getattr(po, name)
    assert list(kind.__members__) == members.split()
    values = POPART_VALUES.get(name, {m: i for i, m in enumerate(members.split())})
    for member in kind:
        assert member == values[member.name] and isinstance(member, int)  # pybind enums compare to ints
    first = list(kind)[0]
    assert str(first) == f"{name}.{first.name}"


def test_enum_aliases():
    ctx = po.BatchSerializationTransformContext
    assert ctx.Fwd is ctx.Forward and ctx.Bwd is ctx.Backward and len(ctx) == 2


def test_settings_structures_are_assignable_and_checked():
    opts = SessionOptions()
    opts.automaticLossScalingSettings = po.AutomaticLossScalingSettings(
        enabled=True, binEdgeLocation=0.5, updatePeriod=2)
    assert opts.automaticLossScalingSettings.binEdgeLocation == 0.5
    assert "automaticLossScalingSettings" in opts.summary()
    bss = opts.batchSerializationSettings
    bss.factor = 4
    bss.method = po.BatchSerializationMethod.Loop
    assert opts.batchSerializationSettings.factor == 4
    with pytest.raises(OptionError, match="factr"):
        bss.factr = 2
    with pytest.raises(OptionError, match="BatchSerializationMethod"):
        bss.method = 9
    opts.accumulateOuterFragmentSettings = po.AccumulateOuterFragmentSettings(
        po.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized, [0])
    assert opts.accumulateOuterFragmentSettings.excludedVirtualGraphs == [0]


def test_tensor_location_overloads():
    TL, TS = po.TensorLocation, po.TensorStorage
    rts = po.ReplicatedTensorSharding
    assert TL().storage == TS.OnChip
    assert TL(TS.OffChip).storage == TS.OffChip
    a = TL(TS.OffChip, rts.On)
    assert a.replicatedTensorSharding == rts.On and a.loadTileSet == po.TileSet.Compute
    b = TL(TS.OnChip, po.TileSet.IO, po.TileSet.Compute, rts.Off)
    assert b.loadTileSet == po.TileSet.IO and b.storageTileSet == po.TileSet.Compute
    c = TL(TS.OffChip, rts.On, CommGroup(CommGroupType.Consecutive, 2))
    assert c.shardingDomain.replicaGroupSize == 2
    s = po.TensorLocationSettings(TS.OffChip, 0)
    assert s.location.storage == TS.OffChip and s.minElementsForOffChip == 0
    assert po.TensorLocationSettings(a, 4, 16).minElementsForReplicatedTensorSharding == 16


# --- CommGroup / VariableSettings (CommGroupType semantics, reference 13.1.3) -----------------
@pytest.mark.parametrize("group,expected", [
    (CommGroup(), [[0, 1, 2, 3, 4, 5, 6, 7]]),
    (CommGroup(CommGroupType.Ungrouped, 0), [[i] for i in range(8)]),
    (CommGroup(CommGroupType.Consecutive, 2), [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (CommGroup(CommGroupType.Consecutive, 4), [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (CommGroup(CommGroupType.Orthogonal, 2), [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (CommGroup(CommGroupType.Orthogonal, 4), [[0, 2, 4, 6], [1, 3, 5, 7]]),
])
def test_variable_settings_groups(group, expected):
    vs = VariableSettings(group)
    assert vs.groups(8) == expected
    assert vs.getGroupCount(8) == len(expected)
    assert vs.getRealGroupSize(8) == len(expected[0])
    assert [vs.getGroupRepresentative(g) for g in range(len(expected))] == \
        [min(g) for g in expected]
    assert vs.getReplicaGrouping(8).groups() == expected
    assert vs.isUsingCommGroup() and vs.getSharedVariableDomain() == group
    for g, members in enumerate(expected):
        grouping = group.toReplicaGrouping(8)
        assert all(grouping.getGroupAt(r) == g for r in members)
        assert [grouping.getIndexInGroupAt(r) for r in members] == list(range(len(members)))


def test_variable_settings_shapes_and_retrieval():
    vs = VariableSettings(CommGroup(CommGroupType.Consecutive, 2))
    assert vs.getRetrievalMode() == VariableRetrievalMode.OnePerGroup
    assert vs.shapeOnHost([3, 5], 8) == [4, 3, 5]
    assert vs.shapeOnReplica([4, 3, 5], 8, "w") == [3, 5]
    with pytest.raises(OptionError, match="'w'"):
        vs.shapeOnReplica([3, 5], 8, "w")
    assert vs.numReplicasReturningVariable(8) == 4
    assert vs.getStride(8) == 1
    everyone = VariableSettings(CommGroup(CommGroupType.Consecutive, 2),
                                VariableRetrievalMode.AllReplicas)
    assert everyone.numReplicasReturningVariable(8) == 8
    shared = VariableSettings()
    assert shared.shapeOnHost([3], 8) == [3] and shared.shapeOnReplica([3], 8, "w") == [3]
    assert shared.getCommGroupType() == CommGroupType.All and shared.getGroupSize() == 0
    ortho = VariableSettings(CommGroup(CommGroupType.Orthogonal, 2),
                             VariableRetrievalMode.AllReplicas)
    assert ortho.getStride(8) == 4
    assert VariableSettings(VariableRetrievalMode.AllReplicas).getRetrievalMode() == \
        VariableRetrievalMode.AllReplicas


def test_variable_settings_from_stride_and_group_size():
    vs = VariableSettings(4, 2)
    assert not vs.isUsingCommGroup()
    assert vs.getStride() == 4 and vs.getGroupSize() == 2
    assert vs.groups(8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(OptionError):
        vs.getSharedVariableDomain()


def test_variable_settings_errors():
    with pytest.raises(OptionError, match="replicaGroupSize"):
        VariableSettings(CommGroup(CommGroupType.Consecutive, 0))
    with pytest.raises(OptionError, match="divisor"):
        VariableSettings(CommGroup(CommGroupType.Consecutive, 3)).groups(8)
    with pytest.raises(OptionError):
        ReplicaGrouping(8, 3, 2)
