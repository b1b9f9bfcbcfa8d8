"""How a popart step's device state is packed, chosen with the placement: :class:`GlobalArrays`
(unplaced: one global array per tensor with its NamedSharding, or its shards by the RTS rule,
``rts.StateSharding``) or ``pipeline.PlacedPlan`` (placed: the weights' and the optimizer
state's ``IpuSlots`` blocks, packed, unpacked, specified and sharded by
``placed.ExecutorPlan``, the placed packing popxl's ``_placement.MainPlan`` shares). Both are
built on each tensor's ``state.Home`` and answer the same questions (:class:`Packing`);
``StepProgram`` asks the one it was planned with."""
from __future__ import annotations

from typing import Any, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from .compiled import CompiledStep, Placement
from .hoist import HoistedStep, wanted as hoist_wanted
from .step import ScanSchedule, StepParts, infer_step, train_step, vectorised_inference

FEED_REPLICA_DIM = 2   # a step's inputs are [batches_per_step, accumulation, replicas, ...]


class Packing(Protocol):
    """A step's device state packing."""
    by_id: bool   # the packed state is a dict by tensor id (a tensor crosses alone)

    def put(self, tree: Any) -> Any:
        """The RNG key or hyper-parameters on the replicas' device(s)."""

    def put_state(self, named: Mapping[str, np.ndarray]) -> Any:
        """Weights or optimizer state (host arrays by tensor id), packed on the device(s)."""

    def state_to_host(self, state: Any) -> dict[str, np.ndarray]:
        """The inverse of :meth:`put_state`: whole host arrays by tensor id."""

    def state_specs(self, named: Mapping[str, Any]) -> Any:
        """The ShapeDtypeStruct tree of :meth:`put_state` for these host arrays."""

    def put_feeds(self, feeds: Mapping[str, np.ndarray]) -> dict:
        """A step's inputs [B, A, R, ...] on the device(s)."""

    def holds(self, part: Any, like: Mapping[str, Any]) -> bool:
        """``part`` (device state) is packed as :meth:`put_state` packs ``like``."""

    def compiled_step(self, parts: StepParts, key_spec: Any) -> CompiledStep:
        """The step of ``parts``, jitted with this packing's shardings."""


class GlobalArrays:
    """The unplaced packing: by tensor id, each a global array on every replica's device, or
    its shards over the replicas (replicated tensor sharding), off-chip ones in host memory
    (``rts.StateSharding``: each tensor's ``Home``); the step is ``step.train_step`` with
    the scan schedule, or inference's vectorised micro-batches."""
    by_id = True

    def __init__(self, placement: Placement, rts: Any) -> None:
        self.placement, self.rts = placement, rts

    def put(self, tree: Any) -> Any:
        return self.placement.put(tree)

    def put_state(self, named: Mapping[str, np.ndarray]) -> Any:
        return self.rts.put(named)

    def state_to_host(self, state: Any) -> dict[str, np.ndarray]:
        return self.rts.to_host(state)

    def state_specs(self, named: Mapping[str, Any]) -> Any:
        return self.rts.specs(named)

    def put_feeds(self, feeds: Mapping[str, np.ndarray]) -> dict:
        return self.placement.put(dict(feeds), FEED_REPLICA_DIM)

    def holds(self, part: Any, like: Mapping[str, Any]) -> bool:
        specs, shardings = self.state_specs(like), self.rts.shardings(like)
        if set(part) != set(specs):
            return False
        for k, x in part.items():
            where = shardings[k] if isinstance(shardings, dict) else shardings
            if not (isinstance(x, jax.Array) and (x.shape, x.dtype) == (specs[k].shape, specs[k].dtype)
                    and x.sharding.is_equivalent_to(where, x.ndim)):
                return False
        return True

    def compiled_step(self, parts: StepParts, key_spec: Any) -> CompiledStep:
        """``(weights, opt_state, key, feeds, hyper) -> (weights, opt_state, key, anchors)``;
        for a graph that draws no random numbers (not ``parts.keyed``) the key stays outside
        (``(weights, opt_state, feeds, hyper) -> (weights, opt_state, anchors)``), one buffer
        fewer in and out of every run."""
        placement = self.placement
        state, feeds = placement.sharding(), placement.sharding(FEED_REPLICA_DIM)
        w = self.rts.shardings(parts.variables)
        s = self.rts.shardings(parts.plan.opt_state)
        if parts.cfg.training:
            step = train_step(parts, ScanSchedule(parts, placement))
        else:
            step = infer_step(parts, vectorised_inference(parts, placement))
        Step = HoistedStep if hoist_wanted(parts.cfg.training, parts.cfg.replication_factor) else CompiledStep
        if parts.keyed:
            return Step(step, donate_argnums=(0, 1, 2), in_shardings=(w, s, state, feeds, state),
                        out_shardings=(w, s, state, state))

        def keyless(weights, opt_state, feeds, hyper):   # any key: the graph never reads it
            weights, opt_state, _, anchors = step(weights, opt_state,
                                                  jnp.zeros(key_spec.shape, key_spec.dtype), feeds, hyper)
            return weights, opt_state, anchors
        return Step(keyless, donate_argnums=(0, 1), in_shardings=(w, s, feeds, state),
                    out_shardings=(w, s, state))
