"""User guide section 5.4 (Full distributed training example), adapted.

The guide runs one PopART process per Horovod rank (``horovodrun -np 2 python train.py``);
Horovod broadcasts the initial weights and all-reduces the gradients on the host. Here
the same data parallelism is local replication in one process: two replicas of the graph
(``SessionOptions.enableReplicatedGraphs`` / ``replicatedGraphCount``) on a two-device
``acquireAvailableDevice(2)``, gradients averaged across replicas in the compiled program
(``accumulationAndReplicationReductionType = Mean``, as Horovod's averaging all-reduce). Every
replica starts from the same weights, so no broadcast is needed. ``hostAllReduce`` is
accepted and has no effect.

The check: two replicas with micro-batch 1 train exactly like one device with batch 2.
"""
from collections import namedtuple

import numpy as np

import popart

Session = namedtuple('Session', ['session', 'anchors'])
batch_size = 1
IN_SHAPE = 784
OUT_SHAPE = 10
REPLICAS = 2


def create_model(batch_size=batch_size):
    builder = popart.Builder()
    dtype = np.float32

    np.random.seed(42)
    input_shape = popart.TensorInfo(dtype, [batch_size, IN_SHAPE])
    x = builder.addInputTensor(input_shape)
    init_weights = np.random.normal(0, 1, [IN_SHAPE, OUT_SHAPE]).astype(dtype)
    w = builder.addInitializedInputTensor(init_weights)
    init_biases = np.random.normal(0, 1, [OUT_SHAPE]).astype(dtype)
    b = builder.addInitializedInputTensor(init_biases)
    h = builder.aiOnnx.matmul([x, w])
    a = builder.aiOnnx.add([h, b])

    output = a
    probs = builder.aiOnnx.softmax([output])
    label_shape = popart.TensorInfo("INT32", [batch_size])
    label = builder.addInputTensor(label_shape)
    # nllloss takes probabilities (the guide passes `output`, the logits)
    nll = builder.aiGraphcore.nllloss([probs, label])

    proto = builder.getModelProto()

    return builder, proto, x, label, output, nll, w


def get_device(num_ipus, simulation=False):
    deviceManager = popart.DeviceManager()
    if simulation:
        print("Creating ipu sim")
        ipu_options = {"compileIPUCode": True, 'numIPUs': num_ipus, "tilesPerIPU": 1216}
        device = deviceManager.createIpuModelDevice(ipu_options)
    else:
        print("Acquiring IPU")
        device = deviceManager.acquireAvailableDevice(num_ipus)
    if device is None:
        raise OSError("Failed to acquire IPU.")
    print("Acquired IPU: {}".format(device))
    return device


def init_session(proto, loss, dataFlow, userOpts, device):
    # Create a session to compile and execute the graph
    optimizer = popart.SGD({"defaultLearningRate": (0.1, False)})
    session = popart.TrainingSession(fnModel=proto,
                                     loss=loss,
                                     deviceInfo=device,
                                     optimizer=optimizer,
                                     dataFlow=dataFlow,
                                     userOptions=userOpts)

    session.prepareDevice()
    session.setRandomSeed(42)

    # Create buffers to receive results from the execution
    anchors = session.initAnchorArrays()

    return Session(session, anchors), optimizer


def train(replicas, data, labels, num_training_steps=10):
    """Train with `replicas` local replicas of micro-batch 1, or (replicas=1) one device
    with a batch of the same total size; returns (losses, final weights)."""
    micro = batch_size if replicas > 1 else batch_size * REPLICAS
    builder, proto, data_in, labels_in, output, loss, w = create_model(micro)
    batches_per_step = data.shape[0]
    anchor_desc = {
        output: popart.AnchorReturnType("All"),
        loss: popart.AnchorReturnType("All")
    }
    dataFlow = popart.DataFlow(batches_per_step, anchor_desc)

    userOpts = popart.SessionOptions()
    # Horovod's host-side AllReduce: accepted; replicas reduce inside the compiled program.
    userOpts.hostAllReduce = True
    if replicas > 1:
        userOpts.enableReplicatedGraphs = True
        userOpts.replicatedGraphCount = replicas
        userOpts.accumulationAndReplicationReductionType = popart.ReductionType.Mean
    device = get_device(replicas)
    training, optimizer = init_session(proto, loss, dataFlow, userOpts, device)
    training.session.weightsFromHost()

    # Input shape [batches_per_step, replicas, micro_batch, 784] (glossary 11.8).
    x = data.reshape(batches_per_step, replicas, micro, IN_SHAPE)
    y = labels.reshape(batches_per_step, replicas, micro)
    losses = []
    for _ in range(num_training_steps):
        stepio = popart.PyStepIO({data_in: x, labels_in: y}, training.anchors)
        training.session.run(stepio)
        losses.append(training.anchors[loss].reshape(batches_per_step, -1).mean(axis=1))
    print(f"{replicas} replica(s): output anchor shape {training.anchors[output].shape}, "
          f"loss anchor shape {training.anchors[loss].shape}")
    training.session.weightsToHost()
    weights = {w: np.zeros([IN_SHAPE, OUT_SHAPE], np.float32)}
    training.session.readWeights(popart.PyWeightsIO(weights))
    device.detach()
    return np.concatenate(losses), weights[w]


batches_per_step = 32
# Synthetic data: REPLICAS samples per batch (one per replica)
rng = np.random.default_rng(0)
data = rng.normal(size=(batches_per_step, REPLICAS * batch_size, IN_SHAPE)).astype(np.float32)
labels = rng.integers(0, OUT_SHAPE, (batches_per_step, REPLICAS * batch_size)).astype(np.int32)

rep_losses, rep_w = train(REPLICAS, data, labels)
one_losses, one_w = train(1, data, labels)
print(f"loss, first and last step: {rep_losses[0]:.4f} -> {rep_losses[-1]:.4f}")
print(f"max |replicated - single device| weights: {np.abs(rep_w - one_w).max():.2e}")
assert rep_losses[-1] < rep_losses[0]
assert np.allclose(rep_losses, one_losses, atol=1e-4) and np.allclose(rep_w, one_w, atol=1e-4)
print("distributed_training: OK")
