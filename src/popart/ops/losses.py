"""PopART's loss ops (ai.graphcore): Nll, L1, IdentityLoss, Ctc, CtcBeamSearchDecoder.

``reduction`` is a string "Sum" / "Mean" / "NoReduction" (ReductionType's names; the ints
0 / 1 / 2 of popart.ReductionType are accepted too)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..tensorinfo import np_dtype
from .registry import GRAPHCORE_DOMAIN, register

_REDUCTIONS = {"sum": "Sum", "mean": "Mean", "noreduction": "NoReduction", "none": "NoReduction",
               0: "Sum", 1: "Mean", 2: "NoReduction"}


def reduction_type(ctx, r):
    key = r.lower() if isinstance(r, str) else int(r)
    if key not in _REDUCTIONS:
        raise ctx.error(f"reduction '{r}' is not one of Sum, Mean, NoReduction")
    return _REDUCTIONS[key]


def reduce_loss(ctx, per, reduction, count=None):
    """Reduce per-sample losses; Mean divides by ``count`` (default: the number of losses)."""
    r = reduction_type(ctx, reduction)
    if r == "NoReduction":
        return per
    s = jnp.sum(per)
    if r == "Sum":
        return s
    return s / (per.size if count is None else count)


def _g(name, **kw):
    return register(name, domain=GRAPHCORE_DOMAIN, **kw)


@_g("Nll")
def nll(ctx, probs, label, reduction="Mean", ignoreIndex=None, inputIsLogProbability=0, **_):
    """-log(p[label]) over the last (class) axis; probabilities are clamped to 1e-7 (6.104e-5
    in float16) as PopART does. Mean divides by the number of labels that are not
    ignoreIndex (at least 1)."""
    lab = label.astype(jnp.int32)
    p = jnp.take_along_axis(probs, jnp.clip(lab, 0, probs.shape[-1] - 1)[..., None], -1)[..., 0]
    if not inputIsLogProbability:
        p = jnp.log(jnp.maximum(p, 6.104e-5 if probs.dtype == jnp.float16 else 1e-7))
    per = -p
    count = None
    if ignoreIndex is not None:
        keep = lab != ignoreIndex
        per = jnp.where(keep, per, jnp.zeros((), per.dtype))
        count = jnp.maximum(jnp.sum(keep), 1).astype(per.dtype)
    return reduce_loss(ctx, per, reduction, count)


@_g("L1")
def l1(ctx, x, reduction="Mean", **attrs):
    lam = attrs.get("lambda", attrs.get("lambda_", 1.0))
    return reduce_loss(ctx, lam * jnp.abs(x), reduction)


@_g("IdentityLoss")
def identity_loss(ctx, x, reduction="Mean", **_):
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


@_g("Ctc")
def ctc(ctx, log_probs, targets, in_lens, tgt_lens, reduction="Mean", blank=0, outDataType=0,
        zeroInfinity=0, **_):
    """CTC loss; Mean divides each loss by its target length, then averages (PyTorch's
    convention). Output 1 (when declared) is d(sum of per-sample losses)/d(log_probs)."""
    out_dt = log_probs.dtype if outDataType in (0, None, "UNDEFINED") else np_dtype(
        outDataType if isinstance(outDataType, int) else str(outDataType))

    def per_sample(lp):
        nll = ctc_nll(lp.astype(jnp.float32) if lp.dtype == jnp.float16 else lp, targets,
                      in_lens, tgt_lens, blank)
        if zeroInfinity:
            nll = jnp.where(jnp.isinf(nll), jnp.zeros((), nll.dtype), nll)
        return nll
    per = per_sample(log_probs)
    r = reduction_type(ctx, reduction)
    if r == "Mean":
        loss = jnp.mean(per / jnp.maximum(tgt_lens, 1).astype(per.dtype))
    else:
        loss = reduce_loss(ctx, per, r)
    loss = loss.astype(out_dt)
    if ctx.num_outputs > 1 and ctx.output_ids[1]:
        g = jax.grad(lambda lp: jnp.sum(per_sample(lp)))(lax.stop_gradient(log_probs))
        return loss, g.astype(out_dt)
    return loss


@_g("CtcBeamSearchDecoder")
def ctc_beam_search_decoder(ctx, log_probs, data_lens, blank=0, beam_width=100, top_paths=1, **_):
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
    return jax.pure_callback(host, shapes, lax.stop_gradient(log_probs), data_lens)


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
