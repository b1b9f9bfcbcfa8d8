"""C++ custom ops with Python equivalents (docs/custom_ops.md).

A C++ custom op (a PopART ``.so`` loaded with ctypes and added by ``Builder.customOp``, or a
popxl-addons op whose pybind11 binding cppimport compiles) runs here as its Python
equivalent: a lowering registered for (domain, op type, version) in the one op registry, with
the C++ grad op as a ``jax.custom_vjp`` (:func:`grad_rule`), and for a cppimport binding module
the Python classes it exposes (:func:`register_binding`, :func:`binding_op`). Importing
popart installs the import finders; popxl-addons' ops are registered here."""
from __future__ import annotations

from . import _imports
from .bindings import (ADDONS_DOMAIN, EXAMPLES_DOMAIN, GRAD_READS, attribute_value, binding_op,  # noqa: F401
                       grad_rule, params_class, register_binding, register_op,
                       source_contains)

__all__ = ["ADDONS_DOMAIN", "EXAMPLES_DOMAIN", "GRAD_READS", "register_op", "register_binding",
           "binding_op", "params_class", "grad_rule", "attribute_value", "source_contains",
           "install_import_hooks"]

install_import_hooks = _imports.install

from . import addons_bindings, addons_collectives, addons_ops, apps_bindings  # noqa: E402,F401

install_import_hooks()
