"""What the ``popart`` command's subcommands share (``popart run``, ``popart profile``): a
device from ``--device``, input arrays from ``--input NAME=FILE.npy``, a model's inputs and the
arrays fed to them."""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import numpy as np


class CliError(ValueError):
    """A bad command-line argument (reported like a runtime error)."""


def device(spec: str) -> Any:
    """The DeviceInfo for ``cpu``, ``ipumodel:N`` or ``gpu``."""
    import jax

    import popart
    dm = popart.DeviceManager()
    if spec == "cpu":
        return dm.createCpuDevice()
    m = re.fullmatch(r"ipumodel(?::(\d+))?", spec)
    if m:
        return dm.createIpuModelDevice({"numIPUs": int(m.group(1) or 1)})
    if spec == "gpu":
        if jax.default_backend() not in ("gpu", "cuda", "rocm"):
            raise CliError(f"--device gpu: JAX sees no GPU (its backend is "
                           f"'{jax.default_backend()}')")
        return dm.acquireAvailableDevice(1)
    raise CliError(f"--device '{spec}' is not one of cpu, ipumodel:N, gpu")


def parse_inputs(specs: Sequence[str]) -> dict[str, np.ndarray]:
    """``NAME=FILE.npy`` pairs -> arrays (the name may contain '='; the last one splits)."""
    out = {}
    for spec in specs:
        name, sep, path = spec.rpartition("=")
        if not sep or not name or not path:
            raise CliError(f"--input '{spec}' is not of the form NAME=FILE.npy")
        try:
            out[name] = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise CliError(f"--input {name}: file '{path}' does not exist") from None
        except (OSError, ValueError) as e:
            raise CliError(f"--input {name}: cannot read '{path}' as a .npy file: {e}") from None
    return out


def model_inputs(model: Any) -> dict[str, tuple[np.dtype, list[int]]]:
    """Graph inputs that are not initializers: name -> (dtype, shape; -1 for unknown dims)."""
    from onnx import helper
    init = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in init:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        except (KeyError, TypeError, ValueError):
            dtype = np.dtype(object)
        if dtype.kind in "OUS":
            raise CliError(f"Input '{vi.name}' has ONNX element type {tt.elem_type}, which "
                           f"`popart run` cannot feed (numeric and bool inputs only)")
        out[vi.name] = (dtype, dims)
    return out


def feed(name: str, dtype: np.dtype, shape: list[int], given: Optional[np.ndarray], bps: int,
          rng: np.random.Generator) -> np.ndarray:
    """The step's array for one input: the given one (repeated bps times if it has just the
    tensor's shape, cast within its kind) or random data of the tensor's shape."""
    if given is None:
        if -1 in shape:
            raise CliError(f"Input '{name}' has unknown dimensions {shape}: give its data with "
                           f"--input {name}=FILE.npy")
        full = [bps, *shape] if bps > 1 else shape
        if np.issubdtype(dtype, np.floating):
            return rng.standard_normal(full).astype(dtype)
        return np.zeros(full, dtype)  # integer / bool inputs are often indices: zero is valid
    if given.dtype != dtype and np.can_cast(given.dtype, dtype, "same_kind"):
        given = given.astype(dtype)
    if bps > 1 and _matches(given.shape, shape):
        given = np.broadcast_to(given, (bps, *given.shape)).copy()
    return given


def _matches(have: Sequence[int], want: Sequence[int]) -> bool:
    return len(have) == len(want) and all(w in (-1, h) for h, w in zip(have, want))
