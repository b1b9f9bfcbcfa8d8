"""popxl.Session: a client of the engine's compiled-step layer (``popart.engine.compiled``).

The Ir's main graph is traced once per replica and compiled once ahead of time. One ``run``
is one call into the compiled program: replicas on distinct devices when the session's device
has enough (``shard_map``; ``POPART_HOST_DEVICES`` on a CPU-only machine) or side by side
(``vmap``), under the replica axis that collectives use; host loads read successive elements
of their streams. Variables stay on the device between runs, stored as [replicas, *shape]
and split across the replicas' devices; a replica-sharded variable (``replica_sharded_variable``)
only as its shards, [replicas, ceil(nelms / shards)]. Remote buffers are kept the same way,
[replicas, entries, *tensor_shape], in host memory where the backend has a ``pinned_host``
memory kind (GPUs; ``POPXL_REMOTE_MEMORY_KIND`` chooses: "auto", "device", "pinned_host"),
moved to the device for a run and back after it; remote variables are entries of them.
With ``POPXL_CACHE_DIR`` (or the Ir's session options ``enableEngineCaching`` +
``cachePath``) the program goes through the engine cache.

Several instances (``Ir(replication="popdist")`` in processes started by ``poprun``): the
program is one SPMD program over the replicas of all instances (one mesh across the processes
of the ``jax.distributed`` job), so collectives span instances. Streams carry this instance's
replicas ([num_host_transfers, instance_replication_factor, ...]); host values of variables
are global, as in popxl: every instance gives all groups' data, each sends its replicas'
share, and ``weights_to_host`` gathers every replica's values on every instance."""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

import popart
from popart import distributed
from popart.dataflow import validate_input
from popart.engine import in_x64, serialised, x64
from popart.engine.backends import backend
from popart import report
from popart.engine.config import EngineConfig
from popart.engine.compiled import REPLICA_AXIS, CompiledStep, Facts, Placement, fetch, plan_trace
from popart.engine.executable import EngineCache, compile_step, runtime_signature
from popart.engine.host_plan import HostInput, HostOutput, HostPlan
from popart.engine.lower import CHECKS, RECORD, raise_failed_checks, trace
from popart.engine.state import Home
from popart.errors import OptionError
from popart.engine.graph_api import fingerprint
from popart.logging import getLogger
from popart.ir_json import serialize_ir
from popart.tensorinfo import TensorInfo, to_datatype

from ._placement import device_ipus, main_step, placed_program
from .dtypes import _DOWNCAST, to_numpy
from .fp8_utils import from_host_fp8, host_np_dtype, to_host_fp8
from .ir import Ir
from .streams import DeviceToHostStream, HostToDeviceStream
from .tensor import Constant, Variable
from .utils import HW_DEVICE_CONNECTION_TIMEOUT, _offline_device_from_str, _to_device_info


_logger = getLogger("session")


# the stream -> array maps of Session.run / run_with_outputs (PopXL's names)
d2hStreamBufferMaps = Mapping[DeviceToHostStream, np.ndarray]
h2dStreamBufferMaps = Mapping[HostToDeviceStream, Any]
StreamBufferMaps = Union[h2dStreamBufferMaps, d2hStreamBufferMaps]


@dataclass
class _StateArray:
    """One array of the session's device state, [replicas, *shape] split over the replicas'
    devices: the value of ``graph_in`` in the main graph before a run; ``graph_out`` (a
    tensor: its latest version; None: ``graph_in``) after it. Where it is kept is its
    ``home`` (``popart.engine.state.Home``, the record popart's sessions keep too): the
    replica sharding of a ``replica_sharded_variable`` (its shards), the memory kind of a
    remote buffer; the placed program gives it an IPU. A variable, the shards of a
    replica-sharded one, or a remote buffer (``buffer``)."""
    key: str                        # its key in Session._dev
    shape: tuple                    # per replica
    dtype: np.dtype
    graph_in: str
    graph_out: Any
    var: Optional[Variable] = None
    buffer: Any = None
    entries: list = field(default_factory=list)   # remote: the remote variables in the buffer
    home: Home = Home()

    @property
    def memory_kind(self) -> Optional[str]:
        """Where it lives between runs (None: device memory)."""
        return self.home.memory_kind


def _to_device_memory(x: Any) -> Any:
    """``x`` moved to device memory inside a jitted function."""
    space = getattr(getattr(jax, "memory", None), "Space", None)
    if space is not None:
        return jax.device_put(x, space.Device)
    return jax.device_put(x, jax.sharding.TransferToMemoryKind("device"))  # type: ignore[attr-defined]


def _in_device_memory(fn: Any, keys: list) -> Any:
    """``fn(state, feeds)`` with the state arrays ``keys`` (kept in host memory between
    runs) moved to device memory for the step; the step's out_shardings put their new values
    back in host memory."""
    def step(state: dict, feeds: dict) -> tuple:
        return fn({k: _to_device_memory(v) if k in keys else v for k, v in state.items()}, feeds)
    return step


def _device(desc: Any, replicas: int) -> Any:
    """The session's device for ``device_desc``: a DeviceInfo as given, else a new device of
    ``replicas`` IPUs, detached (the session attaches it when its context is entered)."""
    if isinstance(desc, popart.DeviceInfo):
        return desc
    if "POPXL_OFFLINE_DEVICE" in os.environ:   # PopXL's: compile for it, run on acquired IPUs
        return _offline_device_from_str(os.environ["POPXL_OFFLINE_DEVICE"], replicas)
    if desc == "ipu_hw":
        dev = popart.DeviceManager().acquireAvailableDevice(replicas)
    else:
        dev = _to_device_info(desc, replicas)
    dev.detach()
    return dev


def _runs_on(compiled: Any, device: Any) -> bool:
    """Whether a program compiled for device ``compiled`` runs on ``device`` (as Poplar's
    targets): the same IPU count, and IPU hardware (an offline IPU device is compiled for
    it), an IPU model or a simulator on the same kind; an IPU model's program on a CPU too."""
    kind = lambda d: "Ipu" if d.type == popart.DeviceType.OfflineIpu else d.type.name  # noqa: E731
    return compiled.numIpus == device.numIpus and (
        kind(compiled) == kind(device) or (kind(compiled), kind(device)) == ("IpuModel", "Cpu"))


def _acquire_hw_device_with_timeout(num_ipus: int = 1, timeout: float = HW_DEVICE_CONNECTION_TIMEOUT
                                    ) -> Any:
    """An attached device of ``num_ipus`` IPUs (PopXL's): the first of them that is free,
    waiting up to ``timeout`` seconds.

    Raises:
        RuntimeError: no device of ``num_ipus`` IPUs, or none free in time (PopXL's messages).
    """
    devices = popart.DeviceManager().enumerateDevices(numIpus=num_ipus)
    if not devices:
        raise RuntimeError(f"Failed to acquire device with {num_ipus} IPUs. Ensure that there are "
                           "sufficient IPUs available. If you have enabled the Poplar SDK you can "
                           "check device availability with the `gc-monitor` command-line utility.")
    deadline = time.monotonic() + timeout
    while True:
        for d in devices:
            if d.attach():
                return d
        if time.monotonic() >= deadline:
            raise RuntimeError(f"Timed out after {timeout} seconds waiting for a device with "
                               f"{num_ipus} IPUs to become available.")
        time.sleep(0.1)


class _RunPlan:
    """A session's run, worked out once (``engine.host_plan``): its streams' dtypes and host
    shapes, and whether [n, local replicas] and [local replicas, n] differ in memory (both
    greater than 1)."""

    def __init__(self, session: "Session") -> None:
        n, r = session._n, session._local_r
        self.swap = n > 1 and r > 1
        inputs = []   # [n, r, ...] host arrays as the step's [r, n, ...]
        for s, t in session._h2d:
            dtype, shape = np.dtype(s.dtype.as_device_numpy()), tuple(s.shape)
            inputs.append(HostInput(s, t.id, dtype, (session._host_shape(shape),),
                                    ((n, r) if self.swap else (r, n)) + shape, self.swap,
                                    downcast=dtype in _DOWNCAST))
        self.d2h = [(s, s.dtype.as_device_numpy(), session._host_shape(s.shape)) for s, _ in session._d2h]
        self.d2h_ids = [t.id for _, t in session._d2h]
        self.host = HostPlan(inputs, [HostOutput(s, shape=host) for s, _, host in self.d2h],
                             exact_outputs=True)
        self.x64 = self.host.x64   # 64-bit host data

    def feeds(self, inputs: Mapping, downcast: bool) -> Optional[dict]:
        """The step's feeds ([local replicas, n, ...]) when every stream has a NumPy array of
        its dtype (one that ``downcast`` leaves alone) and host shape; else None (the general
        path decides)."""
        return self.host.feeds(inputs, downcast)

    def outputs_fit(self, outputs: Mapping) -> bool:
        """Every output stream has a NumPy array of its host shape, and no other is given."""
        return self.host.outputs_fit(outputs)


class Session:
    """A runtime session for a popxl Ir on device ``device_desc`` ("ipu_hw", "ipu_model",
    "cpu" or a popart.DeviceInfo). Use it as a context manager: entering a context while
    detached attaches the device and copies the weights to it (``weights_from_host``); leaving
    that context copies them back (``weights_to_host``, unless ``weights_to_host_on_exit`` is
    False or the block raised) and detaches. Contexts nest: an inner context entered while
    attached does neither. A session made with an attached DeviceInfo is attached from the
    start (and copies the weights to the device then).

    Thread safety: running and moving weights (run, run_with_outputs, weights_from_host,
    weights_to_host, get_tensors_data, write_variables_data) hold the session's lock, so
    threads sharing a session take turns."""

    @in_x64
    def __init__(self, ir: Ir, device_desc: Any = "cpu", weights_to_host_on_exit: bool = True) -> None:
        self._ir = ir
        self.weights_to_host_on_exit = bool(weights_to_host_on_exit) and not ir._has_read_only_memmap
        if weights_to_host_on_exit and ir._has_read_only_memmap:
            _logger.info("Weights to host has been disabled as the `ir` contains a read-only "
                         "memmaped variable.")
        self._was_attached: list[bool] = []
        self._local_r = ir.instance_replication_factor   # this instance's replicas (its streams)
        try:   # all instances' replicas
            self._r = distributed.check_options(ir._options, self._local_r)
        except OptionError as e:
            raise OptionError(f"popxl.Ir {ir.id} has replication_factor {ir.replication_factor} and "
                              f"instance_replication_factor {self._local_r}: {e}") from None
        self._n = ir.num_host_transfers
        self._device = _device(device_desc, device_ipus(ir, device_desc, self._local_r))
        self._compiled_for = self._device   # the device the program is built for (its target)
        o = ir._options   # the engine's config, from the Ir's (PopXL's) session options
        self._config = EngineConfig(
            processes=distributed.process_count() if o.enableDistributedReplicatedGraphs else 1,
            cache_path=o.cachePath if o.enableEngineCaching and o.cachePath else None)
        self._placement = Placement(self._r, self._device, processes=self._config.processes)
        main = ir.main_graph
        self._main_ir = main._finalize(lowering=True)
        self._variables: list[Variable] = list(ir._variables)
        self._h2d = [(s, t) for k, s, t in main._stream_inputs if k == "h2d"]
        self._d2h = [(s, t) for k, s, t in main._stream_inputs if k == "d2h"]
        self._d2h_final = {s: main._hidden[("d2h", s)] for s, _ in self._d2h}
        self._fp8_streams = any(host_np_dtype(s.dtype) != s.dtype.as_device_numpy()
                                for s, _ in self._h2d + self._d2h)
        self._main_ir.inputs = [t.id for _, t in self._h2d + self._d2h]
        self._host: dict[Variable, np.ndarray] = {   # a variable's np.memmap is kept, not copied
            v: d if isinstance(d, np.memmap) else np.array(d)
            for v, d in ((v, ir._variable_data[v]) for v in self._variables)}
        self._host_all: dict[Variable, np.ndarray] = {}   # all_replicas variables: [replicas, ...]
        self._buffer_host: dict[str, np.ndarray] = {}     # remote buffers' last contents on the host
        self._slots = self._make_slots()
        self._written = {s.key for s in self._slots   # the slots a run writes (a newer version)
                         if s.graph_out is not None and s.graph_out._ir_id != s.graph_in}
        self._slot_of = {v: s.key for s in self._slots   # variable -> the slot that holds it
                         for v in ([s.var] if s.var is not None else s.entries)}
        self._stale: set[str] = set()   # slots whose device value is newer than the host's
        self._placed = placed_program(self)   # the main graph's IPUs on their own devices
        self._engine_cache_ = self._engine_cache()
        self._dev: Optional[dict] = None
        self._in_sync = True
        self._lock = threading.RLock()
        self._checks: list = []   # the program's run-time checks (its plan's facts)
        self._facts: dict = {}
        self._plan: Optional[_RunPlan] = None   # _run_plan's
        self.executable_source = ""
        self._compile()
        ir._session = self      # Variable.in_sync_with_ipu
        if self.is_attached:
            self.weights_from_host()

    # ------------------------------------------------------------------ device state
    def _make_slots(self) -> list[_StateArray]:
        """The device state: each on-chip variable ([replicas, *shape]); each replica-sharded
        variable of ``replica_sharded_variable`` (its shards, [replicas, shard size]); each
        remote buffer that ops use or remote variables live in ([replicas, entries, *shape],
        in host memory where the backend has it)."""
        main = self._ir.main_graph
        slots = []
        buffers: dict = {}
        for v in self._variables:
            if v._remote is None:
                slots.append(_StateArray(v.id, v.shape, v.dtype.as_device_numpy(), v.id, v, var=v))
            elif v._shard is not None:
                sh = v._shard
                slots.append(_StateArray(v.id, sh.shape, sh.dtype.as_device_numpy(), sh.id, sh, var=v,
                                         home=Home(shards=v._sharding)))
            else:
                buffers.setdefault(v._remote[0], [])
        for key in main._hidden:
            if isinstance(key, tuple) and key[0] == "remote":
                buffers.setdefault(key[1], [])
        for (buf, off), v in self._ir._remote_entries.items():
            if buf in buffers and v._shard is None:
                buffers[buf].append(v)
        kind = self._remote_memory_kind() if buffers else None
        self.remote_memory_kind = kind or "device"   # where remote buffers live between runs
        for buf in sorted(buffers, key=lambda b: b.remote_buffer_id):
            shape = (buf.entries,) + tuple(buf.tensor_shape)
            t = main._hidden.get(buf._state_key)
            if t is not None and t.shape != shape:
                raise ValueError(f"RemoteBuffer[id={buf.remote_buffer_id}] holds {shape[0]} entries "
                                 f"of {list(shape[1:])}, but ops use it as {t.shape[0]} entries of "
                                 f"{list(t.shape[1:])}")
            for v in buffers[buf]:
                buf._check_offset(v._remote[1], f"offset of remote variable '{v.id}'")
            key = f"remote_buffer:{buf.remote_buffer_id}"
            slots.append(_StateArray(key, shape, buf.tensor_dtype.as_device_numpy(),
                                     t.id if t is not None else key, t, buffer=buf,
                                     entries=buffers[buf], home=Home(memory_kind=kind)))
        return slots

    def _remote_memory_kind(self) -> Optional[str]:
        """The memory kind remote buffers live in between runs: ``POPXL_REMOTE_MEMORY_KIND``
        ("auto" default, "device", or a memory kind such as "pinned_host"). "auto" is
        "pinned_host" where the devices have it, except on CPU, whose device memory is host
        memory. None: the devices' default (device) memory."""
        want = os.environ.get("POPXL_REMOTE_MEMORY_KIND", "auto").strip().lower() or "auto"
        devices = [d for d in self._placement.devices or [self._placement.device]
                   if d.process_index == jax.process_index()]
        try:
            kinds = set.intersection(*({m.kind for m in d.addressable_memories()} for d in devices))
            default = devices[0].default_memory().kind
        except Exception:   # noqa: BLE001  (a backend without memory kinds)
            kinds, default = set(), None
        platform = self._placement.platform
        if want == "auto":
            want = backend(platform).remote_buffer_memory
        if want in ("device", default):
            _logger.info(f"Remote buffers are in device memory ({platform})")
            return None
        if want not in kinds:
            _logger.warn(f"Remote buffers: memory kind {want!r} is not available on {platform} "
                         f"(it has {sorted(kinds)}); they are in device memory")
            return None
        _logger.info(f"Remote buffers are in {want} memory ({platform})")
        return want

    def _device_values(self) -> dict:
        """Each slot's value for the device, [replicas, ...], from the host values."""
        out = {}
        for s in self._slots:
            if s.home.shards is not None:
                out[s.key] = s.home.shards.to_replicas(self._host[s.var])
            elif s.buffer is None:
                out[s.key] = self._per_replica(s.var, self._host[s.var])
            else:
                base = self._buffer_host.get(s.key)
                arr = np.array(base) if base is not None else np.zeros((self._r,) + s.shape, s.dtype)
                for v in s.entries:
                    off = v._remote[1]
                    if v._sharding is not None:
                        arr[:, off] = v._sharding.to_replicas(self._host[v])
                    else:
                        arr[:, off] = self._per_replica(v, self._host[v]).reshape(arr[:, off].shape)
                out[s.key] = arr
            out[s.key] = np.ascontiguousarray(out[s.key], dtype=s.dtype)
        if self._placed:   # each replica's variables in the slots of their IPUs
            return self._placed.executor.pack([{s.graph_in: out[s.key][r] for s in self._slots}
                                               for r in range(self._r)])
        return out

    def _set_host(self, v: Variable, arr: np.ndarray) -> None:
        """The host value of ``v`` from each replica's value ([replicas, *shape])."""
        g = v.replica_grouping
        self._store_host(v, arr[g.first_replicas()] if g is not None and g.num_groups > 1 else arr[0])
        if v.retrieval_mode == "all_replicas" and self._r > 1:
            self._host_all[v] = arr

    def _store_host(self, v: Variable, value: np.ndarray) -> None:
        """Set the host value of ``v``: written into its np.memmap when it has one."""
        if isinstance(self._host.get(v), np.memmap):
            self._host[v][...] = value
        else:
            self._host[v] = value

    def _set_host_sharded(self, v: Variable, shards: np.ndarray) -> None:
        """The host value of a replica-sharded ``v`` from each replica's shard
        ([replicas, shard size]): each group's shards put together, padding removed."""
        layout = v._sharding
        values = layout.group_values(shards)
        self._store_host(v, values if layout.num_groups > 1 else values[0])
        if v.retrieval_mode == "all_replicas" and self._r > 1:
            self._host_all[v] = values[layout.data_group]

    def _put(self, values: dict) -> dict:
        """The state on the replicas' devices from its global host values ([replicas, ...]):
        across processes, each puts only its own replicas' rows."""
        shardings = self._state_shardings()
        if self._placement.across_processes:
            return {k: jax.make_array_from_callback(x.shape, shardings[k], lambda i, x=x: x[i])
                    for k, x in values.items()}
        return jax.device_put(values, {k: shardings[k] for k in values})

    # ------------------------------------------------------------------ compile
    def _replica_fn(self, planning: bool = False):
        """One replica's main graph: (its state: variables and remote buffers, its streams'
        [N, ...] inputs) -> (the new state, device-to-host values, run-time checks). Its
        checks keep the plan's ids (``_checks``); ``planning``: its run-time checks follow,
        as ``Facts``."""
        n, r = self._n, self._r
        slots = [(s.key, s.graph_in, s.graph_out._ir_id if s.graph_out is not None else s.graph_in)
                 for s in self._slots]
        d2h = [(s, t.id, self._d2h_final[s]._ir_id) for s, t in self._d2h]
        main_ir, platform, checks = self._main_ir, self._placement.platform, list(self._checks)

        def replica(state: dict, feeds: dict) -> tuple:
            feeds = dict(feeds)
            for s, tid, _ in d2h:
                feeds[tid] = jnp.zeros((n,) + s.shape, s.dtype.as_device_numpy())
            weights = {gin: state[key] for key, gin, _ in slots}
            t = trace(main_ir, feeds, key=jax.random.key(0), weights=weights, platform=platform,
                      replica_axis=REPLICA_AXIS if r > 1 else None, replication_factor=r,
                      checks=checks)
            new = {key: jnp.asarray(t.env[out]).astype(state[key].dtype) for key, _, out in slots}
            outs = {tid: jnp.asarray(t.env[fid]) for _, tid, fid in d2h}
            if t.check_flags() is not None:
                outs[CHECKS] = t.check_flags()
            if planning:   # run-time checks (indices in range, ...)
                return new, outs, Facts(checks=list(t.checks))
            return new, outs
        return replica

    def _specs(self) -> tuple:
        r, n = self._r, self._n
        wspecs = {s.key: jax.ShapeDtypeStruct((r,) + tuple(s.shape), s.dtype) for s in self._slots}
        if self._placed:
            wspecs = self._placed.executor.state_specs()
        fspecs = {t.id: jax.ShapeDtypeStruct((r, n) + s.shape, s.dtype.as_device_numpy()) for s, t in self._h2d}
        return wspecs, fspecs

    def _state_shardings(self) -> dict:
        if self._placed:
            return self._placed.executor.state_shardings()
        split = self._placement.sharding(0)   # [replicas, ...]: one slice per replica's device
        return {s.key: split.with_memory_kind(s.memory_kind) if s.memory_kind else split
                for s in self._slots}

    def _engine_cache(self) -> Optional[EngineCache]:
        if self._config.cache_path is None:
            return None
        main = self._ir.main_graph
        signature = {"session": "popxl.Session", "graph": fingerprint(self._main_ir),
                     "replication": self._r, "instance_replication": self._local_r,
                     "num_host_transfers": self._n,
                     "devices": len(self._placement.devices),
                     "ipus": self._placed.ipus if self._placed else 1,
                     "variables": {v.id: [list(v.shape), v.dtype.name] for v in self._variables},
                     "remote": {str(b.remote_buffer_id): [b.entries, list(b.tensor_shape), b.tensor_dtype.name]
                                for b in self._ir._remote_buffers.values()
                                if b._state_key in main._hidden},
                     "remote_memory_kind": self.remote_memory_kind,
                     "h2d": {t.id: [list(s.shape), s.dtype.name] for s, t in self._h2d},
                     "d2h": {t.id: [list(s.shape), s.dtype.name] for s, t in self._d2h},
                     **runtime_signature()}
        return EngineCache(self._config.cache_path, "popxl", signature)

    def _feed_sharding(self) -> jax.sharding.Sharding:
        """[replicas, ...] arrays: one slice per replica's device(s)."""
        return self._placed.executor.feed_sharding if self._placed else self._placement.sharding(0)

    def _step_fn(self, planning: bool = False) -> Callable:
        """The program (see ``_replica_fn``), placed or replicated; ``planning``: its facts
        follow its outputs (``compiled.plan_trace``)."""
        if self._placed:
            return main_step(self._placed, self, self._facts, planning)
        return self._placement.replicate(self._replica_fn(planning), in_axes=(0, 0))

    def _compile(self) -> None:
        split = self._feed_sharding()
        state = self._state_shardings()
        specs = self._specs()
        self._checks, self._facts = [], {}   # the plan's abstract trace finds them
        self._facts = plan_trace(self._step_fn(planning=True), *specs)[1]   # run-time checks, ...
        self._checks = self._facts["checks"]
        fn = self._step_fn()
        host = list(self._placed.layout.memory_kinds) if self._placed else \
            [s.key for s in self._slots if s.memory_kind]
        if host:
            fn = _in_device_memory(fn, host)
        step = CompiledStep(fn, in_shardings=(state, split), out_shardings=(state, split),
                            donate_argnums=(0,))
        with report.popxl_compiling(   # autoReport.*, dotChecks, progress logger
                self._ir._options, self._main_ir, f"popxl.Ir {self._ir.id}", self._r * self._n,
                lambda: serialize_ir(self._main_ir, {}, "maingraph")):
            self.executable_source = compile_step(step, specs, self._engine_cache_)
        self._step = step

    # ------------------------------------------------------------------ context / device
    @property
    def ir(self) -> Ir:
        return self._ir

    @property
    def ir_(self) -> Ir:
        """The session's Ir (PopXL's attribute name)."""
        return self._ir

    @property
    def _pb_session(self) -> Any:
        """PopART's binding view of the session (``writeWeights``, ``weightsFromHost``)."""
        from . import _pb
        return _pb.Session(self)

    @property
    def device(self) -> Any:
        """The session's ``popart.DeviceInfo``. PopXL's Session has no ``device`` attribute:
        assigning one (as PopXL's tests do) sets a plain attribute that this property then
        returns, and the session keeps its device, as in PopXL. :meth:`_set_device` (PopXL's,
        which popxl-addons uses) moves the session to another device."""
        return getattr(self, "_device_attribute", self._device)

    @device.setter
    def device(self, device: Any) -> None:
        self._device_attribute = device

    def _set_device(self, device: Any) -> None:
        """Run on ``device`` (a ``popart.DeviceInfo``) from now on (PopXL's private method,
        which popxl-addons uses). Values on the old device that the host has not seen are read
        back first and go to the new device; where its devices differ the program is placed and
        compiled again. The attached state is ``device``'s own. A device the program was not
        built for (another kind or IPU count, see :func:`_runs_on`) is taken, but using the
        session on it raises, as Poplar's executables do.

        Raises:
            TypeError: ``device`` is not a ``popart.DeviceInfo``.
        """
        if not isinstance(device, popart.DeviceInfo):
            raise TypeError(f"Session device must be a popart.DeviceInfo, not {type(device).__name__}")
        with self._lock:
            if device is self._device:
                return
            if self._dev is not None:   # the device's newer values, before the device changes
                self._pull()
                self._in_sync = True
            if not _runs_on(self._compiled_for, device):
                self._device = device
                return
            old = (self._placement.device, list(self._placement.devices))
            self._device = device
            self._placement = Placement(self._r, device, processes=self._config.processes)
            self._placed = placed_program(self)
            if (self._placement.device, list(self._placement.devices)) != old or self._placed:
                self._engine_cache_ = self._engine_cache()
                self._compile()
            if self._dev is not None:
                self._dev = self._put(self._device_values())

    @property
    def is_attached(self) -> bool:
        """True while the session's device is attached."""
        return bool(self._device.isAttached)

    def __enter__(self) -> "Session":
        self._check_target()
        was_attached = self.is_attached
        if self._device.type == popart.DeviceType.OfflineIpu:   # PopXL: run on acquired IPUs,
            offline, hw = self._device, _acquire_hw_device_with_timeout(self._device.numIpus)
            try:                                                # back to the offline one on exit
                self._set_device(hw)
            except BaseException:
                hw.detach()
                raise
            self._was_attached.append(offline)
        else:
            self._was_attached.append(was_attached)
        if not was_attached:
            if not self.is_attached and not self._device.attach() and \
                    not self._device.tryAttachUntilTimeout():
                self._was_attached.pop()
                raise RuntimeError(f"Could not attach to device {self._device.id}. It is attached "
                                   f"elsewhere or offline.")
            try:
                self.weights_from_host()
            except BaseException:
                self.__exit__(*sys.exc_info())
                raise
        return self

    def __exit__(self, exc_type: Any = None, exc_value: Any = None, tb: Any = None) -> None:
        was_attached = self._was_attached.pop() if self._was_attached else False
        if not was_attached or isinstance(was_attached, popart.DeviceInfo):
            if exc_type is None and self.weights_to_host_on_exit and self.is_attached:
                self.weights_to_host()
            self._device.detach()
        if isinstance(was_attached, popart.DeviceInfo):
            self._set_device(was_attached)

    def _host_in_sync(self, v: Variable) -> bool:
        return self._in_sync or v not in self._host

    def _check_target(self) -> None:
        """Raises popart.poplar_runtime_error where the session's device is not one the
        program was built for (:meth:`_set_device`)."""
        if self._device is not self._compiled_for and not _runs_on(self._compiled_for, self._device):
            c, d = self._compiled_for, self._device
            raise popart.poplar_runtime_error(
                f"popxl.Session of Ir {self._ir.id} was compiled for device type {c.type.name} "
                f"with {c.numIpus} IPU(s); it cannot run on device {d.id} of type {d.type.name} "
                f"with {d.numIpus} IPU(s) (it needs the same type and IPU count; an IpuModel "
                f"program also runs on a Cpu device)")

    def _require_attached(self) -> None:
        self._check_target()
        if not self.is_attached:
            raise ValueError("Must be attached to device before calling a runtime function. Put the "
                             "call inside a `Session` context, for example `with session: session.run()`.")

    # ------------------------------------------------------------------ weights
    def _per_replica(self, v: Variable, data: np.ndarray) -> np.ndarray:
        g = v.replica_grouping
        if g is not None and g.num_groups > 1:
            return np.stack([data[a] for a in g.assignment])
        return np.broadcast_to(data, (self._r,) + v.shape)

    @serialised
    @in_x64
    def weights_from_host(self) -> None:
        """Copy the host values of the variables to the device: on-chip variables, the shards
        of replica-sharded variables, and the entries of remote variables in their buffers
        (other entries keep the buffer's contents)."""
        self._require_attached()
        self._dev = self._put(self._device_values())
        self._in_sync, self._stale = True, set()

    @serialised
    @in_x64
    def weights_to_host(self) -> None:
        """Copy the device values of the variables to the host (remote variables: their
        entries; replica-sharded variables: the shards put together); a variable made from an
        np.memmap gets the values written into it and flushed.

        Raises:
            Exception: if the Ir has a variable made from a read-only np.memmap (PopXL's rule).
        """
        self._weights_to_host()

    def _weights_to_host(self, keys: Optional[set] = None) -> None:
        """:meth:`weights_to_host` for the slots ``keys`` (None: all)."""
        if self._ir._has_read_only_memmap:
            raise Exception("Writing data from device to host is not possible as the `ir` "
                            "contains a read-only memmap.")
        self._require_attached()
        self._pull(keys)
        self._in_sync = True

    def _pull(self, keys: Optional[set] = None) -> None:
        """The host values of the slots ``keys`` (None: all) from the device, of those whose
        device value is newer (a run wrote them since): only those cross. Placed programs
        pack the slots together: all of them."""
        keys = self._stale if keys is None else self._stale & keys
        if not keys or self._dev is None:
            return
        get = dict(get=distributed.global_value, what="Copying the weights to the host")
        if self._placed:   # every instance's replicas
            per = self._placed.executor.unpack(dict(zip(self._dev, fetch(list(self._dev.values()), **get))))
            values = {s.key: np.stack([p[s.graph_in] for p in per]) for s in self._slots}
        else:
            order = [s.key for s in self._slots if s.key in keys]   # the same on every instance
            values = dict(zip(order, fetch([self._dev[k] for k in order], **get)))
        for s in self._slots:
            arr = values.get(s.key)
            if arr is None:
                continue
            if s.home.shards is not None:
                self._set_host_sharded(s.var, arr)
            elif s.buffer is None:
                self._set_host(s.var, arr)
            else:
                self._buffer_host[s.key] = arr
                for v in s.entries:
                    entry = arr[:, v._remote[1]]
                    if v._sharding is not None:
                        self._set_host_sharded(v, entry)
                    else:   # the entry's data in the variable's shape (PopXL: any of its size)
                        self._set_host(v, entry.reshape((len(entry),) + v.shape))
        for v in self._variables:
            v._flush_data_if_memmap()
        self._stale -= set(values)

    def get_tensor_data(self, tensor: Union[Variable, Constant]) -> np.ndarray:
        """The value of a variable or constant (see :meth:`get_tensors_data`)."""
        return self.get_tensors_data([tensor])[tensor]

    @serialised
    def get_tensors_data(self, tensors: Iterable[Union[Variable, Constant]]) -> dict:
        """Values of variables (fetched from the device when it holds newer ones) and constants,
        as PopXL gives them: a variable made from an ``np.memmap`` gives that very memmap;
        float8 data are PopXL's uint8 records (``popxl.dtypes.np_dtype_float8_143``)."""
        tensors = list(tensors)
        out = {}
        for t in tensors:
            if not isinstance(t, (Variable, Constant)):
                raise TypeError(f"{t} is not of type Constant or Variable. get_tensor_data is not "
                                f"supported for this type.")
        keys = {self._slot_of[t] for t in tensors if isinstance(t, Variable) and t in self._slot_of}
        if self.is_attached and keys and (not self._in_sync or keys & self._stale):
            self._weights_to_host(keys)   # only the variables asked for
        for t in tensors:
            if isinstance(t, Variable):
                if t.retrieval_mode == "all_replicas" and self._r > 1:   # one value per replica
                    out[t] = np.array(self._host_all[t] if t in self._host_all
                                      else self._per_replica(t, self._host[t]))
                elif t._memmap_arr is not None:   # PopXL: the very np.memmap it was made from
                    out[t] = t._memmap_arr
                else:
                    out[t] = np.array(self._host[t])
            else:
                out[t] = np.array(t._graph._g.initializers[t.id])
            out[t] = to_host_fp8(out[t])   # float8: PopXL's uint8 records
        return out

    def write_variable_data(self, tensor: Variable, data: np.ndarray) -> None:
        self.write_variables_data({tensor: data})

    @serialised
    def write_variables_data(self, tensors: Mapping[Variable, Any]) -> None:
        """Set variables' values on the host (and on the device when attached: only theirs)."""
        keys = {self._slot_of[v] for v in tensors if v in self._slot_of}
        if self.is_attached:   # the device's newer values of what is written only in part
            self._pull(None if self._placed else {s.key for s in self._slots
                                                  if s.key in keys and s.buffer is not None})
        for v, data in tensors.items():
            if not isinstance(v, Variable):
                raise TypeError(f"Tensor {v.id} is not of type Variable. write_variable_data is not "
                                f"supported for this type.")
            arr = np.asarray(data)
            want = v.shape_on_host
            if np.ndim(data) == 0 and not isinstance(data, np.ndarray):   # a Python number
                if v.dtype.name in ("float8_143", "float8_152"):
                    raise TypeError(f"Data for variable {v.id} must be passed in as an np.array with "
                                    f"dtype {host_np_dtype(v.dtype)} (see "
                                    f"popxl.fp8_utils.host_pow2scale_cast_to_fp8)")
                arr = arr.astype(v.dtype.as_device_numpy())
            arr = from_host_fp8(arr)
            if arr.dtype != v.dtype.as_device_numpy():
                raise TypeError(f"The dtype of the input array {np.asarray(data).dtype} must match "
                                f"the equivalent type of the tensor {v.id} : {v.dtype}")
            if arr.shape != tuple(want):
                if arr.size == 1 and not want:
                    arr = arr.reshape(())
                else:
                    raise ValueError(f"The shape of the input array {arr.shape} must match the shape "
                                     f"of the tensor {v.id} : {v.shape}")
            if v.retrieval_mode == "all_replicas" and v.replica_grouping.group_size > 1:
                raise NotImplementedError(f'Copying to tensor {v.id} with "all_replicas" retreval '
                                          f'mode is not yet supported.')
            self._store_host(v, np.array(arr))
            self._host_all.pop(v, None)
        if self.is_attached:
            self._write_slots(keys)

    def _write_slots(self, keys: set) -> None:
        """Copy the host values of the slots ``keys`` to the device: only those cross
        (placed programs pack the slots together: all of them)."""
        if self._placed or self._dev is None:
            self.weights_from_host()
            return
        values = self._device_values()
        self._dev = {**self._dev, **self._put({k: values[k] for k in keys})}
        self._stale -= keys
        self._in_sync = True

    # ------------------------------------------------------------------ run
    def expected_inputs(self) -> list[HostToDeviceStream]:
        return [s for s, _ in self._h2d]

    def _host_shape(self, shape: tuple) -> tuple:
        return tuple(d for d in (self._n, self._local_r) if d != 1) + tuple(shape)

    def create_host_outputs(self) -> dict[DeviceToHostStream, np.ndarray]:
        """Zeroed output arrays, one per device-to-host stream (float8: PopXL's uint8 records)."""
        return {s: np.zeros(self._host_shape(s.shape), host_np_dtype(s.dtype)) for s, _ in self._d2h}

    def _expected_outputs(self) -> list[DeviceToHostStream]:
        return [s for s, _ in self._d2h]

    def _validate_run_inputs(self, inputs: h2dStreamBufferMaps) -> None:
        """Check ``inputs`` as :meth:`run` does: every expected input stream and no other,
        each with an array of the right shape.

        Raises:
            ValueError: a stream missing or unexpected, or an array of the wrong shape."""
        self._validate_streams(inputs, self.expected_inputs(), "input")

    def _validate_run_outputs(self, outputs: d2hStreamBufferMaps) -> None:
        """:meth:`_validate_run_inputs` for the output arrays of :meth:`run_with_outputs`."""
        self._validate_streams(outputs, self._expected_outputs(), "output")

    def _validate_streams(self, given: Mapping, expected: list, kind: str) -> None:
        """The streams given are exactly those expected, each with an array of the right
        shape (popxl's rules: [num_host_transfers, instance_replication_factor, *shape],
        size-1 dimensions of the first two dropped)."""
        got, want = set(given), set(expected)
        if got != want:
            unexpected = {str(x) for x in got - want}
            missing = {str(x) for x in want - got}
            raise ValueError(f"Unexpected/Missing {kind}.\n  Unexpected: {unexpected}\n  "
                             f"Missing: {missing}")
        for st, arr in given.items():
            self._verify_io_shape(st, np.shape(arr), kind)

    def _verify_io_shape(self, st: Any, shape: tuple, kind: str) -> None:
        full = self._host_shape(st.shape)
        repl_index = data_index = 0
        if self._n > 1:
            repl_index = data_index = 1
            if len(shape) < 1 or shape[0] < self._n:
                raise ValueError(f"Dimension 0 ({shape[0] if shape else None}) of the array of "
                                 f"shape {tuple(shape)} provided for {kind} stream {st.tensor_id} "
                                 f"is not large enough.\nIt should be at least of size "
                                 f"num_host_transfers = {self._n}")
        if self._local_r > 1:
            data_index += 1
            if len(shape) <= repl_index or shape[repl_index] != self._local_r:
                size = shape[repl_index] if len(shape) > repl_index else None
                raise ValueError(f"Dimension {repl_index} ({size}) of the array of shape "
                                 f"{tuple(shape)} provided for {kind} stream {st.tensor_id} is the "
                                 f"wrong size.\nIt should be of size replication_factor = {self._local_r}")
        if tuple(d for d in shape if d != 1)[data_index:] == () and \
                all(d == 1 for d in shape[data_index:]) and all(d == 1 for d in st.shape):
            return   # all-ones shapes (a scalar for a [1] stream) are not compared
        if tuple(shape[data_index:]) != tuple(st.shape):
            raise ValueError(f"Shape mismatch for {kind} stream {st.tensor_id}:\nStream shape = "
                             f"{st.shape}, therefore expected full global batch shape {full}. Got "
                             f"array shape = {tuple(shape)}")

    def _run_plan(self) -> Optional["_RunPlan"]:
        """What a run's common path needs, worked out once (None where streams cross
        processes: the general path)."""
        if self._plan is None and not self._placement.across_processes:
            self._plan = _RunPlan(self)
        return self._plan

    def _feed(self, s: HostToDeviceStream, a: np.ndarray) -> np.ndarray:
        """A stream's (validated) input as [instance replicas, num_host_transfers, *shape],
        after popart's StepIO rule (dtype, element count)."""
        full = (self._n, self._local_r) + s.shape
        info = TensorInfo(to_datatype(s.dtype.as_device_numpy()), list(s.shape))
        a = validate_input(s.name, a, info, self._n, 1, self._local_r).reshape(full)
        return np.ascontiguousarray(np.swapaxes(a, 0, 1))

    def run_with_outputs(self, inputs: Optional[Mapping[HostToDeviceStream, Any]] = None,
                         outputs: Optional[Mapping[DeviceToHostStream, np.ndarray]] = None,
                         downcast_inputs: bool = True) -> None:
        """Run once, writing every device-to-host stream into its array of ``outputs``.
        Serialised (the session's lock), in the package's 64-bit JAX scope unless no stream
        carries 64-bit data and the state is on the device.

        Raises:
            ValueError: not attached; an input or output stream missing or unexpected
                ("Unexpected/Missing input" / "output"); an array of the wrong shape.
            popart.popart_exception: input data of another dtype than its stream's (after
                64-bit data is downcast, with ``downcast_inputs``).
        """
        with self._lock:
            plan = self._run_plan()
            if plan is not None and not plan.x64 and self._dev is not None:
                return self._run_with_outputs(inputs, outputs, downcast_inputs)
            with x64():
                return self._run_with_outputs(inputs, outputs, downcast_inputs)

    def _run_with_outputs(self, inputs: Optional[Mapping], outputs: Optional[Mapping],
                          downcast_inputs: bool) -> None:
        self._require_attached()
        if self._dev is None:   # attached by _set_device to a device that came attached
            self.weights_from_host()
        inputs, outputs = inputs or {}, outputs if outputs is not None else {}
        if self._fp8_streams:   # PopXL's float8 host arrays (uint8 records) as ml_dtypes views
            inputs = {s: from_host_fp8(a, s.dtype) for s, a in inputs.items()}
            outputs = {s: from_host_fp8(a) for s, a in outputs.items()}
        plan = self._run_plan()
        feeds = None if plan is None else plan.feeds(inputs, downcast_inputs)
        if feeds is None:   # the general path: conversions, popxl's and popart's checks
            inputs = {s: to_numpy(a, downcast=downcast_inputs) for s, a in inputs.items()}
            self._validate_run_inputs(inputs)
            feeds = {t.id: self._feed(s, inputs[s]) for s, t in self._h2d}
        fit = plan is not None and plan.outputs_fit(outputs)
        if not fit:
            outputs = dict(outputs)
            self._validate_run_outputs(outputs)
        if plan is None:   # across processes: each process puts its own replicas' rows
            feeds = jax.device_put(feeds, self._feed_sharding()) if self._placed else \
                self._placement.put(feeds, 0)
        self._dev, outs = self._step(self._dev, feeds)   # host feeds are moved by the call
        self._in_sync = not self._slots   # PopXL: every variable (in_sync_with_ipu)
        self._stale |= self._written       # what crosses back (only when the host asks)
        flags = outs.pop(CHECKS, None)
        ids = plan.d2h_ids if plan is not None else [t.id for _, t in self._d2h]
        values = [outs[i] for i in ids] + ([] if flags is None else [flags])
        # the copies to the host started together (across processes: this instance's rows)
        values = fetch(values, local=True, get=np.asarray if plan is not None else distributed.local_rows)
        if flags is not None:
            rows = values.pop().reshape(-1, RECORD)   # each replica's first failure: the first of them
            raise_failed_checks(rows[np.argmax(rows[:, 0] != 0)], self._checks)
        if fit and not plan.swap:   # arrays of the host shapes: [1, n] or [replicas, 1] as it is
            for (s, _, host), val in zip(plan.d2h, values):
                np.copyto(outputs[s], val.reshape(host), casting="unsafe")
            return
        for (s, t), val in zip(self._d2h, values):   # [local replicas, n, ...] -> [n, local replicas, ...]
            val = np.swapaxes(val, 0, 1).reshape(self._host_shape(s.shape))
            dst = outputs[s]
            if dst.size != val.size:
                raise ValueError(f"Output array for stream '{s.name}' has shape {list(dst.shape)}; "
                                 f"expected {list(val.shape)}")
            np.copyto(dst, val.reshape(dst.shape), casting="unsafe")

    def run(self, inputs: Optional[Mapping[HostToDeviceStream, Any]] = None,
            downcast_inputs: bool = True) -> dict[DeviceToHostStream, np.ndarray]:
        """Run once; returns an array per device-to-host stream, shaped [num_host_transfers,
        instance_replication_factor, *shape] without size-1 dimensions."""
        outputs = self.create_host_outputs()
        self.run_with_outputs(inputs, outputs, downcast_inputs)
        return outputs

    def __repr__(self) -> str:
        return f"popxl.Session(ir={self._ir.id}, device={self._device})"
