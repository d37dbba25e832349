"""GPU checkpoint benchmark: training stall, persist throughput and restore time, side by side.

One run, one state (the reference job: a 29-layer 4096x4096 MLP with Adam, about 5.8 GB, batch
256), four ways to checkpoint it: ``torch.save``, ``torch.distributed.checkpoint.save``,
``torch.distributed.checkpoint.async_save`` (default stager, and the pinned-memory stager where it
works) and mpickpt. Plus the limits, measured in the same run: device->pinned copy GB/s and
``dd oflag=direct`` write (and ``iflag=direct`` read) GB/s on the target directory.

Stall per checkpoint = the extra wall time the training loop sees over a window of steps around
the checkpoint, compared with the median step time without checkpointing. Persist = bytes over
the time from the checkpoint call until it is durable (fsynced/committed). Restore = time to load
into the existing GPU tensors, page cache dropped first where the machine allows it.

    python bench/bench_gpu.py --dir /tmp/bench          # table on stdout, JSON and PNG written
    python bench/bench_gpu.py --soak 100                # mpickpt only: pinned memory and RSS flat?
    mpirun -n 4 python bench/bench_gpu.py --methods mpickpt,dd   # 4 ranks, one GPU each
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mpickpt

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


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


def fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class Job:
    """The reference training job on one GPU."""

    def __init__(self, layers: int, width: int, batch: int) -> None:
        torch.manual_seed(RANK)
        mods: list[torch.nn.Module] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*mods).cuda()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(batch, width, device="cuda")
        self.step()  # Adam state exists from here on

    def step(self) -> float:
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()  # the loop syncs once per step, as real loops do when they log

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def tensors(self) -> list[torch.Tensor]:
        out = [p.data for p in self.model.parameters()]
        for st in self.opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def baseline_step(job: Job, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        job.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def window(job: Job, base: float, call: Callable[[], Callable[[], bool]], min_steps: int
           ) -> dict[str, float]:
    """Run steps around one checkpoint. ``call`` starts it and returns ``done()``."""
    COMM.Barrier()
    t0 = time.perf_counter()
    job.step()
    c0 = time.perf_counter()
    done = call()
    call_s = time.perf_counter() - c0
    steps, during, trace = 1, [], []
    persisted_at = None
    while True:
        if persisted_at is None and done():
            persisted_at = time.perf_counter()
        if persisted_at is not None and steps >= min_steps:
            break
        t = time.perf_counter()
        job.step()
        dt = time.perf_counter() - t
        trace.append((round(t - c0, 4), round(dt - base, 4)))
        if persisted_at is None:
            during.append(dt)
        steps += 1
    wall = time.perf_counter() - t0
    return {
        "call_s": call_s,
        "stall_s": wall - steps * base,
        "persist_s": persisted_at - c0,
        "steps_during_persist": len(during),
        "step_during_persist_s": statistics.median(during) if during else float("nan"),
        "slowest_steps": sorted(trace, key=lambda x: -x[1])[:8],  # (start after call, extra s)
    }


def run_dd(directory: str, mb: int) -> dict[str, float]:
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
    drop_caches()
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


def d2h_copy(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/mpickpt-bench")
    ap.add_argument("--layers", type=int, default=29)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-steps", type=int, default=20)
    ap.add_argument("--methods", default="dd,torch.save,dcp.save,dcp.async_save,"
                    "dcp.async_save+pinned,mpickpt")
    ap.add_argument("--io-threads", type=int, default=8, help="mpickpt's I/O threads")
    ap.add_argument("--soak", type=int, default=0, help="N consecutive mpickpt checkpoints")
    ap.add_argument("--json", default="bench/results/gpu.json")
    ap.add_argument("--png", default="bench/results/gpu.png")
    args = ap.parse_args()
    methods = args.methods.split(",")

    torch.cuda.set_device(RANK % torch.cuda.device_count())
    base_dir = os.path.join(args.dir, f"rank{RANK}") if SIZE > 1 else args.dir
    shutil.rmtree(base_dir, ignore_errors=True)
    os.makedirs(base_dir)
    job = Job(args.layers, args.width, args.batch)
    nbytes = job.nbytes()
    for _ in range(3):
        job.step()
    base = baseline_step(job, 30)
    res: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ranks": SIZE,
        "state_bytes_per_rank": nbytes, "step_s": base, "layers": args.layers,
        "width": args.width, "batch": args.batch, "dir": args.dir, "methods": {},
    }
    log(f"state {nbytes / 1e9:.2f} GB per rank x {SIZE} ranks, step {base * 1e3:.1f} ms")
    res["d2h_pinned_GBps"] = d2h_copy(min(nbytes, 4 << 30))
    if "dd" in methods:
        res.update(run_dd(base_dir, 4096))
        log({k: round(v, 3) for k, v in res.items() if k.startswith("dd")})
    if args.soak:
        res["soak"] = soak(job, base_dir, args.soak)
        write(res, args)
        return
    ref = [t.clone() for t in job.tensors()]  # the values every restore must bring back

    def verify(name: str) -> None:
        torch.cuda.synchronize()
        bad = sum(not torch.equal(a.to(b.device), b)
                  for a, b in zip(job.tensors(), ref, strict=True))
        if bad:
            raise SystemExit(f"{name}: {bad} tensors differ after restore")

    def perturb() -> None:
        with torch.no_grad():
            for t in job.tensors():
                t.add_(1)

    def restore_timed(name: str, fn: Callable[[], None]) -> dict[str, Any]:
        perturb()
        dropped = drop_caches()
        COMM.Barrier()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        s = time.perf_counter() - t
        verify(name)
        return {"restore_s": s, "restore_GBps": nbytes / s / 1e9, "cache_dropped": dropped}

    for m in methods:
        if m == "dd":
            continue
        try:
            res["methods"][m] = bench_method(m, job, base, base_dir, args, ref, restore_timed,
                                             nbytes)
        except Exception as e:  # a method that breaks is reported, the others still run
            res["methods"][m] = {"error": f"{type(e).__name__}: {e}"}
        log(m, json.dumps(res["methods"][m]))
        # reset the state to the reference so every method saves the same values
        with torch.no_grad():
            for t, r in zip(job.tensors(), ref, strict=True):
                t.copy_(r)
    write(res, args)


def bench_method(m: str, job: Job, base: float, d: str, args: argparse.Namespace,
                 ref: list[torch.Tensor], restore_timed: Callable[..., dict[str, Any]],
                 nbytes: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if m.startswith("dcp") and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=RANK, world_size=SIZE)
    path = os.path.join(d, m.replace("+", "-"))
    base = baseline_step(job, 20)  # again: a process group's threads may have changed it
    reps: list[dict[str, float]] = []
    restore: dict[str, Any] = {}
    ck = None
    for rep in range(args.reps):
        shutil.rmtree(path, ignore_errors=True)
        if m == "torch.save":
            def call() -> Callable[[], bool]:
                f = path + ".pt"
                torch.save(job.state_dict(), f)
                fd = os.open(f, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
                return lambda: True
        elif m == "dcp.save":
            def call() -> Callable[[], bool]:
                dcp.save(job.state_dict(), checkpoint_id=path)
                fsync_tree(path)
                return lambda: True
        elif m.startswith("dcp.async_save"):
            def call() -> Callable[[], bool]:
                kw = {}
                if m.endswith("+pinned"):
                    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
                    kw["async_stager"] = DefaultStager(StagingOptions(True, True, True, True))
                fut = dcp.async_save(job.state_dict(), checkpoint_id=path, **kw)
                fut = getattr(fut, "upload_completion", fut)
                return fut.done
        elif m == "mpickpt":
            if ck is None:
                ck = mpickpt.Checkpointer(path, keep=2, io_threads=args.io_threads)
                ck.save(0, {"model": job.model, "optim": job.opt}).wait()  # allocates the pool

            def call(ck: mpickpt.Checkpointer = ck, step: int = rep + 1) -> Callable[[], bool]:
                h = ck.save(step, {"model": job.model, "optim": job.opt})
                return h.done
        else:
            raise ValueError(f"unknown method {m}")
        w = window(job, base, call, args.min_steps)
        if m.startswith("dcp.async_save"):
            fsync_tree(path)
        reps.append(w)
        # restore the reference values so the state saved is the one restored
        with torch.no_grad():
            for t, r in zip(job.tensors(), ref, strict=True):
                t.copy_(r)
    # one more save of exactly the reference values, then restore it
    if m == "torch.save":
        torch.save(job.state_dict(), path + ".pt")

        def load() -> None:
            sd = torch.load(path + ".pt", map_location="cuda", weights_only=True)
            job.model.load_state_dict(sd["model"])
            job.opt.load_state_dict(sd["optim"])
        restore = restore_timed(m, load)
        size = tree_bytes(path + ".pt")
    elif m.startswith("dcp"):
        shutil.rmtree(path, ignore_errors=True)
        dcp.save(job.state_dict(), checkpoint_id=path)

        def load() -> None:
            sd = job.state_dict()
            dcp.load(sd, checkpoint_id=path)
            job.opt.load_state_dict(sd["optim"])
        restore = restore_timed(m, load)
        size = tree_bytes(path)
    else:
        assert ck is not None
        last = ck.save(args.reps + 1, {"model": job.model, "optim": job.opt}).wait()
        restore = restore_timed(m, lambda: ck.restore({"model": job.model, "optim": job.opt}))
        restore["pinned_pool_bytes"] = ck.pinned_bytes
        restore["stats"] = last.stats
        size = tree_bytes(last.path) // SIZE
        ck.close()
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path + ".pt"):
        os.unlink(path + ".pt")
    out: dict[str, Any] = {k: statistics.median(r[k] for r in reps) for k in reps[0]
                           if isinstance(reps[0][k], (int, float))}
    out["step_s"] = base
    out["stall_s_all"] = [r["stall_s"] for r in reps]
    out["slowest_steps"] = [r["slowest_steps"] for r in reps]
    out["persist_GBps"] = nbytes / out["persist_s"] / 1e9
    out["bytes_on_disk"] = size
    out.update(restore)
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
    shard = tree_bytes(os.path.join(d, "soak", f"step-{n - 1:08d}"))
    return {"checkpoints": n, "pinned_min": min(pinned), "pinned_max": max(pinned),
            "shard_bytes": shard, "pinned_over_shard": max(pinned) / shard,
            "rss_first": rss[0], "rss_max": max(rss), "rss_last": rss[-1],
            "call_s_median": statistics.median(stalls), "call_s_max": max(stalls)}


def write(res: dict[str, Any], args: argparse.Namespace) -> None:
    if RANK != 0:
        return
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1, default=str)
    rows = [(m, r) for m, r in res["methods"].items()]
    print(f"\n{res['gpu']}, torch {res['torch']}, {res['ranks']} rank(s), "
          f"{res['state_bytes_per_rank'] / 1e9:.2f} GB per rank, step {res['step_s'] * 1e3:.1f} ms")
    print(f"limits: d2h pinned {res['d2h_pinned_GBps']:.1f} GB/s, "
          f"dd direct write {res.get('dd_write_GBps', float('nan')):.2f} GB/s "
          f"(aggregate {res.get('dd_write_aggregate_GBps', float('nan')):.2f}), "
          f"read {res.get('dd_read_GBps', float('nan')):.2f} GB/s")
    hdr = f"{'method':24} {'stall s':>9} {'call s':>8} {'persist GB/s':>13} " \
          f"{'step +%':>8} {'restore s':>10} {'restore GB/s':>13}"
    print(hdr)
    print("-" * len(hdr))
    for m, r in rows:
        if "error" in r:
            print(f"{m:24} error: {r['error'][:90]}")
            continue
        slow = (r["step_during_persist_s"] / r["step_s"] - 1) * 100
        print(f"{m:24} {r['stall_s']:9.3f} {r['call_s']:8.3f} {r['persist_GBps']:13.2f} "
              f"{slow:8.1f} {r['restore_s']:10.2f} {r['restore_GBps']:13.2f}")
    if "soak" in res:
        print("soak:", json.dumps(res["soak"]))
    if rows:
        plot(res, args.png)


def plot(res: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [(m, r) for m, r in res["methods"].items() if "error" not in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [m for m, _ in ok]
    for ax, key, title in zip(axes, ["stall_s", "persist_GBps", "restore_s"],
                              ["training stall per checkpoint (s)", "persist (GB/s)",
                               "restore into GPU (s)"], strict=True):
        ax.bar(names, [r[key] for _, r in ok], color="tab:blue")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
        if key == "persist_GBps" and "dd_write_GBps" in res:
            ax.axhline(res["dd_write_GBps"], color="tab:red", ls="--", label="dd oflag=direct")
            ax.legend()
    fig.suptitle(f"{res['gpu']}: {res['state_bytes_per_rank'] / 1e9:.1f} GB state "
                 f"({res['layers']}x{res['width']}^2 MLP + Adam)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
