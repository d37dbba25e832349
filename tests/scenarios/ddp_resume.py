"""DDP (gloo on CPU) training that resumes from its newest checkpoint, run under
``mpiexec -n N python -m mpickpt.run ddp_resume.py --root ROOT --out OUT --steps S --every K``.

Restores the newest committed checkpoint under ROOT when there is one (else starts at step 0),
trains to step S saving ``{"model", "optim", "step"}`` every K steps (``replicated=("model",
"optim")``, the state from ``get_state_dict`` as in ddp_train.py, whose :func:`ddp` builds DDP),
then writes on every rank:

* ``OUT/rank-R.pt``: its final ``{"model": ..., "optim": ...}`` as ``get_state_dict`` gives them;
* ``OUT/rank-R.json``: ``start`` (the step it resumed from), ``losses`` (the global loss of each
  step it ran), ``buckets`` (DDP's bucket layout, the parameter names of each gradient bucket, when
  built and after each step), ``find_unused_parameters`` and ``step_s`` (seconds per training
  step, saves left out).

``--plain``: DDP as most scripts build it (``find_unused_parameters=False``, its buckets rebuilt
after the first iteration); with ``--prime`` a resumed run calls ``mpickpt.prime_ddp`` after its
restore.

The model has about 0.8 M parameters (3.3 MB); with ``bucket_cap_mb=1`` DDP reduces them in
several buckets, as it would a large model with its default 25 MB buckets.

Run by tests/multirank/test_ddp.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
from ddp_train import ddp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

import mpickpt

GLOBAL_BATCH = 32  # split evenly over 1, 2 or 4 ranks
WIDTHS = (64, 512, 512, 512, 512, 1)
BUCKET_CAP_MB = 1


def mlp() -> torch.nn.Sequential:
    """The model, with the same initial weights on every rank."""
    torch.manual_seed(4321)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step`` (the same on every run)."""
    g = torch.Generator().manual_seed(20_000 + step)
    x = torch.randn(GLOBAL_BATCH, WIDTHS[0], generator=g)
    y = torch.sin(x[:, :8].sum(dim=1, keepdim=True))
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def bucket_layout(model: DistributedDataParallel) -> list[list[str]]:
    """The names of the parameters of each of DDP's gradient buckets, in the order it holds them."""
    names = {id(p): n for n, p in model.module.named_parameters()}
    return [[names[id(p)] for p in b.parameters()]
            for b in model.reducer._get_zeros_like_grad_buckets()]


def adam_state(optim: torch.optim.Adam) -> None:
    """Give every parameter the state Adam's first step would create (step 0, zero moments), so
    that get_state_dict has tensors to restore into without the lr-0 step it would take to make
    them (which would count as a step in a run that then finds no checkpoint)."""
    for group in optim.param_groups:
        for p in group["params"]:
            optim.state[p] = {"step": torch.tensor(0.0),
                              "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                              "exp_avg_sq": torch.zeros_like(p,
                                                             memory_format=torch.preserve_format)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--prime", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = (DistributedDataParallel(mlp(), bucket_cap_mb=BUCKET_CAP_MB) if args.plain
             else ddp(mlp(), bucket_cap_mb=BUCKET_CAP_MB))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    adam_state(optim)
    ck = mpickpt.Checkpointer(args.root, replicated=("model", "optim"))
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": 0}
    start = ck.restore(state) or 0
    if start:
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if args.prime:  # any batch of the right shape: the order gradients get ready counts
            x0, y0 = batch(0, rank, world)
            mpickpt.prime_ddp(
                model, lambda m: torch.nn.functional.mse_loss(m(x0), y0).backward())
    buckets = {"built": bucket_layout(model)}
    losses: dict[int, float] = {}
    step_s: list[float] = []
    for step in range(start + 1, args.steps + 1):
        t = time.perf_counter()
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[step] = total.item() / world
        step_s.append(time.perf_counter() - t)
        buckets[str(step)] = bucket_layout(model)
        if step % args.every == 0:
            msd, osd = get_state_dict(model, optim)
            ck.save(step, {"model": msd, "optim": osd, "step": step}).wait()
    ck.close()
    msd, osd = get_state_dict(model, optim)
    dist.destroy_process_group()
    os.makedirs(args.out, exist_ok=True)
    torch.save({"model": msd, "optim": osd}, os.path.join(args.out, f"rank-{rank}.pt"))
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump({"start": start, "losses": {str(k): v for k, v in losses.items()},
                   "buckets": buckets, "find_unused_parameters": model.find_unused_parameters,
                   "step_s": step_s}, f)


if __name__ == "__main__":
    main()
