"""popxl.ops: every op appends IR nodes of registry ops (ai.onnx / ai.graphcore / ai.popxl)
to the current graph. In-place variants (``add_``, ``relu_``, ...) give the tensor a new
version, so later reads of it see the new value."""
from __future__ import annotations

import builtins
from typing import Any, Iterable, List, Optional, Tuple, Union

import numpy as np

from ..dtypes import dtype as _dtype
from ..tensor import Tensor, constant
from ._base import GC, ONNX, POPXL, as_tensor, axes_list, inplace, ints, node, one, onnx_type, \
    reduction_name
from .call import (CallSiteInfo, call, call_with_info, conditional, conditional_with_info,
                   host_load, host_store, repeat, repeat_with_info)
from . import collectives, var_updates  # noqa: F401

_INT_MAX = np.iinfo(np.int64).max


def _unary(op_type: str, domain: str = ONNX):
    def fn(t: Tensor) -> Tensor:
        return one(op_type, t, domain=domain)
    fn.__name__ = fn.__qualname__ = op_type.lower()
    fn.__doc__ = f"Elementwise {domain}::{op_type}."
    return fn


def _binary(op_type: str, domain: str = ONNX):
    def fn(lhs: Any, rhs: Any) -> Tensor:
        if not isinstance(lhs, Tensor):
            lhs = as_tensor(lhs, rhs)
        return one(op_type, lhs, as_tensor(rhs, lhs), domain=domain)
    fn.__name__ = fn.__qualname__ = op_type.lower()
    fn.__doc__ = f"Elementwise {domain}::{op_type} with NumPy broadcasting."
    return fn


def _make_inplace(fn):
    def fn_(t: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return inplace(t, fn(t, *args, **kwargs))
    fn_.__name__ = fn.__name__ + "_"
    fn_.__doc__ = f"In-place {fn.__name__}: updates ``t`` and returns it."
    return fn_


# ---------------------------------------------------------------------------------------
# Elementwise

abs = _unary("Abs")  # noqa: A001
cos, sin, tanh, exp, log, sqrt = (_unary(n) for n in ("Cos", "Sin", "Tanh", "Exp", "Log", "Sqrt"))
relu, sigmoid, negate = _unary("Relu"), _unary("Sigmoid"), _unary("Neg")
ceil, floor, sign, erf = _unary("Ceil"), _unary("Floor"), _unary("Sign"), _unary("Erf")
isnan, isinf, logical_not = _unary("IsNaN"), _unary("IsInf"), _unary("Not")
reciprocal, softplus, identity = _unary("Reciprocal"), _unary("Softplus"), _unary("Identity")
geluerf, swish, detach = _unary("GeluErf", GC), _unary("Swish", GC), _unary("Detach", GC)

add, sub, mul, div, pow = (_binary(n) for n in ("Add", "Sub", "Mul", "Div", "Pow"))  # noqa: A001
equal, greater, less = _binary("Equal"), _binary("Greater"), _binary("Less")
greater_equal, less_equal = _binary("GreaterOrEqual"), _binary("LessOrEqual")
logical_and, logical_or, logical_xor = _binary("And"), _binary("Or"), _binary("Xor")
maximum, minimum, fmod = _binary("Max"), _binary("Min"), _binary("Fmod", GC)


def gelu(t: Tensor, approximation: Any = "tanh") -> Tensor:
    """GELU, tanh approximation (``approximation="none"`` / ``"erf"`` for the exact form)."""
    exact = str(getattr(approximation, "name", approximation)).lower() in ("none", "erf")
    return one("GeluErf" if exact else "Gelu", t, domain=GC)


def isfinite(t: Tensor) -> Tensor:
    return logical_not(logical_or(isnan(t), isinf(t)))


def where(condition: Tensor, lhs: Any, rhs: Any) -> Tensor:
    if not isinstance(lhs, Tensor):
        lhs = as_tensor(lhs, rhs if isinstance(rhs, Tensor) else None)
    return one("Where", condition, lhs, as_tensor(rhs, lhs))


def clip(t: Tensor, min: Optional[float] = None, max: Optional[float] = None) -> Tensor:  # noqa: A002
    lo = None if min is None else constant(min, t.dtype)
    hi = None if max is None else constant(max, t.dtype)
    return one("Clip", t, lo, hi)


def cast(t: Tensor, data_type: Any) -> Tensor:
    return one("Cast", t, to=onnx_type(data_type))


def scale(t: Tensor, factor: float) -> Tensor:
    return one("Scale", t, domain=GC, scale=float(factor))


def scaled_add(X: Tensor, Y: Tensor, a: Union[float, Tensor] = 1.0, b: Union[float, Tensor] = 1.0) -> Tensor:
    """a * X + b * Y (scalars or scalar tensors)."""
    attrs, ins = {}, [X, Y, None, None]
    if isinstance(a, Tensor):
        ins[2] = a
    else:
        attrs["scale0"] = float(a)
    if isinstance(b, Tensor):
        ins[3] = b
    else:
        attrs["scale1"] = float(b)
    while ins[-1] is None:
        ins.pop()
    return node("ScaledAdd", ins, attrs, GC)[0]


def increment_mod(t: Tensor, increment: float, modulus: float) -> Tensor:
    return one("IncrementMod", t, domain=GC, increment=float(increment), modulus=float(modulus))


relu_, gelu_, exp_, swish_, detach_ = (_make_inplace(f) for f in (relu, gelu, exp, swish, detach))
add_, sub_, mul_, div_ = (_make_inplace(f) for f in (add, sub, mul, div))
scaled_add_, increment_mod_ = _make_inplace(scaled_add), _make_inplace(increment_mod)
copy_ = _make_inplace(lambda t, src: identity(cast(src, t.dtype)))

# ---------------------------------------------------------------------------------------
# Matmul, reductions, normalisation


def matmul(lhs: Tensor, rhs: Tensor, available_memory_proportion: Optional[float] = None,
           serialise_mode: Any = None, serialise_factor: int = 1, output_type: Any = None,
           partials_type: Any = None) -> Tensor:
    """Matrix product (NumPy matmul broadcasting); options that tune IPU code are accepted."""
    out = one("MatMul", lhs, as_tensor(rhs, lhs))
    return out if output_type is None or _dtype.as_dtype(output_type) == out.dtype else cast(out, output_type)


def _reduce(op_type: str):
    def fn(t: Tensor, axis: Union[None, int, Iterable[int]] = None, keepdims: bool = False) -> Tensor:
        ax = axes_list(axis, t.rank)
        return one(op_type, t, None if ax is None else ints(ax), keepdims=int(keepdims))
    fn.__name__ = op_type[len("Reduce"):].lower()
    fn.__doc__ = f"{op_type} over ``axis`` (default: all axes)."
    return fn


sum, mean, max, min, prod = (_reduce(n) for n in ("ReduceSum", "ReduceMean", "ReduceMax",  # noqa: A001
                                                  "ReduceMin", "ReduceProd"))
logsum, logsumexp, sumsquare = _reduce("ReduceLogSum"), _reduce("ReduceLogSumExp"), _reduce("ReduceSumSquare")
l1, l2 = _reduce("ReduceL1"), _reduce("ReduceL2")


def median(t: Tensor, axis: Union[None, int, Iterable[int]] = None, keepdims: bool = False) -> Tensor:
    ax = axes_list(axis, t.rank)
    return node("ReduceMedian", [t], {"axes": ax, "keepdims": int(keepdims)}, GC, 2)[0]


def argmax(t: Tensor, dim: int = 0, keepdim: bool = False) -> Tensor:
    return cast(one("ArgMax", t, axis=int(dim), keepdims=int(keepdim)), "int32")


def argmin(t: Tensor, dim: int = 0, keepdim: bool = False) -> Tensor:
    return cast(one("ArgMin", t, axis=int(dim), keepdims=int(keepdim)), "int32")


def topk(t: Tensor, k: int, axis: int = -1, largest: bool = True, sorted: bool = True) -> Tuple[Tensor, Tensor]:  # noqa: A002
    v, i = node("TopK", [t, ints([k])], {"axis": int(axis), "largest": int(largest),
                                         "sorted": int(sorted)}, ONNX, 2)
    return v, cast(i, "int32")


def softmax(t: Tensor, axis: int = -1) -> Tensor:
    return one("Softmax", t, axis=int(axis))


def log_softmax(t: Tensor, axis: int = -1) -> Tensor:
    return one("LogSoftmax", t, axis=int(axis))


def cumsum(t: Tensor, dim: int = 0) -> Tensor:
    return one("CumSum", t, ints(dim))


def group_norm(t: Tensor, weight: Tensor, bias: Tensor, num_groups: int, eps: float = 1e-5) -> Tensor:
    return node("GroupNormalization", [t, weight, bias], {"num_groups": int(num_groups),
                                                          "epsilon": float(eps)}, GC, 3)[0]


def layer_norm(t: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Layer normalisation over the last dimension."""
    return one("LayerNormalization", t, weight, bias, axis=-1, epsilon=float(eps))


def batch_norm_inference(t: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, var: Tensor,
                         epsilon: float = 1e-5, momentum: float = 0.9) -> Tensor:
    return one("BatchNormalization", t, weight, bias, mean, var, epsilon=float(epsilon),
               momentum=float(momentum))


# ---------------------------------------------------------------------------------------
# Convolution and pooling

_PAD = {"not_set": "NOTSET", "same_upper": "SAME_UPPER", "same_lower": "SAME_LOWER", "valid": "VALID"}


def _pad_type(p: Any) -> str:
    return _PAD.get(str(getattr(p, "name", p)).lower(), str(p).upper())


def conv(t: Tensor, weight: Tensor, stride: Tuple[int, ...] = (1, 1), padding: Tuple[int, ...] = (0, 0, 0, 0),
         dilation: Tuple[int, ...] = (1, 1), groups: int = 1, pad_type: Any = "not_set",
         available_memory_proportions: Any = None, partials_types: Any = None,
         enable_conv_dithering: Any = None) -> Tensor:
    """N-d convolution (NCHW input, MCHW weights), as ONNX Conv."""
    return one("Conv", t, weight, strides=list(stride), pads=list(padding), dilations=list(dilation),
               group=int(groups), auto_pad=_pad_type(pad_type))


def _pool_attrs(t: Tensor, kernel_size, stride, padding, dilation, auto_pad, ceil_mode) -> dict:
    sp = t.rank - 2
    return {"kernel_shape": list(kernel_size), "strides": list(stride or [1] * sp),
            "pads": list(padding or [0] * 2 * sp), "dilations": list(dilation or [1] * sp),
            "auto_pad": _pad_type(auto_pad), "ceil_mode": int(ceil_mode)}


def average_pool(t: Tensor, kernel_size: Tuple[int, ...], stride: Optional[Tuple[int, ...]] = None,
                 padding: Optional[Tuple[int, ...]] = None, out_pads: Any = None,
                 dilation: Optional[Tuple[int, ...]] = None, in_dilation: Any = None,
                 auto_pad: Any = "not_set", ceil_mode: bool = False) -> Tensor:
    attrs = _pool_attrs(t, kernel_size, stride, padding, dilation, auto_pad, ceil_mode)
    return node("AveragePool", [t], attrs)[0]


def max_pool(t: Tensor, kernel_size: Tuple[int, ...], stride: Optional[Tuple[int, ...]] = None,
             padding: Optional[Tuple[int, ...]] = None, out_pads: Any = None,
             dilation: Optional[Tuple[int, ...]] = None, in_dilation: Any = None,
             auto_pad: Any = "not_set", ceil_mode: bool = False, storage_order: Any = None) -> Tensor:
    attrs = _pool_attrs(t, kernel_size, stride, padding, dilation, auto_pad, ceil_mode)
    return node("MaxPool", [t], attrs)[0]


# ---------------------------------------------------------------------------------------
# Shape


def reshape(t: Tensor, shape: Iterable[int]) -> Tensor:
    """Reshape; one dimension may be -1."""
    return one("Reshape", t, domain=GC, shape=[int(d) for d in shape])


def flatten(t: Tensor) -> Tensor:
    """Reshape to one dimension."""
    return reshape(t, (-1,))


def transpose(t: Tensor, permutation: Optional[Iterable[int]] = None) -> Tensor:
    perm = list(range(t.rank))[::-1] if permutation is None else [int(p) for p in permutation]
    return one("Transpose", t, perm=perm)


def concat(ts: Iterable[Tensor], axis: int = 0) -> Tensor:
    ts = list(ts)
    return node("Concat", ts, {"axis": int(axis)})[0]


def split(t: Tensor, splits: Union[int, List[int]], axis: int = 0) -> List[Tensor]:
    """Split into ``splits`` equal parts, or parts of the sizes in ``splits``."""
    dim = t.shape[axis]
    if isinstance(splits, int):
        if dim % splits:
            raise ValueError(f"split: axis {axis} of size {dim} does not divide into {splits} parts")
        splits = [dim // splits] * splits
    return node("Split", [t, ints(splits)], {"axis": int(axis)}, ONNX, len(splits))


def squeeze(t: Tensor, axes: Optional[Iterable[int]] = None) -> Tensor:
    """Remove size-1 dimensions (``axes``, default all of them)."""
    return one("Squeeze", t, None if axes is None else ints(list(axes)))


def unsqueeze(t: Tensor, axes: Iterable[int]) -> Tensor:
    return one("Unsqueeze", t, ints(list(axes)))


def slice(t: Tensor, start: Any = None, stop: Any = None, step: Any = None, axis: Any = None) -> Tensor:  # noqa: A001
    """NumPy-like slicing along ``axis`` (default: the first ``len(start)`` axes)."""
    def lst(v):
        return None if v is None else ([v] if isinstance(v, (int, np.integer)) else list(v))
    start, stop, step, axis = lst(start), lst(stop), lst(step), lst(axis)
    n = len(next(v for v in (start, stop, step, axis, [0]) if v is not None))
    axis = axis if axis is not None else list(range(n))
    step = step or [1] * n
    start = start or [0 if s > 0 else -1 for s in step]
    stop = stop or [_INT_MAX if s > 0 else -_INT_MAX for s in step]
    return one("Slice", t, ints(start), ints(stop), ints(axis), ints(step))


def subsample(t: Tensor, strides: Iterable[int]) -> Tensor:
    return one("Subsample", t, domain=GC, strides=[int(s) for s in strides])


# View ops: popxl's in-place spellings return an alias; here they return a new tensor (a later
# in-place change of the view does not reach the original).
reshape_, transpose_, slice_, flatten_ = reshape, transpose, slice, flatten
concat_ = concat


def _getitem(t: Tensor, key: Any) -> Tensor:
    """``t[key]``: ints, slices and ``...`` slice (ints drop their axis); a Tensor or integer
    array gathers along axis 0; a boolean tensor of t's shape selects with zeros elsewhere."""
    if isinstance(key, Tensor):
        if key.dtype == _dtype.as_dtype("bool"):
            return where(key, t, 0)
        return gather(t, key)
    if isinstance(key, (list, np.ndarray)):
        return gather(t, constant(np.asarray(key), "int32"))
    key = key if isinstance(key, tuple) else (key,)
    if builtins.any(k is Ellipsis for k in key):
        i = key.index(Ellipsis)
        key = key[:i] + (builtins.slice(None),) * (t.rank - len(key) + 1) + key[i + 1:]
    starts, stops, steps, axes, drop = [], [], [], [], []
    for ax, k in enumerate(key):
        if isinstance(k, (int, np.integer)):
            k = int(k)
            starts.append(k), stops.append(k + 1 if k != -1 else _INT_MAX), steps.append(1)
            axes.append(ax), drop.append(ax)
        elif isinstance(k, builtins.slice):
            if k == builtins.slice(None):
                continue
            s = 1 if k.step is None else int(k.step)
            starts.append(k.start if k.start is not None else (0 if s > 0 else -1))
            stops.append(k.stop if k.stop is not None else (_INT_MAX if s > 0 else -_INT_MAX))
            steps.append(s), axes.append(ax)
        else:
            raise TypeError(f"Unsupported index {k!r} for tensor '{t.id}'")
    out = slice(t, starts, stops, steps, axes) if axes else t
    return squeeze(out, drop) if drop else out


# ---------------------------------------------------------------------------------------
# Gather / scatter / dynamic slicing


def gather(t: Tensor, indices: Tensor, axis: int = 0, available_memory_proportion: Any = None,
           zero_OOR: bool = False) -> Tensor:
    """Out-of-range indices raise after the run; with ``zero_OOR`` they give zeros."""
    return one("Gather", t, indices, axis=int(axis), **({"zero_OOR": 1} if zero_OOR else {}))


tied_gather = gather


def scatter(t: Tensor, indices: Tensor, values: Any, axis: int = 0,
            available_memory_proportion: Any = None) -> Tensor:
    return one("ScatterElements", t, indices, as_tensor(values, t), axis=int(axis))


def scatter_reduce(data: Tensor, indices: Tensor, reduction: str = "sum", axis: int = 0,
                   axis_size: Optional[int] = None, initial_values: Optional[Tensor] = None,
                   available_memory_proportion: Any = None, enable_index_broadcast: bool = True) -> Tensor:
    size = data.shape[axis] if axis_size is None else axis_size
    return node("ScatterReduce", [data, indices, initial_values],
                {"axis": int(axis), "axis_size": int(size), "reduction": str(reduction),
                 "enable_index_broadcast": int(enable_index_broadcast)}, GC)[0]


def onehot(t: Tensor, num_classes: Any, values: Any, axis: int = -1) -> Tensor:
    depth = num_classes if isinstance(num_classes, Tensor) else ints([num_classes])
    vals = values if isinstance(values, Tensor) else constant(values, "float32")
    return one("OneHot", t, depth, vals, axis=int(axis))


def dynamic_slice(t: Tensor, index: Tensor, axes: List[int], sizes: List[int], no_overlap: bool = False) -> Tensor:
    return one("DynamicSlice", t, index, domain=GC, axes=list(axes), sizes=list(sizes),
               noOverlap=int(no_overlap))


def dynamic_update(t: Tensor, index: Tensor, t_update: Tensor, axes: List[int], sizes: List[int],
                   no_overlap: bool = False) -> Tensor:
    return one("DynamicUpdate", t, index, t_update, domain=GC, axes=list(axes), sizes=list(sizes),
               noOverlap=int(no_overlap))


dynamic_update_ = _make_inplace(dynamic_update)


def init(shape: Iterable[int], dtype: Any, name: Optional[str] = None, init_type: str = "zero",
         meta_shape: Any = None) -> Tensor:
    """A tensor of zeros (``init_type`` "zero" or "undef")."""
    return node("Init", [], {"shape": [int(d) for d in shape], "data_type": onnx_type(dtype)}, GC,
                name=name)[0]


def histogram(t: Tensor, levels: List[float], absolute_of_input: bool = False) -> Tensor:
    return one("Histogram", t, domain=GC, levels=list(levels), absoluteOfInput=int(absolute_of_input))


def print_tensor(t: Tensor, title: Optional[str] = None, print_gradient: bool = True, **_: Any) -> Tensor:
    return one("PrintTensor", t, domain=GC, title=title or t.id, print_gradient=int(print_gradient))


def ipu_copy(t: Tensor, destination: int, source: Optional[int] = None) -> Tensor:
    """Copy to IPU ``destination`` (an annotated Identity)."""
    from ..context import ipu
    with ipu(destination):
        return identity(t)


def io_tile_copy(t: Tensor) -> Tensor:
    return identity(t)


# ---------------------------------------------------------------------------------------
# Losses


def nll_loss(probs: Tensor, labels: Tensor, ignore_index: Optional[int] = None,
             reduction: Any = "Mean", log_prob: bool = False) -> Tensor:
    """Negative log likelihood of ``labels`` under ``probs`` (class axis last)."""
    attrs = {"reduction": reduction_name(reduction), "inputIsLogProbability": int(log_prob)}
    if ignore_index is not None:
        attrs["ignoreIndex"] = int(ignore_index)
    return node("Nll", [probs, labels], attrs, GC)[0]


def nll_loss_with_softmax_grad(probs: Tensor, labels: Tensor, loss_grad: Union[float, Tensor] = 1,
                               ignore_index: Optional[int] = None, reduction: Any = "Mean"
                               ) -> Tuple[Tensor, Tensor]:
    """Softmax of ``probs`` (logits), its nll loss, and the loss's gradient w.r.t. ``probs``
    scaled by ``loss_grad``."""
    attrs = {"reduction": reduction_name(reduction)}
    if ignore_index is not None:
        attrs["ignoreIndex"] = int(ignore_index)
    g = as_tensor(loss_grad, probs)
    loss, dx = node("NllWithSoftmaxGrad", [probs, labels, g], attrs, POPXL, 2)
    return loss, dx


# ---------------------------------------------------------------------------------------
# Random (seeded by uint32[2] seed tensors)


def random_uniform(seed_tensor: Tensor, shape: Tuple[int, ...], low: float = 0.0, high: float = 1.0,
                   dtype: Any = "float32") -> Tensor:
    return one("RandomUniform", seed_tensor, domain=POPXL, shape=[int(d) for d in shape],
               low=float(low), high=float(high), dtype=onnx_type(dtype))


def random_normal(seed_tensor: Tensor, shape: Tuple[int, ...], mean: float = 0.0, std: float = 1.0,
                  dtype: Any = "float32") -> Tensor:
    return one("RandomNormal", seed_tensor, domain=POPXL, shape=[int(d) for d in shape],
               mean=float(mean), scale=float(std), dtype=onnx_type(dtype))


def dropout(t: Tensor, seed_tensor: Tensor, p: float) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p)."""
    return one("Dropout", t, seed_tensor, domain=POPXL, ratio=float(p))


def shaped_dropout(t: Tensor, seed_tensor: Tensor, shape: Iterable[int], ratio: float) -> Tensor:
    return one("Dropout", t, seed_tensor, domain=POPXL, ratio=float(ratio), shape=[int(d) for d in shape])


def split_random_seed(seed: Tensor, count: int = 2) -> Tuple[Tensor, ...]:
    """``count`` new seeds derived from ``seed``."""
    return tuple(node("SplitRandomSeed", [seed], {}, POPXL, int(count)))
