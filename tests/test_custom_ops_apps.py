"""The C++ custom ops that Graphcore's popxl applications carry in their own trees
(docs/custom_ops.md, "Graphcore's popxl applications"): the RotaryPosEmbed copy of Dolly and
LLaMA (forward over the head's halves, grad op over interleaved pairs, as their C++) against
NumPy, and the cppimport resolution that tells it from popxl-addons' op of the same module
name by the C++ source beside the binding."""
from __future__ import annotations

import importlib
import sys
import textwrap

import jax
import numpy as np
import pytest

import popart
import popxl
import popxl.ops as ops
from popart.custom_ops import ADDONS_DOMAIN, EXAMPLES_DOMAIN
from popart.custom_ops import addons_ops as AO

RNG = np.random.default_rng(10)
B, S, H, HH = 2, 5, 3, 8


class Ctx:
    """A lowering context for calling a lowering directly."""
    op_type, domain, version, name, node = "RotaryPosEmbed", EXAMPLES_DOMAIN, 1, "rope", None
    input_ids, output_ids, replication_factor, replica_axis = [], [], 1, None

    def error(self, msg):
        return popart.UnsupportedOperatorError(msg)


def rope_halves(x, phi, d):
    """NumPy: the first ``d`` hidden elements of x [B, S, H, hh] as halves x1 (real), x2
    (imaginary), x1 + i x2 times exp(i phi) (phi [1 | B, S, d / 2]); the rest unchanged."""
    z = (x[..., :d // 2] + 1j * x[..., d // 2:d]) * np.exp(1j * phi)[:, :, None, :]
    return np.concatenate([z.real, z.imag, x[..., d:]], -1)


def unrotate_pairs(g, phi, d):
    """NumPy: the C++ grad op, pairs (g[2i], g[2i+1]) of the first ``d`` elements times
    exp(-i phi)."""
    z = (g[..., 0:d:2] + 1j * g[..., 1:d:2]) * np.exp(-1j * phi)[:, :, None, :]
    out = g.copy()
    out[..., 0:d:2], out[..., 1:d:2] = z.real, z.imag
    return out


@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_apps_rotary_pos_embed_forward_and_grad_op(rotary_dim):
    d = rotary_dim or HH
    x, g = (RNG.normal(size=(B, S, H, HH)).astype(np.float32) for _ in range(2))
    phi = RNG.uniform(-3, 3, size=(1, S, d // 2)).astype(np.float32)
    y, pull = jax.vjp(lambda a, s, c: AO.rotary_pos_embed_halves(Ctx(), a, s, c, rotary_dim),
                      x, np.sin(phi), np.cos(phi))
    dx, ds, dc = pull(g)
    np.testing.assert_allclose(y, rope_halves(x, phi, d), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, unrotate_pairs(g, phi, d), rtol=1e-5, atol=1e-6)
    assert not np.any(ds) and not np.any(dc)
    with pytest.raises(popart.popart_exception, match="rotary dim must be a multiple of 2"):
        AO.rotary_pos_embed_halves(Ctx(), x, np.sin(phi), np.cos(phi), 3)


# An application's package as Dolly / LLaMA lay it out: modelling/rotary_pos_embed/ with the
# binding's .cpp and the Opx source beside it, and a Python module that builds the op.
OP_MODULE = textwrap.dedent("""
    import cppimport.import_hook
    from . import rotary_pos_embed_binding
    import popxl
    from popxl.context import get_current_context

    def rope(t, sin, cos):
        ctx = get_current_context()
        g = ctx.graph
        op = rotary_pos_embed_binding.RotaryPosEmbedOp.createOpInGraph(
            g._pb_graph, {0: t.id, 1: sin.id, 2: cos.id}, {0: g._create_tensor_id("t_rotated")},
            t.shape[-1], ctx._get_op_settings("RotaryPosEmbedOp"))
        ctx._op_created(op)
        return popxl.Tensor._from_pb_tensor(op.outTensor(0))
""")


def make_package(root, name, opx_source):
    pkg = root / name / "rotary_pos_embed"
    pkg.mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .rotary_pos_embed import rope\n")
    (pkg / "rotary_pos_embed.py").write_text(OP_MODULE)
    (pkg / "rotary_pos_embed_binding.cpp").write_text("// PYBIND11_MODULE(rotary_pos_embed_binding, m)\n")
    (pkg / "rotary_pos_embedx.cpp").write_text(opx_source)
    return importlib.import_module(f"{name}.rotary_pos_embed")


@pytest.fixture
def apps_packages(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    halves = make_package(tmp_path, "h10app", "// Get contiguous real/img parts\n"
                          "auto x1 = x.slice({0, h_2}, 3);\n")
    pairs = make_package(tmp_path, "h10addons", "// Get interleave real/img parts\n")
    yield halves, pairs
    for mod in [m for m in sys.modules if m.startswith(("h10app", "h10addons"))]:
        del sys.modules[mod]


def test_apps_binding_resolves_by_its_cpp_source(apps_packages):
    """The same binding module name resolves to the apps' op where its Opx source rotates the
    halves, and to popxl-addons' elsewhere; a popxl program with each runs, forward and
    autodiff, equal to NumPy."""
    x, g = (RNG.normal(size=(B, S, H, HH)).astype(np.float32) for _ in range(2))
    phi = RNG.uniform(-3, 3, size=(1, S, HH // 2)).astype(np.float32)
    for mod, domain, ref in zip(apps_packages, (EXAMPLES_DOMAIN, ADDONS_DOMAIN), (
            rope_halves(x, phi, HH), AO.rotate_pairs(x, np.sin(phi), np.cos(phi), 1))):
        assert mod.rotary_pos_embed.rotary_pos_embed_binding.RotaryPosEmbedOp.domain == domain
        ir = popxl.Ir()
        with ir.main_graph:
            fwd = ir.create_graph(lambda t: mod.rope(t, popxl.constant(np.sin(phi)),
                                                     popxl.constant(np.cos(phi))),
                                  popxl.TensorSpec(x.shape, popxl.float32))
            bwd = popxl.transforms.autodiff(fwd)
            (y,) = ops.call(fwd, popxl.constant(x))
            (dx,) = ops.call(bwd.graph, popxl.constant(g))
            ys, dxs = popxl.d2h_stream(y.shape, y.dtype, "y"), popxl.d2h_stream(y.shape, y.dtype, "dx")
            ops.host_store(ys, y)
            ops.host_store(dxs, dx)
        with popxl.Session(ir, "ipu_model") as s:
            got = s.run()
        np.testing.assert_allclose(got[ys], ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[dxs], unrotate_pairs(g, phi, HH), rtol=1e-5, atol=1e-6)
