"""``popart._internal.ir``: PopART's C++ IR binding, as live handles on popxl's IR.

Every object is a view of the one IR popxl builds (``popart.engine.graph_api`` graphs and popxl's
bookkeeping around them): ``popxl.Ir._pb_ir``, ``Graph._pb_graph``, ``Tensor._pb_tensor`` and
the ops the op-created hooks receive are instances of the classes named here, and what their
methods change (erase an op, remove an output, clone an op into another graph, add a custom
op) is what popxl then compiles. Binding methods with no meaning on XLA raise
``popart_exception`` naming the method. The surface is the one popxl-addons uses
(docs/internal_ir.md)."""
from __future__ import annotations

import enum

from popart.engine.graph_api import COLLECTIVE_OPS
from popxl._pb import (BwdGraphInfo, ExpectedConnection, Graph, GraphId, Ir, Op,
                       OperatorIdentifier, ReplicaGroupingHandle as ReplicaGrouping, Session,
                       Settings, Tensor, TopoCons)
from popxl.tensorlocation import ExecutionContext, TileSet
from popxl.transforms.autodiff import ExpectedConnectionType

from . import op, patterns, view

#: ``popart::CollectiveOperator``.
CollectiveOperator = enum.Enum("CollectiveOperator", [(n, i) for i, n in enumerate(COLLECTIVE_OPS)])

__all__ = ["BwdGraphInfo", "CollectiveOperator", "ExecutionContext", "ExpectedConnection",
           "ExpectedConnectionType", "Graph", "GraphId", "Ir", "Op", "OperatorIdentifier",
           "ReplicaGrouping", "Session", "Settings", "Tensor", "TileSet", "TopoCons", "op",
           "patterns", "view"]
