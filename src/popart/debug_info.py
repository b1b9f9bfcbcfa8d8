"""Debug contexts and debug information (PopART's ``DebugContext`` / ``DebugInfo``, Poplar's
debug-info streamer).

A :class:`DebugContext` names a piece of work and where in the program it was created; a
:class:`DebugInfo` attaches a record of named values to a context, for one ``layer`` (as
``"popart"`` or ``"unit_test"``). Between :func:`initializePoplarDebugInfo` and
:func:`closePoplarDebugInfo`, every DebugInfo created is written to the file given, in
Poplar's layout::

    {"contexts": [{"id": 2, "parentId": 1, "layer": "unit_test", "name": <string index>,
                   "location": {"fileName": <string index>, "functionName": <string index>,
                                "lineNumber": 30}, "arg": "123"}, ...],
     "stringTable": ["", "bar", "/path/to/file.py", "foo", ...]}

A record is written when its DebugInfo is destroyed (records of DebugInfos still alive at
close follow, oldest first); ids count from 1 in each file. The file is written atomically
when the streamer is closed, as JSON or as CBOR.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Optional, Sequence, Union

from .errors import popart_exception
from .fileio import atomic_write
from .logging import getLogger

__all__ = ["SourceLocation", "ProfileValue", "DebugContext", "DebugInfo",
           "initializePoplarDebugInfo", "closePoplarDebugInfo"]


class SourceLocation:
    """A place in the program: function name, file name and line number."""

    __slots__ = ("_function", "_file", "_line", "_valid")

    def __init__(self, functionName: str = "", fileName: str = "",
                 lineNumber: int = 0) -> None:
        for what, value in (("functionName", functionName), ("fileName", fileName)):
            if not isinstance(value, str):
                raise popart_exception(f"SourceLocation: {what} must be a str, got {value!r}")
        if isinstance(lineNumber, bool) or not isinstance(lineNumber, int) or lineNumber < 0:
            raise popart_exception(f"SourceLocation: lineNumber must be an int >= 0, got "
                                   f"{lineNumber!r}")
        self._function, self._file, self._line = functionName, fileName, int(lineNumber)
        self._valid = bool(functionName or fileName or lineNumber)

    @classmethod
    def _caller(cls, depth: int) -> "SourceLocation":
        """The location of the frame ``depth`` levels above the caller of this method."""
        frame = sys._getframe(depth + 1)
        return cls(frame.f_code.co_name, frame.f_code.co_filename, frame.f_lineno)

    def getFunctionName(self) -> str:
        return self._function

    def getFileName(self) -> str:
        return self._file

    def getLineNumber(self) -> int:
        return self._line

    def isValid(self) -> bool:
        return self._valid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SourceLocation) and \
            (self._function, self._file, self._line) == (other._function, other._file, other._line)

    def __repr__(self) -> str:
        return f"SourceLocation({self._function!r}, {self._file!r}, {self._line})"


_PV = Union[str, bool, int, float, Sequence[Any], Mapping[str, Any], "ProfileValue"]


def _plain(value: Any, what: str) -> Any:
    """A profile value as plain JSON-able Python (str, bool, int, float, list, dict)."""
    if isinstance(value, ProfileValue):
        return value._value
    if isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise popart_exception(f"{what}: map keys must be str, got {k!r}")
            out[k] = _plain(v, what)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, what) for v in value]
    try:   # NumPy scalars
        import numpy as np
        if isinstance(value, np.generic):
            return _plain(value.item(), what)
    except ImportError:  # pragma: no cover
        pass
    raise popart_exception(f"{what}: expected a str, number, bool, list or dict (or "
                           f"ProfileValue), got {value!r} ({type(value).__name__})")


class ProfileValue:
    """A value of a debug-info record: a string, number, bool, list or map of them."""

    __slots__ = ("_value",)

    def __init__(self, init: _PV = 0.0) -> None:
        self._value = _plain(init, "ProfileValue")

    @property
    def value(self) -> Any:
        """The value as plain Python (str, bool, int, float, list, dict)."""
        return self._value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProfileValue) and self._value == other._value

    def __repr__(self) -> str:
        return f"ProfileValue({self._value!r})"


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str):
        raise popart_exception(f"{what}: name must be a str, got {name!r} "
                               f"({type(name).__name__})")
    return name


def _check_loc(loc: Any, what: str) -> "SourceLocation":
    if not isinstance(loc, SourceLocation):
        raise popart_exception(f"{what}: loc must be a SourceLocation, got {loc!r}")
    return loc


class DebugContext:
    """A name, an optional parent :class:`DebugInfo` and the source location where the
    context was made. ``DebugContext()``, ``DebugContext(name)``, ``DebugContext(name,
    loc)``, ``DebugContext(debugInfo, name="")``, ``DebugContext(debugInfo, name, loc)`` or a
    copy ``DebugContext(other)``; without ``loc``, the location is the caller's. A str is
    accepted wherever a DebugContext is expected."""

    __slots__ = ("_name", "_loc", "_parent_id", "_parent_path")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        allowed = {"name", "loc", "debugInfo"}
        unknown = set(kwargs) - allowed
        if unknown:
            raise popart_exception(f"DebugContext: unexpected keyword argument(s) "
                                   f"{sorted(unknown)}; expected some of {sorted(allowed)}")
        parent: Optional[DebugInfo] = kwargs.pop("debugInfo", None)
        args = list(args)
        if args and isinstance(args[0], DebugInfo):
            if parent is not None:
                raise popart_exception("DebugContext: debugInfo given twice")
            parent = args.pop(0)
        elif args and isinstance(args[0], DebugContext) and not kwargs and len(args) == 1:
            other = args[0]   # copy: PopART's copy constructor keeps the path and location
            self._name, self._loc = other.getPathName(), other._loc
            self._parent_id, self._parent_path = None, ""
            return
        if len(args) > 2:
            raise popart_exception(f"DebugContext: too many arguments {tuple(args)!r}; expected "
                                   f"([debugInfo,] [name[, loc]])")
        if args and isinstance(args[0], SourceLocation) and len(args) == 1:
            args = ["", args[0]]
        names = ["name", "loc"]
        for key, value in zip(names, args):
            if key in kwargs:
                raise popart_exception(f"DebugContext: '{key}' given twice")
            kwargs[key] = value
        if parent is not None and not isinstance(parent, DebugInfo):
            raise popart_exception(f"DebugContext: debugInfo must be a DebugInfo, got {parent!r}")
        self._name = _check_name(kwargs.get("name", ""), "DebugContext")
        loc = kwargs.get("loc")
        self._loc = SourceLocation._caller(1) if loc is None else _check_loc(loc, "DebugContext")
        self._parent_id = None if parent is None else parent.getId()
        self._parent_path = "" if parent is None else parent.getPathName()

    @classmethod
    def _from(cls, value: Any, what: str, depth: int = 1) -> "DebugContext":
        """``value`` (a DebugContext, str or None) as a DebugContext located at the frame
        ``depth`` levels above the caller."""
        if isinstance(value, DebugContext):
            return value
        if value is None or isinstance(value, str):
            return cls(value or "", SourceLocation._caller(depth + 1))
        raise popart_exception(f"{what}: expected a DebugContext or str, got {value!r} "
                               f"({type(value).__name__})")

    @property
    def name(self) -> str:
        """This context's own name (not its path)."""
        return self._name

    @property
    def location(self) -> SourceLocation:
        """Where the context was made."""
        return self._loc

    @property
    def parentId(self) -> Optional[int]:
        """The id of the parent DebugInfo, or None."""
        return self._parent_id

    def getPathName(self) -> str:
        """The parent's path and this context's name, joined by '/'."""
        if not self._parent_path:
            return self._name
        return f"{self._parent_path}/{self._name}" if self._name else self._parent_path

    def __repr__(self) -> str:
        return f"DebugContext({self.getPathName()!r}, {self._loc!r})"


# ---------------------------------------------------------------------------------------
# The streamer

class _Stream:
    def __init__(self, filename: str, fmt: str) -> None:
        self.filename, self.format = filename, fmt
        self.next_id = 1
        self.written: list[dict] = []       # records of destroyed DebugInfos, in that order
        self.alive: dict[int, dict] = {}    # id -> record of DebugInfos not yet destroyed

    def finished(self, record: dict) -> None:
        if self.alive.pop(record["id"], None) is not None:
            self.written.append(record)

    def document(self) -> dict:
        strings: dict[str, int] = {}

        def index(s: str) -> int:
            return strings.setdefault(s, len(strings))

        contexts = []
        for r in self.written + list(self.alive.values()):
            out = {"id": r["id"]}
            if r["parentId"] is not None:
                out["parentId"] = r["parentId"]
            out["layer"] = r["layer"]
            out["name"] = index(r["name"])
            loc = r["location"]
            out["location"] = {"fileName": index(loc.getFileName()),
                               "functionName": index(loc.getFunctionName()),
                               "lineNumber": loc.getLineNumber()}
            out.update(r["values"])
            contexts.append(out)
        return {"contexts": contexts, "stringTable": list(strings)}

    def encode(self) -> bytes:
        doc = self.document()
        if self.format == "cbor":
            return _cbor(doc)
        return json.dumps(doc, indent=1).encode("utf-8")


_lock = threading.RLock()
_stream: Optional[_Stream] = None
_ids_outside_streams = iter(range(1, 2 ** 63))
_RESERVED_KEYS = frozenset({"id", "parentId", "layer", "name", "location"})


def _finished(stream: _Stream, record: dict) -> None:
    with _lock:
        stream.finished(record)


class DebugInfo:
    """The debug record of one :class:`DebugContext` for one ``layer``: an id and named
    values (:meth:`setValue`). Written to the debug-info file (when one is open) once it is
    destroyed, or when the file is closed."""

    def __init__(self, debugContext: Union[DebugContext, str], layer: str) -> None:
        dc = DebugContext._from(debugContext, "DebugInfo")
        if not isinstance(layer, str):
            raise popart_exception(f"DebugInfo: layer must be a str, got {layer!r} "
                                   f"({type(layer).__name__})")
        self._context = dc
        with _lock:
            stream = _stream
            self._id = next(_ids_outside_streams) if stream is None else stream.next_id
            self._record = {"id": self._id, "parentId": dc.parentId, "layer": layer,
                            "name": dc.name, "location": dc.location, "values": {}}
            if stream is not None:
                stream.next_id += 1
                stream.alive[self._id] = self._record
                weakref.finalize(self, _finished, stream, self._record)

    def getId(self) -> int:
        """This record's id (unique within a debug-info file)."""
        return self._id

    def getPathName(self) -> str:
        """The path name of this record's DebugContext."""
        return self._context.getPathName()

    def setValue(self, name: str, value: _PV) -> bool:
        """Record ``value`` (str, number, bool, list, dict or ProfileValue) under ``name``.
        False, and nothing recorded, when ``name`` is already set or is one of the record's
        own fields (id, parentId, layer, name, location)."""
        if not isinstance(name, str) or not name:
            raise popart_exception(f"DebugInfo.setValue: name must be a non-empty str, got "
                                   f"{name!r}")
        plain = _plain(value, f"DebugInfo.setValue('{name}')")
        with _lock:
            values = self._record["values"]
            if name in values or name in _RESERVED_KEYS:
                return False
            values[name] = plain
        return True

    def __repr__(self) -> str:
        return f"DebugInfo(id={self._id}, {self.getPathName()!r}, layer={self._record['layer']!r})"


def initializePoplarDebugInfo(filename: str, format: str = "json") -> None:  # noqa: A002
    """Start recording DebugInfos to ``filename``, as ``format`` "json" or "cbor"; the
    file is written by :func:`closePoplarDebugInfo`. A recording already under way is
    closed (written) first."""
    global _stream
    if not isinstance(filename, (str, os.PathLike)) or not os.fspath(filename):
        raise popart_exception(f"initializePoplarDebugInfo: filename must be a non-empty path, "
                               f"got {filename!r}")
    if format not in ("json", "cbor"):
        raise popart_exception(f"initializePoplarDebugInfo: format must be 'json' or 'cbor', "
                               f"got {format!r}")
    filename = os.fspath(filename)
    folder = os.path.dirname(os.path.abspath(filename))
    if not os.path.isdir(folder):
        raise popart_exception(f"initializePoplarDebugInfo: the folder '{folder}' of "
                               f"'{filename}' does not exist")
    with _lock:
        if _stream is not None:
            getLogger("popart").warn("initializePoplarDebugInfo: closing the debug info "
                                     "already being recorded to '{}'", _stream.filename)
            closePoplarDebugInfo()
        _stream = _Stream(filename, format)


def closePoplarDebugInfo() -> None:
    """Stop recording DebugInfos and write the file :func:`initializePoplarDebugInfo`
    named (nothing happens when no recording is under way)."""
    global _stream
    with _lock:
        stream, _stream = _stream, None
        if stream is None:
            return
        data = stream.encode()
    atomic_write(stream.filename, data)


# ---------------------------------------------------------------------------------------
# CBOR (RFC 8949), for the value types a debug-info document holds

def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise popart_exception(f"CBOR: integer {n} is too large")


def _cbor(value: Any) -> bytes:
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2 ** 63 and not math.isinf(value):
            return _cbor(int(value))
        return b"\xfb" + struct.pack(">d", value)
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(value, (list, tuple)):
        return _cbor_head(4, len(value)) + b"".join(_cbor(v) for v in value)
    if isinstance(value, Mapping):
        return _cbor_head(5, len(value)) + b"".join(_cbor(k) + _cbor(v)
                                                    for k, v in value.items())
    raise popart_exception(f"CBOR: cannot encode {value!r}")
