"""The documented test hook: what tests may ask of a session's engine.

This is not PopART API (PopART has no such module). It is the one place where tests look
below the public API of ``popart.InferenceSession`` / ``popart.TrainingSession`` and
``popxl.Session``: the planned step program, whether it runs placed (virtual graphs on their
own devices), its mesh, the compiled program and the device-side state. Tests use these
functions instead of a session's private attributes, so the engine's internals can change
without touching the tests.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

__all__ = ["step_program", "placed_plan", "compiled_step", "compiled", "is_placed", "mesh_shape",
           "mesh_devices", "device_values", "executable_source", "engine_loaded",
           "lowered_text", "count_transfers", "Transfers"]


def _is_popxl(session: Any) -> bool:
    return type(session).__module__.startswith("popxl")


def step_program(session: Any, fwd_only: bool = False) -> Any:
    """The engine's planned program: a popart session's ``StepProgram`` (after
    ``prepareDevice``; ``fwd_only``: the forward-only program of
    ``run("implicitPipeliningFwdOnly")``, after that run), or a ``popxl.Session``'s placed
    program (None when it runs unplaced)."""
    if _is_popxl(session):
        return session._placed
    program = session._fwd_program if fwd_only else session._program
    if program is None:
        raise RuntimeError("The session has no such program yet: call prepareDevice() "
                           "(or run the forward-only program) first")
    return program


def placed_plan(session: Any, fwd_only: bool = False) -> Any:
    """The plan of a program that runs placed, None when it runs unplaced: a popart
    session's ``engine.pipeline.PlacedPlan`` (``.executor``, ``.stages``, ``.schedule``, the
    state's slots: ``.weight_layout``, ``.rts_slots``, ...; ``fwd_only`` as in
    :func:`step_program`), or a ``popxl.Session``'s ``MainPlan``."""
    return step_program(session) if _is_popxl(session) else step_program(session, fwd_only).placed


def compiled_step(session: Any) -> Any:
    """The session's ``engine.compiled.CompiledStep`` (``.recorder``, ``.compile_seconds``)."""
    return session._step if _is_popxl(session) else step_program(session).step


def compiled(session: Any) -> Any:
    """JAX's compiled program (``memory_analysis()``, ``as_text()``)."""
    return compiled_step(session).compiled


def is_placed(session: Any) -> bool:
    """True when the program runs its virtual graphs (IPUs) on their own devices."""
    return placed_plan(session) is not None


def mesh_shape(session: Any) -> tuple:
    """The placed program's (replicas, ipus) mesh shape; () when it is not placed."""
    if not is_placed(session):
        return ()
    return tuple(placed_plan(session).mesh.devices.shape)


def mesh_devices(session: Any) -> list:
    """The devices the program runs on: the placed mesh's (replica-major), or the replicas'
    own devices (empty when the replicas share one device)."""
    if is_placed(session):
        return list(placed_plan(session).mesh.devices.flat)
    placement = session._placement if _is_popxl(session) else step_program(session).placement
    return list(placement.devices)


def device_values(session: Any, part: Optional[str] = None) -> dict:
    """The device-side state by name (``jax.Array`` values, as the engine keeps them: placed
    programs' slots and RTS shards included). A popart session's ``part`` picks
    ``"weights"`` or ``"optimizer"`` (state); None gives both in one dict. A popxl session
    has one kind (variables and remote buffers by key); it loads nothing."""
    if _is_popxl(session):
        if part is not None:
            raise ValueError("popxl sessions have no parts")
        return dict(session._dev or {})
    weights, state = session._device_state()
    if part is None:
        return {**weights, **state}
    return dict({"weights": weights, "optimizer": state}[part])


def executable_source(session: Any) -> str:
    """Where the session's program came from: "compiled", "compiled (cached)", "engine
    cache" or "executable" (``engine.executable.compile_step``)."""
    if _is_popxl(session):
        return session.executable_source
    return str(session._summary.get("executable_source", ""))


def engine_loaded(session: Any) -> bool:
    """True when a popart session's weights and optimizer state are on the device (the
    engine is loaded: prepareDevice(loadEngine=False) leaves it unloaded, a run loads it)."""
    return session._dev is not None


def lowered_text(session: Any) -> str:
    """The step as StableHLO text, before XLA optimises it (``CompiledStep.export``)."""
    import jax
    return jax.export.deserialize(compiled_step(session).export()).mlir_module()


@dataclass
class Transfers:
    """What crossed between host and device under :func:`count_transfers`: the number of
    arrays and their bytes each way, and each transfer's (shape, dtype) in ``log``."""
    to_device: int = 0
    to_device_bytes: int = 0
    to_host: int = 0
    to_host_bytes: int = 0
    log: list = field(default_factory=list)   # ("to_device" | "to_host", shape, dtype)

    def _add(self, way: str, shape: tuple, dtype: Any) -> None:
        import numpy as np
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        setattr(self, way, getattr(self, way) + 1)
        setattr(self, way + "_bytes", getattr(self, way + "_bytes") + nbytes)
        self.log.append((way, tuple(shape), np.dtype(dtype)))


_counting = threading.Lock()


@contextlib.contextmanager
def count_transfers() -> Iterator[Transfers]:
    """Count the host <-> device transfers made inside the ``with`` block (by any thread):
    host arrays given to ``jax.device_put``, ``jax.make_array_from_callback`` and
    ``jax.make_array_from_process_local_data`` (the package's ways onto the device), and
    device arrays the package reads back (``engine.compiled.fetch``, the one way to the host
    of both front-ends' state and outputs). Host arrays passed straight to a compiled program
    (a run's inputs) are not counted. One counter at a time."""
    import jax
    import numpy as np
    from .engine import compiled as _compiled

    counts = Transfers()
    host_types = (np.ndarray, np.generic, int, float, bool, complex)

    def count_leaves(tree: Any) -> None:
        for x in jax.tree_util.tree_leaves(tree):
            if isinstance(x, host_types):
                counts._add("to_device", np.shape(x), np.result_type(x))

    put, from_callback, from_local = (jax.device_put, jax.make_array_from_callback,
                                      jax.make_array_from_process_local_data)

    def device_put(x: Any, *args: Any, **kwargs: Any) -> Any:
        count_leaves(x)
        return put(x, *args, **kwargs)

    def make_array_from_callback(shape: Any, sharding: Any, callback: Any, *args: Any, **kw: Any) -> Any:
        out = from_callback(shape, sharding, callback, *args, **kw)
        counts._add("to_device", out.shape, out.dtype)
        return out

    def make_array_from_process_local_data(sharding: Any, local: Any, *args: Any, **kw: Any) -> Any:
        count_leaves(local)
        return from_local(sharding, local, *args, **kw)

    def fetched(values: Any) -> None:
        for x in values:
            if isinstance(x, jax.Array):
                counts._add("to_host", x.shape, x.dtype)

    if not _counting.acquire(blocking=False):
        raise RuntimeError("count_transfers is counting already (one counter at a time)")
    jax.device_put, jax.make_array_from_callback = device_put, make_array_from_callback
    jax.make_array_from_process_local_data = make_array_from_process_local_data
    _compiled.FETCH_HOOKS.append(fetched)
    try:
        yield counts
    finally:
        jax.device_put, jax.make_array_from_callback = put, from_callback
        jax.make_array_from_process_local_data = from_local
        _compiled.FETCH_HOOKS.remove(fetched)
        _counting.release()
