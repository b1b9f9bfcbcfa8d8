"""The graph-building context: the graph ops are added to, and the annotations, name scopes
and scheduling hints of the ``with`` blocks around them."""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

from popart.ir.graph import PIPELINE_STAGE, VIRTUAL_GRAPH  # noqa: F401  (placement names)

if TYPE_CHECKING:
    from .graph import Graph
    from .ir import Ir


class _Context:
    def __init__(self) -> None:
        self.graphs: list["Graph"] = []
        self.annotations: list[dict[str, Any]] = []
        self.scopes: list[str] = []
        self.debug: list[str] = []          # op_debug_context names, outermost first
        self.hooks: dict[int, tuple] = {}   # handle -> (graph, fn)
        self.next_hook = 0


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


def get_ir() -> "Ir":
    """The Ir of the graph being built."""
    return get_current_graph().ir


gir = get_ir


def current_annotations() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in _CTX.annotations:
        out.update(a)
    if _CTX.debug:
        out["__debug_context"] = debug_context_name()
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


def in_sequence(mode: Union[bool, str] = True, *, enabled: Optional[bool] = None) -> Any:
    """Ops of the block run in the order they are created (``mode`` True), in any order
    (False), or ``"pass"`` (no constraint added). Ops always run in creation order here, so
    this only annotates them (``__in_sequence``: True, False or "pass"). ``enabled`` is an
    alias of ``mode``."""
    if enabled is not None:
        mode = enabled
    if mode is None:
        raise TypeError("`None` cannot be passed to `in_sequence`. Try `False` instead.")
    if mode != "pass" and not isinstance(mode, (bool, int)):
        raise ValueError(f"`in_sequence` mode not understood: {mode!r}. Must be one of `True`, "
                         f"`False`, `'pass'`.")
    return _annotate(__in_sequence=mode if mode == "pass" else bool(mode))


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


def op_debug_context(name: Any) -> Any:
    """Decorator naming the ops a function creates: ``@op_debug_context`` (the function's
    name) or ``@op_debug_context("name")``. Nodes created inside get the annotation
    ``__debug_context`` ("outer/inner", joined with the name scopes)."""
    def outer(func: Callable, label: str) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _CTX.debug.append(label)
            try:
                return func(*args, **kwargs)
            finally:
                _CTX.debug.pop()
        return wrapper

    if callable(name):
        return outer(name, name.__name__)
    return lambda func: outer(func, str(name))


def register_op_created_hook(graph: "Graph", fn: Callable) -> int:
    _CTX.next_hook += 1
    _CTX.hooks[_CTX.next_hook] = (graph, fn)
    return _CTX.next_hook


def remove_op_created_hook(handle: int) -> None:
    if handle not in _CTX.hooks:
        raise ValueError(f"Unknown op created hook {handle}")
    del _CTX.hooks[handle]


def op_created(graph: "Graph", node: Any) -> None:
    for g, fn in list(_CTX.hooks.values()):
        if g is graph:
            fn(node)


def placement() -> tuple:
    """(IPU, tile set) of tensors created now: the innermost ``ipu`` block's IPU (None
    outside one) and "io" inside ``io_tiles``, else "compute"."""
    a = current_annotations()
    return a.get(VIRTUAL_GRAPH), ("io" if a.get("__io_tiles") else "compute")


def debug_context_name() -> str:
    return "/".join(_CTX.scopes + _CTX.debug)


@contextmanager
def _graph_scope(graph: "Graph") -> Iterator[None]:
    _CTX.graphs.append(graph)
    try:
        yield
    finally:
        _CTX.graphs.pop()
