"""PopART's gradients of elementwise ops (docs/_rows_elementwise.md) at their special points:
ties, zeros, clip boundaries, negative bases, non-finite incoming gradients. Each case takes
the registered lowering's gradient under jax.vjp and compares it with PopART's rule written
out in NumPy, in float32 and float16."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popart
from popart.ops.registry import lookup

pytestmark = pytest.mark.usefixtures("engine_scope")   # drives engine internals directly

F16, F32 = np.float16, np.float32
DTYPES = pytest.mark.parametrize("dt", [F32, F16], ids=["f32", "f16"])
INF, NAN = np.inf, np.nan


class Ctx:
    """The little a lowering reads of its context here."""

    def error(self, msg: str) -> Exception:
        return ValueError(msg)


def vjp(op, xs, g, wrt=None, domain="ai.onnx", version=20, **attrs):
    """Forward output and the gradients of inputs ``wrt`` (default: all) of a registered op."""
    lower = lookup(domain, op, version).lower
    wrt = list(range(len(xs))) if wrt is None else wrt

    def f(*d):
        full = list(xs)
        for i, v in zip(wrt, d):
            full[i] = v
        return lower(Ctx(), *full, **attrs)

    def run(*d):   # jitted, as the engine runs it (one compile instead of one per primitive)
        out, pull = jax.vjp(f, *d)
        return out, pull(g)

    out, grads = jax.jit(run)(*[xs[i] for i in wrt])
    return np.asarray(out), [np.asarray(t) for t in grads]


def a(v, dt):
    return np.array(v, dt)


def unbroadcast(d, shape):
    """``d`` summed back to ``shape`` (numpy broadcasting)."""
    lead = d.ndim - len(shape)
    d = d.sum(tuple(range(lead))) if lead else d
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and d.shape[i] != 1)
    return d.sum(axes, keepdims=True).astype(d.dtype) if axes else d


def check(got, ref, dt, tol=None):
    assert got.dtype == dt, got.dtype
    rtol = tol or (1e-5 if dt == F32 else 2e-3)
    np.testing.assert_allclose(got.astype(np.float64), np.asarray(ref, dt).astype(np.float64),
                               rtol=rtol, atol=1e-7 if dt == F32 else 1e-4)


@pytest.fixture(autouse=True)
def _quiet_numpy():
    with np.errstate(all="ignore"):
        yield


# ---------------------------------------------------------------------------------------
# Max / Min: MaxArgGradOpx / MinArgGradOpx, (sign(x - out) + 1) * g, every tie gets all of g

@DTYPES
@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_ties_and_broadcasting(dt, op):
    x0 = a([[1, 5, 2], [3, 3, INF]], dt)          # (2, 3)
    x1 = a([3, 5, INF], dt)                         # (3,)
    x2 = a([[3, 1, 2]], dt)                         # (1, 3)
    g = a([[1, 2, 3], [4, 5, 6]], dt)
    out, grads = vjp(op, [x0, x1, x2], g)
    fwd = np.maximum if op == "Max" else np.minimum
    ref_out = fwd(fwd(x0, x1), x2)
    np.testing.assert_array_equal(out, ref_out)
    for x, got in zip((x0, x1, x2), grads):
        d = x - ref_out if op == "Max" else ref_out - x
        check(got, unbroadcast((np.sign(d) + dt(1)) * g, x.shape), dt)
    if op == "Max":   # the three-way tie at [1, 0] gives each input the whole gradient
        assert grads[0][1, 0] == 4 and grads[2][0, 0] == 1 + 4 and grads[1][0] == 1 + 4
        assert np.isnan(grads[0][1, 2])               # inf - inf in the mask, as PopART's


# ---------------------------------------------------------------------------------------
# Clip: ClipGradOpx, g * (out != min) * (out != max); OpToIdentity when unbounded

def clip_ref(x, g, lo, hi, dt):
    lo_c, hi_c = (np.float32(np.finfo(F32).min if lo is None else lo),
                  np.float32(np.finfo(F32).max if hi is None else hi))
    if dt == F16:
        lo_c, hi_c = np.clip(lo_c, -65504, 65504), np.clip(hi_c, -65504, 65504)
    out = x
    if lo is not None:
        out = np.maximum(out, dt(lo))
    if hi is not None:
        out = np.minimum(out, dt(hi))
    return out, g * (out != dt(lo_c)).astype(dt) * (out != dt(hi_c)).astype(dt)


@DTYPES
@pytest.mark.parametrize("form", ["attr6", "input13"])
@pytest.mark.parametrize("lo,hi", [(-1.0, 1.0), (1.0, -1.0), (0.0, None)])
def test_clip_boundaries(dt, form, lo, hi):
    big = np.finfo(dt).max
    x = a([-2, -1, 0, 0.5, 1, 3, big, -big], dt)
    g = a([1, 2, 3, 4, 5, 6, 7, 8], dt)
    if form == "attr6":
        attrs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
        out, (gx,) = vjp("Clip", [x], g, version=6, **attrs)
    else:
        bounds = [None if v is None else a(v, dt) for v in (lo, hi)]
        out, (gx,) = vjp("Clip", [x, *bounds], g, wrt=[0], version=13)
    ref_out, ref = clip_ref(x, g, lo, hi, dt)
    np.testing.assert_array_equal(out, ref_out)
    check(gx, ref, dt)
    if (lo, hi) == (0.0, None):   # the absent max is float32's max (65504 for float16)
        assert gx[6] == 0 and gx[2] == 0 and gx[4] == 5


@DTYPES
def test_unbounded_clip_has_the_identity_gradient(dt):
    x = a([-INF, -3, 0, np.finfo(dt).max, INF], dt)
    g = a([1, 2, 3, 4, 5], dt)
    _, (gx,) = vjp("Clip", [x], g, version=6)
    check(gx, g, dt)
    out, (gx,) = vjp("Clip", [x, a(-INF, dt), a(INF, dt)], g, wrt=[0], version=13)
    np.testing.assert_array_equal(out, x)
    check(gx, g, dt)


# ---------------------------------------------------------------------------------------
# Pow: PowArg0GradOpPattern / PowArg1GradOpPattern

@DTYPES
def test_pow_zero_and_negative_bases(dt):
    base = a([0, 0, 0, 0, -2, 2, 4, 0], dt)
    x0 = np.stack([base, base * dt(1.5)])           # (2, 8)
    x1 = a([-1, 0, 2, NAN, 2, 0.5, 0, 0.5], dt)     # (8,), broadcast
    g = np.ones((2, 8), dt)
    g[1, 1] = INF                                    # b == 0: PopART's where gives 0, not inf * 0
    out, (d0, d1) = vjp("Pow", [x0, x1], g)
    ref_out = np.power(x0, x1)
    np.testing.assert_allclose(out, ref_out, rtol=1e-3 if dt == F16 else 1e-6)
    ref0 = np.where(x1 == 0, dt(0), g * (x1 * np.power(x0, x1 - dt(1))))
    guard = (x0 == 0) & ~((x1 < 0) | np.isnan(x1))
    ref1 = g * np.where(guard, dt(0), ref_out * np.log(x0))
    check(d0, ref0, dt, 1e-3 if dt == F16 else 1e-5)
    check(d1, unbroadcast(ref1, x1.shape), dt, 2e-3 if dt == F16 else 1e-5)
    assert d0[0, 1] == 0 and d0[1, 1] == 0 and d1[0] == -INF   # 0^0 and 0^-1


@DTYPES
@pytest.mark.parametrize("e", [2.0, 3.0, 2.5, 0.0])
@pytest.mark.parametrize("eshape", [(), (1, 1, 1)])
def test_pow_scalar_exponent(dt, e, eshape):
    """An exponent of one element (an exporter's initializer: GELU's 3, RMSNorm's 2), known
    only at run time: 2 and 3 multiply (a lax.switch), others go to power; PopART's rules."""
    x0 = a([[-3, -1.5, -0.25, 0, 0.5, 2, INF, -INF], [1, -2, 4, -0.0, 1e-3, 7, NAN, 3]], dt)
    x1 = np.full(eshape, e, dt)
    g = np.broadcast_to(np.linspace(-2, 2, 16).reshape(2, 8),
                        np.broadcast_shapes(x0.shape, eshape)).astype(dt)
    out, (d0, d1) = vjp("Pow", [x0, x1], g)
    ref_out = np.power(x0, x1)
    assert out.shape == ref_out.shape
    np.testing.assert_allclose(out, ref_out, rtol=1e-3 if dt == F16 else 1e-6)
    ref0 = np.where(x1 == 0, dt(0), g * (x1 * np.power(x0, x1 - dt(1))))
    guard = (x0 == 0) & ~((x1 < 0) | np.isnan(x1))
    with np.errstate(invalid="ignore", divide="ignore"):
        ref1 = g * np.where(guard, dt(0), ref_out * np.log(x0))
    check(d0, unbroadcast(ref0, x0.shape), dt, 1e-3 if dt == F16 else 1e-6)
    check(d1, unbroadcast(ref1, x1.shape), dt, 2e-3 if dt == F16 else 1e-5)


# ---------------------------------------------------------------------------------------
# Div: DivArg0GradOpPattern g / b, DivArg1GradOpPattern -((g * a) / (b * b))

@DTYPES
def test_div_zero_and_small_divisors(dt):
    # b * b stays normal: XLA on CPU flushes subnormals to zero, and JAX's (-g * a) * (1 / b^2)
    # differs from PopART's -((g * a) / b^2) beyond rounding only where b^2 is subnormal.
    small = 1e-2
    x0 = a([[1, 0, -3, 2], [2, 0, 0, 1]], dt)
    x1 = a([0, 0, small, -4], dt)
    g = a([[1, 1, 1e-3, 1], [2, 3, 1e-3, 1]], dt)
    out, (d0, d1) = vjp("Div", [x0, x1], g)
    np.testing.assert_array_equal(out, x0 / x1)
    check(d0, unbroadcast(g / x1, x0.shape), dt)
    check(d1, unbroadcast(-((g * x0) / (x1 * x1)), x1.shape), dt)


# ---------------------------------------------------------------------------------------
# Where: WhereXGradOpx / WhereYGradOpx multiply by the cast condition

@DTYPES
def test_where_masks_and_broadcasting(dt):
    cond = np.array([[True, False, True], [False, False, True]])
    x = a([1, 2, 3], dt)
    y = a([[4], [5]], dt)
    g = a([[1, INF, 3], [4, 5, NAN]], dt)
    out, (dx, dy) = vjp("Where", [cond, x, y], g, wrt=[1, 2])
    np.testing.assert_array_equal(out, np.where(cond, x, y))
    c = cond.astype(dt)
    check(dx, unbroadcast(g * c, x.shape), dt)
    check(dy, unbroadcast(g * (1 - c), y.shape), dt)
    assert np.isnan(dx[1]) and np.isnan(dy[1, 0])   # inf * 0 and NaN * 0, as PopART's


# ---------------------------------------------------------------------------------------
# Unary: Relu, Abs, Sign, Log, Sqrt, Reciprocal, Erf

@DTYPES
def test_relu_mask_from_output(dt):
    x = a([-2, -0.0, 0, 1e-2, 3, -1], dt)
    g = a([INF, NAN, 1, 2, 3, 4], dt)
    out, (gx,) = vjp("Relu", [x], g)
    np.testing.assert_array_equal(out, np.maximum(x, 0))
    check(gx, g * (np.maximum(x, 0) > 0).astype(dt), dt)
    assert np.isnan(gx[0]) and gx[2] == 0


@DTYPES
def test_abs_sign_at_zero(dt):
    x = a([-2, -0.0, 0, 3], dt)
    g = a([1, 2, 3, 4], dt)
    _, (gx,) = vjp("Abs", [x], g)
    check(gx, g * np.sign(x), dt)
    _, (gs,) = vjp("Sign", [x], a([INF, NAN, 1, 2], dt))     # UnaryZeroGradOp: zeros
    np.testing.assert_array_equal(gs, np.zeros(4, dt))


@DTYPES
def test_log_sqrt_reciprocal_at_zero(dt):
    x = a([0, -0.0, 0.5, 4, -1], dt)
    g = a([1, 1, 2, 3, 1], dt)
    _, (gl,) = vjp("Log", [x], g)
    check(gl, g / x, dt)                                     # LogGradOpPattern
    xs, gs = a([0, 0, 0.25, 4], dt), a([0, 1, 2, 3], dt)
    _, (gq,) = vjp("Sqrt", [xs], gs)
    check(gq, gs / (dt(2) * np.sqrt(xs)), dt)                # SqrtGradOpPattern
    _, (gr,) = vjp("Reciprocal", [x], g)
    check(gr, -(dt(1) / (x * x)) * g, dt)                    # ReciprocalGradOpPattern


@DTYPES
def test_erf(dt):
    x = a([0, 1, -1, 2.5, -3, 4], dt)
    g = a([1, 2, 3, 4, 5, 6], dt)
    _, (gx,) = vjp("Erf", [x], g)
    check(gx, (np.exp(-(x * x)) * dt(1.1283791671)) * g, dt)   # ErfxGradOpx


# ---------------------------------------------------------------------------------------
# ai.graphcore Atan2 (Atan2Arg0/1GradOpPattern), Gelu, GeluErf; ai.onnx Gelu-20

@DTYPES
def test_atan2(dt):
    y = a([[0, 1, -1, 0], [2, 0, -0.5, 3]], dt)
    x = a([0, 0, 2, -3], dt)
    g = a([[1, 2, 3, 4], [5, 6, 7, 8]], dt)
    _, (dy, dx) = vjp("Atan2", [y, x], g, domain="ai.graphcore", version=1)
    den = x * x + y * y
    den = np.where(den == 0, 1, den).astype(dt)   # 0 at the origin, as PyTorch's rule
    check(dy, g * (x / den), dt)
    check(dx, unbroadcast(g * -(y / den), x.shape), dt)


def gelu_tanh_rule(x, dt):
    """popnn GELU gradient as the IPU codelets compute it (clamped, tanh CDF + Gaussian pdf)."""
    lim = 6.0 if dt == F16 else 12.0
    xc = np.clip(x.astype(F32), -lim, lim)
    alpha, beta = F32(0.7978845608), F32(0.044715)
    d = 0.5 * (1 + np.tanh(alpha * (xc + beta * xc ** 3)) + alpha * xc * np.exp(-0.5 * xc * xc))
    return d.astype(dt)


def gelu_erf_rule(x, dt):
    """popnn GELU_ERF gradient (float32, then the input's type)."""
    y = x.astype(F32) * F32(0.7071067811865475)
    erf = np.vectorize(math.erf)(y).astype(F32)
    return (0.5 * (1 + erf + y * F32(1.1283791670955126) * np.exp(-y * y))).astype(dt)


@DTYPES
@pytest.mark.parametrize("which", ["graphcore Gelu", "onnx tanh", "graphcore GeluErf", "onnx none"])
def test_gelu(dt, which):
    x = a([-200, -20, -7, -3, -1, 0, 0.5, 1, 2, 6.5, 13, 20, 200], dt)   # f16 autodiff: NaN at 200
    g = np.arange(1, 14).astype(dt) / dt(4)
    if which.startswith("graphcore"):
        out, (gx,) = vjp(which.split()[1], [x], g, domain="ai.graphcore", version=1)
    else:
        out, (gx,) = vjp("Gelu", [x], g, approximate=which.split()[1])
    tanh = which in ("graphcore Gelu", "onnx tanh")
    np.testing.assert_array_equal(out, np.asarray(jax.nn.gelu(x, approximate=tanh)))
    rule = gelu_tanh_rule if tanh else gelu_erf_rule
    check(gx, g * rule(x, dt), dt, None if tanh else (1e-5 if dt == F32 else 3e-3))


# ---------------------------------------------------------------------------------------
# Transformations, constant folding, and the path through a TrainingSession

def test_custom_rules_under_jit_vmap_scan_and_on_constants():
    mx = lookup("ai.onnx", "Max", 13).lower
    x0, x1 = a([[1, 5, 2], [3, 3, 0]], F16), a([3, 5, 1], F16)
    ref = jax.grad(lambda p, q: mx(Ctx(), p, q).sum(), (0, 1))(x0, x1)
    jit = jax.jit(jax.grad(lambda p, q: mx(Ctx(), p, q).sum(), (0, 1)))(x0, x1)
    for r, j in zip(ref, jit):
        np.testing.assert_array_equal(r, j)
    np.testing.assert_array_equal(ref[0], [[0, 1, 1], [1, 0, 0]])
    vm = jax.vmap(jax.grad(lambda p, q: mx(Ctx(), p, q).sum()))(x0, np.stack([x1, x1]))
    np.testing.assert_array_equal(vm, ref[0])

    def body(carry, row):
        return carry + mx(Ctx(), row, carry).sum(), None
    gs = jax.grad(lambda c0: jax.lax.scan(body, c0, a([[1, 3, 5]], F32))[0])(F32(3.0))
    assert gs == 1 + 2              # carry 3 is the max of 1 and ties with 3: both count whole
    with jax.ensure_compile_time_eval():   # lowerings run eagerly on NumPy constants to fold
        np.testing.assert_array_equal(mx(Ctx(), x0, x1), np.maximum(x0, x1))
        np.testing.assert_array_equal(lookup("ai.onnx", "Clip", 13).lower(Ctx(), x0, a(2, F16), None),
                                      np.maximum(x0, 2))


def test_max_tie_gradient_through_training_session():
    G = popart.reservedGradientPrefix()
    w0 = a([[1, 2, 3], [4, 5, 6]], F32)
    v0 = a([1, 7, 3], F32)
    X = a([[1, 0, 3], [9, 5, 0]], F32)
    b = popart.Builder()
    x = b.addInputTensor(popart.TensorInfo("FLOAT", [2, 3]))
    w = b.addInitializedInputTensor(w0)
    v = b.addInitializedInputTensor(v0)
    m = b.aiOnnx.max([x, w, v])
    loss = b.aiGraphcore.identityloss([m], reduction=popart.ReductionType.Sum)
    art = popart.AnchorReturnType("ALL")
    df = popart.DataFlow(1, {loss: art, G + x: art, G + w: art, G + v: art})
    s = popart.TrainingSession(b.getModelProto(), df, loss, popart.SGD({"defaultLearningRate": (0.0, False)}),
                               popart.DeviceManager().createCpuDevice())
    s.prepareDevice()
    s.weightsFromHost()
    out = s.initAnchorArrays()
    s.run(popart.PyStepIO({x: X}, out))
    mo = np.maximum(np.maximum(X, w0), v0)
    np.testing.assert_array_equal(out[G + x], (X == mo).astype(F32))
    np.testing.assert_array_equal(out[G + w], (w0 == mo).astype(F32))
    np.testing.assert_array_equal(out[G + v], (v0 == mo).sum(0).astype(F32))
    assert out[G + x][0, 0] == out[G + w][0, 0] == 1 and out[G + v][0] == 1   # a three-way tie
