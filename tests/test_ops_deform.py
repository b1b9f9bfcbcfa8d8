"""ai.onnx DeformConv run by the op tester, against ONNX's reference evaluator (2-D); 3-D
against 2-D slice by slice; gradients with respect to every input (a TrainingSession, float64)
against central differences; errors for inconsistent shapes."""
import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import popart

from op_tester import one_op

OPSETS = {"ai.onnx": 22}
RNG = np.random.default_rng(11)


def rnd(*shape, scale=1.0, dtype=np.float32):
    return (scale * RNG.standard_normal(shape)).astype(dtype)


def case(n=1, c=2, oc=3, hw=(4, 5), k=(2, 2), pads=(0, 0, 0, 0), strides=(1, 1),
         dilations=(1, 1), group=1, offset_group=1, bias=False, mask=False):
    """Random inputs [X, W, offset, B, mask] and attributes; offsets of about +-1.5 pixels
    so samples fall between pixels and outside the image."""
    eff = [(kk - 1) * d + 1 for kk, d in zip(k, dilations)]
    out = [(i + pads[a] + pads[a + 2] - e) // s + 1
           for a, (i, e, s) in enumerate(zip(hw, eff, strides))]
    kk = k[0] * k[1]
    inputs = [rnd(n, c, *hw), rnd(oc, c // group, *k), rnd(n, offset_group * kk * 2, *out, scale=1.5),
              rnd(oc) if bias else None,
              RNG.uniform(0, 1, (n, offset_group * kk, *out)).astype(np.float32) if mask else None]
    attrs = dict(kernel_shape=list(k), pads=list(pads), strides=list(strides),
                 dilations=list(dilations), group=group, offset_group=offset_group)
    return inputs, attrs


@pytest.mark.parametrize("kw", [
    {},
    dict(pads=(1, 1, 1, 1)),
    dict(pads=(1, 0, 0, 2), strides=(2, 1)),
    dict(k=(3, 2), dilations=(1, 2), pads=(1, 1, 1, 1)),
    dict(c=4, oc=2, group=2),
    dict(c=4, offset_group=2, mask=True),
    dict(mask=True, bias=True),
    dict(n=2, c=4, oc=4, group=2, offset_group=2, strides=(2, 2), pads=(1, 1, 1, 1),
         dilations=(2, 1), mask=True, bias=True),
])
def test_deform_conv_matches_reference(op_tester, kw):
    inputs, attrs = case(**kw)
    op_tester.run(one_op("DeformConv", inputs, **attrs), lambda ref: ref.onnx_reference(), opsets=OPSETS,
                  rtol=1e-5, atol=1e-5)


def test_deform_conv_3d_with_unit_depth_kernel_is_2d_per_slice(op_tester):
    """A 3-D DeformConv whose kernel and offsets are flat along depth is the 2-D one on
    each depth slice."""
    (x2, w2, off2, b, m), attrs = case(n=1, c=2, oc=3, hw=(4, 5), mask=True, bias=True)
    d = 3
    x = rnd(1, 2, d, 4, 5)
    off = rnd(1, 4, 2, d, *off2.shape[2:], scale=1.5)              # (h, w) per tap and slice
    mask = RNG.uniform(0, 1, (1, 4, d, *off2.shape[2:])).astype(np.float32)
    off3 = np.concatenate([np.zeros_like(off[:, :, :1]), off], 2).reshape(1, 12, d, 3, 4)

    def reference(ref):
        node = helper.make_node("DeformConv", ["X", "W", "offset", "B", "mask"], ["Y"], **attrs)
        ev = ReferenceEvaluator(node)
        slices = [ev.run(None, {"X": x[:, :, z], "W": w2, "B": b, "mask": mask[:, :, z],
                                "offset": off[:, :, :, z].reshape(1, 8, 3, 4)})[0]
                  for z in range(d)]
        return [np.stack(slices, 2)]

    op_tester.run(one_op("DeformConv", [x, w2[:, :, None], off3, b, mask], kernel_shape=[1, 2, 2]),
                  reference, opsets=OPSETS, rtol=1e-5, atol=1e-5)


def test_deform_conv_gradients_match_central_differences(op_tester):
    inputs, attrs = case(n=1, c=4, oc=2, group=2, offset_group=2, pads=(1, 1, 1, 1),
                         strides=(2, 1), mask=True, bias=True)
    inputs = [x.astype(np.float64) for x in inputs]

    def reference(ref):   # the gradients of X, W, offset, B, mask
        return [None] + [ref.numeric_grad(i) for i in ref.inputs]

    op_tester.run(one_op("DeformConv", inputs, grads=True, **attrs), reference, step_type="train",
                  opsets=OPSETS, rtol=1e-6, atol=1e-8)


def test_bad_offset_shape_raises_clear_error(op_tester):
    (x, w, off, _, _), attrs = case()
    with pytest.raises(popart.popart_exception,
                       match=r"DeformConv.*'offset' must have shape .* = \(1, 8, 3, 4\), "
                             r"got \(1, 6, 3, 4\)"):
        op_tester.run(one_op("DeformConv", [x, w, off[:, :6]], **attrs), None, opsets=OPSETS)
    with pytest.raises(popart.popart_exception, match=r"DeformConv.*divisible by offset_group=3"):
        op_tester.run(one_op("DeformConv", [x, w, off], offset_group=3), None, opsets=OPSETS)
