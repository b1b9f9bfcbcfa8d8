"""User guide section 3.4 (Setting the IPU number for operations) and the talk's sharding slide.

Ops are placed on IPUs with ``builder.virtualGraph``: per op (``builder.virtualGraph(o, 1)``)
or with the context manager; ``virtualGraphMode`` Manual uses these annotations, Auto places
ops itself. The sharded model must give the same outputs as the unannotated one.
"""
from contextlib import nullcontext

import numpy as np

import popart

rng = np.random.default_rng(0)

# The guide's context-manager example: two adds on IPU 0, one on IPU 1.
builder = popart.Builder()
i1 = builder.addInputTensor(popart.TensorInfo("FLOAT", [1]))
i2 = builder.addInputTensor(popart.TensorInfo("FLOAT", [1]))
i3 = builder.addInputTensor(popart.TensorInfo("FLOAT", [1]))
i4 = builder.addInputTensor(popart.TensorInfo("FLOAT", [1]))

# place two add operations on IPU 0
with builder.virtualGraph(0):
    o1 = builder.aiOnnx.add([i1, i2])
    o2 = builder.aiOnnx.add([i3, i4])

# place one add operation on IPU 1
with builder.virtualGraph(1):
    o = builder.aiOnnx.add([o1, o2])
print(f"{o1}, {o2} on IPU {builder.getVirtualGraph(o1)}; {o} on IPU {builder.getVirtualGraph(o)}")

opts = popart.SessionOptions()
opts.virtualGraphMode = popart.VirtualGraphMode.Manual
device = popart.DeviceManager().acquireAvailableDevice(2)
session = popart.InferenceSession(builder.getModelProto(),
                                  popart.DataFlow(1, {o: popart.AnchorReturnType("ALL")}),
                                  device, userOptions=opts)
session.prepareDevice()
anchors = session.initAnchorArrays()
vals = {t: np.array([v], np.float32) for t, v in zip([i1, i2, i3, i4], [1, 2, 3, 4])}
session.run(popart.PyStepIO(vals, anchors))
print(f"{o} = {anchors[o]}")
assert np.allclose(anchors[o], [10.0])
device.detach()


# The guide's convolution example: a conv placed on IPU 1 with the per-op form.
def conv_model(annotate: bool, seed: int = 1):
    rng_w = np.random.default_rng(seed)  # the same weights for every model
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT16", [1, 4, 8, 8]))
    with b.virtualGraph(0) if annotate else nullcontext():
        h = b.aiOnnx.relu([x])
    we = b.addInitializedInputTensor(rng_w.standard_normal([32, 4, 3, 3]).astype(np.float16))
    bi = b.addInitializedInputTensor(np.zeros([32], np.float16))
    o = b.aiOnnx.conv([h, we, bi], dilations=[1, 1], pads=[1, 1, 1, 1], strides=[1, 1])
    if annotate:
        # place operation on IPU 1
        b.virtualGraph(o, 1)
    b.addOutputTensor(o)
    return b.getModelProto(), x, o


x_data = rng.standard_normal([1, 4, 8, 8]).astype(np.float16)
results = {}
for mode in ["Manual", "Auto", "Off"]:
    proto, x, o = conv_model(annotate=(mode == "Manual"))
    opts = popart.SessionOptions()
    opts.virtualGraphMode = getattr(popart.VirtualGraphMode, mode)
    device = (popart.DeviceManager().acquireAvailableDevice(2) if mode != "Off"
              else popart.DeviceManager().createCpuDevice())
    s = popart.InferenceSession(proto, popart.DataFlow(1, {o: popart.AnchorReturnType("ALL")}),
                                device, userOptions=opts)
    s.prepareDevice()
    a = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: x_data}, a))
    results[mode] = a[o].astype(np.float32)
    device.detach()
    print(f"virtualGraphMode {mode}: output {list(a[o].shape)} {a[o].dtype}, "
          f"mean {results[mode].mean():.4f}")
assert np.allclose(results["Manual"], results["Off"])
assert np.allclose(results["Auto"], results["Off"])
print("sharding: OK")
