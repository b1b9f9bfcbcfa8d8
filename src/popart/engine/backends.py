"""Backends: what the engine knows about one platform, in one object per platform.

As JAX's ``mlir.register_lowering(..., platform=)`` and onnxruntime's kernel registry per
execution provider: the op registry holds a generic lowering of each op and, per platform,
overrides (``registry.register(..., platform="cpu")``); a :class:`Backend`, chosen with the
placement (``backend(placement.platform)``), holds the rest of a platform's knowledge: which
ops are costly to vectorise, its remote buffers' memory kind, the custom calls its overrides
emit, whether its compiler keeps optimisation barriers. A new platform is a row of
``BACKENDS`` (and overrides registered for it), with no edit of a lowering, the step builder
or a session. See docs/op_registry.md."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..ops import registry
from . import onednn

CONV_OPS = frozenset({"Conv", "ConvTranspose", "MultiConv"})


@dataclass(frozen=True)
class Backend:
    """One platform's knowledge (a row of ``BACKENDS``)."""

    platform: str                      # "cpu", "gpu", ... (the placement's device platform)
    # Op types whose graphs run micro-batch by micro-batch rather than vectorised over batches
    # (XLA's CPU convolutions run slower on wider batches: cache).
    costly_to_vectorise: frozenset = frozenset()
    # Memory kind of popxl's remote buffers (POPXL_REMOTE_MEMORY_KIND=auto): host memory where
    # the device has its own; on the CPU the device memory is the host's.
    remote_buffer_memory: str = "pinned_host"
    # Custom-call targets the platform's overrides may emit, and what registers them (a
    # program loaded from a serialized module calls it before compiling).
    custom_call_targets: tuple = ()
    load_custom_calls: Optional[Callable[[], object]] = None
    # Whether XLA keeps optimisation barriers until it schedules (recomputation is kept apart
    # from the forward pass by one; elsewhere by a conditional).
    keeps_barriers: bool = False

    def lookup(self, domain: str, op_type: str, version: int) -> registry.OpDef:
        """The lowering of ``op_type`` on this platform: its override, else the generic one."""
        return registry.lookup(domain, op_type, version, platform=self.platform)

    def vector_budget(self, op_types: set) -> int:
        """Activation bytes a vectorised chunk of a graph with ``op_types`` may hold."""
        return 1 if self.costly_to_vectorise & set(op_types) else 1 << 26


BACKENDS: dict[str, Backend] = {b.platform: b for b in (
    Backend("cpu", costly_to_vectorise=CONV_OPS, remote_buffer_memory="device",
            custom_call_targets=onednn.TARGETS, load_custom_calls=onednn.available),
    *(Backend(p, keeps_barriers=True) for p in ("gpu", "cuda", "rocm", "tpu")),
)}


def backend(platform: str) -> Backend:
    """The backend of ``platform``; one with no overrides for a platform without a row."""
    return BACKENDS.get(platform) or Backend(platform)


def custom_call_targets() -> tuple:
    """Every backend's custom-call targets (those a serialized program may hold)."""
    return tuple(t for b in BACKENDS.values() for t in b.custom_call_targets)


def load_custom_calls(module: bytes) -> None:
    """Register the custom calls a serialized ``module`` holds, before it is compiled."""
    for b in BACKENDS.values():
        if b.load_custom_calls and any(t.encode() in module for t in b.custom_call_targets):
            b.load_custom_calls()
