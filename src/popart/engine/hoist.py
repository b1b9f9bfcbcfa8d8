"""Weight hoisting for inference: what a step computes from its weights alone (an exporter's
Transpose or Reshape of a weight, oneDNN's packed weights) runs once per weights version, not on
every run.

An inference step returns its weights as they came, and between ``writeWeights`` calls they are
constants. :class:`HoistedStep` splits the step's jaxpr by JAX's partial evaluation
(``partial_eval_jaxpr_custom``) with the weights known and the feeds, key and hyper-parameters
unknown: the known part, compiled apart (``derive``), maps the weights to the residuals the rest
reads; the step takes them as an extra argument. Partial evaluation of the whole traced step
was chosen over a request each lowering makes: it finds every weight-only chain (inside the
scan over batches too: JAX hoists loop-invariant residuals), with no lowering changed, and the
same policy decides for all of them.

Memory guard: a value is kept as a residual only where it is no larger than its largest input
and than the weights it derives from (plus 25% and 4 KiB: oneDNN's padded packed layouts);
anything that grows (a broadcast of a weight, a constant made from nothing) is recomputed in the
step, and the whole split is dropped when the residuals exceed ``POPART_HOIST_BYTES`` (default
1.25x the weights + 64 MiB). The residuals are
cached by the identity of the weight arrays (immutable JAX arrays): a run whose weights are the
arrays the step last returned reuses them; ``writeWeights``, ``resetHostWeights`` and a loaded
executable give new arrays, and the next run derives again.

Not hoisted (the plain step): training, replicated or placed programs, a step from a serialized
executable or the engine cache (its module is the plain step, what ``export`` writes),
effectful steps, ``POPART_HOIST=0``."""
from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.extend import core as jcore
from jax._src.interpreters import partial_eval as pe   # partial_eval_jaxpr_custom: not public in jax 0.10

from ..logging import getLogger
from . import onednn
from .compiled import CompiledStep

_logger = getLogger("devicex")
# the default cap on all residuals is this many times the weights (+ 64 MiB); each residual
# obeys onednn.fits (at most a pack's padding over what it derives from)
GROWTH = onednn.PACK_GROWTH


def wanted(training: bool, replication_factor: int) -> bool:
    """Whether a step of this kind is hoisted (inference, one replica, not switched off)."""
    on = os.environ.get("POPART_HOIST", "1") not in ("0", "false", "off", "")
    return on and not training and replication_factor == 1


def _nbytes(aval: Any) -> int:
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return int(np.prod(shape)) * (getattr(dtype, "itemsize", None) or 8)   # keys: extended dtypes


def _saveable(forbidden: set, prim: Any, *avals: Any, **params: Any) -> bool:
    """The memory guard: whether a weight-only value may be a residual (else recomputed): not
    larger than its largest input, nor of a shape in ``forbidden``."""
    try:
        out = prim.abstract_eval(*avals, **params)
    except Exception:  # noqa: BLE001 - a primitive we cannot size stays in the step
        return False
    out = out[0] if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (set, frozenset)) else out
    outs = out if isinstance(out, (list, tuple)) else [out]
    if any((getattr(a, "shape", None), getattr(a, "dtype", None)) in forbidden for a in outs):
        return False
    largest = max((_nbytes(a) for a in avals), default=0)
    return largest > 0 and onednn.fits(sum(map(_nbytes, outs)), largest)


@dataclass
class Split:
    """A step split in two: ``derive(*weight_leaves) -> residuals`` and ``step(*args,
    residuals)``, with the residuals' ShapeDtypeStructs."""
    derive: Callable
    step: Callable
    res_specs: tuple


def split(fn: Callable, specs: Sequence[Any], cap: Optional[int] = None) -> Optional[Split]:
    """``fn(weights, *rest)`` split by partial evaluation with ``weights`` (the first argument)
    known, traced for ``specs`` with oneDNN's packed weights on; None when nothing is worth
    hoisting or the residuals exceed ``cap`` bytes."""
    with onednn.packing():
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*specs)
    if closed.effects:
        return None
    consts = list(closed.consts)
    # the constants (constantWeights) first; dead code dropped (a value a later lowering
    # replaced, such as a convolution before its fusion, would otherwise leave a residual)
    jaxpr = pe.dce_jaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), [True] * len(closed.jaxpr.outvars),
                         instantiate=True)[0]
    n_k = len(consts) + len(jax.tree_util.tree_leaves(specs[0]))
    unknowns = [False] * n_k + [True] * (len(jaxpr.invars) - n_k)
    source = [_nbytes(v.aval) for v in jaxpr.invars[:n_k]]
    # A residual may not outgrow the weights it derives from; one that does (grown by a step
    # recomputed in the step, then reshaped) has its shape forbidden and the split is redone.
    forbidden: set = set()
    for _ in range(4):
        known, staged, _, _, n_res = pe.partial_eval_jaxpr_custom(
            jaxpr, unknowns, True, False, True, functools.partial(_saveable, frozenset(forbidden)))
        res = known.outvars[len(known.outvars) - n_res:]
        big = {(v.aval.shape, v.aval.dtype) for v in res if not onednn.fits(_nbytes(v.aval), sum(
            b for b, used in zip(source, pe.dce_jaxpr(known.replace(outvars=[v]), [True])[1]) if used))}
        if not big:
            break
        forbidden |= big
    else:
        return None
    if n_res == 0:
        return None
    res_avals = [v.aval for v in res]
    w_bytes = sum(source)
    cap = cap if cap is not None else int(os.environ.get("POPART_HOIST_BYTES", GROWTH * w_bytes + (64 << 20)))
    res_bytes = sum(map(_nbytes, res_avals))
    if res_bytes > cap:
        _logger.info(f"weight hoisting: {res_bytes} bytes of residuals over the cap {cap}; not hoisted")
        return None
    known = pe.dce_jaxpr(known.replace(outvars=res), [True] * n_res, instantiate=True)[0]
    out_tree = jax.tree_util.tree_structure(out_shape)

    def derive(*weights):
        return tuple(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(known, []))(*consts, *weights))

    def step(*args):
        *args, res = args
        outs = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(staged, []))(*res, *consts, *jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(out_tree, outs)

    # the plain step's argument names (the report names XLA's parameters by them), then the residuals'
    sig = inspect.signature(fn)
    step.__signature__ = sig.replace(parameters=[*sig.parameters.values(), inspect.Parameter(
        "hoisted", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
    _logger.info(f"weight hoisting: {n_res} residuals, {res_bytes} bytes")
    return Split(jax.jit(derive), step, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in res_avals))


class HoistedStep(CompiledStep):
    """An inference step (``fn(weights, ...)`` returning its weights first, unchanged) compiled
    with its weight-only work split out (:func:`split`); called as the plain step."""

    def __init__(self, fn: Callable, in_shardings: Sequence[Any], out_shardings: Any,
                 donate_argnums: Sequence[int] = ()) -> None:
        super().__init__(fn, in_shardings, out_shardings, donate_argnums)
        self.plain = CompiledStep(fn, in_shardings, out_shardings, donate_argnums)
        self.derive: Optional[Callable] = None
        self.res_specs: tuple = ()
        self._cache: Optional[tuple] = None   # (weight leaves the residuals are of, residuals)

    def compile(self, specs: Sequence[Any], exported: Optional[bytes] = None) -> None:
        """As :meth:`CompiledStep.compile`, hoisted when compiled from the step function."""
        try:
            parts = split(self.plain.fn, specs) if exported is None else None
        except Exception as e:  # noqa: BLE001 - an optimisation: the plain step (whose trace
            parts = None        # raises a lowering's error again, as the plain step would)
            _logger.info(f"weight hoisting skipped: {type(e).__name__}: {str(e)[:200]}")
        if parts is None:
            self.fn, self.derive = self.plain.fn, None
            return super().compile(specs, exported)
        self.fn, self.derive, self.res_specs = parts.step, parts.derive, parts.res_specs
        args = self.plain._jit_args
        self._jit_args = {**args, "in_shardings": (*args["in_shardings"], args["in_shardings"][-1])}
        super().compile((*specs, self.res_specs))
        self._specs = tuple(specs)   # what export() traces: the plain step

    def export(self, specs: Optional[Sequence[Any]] = None) -> bytes:
        """The plain step's module (a program loaded from it runs unhoisted)."""
        return self.plain.export(self._specs if specs is None else specs)

    def residuals(self, weights: Any) -> tuple:
        """The residuals of ``weights``: cached while they are the arrays last seen."""
        leaves = jax.tree_util.tree_leaves(weights)
        seen, res = self._cache or (None, None)
        if seen is None or len(seen) != len(leaves) or any(a is not b for a, b in zip(seen, leaves)):
            res = self.derive(*leaves)
            self._cache = (leaves, res)
        return res

    def __call__(self, *args: Any) -> Any:
        if self.derive is None:
            return super().__call__(*args)
        res = self.residuals(args[0])
        out = super().__call__(*args, res)
        self._cache = (jax.tree_util.tree_leaves(out[0]), res)   # the weights as they came
        return out
