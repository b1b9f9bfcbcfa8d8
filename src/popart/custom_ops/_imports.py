"""Import resolution for C++ custom ops: a cppimport binding module (``from . import
rotary_pos_embed_binding`` beside ``rotary_pos_embed_binding.cpp``) resolves to its registered
Python equivalent, and ``cppimport`` / ``cppimport.import_hook`` resolve to a tiny stand-in
where the real cppimport is not installed. See docs/custom_ops.md."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any, Callable, Optional, Sequence

# binding module name (its last component) -> its registered variants, in the order they are
# tried: (when(cpp path) -> bool, or None for any; the names it exposes: classes, params types)
BINDINGS: dict[str, list[tuple[Optional[Callable[[str], bool]], dict[str, Any]]]] = {}
STAND_IN = "__popart_stand_in__"   # set on the stand-in cppimport modules


def _cpp_beside(name: str, path: Optional[Sequence[str]]) -> Optional[str]:
    """``<dir>/<name>.cpp`` in the importing package's directories (``path``), or in
    sys.path's for a top-level module; None when there is none."""
    for d in (path if path is not None else sys.path):
        cpp = os.path.join(d or ".", name + ".cpp") if isinstance(d, str) else ""
        if cpp and os.path.isfile(cpp):
            return cpp
    return None


class _Loader(importlib.abc.Loader):
    """Makes a module from a dict of names."""

    def __init__(self, names: dict, doc: str) -> None:
        self.names, self.doc = names, doc

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = self.doc
        module.__dict__.update(self.names)


class _RealHookLoader(importlib.abc.Loader):
    """The real ``cppimport.import_hook``'s loader, then :class:`BindingFinder` put back in
    front of the finder that module inserts."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        install()


class BindingFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: a registered binding module whose ``.cpp`` lies beside it is
    its Python equivalent; keeps itself ahead of a real cppimport hook."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        name = fullname.rpartition(".")[2]
        if fullname == "cppimport.import_hook":
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _RealHookLoader(spec.loader)
            return spec
        cpp = _cpp_beside(name, path) if name in BINDINGS else None
        if cpp is None:
            return None
        names = next((n for when, n in BINDINGS[name] if when is None or when(cpp)), None)
        if names is None:
            return None
        doc = f"Python equivalent of the C++ custom op binding {cpp} (popart.custom_ops)."
        spec = importlib.util.spec_from_loader(fullname, _Loader(names, doc), origin=cpp)
        return spec


def _imp(fullname: str) -> types.ModuleType:
    """cppimport.imp: import ``fullname`` (a registered binding resolves to its equivalent)."""
    return importlib.import_module(fullname)


def _imp_from_filepath(filepath: str, fullname: Optional[str] = None) -> types.ModuleType:
    """cppimport.imp_from_filepath: the module of ``filepath``'s name (or ``fullname``)."""
    return _imp(fullname or os.path.splitext(os.path.basename(filepath))[0])


_STAND_INS = {
    "cppimport": ({"imp": _imp, "imp_from_filepath": _imp_from_filepath, "settings": {},
                   STAND_IN: True, "__path__": []},
                  "Stand-in for cppimport (not installed): binding modules resolve to their "
                  "registered Python equivalents (popart.custom_ops)."),
    "cppimport.import_hook": ({STAND_IN: True},
                              "Stand-in for cppimport.import_hook: nothing to install."),
}


def real_cppimport_hook() -> bool:
    """True when the real ``cppimport.import_hook`` is loaded."""
    hook = sys.modules.get("cppimport.import_hook")
    return hook is not None and not getattr(hook, STAND_IN, False)


class FallbackFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path, so asked only for what no other finder found: ``cppimport``
    and ``cppimport.import_hook`` (the stand-ins), and an unregistered binding module whose
    ``.cpp`` exists (an ImportError saying how to register an equivalent)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname in _STAND_INS:
            names, doc = _STAND_INS[fullname]
            return importlib.util.spec_from_loader(fullname, _Loader(dict(names), doc),
                                                   is_package=fullname == "cppimport")
        name = fullname.rpartition(".")[2]
        cpp = _cpp_beside(name, path)
        if cpp is None or real_cppimport_hook():
            return None
        raise ImportError(   # not ModuleNotFoundError: `from . import x` would replace its message
            f"Cannot import the C++ custom op binding '{fullname}': '{cpp}' needs a C++ "
            f"compiler and PopART's libraries, which this runtime does not use, and no Python "
            f"equivalent is registered for '{name}'. Register one before importing it: "
            f"popart.custom_ops.register_binding('{name}', <OpClass>=popart.custom_ops."
            f"binding_op(op_type, params, domain=..., version=...)), with its lowering "
            f"registered by @popart.custom_ops.register_op(op_type, domain, version) "
            f"(docs/custom_ops.md)", name=fullname)


_FIRST, _LAST = BindingFinder(), FallbackFinder()


def install() -> None:
    """Put :class:`BindingFinder` first on sys.meta_path and :class:`FallbackFinder` last
    (idempotent)."""
    for f in (_FIRST, _LAST):
        while f in sys.meta_path:
            sys.meta_path.remove(f)
    sys.meta_path.insert(0, _FIRST)
    sys.meta_path.append(_LAST)
