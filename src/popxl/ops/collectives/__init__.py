"""popxl.ops.collectives: across replicas, within the groups of a :class:`popxl.ReplicaGrouping`
(ai.graphcore ReplicatedAllReduce / ReplicatedReduceScatter / ReplicatedAllGather), and across
the IPUs of one replica (ai.graphcore AllReduce); the lowerings are in
``popart/ops/collectives.py``. The submodules are PopXL's (``collectives.collectives`` holds
``CollectiveOps``, ``OP_MAP`` and ``to_collective_op``)."""
from .all_reduce import all_reduce, all_reduce_identical_grad_inputs, all_reduce_identical_inputs
from .collectives import CommGroup, CommGroupType
from .replicated_all_gather import replicated_all_gather
from .replicated_all_reduce import replicated_all_reduce, replicated_all_reduce_
from .replicated_reduce_scatter import replica_sharded_slice, replicated_reduce_scatter, replicated_slice

__all__ = ["all_reduce", "all_reduce_identical_inputs", "all_reduce_identical_grad_inputs", "CommGroup",
           "CommGroupType", "replicated_all_gather", "replicated_all_reduce", "replicated_all_reduce_",
           "replicated_reduce_scatter", "replica_sharded_slice", "replicated_slice"]
