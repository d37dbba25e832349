"""Checkpoint benchmark on a GPU or the CPU: training stall, persist throughput, restore time.

One run, one state per rank (the reference job: a 29-layer 4096x4096 MLP with Adam, about 5.8 GB,
batch 256, on a GPU; on CPU a 16-layer 2048x2048 MLP with Adam, 0.81 GB = 768 MiB, batch 64, with
the node's cores shared out among its ranks as torch threads), four ways to checkpoint it:
``torch.save``, ``torch.distributed.checkpoint.save``, ``torch.distributed.checkpoint.async_save``
(default stager, and on CUDA the pinned-memory stager) and mpickpt. Plus the limits, measured in
the same run: device->pinned copy GB/s on CUDA (a host memcpy GB/s on CPU) and ``dd oflag=direct``
write (and ``iflag=direct`` read) GB/s on the target directory.

Stall per checkpoint = the extra wall time the training loop sees over a window of steps around
the checkpoint, compared with the median step time without checkpointing. Python's garbage is
collected in full before each window (what earlier phases left would otherwise be collected,
0.1-0.2 s, in whichever window came next), and the full collections inside a window are
counted. Persist = bytes over the time from the checkpoint call until it is durable
(fsynced/committed). Restore = time to load into the existing tensors, page cache dropped first
where the machine allows it (root).

Under ``mpirun -n N`` every rank runs its own job (a different model, seeded by its rank) and all
of them checkpoint into the one directory ``--dir``: mpickpt with one shared ROOT
(``<dir>/mpickpt``, one collective Checkpointer), ``torch.save`` one file per rank, DCP one
checkpoint directory for all ranks (a gloo, or gloo+NCCL, process group; each rank's keys under
``rank<r>``, since DCP writes tensors that several ranks hold under one key only once), ``dd`` one
file per rank written at the same time. Rank 0 gathers every rank's figures: the table shows the
stall (max and median over ranks), persist GB/s per rank and in aggregate (all ranks' bytes over
the slowest rank's time, and as a fraction of the aggregate dd write) and the slowest restore;
the JSON keeps the per-rank figures.

    python bench/bench_gpu.py --dir /tmp/bench          # table on stdout, JSON and PNG written
    python bench/bench_gpu.py --device cpu --dir /tmp/bench      # the CPU reference (0.8 GB)
    python bench/bench_gpu.py --soak 100                # mpickpt only: pinned memory and RSS flat?
    mpirun -n 4 python bench/bench_gpu.py --methods mpickpt,dd   # 4 ranks, one GPU each
    mpiexec -n 2 python bench/bench_gpu.py --device cpu --layers 4 --width 512 --batch 32 \\
        --reps 2 --min-steps 5 --dir /tmp/bench          # 2 ranks on CPU, a small smoke run
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import FULL_GC, columns, watch_full_gc

import mpickpt

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
# mpickpt first: DCP's process group and async machinery stay up for the rest of the run
METHODS = ("dd", "mpickpt", "torch.save", "dcp.save", "dcp.async_save", "dcp.async_save+pinned")
# run only when --methods names them: mpickpt with Encoding(compression="zstd") (needs zstandard)
OPT_IN = ("mpickpt+zstd",)
DEFAULTS = {"cuda": {"layers": 29, "width": 4096, "batch": 256},  # the reference job, 5.84 GB
            "cpu": {"layers": 16, "width": 2048, "batch": 64}}   # the CPU reference, 0.81 GB
NAN = float("nan")
watch_full_gc()  # window() counts the full collections inside it


def add_job_args(ap: argparse.ArgumentParser) -> None:
    """``--layers``, ``--width`` and ``--batch`` of a probe's job: the reference job's by
    default (``DEFAULTS["cuda"]``)."""
    for k, v in DEFAULTS["cuda"].items():
        ap.add_argument(f"--{k}", type=int, default=v, help=f"default {v}: the reference job")


def add_probe_args(ap: argparse.ArgumentParser, io_threads: int = 8) -> None:
    """A probe's job (:func:`add_job_args`) and ``--io-threads``, ``--dir``, ``--cpu`` (the job
    on the CPU) and ``--json``."""
    add_job_args(ap)
    ap.add_argument("--io-threads", type=int, default=io_threads, help="mpickpt's I/O threads")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go")
    ap.add_argument("--cpu", action="store_true", help="the job on the CPU")
    ap.add_argument("--json", default=None, help="write the figures here")


def probe_job(args: argparse.Namespace) -> tuple[Job, torch.device]:
    """The job :func:`add_probe_args` describes, on the GPU unless ``--cpu`` or there is none."""
    dev = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    return Job(args.layers, args.width, args.batch, dev), dev


def log(*a: Any) -> None:
    if RANK == 0:
        print(*a, flush=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
        fsync_file(dirpath)


def tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def remove_shared(path: str) -> None:
    """Remove a directory all ranks share: rank 0 removes it while the others wait (collective)."""
    COMM.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)
    COMM.Barrier()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def median(xs: list[float]) -> float:
    """Median of the numbers that are not NaN (NaN when none is)."""
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else NAN


class Job:
    """The reference training job on one device (a GPU, or the CPU)."""

    def __init__(self, layers: int, width: int, batch: int, device: torch.device,
                 stepped: bool = True) -> None:
        torch.manual_seed(RANK)
        self.device, self.shape = device, (layers, width, batch)
        mods: list[torch.nn.Module] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*mods).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(batch, width, device=device)
        if stepped:
            self.step()  # Adam state exists from here on

    def step(self) -> float:
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()  # the loop syncs once per step, as real loops do when they log

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def dcp_state(self) -> dict[str, Any]:
        """The state for DCP, under a key of its own per rank: the ranks hold different tensors,
        and plain tensors under one key on several ranks would be taken for replicas."""
        return {f"rank{RANK}": self.state_dict()}

    def tensors(self) -> list[torch.Tensor]:
        out = [p.data for p in self.model.parameters()]
        for st in self.opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def load(self, ref: list[torch.Tensor]) -> None:
        """Copy ``ref`` into the state (so that every method saves the same values)."""
        with torch.no_grad():
            for t, r in zip(self.tensors(), ref, strict=True):
                t.copy_(r)

    def perturb(self) -> None:
        with torch.no_grad():
            for t in self.tensors():
                t.add_(1)

    def verify(self, ref: list[torch.Tensor], name: str) -> None:
        self.sync()
        bad = sum(not torch.equal(a.to(b.device), b)
                  for a, b in zip(self.tensors(), ref, strict=True))
        if bad:
            raise RuntimeError(f"{name}: rank {RANK}: {bad} tensors differ after restore")


def baseline_step(job: Job, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        job.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def window(job: Job, base: float, call: Callable[[], Callable[[], bool]], min_steps: int,
           tail_steps: int = 4) -> dict[str, Any]:
    """Run steps around one checkpoint. ``call`` starts it and returns ``done()``.

    The stall is measured against the median of the ``tail_steps`` (or more) steps that ran
    after the checkpoint was durable, in the same window: step times drift over a run on a
    shared machine (by 20% on the 2-core VM), and a baseline taken minutes earlier turned a
    1 s ``torch.save`` into a negative stall. The stall against ``base`` is kept too.

    A full collection of the interpreter's garbage runs first: the objects that earlier phases
    (another method's restore, say) left in its oldest generation would otherwise trigger one
    (0.1-0.2 s) inside whichever window comes next. The full collections inside the window are
    counted (``full_gc_n``, ``full_gc_s``): those the checkpoint's own objects brought on."""
    gc.collect()
    gcs = len(FULL_GC)
    COMM.Barrier()
    t0 = time.perf_counter()
    job.step()
    c0 = time.perf_counter()
    done = call()
    call_s = time.perf_counter() - c0
    steps, during, after, trace = 1, [], [], []
    persisted_at = None
    while True:
        if persisted_at is None and done():
            persisted_at = time.perf_counter()
        if persisted_at is not None and steps >= min_steps and len(after) >= tail_steps:
            break
        t = time.perf_counter()
        job.step()
        dt = time.perf_counter() - t
        trace.append((round(t - c0, 4), round(dt - base, 4)))
        (during if persisted_at is None else after).append(dt)
        steps += 1
    wall = time.perf_counter() - t0
    local = statistics.median(after)
    return {
        "call_s": call_s,
        "stall_s": wall - steps * local,
        "stall_vs_run_base_s": wall - steps * base,
        "local_step_s": local,
        "persist_s": persisted_at - c0,
        "steps_during_persist": len(during),
        "step_during_persist_s": statistics.median(during) if during else NAN,
        "slowest_steps": sorted(trace, key=lambda x: -x[1])[:8],  # (start after call, extra s)
        "full_gc_n": len(FULL_GC) - gcs,
        "full_gc_s": sum(d for _, d in FULL_GC[gcs:]),
    }


def run_dd(directory: str, mb: int) -> dict[str, float]:
    """One ``dd`` writer (then reader) per rank, all at once, a file each in ``directory``."""
    path = os.path.join(directory, f"dd-{RANK}.bin")
    out: dict[str, float] = {}
    COMM.Barrier()
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={mb // 64}",
                    "oflag=direct", "conv=fsync"], capture_output=True, check=True)
    w = time.perf_counter() - t
    COMM.Barrier()
    agg_w = COMM.allreduce(w, op=MPI.MAX)
    out["dd_write_GBps"] = mb * 2**20 / w / 1e9
    out["dd_write_aggregate_GBps"] = SIZE * mb * 2**20 / agg_w / 1e9
    out["dd_cache_dropped"] = drop_caches()
    COMM.Barrier()
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"],
                   capture_output=True, check=True)
    r = time.perf_counter() - t
    agg_r = COMM.allreduce(r, op=MPI.MAX)
    out["dd_read_GBps"] = mb * 2**20 / r / 1e9
    out["dd_read_aggregate_GBps"] = SIZE * mb * 2**20 / agg_r / 1e9
    os.unlink(path)
    return out


def run_parallel_io(directory: str, nbytes: int, threads: int, chunk: int = 64 << 20
                    ) -> dict[str, float]:
    """The disk's parallel bounds, the way mpickpt's persist and restore run: per rank one file
    of ``nbytes`` (the state's size), written by ``threads`` threads with ``O_DIRECT`` ``pwrite``s
    of ``chunk`` bytes at aligned offsets, then fsynced; then written over the same way (a save
    writes over the files retention retired); after the page cache is dropped, read back the
    same way. All ranks at once; the aggregate is over the slowest rank's time."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    path = os.path.join(directory, f"par-{RANK}.bin")
    size = -(-nbytes // chunk) * chunk
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page-aligned, as O_DIRECT wants
    for b in bufs:
        b.write(b"\x5a" * chunk)

    def each(fd: int, write: bool) -> None:
        def run(k: int) -> None:
            view = memoryview(bufs[k])
            for off in range(k * chunk, size, threads * chunk):
                done = (os.pwrite if write else os.preadv)(
                    fd, view if write else [view], off)
                if done != chunk:
                    raise OSError(f"{path}: {'wrote' if write else 'read'} {done} of {chunk}")
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, range(threads)))

    out: dict[str, float] = {}
    # a new file, then the same one written over (as a save into a recycled file), then read
    flags = {"write": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "overwrite": os.O_WRONLY,
             "read": os.O_RDONLY}
    for kind, how in flags.items():
        write = kind != "read"
        if not write:
            out["par_cache_dropped"] = drop_caches()
        fd = os.open(path, how | os.O_DIRECT, 0o644)
        COMM.Barrier()
        t = time.perf_counter()
        try:
            each(fd, write)
            if write:
                os.fsync(fd)
        finally:
            os.close(fd)
        took = time.perf_counter() - t
        slowest = COMM.allreduce(took, op=MPI.MAX)
        out[f"par_{kind}_GBps"] = size / took / 1e9
        out[f"par_{kind}_aggregate_GBps"] = SIZE * size / slowest / 1e9
    os.unlink(path)
    for b in bufs:
        b.close()
    return out


def copy_limit(device: torch.device, nbytes: int) -> float:
    """GB/s of one copy of ``nbytes``: device -> pinned host memory on CUDA, host -> host on CPU
    (the first copy a snapshot makes). Every rank copies at the same time."""
    cuda = device.type == "cuda"
    src = torch.full((nbytes,), 1, dtype=torch.uint8, device=device)  # touched: no zero page
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst.copy_(src, non_blocking=cuda)  # warm-up: faults the destination's pages in
    if cuda:
        torch.cuda.synchronize()
    COMM.Barrier()
    t = time.perf_counter()
    dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - t) / 1e9


def init_process_group(device: torch.device) -> None:
    """The process group DCP needs, from MPI's ranks (collective; once)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    one_node = COMM.Split_type(MPI.COMM_TYPE_SHARED).size == SIZE
    port = None
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    addr, port = COMM.bcast(("127.0.0.1" if one_node else socket.gethostname(), port))
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=RANK, world_size=SIZE)


def restore_timed(job: Job, ref: list[torch.Tensor], name: str, fn: Callable[[], None]
                  ) -> dict[str, Any]:
    """Scramble the state, drop the page cache, time ``fn`` (all ranks together), check."""
    job.perturb()
    dropped = drop_caches()
    COMM.Barrier()
    t = time.perf_counter()
    fn()
    job.sync()
    s = time.perf_counter() - t
    job.verify(ref, name)
    return {"restore_s": s, "restore_GBps": job.nbytes() / s / 1e9, "cache_dropped": dropped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"],
                    help="where the job lives (default: cuda when available, else cpu)")
    ap.add_argument("--dir", default="/tmp/mpickpt-bench",
                    help="the checkpoint directory, shared by all ranks (emptied first)")
    ap.add_argument("--layers", type=int, help="default 29 on cuda, 16 on cpu")
    ap.add_argument("--width", type=int, help="default 4096 on cuda, 2048 on cpu")
    ap.add_argument("--batch", type=int, help="default 256 on cuda, 64 on cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-steps", type=int, default=20)
    ap.add_argument("--methods", help=f"default {','.join(METHODS)} (on cpu without the "
                    f"+pinned one: pinned memory needs CUDA); also {','.join(OPT_IN)}")
    ap.add_argument("--dd-mb", type=int, help="MiB each rank's dd writes (default: the state per "
                    "rank rounded up to 64 MiB, within 256..4096)")
    ap.add_argument("--io-threads", type=int, default=8, help="mpickpt's I/O threads")
    ap.add_argument("--soak", type=int, default=0, help="N consecutive mpickpt checkpoints")
    ap.add_argument("--process-group", action="store_true",
                    help="start the torch.distributed process group (gloo, +NCCL on cuda) before "
                         "any method, as a training job has one (DCP methods start it anyway)")
    ap.add_argument("--json", default="bench/results/gpu.json")
    ap.add_argument("--png", default="bench/results/gpu.png")
    args = ap.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    methods = (args.methods.split(",") if args.methods else
               [m for m in METHODS if args.device == "cuda" or not m.endswith("+pinned")])

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(RANK % torch.cuda.device_count())
        name = torch.cuda.get_device_name()
    else:  # the node's cores shared out among its ranks
        local = COMM.Split_type(MPI.COMM_TYPE_SHARED).size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        name = cpu_name()
    if RANK == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    COMM.Barrier()
    job = Job(args.layers, args.width, args.batch, device)
    nbytes = job.nbytes()
    for _ in range(3):
        job.step()
    base = baseline_step(job, 30)
    steps = COMM.allgather(base)
    res: dict[str, Any] = {
        "device": args.device, "device_name": name, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "ranks": SIZE, "state_bytes_per_rank": nbytes,
        "step_s": median(steps), "step_s_per_rank": steps, "layers": args.layers,
        "width": args.width, "batch": args.batch, "dir": args.dir, "methods": {},
        "io_threads": args.io_threads,
    }
    log(f"state {nbytes / 1e9:.3f} GB per rank x {SIZE} rank(s), "
        f"step {res['step_s'] * 1e3:.1f} ms")
    copies = COMM.allgather(copy_limit(device, min(nbytes, 4 << 30)))
    res["copy_kind"] = "d2h pinned" if device.type == "cuda" else "host copy"
    res["copy_GBps"], res["copy_GBps_per_rank"] = median(copies), copies
    if "dd" in methods:
        mb = args.dd_mb or max(256, min(4096, -(-nbytes // (64 << 20)) * 64))
        dd = COMM.allgather(run_dd(args.dir, mb))
        res["dd_mb_per_rank"] = mb
        for k in dd[0]:
            if k.endswith("aggregate_GBps") or k == "dd_cache_dropped":
                res[k] = dd[0][k]  # the same on every rank (dropped: rank 0's)
            else:
                res[k], res[k + "_per_rank"] = median([d[k] for d in dd]), [d[k] for d in dd]
        log({k: round(v, 3) for k, v in res.items() if k.startswith("dd") and
             isinstance(v, float)})
    if "dd" in methods:  # and the parallel bounds persist and restore are judged against
        par = COMM.allgather(run_parallel_io(args.dir, nbytes, args.io_threads))
        for k in par[0]:
            res[k] = par[0][k] if "aggregate" in k or "dropped" in k else median(
                [d[k] for d in par])
        log({k: round(v, 3) for k, v in res.items() if k.startswith("par_")
             and isinstance(v, float)})
    if args.soak:
        mine = soak(job, args.dir, args.soak)
        every = COMM.gather(mine)
        res["soak"] = mine
        if SIZE > 1:
            res["soak_per_rank"] = every
        write(res, args)
        return
    ref = [t.clone() for t in job.tensors()]  # the values every restore must bring back

    for m in methods:
        if m == "dd":
            continue
        try:
            mine = bench_method(m, job, args.dir, args, ref)
        except Exception as e:  # a method that breaks is reported, the others still run
            mine = {"error": f"{type(e).__name__}: {e}"}
        every = COMM.gather(mine)
        if RANK == 0:
            # persist is judged against the faster of a new file and one written over
            par_write = max(res.get("par_write_aggregate_GBps") or 0,
                            res.get("par_overwrite_aggregate_GBps") or 0) or None
            kinds = {k: res[f"par_{k}_aggregate_GBps"] for k in ("write", "overwrite")
                     if res.get(f"par_{k}_aggregate_GBps")}
            res["methods"][m] = summarize(every, nbytes, res.get("dd_write_aggregate_GBps"),
                                          par_write, res.get("par_read_aggregate_GBps"), kinds)
            log(m, json.dumps({k: v for k, v in res["methods"][m].items() if k != "per_rank"}))
        job.load(ref)  # back to the reference so every method saves the same values
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    write(res, args)


def restart_timed(job: Job, ref: list[torch.Tensor], name: str,
                  new_ck: Callable[[], mpickpt.Checkpointer]) -> dict[str, Any]:
    """A restarted job's restore, the newest checkpoint into a new model and an optimizer that
    has no state yet (what a job brings back after a failure), by a new Checkpointer (built
    before the clock starts), page cache dropped, all ranks together; checked against ``ref``."""
    fresh = Job(*job.shape, job.device, stepped=False)
    state = {"model": fresh.model, "optim": fresh.opt}
    ck = new_ck()
    try:
        r = restore_timed(fresh, ref, f"{name} (restart)", functools.partial(ck.restore, state))
        return {"restart_s": r["restore_s"], "restart_cache_dropped": r["cache_dropped"],
                "restart_room_bytes": ck.restore_info.room_bytes,
                "restart_phases": dict(ck.restore_info.phases)}
    finally:
        ck.close()
        del fresh, state
        if job.device.type == "cuda":
            torch.cuda.empty_cache()


def bench_method(m: str, job: Job, d: str, args: argparse.Namespace, ref: list[torch.Tensor]
                 ) -> dict[str, Any]:
    """Checkpoint ``args.reps`` times in a training window, then save and restore once: this
    rank's figures. Every rank calls it together."""
    import torch.distributed.checkpoint as dcp

    if m not in METHODS + OPT_IN:
        raise ValueError(f"unknown method {m}")
    if m.endswith("+pinned") and job.device.type != "cuda":
        raise ValueError("the pinned-memory stager needs CUDA")
    if m.startswith("dcp") or args.process_group:
        init_process_group(job.device)
    path = os.path.join(d, m.replace("+", "-"))  # DCP's checkpoint and mpickpt's ROOT: shared
    pt = os.path.join(d, f"torch-save-rank{RANK}.pt")  # torch.save: a file per rank
    base = baseline_step(job, 20)  # again: a process group's threads may have changed it
    ck: mpickpt.Checkpointer | None = None
    stagers: list[Any] = []
    pending: list[Any] = []  # DCP's futures: a failed async save must not pass for a fast one
    handles: list[Any] = []  # mpickpt's, whose figures (where a save's time went) are kept

    def settle() -> None:
        for f in pending:
            f.result()
        pending.clear()
        if m.startswith("dcp.async_save"):
            fsync_tree(path)

    def start(step: int) -> Callable[[], bool]:
        """Start checkpoint ``step``; return its done()."""
        if m == "torch.save":
            torch.save(job.state_dict(), pt)
            fsync_file(pt)
            return lambda: True
        if m == "dcp.save":
            dcp.save(job.dcp_state(), checkpoint_id=path)
            fsync_tree(path)
            return lambda: True
        if m.startswith("dcp.async_save"):
            kw = {}
            if m.endswith("+pinned"):
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
                # a stager per save: in torch 2.11 a DefaultStager's second save fails
                # (KeyError: <class 'type'>), so each one page-locks its buffers anew
                stagers.append(DefaultStager(StagingOptions(True, True, True, True)))
                kw["async_stager"] = stagers[-1]
            fut = dcp.async_save(job.dcp_state(), checkpoint_id=path, **kw)
            pending.append(getattr(fut, "upload_completion", fut))
            return pending[-1].done
        assert ck is not None
        handles.append(ck.save(step, {"model": job.model, "optim": job.opt}))
        return handles[-1].done

    def new_ck() -> mpickpt.Checkpointer:
        return mpickpt.Checkpointer(path, keep=2, io_threads=args.io_threads,
                                    encoding=mpickpt.Encoding(
                                        compression="zstd" if m == "mpickpt+zstd" else None))

    if m.startswith("mpickpt"):
        remove_shared(path)
        ck = new_ck()
    reps: list[dict[str, Any]] = []
    try:
        # the first checkpoint in a window of its own: mpickpt allocates (page-locks) its pool
        first = window(job, base, functools.partial(start, 0), args.min_steps)
        settle()
        job.load(ref)
        for rep in range(args.reps):
            if m == "torch.save" and os.path.exists(pt):
                os.unlink(pt)
            elif m.startswith("dcp"):
                remove_shared(path)
            reps.append(window(job, base, functools.partial(start, rep + 1), args.min_steps))
            settle()
            job.load(ref)  # the reference values again, so the state saved is the one restored
        # one more save of exactly the reference values, then restore it
        if m == "torch.save":
            torch.save(job.state_dict(), pt)

            def load() -> None:
                sd = torch.load(pt, map_location=job.device, weights_only=True)
                job.model.load_state_dict(sd["model"])
                job.opt.load_state_dict(sd["optim"])
            restore = restore_timed(job, ref, m, load)
            size = tree_bytes(pt)
            os.unlink(pt)
        elif m.startswith("dcp"):
            remove_shared(path)
            dcp.save(job.dcp_state(), checkpoint_id=path)

            def load() -> None:
                sd = job.dcp_state()
                dcp.load(sd, checkpoint_id=path)  # in place into the model's tensors
                job.opt.load_state_dict(sd[f"rank{RANK}"]["optim"])
            restore = restore_timed(job, ref, m, load)
            size = tree_bytes(path) if RANK == 0 else 0  # all ranks' files (one directory)
            remove_shared(path)
        else:
            assert ck is not None
            last = ck.save(args.reps + 1, {"model": job.model, "optim": job.opt}).wait()
            restore = restore_timed(
                job, ref, m, lambda: ck.restore({"model": job.model, "optim": job.opt}))
            restore["pinned_pool_bytes"] = ck.pinned_bytes
            restore["stats"] = last.stats
            restore["restore_phases"] = dict(ck.restore_info.phases)  # where its time went
            restore |= restart_timed(job, ref, m, new_ck)
            size = tree_bytes(last.path) if RANK == 0 else 0  # all ranks' shards
            ck.close()
            ck = None
            remove_shared(path)
            # a first checkpoint again, its buffers allocated by prepare() before the loop
            ck = new_ck()
            t = time.perf_counter()
            ck.prepare({"model": job.model, "optim": job.opt})
            restore["prepare_s"] = time.perf_counter() - t
            prepared = window(job, base, functools.partial(start, 0), args.min_steps)
            restore["prepared_first_stall_s"] = prepared["stall_s"]
            # where a prepared first checkpoint's stall goes (s66: above the unprepared one's)
            restore["prepared_first"] = {k: prepared[k] for k in (
                "call_s", "persist_s", "local_step_s", "slowest_steps", "full_gc_n",
                "full_gc_s")}
            ck.close()
            ck = None
            remove_shared(path)
    finally:
        for s in stagers:
            s.close()
        if ck is not None:
            ck.close()
    out: dict[str, Any] = {k: statistics.median(r[k] for r in reps) for k in reps[0]
                           if isinstance(reps[0][k], (int, float))}
    out["step_s"] = base
    out["stall_s_all"] = [r["stall_s"] for r in reps]
    out["full_gc_s_all"] = [r["full_gc_s"] for r in reps]
    out["full_gc_n_all"] = [r["full_gc_n"] for r in reps]
    out["persist_s_all"] = [r["persist_s"] for r in reps]
    if handles:  # the first save's and each rep's own figures: where their time went
        out["save_stats_all"] = [{k: v for k, v in h.outcome().stats.items()
                                  if isinstance(v, (int, float))} for h in handles[:args.reps + 1]]
        # each timed save's file: written over a retired one's (recycled) or new
        out["persist_recycled_all"] = [bool(s.get("recycled")) for s in out["save_stats_all"][1:]]
    out["first_stall_s"] = first["stall_s"]
    out["first_call_s"] = first["call_s"]
    out["slowest_steps"] = [r["slowest_steps"] for r in reps]
    out["persist_GBps"] = job.nbytes() / out["persist_s"] / 1e9
    out["bytes_on_disk"] = size  # counted by this rank (a shared directory: by rank 0)
    out.update(restore)
    return out


def persist_by_file(per_rank: list[dict[str, Any]], total: int, bounds: dict[str, float]
                    ) -> dict[str, Any]:
    """Each timed save's persist (the slowest rank's) against the bound of the file it wrote:
    a new one (``par_write``) or a retired checkpoint's, written over (``par_overwrite``); the
    median ratio of each kind and how many saves it has."""
    out: dict[str, Any] = {}
    kinds = per_rank[0]["persist_recycled_all"]
    for recycled, name, key in ((False, "new", "write"), (True, "recycled", "overwrite")):
        idx = [i for i, k in enumerate(kinds) if k == recycled]
        if not idx or not bounds.get(key):
            continue
        ratios = [total / max(r["persist_s_all"][i] for r in per_rank) / 1e9 / bounds[key]
                  for i in idx]
        out[f"persist_{name}_of_parallel"] = median(ratios)
        out[f"persist_{name}_saves"] = len(idx)
    return out


def summarize(per_rank: list[dict[str, Any]], nbytes: int, dd_write: float | None,
              par_write: float | None = None, par_read: float | None = None,
              par_kinds: dict[str, float] | None = None) -> dict[str, Any]:
    """One method's figures over the ranks (each rank's own: the median over its reps)."""
    errors = [f"rank {r}: {x['error']}" for r, x in enumerate(per_rank) if "error" in x]
    if errors:
        return {"error": "; ".join(errors), "per_rank": per_rank}
    total = len(per_rank) * nbytes
    persist = max(r["persist_s"] for r in per_rank)
    restore = max(r["restore_s"] for r in per_rank)
    out: dict[str, Any] = {
        "stall_s_max": max(r["stall_s"] for r in per_rank),
        "stall_s_median": median([r["stall_s"] for r in per_rank]),
        "call_s_max": max(r["call_s"] for r in per_rank),
        "first_stall_s_max": max(r["first_stall_s"] for r in per_rank),
        "first_call_s_max": max(r["first_call_s"] for r in per_rank),
        "prepared_first_stall_s_max": max(r.get("prepared_first_stall_s", NAN)
                                          for r in per_rank),
        "prepare_s_max": max(r.get("prepare_s", NAN) for r in per_rank),
        "persist_s_max": persist,
        "persist_GBps_median": median([r["persist_GBps"] for r in per_rank]),
        "persist_aggregate_GBps": total / persist / 1e9,
        "step_slowdown_pct": median([(r["step_during_persist_s"] / r["local_step_s"] - 1) * 100
                                     for r in per_rank]),
        "restore_s_max": restore,
        "restore_aggregate_GBps": total / restore / 1e9,
        "cache_dropped": all(r["cache_dropped"] for r in per_rank),
        "bytes_on_disk": sum(r["bytes_on_disk"] for r in per_rank),
        # full collections inside the timed windows, all ranks (each counts in its stall)
        "full_gc_in_windows": sum(sum(r["full_gc_n_all"]) for r in per_rank),
    }
    if dd_write:
        out["persist_of_dd"] = out["persist_aggregate_GBps"] / dd_write
    if par_write and par_read:  # the bounds of the disk read and written in parallel
        out["persist_of_parallel"] = out["persist_aggregate_GBps"] / par_write
        out["restore_of_parallel"] = out["restore_aggregate_GBps"] / par_read
    if "restart_s" in per_rank[0]:  # a restarted job's restore (a fresh optimizer)
        out["restart_s_max"] = max(r["restart_s"] for r in per_rank)
        out["restart_aggregate_GBps"] = total / out["restart_s_max"] / 1e9
        if par_read:
            out["restart_of_parallel"] = out["restart_aggregate_GBps"] / par_read
    if par_kinds and "persist_recycled_all" in per_rank[0]:
        out.update(persist_by_file(per_rank, total, par_kinds))
    out["per_rank"] = per_rank
    return out


def soak(job: Job, d: str, n: int) -> dict[str, Any]:
    ck = mpickpt.Checkpointer(os.path.join(d, "soak"), keep=2)
    state = {"model": job.model, "optim": job.opt}
    pinned, rss, stalls = [], [], []
    for i in range(n):
        job.step()
        t = time.perf_counter()
        h = ck.save(i, state)
        stalls.append(time.perf_counter() - t)
        while not h.done():
            job.step()
        h.wait()
        pinned.append(ck.pinned_bytes)
        rss.append(rss_bytes())
    ck.close()
    shard = tree_bytes(os.path.join(d, "soak", f"step-{n - 1:08d}")) // SIZE  # mean per rank
    return {"checkpoints": n, "pinned_min": min(pinned), "pinned_max": max(pinned),
            "shard_bytes": shard, "pinned_over_shard": max(pinned) / shard,
            "rss_first": rss[0], "rss_max": max(rss), "rss_last": rss[-1],
            "call_s_median": statistics.median(stalls), "call_s_max": max(stalls)}


def fmt(x: float | None, digits: int) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def write(res: dict[str, Any], args: argparse.Namespace) -> None:
    if RANK != 0:
        return
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1, default=str)
    many = res["ranks"] > 1
    threads = f", {res['torch_threads']} torch threads per rank" if res["device"] == "cpu" else ""
    print(f"\n{res['device_name']}, torch {res['torch']}, {res['ranks']} rank(s){threads}, "
          f"{res['state_bytes_per_rank'] / 1e9:.3f} GB per rank, "
          f"step {res['step_s'] * 1e3:.1f} ms{' (median over ranks)' if many else ''}")
    per = " per rank" if many else ""
    limits = f"limits: {res['copy_kind']} {res['copy_GBps']:.1f} GB/s{per}"
    if "dd_write_GBps" in res:
        limits += (f", dd direct write {res['dd_write_GBps']:.2f} GB/s{per}"
                   f" (aggregate {res['dd_write_aggregate_GBps']:.2f}),"
                   f" read {res['dd_read_GBps']:.2f} GB/s{per}"
                   f" (aggregate {res['dd_read_aggregate_GBps']:.2f}),"
                   f" {res['dd_mb_per_rank']} MiB{per}")
    if "par_write_GBps" in res:
        limits += (f", parallel O_DIRECT ({res.get('io_threads', '?')} threads) write "
                   f"{res['par_write_aggregate_GBps']:.2f} GB/s (over the same file: "
                   f"{res.get('par_overwrite_aggregate_GBps', float('nan')):.2f}), read "
                   f"{res['par_read_aggregate_GBps']:.2f} GB/s (aggregate)")
    print(limits)
    dd = "dd_write_aggregate_GBps" in res
    if many:
        head = ("method", "stall s max", "stall s med", "call s max", "first stall s max",
                "persist GB/s/rank",
                "persist GB/s agg", *(("of dd",) if dd else ()), "step +%", "restore s max",
                "restore GB/s agg")
    else:
        head = ("method", "stall s", "call s", "first stall s", "persist GB/s",
                *(("of dd",) if dd else ()), "step +%", "restore s", "restore GB/s")
    rows, errors = [], []
    for m, r in res["methods"].items():
        if "error" in r:
            errors.append(f"{m}: error: {r['error'][:200]}")
            continue
        row = [m, fmt(r["stall_s_max"], 3)]
        if many:
            row.append(fmt(r["stall_s_median"], 3))
        row += [fmt(r["call_s_max"], 3), fmt(r["first_stall_s_max"], 3),
                fmt(r["persist_GBps_median"], 2)]
        if many:
            row.append(fmt(r["persist_aggregate_GBps"], 2))
        if dd:
            row.append(fmt(r.get("persist_of_dd"), 2))
        row += [fmt(r["step_slowdown_pct"], 1), fmt(r["restore_s_max"], 2),
                fmt(r["restore_aggregate_GBps"], 2)]
        rows.append(tuple(row))
    if rows:
        print(columns(head, rows))
    mp = res["methods"].get("mpickpt", {})
    if "persist_of_parallel" in mp:  # issue 31's goals: 90% of the parallel bounds
        for what, key in (("persist", "persist_of_parallel"), ("restore", "restore_of_parallel")):
            ratio = mp[key]
            print(f"mpickpt's {what}: {ratio:.0%} of the disk's parallel bound (goal >= 90%: "
                  f"{'met' if ratio >= 0.9 else 'missed'})")
        for name, bound in (("new", "a new file"), ("recycled", "a file written over")):
            if f"persist_{name}_of_parallel" in mp:
                ratio = mp[f"persist_{name}_of_parallel"]
                print(f"  saves into {name} files ({mp[f'persist_{name}_saves']}): {ratio:.0%} "
                      f"of the parallel bound of {bound} (goal >= 90%: "
                      f"{'met' if ratio >= 0.9 else 'missed'})")
    if "restart_s_max" in mp:
        of = (f", {mp['restart_of_parallel']:.0%} of the disk's parallel bound (goal >= 90%: "
              f"{'met' if mp['restart_of_parallel'] >= 0.9 else 'missed'})"
              if "restart_of_parallel" in mp else "")
        r0 = mp["per_rank"][0]
        print(f"mpickpt's restart (a new model, an optimizer without state yet): "
              f"{mp['restart_s_max']:.2f} s{of}; rank 0 through GPU room "
              f"{r0['restart_room_bytes'] / 1e9:.2f} GB, phases (s): " + ", ".join(
                  f"{k} {v:.3f}" for k, v in r0["restart_phases"].items()))
    if "restore_phases" in mp.get("per_rank", [{}])[0]:
        print("mpickpt's restore, rank 0's phases (s): " + ", ".join(
            f"{k} {v:.3f}" for k, v in mp["per_rank"][0]["restore_phases"].items()))
    if "prepare_s_max" in mp:
        print(f"mpickpt's first checkpoint: stall {fmt(mp['first_stall_s_max'], 3)} s; after "
              f"prepare() before the loop ({fmt(mp['prepare_s_max'], 2)} s) "
              f"{fmt(mp['prepared_first_stall_s_max'], 3)} s")
        pf = mp["per_rank"][0].get("prepared_first")
        if pf:
            print(f"  rank 0's prepared first: call {pf['call_s']:.3f} s, persist "
                  f"{pf['persist_s']:.2f} s, {pf['full_gc_n']} full GC(s) "
                  f"{pf['full_gc_s']:.3f} s, step {pf['local_step_s']:.4f} s, slowest steps "
                  "(start after the call, extra s) " + ", ".join(
                      f"({a:.2f}, {b:.3f})" for a, b in pf["slowest_steps"][:5]))
    for m, r in res["methods"].items():
        if r.get("full_gc_in_windows"):
            print(f"{m}: {r['full_gc_in_windows']} full garbage collection(s) of the "
                  "interpreter inside its timed windows, counted in the stall")
    for line in errors:
        print(line)
    if res["methods"] and not all(r.get("cache_dropped", True) for r in res["methods"].values()):
        print("note: the page cache could not be dropped (not root?): restores read from memory")
    if "soak" in res:
        print("soak:", json.dumps(res["soak"]))
    if rows:
        plot(res, args.png)


def plot(res: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [(m, r) for m, r in res["methods"].items() if "error" not in r]
    many = res["ranks"] > 1
    where = "GPU" if res["device"] == "cuda" else "CPU"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [m for m, _ in ok]
    titles = ["training stall per checkpoint (s)" + (", slowest rank" if many else ""),
              "persist (GB/s)" + (f", all {res['ranks']} ranks" if many else ""),
              f"restore into {where} memory (s)" + (", slowest rank" if many else "")]
    for ax, key, title in zip(axes, ["stall_s_max", "persist_aggregate_GBps", "restore_s_max"],
                              titles, strict=True):
        ax.bar(names, [r[key] for _, r in ok], color="tab:blue")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
        if key == "persist_aggregate_GBps" and "dd_write_aggregate_GBps" in res:
            ax.axhline(res["dd_write_aggregate_GBps"], color="tab:red", ls="--",
                       label="dd oflag=direct")
            ax.legend()
    ranks = f", {res['ranks']} ranks" if many else ""
    fig.suptitle(f"{res['device_name']}{ranks}: {res['state_bytes_per_rank'] / 1e9:.2f} GB state "
                 f"per rank ({res['layers']}x{res['width']}^2 MLP + Adam)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
