"""``python -m popdist._rank SCRIPT ARGS...`` (or ``-m MODULE ARGS...``): run the program as
``python SCRIPT ARGS...`` (``python -m MODULE ARGS...``) would, so that a rank of a launched job (``poprun``, ``popart launch``) ends with its status however
the program ends. Python hands a ``SystemExit`` raised by the program itself (the common
``raise SystemExit(main())``) to no hook; here it is seen and, in a rank of a job, given to
``popart.distributed``'s exit handling, so a failing rank leaves at once instead of waiting
for the other ranks at JAX's shutdown barrier (``sys.exit`` is seen there already)."""
from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    """Run ``sys.argv[1]`` (a script, or ``-m`` and a module) as the ``__main__`` program
    with the arguments after it."""
    module = sys.argv[2] if sys.argv[1] == "-m" else None
    try:
        if module is not None:   # sys.path[0] is the working directory, as for `python -m`
            sys.argv = sys.argv[2:]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = sys.argv[1:]
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))   # as `python SCRIPT`
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        dist = sys.modules.get("popart.distributed")
        if dist is None or isinstance(e, dist.RankExit):
            raise
        raise dist.RankExit(e.code) from None


if __name__ == "__main__":
    main()
