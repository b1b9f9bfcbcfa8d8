"""The internal IR as the engine shows it to front-ends other than popart's own (popxl).

The IR package (``popart._ir``) is private to popart; a front-end that builds IR graphs for
the engine takes the names it needs from here, so the two front-ends share the IR through
``popart.engine`` and never through each other's private modules (issue 26)."""
from __future__ import annotations

from .._ir.graph import PIPELINE_STAGE, VIRTUAL_GRAPH, Graph, Node, fingerprint, outer_reads, reads
from .._ir.graphcore_schema import COLLECTIVE_OPS
from .._ir.recompute import RECOMPUTE_OUTPUT
from .._ir.transforms import NO_GRAD_OPS

__all__ = ["Graph", "Node", "reads", "outer_reads", "fingerprint", "VIRTUAL_GRAPH", "PIPELINE_STAGE",
           "RECOMPUTE_OUTPUT", "NO_GRAD_OPS", "COLLECTIVE_OPS"]
