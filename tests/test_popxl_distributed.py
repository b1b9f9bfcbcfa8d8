"""popxl on several instances (processes of one jax.distributed job): replicas spread over
the instances train like the same replicas in one process; Ir(replication="popdist")."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import popart
import popxl

from test_distributed import free_port

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "helpers"))
import popxl_dist_train as prog  # noqa: E402

SCRIPT = os.path.join(HERE, "helpers", "popxl_dist_train.py")


def numpy_reference() -> dict:
    """The helper's program in NumPy: losses [2 runs, N, R] and the final values."""
    d = prog.data()
    w, b, seen, total = d["w"].astype(np.float64), d["b"].astype(np.float64), d["seen"][:, 0] * 1.0, 0.0
    sc = d["scale"][[0, 1, 0, 1], 0]
    losses, pairs = np.zeros((2, prog.N, prog.R)), np.zeros((2, prog.N, prog.R))
    for run in range(2):
        for n in range(prog.N):
            err = (d["x"][n] @ w + b) * sc[:, None, None] - d["y"][n]          # [R, B, K]
            losses[run, n] = (err ** 2).mean(axis=(1, 2))
            pairs[run, n] = losses[run, n][[0, 1, 0, 1]] + losses[run, n][[2, 3, 2, 3]]
            g = 2 * err / err[0].size * sc[:, None, None]
            w = w - prog.LR * np.einsum("rbd,rbk->dk", d["x"][n], g) / prog.R
            b = b - prog.LR * g.sum(axis=(0, 1)) / prog.R
            seen, total = seen + losses[run, n], total + losses[run, n].mean()
        w = w * 2 if run == 0 else w
    return dict(loss=losses, pair_loss=pairs, w=w, b=b, seen=seen[:, None], total=[total])


@pytest.fixture(scope="module")
def reference() -> dict:
    """The program with all 4 replicas in this process (checked against NumPy)."""
    out = prog.train(popxl.Ir(replication=prog.R))
    want = numpy_reference()
    for k in want:
        np.testing.assert_allclose(out[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert (out["replication_factor"], out["instance_replication_factor"]) == (prog.R, prog.R)
    return out


def assert_like_reference(out_dir, reference: dict, instances: int = 2) -> None:
    local = prog.R // instances
    for i in range(instances):
        got = np.load(out_dir / f"{i}.npz")
        assert int(got["replication_factor"]) == prog.R and int(got["instance_replication_factor"]) == local
        mine = slice(i * local, (i + 1) * local)     # this instance's replicas' losses
        for k in ("loss", "pair_loss"):
            np.testing.assert_allclose(got[k], reference[k][..., mine], rtol=1e-5, err_msg=k)
        for k in ("w", "b", "scale", "seen", "total"):   # global values on every instance
            np.testing.assert_allclose(got[k], reference[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_two_instances_train_like_four_local_replicas(tmp_path, reference):
    """`popart launch -n 2`: each instance has 2 of the 4 replicas and feeds its share."""
    from popart.cli import main
    assert main(["launch", "-n", "2", "--port", str(free_port()), SCRIPT, str(tmp_path)]) == 0
    assert_like_reference(tmp_path, reference)


def test_poprun_runs_a_popxl_program(tmp_path, reference):
    """`poprun --num-instances 2 --num-replicas 4 python prog.py` (PopRun's POPDIST_* variables)."""
    from popdist.poprun import main
    assert main(["--num-instances", "2", "--num-replicas", "4", "--only-output-from-instance", "0",
                 "--port", str(free_port()), sys.executable, SCRIPT, str(tmp_path)]) == 0
    assert_like_reference(tmp_path, reference)


POPDIST = {"POPDIST_NUM_INSTANCES": "2", "POPDIST_INSTANCE_INDEX": "1",
           "POPDIST_NUM_TOTAL_REPLICAS": "4", "POPDIST_NUM_LOCAL_REPLICAS": "2",
           "POPDIST_REPLICA_INDEX_OFFSET": "2"}


def test_popdist_ir_has_global_and_instance_replication(monkeypatch):
    for k, v in POPDIST.items():
        monkeypatch.setenv(k, v)
    ir = popxl.Ir(replication="popdist")
    assert (ir.replication_factor, ir.instance_replication_factor) == (4, 2)
    assert ir.replica_grouping().num_replicas == 4                # groupings are global
    ir.replication_factor = 2                                     # popxl: sets the instance's
    assert (ir.replication_factor, ir.instance_replication_factor) == (4, 2)
    monkeypatch.setenv("POPDIST_NUM_INSTANCES", "1")
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "2")
    one = popxl.Ir(replication="popdist")
    assert (one.replication_factor, one.instance_replication_factor) == (2, 2)
    plain = popxl.Ir(replication=3)
    assert (plain.replication_factor, plain.instance_replication_factor) == (3, 3)
    with pytest.raises(ValueError, match="replication must be an int >= 1"):
        popxl.Ir(replication=0)


def test_popdist_ir_outside_its_job_and_late_replication_changes_are_errors(monkeypatch):
    for k, v in POPDIST.items():
        monkeypatch.setenv(k, v)
    ir = popxl.Ir(replication="popdist")
    with ir.main_graph:
        popxl.variable(np.zeros(2, np.float32))
    with pytest.raises(popart.popart_exception, match="globalReplicationFactor is 4, but 1 "
                                                      "process.*replicatedGraphCount 2"):
        popxl.Session(ir, "ipu_model")                              # not one of 2 processes
    small = popxl.Ir(replication=2)
    with small.main_graph:
        popxl.variable(np.zeros(2, np.float32))
    popxl.Session(small, "ipu_model")
    with pytest.raises(RuntimeError, match="cannot change the replication_factor"):
        small.replication_factor = 4
