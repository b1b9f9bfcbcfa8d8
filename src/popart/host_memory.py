"""Host memory for XLA's CPU programs: keep large buffers in the process's heap.

XLA's CPU runtime allocates a program's output and temporary buffers with ``malloc`` on every
execution. glibc serves an allocation above its mmap threshold (at most 32 MiB by default) with
a fresh ``mmap`` and returns it with ``munmap`` when freed, trims freed memory at the top of its
heaps, and gives other threads arenas of 64 MiB heaps that cannot hold larger buffers: each run
then touches its big buffers anew, one page fault per 4 KiB page. GPT-2's 51 MB logits cost 28
ms of kernel time per inference run (a third of the LM head's matmul), a ViT-S training step
142,000 faults and a fifth of its time (docs/performance.md, "Host memory").

:func:`keep_large_buffers` (called on ``import popart``, before JAX starts its CPU client and
threads) sets glibc's ``mallopt``: one arena, an mmap threshold of 1 GiB and a trim threshold of
2 GiB, as ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=... MALLOC_TRIM_THRESHOLD_=...`` would:
freed buffers stay in the heap for the next run (the process keeps its peak's memory, as a
caching allocator does). ``POPART_HOST_MALLOC=0`` leaves glibc's defaults, as do other C
libraries, and settings the user made with those environment variables."""
from __future__ import annotations

import ctypes
import os
import platform


ENV = "POPART_HOST_MALLOC"
# glibc's malloc.h: M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX
_SETTINGS = ((-8, 1, "MALLOC_ARENA_MAX"), (-3, 1 << 30, "MALLOC_MMAP_THRESHOLD_"),
             (-1, (1 << 31) - 1, "MALLOC_TRIM_THRESHOLD_"))


def keep_large_buffers() -> bool:
    """Set glibc's malloc to keep freed large buffers in one heap (see the module's text);
    True if it did. Takes full effect only before other threads first allocate."""
    if os.environ.get(ENV, "1") in ("0", "false", "off", "") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    done = [mallopt(opt, value) == 1 for opt, value, env in _SETTINGS if env not in os.environ]
    return all(done)
