"""An ONNX backend (``onnx.backend.base.Backend``) running models through this runtime.

``prepare(model)`` imports the model once; each distinct set of input shapes / dtypes is
compiled once with ``jax.jit``. Inputs that decide output shapes (Reshape's shape, Slice's
starts, TopK's k, ...) must be compile-time constants in this runtime: when such an input is a
graph input, the program is specialized on its value (and recompiled for a new value).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from .engine import in_x64
from .engine.lower import NOT_STATIC
from .engine.segments import graph_runner
from .errors import UnsupportedOperatorError
from ._ir.graph import Graph
from ._ir.onnx_import import import_model
from .ops import registry

def _jax_devices(device: str) -> list:
    kind = Device(device).type
    try:
        return jax.devices("cpu" if kind == DeviceType.CPU else "gpu")
    except RuntimeError:
        return []


def _static_graph_inputs(graph: Graph) -> set:
    """Graph inputs that feed an input a registered op declares static."""
    out, inputs = set(), set(graph.inputs)
    for node in graph.nodes:
        try:
            opdef = registry.lookup(node.domain, node.op_type, graph.opsets.get(node.domain, 1))
        except UnsupportedOperatorError:
            continue
        out |= {node.inputs[i] for i in opdef.static_inputs
                if i < len(node.inputs) and node.inputs[i] in inputs}
    return out


def _to_numpy(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_to_numpy(x) for x in v]
    return None if v is None else np.asarray(v)


def _to_device(v: Any, dev: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_to_device(x, dev) for x in v]
    return None if v is None else jax.device_put(np.asarray(v), dev)


def _key(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return ("seq",) + tuple(_key(x) for x in v)
    return None if v is None else (v.dtype.str, v.shape, v.tobytes())


class PopartBackendRep(BackendRep):
    """A prepared model: ``run(inputs)`` with inputs positional (graph inputs that are not
    initializers, in order) or a dict by name; returns the outputs in order."""

    @in_x64
    def __init__(self, model: Any, device: str = "CPU"):
        self.graph, self.model = import_model(model)
        devs = _jax_devices(device)
        if not devs:
            raise UnsupportedOperatorError(f"device {device!r} is not available to JAX")
        self.device = devs[0]
        self.static = _static_graph_inputs(self.graph)
        self._cache: dict = {}

    def _fn(self, static_feeds: dict):
        key = tuple(sorted((k, _key(v)) for k, v in static_feeds.items()))
        if key not in self._cache:
            self._cache[key] = graph_runner(self.graph, self.graph.outputs, static_feeds)
        return self._cache[key]

    @in_x64
    def run(self, inputs: Any, **kwargs: Any) -> tuple:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            inputs = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            feeds = dict(zip(self.graph.inputs, inputs))
        feeds = {k: _to_numpy(v) for k, v in feeds.items()}
        missing = [i for i in self.graph.inputs if i not in feeds]
        if missing:
            raise UnsupportedOperatorError(f"missing model inputs: {missing}")
        rng = jax.random.key(int(kwargs.get("seed", 0)))
        static = set(self.static) | {k for k, v in feeds.items()      # XLA has no strings
                                     if isinstance(v, np.ndarray) and v.dtype.kind in "OUS"}
        while True:
            st = {k: v for k, v in feeds.items() if k in static}
            dyn = {k: _to_device(v, self.device) for k, v in feeds.items() if k not in static}
            try:
                out = self._fn(st)(dyn, rng)
                break
            except UnsupportedOperatorError as e:
                # Specialize on shape-like inputs (integer tensors, short vectors, scalars:
                # shapes, axes, counts, scales) and retry.
                more = {k for k, v in feeds.items() if isinstance(v, np.ndarray) and (
                    v.ndim == 0 or (v.ndim == 1 and v.size <= 16)
                    or (v.dtype.kind in "iub" and v.size <= 4096))} - static
                said = " ".join((str(e), *getattr(e, "__notes__", ())))
                if NOT_STATIC not in said or not more:
                    raise
                static |= more
        return tuple(_to_numpy(o) for o in out)


class PopartBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        graph, _ = import_model(model)
        return all(registry.is_registered(n.domain, n.op_type) for n in graph.nodes)

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> PopartBackendRep:
        return PopartBackendRep(model, device)

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple:
        return cls.prepare(model, device).run(inputs, **kwargs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Optional[Sequence] = None, opset: Optional[int] = None,
                 **kwargs: Any) -> tuple:
        arrays = [np.asarray(x) for x in inputs]
        names = [n for n in node.input if n]
        graph = onnx.helper.make_graph(
            [node], "node",
            [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype),
                                                a.shape) for n, a in zip(names, arrays)],
            [onnx.ValueInfoProto(name=o) for o in node.output if o])
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(
            node.domain or "", opset or onnx.defs.onnx_opset_version())])
        return cls.run_model(model, arrays, device, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            return bool(_jax_devices(device))
        except Exception:
            return False


prepare = PopartBackend.prepare
run_model = PopartBackend.run_model
run_node = PopartBackend.run_node
supports_device = PopartBackend.supports_device
is_compatible = PopartBackend.is_compatible


# ---------------------------------------------------------------------------------------
# ONNX's node conformance cases (used by tests/test_onnx_backend.py and tools/conformance.py)

def node_cases() -> list:
    """ONNX's node test cases (generated from the installed onnx package)."""
    import warnings
    from onnx.backend.test.loader import load_model_tests
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sorted((_in_memory(c) for c in load_model_tests(kind="node")), key=lambda c: c.name)


def _in_memory(case: Any) -> Any:
    """``case`` with its model and data sets loaded (onnx < 1.23 leaves them in the case's
    folder, read as onnx's backend test Runner reads them)."""
    import dataclasses
    import glob
    import os
    from onnx.backend.test.runner import Runner
    if case.model is not None or not case.model_dir:
        return case
    model = onnx.load(os.path.join(case.model_dir, "model.onnx"))
    sets = []
    for d in sorted(glob.glob(os.path.join(case.model_dir, "test_data_set_*"))):
        ins: list = []
        outs: list = []
        for kind, values, target in (("input", model.graph.input, ins), ("output", model.graph.output, outs)):
            for i in range(len(glob.glob(os.path.join(d, f"{kind}_*.pb")))):
                Runner._load_proto(None, os.path.join(d, f"{kind}_{i}.pb"), target, values[i].type)
        sets.append((ins, outs))
    return dataclasses.replace(case, model=model, data_sets=sets)


def case_opset(case: Any) -> int:
    return max([o.version for o in case.model.opset_import if o.domain in ("", "ai.onnx")] or [0])


def case_is_tensor_typed(case: Any) -> bool:
    g = case.model.graph
    return all(v.type.HasField("tensor_type") for v in list(g.input) + list(g.output))


def check_case(case: Any, device: str = "CPU", runtime: str = "popart") -> None:
    """Run one case and compare as onnx's backend test runner does; raises on mismatch.
    ``runtime="onnxruntime"`` runs the case through onnxruntime instead (for comparison)."""
    from onnx.backend.test.runner import Runner
    rep = prepare(case.model, device) if runtime == "popart" else _OrtRep(case.model)
    for inputs, ref in case.data_sets:
        outs = rep.run([_as_array(x) for x in inputs])
        Runner.assert_similar_outputs([_as_array(x) for x in ref], list(outs),
                                      rtol=case.rtol, atol=case.atol)


def _as_array(x: Any) -> Any:
    """A data-set value as onnx's runner normalises it (TensorProto -> NumPy)."""
    return onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x


class _OrtRep:
    """onnxruntime behind the BackendRep interface (the comparison column of the
    conformance tool)."""

    def __init__(self, model: Any) -> None:
        import onnxruntime as ort
        self.sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.sess.get_inputs()]

    def run(self, inputs: list) -> list:
        return self.sess.run(None, dict(zip(self.names, inputs)))
