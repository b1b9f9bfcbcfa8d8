"""ONNX -> IR: read a model (path, bytes or ModelProto) into a :class:`Graph`."""
from __future__ import annotations

import functools
import heapq
import math
import os
import weakref
from typing import Any, Optional, Union

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import ModelError, UnsupportedOperatorError, noted, popart_exception
from ..fileio import atomic_patch, is_own_file, note_own_file, read_exact, unpack_popart_data
from ..ops.registry import GRAPHCORE_DOMAIN, ONNX_DOMAIN, canonical_domain, decode_attr
from ..tensorinfo import TensorInfo, to_datatype
from .graph import Graph, Node

ModelLike = Union[str, bytes, onnx.ModelProto, os.PathLike]
MIN_ONNX_OPSET = 1   # PopART started at 6; older models import too


# formatModelProtoString's escapes (filereader.cpp); other bytes outside ' '..'~' as \xHH
_PROTO_STRING_ESCAPES = {ord("{"): "{{", ord("}"): "}}", ord("\\"): "\\\\", ord("'"): "\\'",
                         ord("\n"): "\\n", ord("\t"): "\\t", ord("\r"): "\\r"}


def _not_a_model(data: bytes, note: str) -> ModelError:
    """PopART's error for a model string that is neither a file nor a ModelProto
    (filereader.cpp getModelFromString), the string as formatModelProtoString shows it: its
    first 101 bytes, escaped, then "..."."""
    shown = "".join(_PROTO_STRING_ESCAPES.get(c, chr(c) if 32 <= c <= 126 else f"\\x{c:02x}")
                    for c in data[:101]) + ("..." if len(data) > 100 else "")
    return noted(ModelError(f"Failed to load a ModelProto from the string '{shown}'.\nCheck "
                            f"that it is either a valid path to an existing onnx model file, or "
                            f"is a valid onnx ModelProto string."), note)


def load_model(model: ModelLike) -> tuple[onnx.ModelProto, Optional[str]]:
    """The ModelProto of a file path, serialized bytes or ModelProto, and the folder external
    data is relative to (None when the model did not come from a file)."""
    if isinstance(model, onnx.ModelProto):
        return model, None
    if isinstance(model, (bytes, bytearray)):
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(model))
        except Exception as e:
            raise _not_a_model(bytes(model), f"the bytes do not parse as an ONNX ModelProto: "
                                             f"{e}") from None
        return proto, None
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise _not_a_model(os.fsencode(path), f"file '{path}' does not exist (expected a "
                                                  f"path to an .onnx file, serialized ModelProto "
                                                  f"bytes or a ModelProto)")
        try:
            proto = onnx.load(path, load_external_data=False)
        except Exception as e:
            raise ModelError(f"Could not read ONNX model file '{path}': {e}") from None
        return proto, os.path.dirname(os.path.abspath(path))
    raise ModelError(f"Expected an ONNX model as a file path, bytes or ModelProto, "
                     f"got {type(model).__name__}")


# ------------------------------------------------------------------------------ external data
# Where an initializer's external data is read from. PopART resolves a relative location
# against the working directory; ONNX against the model file's folder. Here a relative
# location is looked up in the model's folder (the working directory for a model given as
# bytes or a ModelProto), then in the working directory. Whatever the location says, the
# file read must be inside the model's folder, or a file this program wrote itself
# (saveInitializersExternally, modelToHost, updateExternallySavedTensorLocations: see
# fileio.note_own_file), or inside a folder the user lists in this environment variable:
EXTERNAL_DATA_DIRS_ENV = "POPART_EXTERNAL_DATA_DIRS"

# PopART's reservedOptimizerStatePrefixes (tensornames.cpp) and its accumulator prefix: an
# initializer so named that no node reads is saved optimizer state (modelToHost writes the
# state of a training session as such initializers), never a weight to train.
OPTIMIZER_STATE_PREFIXES = ("Accl___", "Accl1___", "Accl2___", "Accl3___", "Step___",
                            "AcclIntoReduce___", "AcclIntoUpdate___", "AcclOutOfAcclUpdate___",
                            "Accum___")

_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
                "uint64_data", "string_data")

# Dense size a sparse tensor may expand to (an ONNX model's own tensors stay under 2 GiB).
SPARSE_DENSE_LIMIT = 1 << 31


def is_external(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def external_info(t: onnx.TensorProto) -> dict[str, str]:
    """A tensor's ``external_data`` entries (location, offset, length, ...) as a dict."""
    return {e.key: e.value for e in t.external_data}


def _inside(path: str, folder: str) -> bool:
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:   # different drives
        return False


def _allowed_dirs() -> list[str]:
    dirs = os.environ.get(EXTERNAL_DATA_DIRS_ENV, "")
    return [os.path.realpath(d) for d in dirs.split(os.pathsep) if d.strip()]


def external_data_path(t: onnx.TensorProto, base_dir: Optional[str]) -> str:
    """The file tensor ``t``'s external data is read from (see EXTERNAL_DATA_DIRS_ENV):
    ``base_dir`` is the model file's folder, None for a model given in memory. A ModelError
    when the location is missing, leaves the folder, or names no file."""
    loc = external_info(t).get("location", "")
    if not loc:
        raise ModelError(f"No location information for externally stored tensor '{t.name}'")
    if "\0" in loc:
        raise ModelError(f"Externally stored tensor '{t.name}': location {loc!r} is not a path")
    root = os.path.realpath(base_dir if base_dir is not None else os.getcwd())
    cwd = os.getcwd()
    if os.path.isabs(loc):
        candidates = [loc]
    else:
        candidates = [os.path.join(root, loc)]
        if os.path.realpath(cwd) != root:
            candidates.append(os.path.join(cwd, loc))
    extra = _allowed_dirs() + [os.path.realpath(cwd)]   # PopART opens locations from the cwd
    for c in candidates:
        real = os.path.realpath(c)
        if os.path.isfile(real) and (_inside(real, root) or is_own_file(real)
                                     or any(_inside(real, d) for d in extra)):
            return real
    primary = os.path.realpath(candidates[0])
    if not (_inside(primary, root) or any(_inside(primary, d) for d in extra)):
        folder = (f"the model's folder '{root}'" if base_dir is not None else
                  f"the model's folder '{root}' (the working directory: the model was not "
                  f"loaded from a file)")
        raise ModelError(
            f"Initializer '{t.name}': external data location '{loc}' leaves {folder}: it "
            f"resolves to '{primary}', which is neither inside that folder nor a file this "
            f"program wrote. To allow reading external data from other folders, list them in "
            f"the environment variable {EXTERNAL_DATA_DIRS_ENV} (separated by "
            f"'{os.pathsep}')")
    raise ModelError(f"Unrecognised file name '{loc}' for externally stored tensor "
                     f"'{t.name}': '{primary}' does not exist or is not a regular file")


# Per imported main graph (by id, dropped with the graph): location -> the file its external
# data was read from, for the session's modelToHost to write back to.
_SOURCES: dict[int, dict[str, str]] = {}


def external_sources(graph: Graph) -> dict[str, str]:
    """Location -> file, of the external data :func:`import_model` read for ``graph``."""
    return dict(_SOURCES.get(id(graph), {}))


def tensor_to_numpy(t: onnx.TensorProto, base_dir: Optional[str],
                    sources: Optional[dict] = None) -> np.ndarray:
    """A tensor's value; external data is read from :func:`external_data_path` (recorded
    in ``sources``, location -> file, when given)."""
    if is_external(t):
        info = external_info(t)
        full = external_data_path(t, base_dir)
        if sources is not None:
            sources[info["location"]] = full
        t = onnx.TensorProto.FromString(t.SerializeToString())
        t.raw_data = _read_external(t, full, info)
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]
    if any(d < 0 for d in t.dims):
        raise ModelError(f"Tensor '{t.name}' has negative dims {list(t.dims)}")
    try:
        return numpy_helper.to_array(unpack_popart_data(t))
    except Exception as e:   # data that does not fit the type and dims, an unknown type
        raise ModelError(f"Tensor '{t.name}' (data type {t.data_type}, dims {list(t.dims)}) "
                         f"cannot be read: {' '.join(str(e).split())}") from None


def sparse_to_numpy(sp: onnx.SparseTensorProto, base_dir: Optional[str],
                    sources: Optional[dict] = None) -> np.ndarray:
    """A SparseTensorProto (sparse initializer, Constant ``sparse_value``) as a dense array:
    zeros except ``values`` at ``indices`` (NNZ linear indices, or NNZ x rank coordinates)."""
    name = sp.values.name or "sparse tensor"
    dims = [int(d) for d in sp.dims]
    if any(d < 0 for d in dims):
        raise ModelError(f"Sparse tensor '{name}' has negative dims {dims}")
    values = tensor_to_numpy(sp.values, base_dir, sources)
    if values.ndim != 1:
        raise ModelError(f"Sparse tensor '{name}': values must be 1-D, got shape {list(values.shape)}")
    nnz, size = values.shape[0], math.prod(dims)
    if size * values.dtype.itemsize > SPARSE_DENSE_LIMIT:
        raise ModelError(f"Sparse tensor '{name}': its dense form {dims} would take more than "
                         f"{SPARSE_DENSE_LIMIT} bytes")
    indices = (tensor_to_numpy(sp.indices, base_dir, sources) if sp.HasField("indices")
               else np.zeros((0,), np.int64))
    if indices.dtype.kind not in "iu":
        raise ModelError(f"Sparse tensor '{name}': indices must be integers, got {indices.dtype}")
    if indices.shape == (nnz,) or (nnz == 0 and indices.size == 0):
        flat = indices.astype(np.int64).reshape(-1)
    elif indices.shape == (nnz, len(dims)):
        coords = indices.astype(np.int64)
        if ((coords < 0) | (coords >= np.array(dims, np.int64))).any():
            raise ModelError(f"Sparse tensor '{name}': an index is outside its dims {dims}")
        flat = np.ravel_multi_index(tuple(coords.T), dims) if dims else np.zeros(nnz, np.int64)
    else:
        raise ModelError(f"Sparse tensor '{name}': indices of shape {list(indices.shape)} "
                         f"for {nnz} values of a rank-{len(dims)} tensor (expected [{nnz}] or "
                         f"[{nnz}, {len(dims)}])")
    if ((flat < 0) | (flat >= size)).any():
        raise ModelError(f"Sparse tensor '{name}': an index is outside its {size} elements")
    if np.unique(flat).size != flat.size:
        raise ModelError(f"Sparse tensor '{name}': an index appears twice")
    dense = (np.full(size, b"", dtype=object) if values.dtype == object
             else np.zeros(size, values.dtype))
    dense[flat] = values
    return dense.reshape(dims)


def raw_bytes(t: onnx.TensorProto, base_dir: Optional[str] = None) -> bytes:
    """A tensor's data as ``raw_data`` and external files store it: little-endian, sub-byte
    types packed."""
    if t.HasField("raw_data") and not is_external(t):
        return t.raw_data
    return numpy_helper.from_array(tensor_to_numpy(t, base_dir)).raw_data


def set_external(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make ``t`` refer to ``length`` bytes of ``location`` from ``offset`` (its data in the
    model cleared), with PopART's entries: location, length, offset."""
    for f in _DATA_FIELDS:
        t.ClearField(f)
    del t.external_data[:]
    for key, value in (("location", location), ("length", str(length)), ("offset", str(offset))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    t.data_location = onnx.TensorProto.EXTERNAL


def save_initializers_externally(graph: onnx.GraphProto, ids: list, filename: str,
                                 base_dir: Optional[str] = None) -> None:
    """PopART's saveInitializersExternally (onnxutil.cpp): the data of initializers ``ids``
    of ``graph`` goes to ``filename`` (as given: relative to the working directory), one
    after the other, written now; each then refers to it (location, length, offset).
    Every check comes first, so an error leaves the model and the file as they were. When
    other initializers of the model already keep their data in ``filename``, the new ones
    are appended after them (PopART would overwrite theirs)."""
    parent = os.path.dirname(filename)
    if parent and not os.path.isdir(parent):
        raise popart_exception(f"Saving tensor data to file {filename}, but its parent "
                               f"directory does not exist ('{parent}' does not exist)")
    inits = {t.name: t for t in graph.initializer}
    chunks = []
    for tid in ids:
        t = inits.get(tid)
        if t is None:
            raise popart_exception(f"Tensor '{tid}' is not an initializer")
        if is_external(t):
            raise popart_exception(f"Tensor '{tid}' already has an external data_location")
        if t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
            raise popart_exception(f"Tensor '{tid}' has no data to save externally: only "
                                   f"fixed-size data can be saved externally")
        data = raw_bytes(t, base_dir)
        if not data:
            raise popart_exception(f"Tensor '{tid}' has no data to save externally")
        chunks.append((t, data))
    target = os.path.realpath(filename)
    sharing = [t for t in graph.initializer if t.name not in ids and is_external(t)
               and os.path.realpath(external_info(t).get("location", "")) == target]
    offset = os.path.getsize(filename) if sharing and os.path.isfile(filename) else 0
    writes = []
    for t, data in chunks:
        writes.append((offset, data))
        offset += len(data)
    atomic_patch(filename, writes, base=filename if sharing and os.path.isfile(filename) else None)
    note_own_file(filename)
    for (t, data), (off, _) in zip(chunks, writes):
        set_external(t, filename, off, len(data))


def for_checker(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for onnx.checker: its external tensors (whose locations PopART lets be
    absolute or relative to the working directory, which the checker rejects, and whose
    files the checker would look for relative to the working directory) replaced by empty
    tensors of their type, and tensors in PopART's packed layout (``unpack_popart_data``:
    the Builder's FLOAT16) one element per entry, in a copy; ``model`` itself when it has
    neither."""
    def tensors(g: onnx.GraphProto):
        yield from g.initializer
        for sp in g.sparse_initializer:
            yield sp.values
            yield sp.indices
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield a.t
                elif a.type == onnx.AttributeProto.TENSORS:
                    yield from a.tensors
                elif a.type == onnx.AttributeProto.SPARSE_TENSOR:
                    yield a.sparse_tensor.values
                    yield a.sparse_tensor.indices
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    yield from tensors(sub)

    def odd(t: onnx.TensorProto) -> bool:   # external, or in PopART's packed FLOAT16 form
        return is_external(t) or unpack_popart_data(t) is not t

    if not any(odd(t) for t in tensors(model.graph)):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for t in tensors(copy.graph):
        if not is_external(t):
            t.CopyFrom(unpack_popart_data(t))
        else:
            del t.external_data[:]
            t.data_location = onnx.TensorProto.DEFAULT
            del t.dims[:]
            t.dims.append(0)
    return copy


# Sub-byte types: bits per element in raw (and external) data, packed little-end first.
_PACKED_BITS = {getattr(onnx.TensorProto, n): b for n, b in (
    ("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2),
    ("FLOAT6E2M3", 6), ("FLOAT6E3M2", 6)) if hasattr(onnx.TensorProto, n)}


def _raw_nbytes(t: onnx.TensorProto) -> int:
    """How many bytes of raw data a tensor's type and dims take."""
    if t.data_type in (onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING) or any(d < 0 for d in t.dims):
        raise ModelError(f"Initializer '{t.name}': external data needs a fixed-size type and "
                         f"non-negative dims, got type {t.data_type} dims {list(t.dims)}")
    count = math.prod(t.dims)
    bits = _PACKED_BITS.get(t.data_type)
    if bits:
        return (count * bits + 7) // 8
    try:
        return count * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"Initializer '{t.name}': unknown data type {t.data_type}") from None


def _read_external(t: onnx.TensorProto, path: str, info: dict) -> bytes:
    """The bytes of an external-data tensor: exactly what its type and dims need, from the
    entry's ``offset``, never more of the file (a ``length`` that disagrees, or a file too
    short, is a ModelError)."""
    need = _raw_nbytes(t)
    try:
        offset, length = int(info.get("offset", 0)), int(info.get("length", need))
    except ValueError:
        raise ModelError(f"Initializer '{t.name}': external data offset / length "
                         f"{info.get('offset')!r} / {info.get('length')!r} are not integers") from None
    if length != need:
        raise ModelError(f"Initializer '{t.name}': external data length {length} does not match "
                         f"its type and shape {list(t.dims)} ({need} bytes)")
    try:
        return read_exact(path, offset, need)
    except popart_exception as e:
        raise ModelError(f"Initializer '{t.name}': external data {e}") from None


def value_info_to_tensorinfo(vi: onnx.ValueInfoProto) -> Optional[TensorInfo]:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or tt.elem_type == 0:
        return None
    shape: list = []
    if tt.HasField("shape"):
        for d in tt.shape.dim:
            shape.append(d.dim_value if d.HasField("dim_value") else -1)
    else:
        shape = None  # unknown rank
    info = TensorInfo(to_datatype(tt.elem_type), [])
    info._shape = shape  # may contain -1 (unknown) or be None (unknown rank)
    return info


def _attr_value(a: onnx.AttributeProto, opsets: dict, base_dir, parent: Graph,
                sources: Optional[dict] = None) -> Any:
    if a.type == onnx.AttributeProto.GRAPH:
        return graph_from_onnx(a.g, opsets, base_dir, parent, sources)
    if a.type == onnx.AttributeProto.GRAPHS:
        return [graph_from_onnx(g, opsets, base_dir, parent, sources) for g in a.graphs]
    if a.type == onnx.AttributeProto.TENSOR:
        return tensor_to_numpy(a.t, base_dir, sources)
    if a.type == onnx.AttributeProto.TENSORS:
        return [tensor_to_numpy(t, base_dir, sources) for t in a.tensors]
    if a.type == onnx.AttributeProto.SPARSE_TENSOR:   # dense from here on
        return sparse_to_numpy(a.sparse_tensor, base_dir, sources)
    if a.type == onnx.AttributeProto.SPARSE_TENSORS:
        return [sparse_to_numpy(t, base_dir, sources) for t in a.sparse_tensors]
    return decode_attr(onnx.helper.get_attribute_value(a))


@functools.lru_cache(maxsize=64)
def _checker_context(opsets: tuple) -> Any:
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = onnx.IR_VERSION
    ctx.opset_imports = {"" if d == ONNX_DOMAIN else d: v for d, v in opsets}
    return ctx


# Node forms PopART takes where onnx's checker does not: Abort without a condition,
# Resize-11 with '' for roi or scales (OpCreatorInfo::hasInputTensor), Resize-10 with
# nearest_mode (getNearestMode reads it at every version).
_POPART_NODE_FORMS = {"Abort": ("has zero input and zero output",),
                      "Resize": ("is marked single but has an empty string",
                                 "Unrecognized attribute: nearest_mode")}


def check_node(n: onnx.NodeProto, opsets: dict, k: int = 0) -> None:
    """onnx's checker on one node (its op and opset, input and output counts, attribute names
    and types; subgraphs are checked node by node when imported): a ModelError naming it."""
    if n.domain == ONNX_DOMAIN or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                      for a in n.attribute):
        n = onnx.NodeProto.FromString(n.SerializeToString())
        n.domain = "" if n.domain == ONNX_DOMAIN else n.domain
        for a in n.attribute:   # the checker cannot see enclosing scopes from here
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                sub.CopyFrom(onnx.GraphProto(name=sub.name))
    try:
        onnx.checker.check_node(n, _checker_context(tuple(sorted(opsets.items()))))
    except Exception as e:   # ValidationError, or bytes that are not UTF-8 in a name
        msg = " ".join(str(e).split("==>")[0].split())
        if "is deprecated" in msg:   # deprecated ops (GroupNormalization-18, ...) still run
            return
        if any(form in msg for form in _POPART_NODE_FORMS.get(n.op_type, ())):
            return
        raise ModelError(f"{canonical_domain(n.domain)}::{n.op_type} node "
                         f"'{n.name or f'{n.op_type}_{k}'}': {msg}") from None


def _reads(g: onnx.GraphProto) -> set[str]:
    """Every tensor of ``g``'s scope its nodes (and their subgraphs) read."""
    return {u for n in g.node for u in _uses(n)}


def _uses(n: onnx.NodeProto) -> set[str]:
    """The tensors a node reads: its inputs and those its subgraphs read from outside."""
    names = {i for i in n.input if i}
    for a in n.attribute:
        for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            inner = ({v.name for v in sub.input} | {t.name for t in sub.initializer}
                     | {o for m in sub.node for o in m.output})
            names |= {u for m in sub.node for u in _uses(m)} - inner
    return names


def _node_order(g: onnx.GraphProto) -> list[int]:
    """Indices of ``g``'s nodes, each after the producers of what it reads: the file's order
    when it is topologically sorted (as ONNX requires), else sorted as ONNX Runtime does. A
    tensor produced twice (ONNX graphs are single assignment) or a cycle is a ModelError."""
    label = lambda k: f"'{g.node[k].name or g.node[k].op_type + '_' + str(k)}' ({g.node[k].op_type})"
    producer: dict[str, int] = {}
    defined = {vi.name for vi in g.input} | {t.name for t in g.initializer}
    for k, n in enumerate(g.node):
        for o in n.output:
            if o and (o in producer or o in defined):
                first = f"node {label(producer[o])}" if o in producer else "a graph input or initializer"
                raise ModelError(f"Graph '{g.name}': tensor '{o}' is written by node {label(k)} "
                                 f"and by {first}; every tensor must have one producer")
            if o:
                producer[o] = k
    deps = [{producer[i] for i in _uses(n) if i in producer} for n in g.node]
    if all(d < k for k, ds in enumerate(deps) for d in ds):
        return list(range(len(g.node)))
    users: dict[int, list[int]] = {}
    for k, ds in enumerate(deps):
        for d in ds:
            users.setdefault(d, []).append(k)
    waiting = [len(ds) for ds in deps]
    ready = [k for k, w in enumerate(waiting) if w == 0]
    order: list[int] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for u in users.get(k, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(g.node):
        stuck = [label(k) for k, w in enumerate(waiting) if w > 0]
        raise ModelError(f"Graph '{g.name}' has a cycle: nodes {', '.join(stuck[:6])} each "
                         f"wait for another's output")
    return order


def graph_from_onnx(g: onnx.GraphProto, opsets: dict, base_dir: Optional[str] = None,
                    parent: Optional[Graph] = None, sources: Optional[dict] = None) -> Graph:
    """``g`` as an IR graph. Sparse initializers and sparse attributes become dense arrays
    (a Constant's ``sparse_value`` its ``value``); ``sources`` collects location -> file
    of the external data read."""
    graph = Graph(name=g.name or "graph", opsets=opsets, parent=parent)
    for t in g.initializer:
        graph.initializers[t.name] = tensor_to_numpy(t, base_dir, sources)
    for sp in g.sparse_initializer:
        name = sp.values.name
        if not name or name in graph.initializers:
            raise ModelError(f"Graph '{g.name}': sparse initializer "
                             f"{'without a name' if not name else repr(name)} "
                             f"{'' if not name else 'is also a dense initializer'}".rstrip())
        graph.initializers[name] = sparse_to_numpy(sp, base_dir, sources)
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        info = value_info_to_tensorinfo(vi)
        if info is not None:
            graph.tensor_info[vi.name] = info
    # Older exporters list initializers among the inputs too: those are not streams.
    graph.inputs = [vi.name for vi in g.input if vi.name not in graph.initializers]
    graph.outputs = [vi.name for vi in g.output]
    for k in _node_order(g):
        n = g.node[k]
        check_node(n, opsets, k)
        attrs, ann = {}, {}
        for a in n.attribute:
            target = ann if a.name.startswith("__") else attrs
            try:
                target[a.name] = _attr_value(a, opsets, base_dir, graph, sources)
            except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
                raise ModelError(f"Node '{n.name or n.op_type}' ({n.op_type}): attribute "
                                 f"'{a.name}' cannot be read: {e}") from None
        if n.op_type == "Constant" and canonical_domain(n.domain) == ONNX_DOMAIN \
                and "sparse_value" in attrs:
            attrs["value"] = attrs.pop("sparse_value")
        graph.nodes.append(Node(op_type=n.op_type, inputs=list(n.input), outputs=list(n.output),
                                attrs=attrs, domain=canonical_domain(n.domain),
                                name=n.name or f"{n.op_type}_{k}", annotations=ann))
    return graph


def model_opsets(model: onnx.ModelProto) -> dict[str, int]:
    """The model's opset version per (canonical) domain, checked, as is its IR version."""
    if model.ir_version > onnx.IR_VERSION:
        raise ModelError(f"The model's IR version {model.ir_version} is newer than the newest "
                         f"supported ({onnx.IR_VERSION})")
    opsets = {canonical_domain(o.domain): int(o.version) for o in model.opset_import}
    opsets.setdefault(GRAPHCORE_DOMAIN, 1)
    if not opsets.keys() - {GRAPHCORE_DOMAIN} and not model.opset_import:
        raise ModelError("The model imports no opset (opset_import is empty)")
    # A model of other domains only (ai.onnx.ml, ...) has no ai.onnx nodes to version.
    opsets.setdefault(ONNX_DOMAIN, onnx.defs.onnx_opset_version())
    if opsets[ONNX_DOMAIN] < MIN_ONNX_OPSET:
        raise UnsupportedOperatorError(
            f"The model imports ai.onnx opset {opsets[ONNX_DOMAIN]}; opsets {MIN_ONNX_OPSET} "
            f"to {onnx.defs.onnx_opset_version()} are supported")
    if opsets[ONNX_DOMAIN] > onnx.defs.onnx_opset_version():
        raise UnsupportedOperatorError(
            f"The model imports ai.onnx opset {opsets[ONNX_DOMAIN]}, newer than the newest "
            f"supported ({onnx.defs.onnx_opset_version()})")
    return opsets


def import_model(model: ModelLike, input_shape_info: Any = None) -> tuple[Graph, onnx.ModelProto]:
    """Import an ONNX model into an IR main graph (and return the ModelProto it came from).

    ``input_shape_info`` (a popart.InputShapeInfo or dict id -> TensorInfo) gives the shapes
    of inputs the model leaves open."""
    proto, base_dir = load_model(model)
    if not proto.HasField("graph"):
        raise ModelError("The model has no graph")
    sources: dict[str, str] = {}
    graph = graph_from_onnx(proto.graph, model_opsets(proto), base_dir, sources=sources)
    graph.name = proto.graph.name or "main"
    if sources:
        _SOURCES[id(graph)] = sources
        weakref.finalize(graph, _SOURCES.pop, id(graph), None)
    # Saved optimizer state (what modelToHost writes for a training session) is no weight.
    read = {o.name for o in proto.graph.output} | _reads(proto.graph)
    graph.constants |= {tid for tid in graph.initializers
                        if tid.startswith(OPTIMIZER_STATE_PREFIXES) and tid not in read}
    overrides = _shape_overrides(input_shape_info)
    for tid, info in overrides.items():
        graph.tensor_info[tid] = info
    return graph, proto


def _shape_overrides(info: Any) -> dict[str, TensorInfo]:
    if info is None:
        return {}
    if isinstance(info, dict):
        return dict(info)
    return dict(getattr(info, "_infos", None) or getattr(info, "infos", {}) or {})
