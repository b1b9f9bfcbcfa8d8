"""popxl.Session's state: the arrays it keeps on the device between runs (variables, the
shards of replica-sharded variables, remote buffers) and their host values, and the copies
between the two. Only what changed crosses: a run marks the arrays it writes stale, and a
read of the host values fetches only those asked for (a placed program packs its arrays
together: all of them)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional

import jax
import numpy as np

from popart import distributed
from popart.engine.backends import backend
from popart.engine.compiled import Placement, fetch
from popart.engine.state import Home
from popart.logging import getLogger

from .fp8_utils import from_host_fp8, host_np_dtype, to_host_fp8
from .tensor import Constant, Variable

if TYPE_CHECKING:
    from .ir import Ir

_logger = getLogger("session")


@dataclass
class StateArray:
    """One array of the session's device state, [replicas, *shape] split over the replicas'
    devices: the value of ``graph_in`` in the main graph before a run; ``graph_out`` (a
    tensor: its latest version; None: ``graph_in``) after it. Where it is kept is its
    ``home`` (``popart.engine.state.Home``, the record popart's sessions keep too): the
    replica sharding of a ``replica_sharded_variable`` (its shards), the memory kind of a
    remote buffer; the placed program gives it an IPU. A variable, the shards of a
    replica-sharded one, or a remote buffer (``buffer``)."""
    key: str                        # its key in the device state
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


def make_slots(ir: "Ir", memory_kind: Callable[[], Optional[str]]) -> tuple[list[StateArray], str]:
    """The device state of ``ir``: each on-chip variable ([replicas, *shape]); each
    replica-sharded variable of ``replica_sharded_variable`` (its shards, [replicas, shard
    size]); each remote buffer that ops use or remote variables live in ([replicas, entries,
    *shape], in the memory kind ``memory_kind()`` gives), and where remote buffers live
    between runs ("device" or a memory kind).

    Raises:
        ValueError: ops use a remote buffer in another shape than its own."""
    main = ir.main_graph
    slots, buffers = [], {}
    for v in ir._variables:
        if v._remote is None:
            slots.append(StateArray(v.id, v.shape, v.dtype.as_device_numpy(), v.id, v, var=v))
        elif v._shard is not None:
            sh = v._shard
            slots.append(StateArray(v.id, sh.shape, sh.dtype.as_device_numpy(), sh.id, sh, var=v,
                                    home=Home(shards=v._sharding)))
        else:
            buffers.setdefault(v._remote[0], [])
    for key in main._hidden:
        if isinstance(key, tuple) and key[0] == "remote":
            buffers.setdefault(key[1], [])
    for (buf, off), v in ir._remote_entries.items():
        if buf in buffers and v._shard is None:
            buffers[buf].append(v)
    kind = memory_kind() if buffers else None
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
        slots.append(StateArray(key, shape, buf.tensor_dtype.as_device_numpy(),
                                t.id if t is not None else key, t, buffer=buf,
                                entries=buffers[buf], home=Home(memory_kind=kind)))
    return slots, kind or "device"


def remote_memory_kind(placement: Placement) -> Optional[str]:
    """The memory kind remote buffers live in between runs on ``placement``'s devices:
    ``POPXL_REMOTE_MEMORY_KIND`` ("auto" default, "device", or a memory kind such as
    "pinned_host"). "auto" is the backend's choice ("pinned_host" where the devices have it,
    except on CPU, whose device memory is host memory). None: the devices' default memory."""
    want = os.environ.get("POPXL_REMOTE_MEMORY_KIND", "auto").strip().lower() or "auto"
    devices = [d for d in placement.devices or [placement.device]
               if d.process_index == jax.process_index()]
    try:
        kinds = set.intersection(*({m.kind for m in d.addressable_memories()} for d in devices))
        default = devices[0].default_memory().kind
    except Exception:   # noqa: BLE001  (a backend without memory kinds)
        kinds, default = set(), None
    platform = placement.platform
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


def put(values: dict, shardings: dict, across_processes: bool) -> dict:
    """The state on the replicas' devices from its global host values ([replicas, ...]):
    across processes, each puts only its own replicas' rows."""
    if across_processes:
        return {k: jax.make_array_from_callback(x.shape, shardings[k], lambda i, x=x: x[i])
                for k, x in values.items()}
    return jax.device_put(values, {k: shardings[k] for k in values})


def checked_array(v: Variable, data: Any) -> np.ndarray:
    """``data`` as the host value of variable ``v`` (popxl's ``write_variable_data`` rules).

    Raises:
        TypeError: not a Variable; data of another dtype (a Python number for a float8 one).
        ValueError: data of another shape.
        NotImplementedError: an "all_replicas" variable in groups of several replicas."""
    if not isinstance(v, Variable):
        raise TypeError(f"Tensor {v.id} is not of type Variable. write_variable_data is not "
                        f"supported for this type.")
    arr, want = np.asarray(data), v.shape_on_host
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
    return np.array(arr)


class State:
    """The session's state arrays (``slots``) on the device (``dev``: key -> [replicas, ...];
    None before the first copy to the device) and their host values: each variable's (its
    np.memmap kept, not copied), each "all_replicas" variable's per replica, each remote
    buffer's last contents. ``stale``: the arrays whose device value is newer than the
    host's; ``in_sync``: no run since the host values were read (PopXL's
    ``in_sync_with_ipu``)."""

    def __init__(self, slots: list[StateArray], variables: Iterable[Variable],
                 data: Mapping[Variable, Any], replicas: int) -> None:
        self.slots, self.r = slots, replicas
        self.host: dict[Variable, np.ndarray] = {
            v: d if isinstance(d, np.memmap) else np.array(d)
            for v, d in ((v, data[v]) for v in variables)}
        self.host_all: dict[Variable, np.ndarray] = {}   # all_replicas variables: [replicas, ...]
        self.buffer_host: dict[str, np.ndarray] = {}     # remote buffers' last contents
        self.written = {s.key for s in slots   # the arrays a run writes (a newer version)
                        if s.graph_out is not None and s.graph_out._ir_id != s.graph_in}
        self.slot_of = {v: s.key for s in slots   # variable -> the array that holds it
                        for v in ([s.var] if s.var is not None else s.entries)}
        self.dev: Optional[dict] = None
        self.stale: set[str] = set()
        self.in_sync = True

    def keys(self, tensors: Iterable[Any]) -> set[str]:
        """The state arrays holding the variables among ``tensors``."""
        return {self.slot_of[t] for t in tensors if isinstance(t, Variable) and t in self.slot_of}

    def per_replica(self, v: Variable, data: np.ndarray) -> np.ndarray:
        """Each replica's value of ``v`` ([replicas, *shape]) from its host value."""
        g = v.replica_grouping
        if g is not None and g.num_groups > 1:
            return np.stack([data[a] for a in g.assignment])
        return np.broadcast_to(data, (self.r,) + v.shape)

    def device_values(self, executor: Any = None) -> dict:
        """Each array's value for the device, [replicas, ...], from the host values; with a
        placed program's ``executor``, packed into the slots of their IPUs."""
        out = {}
        for s in self.slots:
            if s.home.shards is not None:
                out[s.key] = s.home.shards.to_replicas(self.host[s.var])
            elif s.buffer is None:
                out[s.key] = self.per_replica(s.var, self.host[s.var])
            else:
                base = self.buffer_host.get(s.key)
                arr = np.array(base) if base is not None else np.zeros((self.r,) + s.shape, s.dtype)
                for v in s.entries:
                    off = v._remote[1]
                    if v._sharding is not None:
                        arr[:, off] = v._sharding.to_replicas(self.host[v])
                    else:
                        arr[:, off] = self.per_replica(v, self.host[v]).reshape(arr[:, off].shape)
                out[s.key] = arr
            out[s.key] = np.ascontiguousarray(out[s.key], dtype=s.dtype)
        if executor is not None:
            return executor.pack([{s.graph_in: out[s.key][r] for s in self.slots}
                                  for r in range(self.r)])
        return out

    def pull(self, keys: Optional[set] = None, executor: Any = None) -> None:
        """The host values of the arrays ``keys`` (None: all) from the device, of those whose
        device value is newer: only those cross (a placed program's ``executor`` unpacks its
        slots: all of them)."""
        keys = self.stale if keys is None else self.stale & keys
        if not keys or self.dev is None:
            return
        get = dict(get=distributed.global_value, what="Copying the weights to the host")
        if executor is not None:   # every instance's replicas
            per = executor.unpack(dict(zip(self.dev, fetch(list(self.dev.values()), **get))))
            values = {s.key: np.stack([p[s.graph_in] for p in per]) for s in self.slots}
        else:
            order = [s.key for s in self.slots if s.key in keys]   # the same on every instance
            values = dict(zip(order, fetch([self.dev[k] for k in order], **get)))
        self.take(values)

    def take(self, values: dict) -> None:
        """The host values from the arrays' device values ``values`` (key -> [replicas, ...]);
        variables made from an np.memmap get them written and flushed."""
        for s in self.slots:
            arr = values.get(s.key)
            if arr is None:
                continue
            if s.home.shards is not None:
                self._set_sharded(s.var, arr)
            elif s.buffer is None:
                self._set(s.var, arr)
            else:
                self.buffer_host[s.key] = arr
                for v in s.entries:
                    entry = arr[:, v._remote[1]]
                    if v._sharding is not None:
                        self._set_sharded(v, entry)
                    else:   # the entry's data in the variable's shape (PopXL: any of its size)
                        self._set(v, entry.reshape((len(entry),) + v.shape))
        for v in self.host:
            v._flush_data_if_memmap()
        self.stale -= set(values)

    def store(self, v: Variable, value: np.ndarray) -> None:
        """Set the host value of ``v`` (written into its np.memmap when it has one)."""
        if isinstance(self.host.get(v), np.memmap):
            self.host[v][...] = value
        else:
            self.host[v] = value
        self.host_all.pop(v, None)

    def _set(self, v: Variable, arr: np.ndarray) -> None:
        """The host value of ``v`` from each replica's value ([replicas, *shape])."""
        g = v.replica_grouping
        self.store(v, arr[g.first_replicas()] if g is not None and g.num_groups > 1 else arr[0])
        if v.retrieval_mode == "all_replicas" and self.r > 1:
            self.host_all[v] = arr

    def _set_sharded(self, v: Variable, shards: np.ndarray) -> None:
        """The host value of a replica-sharded ``v`` from each replica's shard
        ([replicas, shard size]): each group's shards put together, padding removed."""
        layout = v._sharding
        values = layout.group_values(shards)
        self.store(v, values if layout.num_groups > 1 else values[0])
        if v.retrieval_mode == "all_replicas" and self.r > 1:
            self.host_all[v] = values[layout.data_group]

    def values(self, tensors: list) -> dict:
        """The host values of variables and constants ``tensors``, as PopXL gives them: a
        variable made from an ``np.memmap`` gives that very memmap; "all_replicas" ones one
        value per replica; float8 data are PopXL's uint8 records.

        Raises:
            TypeError: a tensor that is neither a Variable nor a Constant."""
        out = {}
        for t in tensors:
            if not isinstance(t, (Variable, Constant)):
                raise TypeError(f"{t} is not of type Constant or Variable. get_tensor_data is not "
                                f"supported for this type.")
        for t in tensors:
            if isinstance(t, Variable):
                if t.retrieval_mode == "all_replicas" and self.r > 1:   # one value per replica
                    out[t] = np.array(self.host_all[t] if t in self.host_all
                                      else self.per_replica(t, self.host[t]))
                elif t._memmap_arr is not None:   # PopXL: the very np.memmap it was made from
                    out[t] = t._memmap_arr
                else:
                    out[t] = np.array(self.host[t])
            else:
                out[t] = np.array(t._graph._g.initializers[t.id])
            out[t] = to_host_fp8(out[t])   # float8: PopXL's uint8 records
        return out
