"""User guide section 6.2.1 (Local replication) and the talk's data-parallelism slide.

``enableReplicatedGraphs`` + ``replicatedGraphCount`` run copies of the graph side by side
(on separate devices where the machine has them), each on its own slice of the input; the
input and every anchor gain a replication dimension: ``[batchesPerStep, replicas, ...]``
(glossary 11.8). In training, the replicas' gradients are reduced before one weight update
(``accumulationAndReplicationReductionType``), so replication equals gradient accumulation
on one device (glossary 11.4): this script checks both identities.
"""
import numpy as np

import popart

REPLICAS, MICRO, BPS, IN, OUT = 4, 2, 3, 16, 5
rng = np.random.default_rng(0)
W0 = rng.standard_normal((IN, OUT)).astype(np.float32) * 0.3


def model():
    builder = popart.Builder()
    x = builder.addInputTensor(popart.TensorInfo("FLOAT", [MICRO, IN]), "x")
    label = builder.addInputTensor(popart.TensorInfo("INT32", [MICRO]), "label")
    w = builder.addInitializedInputTensor(W0, "w")
    probs = builder.aiOnnx.softmax([builder.aiOnnx.matmul([x, w])], axis=1)
    loss = builder.aiGraphcore.nllloss([probs, label], reduction=popart.ReductionType.Mean)
    return builder.getModelProto(), x, label, w, probs, loss


proto, x, label, w, probs, loss = model()
data = rng.standard_normal((BPS, REPLICAS, MICRO, IN)).astype(np.float32)
labels = rng.integers(0, OUT, (BPS, REPLICAS, MICRO)).astype(np.int32)

# --- Inference: 4 replicas, each on a quarter of the step's data ------------------------
options = popart.SessionOptions()
options.enableReplicatedGraphs = True
options.replicatedGraphCount = REPLICAS
device = popart.DeviceManager().acquireAvailableDevice(REPLICAS)
flow = popart.DataFlow(BPS, {probs: popart.AnchorReturnType("ALL")})
session = popart.InferenceSession(proto, flow, device, userOptions=options)
session.prepareDevice()
anchors = session.initAnchorArrays()
session.run(popart.PyStepIO({x: data, label: labels}, anchors))
print(f"replicated inference: input {list(data.shape)}, "
      f"anchor {probs} {list(anchors[probs].shape)}")
flow = popart.DataFlow(BPS * REPLICAS, {probs: popart.AnchorReturnType("ALL")})
single = popart.InferenceSession(proto, flow, popart.DeviceManager().createCpuDevice())
single.prepareDevice()
ref = single.initAnchorArrays()
single.run(popart.PyStepIO({x: data.reshape(-1, MICRO, IN), label: labels.reshape(-1, MICRO)}, ref))
assert np.allclose(anchors[probs].reshape(ref[probs].shape), ref[probs], atol=1e-6)
device.detach()


# --- Training: 4 replicas == accumulation of 4 micro-batches on one device -------------------
def train(opts, device, feed_shape):
    flow = popart.DataFlow(BPS, {loss: popart.AnchorReturnType("ALL")})
    s = popart.TrainingSession(proto, flow, loss, popart.SGD({"defaultLearningRate": (0.5, False)}),
                               device, userOptions=opts)
    s.prepareDevice()
    s.weightsFromHost()
    a = s.initAnchorArrays()
    feeds = {x: data.reshape(feed_shape + [IN]), label: labels.reshape(feed_shape)}
    s.run(popart.PyStepIO(feeds, a))
    s.weightsToHost()
    out = {w: np.zeros_like(W0)}
    s.readWeights(popart.PyWeightsIO(out))
    return a[loss], out[w]


options = popart.SessionOptions()
options.enableReplicatedGraphs = True
options.replicatedGraphCount = REPLICAS
options.accumulationAndReplicationReductionType = popart.ReductionType.Mean
device = popart.DeviceManager().acquireAvailableDevice(REPLICAS)
rep_loss, rep_w = train(options, device, [BPS, REPLICAS, MICRO])
device.detach()
print(f"replicated training: loss anchor shape {list(rep_loss.shape)} (batchesPerStep, replicas)")

options = popart.SessionOptions()
options.enableGradientAccumulation = True
options.accumulationFactor = REPLICAS
options.accumulationAndReplicationReductionType = popart.ReductionType.Mean
acc_loss, acc_w = train(options, popart.DeviceManager().createCpuDevice(), [BPS, REPLICAS, MICRO])
print(f"accumulated training: loss anchor shape {list(acc_loss.shape)} "
      f"(batchesPerStep, accumulation)")
print(f"max |replicated - accumulated| weights after {BPS} updates: "
      f"{np.abs(rep_w - acc_w).max():.2e}")
assert np.allclose(rep_loss, acc_loss, atol=1e-5) and np.allclose(rep_w, acc_w, atol=1e-5)
assert not np.allclose(rep_w, W0)
print("replication: OK")
