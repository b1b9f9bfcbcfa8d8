"""A rank of tests/test_popart_tail2_host.py's job: ``raise_exit_worker.py OUT``. It joins
the job (``import popart`` under ``poprun``), writes OUT/ready.<rank>; then rank 1, once rank 0
is ready too, ends with ``raise SystemExit(7)`` (not ``sys.exit``) while rank 0 sleeps for two
minutes."""
import os
import sys
import time

import popdist

import popart  # noqa: F401  (joins the job the launcher started)


def main() -> int:
    rank = popdist.getInstanceIndex()
    with open(os.path.join(sys.argv[1], f"ready.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    print(f"rank {rank} joined; __name__ {__name__}; argv {sys.argv[1:]}", flush=True)
    if rank == 1:
        while not os.path.exists(os.path.join(sys.argv[1], "ready.0")):
            time.sleep(0.1)
        return 7
    time.sleep(120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
