"""popxl.Module: a class whose ``build`` method defines a graph."""
from __future__ import annotations

from typing import Any


class Module:
    """Subclass and define ``build``; ``ir.create_graph(module, *args)`` builds a graph from
    it, and calling the module builds its ops in the current graph."""

    def build(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("Your popxl.Module must override `build` method")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.build(*args, **kwargs)

    def create_graph(self, *args: Any, **kwargs: Any) -> Any:
        from .context import get_current_graph
        return get_current_graph().ir.create_graph(self, *args, **kwargs)
