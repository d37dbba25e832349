"""FSDP2 (``fully_shard``) training on CPU with gloo, checkpointed with mpickpt; run under
``mpiexec -n N python -m mpickpt.run fsdp_train.py MODE ...``.

The state is obtained the way PyTorch recommends for distributed models,
``torch.distributed.checkpoint.state_dict.get_state_dict`` (model and optimizer state as DTensor
shards, the optimizer's keyed by parameter name) and put back with ``set_state_dict``.

Every step trains on a fixed global batch (drawn from a generator seeded by the step) split evenly
over the ranks, so runs on 1, 2 or 4 ranks do the same math up to the order of float reductions.

Modes:

* ``train --steps A --save-at S``: train A steps from scratch; after step S save
  ``{"model", "optim", "step"}`` with mpickpt and write the full tensors of every parameter and
  optimizer state value (``DTensor.full_tensor()``) to ``OUT/reference.pt`` (rank 0).
* ``resume --steps A``: build the model on this number of ranks, restore the newest checkpoint,
  write ``OUT/restored.json`` (which tensors equal the reference bit for bit) and train on to A.

Both write the global loss of each step they ran to ``OUT/<mode>-losses.json`` (rank 0) and the
time spent to ``OUT/<mode>-timing.json``.

Run by tests/multirank/test_fsdp.py. ddp_train.py shares its training loop.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import mpickpt

GLOBAL_BATCH = 32  # divisible by 1, 2 and 4
# Odd widths so the shards are uneven (30 rows over 4 ranks: 8, 8, 8, 6; 1 row: 1, 0, 0, 0).
SIZES = (12, 30, 22, 1)


def mlp() -> torch.nn.Sequential:
    """The model, with the same initial weights on every rank and every number of ranks."""
    torch.manual_seed(1234)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def wrap_fsdp(model: torch.nn.Sequential, world: int) -> torch.nn.Module:
    """FSDP2: each Linear and the root sharded over all ranks."""
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(GLOBAL_BATCH, SIZES[0], generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(GLOBAL_BATCH, 1, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, rank: int,
               world: int) -> float:
    """One step; returns the loss over the global batch (the mean of the ranks' means)."""
    x, y = batch(step, rank, world)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # FSDP2 and DDP average the gradients over the ranks
    optim.step()
    optim.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Every parameter and optimizer state value as full tensors, keyed by parameter name
    (collective: every rank must call it)."""
    msd, osd = get_state_dict(model, optim)

    def full(v: object) -> object:
        if isinstance(v, DTensor):
            return v.full_tensor()
        return v.clone() if isinstance(v, torch.Tensor) else v

    return {"model": {k: full(v) for k, v in msd.items()},
            "optim": {k: {n: full(v) for n, v in st.items()} for k, st in osd["state"].items()}}


def compare(got: dict, ref: dict) -> dict[str, bool]:
    """name -> whether the restored tensor equals the reference bit for bit (and in dtype)."""
    out: dict[str, bool] = {}
    for k, v in ref["model"].items():
        g = got["model"].get(k)
        out[f"model/{k}"] = g is not None and g.dtype == v.dtype and torch.equal(g, v)
    for k, st in ref["optim"].items():
        for n, v in st.items():
            g = got["optim"].get(k, {}).get(n)
            out[f"optim/{k}/{n}"] = (isinstance(g, torch.Tensor) and g.dtype == v.dtype
                                     and torch.equal(g, v))
    return out


def main(wrap: Callable[[torch.nn.Sequential, int], torch.nn.Module] = wrap_fsdp,
         replicated: tuple[str, ...] = ()) -> None:
    """Parse the command line and run; ``wrap`` parallelizes the model, ``replicated`` is passed
    to the Checkpointer."""
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume"])
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-at", type=int, default=None)
    args = ap.parse_args()
    t0 = time.monotonic()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = wrap(mlp(), world)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ck = mpickpt.Checkpointer(args.root, replicated=replicated)
    os.makedirs(args.out, exist_ok=True)
    timing: dict[str, float] = {"setup": time.monotonic() - t0}
    start = 0
    if args.mode == "resume":
        t = time.monotonic()
        msd, osd = get_state_dict(model, optim)  # initializes the optimizer state (lr 0 step)
        if not osd["state"]:
            raise RuntimeError("get_state_dict gave no optimizer state to restore into")
        state = {"model": msd, "optim": osd, "step": 0}
        restored = ck.restore(state)
        if restored is None:
            raise RuntimeError(f"no checkpoint under {args.root}")
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = state["step"]
        timing["restore"] = time.monotonic() - t
        info = ck.restore_info
        assert info is not None
        ref = torch.load(os.path.join(args.out, "reference.pt"), weights_only=True)
        same = compare(full_state(model, optim), ref)
        if rank == 0:
            with open(os.path.join(args.out, f"restored-{world}.json"), "w") as f:
                json.dump({"step": start, "restored": restored, "saved_by": info.world_size,
                           "same": same}, f)
        with open(os.path.join(args.out, f"bytes-{world}-rank-{rank}.json"), "w") as f:
            json.dump({"bytes_read": info.bytes_read}, f)
    losses: dict[int, float] = {}
    t = time.monotonic()
    for step in range(start + 1, args.steps + 1):
        losses[step] = train_step(model, optim, step, rank, world)
        if step == args.save_at:
            msd, osd = get_state_dict(model, optim)
            ts = time.monotonic()
            ck.save(step, {"model": msd, "optim": osd, "step": step}).wait()
            timing["save"] = time.monotonic() - ts
            ref = full_state(model, optim)
            if rank == 0:
                torch.save(ref, os.path.join(args.out, "reference.pt"))
    timing["train"] = time.monotonic() - t
    ck.close()
    dist.destroy_process_group()
    timing["total"] = time.monotonic() - t0
    if rank == 0:
        name = f"{args.mode}-{world}" if args.mode == "resume" else args.mode
        with open(os.path.join(args.out, f"{name}-losses.json"), "w") as f:
            json.dump({str(k): v for k, v in losses.items()}, f)
        with open(os.path.join(args.out, f"{name}-timing.json"), "w") as f:
            json.dump(timing, f)


if __name__ == "__main__":
    main()
