"""Live handles on popxl's IR in the shape of PopART's C++ IR binding (``popart._internal.ir``).

PopXL keeps its graphs in PopART's C++ IR and hands out binding objects (``Ir._pb_ir``,
``Graph._pb_graph``, ``Tensor._pb_tensor``, op-created hooks); popxl-addons works on them.
Here the IR is ``popart.engine.graph_api`` (a ``Node`` list per graph) with popxl's bookkeeping
(``Graph._tensors`` / ``_specs`` / ``_outputs``, versions of in-place tensors) around it. A handle
holds the popxl object and reads or changes both on each call: there is no second copy, so what
popxl compiles afterwards follows every change. ``popart._internal.ir`` gives these classes
PopART's names (docs/internal_ir.md).

A handle's tensor id is an IR id: the id of the popxl tensor made for that value (an in-place
op's result is a new tensor; the popxl object the user holds moves to it, as PopXL's does)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

from popart.engine.graph_api import PIPELINE_STAGE, VIRTUAL_GRAPH, Graph as IRGraph, Node
from popart.errors import popart_exception
from popart.tensorinfo import TensorInfo

from . import context
from ._versions import inplace
from .tensorlocation import ExecutionContext, TileSet

if TYPE_CHECKING:
    from .graph import Graph as XGraph
    from .ir import Ir as XIr


class _Binding:
    """PopART's binding names that have no meaning here raise ``popart_exception`` naming the
    method; other missing names are AttributeErrors (so ``hasattr`` probes keep working)."""
    _PB_NAMES: frozenset = frozenset()
    _WHY = "the XLA IR has no equivalent"

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._PB_NAMES:
            raise popart_exception(f"popart._internal.ir.{type(self).__name__}.{name} is not "
                                   f"supported on XLA: {self._WHY}")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


def _names(s: str) -> frozenset:
    return frozenset(s.split())


class GraphId:
    """A graph's id (``str()`` gives it); equal to the GraphId or string of the same id."""

    def __init__(self, gid: str) -> None:
        self._id = str(gid)

    def str(self) -> str:
        return self._id

    def __eq__(self, other: object) -> bool:
        return str(other) == self._id if isinstance(other, (GraphId, str)) else NotImplemented

    def __lt__(self, other: "GraphId") -> bool:
        return self._id < str(other)

    def __hash__(self) -> int:
        return hash(self._id)

    def __str__(self) -> str:
        return self._id

    def __repr__(self) -> str:
        return f"GraphId({self._id!r})"


class OperatorIdentifier:
    """``op.opid``: the op's domain, type and version."""

    def __init__(self, domain: str, type_: str, version: int) -> None:
        self.domain, self.type, self.version = domain, type_, version

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OperatorIdentifier) and \
            (self.domain, self.type, self.version) == (other.domain, other.type, other.version)

    def __hash__(self) -> int:
        return hash((self.domain, self.type, self.version))

    def __repr__(self) -> str:
        return f"{self.domain}.{self.type}:{self.version}"


class Region:
    """A region of a tensor (``popart::view::Region``): here the whole tensor or nothing, the
    granularity at which an in-place op modifies its input on XLA."""

    def __init__(self, shape: Sequence[int], empty: bool) -> None:
        self.shape, self._empty = tuple(int(d) for d in shape), bool(empty)

    @staticmethod
    def getFull(shape: Sequence[int]) -> "Region":
        return Region(shape, False)

    @staticmethod
    def getEmpty(rank: int) -> "Region":
        return Region((0,) * int(rank), True)

    def isEmpty(self) -> bool:
        return self._empty or 0 in self.shape

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Region) and (self.isEmpty(), self.shape) == (other.isEmpty(), other.shape)

    def __hash__(self) -> int:
        return hash((self.isEmpty(), self.shape))

    def __str__(self) -> str:
        return "[]" if self.isEmpty() else f"[{[0] * len(self.shape)}->{list(self.shape)}]"

    __repr__ = __str__


# ---------------------------------------------------------------------------------- settings
class Settings(_Binding):
    """``Op::Settings``: the name and placement of an op (``ctx._get_op_settings(name)``), kept
    as the node annotations popxl gives ops created in the same context."""
    _PB_NAMES = _names("optimizerOp recomputeType inplacePriorityVeto inferTensorMappingToFrom "
                       "extraOutlineAttributes batchSerializedPhase executionPhase "
                       "stochasticRoundingMethod scope debugInfoId excludePatterns")

    def __init__(self, graph: "Graph", name: str = "", annotations: Optional[dict] = None) -> None:
        self.graph, self.name = graph, name
        self.annotations = dict(context.current_annotations() if annotations is None else annotations)

    def _get(self, key: str) -> Any:
        return self.annotations.get(key)

    def _set(self, key: str, value: Any) -> None:
        if value is None:
            self.annotations.pop(key, None)
        else:
            self.annotations[key] = value

    vgraphId = property(lambda self: self._get(VIRTUAL_GRAPH),
                        lambda self, v: self._set(VIRTUAL_GRAPH, None if v is None else int(v)))
    pipelineStage = property(lambda self: self._get(PIPELINE_STAGE),
                             lambda self, v: self._set(PIPELINE_STAGE, None if v is None else int(v)))

    @property
    def tileSet(self) -> Any:
        return TileSet.IO if self._get("__io_tiles") else TileSet.Compute

    @tileSet.setter
    def tileSet(self, value: Any) -> None:
        self._set("__io_tiles", 1 if value == TileSet.IO else None)

    @property
    def executionContext(self) -> Any:
        return ExecutionContext[self.annotations.get("__execution_context", "Normal")]

    @executionContext.setter
    def executionContext(self, value: Any) -> None:
        self._set("__execution_context", None if value.name == "Normal" else value.name)

    def copy(self, name: Optional[str] = None) -> "Settings":
        return Settings(self.graph, self.name if name is None else name, self.annotations)


# ---------------------------------------------------------------------------------- tensors
class Consumers:
    """``tensor.consumers``: the ops of the tensor's graph that read it."""

    def __init__(self, tensor: "Tensor") -> None:
        self._t = tensor

    def getOps(self) -> list["Op"]:
        g = self._t._graph
        return [op_handle(g, n) for n in g._g.nodes if self._t.id in n.inputs]

    def getTotal(self) -> int:
        return sum(n.inputs.count(self._t.id) for n in self._t._graph._g.nodes)


class Tensor(_Binding):
    """A tensor of a graph (``popart::Tensor``), by IR id."""
    _PB_NAMES = _names(
        "anyAlias associatedOps clone consumersAllPreLoss dataAsBool getBatchAxis "
        "getCopyFromTensor getDataViaGraphTraversal getDebugInfo getGraph_const getIr_const "
        "getRemoteBufferInfo getReplicatedStreamMode getVariableSettings getVariableUpdateType "
        "getVirtualGraphIdAndTileSet getVirtualGraphIdAndTileSetUnsafe getVirtualGraphIdUnsafe "
        "hasTensorData idIncludesPrefix inputSettings isAccumulatorTensor isAliased isAnchored "
        "isCheckpointTensor isHostLoadTensor isImplicitRecomputeTensor isInSyncWithIPU "
        "isOptimizerStateTensor isOptimizerTensor isRandomSeedTensor isRemote isRemoteArgTensor "
        "isRestoreInplaceTensor isRootAnchor isSharded isUnmodifiable isWeightTensor returnedShape "
        "setCopyFromTensor setRemoteBufferInfo setReplicatedStreamMode setTensorLocationInfo "
        "setTensorType setVariableUpdateType tensorLocationInfo tensorType tensor_type")

    def __init__(self, graph: "XGraph", tid: str) -> None:
        self._graph, self.id = graph, tid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tensor) and other._graph is self._graph and other.id == self.id

    def __hash__(self) -> int:
        return hash((id(self._graph), self.id))

    def __repr__(self) -> str:
        return f"_ir.Tensor({self.id!r} in {self._graph.id!r})"

    def str(self) -> str:
        return self.id

    @property
    def info(self) -> TensorInfo:
        """The data type, shape and meta shape (a replica shard's full shape, [] unless set)."""
        spec = self._graph._specs[self.id]
        info = TensorInfo(spec.dtype, list(spec.shape))
        info.set(spec.dtype, None, popxl_tensor(self._graph, self.id)._meta_shape)
        return info

    @info.setter
    def info(self, info: TensorInfo) -> None:
        """PopART's ``def_readwrite``: an op's setup sets its outputs' info. The data type and
        shape are the traced ones; only the meta shape may change."""
        now = self.info
        if (info.dataType(), info.shape()) != (now.dataType(), now.shape()):
            raise popart_exception(
                f"Tensor {self.id}: info {info.dataType().value} {info.shape()} differs from the "
                f"traced {now.dataType().value} {now.shape()}; only the meta shape can be set")
        popxl_tensor(self._graph, self.id)._meta_shape = tuple(info.metaShape())

    @property
    def consumers(self) -> Consumers:
        return Consumers(self)

    def getGraph(self) -> "Graph":
        return Graph(self._graph)

    def getIr(self) -> "Ir":
        return Ir(self._graph.ir)

    def _producer(self) -> Optional[Node]:
        return next((n for n in self._graph._g.nodes if self.id in n.outputs), None)

    def hasProducer(self) -> bool:
        return self._producer() is not None

    def getProducer(self) -> "Op":
        n = self._producer()
        if n is None:
            raise popart_exception(f"No producer for tensor {self.id} to return")
        return op_handle(self._graph, n)

    def getProducerUnsafe(self) -> Optional["Op"]:
        n = self._producer()
        return None if n is None else op_handle(self._graph, n)

    def _base(self) -> str:
        return self._graph._versions.get(self.id, self.id)

    def _modifiers(self, nodes: Iterable[Node]) -> list[Node]:
        """The nodes whose outputs are later versions of this tensor (in-place writes)."""
        base, versions = self._base(), self._graph._versions
        return [n for n in nodes if any(versions.get(o) == base for o in n.outputs)]

    def modifiedRegionsByOps(self, ops: Iterable["Op"], aliases: Any = None) -> list[Region]:
        """The regions of this tensor that ``ops`` modify in place: all of it or none."""
        hit = self._modifiers(op._node for op in ops)
        shape = self._graph._specs[self.id].shape
        return [Region.getFull(shape) if hit else Region.getEmpty(len(shape))]

    def isModified(self, considerLoopInput: bool = True) -> bool:
        return bool(self._modifiers(self._graph._g.nodes))

    def getVirtualGraphId(self) -> int:
        ipu = self._graph._tensors[self.id]._placement[0]
        return 0 if ipu is None else int(ipu)

    def hasVirtualGraphId(self) -> bool:
        return self._graph._tensors[self.id]._placement[0] is not None

    def isGraphInput(self) -> bool:
        return self.id in self._graph._finalize().inputs

    def isGraphOutput(self) -> bool:
        return self.id in self._graph._finalize().outputs


def popxl_tensor(graph: "XGraph", tid: str) -> Any:
    """The popxl Tensor of IR id ``tid``: the tensor whose value it is now (an in-place op's
    result: the tensor the op changed), else the tensor made for it."""
    own = graph._tensors.get(graph._versions.get(tid, tid))
    return own if own is not None and own._ir_id == tid else graph._tensors[tid]


def current(graph: "XGraph", tid: str) -> str:
    """The IR id of the value of popxl tensor ``tid`` now (its latest in-place version)."""
    return graph._tensors[tensor_of(graph, tid).id]._ir_id


def tensor_of(graph: "XGraph", tid: str) -> Tensor:
    """The handle of tensor ``tid`` of ``graph``.

    Raises:
        popart_exception: no tensor ``tid`` in the graph (PopART's message).
    """
    if tid not in graph._tensors:
        raise popart_exception(f"No Ir::Tensor with TensorId '{tid}' in Graph {graph.id}.")
    return Tensor(graph, tid)


# ---------------------------------------------------------------------------------- ops
class _IndexMap:
    """``op.input`` / ``op.output``: index -> tensor of one side of an op."""

    def __init__(self, op: "Op", side: str) -> None:
        self._op, self._side = op, side

    def _ids(self) -> list[str]:
        return getattr(self._op._node, self._side)

    def tensorMap(self) -> dict[int, Tensor]:
        return {i: Tensor(self._op._graph, t) for i, t in enumerate(self._ids()) if t}

    def tensorIdMap(self) -> dict[int, str]:
        return {i: t for i, t in enumerate(self._ids()) if t}

    def tensors(self) -> list[Tensor]:
        return list(self.tensorMap().values())

    def hasIndex(self, i: int) -> bool:
        ids = self._ids()
        return 0 <= i < len(ids) and bool(ids[i])

    def id(self, i: int) -> str:
        return self._ids()[i]

    def tensor(self, i: int) -> Tensor:
        return Tensor(self._op._graph, self._ids()[i])

    def n(self) -> int:
        return len(self.tensorMap())

    def indices(self, t: Tensor) -> list[int]:
        return [i for i, x in enumerate(self._ids()) if x == t.id]


class Op(_Binding):
    """An op (``popart::Op``): a handle on one IR node of a popxl graph. Its class is chosen
    from the node's op type (:data:`OP_CLASS_NAMES`). ``op_type``, ``domain``, ``inputs``,
    ``outputs``, ``attrs`` and ``annotations`` read the node (what popxl's op-created hooks
    were given before)."""
    _PB_NAMES = _names(
        "adjustInSettings adjustOutSettings append calcAutoVirtualGraphCost canBeReplacedByIdentity "
        "canShard clone consumesGraphOutput copiesOptimizerTensors copy defaultConnectInTensor "
        "finalizeDebugInfo firstInIndex getBatchSerializedPhase getExecutionPhase getGradOps "
        "getHighSubgraphValue getInBatchAxis getInSettings getInplaceVariant "
        "getIntrospectionInVirtualGraphId getLowSubgraphValue getNonGradInIndex "
        "getOptionalBatchSerializedPhase getOptionalExecutionPhase getOutBatchAxis getOutSettings "
        "getScope getSeedInIndex getSubgraphEquivId getSubgraphValue gradInputInfo "
        "gradOutToNonGradIn hasAliasedModifiers hasBatchSerializedPhase hasExecutionPhase "
        "hasSideEffect inferTensorMappingToFrom inheritPlacementAttributes inplacePriorityDefault "
        "inputUnmodifiable inputsUnmodifiable isChildOf isElementWiseUnary isExcludedFromPattern "
        "isInplaceViewChange isLossOp isNorm isOptimizerOp isOutlineable isOutplaceViewChange "
        "isParentOf memOfOutputs modifiesIndex optionalInputs overwritesTensor prettyNpOut "
        "requiresRandomSeed setBatchSerializedPhase setCalledSubgraphGradInfo setExecutionPhase "
        "setScope toJSON transferBaseProperties getSubgraphInputs getSubgraphOutputs "
        "opOutToSubgraphOutIndex subgraphOutToOpOutIndex addModified addLoopInput addLoopOutput "
        "removeLoopInput removeLoopOutput getNumExplicitInputs")

    def __init__(self, graph: "XGraph", node: Node) -> None:
        self._graph, self._node = graph, node
        if not hasattr(node, "_pb_id"):   # given when the op is created (the hooks see it)
            node._pb_id = next(graph.ir._op_ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Op) and other._node is self._node

    def __hash__(self) -> int:
        return hash(id(self._node))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id}, {self._node.describe()})"

    # --- the node, as popxl's hooks saw it
    op_type = property(lambda self: self._node.op_type)
    domain = property(lambda self: self._node.domain)
    inputs = property(lambda self: self._node.inputs)
    outputs = property(lambda self: self._node.outputs)
    attrs = property(lambda self: self._node.attrs)
    annotations = property(lambda self: self._node.annotations)

    # --- identity
    @property
    def id(self) -> int:
        return self._node._pb_id

    @property
    def opid(self) -> OperatorIdentifier:
        n = self._node
        return OperatorIdentifier(n.domain, n.op_type, self._graph._g.opsets.get(n.domain, 1))

    def opType(self) -> str:
        return self._node.op_type

    def name(self) -> str:
        return self._node.name

    getName = name

    def setName(self, name: str) -> None:
        self._node.name = str(name)

    def debugName(self) -> str:
        return f"Op({self._node.name or self.id}, inputs=[{', '.join(self.inputs)}], " \
               f"outputs=[{', '.join(o for o in self.outputs if o)}])"

    def str(self) -> str:
        return f"{self.id} ({self._node.domain}.{self._node.op_type}:{self.opid.version})"

    def getGraph(self) -> "Graph":
        return Graph(self._graph)

    def getIr(self) -> "Ir":
        return Ir(self._graph.ir)

    # --- tensors
    @property
    def input(self) -> _IndexMap:
        return _IndexMap(self, "inputs")

    @property
    def output(self) -> _IndexMap:
        return _IndexMap(self, "outputs")

    def inTensor(self, i: int) -> Tensor:
        return self._at("inputs", i)

    def outTensor(self, i: int) -> Tensor:
        return self._at("outputs", i)

    def _at(self, side: str, i: int) -> Tensor:
        ids = getattr(self._node, side)
        if not (0 <= i < len(ids) and ids[i]):
            raise popart_exception(f"No {side[:-1]} tensor at index {i} of {self.debugName()}")
        return Tensor(self._graph, ids[i])

    def inId(self, i: int) -> str:
        return self.inTensor(i).id

    def outId(self, i: int) -> str:
        return self.outTensor(i).id

    def hasInput(self, i: int) -> bool:
        return self.input.hasIndex(i)

    def hasOutput(self, i: int) -> bool:
        return self.output.hasIndex(i)

    def hasInputTensor(self, t: Tensor) -> bool:
        return t.id in self._node.inputs

    def hasOutputTensor(self, t: Tensor) -> bool:
        return t.id in self._node.outputs

    def inIndex(self, t: Tensor) -> int:
        return self._index("inputs", t)

    def outIndex(self, t: Tensor) -> int:
        return self._index("outputs", t)

    def _index(self, side: str, t: Tensor) -> int:
        ids = getattr(self._node, side)
        if t.id not in ids:
            raise popart_exception(f"{t.id} is not an {side[:-1]} of {self.debugName()}")
        return ids.index(t.id)

    def inTensorCount(self) -> int:
        return self.input.n()

    def outTensorCount(self) -> int:
        return self.output.n()

    def getInputTensors(self) -> list[Tensor]:
        return self.input.tensors()

    def getOutputTensors(self) -> list[Tensor]:
        return self.output.tensors()

    def getInputIndexMap(self) -> dict[int, Tensor]:
        return self.input.tensorMap()

    def getOutputIndexMap(self) -> dict[int, Tensor]:
        return self.output.tensorMap()

    def inInfo(self, i: int) -> TensorInfo:
        return self.inTensor(i).info

    def outInfo(self, i: int) -> TensorInfo:
        return self.outTensor(i).info

    def inShape(self, i: int) -> list[int]:
        return self.inInfo(i).shape()

    def outShape(self, i: int) -> list[int]:
        return self.outInfo(i).shape()

    def inRank(self, i: int) -> int:
        return self.inInfo(i).rank()

    def outRank(self, i: int) -> int:
        return self.outInfo(i).rank()

    # --- placement (the node's annotations)
    @property
    def settings(self) -> Settings:
        """The op's settings; changing a field changes the node's annotations."""
        s = Settings(Graph(self._graph), self._node.name, {})
        s.annotations = self._node.annotations
        return s

    getSettings = settings.fget

    def getVirtualGraphId(self) -> int:
        if VIRTUAL_GRAPH not in self._node.annotations:
            raise popart_exception(f"Cannot return vGraphId for Op {self.debugName()}. "
                                   f"It has not had this attribute set")
        return int(self._node.annotations[VIRTUAL_GRAPH])

    def hasVirtualGraphId(self) -> bool:
        return VIRTUAL_GRAPH in self._node.annotations

    def getOptionalVGraphId(self) -> Optional[int]:
        return self._node.annotations.get(VIRTUAL_GRAPH)

    def setVirtualGraphId(self, value: Optional[int]) -> None:
        self.settings.vgraphId = value

    def getPipelineStage(self) -> int:
        if PIPELINE_STAGE not in self._node.annotations:
            raise popart_exception(f"Cannot return pipelineStage for Op {self.debugName()}. "
                                   f"It has not had this attribute set")
        return int(self._node.annotations[PIPELINE_STAGE])

    def hasPipelineStage(self) -> bool:
        return PIPELINE_STAGE in self._node.annotations

    def getOptionalPipelineStage(self) -> Optional[int]:
        return self._node.annotations.get(PIPELINE_STAGE)

    def setPipelineStage(self, value: Optional[int]) -> None:
        self.settings.pipelineStage = value

    vgraphId = property(getOptionalVGraphId)
    pipelineStage = property(getOptionalPipelineStage)

    @property
    def executionContext(self) -> Any:
        return self.settings.executionContext

    @property
    def tileSet(self) -> Any:
        return self.settings.tileSet

    def isIpuCopyOp(self) -> bool:
        return isinstance(self, op_class("IpuCopyOp"))

    # --- called graphs
    def getCalledGraphs(self) -> list["Graph"]:
        return [Graph(g) for g in called_graphs(self._graph.ir, [self._node])]

    def getCalledGraphIds(self) -> list[GraphId]:
        return [g.id for g in self.getCalledGraphs()]

    def getCalledGraphIndex(self, gid: Any) -> int:
        return self.getCalledGraphIds().index(GraphId(str(gid)))

    # --- changing the op (PopART: connect, setup, erase)
    def cloneIntoGraph(self, graph: "Graph") -> "Op":
        """A copy of this op in ``graph`` with no tensors connected (connect them with
        :meth:`connectInTensor` / :meth:`createAndConnectOutTensor`, then :meth:`setup`)."""
        n = self._node
        clone = Node(n.op_type, [""] * len(n.inputs), [""] * len(n.outputs), dict(n.attrs),
                     n.domain, n.name, dict(n.annotations))
        clone._inplace = self._inplace_pairs()
        graph._graph._g.nodes.append(clone)
        return op_handle(graph._graph, clone)

    def _read(self) -> list[str]:
        """The ids the op read (as connected before ``disconnectAllInputs``)."""
        return getattr(self._node, "_pb_inputs", self._node.inputs)

    def _inplace_pairs(self) -> dict[int, int]:
        """output index -> input index for the outputs that are in-place results on an input."""
        n, versions, ins = self._node, self._graph._versions, self._read()
        pairs = dict(getattr(n, "_inplace", {}))
        if pairs:
            return pairs
        for oi, o in enumerate(n.outputs):
            if o in versions:
                ii = next((i for i, x in enumerate(ins) if x and versions.get(x, x) == versions[o]), None)
                if ii is not None:
                    pairs[oi] = ii
        return pairs

    def _release(self, outputs: Iterable[str]) -> None:
        """The op stops making ``outputs``: where one is its in-place result on an input, the
        other ops and the popxl tensors naming it (the tensor it changed, the result) name the
        value the op read instead."""
        g, n, ins = self._graph, self._node, self._read()
        outputs = set(outputs)
        for oi, ii in self._inplace_pairs().items():
            o = n.outputs[oi] if oi < len(n.outputs) else ""
            if o not in outputs or not ins[ii]:
                continue
            for m in g._g.nodes:
                if m is not n:
                    m.inputs[:] = [ins[ii] if x == o else x for x in m.inputs]
            for t in g._tensors.values():   # the tensor it changed, and the result's own
                if t._ir_id == o:
                    t._ir_id = ins[ii]

    def connectInTensor(self, index: int, tid: str, vgraph: Optional[int] = None) -> None:
        """Connect tensor ``tid`` of the op's graph at input ``index``."""
        tid = current(self._graph, tid)
        ins = self._node.inputs
        ins.extend([""] * (index + 1 - len(ins)))
        if ins[index]:
            raise popart_exception(f"Op {self.debugName()} already has an input at index {index}")
        ins[index] = tid

    def disconnectInTensor(self, *args: Any) -> None:
        """``disconnectInTensor(index)``, ``(tensor)`` or ``(index, tensor)``."""
        ins = self._node.inputs
        for a in args:
            if isinstance(a, Tensor):
                for i in [i for i, x in enumerate(ins) if x == a.id]:
                    ins[i] = ""
                return
        ins[int(args[0])] = ""

    def disconnectAllInputs(self) -> None:
        if not hasattr(self._node, "_pb_inputs"):
            self._node._pb_inputs = list(self._node.inputs)
        self._node.inputs[:] = [""] * len(self._node.inputs)

    def disconnectOutTensor(self, t: Tensor) -> None:
        self._release([t.id])
        outs = self._node.outputs
        outs[:] = ["" if o == t.id else o for o in outs]

    def disconnectAllOutputs(self) -> None:
        self._release(self._node.outputs)
        self._node.outputs[:] = [""] * len(self._node.outputs)

    def createAndConnectOutTensor(self, index: int, tid: str) -> None:
        """Make tensor ``tid`` (exactly this id) the op's output ``index``; its shape and dtype
        come from the op's lowering over the inputs connected now."""
        g = self._graph
        if tid in g._specs:
            raise popart_exception(f"Tensor with id '{tid}' already exists in graph '{g.id}'")
        outs = self._node.outputs
        outs.extend([""] * (index + 1 - len(outs)))
        outs[index] = tid
        g._specs[tid] = None   # reserved; :meth:`setup` gives the spec
        self.setup()

    def connectOutTensor(self, index: int, tid: str) -> None:
        raise popart_exception(f"popart._internal.ir.Op.connectOutTensor is not supported on XLA: "
                               f"tensor '{tid}' already has a value (SSA); use "
                               f"createAndConnectOutTensor")

    def setup(self) -> None:
        """Infer the output tensors' shapes and dtypes from the lowering (PopART's
        ``Op::setup``); outputs made in place on an input become that tensor's new value."""
        g, n = self._graph, self._node
        specs = g._infer(n)
        for oi, o in enumerate(n.outputs):
            if not o:
                continue
            if oi >= len(specs) or specs[oi] is None:
                raise popart_exception(f"{n.describe()} has no output {oi} to connect '{o}' to")
            if o in g._tensors:
                g._specs[o] = specs[oi]
            else:
                g._add_tensor(o, specs[oi])
        for oi, ii in getattr(n, "_inplace", {}).items():
            if oi < len(n.outputs) and ii < len(n.inputs) and n.outputs[oi] and n.inputs[ii]:
                owner = g._tensors[g._versions.get(n.inputs[ii], n.inputs[ii])]
                if owner._ir_id == n.inputs[ii]:
                    inplace(owner, g._tensors[n.outputs[oi]])


class SubgraphOp(Op):
    """An op that calls a graph (``popart::SubgraphOp``). Its inputs, by PopART's index: the
    called graph's inputs (after ``_IN_OFFSET`` of its own), then the graph's hidden inputs
    (host-stream and remote-buffer state). A graph input added after the call is connected
    with :meth:`connectInTensor`, and :meth:`addModified` makes the call return its new value
    (the graph takes it by reference; the caller's tensor moves to the call's result)."""
    _IN_OFFSET = 0   # op input index - called graph input index

    def getCalledGraph(self) -> "Graph":
        return self.getCalledGraphs()[0]

    def opInToSubgraphInIndex(self, i: int) -> int:
        return int(i) - self._IN_OFFSET

    def subgraphInToOpInIndex(self, i: int) -> int:
        return int(i) + self._IN_OFFSET

    def getNumExplicitInputs(self) -> int:
        return len(self._sg()._inputs) + self._IN_OFFSET

    def _sg(self) -> "XGraph":
        return called_graphs(self._graph.ir, [self._node])[0]

    def _inner(self) -> Node:
        """The Call node of the called graph (the op's own node for a call)."""
        return self._node

    def _n_connected(self) -> int:
        """How many of the called graph's (explicit) inputs the op connects."""
        return len(self._inner().inputs) - len(self._sg()._hidden)

    def _pos(self, i: int) -> Optional[int]:
        """The node input position of input ``i`` (None: a graph input not connected yet)."""
        k, n_c, n_exp = int(i) - self._IN_OFFSET, self._n_connected(), len(self._sg()._inputs)
        return int(i) if k < n_c else None if k < n_exp else int(i) - (n_exp - n_c)

    def _bind(self, p: int) -> int:
        """The input index of node input position ``p``."""
        n_c = self._n_connected()
        return p if p - self._IN_OFFSET < n_c else p + len(self._sg()._inputs) - n_c

    def hasInput(self, i: int) -> bool:
        p = self._pos(i)
        return p is not None and super().hasInput(p)

    def inTensor(self, i: int) -> Tensor:
        p = self._pos(i)
        if p is None:
            raise popart_exception(f"No input tensor at index {i} of {self.debugName()}")
        return super().inTensor(p)

    def _same(self, t: Tensor) -> Optional[int]:
        """The node input position of ``t``, or of the value its popxl tensor had when the
        call read it (the call's by-reference result is the same PopART tensor)."""
        ins, versions = self._node.inputs, self._graph._versions
        if t.id in ins:
            return ins.index(t.id)
        base = versions.get(t.id, t.id)
        return next((p for p, x in enumerate(ins) if x and versions.get(x, x) == base
                     and t.id in self._node.outputs), None)

    def hasInputTensor(self, t: Tensor) -> bool:
        return self._same(t) is not None

    def inIndex(self, t: Tensor) -> int:
        p = self._same(t)
        if p is None:
            raise popart_exception(f"{t.id} is not an input of {self.debugName()}")
        return self._bind(p)

    def getInputIndexMap(self) -> dict[int, Tensor]:
        return {self._bind(p): t for p, t in super().getInputIndexMap().items()}

    def connectInTensor(self, index: int, tid: str, vgraph: Optional[int] = None) -> None:
        """Connect ``tid`` at input ``index``; the next graph input not connected yet is
        added to the call."""
        p = self._pos(index)
        if p is not None:
            return super().connectInTensor(p, tid)
        k = int(index) - self._IN_OFFSET
        if k != self._n_connected():
            raise popart_exception(f"{self.debugName()}: connect the inputs of graph "
                                   f"{self._sg().id} in order: input {index} before "
                                   f"{self._n_connected() + self._IN_OFFSET}")
        self._insert_input(k, current(self._graph, tid))
        self._sg()._finalize()
        self._sync_refs()

    def _insert_input(self, k: int, tid: str) -> None:
        self._node.inputs.insert(k, tid)

    def addModified(self, index: int, regions: Iterable[Region]) -> None:
        """Input ``index`` is changed by this call (PopART's modified input): the graph takes
        it by reference and every call of it returns its new value; the caller's tensor moves
        to it at this call only (other calls, earlier or later, leave theirs as they are)."""
        if all(r.isEmpty() for r in regions):
            return
        sg = self._sg()
        k = int(index) - self._IN_OFFSET
        if not 0 <= k < len(sg._inputs):
            raise popart_exception(f"{self.debugName()}.addModified({index}): not an input of "
                                   f"graph {sg.id}")
        t = sg._inputs[k]
        sites = [op_handle(parent, n) for parent, n in _call_sites(sg)]
        for site in sites:
            if not isinstance(site, SubgraphOp) or isinstance(site, op_class("IfOp")):
                raise popart_exception(f"{self.debugName()}.addModified: graph {sg.id} is also "
                                       f"called by {site.debugName()}, which cannot return it")
            site._refs()
        if not any(t is r for r in sg._by_ref_inputs):
            sg._by_ref_inputs.append(t)
            sg._modified_by_calls = [*getattr(sg, "_modified_by_calls", ()), t]   # ops.call: not moved
        self._node._pb_modified = {*getattr(self._node, "_pb_modified", ()), k}
        sg._finalize()
        for site in sites:
            site._sync_refs(move=site._node is self._node)
        self._move_ref(t)

    def _refs(self) -> list:
        """The by-reference graph inputs whose new values the call returns, in order."""
        inner = self._inner()
        if not hasattr(inner, "_pb_refs"):
            inner._pb_refs = list(self._sg()._by_ref_list())
        return inner._pb_refs

    def _sync_refs(self, move: bool = True) -> None:
        """Return from this call the new value of each by-reference input it connects (the
        caller's tensor moves to it where ``move``)."""
        sg, inner, have = self._sg(), self._inner(), self._refs()
        want = sg._by_ref_list()
        for r in want:
            if any(r is h for h in have):
                continue
            k = next(i for i, x in enumerate(sg._all_inputs()) if x is r)
            p = self._pos(k + self._IN_OFFSET)
            if p is None:
                continue   # connected later (connectInTensor syncs again)
            j = sum(1 for w in want[:want.index(r)] if any(w is h for h in have))
            at = len(inner.outputs) - len(have) + j
            self._add_ref_output(k, at)
            have.insert(j, r)
            if move:
                self._move_ref(r)

    def _ref_result(self, k: int) -> str:
        """The call's output: the new value of by-reference input ``k`` (after the explicit
        outputs, in the order of :meth:`_refs`)."""
        have, r = self._refs(), self._sg()._all_inputs()[k]
        return self._node.outputs[len(self._node.outputs) - len(have) +
                                  next(i for i, h in enumerate(have) if h is r)]

    def _move_ref(self, r: Any) -> None:
        """The caller's tensor for by-reference input ``r`` moves to this call's new value of
        it (unless it has moved on since)."""
        k = next(i for i, x in enumerate(self._sg()._all_inputs()) if x is r)
        p = self._pos(k + self._IN_OFFSET)
        src = None if p is None else self._node.inputs[p]
        owner = None if src is None else popxl_tensor(self._graph, src)
        if owner is not None and owner._ir_id == src:
            inplace(owner, self._graph._tensors[self._ref_result(k)])

    def _add_ref_output(self, k: int, at: int) -> str:
        """Add the call's output (at position ``at``) for by-reference input ``k``; its id."""
        g, src = self._graph, self._sg()._all_inputs()[k]
        oid = g._new_id(src.name)
        self._node.outputs.insert(at, oid)
        g._add_tensor(oid, src._spec)
        return oid

    def createAndConnectOutTensor(self, index: int, tid: str) -> None:
        """Connect output ``index``: an unconnected one (of a clone), or the output for a graph
        output added after the call."""
        outs = self._inner().outputs
        if not (index < len(outs) and not outs[index]):
            if index != len(outs) - len(self._refs()) or index >= len(self._sg()._outputs):
                raise popart_exception(f"{self.debugName()}: graph {self._sg().id} has no "
                                       f"output {index} to connect")
            outs.insert(index, "")
        super().createAndConnectOutTensor(index, tid)


class CallOp(SubgraphOp):
    """``ops.call``: an ai.graphcore Call node."""

    def modifiesIndex(self, index: int) -> bool:
        """Whether the call changes its input ``index`` (PopART's modified input): the called
        graph takes it by reference and this call moves the caller's tensor to its new value
        (an input passed by reference, or one :meth:`addModified` marked at this call)."""
        sg, k = self._sg(), int(index)
        t = sg._inputs[k] if 0 <= k < len(sg._inputs) else None
        if t is None or not any(t is r for r in sg._by_ref_inputs):
            return False
        return k in getattr(self._node, "_pb_modified", ()) or \
            not any(t is m for m in getattr(sg, "_modified_by_calls", ()))


class LoopOp(SubgraphOp):
    """``ops.repeat``: an ai.onnx Loop of PopXL's middle graph (``popxl.graph.RepeatBody``:
    inputs iteration, condition, the carried values; outputs condition, the carried values),
    which calls the repeated graph once. Op input i is the middle graph's input i (0 and 1:
    the trip count and the condition); op output i is its output i + 1. Every input is
    carried (ONNX's Loop): one added with :meth:`addLoopInput` passes through unchanged."""

    def getTripCountValue(self) -> int:
        import numpy as np
        return int(np.asarray(self._graph._g.initializers[self._node.inputs[0]]))

    def opOutToSubgraphOutIndex(self, i: int) -> int:
        return int(i) + 1

    def subgraphOutToOpOutIndex(self, i: int) -> int:
        return int(i) - 1

    def _refs(self) -> list:
        return []   # the middle graph returns every carried value: no by-reference results

    def _sync_refs(self, move: bool = True) -> None:
        pass

    def addModified(self, index: int, regions: Iterable[Region]) -> None:
        """Input ``index`` is changed: the caller's tensor moves to the op's output for it
        (its carried value after the last iteration)."""
        if all(r.isEmpty() for r in regions):
            return
        src = self._node.inputs[int(index)]
        owner = popxl_tensor(self._graph, src)
        if owner is not None and owner._ir_id == src:
            inplace(owner, self._graph._tensors[self._node.outputs[int(index) - 2]])

    def addLoopInput(self, index: int, tid: str, sg_tid: str, overwrite: bool = False) -> None:
        """Add op input ``index`` (the next one after the middle graph's inputs), connected to
        ``tid``, the middle graph's input ``sg_tid`` (exactly that id) it feeds, and (ONNX's
        Loop carries every input) its output, that input unchanged."""
        mid, k = self._sg(), int(index)
        if k != len(mid._inputs):
            raise popart_exception(f"{self.debugName()}.addLoopInput({index}): only the next "
                                   f"input, {len(mid._inputs)}, can be added")
        if sg_tid in mid._specs:
            raise popart_exception(f"Tensor with id '{sg_tid}' already exists in graph '{mid.id}'")
        g, src = self._graph, current(self._graph, tid)
        t = mid._add_tensor(sg_tid, g._specs[src])
        mid._entry[t] = sg_tid
        mid._inputs.append(t)
        mid._outputs.append(t)
        self._node.inputs.insert(k, src)
        oid = g._new_id(g._tensors[src].name if src in g._tensors else "loop_out")
        self._node.outputs.insert(k - 2, oid)
        g._add_tensor(oid, g._specs[src])
        mid._finalize()

    def addLoopOutput(self, index: int, tid: str, sg_tid: str, overwrite: bool = True) -> None:
        """The middle graph's tensor ``sg_tid`` becomes its output ``index + 1``: the value
        carried into input ``index + 2`` of the next iteration, and the op's output ``index``."""
        mid, j = self._sg(), int(index) + 1
        if not (overwrite and 1 <= j < len(mid._outputs)):
            raise popart_exception(f"popart._internal.ir.LoopOp.addLoopOutput is not supported "
                                   f"on XLA: only an existing output (0 to "
                                   f"{len(mid._outputs) - 2} here) can be overwritten, not {index}")
        mid._outputs[j] = popxl_tensor(mid, current(mid, sg_tid))
        mid._finalize()


# PopART's op class of each op type, where it is not "<op type>Op".
OP_CLASS_NAMES = {
    "Sub": "SubtractOp", "Neg": "NegateOp", "GroupNormalization": "GroupNormOp",
    "BatchNormalization": "BatchNormOp", "Loop": "LoopOp", "If": "IfOp", "Call": "CallOp",
    "Nll": "NllOp", "NllWithSoftmaxGrad": "NllWithSoftmaxGradDirectOp", "Identity": "IdentityOp",
    "ReplicatedAllReduceInplace": "ReplicatedAllReduceInplaceOp", "GroupedGather": "GatherOp",
    "Pow2ScaleThenCast": "Pow2ScaleThenCastOp", "OpVJP": "GradOp",
}
_CLASSES: dict[str, type] = {"Op": Op, "SubgraphOp": SubgraphOp, "CallOp": CallOp, "LoopOp": LoopOp}
_BASES = {"IfOp": SubgraphOp}


def op_class(name: str) -> type:
    """PopART's op class ``name`` (made on first use: one class per name)."""
    if name not in _CLASSES:
        _CLASSES[name] = type(name, (_BASES.get(name, Op),), {"__module__": "popart._internal.ir.op"})
    return _CLASSES[name]


class IpuCopyOp(Op):
    """``ops.ipu_copy``: an Identity whose output is on another IPU than its input."""

    def getSourceIpu(self, tid: Optional[str] = None) -> int:
        return _ipu_of(self._graph, tid or self._read()[0])

    def getDestIpu(self) -> int:
        return int(self._node.annotations[VIRTUAL_GRAPH])


_CLASSES["IpuCopyOp"] = IpuCopyOp


def _ipu_of(graph: "XGraph", tid: str) -> Optional[int]:
    t = graph._tensors.get(tid)
    return None if t is None else t._placement[0]


def _is_ipu_copy(graph: "XGraph", node: Node) -> bool:
    ins = [i for i in getattr(node, "_pb_inputs", node.inputs) if i]
    dest = node.annotations.get(VIRTUAL_GRAPH)
    return node.op_type == "Identity" and dest is not None and len(ins) == 1 and \
        _ipu_of(graph, ins[0]) not in (None, dest)


def op_handle(graph: "XGraph", node: Node) -> Op:
    """The handle of ``node`` of ``graph``, of the class of its op type (an Identity across
    IPUs: ``IpuCopyOp``)."""
    if _is_ipu_copy(graph, node):
        return IpuCopyOp(graph, node)
    return op_class(OP_CLASS_NAMES.get(node.op_type, f"{node.op_type}Op"))(graph, node)


def op_created(graph: "XGraph", node: Node) -> None:
    """Run the op-created hooks for ``node``, just added to ``graph`` (its handle is only built
    when there are hooks)."""
    ctx = context.get_current_context()
    if ctx._op_created_hooks:
        ctx._op_created(op_handle(graph, node))


def called_graphs(ir: "XIr", nodes: Iterable[Node]) -> list["XGraph"]:
    """The popxl graphs ``nodes`` call, in order (through the wrapper graphs of repeat and
    conditional)."""
    by_ir = {id(g._g): g for g in ir._graphs}
    found: dict[int, "XGraph"] = {}

    def walk(ns: Iterable[Node]) -> None:
        for n in ns:
            for v in n.attrs.values():
                if isinstance(v, IRGraph):
                    if id(v) in by_ir:
                        found.setdefault(id(v), by_ir[id(v)])
                    else:
                        walk(v.nodes)
    walk(nodes)
    return list(found.values())


# ---------------------------------------------------------------------------------- graphs
class TopoCons(_Binding):
    """A graph's topological constraints (``popart::TopoCons``). Ops run in the order of the
    graph's node list; ``insert(before, after)`` moves ops so that ``before`` runs first."""
    _PB_NAMES = _names("remove getBefores getAfters getTiedBefores getTiedAfters contains")

    def __init__(self, graph: "XGraph") -> None:
        self._graph = graph

    def insert(self, before: Op, after: Op, tied: bool = False) -> None:
        cons = self._graph.__dict__.setdefault("_topo_cons", [])
        cons.append((before._node, after._node))
        reschedule(self._graph)

    def transferToSubgraph(self, replacement: Any, opRemaps: Any, removeOld: bool = True) -> None:
        """The constraints of ops moved into a subgraph: their order there is the order they
        were cloned in, and the call runs where the graph's node list puts it."""
        if removeOld:
            moved = {id(op._node) for op in (opRemaps or {})}
            cons = self._graph.__dict__.get("_topo_cons", [])
            cons[:] = [(a, b) for a, b in cons if id(a) not in moved and id(b) not in moved]


def reschedule(graph: "XGraph") -> None:
    """Reorder the graph's nodes to satisfy data flow and its topological constraints, keeping
    the current order where they allow it.

    Raises:
        popart_exception: the constraints form a cycle.
    """
    nodes = graph._g.nodes
    pos = {id(n): i for i, n in enumerate(nodes)}
    made = {o: n for n in nodes for o in n.outputs if o}
    preds: dict[int, set] = {id(n): {id(made[i]) for i in n.inputs if i in made} - {id(n)} for n in nodes}
    for a, b in graph.__dict__.get("_topo_cons", []):
        if id(a) in preds and id(b) in preds:
            preds[id(b)].add(id(a))
    order, done = [], set()
    while len(order) < len(nodes):
        ready = [n for n in nodes if id(n) not in done and preds[id(n)] <= done]
        if not ready:
            raise popart_exception(f"Topological constraints of graph '{graph.id}' form a cycle")
        n = min(ready, key=lambda x: pos[id(x)])
        order.append(n)
        done.add(id(n))
    nodes[:] = order


class Graph(_Binding):
    """A graph (``popart::Graph``): a handle on a popxl graph and its IR graph."""
    _PB_NAMES = _names("addActGrad addInput addStream getAllVirtualGraphIds getScope "
                       "removeInput removeIsolatedTensors")

    def __init__(self, graph: "XGraph") -> None:
        self._graph = graph

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and other._graph is self._graph

    def __hash__(self) -> int:
        return hash(id(self._graph))

    def __repr__(self) -> str:
        return f"_ir.Graph({self._graph.id!r})"

    @property
    def id(self) -> GraphId:
        return GraphId(self._graph.id)

    def getIr(self) -> "Ir":
        return Ir(self._graph.ir)

    def getGraphString(self) -> str:
        return "\n".join(op_handle(self._graph, n).debugName() for n in self._graph._g.nodes)

    # --- ops
    def getOps(self) -> list[Op]:
        return [op_handle(self._graph, n) for n in self._graph._g.nodes]

    def getOpSchedule(self, requireOptimalSchedule: bool = False) -> list[Op]:
        """The ops in the order they run (the node list's)."""
        return self.getOps()

    def getOpIds(self) -> list[int]:
        return [op.id for op in self.getOps()]

    def getOp(self, opid: int) -> Op:
        for op in self.getOps():
            if op.id == opid:
                return op
        raise popart_exception(f"No Op `{opid}' in graph {self._graph.id}")

    def eraseOp(self, opid: int) -> None:
        """Remove op ``opid`` from the graph: its output tensors stay (dangling if read); a
        popxl tensor it changed in place keeps the value the op read."""
        op = self.getOp(opid)
        op._release(op._node.outputs)
        node = op._node
        self._graph._g.nodes.remove(node)
        cons = self._graph.__dict__.get("_topo_cons", [])
        cons[:] = [(a, b) for a, b in cons if a is not node and b is not node]

    def topoCons(self) -> TopoCons:
        return TopoCons(self._graph)

    def getCalledGraphs(self) -> list["Graph"]:
        return [Graph(g) for g in called_graphs(self._graph.ir, self._graph._g.nodes)]

    # --- tensors
    def getTensor(self, tid: str) -> Tensor:
        return tensor_of(self._graph, tid)

    def __contains__(self, tid: str) -> bool:
        return tid in self._graph._tensors

    def getTensorIds(self) -> list[str]:
        return list(self._graph._tensors)

    def getTensors(self) -> list[Tensor]:
        return [Tensor(self._graph, t) for t in self._graph._tensors]

    # --- inputs and outputs (popxl's graph.inputs / graph.outputs)
    def getInputIds(self) -> list[str]:
        return [t.id for t in self._graph._inputs]

    def getOutputIds(self) -> list[str]:
        return [t._ir_id for t in self._graph._outputs]

    def getInputId(self, i: int) -> str:
        return self._at(self.getInputIds(), i, "input")

    def getOutputId(self, i: int) -> str:
        return self._at(self.getOutputIds(), i, "output")

    def _at(self, ids: list[str], i: int, what: str) -> str:
        if not 0 <= i < len(ids):
            raise popart_exception(f"Graph {self._graph.id} has {len(ids)} {what}s, no {what} {i}")
        return ids[i]

    def getInputTensor(self, i: int) -> Tensor:
        return Tensor(self._graph, self.getInputId(i))

    def getOutputTensor(self, i: int) -> Tensor:
        return Tensor(self._graph, self.getOutputId(i))

    def hasInputId(self, tid: str) -> bool:
        return tid in self.getInputIds()

    def hasOutputId(self, tid: str) -> bool:
        return tid in self.getOutputIds()

    def getInputIndex(self, tid: str) -> int:
        return self._index(self.getInputIds(), tid, "input")

    def getOutputIndex(self, tid: str) -> int:
        """The index of the output with IR id ``tid`` (or of popxl tensor ``tid``)."""
        popxl_ids = [t.id for t in self._graph._outputs]
        if tid not in self.getOutputIds() and tid in popxl_ids:
            return popxl_ids.index(tid)
        return self._index(self.getOutputIds(), tid, "output")

    def _index(self, ids: list[str], tid: str, what: str) -> int:
        if tid not in ids:
            raise popart_exception(f"Could not find {what} index for {what} tensor '{tid}' in "
                                   f"graph {self._graph.id}")
        return ids.index(tid)

    def markAsOutput(self, tid: str) -> None:
        """Make tensor ``tid`` the graph's next output. Calls made before get an unconnected
        output for it (``CallOp.createAndConnectOutTensor`` connects it).

        Raises:
            popart_exception: the graph is repeated (its outputs are loop-carried).
        """
        g = self._graph
        t = popxl_tensor(g, tensor_of(g, tid).id)
        sites = [op_handle(parent, n) for parent, n in _call_sites(g)]
        for site in sites:
            if not isinstance(site, CallOp):
                raise popart_exception(f"Graph {g.id}.markAsOutput('{tid}'): the graph is called "
                                       f"by {site.debugName()}, whose outputs are loop-carried")
        for site in sites:
            n_explicit = len(site._node.outputs) - len(site._refs())
            site._node.outputs.insert(n_explicit, "")
        g._outputs.append(t)
        g._finalize()

    def removeOutput(self, index: Union[int, str]) -> None:
        """Remove output ``index`` (or the output with that id) of the graph and of the calls
        of it.

        Raises:
            popart_exception: a call's result for it is read, or the graph is repeated (its
                outputs are loop-carried).
        """
        g = self._graph
        i = index if isinstance(index, int) else self.getOutputIndex(index)
        n_out = len(g._outputs)
        if n_out and i >= n_out:   # PopART erases begin() + i: past the end, libstdc++ drops the
            i = n_out - 1          # last (popxl-addons removes ascending indices and counts on it)
        self._at(self.getOutputIds(), i, "output")
        sites = _call_sites(g)
        for parent, n in sites:
            if n.op_type != "Call":
                raise popart_exception(f"Graph {g.id}.removeOutput({i}): the graph is called by "
                                       f"{n.describe()}, whose outputs are loop-carried")
            out = n.outputs[i]
            if any(out in m.inputs for m in parent._g.nodes) or \
                    any(t._ir_id == out for t in parent._outputs):
                raise popart_exception(f"Graph {g.id}.removeOutput({i}): output '{out}' of "
                                       f"{n.describe()} in graph {parent.id} is read")
        for parent, n in sites:
            del n.outputs[i]
        del g._outputs[i]
        g._finalize()

    # --- flags
    def setCanBeRecursivelyAutodiffed(self, value: bool) -> None:
        self._graph._can_be_recursively_autodiffed = bool(value)

    def canBeRecursivelyAutodiffed(self) -> bool:
        return getattr(self._graph, "_can_be_recursively_autodiffed", True)

    # --- custom ops
    def createCustomOp(self, op_type: str, domain: str, version: int, inputs: dict[int, str],
                       outputs: dict[int, str], attributes: dict, settings: Optional[Settings]) -> Op:
        """Add one node of registry op ``(domain, op_type)`` reading the tensors ``inputs``
        (index -> tensor id) and making the tensors ``outputs`` (index -> exactly that id);
        output shapes come from the op's lowering; the node gets ``settings``' name and
        placement; the graph's op-created hooks run. Returns the op."""
        g = self._graph
        ins = [""] * (max(inputs, default=-1) + 1)
        for i, tid in inputs.items():
            ins[i] = current(g, tid)
        outs = [""] * (max(outputs, default=-1) + 1)
        for i, tid in outputs.items():
            if tid in g._specs:
                raise popart_exception(f"{domain}::{op_type}: output {i} '{tid}' already exists "
                                       f"in graph '{g.id}'")
            outs[i] = tid
        s = settings if settings is not None else Settings(self, op_type)
        node = Node(op_type, ins, outs, dict(attributes or {}), domain, name=s.name or op_type,
                    annotations=dict(s.annotations))
        g._g.opsets.setdefault(domain, int(version))
        specs = g._infer(node)
        missing = [i for i, o in enumerate(outs) if o and (i >= len(specs) or specs[i] is None)]
        if missing:
            raise popart_exception(f"{node.describe()} has no output(s) {missing}: its lowering "
                                   f"gives {len(specs)}")
        g._g.nodes.append(node)
        for o, spec in zip(outs, specs):
            if o:
                g._add_tensor(o, spec)
        op_created(g, node)
        return op_handle(g, node)


def _call_sites(graph: "XGraph") -> list[tuple["XGraph", Node]]:
    """(parent graph, node) of every op in the Ir that calls ``graph`` (Call nodes, or the Loop /
    If whose wrapper graph calls it)."""
    out = []
    for parent in graph.ir._graphs:
        for n in parent._g.nodes:
            if graph in called_graphs(graph.ir, [n]):
                out.append((parent, n))
    return out


# ---------------------------------------------------------------------------------- the Ir
class Ir(_Binding):
    """The IR (``popart::Ir``) of a popxl Ir."""
    _PB_NAMES = _names(
        "addAnchor applyTransform createUniqueSubgraphId dataStreamTensors dotCheckpoint "
        "finalizeOpDebugInfo getAllRemoteBufferInfos getDataFlow getHostLoadTensors "
        "getHostStoreTensors getRemoteBufferInfo getTensor isPrepared logIr removeGraph "
        "removeIsolatedGraphs removeIsolatedTensors serializeToJSON setDataFlow setDeviceInfo "
        "setIsPrepared setRemoteBufferInfo updateVertices")

    def __init__(self, ir: "XIr") -> None:
        self._ir = ir

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ir) and other._ir is self._ir

    def __hash__(self) -> int:
        return hash(id(self._ir))

    def getId(self) -> int:
        return self._ir.id

    def getSessionOptions(self) -> Any:
        return self._ir._options

    def getAllGraphs(self) -> list[Graph]:
        return [Graph(g) for g in self._ir._graphs]

    def getMainGraph(self) -> Graph:
        return Graph(self._ir.main_graph)

    def hasGraph(self, gid: Any) -> bool:
        return str(gid) in self._ir._graph_cache

    def getGraph(self, gid: Any) -> Graph:
        graphs = self._ir._graph_cache
        if str(gid) not in graphs:
            raise popart_exception(f"No graph with id {gid}")
        return Graph(graphs[str(gid)])

    def createGraph(self, gid: Any) -> Graph:
        """A new empty subgraph with exactly the id ``gid``."""
        if self.hasGraph(gid):
            raise popart_exception(f"Graph({gid}) is already in Ir")
        main = self._ir.main_graph
        g = type(main)(self._ir, str(gid), parent=main)   # a popxl Graph (graph.py is above)
        self._ir._graphs.append(g)
        return Graph(g)

    def createIntermediateTensorId(self, base: str) -> str:
        return f"{base}__t{next(self._ir._intermediate_ids)}"

    # --- patterns: OpToIdentity rewrites the graph (popxl.transforms.patterns); XLA's compiler
    # makes the other rewrites PopART's patterns make (fusion, in-place buffer reuse).
    def setPatterns(self, patterns: Any) -> None:
        self._ir._pb_patterns = patterns

    def getPatterns(self) -> Any:
        return getattr(self._ir, "_pb_patterns", None)

    def applyPreAliasPatterns(self, graph: Graph) -> None:
        """PopART's OpToIdentityPattern on ``graph`` when the Ir's patterns enable it (the
        default); the other pre-alias patterns' forms are the lowerings' own."""
        from .transforms.patterns import op_to_identity
        p = self.getPatterns()
        if p is None or p.isPatternEnabled("OpToIdentity"):
            op_to_identity(graph._graph)

    def applyInplacePattern(self, graph: Graph) -> None:
        """Accepted: values are SSA here and XLA reuses buffers in place when it compiles (the
        graph is unchanged)."""


# ---------------------------------------------------------------------------------- autodiff
class ExpectedConnection:
    """One input or output of a gradient graph: the forward tensor id and whether it is that
    tensor (``Fwd``) or its gradient (``FwdGrad``)."""

    def __init__(self, fwdId: str, type: Any) -> None:
        self.fwdId, self.type = str(fwdId), type

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExpectedConnection) and (self.fwdId, self.type) == (other.fwdId, other.type)

    def __hash__(self) -> int:
        return hash((self.fwdId, self.type))

    def __repr__(self) -> str:
        return f"ExpectedConnection({self.fwdId!r}, {self.type})"


class BwdGraphInfo:
    """A gradient graph's id and its expected inputs / outputs (``popart::BwdGraphInfo``)."""

    def __init__(self, bwdGraphId: Any, expectedInputs: Sequence[ExpectedConnection],
                 expectedOutputs: Sequence[ExpectedConnection]) -> None:
        self.bwdGraphId = GraphId(str(bwdGraphId))
        self.expectedInputs, self.expectedOutputs = list(expectedInputs), list(expectedOutputs)

    def __repr__(self) -> str:
        return (f"BwdGraphInfo({self.bwdGraphId!r}, {self.expectedInputs}, "
                f"{self.expectedOutputs})")


# ---------------------------------------------------------------------------------- sessions
class Session(_Binding):
    """A popxl session's ``popart::Session`` surface that popxl-addons uses."""
    _PB_NAMES = _names("compileAndExport loadExecutable prepareDevice run readWeights "
                       "weightsToHost getInfo getSummaryReport getReport getSerializedGraph "
                       "connectStreamToCallback connectHostFunction setRandomSeed")

    def __init__(self, session: Any) -> None:
        self._session = session

    def writeWeights(self, weights_io: Any) -> None:
        """Set the host values of the variables ``weights_io`` names (a ``PyWeightsIO``; also
        on the device when attached, as popxl's ``write_variables_data``)."""
        main = self._session.ir.main_graph
        self._session.write_variables_data(
            {main._tensors[tensor_of(main, tid).id]: data for tid, data in weights_io.weights.items()})

    def weightsFromHost(self) -> None:
        self._session.weights_from_host()

    def setEngineIsLoaded(self, loaded: bool) -> None:
        """Accepted: the engine is loaded while the session is attached."""


class ReplicaGroupingHandle(_Binding):
    """``popart::ReplicaGrouping`` of a popxl ReplicaGrouping."""
    _PB_NAMES = _names("getGroupAt getIndexInGroupAt getReplicaAt getReplicasAt getTranspose")

    def __init__(self, rg: Any) -> None:
        self._rg = rg

    def getNumReplicas(self) -> int:
        return self._rg.num_replicas

    def getStride(self) -> int:
        return self._rg.stride

    def getGroupSize(self) -> int:
        return self._rg.group_size

    def getNumGroups(self) -> int:
        return self._rg.num_groups

    def str(self) -> str:
        return repr(self._rg)


# What context takes from here (it imports no module above it): the handles op-created hooks
# receive, and ``Context._get_op_settings``' maker.
context._UPPER.op = (Op,)
context._UPPER.settings = lambda graph, name: Settings(Graph(graph), name)
