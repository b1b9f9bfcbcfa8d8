"""Reports: where a compiled step's time and memory go, per ONNX node, switched on by PopART's
own options (see ``switches``); ``capture`` records, ``html`` renders, ``cli`` is
``popart profile``. Sessions call :func:`session_built`, :func:`session_compiling`,
:func:`popxl_compiling` and :func:`summary_lines`; :func:`compiling` registers the report's
``CompileHooks`` with the engine (``engine.hooks``) for the compile."""
from .switches import (compiling, engine_options, popxl_compiling, report_settings,
                       samples_per_run, session_built, session_compiling, summary_lines)

__all__ = ["compiling", "engine_options", "popxl_compiling", "report_settings",
           "samples_per_run", "session_built", "session_compiling", "summary_lines"]
