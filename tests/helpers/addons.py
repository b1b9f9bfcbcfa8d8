"""popxl-addons imported as a user imports it, for the tests that use it: installed, or a
checkout named by ``POPXL_ADDONS_DIR``; ``mpi4py.MPI`` stood in by a one-process stand-in where
mpi4py has no MPI library (popxl-addons only uses it for a barrier between instances). popxl-addons
is not on PyPI, so these tests skip where it is absent (as in CI); every behaviour they check also
has a test that does not need it."""
from __future__ import annotations

import importlib
import os
import sys
import types

import pytest


def _stub_mpi() -> None:
    try:
        import mpi4py.MPI  # noqa: F401
    except Exception:   # no mpi4py, or no libmpi for it
        stub = types.ModuleType("mpi4py.MPI")
        stub.COMM_WORLD = types.SimpleNamespace(Barrier=lambda: None, Get_rank=lambda: 0,
                                                Get_size=lambda: 1)
        pkg = sys.modules.get("mpi4py") or types.ModuleType("mpi4py")
        pkg.MPI = stub
        sys.modules.update({"mpi4py": pkg, "mpi4py.MPI": stub})


def import_addons() -> types.ModuleType:
    """The ``popxl_addons`` package; ImportError (or what its import raised) where it cannot be
    imported."""
    path = os.environ.get("POPXL_ADDONS_DIR")
    if path and path not in sys.path:
        sys.path.append(path)
    _stub_mpi()
    return importlib.import_module("popxl_addons")


def addons_or_skip(module_level: bool = False) -> types.ModuleType:
    """``popxl_addons``, else skip the test (or the module)."""
    try:
        return import_addons()
    except Exception as e:   # not there, or a dependency of it missing
        pytest.skip(f"popxl_addons cannot be imported ({type(e).__name__}: {e}); install it or "
                    "set POPXL_ADDONS_DIR to a checkout", allow_module_level=module_level)
