"""Object-detection ops of ai.onnx: NonMaxSuppression.

The greedy selection runs as a fixed-size computation (a ``lax.scan`` over the boxes in score
order, per batch and class), which works on device. Its result, though, is a list of selected
[batch, class, box] triples whose length depends on the data: XLA programs have static shapes,
so on run-time inputs the node runs on the host between compiled segments
(engine/segments.py); known when the program is compiled, it folds into the program."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .registry import LowerCtx, is_static, register
from .shape import shape_deciding


def _corners(boxes, center_point_box):
    """[.., 4] boxes as (x_min, x_max, y_min, y_max)."""
    if center_point_box:
        xc, yc, w, h = (boxes[..., i] for i in range(4))
        return xc - w / 2, xc + w / 2, yc - h / 2, yc + h / 2
    y1, x1, y2, x2 = (boxes[..., i] for i in range(4))
    return jnp.minimum(x1, x2), jnp.maximum(x1, x2), jnp.minimum(y1, y2), jnp.maximum(y1, y2)


def suppresses(boxes, center_point_box, iou_threshold):
    """[N, N]: box i suppresses box j (IoU > threshold, both areas and the union positive)."""
    x0, x1, y0, y1 = _corners(boxes, center_point_box)
    iw = jnp.minimum(x1[:, None], x1[None]) - jnp.maximum(x0[:, None], x0[None])
    ih = jnp.minimum(y1[:, None], y1[None]) - jnp.maximum(y0[:, None], y0[None])
    inter = iw * ih
    area = (x1 - x0) * (y1 - y0)
    union = area[:, None] + area[None] - inter
    ok = (iw > 0) & (ih > 0) & (inter > 0) & (area[:, None] > 0) & (area[None] > 0) & (union > 0)
    return ok & (inter / jnp.where(ok, union, 1) > iou_threshold)


def select_padded(boxes, scores, max_out, iou_threshold, score_threshold, center_point_box,
                  valid=None):
    """Greedy NMS of one batch: boxes [N, 4], scores [C, N] -> (order [C, N], selected [C, N]):
    boxes in descending score order (ties: lower index first) and whether each is selected;
    only the first ``valid`` boxes (default all) may be selected."""
    sup = suppresses(boxes, center_point_box, iou_threshold)

    def one_class(s):
        order = jnp.argsort(-s, stable=True)
        cand = s > score_threshold if score_threshold is not None else jnp.ones_like(s, bool)
        if valid is not None:
            cand = cand & (jnp.arange(s.shape[0]) < valid)

        def step(carry, i):
            chosen, count = carry
            take = cand[i] & (count < max_out) & ~jnp.any(chosen & sup[:, i])
            return (chosen.at[i].set(take), count + take), take
        _, taken = lax.scan(step, (jnp.zeros(s.shape, bool), jnp.zeros((), jnp.int64)), order)
        return order, taken
    return jax.vmap(one_class)(scores)


# jitted: on the host (values known, engine/segments.py) one compiled call per shape, not
# the scan's steps dispatched one by one; inside a traced program it is inlined
_select_batches = jax.jit(jax.vmap(select_padded, (0, 0, None, None, None, None, None)),
                          static_argnums=(5,))


def _bucketed(boxes, scores) -> tuple:
    """Host values padded to a power-of-two number of boxes (zero boxes, zero scores), so
    that the jitted selection compiles once per bucket, not once per count; and the count."""
    n = boxes.shape[1]
    pad = (1 << max(n - 1, 1).bit_length()) - n
    return (np.pad(boxes, ((0, 0), (0, pad), (0, 0))), np.pad(scores, ((0, 0), (0, 0), (0, pad))),
            np.int64(n))


@register("NonMaxSuppression", since=10, data_dependent=(0, 1, 2, 3, 4))
def non_max_suppression(ctx: LowerCtx, boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                        score_threshold=None, center_point_box=0, **_):
    if center_point_box not in (0, 1):
        raise ctx.error(f"center_point_box must be 0 or 1, got {center_point_box}")
    if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3 or \
            scores.shape[0] != boxes.shape[0] or scores.shape[2] != boxes.shape[1]:
        raise ctx.error(f"boxes {list(boxes.shape)} and scores {list(scores.shape)} must be "
                        f"[B, N, 4] and [B, C, N]")
    if boxes.shape[1] == 0 or scores.shape[1] == 0:   # no boxes or no classes: none selected
        return np.zeros((0, 3), np.int64)
    m = 0 if max_output_boxes_per_class is None or np.size(max_output_boxes_per_class) == 0 \
        else max_output_boxes_per_class
    iou = 0.0 if iou_threshold is None or np.size(iou_threshold) == 0 else iou_threshold
    st = None if score_threshold is None or np.size(score_threshold) == 0 else score_threshold
    boxes, scores, valid = _bucketed(boxes, scores) if is_static(boxes) and is_static(scores) \
        else (boxes, scores, None)
    order, taken = _select_batches(boxes, scores, jnp.reshape(m, ()), jnp.reshape(iou, ()),
                                   None if st is None else jnp.reshape(st, ()), center_point_box,
                                   valid)
    why = "the boxes, scores and thresholds"
    order, taken = shape_deciding(ctx, order, why), shape_deciding(ctx, taken, why)
    b, c, k = np.nonzero(taken)   # row-major: batch, class, then selection order
    return np.stack([b, c, order[b, c, k]], 1).astype(np.int64).reshape(-1, 3)
