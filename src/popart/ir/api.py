"""``popart.ir``: the experimental predecessor of popxl (user guide ch. 11), as an alias of
popxl. ``import popart.ir as pir`` then ``pir.Ir()``, ``ir.main_graph()``, ``pir.h2d_stream``,
``pir.variable``, ...; ``import popart.ir.ops as ops`` gives popxl.ops.

Importing this module imports nothing heavy: popxl is loaded on the first attribute access
(``__getattr__``, re-exported by popart.ir) or on ``import popart.ir.ops`` (a finder that maps
``popart.ir.ops`` / ``popart.ir.transforms`` / ``popart.ir.dtypes`` to popxl's modules)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

_SUBMODULES = {"popart.ir.ops": "popxl.ops", "popart.ir.transforms": "popxl.transforms",
               "popart.ir.dtypes": "popxl.dtypes", "popart.ir.streams": "popxl.streams",
               "popart.ir.tensor": "popxl.tensor", "popart.ir.context": "popxl.context"}


def __getattr__(name: str) -> Any:
    """popxl's public names, for ``popart.ir.<name>``."""
    if name.startswith("__"):
        raise AttributeError(name)
    popxl = importlib.import_module("popxl")
    try:
        return getattr(popxl, name)
    except AttributeError:
        raise AttributeError(f"module 'popart.ir' has no attribute '{name}'") from None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self.spec  # the import machinery set it to the alias's spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``popart.ir.ops`` & co. as the popxl modules themselves."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _SUBMODULES:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(_SUBMODULES[fullname]))


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.append(_AliasFinder())
