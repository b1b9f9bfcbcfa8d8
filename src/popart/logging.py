"""PopART's logging (user guide 4.6 and 9.1) on Python's ``logging``.

Modules log under the Python logger names ``popart`` and ``popart.<module>``. Every module is
``OFF`` until ``POPART_LOG_LEVEL`` / ``POPART_LOG_CONFIG`` (read at first use) or
``setLevel`` says otherwise; ``POPART_LOG_DEST`` is ``stderr`` (default), ``stdout`` or a file.
Lines look like ``[2019-10-16 13:55:05.359] [popart:devicex] [debug] Creating ...``.
"""
from __future__ import annotations

import datetime
import json
import logging as _pylogging
import os
import sys
import threading
from typing import Any

from .errors import popart_exception

__all__ = ["getLogger", "Logger", "MODULES", "LEVELS"]

MODULES = ("popart", "session", "ir", "devicex", "transform", "pattern", "builder", "op", "opx",
           "ces", "python", "none")
# PopART level -> (Python level, the name printed in the log line, as spdlog prints it)
LEVELS = {"TRACE": (5, "trace"), "DEBUG": (10, "debug"), "INFO": (20, "info"),
          "WARN": (30, "warning"), "ERR": (40, "error"), "CRITICAL": (50, "critical"),
          "OFF": (60, "off")}
_ALIASES = {"WARNING": "WARN", "ERROR": "ERR"}
_PRINTED = {py: printed for py, printed in LEVELS.values()}
_FROM_PY = {py: name for name, (py, _) in LEVELS.items()}

_lock = threading.Lock()
_configured = False


def _level_name(level: str, where: str) -> str:
    name = str(level).upper()
    name = _ALIASES.get(name, name)
    if name not in LEVELS:
        raise popart_exception(f"{where}: invalid log level {level!r}; expected one of "
                               f"{', '.join(LEVELS)}")
    return name


def _module_name(module: str, where: str) -> str:
    if module not in MODULES:
        raise popart_exception(f"{where}: unknown logging module {module!r}; expected one of "
                               f"{', '.join(MODULES)}")
    return module


def _py_logger(module: str) -> _pylogging.Logger:
    return _pylogging.getLogger("popart" if module == "popart" else f"popart.{module}")


class _Formatter(_pylogging.Formatter):
    def format(self, record: _pylogging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created)
        module = record.name.split(".", 1)[1] if "." in record.name else "popart"
        printed = _PRINTED.get(record.levelno, record.levelname.lower())
        return (f"[{stamp:%Y-%m-%d %H:%M:%S}.{stamp.microsecond // 1000:03d}] "
                f"[popart:{module}] [{printed}] {record.getMessage()}")


class _StdHandler(_pylogging.Handler):
    """Writes to ``sys.stdout`` / ``sys.stderr`` as they are at emit time (so redirection and
    test capture work)."""

    def __init__(self, stream_name: str) -> None:
        super().__init__()
        self._stream_name = stream_name

    def emit(self, record: _pylogging.LogRecord) -> None:
        try:
            stream = getattr(sys, self._stream_name)
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def _configure() -> None:
    """Read the environment once: destination, global level, per-module config file."""
    global _configured
    with _lock:
        if _configured:
            return
        dest = os.environ.get("POPART_LOG_DEST", "stderr") or "stderr"
        handler = (_StdHandler(dest) if dest in ("stdout", "stderr")
                   else _pylogging.FileHandler(dest))
        handler.setFormatter(_Formatter())
        _py_logger("popart").addHandler(handler)   # records still propagate to the host's
        levels = dict.fromkeys(MODULES, "OFF")
        if os.environ.get("POPART_LOG_LEVEL"):
            levels = dict.fromkeys(
                MODULES, _level_name(os.environ["POPART_LOG_LEVEL"], "POPART_LOG_LEVEL"))
        if os.environ.get("POPART_LOG_CONFIG"):
            path = os.environ["POPART_LOG_CONFIG"]
            try:
                with open(path) as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise popart_exception(f"POPART_LOG_CONFIG: cannot read '{path}' as a JSON "
                                       f"object of module:level pairs: {e}") from None
            if not isinstance(config, dict):
                raise popart_exception(f"POPART_LOG_CONFIG: '{path}' must hold a JSON object "
                                       f"of module:level pairs, got {type(config).__name__}")
            for module, level in config.items():
                where = f"POPART_LOG_CONFIG ({path})"
                levels[_module_name(module, where)] = _level_name(level, where)
        for module, level in levels.items():
            _py_logger(module).setLevel(LEVELS[level][0])
        _configured = True


class Logger:
    """The logger of one PopART module (``getLogger("session")``)."""

    def __init__(self, module: str = "popart") -> None:
        self.module = _module_name(module, "getLogger")
        self._logger = _py_logger(self.module)

    def setLevel(self, level: str) -> None:
        """Set this module's level; on ``popart`` it sets every module's level."""
        _configure()
        py = LEVELS[_level_name(level, f"Logger('{self.module}').setLevel")][0]
        for module in (MODULES if self.module == "popart" else (self.module,)):
            _py_logger(module).setLevel(py)

    def getLevel(self) -> str:
        _configure()
        return _FROM_PY.get(self._logger.level, "OFF")

    def isEnabledFor(self, level: str) -> bool:
        _configure()
        return self._logger.isEnabledFor(LEVELS[_level_name(level, "isEnabledFor")][0])

    def log(self, level: str, msg: Any, *args: Any) -> None:
        """Log ``msg`` (``str.format``-style ``{}`` placeholders filled from ``args``)."""
        py = LEVELS[_level_name(level, "log")][0]
        _configure()
        if self._logger.isEnabledFor(py):
            self._logger.log(py, str(msg).format(*args) if args else str(msg))

    def trace(self, msg: Any, *args: Any) -> None:
        self.log("TRACE", msg, *args)

    def debug(self, msg: Any, *args: Any) -> None:
        self.log("DEBUG", msg, *args)

    def info(self, msg: Any, *args: Any) -> None:
        self.log("INFO", msg, *args)

    def warn(self, msg: Any, *args: Any) -> None:
        self.log("WARN", msg, *args)

    warning = warn

    def error(self, msg: Any, *args: Any) -> None:
        self.log("ERR", msg, *args)

    err = error

    def critical(self, msg: Any, *args: Any) -> None:
        self.log("CRITICAL", msg, *args)

    def __repr__(self) -> str:
        return f"Logger('{self.module}', level={self.getLevel()})"


def getLogger(name: str = "all") -> Logger:
    """The logger of a PopART module: one of :data:`MODULES`, or ``"all"`` (PopART's
    default, the same as ``"popart"`` here: its ``setLevel`` sets every module's level)."""
    _configure()
    return Logger("popart" if name == "all" else name)
