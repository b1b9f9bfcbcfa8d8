"""PopART's loss ops (ai.graphcore): Nll, L1, IdentityLoss, Ctc, CtcBeamSearchDecoder.

``reduction`` is a string: PopART's "Sum" / "Mean" / "None", or ReductionType's names ("None"
and "NoReduction" alike; the ints 0 / 1 / 2 of popart.ReductionType are accepted too).
Attribute defaults come from the table in ``popart._ir.graphcore_schema`` (SoftmaxNll takes
Nll's), so the lowerings name those attributes without defaults of their own."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..tensorinfo import DataType, np_dtype, to_datatype
from .elementwise import abs_
from .registry import GRAPHCORE_DOMAIN, LowerCtx, register

_REDUCTIONS = {"sum": "Sum", "mean": "Mean", "noreduction": "NoReduction", "none": "NoReduction",
               0: "Sum", 1: "Mean", 2: "NoReduction"}


def reduction_type(ctx: LowerCtx, r):
    key = r.lower() if isinstance(r, str) else int(r)
    if key not in _REDUCTIONS:
        raise ctx.error(f"reduction '{r}' is not one of Sum, Mean, None (NoReduction)")
    return _REDUCTIONS[key]


def reduce_loss(ctx: LowerCtx, per, reduction, count=None):
    """Reduce per-sample losses; Mean divides by ``count`` (default: the number of losses)."""
    r = reduction_type(ctx, reduction)
    if r == "NoReduction":
        return per
    dt = jnp.result_type(per)   # summed in at least float32, as poplar's reduce (fp16 stays finite)
    s = jnp.sum(per, dtype=jnp.promote_types(dt, jnp.float32) if jnp.issubdtype(dt, jnp.floating) else dt)
    if r == "Sum":
        return s.astype(dt)
    return (s / (per.size if count is None else count)).astype(dt)


def _g(name, **kw):
    return register(name, domain=GRAPHCORE_DOMAIN, **kw)


# ---------------------------------------------------------------------------------------
# Nll, and Softmax followed by Nll (PopART's SoftmaxGradDirect / NlllWithSoftmaxGradDirect)
#
# PopART does not differentiate these forward passes: NllGrad, and the fused softmax + nll
# gradient that its default patterns put in place of NllGrad -> SoftmaxGrad, are written out
# below as custom VJPs (docs/gradients.md).

def _log_eps(dtype) -> float:
    """Nll's forward clamp: log(max(p, eps))."""
    return 6.104e-5 if dtype == jnp.float16 else 1e-7


def _grad_eps(dtype) -> float:
    """NllGrad's guard: -1 / max(p, eps) (a smaller epsilon than the forward's)."""
    return 6.104e-5 if dtype == jnp.float16 else 1e-10


def _nll_parts(probs, label, ignore_index):
    """(one-hot of the labels [.., C], per-sample keep mask, Mean's divisor of the loss,
    Mean's divisor of the gradient) over the last (class) axis. With ``ignore_index`` both
    are the number of labels not ignored (at least 1); without, the loss divides by the
    number of labels and the gradient by ``probs.shape[0]`` (NllOpx::
    applyScalingInPlaceForMeanReduction reads dim 0 of the gradient in probs' shape: the
    same for [N, C] probs, not for [N, S, C])."""
    lab = jnp.asarray(label).astype(jnp.int32)
    onehot = (lab[..., None] == jnp.arange(probs.shape[-1], dtype=jnp.int32)).astype(probs.dtype)
    if ignore_index is None:
        first = probs.shape[0] if probs.ndim else 1
        return (onehot, jnp.ones(lab.shape, probs.dtype), jnp.asarray(lab.size, probs.dtype),
                jnp.asarray(first, probs.dtype))
    keep = (lab != ignore_index).astype(probs.dtype)
    count = jnp.maximum(jnp.sum(keep), 1)
    return onehot, keep, count, count


def _scale_grad(g, keep, count, r: str):
    """The loss's incoming gradient per sample (PopART's handleLossGradScaling)."""
    g = jnp.asarray(g)
    if r == "Mean":
        g = g / jnp.asarray(count, g.dtype)
    return (g * keep)[..., None]


def nll_loss(ctx: LowerCtx, probs, label, reduction: str, ignore_index, log_input: bool):
    """PopART's Nll, with NllGrad's rule as its gradient: d/dp[label] = -1 / max(p, 1e-10)
    (6.104e-5 in float16), or -1 when ``log_input``; 0 for the other classes."""
    r = reduction_type(ctx, reduction)

    @jax.custom_vjp
    def f(p, onehot, keep, count, gcount):
        picked = jnp.sum(p * onehot, -1)
        if not log_input:
            picked = jnp.log(jnp.maximum(picked, jnp.asarray(_log_eps(p.dtype), p.dtype)))
        return reduce_loss(ctx, -picked * keep, r, count)

    def fwd(p, onehot, keep, count, gcount):
        return f(p, onehot, keep, count, gcount), (p, onehot, keep, gcount)

    def bwd(res, g):
        p, onehot, keep, gcount = res
        if log_input:
            d = -onehot
        else:
            d = -onehot / jnp.maximum(p, jnp.asarray(_grad_eps(p.dtype), p.dtype))
        return (d * _scale_grad(g, keep, gcount, r)).astype(p.dtype), None, None, None, None

    f.defvjp(fwd, bwd)
    return f(probs, *_nll_parts(probs, label, ignore_index))


@_g("Nll")
def nll(ctx: LowerCtx, probs, label, *, reduction, ignoreIndex=None, inputIsLogProbability, **_):
    """-log(max(p[label], 1e-7)) (6.104e-5 in float16) over the last (class) axis, or
    -p[label] for log-probabilities; NllGrad's gradient."""
    return nll_loss(ctx, probs, label, reduction, ignoreIndex, bool(inputIsLogProbability))


@_g("SoftmaxNll")
def softmax_nll(ctx: LowerCtx, logits, probs, label, reduction, ignoreIndex=None, axis=-1,
                fuseLoss=1, **_):
    """Nll of ``probs = Softmax(logits)`` whose gradient goes to ``logits`` directly as
    (p - onehot(label)) * scale (SoftmaxGradDirect), exact however saturated p is. With
    ``fuseLoss`` (NlllWithSoftmaxGradDirect) the loss is -log(p[label] + 1e-7), as that fused
    op computes it; otherwise Nll's -log(max(p[label], eps)). Put in place of an Nll by
    ``popart._ir.transforms.fuse_softmax_nll`` in training; a softmax over another axis than
    the last is left to the unfused grads."""
    if axis % jnp.ndim(logits) != jnp.ndim(logits) - 1:
        return nll_loss(ctx, probs, label, reduction, ignoreIndex, False)
    r = reduction_type(ctx, reduction)

    @jax.custom_vjp
    def f(z, p, onehot, keep, count, gcount):
        picked = jnp.sum(p * onehot, -1)
        eps = jnp.asarray(1e-7 if fuseLoss else _log_eps(p.dtype), p.dtype)
        picked = jnp.log(picked + eps if fuseLoss else jnp.maximum(picked, eps))
        return reduce_loss(ctx, -picked * keep, r, count).astype(z.dtype)

    def fwd(z, p, onehot, keep, count, gcount):
        return f(z, p, onehot, keep, count, gcount), (p, onehot, keep, gcount)

    def bwd(res, g):
        p, onehot, keep, gcount = res
        d = (p - onehot) * _scale_grad(g, keep, gcount, r)
        return d.astype(logits.dtype), None, None, None, None, None

    f.defvjp(fwd, bwd)
    return f(logits, lax.stop_gradient(probs), *_nll_parts(probs, label, ignoreIndex))


def nll_with_softmax_grad_direct(ctx: LowerCtx, probs, label, loss_grad, reduction,
                                 ignore_index):
    """PopART's NlllWithSoftmaxGradDirect (``popx/op/softmaxx.cpp``), computed directly from
    ``probs`` that are already a softmax over the last axis: the loss -log(p[label] + 1e-7),
    masked by ``ignore_index`` and reduced (Mean over the labels, or over those not ignored,
    at least 1), and d logits = (p - onehot(label)) x loss_grad (``loss_grad`` broadcast with
    trailing axes; masked; Mean divides by the non-ignored labels, or without
    ``ignore_index`` by ``probs.shape[0]``, as ``NllOpx::handleLossGradScaling`` does). Both
    in ``probs``' dtype; a float32 ``loss_grad`` scales float16 probabilities in float32. No
    gradient flows through this op (PopART's grad ops have none)."""
    r = reduction_type(ctx, reduction)
    p, lab = lax.stop_gradient(jnp.asarray(probs)), jnp.asarray(label)
    onehot, keep, count, gcount = _nll_parts(p, lab, ignore_index)
    logp = jnp.log(jnp.sum(p * onehot, -1) + jnp.asarray(1e-7, p.dtype)) * keep
    work = jnp.float32 if p.dtype == jnp.float16 else p.dtype    # float16 sums in float32
    loss = reduce_loss(ctx, -logp.astype(work), r, count.astype(work)).astype(p.dtype)
    g = lax.stop_gradient(jnp.asarray(loss_grad))
    g = g.reshape(g.shape + (1,) * (p.ndim - g.ndim))
    work = jnp.promote_types(g.dtype, p.dtype)
    if r == "Mean":
        g = g.astype(work) / gcount.astype(work)
    dx = (p - onehot).astype(work) * keep[..., None].astype(work) * g.astype(work)
    return loss, dx.astype(p.dtype)


@_g("L1")
def l1(ctx: LowerCtx, x, *, reduction, **attrs):
    """lambda * |x|, reduced; its gradient is lambda * sign(x) (0 at 0), as L1Grad's. The
    attribute ``lambda`` (a Python keyword, so read from ``attrs``) is required."""
    lam = attrs["lambda"]
    return reduce_loss(ctx, lam * abs_(x), reduction)   # abs_: AbsGrad's sign(x), 0 at 0


@_g("IdentityLoss")
def identity_loss(ctx: LowerCtx, x, *, reduction, **_):
    return reduce_loss(ctx, x, reduction)


# ---------------------------------------------------------------------------------------
# CTC

def _lae(a, b):
    """logaddexp whose gradient is 0 (not NaN) where both arguments are -inf."""
    m = jnp.maximum(a, b)
    ms = jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))
    s = jnp.exp(a - ms) + jnp.exp(b - ms)
    ok = s > 0
    return jnp.where(ok, ms + jnp.log(jnp.where(ok, s, jnp.ones((), s.dtype))), -jnp.inf)


def ctc_nll(log_probs, targets, in_lens, tgt_lens, blank):
    """Per-sample negative log-likelihood. log_probs [T, N, C], targets [N, S]."""
    T, N, C = log_probs.shape
    S = targets.shape[1]
    L = 2 * S + 1
    ninf = jnp.array(-jnp.inf, log_probs.dtype)
    ext = jnp.full((N, L), blank, jnp.int32).at[:, 1::2].set(targets.astype(jnp.int32))
    # a skip from s-2 is allowed onto a label that differs from the label two back
    skip = jnp.zeros((N, L), bool).at[:, 2:].set((ext[:, 2:] != blank) & (ext[:, 2:] != ext[:, :-2]))
    emit = jnp.take_along_axis(log_probs, jnp.broadcast_to(ext[None], (T, N, L)), 2)  # [T, N, L]
    alpha0 = jnp.full((N, L), ninf).at[:, 0].set(emit[0, :, 0]).at[:, 1].set(
        jnp.where(tgt_lens > 0, emit[0, :, 1], ninf))

    def step(alpha, xs):
        e, t = xs
        a1 = jnp.concatenate([jnp.full((N, 1), ninf), alpha[:, :-1]], 1)
        a2 = jnp.where(skip, jnp.concatenate([jnp.full((N, 2), ninf), alpha[:, :-2]], 1), ninf)
        new = _lae(_lae(alpha, a1), a2) + e
        new = jnp.where((t < in_lens)[:, None], new, alpha)  # frozen past each input length
        return new, None
    alpha, _ = lax.scan(step, alpha0, (emit[1:], jnp.arange(1, T)))
    end = 2 * tgt_lens.astype(jnp.int32)
    last = jnp.take_along_axis(alpha, end[:, None], 1)[:, 0]
    prev = jnp.take_along_axis(alpha, jnp.maximum(end - 1, 0)[:, None], 1)[:, 0]
    return -_lae(last, jnp.where(end > 0, prev, ninf))


def _ctc_lp(log_probs):
    """log_probs in the precision the CTC recursions run in (float16 in float32)."""
    return log_probs.astype(jnp.float32) if log_probs.dtype == jnp.float16 else log_probs


def ctc_loss_and_grad(lp, targets, in_lens, tgt_lens, blank: int, zero_infinity: bool):
    """Per-sample losses [N] and PopART's gradient of each w.r.t. ``lp`` [T, N, C], as popnn's
    calcLossAndGradientLogProbabilities gives it: exp(lp) - occupancy, the occupancy being
    -d loss / d lp from the alpha-beta recursion (0 from each input length on, where the
    gradient is therefore exp(lp); 0 for a loss with no valid alignment). With
    ``zero_infinity`` an infinite loss and its whole gradient are 0."""
    def total(v):
        nll = ctc_nll(v, targets, in_lens, tgt_lens, blank)
        return jnp.sum(nll), nll
    (_, nll), d_nll = jax.value_and_grad(total, has_aux=True)(lp)
    grad = jnp.exp(lp) + d_nll
    if zero_infinity:
        inf = jnp.isinf(nll)
        nll = jnp.where(inf, jnp.zeros((), nll.dtype), nll)
        grad = jnp.where(inf[None, :, None], jnp.zeros((), grad.dtype), grad)
    return nll, grad


def _ctc_per_sample(log_probs, targets, in_lens, tgt_lens, blank: int, zero_infinity: bool,
                    out_dt):
    """Per-sample CTC losses (``_ctc_per_sample_grad`` differentiates them as PopART does)."""
    nll = ctc_nll(_ctc_lp(log_probs), targets, in_lens, tgt_lens, blank)
    return jnp.where(jnp.isinf(nll), jnp.zeros((), nll.dtype), nll) if zero_infinity else nll


def _ctc_per_sample_fwd(log_probs, targets, in_lens, tgt_lens, blank, zero_infinity, out_dt):
    nll, grad = ctc_loss_and_grad(_ctc_lp(log_probs), targets, in_lens, tgt_lens, blank,
                                  zero_infinity)
    return nll, (grad, jnp.zeros((), log_probs.dtype))


def _ctc_per_sample_bwd(blank, zero_infinity, out_dt, res, g):
    """CtcGradOpx: the loss gradient per sample times the forward's gradient output (which
    is in outDataType), the product in log_probs' type."""
    grad, like = res
    to = lambda t: t.astype(out_dt).astype(like.dtype)
    return to(grad) * to(g)[None, :, None], None, None, None


_ctc_per_sample_grad = jax.custom_vjp(_ctc_per_sample, nondiff_argnums=(4, 5, 6))
_ctc_per_sample_grad.defvjp(_ctc_per_sample_fwd, _ctc_per_sample_bwd)


@_g("Ctc")
def ctc(ctx: LowerCtx, log_probs, targets, in_lens, tgt_lens, *, reduction, blank, outDataType,
        zeroInfinity, **_):
    """CTC loss; Mean divides each loss by its target length, then averages (PyTorch's
    convention). Output 1 (when declared) is PopART's gradient of the per-sample losses
    w.r.t. log_probs (``ctc_loss_and_grad``), which is also how the loss differentiates.
    ``outDataType``: an ONNX data type (as PopART writes it) or a PopART dtype name;
    UNDEFINED (0) is log_probs' type."""
    undefined = to_datatype(outDataType) == DataType.UNDEFINED
    out_dt = log_probs.dtype if undefined else np_dtype(outDataType)
    args = (targets, in_lens, tgt_lens, int(blank), bool(zeroInfinity))
    per = _ctc_per_sample_grad(log_probs, *args, np.dtype(out_dt))
    r = reduction_type(ctx, reduction)
    if r == "Mean":
        loss = jnp.mean(per / jnp.maximum(tgt_lens, 1).astype(per.dtype))
    else:
        loss = reduce_loss(ctx, per, r)
    loss = loss.astype(out_dt)
    if ctx.num_outputs > 1 and ctx.output_ids[1]:
        _, g = ctc_loss_and_grad(_ctc_lp(lax.stop_gradient(log_probs)), *args)
        return loss, g.astype(out_dt)
    return loss


@_g("CtcBeamSearchDecoder")
def ctc_beam_search_decoder(ctx: LowerCtx, log_probs, data_lens, *, blank, beam_width, top_paths, **_):
    """Prefix beam search (inference only), run on the host through jax.pure_callback.
    Returns [labelProbs [N, top], labelLengths [N, top], decodedLabels [N, top, T]]."""
    T, N, C = log_probs.shape
    if top_paths > beam_width:
        raise ctx.error(f"top_paths ({top_paths}) must be <= beam_width ({beam_width})")

    def host(lp, lens):
        lp, lens = np.asarray(lp, np.float64), np.asarray(lens)
        probs = np.zeros((N, top_paths), lp.dtype)
        lengths = np.zeros((N, top_paths), np.uint32)
        labels = np.zeros((N, top_paths, T), np.uint32)
        for n in range(N):
            beams = _prefix_beam_search(lp[: int(lens[n]), n], blank, beam_width)
            for k, (prefix, score) in enumerate(beams[:top_paths]):
                probs[n, k] = score
                lengths[n, k] = len(prefix)
                labels[n, k, : len(prefix)] = prefix
        return probs.astype(np.dtype(log_probs.dtype)), lengths, labels
    shapes = (jax.ShapeDtypeStruct((N, top_paths), log_probs.dtype),
              jax.ShapeDtypeStruct((N, top_paths), np.uint32),
              jax.ShapeDtypeStruct((N, top_paths, T), np.uint32))
    return jax.pure_callback(host, shapes, lax.stop_gradient(log_probs), data_lens,
                             vmap_method="sequential")


def _prefix_beam_search(lp, blank, width):
    """CTC prefix beam search on log-probabilities [T, C]; [(prefix, log prob)] best first."""
    la = np.logaddexp
    beams = {(): (0.0, -np.inf)}  # prefix -> (log p ending in blank, log p ending in non-blank)
    for t in range(lp.shape[0]):
        nxt: dict = {}
        for prefix, (pb, pnb) in beams.items():
            for c in range(lp.shape[1]):
                p = lp[t, c]
                if c == blank:
                    b, nb = nxt.get(prefix, (-np.inf, -np.inf))
                    nxt[prefix] = (la(b, la(pb, pnb) + p), nb)
                    continue
                new = prefix + (c,)
                b, nb = nxt.get(new, (-np.inf, -np.inf))
                add = pb + p if prefix and prefix[-1] == c else la(pb, pnb) + p
                nxt[new] = (b, la(nb, add))
                if prefix and prefix[-1] == c:  # repeated label without a blank: same prefix
                    b, nb = nxt.get(prefix, (-np.inf, -np.inf))
                    nxt[prefix] = (b, la(nb, pnb + p))
        beams = dict(sorted(nxt.items(), key=lambda kv: -la(*kv[1]))[:width])
    return [(list(k), float(la(*v))) for k, v in sorted(beams.items(), key=lambda kv: -la(*kv[1]))]
