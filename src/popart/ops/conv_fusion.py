"""oneDNN post-op fusion on the CPU: a convolution's bias, activation and residual add applied
by the oneDNN call itself as it writes its result (``onednn.conv2d_fused``), where XLA would
make one more pass over memory for each (docs/performance.md, "Post-op fusion").

The CPU's Conv lowering remembers each oneDNN forward call's result with how it was made
(``Pending``). An elementwise op below whose input is such a result, read by that op alone,
lowers to the same call with one more post-op; the call it extends is then read by nothing and
XLA drops it. So every tensor keeps its value (an anchored pre-activation is computed as well),
and the fused chains are: Conv (+ bias) [+ activation] [+ Add of a tensor] [+ activation],
SiLU as Sigmoid and Mul included (oneDNN's swish). Inference only: a training step's forward
keeps the pre-activations its gradients read.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Optional

import jax.numpy as jnp
import numpy as np
from jax._src import core as _core

from ..engine import onednn
from .registry import LowerCtx, is_static, lookup, register


@dataclasses.dataclass(frozen=True)
class Pending:
    """A oneDNN forward convolution call: its operands and post-ops so far."""
    x: Any
    w: Any
    static: tuple           # strides, padding, dilation, nhwc, groups
    operands: tuple = ()    # the bias, then each binary post-op's input
    posts: tuple = ()       # (name, alpha, beta) of onednn.POST_OPS
    trace: Any = None       # JAX's trace the call belongs to

    def extended(self, post: tuple, operand: Any = None) -> "Pending":
        """The same call with ``post`` appended (its input ``operand``)."""
        return dataclasses.replace(self, posts=self.posts + (post,), operands=self.operands + (
            () if operand is None else (operand,)))

    def emit(self) -> Any:
        """The call's result, remembered."""
        return remember(onednn.conv2d_fused(self.x, self.w, self.operands, *self.static,
                                            self.posts), self)


_PENDING: dict[int, tuple[weakref.ref, Pending]] = {}   # id(result) -> (result, how it was made)


def _trace() -> Any:
    """JAX's current trace (a fresh object, so nothing fuses, where JAX has no such state)."""
    ctx = getattr(_core, "trace_ctx", None)
    return ctx.trace if ctx is not None else object()


def remember(y: Any, p: Pending) -> Any:
    """``y``, remembered as the result of ``p`` (for as long as ``y`` lives)."""
    key = id(y)
    _PENDING[key] = (weakref.ref(y, lambda _, k=key: _PENDING.pop(k, None)), p)
    return y


def start(x: Any, w: Any, y: Any, static: tuple) -> Any:
    """``y``, the result of the oneDNN call conv2d(x, w, *static), remembered."""
    return remember(y, Pending(x, w, tuple(static), trace=_trace()))


def pending(ctx: LowerCtx, y: Any) -> Optional[Pending]:
    """How ``y`` was made if it is a oneDNN forward call's result that a post-op may extend
    here: not in training, and in the same JAX trace (not inside a loop body or branch that
    would compute the call again)."""
    entry = _PENDING.get(id(y))
    if ctx.training or entry is None or entry[0]() is not y:
        return None
    return entry[1] if entry[1].trace is _trace() else None


# ---- Which nodes read a tensor (the fusion must be the only use of what it replaces) ----
def _readers(ctx: LowerCtx, tensor_id: str) -> Optional[list]:
    """The nodes reading ``tensor_id`` (``ctx.readers``; None where the context has none)."""
    readers = getattr(ctx, "readers", None)
    return readers(tensor_id) if readers is not None else None


def _only_reader(ctx: LowerCtx, i: int) -> bool:
    """Whether this node alone reads its input ``i`` (once)."""
    readers = _readers(ctx, ctx.input_ids[i])
    node = getattr(ctx, "node", None)
    return readers is not None and [id(n) for n in readers] == [id(node)]


def _silu_sigmoid(ctx: LowerCtx) -> bool:
    """Whether this Sigmoid's input is read by it and by one Mul of input and output (SiLU)."""
    x_id, y_id = ctx.input_ids[0], ctx.output_ids[0]
    mul, of_x = _readers(ctx, y_id), _readers(ctx, x_id)
    if mul is None or of_x is None:
        return False
    return (len(mul) == 1 and mul[0] != "output" and mul[0].op_type == "Mul"
            and sorted(mul[0].inputs) == sorted([x_id, y_id])
            and {id(n) for n in of_x} == {id(ctx.node), id(mul[0])} and len(of_x) == 2)


# ---- The CPU overrides of the elementwise ops that become post-ops ----

def _generic(ctx: LowerCtx, *inputs: Any, **attrs: Any) -> Any:
    return lookup(ctx.domain, ctx.op_type, ctx.version).lower(ctx, *inputs, **attrs)


def _constant(v: Any) -> Optional[float]:
    """A static scalar's value as a float, else None (absent: None too)."""
    if v is None or not is_static(v) or np.size(v) != 1:
        return None
    return float(np.asarray(v).reshape(()))


def _eltwise(name: str, alpha: float = 0.0, beta: float = 0.0) -> list:
    return [((name, float(alpha), float(beta)), None)]


def _clip(ctx: LowerCtx, x, lo=None, hi=None, min=None, max=None, **_):  # noqa: A002
    """Clip as oneDNN's clip (constant bounds, lo <= hi), or as binary max and min (bounds
    known at run time: a session's initializers)."""
    lo, hi = (min, max) if ctx.version < 11 else (lo, hi)
    f32 = np.finfo(np.float32)
    a = f32.min if lo is None else _constant(lo)
    b = f32.max if hi is None else _constant(hi)
    if a is not None and b is not None:
        return _eltwise("clip", a, b) if a <= b else None
    steps = [(("max", 0.0, 0.0), _operand(x, lo)), (("min", 0.0, 0.0), _operand(x, hi))]
    steps = [(post, v) for (post, v), bound in zip(steps, (lo, hi)) if bound is not None]
    return None if any(v is None for _, v in steps) else steps


def _gelu(ctx, x, approximate="none", **_):
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return name and _eltwise(name)


# op type -> (ctx, *inputs, **attrs) -> the post-ops [((name, alpha, beta), operand)], or None
UNARY_POSTS: dict[str, Callable] = {
    "Relu": lambda ctx, x, **_: _eltwise("relu"),
    "LeakyRelu": lambda ctx, x, alpha=0.01, **_: _eltwise("relu", alpha),
    "Clip": _clip,
    "HardSwish": lambda ctx, x, **_: _eltwise("hardswish", 1 / 6, 0.5),
    "HardSigmoid": lambda ctx, x, alpha=0.2, beta=0.5, **_: _eltwise("hardsigmoid", alpha, beta),
    "Sigmoid": lambda ctx, x, **_: _eltwise("sigmoid"),
    "Tanh": lambda ctx, x, **_: _eltwise("tanh"),
    "Elu": lambda ctx, x, alpha=1.0, **_: _eltwise("elu", alpha),
    "Gelu": _gelu,
}


def unary(ctx: LowerCtx, x: Any, *rest: Any, **attrs: Any) -> Any:
    """An activation on the CPU: a post-op of the oneDNN call that made ``x`` where it applies,
    else the generic lowering."""
    p = pending(ctx, x)
    steps = p and UNARY_POSTS[ctx.op_type](ctx, x, *rest, **attrs)
    if steps and (_only_reader(ctx, 0) or (ctx.op_type == "Sigmoid" and _silu_sigmoid(ctx))):
        for post, operand in steps:
            p = p.extended(post, operand)
        return p.emit()
    return _generic(ctx, x, *rest, **attrs)


def _operand(y: Any, v: Any) -> Optional[Any]:
    """``v`` as a binary post-op's input for result ``y``: float32, 4-D, each dim ``y``'s or 1;
    else None."""
    if v is None or jnp.result_type(v) not in (np.float32, np.float64) or np.ndim(v) > 4:
        return None
    if not is_static(v) and jnp.result_type(v) != np.float32:
        return None
    shape = (1,) * (4 - np.ndim(v)) + tuple(np.shape(v))
    if any(d not in (1, e) for d, e in zip(shape, np.shape(y))):
        return None
    return jnp.reshape(jnp.asarray(v, np.float32), shape)


def binary(ctx: LowerCtx, a: Any, b: Any, **attrs: Any) -> Any:
    """Add or Mul on the CPU: SiLU's Mul (x by Sigmoid(x)) and a tensor added to or multiplied
    into a oneDNN call's result, as post-ops; else the generic lowering."""
    pa, pb = pending(ctx, a), pending(ctx, b)
    if ctx.op_type == "Mul" and pa and pb:
        for x, s in ((pa, pb), (pb, pa)):
            if _extends(s, x, "sigmoid"):
                return x.extended(("swish", 1.0, 0.0)).emit()
    name = ctx.op_type.lower()
    for i, (p, y, v) in enumerate(((pa, a, b), (pb, b, a))):
        operand = p and _operand(y, v)
        if operand is not None and _only_reader(ctx, i):
            return p.extended((name, 0.0, 0.0), operand).emit()
    return _generic(ctx, a, b, **attrs)


def _extends(p: Pending, base: Pending, name: str) -> bool:
    """Whether ``p`` is ``base`` with the one post-op ``name`` appended."""
    return (p.x is base.x and p.w is base.w and p.static == base.static
            and p.posts == base.posts + ((name, 0.0, 0.0),)
            and len(p.operands) == len(base.operands)
            and all(u is v for u, v in zip(p.operands, base.operands)))


# The overrides start where the generic lowerings are elementwise (Add's and Mul's legacy
# broadcast before opset 7 is not) or exist (Gelu).
for _op in UNARY_POSTS:
    register(_op, platform="cpu", elementwise=True, since=20 if _op == "Gelu" else 1)(unary)
for _op in ("Add", "Mul"):
    register(_op, platform="cpu", elementwise=True, since=7)(binary)


def with_bias(ctx: LowerCtx, y: Any, b: Any) -> Optional[Any]:
    """Conv's ``y + b`` as the oneDNN call's bias where ``y`` is its result, else None."""
    p = pending(ctx, y)
    if p is None or b is None or jnp.result_type(b) != np.float32 or np.ndim(b) != 1:
        return None
    return p.extended(("bias", 0.0, 0.0), jnp.asarray(b)).emit()
