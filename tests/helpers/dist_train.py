"""A worker of tests/test_distributed.py: trains the test MLP with global replication.

Run under `popart launch -n 2`; writes its final weights and loss anchors to argv[1]/<pid>.npz.
With argv[2] "rts": weights and optimizer state replica-sharded (tests/test_rts.py)."""
import os
import sys

import numpy as np

import popart
import popart.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_training import data, mlp  # noqa: E402

out_dir = sys.argv[1]
pid = popart.distributed.process_index()
n = popart.distributed.process_count()
b, ids, _ = mlp()
X, L = data(2, lead=(n,))                       # global data [bps, G, B, ...]
opts = popart.SessionOptions()
opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, 1
opts.enableDistributedReplicatedGraphs = True
opts.globalReplicationFactor, opts.globalReplicaOffset = n, pid
opts.accumulationAndReplicationReductionType = popart.ReductionType.Mean
rts = sys.argv[2:] == ["rts"]
if rts:
    on = popart.TensorLocation(popart.TensorStorage.OnChip, popart.ReplicatedTensorSharding.On)
    opts.weightTensorLocationSettings = popart.TensorLocationSettings(on, 0, 8)
    opts.optimizerStateTensorLocationSettings = popart.TensorLocationSettings(on, 0, 8)
df = popart.DataFlow(2, {ids["loss"]: popart.AnchorReturnType("ALL")})
opt = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.5, True)})
s = popart.TrainingSession(b.getModelProto(), df, ids["loss"], opt,
                           popart.DeviceManager().acquireAvailableDevice(1), userOptions=opts)
s.prepareDevice()
s.weightsFromHost()
s.broadcastWeights(0)
out = s.initAnchorArrays()
s.run(popart.PyStepIO({ids["x"]: np.ascontiguousarray(X[:, pid]),   # PyStepIO wants C order
                       ids["label"]: np.ascontiguousarray(L[:, pid])}, out))
s.weightsToHost()
w = {k: np.zeros(s.getInfo(ids[k]).shape(), np.float32) for k in ("w1", "b1", "w2")}
s.readWeights(popart.PyWeightsIO({ids[k]: v for k, v in w.items()}))
shards = {"shard": popart.testing.device_values(s, "optimizer")["Accl___" + ids["w1"]].addressable_shards[0].data.shape} if rts else {}
np.savez(os.path.join(out_dir, f"{pid}.npz"), loss=out[ids["loss"]], **w, **shards)
