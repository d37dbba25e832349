"""Where each rank's CPU goes in ``bench_frequent.py``'s mpickpt row: the thread CPU time
(``time.thread_time``) of each stage of a save, on whichever thread runs it, per call, per rank.

    mpiexec -n 4 python bench/probe_frequent_cpu.py --steps 60 --rounds 1 --methods mpickpt \\
        --mpickpt '{}' --dir /tmp/bf --json /tmp/bf/p.json

Arguments after the script's own (``--out-prefix P``, ``--extra module:Qual.name,...``: more
stages to time) are ``bench_frequent.py``'s. Each rank writes
``--out-prefix``-RANK.json (``{stage: [calls, cpu_s]}``) and rank 0 prints the table. Stages nest
(``Pipeline._save`` holds the store's write, publish and retain; ``Protocol.complete`` is the
polling of every collective, wherever it is).
"""

from __future__ import annotations

import json
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi4py import MPI
from restore_parts import timed

STAGES = [("mpickpt.checkpointer", "Checkpointer.save"),
          ("mpickpt.save.capture", "Capture.take"),
          ("mpickpt.save.snapshot", "Snapshotter.take"),
          ("mpickpt.save.pipeline", "Pipeline._save"),
          ("mpickpt.save.rootstore", "RootStore.write"), ("mpickpt.save.pipeline", "assemble"),
          ("mpickpt.format.manifest", "Manifest.assemble"),
          ("mpickpt.save.rootstore", "RootStore.publish"),
          ("mpickpt.save.rootstore", "RootStore._commit"),
          ("mpickpt.format.manifest", "Manifest.to_json"),
          ("mpickpt.save.rootstore", "RootStore.retain"),
          ("mpickpt.save.upkeep", "Upkeep.after_commit"),
          ("mpickpt.mpi.protocol", "Protocol.complete")]
SPENT: dict[str, list[float]] = {}


def spent(qualname: str, start: float, end: float) -> None:
    c = SPENT.setdefault(qualname, [0, 0.0])
    c[0] += 1
    c[1] += end - start


def main() -> None:
    prefix = "/tmp/frequent-cpu"
    args = sys.argv[1:]
    while args[:1] in (["--out-prefix"], ["--extra"]):
        if args[0] == "--out-prefix":
            prefix = args[1]
        else:
            STAGES.extend(tuple(x.split(":")) for x in args[1].split(","))
        args = args[2:]
    for module, qualname in STAGES:
        timed(module, qualname, time.thread_time, spent)
    sys.argv = [str(Path(__file__).with_name("bench_frequent.py")), *args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        comm = MPI.COMM_WORLD
        with open(f"{prefix}-{comm.rank}.json", "w") as f:
            json.dump(SPENT, f)
        every = comm.gather(SPENT, 0)
        if comm.rank == 0 and every:
            print("thread CPU ms per call (calls), by rank")
            for q in [q for _, q in STAGES]:
                cells = [f"{s[q][1] / s[q][0] * 1e3:6.2f} ({s[q][0]})" if q in s else "-"
                         for s in every]
                print(f"{q:28} " + "  ".join(cells))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
