"""A torchtitan-style training loop that checkpoints through DCP's function API, switched to
mpickpt by its import line.

    torchrun --standalone --nproc-per-node 4 examples/torchtitan_style.py --folder /tmp/tt
    mpiexec -n 4 python -m mpickpt.run examples/torchtitan_style.py --folder /tmp/tt

Adapted from the shape of torchtitan's ``CheckpointManager`` (torchtitan/components/checkpoint.py):
the states are ``model``, ``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state``,
each a ``Stateful`` (or a plain state dict); a checkpoint is the folder ``step-N`` under
``--folder``; a save every ``--interval`` steps is an ``async_save`` whose future is waited for
before the next one; rank 0 purges all but the newest ``--keep``; at start the newest committed
step is loaded. The lines that differ from the DCP version are marked ``# mpickpt``: the import,
and the probe for a committed checkpoint (DCP code looks for its ``.metadata`` file).
The data-parallel model averages its gradients with torch.distributed (gloo).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

import mpickpt
import mpickpt.dcp as dcp  # mpickpt: was `import torch.distributed.checkpoint as dcp`

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE = (
    "model", "optimizer", "lr_scheduler", "dataloader", "train_state")


class TrainState:
    """The loop's own counters (torchtitan's TrainState): a Stateful of plain values."""

    def __init__(self) -> None:
        self.step, self.losses = 0, []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": list(self.losses)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.losses = int(sd["step"]), list(sd["losses"])


class DataLoader:
    """A rank's position in its data: a generator's state (a tensor) and a counter."""

    def __init__(self, rank: int) -> None:
        self.gen = torch.Generator().manual_seed(1000 + rank)
        self.batches = 0

    def next(self) -> torch.Tensor:
        self.batches += 1
        return torch.randn(32, 64, generator=self.gen)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.gen.get_state(), "batches": self.batches}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.gen.set_state(sd["rng"])
        self.batches = int(sd["batches"])


class CheckpointManager:
    """torchtitan's checkpoint manager, reduced to its DCP calls."""

    def __init__(self, states: dict[str, Any], folder: str, interval: int, keep: int) -> None:
        self.states, self.folder, self.interval, self.keep = states, folder, interval, keep
        self.future: Future | None = None

    def _id(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def _find_load_step(self) -> int:
        steps = [int(m.group(1)) for f in os.listdir(self.folder)
                 if (m := re.fullmatch(r"step-(\d+)", f))
                 and dcp.committed(os.path.join(self.folder, f))] \
            if os.path.isdir(self.folder) else []  # mpickpt: DCP code probes f/.metadata
        return max(steps, default=-1)

    def load(self) -> int:
        step = self._find_load_step()
        if step >= 0:
            dcp.load(self.states, checkpoint_id=self._id(step))
        return step

    def save(self, step: int, force: bool = False) -> None:
        if not force and step % self.interval:
            return
        if self.future is not None:
            self.future.result()  # the previous async save, before the next one
        self.future = dcp.async_save(self.states, checkpoint_id=self._id(step))
        self._purge(step)

    def _purge(self, step: int) -> None:
        if dist.get_rank() != 0 or not os.path.isdir(self.folder):
            return
        steps = sorted(int(m.group(1)) for f in os.listdir(self.folder)
                       if (m := re.fullmatch(r"step-(\d+)", f)) and int(m.group(1)) < step)
        for s in steps[: max(0, len(steps) - (self.keep - 1))]:
            shutil.rmtree(self._id(s), ignore_errors=True)

    def close(self) -> None:
        if self.future is not None:
            self.future.result()
        dcp.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--out", help="write each rank's final state here (rank-R.pt)")
    args = ap.parse_args()
    if mpickpt.backend() == "mpi" and "RANK" not in os.environ:
        raise SystemExit("under MPI, start it with python -m mpickpt.run (it sets RANK etc.)")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.7)
    data, train_state = DataLoader(rank), TrainState()
    states = {MODEL: model, OPTIMIZER: optim, LR_SCHEDULER: sched, DATALOADER: data,
              TRAIN_STATE: train_state}
    ckpt = CheckpointManager(states, args.folder, args.interval, args.keep)
    start = max(ckpt.load(), 0)
    if rank == 0:
        print(f"training steps {start + 1}..{args.steps} on {world} ranks", flush=True)
    for step in range(start + 1, args.steps + 1):
        x = data.next()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optim.step()
        sched.step()
        train_state.step = step
        train_state.losses.append(loss.item())
        ckpt.save(step, force=step == args.steps)
    ckpt.close()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(),
                    "losses": train_state.losses, "batches": data.batches},
                   os.path.join(args.out, f"rank-{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
