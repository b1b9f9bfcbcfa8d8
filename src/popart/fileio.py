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
from typing import Callable, Iterable, Mapping, Optional, Union

import numpy as np

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
# file written. A model may read these wherever they are (ir.onnx_import); a file put in
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
