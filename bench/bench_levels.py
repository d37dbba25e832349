"""Node-local level benchmark: time to protected, training stall, recovery after losing a node.

    mpiexec -n 2 python bench/bench_levels.py                 # 2 GPUs: the reference job, halved
    mpirun -n 2 --bind-to none python bench/bench_levels.py   # Open MPI: ranks left unbound
    mpiexec -n 2 python bench/bench_levels.py --gb 0.05 --steps 30 --step-ms 5 --reps 2   # CPU
    mpiexec -n 1 python bench/bench_levels.py                 # one node: no redundancy possible

Every rank is a simulated node (``$MPICKPT_NODE=n<rank>``) holding 1/N of the reference job's
state (bench_gpu.py's 29-layer 4096x4096 MLP with Adam, 5.84 GB in all; ``--gb`` scales it, the
layer width shrinking for small sizes), on ``cuda:<rank>`` when there is a GPU. One run measures,
side by side:

1. time to protected: from the save call until the checkpoint survives what it is meant to
   survive, the slowest rank's time, median of ``--reps`` after one warm-up (reported apart as
   ``first``; the node-local level's rows after a second one too, since it writes over the
   files of the step it retired from its third save on): mpickpt's node-local level
   (``local=/dev/shm/...``) with ``redundancy="partner"`` (the handle resolves once every shard
   has a copy on another node; ``--redundancy xor``: its parity, the ranks one XOR team of up to
   4) and without redundancy,
   mpickpt ROOT-only (commit under ``--root``), ``torch.save`` + fsync of one file per rank,
   ``dcp.save`` and ``dcp.async_save`` (a gloo/NCCL process group, each rank's keys prefixed with
   its rank since the ranks hold different tensors). Each mpickpt row reuses one Checkpointer.
2. training stall and slowdown: ``--steps`` fake training steps (forward passes of the rank's
   own model, no grad, repeated to take about ``--step-ms``, then a host sync and a barrier of
   all ranks, as a data-parallel step would) with a checkpoint at the local level every
   ``--every`` steps, against the same loop without checkpoints (run before and after it).
   Stall is the time ``save()`` took to return.
3. recovery after losing a node: a save at the local level that is also drained to ROOT,
   close, rank 1's node directory wiped (what a replaced node sees), the files on ROOT's disk
   evicted from the page cache (``--cache``); then a
   new Checkpointer's restore (rank 1's shard comes from its partner over MPI: checked that
   ``restore_info.level == "local"`` and no byte comes from ROOT), a restore from the node
   directories once they are whole again, a ROOT-only Checkpointer's restore of the drained copy,
   and ``dcp.load`` of the same state saved by DCP. With one rank there is no partner: the rows
   are the local restore of a restarted job, ROOT, and DCP.
4. local-level memory per node: bytes allocated under ``LOCAL/n<r>`` (tmpfs: memory) at the
   peak, sampled every millisecond during two extra saves (a kept checkpoint and the one being
   written), and in the steady state after the training loop, against the shard and the bound
   (1 + redundancy) x shard x (keep_local + 1).

0. the raw bounds each level is judged against, in the same run, on the same bytes: one MPI
   transfer of a shard's bytes between the simulated nodes (every rank sends its shard to the
   next and receives the previous one's, ``Sendrecv`` into buffers allocated and touched
   before, slowest rank, median of ``--reps``), a write of the shard into existing pages under
   ``--local`` (a file written once before, then overwritten), and with CUDA the device-to-host
   copy of the rank's state into page-locked memory. The report then gives the ratios the level
   is held to: time to protected over the slowest bound, the partner recovery's rate over the
   transfer's, the partner recovery over ROOT's.

Every restore goes into a second model/optimizer holding other values and is compared tensor by
tensor (and ``param_groups``) with the saved state; a mismatch fails the run. The table goes to
stdout, progress to stderr, everything to ``--out`` (JSON). ``/dev/shm`` directories and the
files under ``--root`` are removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's mpickpt
sys.path.insert(0, str(Path(__file__).resolve().parent))
# isort: off
from mpickpt.mpi import CMA  # before MPI starts: MPICH's single-copy transfers, as mpickpt.run's
from mpi4py import MPI
# isort: on

import bench_cpu
import bench_gpu
import restore_parts

import mpickpt
from mpickpt.background import usable_cpus
from mpickpt.format.manifest import NAME as MANIFEST
from mpickpt.format.names import shard_name
from mpickpt.format.rootdir import fsync_path, step_name
from mpickpt.local.nodedir import node_dirname
from mpickpt.local.topology import Topology, partner_source, team_of, xor_chunk_bytes

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
REF_LAYERS, REF_WIDTH = 29, 4096  # bench_gpu.py's defaults: the reference job, 5.84 GB
Pair = bench_cpu.Pair
METHODS = ("local", "local-none", "root", "torch.save", "dcp.save", "dcp.async_save")
LOST_ROWS = ("partner", "xor")  # part 3's row of a lost node's recovery, by redundancy


def say(msg: str) -> None:
    if RANK == 0:
        bench_cpu.log(msg)


def barrier(poll: float = 0.0002) -> None:
    """A barrier that sleeps while it waits (MPI's blocking calls spin and take a core from the
    background threads being measured)."""
    if SIZE > 1:
        req = COMM.Ibarrier()
        while not req.Test():
            time.sleep(poll)


def slowest(x: float) -> float:
    return COMM.allreduce(x, op=MPI.MAX)


def shape(gb: float | None, width: int | None) -> tuple[int, int]:
    """(layers in all, width): the reference job, or ``gb`` of it in at least 4 layers (the
    width halves until they fit; the same shape on any number of ranks)."""
    if gb is None:
        return REF_LAYERS, width or REF_WIDTH
    w = width or REF_WIDTH
    if not width:
        while w > 64 and gb * 1e9 / bench_cpu.layer_bytes(w) < 4:
            w //= 2
    return max(SIZE, bench_cpu.layer_count(gb, w)), w


def build(layers: int, width: int, seed: int, lr: float, device: torch.device) -> Pair:
    """bench_cpu's MLP + Adam (after one step), moved to ``device`` (Adam's ``step`` stays on
    the CPU, as Adam keeps it)."""
    model, optim = bench_cpu.make_state(layers, width, seed, lr)
    model.to(device)
    for st in optim.state.values():
        for k, v in st.items():
            if k != "step" and isinstance(v, torch.Tensor):
                st[k] = v.to(device)
    return model, optim


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(path: str) -> int:
    """Bytes a file takes (du: on tmpfs, memory; the holes of a sparse file take none)."""
    return os.lstat(path).st_blocks * 512


def node_usage(path: str) -> int:
    """Bytes allocated under ``path``, each file once: by inode, since the level renames files
    between the directories while the walk goes on (a retired step's into the pool, the pool's
    into a new step), and a file renamed from a directory already walked into one not yet
    walked would be counted twice (an H100 run reported a node's peak at 1.26x its bound: one
    partner copy more, for a moment, and never again)."""
    seen: dict[tuple[int, int], int] = {}
    for top, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(top, f))
                seen[st.st_dev, st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


class Sampler:
    """Polls ``node_usage`` in a thread; the largest value seen."""

    def __init__(self, path: str, every: float = 0.001) -> None:
        self.path, self.every = path, every
        self.peak, self.samples = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, node_usage(self.path))
            self.samples += 1
            time.sleep(self.every)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, node_usage(self.path))


# ------------------------------------------------------------------------------------ the job


class Workload:
    """A fake training step: forward passes of the rank's model (no grad; the matmuls of the
    step), repeated to take about ``step_s``, a host sync (``.item()``, as a loop that logs its
    loss) and a barrier of all ranks (as the gradient allreduce of a data-parallel step)."""

    def __init__(self, model: torch.nn.Module, width: int, batch: int, step_s: float,
                 device: torch.device) -> None:
        self.model, self.device = model, device
        while True:
            self.x = torch.randn(batch, width, device=device)
            self._pass()
            sync_device(device)
            t = time.perf_counter()
            for _ in range(3):
                self._pass()
            sync_device(device)
            one = (time.perf_counter() - t) / 3
            if one <= step_s or batch == 1:
                break
            batch = max(1, batch // 2)
        self.batch, self.passes = batch, max(1, round(step_s / one))

    def _pass(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model(self.x)

    def step(self) -> None:
        for _ in range(self.passes):
            y = self._pass()
        y.float().mean().item()
        barrier()


def loop(work: Workload, steps: int, save: Callable[[int], None] | None, every: int
         ) -> dict[str, Any]:
    """``steps`` steps; ``save(i)`` before step i when i % every == 0 (not before the first).
    ``steps_s``: each step's time, the slowest rank's (the save before it not included)."""
    barrier()
    times, stalls = [], []
    t0 = time.perf_counter()
    for i in range(steps):
        if save is not None and i and i % every == 0:
            c = time.perf_counter()
            save(i)
            stalls.append(time.perf_counter() - c)
        t = time.perf_counter()
        work.step()
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    each = np.empty(len(times))
    COMM.Allreduce(np.array(times), each, op=MPI.MAX)
    return {"loop_s": slowest(total), "step_s_median": statistics.median(times),
            "step_s_max": max(times), "stalls_s": [slowest(s) for s in stalls],
            "steps_s": each.tolist()}


# -------------------------------------------------------------------------------------- part 1


class Saves:
    """The part 1 rows: one save of a method, timed from a barrier, the slowest rank."""

    def __init__(self, args: argparse.Namespace, work: str, shm: str, src: Pair,
                 device: torch.device, wanted: list[str]) -> None:
        self.args, self.work, self.src, self.device = args, work, src, device
        self.state = {"model": src[0], "optim": src[1]}
        self.ck: dict[str, Any] = {}
        self.scheme = args.redundancy if SIZE > 1 else None
        self.local_dirs: dict[str, str] = {}
        for m in wanted:
            if m in ("local", "local-none"):
                scheme = self.scheme if m == "local" else None
                self.local_dirs[m] = os.path.join(shm, scheme or "none")
                self.ck[m] = self.local_ck(m, scheme)
            elif m == "root":
                self.ck[m] = mpickpt.Checkpointer(self.root_of(m), keep=2, on_error="raise",
                                                  io_threads=args.io_threads)
        self.step = 0
        self.dcp: Any = None

    def root_of(self, method: str) -> str:
        return os.path.join(self.work, f"root-{method}")

    def local_ck(self, method: str, scheme: str | None) -> Any:
        """A Checkpointer with the node-local level of ``method``: its own LOCAL and ROOT (a
        local directory belongs to one ROOT); nothing drained unless asked (drain=True)."""
        return mpickpt.Checkpointer(
            self.root_of(method), keep=2, on_error="raise", io_threads=self.args.io_threads,
            local=mpickpt.Local(self.local_dirs[method], redundancy=scheme, persist_every=None,
                                keep=1))

    def label(self, m: str) -> str:
        return {"local": f"mpickpt local, {self.scheme or 'no'} redundancy"
                         + (" (/dev/shm)" if self.args.local == "/dev/shm" else ""),
                "local-none": "mpickpt local, no redundancy",
                "root": "mpickpt ROOT only",
                "torch.save": "torch.save + fsync",
                "dcp.save": "dcp.save",
                "dcp.async_save": "dcp.async_save"}[m]

    def protects(self, m: str) -> str:
        if m == "local":
            return ("a copy on another node" if self.scheme else
                    "a restart (not the node's loss)")
        if m == "local-none":
            return "a restart (not the node's loss)"
        return "any node loss (on ROOT)"

    def dcp_state(self, pair: Pair) -> dict[str, Any]:
        # the ranks hold different tensors: plain tensors under the same key would be taken
        # for replicas and written once
        return {f"rank{RANK}": {"model": pair[0].state_dict(), "optim": pair[1].state_dict()}}

    def init_dcp(self) -> Any:
        if self.dcp is None:
            import torch.distributed as dist
            import torch.distributed.checkpoint as dcp

            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            if not dist.is_initialized():
                port = None
                if RANK == 0:
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", 0))
                        port = s.getsockname()[1]
                port = COMM.bcast(port)
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(port))
                backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
                dist.init_process_group(backend, rank=RANK, world_size=SIZE)
            self.dcp = dcp
        return self.dcp

    def once(self, m: str) -> dict[str, Any]:
        """One timed save of method ``m``: call and protected seconds (slowest rank)."""
        self.step += 1
        step = self.step
        path = os.path.join(self.work, m)
        if m.startswith("dcp"):
            dcp = self.init_dcp()
            if RANK == 0:
                shutil.rmtree(path, ignore_errors=True)
        elif m == "torch.save":
            os.makedirs(path, exist_ok=True)
        stats: dict[str, float] = {}
        sync_device(self.device)
        if RANK == 0:
            os.sync()  # what the previous row left dirty is not written during this one
        barrier()
        t0 = time.perf_counter()
        if m in self.ck:
            handle = self.ck[m].save(step, self.state)
            call = time.perf_counter() - t0
            result = handle.wait()
            if not result.committed:
                raise AssertionError(f"{m}: step {step} not committed: {result.error}")
            stats = dict(result.stats)
        elif m == "torch.save":
            f = os.path.join(path, f"rank{RANK}.pt")
            torch.save({"model": self.src[0].state_dict(), "optim": self.src[1].state_dict()}, f)
            fsync_path(f)
            fsync_path(path)
            call = time.perf_counter() - t0
        elif m == "dcp.save":
            dcp.save(self.dcp_state(self.src), checkpoint_id=path)
            call = time.perf_counter() - t0
        elif m == "dcp.async_save":
            fut = dcp.async_save(self.dcp_state(self.src), checkpoint_id=path)
            call = time.perf_counter() - t0
            getattr(fut, "upload_completion", fut).result()
        else:
            raise ValueError(f"unknown method {m}")
        total = time.perf_counter() - t0
        if m in self.ck:
            mine = int(stats.get("snapshot_bytes", 0))  # the shards: this and alignment
        elif m == "torch.save":
            mine = bench_gpu.tree_bytes(os.path.join(path, f"rank{RANK}.pt"))
        else:  # one directory for all ranks
            mine = bench_gpu.tree_bytes(path) if RANK == 0 else 0
        return {"step": step, "call_s": slowest(call), "protected_s": slowest(total),
                "bytes": COMM.allreduce(mine), "mpickpt_stats": stats}

    def close(self, m: str) -> None:
        ck = self.ck.pop(m, None)
        if ck is not None:
            ck.close()


def part1(s: Saves, methods: list[str], reps: int) -> dict[str, Any]:
    rows: dict[str, Any] = {m: {"first": None, "reps": []} for m in methods}
    for r in range(reps + 1):
        order = methods[r % len(methods):] + methods[:r % len(methods)]  # same on every rank
        say(f"part 1, {'warm-up round' if r == 0 else f'round {r}/{reps}'}: {', '.join(order)}")
        for m in order:
            got = s.once(m)
            if r == 0 and m.startswith("local"):  # keep_local=1: the third save on is the
                s.once(m)  # level's steady state, its files recycled from the one retired
            if r == 0:
                rows[m]["first"] = got
            else:
                rows[m]["reps"].append(got)
            say(f"  {m}: save() returned after {got['call_s']:.3f} s, protected after "
                f"{got['protected_s']:.3f} s")
    for m, row in rows.items():
        ps = [x["protected_s"] for x in row["reps"]]
        cs = [x["call_s"] for x in row["reps"]]
        row.update(label=s.label(m), protects=s.protects(m),
                   protected_s=statistics.median(ps), protected_best_s=min(ps),
                   call_s=statistics.median(cs), first_s=row["first"]["protected_s"])
    return rows


# -------------------------------------------------------------------------------------- part 3


def timed_restore(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    barrier()
    t0 = time.perf_counter()
    out = fn()
    sync_device(device)
    return slowest(time.perf_counter() - t0), out


def before_restore(dst: Pair, salt: int, work: str, cache: str, shm: str) -> str | None:
    """Scramble the target; make the restores read from the disk (once per host): ``cache``
    "files" evicts the bench's files under ``work`` (not the level's, under ``shm``) from the
    page cache, "global" drops all of it; why it could not be."""
    bench_cpu.scramble(dst, salt)
    barrier()
    note = None
    if RANK == 0 and cache == "global":
        note = bench_cpu.drop_caches()
    elif RANK == 0:
        left, pages = bench_cpu.evict(work, skip=shm)
        note = f"{left:,} of {pages:,} pages of {work} still cached" if left else None
    barrier()
    return COMM.bcast(note)


def check(what: str, ok: bool, detail: str) -> None:
    """Fail the run (every rank) unless ``ok`` holds on every rank."""
    bad = COMM.allgather(None if ok else f"rank {RANK}: {detail}")
    bad = [b for b in bad if b]
    if bad:
        raise AssertionError(f"{what}: " + "; ".join(bad))


def verified(what: str, src: Pair, dst: Pair) -> None:
    err = None
    try:
        bench_cpu.verify(src, dst)
    except AssertionError as e:
        err = str(e)
    check(what, err is None, f"restored state differs from the saved one: {err}")


def bounds(nbytes: int, state_bytes: int, shm: str, device: torch.device, reps: int,
           xor_share: float = 0.0) -> dict[str, Any]:
    """Part 0: the raw bounds, for ``nbytes`` (a shard) and ``state_bytes`` (this rank's state):
    seconds, slowest rank, median of ``reps`` after a warm-up. ``xor_share``: with XOR
    redundancy, the share of a shard's bytes each member XORs into the blocks it passes on
    ((n - 2) / (n - 1) in a team of n), for the bound of the transfer and that XOR at once."""
    chunk = 64 << 20
    out: dict[str, Any] = {"shard_bytes": COMM.allreduce(nbytes, op=MPI.MAX)}
    nbytes = out["shard_bytes"]
    buf = bytearray(nbytes)
    buf[::4096] = b"\x01" * len(buf[::4096])  # every page touched: no first-touch faults timed

    def median(fn: Callable[[], None]) -> float:
        fn()  # warm-up
        times = []
        for _ in range(reps):
            barrier()
            t = time.perf_counter()
            fn()
            times.append(slowest(time.perf_counter() - t))
        return statistics.median(times)

    if SIZE > 1:
        recv = bytearray(nbytes)
        recv[::4096] = b"\x01" * len(recv[::4096])
        nxt, prev = (RANK + 1) % SIZE, (RANK - 1) % SIZE

        def transfer() -> None:
            for off in range(0, nbytes, chunk):
                n = min(chunk, nbytes - off)
                COMM.Sendrecv([memoryview(buf)[off:off + n], MPI.BYTE], nxt,
                              recvbuf=[memoryview(recv)[off:off + n], MPI.BYTE], source=prev)

        out["mpi_s"] = median(transfer)
    path = os.path.join(shm, f"bound-{RANK}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        def write() -> None:
            for off in range(0, nbytes, chunk):
                os.pwrite(fd, memoryview(buf)[off:off + chunk], off)

        write()  # the pages exist from here on
        out["shm_write_s"] = median(write)
        if SIZE > 1:  # what a node does to protect a shard, on the same memory and cores
            def beside(work: Callable[[], None]) -> Callable[[], None]:
                """The transfer with ``work`` on a thread of its own meanwhile."""
                def run() -> None:
                    worker = threading.Thread(target=work)
                    worker.start()
                    transfer()
                    worker.join()
                return run

            out["both_s"] = median(beside(write))
            if xor_share > 0:  # the ring's own work beside the transfer: XOR on the same memory
                acc = np.zeros(chunk, np.uint8)
                src = np.frombuffer(buf, np.uint8)
                todo = int(nbytes * xor_share)

                def xor() -> None:
                    for off in range(0, todo, chunk):
                        n = min(chunk, todo - off)
                        np.bitwise_xor(acc[:n], src[off:off + n], out=acc[:n])

                out["xor_s"] = median(beside(xor))
    finally:
        os.close(fd)
        os.unlink(path)
    if device.type == "cuda":
        src = torch.empty(state_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty(state_bytes, dtype=torch.uint8, pin_memory=True)

        def d2h() -> None:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)

        out["d2h_s"] = median(d2h)
        del src, dst
    out["slowest_s"] = max(v for k, v in out.items()
                           if k.endswith("_s") and k not in ("both_s", "xor_s"))
    say(f"part 0: bounds {out}")
    return out


def part3(s: Saves, src: Pair, dst: Pair, step: int, device: torch.device,
          want_dcp: bool) -> dict[str, Any]:
    args, ck = s.args, s.ck["local"]
    local = s.local_dirs["local"]
    root = s.root_of("local")
    state = {"model": src[0], "optim": src[1]}
    dst_state = {"model": dst[0], "optim": dst[1]}
    out: dict[str, Any] = {"step": step, "rows": {}}
    say(f"part 3: save step {step} at the local level, drained to ROOT")
    res = ck.save(step, state, drain=True).wait()
    ck.wait()
    check("drained save", res.committed and os.path.isfile(
        os.path.join(root, step_name(step), MANIFEST)),
          f"step {step} not committed locally or not drained to {root}")
    out["save_stats"] = dict(res.stats)
    s.close("local")
    if want_dcp:
        dcp = s.init_dcp()
        dpath = os.path.join(s.work, "dcp-recovery")
        if RANK == 0:
            shutil.rmtree(dpath, ignore_errors=True)
        barrier()
        dcp.save(s.dcp_state(src), checkpoint_id=dpath)
    lost = SIZE > 1 and s.scheme is not None
    if lost:
        if RANK == 1:
            shutil.rmtree(os.path.join(local, node_dirname("n1")), ignore_errors=True)
        out["lost"] = f"node n1 (rank 1): {os.path.join(local, node_dirname('n1'))} wiped"
    else:
        out["lost"] = "no node lost (one node, no redundancy): a restarted job"
    notes = []

    def restore_ck(key: str, label: str, make: Callable[[], Any], level: str,
                   salt: int) -> None:
        notes.append(before_restore(dst, salt, s.work, args.cache, local))
        restore_parts.EVENTS.clear()
        t = time.perf_counter()
        c = make()
        setup = slowest(time.perf_counter() - t)
        secs, got = timed_restore(lambda: c.restore(dst_state), device)
        info = c.restore_info
        check(label, got == step and info is not None and info.level == level,
              f"restored step {got} from level {info and info.level}, expected step {step} "
              f"from {level}")
        if level == "local":
            check(label, info.root_bytes == 0, f"{info.root_bytes} bytes read from ROOT")
        if key in LOST_ROWS:
            want = "partner copy" if key == "partner" else "XOR rebuild"
            check(label, RANK != 1 or (info.source or "").startswith(want),
                  f"rank 1's shard came from {info.source!r}, not from a {want}")
        timeline = restore_parts.lines(t)
        verified(label, src, dst)
        sources = COMM.allgather(info.source)
        out["rows"][key] = {
            "label": label, "restore_s": secs, "setup_s": setup, "level": info.level,
            "sources": sources, "network_bytes": COMM.allgather(info.network_bytes),
            "total_network_bytes": info.total_network_bytes, "root_bytes": info.root_bytes,
            "restore_info_s": slowest(info.seconds), "phases": COMM.allgather(info.phases)}
        if args.timeline:
            out["rows"][key]["timeline"] = COMM.allgather(timeline)
            for r, tl in enumerate(out["rows"][key]["timeline"]):
                say(f"  timeline of rank {r} (ms from the Checkpointer's construction):\n"
                    + "\n".join(tl))
        say(f"  {label}: {secs:.3f} s (level {info.level}, sources {sources}, "
            f"{info.total_network_bytes:,} bytes over MPI, {info.root_bytes:,} from ROOT)")
        c.close()

    def local_ck() -> Any:
        return s.local_ck("local", s.scheme)

    say(f"part 3: restores ({out['lost']})")
    first = s.scheme if lost else "local"
    restore_ck(first, ("mpickpt local, rank 1 from its partner" if s.scheme == "partner" else
                       "mpickpt local, rank 1 rebuilt from its XOR team") if lost else
               "mpickpt local (own shards)", local_ck, "local", 11)
    if lost:
        restore_ck("local", "mpickpt local, own shards (node whole again)", local_ck, "local",
                   12)
    restore_ck("root", "mpickpt ROOT only (the drained copy)",
               lambda: mpickpt.Checkpointer(root, on_error="raise", io_threads=args.io_threads),
               "root", 13)
    if want_dcp:
        notes.append(before_restore(dst, 14, s.work, args.cache, local))

        def load() -> None:
            sd = s.dcp_state(dst)
            s.dcp.load(sd, checkpoint_id=dpath)
            dst[0].load_state_dict(sd[f"rank{RANK}"]["model"])
            dst[1].load_state_dict(sd[f"rank{RANK}"]["optim"])

        secs, _ = timed_restore(load, device)
        verified("dcp.load", src, dst)
        out["rows"]["dcp"] = {"label": "dcp.load", "restore_s": secs}
        say(f"  dcp.load: {secs:.3f} s")
    base = out["rows"][first]["restore_s"]
    for row in out["rows"].values():
        row["vs_first"] = row["restore_s"] / base
    out["reference_row"] = first
    out["cache_note"] = next((n for n in notes if n), None)
    return out


# ---------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace, work: str, shm: str) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(RANK % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // SIZE))
    os.environ["MPICKPT_NODE"] = f"n{RANK}"  # one simulated node per rank
    layers, width = shape(args.gb, args.width)
    mine = layers // SIZE + (1 if layers % SIZE > RANK else 0)
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(wanted) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    if "local" not in wanted:
        wanted.insert(0, "local")  # parts 2-4 need it
    if SIZE == 1 and "local-none" in wanted:
        wanted.remove("local-none")  # "local" is already without redundancy
    # every simulated node is on this host: its LOCAL must hold them all at their peak
    total = layers * bench_cpu.layer_bytes(width)
    need = total * (4 if SIZE > 1 else 2) + (2 * total if "local-none" in wanted else 0)
    os.makedirs(args.local, exist_ok=True)
    st = os.statvfs(args.local)
    free = st.f_bavail * st.f_frsize
    if free < 1.1 * need:
        raise SystemExit(
            f"{args.local} has {free / 1e9:.1f} GB free, the local level needs about "
            f"{need / 1e9:.1f} GB at its peak here ({SIZE} simulated node(s) on this host: kept "
            "checkpoint + the one being written, each with its redundancy"
            + (", and the no-redundancy row's" if "local-none" in wanted else "") + "): "
            "give --local a larger directory, leave out local-none (--methods), or use --gb")
    t = time.perf_counter()
    src = build(mine, width, seed=1 + 100 * RANK, lr=1e-3, device=device)
    dst = build(mine, width, seed=2 + 100 * RANK, lr=3e-4, device=device)
    nbytes = bench_cpu.payload_bytes(src)
    total = COMM.allreduce(nbytes)
    cpus = COMM.allgather(usable_cpus())
    say(f"state: {layers} x Linear({width}, {width}) + Adam = {total / 1e9:.3f} GB in all, "
        f"{SIZE} rank(s) of {COMM.allgather(nbytes)} bytes, on {device.type}, built in "
        f"{slowest(time.perf_counter() - t):.1f} s; ROOT {work}, local {shm}; CPUs each rank "
        f"may run on: {cpus}")
    if min(cpus) == 1 < (os.cpu_count() or 1):
        say("WARNING: a rank is bound to one CPU (Open MPI's mpirun binds two ranks to a core "
            "each: add --bind-to none); its figures measure that core, not the level")
    doc: dict[str, Any] = {
        "args": vars(args), "ranks": SIZE, "device": torch.cuda.get_device_name() if cuda
        else "cpu", "torch": torch.__version__, "layers": layers, "width": width,
        "bytes_per_rank": COMM.allgather(nbytes), "bytes": total, "root": work, "local": shm,
        "cpus_per_rank": cpus,
        "machine": bench_cpu.machine_info(work) if RANK == 0 else None,
        "local_filesystem": bench_cpu.filesystem_of(shm),
        "mpich_single_copy": os.environ.get(CMA) == "1" and "MPICH" in MPI.Get_library_version()}
    s = Saves(args, work, shm, src, device, wanted)

    # 1. time to protected
    doc["part1"] = part1(s, wanted, args.reps)
    for m in [m for m in wanted if m != "local"]:
        s.close(m)
    if RANK == 0:  # what only part 1 needed (local-none's node-local memory too)
        for m in ("torch.save", "dcp.save", "dcp.async_save", "root-root", "root-local-none"):
            shutil.rmtree(os.path.join(work, m), ignore_errors=True)
        if "local-none" in s.local_dirs:
            shutil.rmtree(s.local_dirs["local-none"], ignore_errors=True)

    # 4a. peak node-local memory during two more saves (untimed)
    node = os.path.join(s.local_dirs["local"], node_dirname(f"n{RANK}"))
    ck = s.ck["local"]
    with Sampler(node) as sampler:
        for _ in range(2):
            s.step += 1
            res = ck.save(s.step, s.state).wait()
    shard_file = os.path.join(res.path, shard_name(RANK))
    shard, shard_alloc = os.path.getsize(shard_file), allocated(shard_file)

    # 2. training loop
    every = args.every if args.every < args.steps else max(1, args.steps // 3)
    work_ = Workload(src[0], width, args.batch, args.step_ms / 1e3, device)
    say(f"part 2: {args.steps} steps of {work_.passes} forward pass(es) of batch {work_.batch} "
        f"(~{args.step_ms} ms), a checkpoint every {every} steps")
    for _ in range(5):  # warm-up, not counted
        work_.step()
    base0 = loop(work_, args.steps, None, every)
    stats: list[dict[str, float]] = []
    handles: list[Any] = []
    step0 = s.step

    def save(i: int) -> None:
        handles.append(ck.save(step0 + i, s.state))

    with_ck = loop(work_, args.steps, save, every)
    wait_t = time.perf_counter()
    for h in handles:
        r = h.wait()
        stats.append(dict(r.stats))
    ck.wait()
    waited = slowest(time.perf_counter() - wait_t)
    s.step = step0 + args.steps
    base1 = loop(work_, args.steps, None, every)
    base = (base0["loop_s"] + base1["loop_s"]) / 2
    stalls = with_ck["stalls_s"]
    doc["part2"] = {
        "steps": args.steps, "every": every, "checkpoints": len(stalls),
        "passes_per_step": work_.passes, "batch": work_.batch,
        "baseline_before": base0, "baseline_after": base1, "with_checkpoints": with_ck,
        "slowdown_pct": (with_ck["loop_s"] / base - 1) * 100,
        "stall_max_s": max(stalls) if stalls else float("nan"),
        "stall_median_s": statistics.median(stalls) if stalls else float("nan"),
        "protected_s": [x.get("protected_s") for x in stats], "mpickpt_stats": stats,
        "waited_after_loop_s": waited}
    say(f"  slowdown {doc['part2']['slowdown_pct']:.1f} %, stalls {stalls}")
    if args.sweep:  # 2b. the same loop at each interval: the shortest one training sustains
        sweep = []
        for k in sorted({int(x) for x in args.sweep.split(",")}):
            step0, handles = s.step, []
            run_k = loop(work_, args.steps, save, k)
            for h in handles:
                h.wait()
            ck.wait()
            s.step = step0 + args.steps
            again = loop(work_, args.steps, None, k)  # a baseline beside each, for the drift
            base_k = (base + again["loop_s"]) / 2
            sweep.append({"every": k, "checkpoints": len(run_k["stalls_s"]),
                          "slowdown_pct": (run_k["loop_s"] / base_k - 1) * 100,
                          "stall_max_s": max(run_k["stalls_s"], default=0.0),
                          "step_s_max": run_k["step_s_max"], "loop_s": run_k["loop_s"],
                          "baseline_s": base_k, "steps_s": run_k["steps_s"]})
            say(f"  every {k}: slowdown {sweep[-1]['slowdown_pct']:.1f} %")
        doc["part2"]["sweep"] = sweep

    # 4b. steady state after the loop
    steady = node_usage(node)
    factor = 1.0 if s.scheme == "partner" else 0.0
    kept = 1 + 1  # keep_local=1, and the one being written
    shards = COMM.allgather(shard)
    held = 0  # the partner copy this node stores (the shards of the ranks may differ)
    topology = Topology(tuple(f"n{r}" for r in range(SIZE)))
    if s.scheme == "partner":
        held = shards[partner_source(topology.teams("partner", None), RANK)]
    elif s.scheme == "xor":  # this node's parity: one chunk of its team's largest shard
        team = team_of(topology.teams("xor", None), RANK)
        held = xor_chunk_bytes(max(shards[m] for m in team), len(team))
        factor = 1 / (len(team) - 1)
    mem = {"node": f"n{RANK}", "state_bytes": nbytes, "shard_file_bytes": shard,
           "held_copy_bytes": held, "shard_bytes": shard_alloc, "peak_bytes": sampler.peak,
           "samples": sampler.samples, "steady_bytes": steady,
           "bound_bytes": int((shard + held) * kept), "redundancy": s.scheme}
    doc["part4"] = {"nodes": COMM.gather(mem), "kept": kept, "factor": factor}

    # 0. the raw bounds of the same bytes
    team_size = len(team_of(topology.teams("xor", None), RANK)) if s.scheme == "xor" else 0
    doc["bounds"] = bounds(shard, nbytes, shm, device, args.reps,
                           (team_size - 2) / (team_size - 1) if team_size > 2 else 0.0)

    # 3. recovery after losing a node
    doc["part3"] = part3(s, src, dst, s.step + 1, device,
                         any(m.startswith("dcp") for m in wanted))
    return doc


# -------------------------------------------------------------------------------------- report


table = bench_cpu.columns


PHASES = (("copy_s", "into host memory"), ("data_s", "shard written"),
          ("stream_s", "partner stream or XOR parity"), ("protect_s", "protect"),
          ("protected_s", "protected"))


def phases_report(p1: dict[str, Any]) -> list[str]:
    """Rank 0's own figures of each mpickpt row's timed saves (median), from save(): where the
    time to protected goes."""
    out = []
    for r in p1.values():
        stats = [x.get("mpickpt_stats") or {} for x in r.get("reps", [])]
        have = [(label, statistics.median(s[k] for s in stats)) for k, label in PHASES
                if stats and all(k in s for s in stats)]
        if have:
            out.append(f"  {r['label']}, rank 0's phases (median s): "
                       + ", ".join(f"{label} {v:.3f}" for label, v in have))
    return out


def bounds_report(doc: dict[str, Any]) -> list[str]:
    """Part 0's table, and the ratios the node-local level is held to (issue goals in
    brackets)."""
    b, p1, p3 = doc["bounds"], doc["part1"], doc["part3"]
    size = b["shard_bytes"]
    names = {"mpi_s": "one MPI transfer of a shard between two nodes (Sendrecv, reused buffers)",
             "shm_write_s": "a write of a shard into existing pages of LOCAL",
             "d2h_s": "the device-to-host copy of a rank's state (page-locked)",
             "both_s": "the transfer and the write at once (a thread each)",
             "xor_s": "the transfer and the XOR a member of the ring does, at once"}
    rows = [(names[k], f"{b[k]:.3f}", f"{size / b[k] / 1e9:.2f}")
            for k in names if k in b]
    out = [f"0. raw bounds, {size:,} bytes per shard, slowest rank, median of "
           f"{doc['args']['reps']} after a warm-up",
           table(("bound", "s", "GB/s"), rows)]
    if "local" in p1:
        out.append(f"time to protected ({p1['local']['label']}) / slowest bound: "
                   f"{p1['local']['protected_s'] / b['slowest_s']:.2f}x  (goal <= 1.25x)")
        if "both_s" in b:
            out.append(f"time to protected / the transfer and the write at once: "
                       f"{p1['local']['protected_s'] / b['both_s']:.2f}x  (where both share "
                       "one host's memory, as simulated nodes do)")
        if "xor_s" in b:
            out.append(f"time to protected / the transfer and the ring's XOR at once: "
                       f"{p1['local']['protected_s'] / b['xor_s']:.2f}x")
    rows3 = p3["rows"]
    key = next((k for k in LOST_ROWS if k in rows3), None)
    if key is not None and "mpi_s" in b:
        r = rows3[key]
        # the lost shard's bytes (XOR: they come around the team's ring, the lost rank's
        # parity after the restore)
        moved = doc["bytes_per_rank"][1] if key == "xor" else r["total_network_bytes"]
        rate = moved / r["restore_s"] if r["restore_s"] else 0.0
        out.append(f"recovery of a lost node from its {key if key == 'partner' else 'XOR team'}"
                   f": {moved:,} bytes {'over MPI' if key == 'partner' else 'rebuilt'} in "
                   f"{r['restore_s']:.3f} s = {rate / (size / b['mpi_s']):.0%} of the transfer "
                   "rate  (goal >= 80%)"
                   + (f"; {rate / (size / b['xor_s']):.0%} of the rate of the transfer and the "
                      "ring's XOR at once" if key == "xor" and "xor_s" in b else ""))
        if "root" in rows3:
            out.append(f"{key} recovery / ROOT recovery: "
                       f"{r['restore_s'] / rows3['root']['restore_s']:.2f}x  (goal <= 0.5x)")
    return out


def report(doc: dict[str, Any]) -> str:
    gb = doc["bytes"] / 1e9
    p1, p2, p3, p4 = doc["part1"], doc["part2"], doc["part3"], doc["part4"]
    fs = (doc["machine"] or {}).get("filesystem", {})
    lfs = doc["local_filesystem"]
    how = doc["args"].get("cache", "global")
    cache = (f"cache not dropped ({p3['cache_note']})" if p3["cache_note"] is not None else
             "page cache dropped before each restore" if how == "global" else
             "ROOT's and the peers' files evicted from the page cache before each restore "
             "(the local level's left as they are)")
    out = [f"{doc['ranks']} rank(s), one per simulated node, {gb:.3f} GB state in all "
           f"({doc['layers']} x Linear({doc['width']})^2 + Adam; per rank "
           f"{', '.join(f'{b / 1e9:.3f}' for b in doc['bytes_per_rank'])} GB), "
           f"{doc['device']}, torch {doc['torch']}",
           f"ROOT {doc['root']} on {fs.get('type', '?')} ({fs.get('device', '?')}); local "
           f"{doc['local']} on {lfs.get('type', '?')}; {cache}; MPICH single-copy (CMA) "
           f"transfers {'on' if doc.get('mpich_single_copy') else 'off'}", ""]
    reps = doc["args"]["reps"]
    out += [*bounds_report(doc), ""]
    out.append(f"1. time to protected: save call -> protected, slowest rank, median (best) of "
               f"{reps} after a warm-up (first)")
    rows = []
    for r in p1.values():
        rows.append((r["label"], f"{r['call_s']:.3f}",
                     f"{r['protected_s']:.3f} ({r['protected_best_s']:.3f})",
                     f"{r['first_s']:.3f}", f"{gb / r['protected_s']:.2f}", r["protects"]))
    out += [table(("method", "save() s", "protected s", "first s", "state GB/s", "survives"),
                  rows)]
    out += [*phases_report(p1), ""]
    out.append(f"2. training: {p2['steps']} steps, {p2['passes_per_step']} forward pass(es) of "
               f"batch {p2['batch']} each, checkpoint at the local level every {p2['every']} "
               f"steps ({p2['checkpoints']} checkpoints)")
    b0, b1, w = p2["baseline_before"], p2["baseline_after"], p2["with_checkpoints"]
    rows = [("no checkpoints (before)", f"{b0['loop_s']:.3f}", f"{b0['step_s_median'] * 1e3:.1f}",
             f"{b0['step_s_max'] * 1e3:.1f}", "-", "-", "-"),
            ("no checkpoints (after)", f"{b1['loop_s']:.3f}", f"{b1['step_s_median'] * 1e3:.1f}",
             f"{b1['step_s_max'] * 1e3:.1f}", "-", "-", "-"),
            (f"checkpoint every {p2['every']}", f"{w['loop_s']:.3f}",
             f"{w['step_s_median'] * 1e3:.1f}", f"{w['step_s_max'] * 1e3:.1f}",
             f"{p2['stall_max_s']:.4f}", f"{p2['stall_median_s']:.4f}",
             f"{p2['slowdown_pct']:+.1f} %")]
    out += [table(("loop", "total s", "step ms (med)", "step ms (max)", "stall max s",
                   "stall med s", "slowdown"), rows)]
    prot = [x for x in p2["protected_s"] if x is not None]
    if prot:
        out.append(f"(slowdown: loop time over the mean of the two without; each checkpoint "
                   f"protected {min(prot):.3f}-{max(prot):.3f} s after its save(); waited "
                   f"{p2['waited_after_loop_s']:.3f} s after the loop for the last)")
    if p2.get("sweep"):
        rows = [(f"every {x['every']}", str(x["checkpoints"]), f"{x['loop_s']:.3f}",
                 f"{x['baseline_s']:.3f}", f"{x['step_s_max'] * 1e3:.1f}",
                 f"{x['stall_max_s']:.4f}", f"{x['slowdown_pct']:+.1f} %")
                for x in p2["sweep"]]
        ok = [x["every"] for x in p2["sweep"] if x["slowdown_pct"] <= 1.0]
        out += ["", "2b. the same loop at each interval (baseline: the mean of part 2's and one "
                "run beside it)",
                table(("interval", "checkpoints", "total s", "baseline s", "step ms (max)",
                       "stall max s", "slowdown"), rows),
                f"shortest interval with at most 1% slowdown: "
                f"{f'every {min(ok)} steps' if ok else 'none of these'}"]
    out += ["", f"3. recovery of step {p3['step']}: {p3['lost']}; {cache}"]
    ref = p3["rows"][p3["reference_row"]]["label"]
    rows = []
    for r in p3["rows"].values():
        src = r.get("sources")
        rows.append((r["label"], f"{r['restore_s']:.3f}", f"{r['vs_first']:.2f}x",
                     r.get("level", "-"), src[-1] if src else "-",
                     f"{r['total_network_bytes']:,}" if "total_network_bytes" in r else "-",
                     f"{r['root_bytes']:,}" if "root_bytes" in r else "-"))
    vs = f"/ {p3['reference_row']}"
    out += [table(("restore", "s", vs, "level", f"rank {doc['ranks'] - 1} from",
                   "MPI bytes", "ROOT bytes"), rows)]
    out.append(f"({vs}: each restore's time over \"{ref}\"'s; a new Checkpointer is built "
               "before each restore, not timed)")
    for key, r in p3["rows"].items():
        if any(r.get("phases") or []):
            per = "; ".join(f"rank {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items())
                            for i, ph in enumerate(r["phases"]))
            out.append(f"  {key} restore, seconds per phase: {per}")
    out += ["", f"4. local-level memory per node, bytes allocated under LOCAL/<node>; bound = "
            f"(shard + {p4['factor']:.3g} x " + ("the parity chunk" if p4['factor'] < 1 else
                                                 "the partner copy")
            + f" it holds) x {p4['kept']} "
            "(keep_local=1 + the one being written)"]
    rows = []
    for n in p4["nodes"]:
        rows.append((n["node"], f"{n['state_bytes']:,}", f"{n['shard_file_bytes']:,}",
                     f"{n['shard_bytes']:,}", f"{n['peak_bytes']:,}", f"{n['steady_bytes']:,}",
                     f"{n['bound_bytes']:,}", f"{n['peak_bytes'] / n['bound_bytes']:.2f}"))
    out += [table(("node", "state", "shard file", "shard alloc", "peak (sampled)",
                   "steady state", "bound", "peak/bound"), rows)]
    out.append(f"(peak: measured, sampled every ms during two saves, {p4['nodes'][0]['samples']} "
               "samples on n0; steady state: after the training loop; bound from the shard "
               "file's size; shard alloc: what it takes, its alignment holes taking none)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--gb", type=float, help="state in GB, all ranks together (default: the "
                    "reference job, 29 x 4096^2 + Adam = 5.84 GB)")
    ap.add_argument("--width", type=int, help="layer width (default 4096, halved for small --gb)")
    ap.add_argument("--reps", type=int, default=3, help="timed saves per method (default 3)")
    ap.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    ap.add_argument("--step-ms", type=float, default=100.0, help="step time (default 100)")
    ap.add_argument("--every", type=int, default=100,
                    help="steps between checkpoints (default 100; steps // 3 if not below it)")
    ap.add_argument("--sweep", help="part 2 again at each of these intervals (comma-separated "
                    "steps), to find the shortest one with at most 1%% slowdown")
    ap.add_argument("--batch", type=int, default=256, help="step batch (default 256, halved "
                    "until one forward pass fits --step-ms)")
    ap.add_argument("--root", help="where ROOT, torch.save and DCP write (default: a temp dir "
                    "under /tmp, removed after; else subdirectories of it, removed after)")
    ap.add_argument("--local", default="/dev/shm", help="where the node-local level goes (a "
                    "unique subdirectory, removed after; default /dev/shm)")
    ap.add_argument("--redundancy", choices=("partner", "xor"), default="partner",
                    help="the local level's redundancy (partner; xor: the ranks form one "
                    "XOR team, 3 or more for a team that is not a mirror)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"part 1 rows (default: all of {','.join(METHODS)})")
    ap.add_argument("--io-threads", type=int, default=8, help="mpickpt's I/O threads (8)")
    ap.add_argument("--cache", choices=("files", "global"), default="files",
                    help="before each restore: evict the files the bench wrote under ROOT's "
                    "directory from the page cache (files, the default), or drop the whole "
                    "page cache (global; on some kernels a tmpfs file's page faults stay "
                    "several times slower after it: bench/probe_tmpfs_faults.py)")
    ap.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    ap.add_argument("--timeline", action="store_true", help="part 3: print and keep each "
                    "rank's timeline of each restore's parts (bench/restore_parts.py)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" /
                                          "levels.json"), help="JSON results")
    args = ap.parse_args()
    if args.reps < 1 or args.steps < 1:
        ap.error("--reps and --steps must be 1 or more")
    os.environ.setdefault("MPICKPT_LOG", "WARNING")
    if args.timeline:
        restore_parts.install()

    tag = COMM.bcast(uuid.uuid4().hex[:8] if RANK == 0 else None)
    own_root = args.root is None
    if own_root:
        work = COMM.bcast(tempfile.mkdtemp(prefix="mpickpt-levels-", dir="/tmp")
                          if RANK == 0 else None)
    else:
        work = os.path.join(os.path.abspath(args.root), f"bench-levels-{tag}")
    shm = os.path.join(os.path.abspath(args.local), f"mpickpt-levels-{tag}")

    def clean() -> None:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    try:
        if RANK == 0:
            os.makedirs(work, exist_ok=True)
        barrier()
        started = time.time()
        doc = run(args, work, shm)
        doc["elapsed_s"] = time.time() - started
        barrier()
        if RANK == 0:
            text = report(doc)
            doc["table"] = text
            print("\n" + text, flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1, default=str)
            bench_cpu.log(f"\nwrote {args.out} ({doc['elapsed_s']:.0f} s)")
    except SystemExit as e:  # a refusal (sizes, methods): the message is enough
        if RANK == 0 or SIZE == 1:
            print(f"bench_levels.py: {e}", file=sys.stderr, flush=True)
        clean()
        COMM.Abort(2)
    except BaseException:  # a failure or a wrong restore: every rank stops, files removed
        traceback.print_exc()
        sys.stderr.flush()
        clean()
        COMM.Abort(1)
    barrier()
    if RANK == 0:
        clean()
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
