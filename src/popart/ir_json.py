"""``Session.getIr()``: a read-only view of a session's IR, and ``_serializeIr``'s JSON.

The JSON has PopART's layout (``Ir::serialise``): one key per graph ("maingraph" unless the
model names its graph), each a list of ops ``{"type", "name", "inputs": [{"name", "shape",
"type", "index"}], "outputs": [{"name", "index"}], "attributes": {name: "value"}}``, values
as strings. A TrainingSession's IR also lists, as PopART's does after autodiff and the
optimizer transform, each op's grad op (``<Type>Grad``, in reverse order, reading
``Gradient___<output>`` and writing ``Gradient___<input>`` of the inputs that need one; where
a tensor has several consumers, their partial gradients and the sum of them, ``_grad_sum``) and
one var-update op per trained weight, named by the optimizer as PopART names them. On XLA
the backward pass is JAX's autodiff with PopART's grad rules (docs/gradients.md); this is
the description of what the compiled program computes, not a second implementation."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Mapping, Optional

import numpy as np

from ._ir.graph import PIPELINE_STAGE, VIRTUAL_GRAPH, Graph
from ._ir import recompute as _recompute
from ._ir.recompute import RECOMPUTE, RECOMPUTE_OUTPUT
from ._ir.transforms import gradient_flow
from ._ir.interipucopy import copied_id, ipu_copy_node
from .engine.placed import copied
from .ops.registry import shape_text
from .options import IrSerializationFormat
from .tensornames import PREFIXES
from .tensorinfo import TensorInfo

GRAD = "Gradient___"
YES_NO = {True: "YES", False: "NO"}


def _tensor(tid: str, infos: dict, index: int) -> dict:
    info: Optional[TensorInfo] = infos.get(tid) if tid in infos else \
        infos.get(tid[len(GRAD):] if tid.startswith(GRAD) else tid)
    shape = shape_text(info.shape()) if info is not None else "[]"
    dtype = info.data_type() if info is not None else "UNDEFINED"
    return {"name": tid, "shape": shape, "type": dtype, "index": str(index)}


def _attr(v: Any) -> str:
    if isinstance(v, Graph):
        return v.name
    if isinstance(v, np.ndarray):
        return str(v.tolist())
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    return str(v)


def _op(node_type: str, name: str, inputs: list, outputs: list, attrs: dict, infos: dict,
        priority: float = 0.0) -> dict:
    """One op as Op::toJSON writes it; its attributes end with ``schedulePriority``
    (Op::appendMore: the priority as a float, std::to_string's form)."""
    return {"type": node_type, "name": name,
            "inputs": [_tensor(t, infos, i) for i, t in enumerate(inputs) if t],
            "outputs": [{"name": t, "index": str(i)} for i, t in enumerate(outputs) if t],
            "attributes": {**{k: _attr(v) for k, v in {"recompute": "NO", **attrs}.items()},
                           "schedulePriority": f"{float(np.float32(priority)):.6f}"}}


# PopART's LikeOpsPattern (mandatory): RandomNormalLike / RandomUniformLike become
# RandomNormal / RandomUniform of the input's shape and type, named "<name>_<pattern>".
_FOLDED_LIKE = {"RandomNormalLike": ("RandomNormal", "RandomNormalLikeOpPattern"),
                "RandomUniformLike": ("RandomUniform", "RandomUniformLikeOpPattern")}


# PopART's Inplace pattern (ir.cpp applyInplacePattern, patterns/inplace.cpp): the ops'
# inplace variants with their ``inplacePriorityDefault`` (10 unless said; Transpose 100, Pad
# 1). View variants (``_VIEWS``) only alias their input; the others also modify it. Binary
# elementwise ops have two: Lhs when the output has the first input's size, Rhs when it has
# the second's (ElementWiseBinaryOp::inplacePriorityDefault). Tanh has none in PopART.
# Concat aliases all its inputs; the others their first (Rhs: the second).
_UNARY_INPLACE = ("Relu", "Sigmoid", "Scale", "Softmax", "Gelu", "LeakyRelu", "HardSigmoid",
                  "Exp", "Floor", "Ceil", "Round", "Sign", "Atan", "Asin", "Sinh", "Elu",
                  "Selu", "Swish", "SoftPlus", "Softsign", "Shrink", "ThresholdedRelu",
                  "Expm1", "Log1p", "LogSoftmax", "Clip")
_VIEWS = ("Reshape", "Transpose", "Slice", "Concat", "Expand", "Subsample", "Identity",
          "Detach")
_INPLACE_VARIANTS = {
    **{op: ((f"{op}Inplace", 100.0 if op == "Transpose" else 10.0),)
       for op in _UNARY_INPLACE + _VIEWS},
    "Pad": (("PadInplace", 1.0),),
    **{op: ((f"{op}LhsInplace", 10.0), (f"{op}RhsInplace", 10.0)) for op in ("Add", "Mul")}}


def _inplace_pattern(ops: list, infos: dict, frozen: set) -> None:
    """Apply PopART's Inplace pattern to a graph's ``ops`` (serialized, in PopART's op id
    order: forward, then backward), in place. Candidates are taken in decreasing priority,
    ties by the higher op id (applyInplacePattern's sort). A candidate is refused when
    (Op::inputUnmodifiableFor, Tensor::isUnmodifiable) it would modify a tensor whose alias
    set holds a ``frozen`` one (a weight, constant or optimizer tensor: one no op here
    produces and no graph input; an anchor; a graph output; a restored-inplace tensor), or
    when (poprithms' alias model) another reader of that alias set runs after it: one that
    depends on its output, directly or through the order earlier inplacings imposed; else
    the other readers are ordered before it. A view variant joins its output to its input's
    alias set; its readers then must also come before the set's modifiers."""
    readers: dict = {}
    for k, op in enumerate(ops):
        for t in op["inputs"]:
            readers.setdefault(t["name"], set()).add(k)
    after: dict = {k: set() for k in range(len(ops))}   # k -> ops ordered after it (data, topo)
    for k, op in enumerate(ops):
        for t in op["outputs"]:
            after[k] |= readers.get(t["name"], set())
    group: dict = {}                                    # tensor -> its alias set (shared)
    modifiers: dict = {}                                # id(alias set) -> modifying op ids

    def aliases(t: str) -> set:
        return group.setdefault(t, {t})

    def reach(k: int) -> set:
        seen, todo = set(), [k]
        while todo:
            for j in after[todo.pop()] - seen:
                seen.add(j)
                todo.append(j)
        return seen

    def size(t: str) -> Optional[int]:
        info = infos.get(t)
        return None if info is None else info.nelms()

    candidates = []
    for k, op in enumerate(ops):
        for i, (variant, priority) in enumerate(_INPLACE_VARIANTS.get(op["type"], ())):
            ins = [t["name"] for t in op["inputs"]]
            if len(_INPLACE_VARIANTS[op["type"]]) == 2:   # Lhs / Rhs by size
                if len(ins) < 2 or size(ins[i]) is None or size(ins[i]) != size(op["outputs"][0]["name"]):
                    continue
                aliased = [ins[i]]
            else:
                aliased = ins if op["type"] == "Concat" else ins[:1]
            candidates.append((-priority, -k, i, k, variant, aliased))
    done: set = set()
    for _, _, _, k, variant, aliased in sorted(candidates):
        if k in done or not aliased or not ops[k]["outputs"]:
            continue
        out = ops[k]["outputs"][0]["name"]
        view = ops[k]["type"] in _VIEWS
        sets, viewed = [aliases(t) for t in aliased], aliases(out)
        members = set().union(*sets)
        mods_in = {m for a in sets for m in modifiers.get(id(a), ()) if k not in reach(m)}
        mods_out = modifiers.get(id(viewed), set())
        in_readers = {j for t in members for j in readers.get(t, ()) if j != k}
        out_readers = {j for t in viewed for j in readers.get(t, ())}
        if view:   # then readers of each side must come before the other side's modifiers
            if members & frozen and mods_out:   # an unmodifiable input modified through it
                continue
            order = [(j, m) for m in mods_in for j in out_readers] + \
                    [(j, m) for m in mods_out for j in in_readers]
        else:      # it modifies its input: every other reader of it must come first
            if members & frozen:
                continue
            order = [(j, k) for j in in_readers]
        if any(j in reach(m) for j, m in order):
            continue
        for j, m in order:
            after[j].add(m)
        merged = members | viewed
        mods = set().union(*(modifiers.pop(id(a), set()) for a in sets + [viewed]))
        for t in merged:
            group[t] = merged
        modifiers[id(merged)] = mods | (set() if view else {k})
        ops[k]["type"] = variant
        done.add(k)


def _frozen(ops: list, g: Graph, anchors: set) -> set:
    """The tensors no inplace op may modify (Tensor::isUnmodifiable, and Ir::
    applyInplacePattern's recomputation check): the anchors, a subgraph's outputs, tensors a
    RestoreInplace reads, implicit recomputation's tensors and checkpoints, and those no op
    produces that are not streamed in (weights and constants: Variable / Const; optimizer
    and loss-scaling tensors)."""
    made = {t["name"]: op for op in ops for t in op["outputs"]}
    read = {t["name"] for op in ops for t in op["inputs"]}
    restored = {t["name"] for op in ops if op["type"] == "RestoreInplace" for t in op["inputs"]}
    # implicit recomputation: what Recompute ops make (isImplicitRecomputeTensor) and what
    # they read from elsewhere (isCheckpointTensor)
    again = [op for op in ops if op["attributes"].get("recompute") == "YES"]
    recomputed = {t["name"] for op in again for t in op["outputs"]} | {
        t["name"] for op in again for t in op["inputs"]
        if made.get(t["name"], {"attributes": {}})["attributes"].get("recompute") != "YES"}
    return set(anchors) | set(g.outputs if g.parent is not None else ()) | restored | \
        recomputed | (read - set(made) - (set(g.inputs) - set(g.initializers)))


def _opt_to_identity(n: Any, infos: dict, patterns: Any) -> bool:
    """PopART's OpToIdentity pattern (on by default): ``IdentityLossOp::
    canBeReplacedByIdentity``, an IdentityLoss with reduction None or of a scalar."""
    if n.op_type != "IdentityLoss" or n.domain != "ai.graphcore" or patterns is None or \
            not patterns.isPatternEnabled("OpToIdentity"):
        return False
    info = infos.get(n.inputs[0])
    return n.attrs.get("reduction", "Mean") == "None" or (info is not None and info.rank() == 0)


def _node_op(n: Any, attrs: dict, infos: dict, inplace: Optional[str] = None,
             inputs: Optional[list] = None, identity: bool = False) -> dict:
    """A graph node as its op, after PopART's LikeOpsPattern, (``inplace``) Inplace and
    (``identity``) OpToIdentity: ``Identity`` named ``<name>:OpToIdentity``
    (``Pattern::getReplacementOpName``), only the node's placement and debug id kept
    (``makeReplacementOp``). ``inputs``: the tensors it reads, when the IR renamed them."""
    name, inputs = n.name or n.outputs[0], list(n.inputs) if inputs is None else inputs
    if identity:
        kept = {k: v for k, v in attrs.items() if k not in n.attrs}
        return _op("Identity", f"{n.name}:OpToIdentity" if n.name else "", inputs, n.outputs,
                   kept, infos)
    if inplace:
        return _op(inplace, name, inputs, n.outputs, attrs, infos)
    if n.op_type not in _FOLDED_LIKE or n.domain not in ("", "ai.onnx") or n.inputs[0] not in infos:
        return _op(n.op_type, name, inputs, n.outputs, attrs, infos)
    info = infos[n.inputs[0]]
    op_type, pattern = _FOLDED_LIKE[n.op_type]
    shape = shape_text(info.shape())
    return _op(op_type, f"{name}_{pattern}", [], n.outputs,
               {**attrs, "shape": shape, "dtype": attrs.get("dtype", info.data_type())}, infos)


def _graphs(graph: Graph) -> list[Graph]:
    """``graph`` and every subgraph its nodes hold (If / Loop / Scan bodies, callees)."""
    out, todo = [], [graph]
    while todo:
        g = todo.pop(0)
        out.append(g)
        for n in g.nodes:
            for v in n.attrs.values():
                todo += [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, Graph)]
    return out


def serialize_ir(graph: Graph, infos: dict, main_name: str, training: Optional[dict] = None,
                 inplace_keep: Optional[set] = None, patterns: Any = None,
                 anchors: Optional[set] = None, options: Any = None,
                 program: Any = None) -> str:
    """The IR as PopART's JSON. ``infos``: TensorInfo by id; ``training``: {"loss", "trainable",
    "optimizer"} for a TrainingSession; ``inplace_keep``: an inference session's anchors when
    its InPlace pattern is on (``_inplace_pattern``; a TrainingSession's come from
    ``patterns``: the session's Patterns, ``anchors``); ``options`` / ``program``: an
    InferenceSession's SessionOptions and step program (its Auto virtual graphs);
    ``anchors``: its anchored tensors."""
    doc, infos = {}, dict(infos)
    inplace = inplace_keep   # the InPlace pattern's anchors (a TrainingSession: from patterns)
    if inplace is None and training is not None and patterns is not None and \
            patterns.isInPlaceEnabled():
        inplace = set(anchors or ())
    plan = _plan(training)
    stages = _stages(plan, training)
    marks = _marks(graph, infos, training) if training is not None and not stages else {}
    vgs = None if stages else _virtual_graphs(graph, training or {"options": options,
                                                                  "program": program})
    for g in _graphs(graph):
        main = g is graph
        ops, read = _forward(g, infos, stages if main else {}, plan if main else None,
                             marks if main else {}, patterns,
                             set(anchors or ()) | (set() if main else set(g.outputs)),
                             training, vgs if main else None)
        if main and training is not None:
            ops += _backward(g, infos, training, stages, read, marks, patterns, vgs)
        if main and inplace is not None:
            _inplace_pattern(ops, infos, _frozen(ops, g, inplace))
        doc["maingraph" if main else g.name] = ops
    if main_name != "maingraph":
        doc = {(main_name if k == "maingraph" else k): v for k, v in doc.items()}
    return json.dumps(doc)


def _forward(g: Graph, infos: dict, stages: dict, plan: Any, marks: dict,
             patterns: Any, keep: set,
             training: Optional[dict], shard: Optional[dict] = None) -> tuple[list, Any]:
    """Graph ``g``'s ops as PopART's patterns and transforms leave them, and ``read(t, ipu)``:
    the id an op on IPU ``ipu`` reads for tensor ``t``. OpToIdentity's Identity is removed
    by PostNRepl in an inference session when its output is not in ``keep`` (the anchors,
    a subgraph's outputs: its readers read its input); in a pipeline, each stage
    boundary's ``IpuCopy`` ops (``_ipu_copies``) come before the first op of the next
    stage; in a sharded program (``shard``: ``_shard_sources``), an op's copies come
    before it."""
    ops: list = []
    alias: dict = {}                 # tensor -> what PostNRepl has its readers read
    moved: dict = {}                 # (tensor, IPU) -> its copy there (IpuCopy)
    graph = copied(plan) if stages else None   # the stages after InterIpuCopy
    origin = graph.source if graph is not None else {}
    explicit = training is not None and getattr(training.get("options"),
                                                "explicitRecomputation", False)

    def read(t: str, ipu: Optional[int] = None) -> str:
        return moved.get((alias.get(t, t), ipu), alias.get(t, t)) if t else t

    sources = _shard_sources(g, shard) if shard is not None else {}

    done = 0
    for n in g.nodes:
        s, ipu, _ = stages.get(id(n), (None, None, False))
        while s is not None and done < s:    # the copies of the boundaries before stage s
            ops += _ipu_copies(graph.copies[done + 1], done, infos, moved, origin)
            done += 1
        if shard is not None:
            ipu = shard[id(n)]
            sent = [t for t in dict.fromkeys(n.inputs)
                    if t in sources and sources[t] != ipu and (read(t), ipu) not in moved]
            ops += _ipu_copies([ipu_copy_node(read(t), sources[t], ipu) for t in sent], None,
                               infos, moved, {})
        identity = _opt_to_identity(n, infos, patterns)
        if (identity and training is None and patterns.isPatternEnabled("PostNRepl")
                and not keep.intersection(n.outputs)):
            alias[n.outputs[0]] = read(n.inputs[0])
            continue
        attrs = {**n.attrs, **_placement(n, stages.get(id(n)))}
        if shard is not None:   # AutoVirtualGraph's ids, or the Builder's
            attrs[VIRTUAL_GRAPH] = shard[id(n)]
        if marks:   # autoRecomputation: Recompute ops say YES, unless made explicit (clones)
            attrs["recompute"] = YES_NO[marks.get(id(n)) == RECOMPUTE and not explicit]
        ops.append(_node_op(n, attrs, infos, None, [read(t, ipu) for t in n.inputs], identity))
    return ops, read


def _virtual_graphs(g: Graph, training: Optional[dict]) -> Optional[dict]:
    """id(node) -> IPU of a sharded (virtual graphs, no pipeline) main graph: the Builder's
    ids (Manual), or AutoVirtualGraph's (``engine.pipeline.auto_virtual_graphs`` on the
    program's tensor sizes, as the engine places it). None when the mode is Off (training)
    or no op has an id (``InterIpuCopy::apply`` looks at the first)."""
    options, program = (training or {}).get("options"), (training or {}).get("program")
    mode = getattr(getattr(options, "virtualGraphMode", None), "name", "")
    if not g.nodes or mode == "Off":
        return None
    if mode == "Auto" and program is not None:
        from .engine.pipeline import auto_virtual_graphs, ipus_per_replica
        n = ipus_per_replica(program.device_info, program.cfg.replication_factor)
        if n < 2:
            return None
        sizes = {k: int(np.prod(v.shape)) for k, v in program.tensor_specs.items()}
        stand_ins = [SimpleNamespace(inputs=nd.inputs, outputs=nd.outputs, annotations={})
                     for nd in g.nodes]   # the session's own nodes keep their annotations
        return {id(nd): v for nd, v in zip(g.nodes, auto_virtual_graphs(
            SimpleNamespace(nodes=stand_ins), n, sizes))}
    ids = [nd.annotations.get(VIRTUAL_GRAPH) for nd in g.nodes]
    if ids[0] is None or any(i is None for i in ids):
        return None
    return {id(nd): int(i) for nd, i in zip(g.nodes, ids)}


def _shard_sources(g: Graph, vgs: dict) -> dict:
    """The IPU each tensor of a sharded main graph is copied from (transforms/
    interipucopy.cpp): its producer's; for a graph input, weight or constant, the lowest
    IPU reading it (the stream's "first ipu")."""
    made = {t: vgs[id(n)] for n in g.nodes for t in n.outputs if t}
    out: dict = {}
    for n in g.nodes:
        for t in n.inputs:
            if t and t not in made:
                out[t] = min(out.get(t, vgs[id(n)]), vgs[id(n)])
    return {**out, **made}


def _ipu_copies(nodes: list, stage: Optional[int], infos: dict, moved: dict,
                origin: Mapping[str, str]) -> list:
    """IpuCopy nodes of the graph (the ones before a pipeline stage, ``placed.copied``;
    ``stage`` None: a sharded program's) as PopART's InterIpuCopy writes them: no name, the
    node's ids (the copy of ``t`` is ``<t>_c<destIpu>``, ``generateCopiedTensorId``), in
    the pipeline stage of its producer, with ``__sourceIpus`` / ``__destIpu``
    (``IpuCopyOp::appendOutlineAttributes``). ``moved``: (tensor, IPU) -> its copy there
    (``origin``: a copy's id -> its tensor), updated."""
    out = []
    for node in nodes:
        (source,), (copy,), src, dst = node.inputs, node.outputs, node.attrs["sourceIpu"], node.attrs["destIpu"]
        t = origin.get(source, source)
        infos[copy], moved[(t, dst)] = infos.get(t), copy
        out.append(_ipu_copy_op(source, copy, src, dst, stage, infos))
    return out


def _ipu_copy_op(source: str, copied: str, src: int, dst: int, stage: Optional[int],
                 infos: dict) -> dict:
    """The IpuCopy of ``source`` from IPU ``src`` to ``dst`` as ``copied`` (unnamed, in
    pipeline ``stage`` unless None, with ``IpuCopyOp::appendOutlineAttributes``'s IPUs)."""
    return _op("IpuCopy", "", [source], [copied],
               {"recompute": "NO", **({} if stage is None else {PIPELINE_STAGE: stage}),
                "__sourceIpus": f"{{{src}}}", "__destIpu": dst}, infos)


def _marks(g: Graph, infos: dict, training: dict) -> dict:
    """id(node) -> CHECKPOINT / RECOMPUTE of a TrainingSession's forward ops
    (``_ir.recompute.annotate``, the marks the program recomputes by), when
    ``autoRecomputation`` or ``explicitRecomputation`` asks for them."""
    options = training.get("options")
    method = _recompute.method_name(getattr(options, "autoRecomputation", None))
    if method == "NoRecompute" and not getattr(options, "explicitRecomputation", False):
        return {}
    nbytes = {t: int(np.prod(i.shape())) * np.dtype(i.np_dtype()).itemsize
              for t, i in infos.items() if i is not None}
    return _recompute.annotate(g, training["loss"], method, nbytes)


def _placement(n: Any, stage: Optional[tuple]) -> dict:
    """The attributes every PopART op serialises (``Op::appendOutlineAttributes`` /
    ``appendAttributes``): ``recompute`` (YES / NO) and, where set, ``__ipu_number`` and
    ``__pipeline_stage`` (the pipeline's stage and IPU when PopART derives them); the node's
    other annotations by their names."""
    out = {k: v for k, v in n.annotations.items() if k != RECOMPUTE_OUTPUT}
    recompute = n.annotations.get(RECOMPUTE_OUTPUT) == RECOMPUTE
    if stage is not None:
        ps, ipu, recomputed = stage
        out.setdefault(PIPELINE_STAGE, ps)
        out.setdefault(VIRTUAL_GRAPH, ipu)
        recompute = recompute or recomputed
    return {"recompute": YES_NO[recompute], **out}


def _plan(training: Optional[dict]) -> Any:
    """The stage plan (``engine.pipeline.StagePlan``) of a pipelined TrainingSession whose
    program places the graph over several IPUs, or None."""
    program, options = (training or {}).get("program"), (training or {}).get("options")
    if program is None or not getattr(options, "enablePipelining", False):
        return None
    plan = program.placed.stages if program.placed is not None else None
    if plan is None:   # not placed on this machine's devices: the same stages, unplaced
        from .engine.pipeline import popart_stages
        ipus = int(getattr(getattr(program, "device_info", None), "numIpus", 1) or 1)
        sizes = {k: int(np.prod(v.shape)) for k, v in program.tensor_specs.items()}
        plan = popart_stages(program.graph_consts, program.variables, program.cfg.config,
                             max(ipus // program.cfg.replication_factor, 1), sizes)
    return plan if plan.pipelined and plan.num_stages >= 2 else None


def _stages(plan: Any, training: Optional[dict]) -> dict:
    """id(node) -> (pipeline stage, IPU, recomputed) for ``plan``'s nodes; the forward ops
    of every stage but the last are recomputed with ``RecomputationType.Pipeline``."""
    if plan is None:
        return {}
    auto = getattr(getattr(training["options"], "autoRecomputation", None), "name",
                   "") == "Pipeline"
    last = plan.num_stages - 1
    return {id(n): (s, plan.stage_ipu[s], auto and s < last)
            for s, nodes in enumerate(plan.nodes) for n in nodes}


# The forward tensors a grad op reads (its ``gradInputInfo``, GradOpInType In / Out): the
# forward op's outputs (relu.cpp:77-78, sigmoid.cpp, tanh.cpp, exp.cpp, softmax.cpp,
# sqrt.cpp, leakyrelu.cpp), none (add.cpp:76, scale.cpp:94, reshape.cpp:237,
# transpose.cpp:195, concat.cpp:304, slice.cpp:492, expand.cpp:204, identity.cpp:72,146: the
# gradient only), else its inputs.
_GRAD_READS_OUTPUTS = {"Relu", "Sigmoid", "Tanh", "Exp", "Softmax", "Sqrt", "LeakyRelu"}
_GRAD_READS_NOTHING = {"Add", "Sub", "Neg", "Scale", "Reshape", "Transpose", "Concat", "Slice",
                       "Expand", "Identity", "IdentityLoss", "Squeeze", "Unsqueeze", "Flatten"}


def _grad_reads(n: Any) -> list[str]:
    """What forward tensors the grad op of node ``n`` reads (besides gradients)."""
    if n.op_type in _GRAD_READS_NOTHING:
        return []
    return [t for t in (n.outputs if n.op_type in _GRAD_READS_OUTPUTS else n.inputs) if t]


class _Ids:
    """PopART's ``Ir::createIntermediateTensorId``: ``<base>__t<counter>``."""

    def __init__(self) -> None:
        self.k = 0

    def __call__(self, base: str) -> str:
        self.k += 1
        return f"{base}__t{self.k - 1}"


def _backward(g: Graph, infos: dict, training: dict, stages: dict, read: Any, marks: dict,
              patterns: Any, vgs: Optional[dict] = None) -> list[dict]:
    """What PopART's backward pass and optimizer transforms add to the main graph: grad ops
    (reverse order, where ``ir.transforms.gradient_flow`` has a gradient flow, reading what
    ``read`` names), explicit recomputation's clones, pipeline stashes and restores, gradient
    clipping, automatic loss scaling's statistics and update, and the var updates (SGD1's
    accumulator ops with their PopART tensor names). Intermediate ids are numbered in
    PopART's transform order: the optimizer's decomposition, the clones, the clipping. A
    grad op runs on its forward op's IPU (``stages``, or ``vgs`` when sharded); a gradient
    made on another IPU is copied to it first (InterIpuCopy after autodiff)."""
    def is_float(t: str) -> bool:
        info = infos.get(t)
        return info is not None and np.issubdtype(info.np_dtype(), np.floating)

    has_grad, edges = gradient_flow(g, training["loss"], training["trainable"], is_float)
    last = max((s for s, _, _ in stages.values()), default=0)
    trained = [w for w in training["trainable"] if w in has_grad]
    accumulating = getattr(getattr(training.get("program"), "cfg", None),
                           "accumulation_factor", 1) > 1
    new_id = _Ids()
    for w in trained:   # only to count the decomposition's ids (SGD2Decompose runs first)
        _var_update(training["optimizer"], w, GRAD + w, dict(infos), new_id, accumulating)
    grad_nodes = [(k, n) for k, n in reversed(list(enumerate(g.nodes)))
                  if any((k, i) in edges for i in range(len(n.inputs)))]
    explicit = getattr(training.get("options"), "explicitRecomputation", False)
    clones = _recompute_clones(g, [n for _, n in grad_nodes], marks, infos, new_id, read) \
        if explicit and marks else {}
    recomputed = {t: c["outputs"][i]["name"] for c in clones.values()
                  for i, t in enumerate(o for o in c["_node"].outputs if o)}

    # id(node) -> (its grad op's pipeline stage: maxPipelineStage - its forward stage, IPU)
    where = {k: (2 * last - s, ipu) for k, (s, ipu, _) in stages.items()} or \
        {k: (None, ipu) for k, ipu in (vgs or {}).items()}

    def place(at: Optional[tuple]) -> dict:   # (grad stage or None, IPU) as attributes
        if at is None:
            return {}
        s, ipu = at
        return {"recompute": "NO", VIRTUAL_GRAPH: ipu, **({} if s is None else {PIPELINE_STAGE: s})}

    stash = _stash_ops(g, edges, stages, training, infos)
    ops, copied = stash["stash"], {}
    parts: dict = {}   # tensor -> its partial gradients, in the grad ops' order
    for k, n in grad_nodes:
        for i, t in enumerate(n.inputs):
            if (k, i) in edges:
                parts.setdefault(t, []).append(_edge_grad(k, i))
    parts = {t: p for t, p in parts.items() if len(p) > 1}
    infos.update({e: infos.get(t) for t, p in parts.items() for e in p})
    left = {t: set(p) for t, p in parts.items()}   # the partials not yet made
    made_at: dict = {}   # gradient -> where it was made: (grad stage or None, IPU) or None
    for k, n in grad_nodes:
        ins = [t for i, t in enumerate(n.inputs) if (k, i) in edges]
        made = [_edge_grad(k, i) if t in parts else GRAD + t
                for i, t in enumerate(n.inputs) if (k, i) in edges]
        s, _, _ = stages.get(id(n), (None, None, False))
        at = where.get(id(n))
        ipu = at[1] if at else None
        restored = {t: op for t, (st, k, op) in stash["restore"].items()
                    if st == s and (t in _grad_reads(n) or k == id(n))}
        ops += [stash["restore"].pop(t)[2] for t in restored]
        ops += _take_clones(clones, n.inputs)
        outs = [o for o in n.outputs if o in has_grad]
        ops += [c for o in outs
                for c in _grad_copy(GRAD + o, at, made_at.get(GRAD + o), copied, infos,
                                    infos.get(o))]
        kind = "Identity" if _opt_to_identity(n, infos, patterns) else n.op_type
        reads = [restored[i]["outputs"][0]["name"] if i in restored else
                 recomputed.get(i, read(i, ipu)) for i in _grad_reads(n)]
        ops.append(_op(f"{kind}Grad", f"{n.name or n.outputs[0]}_Grad",
                       [copied.get((GRAD + o, ipu), GRAD + o) for o in outs] + reads,
                       made, {"recompute": "NO", **place(at)}, infos))
        made_at.update(dict.fromkeys(made, at))
        for t in dict.fromkeys(ins):   # a gradient whose last partial this op made: its sum
            if t in left:
                left[t] -= set(made)
                if not left[t]:
                    ops += _grad_sum(t, parts[t], infos, patterns, made_at, copied, place)
    grads = {w: GRAD + w for w in trained}
    ops += _clipping(training["optimizer"], trained, grads, infos, new_id)
    ops += _als_ops(training.get("program"), infos, training.get("options"))
    decomposed = _Ids()
    # a sharded program's var updates (Ir::growVarUpdateOpInternal, inheritPlacementAttributes:
    # an op modifying a Variable takes the lowest IPU of the Variable's other consumers,
    # opattributehelper.cpp getRequiredVirtualGraphId), the gradient copied there if made
    # elsewhere
    home = _shard_sources(g, vgs) if vgs and not stages else {}
    for w in trained:
        at = (None, home[w]) if w in home else None
        ops += _grad_copy(grads[w], at, made_at.get(grads[w]), copied, infos, infos.get(w))
        grad = copied.get((grads[w], home.get(w)), grads[w])
        ops += _var_update(training["optimizer"], w, grad, infos, decomposed, accumulating,
                           place(at))
    return ops


def _edge_grad(k: int, i: int) -> str:
    """The partial gradient a grad op makes for input ``i`` of the main graph's ``k``-th op,
    when that input has several consumers (``getEdgeGradId``, tensornames.cpp:57-62:
    ``Gradient___<opId>_<index>``, gradgrowerop.cpp:199-204). PopART's op id is its Ir's op
    counter, which starts at 100 (ir.hpp:734) and gives the forward ops their ids in node
    order (Graph::constructFromOnnxGraph); we write ``100 + k``, PopART's id unless a Constant
    node took an id or a pattern replaced the op (a fresh id) before autodiff."""
    return f"{GRAD}{100 + k}_{i}"


def _grad_sum(t: str, parts: list, infos: dict, patterns: Any, made_at: dict, copied: dict,
              place: Any) -> list:
    """The sum of tensor ``t``'s partial gradients into ``Gradient___<t>`` (autodiff's
    ``GradGrowerSumOp::growGradSumOp``, gradgrowersumop.cpp:82-87: a Sum named
    ``GradSum_Gradient___<t>``), preceded by the IpuCopy of each partial made on another IPU.
    With two partials and SumToAdd on (sumtoaddpattern.cpp:18-42) it is an Add,
    ``<name>:SumToAdd`` (``Pattern::getReplacementOpName``, pattern.cpp:105-118), which the
    Inplace pattern may then make ``AddLhsInplace``. A single partial gets no sum here: PopART
    grows one and PostNRepl (postnrepl.cpp:21-50, 60-101) removes it with its output, so its
    readers read the partial ``Gradient___<opId>_<index>`` unless ``Gradient___<t>`` is
    anchored; we keep writing ``Gradient___<t>`` there (the name the rest of the package, ALS
    and anchors use). Placement (``inheritPlacementAttributes``, opattributehelper.cpp: the
    nearest producers first, the highest pipeline stage, then the highest IPU among them):
    the latest of the partials' grad ops; ``made_at`` (gradient -> where it was made) and
    ``copied`` are updated, ``place`` writes a placement as attributes."""
    name, infos[GRAD + t] = f"GradSum_{GRAD}{t}", infos.get(t)
    wheres = [made_at[p] for p in parts]
    at = None if None in wheres else max(wheres, key=lambda w: (w[0] or 0, w[1]))
    ops = [c for p in parts for c in _grad_copy(p, at, made_at[p], copied, infos, infos.get(t))]
    ins = [copied.get((p, at[1]), p) if at else p for p in parts]
    made_at[GRAD + t] = at
    to_add = len(parts) == 2 and (patterns is None or patterns.isPatternEnabled("SumToAdd"))
    return ops + [_op("Add" if to_add else "Sum", f"{name}:SumToAdd" if to_add else name, ins,
                      [GRAD + t], {"recompute": "NO", **place(at)}, infos)]


def _grad_copy(grad: str, at: Optional[tuple], source: Optional[tuple], copied: dict,
               infos: dict, info: Optional[TensorInfo]) -> list:
    """The IpuCopy of gradient ``grad``, made at ``source``, to the IPU of ``at`` (each a
    (grad stage or None, IPU), or None unplaced) when they differ (InterIpuCopy after the
    backward pass): ``<grad>_c<ipu>``, in the pipeline stage where it was made. ``copied``:
    (gradient, IPU) -> its copy, and ``infos`` (the copy's: ``info``) are updated."""
    if at is None or source is None or source[1] == at[1] or (grad, at[1]) in copied:
        return []
    (s, src), ipu = source, at[1]
    copy = copied[(grad, ipu)] = copied_id(grad, ipu)
    infos[copy] = info
    return [_ipu_copy_op(grad, copy, src, ipu, s, infos)]


def _recompute_clones(g: Graph, grad_nodes: list, marks: dict, infos: dict, new_id: "_Ids",
                      read: Any) -> dict:
    """ExplicitRecompute (``explicitRecomputation``, no pipeline): each Recompute op whose
    outputs a backward op reads (a grad op or another clone) is cloned, last op first, into
    the backward pass: same type, name and attributes, outputs ``<t>__re__t<n>``
    (``createRecomputedTensorId``, then ``createIntermediateTensorId``), inputs the
    recomputed tensors where there are; the original and the clone both serialise
    ``recompute`` NO (Checkpoint / Recomputed). id(node) -> the clone op (``_node``: its
    node), in forward order."""
    wanted = {t for n in grad_nodes for t in _grad_reads(n)}
    picked = []
    for n in reversed(g.nodes):
        if marks.get(id(n)) == RECOMPUTE and wanted.intersection(n.outputs):
            picked.append(n)
            wanted |= {t for t in n.inputs if t}
    new = {o: new_id(f"{o}__re") for n in picked for o in n.outputs if o}
    infos.update({new[o]: infos.get(o) for o in new})
    out = {}
    for n in reversed(picked):
        op = _op(n.op_type, n.name or n.outputs[0],
                 [new.get(t) or read(t) for t in n.inputs], [new.get(o, o) for o in n.outputs],
                 {**n.attrs, **_placement(n, None), "recompute": "NO"}, infos)
        out[id(n)] = {**op, "_node": n}
    return out


def _take_clones(clones: dict, inputs: list) -> list:
    """The not yet scheduled clones a backward op reading ``inputs`` needs (and those they
    need), in forward order, removed from ``clones``."""
    made = {o: k for k, c in clones.items() for o in c["_node"].outputs if o}
    need, todo = set(), [made[t] for t in inputs if t in made]
    while todo:
        k = todo.pop()
        if k not in need:
            need.add(k)
            todo += [made[t] for t in clones[k]["_node"].inputs if t in made]
    return [{key: v for key, v in clones.pop(k).items() if key != "_node"}
            for k in list(clones) if k in need]


def _stash_ops(g: Graph, edges: set, stages: dict, training: dict, infos: dict) -> dict:
    """Implicit pipelining's Stash / Restore ops (``Pipeline::addStashRestoreOps``): each
    activation a backward stage reads that its forward stage s (not the last) made or took
    in is stashed in stage s (``Stashed___<t>``, stash size 2 (S-1) - 2 s + 1) and restored
    before the first grad op that reads it, which reads ``Restored___<t>`` as every grad op
    of stage s does (``RestoreInplace`` unless anchored or sent to a later stage; ``restore``:
    t -> (s, id(the forward op whose grad op reads it at the latest), the op)). With
    ``RecomputationType.Pipeline`` only each stage's inputs are stashed (the rest is
    recomputed)."""
    out: dict = {"stash": [], "restore": {}}
    if not stages:
        return out
    last = max(s for s, _, _ in stages.values())
    recompute = any(r for _, _, r in stages.values())
    weights = set(g.initializers)
    made = {t: stages[id(n)][0] for n in g.nodes for t in n.outputs if t and id(n) in stages}
    later = {t for n in g.nodes if id(n) in stages for t in n.inputs
             if t in made and made[t] < stages[id(n)][0]}
    anchors = set(getattr(training.get("program"), "anchor_ids", ()) or ())
    seen: set = set()
    for k, n in enumerate(g.nodes):
        s, ipu, _ = stages.get(id(n), (last, 0, False))
        if s == last or not any((k, i) in edges for i in range(len(n.inputs))):
            continue
        acts = [t for t in n.inputs if t and made.get(t, -1) < s] if recompute else \
            _grad_reads(n)
        for t in acts:
            if t in weights or t in seen or t not in infos:
                continue
            seen.add(t)
            size, info = 2 * last - 2 * s + 1, infos[t]
            stashed, restored = PREFIXES["Stashed"] + t, PREFIXES["Restored"] + t
            infos[stashed] = TensorInfo(info.data_type(), [size] + list(info.shape()))
            infos[restored] = info
            attrs = {"stashSize": size, "recompute": "NO", VIRTUAL_GRAPH: ipu}
            out["stash"].append(_op("Stash", f"Stash_{t}", [t], [stashed],
                                    {**attrs, PIPELINE_STAGE: s}, infos))
            inplace = t not in anchors and t not in later
            out["restore"][t] = (s, id(n), _op(
                "RestoreInplace" if inplace else "Restore", f"Restore_{t}",
                [stashed, t] if inplace else [stashed], [restored],
                {**attrs, PIPELINE_STAGE: 2 * last - s}, infos))
    return out


def _clipping(optimizer: Any, trained: list, grads: dict, infos: dict, new_id: _Ids) -> list:
    """``ClipWeightGradientsByNorm`` per ClipNormSettings group i: ReduceSumSquare of each
    clipped gradient, Sum, Sqrt (``GlobalNorm___<i>``), Max with the clip norm, Div, and a Mul
    per gradient; the var updates read the clipped gradients (``grads`` is updated)."""
    ops = []
    for i, c in enumerate(getattr(optimizer, "clip_norm_settings", ())):
        ids = [w for w in (trained if c.weightIds is None else c.weightIds) if w in grads]
        if not ids:
            continue
        norms = []
        for w in ids:
            norms.append(new_id(f"{w}_clipping"))
            infos[norms[-1]] = TensorInfo(infos[w].data_type(), []) if w in infos else None
            ops.append(_op("ReduceSumSquare", f"ReduceSumSquare_{w}", [grads[w]], [norms[-1]],
                           {"keepdims": 0}, infos))
        total, norm = new_id("normsSum"), f"{PREFIXES['GlobalNorm']}{i}"
        clip, big, factor = new_id("clipByNorm"), new_id("clipByNorm"), new_id("clipByNorm")
        ops += [_op("Sum", f"Sum_norms{i}", norms, [total], {}, infos),
                _op("Sqrt", f"Sqrt_norms{i}", [total], [norm], {}, infos),
                _op("Max", f"Max_norms{i}", [norm, clip], [big], {}, infos),
                _op("Div", f"Div_norms{i}", [clip, big], [factor], {}, infos)]
        for w in ids:
            clipped = new_id(f"{w}_clipped")
            infos[clipped] = infos.get(w)
            ops.append(_op("Mul", f"Mul_{w}_clip", [grads[w], factor], [clipped], {}, infos))
            grads[w] = clipped
    return ops


def _als_ops(program: Any, infos: dict, o: Any) -> list:
    """Automatic loss scaling (``AutomaticLossScale``): a Histogram per tracked gradient
    (``Gradient___<t>_statistics``), their Sum (``summedHistograms``), the Cast to float
    (``summedCastedHistograms``), the LossScaleUpdate and ``finalLossScale``'s Mul."""
    als = getattr(program, "als", None)
    if als is None:
        return []
    stats = [GRAD + t + "_statistics" for t in als.tracked]
    f32 = lambda *shape: TensorInfo("FLOAT", list(shape))   # noqa: E731
    infos.update({h: TensorInfo("UINT32", [2]) for h in stats + ["summedHistograms"]})
    infos.update({"summedCastedHistograms": f32(2), "lossScaleUpdateFactor": f32(),
                  "finalLossScale": f32(), als.loss_scaling_id: f32()})
    # SessionOptions::shouldDelayVarUpdates, consumers early
    early = (o.delayVarUpdates and o.executionPhaseSettings.phases < 2 and
             o.batchSerializationSettings.factor < 2 and not o.explicitRecomputation and
             not o.enableExplicitMainLoops and o.scheduleNonWeightUpdateGradientConsumersEarly)
    ops = [_op("Histogram", f"Histogram_{t}", [GRAD + t], [h],
               {"levels": [float(als.level)], "absoluteOfInput": 1}, infos,
               priority=np.inf if early else 0.0)
           for t, h in zip(als.tracked, stats)]
    ops += [_op("Sum", "HistogramSum", stats, ["summedHistograms"], {}, infos),
            _op("Cast", "HistogramCast", ["summedHistograms"], ["summedCastedHistograms"],
                {"to": "FLOAT"}, infos),
            _op("LossScaleUpdate", "LossScaleUpdate",
                ["lossScaleUpdateFactor", "summedCastedHistograms"],
                ["UpdatedVar___lossScaleUpdateFactor"], {}, infos),
            _op("Mul", "finalLossScale", [als.loss_scaling_id, "lossScaleUpdateFactor"],
                ["finalLossScale"], {}, infos)]
    return ops


def _var_update(optimizer: Any, w: str, grad: str, infos: dict, new_id: _Ids,
                accumulating: bool, attrs: Optional[dict] = None) -> list:
    """The var update of weight ``w``; SGD1 (``SGD1Decompose``) is Accumulate into
    ``Accl___<w>`` (giving ``AcclIntoUpdate___<w>``), SGD1VarUpdate, then SGD1AcclUpdate
    (giving ``AcclOutOfAcclUpdate___<w>``); SGD2 (``SGD2Decompose``) is
    SGD2PartialAcclUpdate and Accumulate of ``Accl1___<w>``, then SGD2VarUpdate (when
    gradients accumulate: first Accumulate into ``Accum___<w>``, zeroed after). ``attrs``:
    their placement (OptimizerDecompose's ops take the combo op's, transferBaseProperties)."""
    attrs = attrs or {}
    update = optimizer.var_update_type(w)
    if update == "SGD2VarUpdate":
        return _sgd2_update(w, grad, infos, new_id, accumulating, attrs)
    if update != "SGD1VarUpdate":
        return [_op(update, f"{update}_{w}", [w, grad], ["UpdatedVar___" + w], attrs, infos)]
    accl, to_update, final = (PREFIXES[p] + w for p in ("Accl", "AcclToUpdate", "AcclFinalOut"))
    infos.update({t: infos.get(w) for t in (accl, to_update, final)})
    return [_op("Accumulate", f"{w}_accumulate", [accl, grad], [to_update],
                {"type": "DampenedAdd", **attrs}, infos),
            _op("SGD1VarUpdate", f"{w}_var_update", [w, to_update], ["UpdatedVar___" + w],
                attrs, infos),
            _op("SGD1AcclUpdate", f"{w}_accl_update", [to_update, w], [final], attrs, infos)]


def _sgd2_update(w: str, grad: str, infos: dict, new_id: _Ids, accumulating: bool,
                 attrs: dict) -> list:
    """SGD2Decompose's ops for weight ``w`` (intermediate ids ``Ir::
    createIntermediateTensorId``'s)."""
    accl1, accum = PREFIXES["Accl1"] + w, PREFIXES["Accum"] + w
    ops, into = [], grad
    if accumulating:   # OptimizerDecompose::gradAccum
        into = new_id(accum)
        infos.update({accum: infos.get(w), into: infos.get(w)})
        ops.append(_op("Accumulate", f"{w}_accumulate", [accum, grad], [into],
                       {"type": "Add", **attrs}, infos))
    accl1_0 = new_id(accl1)
    accl1_1 = new_id(accl1_0)
    infos.update({t: infos.get(w) for t in (accl1, accl1_0, accl1_1)})
    ops += [_op("SGD2PartialAcclUpdate", f"{w}_accl_update_0_prev_v_w", [accl1, w], [accl1_0],
                attrs, infos),
            _op("Accumulate", f"{w}_accl_update_1_grads", [accl1_0, into], [accl1_1],
                {"type": "DampenedAdd", **attrs}, infos)]
    if accumulating:   # OptimizerDecompose::zeroAccumulator
        ops.append(_op("AccumulatorZero", f"{w}_accumupdate", [accum],
                       ["UpdatedVar___" + accum], attrs, infos))
    return ops + [_op("SGD2VarUpdate", f"{w}_var_update", [w, accl1_1], ["UpdatedVar___" + w],
                      attrs, infos)]


class SessionIr:
    """What ``Session.getIr()`` returns: the session's graph, data flow, options and
    patterns (PopART's Ir methods that read them), and the model to rebuild a session from
    (``InferenceSession.fromIr``)."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def getId(self) -> int:
        return id(self._session)

    def getMainGraph(self) -> Graph:
        return self._session._graph

    def getAllGraphs(self) -> list[Graph]:
        return _graphs(self._session._graph)

    def hasGraph(self, graphId: str) -> bool:
        return any(g.name == graphId for g in self.getAllGraphs())

    def getDataFlow(self) -> Any:
        return self._session.dataFlow

    def getSessionOptions(self) -> Any:
        return self._session.options

    def getPatterns(self) -> Any:
        return self._session.patterns

    def isPrepared(self) -> bool:
        return self._session._prepared

    def isTraining(self) -> bool:
        return self._session._training

    def getModel(self) -> Any:
        """The session's ONNX model with its current weights."""
        if self._session._prepared:
            self._session.weightsToHost()
        return self._session.model_proto()

    def serializeToJSON(self) -> str:
        return self._session._serializeIr(IrSerializationFormat.JSON)

    def __repr__(self) -> str:
        return f"popart.Ir(session '{self._session.name}', {len(self._session._graph.nodes)} ops)"
