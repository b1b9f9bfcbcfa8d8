"""InferenceSession runs of a graph cut by data-dependent output shapes.

Where a NonZero, Unique, Compress or NonMaxSuppression node meets run-time values, the graph
cannot be one XLA program (static shapes): ``engine/segments.py`` runs it as compiled
segments with those nodes on the host between them, each segment compiled once per shape
signature. :class:`SegmentedRuns`, mixed into InferenceSession, sends ``prepareDevice``,
``initAnchorArrays`` and ``run`` there for such graphs, and to the session's one compiled
program for every other graph (unchanged). A run does its ``batchesPerStep`` x replicas
micro-batches one after another (each may have its own shapes); an anchor whose shape
depends on the data comes back, in the StepIO's output dict, as the array itself where the
host shape has no batch or replica dimension, else as a list per batch (of lists per
replica). See docs/data_dependent_shapes.md."""
from __future__ import annotations

import itertools
from typing import Any, Optional

import jax
import numpy as np

from . import dataflow as _df
from .engine import x64
from .engine.program import reduce_anchor
from .engine.segments import Segmented, has_data_dependent
from .engine.shapes import input_specs
from .errors import StepIOError, popart_exception
from .logging import getLogger
from .session_config import anchor_returns, engine_config
from .session_io import weights_to_io

_logger = getLogger("session")


class SegmentedRuns:
    """What InferenceSession does for a graph cut by data-dependent shapes (module docstring)."""

    def _segments(self) -> Optional[Segmented]:
        """The graph's segments where it has a cut for the session's input shapes, else None."""
        if "_segmented" not in self.__dict__:
            seg = None
            if has_data_dependent(self._graph):
                with x64():
                    seg = Segmented(self._graph, list(self._dataFlow.anchors()),
                                    config=engine_config(self.options))
                    if not seg.has_cuts(input_specs(self._graph, self._input_infos)):
                        seg = None
            self.__dict__["_segmented"] = seg
        return self.__dict__["_segmented"]

    def _varying(self, anchor: str) -> bool:
        return -1 in self.getInfo(anchor).shape()

    def prepareDevice(self, loadEngine: bool = True) -> None:
        if self._segments() is None:
            return super().prepareDevice(loadEngine)
        with self._lock:
            for a in self._dataFlow.anchors():
                if self._dataFlow.art(a).id() == _df.AnchorReturnTypeId.Sum and self._varying(a):
                    raise popart_exception(
                        f"Anchor '{a}': AnchorReturnType('SUM') cannot sum a tensor whose shape "
                        f"depends on the data (shape {self.getInfo(a).shape()}); use 'ALL', "
                        f"'EVERYN' or 'FINAL'")
            _logger.info(f"'{self.name}': data-dependent shapes: segments compile on first "
                         f"use, one per shape signature (docs/data_dependent_shapes.md)")

    # The weights are the model's, compiled into the segments (an inference session's
    # constantWeights): nothing to copy, readWeights reads the model's; writeWeights refuses.
    def weightsFromHost(self) -> None:
        if self._segments() is None:
            return super().weightsFromHost()

    def weightsToHost(self) -> None:
        if self._segments() is None:
            return super().weightsToHost()

    def readWeights(self, weightsIo: Any) -> None:
        if self._segments() is None:
            return super().readWeights(weightsIo)
        weights_to_io(weightsIo, self._graph.initializers, {})

    def writeWeights(self, weightsIo: Any) -> None:
        if self._segments() is None:
            return super().writeWeights(weightsIo)
        raise popart_exception("writeWeights: a graph with data-dependent output shapes compiles "
                               "its weights in (docs/data_dependent_shapes.md)")

    def initAnchorArrays(self) -> dict:
        """As the session's; an anchor whose shape depends on the data gets an empty array
        (0 for those dimensions), which ``run`` replaces in the StepIO's output dict."""
        if self._segments() is None:
            return super().initAnchorArrays()
        bps, _, R = self._io.factors()
        out = {}
        for a in self._dataFlow.anchors():
            info = self.getInfo(a)
            shape = [max(d, 0) for d in info.shape()] if self._varying(a) else \
                _df.anchor_host_shape(info.shape(), self._dataFlow.art(a), bps, 1, R)
            out[a] = np.zeros(shape, info.np_dtype())
        return out

    def run(self, *args: Any, **kwargs: Any) -> None:
        seg = self._segments()
        if seg is None:
            return super().run(*args, **kwargs)
        stepio = kwargs.get("stepio", args[0] if args else None)
        if isinstance(stepio, str) or isinstance(stepio, _df.PyStepIOCallback):
            raise popart_exception(
                f"run: a graph with data-dependent output shapes runs with a popart.PyStepIO "
                f"(got {type(stepio).__name__}); named programs and PyStepIOCallback are not "
                f"available for it")
        with self._lock, x64():
            feeds = self._io.synthetic() or self._io.gather(stepio)
            bps, _, R = self._io.factors()
            anchors = self._dataFlow.anchors()
            runs = {}
            step = self.__dict__.setdefault("_segmented_runs", itertools.count())
            key = jax.random.fold_in(jax.random.key(0), next(step))
            for b, r in itertools.product(range(bps), range(R)):
                vals = seg({t: v[b, 0, r] for t, v in feeds.items()},
                           jax.random.fold_in(key, b * R + r))
                runs[b, r] = [np.asarray(v) for v in vals]
            if self._io.synthetic() is None:
                for i, a in enumerate(anchors):
                    self._write_anchor(stepio, a, {k: v[i] for k, v in runs.items()}, bps, R)

    def _write_anchor(self, stepio: Any, a: str, vals: dict, bps: int, R: int) -> None:
        """Anchor ``a``'s values per (batch, replica), as its AnchorReturnType returns them."""
        art = self._dataFlow.art(a)
        ret = anchor_returns({a: art})[a]
        outs = stepio.outputs
        if self._varying(a):   # the batches it returns (SUM is refused); size-1 batch /
            batches = np.ravel(reduce_anchor(ret, np.arange(bps).reshape(bps, 1, 1)))
            per = [[vals[b, r] for r in range(R)] if R > 1 else vals[b, 0] for b in batches]
            outs[a] = per if len(per) > 1 else per[0]   # replica levels dropped, as in host shapes
            return
        v = np.stack([np.stack([vals[b, r] for r in range(R)]) for b in range(bps)])[:, None]
        v = reduce_anchor(ret, v)   # [B, 1, R, ...] as the compiled program reduces it
        if a not in outs:
            raise StepIOError(f"Anchor '{a}' has no output array in the StepIO; use "
                              f"session.initAnchorArrays() to create them")
        host = _df.anchor_host_shape(self.getInfo(a).shape(), art, bps, 1, R)
        if not isinstance(outs[a], np.ndarray) or outs[a].size != v.size:
            raise StepIOError(f"Output array for anchor '{a}' has shape {list(np.shape(outs[a]))}; "
                              f"expected {host}")
        np.copyto(outs[a], v.reshape(outs[a].shape), casting="unsafe")
