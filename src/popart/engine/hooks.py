"""The engine's hook interface for compiles: what a compile reports to (a progress logger, a
report's recorder). A front-end registers hooks for the extent of a block
(:func:`compile_hooks`; popart's are ``popart.report``'s); the engine calls
:func:`current`'s at its milestones and does nothing more when none are registered."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional, Protocol


class CompileHooks(Protocol):
    """What a compile calls: ``at`` each milestone ("start", "plan", "lower", "compile"),
    ``compiler_options`` for XLA's compile, ``compiled`` once the step is compiled (returns
    the recorder its runs go through, or None)."""

    def at(self, milestone: str) -> None: ...

    def compiler_options(self) -> Optional[dict]: ...

    def compiled(self, step: Any) -> Any: ...


_hooks: contextvars.ContextVar = contextvars.ContextVar("popart_compile_hooks", default=None)


def current() -> Optional[CompileHooks]:
    """The hooks registered for this block (None: none)."""
    return _hooks.get()


@contextlib.contextmanager
def compile_hooks(hooks: Optional[CompileHooks]) -> Iterator[Optional[CompileHooks]]:
    """Register ``hooks`` for the compiles of a ``with`` block (this thread / context)."""
    token = _hooks.set(hooks)
    try:
        yield hooks
    finally:
        _hooks.reset(token)
