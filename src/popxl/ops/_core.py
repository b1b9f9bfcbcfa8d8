"""The ops of ``popxl.ops`` (which re-exports them; its submodules use them from here, so
that none imports the package)."""
from __future__ import annotations

import builtins
from typing import Any, Iterable, List, Literal, Optional, Tuple, Union

import numpy as np

from ..dtypes import dtype as _dtype
from ..tensor import Tensor, constant
from ._base import GC, ONNX, POPXL, as_tensor, axes_list, inplace, ints, node, one, onnx_type, \
    reduction_name, view

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
reciprocal, softplus = _unary("Reciprocal"), _unary("Softplus")
geluerf, swish, detach = _unary("GeluErf", GC), _unary("Swish", GC), _unary("Detach", GC)

add, sub, mul, div = (_binary(n) for n in ("Add", "Sub", "Mul", "Div"))
equal, less = _binary("Equal"), _binary("Less")
greater_equal, less_equal = _binary("GreaterOrEqual"), _binary("LessOrEqual")
logical_and, logical_or, logical_xor = _binary("And"), _binary("Or"), _binary("Xor")
fmod = _binary("Fmod", GC)


def identity(t: Tensor, output_name: Optional[str] = None) -> Tensor:
    """``t`` unchanged, as a new tensor (named ``output_name``, default ``identity_<name>``):
    also a way to rename a tensor."""
    return one("Identity", t, name=output_name or f"identity_{t.name}")


rename = identity


def greater(input: Tensor, other: Any) -> Tensor:  # noqa: A002
    """``input > other`` elementwise (NumPy broadcasting)."""
    if not isinstance(input, Tensor):
        input = as_tensor(input, other)  # noqa: A001
    return one("Greater", input, as_tensor(other, input))


def pow(t: Tensor, e: Any) -> Tensor:  # noqa: A001
    """``t ** e`` elementwise (``e`` a tensor or a number of t's dtype)."""
    if not isinstance(t, Tensor):
        t = as_tensor(t, e)
    return one("Pow", t, as_tensor(e, t))


def _variadic(op_type: str, what: str):
    def fn(*ts: Any) -> Tensor:
        if len(ts) == 1 and isinstance(ts[0], (list, tuple)):
            ts = tuple(ts[0])
        like = next((t for t in ts if isinstance(t, Tensor)), None)
        if like is None:
            raise ValueError(f"{what} needs at least one Tensor")
        return node(op_type, [as_tensor(t, like) for t in ts], {}, ONNX)[0]
    fn.__name__ = fn.__qualname__ = what
    fn.__doc__ = f"Elementwise {what} of the tensors ``ts`` (NumPy broadcasting)."
    return fn


maximum, minimum = _variadic("Max", "maximum"), _variadic("Min", "minimum")


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


def clip(t: Tensor, min: Optional[float] = float("-inf"), max: Optional[float] = float("inf")  # noqa: A002
         ) -> Tensor:
    """Clip the elements of ``t`` to [min, max] (NaN stays NaN)."""
    lo = None if min is None or min == float("-inf") else constant(min, t.dtype)
    hi = None if max is None or max == float("inf") else constant(max, t.dtype)
    return one("Clip", t, lo, hi)


clamp = clip


def cast(t: Tensor, data_type: Any) -> Tensor:
    """``t`` as ``data_type``.

    Raises:
        TypeError: for float8 ``data_type`` (use :func:`pow2scale_cast_to_fp8`).
    """
    dt = _dtype.as_dtype(data_type)
    if dt.name in ("float8_143", "float8_152"):
        raise TypeError(f"Data type {dt} not supported for cast, please consider "
                        f"pow2scale_cast_to_fp8 or pow2scale_cast_from_fp8")
    return one("Cast", t, to=onnx_type(dt))


def scale(t: Tensor, factor: float) -> Tensor:
    return one("Scale", t, domain=GC, scale=float(factor))


def scaled_add(X: Tensor, Y: Tensor, a: Union[float, Tensor] = 1.0, b: Union[float, Tensor] = 1.0) -> Tensor:
    """a * X + b * Y (scalars or scalar tensors). PopART's ScaledAddOpx takes a tensor ``a``
    only with a tensor ``b``, and a tensor ``b`` only with ``a`` == 1.

    Raises:
        popart_exception: for those two combinations, with PopART's message.
    """
    from popart.errors import popart_exception
    if isinstance(a, Tensor) and not isinstance(b, Tensor):
        raise popart_exception("Unsupported tensor scale0 with non-tensor scale1.")
    if isinstance(b, Tensor) and not isinstance(a, Tensor) and float(a) != 1.0:
        raise popart_exception(f"Unsupported scale0 {float(a)} with tensor scale1.")
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
geluerf_ = _make_inplace(geluerf)
add_, sub_, mul_, div_ = (_make_inplace(f) for f in (add, sub, mul, div))
scaled_add_, increment_mod_ = _make_inplace(scaled_add), _make_inplace(increment_mod)
copy_ = _make_inplace(lambda t, src: identity(src if src.dtype == t.dtype else cast(src, t.dtype)))

# ---------------------------------------------------------------------------------------
# Matmul, reductions, normalisation


def matmul(lhs: Tensor, rhs: Tensor, available_memory_proportion: Optional[float] = None,
           output_type: Any = None, partials_type: Any = None) -> Tensor:
    """Matrix product (NumPy matmul broadcasting), cast to ``output_type`` when given.
    ``partials_type`` (float16 / float32) is checked; products accumulate in XLA's type."""
    if partials_type is not None and _dtype.as_dtype(partials_type).name not in ("float16", "float32"):
        raise ValueError(f"dtype {partials_type} is not valid, must be float16 or float32")
    out = one("MatMul", lhs, as_tensor(rhs, lhs))
    return out if output_type is None or _dtype.as_dtype(output_type) == out.dtype else cast(out, output_type)


def _check_pow2scaled(a: Tensor, b: Tensor, log2_scale: Tensor, what: str) -> None:
    fp8 = ("float8_143", "float8_152")
    if a.dtype.name not in fp8 or b.dtype.name not in fp8:
        raise TypeError(f"Scaled {what} operands must be of dtype popxl.float8_143 or popxl.float8_152")
    if log2_scale.rank > 0:
        raise ValueError("Log2 scale argument must be a scalar tensor")
    if log2_scale.dtype.name != "int32":
        raise TypeError("Log2 scale tensor must be of type popxl.int32")


def _pow2scale_then_cast(t: Tensor, log2_scale: Tensor, to: Any, no_grad: str) -> Tensor:
    """``cast(t * 2**log2_scale, to)``; differentiating it raises PopART's error for the
    float8 op ``no_grad`` ("cast", "matmul" or "conv": PopART has no float8 grad ops)."""
    return one("Pow2ScaleThenCast", t, log2_scale, domain=POPXL, to=onnx_type(to), no_grad=no_grad)


def _to_f32(t: Tensor) -> Tensor:
    return one("Cast", t, to=onnx_type("float32"))


def matmul_pow2scaled(lhs: Tensor, rhs: Tensor, log2_scale: Tensor,
                      available_memory_proportion: Optional[float] = None) -> Tensor:
    """float16 ``matmul(lhs, rhs) * 2**log2_scale`` of float8 operands (the products and sums
    in float32, one rounding to float16).

    Raises:
        TypeError: operands not float8_143 / float8_152, or ``log2_scale`` not int32.
        ValueError: ``log2_scale`` not a scalar.
    """
    _check_pow2scaled(lhs, rhs, log2_scale, "matmul")
    return _pow2scale_then_cast(one("MatMul", _to_f32(lhs), _to_f32(rhs)), log2_scale, "float16", "matmul")


def pow2scale_cast_to_fp8(t: Tensor, log2_scale: Tensor, data_type: Any) -> Tensor:
    """``cast(t * 2**log2_scale, data_type)`` for float8 ``data_type`` (round to nearest even;
    values out of range become NaN).

    Raises:
        TypeError: ``data_type`` not float8_143 / float8_152, or ``log2_scale`` not int32.
        ValueError: ``log2_scale`` not a scalar.
    """
    dt = _dtype.as_dtype(data_type)
    if dt.name not in ("float8_143", "float8_152"):
        raise TypeError(f"Data type {dt} not supported for pow2scale_cast_to_fp8")
    _check_log2_scale(log2_scale)
    return _pow2scale_then_cast(t, log2_scale, dt, "cast")


def pow2scale_cast_from_fp8(t: Tensor, log2_scale: Tensor, data_type: Any) -> Tensor:
    """``cast(t, data_type) * 2**log2_scale`` for float8 ``t`` and float16 / float32
    ``data_type``.

    Raises:
        TypeError: ``data_type`` not float16 / float32, or ``log2_scale`` not int32.
        ValueError: ``log2_scale`` not a scalar.
    """
    dt = _dtype.as_dtype(data_type)
    if dt.name not in ("float16", "float32"):
        raise TypeError(f"Data type {dt} not supported for pow2scale_cast_from_fp8")
    _check_log2_scale(log2_scale)
    if t.dtype.name not in ("float8_143", "float8_152"):
        from popart.errors import popart_exception
        raise popart_exception("Casting from FLOAT8 is only supported for FLOAT8_143 and FLOAT8_152 "
                               f"input types. This is for op pow2scale_cast_from_fp8 of '{t.id}'.")
    return _pow2scale_then_cast(t, log2_scale, dt, "cast")


def _check_log2_scale(log2_scale: Tensor) -> None:
    if log2_scale.rank > 0:
        raise ValueError("Log2 scale argument must be a scalar tensor")
    if log2_scale.dtype.name != "int32":
        raise TypeError("Log2 scale tensor must be of type popxl.int32")


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


def topk(t: Tensor, k: int, axis: int = -1, largest: bool = True, sorted: bool = True,  # noqa: A002
         available_memory_proportion: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """The ``k`` largest (or smallest) values along ``axis`` and their int32 indices."""
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
    """PopXL's layer_norm: :func:`group_norm` with one group, so each sample (dimension 0)
    is normalised over all its other dimensions, and ``weight`` / ``bias`` are per channel
    (dimension 1): for [N, C] the usual layer norm over C."""
    return group_norm(t, weight, bias, 1, eps)


def batch_norm_inference(t: Tensor, scale: Tensor, bias: Tensor, mean: Tensor, var: Tensor,
                         epsilon: float = 1e-5, momentum: float = 0.9) -> Tensor:
    """``scale * (t - mean) / sqrt(var + epsilon) + bias`` over the channel axis 1."""
    return one("BatchNormalization", t, scale, bias, mean, var, epsilon=float(epsilon),
               momentum=float(momentum))


# ---------------------------------------------------------------------------------------
# Convolution and pooling

PadType = Literal["not_set", "same_upper", "same_lower", "valid"]
_PAD = {"not_set": "NOTSET", "same_upper": "SAME_UPPER", "same_lower": "SAME_LOWER", "valid": "VALID"}


def _pad_type(p: Any) -> str:
    name = str(getattr(p, "name", p)).lower()
    if name not in _PAD:
        raise ValueError(f"pad type {p} is not valid, must be not_set, same_upper, same_lower or valid")
    return _PAD[name]


def _conv_attrs(stride, padding, dilation, groups, pad_type) -> dict:
    return {"strides": [int(v) for v in stride], "pads": [int(v) for v in padding],
            "dilations": [int(v) for v in dilation], "group": int(groups),
            "auto_pad": _pad_type(pad_type)}


def conv(t: Tensor, weight: Tensor, stride: Tuple[int, ...] = (1, 1), padding: Tuple[int, ...] = (0, 0, 0, 0),
         dilation: Tuple[int, ...] = (1, 1), groups: int = 1, pad_type: PadType = "not_set",
         available_memory_proportions: Any = None, partials_types: Any = None,
         enable_conv_dithering: Any = None) -> Tensor:
    """N-d convolution (NCHW input, MCHW weights), as ONNX Conv."""
    return node("Conv", [t, weight], _conv_attrs(stride, padding, dilation, groups, pad_type))[0]


def conv_pow2scaled(t: Tensor, weight: Tensor, log2_scale: Tensor, stride: Tuple[int, ...] = (1, 1),
                    padding: Tuple[int, ...] = (0, 0, 0, 0), dilation: Tuple[int, ...] = (1, 1),
                    groups: int = 1, pad_type: PadType = "not_set",
                    available_memory_proportions: Any = None, enable_conv_dithering: Any = None) -> Tensor:
    """float16 ``conv(t, weight) * 2**log2_scale`` of float8 ``t`` and ``weight`` (computed in
    float32, one rounding to float16).

    Raises:
        TypeError: operands not float8_143 / float8_152, or ``log2_scale`` not int32.
        ValueError: ``log2_scale`` not a scalar.
    """
    _check_pow2scaled(t, weight, log2_scale, "conv")
    y = node("Conv", [_to_f32(t), _to_f32(weight)], _conv_attrs(stride, padding, dilation, groups, pad_type))[0]
    return _pow2scale_then_cast(y, log2_scale, "float16", "conv")


def _conv_transpose_attrs(stride, padding, dilation, groups, pad_type, output_padding, output_shape) -> dict:
    attrs = _conv_attrs(stride, padding, dilation, groups, pad_type)
    if output_padding:
        attrs["output_padding"] = [int(v) for v in output_padding]
    if output_shape:
        attrs["output_shape"] = [int(v) for v in output_shape]
    return attrs


def conv_transpose(t: Tensor, weight: Tensor, stride: Tuple[int, ...] = (1, 1),
                   padding: Tuple[int, ...] = (0, 0, 0, 0), dilation: Tuple[int, ...] = (1, 1),
                   groups: int = 1, pad_type: PadType = "not_set", output_padding: Tuple[int, ...] = (),
                   output_shape: Tuple[int, ...] = (), available_memory_proportions: Any = None,
                   partials_types: Any = None, enable_conv_dithering: Any = None) -> Tensor:
    """Transposed convolution (ONNX ConvTranspose): ``t`` (N, C, *spatial), ``weight``
    (C, M / groups, *kernel). With ``output_shape`` the pads are derived from it."""
    attrs = _conv_transpose_attrs(stride, padding, dilation, groups, pad_type, output_padding, output_shape)
    return node("ConvTranspose", [t, weight], attrs)[0]


def conv_transpose_pow2scaled(t: Tensor, weight: Tensor, log2_scale: Tensor, stride: Tuple[int, ...] = (1, 1),
                              padding: Tuple[int, ...] = (0, 0, 0, 0), dilation: Tuple[int, ...] = (1, 1),
                              groups: int = 1, pad_type: PadType = "not_set",
                              output_padding: Tuple[int, ...] = (), output_shape: Tuple[int, ...] = (),
                              available_memory_proportions: Any = None,
                              enable_conv_dithering: Any = None) -> Tensor:
    """float16 ``conv_transpose(t, weight) * 2**log2_scale`` of float8 operands (see
    :func:`conv_pow2scaled`)."""
    _check_pow2scaled(t, weight, log2_scale, "conv")
    attrs = _conv_transpose_attrs(stride, padding, dilation, groups, pad_type, output_padding, output_shape)
    y = node("ConvTranspose", [_to_f32(t), _to_f32(weight)], attrs)[0]
    return _pow2scale_then_cast(y, log2_scale, "float16", "conv")


_RESIZE_CHOICES = (("interpolate type", ("nearest", "linear", "cubic")),
                   ("interpolate type", ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")),
                   ("interpolate type", ("half_pixel", "pytorch_half_pixel", "align_corners",
                                         "asymmetric", "tf_crop_and_resize")))


def interpolate(t: Tensor, scale_factor: Tuple[float, ...] = (1.0, 1.0, 1.0, 1.0), mode: str = "nearest",
                nearest_mode: str = "round_prefer_floor",
                coordinate_transformation_mode: str = "half_pixel") -> Tensor:
    """PopART's Resize: each dimension resized by ``scale_factor`` (output size
    floor(size * scale)) with ONNX Resize's ``mode``, ``nearest_mode`` and
    ``coordinate_transformation_mode``; gradients as PopART's ResizeGrad (see
    docs/popxl_ops.md: nearest by its own rule, linear not differentiable).

    Raises:
        ValueError: an unknown mode (PopXL's message).
        popart_exception: ``scale_factor`` not of ``t``'s rank, or ``tf_crop_and_resize``
            (which PopART's Resize does not implement).
    """
    for v, (what, allowed) in zip((mode, nearest_mode, coordinate_transformation_mode), _RESIZE_CHOICES):
        if v not in allowed:
            raise ValueError(f"{what} {v} is not valid, must be {', '.join(allowed[:-1])} or "
                             f"{allowed[-1]}.")
    return one("Resize", t, domain=POPXL, scales=[float(v) for v in scale_factor], mode=mode,
               nearest_mode=nearest_mode, coordinate_transformation_mode=coordinate_transformation_mode)


def roi_align(t: Tensor, rois: Tensor, batch_index: Tensor, output_size: Tuple[int, int],
              spatial_scale: float, sampling_ratio: int) -> Tensor:
    """Average pooling of each region of interest (ONNX RoiAlign, ``output_half_pixel``
    coordinates as torchvision's ``roi_align(aligned=False)``): ``t`` (N, C, H, W), ``rois``
    (R, 4) as [x1, y1, x2, y2], ``batch_index`` (R,) -> (R, C, *output_size)."""
    if batch_index.dtype.name != "int64":
        batch_index = cast(batch_index, "int64")     # ONNX RoiAlign's batch indices are int64
    return one("RoiAlign", t, rois, batch_index, coordinate_transformation_mode="output_half_pixel",
               mode="avg", output_height=int(output_size[0]), output_width=int(output_size[1]),
               sampling_ratio=int(sampling_ratio), spatial_scale=float(spatial_scale))


def _pool_attrs(t: Tensor, kernel_size, stride, padding, dilation, auto_pad, ceil_mode) -> dict:
    sp = t.rank - 2
    return {"kernel_shape": list(kernel_size), "strides": list(stride or [1] * sp),
            "pads": list(padding or [0] * 2 * sp), "dilations": list(dilation or [1] * sp),
            "auto_pad": _pad_type(auto_pad), "ceil_mode": int(ceil_mode)}


def _check_pool_extras(out_pads: Any, in_dilations: Any) -> None:
    if out_pads is not None and any(int(v) for v in out_pads):
        raise NotImplementedError("pooling with non-zero out_pads is not supported")
    if in_dilations is not None and any(int(v) != 1 for v in in_dilations):
        raise NotImplementedError("pooling with input dilations other than 1 is not supported")


def average_pool(t: Tensor, kernel_size: Tuple[int, ...], stride: Optional[Tuple[int, ...]] = None,
                 padding: Optional[Tuple[int, ...]] = None, out_pads: Any = None,
                 dilation: Optional[Tuple[int, ...]] = None, in_dilations: Any = None,
                 auto_pad: PadType = "not_set", ceil_mode: bool = False) -> Tensor:
    """Average pooling (ONNX AveragePool, padding excluded from the count)."""
    _check_pool_extras(out_pads, in_dilations)
    attrs = _pool_attrs(t, kernel_size, stride, padding, dilation, auto_pad, ceil_mode)
    return node("AveragePool", [t], attrs)[0]


def max_pool(t: Tensor, kernel_size: Tuple[int, ...], stride: Optional[Tuple[int, ...]] = None,
             padding: Optional[Tuple[int, ...]] = None, out_pads: Any = None,
             dilation: Optional[Tuple[int, ...]] = None, in_dilations: Any = None,
             auto_pad: PadType = "not_set", ceil_mode: bool = False, storage_order: str = "row") -> Tensor:
    """Max pooling (ONNX MaxPool). ``storage_order`` ("row" / "column") only orders the
    indices output that this op does not return."""
    if storage_order not in ("row", "column"):
        raise ValueError(f"storage_order must be 'row' or 'column', got {storage_order!r}")
    _check_pool_extras(out_pads, in_dilations)
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
    """Concatenate ``ts`` along ``axis``.

    Raises:
        TypeError: the tensors' dtypes differ (float8_143 with float8_152 too).
    """
    ts = list(ts)
    types_ = [t.dtype for t in ts]
    if len(set(types_)) > 1:
        raise TypeError(f"All inputs to a concat operation must have the same type: {types_}")
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


def _slice_lists(start: Any, stop: Any, step: Any, axis: Any) -> tuple:
    """:func:`slice`'s arguments as lists (None where not given); ``axis`` defaults to the
    first axes and ``step`` to ones."""
    def lst(v):
        return None if v is None else ([v] if isinstance(v, (int, np.integer)) else list(v))
    start, stop, step, axis = lst(start), lst(stop), lst(step), lst(axis)
    n = len(next(v for v in (start, stop, step, axis, [0]) if v is not None))
    return (start, stop, step or [1] * n, axis if axis is not None else list(range(n)))


def slice(t: Tensor, start: Any = None, stop: Any = None, step: Any = None, axis: Any = None) -> Tensor:  # noqa: A001
    """NumPy-like slicing along ``axis`` (default: the first ``len(start)`` axes)."""
    start, stop, step, axis = _slice_lists(start, stop, step, axis)
    start = start or [0 if s > 0 else -1 for s in step]
    stop = stop or [_INT_MAX if s > 0 else -_INT_MAX for s in step]
    return one("Slice", t, ints(start), ints(stop), ints(axis), ints(step))


def subsample(t: Tensor, strides: Union[int, Iterable[int]]) -> Tensor:
    """Every ``strides[i]``-th element of dimension i, from the first (size
    ceil(n / stride)). An int is the stride of dimension 0; missing strides are 1.

    Raises:
        ValueError: more strides than ``t`` has dimensions.
        popart_exception: a stride of 0.
    """
    strides = [int(strides)] if isinstance(strides, (int, np.integer)) else [int(s) for s in strides]
    if len(strides) > t.rank:
        raise ValueError("The length of subsample `strides` must not be greater than the rank of "
                         "the input tensor.")
    strides += [1] * (t.rank - len(strides))
    if 0 in strides:
        from popart.errors import popart_exception
        raise popart_exception(f"Strides invalid. 0 stride at index {strides.index(0)}")
    return one("Subsample", t, domain=GC, strides=strides)


# View ops: popxl's in-place spellings return an alias of their input(s): an in-place op on
# the view changes the input, and one on the input changes the view (``_base.view``).


def reshape_(t: Tensor, shape: Iterable[int]) -> Tensor:
    """:func:`reshape`, as an alias of ``t``."""
    out = reshape(t, shape)
    return view(t, out, lambda b: reshape(b, out.shape), lambda b, v: reshape(v, b.shape))


def flatten_(t: Tensor) -> Tensor:
    """:func:`flatten`, as an alias of ``t``."""
    return reshape_(t, (-1,))


def transpose_(t: Tensor, permutation: Optional[Iterable[int]] = None) -> Tensor:
    """:func:`transpose`, as an alias of ``t``."""
    perm = list(range(t.rank))[::-1] if permutation is None else [int(p) % t.rank for p in permutation]
    inv = list(np.argsort(perm))
    return view(t, transpose(t, perm), lambda b: transpose(b, perm), lambda b, v: transpose(v, inv))


def slice_(t: Tensor, start: Any = None, stop: Any = None, step: Any = None, axis: Any = None) -> Tensor:  # noqa: A001
    """:func:`slice`, as an alias of ``t`` (writing the view scatters its elements back)."""
    out = slice(t, start, stop, step, axis)
    if out.rank == 0 or t.nelms == 0:
        return out
    positions = np.arange(t.nelms).reshape(t.shape)
    sel = _slice_index(t, start, stop, step, axis)
    flat = constant(positions[sel].reshape(-1).astype(np.int32), "int32", name="slice_positions")
    return view(t, out, lambda b: slice(b, start, stop, step, axis),
                lambda b, v: reshape(scatter(reshape(b, (-1,)), flat, reshape(v, (-1,))), b.shape))


def _slice_index(t: Tensor, start: Any, stop: Any, step: Any, axis: Any) -> tuple:
    """The NumPy index of :func:`slice`'s elements (ONNX Slice's clamping is Python's)."""
    start, stop, step, axis = _slice_lists(start, stop, step, axis)
    key = [builtins.slice(None)] * t.rank
    for i, ax in enumerate(axis):
        key[int(ax) % t.rank] = builtins.slice(None if start is None else int(start[i]),
                                               None if stop is None else int(stop[i]), int(step[i]))
    return tuple(key)


def concat_(ts: Iterable[Tensor], axis: int = 0) -> Tensor:
    """:func:`concat`, as an alias of every tensor of ``ts``."""
    ts = list(ts)
    out = concat(ts, axis)
    ax, offsets = int(axis) % out.rank, np.cumsum([0] + [t.shape[int(axis)] for t in ts])
    for t, lo, hi in zip(ts, offsets[:-1], offsets[1:]):
        view(t, out, lambda b: concat(ts, axis),
             lambda b, v, lo=int(lo), hi=int(hi): slice(v, [lo], [hi], [1], [ax]))
    return out


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


def groupedgather(t: Tensor, indices: Tensor, axis: int = 0, group_size: int = 1,
                  available_memory_proportion: Optional[float] = None, zero_OOR: bool = False) -> Tensor:
    """Gather within groups: with ``group_size`` > 1 the leading axis of ``t`` and
    ``indices`` is the group (``group_size`` long) and ``axis`` (counting it, so not 0) is
    gathered in each group; with ``group_size`` 1 a plain :func:`gather`."""
    if int(group_size) == 1:
        return gather(t, indices, axis, available_memory_proportion, zero_OOR)
    if zero_OOR:
        raise NotImplementedError("groupedgather: zero_OOR with group_size > 1 is not supported")
    if t.shape[:1] != (int(group_size),) or indices.shape[:1] != (int(group_size),):
        raise ValueError(f"groupedgather: t {t.shape} and indices {indices.shape} need a leading "
                         f"group axis of size {group_size}")
    if int(axis) % t.rank == 0:
        raise ValueError(f"groupedgather: axis = {axis} indicates the dimension of the group")
    return one("GroupedGather", t, indices, domain=GC, axis=int(axis), group_size=int(group_size))


def scatter(t: Tensor, indices: Tensor, values: Any, axis: int = 0,
            available_memory_proportion: Any = None) -> Tensor:
    return one("ScatterElements", t, indices, as_tensor(values, t), axis=int(axis))


def scatter_reduce(data: Tensor, indices: Tensor, reduction: str = "sum",
                   initial_values: Optional[Tensor] = None, axis: int = 0,
                   axis_size: Optional[int] = None, enable_index_broadcast: bool = True,
                   available_memory_proportion: Any = None) -> Tensor:
    """Reduce (``"sum"``, ``"max"``, ``"min"``, ``"mul"``, ``"none"``) the slices of ``data``
    into the ``axis_size`` (default ``data.shape[axis]``) positions ``indices`` of ``axis``,
    starting from ``initial_values`` (default the reduction's identity)."""
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
    """A tensor of zeros (``init_type`` "zero" or "undef"); ``meta_shape``: see
    :attr:`popxl.Tensor.meta_shape`."""
    out = node("Init", [], {"shape": [int(d) for d in shape], "data_type": onnx_type(dtype)}, GC,
               name=name)[0]
    out._meta_shape = tuple(int(d) for d in meta_shape or ())
    return out


def histogram(t: Tensor, levels: List[float], absolute_of_input: bool = False) -> Tensor:
    """uint32 counts of ``t``'s elements (or their absolute values) in the len(levels) + 1
    bins (-inf, l0), [l0, l1), ..., [l_last, inf).

    Raises:
        ValueError: ``levels`` not strictly increasing.
    """
    levels = [float(v) for v in levels]
    if not all(a < b for a, b in zip(levels, levels[1:])):
        raise ValueError(f"The input levels `{levels}` is not a monotonically increasing list.")
    return one("Histogram", t, domain=GC, levels=list(levels), absoluteOfInput=int(absolute_of_input))


def print_tensor(t: Tensor, title: Optional[str] = None, print_self: bool = True,
                 print_gradient: bool = False, summarise_threshold: int = 1000, edge_items: int = 3,
                 max_line_width: int = 75, digits: int = 8, float_format: str = "auto",
                 separator: str = " ", open_bracket: str = "[", close_bracket: str = "]") -> Tensor:
    """``t`` unchanged, printed at run time with ``title`` (default the tensor's id) when
    ``print_self``, and its gradient printed (in the backward pass) when ``print_gradient``.
    The formatting options are kept as attributes of the node; the values print in NumPy's
    format."""
    if not print_self:
        if not print_gradient:
            return identity(t)
        return one("PrintGradient", t, domain=POPXL, title=title or t.id)
    return one("PrintTensor", t, domain=GC, title=title or t.id, print_gradient=int(print_gradient),
               print_self=int(print_self), summariseThreshold=int(summarise_threshold),
               edgeItems=int(edge_items), maxLineWidth=int(max_line_width), digits=int(digits),
               floatFormat=str(float_format), separator=str(separator), openBracket=str(open_bracket),
               closeBracket=str(close_bracket))


def ipu_copy(t: Tensor, destination: int, source: Optional[int] = None) -> Tensor:
    """Copy to IPU ``destination`` (an annotated Identity)."""
    from ..context import ipu
    with ipu(destination):
        return identity(t, output_name=f"{t.name}_c{destination}")


def io_tile_copy(t: Tensor) -> Tensor:
    """Copy to the IO tiles (an Identity here: XLA has no tile sets)."""
    return identity(t, output_name=f"{t.name}_iotilecopy")


# ---------------------------------------------------------------------------------------
# Losses


_NLL_REDUCTIONS = {"mean": "Mean", "sum": "Sum", "none": "NoReduction"}


def _nll_reduction(reduction: Any) -> str:
    """popxl's reduction string ("mean" / "sum" / "none"; a ReductionType is accepted too)."""
    if not isinstance(reduction, str):
        return reduction_name(reduction)
    if reduction not in _NLL_REDUCTIONS:
        raise ValueError(f"Not a valid reduction: {reduction}. "
                         f"Must choose from: {', '.join(_NLL_REDUCTIONS)}")
    return _NLL_REDUCTIONS[reduction]


def nll_loss(probs: Tensor, labels: Tensor, ignore_index: Optional[int] = None,
             reduction: Any = "mean", log_prob: bool = False) -> Tensor:
    """Negative log likelihood of ``labels`` under ``probs`` (class axis last): PopART's Nll,
    -log(max(p[label], 1e-7)) (6.104e-5 in float16), or -p[label] with ``log_prob``; labels
    equal to ``ignore_index`` count for nothing. Differentiated with NllGrad's rule."""
    attrs = {"reduction": _nll_reduction(reduction), "inputIsLogProbability": int(log_prob)}
    if ignore_index is not None:
        attrs["ignoreIndex"] = int(ignore_index)
    return node("Nll", [probs, labels], attrs, GC)[0]


def nll_loss_with_softmax_grad(probs: Tensor, labels: Tensor, loss_grad: Union[float, Tensor] = 1,
                               ignore_index: Optional[int] = None, reduction: Any = "mean"
                               ) -> Tuple[Tensor, Tensor]:
    """PopART's NlllWithSoftmaxGradDirect: ``probs`` are the output of a softmax (over the
    last axis) of some ``x``; returns the nll loss -log(p[label] + 1e-7) (reduced) and
    dE/dx = (p - onehot(label)) * ``loss_grad`` (a float32 constant when a number), scaled
    as the loss is reduced and zero for ignored labels (see docs/popxl_ops.md)."""
    attrs = {"reduction": _nll_reduction(reduction)}
    if ignore_index is not None:
        attrs["ignoreIndex"] = int(ignore_index)
    g = loss_grad if isinstance(loss_grad, Tensor) else constant(loss_grad, "float32")
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


def split_random_seed(seed: Tensor, n: int = 2, *, count: Optional[int] = None) -> Tuple[Tensor, ...]:
    """``n`` new seeds derived from ``seed`` (``count`` is an alias of ``n``)."""
    n = n if count is None else count
    if int(n) < 1:
        raise ValueError(f"split_random_seed: n must be >= 1, got {n}")
    return tuple(node("SplitRandomSeed", [seed], {}, POPXL, int(n)))


def lamb_square(t: Tensor) -> Tensor:
    """The sum of the squares of all elements of ``t`` (a float32 scalar; LAMB's norms)."""
    return one("ReduceSumSquare", cast(t, "float32") if t.dtype.name != "float32" else t, None,
               keepdims=0)

