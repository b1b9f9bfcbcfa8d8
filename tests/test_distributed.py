"""Global replication across processes (jax.distributed) equals local replication."""
from __future__ import annotations

import os
import socket

import numpy as np

import popart

from test_training import data, mlp, read, train

HERE = os.path.dirname(__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_trains_like_local_replicas(got: list, replicas: int) -> None:
    """``got``: each process's losses and weights after training the test MLP (SGD with
    momentum, 2 batches) on its replicas' part of the global data. They must equal one
    process training ``replicas`` local replicas (Mean reduction) on all of it."""
    b, ids, _ = mlp()
    X, L = data(2, lead=(replicas,))
    opts = popart.SessionOptions()
    opts.enableReplicatedGraphs, opts.replicatedGraphCount = True, replicas
    opts.accumulationAndReplicationReductionType = popart.ReductionType.Mean
    opt = popart.SGD({"defaultLearningRate": (0.1, False), "defaultMomentum": (0.5, True)})
    s, out = train(b, ids, opt, 2, X, L, opts=opts,
                   device=popart.DeviceManager().acquireAvailableDevice(replicas))
    ref = read(s, ids)
    local = replicas // len(got)
    for p, g in enumerate(got):
        losses = out[ids["loss"]][:, p] if local == 1 else out[ids["loss"]][:, p * local:(p + 1) * local]
        np.testing.assert_allclose(g["loss"], losses, rtol=1e-5)
        for k in ref:
            np.testing.assert_allclose(g[k], ref[k], rtol=1e-5, atol=1e-6)


def test_two_processes_train_like_two_local_replicas(tmp_path):
    from popart.cli import main
    code = main(["launch", "-n", "2", "--port", str(free_port()),
                 os.path.join(HERE, "helpers", "dist_train.py"), str(tmp_path)])
    assert code == 0
    got = [np.load(tmp_path / f"{p}.npz") for p in range(2)]
    assert_trains_like_local_replicas(got, 2)


def test_global_replication_options_are_checked():
    b, ids, _ = mlp()
    opts = popart.SessionOptions()
    opts.enableDistributedReplicatedGraphs = True
    opts.globalReplicationFactor = 4
    s = popart.TrainingSession(b.getModelProto(), popart.DataFlow(1, [ids["loss"]]), ids["loss"],
                               popart.ConstSGD(0.1), popart.DeviceManager().createCpuDevice(), userOptions=opts)
    try:
        s.prepareDevice()
        s.weightsFromHost()
        raise AssertionError("expected an error")
    except popart.popart_exception as e:
        assert "globalReplicationFactor" in str(e) and "4" in str(e)


def test_horovod_recipe_trains_like_one_process_with_the_combined_batch(tmp_path):
    """The user guide's Horovod recipe with `import popart.horovod as hvd`, 2 processes:
    rank 1's different initial weights are replaced by rank 0's (broadcast_weights), and the
    averaged gradients give the weights of one process training on both halves of the batch
    (two local replicas, Mean reduction)."""
    from popart.cli import main
    code = main(["launch", "-n", "2", "--port", str(free_port()),
                 os.path.join(HERE, "helpers", "hvd_train.py"), str(tmp_path)])
    assert code == 0
    got = [np.load(tmp_path / f"{p}.npz") for p in range(2)]
    assert [int(g["size"]) for g in got] == [2, 2] and [int(g["local_rank"]) for g in got] == [0, 1]
    assert all(float(g["mean_rank"][0]) == 0.5 for g in got)      # hvd.allreduce averages
    assert_trains_like_local_replicas(got, 2)   # from rank 0's weights, mlp(seed=0)


def test_poprun_and_popdist_run_a_poprun_program(tmp_path, capfd):
    """`poprun --num-instances 2 --num-replicas 4 python prog.py`: each instance has 2 local
    replicas at its offset (popdist.popart.configureSessionOptions), and the job trains like 4
    local replicas; --only-output-from-instance keeps one instance's output."""
    import sys
    from popdist.poprun import main
    script = os.path.join(HERE, "helpers", "popdist_train.py")
    code = main(["--num-instances", "2", "--num-replicas", "4", "--only-output-from-instance",
                 "0", "--port", str(free_port()), sys.executable, script, str(tmp_path)])
    assert code == 0
    got = [np.load(tmp_path / f"{p}.npz") for p in range(2)]
    assert_trains_like_local_replicas(got, 4)
    assert main(["--num-instances", "2", "--num-replicas", "3", "python", "x.py"]) == 2
    assert "multiple of --num-instances" in capfd.readouterr().err
