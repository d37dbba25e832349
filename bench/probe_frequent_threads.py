"""Where ``bench_frequent.py``'s CPU goes, by thread, for every row: the training thread's CPU in
its training steps and in its checkpoint calls, and the CPU of the process's other Python
threads (a background save's) and of its other threads (gloo's), per step, per rank.

    mpiexec -n 4 python bench/probe_frequent_threads.py --steps 150 --rounds 2 \\
        --methods none,thread:torch.save+fsync,mpickpt --mpickpt '{}' --dir /tmp/bf

Arguments are ``bench_frequent.py``'s. The training steps' own CPU grows with what runs beside
them (the row without checkpoints is their baseline): that is the part of a save's cost no
thread of the save spends. Other threads are read from ``/proc/self/task`` before the row's
``finish()`` (a background thread may end in it) and after its setup; Linux only.
"""

from __future__ import annotations

import glob
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_frequent as bf
from mpi4py import MPI

SPENT: dict[str, list[float]] = {"step": [], "call": []}
TICKS: dict[str, dict[int, tuple[str, int]]] = {}


def threads() -> dict[int, tuple[str, int]]:
    """Every thread of this process: tid -> (name, CPU ticks so far)."""
    out = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            name = Path(task, "comm").read_text().strip()
            fields = Path(task, "stat").read_text().rsplit(")", 1)[1].split()
            out[int(Path(task).name)] = (name, int(fields[11]) + int(fields[12]))
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return out


def timed(owner: Any, name: str, key: str) -> None:
    fn = getattr(owner, name)

    def call(self: Any, *args: Any) -> Any:
        t = time.thread_time()
        try:
            return fn(self, *args)
        finally:
            SPENT[key].append(time.thread_time() - t)

    setattr(owner, name, call)


def main() -> None:
    timed(bf.Job, "step", "step")
    for cls in (bf.TorchSave, bf.ThreadSave, bf.DcpSave, bf.Mpickpt):
        timed(cls, "save", "call")
    for cls in (bf.Method, bf.ThreadSave, bf.DcpSave, bf.Mpickpt):
        def finish(self: Any, fn: Any = cls.finish) -> Any:
            TICKS["end"] = threads()
            return fn(self)
        cls.finish = finish
    one = bf.Bench.one

    def row(self: bf.Bench, name: str, rnd: int, index: int) -> dict[str, Any]:
        for v in SPENT.values():
            v.clear()
        TICKS["start"] = threads()
        out = one(self, name, rnd, index)
        start, end, main = TICKS["start"], TICKS["end"], os.getpid()  # (its tid)
        spent = {t: c - start.get(t, ("", 0))[1] for t, (_, c) in end.items()}
        tick = 1 / os.sysconf("SC_CLK_TCK") / self.args.steps
        python = sum(c for t, c in spent.items() if t != main and end[t][0] == "python")
        other = sum(c for t, c in spent.items() if end[t][0] != "python")
        w = self.args.warmup
        mine = (statistics.mean(SPENT["step"][w:]), statistics.mean(SPENT["call"][w:] or [0.0]),
                python * tick, other * tick)
        every = self.comm.gather(mine, 0)
        if self.rank == 0 and every:
            cells = ["/".join(f"{x * 1e3:.2f}" for x in r) for r in every]
            print(f"{name:26} {'  '.join(cells)}", flush=True)
        return out

    bf.Bench.one = row
    if MPI.COMM_WORLD.rank == 0:
        print("per rank, CPU ms per step: training steps / checkpoint call / other Python "
              "threads / other threads", flush=True)
    bf.main()


if __name__ == "__main__":
    sys.argv = [str(Path(bf.__file__)), *sys.argv[1:]]
    main()
