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

from typing import Any, Optional

import numpy as np

from . import distributed
from .errors import popart_exception
from .options import ReductionType

def init() -> None:
    """Join the job: the one ``popart launch`` started (``import popart`` has joined it
    already), or one a Horovod / MPI launcher started (rank variables, plus the coordinator
    from ``POPART_DIST_COORDINATOR`` or ``MASTER_ADDR`` / ``MASTER_PORT``). Without either,
    a job of one process. A rank that fails then ends at once, without waiting for the
    others (docs/multiprocess.md)."""
    distributed.join("hvd.init")


def size() -> int:
    """Processes in the job."""
    return distributed.process_count()


def rank() -> int:
    """This process's index in the job."""
    return distributed.process_index()


def local_rank() -> int:
    """This process's index among the job's processes on this host."""
    ranks = distributed.launcher_ranks()
    return ranks[2] if ranks is not None else rank()


def local_size() -> int:
    """The job's processes on this host."""
    ranks = distributed.launcher_ranks()
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
