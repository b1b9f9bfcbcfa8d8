"""The graph-building context: the graph ops are added to, and the annotations, name scopes
and scheduling hints of the ``with`` blocks around them."""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from popart.ir.graph import PIPELINE_STAGE, VIRTUAL_GRAPH  # noqa: F401  (placement names)

if TYPE_CHECKING:
    from .graph import Graph


class _Context:
    def __init__(self) -> None:
        self.graphs: list["Graph"] = []
        self.annotations: list[dict[str, Any]] = []
        self.scopes: list[str] = []


_CTX = _Context()


def get_current_graph() -> "Graph":
    """The graph of the innermost ``with graph:`` block."""
    if not _CTX.graphs:
        raise RuntimeError("No graph is being built: add ops inside a `with ir.main_graph:` "
                           "(or `with graph:`) block")
    return _CTX.graphs[-1]


gcg = get_current_graph


def get_main_graph() -> "Graph":
    return get_current_graph().ir.main_graph


gmg = get_main_graph


def current_annotations() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in _CTX.annotations:
        out.update(a)
    return out


def scope_prefix() -> str:
    return "".join(s + "/" for s in _CTX.scopes)


@contextmanager
def _annotate(**attrs: Any) -> Iterator[None]:
    _CTX.annotations.append(attrs)
    try:
        yield
    finally:
        _CTX.annotations.pop()


def ipu(ipu: int) -> Any:
    """Place the ops of the block on IPU ``ipu`` (the node's virtual-graph annotation)."""
    return _annotate(**{VIRTUAL_GRAPH: int(ipu)})


def pipeline_stage(stage: int) -> Any:
    """Annotate the ops of the block with a pipeline stage."""
    return _annotate(**{PIPELINE_STAGE: int(stage)})


def io_tiles() -> Any:
    """Ops of the block run on IO tiles (kept as an annotation; no effect on XLA)."""
    return _annotate(__io_tiles=1)


def in_sequence(enabled: bool = True) -> Any:
    """Ops of the block run in the order they are created. Ops always run in creation order
    here, so this only annotates them."""
    return _annotate(__in_sequence=bool(enabled))


def merge_exchange() -> Any:
    """Accepted for compatibility; host / remote exchanges are not merged on XLA."""
    return _annotate(__merge_exchange=1)


@contextmanager
def name_scope(name: str) -> Iterator[None]:
    """Prefix the names of tensors created in the block with ``name/``."""
    _CTX.scopes.append(name)
    try:
        yield
    finally:
        _CTX.scopes.pop()


@contextmanager
def _graph_scope(graph: "Graph") -> Iterator[None]:
    _CTX.graphs.append(graph)
    try:
        yield
    finally:
        _CTX.graphs.pop()
