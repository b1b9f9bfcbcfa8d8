"""``popdist``: what programs started by PopRun ask about their instance, on JAX's distributed
runtime.

PopRun started one instance (process) of a program per group of replicas and told each, through
``POPDIST_*`` environment variables, how many instances and replicas the job has and which are
its own. ``poprun`` (this package's console script, see :mod:`popdist.poprun`) sets the same
variables and makes the instances one ``jax.distributed`` job, so ``popdist.popart.
configureSessionOptions`` gives a session global replication across them."""
from __future__ import annotations

import os

ENV = {"instances": "POPDIST_NUM_INSTANCES", "index": "POPDIST_INSTANCE_INDEX",
       "replicas": "POPDIST_NUM_TOTAL_REPLICAS", "offset": "POPDIST_REPLICA_INDEX_OFFSET",
       "local": "POPDIST_NUM_LOCAL_REPLICAS", "ipus": "POPDIST_NUM_IPUS_PER_REPLICA"}


def _get(key: str, default: int) -> int:
    value = os.environ.get(ENV[key], "")
    try:
        return int(value) if value else default
    except ValueError:
        from popart.errors import popart_exception
        raise popart_exception(f"{ENV[key]} must be an integer, got {value!r}") from None


def isPopdistEnvSet() -> bool:
    """Whether the program was started by ``poprun`` (or its variables are set)."""
    return ENV["instances"] in os.environ


def isUsingPopdist() -> bool:
    return isPopdistEnvSet()


def init() -> None:
    """Join the job's distributed runtime: ``import popart`` has joined it already when this
    package's ``poprun`` started the process; under an MPI launcher (PopRun's own) the rank
    comes from Open MPI's variables and the coordinator from ``MASTER_ADDR`` /
    ``MASTER_PORT`` (``popart.horovod.init``'s rules)."""
    from popart import distributed
    distributed.join("popdist.init")


def getNumInstances() -> int:
    return _get("instances", 1)


def getInstanceIndex() -> int:
    return _get("index", 0)


def getNumTotalReplicas() -> int:
    return _get("replicas", getNumLocalReplicas() * getNumInstances())


def getNumLocalReplicas() -> int:
    return _get("local", 1)


def getReplicaIndexOffset() -> int:
    return _get("offset", getInstanceIndex() * getNumLocalReplicas())


def getNumIpusPerReplica() -> int:
    return _get("ipus", 1)


def getDeviceId() -> int:
    """The id of the device holding this instance's IPUs (the first group of their size)."""
    return 0
