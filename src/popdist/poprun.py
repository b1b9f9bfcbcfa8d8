"""``poprun``: PopRun's command line on one machine. Starts ``--num-instances`` processes of
COMMAND as one ``jax.distributed`` job (``popart launch``'s machinery), each with PopRun's
``POPDIST_*`` variables for its share of ``--num-replicas``.

    poprun --num-instances 2 --num-replicas 4 [--ipus-per-replica 1]
           [--only-output-from-instance I] [--mpi-global-args "..."] python train.py ...

PopRun's partition and host options (``--vipu-partition``, ``--update-partition``,
``--remove-partition``, ``--offline-mode``, ``--host``, ``-v``/``-vv``, ...) are accepted; those
that mean nothing on one machine without V-IPU are named in one log line and change nothing.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from popdist import ENV

_LOG = logging.getLogger("poprun")


# PopRun options for V-IPU partitions, hosts and MPI placement: accepted, logged, no effect.
_IGNORED_VALUE = ("--vipu-partition", "--vipu-server-host", "--vipu-server-port",
                  "--vipu-server-timeout", "--vipu-cluster", "--vipu-allocation", "--num-ilds",
                  "--ipus-per-ild", "--mpi-local-args", "--executable-cache-path",
                  "--process-placement", "--host-subnet", "--ild-partition-type")
_IGNORED_BOOL = ("--update-partition", "--remove-partition", "--reset-partition",
                 "--offline-mode", "--print-topology", "--numa-aware", "--sync-type")


def ignored_options(args: argparse.Namespace) -> list[str]:
    """The PopRun options given in ``args`` that mean nothing here, as ``--name=value``."""
    flags = _IGNORED_VALUE + _IGNORED_BOOL + ("--host",)
    return [f"{f}={v}" for f in flags
            if (v := getattr(args, f[2:].replace("-", "_"))) is not None]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poprun", description="Run COMMAND as several instances "
                                "of one distributed job (PopRun's main options).")
    p.add_argument("--num-instances", type=int, default=1, metavar="N")
    p.add_argument("--num-replicas", type=int, default=None, metavar="R",
                   help="replicas of the job (default: one per instance)")
    p.add_argument("--ipus-per-replica", type=int, default=1, metavar="K")
    p.add_argument("--only-output-from-instance", type=int, default=None, metavar="I",
                   help="keep only instance I's stdout and stderr")
    p.add_argument("--mpi-global-args", default="", help="accepted; there is no MPI here")
    p.add_argument("--port", type=int, default=12355, help="coordinator port on 127.0.0.1")
    for flag in _IGNORED_VALUE + _IGNORED_BOOL:
        p.add_argument(flag, default=None, metavar="yes|no" if flag in _IGNORED_BOOL else None,
                       help=argparse.SUPPRESS)
    p.add_argument("--host", "-H", default=None, metavar="HOSTS",
                   help="accepted; every instance runs on this machine")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="-v / -vv: poprun logs at INFO / DEBUG")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``poprun`` console script; returns the exit status."""
    from popart import distributed
    args = build_parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(format="poprun: %(levelname)s: %(message)s")
        _LOG.setLevel(logging.INFO if args.verbose == 1 else logging.DEBUG)
    ignored = ignored_options(args)
    if ignored:
        _LOG.warning("ignoring %s: no V-IPU partitions or remote hosts here; all %d "
                     "instance(s) run on this machine", " ".join(ignored), args.num_instances)
    n = args.num_instances
    replicas = args.num_replicas if args.num_replicas is not None else n
    problems = [] if n >= 1 else [f"--num-instances must be >= 1, got {n}"]
    if n >= 1 and (replicas < n or replicas % n):
        problems.append(f"--num-replicas ({replicas}) must be a multiple of --num-instances ({n})")
    if not args.command:
        problems.append("no command to run (e.g. poprun --num-instances 2 python train.py)")
    if problems:
        print("poprun: error: " + "; ".join(problems), file=sys.stderr)
        return 2
    local = replicas // n

    def env_for(i: int) -> dict:
        env = {ENV["instances"]: str(n), ENV["index"]: str(i), ENV["replicas"]: str(replicas),
               ENV["offset"]: str(i * local), ENV["local"]: str(local),
               ENV["ipus"]: str(args.ipus_per_replica)}
        return env

    quiet = None if args.only_output_from_instance is None else \
        [i != args.only_output_from_instance for i in range(n)]
    return distributed.launch(list(args.command), n, port=args.port, env_for=env_for,
                              python=False, quiet=quiet, prog="poprun")


if __name__ == "__main__":
    sys.exit(main())
