"""What a collective costs the ranks that wait for it, by the longest nap between two tests.

    mpiexec -n 2 python bench/probe_naps.py --calls 100 --json naps.json

The ranks of the job call ``--calls`` object allgathers (``Protocol.allgather``, two stages: the
sizes, then the bytes) one after another, each rank after its own busy wait of 0 to
``--skew-ms`` (3) at random, as ranks reach a restore's collectives at different times.
Rows: the cap of a save's collectives (``POLL_NAP_MAX_S``, 2 ms) and of a restore's
(``BRISK_NAP_S``, 0.1 ms), alternating for ``--rounds`` (2). Per call: the slowest rank's wall
time less its mean busy wait (what the collective cost), and each rank's CPU time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from mpi4py import MPI

from mpickpt.mpi import polling
from mpickpt.mpi.protocol import Protocol


def busy(ms: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < ms / 1e3:
        pass


def run(proto: Protocol, cap: float, calls: int, skew_ms: float) -> tuple[float, float]:
    """(wall s, CPU s) of this rank for ``calls`` collectives after busy waits, at ``cap``."""
    proto.nap_max = cap
    proto.barrier("start")
    t, c = time.perf_counter(), time.process_time()
    for i in range(calls):
        busy(random.random() * skew_ms)
        proto.allgather({"call": i, "payload": list(range(20))}, "probe")
    return time.perf_counter() - t, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=100, help="collectives per row (100)")
    ap.add_argument("--skew-ms", type=float, default=3.0, help="busy wait before each, at most")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the two rows (2)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    proto = Protocol(MPI.COMM_WORLD)
    random.seed(proto.rank)
    caps = {"save (naps up to 2 ms)": polling.POLL_NAP_MAX_S,
            "restore (brisk, 0.1 ms)": polling.BRISK_NAP_S}
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in caps}
    for _ in range(a.rounds):
        for label, cap in caps.items():
            wall, cpu = run(proto, cap, a.calls, a.skew_ms)
            every = MPI.COMM_WORLD.allgather((wall, cpu))
            rows[label].append({
                "collective_ms": max(w for w, _ in every) / a.calls * 1e3 - a.skew_ms / 2,
                "cpu_ms": statistics.mean(c for _, c in every) / a.calls * 1e3})
    if proto.rank == 0:
        print(f"{proto.size} ranks, {a.calls} allgathers per row after busy waits of 0-"
              f"{a.skew_ms:g} ms, {a.rounds} rounds (each round's figure)")
        print(f"{'waiting':26s} {'collective ms':>18s} {'CPU ms per call':>18s}")
        for label, rs in rows.items():
            took = ", ".join(f"{r['collective_ms']:.2f}" for r in rs)
            cpu = ", ".join(f"{r['cpu_ms']:.2f}" for r in rs)
            print(f"{label:26s} {took:>18s} {cpu:>18s}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"ranks": proto.size, "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
