"""Where tensors live: TensorStorage (tile memory or Streaming Memory), ReplicatedTensorSharding,
TensorLocation, and the TileSet / ExecutionContext enums of PopART's IR.

On XLA "Streaming Memory" is a remote buffer: storage the session keeps between runs outside
the step's working set (see :class:`popxl.RemoteBuffer`)."""
from __future__ import annotations

from enum import Enum

from popart.options import int_enum as _enum

#: The tile set an op runs on: Compute, IO (PopART's TileSet; Undefined and N as in its IR).
TileSet = _enum("TileSet", "Compute IO Undefined N")

#: The program fragment an op belongs to (PopART's ExecutionContext). popxl's
#: ``replica_sharded_variable`` loads its shard in the WeightsFromHostFragment and stores it
#: in the WeightsToHostFragment; on XLA those are the start and the end of every run.
ExecutionContext = _enum("ExecutionContext", "Normal AccumulateOuterFragment WeightsFromHostFragment "
                                             "WeightsToHostFragment OptimizerFromHostFragment Subgraph")


class TensorStorage(Enum):
    """Whether a tensor is stored on chip (tile memory) or off chip (Streaming Memory)."""

    OnChip = "OnChip"    #: Store the tensor in tile (device) memory.
    OffChip = "OffChip"  #: Store the tensor in Streaming Memory (a remote buffer).


class ReplicatedTensorSharding(Enum):
    """Whether a tensor is sharded over replicas."""

    On = "On"    #: Each replica holds one shard of the tensor.
    Off = "Off"  #: Each replica holds the whole tensor.


class TensorLocation:
    """The memory characteristics of one or more tensors: storage and sharding."""

    def __init__(self, storage: TensorStorage = TensorStorage.OnChip,
                 replicated_tensor_sharding: ReplicatedTensorSharding = ReplicatedTensorSharding.Off) -> None:
        self._storage = TensorStorage(storage)
        self._replicated_tensor_sharding = ReplicatedTensorSharding(replicated_tensor_sharding)

    @property
    def storage(self) -> TensorStorage:
        return self._storage

    @property
    def replicated_tensor_sharding(self) -> ReplicatedTensorSharding:
        return self._replicated_tensor_sharding

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorLocation) and \
            (self._storage, self._replicated_tensor_sharding) == (other._storage, other._replicated_tensor_sharding)

    def __hash__(self) -> int:
        return hash((self._storage, self._replicated_tensor_sharding))

    def __repr__(self) -> str:
        return (f"TensorLocation(storage={self._storage.name}, "
                f"replicated_tensor_sharding={self._replicated_tensor_sharding.name})")
