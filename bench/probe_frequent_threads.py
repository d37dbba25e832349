"""Where ``bench_frequent.py``'s CPU goes, by thread, for every row: the training thread's CPU in
its training steps and in its checkpoint calls, and the CPU of the process's other Python
threads (a background save's), of its other threads (gloo's), and of the threads that ended
during the row (``dcp.async_save`` starts one per save), per step, per rank.

    mpiexec -n 4 python bench/probe_frequent_threads.py --steps 150 --rounds 2 \\
        --methods none,thread:torch.save+fsync,mpickpt --mpickpt '{}' --dir /tmp/bf

Arguments are ``bench_frequent.py``'s. The training steps' own CPU grows with what runs beside
them (the row without checkpoints is their baseline): that is the part of a save's cost no
thread of the save spends. The threads are read from ``/proc/self/task`` before the row's setup
and before its ``finish()`` (a background thread may end in it); a thread is Python's if
``threading.enumerate()`` lists it then; what the process spent beyond its live threads is the
ended threads'. Linux only.
"""

from __future__ import annotations

import glob
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_frequent as bf
from mpi4py import MPI
from restore_parts import timed

SPENT: dict[str, list[float]] = {"step": [], "call": []}
TICKS: dict[str, tuple[dict[int, int], int, set[int]]] = {}


def ticks(stat: str) -> int:
    """utime + stime, in clock ticks, of a ``/proc/.../stat`` line."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def threads() -> tuple[dict[int, int], int, set[int]]:
    """(every live thread of this process: tid -> CPU ticks so far; the whole process's CPU
    ticks, ended threads included; the tids of Python's threads)."""
    python = {t.native_id for t in threading.enumerate() if t.native_id is not None}
    out = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            out[int(Path(task).name)] = ticks(Path(task, "stat").read_text())
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return out, ticks(Path("/proc/self/stat").read_text()), python


def spent(qualname: str, start: float, end: float) -> None:
    SPENT["step" if qualname == "Job.step" else "call"].append(end - start)


def main() -> None:
    for q in ("Job.step", "TorchSave.save", "ThreadSave.save", "DcpSave.save", "Mpickpt.save"):
        timed("bench_frequent", q, time.thread_time, spent)
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
        (start, total0, _), (end, total, python) = TICKS["start"], TICKS["end"]
        main = threading.main_thread().native_id
        spent = {t: c - start.get(t, 0) for t, c in end.items()}
        tick = 1 / os.sysconf("SC_CLK_TCK") / self.args.steps
        py = sum(c for t, c in spent.items() if t != main and t in python)
        other = sum(c for t, c in spent.items() if t not in python)
        ended = max(0, total - total0 - sum(spent.values()))
        w = self.args.warmup
        mine = (statistics.mean(SPENT["step"][w:]), statistics.mean(SPENT["call"][w:] or [0.0]),
                py * tick, other * tick, ended * tick)
        every = self.comm.gather(mine, 0)
        if self.rank == 0 and every:
            cells = ["/".join(f"{x * 1e3:.2f}" for x in r) for r in every]
            print(f"{name:26} {'  '.join(cells)}", flush=True)
        return out

    bf.Bench.one = row
    if MPI.COMM_WORLD.rank == 0:
        print("per rank, CPU ms per step: training steps / checkpoint call / other Python "
              "threads / other threads / threads that ended", flush=True)
    bf.main()


if __name__ == "__main__":
    sys.argv = [str(Path(bf.__file__)), *sys.argv[1:]]
    main()
