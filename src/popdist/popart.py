"""``popdist.popart``: PopART session options and devices for an instance started by PopRun."""
from __future__ import annotations

from typing import Any

import popdist


def configureSessionOptions(opts: Any) -> None:
    """Global replication over the job's instances: this instance's local replicas
    (``replicatedGraphCount``) at its offset among all of them."""
    local = popdist.getNumLocalReplicas()
    if local > 1:
        opts.enableReplicatedGraphs = True
        opts.replicatedGraphCount = local
    if popdist.getNumInstances() > 1:
        opts.enableDistributedReplicatedGraphs = True
        opts.globalReplicationFactor = popdist.getNumTotalReplicas()
        opts.globalReplicaOffset = popdist.getReplicaIndexOffset()


def getDevice(ipus_per_replica: int = 0, *args: Any, **kwargs: Any) -> Any:
    """A device with this instance's IPUs (local replicas x IPUs per replica)."""
    import popart
    ipus = (ipus_per_replica or popdist.getNumIpusPerReplica()) * popdist.getNumLocalReplicas()
    return popart.DeviceManager().acquireAvailableDevice(ipus)
