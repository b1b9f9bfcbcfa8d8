"""``popart.horovod``: the user guide's Horovod PopART extension (``horovod.popart``, section
5) on JAX's distributed runtime.

A program written for it runs with one changed import line, ``import popart.horovod as hvd``.
Each Horovod rank is a process of one ``jax.distributed`` job (started by ``popart launch -n N``,
or by another launcher that sets Horovod's or Open MPI's rank variables together with
``POPART_DIST_COORDINATOR`` or ``MASTER_ADDR`` / ``MASTER_PORT``). Instead of copying gradients to
the host for Horovod's all-reduce, :meth:`DistributedOptimizer.insert_host_allreduce` makes the
session a global replica of the job (``enableDistributedReplicatedGraphs``): the gradients are
averaged across the processes inside the compiled step, as Horovod's averaging all-reduce
does, so every rank applies the same update."""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from . import distributed
from .errors import popart_exception
from .options import ReductionType

# Rank variables of the launchers Horovod programs use: (rank, size, local rank, local size).
_RANK_VARIABLES = (("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
                   ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                   ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


def _launcher_ranks() -> Optional[tuple[int, int, int, int]]:
    for names in _RANK_VARIABLES:
        if names[0] in os.environ and names[1] in os.environ:
            rank, size = int(os.environ[names[0]]), int(os.environ[names[1]])
            return (rank, size, int(os.environ.get(names[2], rank)),
                    int(os.environ.get(names[3], size)))
    return None


def init() -> None:
    """Join the job: the one ``popart launch`` started (``import popart`` has joined it
    already), or one a Horovod / MPI launcher started (rank variables, plus the coordinator
    from ``POPART_DIST_COORDINATOR`` or ``MASTER_ADDR`` / ``MASTER_PORT``). Without either,
    a job of one process."""
    if distributed.is_distributed() or distributed.initialize_from_env():
        return
    ranks = _launcher_ranks()
    if ranks is None or ranks[1] == 1:
        return
    coordinator = os.environ.get(distributed.ENV_COORDINATOR)
    if coordinator is None and "MASTER_ADDR" in os.environ:
        coordinator = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '12355')}"
    if coordinator is None:
        raise popart_exception(
            f"hvd.init: rank {ranks[0]} of {ranks[1]} processes, but no coordinator address: "
            f"set {distributed.ENV_COORDINATOR} (host:port of rank 0) or MASTER_ADDR / "
            f"MASTER_PORT, or start the processes with `popart launch -n {ranks[1]} ...`")
    distributed.initialize(coordinator, ranks[1], ranks[0])


def size() -> int:
    """Processes in the job."""
    return distributed.process_count()


def rank() -> int:
    """This process's index in the job."""
    return distributed.process_index()


def local_rank() -> int:
    """This process's index among the job's processes on this host."""
    ranks = _launcher_ranks()
    return ranks[2] if ranks is not None else rank()


def local_size() -> int:
    """The job's processes on this host."""
    ranks = _launcher_ranks()
    return ranks[3] if ranks is not None else size()


class DistributedOptimizer:
    """``DistributedOptimizer(optimizer, session, userOptions)``: makes ``session`` (a
    TrainingSession whose options are ``userOptions``) average its gradients across the job's
    processes. The averaging is part of the compiled step: see :meth:`insert_host_allreduce`."""

    def __init__(self, optimizer: Any, session: Any, userOptions: Any) -> None:
        if not hasattr(session, "updateOptimizerFromHost"):
            raise popart_exception(f"DistributedOptimizer needs a popart.TrainingSession, got "
                                   f"{type(session).__name__}")
        self.optimizer, self.session, self.options = optimizer, session, userOptions

    def insert_host_allreduce(self) -> None:
        """Average the gradients across the processes: the session becomes global replica
        ``rank()`` of ``size()`` (``enableDistributedReplicatedGraphs``, Mean reduction). A
        session prepared already is compiled again, keeping its weights."""
        n = size()
        if n == 1:
            return
        s = self.session
        o = s.options
        local = s.replicationFactor
        o.enableDistributedReplicatedGraphs = True
        o.globalReplicationFactor = local * n
        o.globalReplicaOffset = local * rank()
        o.accumulationAndReplicationReductionType = ReductionType.Mean
        s._recompile()   # compiled for one process already: again, with the job's replicas

    def broadcast_weights(self, root_rank: int = 0) -> None:
        broadcast_weights(self.session, root_rank)


def broadcast_weights(session: Any, root_rank: int = 0) -> None:
    """Copy the weights of process ``root_rank`` to every process (the session is prepared
    first if it is not)."""
    if not session._prepared:
        session.prepareDevice()
    session.broadcastWeights(root_rank)


def allreduce(tensor: Any, average: bool = True, name: Optional[str] = None) -> np.ndarray:
    """The sum (``average``: the mean) of ``tensor`` over the processes, on the host."""
    x = np.asarray(tensor)
    if size() == 1:
        return x.copy()
    from jax.experimental import multihost_utils
    total = np.asarray(multihost_utils.process_allgather(x)).sum(axis=0)
    return (total / size()).astype(x.dtype) if average else total.astype(x.dtype)


def broadcast(tensor: Any, root_rank: int = 0, name: Optional[str] = None) -> np.ndarray:
    """``tensor`` of process ``root_rank``, on every process."""
    x = np.asarray(tensor)
    if size() == 1:
        return x.copy()
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.broadcast_one_to_all(x, is_source=rank() == root_rank))
