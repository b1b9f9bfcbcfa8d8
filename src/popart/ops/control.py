"""Control flow: If, Loop, Scan (ai.onnx) and Call (ai.graphcore), lowered to lax.cond /
lax.scan / lax.while_loop. Subgraphs are IR Graphs held in node attributes and run through
``ctx.run_subgraph`` (which makes tensors of enclosing scopes visible)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import UnsupportedOperatorError, noted
from .registry import CHECK_RECORD_SIZE, GRAPHCORE_DOMAIN, LowerCtx, onnx_semantics, register


def _static_value(x):
    return x is not None and isinstance(x, (np.ndarray, np.generic, bool, int))


def _struct(v):
    return jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v))


def _same_types(ctx: LowerCtx, what, a, b):
    sa, sb = [_struct(v) for v in a], [_struct(v) for v in b]
    if sa != sb:
        raise ctx.error(f"{what} must have the same shapes and dtypes, got "
                        + "; ".join(f"{x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"
                                    for x, y in zip(sa, sb) if x != y))


@register("If")
def if_(ctx: LowerCtx, cond, then_branch, else_branch, **_):
    if _static_value(cond):
        return ctx.run_subgraph(then_branch if bool(np.asarray(cond).reshape(())) else else_branch, [])
    # lax.cond traces each branch exactly once (no eval_shape pass first): a nested If's
    # branches are traced once per trace of the enclosing one, so compile time is linear in
    # the nesting depth, not 2**depth.
    not_tensors, shapes = [], []

    def branch(g):
        def run():
            outs, record = ctx.run_body(g, [])
            not_tensors.extend(v is None or isinstance(v, list) for v in outs)
            vals = [jnp.asarray(v) for v in outs if v is not None and not isinstance(v, list)]
            shapes.append([_struct(v) for v in vals])
            return vals, record
        return run
    failure = None
    try:
        out, record = lax.cond(jnp.asarray(cond, bool).reshape(()), branch(then_branch),
                               branch(else_branch))
    except TypeError as e:   # lax.cond's own check of the branches' output types
        if len(shapes) < 2:
            raise
        failure = e
    if any(not_tensors):
        raise ctx.error("branches that return sequences or optional values need a condition "
                        "that must be known at compile time")
    _same_types(ctx, "If's then_branch and else_branch outputs", *shapes)
    if failure is not None:
        raise failure
    ctx.check_record(record)   # the taken branch's run-time checks
    return out


def _cond_passthrough(body):
    """True when the body's condition output is its condition input (maybe via Identity)."""
    prod, t = body.producer(), body.outputs[0]
    while t in prod and prod[t].op_type == "Identity":
        t = prod[t].inputs[0]
    return t == body.inputs[1]


UNROLL_LIMIT = 64   # Loops whose body needs a static iteration count run unrolled up to this


@register("Loop")
def loop(ctx: LowerCtx, m=None, cond=None, *v_init, body, **_):
    """A device loop (lax.scan / while_loop); a loop with a static trip count whose body
    cannot be traced with a run-time iteration index (a Slice starting at the index, sequences
    that grow) runs unrolled instead, up to UNROLL_LIMIT iterations."""
    if len(body.outputs) < 1 + len(v_init):
        raise ctx.error(f"the body has {len(body.outputs)} output(s); it needs the condition "
                        f"and the {len(v_init)} loop-carried value(s) first")
    try:
        return _loop(ctx, m, cond, *v_init, body=body)
    except (UnsupportedOperatorError, TypeError, ValueError, AttributeError) as e:
        if not (_static_value(m) and int(np.asarray(m).reshape(())) <= UNROLL_LIMIT):
            raise
        ctx.discard_subgraph_traces()
        try:
            return _loop_unrolled(ctx, int(np.asarray(m).reshape(())), cond, list(v_init), body)
        except Exception:
            raise e from None


def _loop_unrolled(ctx: LowerCtx, trips, cond, vals, body):
    n_carry = len(vals)
    c = np.bool_(True) if cond is None else cond
    scans = []
    for i in range(trips):
        if _static_value(c) and not bool(np.asarray(c).reshape(())):
            break
        if not _static_value(c):
            raise ctx.error("an unrolled loop needs a condition known at compile time")
        outs = ctx.run_subgraph(body, [np.int64(i), np.bool_(c)] + vals, iteration=i)
        c, vals = outs[0], list(outs[1:1 + n_carry])
        scans.append(outs[1 + n_carry:])
    n_scan = len(body.outputs) - 1 - n_carry
    if n_scan and not scans:
        raise ctx.error("a loop with scan outputs ran no iteration")
    return vals + [jnp.stack([jnp.asarray(s[k]) for s in scans]) for k in range(n_scan)]


def _loop(ctx: LowerCtx, m=None, cond=None, *v_init, body):
    n_carry = len(v_init)
    n_scan = len(body.outputs) - 1 - n_carry
    v_init = [jnp.asarray(v) for v in v_init]
    static_m = _static_value(m)
    cond_init = True if cond is None else cond
    cond_static_true = _static_value(cond_init) and bool(np.asarray(cond_init).reshape(()))

    def step(i, c, vals):
        outs, record = ctx.run_body(body, [jnp.asarray(i, jnp.int64), jnp.asarray(c, bool)] + list(vals),
                                    iteration=i)
        new = [jnp.asarray(o).astype(v.dtype) for o, v in zip(outs[1:1 + n_carry], vals)]
        for o, v in zip(new, vals):
            if o.shape != v.shape:
                raise ctx.error(f"loop-carried value changes shape from {v.shape} to {o.shape} "
                                f"across iterations; only fixed shapes are supported")
        scans = [jnp.asarray(o) for o in outs[1 + n_carry:]]
        return jnp.asarray(outs[0], bool).reshape(()), new, scans, record

    if static_m:
        trips = int(np.asarray(m).reshape(()))
        exact = cond_static_true and _cond_passthrough(body)
        if n_scan and not exact:
            raise ctx.error("scan outputs need a trip count known at compile time: the "
                            "condition must be known at compile time and passed through "
                            "the body unchanged, but this loop's is computed at run time")

        def scan_body(carry, i):
            c, vals = carry
            c2, new, scans, record = step(i, c, vals)
            if exact:
                return (c2, new), (scans, record)
            keep = c  # once the condition is false the remaining iterations do nothing
            new = [jnp.where(keep, a, b) for a, b in zip(new, vals)]
            return (jnp.where(keep, c2, c), new), (scans, jnp.where(keep, record, 0))
        (c_fin, vals), (scans, records) = lax.scan(
            scan_body, (jnp.asarray(cond_init, bool).reshape(()), v_init),
            jnp.arange(trips, dtype=jnp.int64))
        ctx.check_record(records)   # the body's run-time checks, every iteration
        return list(vals) + list(scans)
    if n_scan:
        raise ctx.error("scan outputs need a trip count: input M must be known at compile "
                        "time, but it is absent or computed at run time")
    trips = None if m is None else jnp.asarray(m, jnp.int64).reshape(())

    def w_cond(carry):
        i, c, _v, _failed = carry
        return c if trips is None else c & (i < trips)

    def w_body(carry):
        i, c, vals, failed = carry
        c2, new, _s, record = step(i, c, vals)
        return i + 1, c2, new, jnp.where(failed[0] != 0, failed, record)   # the first failure
    _i, _c, vals, failed = lax.while_loop(w_cond, w_body, (
        jnp.int64(0), jnp.asarray(cond_init, bool).reshape(()), v_init,
        jnp.zeros(CHECK_RECORD_SIZE, jnp.int64)))
    ctx.check_record(failed)
    return list(vals)


def _scan_core(ctx: LowerCtx, body, states, xs, n_out_scan, in_axes, in_dirs, out_axes, out_dirs,
               concat=False):
    """With ``concat`` PopART's ScanOp: a rank-1 scan input is sliced to shape [1], not a
    scalar (scan.cpp:304-313), and the scan outputs concatenate (scan.cpp:97-105)."""
    xs = [jnp.moveaxis(jnp.asarray(x), a % jnp.ndim(x), 0) for x, a in zip(xs, in_axes)]
    if concat:
        xs = [x[:, None] if x.ndim == 1 else x for x in xs]
    xs = [jnp.flip(x, 0) if d else x for x, d in zip(xs, in_dirs)]
    states = [jnp.asarray(s) for s in states]

    def f(carry, xs_i):
        i, sl = xs_i
        outs, record = ctx.run_body(body, list(carry) + list(sl), iteration=i)
        new = [jnp.asarray(o).astype(c.dtype) for o, c in zip(outs, carry)]
        return new, ([jnp.asarray(o) for o in outs[len(carry):]], record)
    n = xs[0].shape[0] if xs else 0
    fin, (ys, records) = lax.scan(f, states, (jnp.arange(n), xs), length=n)
    ys = [jnp.flip(y, 0) if d else y for y, d in zip(ys, out_dirs)]
    if concat:   # PopART's ScanOp: each iteration's output is a block along its axis
        ys = [_concat_blocks(y, a) for y, a in zip(ys, out_axes)]
    else:
        ys = [jnp.moveaxis(y, 0, a % y.ndim) for y, a in zip(ys, out_axes)]
    return list(fin) + ys, records   # records: for ctx.check_record


def _concat_blocks(y, axis):
    """[n, *s] -> s with s[axis] * n, the n blocks in order along ``axis`` (of s's rank)."""
    if y.ndim == 1:
        return y
    a = axis % (y.ndim - 1)
    y = jnp.moveaxis(y, 0, a)
    return y.reshape(y.shape[:a] + (y.shape[a] * y.shape[a + 1],) + y.shape[a + 2:])


@register("Scan", since=9)
def scan(ctx: LowerCtx, *ins, body, num_scan_inputs, scan_input_axes=None, scan_input_directions=None,
         scan_output_axes=None, scan_output_directions=None, **_):
    """ONNX's Scan; in a PopART session PopART's ScanOp, whose scan outputs concatenate each
    iteration's output along its axis (the body output's rank, that axis times the trip count)
    instead of stacking them on a new one."""
    n_state = len(ins) - num_scan_inputs
    n_out_scan = len(body.outputs) - n_state
    outs, records = _scan_core(ctx, body, ins[:n_state], ins[n_state:], n_out_scan,
                               scan_input_axes or [0] * num_scan_inputs,
                               scan_input_directions or [0] * num_scan_inputs,
                               scan_output_axes or [0] * n_out_scan,
                               scan_output_directions or [0] * n_out_scan,
                               concat=not onnx_semantics(ctx))
    ctx.check_record(records)
    return outs


@register("Scan", since=8)
def scan8(ctx: LowerCtx, seq_lens, *ins, body, num_scan_inputs, directions=None, **_):
    """Scan-8: every input has a leading batch axis; scan axis 1."""
    n_state = len(ins) - num_scan_inputs
    n_out_scan = len(body.outputs) - n_state
    seq = ins[n_state].shape[1] if num_scan_inputs else 0
    if seq_lens is not None:
        if not _static_value(seq_lens) or (np.asarray(seq_lens) != seq).any():
            raise ctx.error("Scan-8 sequence_lens shorter than the sequence are not supported")
    dirs = directions or [0] * num_scan_inputs

    def one(*args):
        return _scan_core(ctx, body, args[:n_state], args[n_state:], n_out_scan,
                          [0] * num_scan_inputs, dirs, [0] * n_out_scan, [0] * n_out_scan)
    outs, records = jax.vmap(one)(*[jnp.asarray(x) for x in ins])
    ctx.check_record(records)
    return list(outs)


@register("Call", domain=GRAPHCORE_DOMAIN)
def call(ctx: LowerCtx, *ins, callee, **_):
    """The callee on the inputs, bound by position. A Call of an ONNX model (a PopART
    session) gives the callee its inputs' tensor infos (call.cpp:285-293); popxl's callee
    inputs keep theirs, which must match (CallOp::setup; dimensions the callee leaves unknown
    match any)."""
    from ..engine.lower import info_text
    from ..errors import ModelError
    from ..tensorinfo import to_datatype
    for i, (x, tid) in enumerate(zip(ins, callee.inputs if onnx_semantics(ctx) else ())):
        info = callee.tensor_info.get(tid)
        if info is None or info._shape is None or not hasattr(x, "dtype"):
            continue
        dtype, shape = to_datatype(np.dtype(x.dtype)).name, list(np.shape(x))
        if dtype != info.data_type() or len(shape) != len(info._shape) or any(
                d not in (-1, s) for d, s in zip(info._shape, shape)):
            raise noted(ModelError(
                f"CallOp input (@{i}) does not match callee input tensor (@{i}):\n"
                f"   {ctx.input_ids[i]} -> {tid}\n"
                f"   {info_text(dtype, shape)} vs {info_text(info.data_type(), info._shape)}"),
                f"Call node '{ctx.name}': subgraph '{callee.name}' declares input '{tid}' as "
                f"{info.data_type()} {list(info._shape)}; it is given {dtype} {shape}")
    return list(ctx.run_subgraph(callee, list(ins)))
