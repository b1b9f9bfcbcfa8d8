"""The graph-building context (PopXL's ``popxl.context``): the stack of graphs ops are added
to, and the IPU, tile set, name scopes, scheduling hints, debug context and op-created hooks
of the ``with`` blocks around them. One :class:`Context` per process
(:func:`get_current_context`)."""
from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager
from typing import (TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Tuple, TypeVar,
                    Union, overload)

import popart as _popart
from popart.debug_info import DebugContext, DebugInfo, ProfileValue, SourceLocation
from popart.engine.graph_api import PIPELINE_STAGE, VIRTUAL_GRAPH  # noqa: F401  (placement names)

from .tensorlocation import ExecutionContext

if TYPE_CHECKING:
    from .graph import Graph
    from .ir import Ir

#: The key of PopXL's in-sequence bookkeeping: (graph id, execution context).
InSequenceKey = Tuple[str, Any]

_NO_GRAPH = ("Trying to access {what}, but no graph has been selected. Hint - try performing the "
             "operations in a context manager (for example `with graph_instance:`) or inside a "
             "function that's called by `popxl.Ir().create_graph()`")

# Files of this package and of popart: frames skipped when locating the user's code.
_PACKAGE_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, _popart.__file__))


class Context:
    """The state of graph building: the graphs entered (``with graph:``, innermost last), the
    IPU (``ipu``), IO tiles (``io_tiles``), name scopes (``name_scope``), in-sequence mode
    (``in_sequence``), the op debug context and the op-created hooks."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._graphs: list["Graph"] = []
        self._ipu_id: Optional[int] = None          # None: no ``ipu`` block (PopXL's IPU 0)
        self._io_tile_set = False
        self._in_sequence_mode: Union[None, bool, str] = None   # None: no block; "pass"
        self._annotations: list[dict[str, Any]] = []  # pipeline stage, merge exchange blocks
        self._name_scope: list[str] = []
        self._debug: list[str] = []                  # op_debug_context names, outermost first
        self._debug_info: Optional[DebugInfo] = None
        self._debug_context_frame_offset = 0
        self._execution_context: Any = ExecutionContext.Normal
        self._hook_handle = 0
        self._op_created_hooks: dict[int, Callable[[Any], Any]] = {}
        self._op_graph: Optional["Graph"] = None     # the graph of the op being reported

    # ------------------------------------------------------------------ PopXL's members
    @property
    def ipu_id(self) -> Optional[int]:
        """The IPU of ops created now: the innermost ``ipu`` block's, else 0."""
        return 0 if self._ipu_id is None else self._ipu_id

    @property
    def io_tile_set(self) -> bool:
        """True inside an ``io_tiles`` block."""
        return self._io_tile_set

    def push_name_scope(self, name: str) -> None:
        self._name_scope.append(name)

    def pop_name_scope(self) -> str:
        return self._name_scope.pop()

    @property
    def name_scopes(self) -> list[str]:
        """The name scopes, outermost first (a copy)."""
        return list(self._name_scope)

    def push_graph(self, g: "Graph") -> None:
        """Enter graph ``g``.

        Raises:
            RuntimeError: if a graph of another Ir is already entered.
        """
        if self._graphs and self._graphs[0].ir is not g.ir:
            raise RuntimeError("Trying to a create a context manager nested in another context, "
                               "when the previous context's Ir is different. "
                               f"{self._graphs[0].ir} != {g.ir}")
        self._graphs.append(g)

    def pop_graph(self) -> "Graph":
        return self._graphs.pop()

    def _first(self, what: str) -> "Graph":
        if not self._graphs:
            raise RuntimeError(_NO_GRAPH.format(what=what))
        return self._graphs[0]

    @property
    def graph(self) -> "Graph":
        """The graph of the innermost ``with graph:`` block."""
        self._first("a graph")
        return self._graphs[-1]

    @property
    def main_graph(self) -> "Graph":
        return self._first("the main_graph").main_graph

    @property
    def ir(self) -> "Ir":
        return self._first("the ir").main_graph.ir

    @property
    def in_sequence(self) -> Optional[bool]:
        """True / False inside an ``in_sequence`` block of that mode; None outside one or
        in a ``"pass"`` block."""
        mode = self._in_sequence_mode
        return None if mode == "pass" else mode

    @in_sequence.setter
    def in_sequence(self, enabled: Optional[bool]) -> None:
        self._in_sequence_mode = enabled

    @in_sequence.deleter
    def in_sequence(self) -> None:
        raise AttributeError("Cannot delete in_sequence. Set to 'False' instead.")

    def register_op_created_hook(self, fn: Callable[[Any], Any]) -> int:
        """Call ``fn(op)`` (a ``popart._internal.ir.Op``) after each op is created, in any
        graph; returns a handle for
        :meth:`remove_op_created_hook`."""
        self._hook_handle += 1
        self._op_created_hooks[self._hook_handle] = fn
        return self._hook_handle

    def remove_op_created_hook(self, handle: int) -> None:
        if handle not in self._op_created_hooks:
            raise ValueError(f"Unknown op created hook {handle}")
        del self._op_created_hooks[handle]

    def _add_in_sequence_topocons(self, op: Any) -> None:
        """Order ``op`` (an IR node, or a call site info's op) as if it were created now
        (PopXL's private method, which popxl-addons calls for an op created in an
        ``in_sequence("pass")`` block): it takes the current ``in_sequence`` mode; outside an
        ``in_sequence`` block or in a "pass" block it is left as it is.

        Raises:
            ValueError: the in-sequence mode is not True, False or "pass" (PopXL's message).
        """
        mode = self._in_sequence_mode
        if mode is None or mode == "pass":
            return
        if not isinstance(mode, bool):
            raise ValueError(f"`in_sequence` mode not understood: {mode}. "
                             "Must be one of `True`, `False`, `'pass'`.")
        while not hasattr(op, "annotations"):   # CallSiteInfo -> its _SubgraphOp -> the node
            op = getattr(op, "_op", None) or op.node
        op.annotations["__in_sequence"] = mode

    # ------------------------------------------------------------------ package internals
    def _op_created(self, op: Any) -> None:
        """Run the op-created hooks for ``op``, a ``popart._internal.ir.Op`` (PopXL's
        signature, which popxl-addons calls; popxl's own ops: ``_pb.op_created``)."""
        if not isinstance(op, _UPPER.op):
            raise TypeError(f"_op_created expects a popart._internal.ir.Op, got {type(op).__name__}")
        prev, self._op_graph = self._op_graph, op._graph
        try:
            for fn in list(self._op_created_hooks.values()):
                fn(op)
        finally:
            self._op_graph = prev

    def _get_op_settings(self, name: str) -> Any:
        """The settings (``popart._internal.ir.Settings``) of an op named ``name`` created now
        in the current graph: its name after the name scopes, and the placement annotations of
        the enclosing blocks (IPU, IO tiles, pipeline stage, execution context, ...)."""
        return _UPPER.settings(self.graph, "/".join((*self._name_scope, name)))

    def _annotations_now(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self._ipu_id is not None:
            out[VIRTUAL_GRAPH] = self._ipu_id
        if self._io_tile_set:
            out["__io_tiles"] = 1
        if self._in_sequence_mode is not None:
            out["__in_sequence"] = self._in_sequence_mode
        if self._execution_context != ExecutionContext.Normal:
            out["__execution_context"] = self._execution_context.name
        for a in self._annotations:
            out.update(a)
        if self._debug:
            out["__debug_context"] = "/".join(self._name_scope + self._debug)
        return out


class _Upper:
    """What this module uses of the modules above it, set by them when they are imported (so
    that it imports none of them): popxl's ``Tensor`` class (tensor.py), whose instances among
    an op's arguments and results the debug records list; the binding's op handle class, which
    op-created hooks receive, and its op-settings maker ``settings(graph, name)`` (_pb.py)."""
    tensor: tuple = ()
    op: tuple = ()
    settings: Callable[[Any, str], Any]


_UPPER = _Upper()
_CURRENT_CONTEXT = Context()
_CTX = _CURRENT_CONTEXT   # (the package's short name for it)


def get_current_context() -> Context:
    """The process's graph-building context."""
    return _CURRENT_CONTEXT


def get_current_graph() -> "Graph":
    """The graph of the innermost ``with graph:`` block (alias ``gcg``).

    Raises:
        RuntimeError: outside any graph.
    """
    return _CTX.graph


def get_main_graph() -> "Graph":
    """The main graph of the Ir being built (alias ``gmg``)."""
    return _CTX.main_graph


def get_ir() -> "Ir":
    """The Ir being built (alias ``gir``)."""
    return _CTX.ir


gcg = get_current_graph
gmg = get_main_graph
gir = get_ir


@contextmanager
def _setting(attr: str, value: Any) -> Iterator[Any]:
    """Set the context's ``attr`` for the block; the previous value afterwards."""
    prev = getattr(_CTX, attr)
    setattr(_CTX, attr, value)
    try:
        yield value
    finally:
        setattr(_CTX, attr, prev)


@contextmanager
def _annotate(**attrs: Any) -> Iterator[None]:
    _CTX._annotations.append(attrs)
    try:
        yield
    finally:
        _CTX._annotations.pop()


def ipu(ipu: int) -> Any:
    """Set the IPU for ops created in this context (the node's virtual-graph annotation)."""
    return _setting("_ipu_id", int(ipu))


def pipeline_stage(stage: int) -> Any:
    """Annotate the ops of the block with a pipeline stage."""
    return _annotate(**{PIPELINE_STAGE: int(stage)})


def io_tiles() -> Any:
    """Execute ops created in this context on IO tiles of the current IPU (an annotation; no
    effect on XLA)."""
    return _setting("_io_tile_set", True)


def in_sequence(mode: Union[bool, str] = True, *, enabled: Optional[bool] = None) -> Any:
    """Ops of the block run in the order they are created (``mode`` True), in any order
    (False), or ``"pass"`` (no constraint added). Ops always run in creation order here, so
    this annotates them (``__in_sequence``: True, False or "pass"). ``enabled`` is an alias of
    ``mode``.

    Raises:
        TypeError: if ``mode`` is None.
        ValueError: if ``mode`` is not True, False or "pass".
    """
    if enabled is not None:
        mode = enabled
    if mode is None:
        raise TypeError("`None` cannot be passed to `in_sequence`. Try `False` instead.")
    if mode != "pass" and not isinstance(mode, (bool, int)):
        raise ValueError(f"`in_sequence` mode not understood: {mode!r}. Must be one of `True`, "
                         f"`False`, `'pass'`.")
    return _setting("_in_sequence_mode", mode if mode == "pass" else bool(mode))


def merge_exchange() -> Any:
    """Accepted for compatibility; host / remote exchanges are not merged on XLA."""
    return _annotate(__merge_exchange=1)


@contextmanager
def name_scope(name: str) -> Iterator[list[str]]:
    """Prefix the names of tensors and ops created in the block with ``name/``; yields the
    name scopes."""
    _CTX.push_name_scope(name)
    try:
        yield _CTX.name_scopes
    finally:
        _CTX.pop_name_scope()


@contextmanager
def debug_context_frame_offset(i: int) -> Iterator[int]:
    """Move the source location recorded for ops created in the block ``i`` frames further
    out (plus one, for the frame this adds when used as a decorator)."""
    _CTX._debug_context_frame_offset += i + 1
    try:
        yield _CTX._debug_context_frame_offset
    finally:
        _CTX._debug_context_frame_offset -= i + 1


@contextmanager
def _execution_context(execution_context: Any) -> Iterator[Any]:
    """Ops of the block belong to ``execution_context`` (a popxl ``ExecutionContext``),
    kept as the node annotation ``__execution_context``."""
    with _setting("_execution_context", execution_context):
        yield execution_context


def get_source_location(offset: int) -> SourceLocation:
    """The location (function, real path of the file, line) of the frame ``offset`` levels
    above the caller.

    Raises:
        IndexError: if the stack is not that deep.
    """
    depth = 0
    frame = sys._getframe(1)
    while frame is not None and depth < offset:
        frame, depth = frame.f_back, depth + 1
    if frame is None:
        stack = len(_frames(sys._getframe(0)))   # PopXL counts this function's frame too
        raise IndexError(f"Incorrect source location offset. Stack {stack}, Offset {offset + 1}")
    return SourceLocation(frame.f_code.co_name, os.path.realpath(frame.f_code.co_filename),
                          frame.f_lineno)


def _frames(frame: Any) -> list:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def _user_location() -> SourceLocation:
    """The first frame outside popxl and popart (the user's line that created an op), moved
    out by the enclosing ``debug_context_frame_offset`` blocks."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIRS):
        frame = frame.f_back
    for _ in range(_CTX._debug_context_frame_offset):
        if frame is None or frame.f_back is None:
            break
        frame = frame.f_back
    if frame is None:
        return SourceLocation()
    return SourceLocation(frame.f_code.co_name, os.path.realpath(frame.f_code.co_filename),
                          frame.f_lineno)


def _tensor_ids(values: Iterable[Any]) -> ProfileValue:
    return ProfileValue([t.id for t in values if isinstance(t, _UPPER.tensor)])


def _op_debug_info(api: str, inputs: Iterable[Any], location: SourceLocation) -> DebugInfo:
    """PopXL's debug record of an op: layer "popxl", named by the name scopes and ``api``,
    with the values category "op", api and the input tensor ids."""
    di = DebugInfo(DebugContext("/".join((*_CTX._name_scope, api)), location), "popxl")
    di.setValue("category", "op")
    di.setValue("api", api)
    di.setValue("inputs", _tensor_ids(inputs))
    return di


def _set_outputs(di: DebugInfo, result: Any) -> None:
    if isinstance(result, _UPPER.tensor):
        result = [result]
    try:
        di.setValue("outputs", _tensor_ids(result))
    except TypeError:
        pass


Fn = TypeVar("Fn")


@overload
def op_debug_context(name: str) -> Callable[[Fn], Fn]:
    ...


@overload
def op_debug_context(name: Fn) -> Fn:
    ...


def op_debug_context(name: Any) -> Any:
    """Decorator naming the ops a function creates: ``@op_debug_context`` (the function's
    name) or ``@op_debug_context("name")``. Each call records a debug record (layer "popxl",
    category "op", api the name, the input and output tensor ids, the caller's location), and
    nodes created inside get the annotation ``__debug_context`` ("outer/inner", after the
    name scopes)."""
    def outer(func: Callable, label: str) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ctx = _CTX
            loc = get_source_location(ctx._debug_context_frame_offset + 1)
            di = _op_debug_info(label, (*args, *kwargs.values()), loc)
            prev = ctx._debug_info
            ctx._debug_info = di
            ctx._debug.append(label)
            try:
                result = func(*args, **kwargs)
            finally:
                ctx._debug.pop()
                ctx._debug_info = prev
            if result is not None:
                _set_outputs(di, result)
            return result
        return wrapper

    if callable(name):
        return outer(name, name.__name__)
    return lambda func: outer(func, str(name))


# ---------------------------------------------------------------------- package internals
def current_annotations() -> dict[str, Any]:
    """The annotations of a node created now."""
    return _CTX._annotations_now()


def placement() -> tuple:
    """(IPU, tile set) of tensors created now: the innermost ``ipu`` block's IPU (None
    outside one) and "io" inside ``io_tiles``, else "compute"."""
    return _CTX._ipu_id, ("io" if _CTX._io_tile_set else "compute")


def register_op_created_hook(graph: "Graph", fn: Callable) -> int:
    """A hook called for the ops created in ``graph`` only."""
    @functools.wraps(fn)
    def hook(node: Any) -> None:
        if _CTX._op_graph is graph:
            fn(node)
    return _CTX.register_op_created_hook(hook)


def remove_op_created_hook(handle: int) -> None:
    _CTX.remove_op_created_hook(handle)
