"""Compile progress on stderr, as PopART shows it: quiet for fast compiles, a live elapsed-time
line for ones that take more than a second."""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def compile_progress(name: str, delay: float = 1.0) -> Iterator[None]:
    """Show ``Compiling <name> ... N.N s`` while the body runs longer than ``delay`` seconds.

    Set POPART_PROGRESS=0 to silence it."""
    if os.environ.get("POPART_PROGRESS", "1") == "0":
        yield
        return
    done = threading.Event()
    t0 = time.perf_counter()
    tty = sys.stderr.isatty()
    start, end = ("\r", "") if tty else ("", "\n")
    shown = []

    def show() -> None:
        if done.wait(delay):
            return
        shown.append(True)
        while not done.wait(0.5 if tty else 10.0):
            sys.stderr.write(f"{start}[popart] Compiling {name} ... "
                             f"{time.perf_counter() - t0:5.1f} s{end}")
            sys.stderr.flush()

    thread = threading.Thread(target=show, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if shown:
            sys.stderr.write(f"{start}[popart] Compiled {name} in "
                             f"{time.perf_counter() - t0:.1f} s{' ' * 10}\n")
            sys.stderr.flush()
