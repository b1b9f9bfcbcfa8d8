"""A worker of tests/test_distributed.py: the user guide's Horovod recipe (section 5.1) with
`import popart.horovod as hvd`. Each rank starts from its own initial weights (the broadcast
makes them rank 0's) and trains on its part of the global batch.

Run under `popart launch -n 2`; writes its final weights and loss anchors to argv[1]/<rank>.npz."""
import os
import sys

import numpy as np

import popart
import popart.horovod as hvd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_training import data, mlp  # noqa: E402

out_dir = sys.argv[1]
hvd.init()
b, ids, _ = mlp(seed=hvd.rank())                # different initial weights on every rank
X, L = data(2, lead=(hvd.size(),))              # global data [bps, ranks, B, ...]
userOpts = popart.SessionOptions()
userOpts.hostAllReduce = True
optimizer = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.5, True)})
df = popart.DataFlow(2, {ids["loss"]: popart.AnchorReturnType("ALL")})
session = popart.TrainingSession(b.getModelProto(), df, ids["loss"], optimizer,
                                 popart.DeviceManager().acquireAvailableDevice(1), userOptions=userOpts)
session.prepareDevice()
out = session.initAnchorArrays()
distributed_optimizer = hvd.DistributedOptimizer(optimizer, session, userOpts)
distributed_optimizer.insert_host_allreduce()
hvd.broadcast_weights(session, root_rank=0)
session.weightsFromHost()
r = hvd.rank()
session.run(popart.PyStepIO({ids["x"]: np.ascontiguousarray(X[:, r]),
                             ids["label"]: np.ascontiguousarray(L[:, r])}, out))
session.weightsToHost()
w = {k: np.zeros(session.getInfo(ids[k]).shape(), np.float32) for k in ("w1", "b1", "w2")}
session.readWeights(popart.PyWeightsIO({ids[k]: v for k, v in w.items()}))
mean = hvd.allreduce(np.array([float(r)], np.float32))
np.savez(os.path.join(out_dir, f"{r}.npz"), loss=out[ids["loss"]], mean_rank=mean,
         size=hvd.size(), local_rank=hvd.local_rank(), **w)
