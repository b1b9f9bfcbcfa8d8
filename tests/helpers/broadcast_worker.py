"""A rank of tests/test_popart_tail2_host.py's job: ``broadcast_worker.py OUT``. Each rank
builds loss = sum |x * w| with its own initial w (rank + 1), calls broadcastWeights(0) before
prepareDevice, runs one training step and writes OUT/<rank>.npy with its
loss anchor."""
import os
import sys

import numpy as np

import popart
import popart.horovod as hvd

hvd.init()
rank = hvd.rank()
b = popart.Builder()
x = b.addInputTensor(popart.TensorInfo("FLOAT", [3]), "x")
w = b.addInitializedInputTensor(np.full(3, rank + 1.0, np.float32), "w")
y = b.aiGraphcore.l1loss([b.aiOnnx.mul([x, w])], 1.0, reduction=popart.ReductionType.Sum)
s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [y]), y, popart.ConstSGD(0.1),
                           popart.DeviceManager().createCpuDevice())
s.broadcastWeights(0)
s.prepareDevice()
s.weightsFromHost()
anchors = s.initAnchorArrays()
s.run(popart.PyStepIO({x: np.array([1, 2, 3], np.float32)}, anchors))
np.save(os.path.join(sys.argv[1], f"{rank}.npy"), anchors[y])
