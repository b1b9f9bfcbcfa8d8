"""Reductions: one table. Axes are an attribute before ReduceSum-13 / other Reduce*-18 and an
optional input from then on (with noop_with_empty_axes)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .registry import add, LowerCtx, opid, popart_error


def _lowest(x, sign):
    dt = jnp.result_type(x)
    if dt == jnp.bool_:
        return sign > 0
    if jnp.issubdtype(dt, jnp.integer):
        i = jnp.iinfo(dt)
        return i.max if sign > 0 else i.min
    return sign * np.inf


def _sum(x, ax, kd):
    return jnp.sum(x, axis=ax, keepdims=kd, dtype=jnp.result_type(x))


def _mean(x, ax, kd):
    """The mean over ``ax``; 0 over an empty set, as ONNX Runtime (ONNX leaves it undefined)."""
    if jnp.size(x) == 0:
        return _sum(x, ax, kd)
    return jnp.mean(x, axis=ax, keepdims=kd, dtype=jnp.result_type(x))


def _logsumexp(x, ax, kd):
    m = lax.stop_gradient(jnp.max(x, axis=ax, keepdims=True, initial=-np.inf))
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))
    y = jnp.log(jnp.sum(jnp.exp(x - m), axis=ax, keepdims=True)) + m
    return y if kd else jnp.squeeze(y, ax)


def _extremum(x, ax: tuple, kd: bool, sign: int):
    """Max (sign 1) or min (sign -1) of ``x`` over ``ax``."""
    f = jnp.max if sign > 0 else jnp.min
    return f(x, axis=ax, keepdims=kd, initial=_lowest(x, -sign))


def _extremum_fwd(x, ax, kd, sign):
    y = _extremum(x, ax, kd, sign)
    return y, (x, y)


def _extremum_bwd(ax, kd, sign, res, g):
    """PopART's ReduceMaxGradOpx / ReduceMinGradOpx: g * (sign(x - y) + 1) (sign(y - x) for
    min), so every element equal to the result gets the whole gradient (JAX's rule splits it
    among ties)."""
    x, y = res
    if not kd:
        y, g = jnp.expand_dims(y, ax), jnp.expand_dims(g, ax)
    return ((jnp.sign(sign * (x - y)) + 1) * g,)


_extremum_grad = jax.custom_vjp(_extremum, nondiff_argnums=(1, 2, 3))
_extremum_grad.defvjp(_extremum_fwd, _extremum_bwd)


def _max_min(sign: int):
    def fn(x, ax, kd):
        floating = jnp.issubdtype(jnp.result_type(x), jnp.floating)
        return (_extremum_grad if floating else _extremum)(x, ax, kd, sign)
    return fn


REDUCE = {  # name: (fn(x, axes, keepdims), opset where axes became an input)
    "ReduceSum": (_sum, 13),
    "ReduceMean": (lambda x, ax, kd: _mean(x, ax, kd), 18),
    "ReduceMax": (_max_min(1), 18),
    "ReduceMin": (_max_min(-1), 18),
    "ReduceProd": (lambda x, ax, kd: jnp.prod(x, axis=ax, keepdims=kd, dtype=jnp.result_type(x)), 18),
    "ReduceL1": (lambda x, ax, kd: _sum(jnp.abs(x), ax, kd), 18),
    "ReduceL2": (lambda x, ax, kd: jnp.sqrt(_sum(x * x, ax, kd)).astype(jnp.result_type(x)), 18),
    "ReduceLogSum": (lambda x, ax, kd: jnp.log(_sum(x, ax, kd)), 18),
    "ReduceLogSumExp": (_logsumexp, 18),
    "ReduceSumSquare": (lambda x, ax, kd: _sum(x * x, ax, kd), 18),
}


def reduce_axes(ctx: LowerCtx, x, axes, noop_with_empty_axes):
    """Normalized axes tuple. Empty axes reduce everything, or with noop_with_empty_axes
    nothing (``()``: the op's elementwise part still applies, as onnx's reference does)."""
    axes = [] if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
    if not axes:
        return () if noop_with_empty_axes else tuple(range(jnp.ndim(x)))
    check_reduce_axes(ctx, axes, jnp.ndim(x))
    return tuple(sorted({a % jnp.ndim(x) for a in axes}))


def check_reduce_axes(ctx: LowerCtx, axes: list, rank: int) -> None:
    """validateReduceAxes (util.cpp): axes of a rank > 0 input, each in [-rank, rank - 1]."""
    if rank == 0:
        raise popart_error(ctx, f"Reduce input rank must be greater than 0, invalid Reduce "
                           f"{ctx.name} ({opid(ctx)}).", f"axes {axes}")
    bad = next((a for a in axes if not -rank <= a < rank), None)
    if bad is not None:
        raise popart_error(ctx, f"Axis {bad} is out of acceptable range [{-rank}, {rank - 1}]",
                           f"axes {axes} of input '{ctx.input_ids[0]}' of rank {rank}")


def _attr_form(fn):
    def lower(ctx: LowerCtx, x, axes=None, keepdims=1, noop_with_empty_axes=0, **_):
        # PopART's ReduceOp: an 'axes' attribute that is there but empty reduces nothing
        # (an absent one reduces every axis)
        ax = reduce_axes(ctx, x, axes, noop_with_empty_axes or axes is not None)
        return fn(x, ax, bool(keepdims))
    return lower


def _input_form(fn):
    def lower(ctx: LowerCtx, x, axes=None, keepdims=1, noop_with_empty_axes=0, **_):
        axes = None if axes is None else ctx.static(axes, "axes")
        ax = reduce_axes(ctx, x, axes, noop_with_empty_axes)
        return fn(x, ax, bool(keepdims))
    return lower


for _name, (_fn, _since) in REDUCE.items():
    add(_name, _attr_form(_fn), since=1)
    add(_name, _input_form(_fn), since=_since, static_inputs=(1,))
