"""Elementwise ops: unary math, activations, binary / variadic with broadcasting. One table
row per op; attribute values are cast to the input's dtype so float32 stays float32."""
from __future__ import annotations

import functools

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax

from .registry import add, register


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


UNARY = {
    "Abs": jnp.abs, "Neg": jnp.negative, "Exp": jnp.exp, "Log": jnp.log, "Sqrt": jnp.sqrt,
    "Reciprocal": jnp.reciprocal, "Floor": jnp.floor, "Ceil": jnp.ceil, "Round": jnp.round,
    "Sign": jnp.sign, "Sin": jnp.sin, "Cos": jnp.cos, "Tan": jnp.tan, "Asin": jnp.arcsin,
    "Acos": jnp.arccos, "Atan": jnp.arctan, "Sinh": jnp.sinh, "Cosh": jnp.cosh,
    "Asinh": jnp.arcsinh, "Acosh": jnp.arccosh, "Atanh": jnp.arctanh,
    "Erf": jax.scipy.special.erf, "IsNaN": jnp.isnan, "Not": jnp.logical_not,
    "BitwiseNot": jnp.invert, "Identity": lambda x: (x,),     # (x,): x may be a sequence
    "Relu": jax.nn.relu, "Sigmoid": jax.nn.sigmoid, "Tanh": jnp.tanh,
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


def _div(a, b):
    if _is_int(a):
        a, b = jnp.broadcast_arrays(a, b)
        return lax.div(a, b.astype(a.dtype))      # truncates toward zero, like C
    return jnp.divide(a, b)


def _pow(a, b):
    """Output dtype is the base's (Pow-12 allows mixed dtypes)."""
    if _is_int(a) and not _is_int(b):
        return jnp.power(a.astype(jnp.result_type(b)), b).astype(jnp.result_type(a))
    return jnp.power(a, jnp.asarray(b).astype(jnp.result_type(a)))


BINARY.update(Div=_div, Pow=_pow)
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
    add(_name, lambda ctx, x, _fn=_fn, **_: _fn(x))
for _name, _fn in UNARY_ATTR.items():
    add(_name, lambda ctx, x, _fn=_fn, **a: _fn(x, **a))
for _name, _fn in BINARY.items():
    add(_name, lambda ctx, a, b, _fn=_fn, **_: _fn(a, b), since=7 if _name in LEGACY_BCAST else 1)
for _name in LEGACY_BCAST:
    add(_name, lambda ctx, a, b, _fn=BINARY[_name], broadcast=0, axis=None, **_:
        _fn(*legacy_broadcast(a, b, broadcast, axis)))
for _name, _fn in VARIADIC.items():
    add(_name, lambda ctx, *xs, _fn=_fn, _n=_name, **_:
        functools.reduce(_fn, xs) / len(xs) if _n == "Mean" else functools.reduce(_fn, xs))


@register("Mod", since=10)
def mod(ctx, a, b, fmod=0, **_):
    if fmod:
        return jnp.fmod(a, b)
    return jnp.mod(a, b)       # sign of the divisor (floats too, as onnx's tests expect)


@register("BitShift", since=11)
def bitshift(ctx, a, b, direction="", **_):
    if direction not in ("LEFT", "RIGHT"):
        raise ctx.error(f"direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    b = jnp.asarray(b).astype(jnp.result_type(a))
    return jnp.left_shift(a, b) if direction == "LEFT" else jnp.right_shift(a, b)


@register("Where", since=9)
def where(ctx, cond, x, y, **_):
    return jnp.where(cond, x, y)


@register("Gelu", since=20)
def gelu(ctx, x, approximate="none", **_):
    if approximate not in ("none", "tanh"):
        raise ctx.error(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return jax.nn.gelu(x, approximate=approximate == "tanh")


def _clip(x, lo, hi):
    """min(max(x, lo), hi): when lo > hi every value becomes hi, as ONNX specifies."""
    if lo is not None:
        x = jnp.maximum(x, jnp.asarray(lo).astype(x.dtype))
    if hi is not None:
        x = jnp.minimum(x, jnp.asarray(hi).astype(x.dtype))
    return x


add("Clip", lambda ctx, x, min=None, max=None, **_: _clip(x, min, max), since=1)
add("Clip", lambda ctx, x, lo=None, hi=None, **_: _clip(x, lo, hi), since=11)
