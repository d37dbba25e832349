"""Where a compressed persist's time goes: the reference job saved (and waited for) with
``compression="zstd"`` and raw, each call of a compressed save's parts recorded with its
thread, against what the threads alone can do in the same run (each block compressed on
``--io-threads`` threads with nothing else; the compressed bytes written with O_DIRECT on as many).

Per part: calls, time in all, the first start and the last end from the save's start; and how
busy the save's threads were. No training loop: only the persist.

    python bench/probe_zstd_persist.py --saves 2 --dir /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import add_probe_args, probe_job
from restore_parts import timed

import mpickpt

PARTS = [("mpickpt.save.snapshot", "Snapshot.wait"),
         ("mpickpt.format.shard", "ShardWriter.__init__"),
         ("mpickpt.format.codec", "compress_into"),
         ("mpickpt.format.checksum", "digest"),
         ("mpickpt.format.framesink", "write_frame"),
         ("mpickpt.format.framesink", "FrameWriter.put"),
         ("mpickpt.format.framesink", "FrameWriter.finish"),
         ("mpickpt.format.shard", "ShardWriter.write"),
         ("mpickpt.format.shard", "ShardWriter._write_compressed"),
         ("mpickpt.format.shard", "ShardWriter.seal")]
EVENTS: list[tuple[str, str, float, float]] = []


def record(q: str, a: float, b: float) -> None:
    EVENTS.append((q, threading.current_thread().name, a, b))


def summary(t0: float, t1: float) -> list[str]:
    """Each part's calls between ``t0`` and ``t1``, and how many threads ran it."""
    out = []
    for _, q in PARTS:
        ev = [(th, a, b) for name, th, a, b in EVENTS if name == q and t0 <= a <= t1]
        if not ev:
            continue
        busy = sum(b - a for _, a, b in ev)
        out.append(f"  {q:32s} {len(ev):4d} calls {busy:7.3f} s in all, "
                   f"{min(a for _, a, _ in ev) - t0:6.3f} -> {max(b for _, _, b in ev) - t0:6.3f} s"
                   f", {len({th for th, _, _ in ev})} thread(s)")
    return out


Frames = list[tuple[Any, int]]  # each block's frame: its aligned buffer, and its length


def bound_compress(blocks: list[memoryview], threads: int) -> tuple[float, Frames]:
    """Seconds to compress every block on ``threads`` threads into buffers made beforehand,
    nothing else running."""
    from mpickpt.format import codec
    from mpickpt.format.framesink import AlignedBuffers

    pool = AlignedBuffers(codec.max_frame(max(len(b) for b in blocks)))
    bufs = [pool.take() for _ in blocks]
    for b in bufs:  # faulted in, as mpickpt's kept buffers are after its first save
        b[::4096] = bytes(len(b[::4096]))
    with ThreadPoolExecutor(threads) as ex:
        t = time.perf_counter()
        sizes = list(ex.map(lambda k: codec.compress_into("zstd", blocks[k], len(blocks[k]), 4,
                                                          memoryview(bufs[k])),
                            range(len(blocks))))
        return time.perf_counter() - t, list(zip(bufs, sizes, strict=True))


def bound_write(frames: Frames, path: str, threads: int) -> float:
    """Seconds to write ``frames`` (each in its aligned buffer, as mpickpt's compressing leaves
    it) back to back into a new file with O_DIRECT on ``threads`` threads, and fsync."""
    from mpickpt.format.framesink import AlignedBuffers, write_frame

    offsets, at = [], 0
    for _, n in frames:
        offsets.append(at)
        at += -(-n // 4096) * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    dfd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
    pool = AlignedBuffers(len(frames[0][0]))
    try:
        with ThreadPoolExecutor(threads) as ex:
            t = time.perf_counter()
            list(ex.map(lambda k: write_frame(fd, dfd, *frames[k], offsets[k], pool),
                        range(len(frames))))
            os.fsync(fd)
            return time.perf_counter() - t
    finally:
        os.close(dfd)
        os.close(fd)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_args(ap)
    ap.add_argument("--saves", type=int, default=2)
    args = ap.parse_args()
    job, dev = probe_job(args)
    nbytes = job.nbytes()
    print(f"state {nbytes / 1e9:.2f} GB on {dev}, {args.io_threads} I/O threads, {args.dir}",
          flush=True)
    for module, q in PARTS:
        timed(module, q, time.perf_counter, record)
    out: dict[str, Any] = {"bytes": nbytes, "io_threads": args.io_threads, "saves": {}}
    for comp in ("zstd", None):
        root = tempfile.mkdtemp(prefix="probe-zstd-", dir=args.dir)
        ck = mpickpt.Checkpointer(root, keep=2, io_threads=args.io_threads,
                                  encoding=mpickpt.Encoding(compression=comp))
        name = comp or "raw"
        try:
            for s in range(args.saves):
                t0 = time.perf_counter()
                h = ck.save(s, {"model": job.model, "optim": job.opt})
                t_call = time.perf_counter() - t0
                h.wait()
                t1 = time.perf_counter()
                size = sum(os.path.getsize(os.path.join(d, f))
                           for d, _, fs in os.walk(root) for f in fs if f.endswith(".h5"))
                print(f"{name} save {s}: save() {t_call:.3f} s, persisted after {t1 - t0:.3f} s"
                      f" ({nbytes / (t1 - t0) / 1e9:.2f} GB/s of state)", flush=True)
                for line in summary(t0, t1):
                    print(line, flush=True)
                out["saves"].setdefault(name, []).append(
                    {"call_s": t_call, "persist_s": t1 - t0, "files_bytes": size})
        finally:
            ck.close()
            import shutil
            shutil.rmtree(root, ignore_errors=True)
    # the threads alone, on the same bytes
    host = [t.detach().to("cpu").contiguous() for t in job.tensors()]
    blocks = []
    for t in host:
        v = memoryview(t.numpy()).cast("B")
        blocks += [v[i: i + (64 << 20)] for i in range(0, len(v), 64 << 20)]
    c_s, frames = bound_compress(blocks, args.io_threads)
    fb = sum(n for _, n in frames)
    cores = os.cpu_count() or 1
    if cores != args.io_threads:
        more_s, _ = bound_compress(blocks, cores)
        print(f"bound: compress on {cores} threads {more_s:.3f} s "
              f"({nbytes / more_s / 1e9:.2f} GB/s of state)")
        out["compress_all_cores_s"] = more_s
    w_s = bound_write(frames, os.path.join(args.dir, "probe-zstd-bound"), args.io_threads)
    print(f"bounds: compress {len(blocks)} blocks on {args.io_threads} threads {c_s:.3f} s "
          f"({nbytes / c_s / 1e9:.2f} GB/s of state); write the {fb / 1e9:.2f} GB of frames "
          f"(O_DIRECT, {args.io_threads} threads, fsync) {w_s:.3f} s ({fb / w_s / 1e9:.2f} GB/s)")
    out.update(compress_s=c_s, frames_bytes=fb, write_s=w_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
