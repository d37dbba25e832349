"""The training stall of a checkpoint inside PyTorch Lightning and the Hugging Face Trainer: each
framework's own checkpointing against mpickpt's integration, on the same job, in one run.

Methods (each a process of its own, one rank; the order rotates every round):

  lightning own            Lightning's default CheckpointIO (torch.save, on the training thread)
  lightning async          Lightning's AsyncCheckpointIO (torch.save on a thread)
  lightning mpickpt        mpickpt.lightning.MpickptIO, with its Preemption callback (as
                           lightning.md's lines; its setup makes the Checkpointer)
  lightning none           no checkpoint: the baseline
  hf own                   Trainer's own checkpoint (safetensors + torch.save of optimizer,
                           scheduler and RNG states)
  hf mpickpt               mpickpt.hf.Trainer
  hf none                  save_strategy="no": the baseline

Lightning trains an MLP (``--width`` by ``--layers``, AdamW), the Trainer a GPT-2 built from a
config (``--gpt-layers`` by ``--gpt-width``); both save every ``--every`` steps for ``--steps``
steps. Per method: the state's size, the median time of the save call (the stall the training
loop sees directly: Lightning's ``trainer.save_checkpoint``, the Trainer's ``_save_checkpoint``),
and the slowdown of the whole run per checkpoint against the baseline (the stall plus what
background writing takes from the training steps, and the wait for the last save at the end);
then the tail (from the end of the last training step to the end of the run: the wait for the
last save) and the slowdown per checkpoint up to the end of the last step, the tail apart; and
the whole process's slowdown per checkpoint (imports, MPI's start and building the job too).
A run is the framework's ``fit``/``train`` call. ``--mpi-first 1`` starts MPI in every method's
process before its job, as ``mpickpt.run`` does under ``mpirun`` or ``srun`` (the documented
launch); by default no process starts MPI (one that no launcher started runs mpickpt alone).
Neither framework fsyncs its files; mpickpt does. On CUDA the models are on the GPU.

    python bench/bench_frameworks.py                  # ~6 minutes on 2 cores
    python bench/bench_frameworks.py --device cuda --width 4096 --layers 8 --batch 4096 \
        --gpt-width 1024 --gpt-layers 12 --gpt-batch 32 --steps 160 --every 40  # an H200

Needs ``pip install '.[lightning,hf]'``. JSON to ``--json``: each run's step ends, save starts
and full GCs, and on CUDA for Lightning ``gpu_steps_ms`` (per step, its stream's time from start
to end and the GPU's idle gap before it: whether a slower step lost its time on the GPU or on
the CPU). The save calls are timed without synchronizing the GPU around them (a synchronize
drains the step in flight, up to a step's GPU time that no training loop would lose);
``--sync-calls 1`` synchronizes, to count the call's GPU work in the call.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_cpu import FULL_GC, columns, watch_full_gc  # noqa: E402

METHODS = ("lightning none", "lightning own", "lightning async", "lightning mpickpt",
           "hf none", "hf own", "hf mpickpt")


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[..., None], calls: list[float], device: str,
           starts: list[float]) -> Callable[..., None]:
    """``fn``, appending to ``calls`` how long each call took (the GPU's work included) and to
    ``starts`` when it began."""

    def timed(*a: Any, **k: Any) -> None:
        _sync(device)
        t = time.perf_counter()
        starts.append(t)
        fn(*a, **k)
        _sync(device)
        calls.append(time.perf_counter() - t)

    return timed


def _call_sync(args: argparse.Namespace) -> str:
    """The device ``_timed`` synchronizes around a save call ("cpu": none)."""
    return args.device if args.sync_calls else "cpu"


def _timeline(t0: float, ends: list[float], starts: list[float]) -> dict[str, list[Any]]:
    """When each step ended and each save call began, and each full collection of Python's
    (start, seconds), in seconds from the run's start: where a run lost its time (the steps
    after each save against the others)."""
    return {"step_ends": [round(e - t0, 4) for e in ends],
            "save_starts": [round(s - t0, 4) for s in starts],
            "full_gc": [[round(a - t0, 4), round(d, 4)] for a, d in FULL_GC if a >= t0]}


def _gpu_steps(marks: list[Any]) -> dict[str, list[list[float]]]:
    """With CUDA events at each step's start and end (after a synchronize): per step, the
    milliseconds its stream spent from start to end (waits on other streams included) and the
    idle gap before it (the GPU waiting for the CPU): whether a slower step was slower on the
    GPU or on the CPU. Empty without events."""
    if len(marks) < 2:
        return {}
    pairs = list(zip(marks[0::2], marks[1::2], strict=False))
    return {"gpu_steps_ms": [
        [round(a.elapsed_time(b), 2), round(pairs[i - 1][1].elapsed_time(a), 2) if i else 0.0]
        for i, (a, b) in enumerate(pairs)]}


def _durations(ends: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True)] if ends else []


def save_steps(run: dict[str, Any]) -> list[int]:
    """The index of the step each save began in."""
    ends = run.get("step_ends") or []
    return [next((i for i, e in enumerate(ends) if e > s), len(ends))
            for s in run.get("save_starts") or []]


def steps_lost(run: dict[str, Any], at: list[int], window: int) -> list[float]:
    """For each save step of ``at`` with ``window`` steps from it: how much longer those steps
    took than this run's median step away from them (a save's call included), less the full
    collections of Python's garbage collector that ran in them (``full_gc``; the framework's
    own: a run without checkpoints has as many, elsewhere). The run without checkpoints over
    the same steps gives the figure's noise."""
    ends = run.get("step_ends") or []
    d = _durations(ends)
    if window < 1 or not d:
        return []
    after = [list(range(i, i + window)) for i in at if i + window <= len(d)]
    # away from saves: not the first step (the job's start), nor any save's window, cut or not
    near = {i for s in at for i in range(s, min(s + window, len(d)))} | {0}
    quiet = [x for i, x in enumerate(d) if i not in near]
    if not quiet:
        return []
    med = statistics.median(quiet)
    out = []
    for w in after:
        lo, hi = ends[w[0]] - d[w[0]], ends[w[-1]]
        out.append(sum(d[i] - med for i in w)
                   - sum(g for a, g in run.get("full_gc") or [] if lo <= a < hi))
    return out


def _steps_less_gc(run: dict[str, Any]) -> float:
    """A run's time to the end of its last training step, less the full collections in it."""
    steps = run.get("steps_s", run.get("total_s", 0.0))
    return steps - sum(g for a, g in run.get("full_gc") or [] if a < steps)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The Checkpointer's options for the mpickpt methods: keep=2, and ``--options``."""
    return {"keep": 2, **json.loads(args.options)}


def lightning_job(args: argparse.Namespace, how: str, work: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch import nn

    from mpickpt.lightning import MpickptIO, Preemption

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            for _ in range(args.layers):
                layers += [nn.Linear(args.width, args.width), nn.ReLU()]
            self.net = nn.Sequential(*layers)

        def training_step(self, batch, i):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    x = torch.randn(args.steps * args.batch, args.width)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x),
                                         batch_size=args.batch)
    plugins, callbacks = [], []
    if how == "own":
        pass
    elif how == "async":
        plugins = [AsyncCheckpointIO()]
    elif how == "mpickpt":
        plugins = [MpickptIO(os.path.join(work, "root"), **_options(args))]
    if how != "none":
        callbacks = [ModelCheckpoint(dirpath=os.path.join(work, "ckpt"), save_top_k=-1,
                                     every_n_train_steps=args.every)]
    if how == "mpickpt":  # as lightning.md's lines: it also makes the Checkpointer at setup
        callbacks.append(Preemption(plugins[0]))
    ends: list[float] = []  # when each training step ended: the last one starts the tail

    marks: list[Any] = []  # CUDA events at each step's start and end, on the current stream

    class Clock(pl.Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            if args.device == "cuda":
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()

        def on_train_batch_end(self, *_: Any) -> None:
            ends.append(time.perf_counter())
            if args.device == "cuda":
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()

    callbacks.append(Clock())
    trainer = pl.Trainer(accelerator=args.device if args.device == "cuda" else "cpu", devices=1,
                         max_steps=args.steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=how != "none",
                         callbacks=callbacks, plugins=plugins)
    calls: list[float] = []
    starts: list[float] = []
    trainer.save_checkpoint = _timed(trainer.save_checkpoint, calls, _call_sync(args), starts)  # type: ignore[method-assign]
    model = MLP()
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    t = time.perf_counter()
    trainer.fit(model, loader)
    _sync(args.device)
    return {"total_s": time.perf_counter() - t, "steps_s": ends[-1] - t, "calls": calls,
            "state_bytes": state_bytes, **_timeline(t, ends, starts), **_gpu_steps(marks)}


def hf_job(args: argparse.Namespace, how: str, work: str) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    import mpickpt.hf

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.x = torch.randint(0, 8192, (n, 128), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    cfg = GPT2Config(n_layer=args.gpt_layers, n_embd=args.gpt_width, n_head=8, vocab_size=8192,
                     n_positions=128)
    model = GPT2LMHeadModel(cfg)
    targs = TrainingArguments(
        output_dir=os.path.join(work, "hf"), max_steps=args.steps,
        per_device_train_batch_size=args.gpt_batch,
        save_strategy="no" if how == "none" else "steps", save_steps=args.every,
        report_to=[], disable_tqdm=True, logging_strategy="no",
        use_cpu=args.device != "cuda")
    data = Tokens(args.steps * args.gpt_batch)
    if how == "mpickpt":
        trainer = mpickpt.hf.Trainer(model=model, args=targs, train_dataset=data,
                                     mpickpt_root=os.path.join(work, "root"),
                                     mpickpt_options=_options(args))
    else:
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=data)
    calls: list[float] = []
    starts: list[float] = []
    trainer._save_checkpoint = _timed(trainer._save_checkpoint, calls, _call_sync(args), starts)  # type: ignore[method-assign]
    ends: list[float] = []  # when each training step ended: the last one starts the tail

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            ends.append(time.perf_counter())

    trainer.add_callback(Clock())
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    t = time.perf_counter()
    trainer.train()
    _sync(args.device)
    return {"total_s": time.perf_counter() - t, "steps_s": ends[-1] - t, "calls": calls,
            "state_bytes": state_bytes, **_timeline(t, ends, starts)}


def worker(args: argparse.Namespace) -> None:
    framework, how = args.method.split()
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(dir=args.dir, prefix="mpickpt-fw-")
    watch_full_gc()
    started: dict[str, float] = {}
    if args.mpi_first:  # as under mpirun with mpickpt.run: MPI is up before the job's code
        t = time.perf_counter()
        from mpickpt.run import init_mpi

        init_mpi()
        started["mpi_start_s"] = time.perf_counter() - t
    try:
        job = lightning_job if framework == "lightning" else hf_job
        out = {**job(args, how, work), **started}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("RESULT " + json.dumps({"method": args.method, **out}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--window", type=int, default=10,
                    help="steps after each save counted in 'steps lost' (timeline)")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--gpt-width", type=int, default=512)
    ap.add_argument("--gpt-layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="Lightning's batch")
    ap.add_argument("--gpt-batch", type=int, default=4, help="the Trainer's batch")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default="bench/results/frameworks.json")
    ap.add_argument("--options", default="{}", help="the Checkpointer's options for the "
                    'mpickpt methods, as JSON (default: keep=2 only), e.g. \'{"io_threads": 4}\'')
    ap.add_argument("--sync-calls", type=int, choices=[0, 1], default=0,
                    help="0 (the default): the call's CPU time only, nothing synchronized (a "
                    "step then shows what the loop itself would wait for); 1: the GPU "
                    "synchronized before and after each call (its GPU work counted in the call, "
                    "but the first synchronize drains the step in flight, which a training loop "
                    "would not: up to a step's GPU time lands in the steps lost)")
    ap.add_argument("--mpi-first", type=int, choices=[0, 1], default=0,
                    help="1: every method's process starts MPI (MPI_THREAD_MULTIPLE, as "
                    "mpickpt.run does under mpirun or srun) before it builds its job, so that "
                    "MPI's start (shown apart) falls outside the run; 0 (the default): a "
                    "process no launcher started, where mpickpt starts no MPI (until s66 its "
                    "Checkpointer's construction started it, inside the run)")
    ap.add_argument("--method", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not 1 <= args.window <= args.every:
        ap.error(f"--window {args.window}: from 1 to --every ({args.every}), so that no step "
                 "counts after two saves")
    if args.method:
        worker(args)
        return

    methods = args.methods.split(",")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for r in range(args.rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for m in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--method", m,
                   *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k in ("steps", "every", "width", "layers", "gpt_width", "gpt_layers",
                              "batch", "gpt_batch", "device", "dir", "options", "sync_calls",
                              "window", "mpi_first")]]
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True,
                               env={**os.environ, "MPICKPT_LOG": "WARNING"})
            process_s = time.perf_counter() - t
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                sys.exit(f"{m} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
            runs[m].append({**json.loads(line[-1][7:]), "process_s": process_s})
            gcs = runs[m][-1].get("full_gc") or []
            mpi = runs[m][-1].get("mpi_start_s")
            print(f"round {r + 1}: {m}: total {runs[m][-1]['total_s']:.2f} s (process "
                  f"{process_s:.2f} s{f', MPI start {mpi:.2f} s' if mpi is not None else ''}), "
                  "save calls "
                  f"{[round(c, 3) for c in runs[m][-1]['calls']]}, {len(gcs)} full GC "
                  f"({sum(d for _, d in gcs):.2f} s)", flush=True)
    rows, out = [], []
    for m in methods:
        fw = m.split()[0]
        base_runs = runs.get(f"{fw} none") or [{"total_s": 0.0}]
        base = statistics.median(x["total_s"] for x in base_runs)
        base_steps = statistics.median(x.get("steps_s", x["total_s"]) for x in base_runs)
        total = statistics.median(x["total_s"] for x in runs[m])
        steps = statistics.median(x["steps_s"] for x in runs[m])
        tail = statistics.median(x["total_s"] - x["steps_s"] for x in runs[m])
        calls = [c for x in runs[m] for c in x["calls"]]
        saves = len(runs[m][0]["calls"])
        stall = statistics.median(calls) if calls else 0.0
        slow = (total - base) / saves if saves else 0.0
        # the whole process (imports, MPI's start, building the job): what a user waits for
        proc = statistics.median(x["process_s"] for x in runs[m])
        proc_base = statistics.median(x.get("process_s", 0.0) for x in base_runs)
        proc_slow = (proc - proc_base) / saves if saves else 0.0
        # to the end of the last training step: the tail (the wait for the last save) apart
        rest = (steps - base_steps) / saves if saves else 0.0
        # and less the full collections in those steps (how many a run gets varies: 1-5 in
        # Lightning's runs without checkpoints on an H200, 0.2-0.4 s each)
        no_gc = (statistics.median(_steps_less_gc(x) for x in runs[m])
                 - statistics.median(_steps_less_gc(x) for x in base_runs))
        rest_no_gc = no_gc / saves if saves else 0.0
        nones = runs.get(f"{fw} none") or []
        lost, noise = [], []
        for i, run in enumerate(runs[m]):
            none = nones[i] if i < len(nones) and nones[i] is not run else None
            lost += steps_lost(run, save_steps(run), args.window)
            if none is not None:
                noise += steps_lost(none, save_steps(run), args.window)
        lost_med = statistics.median(lost) if lost else None
        out.append({"method": m, "state_bytes": runs[m][0]["state_bytes"], "saves": saves,
                    "save_call_s": stall, "total_s": total, "slowdown_per_save_s": slow,
                    "tail_s": tail, "slowdown_per_save_less_tail_s": rest,
                    "slowdown_per_save_less_tail_and_full_gc_s": rest_no_gc,
                    "process_s": proc, "process_slowdown_per_save_s": proc_slow,
                    "steps_lost_per_save_s": lost, "steps_lost_per_save_median_s": lost_med,
                    "steps_lost_without_checkpoints_s": noise,
                    "runs": runs[m]})
        rows.append((m, f"{runs[m][0]['state_bytes'] / 1e6:.0f}", str(saves),
                     f"{stall:.3f}", f"{total:.2f}", f"{slow:.3f}" if saves else "-",
                     f"{tail:.2f}", f"{rest:.3f}" if saves else "-",
                     f"{rest_no_gc:.3f}" if saves else "-",
                     f"{proc_slow:.3f}" if saves else "-",
                     f"{lost_med:.3f}" if lost_med is not None else "-",
                     ", ".join(f"{x:.2f}" for x in lost) or "-",
                     ", ".join(f"{x:.2f}" for x in noise) or "-"))
    print(columns(("method", "state MB", "saves", "save call s (median)", "run s",
                   "slowdown per save s", "tail s", "per save less the tail s",
                   "and less full GCs s",
                   "process: slowdown per save s",
                   "steps lost per save s (median)", "each", "same steps, no checkpoints"),
                  rows))
    print(f"steps lost: the {args.window} steps from each save's (but the last's) over the same "
          "run's median step away from saves, less the full GCs that ran in them (counted per "
          "run above); 'same steps, no checkpoints': that run's own steps there, likewise (the "
          "noise)")
    for fw in ("lightning", "hf"):
        own = next((o for o in out if o["method"] == f"{fw} own"), None)
        mine = next((o for o in out if o["method"] == f"{fw} mpickpt"), None)
        if own and mine and mine["save_call_s"] > 0:
            print(f"{fw}: mpickpt's save call is {own['save_call_s'] / mine['save_call_s']:.1f}x "
                  f"shorter than the framework's own")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "method"},
                   "device": args.device, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
