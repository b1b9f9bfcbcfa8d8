"""``popart.ir``: the experimental predecessor of popxl (user guide ch. 11), as an alias of
popxl. ``import popart.ir as pir`` then ``pir.Ir()``, ``ir.main_graph()``, ``pir.h2d_stream``,
``pir.variable``, ...; ``import popart.ir.ops as ops`` gives popxl.ops.

This package is only that alias (the internal IR is ``popart._ir``). Importing it imports
nothing heavy: popxl is loaded on the first attribute access (``__getattr__``) or on
``import popart.ir.<module>`` (a finder that gives popxl's module ``popxl.<module>`` itself)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

_PREFIX = __name__ + "."   # popart.ir.<module> is popxl.<module>


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
        if not fullname.startswith(_PREFIX):
            return None
        target_name = "popxl." + fullname[len(_PREFIX):]
        if importlib.util.find_spec(target_name) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(target_name))


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    # first: the path finder would otherwise load popxl's files again under popart.ir names
    sys.meta_path.insert(0, _AliasFinder())
