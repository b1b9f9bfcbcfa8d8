"""Multi-process jobs fail fast and whole: one failing rank ends the job, with its status, in
seconds (launched by `popart launch`, `poprun`, or as plain processes with rank variables).

Each test is its own small job of 2 processes (tests/helpers/fail_fast_worker.py). Starting a
rank (importing JAX, joining the job) can take long on a loaded machine, so the bound on how
fast a failure ends the job is measured from the moment the ranks are in the job (the workers'
ready files), and only the whole job has a generous subprocess timeout."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "helpers", "fail_fast_worker.py")
START_S = 150     # a whole job, startup included (subprocess timeout)
BOUND_S = 30      # from every rank being in the job to the end of the job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "popart.cli", "launch", "-n", "2", "--port", str(free_port()),
            WORKER, *args]


def poprun(*args: str) -> list[str]:
    return [sys.executable, "-m", "popdist.poprun", "--num-instances", "2", "--num-replicas", "2",
            "--port", str(free_port()), sys.executable, WORKER, *args]


def ready(out, rank: int) -> float:
    """When rank ``rank`` was in the job (its ready file's time)."""
    return os.path.getmtime(out / f"ready.{rank}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:      # a zombie is gone as far as work goes
        return f.read().split(")")[-1].split()[0] != "Z"


def rank_pids(out) -> list[int]:
    return [int((out / f"pid.{r}").read_text()) for r in range(2)]


def run_job(cmd: list[str], out) -> tuple[int, str, str, float]:
    """Run a launcher to its end: (exit status, stdout, stderr, seconds from the later of the
    ranks being in the job to the launcher's end)."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=START_S)
    end = time.time()
    return p.returncode, p.stdout, p.stderr, end - max(ready(out, 0), ready(out, 1))


def wait_ready(proc: subprocess.Popen, out) -> None:
    deadline = time.monotonic() + START_S
    while not all((out / f"ready.{r}").exists() for r in range(2)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)


def test_rank_exit_status_ends_a_launched_job(tmp_path):
    """`popart launch -n 2`: rank 1 exits with 7 right after init while rank 0 sleeps for two
    minutes: the job ends with 7 in seconds, rank 0 stopped, both ranks' output kept."""
    code, out, err, took = run_job(launcher("exit7", str(tmp_path)), tmp_path)
    assert code == 7, err
    assert took < BOUND_S, took
    assert "[rank 0] rank 0 joined" in out and "[rank 1] rank 1 joined" in out
    assert "popart launch: rank 1 exited with status 7" in err
    assert "[rank 1] popart: rank 1 of 2 failed (exit status 7)" in err
    assert not any(alive(p) for p in rank_pids(tmp_path))


def plain_job(tmp_path, mode: str, env_for) -> tuple[list[int], list[str]]:
    """Two plain processes (no launcher): their exit statuses and outputs."""
    procs = [subprocess.Popen([sys.executable, WORKER, mode, str(tmp_path)],
                              env=dict(os.environ, **env_for(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=START_S)[0] for p in reversed(procs)][::-1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], logs


def test_plain_processes_rank_0_in_a_collective_fails_when_rank_1_exits(tmp_path):
    """No launcher: Open MPI's rank variables and MASTER_ADDR / MASTER_PORT (hvd.init()).
    Rank 1 exits with 3 while rank 0 waits in an all-reduce: rank 0 fails at once (its
    collective breaks) and leaves without waiting for rank 1 at shutdown."""
    port = str(free_port())
    env = lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    codes, logs = plain_job(tmp_path, "collective", env)
    assert codes[1] == 3, logs[1]
    assert codes[0] != 0, logs[0]
    assert "rank 0 waits in an all-reduce" in logs[0]
    assert time.time() - max(ready(tmp_path, 0), ready(tmp_path, 1)) < BOUND_S
    assert "another rank of the job has most likely ended" in logs[0]


def test_plain_processes_idle_rank_0_is_ended_by_the_runtime(tmp_path):
    """No launcher (POPART_DIST_* only): rank 1 exits with 5 while rank 0 sleeps; JAX's
    coordination service notices rank 1's missing heartbeats (HEARTBEAT_TIMEOUT_S) and ends
    rank 0, naming task 1."""
    import jax
    from popart import distributed
    if "heartbeat_timeout_seconds" not in distributed._timeouts(jax.distributed.initialize):
        pytest.skip("this JAX has no heartbeat_timeout_seconds: its fixed 100 s apply")
    port = str(free_port())
    env = lambda r: {distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                     distributed.ENV_NUM_PROCESSES: "2", distributed.ENV_PROCESS_ID: str(r)}
    codes, logs = plain_job(tmp_path, "idle", env)
    assert codes[1] == 5, logs[1]
    assert codes[0] != 0, logs[0]
    assert time.time() - ready(tmp_path, 1) < BOUND_S
    assert "unhealthy" in logs[0] and "rank 0 ended" not in logs[0]


def test_timeouts_are_the_documented_ones():
    import inspect

    import jax
    from popart import distributed
    got = distributed._timeouts(jax.distributed.initialize)
    params = inspect.signature(jax.distributed.initialize).parameters
    assert got.get("heartbeat_timeout_seconds", 10) == distributed.HEARTBEAT_TIMEOUT_S == 10
    assert got.get("shutdown_timeout_seconds", 300) == distributed.SHUTDOWN_TIMEOUT_S == 300
    assert set(got) == {k for k in ("heartbeat_timeout_seconds", "shutdown_timeout_seconds")
                        if k in params}


@pytest.mark.parametrize("how, status", [("raise", 1), ("kill", 137)])
def test_rank_failing_in_the_third_training_step_ends_the_job(tmp_path, how, status):
    """A replicated TrainingSession over 2 ranks (gradients all-reduced in the step): in its
    third step rank 1 raises (status 1), or is killed by SIGKILL (137), inside ``run()`` while
    rank 0 waits in the step's collective. The job ends in seconds naming rank 1."""
    code, out, err, took = run_job(launcher("train", str(tmp_path), how), tmp_path)
    assert code == status, err
    assert took < BOUND_S, took
    what = "exited with status 1" if how == "raise" else "was killed by signal 9"
    assert f"popart launch: rank 1 {what}" in err
    assert "[rank 1] rank 1 finished step 2" in out and "rank 1 finished step 3" not in out
    if how == "raise":
        assert "[rank 1] RuntimeError: rank 1 fails inside its third training step" in err
    assert not any(alive(p) for p in rank_pids(tmp_path))


@pytest.mark.parametrize("cmd, args, sig, status", [
    (launcher, ("wait",), signal.SIGINT, 130),
    (poprun, ("popxl", "wait"), signal.SIGTERM, 143)])
def test_launcher_signal_stops_every_rank(tmp_path, cmd, args, sig, status):
    """SIGINT to `popart launch` (ranks sleeping) / SIGTERM to `poprun` (ranks running a
    popxl program): every rank is stopped, the launcher exits 130 / 143, the output is kept."""
    proc = subprocess.Popen(cmd(args[0], str(tmp_path), *args[1:]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(proc, tmp_path)
        time.sleep(0.5)
        t0 = time.time()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, err
    assert time.time() - t0 < BOUND_S
    assert not any(alive(p) for p in rank_pids(tmp_path))
    assert "[rank 0] rank 0 joined" in out and "[rank 1] rank 1 joined" in out
    if args[0] == "popxl":
        assert "[rank 0] instance 0 finished run 1" in out and "[rank 1] instance 1 finished run 1" in out
        assert f"poprun: got signal {int(sig)}; stopping every rank; exit status 143" in err
    else:
        assert "[rank 1] rank 1 is waiting" in out
        assert "popart launch: interrupted (SIGINT)" in err


@pytest.mark.parametrize("how, status", [("raise", 1), ("kill", 137)])
def test_poprun_popxl_instance_failing_ends_the_job(tmp_path, how, status):
    """A popxl program (Ir(replication="popdist"), an all-reduce per run) under `poprun
    --num-instances 2`: instance 1 raises (status 1) or is killed by SIGKILL (137) in its
    third run while instance 0 runs on."""
    code, out, err, took = run_job(poprun("popxl", str(tmp_path), how), tmp_path)
    assert code == status, err
    assert took < BOUND_S, took
    what = "exited with status 1" if how == "raise" else "was killed by signal 9"
    assert f"poprun: rank 1 {what}" in err
    if how == "raise":
        assert "[rank 1] RuntimeError: instance 1 fails in its third run" in err
    assert "[rank 1] instance 1 finished run 2" in out
    assert not any(alive(p) for p in rank_pids(tmp_path))


def test_a_rank_failing_while_another_writes_its_model_leaves_the_old_or_the_new_file(tmp_path):
    """Rank 0 trains and writes modelToHost again and again; rank 1 exits with 9 meanwhile and
    the launcher stops rank 0, wherever it is in its write: model.onnx is a whole model whose
    weights are one of the versions rank 0 wrote. (A rank killed by SIGKILL mid-write runs no
    clean-up, so its temporary file may stay beside the model; it is never the model.)"""
    import onnx
    from onnx import numpy_helper
    code, out, err, took = run_job(launcher("checkpoint", str(tmp_path)), tmp_path)
    assert code == 9, err
    assert took < BOUND_S, took
    model = onnx.load(str(tmp_path / "model.onnx"))
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}["w"]
    versions = [float(v) for v in (tmp_path / "versions.txt").read_text().split()]
    assert len(versions) >= 2
    assert np.isclose(versions, w.sum(), rtol=0, atol=1e-5).any(), (w.sum(), versions[-3:])
    assert all(f.startswith(".tmp_") or f in ("model.onnx", "versions.txt") or
               not f.endswith(".onnx") for f in os.listdir(tmp_path))


def test_popdist_and_hvd_init_take_the_rank_from_mpi_variables(monkeypatch):
    """Under an MPI launcher (PopRun's own, horovodrun) the rank comes from Open MPI's
    variables; without a coordinator address the error says which variables to set."""
    import popart
    import popdist
    from popart import distributed, horovod
    assert not distributed.is_distributed()
    for k in (distributed.ENV_COORDINATOR, "MASTER_ADDR", "HOROVOD_RANK", "HOROVOD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    for init, name in ((popdist.init, "popdist.init"), (horovod.init, "hvd.init")):
        with pytest.raises(popart.popart_exception, match=rf"{name}: rank 1 of 2 processes, but "
                           rf"no coordinator address: set {distributed.ENV_COORDINATOR} .* or "
                           rf"MASTER_ADDR / MASTER_PORT"):
            init()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "x")
    with pytest.raises(popart.popart_exception, match="OMPI_COMM_WORLD_SIZE .* must be integers"):
        popdist.init()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")      # a job of one process: nothing to join
    popdist.init()
    assert not distributed.is_distributed() and horovod.size() == 1
