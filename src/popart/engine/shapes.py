"""Shape / dtype inference and one-shot execution of IR graphs (no session)."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import popart_exception
from .._ir.graph import Graph
from .._ir.onnx_import import ModelLike, import_model
from ..tensorinfo import TensorInfo, to_datatype
from . import in_x64
from .config import EngineConfig
from .lower import trace
from .segments import Segmented, graph_runner, has_data_dependent


def input_specs(graph: Graph, overrides: Optional[Mapping[str, TensorInfo]] = None) -> dict:
    """jax.ShapeDtypeStruct of every stream input; unknown dimensions are an error."""
    specs = {}
    for tid in graph.inputs:
        info = (overrides or {}).get(tid) or graph.tensor_info.get(tid)
        shape = None if info is None else info._shape
        if info is None or shape is None or any(d is None or d < 0 for d in shape):
            given = "no type" if info is None else f"shape {shape}"
            raise popart_exception(
                f"Input tensor '{tid}' has {given}: every input needs a fully specified shape "
                f"and type; give it with inputShapeInfo (popart.InputShapeInfo().add('{tid}', "
                f"popart.TensorInfo(dtype, shape)))")
        if info.np_dtype().kind in "OUS":
            raise popart_exception(f"Input tensor '{tid}' is a {info.data_type()} tensor: the "
                                   f"compiled program takes numeric and bool inputs only")
        specs[tid] = jax.ShapeDtypeStruct(tuple(shape), info.np_dtype())
    return specs


@in_x64
def infer_graph(graph: Graph, ids: Optional[Iterable[str]] = None,
                overrides: Optional[Mapping[str, TensorInfo]] = None,
                training: bool = False, config: Optional[EngineConfig] = None) -> dict[str, TensorInfo]:
    """TensorInfo of ``ids`` (default: every tensor) by tracing the graph abstractly; with
    ``training``, as a training session's forward pass (BatchNormalization's statistics
    outputs, active dropout); with a session's ``config``, by PopART's rules where they
    differ from ONNX's (ArgMax's INT32, Scan's concatenated outputs)."""
    specs = input_specs(graph, overrides)
    wanted = list(ids) if ids is not None else graph.all_tensor_ids()

    def fn(feeds):
        env = trace(graph, feeds, training=training, config=config).env
        return {k: env[k] for k in wanted if k in env and env[k] is not None}

    if has_data_dependent(graph):   # -1 for dimensions that depend on run-time data
        out = {**graph.initializers,
               **Segmented(graph, wanted, config=config, training=training).infer(specs)}
        out = {k: out[k] for k in wanted if k in out}
    else:
        out = jax.eval_shape(fn, specs)
    return {k: TensorInfo(to_datatype(v.dtype), list(v.shape)) for k, v in out.items()
            if hasattr(v, "dtype")}   # sequences have no TensorInfo


def infer_tensor_infos(model: ModelLike) -> dict[str, TensorInfo]:
    """TensorInfo of every tensor of an ONNX model (ops of any registered domain)."""
    graph, _ = import_model(model)
    return infer_graph(graph)


@in_x64
def run_model(model: Any, feeds: Mapping[str, np.ndarray], outputs: Optional[list[str]] = None,
              training: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Compile and run a model once on ``feeds`` (tests, the ONNX backend). ``model`` is
    anything ``import_model`` takes, or an IR Graph."""
    graph = model if isinstance(model, Graph) else import_model(model)[0]
    outputs = list(outputs or graph.outputs)

    run = graph_runner(graph, outputs, training=training)
    res = run({k: jnp.asarray(v) for k, v in feeds.items()}, jax.random.key(seed))
    return {k: np.asarray(v) for k, v in zip(outputs, res)}
