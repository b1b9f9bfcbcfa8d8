"""ai.onnx DeformConv built with popart.Builder and run through an InferenceSession, against
ONNX's reference evaluator (2-D); 3-D against 2-D slice by slice; gradients with respect to
every input against central differences (float64); errors for inconsistent shapes."""
import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

import jax
import jax.numpy as jnp

import popart
from popart.engine.lower import TraceState, execute
from popart.ir.onnx_import import import_model

from one_op import build, run_session

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

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
def test_deform_conv_matches_reference(kw):
    inputs, attrs = case(**kw)
    proto, feeds, outs = build("DeformConv", inputs, opset=22, **attrs)
    (got,) = run_session(proto, feeds, outs)
    (exp,) = ReferenceEvaluator(proto).run(None, feeds)
    assert got.shape == exp.shape and got.dtype == exp.dtype
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)


def test_deform_conv_3d_with_unit_depth_kernel_is_2d_per_slice():
    """A 3-D DeformConv whose kernel and offsets are flat along depth is the 2-D one on
    each depth slice."""
    (x2, w2, off2, b, m), attrs = case(n=1, c=2, oc=3, hw=(4, 5), mask=True, bias=True)
    d = 3
    x = rnd(1, 2, d, 4, 5)
    off = rnd(1, 4, 2, d, *off2.shape[2:], scale=1.5)              # (h, w) per tap and slice
    mask = RNG.uniform(0, 1, (1, 4, d, *off2.shape[2:])).astype(np.float32)
    off3 = np.concatenate([np.zeros_like(off[:, :, :1]), off], 2).reshape(1, 12, d, 3, 4)
    proto, feeds, outs = build("DeformConv", [x, w2[:, :, None], off3, b, mask], opset=22,
                               kernel_shape=[1, 2, 2])
    (got,) = run_session(proto, feeds, outs)
    for z in range(d):
        slice_inputs = [x[:, :, z], w2, off[:, :, :, z].reshape(1, 8, 3, 4), b, mask[:, :, z]]
        proto2, feeds2, _ = build("DeformConv", slice_inputs, opset=22, **attrs)
        (exp,) = ReferenceEvaluator(proto2).run(None, feeds2)
        np.testing.assert_allclose(got[:, :, z], exp, rtol=1e-5, atol=1e-5)


def test_deform_conv_gradients_match_central_differences():
    inputs, attrs = case(n=1, c=4, oc=2, group=2, offset_group=2, pads=(1, 1, 1, 1),
                         strides=(2, 1), mask=True, bias=True)
    inputs = [x.astype(np.float64) for x in inputs]
    proto, feeds, (out,) = build("DeformConv", inputs, opset=22, **attrs)
    graph, _ = import_model(proto)
    ids = list(feeds)
    r = RNG.standard_normal(np.shape(execute(graph, feeds, TraceState())[out]))

    @jax.jit
    def loss(*vals):
        return jnp.sum(execute(graph, dict(zip(ids, vals)), TraceState())[out] * r)
    grads = jax.grad(loss, argnums=tuple(range(len(ids))))(*inputs)
    eps = 1e-6
    for a, (x0, g) in enumerate(zip(inputs, grads)):   # X, W, offset, B, mask
        flat = x0.reshape(-1)
        for i in RNG.choice(flat.size, min(flat.size, 6), replace=False):
            d = np.zeros_like(flat)
            d[i] = eps
            moved = [inputs[:a] + [(flat + s * d).reshape(x0.shape)] + inputs[a + 1:]
                     for s in (1, -1)]
            num = (float(loss(*moved[0])) - float(loss(*moved[1]))) / (2 * eps)
            np.testing.assert_allclose(np.asarray(g).reshape(-1)[i], num, rtol=1e-6, atol=1e-8,
                                       err_msg=f"input {ids[a]}, element {i}")


def test_bad_offset_shape_raises_clear_error():
    (x, w, off, _, _), attrs = case()
    with pytest.raises(popart.popart_exception,
                       match=r"DeformConv.*'offset' must have shape .* = \(1, 8, 3, 4\), "
                             r"got \(1, 6, 3, 4\)"):
        run_session(*build("DeformConv", [x, w, off[:, :6]], opset=22, **attrs))
    with pytest.raises(popart.popart_exception, match=r"DeformConv.*divisible by offset_group=3"):
        run_session(*build("DeformConv", [x, w, off], opset=22, offset_group=3))
