"""Recurrent ops: ai.onnx LSTM / GRU / RNN and PopART's ai.graphcore LSTM, on lax.scan."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .registry import GRAPHCORE_DOMAIN, LowerCtx, debug_name, opid, popart_error, register

HI = lax.Precision.HIGHEST

# name -> (fn(x, alpha, beta), default alpha, default beta); None where unused
ACTIVATIONS = {
    "relu": (lambda x, a, b: jax.nn.relu(x), None, None),
    "tanh": (lambda x, a, b: jnp.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: jax.nn.sigmoid(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: jnp.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: jnp.where(x > a, x, 0), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * jnp.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: jnp.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (lambda x, a, b: jnp.where(x >= 0, x, a * jnp.expm1(x)), 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + jnp.abs(x)), None, None),
    "softplus": (lambda x, a, b: jax.nn.softplus(x), None, None),
}


def _creator_name(ctx: LowerCtx) -> str:
    """The node as PopART's OpCreatorInfo::debugName prints it."""
    return (f"Op({ctx.name}[{opid(ctx)}], inputs=[{', '.join(ctx.input_ids)}], outputs=["
            f"{', '.join(ctx.output_ids)}])")


def activations(ctx: LowerCtx, names, alphas, betas, defaults, num_dirs):
    """Per direction, the list of activation callables (alpha / beta consumed in order)."""
    names = list(names) if names else defaults * num_dirs
    if len(names) == 2 * len(defaults) and num_dirs == 1:  # RNN's schema default lists both
        names = names[:len(defaults)]
    if len(names) != len(defaults) * num_dirs:
        if len(defaults) * num_dirs == 1:   # a one-direction RNN: rnn.cpp:175's text
            raise popart_error(ctx, f"{_creator_name(ctx)} only supports 1 activation, "
                               f"{len(names)} were specified", f"activations {names}")
        raise ctx.error(f"expected {len(defaults) * num_dirs} activations, got {names}")
    alphas, betas = list(alphas or []), list(betas or [])
    fns = []
    for n in names:
        key = n.lower()
        if key not in ACTIVATIONS:   # rnn.cpp:170's text
            raise popart_error(ctx, f"Activation type '{n}' is not supported for "
                               f"{_creator_name(ctx)}",
                               f"activations {list(names)}; supported: {sorted(ACTIVATIONS)}")
        fn, da, db = ACTIVATIONS[key]
        a = alphas.pop(0) if da is not None and alphas else da
        b = betas.pop(0) if db is not None and betas else db
        fns.append(lambda x, fn=fn, a=a, b=b: fn(x, a, b))
    k = len(defaults)
    return [fns[d * k:(d + 1) * k] for d in range(num_dirs)]


def _reverse_within(x, lens):
    """Reverse each batch column of x [T, B, ...] within its length (padding stays put)."""
    T = x.shape[0]
    t = jnp.arange(T)[:, None]
    idx = jnp.where(t < lens[None], lens[None] - 1 - t, t)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), 0)


def run_rnn(cell, x, h0, c0, lens, reverse):
    """Scan ``cell(x_t, h, c) -> (h, c)`` over x [T, B, I]; steps past a sequence's length
    keep the state and output zeros. Returns Y [T, B, H], last h, last c."""
    T = x.shape[0]
    if reverse:
        x = _reverse_within(x, lens)

    def step(carry, xs):
        h, c = carry
        xt, t = xs
        h2, c2 = cell(xt, h, c)
        m = (t < lens)[:, None]
        h2 = jnp.where(m, h2, h)
        c2 = c2 if c is None else jnp.where(m, c2, c)
        return (h2, c2), jnp.where(m, h2, jnp.zeros((), h2.dtype))
    (h, c), y = lax.scan(step, (h0, c0), (x, jnp.arange(T)))
    if reverse:
        y = _reverse_within(y, lens)
    return y, h, c


def _mm(a, b):
    return jnp.matmul(a, b, precision=HI)


def onnx_rnn(ctx: LowerCtx, kind, x, w, r, b, lens, h0, c0, p, direction, hidden_size, layout, acts,
             clip, input_forget=0, linear_before_reset=0):
    if layout:
        x = x.swapaxes(0, 1)
        h0 = None if h0 is None else h0.swapaxes(0, 1)
        c0 = None if c0 is None else c0.swapaxes(0, 1)
    T, B, _ = x.shape
    nd = 2 if direction == "bidirectional" else 1
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ctx.error(f"direction '{direction}' is not forward, reverse or bidirectional")
    H = r.shape[-1]
    if hidden_size is not None and hidden_size != H:   # BaseOnnxRNNOp::checkHiddenSize
        raise popart_error(ctx, f"hidden_size attribute passed to {debug_name(ctx)} ({hidden_size}) "
                           f"does not match hidden size calculated from recurrenceWeights tensor "
                           f"({H}).", f"R has shape {list(r.shape)}: hidden_size must be its last "
                           f"dimension")
    g = {"LSTM": 4, "GRU": 3, "RNN": 1}[kind]
    lens = jnp.full((B,), T, jnp.int32) if lens is None else jnp.asarray(lens).astype(jnp.int32)
    zeros = jnp.zeros((nd, B, H), x.dtype)
    h0 = zeros if h0 is None else h0
    c0 = zeros if c0 is None else c0
    b = jnp.zeros((nd, 2 * g * H), x.dtype) if b is None else b
    p = jnp.zeros((nd, 3 * H), x.dtype) if p is None else p
    cl = (lambda v: v) if clip is None else (lambda v: jnp.clip(v, -clip, clip))
    ys, hs, cs = [], [], []
    for d in range(nd):
        f, gact, hact = (acts[d] + [None, None])[:3]
        W, R, Wb, Rb = w[d], r[d], b[d, :g * H], b[d, g * H:]
        # input projections for every step at once; LSTM and RNN add both biases there, as
        # PopART's LSTMOp / RNNOp (one bias, Wb + Rb), GRU's recurrent bias stays in the cell
        xw = _mm(x, W.T) + (Wb if kind == "GRU" else Wb + Rb)

        if kind == "LSTM":
            pi, po, pf = p[d, :H], p[d, H:2 * H], p[d, 2 * H:]

            def cell(xt, h, c, R=R, f=f, gact=gact, hact=hact, pi=pi, po=po, pf=pf):
                z = xt + _mm(h, R.T)
                zi, zo, zf, zc = jnp.split(z, 4, -1)
                i = f(cl(zi + pi * c))
                fg = 1 - i if input_forget else f(cl(zf + pf * c))
                c2 = fg * c + i * gact(cl(zc))
                o = f(cl(zo + po * c2))
                return o * hact(c2), c2
        elif kind == "GRU":
            def cell(xt, h, c, R=R, Rb=Rb, f=f, gact=gact):
                xz, xr, xh = jnp.split(xt, 3, -1)
                Rz, Rr, Rh = jnp.split(R, 3, 0)
                bz, br, bh = jnp.split(Rb, 3)
                z = f(cl(xz + _mm(h, Rz.T) + bz))
                rr = f(cl(xr + _mm(h, Rr.T) + br))
                if linear_before_reset:
                    hh = gact(cl(xh + rr * (_mm(h, Rh.T) + bh)))
                else:
                    hh = gact(cl(xh + _mm(rr * h, Rh.T) + bh))
                return (1 - z) * hh + z * h, c
        else:
            def cell(xt, h, c, R=R, f=f):
                return f(cl(xt + _mm(h, R.T))), c
        rev = direction == "reverse" or d == 1
        y, h, c = run_rnn(cell, xw, h0[d], c0[d] if kind == "LSTM" else None, lens, rev)
        ys.append(y), hs.append(h), cs.append(c)
    Y, Yh = jnp.stack(ys, 1), jnp.stack(hs)  # Y [T, nd, B, H]
    Yc = jnp.stack(cs) if kind == "LSTM" else None
    if layout:
        Y, Yh = Y.transpose(2, 0, 1, 3), Yh.swapaxes(0, 1)
        Yc = None if Yc is None else Yc.swapaxes(0, 1)
    return [Y, Yh] + ([Yc] if kind == "LSTM" else [])


def _common(ctx: LowerCtx, defaults, nd, activations_, activation_alpha, activation_beta):
    return activations(ctx, activations_, activation_alpha, activation_beta, defaults, nd)


@register("LSTM")
def lstm(ctx: LowerCtx, x, w, r, b=None, lens=None, h0=None, c0=None, p=None, activation_alpha=None,
         activation_beta=None, activations=None, clip=None, direction="forward", hidden_size=None,
         input_forget=0, layout=0, **_):
    nd = 2 if direction == "bidirectional" else 1
    acts = _common(ctx, ["Sigmoid", "Tanh", "Tanh"], nd, activations, activation_alpha, activation_beta)
    return onnx_rnn(ctx, "LSTM", x, w, r, b, lens, h0, c0, p, direction, hidden_size, layout,
                    acts, clip, input_forget=input_forget)


@register("GRU")
def gru(ctx: LowerCtx, x, w, r, b=None, lens=None, h0=None, activation_alpha=None, activation_beta=None,
        activations=None, clip=None, direction="forward", hidden_size=None,
        linear_before_reset=0, layout=0, **_):
    nd = 2 if direction == "bidirectional" else 1
    acts = _common(ctx, ["Sigmoid", "Tanh"], nd, activations, activation_alpha, activation_beta)
    return onnx_rnn(ctx, "GRU", x, w, r, b, lens, h0, None, None, direction, hidden_size, layout,
                    acts, clip, linear_before_reset=linear_before_reset)


@register("RNN")
def rnn(ctx: LowerCtx, x, w, r, b=None, lens=None, h0=None, activation_alpha=None, activation_beta=None,
        activations=None, clip=None, direction="forward", hidden_size=None, layout=0, **_):
    nd = 2 if direction == "bidirectional" else 1
    acts = _common(ctx, ["Tanh"], nd, activations, activation_alpha, activation_beta)
    return onnx_rnn(ctx, "RNN", x, w, r, b, lens, h0, None, None, direction, hidden_size, layout,
                    acts, clip)


@register("LSTM", domain=GRAPHCORE_DOMAIN)
def popart_lstm(ctx: LowerCtx, x, weights, biases=None, init_state=None, lens=None, outputFullSequence=1, **_):
    """PopART's LSTM: x [T, B, I], weights [4, I + H, H] (input then recurrent weights),
    biases [4, H], initialState [2, B, H] (output, cell), gates in poplibs' order
    (forget, input, candidate, output). Outputs: output [T, B, H] (or [B, H] when
    outputFullSequence is 0) and the final cell state [B, H]. Computed as ai.onnx's LSTM
    on the same weights reordered (gates i, o, f, c; W [4H, I], R [4H, H]): the two agree
    bit for bit."""
    T, B, I = x.shape
    H = weights.shape[2]
    order = [1, 3, 0, 2]   # ONNX's i, o, f, c from poplibs' f, i, c, o
    w = jnp.concatenate([weights[k, :I].T for k in order])[None]
    r = jnp.concatenate([weights[k, I:].T for k in order])[None]
    bias = jnp.zeros((4, H), x.dtype) if biases is None else biases
    b = jnp.concatenate([bias[k] for k in order] + [jnp.zeros(4 * H, x.dtype)])[None]
    h0 = c0 = None
    if init_state is not None:
        h0, c0 = init_state[0][None], init_state[1][None]
    acts = activations(ctx, None, None, None, ["Sigmoid", "Tanh", "Tanh"], 1)
    y, h, c = onnx_rnn(ctx, "LSTM", x, w, r, b, lens, h0, c0, None, "forward", None, 0, acts, None)
    return (y[:, 0] if outputFullSequence else h[0]), c[0]
