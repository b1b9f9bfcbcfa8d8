"""A worker of tests/test_distributed.py: a PopRun-style program (popdist API). Run under
`poprun --num-instances 2 --num-replicas 4 python popdist_train.py OUT`; writes its final
weights and loss anchors to OUT/<instance>.npz."""
import os
import sys

import numpy as np

import popart
import popdist
import popdist.popart

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_training import data, mlp  # noqa: E402

out_dir = sys.argv[1]
popdist.init()
assert popdist.isPopdistEnvSet()
b, ids, _ = mlp()
X, L = data(2, lead=(popdist.getNumTotalReplicas(),))    # global data [bps, R, B, ...]
opts = popart.SessionOptions()
popdist.popart.configureSessionOptions(opts)
opts.accumulationAndReplicationReductionType = popart.ReductionType.Mean
df = popart.DataFlow(2, {ids["loss"]: popart.AnchorReturnType("ALL")})
opt = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.5, True)})
s = popart.TrainingSession(b.getModelProto(), df, ids["loss"], opt, popdist.popart.getDevice(),
                           userOptions=opts)
s.prepareDevice()
s.weightsFromHost()
out = s.initAnchorArrays()
mine = slice(popdist.getReplicaIndexOffset(), popdist.getReplicaIndexOffset() + popdist.getNumLocalReplicas())
s.run(popart.PyStepIO({ids["x"]: np.ascontiguousarray(X[:, mine]),
                       ids["label"]: np.ascontiguousarray(L[:, mine])}, out))
s.weightsToHost()
w = {k: np.zeros(s.getInfo(ids[k]).shape(), np.float32) for k in ("w1", "b1", "w2")}
s.readWeights(popart.PyWeightsIO({ids[k]: v for k, v in w.items()}))
np.savez(os.path.join(out_dir, f"{popdist.getInstanceIndex()}.npz"), loss=out[ids["loss"]], **w)
