"""Replicated tensor sharding (RTS) of a popart session's step: PopART's
``TensorLocation.replicatedTensorSharding`` for the weights, optimizer state and gradient
accumulators, and off-chip (``pinned_host``) storage from the same settings (:func:`choose`),
and how the step moves between whole and sharded forms (:class:`StateSharding`). A sharded
tensor follows the one rule of ``engine/state.py`` (``ReplicaShards``). See
docs/replication.md (what the step does, which tensors are sharded)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from ..errors import OptionError
from ..logging import getLogger
from ..tensornames import PREFIXES
from .config import ACCUM, STATE, WEIGHTS, Location, Locations
from .compiled import REPLICA_AXIS, Placement, arg_specs
from .placed import run_on_mesh
from .state import HOST_MEMORY, Home, ReplicaShards

_logger = getLogger("session")
STATE_PREFIXES = tuple(PREFIXES[k] for k in ("Accl", "Accl1", "Accl2", "Accl3"))
SHARED_PREFIX = PREFIXES["Accl"]   # optimizer state and accumulator (SGD)
ACCUM_PREFIX = PREFIXES["Accum"]


@dataclass
class StateSharding:
    """A popart step's weights and optimizer state over the replicas: where each is kept
    (``homes``: sharded, off chip) and how the step moves between whole and sharded forms.
    Nothing sharded (the default) leaves every tensor and the step as they are."""
    placement: Placement
    shapes: dict[str, tuple] = field(default_factory=dict)   # full shape of each tensor below
    homes: dict[str, Home] = field(default_factory=dict)     # weights and owned state: where kept
    owner: dict[str, str] = field(default_factory=dict)      # optimizer state id -> its weight
    sharded_update: frozenset = frozenset()   # trained weights updated on their shards
    scattered: frozenset = frozenset()   # trained weights with sharded gradient accumulators

    @property
    def stored(self) -> frozenset:
        """The weights and optimizer state kept sharded."""
        return frozenset(k for k, h in self.homes.items() if h.shards is not None)

    @property
    def off_chip(self) -> frozenset:
        """The weights and optimizer state kept in host memory."""
        return frozenset(k for k, h in self.homes.items() if h.memory_kind == HOST_MEMORY)

    @property
    def R(self) -> int:
        return self.placement.replication_factor

    def shards(self, shape: tuple) -> ReplicaShards:
        """The shards of a tensor (or a placed slot's block) of ``shape`` over the replicas."""
        return ReplicaShards.over_all(shape, self.R)

    # ------------------------------------------------------------------ in the step
    def _constrain(self, x: Any, sharded: bool) -> Any:
        if self.placement.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self._sharding(sharded))

    def shard(self, x: Any) -> Any:
        """A whole tensor as its shards: flattened, zero-padded, split over the replicas."""
        return self._constrain(self.shards(jnp.shape(x)).flat(jnp.asarray(x)), True)

    def unshard(self, x: Any, shape: tuple) -> Any:
        """The inverse of :meth:`shard` (an all-gather)."""
        return self.shards(shape).whole(self._constrain(x, False))

    def gather(self, tree: Mapping[str, Any]) -> dict:
        """Every tensor of ``tree`` whole (sharded ones all-gathered)."""
        return {k: self.unshard(v, self.shapes[k]) if k in self.stored else v
                for k, v in tree.items()}

    def store(self, tree: Mapping[str, Any]) -> dict:
        """Whole tensors in their stored form (the inverse of :meth:`gather`)."""
        return {k: self.shard(v) if k in self.stored else v for k, v in tree.items()}

    def accumulators(self, weights: Mapping[str, Any]) -> dict:
        """Zero gradient accumulators of these (whole) weights: shards where the accumulator
        is sharded, one whole tensor per replica ([R, ...], each on its replica's device)
        for the other weights updated on shards, else one whole tensor."""
        def zeros(k: str, v: Any) -> Any:
            if k in self.scattered:
                return self.shard(jnp.zeros_like(v))
            if k in self.sharded_update:
                return self._constrain(jnp.zeros((self.R,) + jnp.shape(v), v.dtype), True)
            return jnp.zeros_like(v)
        return {k: zeros(k, v) for k, v in weights.items()}

    def reduce_replicas(self, grads: Mapping[str, Any]) -> dict:
        """The replica reduction of a micro-batch's gradients [R, ...]: reduce-scattered into
        the shards of a sharded accumulator, kept per replica for the other weights updated
        on shards (reduce-scattered once, in :meth:`update`), else summed (all-reduce)."""
        return {k: self._reduce_scatter(v) if k in self.scattered else
                v if k in self.sharded_update else jnp.sum(v, axis=0) for k, v in grads.items()}

    def _reduce_scatter(self, v: Any) -> Any:
        """Per-replica tensors [R, ...] (replica r's on its device) summed into shards."""
        rows = self.shards(v.shape[1:]).flat(v, 1)
        if self.placement.mesh is None:
            return jnp.sum(rows, axis=0)
        P = jax.sharding.PartitionSpec
        return run_on_mesh(lambda r: jax.lax.psum_scatter(r[0], REPLICA_AXIS, tiled=True),
                           self.placement.mesh, P(REPLICA_AXIS), P(REPLICA_AXIS))(rows)

    def update(self, apply: Callable, weights: Mapping[str, Any], grads: Mapping[str, Any],
               state: Mapping[str, Any], hyper: Mapping[str, Any]) -> tuple[dict, dict]:
        """``apply`` (``Optimizer.apply``) on the stored ``weights`` with the accumulated
        ``grads`` (as :meth:`reduce_replicas` leaves them): the weights in
        ``sharded_update`` with their gradients and state as shards, the rest whole.
        Returns (weights, state) in their stored forms."""
        def on_shards(k: str) -> bool:   # a weight, or a state tensor of a weight
            return self.owner.get(k, k) in self.sharded_update

        def view(k: str, v: Any) -> Any:   # stored form -> what the update takes
            return self.shard(v) if on_shards(k) and k not in self.stored else v

        def back(k: str, v: Any) -> Any:   # what the update gives -> stored form
            return self.unshard(v, self.shapes[k]) if on_shards(k) and k not in self.stored else v

        def grad(k: str, v: Any) -> Any:
            if k in self.scattered:   # shards already
                return v if on_shards(k) else self.unshard(v, self.shapes[k])
            return self._reduce_scatter(v) if on_shards(k) else v

        new_w, new_s = apply({k: view(k, v) for k, v in weights.items()},
                             {k: grad(k, v) for k, v in grads.items()},
                             {k: view(k, v) for k, v in state.items()}, hyper)
        return {k: back(k, v) for k, v in new_w.items()}, {k: back(k, v) for k, v in new_s.items()}

    # ------------------------------------------------------------------ host and placement
    def _sharding(self, sharded: bool) -> jax.sharding.Sharding:
        if self.placement.mesh is None or not sharded:
            return self.placement.sharding()
        return jax.sharding.NamedSharding(self.placement.mesh, jax.sharding.PartitionSpec(REPLICA_AXIS))

    def target(self, k: str) -> jax.sharding.Sharding:
        """Where tensor ``k`` is stored: sharded or not, in host memory when off-chip."""
        sharding = self._sharding(k in self.stored)
        return sharding.with_memory_kind(HOST_MEMORY) if k in self.off_chip else sharding

    def put(self, named: Mapping[str, Any]) -> dict:
        """Host arrays by tensor id on the device(s), sharded ones as shards (each process
        places its own replicas' shards)."""
        whole = {k: v for k, v in named.items() if k not in self.stored}
        out = dict(self.placement.put(whole)) if whole else {}
        for k in self.stored & set(named):
            flat = self.shards(np.shape(named[k])).flat(np.asarray(named[k]))
            out[k] = jax.make_array_from_callback(flat.shape, self._sharding(True),
                                                  lambda idx, f=flat: f[idx])
        for k in self.off_chip & set(named):
            out[k] = jax.device_put(out[k], self.target(k))
        return {k: out[k] for k in named}

    def to_host(self, state: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Device arrays by tensor id as whole host arrays."""
        out = {}
        for k, v in state.items():
            if k in self.stored and not getattr(v, "is_fully_addressable", True):
                v = multihost_utils.process_allgather(v, tiled=True)   # other processes' shards
            host = Placement.to_host(v)
            out[k] = self.shards(self.shapes[k]).whole(host) if k in self.stored else host
        return out

    def specs(self, named: Mapping[str, Any]) -> dict:
        """ShapeDtypeStruct of each tensor's stored form."""
        return {k: jax.ShapeDtypeStruct((self.shards(np.shape(v)).padded,), jnp.result_type(v))
                if k in self.stored else arg_specs(v) for k, v in named.items()}

    def shardings(self, names: Any) -> Any:
        """The step's in/out sharding of a weights or state argument with these ids."""
        names = list(names)
        if not (self.stored | self.off_chip) & set(names):
            return self.placement.sharding()
        return {k: self.target(k) for k in names}


# ---------------------------------------------------------------------- choosing tensors
def choose(locations: Optional[Locations], placement: Placement, variables: Mapping[str, Any],
           opt_state: Mapping[str, Any], trainable: list[str], accumulation_factor: int) -> StateSharding:
    """Where the tensor location settings keep each weight and optimizer state tensor
    (docs/replication.md)."""
    if locations is None:
        return StateSharding(placement)
    settings, overrides = locations.rules, locations.overrides
    accumulating = accumulation_factor > 1
    owner = {p + w: w for w in trainable for p in STATE_PREFIXES
             if p + w in opt_state and np.shape(opt_state[p + w]) == np.shape(variables[w])}

    def kind(tid: str) -> str:
        if tid.startswith(ACCUM_PREFIX) or (accumulating and tid.startswith(SHARED_PREFIX)):
            return ACCUM
        return STATE if tid in owner else WEIGHTS

    def location(tid: str) -> tuple[Location, str]:
        """(tid's location, checked; the kind whose settings' minimums apply: the shared
        Accl___'s are the optimizer state's)."""
        k = kind(tid)
        loc = overrides.get(tid, settings[k].location)
        if loc.error:
            raise OptionError(loc.error)
        return loc, STATE if tid in owner else k

    def sharded(tid: str, shape: tuple) -> bool:
        loc, k = location(tid)
        return loc.sharded and (k == ACCUM or int(np.prod(shape)) >= settings[k].min_sharded)

    def off_chip(tid: str, shape: tuple) -> bool:
        loc, k = location(tid)
        return loc.off_chip and int(np.prod(shape)) >= settings[k].min_off_chip

    shapes = {**{k: np.shape(v) for k, v in variables.items()},
              **{k: np.shape(opt_state[k]) for k in owner}}
    stored = {k for k, s in shapes.items() if sharded(k, s)}
    accum = {w for w in trainable if accumulating and sharded(ACCUM_PREFIX + w, shapes[w])}
    host = frozenset(k for k, s in shapes.items() if off_chip(k, s))
    if host and not _has_host_memory(placement):
        _logger.info(f"OffChip tensors {sorted(host)} stay resident in device memory: the "
                     f"{placement.platform} devices have no '{HOST_MEMORY}' memory")
        host = frozenset()
    elif host:
        _logger.info(f"OffChip: {sorted(host)} kept in {HOST_MEMORY} memory, moved to the "
                     f"device for each step and back")
    def homes(sharded: set) -> dict[str, Home]:
        return {k: Home(shards=ReplicaShards.over_all(s, placement.replication_factor)
                        if k in sharded else None, memory_kind=HOST_MEMORY if k in host else None)
                for k, s in shapes.items()}

    if not (stored or accum):
        return StateSharding(placement, shapes=shapes, homes=homes(set()))
    if placement.replication_factor <= 1:
        _logger.warn(f"Unable to shard tensors {sorted(stored | accum)} due to lack of "
                     f"replication (replicated tensor sharding needs {locations.name('replicas')} > 1)")
        return StateSharding(placement, shapes=shapes, homes=homes(set()))
    for s, w in owner.items():
        if w in stored and s not in stored:
            raise OptionError(
                f"Weight '{w}' is replica-sharded but its optimizer state '{s}' is not: the "
                f"update modifies a sharded tensor, but not all required sharded inputs could "
                f"be connected. Adjust the replicated tensor sharding settings: expected "
                f"{locations.name(kind(s))} to shard '{s}' too ({locations.name('sharded')}, "
                f"{locations.name('min_sharded')} <= {int(np.prod(shapes[s]))}), got "
                f"{settings[kind(s)].text}")
    update = (stored & set(trainable)) | {owner[s] for s in stored if s in owner}
    _logger.info(f"Replicated tensor sharding over {placement.replication_factor} replicas: "
                 f"{sorted(stored)} stored sharded, accumulators of {sorted(accum)} sharded")
    return StateSharding(placement, shapes=shapes, homes=homes(stored), owner=owner,
                         sharded_update=frozenset(update), scattered=frozenset(accum))


def _has_host_memory(placement: Placement) -> bool:
    """Whether every device of the placement has the host memory kind."""
    devices = [d for d in (placement.devices or [placement.device])
               if d.process_index == jax.process_index()]
    try:
        return all(HOST_MEMORY in {m.kind for m in d.addressable_memories()} for d in devices)
    except Exception:   # a backend without memory kinds
        return False
