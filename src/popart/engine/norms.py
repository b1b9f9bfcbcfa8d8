"""How an optimizer's clipping and norm-based rules see gradients: the engine's side of the
optimizer parts (``popart.optimizers`` imports these; an engine whose gradients span devices,
IPUs or replica shards, passes its own :class:`GradientNorms`)."""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

Array = Any  # jax.Array or np.ndarray


def local_sum_squares(x: Array) -> Array:
    """The sum of the squares of a tensor's elements (on this device)."""
    return jnp.sum(jnp.square(x))


class GradientNorms:
    """How clipping sees gradients: ``sum_squares(ids, g)`` of a group of weights and
    ``scale(ids, g, factor)``. This one holds whole tensors on one device; engines whose
    gradients span devices (IPUs, replica shards) supply their own."""

    def sum_squares(self, ids: list[str], g: Mapping[str, Array]) -> Array:
        return sum(jnp.sum(jnp.square(g[i])) for i in ids)

    def scale(self, ids: list[str], g: Mapping[str, Array], factor: Array) -> dict[str, Array]:
        return {**g, **{i: g[i] * factor for i in ids}}
