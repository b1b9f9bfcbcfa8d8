"""Elementwise ops: unary math, activations, binary / variadic with broadcasting. One table
row per op; attribute values are cast to the input's dtype so float32 stays float32."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax

from .registry import add, LowerCtx, opid, popart_error, register


def c(x, v):
    """Constant ``v`` in ``x``'s dtype."""
    return jnp.asarray(v, dtype=jnp.result_type(x))


def _is_int(x):
    return jnp.issubdtype(jnp.result_type(x), jnp.integer)


def _is_float(x):
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _isinf(x, detect_positive=1, detect_negative=1, **_):
    return (jnp.isposinf(x) & bool(detect_positive)) | (jnp.isneginf(x) & bool(detect_negative))


def _shrink(x, lambd=0.5, bias=0.0, **_):
    return jnp.where(x < -lambd, x + c(x, bias), jnp.where(x > lambd, x - c(x, bias), c(x, 0)))


# ---------------------------------------------------------------------------------------
# PopART's gradients where they differ from JAX autodiff (see docs/_rows_elementwise.md).
# Its grad ops multiply by 0/1 masks (a NaN / inf incoming gradient stays NaN where JAX's
# select gives 0), give every tied Max / Min input the whole gradient, guard Pow's zeros, ...
# Used for floating-point inputs; forward values are those of the plain functions.

_F32 = np.finfo(np.float32)


def _float_inputs(xs: tuple) -> bool:
    """Some input is floating point and every other one is floating point, bool or absent."""
    dts = [x.dtype if hasattr(x, "dtype") else jnp.result_type(x) for x in xs if x is not None]
    fl = [jnp.issubdtype(d, jnp.floating) for d in dts]
    return any(fl) and all(f or d == bool for f, d in zip(fl, dts))


def _unbroadcast(d: jax.Array, x: Any) -> jax.Array:
    """Cotangent ``d`` (output shape) summed over the axes ``x`` was broadcast along."""
    shape = jnp.shape(x)
    lead = d.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and d.shape[lead + i] != 1)
    return jnp.sum(d, axes).reshape(shape).astype(jnp.result_type(x))


def with_popart_grad(fwd: Callable, rule: Callable) -> Callable:
    """``fwd(*xs)`` whose vjp is ``rule(g, out, *xs)``: one cotangent per input at the output's
    shape (summed back to the input's shape here), or None for no gradient. Inputs that are
    not floating point (ints, strings) get plain ``fwd``."""
    @jax.custom_vjp
    def op(*xs):
        return fwd(*xs)

    def op_fwd(*xs):
        out = fwd(*xs)
        return out, (xs, out)

    def op_bwd(res, g):
        xs, out = res
        return tuple(None if d is None else _unbroadcast(d, x)
                     for d, x in zip(rule(g, out, *xs), xs))

    op.defvjp(op_fwd, op_bwd)
    return lambda *xs: op(*xs) if _float_inputs(xs) else fwd(*xs)


def _masked(g: jax.Array, cond: jax.Array) -> jax.Array:
    """g * cast(cond) as PopART computes it (inf / NaN * 0 is NaN). Written as a select of
    g * 0: XLA rewrites a multiply by a converted predicate into a select of 0."""
    return jnp.where(cond, g, g * c(g, 0))


def _max_grad(g, out, *xs):
    """MaxArgGradOpx: (sign(x - out) + 1) * g, so every input equal to the max gets all of g."""
    return tuple((jnp.sign(x - out) + c(g, 1)) * g for x in xs)


def _min_grad(g, out, *xs):
    """MinArgGradOpx: (sign(out - x) + 1) * g."""
    return tuple((jnp.sign(out - x) + c(g, 1)) * g for x in xs)


def _relu_grad(g, out, x):
    """ReluGradOpx (popnn RELU): g * (out > 0)."""
    return (_masked(g, out > 0),)


def _abs_grad(g, out, x):
    """AbsGradOp -> ElementWiseGradOpPattern<AbsGradOp, SignOp>: g * sign(x) (0 at 0)."""
    return (g * jnp.sign(x),)


def _div_grad(g, out, a, b):
    """DivArg0GradOpPattern g / b; DivArg1GradOpPattern -((g * a) / (b * b))."""
    return g / b, -((g * a) / (b * b))


# XLA's CPU power is a libm call per element, 15-20x a multiply; exporters write GELU's cube and
# RMSNorm's square as Pow with an exponent initializer, known only at run time (a variable).
_POWERS = (jnp.power, lambda a, b: a * a, lambda a, b: a * a * a)


def _power(a, b):
    """``a ** b`` (floats of one dtype); an exponent of one element that is 2 or 3 squares or
    cubes by multiplication (as onnxruntime's Pow does), chosen at run time by a
    ``lax.switch`` (XLA folds it where the exponent is a constant)."""
    if jnp.size(b) != 1 or jnp.ndim(a) == 0:
        return jnp.power(a, b)
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    e = jnp.reshape(b, ())
    i = (e == 2).astype(jnp.int32) + 2 * (e == 3).astype(jnp.int32)
    return lax.switch(i, _POWERS, a, e).reshape(shape)


def _pow_grad(g, out, a, b):
    """PowArg0GradOpPattern: where(b == 0, 0, g * (b * a^(b-1)));
    PowArg1GradOpPattern: g * where(a == 0 and not (b < 0 or isnan(b)), 0, out * log(a))."""
    zero = c(g, 0)
    da = jnp.where(b == 0, zero, g * (b * _power(a, b - c(b, 1))))
    guard = (a == 0) & ~((b < 0) | jnp.isnan(b))
    return da, g * jnp.where(guard, zero, out * jnp.log(a))


def _where_grad(g, out, cond, x, y):
    """WhereXGradOpx / WhereYGradOpx: g * cast(cond), g * cast(not cond); none for cond."""
    return None, _masked(g, cond), _masked(g, jnp.logical_not(cond))


def _clip_bound(v: Any, default: float, dtype: Any) -> jax.Array:
    """The bound ClipGradOpx compares with (float32's lowest / max when absent), clamped to
    +-65504 for float16."""
    v = jnp.asarray(default if v is None else v)
    if dtype == jnp.float16:
        v = jnp.clip(v.astype(jnp.float32), -65504.0, 65504.0)
    return v.astype(dtype)


def _clip_grad(g, out, x, lo, hi):
    """ClipGradOpx: g * (out != min) * (out != max). PopART needs min / max constant; when
    they are run-time tensors here, each gets g where the output equals it."""
    lo_c, hi_c = _clip_bound(lo, _F32.min, out.dtype), _clip_bound(hi, _F32.max, out.dtype)
    at_hi = out == hi_c
    return (_masked(_masked(g, out != lo_c), ~at_hi),
            None if lo is None else _masked(g, (out == lo_c) & ~at_hi),
            None if hi is None else _masked(g, at_hi))


def _gelu_grad(g, out, x):
    """popnn GELU input gradient as the IPU codelets compute it: with x' = clamp(x, +-6 for
    float16, +-12 for float32), 0.5 * (1 + tanh(a(x' + b x'^3)) + a x' exp(-x'^2 / 2)),
    a = sqrt(2 / pi), b = 0.044715."""
    lim = 6.0 if x.dtype == jnp.float16 else 12.0
    xc = jnp.clip(x.astype(jnp.float32), -lim, lim)
    a, b = 0.7978845608, 0.044715
    d = 0.5 * (1 + jnp.tanh(a * (xc + b * xc ** 3)) + a * xc * jnp.exp(-0.5 * xc * xc))
    return (g * d.astype(g.dtype),)


def _sqrt(x):
    """Square root; of an integer tensor (PopART takes those: no schema types at construction)
    the integer part, in the input's type."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.floor(jnp.sqrt(x.astype(jnp.float64 if x.dtype.itemsize > 4 else jnp.float32))
                         ).astype(x.dtype)
    return jnp.sqrt(x)


abs_ = with_popart_grad(jnp.abs, _abs_grad)
relu = with_popart_grad(jax.nn.relu, _relu_grad)
gelu_tanh = with_popart_grad(lambda x: jax.nn.gelu(x, approximate=True), _gelu_grad)
VARIADIC_GRAD = {"Max": with_popart_grad(lambda *xs: functools.reduce(jnp.maximum, xs), _max_grad),
                 "Min": with_popart_grad(lambda *xs: functools.reduce(jnp.minimum, xs), _min_grad)}


UNARY = {
    "Abs": abs_, "Neg": jnp.negative, "Exp": jnp.exp, "Log": jnp.log, "Sqrt": _sqrt,
    "Reciprocal": jnp.reciprocal, "Floor": jnp.floor, "Ceil": jnp.ceil, "Round": jnp.round,
    "Sign": jnp.sign, "Sin": jnp.sin, "Cos": jnp.cos, "Tan": jnp.tan, "Asin": jnp.arcsin,
    "Acos": jnp.arccos, "Atan": jnp.arctan, "Sinh": jnp.sinh, "Cosh": jnp.cosh,
    "Asinh": jnp.arcsinh, "Acosh": jnp.arccosh, "Atanh": jnp.arctanh,
    "Erf": jax.scipy.special.erf, "IsNaN": jnp.isnan, "Not": jnp.logical_not,
    "BitwiseNot": jnp.invert, "Identity": lambda x: (x,),     # (x,): x may be a sequence
    "Relu": relu, "Sigmoid": jax.nn.sigmoid, "Tanh": jnp.tanh,
    "Softplus": jax.nn.softplus, "Softsign": lambda x: x / (1 + jnp.abs(x)),
    "Mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
}
# Unary ops with attributes: fn(x, **attrs) (attributes come with ONNX's defaults filled in).
UNARY_ATTR = {
    "IsInf": _isinf,
    "Shrink": _shrink,
    "LeakyRelu": lambda x, alpha=0.01, **_: jnp.where(x >= 0, x, x * alpha),
    "Elu": lambda x, alpha=1.0, **_: jnp.where(x > 0, x, alpha * jnp.expm1(x)),
    "Selu": lambda x, alpha=1.67326, gamma=1.0507, **_:
        gamma * jnp.where(x > 0, x, alpha * jnp.expm1(x)),
    "Celu": lambda x, alpha=1.0, **_: jnp.maximum(x, 0) + jnp.minimum(0, alpha * jnp.expm1(x / alpha)),
    "HardSigmoid": lambda x, alpha=0.2, beta=0.5, **_: jnp.clip(x * alpha + beta, 0, 1),
    "HardSwish": lambda x, **_: x * jnp.clip(x * (1 / 6) + 0.5, 0, 1),
    "ThresholdedRelu": lambda x, alpha=1.0, **_: jnp.where(x > alpha, x, c(x, 0)),
    "Swish": lambda x, alpha=1.0, **_: x * jax.nn.sigmoid(x * alpha),
}
BINARY = {
    "Add": jnp.add, "Sub": jnp.subtract, "Mul": jnp.multiply,
    "And": jnp.logical_and, "Or": jnp.logical_or, "Xor": jnp.logical_xor,
    "Equal": lambda a, b: (np.equal if np.result_type(a) == object else jnp.equal)(a, b), "Greater": jnp.greater, "Less": jnp.less,
    "GreaterOrEqual": jnp.greater_equal, "LessOrEqual": jnp.less_equal,
    "BitwiseAnd": jnp.bitwise_and, "BitwiseOr": jnp.bitwise_or, "BitwiseXor": jnp.bitwise_xor,
    "PRelu": lambda x, slope: jnp.where(x < 0, x * slope, x),
}
VARIADIC = {"Sum": jnp.add, "Max": jnp.maximum, "Min": jnp.minimum, "Mean": jnp.add}


def _divide(a, b):
    """a / b, float16 / bfloat16 in float32: XLA makes a division by a broadcast scalar a
    multiplication by its reciprocal, which half precision rounds (PopART's is exact)."""
    t = jnp.result_type(a, b)
    if t in (jnp.float16, jnp.bfloat16):
        return jnp.divide(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)).astype(t)
    return jnp.divide(a, b)


_div_float = with_popart_grad(_divide, _div_grad)
_pow_float = with_popart_grad(_power, _pow_grad)


def _div(a, b):
    if _is_int(a):
        a, b = jnp.broadcast_arrays(a, b)
        return lax.div(a, b.astype(a.dtype))      # truncates toward zero, like C
    return _div_float(a, b)


def _pow(a, b):
    """Output dtype is the base's (Pow-12 allows mixed dtypes)."""
    if _is_int(a) and not _is_int(b):
        return jnp.power(a.astype(jnp.result_type(b)), b).astype(jnp.result_type(a))
    return _pow_float(a, jnp.asarray(b).astype(jnp.result_type(a)))


def _mul(a, b):
    """MulOp::setup: float16 times a float32 tensor of one element (either side) is float16."""
    ta, tb = jnp.result_type(a), jnp.result_type(b)
    if ta != tb and jnp.float16 in (ta, tb):
        a, b = jnp.asarray(a).astype(jnp.float16), jnp.asarray(b).astype(jnp.float16)
    return jnp.multiply(a, b)


BINARY.update(Div=_div, Pow=_pow, Mul=_mul)
# Binary ops that existed before opset 7 with the legacy broadcast / axis attributes.
LEGACY_BCAST = ("Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater", "Less")


def legacy_broadcast(a, b, broadcast=0, axis=None):
    """Opset < 7 broadcasting: with broadcast=1 and ``axis``, ``b``'s dims align with
    ``a``'s starting at ``axis``; without ``axis`` they align with the trailing dims."""
    if broadcast and axis is not None and jnp.ndim(b) > 0:
        axis = axis % jnp.ndim(a)
        b = jnp.reshape(b, jnp.shape(b) + (1,) * (jnp.ndim(a) - axis - jnp.ndim(b)))
    return a, b


for _name, _fn in UNARY.items():
    add(_name, lambda ctx, x, _fn=_fn, **_: _fn(x), elementwise=True)
for _name, _fn in UNARY_ATTR.items():
    add(_name, lambda ctx, x, _fn=_fn, **a: _fn(x, **a), elementwise=True)
for _name, _fn in BINARY.items():
    add(_name, lambda ctx, a, b, _fn=_fn, **_: _fn(a, b), since=7 if _name in LEGACY_BCAST else 1,
        elementwise=True)
for _name in LEGACY_BCAST:
    add(_name, lambda ctx, a, b, _fn=BINARY[_name], broadcast=0, axis=None, **_:
        _fn(*legacy_broadcast(a, b, broadcast, axis)))


def _variadic(name: str, fn: Callable, xs: tuple) -> Any:
    if name in VARIADIC_GRAD and len(xs) > 1:
        return VARIADIC_GRAD[name](*xs)
    out = functools.reduce(fn, xs)
    return out / len(xs) if name == "Mean" else out


def _variadic_6(ctx: LowerCtx, name: str, fn: Callable, xs: tuple) -> Any:
    """VariadicOp::setup: the version-6 ops take inputs of one type and shape only."""
    if any(jnp.shape(x) != jnp.shape(xs[0]) or jnp.result_type(x) != jnp.result_type(xs[0])
           for x in xs):
        raise popart_error(ctx, f"Inputs to {opid(ctx)} do not all the same type & shape, with "
                           f"opid.version = 6", "inputs " + ", ".join(
                               f"{jnp.shape(x)}/{jnp.result_type(x)}" for x in xs)
                           + ": version 8 broadcasts")
    return _variadic(name, fn, xs)


for _name, _fn in VARIADIC.items():
    add(_name, lambda ctx, *xs, _fn=_fn, _n=_name, **_: _variadic_6(ctx, _n, _fn, xs), since=1)
    add(_name, lambda ctx, *xs, _fn=_fn, _n=_name, **_: _variadic(_n, _fn, xs), since=8,
        elementwise=True)


@register("Mod", since=10)
def mod(ctx: LowerCtx, a, b, fmod=0, **_):
    if fmod:
        return jnp.fmod(a, b)
    return jnp.mod(a, b)       # sign of the divisor (floats too, as onnx's tests expect)


@register("BitShift", since=11)
def bitshift(ctx: LowerCtx, a, b, direction="", **_):
    if direction not in ("LEFT", "RIGHT"):
        raise ctx.error(f"direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    b = jnp.asarray(b).astype(jnp.result_type(a))
    return jnp.left_shift(a, b) if direction == "LEFT" else jnp.right_shift(a, b)


@register("Where", since=9)
def where(ctx: LowerCtx, cond, x, y, **_):
    return _where(cond, x, y)


_where = with_popart_grad(jnp.where, _where_grad)


@register("Gelu", since=20, elementwise=True)   # runs on channels-last twins
def gelu(ctx: LowerCtx, x, approximate="none", **_):
    if approximate not in ("none", "tanh"):
        raise ctx.error(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return gelu_tanh(x) if approximate == "tanh" else jax.nn.gelu(x, approximate=False)


def _clip(x, lo, hi):
    """min(max(x, lo), hi): when lo > hi every value becomes hi, as ONNX specifies."""
    if lo is not None:
        x = jnp.maximum(x, jnp.asarray(lo).astype(x.dtype))
    if hi is not None:
        x = jnp.minimum(x, jnp.asarray(hi).astype(x.dtype))
    return x


_clip_popart = with_popart_grad(_clip, _clip_grad)
_clip_identity = with_popart_grad(_clip, lambda g, out, x, lo, hi: (g, None, None))


def _unbounded(v: Any, limit: float) -> bool:
    """A Clip bound that is absent or a constant at or beyond float32's ``limit``."""
    if v is None:
        return True
    if isinstance(v, jax.core.Tracer):
        return False
    v = np.asarray(v, np.float32)
    return bool(np.all(v <= limit) if limit < 0 else np.all(v >= limit))


def clip(x: Any, lo: Any = None, hi: Any = None) -> Any:
    """Clip; a constant-unbounded one gets the identity's gradient (PopART's OpToIdentity
    pattern, ClipOp::canBeReplacedByIdentity), others ClipGradOpx's mask."""
    if lo is None and hi is None:
        return x
    cast = lambda v: None if v is None else jnp.asarray(v).astype(jnp.result_type(x))  # noqa: E731
    unbounded = _unbounded(lo, _F32.min) and _unbounded(hi, _F32.max)
    return (_clip_identity if unbounded else _clip_popart)(x, cast(lo), cast(hi))


add("Clip", lambda ctx, x, min=None, max=None, **_: clip(x, min, max), since=1, elementwise=True)
add("Clip", lambda ctx, x, lo=None, hi=None, **_: clip(x, lo, hi), since=11, elementwise=True)
