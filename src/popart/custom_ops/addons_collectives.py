"""popxl-addons' C++ collective custom ops (domain popxl.addons.ops), from their C++ sources:
ReplicatedAllReduceTP, ReplicatedAllReduceStrided / AllGatherStrided / ReduceScatterStrided,
LayerNormDistributed, CrossEntropySharded (across replicas) and CrossEntropyShardedWR (across
the IPUs of one replica). The reductions are the project's collectives
(popart/ops/collectives.py) over ``ctx.replica_axis`` within the op's replica grouping."""
from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp
from jax import lax

from ..ops import collectives as C
from ..ops.registry import LowerCtx, popart_error
from .bindings import ADDONS_DOMAIN, grad_rule, register_op

_ADD_OR_MEAN = ("add", "mean")


def group_reduce(ctx: LowerCtx, x: Any, op: str, group: Optional[list]) -> Any:
    """All-reduce ``x`` with ``op`` over this replica's group of ``group`` ([num replicas,
    stride, group size]; None: all replicas)."""
    attrs = {} if group is None else {"__collectiveReplicaGrouping": list(group)}
    return C.all_reduce(ctx, x, collectiveOperator=op, **attrs)


def group_size(ctx: LowerCtx, group: Optional[list]) -> int:
    return ctx.replication_factor if group is None else int(group[2])


def _strided(ctx: LowerCtx, stride: int, groupSize: int) -> list:
    """The replica grouping of a strided op (the three C++ ops' one message)."""
    if int(stride) <= 0 or int(groupSize) <= 0:
        raise popart_error(ctx, "Cannot create ReplicatedAllGatherStrided op stride and group size "
                           "must be > 0.")
    return [ctx.replication_factor, int(stride), int(groupSize)]


def all_reduce_pair(ctx: LowerCtx, x: Any, op: str, group: Optional[list], identical_inputs: Any,
                    identical_grad_inputs: Any) -> Any:
    """The all-reduce whose grad op is the same op with the two flags swapped: with
    ``identical_inputs`` the forward is the identity, with ``identical_grad_inputs`` the
    gradient is; otherwise each is the all-reduce over the group."""
    def reduce(v: Any) -> Any:
        return group_reduce(ctx, v, op, group)
    fwd = (lambda v: v) if identical_inputs else reduce
    bwd = (lambda g: g) if identical_grad_inputs else reduce
    return grad_rule(lambda v: (fwd(v), None), lambda _, g: (bwd(g),))(jnp.asarray(x))


@register_op("ReplicatedAllReduceTP", ADDONS_DOMAIN, grad_reads="none")
def all_reduce_tp(ctx: LowerCtx, x: Any, op: Any = "Add", group: Optional[list] = None,
                  identicalInputs: int = 0, identicalGradInputs: int = 0, **_: Any) -> Any:
    """ReplicatedAllReduceTPOp: Add over ``group``; identity forward (identicalInputs) or
    identity gradient (identicalGradInputs)."""
    if C.op_name(ctx, op) != "add":
        raise popart_error(ctx, "Cannot create ReplicatedAllReduceTPOp op. CollectiveOperator::Add "
                           "is the only collective operator that is currently implemented.")
    return all_reduce_pair(ctx, x, "add", group, identicalInputs, identicalGradInputs)


def _add_or_mean(ctx: LowerCtx, op: Any, what: str) -> str:
    name = C.op_name(ctx, op)
    if name not in _ADD_OR_MEAN:
        raise popart_error(ctx, f"Cannot create {what} op. CollectiveOperator::Add and "
                           "CollectiveOperator::Mean are the only collective operators that are "
                           "currently implemented.")
    return name


@register_op("ReplicatedAllReduceStrided", ADDONS_DOMAIN, grad_reads="none")
def all_reduce_strided(ctx: LowerCtx, x: Any, op: Any = "Add", stride: int = 1,
                       groupSize: int = 1, identicalInputs: int = 0, identicalGradInputs: int = 0,
                       **_: Any) -> Any:
    """ReplicatedAllReduceStridedOp: Add or Mean over groups of ``groupSize`` replicas
    ``stride`` apart, with the TP op's identical-inputs flags."""
    name = _add_or_mean(ctx, op, "ReplicatedAllReduceStridedOp")
    group = _strided(ctx, stride, groupSize)
    return all_reduce_pair(ctx, x, name, group, identicalInputs, identicalGradInputs)


@register_op("ReplicatedAllGatherStrided", ADDONS_DOMAIN)
def all_gather_strided(ctx: LowerCtx, x: Any, stride: int = 1, groupSize: int = 1,
                       **_: Any) -> Any:
    """ReplicatedAllGatherStridedOp: the group's flattened inputs in rank order, shape
    [groupSize * nelms]. It has no grad op: no gradient flows through it."""
    group = _strided(ctx, stride, groupSize)
    return C.all_gather(ctx, lax.stop_gradient(x), __collectiveReplicaGrouping=group)


@register_op("ReplicatedReduceScatterStrided", ADDONS_DOMAIN)
def reduce_scatter_strided(ctx: LowerCtx, x: Any, op: Any = "Add", stride: int = 1,
                           groupSize: int = 1, **_: Any) -> Any:
    """ReplicatedReduceScatterStridedOp: this rank's ceil(nelms / groupSize) elements of the
    Add / Mean of the group's flattened (zero-padded) inputs. No grad op."""
    name = _add_or_mean(ctx, op, "ReplicatedReduceScatterStridedOp")
    group = _strided(ctx, stride, groupSize)
    return C.reduce_scatter(ctx, lax.stop_gradient(x), collectiveOperator=name,
                            __collectiveReplicaGrouping=group)


@register_op("LayerNormDistributed", ADDONS_DOMAIN, grad_reads=((0, 1), (1, 2)))
def layer_norm_distributed(ctx: LowerCtx, x: Any, scale: Any, bias: Any, epsilon: float = 1e-5,
                           group: Optional[list] = None, **_: Any) -> Any:
    """LayerNormDistributedOp: layer norm of x [N, H / group size] whose hidden dimension is
    sharded over the group: (Y, Mean, InvStdDev), the statistics (float32, non-stable:
    E[x^2] - E[x]^2) from one all-reduce of the partial sums. LayerNormDistributedGradOp:
    dX = invStd * (dY - mean_H(dY) - xhat * mean_H(dY * xhat)) with the means all-reduced
    (poplin's distributedNormStatisticsGradients on dY as given: the scale does not enter),
    dScale = sum_N(dY * xhat), dBias = sum_N(dY) of the local shard."""
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise popart_error(ctx, f"LayerNormDistributed: X must be [N, H], got shape {x.shape}")
    hidden = x.shape[1] * group_size(ctx, group)

    def total(*vs: Any) -> Any:
        return group_reduce(ctx, jnp.stack(vs), "add", group) / hidden

    def forward(x: Any, w: Any, b: Any) -> tuple:
        xf = x.astype(jnp.float32)
        mean, power = total(xf.sum(1), (xf * xf).sum(1))
        inv = lax.rsqrt(power - mean * mean + jnp.float32(epsilon))
        xhat = ((xf - mean[:, None]) * inv[:, None]).astype(x.dtype)
        y = xhat * w + b
        return (y, mean.astype(x.dtype), inv.astype(x.dtype)), (xhat, inv.astype(x.dtype))

    def backward(res: tuple, grads: tuple) -> tuple:
        xhat, inv = res
        dy, xh = (v.astype(jnp.float32) for v in (grads[0], xhat))   # float32 partials
        m_dy, m_dyx = total(dy.sum(1), (dy * xh).sum(1))
        dx = inv[:, None] * (dy - m_dy[:, None] - xh * m_dyx[:, None])
        return tuple(v.astype(inv.dtype) for v in (dx, (dy * xh).sum(0), dy.sum(0)))

    return grad_rule(forward, backward)(x, jnp.asarray(scale), jnp.asarray(bias))


def _neg_log_softmax(logits: Any, reduce: Any) -> Any:
    """-(x - max - log(sum(exp(x - max)))) with the max and the sum over the class axis
    completed by ``reduce(value, op)`` (the all-reduce of class-sharded logits)."""
    m = reduce(jnp.max(logits, 1), "max")
    t = logits - m[:, None]
    denom = reduce(jnp.sum(jnp.exp(t), 1), "add")
    return -(t - jnp.log(denom).astype(logits.dtype)[:, None])


def _take_true(nls: Any, idx: Any) -> Any:
    """nls[n, idx[n]] where 0 <= idx[n] < classes, else 0."""
    c = nls.shape[1]
    picked = jnp.take_along_axis(nls, jnp.clip(idx, 0, c - 1).astype(jnp.int32)[:, None], 1)[:, 0]
    return jnp.where((idx >= 0) & (idx < c), picked, jnp.zeros_like(picked))


def _logits_grad(nls: Any, idx: Any, g: Any) -> Any:
    """dL/dlogits = g * softmax - g at the true class (PopART's multiUpdateAdd of -g; an
    index out of this shard's range updates nothing)."""
    onehot = idx[:, None] == jnp.arange(nls.shape[1])
    return jnp.exp(-nls) * g[:, None] - jnp.where(onehot, g[:, None], jnp.zeros_like(nls))


@register_op("CrossEntropySharded", ADDONS_DOMAIN, grad_reads=((0, 1), (0, 1)))
def cross_entropy_sharded(ctx: LowerCtx, logits: Any, indices: Any, group: Optional[list] = None,
                          availableMemoryProportion: float = 0.4, **_: Any) -> Any:
    """CrossEntropyShardedOp: logits [N, C / group size] sharded over the group's classes,
    indices [N] already shifted to this shard (out-of-range ones pick 0): (loss [N], the
    same on every member, from one all-reduce; the shard's negative log-softmax).
    CrossEntropyShardedGradOp: dLogits = dLoss * softmax - dLoss at the true class."""
    def forward(x: Any, i: Any) -> tuple:
        nls = _neg_log_softmax(x, lambda v, op: group_reduce(ctx, v, op, group))
        return (group_reduce(ctx, _take_true(nls, i), "add", group), nls), (nls, i)

    def backward(res: tuple, grads: tuple) -> tuple:
        return _logits_grad(*res, grads[0]), None

    return grad_rule(forward, backward)(jnp.asarray(logits), jnp.asarray(indices))


@register_op("CrossEntropyShardedWR", ADDONS_DOMAIN, grad_reads="in+out")
def cross_entropy_sharded_wr(ctx: LowerCtx, *inputs: Any, ipus: Optional[list] = None,
                             **_: Any) -> Any:
    """CrossEntropyShardedWROp: the class shards of the logits on the IPUs of one replica
    (inputs logits_0..n-1 then indices_0..n-1, indices not shifted: shard s takes
    index - its first class): (loss [N], each shard's negative log-softmax). The IPUs of a
    replica share one device here. Grad: per shard dLoss * softmax - dLoss at its class."""
    n = len(inputs) // 2
    if n == 0 or len(inputs) != 2 * n or (ipus is not None and len(ipus) != n):
        raise popart_error(ctx, f"CrossEntropyShardedWR: expected n logits, n indices and n "
                           f"ipus, got {len(inputs)} inputs and ipus {ipus}")
    logits = [jnp.asarray(x) for x in inputs[:n]]
    starts = [sum(x.shape[1] for x in logits[:s]) for s in range(n)]

    def forward(*xs: Any) -> tuple:
        idx = [i - s for i, s in zip(xs[n:], starts)]
        shards = jnp.split(_neg_log_softmax(jnp.concatenate(xs[:n], 1), lambda v, op: v),
                           starts[1:], 1)
        loss = sum(_take_true(p, i) for p, i in zip(shards, idx))
        return (loss, *shards), (shards, idx)

    def backward(res: tuple, grads: tuple) -> tuple:
        return (*(_logits_grad(p, i, grads[0]) for p, i in zip(*res)), *[None] * n)

    return list(grad_rule(forward, backward)(*logits, *map(jnp.asarray, inputs[n:])))
