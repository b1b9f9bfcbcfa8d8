"""Typing helpers of popxl (named ``typing_`` so as not to shadow the standard ``typing``)."""
from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def NewAliasAnnotation(name: str, tp: T) -> T:  # noqa: N802  (PopXL's name)
    """An annotation that static type checkers read as ``tp`` and that is a distinct object at
    run time (``inspect.signature(fn).parameters["x"].annotation is Id``). Calling it raises
    NotImplementedError."""
    def symbol(*_: Any, **__: Any) -> Any:
        raise NotImplementedError(f"{name} should only be used as an annotation. Try using the "
                                  f"associated type alias instead: {tp}")
    symbol.__name__ = symbol.__qualname__ = name
    return symbol  # type: ignore[return-value]
