"""The compiled-step layer: the one way every front-end turns a traced graph into a program.

:class:`Placement` decides where a program's replicas run (one per device over a mesh axis
with ``shard_map``, or side by side with ``vmap`` under the same axis name, so collectives
work either way) and moves arrays there and back. :class:`CompiledStep` jits a step with
donated state and explicit shardings, compiles it ahead of time for fixed argument shapes
(from the step function, or from a serialized executable), exports it and runs it.
:func:`graph_function` is the one-shot path for helpers (``run_model``, the ONNX backend).

popart's InferenceSession / TrainingSession (``program.StepProgram``), ``popxl.Session``, the
ONNX backend and ``shapes.run_model`` are clients of this module; executable files and the
engine cache are in ``executable.py``.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import jax
import jax.export  # noqa: F401  (jax < 0.7 does not import it with jax)
import jax.numpy as jnp
import numpy as np

from ..errors import OutOfMemoryException, popart_exception, popart_runtime_error
from .._ir.graph import Graph
from .config import EngineConfig
from .lower import raise_failed_checks, trace
from . import backends, hooks as _hooks

REPLICA_AXIS = "replica"


def raise_as_popart(e: BaseException, what: str) -> None:
    """Raise XLA's own error ``e`` (out of memory, ...) as a popart error; any other
    exception as it is. Call it from an ``except`` clause."""
    if isinstance(e, popart_exception) or not (
            isinstance(e, MemoryError) or type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError")):
        raise e
    msg = " ".join(str(e).split())
    if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in msg:   # whole: XLA's peak buffers
        raise OutOfMemoryException(f"{what}: out of memory ({str(e).strip()})") from None
    if len(msg) > 1200:   # keep the head and the tail, where a host callback's reason is
        msg = msg[:500] + " ... " + msg[-600:]
    raise popart_runtime_error(f"{what}: {msg}") from None


@contextlib.contextmanager
def xla_errors(what: str) -> Iterator[None]:
    """XLA's own errors (out of memory, ...) as popart errors (:func:`raise_as_popart`)."""
    try:
        yield
    except Exception as e:
        raise_as_popart(e, what)


# Called with the arrays of every fetch (``popart.testing.count_transfers`` counts them).
FETCH_HOOKS: list[Callable[[Sequence[Any]], None]] = []


def fetch(values: Sequence[Any], local: bool = False,
          get: Callable[[Any], np.ndarray] = np.asarray, what: str = "Running the step") -> list:
    """Device arrays as NumPy arrays, the one way to the host (replicated outputs: this
    process's copy; ``local``: the caller knows every array is whole in this process; ``get``:
    how to read one whole, e.g. ``distributed.global_value``), their copies to the host
    started together; the run's own errors surface here as popart errors named by ``what``
    (XLA runs asynchronously)."""
    for hook in FETCH_HOOKS:
        hook(values)
    try:
        if len(values) > 1:
            for x in values:
                if isinstance(x, jax.Array) and x.is_fully_addressable:
                    x.copy_to_host_async()
        if local or get is not np.asarray:
            return [get(x) for x in values]
        return [np.asarray(x) if getattr(x, "is_fully_addressable", True)
                else np.asarray(x.addressable_data(0)) for x in values]
    except Exception as e:
        raise_as_popart(e, what)
        raise   # not reached


def _first(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a[0], tree)


def _stack1(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a[None], tree)


class Placement:
    """Where a program's ``replication_factor`` replicas run, for the session's device
    (a ``popart.DeviceInfo`` whose ``jax_devices`` are its devices, or None: JAX's first).

    Replicas get distinct devices (a mesh with axis ``REPLICA_AXIS``) when the device has
    enough of them, or, for replicas spread over the processes of a distributed job
    (``processes`` > 1: global replication), each process's first local devices; otherwise
    they run side by side on one device."""

    def __init__(self, replication_factor: int, device_info: Any = None,
                 processes: int = 1) -> None:
        self.replication_factor = R = int(replication_factor)
        own = list(getattr(device_info, "jax_devices", None) or [])
        n = int(processes)
        self.across_processes = n > 1
        if n > 1:
            local = R // n
            devs = [d for p in range(n) for d in [d for d in jax.devices() if d.process_index == p][:local]]
            if len(devs) != R:
                raise popart_exception(f"Global replication needs {local} device(s) in each of "
                                       f"the {n} processes; some process has fewer")
        else:
            devs = own[:R] if R > 1 and len(set(own)) >= R else []
        self.devices: list = devs
        self.device = devs[0] if devs else (own or jax.local_devices())[0]
        self.mesh = jax.sharding.Mesh(np.array(devs), (REPLICA_AXIS,)) if devs else None

    @property
    def platform(self) -> str:
        """"cpu", "gpu", ...: where the program runs."""
        return self.device.platform

    def sharding(self, replica_dim: Optional[int] = None) -> jax.sharding.Sharding:
        """Arrays replicated on every replica's device (``replica_dim`` None), or split
        along dimension ``replica_dim`` (one slice per replica's device)."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(self.device)
        P = jax.sharding.PartitionSpec
        spec = P() if replica_dim is None else P(*([None] * replica_dim), REPLICA_AXIS)
        return jax.sharding.NamedSharding(self.mesh, spec)

    def replicate(self, fn: Callable, in_axes: Sequence[Optional[int]]) -> Callable:
        """``fn`` (one replica's function) for all replicas: each argument is shared
        (``in_axes`` None) or has the replicas on its leading dimension (0); every output
        gets the replicas on its leading dimension. One replica: called directly."""
        if any(ax not in (None, 0) for ax in in_axes):
            raise ValueError(f"in_axes must be None or 0, got {in_axes}")
        in_axes = tuple(in_axes)

        def per_replica(*args: Any) -> Any:   # arguments with a leading replica dim of 1
            return _stack1(fn(*[a if ax is None else _first(a) for a, ax in zip(args, in_axes)]))

        if self.mesh is not None:
            P = jax.sharding.PartitionSpec
            return jax.shard_map(per_replica, mesh=self.mesh,
                                 in_specs=tuple(P() if ax is None else P(REPLICA_AXIS) for ax in in_axes),
                                 out_specs=P(REPLICA_AXIS), check_vma=False)
        if self.replication_factor > 1:
            return jax.vmap(fn, in_axes=in_axes, axis_name=REPLICA_AXIS,
                            axis_size=self.replication_factor)
        return per_replica

    def put(self, tree: Any, replica_dim: Optional[int] = None) -> Any:
        """Place ``tree``'s arrays (see :meth:`sharding`). In a distributed job each process
        gives its local replicas' part."""
        sharding = self.sharding(replica_dim)
        if self.across_processes:
            return jax.tree_util.tree_map(
                lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)
        return jax.device_put(tree, sharding)

    @staticmethod
    def to_host(x: Any) -> np.ndarray:
        """A program output as a NumPy array (replicated outputs: this process's copy). The
        run's own errors surface here (XLA runs asynchronously)."""
        return fetch((x,))[0]


class Facts:
    """What only tracing a step learns (its run-time checks, every tensor's type, where its
    outputs are), returned by the traced function as a value: a static pytree (no leaves), so
    it comes back unchanged through ``jax.eval_shape``, ``vmap`` and ``shard_map``."""

    def __init__(self, **values: Any) -> None:
        self.values = values

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


jax.tree_util.register_static(Facts)


def plan_trace(step: Callable, *specs: Any) -> tuple[Any, dict]:
    """A step's facts from one abstract trace (``jax.eval_shape``) of ``step``, the step
    function built for planning: its last output is a :class:`Facts`. Returns (the other
    outputs' ShapeDtypeStructs, the facts). The step that is compiled is built without them
    and is given the facts instead, so a program loaded from the engine cache or an
    executable file has them without being traced."""
    *outs, facts = jax.eval_shape(step, *specs)
    return tuple(outs), dict(facts.values)


def arg_specs(tree: Any) -> Any:
    """jax.ShapeDtypeStruct of every array of ``tree``."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


class CompiledStep:
    """One program: ``fn`` jitted with ``in_shardings`` / ``out_shardings`` and its
    ``donate_argnums`` buffers donated (state that the step replaces), compiled ahead of time
    by :meth:`compile`, called as ``step(*args)``."""

    def __init__(self, fn: Callable, in_shardings: Sequence[Any], out_shardings: Any,
                 donate_argnums: Sequence[int] = ()) -> None:
        self.fn = fn
        self._jit_args = dict(in_shardings=tuple(in_shardings), out_shardings=out_shardings,
                              donate_argnums=tuple(donate_argnums))
        self.compiled: Any = None
        self.compile_seconds = 0.0
        self.compile_phases: dict[str, float] = {}
        self.recorder: Any = None   # the compile hooks' recorder (popart.report's), if any
        self._specs: Optional[tuple] = None
        self._jitted: Any = None

    def _jit(self, fn: Callable) -> Any:
        return jax.jit(fn, **self._jit_args)

    def compile(self, specs: Sequence[Any], exported: Optional[bytes] = None) -> None:
        """Compile for arguments shaped like ``specs`` (ShapeDtypeStruct trees), from the
        step function or from a serialized executable (``exported``, see :meth:`export`)."""
        self._specs = tuple(specs)
        hooks = _hooks.current()   # None unless a front-end registered some (engine/hooks.py)
        t0 = time.perf_counter()
        if exported is not None:
            backends.load_custom_calls(exported)   # register the custom calls it holds
        fn = self.fn if exported is None else jax.export.deserialize(bytearray(exported)).call
        self._jitted = self._jit(fn)
        with xla_errors("Compiling the step"):
            hooks and hooks.at("lower")
            lowered = self._jitted.lower(*self._specs)
            t1 = time.perf_counter()
            hooks and hooks.at("compile")
            self.compiled = lowered.compile(hooks and hooks.compiler_options())
        t2 = time.perf_counter()
        self.compile_seconds = t2 - t0
        self.compile_phases = {"trace_and_lower": t1 - t0, "xla_compile": t2 - t1}
        self.recorder = hooks.compiled(self) if hooks else None

    def export(self, specs: Optional[Sequence[Any]] = None) -> bytes:
        """The step as a serialized StableHLO module (``jax.export``): the compiled one, or
        for ``specs`` traced without compiling (what the engine cache stores and compiles)."""
        # The backends' custom calls are this package's own, built on this machine.
        checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in backends.custom_call_targets()]
        if specs is None:
            return bytes(jax.export.export(self._jitted, disabled_checks=checks)(
                *self._specs).serialize())
        return bytes(jax.export.export(self._jit(self.fn), disabled_checks=checks)(
            *specs).serialize())

    def __call__(self, *args: Any) -> Any:
        """Run the program (host arrays among ``args`` are moved to the device by the call,
        to its ``in_shardings``)."""
        try:
            if self.recorder is not None:
                return self.recorder.run(self.compiled, *args)
            return self.compiled(*args)
        except Exception as e:
            raise_as_popart(e, "Running the step")


def graph_function(graph: Graph, outputs: Sequence[str], static_feeds: Optional[Mapping[str, Any]] = None,
                   training: bool = False, config: Optional[EngineConfig] = None
                   ) -> Callable[[Mapping[str, Any], Any], list]:
    """``graph`` as a jitted function ``(feeds, key) -> outputs`` (a list in the order of
    ``outputs``) for one-shot runs: inputs in ``static_feeds`` are compiled in; outputs known
    at trace time (strings, shapes) bypass XLA; a failed run-time check raises
    popart_runtime_error. It compiles again for new input shapes, as ``jax.jit`` does.
    ``config``: a session's EngineConfig (PopART's op semantics), None for ONNX's."""
    outputs, static_feeds = list(outputs), dict(static_feeds or {})
    per_trace: dict[str, tuple] = {}   # input signature -> (folded outputs, checks) of its trace

    def signature(feeds: Mapping[str, Any]) -> str:
        return str(jax.tree_util.tree_map(lambda v: (tuple(v.shape), str(v.dtype)), dict(feeds)))

    @jax.jit
    def traced(feeds: Mapping[str, Any], key: Any) -> tuple:
        t = trace(graph, {**feeds, **static_feeds}, key=key, training=training, config=config)
        folded = {i: t.env[o] for i, o in enumerate(outputs) if isinstance(t.env[o], np.ndarray)}
        per_trace[signature(feeds)] = (folded, list(t.checks))
        return [None if i in folded else t.env[o] for i, o in enumerate(outputs)], t.check_flags()

    def run(feeds: Mapping[str, Any], key: Any) -> list:
        with xla_errors("Running the model"):
            res, flags = traced(dict(feeds), key)
            folded, checks = per_trace[signature(feeds)]
            raise_failed_checks(flags, checks)
        return [folded[i] if i in folded else r for i, r in enumerate(res)]
    return run
