"""The engine: IR -> one compiled XLA program per session.

The package traces, compiles and runs with 64-bit types (ONNX models use int64 and float64),
but only inside its own calls: :func:`x64` scopes JAX's ``enable_x64`` to them, so other JAX
code in the process keeps JAX's defaults."""
from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager, TypeVar

import jax
import numpy as np

F = TypeVar("F", bound=Callable[..., Any])

# Host dtypes that reach a program as they are only inside :func:`x64` (a run moving none of
# them may skip the scope: the program was compiled in it either way).
WIDE_DTYPES = frozenset(np.dtype(t) for t in (np.int64, np.uint64, np.float64, np.complex128))


def x64() -> ContextManager:
    """JAX with 64-bit types enabled, for the extent of a ``with`` block (this thread)."""
    if hasattr(jax, "enable_x64"):   # jax >= 0.7
        return jax.enable_x64(True)
    from jax.experimental import enable_x64   # the same scoped setting on older JAX
    return enable_x64(True)


def in_x64(fn: F) -> F:
    """``fn`` run inside :func:`x64` (for the package's entry points into JAX)."""
    @functools.wraps(fn)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with x64():
            return fn(*args, **kwargs)
    return scoped  # type: ignore[return-value]


def serialised(method: F) -> F:
    """A session method run holding the session's ``_lock``, inside :func:`x64`: one call into
    a session at a time (popart and popxl sessions alike)."""
    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock, x64():
            return method(self, *args, **kwargs)
    return locked  # type: ignore[return-value]
