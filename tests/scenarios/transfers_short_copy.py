"""A partner copy shorter than its manifest says (truncated on the surviving node): its donor
cannot map it, and its windows go all the same, so that the receiver does not wait for them;
the donor raises, the receiver's bytes are not the copy's (its verification then fails the
rebuild, and the restore falls back). Each rank writes "ok" or its error to OUT/rank-R.txt.

Run by tests/multirank/test_transfers.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mpickpt.local.exchange import copy_over
from mpickpt.mpi.protocol import Protocol

out = Path(sys.argv[1])
SIZE, WINDOW = 3 * (1 << 20) + 5, 1 << 20
proto = Protocol(timeout=60)
donor_file = out / "donor.h5"
if proto.rank == 0:
    donor_file.write_bytes(b"x" * (SIZE // 2))  # truncated
path = str(donor_file if proto.rank == 0 else out / "received.h5")
proto.barrier("files")
try:
    got = copy_over(proto, [(0, 1, path, SIZE)], WINDOW)
    result = f"ok {got}"
except OSError as e:
    result = f"OSError {e}"
(out / f"rank-{proto.rank}.txt").write_text(result)
if proto.rank == 1:
    assert os.path.getsize(out / "received.h5") == SIZE
