"""The layers keep to their own names (issue 26): popxl imports no private popart name and
shares the IR through ``popart.engine.graph_api``; ``popart.ir`` is only popxl's alias;
``popart._internal.ir`` (PopART's C++ binding) names popxl's handles on its IR."""
from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys
import types

import pytest

import popart
import popxl

POPXL_DIR = pathlib.Path(popxl.__file__).parent
POPXL_FILES = sorted(POPXL_DIR.rglob("*.py"))


def _private(dotted: str) -> bool:
    """Whether a dotted name has a private component (``_x``; dunders such as ``__file__`` are
    public attributes of any module)."""
    return any(part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
               for part in dotted.split("."))


def _is_popart(module: str | None) -> bool:
    return module is not None and (module == "popart" or module.startswith("popart."))


def private_popart_uses(path: pathlib.Path) -> list[str]:
    """``line: name`` for each private popart name the file imports or reads as an attribute of
    a popart module it imported."""
    tree = ast.parse(path.read_text(), str(path))
    found, modules = [], {}   # local name -> the popart module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_popart(alias.name):
                    if _private(alias.name):
                        found.append(f"{node.lineno}: import {alias.name}")
                    local = alias.asname or alias.name.split(".")[0]
                    modules[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_popart(node.module):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _private(full):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                elif isinstance(getattr(importlib.import_module(node.module), alias.name, None),
                                types.ModuleType):
                    modules[alias.asname or alias.name] = full
    for node in ast.walk(tree):   # popart_module.x._y
        if isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in modules:
                dotted = ".".join([modules[inner.id], *reversed(chain)])
                if _private(dotted):
                    found.append(f"{node.lineno}: {dotted}")
    return sorted(set(found))


def test_scan_finds_private_names(tmp_path):
    """The scan itself: each form of reaching a private popart name is reported."""
    src = tmp_path / "m.py"
    src.write_text("import popart as _p\nimport popart._ir.graph\nfrom popart.options import _enum\n"
                   "from popart import engine\nfrom popart.engine.graph_api import Node\n"
                   "x = _p.session._serialised\ny = engine._x\nz = _p.__file__\n")
    assert private_popart_uses(src) == [
        "2: import popart._ir.graph", "3: from popart.options import _enum",
        "6: popart.session._serialised", "7: popart.engine._x"]


@pytest.mark.parametrize("path", POPXL_FILES, ids=lambda p: str(p.relative_to(POPXL_DIR)))
def test_popxl_imports_no_private_popart_name(path):
    assert private_popart_uses(path) == []


def test_engine_graph_api_is_the_internal_ir():
    """popxl's graphs are the engine's IR graphs, reached through ``popart.engine.graph_api``."""
    from popart.engine import graph_api as ir
    assert set(ir.__all__) <= set(dir(ir))
    ir_ = popxl.Ir()
    with ir_.main_graph:
        x = popxl.variable(1.0) + 1.0
    graph = ir_.main_graph._finalize()
    assert isinstance(graph, ir.Graph) and all(isinstance(n, ir.Node) for n in graph.nodes)
    assert x.id in graph.nodes[-1].outputs and len(ir.fingerprint(graph)) > 0


def test_fresh_imports_have_no_cycle():
    """``popart.engine.graph_api`` first, then popxl, in a fresh interpreter."""
    code = ("import popart.engine.graph_api as e, popxl, popart; "
            "assert e.Graph is popxl.graph.IRGraph")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_popart_ir_is_popxl():
    import popart.ir.transforms
    import popart.ir.ops
    assert popart.ir.transforms is popxl.transforms
    assert popart.ir.transforms.autodiff is popxl.transforms.autodiff
    assert popart.ir.ops is popxl.ops
    assert popart.ir.Ir is popxl.Ir


def test_popart_internal_ir_is_popxls_binding_facade():
    """``popart._internal.ir`` (PopART's C++ binding) names popxl's live handles on its IR."""
    binding = importlib.import_module("popart._internal.ir")
    assert binding.Graph is type(popxl.Ir().main_graph._pb_graph)
