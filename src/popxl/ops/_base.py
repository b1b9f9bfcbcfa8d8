"""What every popxl op uses: append a node of a registry op to the current graph."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from popart.tensorinfo import onnx_dtype

from ..context import get_current_graph
from ..dtypes import dtype as _dtype
from .._versions import inplace  # noqa: F401  (every in-place op's, and the binding's)
from ..tensor import Tensor, constant

ONNX = "ai.onnx"
GC = "ai.graphcore"
POPXL = "ai.popxl"


# PopXL's output names, where they are not "<op type in lower case>_out": a tuple per output
# ("{t}": the first input's name, "{i}": the output's index, "{dtype}": the Cast's dtype).
_OUT_NAMES: dict[str, tuple[str, ...]] = {
    "Neg": ("negate_out",), "Max": ("maximum_out",), "Min": ("minimum_out",),
    "Cast": ("{t}_{dtype}",), "Reshape": ("{t}_reshaped",), "Squeeze": ("{t}_reshaped",),
    "Transpose": ("{t}_T",), "Split": ("{t}_split_{i}",), "ScaledAdd": ("scaled_add_out",),
    "IncrementMod": ("increment_mod_out",), "ReduceSumSquare": ("sumsquare_out",),
    "ReduceMedian": ("median_out", "median_indices_out"), "TopK": ("topk_out_value", "topk_out_indices"),
    "GroupNormalization": ("group_norm_out", "group_norm_mean", "group_norm_inv_std_dev"),
    "BatchNormalization": ("batch_norm_out",), "Resize": ("interpolate_out",),
    "RoiAlign": ("roi_align_out",), "GroupedGather": ("gather_out",),
    "ScatterElements": ("scatter_out",), "DynamicSlice": ("dynamic_slice_out",),
    "DynamicUpdate": ("dynamic_update_out",), "PrintTensor": ("print_out",),
    "PrintGradient": ("print_out",), "Nll": ("loss",), "NllWithSoftmaxGrad": ("loss", "dx"),
    "RandomUniform": ("random_uniform_out",), "RandomNormal": ("random_normal_out",),
    "Pow2ScaleThenCast": ("{t}_{dtype}",), "AllReduce": ("all_reduce_out_{i}",),
}
# Our int64 results that the op casts to PopXL's int32: the cast gets PopXL's name.
_CAST_LATER = {"ArgMax": ("argmax_out",), "ArgMin": ("argmin_out",), "TopK": (None, "topk_out_indices")}


def output_names(op_type: str, inputs: Sequence[Optional[Tensor]], attrs: dict,
                 num_outputs: int) -> list[str]:
    """The ids PopXL gives the outputs of ``op_type`` (before name scopes and uniquing):
    ``"<op>_out"`` (``ReduceMax`` -> ``max_out``), or PopXL's own (:data:`_OUT_NAMES`)."""
    src = next((t for t in inputs if t is not None), None)
    if op_type == "Cast" and getattr(src, "_cast_name", None):
        return [src._cast_name]
    if op_type == "Dropout" and "shape" in attrs:
        return ["shapeddropout_out"]
    if op_type == "Pow2ScaleThenCast" and attrs.get("no_grad") != "cast":
        return [{"matmul": "matmul_pow2scaled_out"}.get(attrs.get("no_grad"), src.name)]
    low = op_type[len("Reduce"):] if op_type.startswith("Reduce") else op_type
    names = _OUT_NAMES.get(op_type, (f"{low.lower()}_out",))
    dt = ""
    if "to" in attrs:
        from popart.tensorinfo import np_dtype
        dt = _dtype.as_dtype(np_dtype(attrs["to"]))._name
    return [names[min(i, len(names) - 1)].format(t=getattr(src, "name", ""), i=i, dtype=dt)
            for i in range(num_outputs)]


def node(op_type: str, inputs: Sequence[Optional[Tensor]], attrs: Optional[dict] = None,
         domain: str = ONNX, num_outputs: int = 1, name: Optional[str] = None) -> list[Tensor]:
    """Append ``domain::op_type`` to the current graph; returns its outputs, named ``name``
    when given, else as PopXL names them (:func:`output_names`)."""
    attrs = dict(attrs or {})
    out_names = None
    if name is None:
        out_names = output_names(op_type, inputs, attrs, num_outputs)
        later = _CAST_LATER.get(op_type, ())
        out_names = [f"{n}_int64" if later[i:i + 1] and later[i] else n for i, n in enumerate(out_names)]
    outs = get_current_graph()._add_node(op_type, inputs, attrs, domain, num_outputs, name, out_names)
    for t, cast_name in zip(outs, _CAST_LATER.get(op_type, ()) if name is None else ()):
        if cast_name:
            t._cast_name = cast_name
    return outs


def one(op_type: str, *inputs: Optional[Tensor], domain: str = ONNX, name: Optional[str] = None,
        **attrs: Any) -> Tensor:
    """A single-output node."""
    return node(op_type, inputs, attrs, domain, 1, name)[0]


def as_tensor(x: Any, like: Optional[Tensor] = None, dtype: Any = None) -> Tensor:
    """``x`` as a tensor of the current graph (literals become constants of ``like``'s dtype)."""
    if isinstance(x, Tensor):
        return x
    if dtype is None and like is not None:
        dtype = like.dtype
    return constant(x, dtype)


def ints(values: Union[int, Iterable[int]]) -> Tensor:
    """An int64 constant (axes, sizes and other compile-time operands)."""
    return constant(np.asarray(values, np.int64).reshape(-1), "int64", name="const_i64")


def view(base: Tensor, out: Tensor, fwd: Any, back: Any) -> Tensor:
    """Make ``out`` (``fwd(base)``) an alias of ``base``, as PopXL's view-changing in-place
    ops (``reshape_``, ``transpose_``, ``slice_``, ...) return: an in-place op on ``out``
    changes ``base`` (to ``back(base, out)``), and one on ``base`` changes ``out``."""
    out._alias_of = [*getattr(out, "_alias_of", ()), (base, back)]
    base._aliases = [*getattr(base, "_aliases", ()), (out, fwd)]
    return out


def onnx_type(dt: Any) -> int:
    return onnx_dtype(_dtype.as_dtype(dt).as_device_numpy())


def axes_list(axis: Union[None, int, Iterable[int]], rank: int) -> Optional[list[int]]:
    if axis is None:
        return None
    return [int(axis)] if isinstance(axis, (int, np.integer)) else [int(a) for a in axis]


def reduction_name(r: Any) -> str:
    """ReductionType (popart / popxl enum, string or int) as the loss ops' string."""
    if isinstance(r, str):
        return r
    if hasattr(r, "name"):
        return str(r.name)
    return ["Sum", "Mean", "NoReduction"][int(r)]


def reshape_(t: Tensor, shape: Any) -> Tensor:
    return one("Reshape", t, domain=GC, shape=[int(d) for d in shape])
