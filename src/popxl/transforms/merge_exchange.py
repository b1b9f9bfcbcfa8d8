"""merge_exchange and io_tile_exchange: blocks whose host and remote transfers PopART merges
into one exchange. XLA schedules transfers itself, so nothing is merged here; the blocks
annotate their ops, and io_tile_exchange checks, as PopXL does, that the block holds only
transfers (that would become one op)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from .. import context

_EXCHANGE = ("HostLoad", "HostStore", "RemoteLoad", "RemoteStore")


@contextmanager
def merge_exchange() -> Iterator[None]:
    """The host loads / stores and remote loads / stores of the block form one exchange
    (annotated ``__merge_exchange``; XLA schedules the transfers)."""
    with context.merge_exchange():
        yield


@contextmanager
def io_tile_exchange(verify_overlap: bool = True) -> Iterator[None]:
    """:func:`popxl.io_tiles`, :func:`merge_exchange` and ``in_sequence(False)`` together.

    Raises:
        RuntimeError: with ``verify_overlap``, when more than one op would remain once the
            block's transfers are merged into one (Init ops aside), as in PopXL.
    """
    graph = context.get_current_graph()
    first = len(graph._g.nodes)
    with context.io_tiles(), merge_exchange(), context.in_sequence(False):
        yield
    if verify_overlap:
        added = [n for n in graph._g.nodes[first:] if n.op_type != "Init"]
        others = [n for n in added if n.op_type not in _EXCHANGE]
        if len(others) + (len(others) < len(added)) > 1:
            names = "\n   ".join(f"{n.op_type} ({', '.join(n.outputs)})" for n in others)
            raise RuntimeError("More than one Op remained after `io_tile_exchange`. This will prevent "
                               f"overlap with following compute. Remaining Ops:\n   {names}")
