"""Writes $RUN_ARGV_OUT/rank-R.json: this rank's __name__, sys.argv and sys.path[0].

Run as a script (``run_argv.py ARGS``), a module (``-m run_argv ARGS``) or its text with ``-c``.

Run by tests/test_run.py.
"""

from __future__ import annotations

import json
import os
import sys

from mpi4py import MPI

rank = MPI.COMM_WORLD.rank
with open(os.path.join(os.environ["RUN_ARGV_OUT"], f"rank-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "name": __name__, "argv": sys.argv, "path0": sys.path[0]}, f)
