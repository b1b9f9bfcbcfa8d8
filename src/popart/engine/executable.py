"""Executable files and the engine cache, for every front-end.

An executable file (``.popef``) is an .npz of the exported step (serialized StableHLO, see
``CompiledStep.export``), its signature as JSON (what the program was compiled for: the
model, configuration, options, package and JAX versions) and optionally arrays (variables,
optimizer state). Reading one bounds every size and checks the signature. The engine cache
is a folder of such files named by a hash of the signature; next to them, JAX's persistent
compilation cache keeps the XLA executables, so a hit neither traces nor compiles."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import threading
from importlib import metadata
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from ..errors import popart_exception
from ..fileio import atomic_write, load_npz_bounded
from ..logging import getLogger
from .compiled import CompiledStep

_logger = getLogger("session")
_devicex = getLogger("devicex")
EXECUTABLE_SLACK = 64 << 20   # bytes a file may hold beyond the tensors it is expected to hold


def package_version() -> str:
    try:
        return metadata.version("popart-xla")
    except metadata.PackageNotFoundError:
        return "unknown"


def runtime_signature() -> dict:
    """The versions and backend that compile a program (part of every signature)."""
    return {"popart_xla": package_version(), "jax": jax.__version__, "backend": jax.default_backend()}


def canonical(v: Any) -> Any:
    """``v`` as JSON-able data that is the same in every process (sets sorted)."""
    if isinstance(v, dict):
        return {str(k): canonical(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (set, frozenset)):
        return sorted(repr(x) for x in v)
    if isinstance(v, (list, tuple)):
        return [canonical(x) for x in v]
    return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)


def signature_diff(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> list[str]:
    """What differs between a saved signature and the session's, one item per field (per
    option for the options)."""
    out = []
    for k, b in mine.items():
        a = saved.get(k)
        if a == b:
            continue
        if k == "options" and isinstance(a, dict) and isinstance(b, dict):
            for n in sorted(set(a) | set(b)):
                if a.get(n) != b.get(n):
                    out.append(f"option {n} (file: {a.get(n, 'default')}, session: {b.get(n, 'default')})")
        else:
            out.append(f"{k} (file: {a}, session: {b})")
    return out


def executable_bytes(executable: bytes, signature: Mapping[str, Any],
                     arrays: Optional[Mapping[str, np.ndarray]] = None) -> bytes:
    """The contents of an executable file."""
    entries = {"executable": np.frombuffer(executable, np.uint8),
               "metadata": np.frombuffer(json.dumps(signature).encode(), np.uint8),
               **dict(arrays or {})}
    buf = io.BytesIO()
    np.savez(buf, **entries)
    return buf.getvalue()


def read_executable(filename: str, signature: Mapping[str, Any],
                    arrays_like: Optional[Mapping[str, Any]] = None,
                    max_bytes: int = EXECUTABLE_SLACK) -> tuple[bytes, dict[str, np.ndarray]]:
    """(executable, arrays) of an executable file. Arrays must be among ``arrays_like``
    with their shapes and dtypes; the file may hold at most ``max_bytes``; its signature must
    equal ``signature`` (popart_exception naming what differs)."""
    expected = {"executable": None, "metadata": None,
                **{k: (np.shape(v), np.asarray(v).dtype) for k, v in (arrays_like or {}).items()}}
    data = load_npz_bounded(filename, expected, max_bytes=max_bytes, required=("executable", "metadata"))
    try:
        saved = json.loads(bytes(data["metadata"]).decode())
    except (UnicodeDecodeError, ValueError):
        raise popart_exception(f"'{filename}' has unreadable metadata") from None
    diff = signature_diff(saved, signature)
    if diff:
        raise popart_exception(f"'{filename}' was compiled for something else: " + "; ".join(diff))
    arrays = {k: v for k, v in data.items() if k not in ("executable", "metadata")}
    return bytes(data["executable"]), arrays


def state_arrays(weights: Mapping[str, Any], state: Mapping[str, Any]) -> dict:
    """Variables and optimizer state as an executable (or variables) file names them:
    ``var/<id>``, ``opt/<id>``."""
    return {**{"var/" + k: v for k, v in weights.items()},
            **{"opt/" + k: v for k, v in state.items()}}


def optimizer_signature(opt: Any) -> Any:
    """The optimizer's type, settings and const hyper-parameters (compiled into the
    program); non-const ones are fed at run time and left out."""
    if opt is None:
        return None
    const = lambda ov: repr(ov) if ov.isConst() else "non-const"
    maps = {n: [const(m.getDefault()), {w: const(v) for w, v in m.getSpecifics().items()}]
            for n, m in getattr(opt, "_maps", {}).items()}
    return canonical({"type": opt.type_name(), "settings": opt.settings(), "const": maps,
                      "lossScaling": const(opt.loss_scaling())})


_XLA_CACHE_FLAGS = {"jax_compilation_cache_dir": None,
                    "jax_persistent_cache_min_compile_time_secs": 0.0,
                    "jax_persistent_cache_min_entry_size_bytes": 0}
_XLA_CACHE_LOCK = threading.Lock()


@contextlib.contextmanager
def xla_cache(folder: Optional[str]) -> Iterator[None]:
    """JAX's persistent compilation cache (XLA executables) in ``folder`` for the compile in
    this block only; ``folder`` None: JAX's own settings. JAX's config is process-wide, so
    it is set and put back under a lock that every compile through this module takes."""
    with _XLA_CACHE_LOCK:
        if folder is None:
            yield
            return
        saved = {k: getattr(jax.config, k) for k in _XLA_CACHE_FLAGS}
        try:
            for k, v in {**_XLA_CACHE_FLAGS, "jax_compilation_cache_dir": folder}.items():
                jax.config.update(k, v)
            compilation_cache.reset_cache()
            yield
        finally:
            for k, v in saved.items():
                jax.config.update(k, v)
            compilation_cache.reset_cache()


def signature_hash(signature: Mapping[str, Any]) -> int:
    """The hash an engine-cache entry is named by: 64 bits (PopART's ``size_t`` IR hash) of
    the signature's canonical JSON."""
    return int(hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16], 16)


class EngineCache:
    """One program's entry in an engine-cache folder: ``<folder>/<hash>.popef``, the decimal
    ``signature_hash`` of ``signature`` (PopART's ``Executablex::getCachePath``). Entries hold
    the exported step and its signature; ``<folder>/xla`` holds XLA's executables for them.
    Looking up an entry logs as PopART's Session / Ir / popef Reader do."""

    def __init__(self, folder: str, kind: str, signature: Mapping[str, Any],
                 max_bytes: int = EXECUTABLE_SLACK) -> None:
        self.folder, self.max_bytes = folder, max_bytes
        self.signature = {**signature, "kind": kind}
        self.hash = signature_hash(self.signature)
        self.entry = os.path.join(folder, f"{self.hash}.popef")
        self.xla_folder = os.path.join(os.path.abspath(folder), "xla")

    def _entries(self) -> dict[int, str]:
        """Hash -> file of the folder's entries (session.cpp getCacheEntries): a ``.popef``
        file named by a hash, else any file holding a valid executable."""
        out: dict[int, str] = {}
        names = sorted(os.listdir(self.folder)) if os.path.isdir(self.folder) else []
        for path in (os.path.join(self.folder, n) for n in names):
            if not os.path.isfile(path):
                continue
            stem, ext = os.path.splitext(os.path.basename(path))
            found: Optional[int] = None
            if ext != ".popef":
                _logger.trace(f"File in cache path does not have extension '.popef': {path}")
            elif not stem.isdigit():
                _logger.trace(f"Cannot infer IR hash from PopEF file name: {stem}")
            else:
                found = int(stem)
                _logger.info(f"PopEF file inferred to have hash '{found}' has been found: {path}")
            found = self._file_hash(path) if found is None else found
            if found is not None:
                out.setdefault(found, path)
        return out

    def _file_hash(self, path: str) -> Optional[int]:
        """The hash of the executable ``path`` holds, or None (popefserializer.cpp
        checkFileForValidPoplarExecutable; POPART_PRELOAD_POPEF=full-preload reads the file
        through first)."""
        _preload(path)
        try:
            data = load_npz_bounded(path, {"executable": None, "metadata": None},
                                    max_bytes=self.max_bytes)
        except popart_exception as e:
            _logger.trace(f"Ignoring invalid cache file {path}: {e}")
            return None
        try:
            saved = json.loads(bytes(data["metadata"]).decode()) if "metadata" in data else None
        except (UnicodeDecodeError, ValueError):
            saved = None
        if "executable" not in data or not isinstance(saved, dict):
            _logger.info(f"Ignoring cache file because it does not contain a valid PopART "
                         f"executable : {path}")
            return None
        _logger.info(f"PopART cache file has been found: {path}")
        return signature_hash(saved)

    def matching_entry(self) -> Optional[str]:
        """The folder's entry for this program, or None (Ir::compareWithSavedHash: a file
        named by the hash that holds another program is a false hit, warned about)."""
        path = self._entries().get(self.hash)
        stored = None if path is None else self._file_hash(path)
        if stored is not None and stored != self.hash:
            _logger.warn("Cache file hash did not match the IR hash, ignoring false cache hit.")
        return path if stored == self.hash else None

    def load(self) -> Optional[bytes]:
        """The entry's exported step, or None (no entry, or one that cannot be used: logged)."""
        path = self.matching_entry()
        if path is None:
            _logger.info(f"Engine cache: no entry for hash {self.hash}, compiling")
            return None
        _logger.info(f"Loading serialized PopART executable from {path}")   # PopART's
        try:
            executable, _ = read_executable(path, self.signature, max_bytes=self.max_bytes)
        except popart_exception as e:
            _logger.warn(f"Engine cache: entry not used, recompiling: {e}")
            return None
        return executable

    def store(self, executable: bytes) -> None:
        """Write the entry (atomically); a session works without it, so failures are logged."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            atomic_write(self.entry, executable_bytes(executable, self.signature))
            _logger.info(f"Engine cache: wrote '{self.entry}'")
        except (OSError, popart_exception) as e:
            _logger.warn(f"Engine cache: cannot write '{self.entry}': {e}")


def _preload(path: str) -> None:
    """POPART_PRELOAD_POPEF=full-preload: read a ``.popef`` file through once before it is
    opened (popefserializer.cpp preloadFileIfEnvVarSet)."""
    value = os.environ.get("POPART_PRELOAD_POPEF")
    if value != "full-preload" or not path.endswith(".popef"):
        return
    try:
        _logger.debug(f"Performing preload of popef file {path}")
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
        _logger.debug(f"Completed preload of popef file {path}")
    except OSError as e:
        _logger.warn(f"Error executing preload of file {path}, where POPART_PRELOAD_POPEF env "
                     f"var has value {value}. Error msg: {e}")


def compile_step(step: CompiledStep, specs: Sequence[Any], cache: Optional[EngineCache] = None,
                 exported: Optional[bytes] = None) -> str:
    """Compile ``step`` for ``specs``: from ``exported`` when given; else through ``cache``
    (its entry's module, or the step exported now and stored after compiling: the same
    module each time, so XLA's cache in the entry's folder finds its executable); else
    from the step function. Returns where the program came from: "executable",
    "engine cache", "compiled (cached)" or "compiled"."""
    source = "executable" if exported is not None else "compiled"
    store = False
    if exported is None and cache is not None:
        exported = cache.load()
        source = "engine cache"
        if exported is None:
            exported, store, source = step.export(specs), True, "compiled (cached)"
    compiling = source.startswith("compiled")
    if compiling:   # PopART's lines around poplar::compileGraph (IrLowering, devicex)
        _devicex.info("Starting compilation")
    with xla_cache(cache.xla_folder if cache is not None else None):
        step.compile(specs, exported)
    if compiling:
        _devicex.info("Graph compiled")
    if store:
        cache.store(exported)
    return source


class SessionFiles:
    """A popart session's executable files and engine-cache entry: their signature (the
    model, the configuration and options that shape the compiled program, the versions that
    compiled it) and the size bound for reading them. ``cfg`` is the session's current
    ``StepConfig``; ``like`` the arrays a file of the session may hold (``state_arrays``
    of its planned variables and optimizer state)."""

    def __init__(self, kind: str, model: Any, inputs: Mapping[str, Any], patterns: Any,
                 initializers: Mapping[str, Any]) -> None:
        self.kind, self.model, self.inputs = kind, model, inputs
        self.patterns, self.initializers = patterns, initializers

    def signature(self, cfg: Any) -> dict:
        """What a saved executable or engine-cache entry must agree on with the session."""
        return {"model_sha256": hashlib.sha256(self.model.SerializeToString()).hexdigest(),
                "session": self.kind, "batchesPerStep": cfg.batches_per_step,
                "accumulationFactor": cfg.accumulation_factor,
                "replicationFactor": cfg.replication_factor,
                "anchors": {k: repr(v) for k, v in cfg.anchors.items()},
                "inputs": {k: [v.data_type(), v.shape()] for k, v in self.inputs.items()},
                "loss": cfg.loss, "optimizer": optimizer_signature(cfg.optimizer),
                "options": dict(cfg.config.signature),
                "patterns": None if self.patterns is None else canonical(self.patterns.getSettings()),
                **runtime_signature()}

    def bound(self, like: Mapping[str, Any]) -> int:
        """The most bytes an executable file of this session may hold."""
        tensors = sum(np.asarray(v).nbytes for v in like.values())
        tensors += sum(np.asarray(v).nbytes for v in self.initializers.values())
        return EXECUTABLE_SLACK + 2 * tensors

    def cache(self, cfg: Any, like: Callable[[], Mapping[str, Any]]) -> Optional[EngineCache]:
        """The session's engine-cache entry (its config's ``cache_path``:
        SessionOptions.enableEngineCaching + cachePath, or POPART_CACHE_DIR), None when caching
        is off (``like`` is called only when on)."""
        if cfg.config.cache_path is None:
            return None
        return EngineCache(cfg.config.cache_path, self.kind, self.signature(cfg), max_bytes=self.bound(like()))

    def file_bytes(self, executable: bytes, cfg: Any, arrays: Mapping[str, Any]) -> bytes:
        """The .popef file: the compiled step, its signature and ``arrays`` (variables and
        optimizer state, or none)."""
        return executable_bytes(executable, self.signature(cfg), arrays)

    def read(self, filename: str, cfg: Any, like: Mapping[str, Any]) -> dict:
        """A .popef file's executable and variables, every size bounded by this session's
        tensors and its signature checked (popart_exception naming what differs)."""
        executable, arrays = read_executable(filename, self.signature(cfg), like, self.bound(like))
        loaded = {"executable": executable}
        if any(k.startswith("var/") for k in arrays):
            loaded["variables"] = {k[4:]: v for k, v in arrays.items() if k.startswith("var/")}
            loaded["optimizer_state"] = {k[4:]: v for k, v in arrays.items() if k.startswith("opt/")}
        return loaded
