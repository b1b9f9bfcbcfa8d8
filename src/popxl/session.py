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
from typing import Any, Iterable, Mapping, Optional, Union

import jax
import numpy as np

import popart
from popart import distributed
from popart.engine import in_x64, serialised, x64
from popart.engine.config import EngineConfig
from popart.engine.compiled import Placement, fetch
from popart.engine.lower import CHECKS, RECORD, raise_failed_checks
from popart.errors import OptionError
from popart.logging import getLogger

from . import _step
from ._placement import device_ipus, placed_program
from ._state import State, checked_array, make_slots, put, remote_memory_kind
from ._streams import RunPlan, feed, host_shape, validate_streams
from .dtypes import to_numpy
from .fp8_utils import from_host_fp8, host_np_dtype
from .ir import Ir
from .streams import DeviceToHostStream, HostToDeviceStream
from .tensor import Constant, Variable
from .utils import HW_DEVICE_CONNECTION_TIMEOUT, _offline_device_from_str, _to_device_info


_logger = getLogger("session")


# the stream -> array maps of Session.run / run_with_outputs (PopXL's names)
d2hStreamBufferMaps = Mapping[DeviceToHostStream, np.ndarray]
h2dStreamBufferMaps = Mapping[HostToDeviceStream, Any]
StreamBufferMaps = Union[h2dStreamBufferMaps, d2hStreamBufferMaps]


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


class Session:
    """A runtime session for a popxl Ir on device ``device_desc`` ("ipu_hw", "ipu_model",
    "cpu" or a popart.DeviceInfo). Use it as a context manager: entering a context while
    detached attaches the device and copies the weights to it (``weights_from_host``); leaving
    that context copies them back (``weights_to_host``, unless ``weights_to_host_on_exit`` is
    False or the block raised) and detaches. Contexts nest: an inner context entered while
    attached does neither. A session made with an attached DeviceInfo is attached from the
    start (and copies the weights to the device then).

    A facade: the state and its copies are ``_state.State``'s, the step ``_step``'s (placed:
    ``_placement``'s), the streams' checks and feeds ``_streams``'.

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
        main_ir = main._finalize(lowering=True)
        self._h2d = [(s, t) for k, s, t in main._stream_inputs if k == "h2d"]
        self._d2h = [(s, t) for k, s, t in main._stream_inputs if k == "d2h"]
        self._fp8_streams = any(host_np_dtype(s.dtype) != s.dtype.as_device_numpy()
                                for s, _ in self._h2d + self._d2h)
        main_ir.inputs = [t.id for _, t in self._h2d + self._d2h]
        slots, self.remote_memory_kind = make_slots(   # where remote buffers live between runs
            ir, lambda: remote_memory_kind(self._placement))
        self._program = _step.Program(ir, main_ir, tuple(slots), tuple(self._h2d), tuple(self._d2h),
                                      {s: main._hidden[("d2h", s)] for s, _ in self._d2h},
                                      self._n, self._r, self._local_r)
        self._state = State(slots, ir._variables, ir._variable_data, self._r)
        self._lock = threading.RLock()
        self._plan: Optional[RunPlan] = None   # _run_plan's
        self._placed = placed_program(self._program, self._placement, self._device.jax_devices)
        self._compile()
        ir._session = self      # Variable.in_sync_with_ipu
        if self.is_attached:
            self.weights_from_host()

    # ------------------------------------------------------------------ the step
    def _compile(self) -> None:
        """Compile the step for the session's placement (``_placed``: the main graph's IPUs
        on their own devices, or None), through the engine cache when there is one."""
        self._engine_cache_ = _step.engine_cache(self._program, self._config, self._placement,
                                                 self._placed, self.remote_memory_kind)
        built = _step.compile_program(self._program, self._placement, self._placed,
                                      self._engine_cache_)
        self._step, self._checks, self._facts, self.executable_source = built

    @property
    def _slots(self) -> tuple:
        """The state arrays (``_state.StateArray``)."""
        return self._program.slots

    @property
    def _dev(self) -> Optional[dict]:
        """The state on the device (key -> [replicas, ...]), None before it is copied there."""
        return self._state.dev

    @property
    def _buffer_host(self) -> dict:
        """Remote buffers' last contents on the host (key -> [replicas, entries, ...])."""
        return self._state.buffer_host

    def _executor(self) -> Any:
        """The placed program's plan (it packs the state: ``ExecutorPlan.pack`` / ``unpack``),
        or None."""
        return self._placed if self._placed else None

    def _put(self, values: dict) -> dict:
        """The state on the replicas' devices from its global host values ([replicas, ...])."""
        shardings = _step.state_shardings(self._program, self._placement, self._placed)
        return put(values, shardings, self._placement.across_processes)

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
            if self._state.dev is not None:   # the device's newer values, before it changes
                self._state.pull(executor=self._executor())
                self._state.in_sync = True
            if not _runs_on(self._compiled_for, device):
                self._device = device
                return
            old = (self._placement.device, list(self._placement.devices))
            self._device = device
            self._placement = Placement(self._r, device, processes=self._config.processes)
            self._placed = placed_program(self._program, self._placement, device.jax_devices)
            if (self._placement.device, list(self._placement.devices)) != old or self._placed:
                self._compile()
            if self._state.dev is not None:
                self._state.dev = self._put(self._state.device_values(self._executor()))

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
        return self._state.in_sync or v not in self._state.host

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
    @serialised
    @in_x64
    def weights_from_host(self) -> None:
        """Copy the host values of the variables to the device: on-chip variables, the shards
        of replica-sharded variables, and the entries of remote variables in their buffers
        (other entries keep the buffer's contents)."""
        self._require_attached()
        self._state.dev = self._put(self._state.device_values(self._executor()))
        self._state.in_sync, self._state.stale = True, set()

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
        """:meth:`weights_to_host` for the state arrays ``keys`` (None: all): only those a
        run wrote since cross."""
        if self._ir._has_read_only_memmap:
            raise Exception("Writing data from device to host is not possible as the `ir` "
                            "contains a read-only memmap.")
        self._require_attached()
        self._state.pull(keys, self._executor())
        self._state.in_sync = True

    def get_tensor_data(self, tensor: Union[Variable, Constant]) -> np.ndarray:
        """The value of a variable or constant (see :meth:`get_tensors_data`)."""
        return self.get_tensors_data([tensor])[tensor]

    @serialised
    def get_tensors_data(self, tensors: Iterable[Union[Variable, Constant]]) -> dict:
        """Values of variables (fetched from the device when it holds newer ones) and constants,
        as PopXL gives them: a variable made from an ``np.memmap`` gives that very memmap;
        float8 data are PopXL's uint8 records (``popxl.dtypes.np_dtype_float8_143``).

        Raises:
            TypeError: a tensor that is neither a Variable nor a Constant."""
        tensors, state = list(tensors), self._state
        keys = state.keys(tensors)
        if self.is_attached and keys and (not state.in_sync or keys & state.stale):
            self._weights_to_host(keys)   # only the variables asked for
        return state.values(tensors)

    def write_variable_data(self, tensor: Variable, data: np.ndarray) -> None:
        self.write_variables_data({tensor: data})

    @serialised
    def write_variables_data(self, tensors: Mapping[Variable, Any]) -> None:
        """Set variables' values on the host (and on the device when attached: only theirs).

        Raises:
            TypeError, ValueError: not a Variable, data of another dtype or shape
                (``_state.checked_array``)."""
        state = self._state
        keys = state.keys(tensors)
        if self.is_attached:   # the device's newer values of what is written only in part
            state.pull(None if self._placed else {s.key for s in state.slots
                                                  if s.key in keys and s.buffer is not None},
                       self._executor())
        for v, data in tensors.items():
            state.store(v, checked_array(v, data))
        if not self.is_attached:
            return
        if self._placed or state.dev is None:   # placed programs pack the arrays together
            self.weights_from_host()
            return
        values = state.device_values()   # only the arrays written cross
        state.dev = {**state.dev, **self._put({k: values[k] for k in keys})}
        state.stale -= keys
        state.in_sync = True

    # ------------------------------------------------------------------ run
    def expected_inputs(self) -> list[HostToDeviceStream]:
        return [s for s, _ in self._h2d]

    def create_host_outputs(self) -> dict[DeviceToHostStream, np.ndarray]:
        """Zeroed output arrays, one per device-to-host stream (float8: PopXL's uint8 records)."""
        return {s: np.zeros(host_shape(self._n, self._local_r, s.shape), host_np_dtype(s.dtype))
                for s, _ in self._d2h}

    def _validate_run_inputs(self, inputs: h2dStreamBufferMaps) -> None:
        """Check ``inputs`` as :meth:`run` does: every expected input stream and no other,
        each with an array of the right shape (``_streams.validate_streams``).

        Raises:
            ValueError: a stream missing or unexpected, or an array of the wrong shape."""
        validate_streams(inputs, self.expected_inputs(), "input", self._n, self._local_r)

    def _validate_run_outputs(self, outputs: d2hStreamBufferMaps) -> None:
        """:meth:`_validate_run_inputs` for the output arrays of :meth:`run_with_outputs`."""
        validate_streams(outputs, [s for s, _ in self._d2h], "output", self._n, self._local_r)

    def _run_plan(self) -> Optional[RunPlan]:
        """What a run's common path needs, worked out once (None where streams cross
        processes: the general path)."""
        if self._plan is None and not self._placement.across_processes:
            self._plan = RunPlan(self._h2d, self._d2h, self._n, self._local_r)
        return self._plan

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
            if plan is not None and not plan.x64 and self._state.dev is not None:
                return self._run_with_outputs(inputs, outputs, downcast_inputs)
            with x64():
                return self._run_with_outputs(inputs, outputs, downcast_inputs)

    def _run_with_outputs(self, inputs: Optional[Mapping], outputs: Optional[Mapping],
                          downcast_inputs: bool) -> None:
        self._require_attached()
        state = self._state
        if state.dev is None:   # attached by _set_device to a device that came attached
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
            feeds = {t.id: feed(s, inputs[s], self._n, self._local_r) for s, t in self._h2d}
        fit = plan is not None and plan.outputs_fit(outputs)
        if not fit:
            outputs = dict(outputs)
            self._validate_run_outputs(outputs)
        if plan is None:   # across processes: each process puts its own replicas' rows
            feeds = jax.device_put(feeds, self._placed.feed_sharding) if self._placed \
                else self._placement.put(feeds, 0)
        state.dev, outs = self._step(state.dev, feeds)   # host feeds are moved by the call
        state.in_sync = not state.slots   # PopXL: every variable (in_sync_with_ipu)
        state.stale |= state.written       # what crosses back (only when the host asks)
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
            val = np.swapaxes(val, 0, 1).reshape(host_shape(self._n, self._local_r, s.shape))
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
