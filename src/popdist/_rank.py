"""``python -m popdist._rank SCRIPT ARGS...``: run SCRIPT as ``python SCRIPT ARGS...`` would,
so that a rank of a launched job (``poprun``, ``popart launch``) ends with its status however
the program ends. Python hands a ``SystemExit`` raised by the program itself (the common
``raise SystemExit(main())``) to no hook; here it is seen and, in a rank of a job, given to
``popart.distributed``'s exit handling, so a failing rank leaves at once instead of waiting
for the other ranks at JAX's shutdown barrier (``sys.exit`` is seen there already)."""
from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    """Run ``sys.argv[1]`` as the ``__main__`` program with the arguments after it."""
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))   # as `python SCRIPT` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        dist = sys.modules.get("popart.distributed")
        if dist is None or isinstance(e, dist.RankExit):
            raise
        raise dist.RankExit(e.code) from None


if __name__ == "__main__":
    main()
