"""C++ custom ops with Python equivalents (docs/custom_ops.md).

A C++ custom op (a PopART ``.so`` loaded with ctypes and added by ``Builder.customOp``, or a
popxl-addons op whose pybind11 binding cppimport compiles) runs here as its Python
equivalent: a lowering registered for (domain, op type, version) in the one op registry, with
the C++ grad op as a ``jax.custom_vjp`` (:func:`grad_rule`), and for a cppimport binding module
the Python classes it exposes (:func:`register_binding`, :func:`binding_op`). Importing
popart installs the import finders; popxl-addons' ops are registered here."""
from __future__ import annotations

from typing import Callable

from ..ops import registry as _registry
from . import _imports
from .bindings import (ADDONS_DOMAIN, attribute_value, binding_op, grad_rule,  # noqa: F401
                       params_class, register_binding)

__all__ = ["ADDONS_DOMAIN", "register_op", "register_binding", "binding_op", "params_class",
           "grad_rule", "attribute_value", "install_import_hooks"]


def register_op(op_type: str, domain: str, version: int = 1, *, random: bool = False,
                static_inputs: tuple = ()) -> Callable:
    """Decorator registering ``fn(ctx, *inputs, **attributes)`` (attributes with their
    defaults in its signature) as the Python equivalent of the custom op
    ``domain::op_type`` from ``version`` on; ``Builder.customOp(op_type, version, domain,
    ...)`` and ``graph.createCustomOp`` nodes then run it (docs/op_registry.md)."""
    return _registry.register(op_type, domain=domain, since=version, random=random,
                              static_inputs=static_inputs)


install_import_hooks = _imports.install

from . import addons_bindings, addons_collectives, addons_ops  # noqa: E402,F401

install_import_hooks()
