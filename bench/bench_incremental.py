"""Incremental checkpoints against full ones, torch.save and DCP, on a real LoRA and a real full
fine-tune of one GPT-2 built from a config (no downloaded weights).

Each run trains on a synthetic Markov language (bench_codecs.py's) and checkpoints every
``--every`` steps, ``--rounds`` times; at each checkpoint every method saves the same state, one
after the other, in an order that rotates each round:

  torch.save+fsync          torch.save of the state dicts, then fsync of the file
  dcp.save                  torch.distributed.checkpoint.save, one process, no process group
  mpickpt full              Checkpointer(): every tensor written
  mpickpt incremental       Encoding(incremental=1000): unchanged tensors referred to
  mpickpt inc.+frozen       the same with frozen=mpickpt.frozen_params(model) (LoRA only)
  mpickpt zstd[+shuffle]    Encoding(compression=...) (full fine-tune only: --codecs)

Per method: bytes written per checkpoint (the new files), the time until the checkpoint is durable
(``save().wait()`` for mpickpt), the training thread's stall (``save()`` returning), and, after
the last round, the time to restore the last checkpoint into a fresh copy of the state. The first
checkpoint of an incremental method has nothing to refer to and is full: the figures are the
medians of the later rounds (the first is in the JSON).

Goals (issue 15): LoRA with about 1% trainable parameters: bytes ≤ 3% of a full checkpoint and
save time ≥ 10x shorter; full fine-tune: the dedup check costs ≤ 2% of the save time.

    python bench/bench_incremental.py                    # ~5 minutes on 2 cores
    python bench/bench_incremental.py --layers 4 --width 384 --rounds 3   # a quick look

Needs ``pip install '.[bench-codecs]'`` (transformers, peft).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_codecs import gpt, markov_batches, train
from bench_cpu import columns, du, machine_info

import mpickpt


class Method:
    """One way of saving the state: ``save(i)`` returns (stall s, durable s, bytes written)."""

    name = ""

    def __init__(self, work: str) -> None:
        self.work = work
        os.makedirs(work, exist_ok=True)

    def save(self, i: int, model: torch.nn.Module, opt: torch.optim.Optimizer
             ) -> tuple[float, float, int]:
        raise NotImplementedError

    def restore(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TorchSave(Method):
    name = "torch.save+fsync"

    def save(self, i, model, opt):
        path = os.path.join(self.work, f"step-{i}.pt")
        t = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        s = time.perf_counter() - t
        self.last = path
        for old in os.listdir(self.work):  # keep one, as keep=1 would
            if old != os.path.basename(path):
                os.unlink(os.path.join(self.work, old))
        return s, s, os.path.getsize(path)

    def restore(self, model, opt):
        sd = torch.load(self.last, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])


class DCP(Method):
    name = "dcp.save"

    def __init__(self, work: str) -> None:
        super().__init__(work)
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp

    def save(self, i, model, opt):
        path = os.path.join(self.work, f"step-{i}")
        t = time.perf_counter()
        self.dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                      checkpoint_id=path)
        s = time.perf_counter() - t
        if getattr(self, "last", None):
            shutil.rmtree(self.last)
        self.last = path
        return s, s, du(path)

    def restore(self, model, opt):
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        self.dcp.load(sd, checkpoint_id=self.last)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])


class Mpickpt(Method):
    def __init__(self, work: str, name: str, **options: Any) -> None:
        super().__init__(work)
        self.name, self.options = name, options
        self.ck = mpickpt.Checkpointer(work, keep=1, **options)

    def save(self, i, model, opt):
        t = time.perf_counter()
        h = self.ck.save(i, {"model": model, "optim": opt})
        stall = time.perf_counter() - t
        r = h.wait()
        durable = time.perf_counter() - t
        assert r.committed, r.error
        return stall, durable, int(r.stats["bytes"])

    def restore(self, model, opt):
        with mpickpt.Checkpointer(self.work, keep=1) as ck:
            assert ck.restore({"model": model, "optim": opt}) is not None

    def close(self) -> None:
        self.ck.close()


def run(label: str, make: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
        draw: Callable[[], torch.Tensor], args: argparse.Namespace, work: str,
        lora: bool) -> dict[str, Any]:
    model, opt = make()
    train(model, opt, draw, 1)  # the optimizer's state exists
    methods: list[Method] = [
        TorchSave(os.path.join(work, "torch")), DCP(os.path.join(work, "dcp")),
        Mpickpt(os.path.join(work, "full"), "mpickpt full"),
        Mpickpt(os.path.join(work, "inc"), "mpickpt incremental",
                encoding=mpickpt.Encoding(incremental=1000))]
    if lora:
        methods.append(Mpickpt(os.path.join(work, "frozen"), "mpickpt inc.+frozen",
                               encoding=mpickpt.Encoding(
                                   incremental=1000, frozen=mpickpt.frozen_params(model))))
    else:  # compression's effect on a trained state: persist and restore time, bytes
        methods += [Mpickpt(os.path.join(work, c), f"mpickpt {c}",
                            encoding=mpickpt.Encoding(compression=c))
                    for c in args.codecs.split(",") if c]
    rounds: dict[str, list[dict[str, float]]] = {m.name: [] for m in methods}
    for i in range(args.rounds):
        train(model, opt, draw, args.every)
        order = methods[i % len(methods):] + methods[:i % len(methods)]
        for m in order:
            stall, durable, nbytes = m.save(i, model, opt)
            rounds[m.name].append({"stall_s": stall, "durable_s": durable, "bytes": nbytes})
        print(f"{label}: round {i + 1}/{args.rounds} saved", flush=True)
    restore_s = {}
    for m in methods:
        fresh, fopt = make()
        train(fresh, fopt, draw, 1)
        t = time.perf_counter()
        m.restore(fresh, fopt)
        restore_s[m.name] = time.perf_counter() - t
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                     model.state_dict().values(), strict=True))
        m.close()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"trainable_share": trainable / total, "rounds": rounds,
                           "restore_s": restore_s, "methods": {}}
    full = _median(rounds["mpickpt full"][1:])
    for m in methods:
        med = _median(rounds[m.name][1:])
        out["methods"][m.name] = {
            **med, "restore_s": restore_s[m.name],
            "bytes_vs_full": med["bytes"] / full["bytes"],
            "durable_vs_full": med["durable_s"] / full["durable_s"]}
    return out


def _median(rs: list[dict[str, float]]) -> dict[str, float]:
    return {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--every", type=int, default=5, help="training steps between checkpoints")
    ap.add_argument("--rounds", type=int, default=5, help="checkpoints per method and run")
    ap.add_argument("--lora-r", type=int, default=32, help="LoRA rank on c_attn (~1%% trainable)")
    ap.add_argument("--codecs", default="zstd,zstd+shuffle",
                    help="compressed mpickpt rows of the full fine-tune (empty: none)")
    ap.add_argument("--dir", help="where to write (default: a temp dir under /tmp, removed after)")
    ap.add_argument("--json", default="bench/results-vm/incremental.json")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first incremental checkpoint is full)")
    work = args.dir or tempfile.mkdtemp(prefix="mpickpt-inc-")
    draw = markov_batches(args.vocab, args.batch, args.seq)
    res: dict[str, Any] = {"args": vars(args), "machine": machine_info(work)}

    def full_ft() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m = gpt(args.layers, args.width, args.vocab, args.seq)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    def lora() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        from peft import LoraConfig, get_peft_model

        m = get_peft_model(gpt(args.layers, args.width, args.vocab, args.seq),
                           LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                      target_modules=["c_attn"], fan_in_fan_out=True))
        return m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)

    try:
        res["lora"] = run("LoRA", lora, draw, args, os.path.join(work, "lora"), lora=True)
        res["full"] = run("full fine-tune", full_ft, draw, args, os.path.join(work, "full"),
                          lora=False)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    for key, title in (("lora", f"LoRA ({res['lora']['trainable_share']:.2%} trainable)"),
                       ("full", "full fine-tune")):
        print(f"\n{title}: a checkpoint every {args.every} steps, median of rounds 2..."
              f"{args.rounds}")
        rows = [(name, f"{m['bytes'] / 1e6:.1f}", f"{m['bytes_vs_full']:.2%}",
                 f"{m['durable_s']:.3f}", f"{1 / m['durable_vs_full']:.2f}x",
                 f"{m['stall_s']:.3f}", f"{m['restore_s']:.3f}")
                for name, m in res[key]["methods"].items()]
        print(columns(("method", "MB written", "vs mpickpt full", "save s (durable)",
                       "faster than full", "stall s", "restore s"), rows))
    lo, fu = res["lora"]["methods"], res["full"]["methods"]
    inc = "mpickpt inc.+frozen" if "mpickpt inc.+frozen" in lo else "mpickpt incremental"
    res["goals"] = {
        "lora_bytes_share": lo["mpickpt incremental"]["bytes_vs_full"],
        "lora_save_speedup": 1 / lo["mpickpt incremental"]["durable_vs_full"],
        "lora_frozen_save_speedup": 1 / lo[inc]["durable_vs_full"],
        "full_dedup_overhead": fu["mpickpt incremental"]["durable_vs_full"] - 1,
    }
    g = res["goals"]
    print(f"\ngoals: LoRA bytes {g['lora_bytes_share']:.2%} of full (<= 3%), save "
          f"{g['lora_save_speedup']:.1f}x shorter ({g['lora_frozen_save_speedup']:.1f}x with "
          f"frozen=) (>= 10x); full fine-tune dedup overhead {g['full_dedup_overhead']:+.1%} "
          "(<= 2%)")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
