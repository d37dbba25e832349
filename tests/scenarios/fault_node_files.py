"""Run examples/train.py with its ranks grouped into simulated nodes:
``fault_node_files.py K ARGS...`` makes rank r node ``n{r // K}`` (``$MPICKPT_NODE``) and runs
the example with ARGS.

Run by tests/faults/test_fault_node_files.py.
"""

from __future__ import annotations

import os
import runpy
import sys

from mpi4py import MPI

TRAIN = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train.py")

if __name__ == "__main__":
    per_node = int(sys.argv[1])
    os.environ["MPICKPT_NODE"] = f"n{MPI.COMM_WORLD.rank // per_node}"
    sys.argv = [TRAIN, *sys.argv[2:]]
    runpy.run_path(TRAIN, run_name="__main__")
