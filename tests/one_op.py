"""One-op models written with popart.Builder and run through an InferenceSession (shared by
the op tests)."""
from __future__ import annotations

import numpy as np

import popart


def build(op: str, inputs: list, n_out: int = 1, opset: int = 28, **attrs) -> tuple:
    """A one-op Builder model; ``inputs`` is a list of arrays (None omits an optional input).
    Returns (model proto, feeds by input id, output ids)."""
    builder = popart.Builder(opsets={"ai.onnx": opset, "ai.graphcore": 1})
    ids = ["" if x is None else builder.addInputTensor(popart.TensorInfo(x)) for x in inputs]
    while ids and not ids[-1]:   # trailing omitted inputs are left out
        ids.pop()
    outs = getattr(builder.aiOnnx, op.lower())(ids, **attrs)
    outs = [outs] if n_out == 1 else list(outs)
    for o in outs:
        builder.addOutputTensor(o)
    feeds = {i: x for i, x in zip(ids, inputs) if i}
    return builder.getModelProto(), feeds, outs


def run_session(proto, feeds: dict, outs: list) -> list[np.ndarray]:
    """The outputs ``outs`` of one run of ``proto`` on ``feeds``."""
    df = popart.DataFlow(1, {o: popart.AnchorReturnType("ALL") for o in outs})
    s = popart.InferenceSession(proto, df, popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO(feeds, anchors))
    return [anchors[o] for o in outs]
