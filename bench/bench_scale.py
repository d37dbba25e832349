"""Real jobs of 1 to 64 ranks on this machine: what a save, its commit and a restore cost as
the number of ranks grows, and what rank 0 holds.

Each job (``mpiexec -n P``, oversubscribed) gives every rank a small state of ``--tensors``
tensors (``--kb`` KiB each, its own values) and checkpoints it ``--saves`` times into one ROOT,
each save waited for, then restores the last one. Per job, rank 0 reports the medians: the
``save()`` call, the time from the call until the commit is known (``wait()``), the
restore, the manifest's bytes, and rank 0's peak resident memory; every rank checks that it
got its own values back. The table goes to stdout, the JSON and a PNG under ``bench/results``::

    python bench/bench_scale.py                          # 1, 4, 16, 32 ranks (~4 minutes)
    python bench/bench_scale.py --ranks 1,4,16,32,64 --tensors 20
    python bench/bench_scale.py --ranks 16,32,64 --files per-rank,per-node --per-node 8
    python bench/bench_scale.py --ranks 16,32,64 --files per-rank,per-node --index per-rank

``--files per-rank,per-node`` runs every job twice, one shard per rank and one per node
(``Checkpointer(files="per-node")``, ranks grouped ``--per-node`` to a simulated node with
``$MPICKPT_NODE``), side by side in the same run, and counts the files each checkpoint is.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def worker(args: argparse.Namespace) -> None:
    """One rank of one job."""
    import torch
    from mpi4py import MPI

    import mpickpt

    comm = MPI.COMM_WORLD
    if args.files == "per-node":
        os.environ["MPICKPT_NODE"] = f"n{comm.rank // args.per_node}"
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(comm.rank)
    state = {f"t{i}": torch.randn(args.kb * 256, generator=g) for i in range(args.tensors)}
    expected = {k: v.clone() for k, v in state.items()}
    calls, commits = [], []
    files = mpickpt.Files(per=args.files.removeprefix("per-"), index=args.index)
    with mpickpt.Checkpointer(args.root, keep=2, files=files) as ck:
        for step in range(1, args.saves + 1):
            comm.Barrier()
            t = time.perf_counter()
            handle = ck.save(step, state)
            calls.append(time.perf_counter() - t)
            if not handle.wait().committed:
                raise RuntimeError(f"rank {comm.rank}: save {step} failed")
            commits.append(time.perf_counter() - t)
        for v in state.values():
            v.zero_()
        comm.Barrier()
        t = time.perf_counter()
        got = ck.restore(state)
        restore = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
    bad = [k for k in state if not torch.equal(state[k], expected[k])]
    if got != args.saves or bad:
        raise RuntimeError(f"rank {comm.rank}: restored step {got}, wrong tensors {bad[:3]}")
    call = comm.allreduce(statistics.median(calls), op=MPI.MAX)
    commit = comm.allreduce(statistics.median(commits), op=MPI.MAX)
    if comm.rank == 0:
        step_dir = os.path.join(args.root, f"step-{args.saves:08d}")
        files = [os.path.join(t, f) for t, _, fs in os.walk(step_dir) for f in fs]
        print(json.dumps({
            "ranks": comm.size, "layout": args.files, "index": args.index,
            "files": len(files), "data_files": sum(f.endswith(".h5") for f in files),
            "bytes_on_disk": sum(os.path.getsize(f) for f in files),
            "call_s": call, "commit_s": commit, "restore_s": restore,
            "manifest_bytes": os.path.getsize(os.path.join(step_dir, "MANIFEST.json")),
            "rank0_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "state_bytes_per_rank": args.tensors * args.kb * 1024}))


def mpiexec() -> list[str]:
    exe = os.environ.get("MPICKPT_MPIEXEC") or (
        os.path.join(os.path.dirname(sys.executable), "mpiexec")
        if os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec"))
        else shutil.which("mpiexec"))
    if not exe:
        sys.exit("no mpiexec found: install the 'mpich' wheel or a system MPI")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    extra = ["--oversubscribe", "--allow-run-as-root"] if "Open MPI" in out else []
    return [exe, *extra]


def plot(rows: list[dict[str, Any]], png: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot (pip install '.[bench]')")
        return
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    base = [r for r in rows if r["layout"] == layouts[0]]
    ranks = [r["ranks"] for r in base]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for layout in layouts:
        mine = [r for r in rows if r["layout"] == layout]
        tag = f" ({layout})" if len(layouts) > 1 else ""
        for key, label in (("call_s", "save() call"), ("commit_s", "save() to commit"),
                           ("restore_s", "restore")):
            axes[0].plot([r["ranks"] for r in mine], [r[key] for r in mine], marker="o",
                         linestyle="-" if layout == layouts[0] else "--", label=label + tag)
    axes[0].set(xscale="log", yscale="log", xlabel="ranks (2 cores, oversubscribed)",
                ylabel="seconds (slowest rank, median of saves)")
    axes[0].legend()
    axes[1].plot(ranks, [r["manifest_bytes"] / 1e3 for r in base], marker="o",
                 label="MANIFEST.json (kB)")
    axes[1].plot(ranks, [r["rank0_peak_rss"] / 1e6 for r in base], marker="o",
                 label="rank 0 peak RSS (MB)")
    for layout in layouts:
        mine = [r for r in rows if r["layout"] == layout]
        axes[1].plot([r["ranks"] for r in mine], [r["files"] for r in mine], marker="s",
                     label=f"files per checkpoint ({layout})")
    axes[1].set(xscale="log", yscale="log", xlabel="ranks")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"plot: {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,4,16,32")
    ap.add_argument("--tensors", type=int, default=20)
    ap.add_argument("--kb", type=int, default=64, help="KiB per tensor")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--files", default="per-rank",
                    help="layouts to run, comma-separated: per-rank, per-node")
    ap.add_argument("--per-node", type=int, default=8, help="ranks per simulated node")
    ap.add_argument("--index", default="auto", help="Files(index=...)")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default="bench/results/scale.json")
    ap.add_argument("--png", default="bench/results/scale.png")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from bench_cpu import columns

    rows = []
    for p in (int(x) for x in args.ranks.split(",")):
        for layout in args.files.split(","):
            root = os.path.join(args.dir, f"mpickpt-scale-{p}")
            shutil.rmtree(root, ignore_errors=True)
            cmd = [*mpiexec(), "-n", str(p), sys.executable, os.path.abspath(__file__),
                   "--worker", "--root", root, "--tensors", str(args.tensors), "--kb",
                   str(args.kb), "--saves", str(args.saves), "--files", layout,
                   "--per-node", str(args.per_node), "--index", args.index]
            t = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                 env={**os.environ, "MPICKPT_LOG": "WARNING"})
            shutil.rmtree(root, ignore_errors=True)
            if out.returncode != 0:
                sys.exit(f"{p} ranks ({layout}) failed (exit {out.returncode}):\n{out.stdout}\n"
                         f"{out.stderr}")
            line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
            rows.append({**json.loads(line), "job_s": time.perf_counter() - t})
            print(f"{p} ranks, {layout}: {rows[-1]}", flush=True)
    print(columns(("ranks", "files", "files per checkpoint", "save() call s",
                   "save to commit s", "restore s", "MANIFEST kB", "rank 0 peak RSS MB",
                   "job s"),
                  [(str(r["ranks"]), r["layout"], str(r["files"]), f"{r['call_s']:.4f}",
                    f"{r['commit_s']:.3f}", f"{r['restore_s']:.3f}",
                    f"{r['manifest_bytes'] / 1e3:.1f}", f"{r['rank0_peak_rss'] / 1e6:.0f}",
                    f"{r['job_s']:.0f}") for r in rows]))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, args.png)


if __name__ == "__main__":
    main()
