"""The grad op of one forward op (ai.popxl::OpVJP), as popxl's autodiff builds grad graphs:
it reads the saved forward tensors that PopART's grad op reads (gradInputInfo) and never
recomputes anything before them. Ops whose grad reads only the output (PopART's ReluGrad,
SigmoidGrad, ...) get their gradient from that output (``FROM_OUTPUT``); the others get the
vjp of the op's lowering at its saved inputs (inputs the grad does not read, as for linear
ops, are zeros of their shape)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .elementwise import _max_grad, _min_grad, _unbroadcast
from .popxl_ops import _p, vjp
from .registry import LowerCtx


def _softmax_from_output(g, y, axis=-1, **_):
    """SoftmaxGradOp: y * (g - sum(g * y, axis))."""
    return y * (g - jnp.sum(g * y, axis=int(axis), keepdims=True))


def _clip_from_output(g, y, lo=None, hi=None, **_):
    """ClipGradOpx: g where the output is neither bound (a missing bound never is)."""
    keep = jnp.ones(y.shape, bool)
    for b in (lo, hi):
        if b is not None:
            keep = keep & (y != jnp.asarray(b, y.dtype))
    return jnp.where(keep, g, g * jnp.zeros((), g.dtype))


def _reduce_log_sum_from_output(g, y, axes=None, keepdims=1, in_shape=(), **_):
    """ReduceLogSumGradOp (reads the output): g / exp(y), broadcast over the reduced axes."""
    d = g / jnp.exp(y)
    if not int(keepdims):
        ax = range(len(in_shape)) if axes is None else np.asarray(axes).reshape(-1)
        d = jnp.expand_dims(d, tuple(sorted(int(a) % len(in_shape) for a in ax)))
    return jnp.broadcast_to(d, tuple(in_shape))


def _topk_from_indices(g, idx, *_, axis=-1, in_shape=(), **__):
    """TopKGradOp (reads the indices output): g scattered to the chosen positions."""
    return jnp.put_along_axis(jnp.zeros(tuple(in_shape), g.dtype), jnp.asarray(idx, jnp.int32), g,
                              axis=int(axis), inplace=False)


def _median_from_indices(g, idx, *_, axes=None, in_shape=(), **__):
    """ReduceMedianGradOp (reads the indices output, flat over the reduced axes): g at the
    median's position, zeros elsewhere."""
    nd = len(in_shape)
    red = sorted(int(a) % nd for a in (axes if axes else range(nd)))
    keep = [a for a in range(nd) if a not in red]
    ks, rs = [in_shape[a] for a in keep], [in_shape[a] for a in red]
    z = jnp.put_along_axis(jnp.zeros(ks + [int(np.prod(rs))], g.dtype),
                           jnp.asarray(idx, jnp.int32).reshape(ks + [1]), g.reshape(ks + [1]),
                           axis=-1, inplace=False)
    return jnp.transpose(z.reshape(ks + rs), np.argsort(keep + red))


FROM_OUTPUT = {
    "Relu": lambda g, y, **_: jnp.where(y > 0, g, g * jnp.zeros((), g.dtype)),  # ReluGradOpx
    "Sigmoid": lambda g, y, **_: g * y * (1 - y),                             # SigmoidGradOpx
    "Tanh": lambda g, y, **_: g * (1 - y * y),                                # TanhGradOpx
    "Exp": lambda g, y, **_: g * y,                                           # ExpGradOpx
    "Sqrt": lambda g, y, **_: g / (y * 2),                                    # SqrtGradOpx
    "Softmax": _softmax_from_output,
    "Clip": _clip_from_output,
    "ReduceLogSum": _reduce_log_sum_from_output,
    "TopK": _topk_from_indices,
    "ReduceMedian": _median_from_indices,
}


# Grad ops of one argument that read that argument and the output (NonLinearVariadicGradOp:
# MaxArgGradOpx, MinArgGradOpx): the gradient of each required input from it and the output.
FROM_ARG_AND_OUTPUT = {"Max": _max_grad, "Min": _min_grad}


@_p("OpVJP")
def op_vjp(ctx: LowerCtx, *ins, fwd, provided, required, given, specs, n_saved_out=0,
           rule="", **_):
    """Gradients of inputs ``required`` of the one-node graph ``fwd`` given the gradients of
    its outputs ``provided``. Inputs: those gradients, the forward inputs ``given`` (indices
    of ``fwd.inputs``), then ``n_saved_out`` forward outputs. ``rule``: the op type whose
    gradient comes from its output (``FROM_OUTPUT``; the rule also gets the op's constant
    inputs after the first, None where omitted, its attributes and ``in_shape``) or from
    each required input and the output (``FROM_ARG_AND_OUTPUT``)."""
    n, m = len(provided), len(given)
    grads, vals = ins[:n], ins[n:n + m]
    if rule in FROM_ARG_AND_OUTPUT:
        y, xs = jnp.asarray(ins[n + m]), dict(zip(given, vals))
        g = jnp.asarray(grads[0], y.dtype).reshape(y.shape)
        return [_unbroadcast(FROM_ARG_AND_OUTPUT[rule](g, y, jnp.asarray(xs[i]))[0], xs[i])
                for i in required]
    if rule:
        y = jnp.asarray(ins[n + m])
        consts = [fwd.initializers[i] if i else None for i in fwd.nodes[0].inputs[1:]]
        g = jnp.asarray(grads[0], np.dtype(specs[0][1]))
        return [FROM_OUTPUT[rule](g.reshape(y.shape) if g.size == y.size else g, y, *consts,
                                  in_shape=tuple(specs[0][0]), **fwd.nodes[0].attrs)]
    xs = [jnp.zeros(tuple(s), np.dtype(d)) for s, d in specs]
    for i, v in zip(given, vals):
        xs[i] = v
    return vjp(ctx, *grads, *xs, fwd=fwd, provided=provided, required=required)
