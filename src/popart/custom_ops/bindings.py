"""Python stand-ins for the pybind11 classes of C++ custom ops: an op class whose
``createOpInGraph(graph, inputs, outputs, *params, settings)`` (or, for PopART's
ParameterizedOp bindings, ``create_op_in_graph(graph=, inputs=, outputs=, params=,
settings=)``) adds the registered op's node through ``graph.createCustomOp``."""
from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..ops import registry
from ._imports import BINDINGS

ADDONS_DOMAIN = "popxl.addons.ops"
# the copies of C++ ops in Graphcore's popxl applications that differ from popxl-addons' ops
EXAMPLES_DOMAIN = "graphcore.examples.ops"

# op type -> what its C++ grad op reads of the forward op (its gradInputInfo()), in
# popxl.transforms.autodiff's GRAD_READS terms: "none" (the output gradient only), "in",
# "in+out", or (input indices, output indices); absent: its inputs.
GRAD_READS: dict[str, Any] = {}


def register_op(op_type: str, domain: str, version: int = 1, *, grad_reads: Any = None,
                random: bool = False, static_inputs: tuple = ()) -> Callable:
    """Decorator registering ``fn(ctx, *inputs, **attributes)`` (attributes with their
    defaults in its signature) as the Python equivalent of the custom op
    ``domain::op_type`` from ``version`` on; ``Builder.customOp(op_type, version, domain,
    ...)`` and ``graph.createCustomOp`` nodes then run it (docs/op_registry.md).
    ``grad_reads``: what the C++ grad op reads of the forward op (:data:`GRAD_READS`)."""
    if grad_reads is not None:
        GRAD_READS[op_type] = grad_reads
    return registry.register(op_type, domain=domain, since=version, random=random,
                             static_inputs=static_inputs)


def attribute_value(value: Any) -> Any:
    """A parameter of a binding as a node attribute: a replica grouping (PopART's handle or
    popxl's) -> [num replicas, stride, group size]; an enum -> its name; bool -> int; a params
    object -> its fields; arrays -> lists."""
    if hasattr(value, "getGroupSize"):
        return [int(value.getNumReplicas()), int(value.getStride()), int(value.getGroupSize())]
    if hasattr(value, "group_size") and hasattr(value, "num_replicas"):
        return [int(value.num_replicas), int(value.stride), int(value.group_size)]
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if hasattr(value, "name") and hasattr(value, "value") and not isinstance(value, str):
        return str(value.name)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def binding_op(op_type: str, params: Sequence[str] = (), *, domain: str = ADDONS_DOMAIN,
               version: int = 1, name: Optional[str] = None,
               created: Optional[Callable[[Any, dict], None]] = None) -> type:
    """A class standing for a C++ op's pybind11 class: ``createOpInGraph(graph, inputs,
    outputs, *params, settings)`` takes ``params`` (by position or name) and adds
    ``domain::op_type`` (``version``) to ``graph`` with those attributes, through
    ``graph.createCustomOp``; ``create_op_in_graph(graph, inputs, outputs, params, settings)``
    takes a params object (:func:`params_class`) instead. ``created(op, attributes)`` then
    does what the C++ op's setup does beyond its outputs' shapes."""
    params = tuple(params)
    signature = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
         for p in ("graph", "inputs", "outputs", *params)]
        + [inspect.Parameter("settings", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)])

    def add(graph: Any, inputs: dict, outputs: dict, attrs: dict, settings: Any) -> Any:
        attrs = {k: attribute_value(v) for k, v in attrs.items()}
        op = graph.createCustomOp(op_type, domain, version, dict(inputs), dict(outputs), attrs,
                                  settings)
        if created is not None:
            created(op, attrs)
        return op

    def createOpInGraph(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"{cls.__name__}.createOpInGraph{signature}: {e}") from None
        return add(bound["graph"], bound["inputs"], bound["outputs"],
                   {p: bound[p] for p in params}, bound.get("settings"))

    def create_op_in_graph(cls, graph: Any, inputs: dict, outputs: dict, params: Any = None,
                           settings: Any = None, opid: Any = None) -> Any:
        fields = {} if params is None else (
            dataclasses.asdict(params) if dataclasses.is_dataclass(params) else dict(vars(params)))
        return add(graph, inputs, outputs, fields, settings)

    def default_opid(cls) -> tuple:
        return (domain, op_type, version)

    return type(name or f"{op_type}Op", (), {
        "__doc__": f"Python stand-in for the C++ custom op {domain}::{op_type}-{version}.",
        "op_type": op_type, "domain": domain, "version": version, "params": params,
        "createOpInGraph": classmethod(createOpInGraph),
        "create_op_in_graph": classmethod(create_op_in_graph),
        "default_opid": classmethod(default_opid)})


def params_class(name: str, *fields: str) -> type:
    """A params type of a ParameterizedOp binding (``LinearLayoutParams(bs)``): fields by
    position or name, readable and writable."""
    return dataclasses.make_dataclass(name, [(f, Any) for f in fields])


def register_binding(module_name: str, *, when: Optional[Callable[[str], bool]] = None,
                     **names: Any) -> None:
    """Make the cppimport binding module ``module_name`` (its last component, e.g.
    ``"rotary_pos_embed_binding"``) resolve to a module holding ``names`` (op classes from
    :func:`binding_op`, params types from :func:`params_class`) wherever ``<module>.cpp``
    lies beside the importing package. ``when(cpp_path)``: this variant only for the ``.cpp``
    files it accepts (another C++ op under the same module name, e.g. an application's own
    copy); variants with ``when`` are tried first, and one without replaces the last one
    without."""
    variants = BINDINGS.setdefault(module_name.rpartition(".")[2], [])
    if when is None:
        variants[:] = [v for v in variants if v[0] is not None] + [(None, dict(names))]
    else:
        variants.insert(sum(v[0] is not None for v in variants), (when, dict(names)))


def source_contains(file_name: str, text: str) -> Callable[[str], bool]:
    """A ``when`` for :func:`register_binding`: the C++ file ``file_name`` beside the binding's
    ``.cpp`` contains ``text``."""
    def when(cpp: str) -> bool:
        try:
            with open(os.path.join(os.path.dirname(cpp), file_name), encoding="utf-8") as f:
                return text in f.read()
        except OSError:
            return False
    return when


def grad_rule(forward: Callable, backward: Callable) -> Callable:
    """``f(*xs)`` = ``forward(*xs)[0]`` whose gradient is ``backward(residuals, output
    cotangents)`` -> one cotangent (or None) per x: a C++ op's grad op, where it is not what
    differentiating the forward gives."""
    import jax

    @jax.custom_vjp
    def f(*xs: Any) -> Any:
        return forward(*xs)[0]

    f.defvjp(forward, backward)
    return f
