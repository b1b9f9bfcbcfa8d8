"""Many processes: global replication on JAX's distributed runtime.

PopART's global replication (``enableDistributedReplicatedGraphs``, ``globalReplicationFactor``,
``globalReplicaOffset``) ran one PopART instance per host, launched by PopRun. Here each
instance is a process of JAX's distributed runtime (``jax.distributed``; on CPUs the collectives
go through gloo). All replicas of all processes form one device mesh, so gradients are reduced
across processes inside the compiled program.

Start processes with ``popart launch -n N script.py`` (PopRun-style), or set the environment
variables below yourself; ``import popart`` then joins the runtime before JAX starts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .errors import OptionError, popart_exception

ENV_COORDINATOR = "POPART_DIST_COORDINATOR"      # host:port of process 0
ENV_NUM_PROCESSES = "POPART_DIST_NUM_PROCESSES"
ENV_PROCESS_ID = "POPART_DIST_PROCESS_ID"

_initialized = False


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the distributed runtime (call before any JAX computation)."""
    global _initialized
    if _initialized:
        return
    import jax
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # older / newer JAX without the option: its default
        pass
    jax.distributed.initialize(coordinator, num_processes=int(num_processes), process_id=int(process_id))
    _initialized = True


def initialize_from_env() -> bool:
    """Join the runtime if the launcher's environment variables are set."""
    if ENV_COORDINATOR not in os.environ:
        return False
    try:
        n, pid = int(os.environ[ENV_NUM_PROCESSES]), int(os.environ[ENV_PROCESS_ID])
    except (KeyError, ValueError):
        raise popart_exception(f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and "
                               f"{ENV_PROCESS_ID} must be integers; got "
                               f"{os.environ.get(ENV_NUM_PROCESSES)!r}, "
                               f"{os.environ.get(ENV_PROCESS_ID)!r}") from None
    initialize(os.environ[ENV_COORDINATOR], n, pid)
    return True


def is_distributed() -> bool:
    return _initialized


def process_index() -> int:
    import jax
    return jax.process_index() if _initialized else 0


def process_count() -> int:
    import jax
    return jax.process_count() if _initialized else 1


def local_rows(x: Any) -> np.ndarray:
    """This process's rows of ``x``, an array split over the replicas along its leading
    dimension (all of it when this process holds all of it)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def global_value(x: Any) -> np.ndarray:
    """The whole value of ``x`` on every process. Across processes this is a collective:
    every process of the job must call it, for the same arrays in the same order."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_options(options: object, local_replicas: int) -> int:
    """The global replication factor the options ask for, checked against the runtime."""
    if not getattr(options, "enableDistributedReplicatedGraphs", False):
        return local_replicas
    g = int(getattr(options, "globalReplicationFactor", 1))
    offset = int(getattr(options, "globalReplicaOffset", 0))
    n, p = process_count(), process_index()
    if g != local_replicas * n:
        raise OptionError(
            f"globalReplicationFactor is {g}, but {n} process(es) with replicatedGraphCount "
            f"{local_replicas} give {local_replicas * n} replicas (start the processes with "
            f"`popart launch -n {max(g // max(local_replicas, 1), 1)} ...`)")
    if offset != p * local_replicas:
        raise OptionError(f"globalReplicaOffset is {offset}, but process {p} runs replicas from "
                          f"{p * local_replicas} (offset = process index x replicatedGraphCount)")
    return g


def launch(argv: Sequence[str], num_processes: int, port: int = 12355,
           host: str = "127.0.0.1", timeout: Optional[float] = None,
           env_for: Optional[Callable[[int], dict]] = None, python: bool = True,
           quiet: Optional[Sequence[bool]] = None) -> int:
    """Run ``python argv...`` (``python`` False: the command ``argv``) as ``num_processes``
    processes of one distributed job on this machine; ``env_for(i)``: more environment
    variables for process i; ``quiet[i]``: discard process i's output. As soon as one process
    fails, every other one is stopped (SIGTERM, then SIGKILL after ``GRACE_SECONDS``) and its
    exit status is returned (128 + N for a process killed by signal N); 0 when all succeed.
    ``timeout`` (seconds): stop them all and raise subprocess.TimeoutExpired."""
    procs = []
    deadline = None if timeout is None else time.monotonic() + timeout
    command = [sys.executable, *argv] if python else list(argv)
    try:
        for pid in range(num_processes):
            env = dict(os.environ, **{ENV_COORDINATOR: f"{host}:{port}",
                                      ENV_NUM_PROCESSES: str(num_processes), ENV_PROCESS_ID: str(pid)},
                       **(env_for(pid) if env_for else {}))
            out = subprocess.DEVNULL if quiet and quiet[pid] else None
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=out))
        while True:
            codes = [p.poll() for p in procs]
            failed = next((c for c in codes if c), None)
            if failed is not None:
                return 128 - failed if failed < 0 else failed
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
            time.sleep(0.05)
    finally:
        _stop(procs)


GRACE_SECONDS = 5.0   # between SIGTERM and SIGKILL when launch stops its processes


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """Stop the processes still running: SIGTERM, then SIGKILL those left after the grace."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    end = time.monotonic() + GRACE_SECONDS
    for p in running:
        try:
            p.wait(timeout=max(end - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
