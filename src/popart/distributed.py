"""Many processes: global replication on JAX's distributed runtime.

PopART's global replication (``enableDistributedReplicatedGraphs``, ``globalReplicationFactor``,
``globalReplicaOffset``) ran one PopART instance per host, launched by PopRun. Here each
instance is a process of JAX's distributed runtime (``jax.distributed``; on CPUs the collectives
go through gloo). All replicas of all processes form one device mesh, so gradients are reduced
across processes inside the compiled program.

Start processes with ``popart launch -n N script.py`` (PopRun-style), or set the environment
variables below yourself; ``import popart`` then joins the runtime before JAX starts. A job
fails fast and whole: a failing rank leaves at once with its status, and the launcher or JAX's
coordination service ends the others (docs/multiprocess.md).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .errors import OptionError, popart_exception

ENV_COORDINATOR = "POPART_DIST_COORDINATOR"      # host:port of process 0
ENV_NUM_PROCESSES = "POPART_DIST_NUM_PROCESSES"
ENV_PROCESS_ID = "POPART_DIST_PROCESS_ID"

_initialized = False


# The distributed runtime's timeouts, set deliberately (docs/multiprocess.md):
HEARTBEAT_TIMEOUT_S = 10    # a rank silent this long (killed, crashed, host gone) is dead: the
                            # coordination service then ends every other rank. Heartbeats come
                            # from a C++ thread, so a busy or compiling rank still sends them;
                            # 10 s leaves room for a loaded host and keeps detection under 30 s.
SHUTDOWN_TIMEOUT_S = 300    # how long a rank that ended well waits at exit for the others to
                            # end (JAX's shutdown barrier). Ranks that fail skip the barrier, so
                            # this only bounds a healthy job's ranks finishing at different times.


def _timeouts(init: Callable) -> dict:
    """The timeout arguments this JAX's ``jax.distributed.initialize`` takes (heartbeat from
    jax 0.7.0, shutdown from jax 0.8.1; older ones keep JAX's fixed 100 s and 300 s)."""
    import inspect
    params = inspect.signature(init).parameters
    want = {"heartbeat_timeout_seconds": HEARTBEAT_TIMEOUT_S,
            "shutdown_timeout_seconds": SHUTDOWN_TIMEOUT_S}
    return {k: v for k, v in want.items() if k in params}


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the distributed runtime (call before any JAX computation). From then on a failure
    of this process ends it at once, without waiting for the job's other processes
    (:func:`_leave_on_failure`)."""
    global _initialized
    if _initialized:
        return
    import jax
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # older / newer JAX without the option: its default
        pass
    jax.distributed.initialize(coordinator, num_processes=int(num_processes),
                               process_id=int(process_id), **_timeouts(jax.distributed.initialize))
    _initialized = True
    _install_fail_fast(int(process_id), int(num_processes))


# ------------------------------------------------------------------- failing fast, in a rank
# At exit JAX's atexit handler shuts the distributed client down, a barrier that waits for
# every other process of the job. A failing process must not wait there: the launcher could
# not see the failure and the other processes would run on (or wait in their next collective
# until the heartbeat timeout). So a rank that ends with an uncaught exception or a non-zero
# ``sys.exit`` leaves with ``os._exit`` from an atexit handler that runs before JAX's.
_rank = (0, 1)
_exit_status = 0        # set when a SystemExit from sys.exit / exit / quit ends the program


def _install_fail_fast(rank: int, size: int) -> None:
    global _rank
    import atexit
    import builtins
    _rank = (rank, size)
    atexit.register(_leave_on_failure)   # registered after JAX's: runs before it
    sys.exit = _recording(sys.exit)
    for name in ("exit", "quit"):        # site's exit() / quit() raise SystemExit themselves
        if callable(getattr(builtins, name, None)):
            setattr(builtins, name, _recording(getattr(builtins, name)))


class RankExit(SystemExit):
    """The SystemExit that ``sys.exit`` raises in a rank. Python frees it at the top level,
    with no Python frame running, only when it ends the program (after the ``finally``
    blocks, before the atexit handlers); one that is caught is freed inside a frame."""

    def __del__(self) -> None:
        global _exit_status
        try:
            sys._getframe(1)
        except ValueError:   # no caller: freed by the interpreter as the program ends
            _exit_status = _status(self.code)


def _recording(exit_fn: Callable) -> Callable:
    """``exit_fn`` raising an :class:`RankExit` instead of its SystemExit."""
    if getattr(exit_fn, "_popart_records", False):
        return exit_fn

    def exit(status: object = None) -> None:
        try:
            exit_fn(status)
        except SystemExit as e:
            raise RankExit(e.code) from None
    exit._popart_records = True   # type: ignore[attr-defined]
    exit.__doc__ = exit_fn.__doc__
    return exit


def _status(code: object) -> int:
    """The process exit status Python gives ``SystemExit(code)``."""
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) else 1


def failure_status() -> int:
    """The exit status of this process if it is ending because it failed, else 0: an uncaught
    exception (1; 130 for KeyboardInterrupt), or ``sys.exit(n)`` with n != 0 that ended the
    program (a bare ``raise SystemExit(n)`` is seen where the launcher ran the script
    through ``popdist._rank``; otherwise such a rank waits at JAX's shutdown barrier like one
    that ended well)."""
    last = getattr(sys, "last_type", None)
    if last is not None and not hasattr(sys, "ps1"):     # not an interactive session's error
        return 130 if issubclass(last, KeyboardInterrupt) else 1
    return _exit_status


def _leave_on_failure() -> None:
    """atexit: a failing rank ends now, with its status, instead of waiting in JAX's shutdown
    barrier for the other ranks."""
    status = failure_status()
    if not status:
        return
    rank, size = _rank
    hint = ""
    value = getattr(sys, "last_value", None)
    if value is not None and "Gloo" in str(value):
        hint = " (a collective failed: another rank of the job has most likely ended)"
    how = "was interrupted" if status == 130 else "failed"
    print(f"popart: rank {rank} of {size} {how} (exit status {status}){hint}; ending it now, "
          f"without waiting for the other ranks", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    import logging
    logging.shutdown()
    os._exit(status)


def initialize_from_env() -> bool:
    """Join the runtime if the launcher's environment variables are set."""
    if ENV_COORDINATOR not in os.environ:
        return False
    try:
        n, pid = int(os.environ[ENV_NUM_PROCESSES]), int(os.environ[ENV_PROCESS_ID])
    except (KeyError, ValueError):
        raise popart_exception(f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and "
                               f"{ENV_PROCESS_ID} must be integers; got "
                               f"{os.environ.get(ENV_NUM_PROCESSES)!r}, "
                               f"{os.environ.get(ENV_PROCESS_ID)!r}") from None
    initialize(os.environ[ENV_COORDINATOR], n, pid)
    return True


# Rank variables of the launchers Horovod / PopRun programs use: (rank, size, local rank,
# local size).
RANK_VARIABLES = (("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
                  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                   "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                  ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


def launcher_ranks() -> Optional[tuple[int, int, int, int]]:
    """(rank, size, local rank, local size) from the first launcher's variables set, if any."""
    for names in RANK_VARIABLES:
        if names[0] in os.environ and names[1] in os.environ:
            try:
                rank, size = int(os.environ[names[0]]), int(os.environ[names[1]])
                return (rank, size, int(os.environ.get(names[2], rank)),
                        int(os.environ.get(names[3], size)))
            except ValueError:
                raise popart_exception(f"{names[0]} / {names[1]} / {names[2]} / {names[3]} must "
                                       f"be integers, got " + ", ".join(
                                           repr(os.environ.get(n)) for n in names)) from None
    return None


def join(caller: str) -> None:
    """Join the job this process was started in: one ``popart launch`` / ``poprun`` started
    (``POPART_DIST_*``; ``import popart`` has joined it already), or one a Horovod / MPI
    launcher started (:data:`RANK_VARIABLES`, plus the coordinator from
    ``POPART_DIST_COORDINATOR`` or ``MASTER_ADDR`` / ``MASTER_PORT``). Without either, a job
    of one process. ``caller`` names the API in errors."""
    if is_distributed() or initialize_from_env():
        return
    ranks = launcher_ranks()
    if ranks is None or ranks[1] == 1:
        return
    coordinator = os.environ.get(ENV_COORDINATOR)
    if coordinator is None and "MASTER_ADDR" in os.environ:
        coordinator = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '12355')}"
    if coordinator is None:
        raise popart_exception(
            f"{caller}: rank {ranks[0]} of {ranks[1]} processes, but no coordinator address: "
            f"set {ENV_COORDINATOR} (host:port of rank 0) or MASTER_ADDR / MASTER_PORT, or "
            f"start the processes with `popart launch -n {ranks[1]} ...`")
    initialize(coordinator, ranks[1], ranks[0])


def is_distributed() -> bool:
    return _initialized


def process_index() -> int:
    import jax
    return jax.process_index() if _initialized else 0


def process_count() -> int:
    import jax
    return jax.process_count() if _initialized else 1


def local_rows(x: Any) -> np.ndarray:
    """This process's rows of ``x``, an array split over the replicas along its leading
    dimension (all of it when this process holds all of it)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def global_value(x: Any) -> np.ndarray:
    """The whole value of ``x`` on every process. Across processes this is a collective:
    every process of the job must call it, for the same arrays in the same order."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_options(options: object, local_replicas: int) -> int:
    """The global replication factor the options ask for, checked against the runtime."""
    if not getattr(options, "enableDistributedReplicatedGraphs", False):
        return local_replicas
    g = int(getattr(options, "globalReplicationFactor", 1))
    offset = int(getattr(options, "globalReplicaOffset", 0))
    n, p = process_count(), process_index()
    if g != local_replicas * n:
        raise OptionError(
            f"globalReplicationFactor is {g}, but {n} process(es) with replicatedGraphCount "
            f"{local_replicas} give {local_replicas * n} replicas (start the processes with "
            f"`popart launch -n {max(g // max(local_replicas, 1), 1)} ...`)")
    if offset != p * local_replicas:
        raise OptionError(f"globalReplicaOffset is {offset}, but process {p} runs replicas from "
                          f"{p * local_replicas} (offset = process index x replicatedGraphCount)")
    return g


# ------------------------------------------------------------------- the launcher
GRACE_SECONDS = 5.0   # between SIGTERM and SIGKILL when launch stops its processes


class _Stopped(Exception):
    """The launcher got SIGTERM (or SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def launch(argv: Sequence[str], num_processes: int, port: int = 12355,
           host: str = "127.0.0.1", timeout: Optional[float] = None,
           env_for: Optional[Callable[[int], dict]] = None, python: bool = True,
           quiet: Optional[Sequence[bool]] = None, prog: str = "popart launch") -> int:
    """Run ``python argv...`` (``python`` False: the command ``argv``) as ``num_processes``
    processes of one distributed job on this machine; ``env_for(i)``: more environment
    variables for process i; ``quiet[i]``: discard process i's output.

    Returns 0 when every process succeeds. As soon as one fails, the others are stopped
    (:func:`_stop`) and the failed one's exit status is
    returned (128 + N for one killed by signal N). SIGINT or SIGTERM to the launcher stops
    every process and returns 130 / 143. When several processes print, each line of their
    output is prefixed by ``[rank I] `` (they run unbuffered: nothing is lost when they are
    stopped). ``prog`` names the launcher in its messages.
    ``timeout`` (seconds): stop them all and raise subprocess.TimeoutExpired."""
    import queue
    import signal
    import threading

    command = _rank_command([sys.executable, *argv] if python else list(argv))
    prefix = sum(not (quiet and quiet[r]) for r in range(num_processes)) > 1
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    ended: "queue.Queue[tuple[int, int]]" = queue.Queue()
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        def stop(signum: int, frame: Any) -> None:
            raise _Stopped(signum)
        handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for rank in range(num_processes):
            env = dict(os.environ, **{ENV_COORDINATOR: f"{host}:{port}",
                                      ENV_NUM_PROCESSES: str(num_processes),
                                      ENV_PROCESS_ID: str(rank)},
                       **(env_for(rank) if env_for else {}))
            silent = bool(quiet and quiet[rank])
            if prefix and not silent:
                env["PYTHONUNBUFFERED"] = "1"
            out = subprocess.DEVNULL if silent else subprocess.PIPE if prefix else None
            p = subprocess.Popen(command, env=env, stdout=out, stderr=out)
            procs.append(p)
            if out is subprocess.PIPE:
                pumps += [_pump(p.stdout, sys.stdout, f"[rank {rank}] "),
                          _pump(p.stderr, sys.stderr, f"[rank {rank}] ")]
            threading.Thread(target=lambda r=rank, q=p: ended.put((r, q.wait())),
                             daemon=True).start()
        done = 0
        while done < num_processes:
            wait = None if deadline is None else max(deadline - time.monotonic(), 0)
            try:
                rank, code = ended.get(timeout=wait if wait is not None else 3600)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(command, timeout) from None
                continue
            done += 1
            if code:
                status = 128 - code if code < 0 else code
                how = f"was killed by signal {-code}" if code < 0 else \
                    f"exited with status {code}"
                others = [str(r) for r, q in enumerate(procs) if q.poll() is None]
                _say(prog, f"rank {rank} {how}; " + (f"stopping rank(s) {', '.join(others)}; "
                                                     if others else "") + f"exit status {status}")
                return status
        return 0
    except KeyboardInterrupt:
        _say(prog, "interrupted (SIGINT); stopping every rank; exit status 130")
        return 130
    except _Stopped as e:
        _say(prog, f"got signal {e.signum}; stopping every rank; exit status {128 + e.signum}")
        return 128 + e.signum
    finally:
        try:
            _stop(procs)
        finally:
            for sig, h in handlers.items():
                signal.signal(sig, h)
            for t in pumps:   # the stopped processes' last output
                t.join(timeout=GRACE_SECONDS)


def _rank_command(command: list[str]) -> list[str]:
    """``command``, a script or ``-m`` module run by this Python run through
    ``popdist._rank`` (which sees the program's own ``raise SystemExit(n)``); any other
    command as it is."""
    import shutil
    exe = shutil.which(command[0]) if command else None
    runs = len(command) > 2 if command[1:2] == ["-m"] else \
        len(command) > 1 and not command[1].startswith("-")
    if not runs or exe is None or not os.path.samefile(exe, sys.executable):
        return command
    return [command[0], "-m", "popdist._rank", *command[1:]]


def _say(prog: str, message: str) -> None:
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


def _pump(source: Any, sink: Any, prefix: str) -> Any:
    """A thread copying the lines of ``source`` (a binary pipe) to ``sink``, each prefixed."""
    import threading

    def run() -> None:
        with source:
            for line in iter(source.readline, b""):
                text = line.decode(errors="replace")
                sink.write(prefix + text + ("" if text.endswith("\n") else "\n"))
                sink.flush()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """Stop the processes still running: SIGINT (a Python rank raises KeyboardInterrupt at its
    next Python line, runs its ``finally`` blocks and leaves at once) and SIGTERM (JAX's
    preemption notifier takes it in a rank of a job), then SIGKILL for those left after
    ``GRACE_SECONDS`` (a rank blocked in a call may not see the SIGINT: one of JAX's threads
    may get it)."""
    import signal
    running = [p for p in procs if p.poll() is None]
    for p in running:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
    end = time.monotonic() + GRACE_SECONDS
    for p in running:
        try:
            p.wait(timeout=max(end - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
