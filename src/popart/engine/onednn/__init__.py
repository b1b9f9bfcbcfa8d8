"""2D float32 convolutions through oneDNN on the CPU, as an XLA FFI custom call (``conv.cc``),
behind the Conv lowering; and matrix products on weights packed once (``matmul.cc``), behind the
CPU's MatMul / Gemm in a hoisted inference step (``engine/hoist.py``, ``ops/matmul_cpu.py``).

``conv2d(x, w, ...)`` is a ``custom_vjp`` function: its forward, input gradient and weight
gradient are each one call of the same handler (oneDNN's forward, backward-data and
backward-weights primitives); inside :func:`packing` its forward reads weights a separate call
packed (the pack hoisted out of the step). The handlers are compiled at first use with the C++ compiler
against the oneDNN PyPI wheels (``onednn-cpu-gomp`` and ``onednn-devel-cpu-gomp``, linux
x86-64), into ``~/.cache/popart-xla/onednn-<hash>/`` (``$XDG_CACHE_HOME`` honoured; built under
a file lock and renamed into place), then loaded and registered with ``jax.ffi``.

``available()`` says whether that worked; when it did not (no wheel, no compiler, another
platform, ``POPART_ONEDNN=0``) one log line (module ``devicex``) says why and convolutions stay
XLA's. oneDNN runs on GNU OpenMP's threads (``OMP_NUM_THREADS``), not XLA's pool.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...logging import getLogger

TARGET = "popart_onednn_conv"
MATMUL, PACK, CONV_PACK = "popart_onednn_matmul", "popart_onednn_pack", "popart_onednn_conv_pack"
TARGETS = (TARGET, MATMUL, PACK, CONV_PACK)   # the custom calls an exported program may hold (engine/compiled.py)
SOURCES = [Path(__file__).with_name("conv.cc"), Path(__file__).with_name("matmul.cc")]
HEADERS = [Path(__file__).with_name("common.h")]   # in the build's hash
_LIB: list = []   # the loaded library (ctypes), once available() has loaded it
_logger = getLogger("devicex")
FORWARD, BACKWARD_DATA, BACKWARD_WEIGHTS, PACKED_FORWARD = 0, 1, 2, 3


def _onednn_prefix() -> Optional[Path]:
    """The install prefix holding include/dnnl.hpp and lib/libdnnl.so.3 (the wheels install
    into the environment's prefix), or None."""
    roots = []
    try:
        for f in metadata.files("onednn-devel-cpu-gomp") or ():
            if f.name == "dnnl.hpp" and f.parent.name == "include":
                roots.append(Path(f.locate()).resolve().parents[1])
    except metadata.PackageNotFoundError:
        pass
    roots += [Path(sys.prefix), Path(sys.base_prefix)]
    for root in roots:
        if (root / "include" / "dnnl.hpp").is_file() and (root / "lib" / "libdnnl.so.3").exists():
            return root
    return None


def _cache_dir(key: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "popart-xla" / f"onednn-{key}"


def _build(prefix: Path, cxx: str) -> Path:
    """The handler's shared library, built once per source / oneDNN / jax / compiler."""
    include = jax.ffi.include_dir()
    key = hashlib.sha256(b"\0".join(
        [*(s.read_bytes() for s in SOURCES + HEADERS), str(prefix).encode(), include.encode(), jax.__version__.encode(),
         cxx.encode()])).hexdigest()[:16]
    out = _cache_dir(key)
    lib = out / "libpopart_onednn.so"
    if lib.is_file():
        return lib
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file():   # another process built it while we waited
            return lib
        tmp = out / f".build-{os.getpid()}.so"
        cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{prefix / 'include'}",
               f"-I{include}", *map(str, SOURCES), "-o", str(tmp), f"-L{prefix / 'lib'}", "-l:libdnnl.so.3",
               f"-Wl,-rpath,{prefix / 'lib'}"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{' '.join(cmd)} failed: {run.stderr.strip()[-400:]}")
        os.replace(tmp, lib)
    return lib


@functools.cache
def available() -> bool:
    """Whether the oneDNN convolution is built, loaded and registered (for the CPU)."""
    why = None
    if os.environ.get("POPART_ONEDNN", "1") in ("0", "false", "off", ""):
        why = "switched off (POPART_ONEDNN=0)"
    elif sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        why = f"not built for {sys.platform} {platform.machine()} (linux x86-64 only)"
    elif (prefix := _onednn_prefix()) is None:
        why = "oneDNN not found (pip install onednn-cpu-gomp onednn-devel-cpu-gomp)"
    elif (cxx := os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")) is None:
        why = "no C++ compiler (g++) to build the oneDNN custom call"
    if why is None:
        try:
            lib = ctypes.CDLL(str(_build(prefix, cxx)))
            for target, symbol in ((TARGET, lib.PopartOnednnConv), (MATMUL, lib.PopartOnednnMatmul),
                                   (PACK, lib.PopartOnednnPack), (CONV_PACK, lib.PopartOnednnConvPack)):
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
            _LIB.append(lib)
        except Exception as e:  # noqa: BLE001 - any failure means XLA's convolution
            why = f"could not be built or loaded: {e}"
    if why is not None:
        _logger.warn(f"oneDNN convolutions unavailable, using XLA's: {why}")
        return False
    _logger.info(f"oneDNN convolutions and matmuls: {', '.join(TARGETS)} registered")
    return True


def _call(kind: int, a, b, out_shape: Sequence[int], geom: Sequence[int], nhwc: bool,
          operands: Sequence = (), posts: Sequence[int] = ()):
    if not available():
        raise RuntimeError("the oneDNN convolution is unavailable (see popart's devicex log)")
    geom = np.array([kind, int(nhwc), *geom, *posts], np.int64)
    codes = list(posts[::3])
    if POST_OPS["sum"][0] not in codes:
        return _ffi(tuple(out_shape), geom)(a, b, *operands)
    return _summed(tuple(out_shape), geom, 2 + int(codes[0] == POST_OPS["bias"][0]))(
        a, b, *operands)


def _ffi(out_shape: tuple, geom: np.ndarray, alias: Optional[int] = None):
    out = jax.ShapeDtypeStruct(out_shape, np.float32)
    return functools.partial(jax.ffi.ffi_call(
        TARGET, out, vmap_method="expand_dims",
        input_output_aliases=None if alias is None else {alias: 0}), geom=geom)


def _summed(out_shape: tuple, geom: np.ndarray, i: int):
    """The call with a sum post-op, its operand (argument ``i``) the result's buffer (XLA
    copies it only where something else reads it) while batched like the result: under vmap
    an operand shared by the batch is passed without the alias (conv.cc copies it in)."""
    call = jax.custom_batching.custom_vmap(_ffi(out_shape, geom, i))

    @call.def_vmap
    def _batched(axis_size, in_batched, *args):   # as vmap_method="expand_dims" does
        args = [v if batched else v[None] for v, batched in zip(args, in_batched)]
        shape = (axis_size, *out_shape)
        return (_summed(shape, geom, i) if in_batched[i] else _ffi(shape, geom))(*args), True
    return call


def _geom(strides, padding, dilation, groups) -> tuple:
    (pt, pb), (pl, pr) = padding
    return (*strides, pt, pl, pb, pr, *dilation, groups)


def conv2d(x, w, strides: tuple, padding: tuple, dilation: tuple, nhwc: bool, groups: int = 1):
    """2D float32 convolution by oneDNN: x NHWC (``nhwc``) or NCHW, w OIHW (ONNX's: O x C/groups
    x KH x KW), y in x's layout; ``padding`` ((top, bottom), (left, right)), ``dilation`` 1 for
    none, ``groups`` as ONNX's ``group`` (depthwise: the channels). Inside :func:`packing` (a
    hoisted inference step) on weights packed by a separate call (:func:`_packed_forward`)."""
    if _PACKING.get():
        return _packed_forward(x, w, (), strides, padding, dilation, nhwc, groups, ())
    return _conv2d(x, w, strides, padding, dilation, nhwc, groups)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _conv2d(x, w, strides: tuple, padding: tuple, dilation: tuple, nhwc: bool, groups: int = 1):
    return _fwd(x, w, strides, padding, dilation, nhwc, groups)[0]


def _out_shape(x, w, strides, padding, dilation, nhwc):
    n, *sp, c = x.shape if nhwc else (x.shape[0], *x.shape[2:], x.shape[1])
    o, k = w.shape[0], w.shape[2:]
    out = [(s + lo + hi - (kk - 1) * d - 1) // st + 1
           for s, (lo, hi), kk, d, st in zip(sp, padding, k, dilation, strides)]
    return (n, *out, o) if nhwc else (n, o, *out)


def _fwd(x, w, strides, padding, dilation, nhwc, groups=1):
    y = _call(FORWARD, x, w, _out_shape(x, w, strides, padding, dilation, nhwc),
              _geom(strides, padding, dilation, groups), nhwc)
    return y, (x, w)


def _bwd(strides, padding, dilation, nhwc, groups, res, dy):
    x, w = res
    geom = _geom(strides, padding, dilation, groups)
    dx = _call(BACKWARD_DATA, dy, w, x.shape, geom, nhwc)
    dw = _call(BACKWARD_WEIGHTS, x, dy, w.shape, geom, nhwc)
    return dx, dw


_conv2d.defvjp(_fwd, _bwd)


def _packed_forward(x, w, operands, strides, padding, dilation, nhwc, groups, posts):
    """The forward (post-ops too) on ``w`` packed by ``popart_onednn_conv_pack`` into the layout
    of the forward primitive of this shape (no gradients: inference)."""
    out = _out_shape(x, w, strides, padding, dilation, nhwc)
    geom = _geom(strides, padding, dilation, groups)
    n, c, h, wd = (x.shape[-4], x.shape[-1], *x.shape[-3:-1]) if nhwc else x.shape[-4:]
    oh, ow = out[1:3] if nhwc else out[2:]
    # conv.cc's key of this forward's plan: shapes, geometry, the post-ops and each binary
    # post-op operand's N, C, H, W (the layout the pack writes is that plan's)
    rest, dims = iter(operands), []
    for name, _, _ in posts:
        if name == "bias" or name in BINARY_POSTS:
            s = next(rest).shape[-4:]
            dims += [] if name == "bias" else [s[0], s[3], s[1], s[2]] if nhwc else list(s)
    key = np.array([FORWARD, int(nhwc), n, c, h, wd, w.shape[0], *w.shape[2:], oh, ow, *geom, len(posts),
                    *_post_geom(posts), *dims], np.int64)
    f = _lib().popart_onednn_conv_packed_bytes
    f.restype = ctypes.c_int64
    size = f(key.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), ctypes.c_int64(key.size))
    if size < 0:
        raise RuntimeError(f"oneDNN has no forward convolution for the key {key.tolist()}")
    if not fits(size, 4 * int(np.prod(w.shape))):   # the hoisting would keep its pack
        return (_conv2d_fused(x, w, operands, strides, padding, dilation, nhwc, groups, posts) if posts
                else _conv2d(x, w, strides, padding, dilation, nhwc, groups))
    packed = jax.ffi.ffi_call(CONV_PACK, jax.ShapeDtypeStruct((size // 4,), np.float32),
                              vmap_method="sequential")(w, key=key)
    return _call(PACKED_FORWARD, x, packed, out, geom, nhwc, operands, _post_geom(posts))

def channels_last(x_shape: Sequence[int], w_shape: Sequence[int], training: bool = True) -> bool:
    """Whether oneDNN runs a convolution of NCHW x (no channels-last form) by OIHW w on NHWC
    activations, x transposed in and y kept NHWC for what follows (engine/channels_last.py), rather
    than on NCHW as they are: NHWC is oneDNN's fast layout, the 3-channel stems included
    (forward 1.4-1.8x NCHW with the input's transpose). In training 1x1 kernels stay NCHW
    (forward and gradients in isolation, transposes on both sides: 0.83-0.94x); in inference
    they run NHWC too, their result feeding NHWC consumers (ShuffleNetV2, whose channel shuffle
    drops the channels-last form before each 1x1: 27.3 -> 18.4 ms of CPU per batch;
    docs/performance.md), except a 1x1 over more than one pixel that at least halves the
    channels: transposing its input costs more than the NCHW kernel loses (SegFormer-B0's head,
    a concatenation of four NCHW maps, 2 x 1024 x 64 x 64 -> 256: 62.5 -> 53.3 ms of CPU per
    batch). An input already channels-last always runs NHWC."""
    if tuple(w_shape[2:]) != (1, 1):
        return True
    return not training and (2 * w_shape[0] > x_shape[1] or int(np.prod(x_shape[2:])) == 1)


def prefers(x_shape: Sequence[int], w_shape: Sequence[int], strides: Sequence[int],
            dilation: Sequence[int], groups: int = 1) -> bool:
    """Whether a 2D convolution of this shape (x NCHW, w OIHW) runs faster through oneDNN
    than through XLA on the CPU, decided at trace time. Measured (``bench/conv_onednn.py``,
    docs/performance.md): forward + gradients, oneDNN is ahead of popart's XLA lowering on
    every ResNet-18 shape (3x3 of 3 to 512 channels, 1x1, stride 1 and 2; 1.05-12x with one
    thread and two) and on every depthwise and grouped shape of MobileNetV3, EfficientNet-B0,
    ConvNeXt-T, RegNetY-400MF and ShuffleNetV2 (8-900x: XLA's grouped convolutions and their
    gradients run at 0.1-1.3 GFLOP/s), so no shape is kept on XLA: ``_XLA_SHAPES`` is empty."""
    return not any(rule(x_shape, w_shape, strides, dilation, groups) for rule in _XLA_SHAPES)


# Predicates (x_shape, w_shape, strides, dilation, groups) -> True for shapes that stay on XLA's
# convolution; add one where a measurement shows XLA ahead.
_XLA_SHAPES: list = []



# ---- Post-ops (conv.cc ``Post``): what a forward call applies to its result in the same pass:
# the bias, a binary add / multiply / max / min with an operand (each dim the result's or 1),
# and oneDNN's
# eltwise algorithms. name -> (code, reference in jax.numpy of (y, alpha, beta[, operand])).
POST_OPS = {
    "bias": (1, None),
    "add": (2, lambda y, a, b, v: y + v),
    "mul": (3, lambda y, a, b, v: y * v),
    "max": (4, lambda y, a, b, v: jnp.maximum(y, v)),
    "min": (5, lambda y, a, b, v: jnp.minimum(y, v)),
    "sum": (6, lambda y, a, b, v: y + v),   # add of the result's shape, accumulated in place
    "relu": (10, lambda y, a, b: jnp.where(y > 0, y, y * a)),
    "clip": (11, lambda y, a, b: jnp.clip(y, a, b)),
    "hardswish": (12, lambda y, a, b: y * jnp.clip(y * a + b, 0, 1)),
    "hardsigmoid": (13, lambda y, a, b: jnp.clip(y * a + b, 0, 1)),
    "sigmoid": (14, lambda y, a, b: jax.nn.sigmoid(y)),
    "swish": (15, lambda y, a, b: y * jax.nn.sigmoid(y * a)),
    "gelu": (16, lambda y, a, b: jax.nn.gelu(y, approximate=False)),
    "gelu_tanh": (17, lambda y, a, b: jax.nn.gelu(y, approximate=True)),
    "tanh": (18, lambda y, a, b: jnp.tanh(y)),
    "elu": (19, lambda y, a, b: jnp.where(y > 0, y, a * jnp.expm1(y))),
    "linear": (20, lambda y, a, b: y * a + b),
}
BINARY_POSTS = ("add", "mul", "max", "min", "sum")
Post = tuple   # (name, alpha, beta)


def _post_geom(posts: Sequence[Post]) -> list[int]:
    """The geom values of a post-op chain: code, alpha's and beta's float32 bits, each."""
    bits = lambda v: int(np.float32(v).view(np.int32))  # noqa: E731
    return [v for name, a, b in posts for v in (POST_OPS[name][0], bits(a), bits(b))]


def apply_posts(y, operands: Sequence, posts: Sequence[Post], nhwc: bool):
    """``posts`` applied to the convolution result ``y`` in jax.numpy (the reference the
    gradients of ``conv2d_fused`` differentiate); ``operands``: the bias, then each binary
    post-op's input, in order."""
    rest = iter(operands)
    for name, a, b in posts:
        if name == "bias":
            bias = next(rest)
            y = y + (bias if nhwc else bias.reshape(-1, 1, 1))
        elif name in BINARY_POSTS:
            y = POST_OPS[name][1](y, a, b, next(rest))
        else:
            y = POST_OPS[name][1](y, np.float32(a), np.float32(b))
    return y


def conv2d_fused(x, w, operands: tuple, strides: tuple, padding: tuple, dilation: tuple,
                 nhwc: bool, groups: int, posts: tuple):
    """``apply_posts(conv2d(x, w, ...), operands, posts, nhwc)`` as one oneDNN forward call,
    the post-ops applied as the convolution writes its result (``posts``: (name, alpha, beta)
    of ``POST_OPS``, the bias first if any). Its gradients are those of the reference. Inside
    :func:`packing`, on packed weights (as :func:`conv2d`)."""
    posts = _sum_post(operands, posts, _out_shape(x, w, strides, padding, dilation, nhwc))
    if _PACKING.get():
        return _packed_forward(x, w, operands, strides, padding, dilation, nhwc, groups, posts)
    return _conv2d_fused(x, w, operands, strides, padding, dilation, nhwc, groups, posts)


def _sum_post(operands: Sequence, posts: tuple, out_shape: Sequence[int]) -> tuple:
    """``posts`` with a first post-op (after the bias) "add" of an operand of the result's own
    shape (a residual) as "sum": oneDNN accumulates into the operand's values instead of reading
    it as a second tensor (ResNet-50's 64 -> 256 1x1 at 56 x 56, batch 4, one thread: 3.1 ->
    1.7-2.2 ms; docs/performance.md)."""
    first = 1 if posts and posts[0][0] == "bias" else 0
    if len(posts) > first and posts[first][0] == "add" and \
            tuple(operands[first].shape) == tuple(out_shape):
        return (*posts[:first], ("sum", *posts[first][1:]), *posts[first + 1:])
    return posts


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _conv2d_fused(x, w, operands: tuple, strides: tuple, padding: tuple, dilation: tuple,
                  nhwc: bool, groups: int, posts: tuple):
    out = _out_shape(x, w, strides, padding, dilation, nhwc)
    return _call(FORWARD, x, w, out, _geom(strides, padding, dilation, groups), nhwc,
                 operands, _post_geom(posts))


def _reference(x, w, operands, strides, padding, dilation, nhwc, groups, posts):
    return apply_posts(conv2d(x, w, strides, padding, dilation, nhwc, groups), operands, posts,
                       nhwc)


def _fused_fwd(x, w, operands, *static):
    return _conv2d_fused(x, w, operands, *static), (x, w, operands)


def _fused_bwd(*args):
    *static, (x, w, operands), dy = args
    return jax.vjp(lambda x, w, o: _reference(x, w, o, *static), x, w, operands)[1](dy)


_conv2d_fused.defvjp(_fused_fwd, _fused_bwd)


# ---- Matrix products (matmul.cc): y = a @ W, float32, W [K, N] (or W^T [N, K], ``trans``), on
# oneDNN's matmul; ``pack`` reorders W once into the blocked layout the primitive reads, so a
# step whose packs are hoisted out of it (engine/hoist.py) reads packed weights on every run.
PACK_M = 256   # the rows the packed layout is chosen for (a product of any M reads it)


def _lib() -> ctypes.CDLL:
    if not available():
        raise RuntimeError("oneDNN is unavailable (see popart's devicex log)")
    return _LIB[0]


def packed_bytes(k: int, n: int, trans: bool = False) -> int:
    """Bytes of W [K, N] in oneDNN's packed layout (a multiple of 4)."""
    f = _lib().popart_onednn_packed_bytes
    f.restype = ctypes.c_int64
    size = f(ctypes.c_int64(k), ctypes.c_int64(n), ctypes.c_int64(int(trans)), ctypes.c_int64(PACK_M))
    if size < 0:
        raise RuntimeError(f"oneDNN has no packed layout for a {k} x {n} weight")
    return int(size)


def packs_run() -> int:
    """How many packs (matmul weights and convolution weights) the library has run in this
    process (tests count them)."""
    lib = _lib()
    lib.popart_onednn_packs.restype = lib.popart_onednn_conv_packs.restype = ctypes.c_int64
    return int(lib.popart_onednn_packs()) + int(lib.popart_onednn_conv_packs())


def matmul_impl(m: int, k: int, n: int, packed: bool) -> str:
    """oneDNN's implementation name for an (m, k) x (k, n) product (benches print it)."""
    f = _lib().popart_onednn_matmul_impl
    f.restype = ctypes.c_char_p
    return f(*(ctypes.c_int64(v) for v in (m, k, n, int(packed)))).decode()


def _mm_geom(kind: int, k: int, n: int, trans: bool) -> np.ndarray:
    return np.array([kind, k, n, int(trans), PACK_M], np.int64)


def pack(w, trans: bool = False):
    """W (``[K, N]``, or ``[N, K]`` with ``trans``) in oneDNN's packed layout: a flat float32
    array that only :func:`matmul` reads."""
    k, n = (w.shape[1], w.shape[0]) if trans else w.shape
    out = jax.ShapeDtypeStruct((packed_bytes(k, n, trans) // 4,), np.float32)
    return jax.ffi.ffi_call(PACK, out, vmap_method="sequential")(w, geom=_mm_geom(2, k, n, trans))


def matmul(a, w, n: int, trans: bool = False, packed: bool = False):
    """``a @ W`` (a ``[..., K]``) by oneDNN: ``w`` is W ``[K, N]`` (``[N, K]`` with ``trans``),
    or with ``packed`` what :func:`pack` made of it (``n``: W's columns)."""
    _lib()
    k = a.shape[-1]
    out = jax.ShapeDtypeStruct((*a.shape[:-1], n), np.float32)
    # vmap folds into the rows (a's leading dims); a batched weight runs one call per item.
    return jax.ffi.ffi_call(MATMUL, out, vmap_method="expand_dims")(
        a, w, geom=_mm_geom(int(packed), k, n, trans))


_PACKING = contextvars.ContextVar("popart_onednn_packing", default=False)
# A packed layout this much larger than its weights (padding) is not packed: hoist.py's memory
# guard (GROWTH, SLACK) would keep its pack in the step, run on every call.
PACK_GROWTH, PACK_SLACK = 1.25, 4096


def fits(nbytes: int, source_bytes: int) -> bool:
    """Whether a value of ``nbytes`` derived from ``source_bytes`` of weights stays within the
    growth a pack may add (padding): the one rule of hoist.py's guard and of what is packed."""
    return nbytes <= PACK_GROWTH * source_bytes + PACK_SLACK


@contextlib.contextmanager
def packing():
    """While a step whose weight-only work is hoisted (engine/hoist.py) is traced: matmul
    lowerings read their weights packed (:func:`packs_weights`), the packs hoisted with the rest."""
    token = _PACKING.set(True)
    try:
        yield
    finally:
        _PACKING.reset(token)


def packs_weights(w) -> bool:
    """Whether a matmul by the 2-D float32 operand ``w`` runs on oneDNN with ``w`` packed:
    inside :func:`packing` only (elsewhere the pack would run on every call), where oneDNN is
    built, for weights of 4096 elements or more (smaller products stay XLA's dots) whose packed
    layout is at most a quarter larger (padding; hoist.py's guard would keep a larger one's pack
    in the step, run on every call)."""
    if not (_PACKING.get() and jnp.ndim(w) == 2 and jnp.result_type(w) == jnp.float32
            and int(np.prod(jnp.shape(w))) >= 4096 and available()):
        return False
    return fits(packed_bytes(*w.shape), 4 * int(np.prod(w.shape)))
