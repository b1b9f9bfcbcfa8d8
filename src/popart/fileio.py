"""Every file the package writes goes through :func:`atomic_write` (or :func:`atomic_patch`,
its form for updating part of a file); every file it reads that
declares its own sizes (saved executables, ONNX external data) is read through a bounded
reader here, so a small hostile file cannot make it read or allocate more than the caller
expects."""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
import zipfile
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import popart_exception

PathLike = Union[str, "os.PathLike[str]"]


# ------------------------------------------------------------------------------ writing
def _umask() -> int:
    """The process's umask, read without changing it where /proc says it (Linux)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_target(path: str) -> str:
    """The file a write of ``path`` replaces: ``path`` itself, or the file a symlink at
    ``path`` points to when that file is in ``path``'s folder (the link is kept)."""
    if not os.path.islink(path):
        return path
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    target = os.path.realpath(path)
    if os.path.dirname(target) != folder:
        raise popart_exception(f"Refusing to write '{path}': it is a symlink to '{target}', "
                               f"outside its folder '{folder}'")
    return target


def atomic_write(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a
    partial one: through a temporary file in the same folder, fsynced, then renamed over
    the target. An existing target keeps its mode (a new file gets 0666 & ~umask); the
    temporary file is removed on any failure, KeyboardInterrupt included; a symlink at
    ``path`` is written through only when it points into ``path``'s own folder."""
    _atomic(path, lambda f: f.write(data))


def atomic_patch(path: PathLike, writes: Iterable[tuple[int, bytes]],
                 base: Optional[PathLike] = None) -> None:
    """Write ``path`` atomically (as :func:`atomic_write`) with the bytes of the file
    ``base`` (None: none), each ``(offset, data)`` of ``writes`` written over them; the file
    grows as a write needs (a gap reads as zeros). ``base`` may be ``path`` itself: an update
    in place that readers see whole or not at all. ``base`` is copied in chunks, never read
    into memory whole."""
    def fill(f) -> None:
        if base is not None:
            with open(base, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
        for offset, data in writes:
            f.seek(offset)
            f.write(data)
    _atomic(path, fill)


def _atomic(path: PathLike, fill: Callable) -> None:
    """The temporary-file-and-rename of :func:`atomic_write`; ``fill(f)`` writes the new
    contents to the open temporary file ``f``."""
    target = _write_target(os.fspath(path))
    folder = os.path.dirname(os.path.abspath(target))
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_", suffix=os.path.basename(target))
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable too (not on every OS)
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


# ------------------------------------------------------------------------------ own files
# The external tensor-data files this process wrote (saveInitializersExternally,
# modelToHost, updateExternallySavedTensorLocations): real path -> (device, inode) of the
# file written. A model may read these wherever they are (_ir.onnx_import); a file put in
# their place since (another inode) is no longer one of them.
_OWN_FILES: dict[str, tuple[int, int]] = {}
_OWN_LOCK = threading.Lock()


def note_own_file(path: PathLike) -> None:
    """Record ``path`` (just written, or read from a model's own folder) as this program's."""
    real = os.path.realpath(os.fspath(path))
    st = os.stat(real)
    with _OWN_LOCK:
        _OWN_FILES[real] = (st.st_dev, st.st_ino)


def is_own_file(path: PathLike) -> bool:
    """Whether ``path`` is a file :func:`note_own_file` recorded, still the same file."""
    real = os.path.realpath(os.fspath(path))
    with _OWN_LOCK:
        entry = _OWN_FILES.get(real)
    if entry is None:
        return False
    try:
        st = os.stat(real)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == entry


# ------------------------------------------------------------------------------ reading
def read_exact(path: PathLike, offset: int, length: int) -> bytes:
    """Exactly ``length`` bytes of ``path`` from ``offset`` (never more, whatever the file's
    size); a file too short for them raises popart_exception."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    if offset < 0 or length < 0 or offset + length > size:
        raise popart_exception(f"'{path}' has {size} bytes: {length} bytes from offset "
                               f"{offset} are needed")
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:  # the file shrank while it was read
        raise popart_exception(f"'{path}': read {len(data)} of {length} bytes from offset {offset}")
    return data


NPY_HEADER_LIMIT = 1 << 16   # bytes of .npy header allowed before an array's data

ArraySpec = Optional[tuple]   # (shape, dtype) an array must have, or None: any, within the cap


def load_npz_bounded(path: PathLike, expected: Mapping[str, ArraySpec], *,
                     max_bytes: int, required: tuple = ()) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` file ``path``, read only after checking the zip's declared
    sizes: every member must be named in ``expected`` (``name`` -> ``(shape, dtype)`` it must
    have, or None for any 1-D array), its declared size must fit its .npy header and its
    spec, and all declared sizes together must stay under ``max_bytes``. Decompression
    never produces more than a member's declared size (zipfile stops there and checks the
    CRC), so a small zip bomb is rejected before it costs memory."""
    path = os.fspath(path)
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            names = [i.filename[:-4] if i.filename.endswith(".npy") else i.filename for i in infos]
            unknown = [n for n in names if n not in expected]
            missing = [n for n in required if n not in names]
            if unknown or missing or len(set(names)) != len(names):
                raise popart_exception(
                    f"'{path}': unexpected entries {unknown[:5]}" if unknown else
                    f"'{path}': missing entries {missing}" if missing else
                    f"'{path}': duplicate entries")
            total = sum(i.file_size for i in infos)
            if total > max_bytes:
                raise popart_exception(f"'{path}' declares {total} bytes of data, more than the "
                                       f"{max_bytes} expected")
            out = {}
            for name, info in zip(names, infos):
                with z.open(info) as f:
                    out[name] = _read_npy(f, info.file_size, expected[name], f"'{path}' entry '{name}'")
            return out
    except popart_exception:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, NotImplementedError) as e:
        raise popart_exception(f"cannot read '{path}': {e}") from None   # encrypted, unknown method


def _read_npy(f, declared: int, spec: ArraySpec, what: str) -> np.ndarray:
    """One .npy member: header checked against ``spec`` and the member's declared size
    before the data is read."""
    from numpy.lib import format as npf
    version = npf.read_magic(f)
    read_header = npf.read_array_header_1_0 if version == (1, 0) else npf.read_array_header_2_0
    shape, fortran, dtype = read_header(f, max_header_size=NPY_HEADER_LIMIT)
    if dtype.hasobject:
        raise popart_exception(f"{what}: object arrays are not allowed")
    if spec is None:
        if len(shape) != 1:
            raise popart_exception(f"{what}: expected a 1-D array, got shape {shape}")
    else:
        want = np.dtype(spec[1])   # ml_dtypes types (bfloat16, int4, ...) are saved as void
        same = dtype == want or (dtype.kind == "V" and dtype.itemsize == want.itemsize)
        if tuple(shape) != tuple(spec[0]) or not same:
            raise popart_exception(f"{what}: expected {want}{list(spec[0])}, the file has "
                                   f"{dtype}{list(shape)}")
        dtype = want
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes > declared:
        raise popart_exception(f"{what}: its header declares {nbytes} bytes of data, more "
                               f"than the entry's {declared} bytes")
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise popart_exception(f"{what}: truncated ({len(data)} of {nbytes} bytes)")
    arr = np.frombuffer(data, dtype=dtype).copy()
    return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)


# ------------------------------------------------------------------------------ initializer storage
# The narrow types PopART's BuilderImpl::populateTensorProtoFromConstVoidData memcpy'd into a
# wider field (ONNX type -> (numpy type, field, field's numpy type)): their bytes packed into
# the first entries. Every other type it stores one element per entry.
_PACKED = {onnx.TensorProto.FLOAT16: (np.float16, "int32_data", "<i4"),
           onnx.TensorProto.INT8: (np.int8, "int32_data", "<i4"),
           onnx.TensorProto.UINT8: (np.uint8, "int32_data", "<i4"),
           onnx.TensorProto.INT16: (np.int16, "int32_data", "<i4"),
           onnx.TensorProto.UINT16: (np.uint16, "int32_data", "<i4"),
           onnx.TensorProto.BOOL: (np.uint8, "int32_data", "<i4"),
           onnx.TensorProto.UINT32: (np.uint32, "uint64_data", "<u8")}


def initializer_proto(array: Any, name: str, pack_half: bool = False) -> onnx.TensorProto:
    """``array`` as a TensorProto in the field PopART's Builder stores its type in
    (``populateTensorProtoFromConstVoidData``): FLOAT in ``float_data``; INT8..INT32, UINT8,
    UINT16, BOOL and FLOAT16 in ``int32_data``; INT64 in ``int64_data``; UINT32 / UINT64 in
    ``uint64_data`` (DOUBLE in ``double_data``, other types where ONNX puts them), never
    ``raw_data``. With ``pack_half``, FLOAT16 is packed as PopART's Builder packs an
    initializer, two halves per entry (ceil(n/2) entries, builder_impl.cpp); otherwise, and
    for the other types, one value per entry as ONNX defines them (PopART memcpy'd the narrow
    integer types' bytes too, a form no other tool reads; :func:`unpack_popart_data` reads
    both)."""
    array = np.asarray(array)
    if array.dtype.kind in "OUS":   # strings: string_data, as ONNX has them
        return numpy_helper.from_array(array, name)
    dtype = helper.np_dtype_to_tensor_dtype(array.dtype)
    field = _FIXED_FIELDS.get(dtype)
    if dtype == onnx.TensorProto.FLOAT16 and pack_half:
        halves = np.zeros(-(-array.size // 2) * 2, "<f2")
        halves[:array.size] = array.reshape(-1)
        t = onnx.TensorProto(name=name, data_type=dtype, dims=list(array.shape))
        t.int32_data.extend(halves.view("<i4").tolist())
        return t
    if field is None:
        return helper.make_tensor(name, dtype, list(array.shape), array.reshape(-1), raw=False)
    t = onnx.TensorProto(name=name, data_type=dtype, dims=list(array.shape))
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    if data:   # the field's packed wire form (tag, length, little-endian values): no lists
        t.MergeFromString(_varint(field << 3 | 2) + _varint(len(data)) + data)
    return t


# Fields whose entries are fixed-size little-endian values (field numbers of onnx.proto).
_FIXED_FIELDS = {onnx.TensorProto.FLOAT: onnx.TensorProto.FLOAT_DATA_FIELD_NUMBER,
                 onnx.TensorProto.DOUBLE: onnx.TensorProto.DOUBLE_DATA_FIELD_NUMBER}


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def unpack_popart_data(t: onnx.TensorProto) -> onnx.TensorProto:
    """``t``, or a copy of it with its data one element per entry where it has PopART's
    packed layout (the narrow types' bytes memcpy'd into ``int32_data`` / ``uint64_data``).
    Told apart where the two layouts differ: FLOAT16 with ceil(n/2) entries for n > 1
    elements, or an entry outside the narrow type's range with every entry past the packed
    bytes zero. A packed tensor whose entries all fit the narrow type (e.g. INT8 [5, 0, 0, 0,
    7]) reads as ONNX defines it."""
    spec = _PACKED.get(t.data_type)
    if spec is None or t.HasField("raw_data"):
        return t
    np_type, field, field_type = spec
    values = getattr(t, field)
    n = int(np.prod(t.dims, dtype=np.int64))
    width = np.dtype(np_type).itemsize
    used = -(-n * width // np.dtype(field_type).itemsize)   # entries the packed bytes fill
    entries = np.asarray(values, dtype=np.uint64 if field == "uint64_data" else np.int64)
    if t.data_type == onnx.TensorProto.FLOAT16 and n > 1 and len(entries) == used:
        packed = True
    elif t.data_type != onnx.TensorProto.FLOAT16 and len(entries) == n and n > 0 \
            and not entries[used:].any():
        lo, hi = (0, 1) if t.data_type == onnx.TensorProto.BOOL else \
            (np.iinfo(np_type).min, np.iinfo(np_type).max)
        packed = bool(((entries < lo) | (entries > hi)).any())
    else:
        packed = False
    if not packed:
        return t
    out = onnx.TensorProto()
    out.CopyFrom(t)
    out.ClearField(field)
    out.raw_data = entries[:used].astype(field_type).tobytes()[:n * width]
    return out
