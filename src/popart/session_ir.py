"""``Session.getIr()``: a read-only view of a session's IR, and ``_serializeIr``'s JSON.

The JSON has PopART's layout (``Ir::serialise``): one key per graph ("maingraph" unless the
model names its graph), each a list of ops ``{"type", "name", "inputs": [{"name", "shape",
"type", "index"}], "outputs": [{"name", "index"}], "attributes": {name: "value"}}``, values
as strings. A TrainingSession's IR also lists, as PopART's does after autodiff and the
optimizer transform, each op's grad op (``<Type>Grad``, in reverse order, reading
``Gradient___<output>`` and writing ``Gradient___<input>`` of the inputs that need one) and
one var-update op per trained weight, named by the optimizer as PopART names them. On XLA
the backward pass is JAX's autodiff with PopART's grad rules (docs/gradients.md); this is
the description of what the compiled program computes, not a second implementation."""
from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np

from .ir.graph import Graph
from .ir.transforms import gradient_flow
from .options import IrSerializationFormat
from .tensorinfo import TensorInfo

GRAD = "Gradient___"


def _var_update_type(optimizer: Any, weight_id: str) -> str:
    """PopART's var-update op type for a weight: ``SGD0VarUpdate`` for SGD without momentum,
    ``SGD1VarUpdate`` / ``SGD2VarUpdate`` with it (combined / separate accumulators),
    ``AdamVarUpdate``, ``AdaptiveVarUpdate``."""
    name = optimizer.type_name()
    if name in ("SGD", "ConstSGD"):
        mm = optimizer.hyper_value(weight_id, "momentum") if "momentum" in optimizer.hyper_names() else None
        if mm is None or (mm.isConst() and mm.val() == 0.0):
            return "SGD0VarUpdate"
        return "SGD2VarUpdate" if "Separate" in str(optimizer.accumulatorAndMomentum) else "SGD1VarUpdate"
    return f"{name}VarUpdate"


def _tensor(tid: str, infos: dict, index: int) -> dict:
    info: Optional[TensorInfo] = infos.get(tid[len(GRAD):] if tid.startswith(GRAD) else tid)
    shape = "[" + " ".join(str(d) for d in info.shape()) + "]" if info is not None else "[]"
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


def _op(node_type: str, name: str, inputs: list, outputs: list, attrs: dict, infos: dict) -> dict:
    return {"type": node_type, "name": name,
            "inputs": [_tensor(t, infos, i) for i, t in enumerate(inputs) if t],
            "outputs": [{"name": t, "index": str(i)} for i, t in enumerate(outputs) if t],
            "attributes": {k: _attr(v) for k, v in attrs.items()}}


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


def serialize_ir(graph: Graph, infos: dict, main_name: str, training: Optional[dict] = None) -> str:
    """The IR as PopART's JSON. ``infos``: TensorInfo by id; ``training``: {"loss", "trainable",
    "optimizer"} for a TrainingSession."""
    doc = {}
    for g in _graphs(graph):
        ops = [_op(n.op_type, n.name or n.outputs[0], n.inputs, n.outputs,
                   {**n.attrs, **{k.lstrip("_"): v for k, v in n.annotations.items()}}, infos)
               for n in g.nodes]
        if g is graph and training is not None:
            ops += _backward(g, infos, training)
        doc["maingraph" if g is graph else g.name] = ops
    if main_name != "maingraph":
        doc = {(main_name if k == "maingraph" else k): v for k, v in doc.items()}
    return json.dumps(doc)


def _backward(g: Graph, infos: dict, training: dict) -> list[dict]:
    """Grad ops (reverse order, where ``ir.transforms.gradient_flow`` has a gradient flow)
    and var updates."""
    def is_float(t: str) -> bool:
        info = infos.get(t)
        return info is not None and np.issubdtype(info.np_dtype(), np.floating)

    has_grad, edges = gradient_flow(g, training["loss"], training["trainable"], is_float)
    ops = []
    for k, n in reversed(list(enumerate(g.nodes))):
        ins = [t for i, t in enumerate(n.inputs) if (k, i) in edges]
        if not ins:
            continue
        outs = [o for o in n.outputs if o in has_grad]
        ops.append(_op(f"{n.op_type}Grad", f"{n.name or n.outputs[0]}_Grad",
                       [GRAD + o for o in outs] + [i for i in n.inputs if i],
                       [GRAD + i for i in ins], {}, infos))
    for w in training["trainable"]:
        update = _var_update_type(training["optimizer"], w)
        if w in has_grad:
            ops.append(_op(update, f"{update}_{w}", [w, GRAD + w], ["UpdatedVar___" + w], {}, infos))
    return ops


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
