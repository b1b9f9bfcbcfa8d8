"""ONNX write-back of a session's model (PopART's Session::modelToHost): initializers in the
storage form they came in, external data files, a training session's optimizer state as
further initializers; ``resetHostWeights``' reading of another model and ``saveVariables``'
file. The session passes its host values in; nothing here touches the device."""
from __future__ import annotations

import io
import os
from typing import Any, Mapping, Optional

import numpy as np
import onnx
from onnx import numpy_helper

from ._ir.graph import Graph
from ._ir.onnx_import import (OPTIMIZER_STATE_PREFIXES, ModelLike, external_data_path,
                              external_info, external_sources, is_external, load_model,
                              raw_bytes, set_external, sparse_to_numpy, tensor_to_numpy)
from .engine.executable import state_arrays
from .errors import noted, popart_exception, popart_runtime_error
from .fileio import atomic_patch, atomic_write, initializer_proto, note_own_file, read_exact
from .tensorinfo import shape_str

_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                 "string_data")


def store_like(t: onnx.TensorProto, value: Any) -> None:
    """Tensor ``t``'s data := ``value``, in ``t``'s storage form (``raw_data`` stays
    ``raw_data``, otherwise PopART's typed field, ``fileio.initializer_proto``);
    unchanged when the value is."""
    value = np.asarray(value)
    try:
        old = tensor_to_numpy(t, None)
    except popart_exception:
        old = None
    if old is not None:
        value = value.astype(old.dtype, copy=False)
        if old.shape == value.shape and old.tobytes() == np.ascontiguousarray(value).tobytes():
            return
    if t.HasField("raw_data"):
        t.raw_data = numpy_helper.from_array(value, t.name).raw_data
        return
    # PopART's typed field; FLOAT16 packed where t was (memcpy into the tensor's storage)
    new = initializer_proto(value, t.name, pack_half=len(t.int32_data) != value.size)
    for f in _TYPED_FIELDS:
        t.ClearField(f)
        getattr(t, f).extend(getattr(new, f))


def store_sparse_like(sp: onnx.SparseTensorProto, value: Any) -> None:
    """A sparse initializer := ``value`` (its non-zeros), its indices in the layout they
    had (linear or coordinates), its values in their storage form; unchanged when the
    value is."""
    value = np.asarray(value)
    try:
        old = sparse_to_numpy(sp, None)
        if old.shape == value.shape and old.tobytes() == \
                np.ascontiguousarray(value.astype(old.dtype, copy=False)).tobytes():
            return
        value = value.astype(old.dtype, copy=False)
    except popart_exception:
        pass
    flat = np.flatnonzero(value.reshape(-1))
    vals = value.reshape(-1)[flat]
    idx = np.stack(np.unravel_index(flat, value.shape), axis=1) \
        if len(sp.indices.dims) == 2 else flat
    typed = not sp.values.HasField("raw_data") and \
        any(len(getattr(sp.values, f)) for f in _TYPED_FIELDS)
    new = (initializer_proto(vals, sp.values.name) if typed
           else numpy_helper.from_array(vals, sp.values.name))
    sp.values.CopyFrom(new)
    sp.indices.CopyFrom(numpy_helper.from_array(idx.astype(np.int64), sp.indices.name))


def model_weights(model: ModelLike, weights: Mapping[str, np.ndarray],
                 state: Mapping[str, Any], constants: Any, ignore_unknown: bool,
                 infos: Mapping[str, Any]) -> tuple[dict, dict]:
    """resetHostWeights' reading of ``model`` (a file, bytes or a ModelProto; external and
    sparse data read as for a session's model): (new weights, new optimizer state), each
    initializer checked against the session's ``weights`` / ``state`` as PopART's
    executablex.cpp resetWeights does; ``constants``, saved optimizer state the session
    has none of, and a tensor of the session that is no weight (``infos``: PopART's
    containsTensor; its type and shape checked) are skipped."""
    proto, base = load_model(model)
    new_weights, new_state = {}, {}
    tensors = [(t.name, t, tensor_to_numpy) for t in proto.graph.initializer] + \
        [(s.values.name, s, sparse_to_numpy) for s in proto.graph.sparse_initializer]
    for name, t, to_numpy in tensors:
        target = (new_weights if name in weights else new_state if name in state else None)
        if target is None:
            if name in infos:   # a tensor of the session, not a weight: checked, not kept
                info = infos[name]
                _check_reset_info(name, to_numpy(t, base), tuple(info.shape()),
                                  np.dtype(info.np_dtype()))
                continue
            if name in constants or name.startswith(OPTIMIZER_STATE_PREFIXES) or ignore_unknown:
                continue
            raise noted(popart_runtime_error(f"resetWeights, no tensor '{name}' in tensors"),
                        f"The given model's initializer '{name}' is no weight or optimizer "
                        f"state of the session (pass "
                        f"ignoreWeightsInModelWithoutCorrespondingHostWeight=True to skip "
                        f"such)")
        val = to_numpy(t, base)
        cur = weights[name] if target is new_weights else np.asarray(state[name])
        _check_reset_info(name, val, cur.shape, cur.dtype)
        target[name] = val.copy()
    return new_weights, new_state


def _check_reset_info(name: str, val: np.ndarray, shape: tuple, dtype: np.dtype) -> None:
    """executablex.cpp resetWeights' check: ``val`` has the session tensor's ``shape`` and ``dtype``."""
    if val.shape != shape or val.dtype != dtype:
        raise noted(popart_runtime_error(f"Trying to reset weights using tensor with non "
                                         f"matching tensor info. Tensor ID: {name}"),
                    f"{val.dtype}{shape_str(val.shape)} in the given model, "
                    f"{dtype}{shape_str(shape)} in the session")


def save_variables(path: str, weights: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """saveVariables' file (an .npz: ``var/<id>``, ``opt/<id>``), written atomically; a
    directory gets ``<path>/variables.popef``."""
    if os.path.isdir(path):
        path = os.path.join(path, "variables.popef")
    buf = io.BytesIO()
    np.savez(buf, **state_arrays(weights, state))
    atomic_write(path, buf.getvalue())


class WriteBack:
    """The ONNX model a session writes back: its own (``proto``, read from ``base_dir``
    when it came from a file), the external files it refers to (with the locations
    ``move`` gives them) and, once prepared, a training session's optimizer state."""

    def __init__(self, proto: onnx.ModelProto, graph: Graph, base_dir: Optional[str]) -> None:
        self.proto, self.graph, self.base_dir = proto, graph, base_dir
        self._out_model: Optional[onnx.ModelProto] = None
        self._ext_files: Optional[dict] = None

    def model(self, values: Mapping[str, Any], state: Optional[Mapping[str, Any]]) -> onnx.ModelProto:
        """The model with ``values`` (host weights and optimizer state by id) as its
        initializers, each in the storage form it came in; external ones refer to their
        files, which ``write`` writes. ``state``: the optimizer state once prepared, else
        None."""
        model = onnx.ModelProto()
        model.CopyFrom(self.saved_model(state))
        for t in model.graph.initializer:
            if t.name in values and not is_external(t):
                store_like(t, values[t.name])
        for sp in model.graph.sparse_initializer:
            if sp.values.name in values and not is_external(sp.values) \
                    and not is_external(sp.indices):
                store_sparse_like(sp, values[sp.values.name])
        return model

    def write(self, fn: str, model: onnx.ModelProto, values: Mapping[str, Any]) -> None:
        """modelToHost's files: ``model`` (from ``model()``) to ``fn``, and ``values`` of its
        external initializers into their files (see the session's modelToHost)."""
        folder = os.path.dirname(os.path.abspath(fn))
        if not os.path.isdir(folder):
            raise popart_exception(f"modelToHost: cannot write '{fn}': folder '{folder}' does "
                                   f"not exist")
        external: dict[str, list] = {}
        for t in model.graph.initializer:
            if is_external(t):
                external.setdefault(external_info(t).get("location", ""), []).append(t)
        sources = self.sources()
        for location, tensors in external.items():
            target = self.path(location, folder)
            source = sources.get(location)
            source = source if source and os.path.isfile(source) else None
            writes = []
            for t in tensors:
                info = external_info(t)
                if t.name in values:
                    raw = numpy_helper.from_array(np.asarray(values[t.name])).raw_data
                    if "length" in info and int(info["length"]) != len(raw):
                        raise popart_exception(
                            f"modelToHost: initializer '{t.name}' takes {len(raw)} bytes, its "
                            f"external data entry says {info['length']}")
                    writes.append((int(info.get("offset", 0)), raw))
                elif source is None:
                    raise popart_exception(f"Trying to update initializer {t.name}, stored in file "
                                           f"{location}, when writing modelToHost. Failed to open "
                                           f"file: the file the session read it from is gone")
            if not os.path.isdir(os.path.dirname(os.path.abspath(target))):
                raise popart_exception(f"Trying to update initializer {tensors[0].name}, stored in "
                                       f"file {location}, when writing modelToHost. Failed to open "
                                       f"file: the folder of '{target}' does not exist")
            atomic_patch(target, writes, base=source)
            note_own_file(target)
        atomic_write(fn, model.SerializeToString())

    def sources(self) -> dict:
        """Location -> the file the session's external data for it is in (what the import
        read, then what ``move`` wrote)."""
        if self._ext_files is None:
            files = external_sources(self.graph)
            for t in self.proto.graph.initializer:   # not recorded: resolved as the import does
                loc = external_info(t).get("location", "") if is_external(t) else None
                if loc is not None and loc not in files:
                    try:
                        files[loc] = external_data_path(t, self.base_dir)
                    except popart_exception:
                        pass
            self._ext_files = files
        return self._ext_files

    def saved_model(self, state: Optional[Mapping[str, Any]]) -> onnx.ModelProto:
        """The model modelToHost writes (PopART's Ir model): the session's, with external
        locations as ``move`` moved them and, once a training session is prepared (``state``
        not None), its optimizer state as further initializers (PopART's
        Ir::addAdditionalModelProtoTensors): external, after the data already in its weight's
        file, when the weight is external, else in ``raw_data``. Their offsets are decided
        once, so every modelToHost writes the same layout."""
        if self._out_model is not None:
            return self._out_model
        if state is None:
            return self.proto
        model = onnx.ModelProto()
        model.CopyFrom(self.proto)
        inits = {t.name: t for t in model.graph.initializer}
        sparse = {sp.values.name for sp in model.graph.sparse_initializer}
        ends: dict[str, int] = {}
        for t in model.graph.initializer:
            if is_external(t):
                info = external_info(t)
                end = int(info.get("offset", 0)) + int(info.get("length", 0))
                ends[info.get("location", "")] = max(ends.get(info.get("location", ""), 0), end)
        sources = self.sources()
        for loc in ends:
            src = sources.get(loc)
            if src and os.path.isfile(src):
                ends[loc] = max(ends[loc], os.path.getsize(src))
        order = {name: k for k, name in enumerate(list(inits) + sorted(sparse))}
        saved = []   # by prefix, then weight (the layout PopART's tests read back)
        for sid, value in state.items():
            prefix = next((p for p in OPTIMIZER_STATE_PREFIXES if sid.startswith(p)), None)
            if prefix is not None:
                saved.append((OPTIMIZER_STATE_PREFIXES.index(prefix),
                              order.get(sid[len(prefix):], -1), sid, prefix, value))
        for _, _, sid, prefix, value in sorted(saved, key=lambda e: e[:3]):
            base = sid[len(prefix):]
            if (base not in inits and base not in sparse) or sid in inits or sid in sparse:
                continue
            weight = inits.get(base)
            t = initializer_proto(value, sid)   # PopART's typed field, as its Builder's
            if weight is not None and is_external(weight):
                loc = external_info(weight).get("location", "")
                set_external(t, loc, ends[loc], len(raw_bytes(t)))
                ends[loc] += int(external_info(t)["length"])
            model.graph.initializer.append(t)
            inits[sid] = t
        self._out_model = model
        return model

    def moving(self, fromLocation: str, toLocation: str,
               state: Optional[Mapping[str, Any]]) -> list:
        """updateExternallySavedTensorLocations' checks (PopART's errors): the initializers
        saved in ``fromLocation``, to be moved to ``toLocation`` by ``move``."""
        if os.path.exists(self.path(toLocation, os.getcwd())):
            raise popart_runtime_error(f"Updating externally saved tensor location from file "
                                       f"'{fromLocation}' to file '{toLocation}', but file "
                                       f"'{toLocation}' already exists")
        moved = [t for t in self.saved_model(state).graph.initializer
                 if is_external(t) and external_info(t).get("location") == fromLocation]
        if not moved:
            if not os.path.exists(self.path(fromLocation)):
                raise noted(popart_runtime_error(f"Updating externally saved tensor location "
                                                 f"from file '{fromLocation}' to file "
                                                 f"'{toLocation}', but file '{fromLocation}' does "
                                                 f"not exist"),
                            f"'{fromLocation}': no tensor of the model is saved externally there")
            raise noted(popart_runtime_error(f"No ONNX model initializers have external "
                                             f"location set to '{fromLocation}'"),
                        f"'{fromLocation}': no tensor of the model is saved externally there")
        return moved

    def path(self, location: str, folder: Optional[str] = None) -> str:
        """The file a relative ``location`` names in ``folder`` (default: the model's folder,
        the working directory for a model given in memory); an absolute one as it is."""
        folder = folder or self.base_dir or os.getcwd()
        return location if os.path.isabs(location) else os.path.join(folder, location)

    def move(self, location: str, tensors: list, values: Mapping[str, Any],
             folder: Optional[str] = None) -> None:
        """Write ``tensors``' ``values`` (the file's bytes for those without) to ``location``
        (atomically), one after another, and point their external_data there (location,
        length, offset, as PopART)."""
        sources = self.sources()
        chunks, offset = [], 0
        for t in tensors:
            if t.name in values:
                raw = numpy_helper.from_array(np.asarray(values[t.name])).raw_data
            else:
                src = sources.get(external_info(t).get("location", ""))
                raw = read_exact(src, int(external_info(t).get("offset", 0)),
                                 int(external_info(t)["length"])) if src else \
                    raw_bytes(t, self.base_dir)
            chunks.append((t, offset, raw))
            offset += len(raw)
        path = self.path(location, folder)
        atomic_write(path, b"".join(raw for _, _, raw in chunks))
        note_own_file(path)
        for t, off, raw in chunks:
            set_external(t, location, off, len(raw))
        sources[location] = os.path.realpath(path)
