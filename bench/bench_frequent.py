"""A tiny DDP state checkpointed every training step: torch.save, DCP and mpickpt side by side.

    .venv/bin/mpiexec -n 4 .venv/bin/python bench/bench_frequent.py --dir /tmp/bf
    .venv/bin/python bench/bench_frequent.py --dir /tmp/bf        # relaunches itself, 4 ranks
    mpiexec -n 4 python bench/bench_frequent.py --steps 15 --rounds 1 --methods none,mpickpt
    mpiexec -n 4 python bench/bench_frequent.py --mpickpt-kw '{"io_threads": 2}' \\
        --mpickpt '{}' --mpickpt '{"max_in_flight": 3}'          # other mpickpt rows

The job: real DDP (``DistributedDataParallel`` over gloo) on every rank of ``mpiexec``, an MLP
of ``--layers`` ``Linear(width, width)`` layers (256 x 2: 131,584 parameters, model + Adam state
about 1.6 MB per rank) whose forward pass runs the layer stack ``--work`` times on a batch of
``--batch`` rows (more compute, same state): tune them so that the baseline step lands where
you want it (78 ms on 4 ranks of an idle 2-core machine with the defaults; the step time
grows about in proportion to both). Each row trains
``--steps`` steps (the first ``--warmup`` not counted) and checkpoints after every step:

  none                  no checkpoint: the baseline step time
  torch.save+fsync      each rank torch.save()s model + optimizer state dicts to its own file,
                        then fsyncs the file and the directory
  thread:torch.save+fsync  the floor of an asynchronous save of the bytes mpickpt writes: each
                        rank clones its share of the tensors (as mpickpt's default splits
                        them: this small state all on the last rank) on the training thread,
                        then torch.save()s and fsyncs them on a thread of its own, one save
                        in flight, over the same file each time; no vote, no commit, not
                        crash-safe
  dcp.save              torch.distributed.checkpoint.save into step-N/ (keeps the last 2)
  dcp.async_save        dcp.async_save into step-N/; before the next one it waits for the
                        previous one's future, as DCP requires (that wait is shown apart)
  mpickpt ...           one Checkpointer(ROOT, keep=2, replicated=("model", "optim"),
                        **--mpickpt-kw, **row) per row, ck.save(step, {"model", "optim"}); one
                        row per --mpickpt JSON (default: {} and {"max_in_flight": 2})

With ``--no-train`` the rows save back to back with no training step between the saves: the
CPU a save costs each rank alone, without a training loop beside it that its threads slow
down (a save waits for the one before where the method allows one in flight).

DCP uses a gloo process group of its own, so its background collectives never meet DDP's.
A step is the time from the start of ``zero_grad`` to the return of the checkpoint call; every
rank's step times are reduced to the slowest rank's, step by step. Rows run in rounds
(``--rounds``), in an order shuffled per round; slowdowns compare with ``none`` of the same
round, and the table gives the median over rounds. After the last step the row waits for its
checkpoints in flight ("tail"). For mpickpt the SaveResult stats of the counted saves (slowest
rank per save, then the median) say where the time of a save goes, and "seen done" is the time
from save() to the first step boundary at which its handle was done. "CPU ms/step/rank" is the
CPU time of each rank's process (all its threads) per step: where the ranks already fill the
CPUs, a checkpoint's background work shows up there and in the step time; "switches/step/rank"
its context switches per step (``getrusage``, voluntary and not, every thread's: the training's
own waits too, DDP's and the interpreter lock's, as the row without checkpoints shows). Every
row and round writes into a fresh directory under ``--dir``, removed afterwards. Rank 0 prints
the tables and writes ``--json`` (every step time, the machine, the figures).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpickpt.format.rootdir import fsync_path
from mpickpt.sharding import MIN_WRITE_SHARE, writers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_cpu import columns, machine_info  # noqa: E402

MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALRANKID")
CHILD = "BENCH_FREQUENT_CHILD"
METHODS = ("none", "torch.save+fsync", "thread:torch.save+fsync", "dcp.save", "dcp.async_save",
           "mpickpt")
# mpickpt's stats in this order first (others, as they come, after)
STAT_ORDER = ("stall_s", "waited_for_buffer_s", "copy_s", "create_s", "data_s", "seal_s",
              "persist_s", "commit_s", "protect_s", "protected_s", "seen_done_s")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def switches() -> int:
    """Context switches of this process so far, voluntary and not (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy since boot (all CPUs, from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------- the job


class MLP(torch.nn.Module):
    """``layers`` Linear(width, width) + tanh, the whole stack applied ``work`` times."""

    def __init__(self, width: int, layers: int, work: int) -> None:
        super().__init__()
        self.body = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.work = work

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.work):
            for lin in self.body:
                x = torch.tanh(lin(x))
        return x


class Job:
    """This rank's DDP model, its Adam and a few fixed batches to cycle through."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts it anyway)
        self.model = MLP(args.width, args.layers, args.work)
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1000 + rank)
        self.batches = [(torch.randn(args.batch, args.width, generator=g),
                         torch.randn(args.batch, args.width, generator=g)) for _ in range(4)]
        self.n = 0
        self.step()  # Adam's moments exist from here on: the state has its full size

    def step(self) -> None:
        x, y = self.batches[self.n % len(self.batches)]
        self.n += 1
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.ddp(x), y)
        loss.backward()
        self.opt.step()

    def state_dicts(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def nbytes(self) -> tuple[int, int]:
        """(parameters, bytes of model + optimizer tensors)."""
        params = sum(p.numel() for p in self.model.parameters())
        sd = self.state_dicts()
        n = sum(t.numel() * t.element_size() for t in sd["model"].values())
        for st in sd["optim"]["state"].values():
            n += sum(t.numel() * t.element_size() for t in st.values()
                     if isinstance(t, torch.Tensor))
        return params, n


# ------------------------------------------------------------------------------------- methods


class Method:
    """One row's checkpoint: ``save(step)`` after every step, ``finish()`` after the last."""

    def __init__(self, b: Bench, work: str) -> None:
        self.b, self.work = b, work

    def save(self, step: int) -> None:
        pass

    def finish(self) -> dict[str, Any]:
        """Wait for what is in flight; details for the JSON."""
        return {}


class TorchSave(Method):
    def save(self, step: int) -> None:
        path = os.path.join(self.work, f"rank{self.b.rank}.pt")
        torch.save(self.b.job.state_dicts(), path)
        fsync_path(path)
        fsync_path(self.work)


def tensors_of(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors of ``Job.state_dicts()``, by a name of their path."""
    out = {f"model/{k}": t for k, t in sd["model"].items()}
    for pid, st in sd["optim"]["state"].items():
        out.update((f"optim/{pid}/{k}", t) for k, t in st.items() if isinstance(t, torch.Tensor))
    return out


def share_of(tensors: dict[str, torch.Tensor], rank: int, size: int) -> list[str]:
    """This rank's share of ``tensors``, as mpickpt splits replicated tensors among their
    holders by default (:func:`mpickpt.sharding.writers`; this small state: all on the last
    rank, the others write an empty file)."""
    who = writers(((n, t.nbytes, range(size)) for n, t in tensors.items()), MIN_WRITE_SHARE)
    return [n for n in tensors if who[n] == rank]


class ThreadSave(Method):
    """``thread:torch.save+fsync``: this rank's share cloned, written on a background thread."""

    def __init__(self, b: Bench, work: str) -> None:
        super().__init__(b, work)
        from concurrent.futures import ThreadPoolExecutor

        self.share = share_of(tensors_of(b.job.state_dicts()), b.rank, b.size)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="bench-save")
        self.future: Any = None
        self.nbytes = 0

    def save(self, step: int) -> None:
        every = tensors_of(self.b.job.state_dicts())
        copy = {n: every[n].detach().clone() for n in self.share}
        self.nbytes = sum(t.nbytes for t in copy.values())
        if self.future is not None:  # one in flight
            self.future.result()
        self.future = self.thread.submit(self._write, copy)

    def _write(self, copy: dict[str, torch.Tensor]) -> None:
        path = os.path.join(self.work, f"rank{self.b.rank}.pt")
        torch.save(copy, path)
        fsync_path(path)
        fsync_path(self.work)

    def finish(self) -> dict[str, Any]:
        if self.future is not None:
            self.future.result()
        self.thread.shutdown()
        return {"share_bytes": self.nbytes}


class DcpSave(Method):
    """dcp.save, or dcp.async_save waiting for the previous future first; the last 2 kept."""

    def __init__(self, b: Bench, work: str, asynchronous: bool) -> None:
        super().__init__(b, work)
        import torch.distributed.checkpoint as dcp

        self.dcp, self.asynchronous = dcp, asynchronous
        self.future: Any = None
        self.waits: list[float] = []  # async: how long each save waited for the previous one

    def _drop(self, step: int) -> None:
        if self.b.rank == 0 and step > 0:
            shutil.rmtree(os.path.join(self.work, f"step-{step}"), ignore_errors=True)

    def save(self, step: int) -> None:
        cid = os.path.join(self.work, f"step-{step}")
        if not self.asynchronous:
            self.dcp.save(self.b.job.state_dicts(), checkpoint_id=cid,
                          process_group=self.b.dcp_group)
            self._drop(step - 2)
            return
        t = time.perf_counter()
        if self.future is not None:
            self.future.result()
        self.waits.append(time.perf_counter() - t)
        self._drop(step - 3)  # step-1 and step-2 are committed, this one in flight
        fut = self.dcp.async_save(self.b.job.state_dicts(), checkpoint_id=cid,
                                  process_group=self.b.dcp_group)
        self.future = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse or Future

    def finish(self) -> dict[str, Any]:
        if self.future is not None:
            self.future.result()
        return {"wait_for_previous_s": self.waits} if self.asynchronous else {}


class Mpickpt(Method):
    def __init__(self, b: Bench, work: str, kw: dict[str, Any]) -> None:
        super().__init__(b, work)
        import mpickpt
        from mpickpt.options import FILES_KEYWORDS, SNAPSHOTS_KEYWORDS

        self.kw = {"keep": 2, "replicated": ("model", "optim"), **kw}
        if isinstance(self.kw["replicated"], list):
            self.kw["replicated"] = tuple(self.kw["replicated"])
        # --mpickpt '{"max_in_flight": 2}': the Snapshots fields, given flat on the command line
        snap = {k: self.kw.pop(k) for k in SNAPSHOTS_KEYWORDS if k in self.kw}
        if snap:
            self.kw["snapshots"] = mpickpt.Snapshots(**snap)
        # --mpickpt '{"min_write_share": 0}': a Files field, given flat (the flat fanout=,
        # index=, alignment= and checksum_block= are Checkpointer's own, deprecated, keywords)
        files = {f.name: self.kw.pop(f.name) for f in dataclasses.fields(mpickpt.Files)
                 if f.name in self.kw and f.name not in FILES_KEYWORDS}
        if files:
            self.kw["files"] = mpickpt.Files(**files)
        self.ck = mpickpt.Checkpointer(work, **self.kw)
        self.handles: list[tuple[int, Any, float]] = []  # step, handle, when save() was called
        self.seen: dict[int, float] = {}  # step -> seconds from save() to first seen done

    def _poll(self) -> None:
        now = time.perf_counter()
        for step, h, t in self.handles:
            if step not in self.seen and h.done():
                self.seen[step] = now - t

    def save(self, step: int) -> None:
        t = time.perf_counter()
        h = self.ck.save(step, {"model": self.b.job.model, "optim": self.b.job.opt})
        self._poll()
        self.handles.append((step, h, t))

    def finish(self) -> dict[str, Any]:
        self.ck.wait()
        self._poll()
        saves = []
        for step, h, _ in self.handles:
            r = h.wait()  # on_error="warn": an aborted save is a result, not an exception
            saves.append({"step": step, "committed": bool(r.committed),
                          "skipped": bool(getattr(r, "skipped", False)), "error": r.error,
                          "stats": {**r.stats, "seen_done_s": self.seen.get(step)}})
        self.ck.close()
        return {"kwargs": {k: list(v) if isinstance(v, tuple) else v
                           for k, v in self.kw.items()}, "saves": saves}


# ----------------------------------------------------------------------------------------- rows


def mpickpt_label(kw: dict[str, Any]) -> str:
    return "mpickpt" + (f" ({', '.join(f'{k}={v}' for k, v in kw.items())})" if kw else "")


class Bench:
    """Every rank's side of the run; rank 0 also keeps the figures."""

    def __init__(self, args: argparse.Namespace, comm: Any, top: str) -> None:
        import torch.distributed as dist

        self.args, self.comm, self.top = args, comm, top
        self.rank, self.size = comm.rank, comm.size
        self.dcp_group = dist.new_group(backend="gloo")
        self.job = Job(args, self.rank)
        base = json.loads(args.mpickpt_kw)
        rows = args.mpickpt or ["{}", '{"max_in_flight": 2}']
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = set(wanted) - set(METHODS)
        if unknown:
            raise SystemExit(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
        self.rows: dict[str, Callable[[str], Method]] = {}
        for m in wanted:
            if m == "none":
                self.rows[m] = lambda w: Method(self, w)
            elif m == "torch.save+fsync":
                self.rows[m] = lambda w: TorchSave(self, w)
            elif m == "thread:torch.save+fsync":
                self.rows[m] = lambda w: ThreadSave(self, w)
            elif m in ("dcp.save", "dcp.async_save"):
                self.rows[m] = lambda w, a=m == "dcp.async_save": DcpSave(self, w, a)
            else:
                for js in rows:
                    kw = json.loads(js)
                    self.rows[mpickpt_label(kw)] = lambda w, kw=kw: Mpickpt(self, w,
                                                                            {**base, **kw})
        self.results: dict[str, list[dict[str, Any]]] = {name: [] for name in self.rows}

    def barrier(self) -> None:
        """A barrier that sleeps while it waits (MPI's blocking calls spin on a core)."""
        req = self.comm.Ibarrier()
        while not req.Test():
            time.sleep(0.001)

    def one(self, name: str, rnd: int, index: int) -> dict[str, Any]:
        """One row in one round: ``--steps`` steps, each followed by its checkpoint."""
        a = self.args
        work = os.path.join(self.top, f"r{rnd}-{index}")
        if self.rank == 0:
            os.makedirs(work)
        self.barrier()
        t = time.perf_counter()
        method = self.rows[name](work)
        setup = time.perf_counter() - t
        self.barrier()
        busy0, ours0, wall0 = busy_cpu_s(), time.process_time(), time.perf_counter()
        csw0 = switches()
        steps, calls = np.zeros(a.steps), np.zeros(a.steps)
        for i in range(a.steps):
            t0 = time.perf_counter()
            if not a.no_train:
                self.job.step()
            t1 = time.perf_counter()
            method.save(i + 1)
            t2 = time.perf_counter()
            steps[i], calls[i] = t2 - t0, t2 - t1
        t = time.perf_counter()
        details = method.finish()
        tail = time.perf_counter() - t
        mine, busy = time.process_time() - ours0, busy_cpu_s() - busy0
        wall = time.perf_counter() - wall0
        csw = self.comm.allreduce(switches() - csw0)
        ours = self.comm.allreduce(mine)  # (others_cpu_s: rank 0's view of the machine)
        self.comm.Allreduce(steps.copy(), steps, op=_max())
        self.comm.Allreduce(calls.copy(), calls, op=_max())
        tail = self.comm.allreduce(tail, op=_max())
        setup = self.comm.allreduce(setup, op=_max())
        gathered = self.comm.gather(details, root=0)
        if self.rank == 0:
            os.sync()  # this row's dirty pages are not written back during the next one
            shutil.rmtree(work, ignore_errors=True)
        self.barrier()
        out: dict[str, Any] = {"round": rnd, "step_s": steps.tolist(), "call_s": calls.tolist(),
                               "tail_s": tail, "setup_s": setup, "wall_s": wall,
                               "ranks_cpu_s": ours, "others_cpu_s": busy - ours,
                               "ranks_context_switches": int(csw),
                               "loadavg": Path("/proc/loadavg").read_text().strip()}
        if self.rank == 0:
            assert gathered is not None
            out.update(per_rank_details(gathered, a.warmup))
        return out

    def run(self) -> None:
        a = self.args
        for rnd in range(a.rounds):
            order = list(self.rows)
            random.Random(a.seed + rnd).shuffle(order)  # the same order on every rank
            if self.rank == 0:
                log(f"round {rnd + 1}/{a.rounds}: {', '.join(order)}")
            for index, name in enumerate(order):
                r = self.one(name, rnd, index)
                self.results[name].append(r)
                if self.rank == 0:
                    s = np.array(r["step_s"][a.warmup:])
                    log(f"  {name}: step median {np.median(s) * 1e3:.1f} ms, p90 "
                        f"{np.percentile(s, 90) * 1e3:.1f} ms, mean {s.mean() * 1e3:.1f} ms, "
                        f"tail {r['tail_s']:.2f} s; CPU s: ranks {r['ranks_cpu_s']:.1f}, "
                        f"other processes {r['others_cpu_s']:.1f}, in {r['wall_s']:.1f} s")


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def per_rank_details(gathered: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Rank 0: the per-rank details of one row, and for mpickpt the slowest rank's stats of
    each counted save and the outcomes."""
    out: dict[str, Any] = {"per_rank": gathered}
    first = gathered[0]
    if "wait_for_previous_s" in first:
        waits = np.max([d["wait_for_previous_s"] for d in gathered], axis=0)
        out["wait_for_previous_s"] = waits.tolist()
    if "saves" in first:
        counted = []
        for j, s0 in enumerate(first["saves"]):
            if s0["step"] <= warmup:
                continue
            st: dict[str, float] = {}
            for d in gathered:
                for k, v in d["saves"][j]["stats"].items():
                    if isinstance(v, (int, float)) and v is not None:
                        st[k] = max(st.get(k, v), v)
            counted.append(st)
        saves = first["saves"]
        out["slowest_stats"] = counted
        out["outcomes"] = {
            "committed": sum(s["committed"] and not s["skipped"] for s in saves),
            "aborted": sum(not s["committed"] and not s["skipped"] for s in saves),
            "skipped": sum(s["skipped"] for s in saves),
        }
        out["errors"] = sorted({s["error"] for s in saves if s["error"]})[:5]
        out["kwargs"] = first["kwargs"]
    return out


# --------------------------------------------------------------------------------------- report


def summarize(b: Bench) -> tuple[list[dict[str, Any]], str, str]:
    """Rank 0: per-row figures, the main table and the mpickpt stats table."""
    a = b.args
    base = b.results.get("none")
    rows = []
    for name, rounds in b.results.items():
        med, mean, p90, peak, call, tail, slow_med, slow_mean, cpu, csw, extra = (
            [] for _ in range(11))
        for i, r in enumerate(rounds):
            cpu.append(r["ranks_cpu_s"] / a.steps / b.size)
            csw.append(r["ranks_context_switches"] / a.steps / b.size)
            s = np.array(r["step_s"][a.warmup:])
            med.append(float(np.median(s)))
            mean.append(float(s.mean()))
            p90.append(float(np.percentile(s, 90)))
            peak.append(float(s.max()))
            call.append(float(np.median(r["call_s"][a.warmup:])))
            tail.append(r["tail_s"])
            if base and not a.no_train:  # (without training, none's steps are empty)
                s0 = np.array(base[i]["step_s"][a.warmup:])
                slow_med.append(100 * (med[-1] / float(np.median(s0)) - 1))
                slow_mean.append(100 * (mean[-1] / float(s0.mean()) - 1))
            if base:
                extra.append(cpu[-1] - base[i]["ranks_cpu_s"] / a.steps / b.size)
        row: dict[str, Any] = {
            "method": name, "step_median_s": statistics.median(med),
            "step_mean_s": statistics.median(mean), "step_p90_s": statistics.median(p90),
            "step_max_s": max(peak), "call_median_s": statistics.median(call),
            "tail_s": statistics.median(tail), "rank_cpu_per_step_s": statistics.median(cpu),
            "rank_context_switches_per_step": statistics.median(csw),
            # a save per step: the CPU a save costs a rank, against none of the same round
            "rank_cpu_per_save_s": statistics.median(extra) if extra else None,
            "slowdown_median_pct": statistics.median(slow_med) if slow_med else None,
            "slowdown_mean_pct": statistics.median(slow_mean) if slow_mean else None,
        }
        waits = [w for r in rounds for w in r.get("wait_for_previous_s", [])[a.warmup:]]
        if waits:
            row["wait_for_previous_median_s"] = statistics.median(waits)
        if "outcomes" in rounds[0]:
            row["outcomes"] = {k: sum(r["outcomes"][k] for r in rounds)
                               for k in rounds[0]["outcomes"]}
            row["errors"] = sorted({e for r in rounds for e in r["errors"]})[:5]
            keys: list[str] = []
            for r in rounds:
                for st in r["slowest_stats"]:
                    keys += [k for k in st if k not in keys]
            row["stats_median"] = {
                k: statistics.median(vals) for k in keys
                if (vals := [st[k] for r in rounds for st in r["slowest_stats"] if k in st])}
        rows.append(row)

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:+.0f}%"

    head = ("method", "step ms", "slower", "mean ms", "slower (mean)", "p90 ms", "max ms",
            "in ckpt call ms", "tail s", "CPU ms/step/rank", "CPU ms/save/rank",
            "switches/step/rank",
            "saves ok/aborted/skipped (all)")
    lines = []
    for r in rows:
        o = r.get("outcomes")
        call = ms(r["call_median_s"])
        if "wait_for_previous_median_s" in r:
            call += f" (wait {ms(r['wait_for_previous_median_s'])})"
        lines.append((r["method"], ms(r["step_median_s"]), pct(r["slowdown_median_pct"]),
                      ms(r["step_mean_s"]), pct(r["slowdown_mean_pct"]), ms(r["step_p90_s"]),
                      ms(r["step_max_s"]), call, f"{r['tail_s']:.2f}",
                      ms(r["rank_cpu_per_step_s"]), ms(r["rank_cpu_per_save_s"]),
                      f"{r['rank_context_switches_per_step']:.0f}",
                      f"{o['committed']}/{o['aborted']}/{o['skipped']}" if o else "-"))
    main = columns(head, lines)

    mp = [r for r in rows if "stats_median" in r]
    stats = ""
    if mp:
        keys = [k for k in STAT_ORDER if any(k in r["stats_median"] for r in mp)]
        keys += sorted({k for r in mp for k in r["stats_median"]
                        if k.endswith("_s") and k not in keys})
        lines = [(k, *(ms(r["stats_median"].get(k)) for r in mp)) for k in keys]
        for k in ("bytes", "snapshot_bytes"):
            if any(k in r["stats_median"] for r in mp):
                lines.append((k, *(f"{r['stats_median'][k]:,.0f}" if k in r["stats_median"]
                                   else "-" for r in mp)))
        stats = columns(("median of a save's stats, ms", *(r["method"] for r in mp)), lines)
    return rows, main, stats


# ----------------------------------------------------------------------------------------- main


def relaunch(args: argparse.Namespace) -> None:
    """Not under an MPI launcher: run this script again under ``mpiexec -n --ranks``."""
    exe = os.environ.get("MPICKPT_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
    if not os.path.exists(exe):
        exe = shutil.which("mpiexec") or ""
    if not exe:
        raise SystemExit("no mpiexec found: run this script under mpiexec")
    cmd = [exe, "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve()),
           *sys.argv[1:]]
    log("relaunching: " + " ".join(cmd))
    os.environ[CHILD] = "1"
    os.execv(exe, cmd)


def init_torch_dist(comm: Any) -> None:
    """gloo process group over the MPI ranks (rank 0 picks a free port)."""
    import torch.distributed as dist

    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--steps", type=int, default=60, help="steps per row and round (60)")
    ap.add_argument("--warmup", type=int, default=5, help="first steps not counted (5)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds (2)")
    ap.add_argument("--width", type=int, default=256, help="Linear width (256)")
    ap.add_argument("--layers", type=int, default=2, help="Linear layers (2)")
    ap.add_argument("--batch", type=int, default=512, help="rows per batch (512)")
    ap.add_argument("--work", type=int, default=5,
                    help="times the forward pass runs the layer stack: compute, not state (5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    ap.add_argument("--no-train", action="store_true",
                    help="no training step between the checkpoints: saves back to back, what "
                         "a save's own work costs each rank (its CPU less none's, which is "
                         "then about nothing), without the training beside it")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated rows (default: {','.join(METHODS)}); mpickpt: one "
                         "row per --mpickpt")
    ap.add_argument("--mpickpt-kw", default="{}",
                    help="JSON: Checkpointer keywords for every mpickpt row, e.g. "
                         "'{\"io_threads\": 2}' (over keep=2, replicated=[model, optim])")
    ap.add_argument("--mpickpt", action="append",
                    help="JSON: one mpickpt row with these extra keywords; repeat for more "
                         "(default: '{}' and '{\"max_in_flight\": 2}')")
    ap.add_argument("--dir", help="where the checkpoints go (default: /tmp); a fresh "
                                  "subdirectory is made and removed")
    ap.add_argument("--json", default=str(HERE / "results" / "frequent.json"),
                    help="results (default bench/results/frequent.json)")
    ap.add_argument("--ranks", type=int, default=4,
                    help="ranks when the script relaunches itself under mpiexec (4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the row order per round")
    args = ap.parse_args()
    json.loads(args.mpickpt_kw)
    for js in args.mpickpt or []:
        json.loads(js)
    if args.steps <= args.warmup:
        ap.error("--steps must be more than --warmup")
    return args


def main() -> None:
    args = parse()
    if not any(k in os.environ for k in MPI_ENV) and CHILD not in os.environ:
        relaunch(args)
    os.environ.setdefault("MPICKPT_LOG", "WARNING")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    torch.set_num_threads(args.threads)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        run(args, comm)
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)


def run(args: argparse.Namespace, comm: Any) -> None:
    started = time.time()
    parent = os.path.abspath(args.dir or "/tmp")
    top, made = None, False
    if comm.rank == 0:
        made = not os.path.exists(parent)
        os.makedirs(parent, exist_ok=True)
        top = tempfile.mkdtemp(prefix="bench-frequent-", dir=parent)
    top = comm.bcast(top)
    init_torch_dist(comm)
    import torch.distributed as dist

    try:
        b = Bench(args, comm, top)
        params, nbytes = b.job.nbytes()
        if comm.rank == 0:
            log(f"{comm.size} ranks, DDP over gloo; MLP {args.layers} x Linear({args.width}, "
                f"{args.width}) x work {args.work}, batch {args.batch}: {params:,} parameters, "
                f"model + Adam {nbytes:,} bytes per rank; {args.steps} steps per row "
                f"({args.warmup} warm-up), {args.rounds} round(s); {top}")
        b.run()
    finally:
        if comm.rank == 0:
            shutil.rmtree(top, ignore_errors=True)
            if made:
                with contextlib.suppress(OSError):
                    os.rmdir(parent)
    if comm.rank == 0:
        rows, main_table, stats_table = summarize(b)
        info = machine_info(parent)
        base = next((r for r in rows if r["method"] == "none"), None)
        title = (f"{comm.size}-rank DDP (gloo), {nbytes / 1e6:.2f} MB model + Adam state per "
                 f"rank ({params:,} params), a checkpoint after every step; "
                 f"{args.steps - args.warmup} steps x {args.rounds} round(s), slowest rank per "
                 "step; "
                 f"baseline step {base['step_median_s'] * 1e3:.1f} ms" if base else "")
        print(f"\n{title}\n{info['cpu_count']} CPUs, torch {torch.__version__}, {parent} on "
              f"{info['filesystem'].get('type', '?')}\n")
        print(main_table)
        print("\n'slower': median step against none's of the same round, median over rounds; "
              "'in ckpt call': the checkpoint call's own time per step (dcp.async_save: of it, "
              "the wait for the previous save); 'tail': waiting for the saves in flight after "
              "the last step; 'CPU ms/step/rank': CPU time of each rank's process, all its "
              "threads, per step (the ranks share the machine's CPUs); 'CPU ms/save/rank': "
              "the same less none's of the same round, median over rounds (a save per step: "
              "what a save costs a rank); 'switches/step/rank': "
              "its context switches per step, voluntary and not, every thread's (the row "
              "without checkpoints: the training's own)")
        if stats_table:
            print("\n" + stats_table)
            print("\n(slowest rank per save, median over the counted saves; seen_done_s: from "
                  "save() to the first step boundary that found the handle done)")
        others = sum(r["others_cpu_s"] for rs in b.results.values() for r in rs)
        wall = sum(r["wall_s"] for rs in b.results.values() for r in rs)
        print(f"\nother processes on this machine used {max(others, 0):.0f} CPU s during the "
              f"{wall:.0f} s of the rows ({info['cpu_count']} CPUs; per row in the JSON: "
              "others_cpu_s)")
        for r in rows:
            for e in r.get("errors", []):
                print(f"{r['method']}: aborted save: {e}")
        doc = {"args": vars(args), "ranks": comm.size, "params": params,
               "state_bytes_per_rank": nbytes, "machine": info, "started": started,
               "elapsed_s": time.time() - started, "rows": rows, "rounds": b.results,
               "table": main_table, "stats_table": stats_table}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        log(f"\nwrote {args.json} ({time.time() - started:.0f} s in all)")
    b.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
