"""An op tester in the spirit of PopART's own (the ``op_tester`` fixture of tests/conftest.py).

One call builds a small model with popart.Builder, runs it once through a session and checks
the tensors it names against a reference::

    def init_builder(builder):
        x = builder.addInputTensor(x_array)           # the tester feeds x_array
        y = builder.aiOnnx.relu([x])
        return [y, popart.reservedGradientPrefix() + x]

    def reference(ref_data):
        return [np.maximum(x_array, 0), ref_data.getOutputTensorGrad(0) * (x_array > 0)]

    op_tester.run(init_builder, reference, step_type="train")

``step_type="infer"`` runs an InferenceSession; ``"train"`` a TrainingSession whose loss is
``sum(output0 * G)``, G a fixed random array (``ref_data.getOutputTensorGrad(0)``): the
returned ids may then include gradients (``reservedGradientPrefix() + id``) of inputs, weights
or outputs, all anchored in the same run. ``reference`` returns one expected value per
returned id (None: not checked; a numpy masked array: only its unmasked elements checked).
Outputs, gradients and weights are compared with ``rtol`` / ``atol`` (floating types;
integers must be equal, or within ``atol`` when it is 1 or more), after checking shape and
dtype.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence

import numpy as np
import onnx

import popart

GRAD = popart.reservedGradientPrefix()
DEFAULT_OPSETS = {"ai.onnx": 11, "ai.graphcore": 1}
_ONNX_METHODS = {"If": "logical_if", "And": "logical_and", "Or": "logical_or",
                 "Not": "logical_not", "Xor": "logical_xor"}


class Const:
    """An input of ``one_op`` given as a Constant node (a compile-time constant), not fed."""

    def __init__(self, value: Any) -> None:
        self.value = np.asarray(value)


def one_op(op: str, inputs: Sequence[Any], domain: str = "", grads: Any = False,
           **attrs: Any) -> Callable:
    """The init_builder of a one-node model: op type ``op`` of ``domain`` on ``inputs`` (arrays
    to feed; ``Const(array)`` for constants; None omits an optional input). ai.onnx ops go
    through the Builder's ``aiOnnx`` methods (``num_outputs=`` for ops with optional outputs),
    other domains (and ai.onnx ops the Builder has no method for) through ``customOp``.
    Returns the node's outputs, then, with ``grads``, the gradients of the fed floating-point
    inputs (``grads=True``: all; or their positions in ``inputs``)."""
    def init_builder(builder: TesterBuilder) -> list:
        ids = []
        for v in inputs:
            if v is None:
                ids.append("")
            elif isinstance(v, Const):
                ids.append(builder.aiOnnx.constant(v.value))
            else:
                ids.append(builder.addInputTensor(v))
        while ids and not ids[-1]:   # trailing omitted inputs are left out
            ids.pop()
        method = None
        if domain in ("", "ai.onnx"):   # ops deprecated at the opset (no method): customOp
            method = getattr(builder.aiOnnx, _ONNX_METHODS.get(op, op.lower()), None)
        if method is not None:
            params = inspect.signature(method).parameters
            pos = (ids,) if "args" in params else ()   # ops without inputs take no list
            if "num_outputs" in params:   # optional outputs
                outs = method(*pos, **{"num_outputs": 1, **attrs})
            else:   # a fixed number of outputs
                outs = method(*pos, **{k: v for k, v in attrs.items() if k != "num_outputs"})
        else:
            custom = dict(attrs)
            n = custom.pop("num_outputs", 1)
            outs = builder.customOp(op, 1, domain, ids, custom, n)
        outs = [] if outs is None else [outs] if isinstance(outs, str) else list(outs)
        fed = [k for k, v in enumerate(inputs[:len(ids)])
               if v is not None and not isinstance(v, Const) and np.asarray(v).dtype.kind == "f"]
        wanted = fed if grads is True else [k for k in fed if k in (grads or ())]
        return outs + [GRAD + ids[k] for k in wanted]
    return init_builder


class TesterBuilder:
    """popart.Builder whose ``addInputTensor`` takes the array to feed (and records it);
    everything else is the Builder's."""

    def __init__(self, opsets: Optional[dict] = None) -> None:
        self._builder = popart.Builder(opsets=dict(DEFAULT_OPSETS, **(opsets or {})))
        self._feeds: dict[str, np.ndarray] = {}
        self._weights: dict[str, np.ndarray] = {}

    def addInputTensor(self, data: Any, debugContext: str = "") -> str:
        """A graph input of ``data``'s dtype and shape; the tester feeds ``data``."""
        if isinstance(data, popart.TensorInfo):
            raise TypeError("op_tester: addInputTensor takes the array to feed, not a TensorInfo")
        data = np.asarray(data, order="C")
        tid = self._builder.addInputTensor(popart.TensorInfo(data), debugContext)
        self._feeds[tid] = data
        return tid

    def addInitializedInputTensor(self, data: Any, debugContext: str = "") -> str:
        """A weight initialised to ``data`` (trainable in train mode when floating)."""
        tid = self._builder.addInitializedInputTensor(np.asarray(data), debugContext)
        self._weights[tid] = np.asarray(data)
        return tid

    def __getattr__(self, name: str) -> Any:
        return getattr(self._builder, name)


def _graphs(graph: onnx.GraphProto):
    """``graph`` and the sub-graphs in its nodes' attributes."""
    yield graph
    for n in graph.node:
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                yield from _graphs(g)


class RefData:
    """What ``reference`` gets: the gradient flowing into each returned output, the values the
    session computed, the fed inputs and the forward model (for ONNX references)."""

    def __init__(self, ids: list, values: dict, out_grads: dict, feeds: dict, weights: dict,
                 model: bytes, loss_nodes: set, rerun: Callable) -> None:
        self.ids = ids
        self._rerun = rerun                  # feeds -> output 0, by the same session
        self._values, self._out_grads = values, out_grads
        self.inputs = dict(feeds)            # input id -> the array fed
        self.weights = dict(weights)         # weight id -> its initial value
        self._full_model, self._loss_nodes = model, loss_nodes
        self._model: Optional[bytes] = None

    def getOutputTensorGrad(self, index: int) -> np.ndarray:
        """The gradient of the loss with respect to returned tensor ``index`` (train mode):
        G for output 0, zeros for the others (they do not reach the loss)."""
        if not self._out_grads:
            raise RuntimeError("getOutputTensorGrad: only in step_type='train'")
        tid = self.ids[index]
        if tid in self._out_grads:
            return self._out_grads[tid]
        value = self._values[tid]
        if tid.startswith(GRAD) or tid in self.weights or value.dtype.kind != "f":
            raise KeyError(f"getOutputTensorGrad: returned id {index} ('{tid}') is not a "
                           f"floating-point forward tensor")
        return np.zeros_like(value)

    def getOutputTensor(self, index: int) -> np.ndarray:
        """The session's value of returned tensor ``index``."""
        return self._values[self.ids[index]]

    @property
    def model(self) -> bytes:
        """The serialized forward model (without the tester's loss and PopART's "__"
        annotations, which onnx.reference rejects on Conv, If, Loop, ...); the returned
        forward tensors are its graph outputs."""
        if self._model is None:
            m = onnx.load_from_string(self._full_model)
            for g in _graphs(m.graph):
                for n in g.node:
                    kept = [a for a in n.attribute if not a.name.startswith("__")]
                    del n.attribute[:]
                    n.attribute.extend(kept)
            if self._loss_nodes:
                keep = [n for n in m.graph.node if not set(n.output) & self._loss_nodes]
                del m.graph.node[:]
                m.graph.node.extend(keep)
                used = {n.domain for n in keep}
                imports = [o for o in m.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
                del m.opset_import[:]
                m.opset_import.extend(imports)
            self._model = m.SerializeToString()
        return self._model

    def _forward(self, run: Callable, feeds: Optional[dict]) -> list:
        names = [t for t in self.ids if not t.startswith(GRAD) and t not in self.weights]
        got = dict(zip(names, run(names, self.inputs if feeds is None else feeds)))
        return [got.get(t) for t in self.ids]

    def onnx_reference(self, feeds: Optional[dict] = None) -> list:
        """The returned forward tensors computed by onnx.reference.ReferenceEvaluator on the
        forward model (None for gradients and weights), from ``feeds`` (default: the inputs)."""
        from onnx.reference import ReferenceEvaluator
        ev = ReferenceEvaluator(self.model)
        return self._forward(lambda names, f: ev.run(names, f), feeds)

    def onnxruntime(self, feeds: Optional[dict] = None) -> list:
        """As onnx_reference, computed by onnxruntime (CPU)."""
        import onnxruntime as ort
        sess = ort.InferenceSession(self.model, providers=["CPUExecutionProvider"])
        return self._forward(lambda names, f: sess.run(names, f), feeds)

    def numeric_grad(self, wrt: str, fn: Optional[Callable] = None, n: Optional[int] = 6,
                     eps: float = 1e-6, seed: int = 2) -> np.ndarray:
        """Central differences of ``sum(output0 * getOutputTensorGrad(0))`` with respect to
        input ``wrt`` (fed in float64) at ``n`` random elements (all when None), as a masked
        array hiding the others. ``fn(feeds) -> output0`` computes the forward; by default the
        session that was run (run again on the moved inputs; nothing is compiled: in train
        mode each run is an optimizer step, so keep trainable weights out of such models)."""
        x0 = self.inputs[wrt]
        if x0.dtype != np.float64:
            raise TypeError(f"numeric_grad: feed input '{wrt}' in float64, not {x0.dtype}")
        fn = fn or self._rerun
        w = np.asarray(self.getOutputTensorGrad(0), np.float64)
        flat = x0.reshape(-1)
        picked = (range(flat.size) if n is None or n >= flat.size else
                  np.random.default_rng(seed).choice(flat.size, n, replace=False))
        grad, hidden = np.zeros(flat.size), np.ones(flat.size, bool)
        for i in picked:
            step = np.zeros_like(flat)
            step[i] = eps
            f = [float(np.sum(np.asarray(fn({**self.inputs, wrt: (flat + s * step).reshape(x0.shape)}),
                                         np.float64) * w)) for s in (1, -1)]
            grad[i], hidden[i] = (f[0] - f[1]) / (2 * eps), False
        return np.ma.masked_array(grad.reshape(x0.shape), hidden.reshape(x0.shape))

    def numeric_grads(self, n: Optional[int] = 6) -> list:
        """A reference of numeric gradients: ``numeric_grad`` for each returned input gradient
        (``n`` elements each), None for the other ids."""
        return [self.numeric_grad(t[len(GRAD):], n=n) if t.startswith(GRAD) else None
                for t in self.ids]


def _as_array(value: Any) -> Any:
    if value is None or isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):   # torch.Tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)


def infer(model: Any, feeds: dict, outputs: Sequence[str]) -> list:
    """The ``outputs`` of one InferenceSession run of a model (a proto or its bytes) that
    was not built with the tester (e.g. nodes written with onnx.helper)."""
    if not isinstance(model, (bytes, str)):
        model = model.SerializeToString()
    df = popart.DataFlow(1, {o: popart.AnchorReturnType("All") for o in outputs})
    session = popart.InferenceSession(model, df, popart.DeviceManager().createCpuDevice())
    session.prepareDevice()
    anchors = session.initAnchorArrays()
    session.run(popart.PyStepIO(dict(feeds), anchors))
    return [anchors[o] for o in outputs]


class OpTester:
    """Run one small Builder model through a session and check it (see the module docstring).
    ``rtol``, ``atol``, ``equal_nan``, ``check_dtypes`` apply to every check (``run`` takes
    ``rtol`` / ``atol`` per call); ``opsets`` and ``options`` (SessionOptions) to every run.
    With ``options`` asking for replicated graphs (R replicas), replica r is fed each numeric
    input + r (as PopART's op tester) and values have a leading replica dimension;
    ``ref_data.inputs`` are as fed."""

    def __init__(self) -> None:
        self.rtol = 1e-5
        self.atol = 1e-8
        self.equal_nan = False
        self.check_dtypes = True
        self.options: Optional[popart.SessionOptions] = None
        self.opsets: Optional[dict] = None   # run's default opsets
        self.sessions = 0                    # sessions this tester has compiled

    def verifyTensor(self, tid: str, got: np.ndarray, ref: Any, rtol: float, atol: float) -> None:
        ref = _as_array(ref)
        what = f"tensor '{tid}'"
        assert got.shape == ref.shape, f"{what}: shape {got.shape} != reference {ref.shape}"
        if self.check_dtypes:
            assert got.dtype == ref.dtype, f"{what}: dtype {got.dtype} != reference {ref.dtype}"
        if np.ma.isMaskedArray(ref):
            keep = ~np.ma.getmaskarray(ref)
            got, ref = np.broadcast_to(got, ref.shape)[keep], ref.data[keep]
        ref = np.asarray(ref)
        if got.dtype.kind in "fc" or "bfloat16" in str(got.dtype):
            np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64),
                                       rtol=rtol, atol=atol, equal_nan=self.equal_nan,
                                       err_msg=what)
        elif got.dtype.kind in "iu" and atol >= 1:   # integers within atol
            np.testing.assert_allclose(got.astype(np.int64), ref.astype(np.int64), rtol=0,
                                       atol=atol, err_msg=what)
        else:   # integers (atol < 1), booleans: equal
            np.testing.assert_array_equal(got, ref, err_msg=what)

    def run(self, init_builder: Callable, reference: Optional[Callable],
            step_type: str = "infer", opsets: Optional[dict] = None, seed: Optional[int] = None,
            patterns: Any = None, rtol: Optional[float] = None, atol: Optional[float] = None,
            optimizer: Any = None) -> list:
        """Build with ``init_builder(builder) -> [ids]``, run one step and check each id
        against ``reference(ref_data)`` (None: check nothing). ``patterns``, ``optimizer``
        (train; default ConstSGD(0.01): the loss only reaches the inputs unless the model has
        weights) and ``seed`` (the session's random seed) go to the session. Returns the values
        of the ids: anchors, and weights as they are after the step."""
        if step_type not in ("infer", "train"):
            raise ValueError(f"step_type must be 'infer' or 'train', got {step_type!r}")
        bld = TesterBuilder(opsets if opsets is not None else self.opsets)
        ids = list(init_builder(bld))
        if not ids:
            raise ValueError("init_builder must return the ids of the tensors to check")
        forward = [t for t in ids if not t.startswith(GRAD) and t not in bld._weights]
        for t in forward:
            bld.addOutputTensor(t)

        out_grads: dict[str, np.ndarray] = {}
        loss_nodes: set = set()
        if step_type == "train":
            out0 = ids[0]
            dtype = np.dtype(bld.getTensorDtypeString(out0))
            if dtype.kind != "f":
                raise TypeError(f"op_tester: in train mode returned id 0 ('{out0}') feeds the "
                                f"loss and must be floating point, not {dtype}")
            shape = bld.getTensorShape(out0)
            if any(d < 0 for d in shape):   # left open by ONNX shape inference: the engine's
                from popart.engine.shapes import infer_tensor_infos
                shape = infer_tensor_infos(bld.getModelProto())[out0].shape()
            out_grads[out0] = np.random.default_rng(0).standard_normal(shape).astype(dtype)
            g = bld.aiOnnx.constant(out_grads[out0], debugContext="outputGrad")
            weighted = bld.aiOnnx.mul([out0, g])
            loss = bld.aiGraphcore.identityloss([weighted], reduction=popart.ReductionType.Sum)
            loss_nodes = {g, weighted, loss}

        anchor_ids = [t for t in dict.fromkeys(ids) if t not in bld._weights]
        data_flow = popart.DataFlow(1, {t: popart.AnchorReturnType("All") for t in anchor_ids})
        proto = bld.getModelProto()
        opts = self.options
        replicas = opts.replicatedGraphCount if opts is not None and opts.enableReplicatedGraphs else 1
        feeds = dict(bld._feeds)
        if replicas > 1:   # as PopART's op tester: replica r gets input + r (numbers)
            feeds = {k: np.stack([v + np.asarray(r, v.dtype) if v.dtype.kind in "iuf" else v
                                  for r in range(replicas)]) for k, v in feeds.items()}
            device = popart.DeviceManager().createIpuModelDevice({"numIPUs": replicas})
        else:
            device = popart.DeviceManager().createCpuDevice()
        kwargs = dict(fnModel=proto, dataFlow=data_flow, deviceInfo=device, patterns=patterns,
                      userOptions=self.options)
        if step_type == "train":
            session = popart.TrainingSession(
                loss=loss, optimizer=optimizer if optimizer is not None else popart.ConstSGD(0.01),
                **kwargs)
        else:
            session = popart.InferenceSession(**kwargs)
        session.prepareDevice()
        session.weightsFromHost()   # PopART: required before a training session's run
        self.sessions += 1
        if seed is not None:
            session.setRandomSeed(seed)
        anchors = session.initAnchorArrays()
        session.run(popart.PyStepIO(feeds, anchors))
        values = {t: anchors[t] for t in anchor_ids}
        wanted_weights = [t for t in ids if t in bld._weights]
        if wanted_weights:   # weights after the step (updated by the optimizer or assigned)
            session.weightsToHost()
            buffers = {t: np.empty(session.getInfo(t).shape(), session.getInfo(t).np_dtype())
                       for t in wanted_weights}
            session.readWeights(popart.PyWeightsIO(buffers))
            values.update(buffers)

        if reference is not None:
            def rerun(feeds: dict) -> np.ndarray:
                again = session.initAnchorArrays()
                session.run(popart.PyStepIO(feeds, again))
                return again[ids[0]]
            ref_data = RefData(ids, values, out_grads, feeds, bld._weights, proto, loss_nodes,
                               rerun)
            refs = list(reference(ref_data))
            if len(refs) != len(ids):
                raise ValueError(f"reference returned {len(refs)} values for {len(ids)} ids")
            rtol = self.rtol if rtol is None else rtol
            atol = self.atol if atol is None else atol
            for t, ref in zip(ids, refs):
                if ref is not None:
                    self.verifyTensor(t, values[t], ref, rtol, atol)
        return [values[t] for t in ids]


def onnx_model(nodes: list, inputs: Sequence, outputs: Sequence, inits: Sequence = (),
               opset: int = 11) -> bytes:
    """A serialized ONNX model (ai.onnx ``opset`` and ai.graphcore 1): ``inputs`` /
    ``outputs`` as (name, elem type, shape), ``inits`` as (name, array)."""
    vi = onnx.helper.make_tensor_value_info
    g = onnx.helper.make_graph(nodes, "g", [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                               [onnx.numpy_helper.from_array(v, k) for k, v in inits])
    return onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", opset),
                                                    onnx.helper.make_opsetid("ai.graphcore", 1)]
                                  ).SerializeToString()


def onnx_node(op: str, ins: Sequence[str], outs: Sequence[str], domain: str = "",
              **attrs: Any) -> onnx.NodeProto:
    """``onnx.helper.make_node`` with the domain as a keyword."""
    return onnx.helper.make_node(op, ins, outs, domain=domain, **attrs)
