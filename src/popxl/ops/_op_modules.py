"""PopXL's per-op modules (``popxl.ops.conv``, ``popxl.ops.add``, ...), as importable modules.

PopXL defines each op in a module of its own, which ``popxl.ops`` re-exports. Here the ops
live in ``popxl.ops`` itself; :data:`_TABLE` names, for each of PopXL's op modules, the names
PopXL's file defines, and :func:`_materialise` registers a module holding them (the very
objects of ``popxl.ops``), so ``from popxl.ops.conv import PadType`` and
``import popxl.ops.conv`` work. As in PopXL, the attribute ``popxl.ops.add`` stays the
function (PopXL's ``popxl.ops.__init__`` binds the function over the submodule).

The names PopXL's op modules define besides the ops are defined below. Those that build
PopART C++ IR objects in PopXL (``multi_conv_options``, ``receptive_attributes``) return plain
Python records of the same fields here."""
from __future__ import annotations

import importlib.abc
import importlib.util
import math
import sys
import types
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from typing import Any, Dict, Iterable, List, Literal, Optional, Tuple, Union

from popart import ReductionType, ScatterReduction

from ..context import get_current_graph
from ..dtypes import uint32
from ..graph import Graph
from ..tensor import Tensor, constant
from ._base import GC, POPXL, node
from .call import ConditionalSiteInfo  # noqa: F401  (popxl.ops.conditional's)
from .utils import cast_if_needed, check_in_graph, check_tensor_ipu_and_tile_set

# module -> the names it defines; the modules whose only name is their own are listed in _SAME
_SAME = ("abs ceil cos cumsum div dropout dynamic_slice equal floor fmod greater "
         "host_load host_store init io_tile_copy ipu_copy isfinite isinf isnan l1 l2 "
         "logical_and logical_not logical_or logsum logsumexp mean median min mul negate onehot pow "
         "prod remote_store scatter shaped_dropout sign sin softmax split sqrt squeeze sub subsample "
         "sum sumsquare tanh topk where").split()
_TABLE: Dict[str, str] = {
    **{m: m for m in _SAME},
    "batch_norm": "batch_norm_inference", "add": "add add_", "argminmax": "argmax argmin",
    "cast": "cast pow2scale_cast_to_fp8 pow2scale_cast_from_fp8", "clip": "clip clamp",
    "code_copy": "CODE_LOCATION TO_IR_ENUM_MAP remote_code_load code_copy", "concat": "concat concat_",
    "conditional": "ConditionalSiteInfo conditional conditional_with_info",
    "conv": "PadType multi_conv_options conv conv_pow2scaled conv_transpose conv_transpose_pow2scaled",
    "detach": "detach detach_", "dynamic_update": "dynamic_update dynamic_update_", "exp": "exp exp_",
    "gather": "groupedgather gather tied_gather", "gelu": "gelu gelu_", "geluerf": "geluerf geluerf_",
    "group_norm": "group_norm layer_norm", "histogram": "histogram check_increment",
    "identity": "identity rename", "increment_mod": "increment_mod increment_mod_",
    "interpolate": "InterpolateType InterpolateNearestType InterpolateCoordinateTransformationType "
                   "interpolate",
    "lamb": "lamb_square", "log": "log log2", "matmul": "matmul matmul_pow2scaled", "max": "max maximum",
    "negative_log_likelihood": "REDUCTION_MAP REDUCTION_TYPE nll_loss nll_loss_with_softmax_grad",
    "pool": "receptive_attributes average_pool max_pool",
    "print_tensor": "PrintTensorFmt FloatFormat FLOAT_FORMAT_MAP print_tensor",
    "random": "random_uniform random_normal", "random_seed": "create_random_seed split_random_seed",
    "relu": "relu relu_", "remote_load": "remote_load remote_load_ multiply_tuple",
    "repeat": "repeat repeat_with_info", "reshape": "reshape_handle_negative_axis reshape reshape_ flatten flatten_",
    "roialign": "roi_align", "scaled_add": "scaled_add scaled_add_",
    "scatter_reduce": "ScatterReductionType reduction_dict grouped_scatter_reduce scatter_reduce",
    "slice": "INT_MIN INT_MAX slice slice_ process_args", "swish": "swish swish_",
    "transpose": "transpose transpose_",
}


def _ops() -> types.ModuleType:
    return sys.modules[__package__]


# ---------------------------------------------------------------------------------------
# code_copy: graphs' code is always in executable memory on XLA

CODE_LOCATION = Literal["executable", "compute_buffer", "io_buffer"]
TO_IR_ENUM_MAP: Dict[str, str] = {"io_buffer": "Buffer", "compute_buffer": "Buffer",
                                  "executable": "ExecutableMemory"}


def remote_code_load(graph: Graph, destination: CODE_LOCATION) -> None:
    """Load ``graph``'s code into ``destination`` ("executable": the only one PopXL
    implements). On XLA a graph's code is always in executable memory: nothing to do.

    Raises:
        ValueError: ``graph`` is the graph being built.
        NotImplementedError: another destination (as PopXL).
    """
    g = get_current_graph()
    if g == graph:
        raise ValueError(f"The remote_code_load op cannot load the code for the graph it resides in ({g.id}).")
    if destination != "executable":
        raise NotImplementedError(f"destination == '{destination}' for remote_code_load op, graph "
                                  f"{graph.id} not supported.")


def code_copy(graph: Graph, source: CODE_LOCATION, destination: CODE_LOCATION) -> None:
    """Not implemented, as in PopXL.

    Raises:
        NotImplementedError: always.
    """
    raise NotImplementedError(f"{__package__}.code_copy op is not yet implemented.")


# ---------------------------------------------------------------------------------------
# conv / pool: PopART's option records, as plain records


def multi_conv_options(sess_opts: Any, attr_param: Any, available_memory_proportions: Any,
                       partials_types: Any, enable_conv_dithering: Any) -> types.SimpleNamespace:
    """PopART's MultiConvOptions for a convolution: the session's ``convolutionOptions``
    and the per-convolution settings that are given (accepted; XLA chooses its own
    convolution plan)."""
    return types.SimpleNamespace(
        convolutionOptions=dict(getattr(sess_opts, "convolutionOptions", None) or {}),
        availableMemoryProportions=list(available_memory_proportions or []),
        partialsTypes=list(partials_types or []), enableConvDithering=list(enable_conv_dithering or []))


def receptive_attributes(strides: Any, pads: Any, out_pads: Any, dilations: Any, in_dilations: Any,
                         auto_pad: Any, ceil_mode: Any) -> types.SimpleNamespace:
    """PopART's ReceptiveOpAttributes of a pooling: the fields given (empty lists, "NOTSET"
    and 0 otherwise)."""
    pad = {"not_set": "NOTSET", "same_upper": "SAME_UPPER", "same_lower": "SAME_LOWER", "valid": "VALID"}
    return types.SimpleNamespace(strides=list(strides or []), pads=list(pads or []), outPads=list(out_pads or []),
                                 dilations=list(dilations or []), inDilations=list(in_dilations or []),
                                 auto_pad=pad[auto_pad] if auto_pad else "NOTSET", ceil_mode=int(bool(ceil_mode)))


# ---------------------------------------------------------------------------------------
# histogram, interpolate, negative_log_likelihood, print_tensor, scatter_reduce: types, tables


def check_increment(levels: List[float]) -> None:
    """Raises ValueError unless ``levels`` increase strictly."""
    if not all(a < b for a, b in zip(levels, levels[1:])):
        raise ValueError(f"The input levels `{levels}` is not a monotonically increasing list.")


InterpolateType = Literal["nearest", "linear", "cubic"]
InterpolateNearestType = Literal["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
InterpolateCoordinateTransformationType = Literal["half_pixel", "pytorch_half_pixel", "align_corners",
                                                  "asymmetric", "tf_crop_and_resize"]

REDUCTION_MAP = {"mean": ReductionType.Mean, "sum": ReductionType.Sum, "none": ReductionType.NoReduction}
REDUCTION_TYPE = Literal["mean", "sum", "none"]

FloatFormat = Literal["auto", "fixed", "scientific", "none"]
FLOAT_FORMAT_MAP = {"auto": "Auto", "fixed": "Fixed", "scientific": "Scientific", "none": "None_"}


@dataclass(frozen=True)
class PrintTensorFmt:
    """PopART's PrintTensorFmt: how print_tensor formats a tensor (``floatFormat`` one of
    :data:`FLOAT_FORMAT_MAP`'s values)."""
    summariseThreshold: int = 1000
    edgeItems: int = 3
    maxLineWidth: int = 75
    digits: int = 8
    floatFormat: str = "Auto"
    separator: str = " "
    openBracket: str = "["
    closeBracket: str = "]"


ScatterReductionType = Literal["sum", "min", "max", "none"]
reduction_dict = {"sum": ScatterReduction.Sum, "min": ScatterReduction.Min, "max": ScatterReduction.Max,
                  "none": ScatterReduction.NoReduction}


def grouped_scatter_reduce(data: Tensor, indices: Tensor, reduction: ScatterReductionType,
                           initial_values: Optional[Tensor] = None, axis: int = 0,
                           axis_size: Optional[int] = None, group_size: int = 1,
                           enable_index_broadcast: bool = True,
                           available_memory_proportion: Optional[float] = None) -> Tensor:
    """:func:`popxl.ops.scatter_reduce` within groups: with ``group_size`` > 1 the leading
    axis of ``data``, ``indices`` (and ``initial_values``) is the group, and ``axis`` counts
    it; each group scatters into its own ``axis_size`` positions.

    Raises:
        ValueError: neither ``initial_values`` nor ``axis_size`` given; an unknown reduction.
    """
    if initial_values is None and axis_size is None:
        raise ValueError("One of initial_values and axis_size must be specified")
    if reduction not in reduction_dict:
        raise ValueError(f"The reduction must be one of {list(reduction_dict.keys())}")
    size = initial_values.shape[axis] if axis_size is None else axis_size
    if int(group_size) == 1:
        return _ops().scatter_reduce(data, indices, reduction, initial_values, axis, size,
                                     enable_index_broadcast, available_memory_proportion)
    return node("ScatterReduce", [data, indices, initial_values],
                {"axis": int(axis), "axis_size": int(size), "reduction": reduction,
                 "group_size": int(group_size), "enable_index_broadcast": int(enable_index_broadcast)}, GC)[0]


# ---------------------------------------------------------------------------------------
# log2, random seeds, shapes and slices


def log2(t: Tensor) -> Tensor:
    """Base-2 logarithm: ``log(t) / log(2)`` in ``t``'s dtype."""
    ops = _ops()
    return ops.log(t) / ops.log(constant(2, t.dtype))


def create_random_seed(seed: Tensor, modifier: Tensor) -> Tensor:
    """A new seed ``[L, r]`` from ``seed = [L, R]``: ``r`` is drawn from the random stream
    seeded by ``[L, R + modifier]`` (PopART's ModifyRandomSeed; the generator is JAX's, not
    Poplar's, so the values differ from an IPU's).

    Raises:
        ValueError: ``seed`` not of shape (2,) and dtype uint32.
    """
    g = get_current_graph()
    check_in_graph(g, seed=seed, modifier=modifier)
    check_tensor_ipu_and_tile_set(seed=seed, modifier=modifier)
    if seed.shape != (2,) or seed.dtype != uint32:
        raise ValueError(f"seed Tensor must be shape=(2,) dtype=uint32. Provided {seed}")
    ops = _ops()
    left, right = ops.split(seed, 2)
    meta = ops.concat([left, right + ops.reshape(cast_if_needed(modifier, uint32), (1,))])
    drawn = node("SplitRandomSeed", [meta], {}, POPXL, 1, name="modified_seed")[0]
    return ops.concat([left, drawn[1:2]])


def multiply_tuple(tup: Iterable[int]) -> int:
    """The product of the elements of ``tup`` (1 for none)."""
    return math.prod(tup)


def reshape_handle_negative_axis(t: Tensor, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """``shape`` with a -1 replaced by the size that keeps ``t``'s element count."""
    known = math.prod(abs(int(d)) for d in shape)
    return tuple(d if d > 0 else t.nelms // known for d in shape)


INT_MIN = -(2 ** 31)
INT_MAX = 2 ** 31 - 1
_Ints = Optional[Union[int, List[Optional[int]]]]


def process_args(start: _Ints = None, stop: _Ints = None, step: _Ints = None,
                 axis: Optional[Union[int, List[int]]] = None) -> Tuple[List[int], List[int], List[int], List[int]]:
    """:func:`popxl.ops.slice`'s arguments as four lists of one length: ``step`` 1, ``start``
    0 (-1 for a negative step), ``stop`` INT_MAX (INT_MIN) and ``axis`` 0, 1, ... where not
    given (or None).

    Raises:
        ValueError: lists of different lengths.
    """
    args = {k: [v] if isinstance(v, int) else v for k, v in
            dict(start=start, stop=stop, step=step, axis=axis).items()}
    n = None
    for k, v in args.items():
        if v is not None:
            if n is None:
                n = len(v)
            elif len(v) != n:
                raise ValueError(f"All inputs must have same length. `{k}` has length {len(v)} != {n}.")
    n = n or 0
    step_ = [1 if e is None else e for e in (args["step"] or [None] * n)]
    axis_ = list(range(n)) if args["axis"] is None else list(args["axis"])
    start_ = [(0 if s > 0 else -1) if e is None else e for e, s in zip(args["start"] or [None] * n, step_)]
    stop_ = [(INT_MAX if s > 0 else INT_MIN) if e is None else e for e, s in zip(args["stop"] or [None] * n, step_)]
    return start_, stop_, step_, axis_


# ---------------------------------------------------------------------------------------


_ABSENT = object()


class _OpModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds (``importlib.util.find_spec``) and fills the modules of :data:`_TABLE`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[ModuleSpec]:
        pkg, _, mod = fullname.rpartition(".")
        return ModuleSpec(fullname, self, origin=__file__) if pkg == __package__ and mod in _TABLE else None

    def exec_module(self, module: types.ModuleType) -> None:
        ops, here = _ops(), globals()
        names = _TABLE[module.__name__.rpartition(".")[2]].split()
        module.__doc__ = f"PopXL's ``{module.__name__}``: {', '.join(names)} (see ``{__name__}``)."
        for n in names:   # (a name popxl.ops lost is left out: tests/test_popxl_modules.py lists it)
            value = vars(ops).get(n, here.get(n, _ABSENT))
            if value is not _ABSENT:
                setattr(module, n, value)


def _materialise() -> None:
    """Register the modules of :data:`_TABLE` in ``sys.modules`` now, so importing one does
    not set it as an attribute of ``popxl.ops`` (where the op functions stay)."""
    finder = _OpModules()
    sys.meta_path.append(finder)
    for mod in _TABLE:
        spec = finder.find_spec(f"{__package__}.{mod}")
        m = importlib.util.module_from_spec(spec)
        finder.exec_module(m)
        sys.modules[spec.name] = m


_materialise()
