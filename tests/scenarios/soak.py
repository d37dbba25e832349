"""Soak: many saves of a small state with retention, watching memory, descriptors and disk.

Usage: soak.py ROOT SAVES KEEP REPORTS

Every rank holds a few tensors (about 100 KB), changes them before each save and saves steps
1..SAVES with ``keep=KEEP``, waiting for each save. Each rank samples its resident memory (VmRSS)
and open file descriptors at a few points; rank 0 checks ROOT after every save: it must hold
exactly stats.jsonl and the KEEP newest checkpoints. At the end the last checkpoint is restored
into a fresh state and compared bit for bit.

Each rank writes REPORTS/rank-R.json: the steps not committed (with their errors), the samples
(save, VmRSS bytes, open descriptors), the seconds of every save, and on rank 0 the largest ROOT
seen (bytes and entries, apart from stats.jsonl), each checkpoint's size, stats.jsonl's final
size, and the first few saves after which ROOT held something else than expected.

Run by tests/soak/test_soak.py.
"""

from __future__ import annotations

import os
import sys
import time
from array import array
from pathlib import Path

import torch
from _report import write_report
from mpi4py import MPI

import mpickpt

sys.path.insert(0, str(Path(__file__).resolve().parent))

WARMUP = 50  # saves before the first sample: lazily created pools, threads and caches


def make_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(7 + rank)
    return {
        "w": torch.randn(64, 256, generator=g),  # 64 KiB
        "b": torch.randn(256, generator=g),
        "m": torch.randn(4096, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 30, (2048,), generator=g),  # 16 KiB of int64
        "step": 0,
    }


def advance(state: dict, step: int) -> None:
    state["w"].mul_(0.999).add_(step * 1e-3)
    state["b"].add_(1.0)
    state["m"].add_(0.5)
    state["ids"].add_(step)
    state["step"] = step


def vm_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def scan(root: str) -> tuple[list[str], int, int]:
    """ROOT's names, the bytes of every file apart from stats.jsonl, and stats.jsonl's bytes."""
    names, total, stats = sorted(os.listdir(root)), 0, 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            size = os.path.getsize(os.path.join(dirpath, name))
            if dirpath == root and name == "stats.jsonl":
                stats = size
            else:
                total += size
    return names, total, stats


def main() -> None:
    root, saves, keep, reports = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    comm = MPI.COMM_WORLD
    rank = comm.rank
    marks = {WARMUP, *range(100, saves + 1, 100), saves}
    state = make_state(rank)
    ck = mpickpt.Checkpointer(root, keep=keep)
    seconds = array("d", bytes(8 * saves))  # allocated up front: the samples see no growth of it
    failed, samples, wrong = [], [], []
    most = {"bytes": 0, "entries": 0}
    ckpt_bytes: set[int] = set()
    stats_bytes = 0
    for step in range(1, saves + 1):
        advance(state, step)
        t = time.perf_counter()
        result = ck.save(step, state).wait()
        seconds[step - 1] = time.perf_counter() - t
        if not result.committed:
            failed.append([step, result.error])
        comm.Barrier()  # every rank is done with this save and none has begun the next
        if rank == 0:
            names, total, stats_bytes = scan(root)
            # past keep saves, the retired checkpoint's shards wait in .pool to be written over
            expect = [*([".pool"] if step > keep else []), "stats.jsonl",
                      *(f"step-{s:08d}" for s in range(max(1, step - keep + 1), step + 1))]
            if names != expect and len(wrong) < 5:
                wrong.append([step, names])
            most = {"bytes": max(most["bytes"], total),
                    "entries": max(most["entries"], len([n for n in names if
                                                         n.startswith("step-")]))}
            ckpt_bytes.add(sum(os.path.getsize(os.path.join(result.path, n))
                               for n in os.listdir(result.path)) if result.path else 0)
        if step in marks:
            samples.append([step, vm_rss(), open_fds()])
        comm.Barrier()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    fresh = make_state(rank)
    got = ck.restore(fresh)
    same = all(torch.equal(fresh[k], v) if isinstance(v, torch.Tensor) else fresh[k] == v
               for k, v in expected.items())
    ck.close()
    write_report(reports, f"rank-{rank}.json", {
        "rank": rank, "failed": failed, "samples": samples, "seconds": seconds.tolist(),
        "restored": [got, same],
        "most": most if rank == 0 else None,
        "checkpoint_bytes": sorted(ckpt_bytes) if rank == 0 else None,
        "stats_bytes": stats_bytes if rank == 0 else None,
        "wrong": wrong,
    })


if __name__ == "__main__":
    main()
