"""Seeds for popxl's random ops: uint64 values held as two uint32 elements."""
from __future__ import annotations

import numpy as np

MAX_UINT64 = 2 ** 64 - 1


def create_seeds(seed: int, offset: int = 0, batches_per_step: int = 1,
                 gradient_accumulation_factor: int = 1, replicas: int = 1) -> np.ndarray:
    """Seed tensors derived from ``seed``: shape [batches_per_step,
    gradient_accumulation_factor, replicas, 2] with size-1 dimensions dropped."""
    n = batches_per_step * gradient_accumulation_factor * replicas
    seeds = np.random.default_rng(seed + offset).integers(0, MAX_UINT64, endpoint=True,
                                                          dtype="uint64", size=n)
    out = np.stack([np.array(uint64_to_two_uint32(int(s)), np.uint32) for s in seeds])
    return np.squeeze(out.reshape(batches_per_step, gradient_accumulation_factor, replicas, 2))


def uint64_to_two_uint32(num: int) -> tuple[int, int]:
    """(most significant 32 bits, least significant 32 bits) of a uint64."""
    if not 0 <= num <= MAX_UINT64:
        raise ValueError(f"Number is negative or cannot be represented as a uint64: {num}")
    return num >> 32, num & 0xFFFFFFFF


def two_uint32_to_uint64(a: int, b: int) -> int:
    if not (0 <= a < 2 ** 32 and 0 <= b < 2 ** 32):
        raise ValueError(f"Either `a` or `b` are negative or cannot be represented as a uint32: {a}, {b}")
    return (a << 32) | b
