"""PopART's internal ai.graphcore ops (opset 1) that the user guide lists as supported but that
are mostly created by PopART's own transforms: ConvFlipWeights, LossScaleUpdate, HostLoad,
HostStore, RemoteLoad, RemoteStore and PackedDataBlock. Inputs and attribute names follow
PopART's op definitions (``willow/src/op/...``); the semantics are restated on XLA terms in
each lowering's docstring."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..tensorinfo import np_dtype
from .registry import GRAPHCORE_DOMAIN, LowerCtx, register


def _g(name, **kw):
    return register(name, domain=GRAPHCORE_DOMAIN, **kw)


# ---------------------------------------------------------------------------------------
# Convolution

@_g("ConvFlipWeights")
def conv_flip_weights(ctx: LowerCtx, w, group=1, groupReshape=0, **_):
    """The weights of a convolution's data-gradient (transposed) convolution.

    ``w`` is ONNX Conv's weight [O, I/g, *k]. Per group, the input and output channels are
    swapped and every spatial axis is flipped, giving [g, I/g, O/g, *k] in memory; that is
    reshaped to [I, O/g, *k] when ``groupReshape`` (the layout of a grouped convolution's
    weight with I output channels) or to PopART's plain swapped shape [I/g, O, *k]
    otherwise. With ``group`` 1 both are the transposed, flipped weight."""
    g = int(group)
    if w.ndim < 3:
        raise ctx.error(f"weights must have rank >= 3 ([O, I/group, *kernel]), got shape "
                        f"{list(w.shape)}")
    o, ig, k = w.shape[0], w.shape[1], tuple(w.shape[2:])
    if g < 1 or o % g:
        raise ctx.error(f"group {g} must be >= 1 and divide the {o} output channels")
    n = len(k)
    w5 = jnp.reshape(w, (g, o // g, ig) + k)
    w5 = jnp.flip(w5, tuple(range(3, 3 + n)))
    w5 = jnp.swapaxes(w5, 1, 2)                              # [g, I/g, O/g, *k]
    shape = (ig * g, o // g) + k if groupReshape else (ig, o) + k
    return jnp.reshape(w5, shape)


# ---------------------------------------------------------------------------------------
# Automatic loss scaling

FP16_MAX_POW2 = 32768.0   # the largest power of two float16 holds (2^15)


def _threshold(ctx: LowerCtx, override):
    if override is not None:
        return float(override)
    if ctx.config is None:   # outside a session: PopART's default
        return 1e-7
    return float(ctx.config.als.thresholdUpperCountProportion)


@_g("LossScaleUpdate")
def loss_scale_update(ctx: LowerCtx, factor, *rest, updateFactorDType=None, clipOutput=0,
                      thresholdUpperCountProportion=None, **_):
    """The automatic-loss-scaling update factor.

    Inputs: the current loss-scale update factor (a scalar), optionally the loss scaling
    (a scalar, PopART 3's input 1), then one or more gradient statistics tensors of shape
    [2]: [count of gradient values below the bin edge, count above it] (the two bins of a
    Histogram of the tracked gradients). With l and u the summed lower and upper counts and
    t the session's ``automaticLossScalingSettings.thresholdUpperCountProportion`` (or this
    node's ``thresholdUpperCountProportion`` attribute, an extension), the factor is halved
    when u > l * t / (1 - t) -- that is, when u / (u + l) > t -- and doubled otherwise.
    With ``clipOutput`` the result is clipped to 2^15 / loss_scaling, so that
    factor * loss_scaling fits float16. The output has type ``updateFactorDType`` (an ONNX
    data type; default the factor's type)."""
    rest = list(rest)
    loss_scaling = None
    if len(rest) >= 2 and tuple(np.shape(rest[0])) != (2,):
        loss_scaling, rest = rest[0], rest[1:]
    if not rest:
        raise ctx.error("needs at least one gradient statistics input")
    for i, s in enumerate(rest):
        if tuple(np.shape(s)) != (2,):
            raise ctx.error(f"gradient statistics input {i} has shape {list(np.shape(s))}; "
                            f"expected [2] (lower bin count, upper bin count)")
    t = _threshold(ctx, thresholdUpperCountProportion)
    if not 0 <= t <= 1:
        raise ctx.error(f"thresholdUpperCountProportion {t} is out of the range [0, 1]")
    stats = sum(jnp.asarray(s).astype(jnp.float32) for s in rest)
    lower, upper = stats[0], stats[1]
    f = np.float32(np.inf if t == 1 else t / (1 - t))
    scale_down = upper > lower * f
    out_dt = (jnp.result_type(factor) if updateFactorDType is None
              else np_dtype(int(updateFactorDType)))
    fac = jnp.asarray(factor).astype(jnp.float32).reshape(())
    new = jnp.where(scale_down, fac * 0.5, fac * 2.0)
    if clipOutput:
        if loss_scaling is None:
            raise ctx.error("clipOutput needs the loss scaling input (input 1)")
        ls = jnp.asarray(loss_scaling).astype(jnp.float32).reshape(())
        new = jnp.minimum(new, FP16_MAX_POW2 / ls)
    return new.astype(out_dt)


# ---------------------------------------------------------------------------------------
# Host streams

def _stream_id(ctx: LowerCtx, streamid, streamId):
    sid = streamid if streamid is not None else streamId
    if not sid:
        raise ctx.error("attribute 'streamid' (the host stream's tensor id) is required")
    return str(sid)


@_g("HostLoad")
def host_load(ctx: LowerCtx, x, streamid=None, streamId=None, **_):
    """Load a tensor from host stream ``streamid`` into ``x``'s place.

    On XLA the host streams are the step's inputs: the result is the value of the tensor
    named ``streamid`` (a graph input, or any tensor of an enclosing scope) when there is
    one, converted to ``x``'s type, else ``x`` unchanged."""
    sid = _stream_id(ctx, streamid, streamId)
    v = ctx.host_stream(sid)
    if v is None:
        return x
    if tuple(np.shape(v)) != tuple(np.shape(x)):
        raise ctx.error(f"stream '{sid}' has shape {list(np.shape(v))} but the tensor it loads "
                        f"into has shape {list(np.shape(x))}")
    return jnp.asarray(v).astype(jnp.result_type(x))


@_g("HostStore")
def host_store(ctx: LowerCtx, x, streamid=None, streamId=None, **_):
    """Store ``x`` to host stream ``streamid``.

    On XLA the host reads anchors: when no tensor named ``streamid`` exists in the graph
    yet, ``x`` becomes the tensor ``streamid``, so anchoring ``streamid`` returns it (in a
    subgraph it is visible only inside that subgraph). When a tensor of that name already
    exists (e.g. the anchor is the stored tensor itself) the op does nothing. PopART's op
    has no outputs; an output the node declares anyway is ``x``."""
    sid = _stream_id(ctx, streamid, streamId)
    ctx.store_host_stream(sid, x)
    return x if ctx.num_outputs else []


# ---------------------------------------------------------------------------------------
# Remote buffers

def _remote_buffers(ctx: LowerCtx) -> dict:
    """Remote buffer id -> [(offset, value)] stores of this graph execution (on the TraceState)."""
    return ctx.remote_buffers()


def _offset(offset):
    if offset is None:
        return 0
    if np.size(offset) != 1:
        raise ValueError
    if isinstance(offset, (np.ndarray, np.generic, int)):
        return int(np.asarray(offset).reshape(()))
    return jnp.asarray(offset).reshape(()).astype(jnp.int32)


def _bufferid(ctx: LowerCtx, bufferid):
    if bufferid is None:
        raise ctx.error("attribute 'bufferid' is required")
    return int(bufferid)


@_g("RemoteStore")
def remote_store(ctx: LowerCtx, x, offset=None, bufferid=None, **_):
    """Write ``x`` to entry ``offset`` (default 0) of remote buffer ``bufferid``.

    On XLA, device memory is the remote memory: the buffers live for one execution of the
    graph (one step's trace), so a RemoteLoad of the same buffer and entry later in the
    graph returns ``x``. Buffers do not persist across steps. No outputs."""
    bid = _bufferid(ctx, bufferid)
    try:
        off = _offset(offset)
    except ValueError:
        raise ctx.error(f"offset must hold one index, got shape {list(np.shape(offset))}") from None
    stores = _remote_buffers(ctx).setdefault(bid, [])
    if stores:
        s0 = stores[0][1]
        if tuple(np.shape(s0)) != tuple(np.shape(x)) or jnp.result_type(s0) != jnp.result_type(x):
            raise ctx.error(f"remote buffer {bid} holds {jnp.result_type(s0)}{list(np.shape(s0))} "
                            f"entries; cannot store {jnp.result_type(x)}{list(np.shape(x))}")
    stores.append((off, x))
    return x if ctx.num_outputs else []


@_g("RemoteLoad")
def remote_load(ctx: LowerCtx, x, offset=None, bufferid=None, **_):
    """Read entry ``offset`` (default 0) of remote buffer ``bufferid`` into ``x``'s place:
    the value the latest earlier RemoteStore of this graph execution wrote to that entry
    (offsets known only at run time are compared at run time), or ``x`` unchanged when
    none did."""
    bid = _bufferid(ctx, bufferid)
    try:
        off = _offset(offset)
    except ValueError:
        raise ctx.error(f"offset must hold one index, got shape {list(np.shape(offset))}") from None
    out = x
    for s_off, val in _remote_buffers(ctx).get(bid, []):
        if tuple(np.shape(val)) != tuple(np.shape(x)):
            raise ctx.error(f"remote buffer {bid} holds entries of shape {list(np.shape(val))}; "
                            f"cannot load into shape {list(np.shape(x))}")
        if isinstance(off, int) and isinstance(s_off, int):
            if off == s_off:
                out = val
        else:
            out = jnp.where(jnp.asarray(off) == jnp.asarray(s_off), jnp.asarray(val),
                            jnp.asarray(out))
    return jnp.asarray(out).astype(jnp.result_type(x))


# ---------------------------------------------------------------------------------------
# Packed sequences

def _unpack(data, offsets, lengths, max_len):
    """[B, max_len, *rest]: sequence j is data[offsets[j]:offsets[j]+lengths[j]], zero padded."""
    r = jnp.arange(max_len)
    idx = offsets[:, None] + r[None]                                     # [B, L]
    valid = r[None] < lengths[:, None]
    rows = jnp.take(data, jnp.clip(idx, 0, data.shape[0] - 1), axis=0)  # [B, L, *rest]
    mask = valid.reshape(valid.shape + (1,) * (data.ndim - 1))
    return jnp.where(mask, rows, jnp.zeros((), data.dtype))


def _repack(result, r, offsets, lengths):
    """result[offsets[j]:offsets[j]+lengths[j]] = r[j][:lengths[j]] for each j."""
    b, length = r.shape[:2]
    rows = jnp.arange(length)
    dst = offsets[:, None] + rows[None]                                  # [B, L]
    dst = jnp.where(rows[None] < lengths[:, None], dst, result.shape[0])  # out of range: dropped
    rows_r = r.reshape((b * length,) + r.shape[2:]).astype(result.dtype)
    return result.at[dst.reshape(-1)].set(rows_r, mode="drop")


@_g("PackedDataBlock")
def packed_data_block(ctx: LowerCtx, *ins, maxSequenceLengths=(), resultSize=None, callbackBatchSize=1,
                      callback=None, **_):
    """Run ``callback`` on sequences unpacked from packed tensors and pack its results.

    Inputs: (data, offsets, lengths) for each packed input -- ``data`` holds sequences back
    to back along axis 0, sequence j being data[offsets[j]:offsets[j]+lengths[j]] -- then
    the result's offsets and lengths. For each block of ``callbackBatchSize`` sequences
    (len(offsets of input 0) // callbackBatchSize blocks), input i's sequences are zero
    padded to ``maxSequenceLengths[i]`` and stacked into [callbackBatchSize, max length,
    *rest]; the callback maps those to one output [callbackBatchSize, L, *rest_out], and
    its row j's first result_lengths[j] entries go to
    result[result_offsets[j]:result_offsets[j]+result_lengths[j]]. The output is
    [resultSize, *rest_out], zero where nothing is written. Shapes are static; offsets and
    lengths may be run-time values (lengths beyond the maximum length are truncated)."""
    if callback is None:
        raise ctx.error("attribute 'callback' (the subgraph) is required")
    if len(ins) < 5 or (len(ins) - 2) % 3:
        raise ctx.error(f"expects 3 inputs (data, offsets, lengths) per packed input plus the "
                        f"result's offsets and lengths, got {len(ins)} inputs")
    n = (len(ins) - 2) // 3
    max_lens = [int(v) for v in maxSequenceLengths]
    if len(max_lens) != n:
        raise ctx.error(f"maxSequenceLengths has {len(max_lens)} entries for {n} packed inputs")
    if resultSize is None:
        raise ctx.error("attribute 'resultSize' is required")
    bsz = int(callbackBatchSize)
    if bsz < 1:
        raise ctx.error(f"callbackBatchSize must be >= 1, got {bsz}")
    data = [jnp.asarray(ins[3 * i]) for i in range(n)]
    offs = [jnp.asarray(ins[3 * i + 1]).reshape(-1).astype(jnp.int32) for i in range(n)]
    lens = [jnp.asarray(ins[3 * i + 2]).reshape(-1).astype(jnp.int32) for i in range(n)]
    r_off = jnp.asarray(ins[-2]).reshape(-1).astype(jnp.int32)
    r_len = jnp.asarray(ins[-1]).reshape(-1).astype(jnp.int32)
    iters = offs[0].shape[0] // bsz
    if iters == 0:
        raise ctx.error(f"the {offs[0].shape[0]} sequences of input 0 make no block of "
                        f"callbackBatchSize {bsz}")
    checks = [(f"offsets/lengths of input {i}", v) for i in range(n) for v in (offs[i], lens[i])]
    for name, t in checks + [("result offsets", r_off), ("result lengths", r_len)]:
        if t.shape[0] < iters * bsz:
            raise ctx.error(f"{name} hold {t.shape[0]} entries; {iters * bsz} are needed")

    def block(carry, b):
        seqs = [_unpack(data[i], lax.dynamic_slice_in_dim(offs[i], b * bsz, bsz),
                        lax.dynamic_slice_in_dim(lens[i], b * bsz, bsz), max_lens[i])
                for i in range(n)]
        outs, record = ctx.run_body(callback, seqs, iteration=b)
        r = jnp.asarray(outs[0])
        if r.ndim < 2 or r.shape[0] != bsz:
            raise ctx.error(f"the callback's output must be [callbackBatchSize={bsz}, length, "
                            f"...], got shape {list(r.shape)}")
        return carry, (r, record)

    _, (rs, records) = lax.scan(block, None, jnp.arange(iters, dtype=jnp.int32))   # rs: [iters, B, L, *rest]
    ctx.check_record(records)   # the callback's run-time checks, every block
    rs = rs.reshape((iters * bsz,) + rs.shape[2:])
    result = jnp.zeros((int(resultSize),) + rs.shape[2:], rs.dtype)
    return _repack(result, rs, r_off[:iters * bsz], r_len[:iters * bsz])
