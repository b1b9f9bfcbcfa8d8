"""popxl.Session: compiles the Ir's main graph once (jax.jit) and runs it.

One ``run`` is one call into the compiled program: replicas side by side (``vmap`` with the
replica axis, so collectives work), the main graph once per replica, host loads reading
successive elements of their streams. Variables stay on the device between runs, stored as
[replicas, *shape]."""
from __future__ import annotations

import threading
from typing import Any, Iterable, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

import popart
from popart.engine.lower import CHECKS, TraceState, check_flags, execute, first_failure, raise_failed_checks
from popart.engine.program import REPLICA_AXIS
from popart.engine import in_x64
from popart.session import _serialised

from .ir import Ir
from .streams import DeviceToHostStream, HostToDeviceStream
from .tensor import Constant, Variable


def _device(desc: Any, replicas: int) -> Any:
    if isinstance(desc, popart.DeviceInfo):
        return desc
    dm = popart.DeviceManager()
    if desc == "cpu":
        if replicas > 1:
            raise ValueError("The 'cpu' device does not support replication; use 'ipu_model' or 'ipu_hw'")
        return dm.createCpuDevice()
    if desc == "ipu_model":
        return dm.createIpuModelDevice({"numIPUs": replicas})
    if desc == "ipu_hw":
        return dm.acquireAvailableDevice(replicas)
    raise ValueError(f"device_desc must be 'ipu_hw', 'ipu_model', 'cpu' or a popart.DeviceInfo, got {desc!r}")


class Session:
    """A runtime session for a popxl Ir on device ``device_desc`` ("ipu_hw", "ipu_model",
    "cpu" or a popart.DeviceInfo). Use it as a context manager: entering attaches the device
    and copies the weights to it; leaving copies them back and detaches.

    Thread safety: running and moving weights (run, run_with_outputs, weights_from_host,
    weights_to_host, get_tensors_data, write_variables_data) hold the session's lock, so
    threads sharing a session take turns."""

    @in_x64
    def __init__(self, ir: Ir, device_desc: Any = "cpu") -> None:
        self._ir = ir
        self._r = ir.replication_factor
        self._n = ir.num_host_transfers
        self._device = _device(device_desc, self._r)
        self._jax_device = (getattr(self._device, "jax_devices", None) or jax.devices())[0]
        main = ir.main_graph
        self._main_ir = main._finalize()
        self._variables: list[Variable] = list(ir._variables)
        self._h2d = [(s, t) for k, s, t in main._stream_inputs if k == "h2d"]
        self._d2h = [(s, t) for k, s, t in main._stream_inputs if k == "d2h"]
        self._d2h_final = {s: main._hidden[("d2h", s)] for s, _ in self._d2h}
        self._main_ir.inputs = [t.id for _, t in self._h2d + self._d2h]
        self._host: dict[Variable, np.ndarray] = {v: np.array(ir._variable_data[v]) for v in self._variables}
        self._dev: Optional[dict] = None
        self._in_sync = True
        self._attached = False
        self._lock = threading.RLock()
        self._checks: list = []
        self._compile()

    # ------------------------------------------------------------------ compile
    def _step(self):
        n, variables = self._n, self._variables
        final_ids = {v.id: v._ir_id for v in variables}
        d2h = [(s, t.id, self._d2h_final[s]._ir_id) for s, t in self._d2h]
        main_ir, r = self._main_ir, self._r

        def replica(weights: dict, feeds: dict) -> tuple:
            feeds = dict(feeds)
            for s, tid, _ in d2h:
                feeds[tid] = jnp.zeros((n,) + s.shape, s.dtype.as_numpy())
            state = TraceState(rng_key=jax.random.key(0), replica_axis=REPLICA_AXIS, replication_factor=r)
            env = execute(main_ir, feeds, state, weights=weights)
            new_w = {vid: jnp.asarray(env[fid]).astype(weights[vid].dtype) for vid, fid in final_ids.items()}
            outs = {tid: jnp.asarray(env[fid]) for _, tid, fid in d2h}
            self._checks[:] = state.registry   # run-time checks (indices in range, ...)
            if state.checks:
                outs[CHECKS] = check_flags(state)
            return new_w, outs

        def step(weights: dict, feeds: dict) -> tuple:
            return jax.vmap(replica, axis_name=REPLICA_AXIS, axis_size=r)(weights, feeds)
        return step

    def _compile(self) -> None:
        r, n = self._r, self._n
        wspecs = {v.id: jax.ShapeDtypeStruct((r,) + v.shape, v.dtype.as_numpy()) for v in self._variables}
        fspecs = {t.id: jax.ShapeDtypeStruct((r, n) + s.shape, s.dtype.as_numpy()) for s, t in self._h2d}
        with jax.default_device(self._jax_device):
            self._compiled = jax.jit(self._step(), donate_argnums=(0,)).lower(wspecs, fspecs).compile()

    # ------------------------------------------------------------------ context / device
    @property
    def ir(self) -> Ir:
        return self._ir

    @property
    def device(self) -> Any:
        return self._device

    @property
    def is_attached(self) -> bool:
        return self._attached

    def __enter__(self) -> "Session":
        if not self._device.isAttached and not self._device.attach():
            raise RuntimeError("Could not attach to the session's device")
        self._attached = True
        self.weights_from_host()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._attached:
            self.weights_to_host()
        self._attached = False
        self._device.detach()

    def _require_attached(self) -> None:
        if not self._attached:
            raise ValueError("Must be attached to device before calling a runtime function. Put the "
                             "call inside a `Session` context, for example `with session: session.run()`.")

    # ------------------------------------------------------------------ weights
    def _per_replica(self, v: Variable, data: np.ndarray) -> np.ndarray:
        g = v.replica_grouping
        if g is not None and g.num_groups > 1:
            return np.stack([data[a] for a in g.assignment])
        return np.broadcast_to(data, (self._r,) + v.shape)

    @_serialised
    @in_x64
    def weights_from_host(self) -> None:
        """Copy the host values of the variables to the device."""
        self._require_attached()
        self._dev = {v.id: jax.device_put(np.ascontiguousarray(self._per_replica(v, self._host[v])),
                                          self._jax_device) for v in self._variables}
        self._in_sync = True

    @_serialised
    @in_x64
    def weights_to_host(self) -> None:
        """Copy the device values of the variables to the host."""
        self._require_attached()
        if self._in_sync or self._dev is None:
            return
        for v in self._variables:
            arr = np.asarray(self._dev[v.id])
            g = v.replica_grouping
            if g is not None and g.num_groups > 1:
                self._host[v] = arr[g.first_replicas()]
            else:
                self._host[v] = arr[0]
            if v.retrieval_mode == "all_replicas" and self._r > 1:
                self._host_all = getattr(self, "_host_all", {})
                self._host_all[v] = arr
        self._in_sync = True

    def get_tensor_data(self, tensor: Union[Variable, Constant]) -> np.ndarray:
        return self.get_tensors_data([tensor])[tensor]

    @_serialised
    def get_tensors_data(self, tensors: Iterable[Union[Variable, Constant]]) -> dict:
        """Values of variables (fetched from the device when it holds newer ones) and constants."""
        tensors = list(tensors)
        out = {}
        for t in tensors:
            if not isinstance(t, (Variable, Constant)):
                raise TypeError(f"{t} is not of type Constant or Variable. get_tensor_data is not "
                                f"supported for this type.")
        if self._attached and not self._in_sync and any(isinstance(t, Variable) for t in tensors):
            self.weights_to_host()
        for t in tensors:
            if isinstance(t, Variable):
                all_r = getattr(self, "_host_all", {})
                out[t] = np.array(all_r[t] if t in all_r and t.retrieval_mode == "all_replicas"
                                  else self._host[t])
            else:
                out[t] = np.array(t._graph._g.initializers[t.id])
        return out

    def write_variable_data(self, tensor: Variable, data: np.ndarray) -> None:
        self.write_variables_data({tensor: data})

    @_serialised
    def write_variables_data(self, tensors: Mapping[Variable, Any]) -> None:
        """Set variables' values on the host (and on the device when attached)."""
        for v, data in tensors.items():
            if not isinstance(v, Variable):
                raise TypeError(f"Tensor {v.id} is not of type Variable. write_variable_data is not "
                                f"supported for this type.")
            arr = np.asarray(data)
            want = v.shape_on_host
            if arr.dtype != v.dtype.as_numpy():
                if np.ndim(data) == 0 and not isinstance(data, np.ndarray):
                    arr = arr.astype(v.dtype.as_numpy())
                else:
                    raise TypeError(f"Variable '{v.id}' is {v.dtype.name}, data is {arr.dtype}")
            if arr.shape != tuple(want):
                if arr.size == 1 and not want:
                    arr = arr.reshape(())
                else:
                    raise ValueError(f"Variable '{v.id}' has host shape {list(want)}, data has {list(arr.shape)}")
            if self._attached and not self._in_sync:
                self.weights_to_host()
            self._host[v] = np.array(arr)
        if self._attached:
            self.weights_from_host()

    # ------------------------------------------------------------------ run
    def expected_inputs(self) -> list[HostToDeviceStream]:
        return [s for s, _ in self._h2d]

    def _host_shape(self, shape: tuple) -> tuple:
        return tuple(d for d in (self._n, self._r) if d != 1) + tuple(shape)

    def create_host_outputs(self) -> dict[DeviceToHostStream, np.ndarray]:
        """Zeroed output arrays, one per device-to-host stream."""
        return {s: np.zeros(self._host_shape(s.shape), s.dtype.as_numpy()) for s, _ in self._d2h}

    def _feed(self, s: HostToDeviceStream, arr: Any, downcast: bool) -> np.ndarray:
        a = np.asarray(arr)
        want_dt = s.dtype.as_numpy()
        if a.dtype != want_dt:
            if downcast or np.can_cast(a.dtype, want_dt, "same_kind"):
                a = a.astype(want_dt)
            else:
                raise TypeError(f"Input for stream '{s.name}' is {a.dtype}, expected {want_dt}")
        full = (self._n, self._r) + s.shape
        if a.shape != self._host_shape(s.shape) and a.shape != full:
            raise ValueError(f"Input for stream '{s.name}' has shape {list(a.shape)}; expected "
                             f"{list(self._host_shape(s.shape))} ([num_host_transfers={self._n}, "
                             f"replication={self._r}, *{list(s.shape)}] without size-1 dimensions)")
        return np.ascontiguousarray(np.swapaxes(a.reshape(full), 0, 1))  # [R, N, ...]

    @_serialised
    @in_x64
    def run_with_outputs(self, inputs: Optional[Mapping[HostToDeviceStream, Any]] = None,
                         outputs: Optional[Mapping[DeviceToHostStream, np.ndarray]] = None,
                         downcast_inputs: bool = True) -> None:
        """Run once, writing the device-to-host streams into ``outputs``' arrays."""
        self._require_attached()
        inputs = dict(inputs or {})
        feeds = {}
        for s, t in self._h2d:
            if s not in inputs:
                raise ValueError(f"No input was given for host-to-device stream '{s.name}' "
                                 f"(expected inputs: {[x.name for x, _ in self._h2d]})")
            feeds[t.id] = self._feed(s, inputs.pop(s), downcast_inputs)
        if inputs:
            raise ValueError(f"Inputs {[getattr(s, 'name', s) for s in inputs]} are not streams "
                             f"that this Ir loads from")
        with jax.default_device(self._jax_device):
            self._dev, outs = self._compiled(self._dev, feeds)
        if CHECKS in outs:
            raise_failed_checks(first_failure(outs.pop(CHECKS)), self._checks)
        self._in_sync = not self._variables
        for s, t in self._d2h:
            if outputs is None or s not in outputs:
                continue
            val = np.swapaxes(np.asarray(outs[t.id]), 0, 1).reshape(self._host_shape(s.shape))
            dst = outputs[s]
            if dst.shape != val.shape:
                raise ValueError(f"Output array for stream '{s.name}' has shape {list(dst.shape)}; "
                                 f"expected {list(val.shape)}")
            np.copyto(dst, val, casting="unsafe")

    def run(self, inputs: Optional[Mapping[HostToDeviceStream, Any]] = None,
            downcast_inputs: bool = True) -> dict[DeviceToHostStream, np.ndarray]:
        """Run once; returns an array per device-to-host stream, shaped [num_host_transfers,
        replication, *shape] without size-1 dimensions."""
        outputs = self.create_host_outputs()
        self.run_with_outputs(inputs, outputs, downcast_inputs)
        return outputs

    def __repr__(self) -> str:
        return f"popxl.Session(ir={self._ir.id}, device={self._device})"
