"""PopART's pre-alias ``OpToIdentityPattern`` on popxl graphs (``Ir._pb_ir.applyPreAliasPatterns``).

PopART replaces every op whose ``canBeReplacedByIdentity()`` holds by an IdentityOp of its
one data input (willow/src/patterns/optoidentitypattern.cpp). :data:`TO_IDENTITY` holds those
rules, per op type, for the ops that have one here. The pattern is on in
``PatternsLevel.Default`` and ``All``, not in ``Minimal`` (it is not mandatory), which is what
``popxl.Session`` applies; so popxl-addons' collectives with ``identicalInputs`` (and the grad
of those with ``identicalGradInputs``), whose Opx refuses to lower an op that should have been
an identity, need the user to run it (``popxl_addons.patterns.apply_pre_alias_patterns``):
:func:`check_lowerable` raises PopART's error at session construction otherwise.

The other pre-alias patterns rewrite gradient or fused forms that the XLA lowerings already
compute (the numbers are the same); the inplace pattern has nothing to do on SSA values."""
from __future__ import annotations

from typing import Any, Callable

from popart.custom_ops import ADDONS_DOMAIN
from popart.errors import popart_exception
from popart.engine.graph_api import Node

_COLLECTIVES = ("ReplicatedAllReduceTP", "ReplicatedAllReduceStrided")


def _same_spec(g: Any, n: Node) -> bool:
    a, b = g._specs.get(n.inputs[0]), g._specs.get(n.outputs[0])
    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype


def _identical(flag: str) -> Callable[[Any, Node], bool]:
    return lambda g, n: n.domain == ADDONS_DOMAIN and bool(n.attrs.get(flag, 0))


def _vjp_of_identical_grad(g: Any, n: Node) -> bool:
    """The grad op of a collective with identicalGradInputs: PopART's grad op is the same op
    with identicalInputs set, so it is the identity of the output gradient."""
    fwd = n.attrs.get("fwd")
    f = fwd.nodes[0] if fwd is not None and len(fwd.nodes) == 1 else None
    return f is not None and f.op_type in _COLLECTIVES and _identical("identicalGradInputs")(g, f)


# op type -> canBeReplacedByIdentity(graph, node) (willow/src/op/*.cpp). ReduceL1 / L2 /
# LogSum / LogSumExp / SumSquare are left out: PopART's ReduceOp rule (input shape == output
# shape) would make |x|, x^2, log(x) the identity.
TO_IDENTITY: dict[str, Callable[[Any, Node], bool]] = {
    **dict.fromkeys(_COLLECTIVES, _identical("identicalInputs")),
    "OpVJP": _vjp_of_identical_grad,
    **dict.fromkeys(("Reshape", "Tile", "Expand", "Subsample", "Cast", "ReduceSum", "ReduceMean",
                     "ReduceMax", "ReduceMin", "ReduceProd"), _same_spec),
    **dict.fromkeys(("Concat", "Sum", "Max", "Min", "Mean"),
                    lambda g, n: len([i for i in n.inputs if i]) == 1),   # VariadicOp, ConcatOp
    "Scale": lambda g, n: float(n.attrs.get("scale", 1.0)) == 1.0,
    "Transpose": lambda g, n: n.attrs.get("perm") is not None
    and list(n.attrs["perm"]) == sorted(n.attrs["perm"]),
    "Reverse": lambda g, n: not n.attrs.get("dimensions"),
}
# Ops whose Opx throws when the pattern should have replaced them (the two collectives and the
# grad op of one, which is the collective itself).
MUST_REPLACE = (*_COLLECTIVES, "OpVJP")
NEEDS_PATTERN = "You need to run the `OpToIdentityPattern` pattern before running the IR."


_DOMAINS = ("ai.onnx", "ai.graphcore", "ai.popxl", ADDONS_DOMAIN)   # not a user's custom op


def replaceable(graph: Any, node: Node) -> bool:
    """Whether PopART's OpToIdentityPattern matches ``node`` of popxl graph ``graph``."""
    rule = TO_IDENTITY.get(node.op_type) if node.domain in _DOMAINS else None
    return rule is not None and len([o for o in node.outputs if o]) == 1 and rule(graph, node)


def op_to_identity(graph: Any) -> int:
    """Replace each matching node of popxl graph ``graph`` by an Identity of its first input
    (same output, name and placement); returns how many were replaced."""
    count = 0
    for i, n in enumerate(graph._g.nodes):
        if replaceable(graph, n):
            graph._g.nodes[i] = Node("Identity", [n.inputs[0]], list(n.outputs), {}, "ai.onnx",
                                     n.name, dict(n.annotations))
            count += 1
    return count


def check_lowerable(main: Any) -> None:
    """Raise PopART's Opx error for an op of popxl graph ``main`` or a graph it calls (PopXL's
    session removes the others first) that only lowers once OpToIdentityPattern has replaced
    it."""
    graphs, todo = [], [main]
    while todo:
        g = todo.pop()
        if all(g is not h for h in graphs):
            graphs.append(g)
            todo += g.called_graphs
    for g in graphs:
        for n in g._g.nodes:
            if n.op_type in MUST_REPLACE and replaceable(g, n):
                raise popart_exception(f"{NEEDS_PATTERN} ({n.describe()} in graph '{g.name}')")
