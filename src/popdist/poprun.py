"""``poprun``: PopRun's command line on one machine. Starts ``--num-instances`` processes of
COMMAND as one ``jax.distributed`` job (``popart launch``'s machinery), each with PopRun's
``POPDIST_*`` variables for its share of ``--num-replicas``.

    poprun --num-instances 2 --num-replicas 4 [--ipus-per-replica 1]
           [--only-output-from-instance I] [--mpi-global-args "..."] python train.py ...
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from popdist import ENV


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
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``poprun`` console script; returns the exit status."""
    from popart import distributed
    args = build_parser().parse_args(argv)
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
