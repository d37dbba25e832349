"""A small deterministic multi-rank training job that checkpoints with mpickpt.

Run it under MPI:  mpiexec -n 4 python examples/train.py --root /tmp/run --steps 40 --every 5
or under torchrun: torchrun --standalone --nproc-per-node 4 examples/train.py --root /tmp/run
(gradients averaged over torch.distributed's gloo, mpickpt's protocol over gloo groups of its own)

Each rank trains its own MLP (with dropout, Adam and a step LR schedule) on batches drawn from a
per-rank generator, and averages its gradients with the other ranks, so the job is deterministic:
an interrupted and resumed run ends bit-identical to an uninterrupted one. ``--out DIR`` writes each
rank's final parameters and optimizer state to DIR/rank-R.pt for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np
import torch

import mpickpt


def make_state(rank: int, width: int) -> dict:
    torch.manual_seed(1234 + rank)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1),
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=10, gamma=0.5)
    return {
        "model": model, "optim": optim, "sched": sched,
        "data": torch.Generator().manual_seed(99 + rank),  # the data loader's position
        "rng": mpickpt.RNGState(),  # dropout draws from the global torch RNG
        "losses": np.zeros(0),
    }


class World:
    """The job's ranks and a sum over them: MPI under mpiexec or srun (or ``comm``, an mpi4py
    communicator), torch.distributed's gloo under torchrun (``mpickpt.backend()`` says which)."""

    def __init__(self, comm: Any = None) -> None:
        if comm is not None or mpickpt.backend() == "mpi":
            from mpi4py import MPI

            comm = comm if comm is not None else MPI.COMM_WORLD
            self.rank, self.size = comm.rank, comm.size
            self.sum = lambda a: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
        else:
            import torch.distributed as dist

            dist.init_process_group("gloo")
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self.sum = lambda a: dist.all_reduce(torch.from_numpy(a))


def train_step(state: dict, comm: Any) -> float:
    """One step; ``comm`` is a :class:`World`, or an mpi4py communicator."""
    if not isinstance(comm, World):
        comm = World(comm)
    x = torch.randn(64, 32, generator=state["data"])
    y = x.sum(dim=1, keepdim=True).sin()
    loss = torch.nn.functional.mse_loss(state["model"](x), y)
    state["optim"].zero_grad()
    loss.backward()
    for p in state["model"].parameters():  # data parallel: average gradients over the ranks
        g = p.grad.numpy()
        comm.sum(g)
        g /= comm.size
    state["optim"].step()
    state["sched"].step()
    state["losses"] = np.append(state["losses"], loss.item())
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="checkpoint directory")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--no-checkpoint", action="store_true", help="train without checkpoints")
    ap.add_argument("--out", help="write final state per rank here")
    ap.add_argument("--local", default=os.environ.get("MPICKPT_LOCAL") or None, metavar="DIR",
                    help="the node-local level: every save commits here first, on each node "
                         "(default: $MPICKPT_LOCAL, which slurm/train.sbatch sets; none)")
    ap.add_argument("--redundancy", choices=["partner", "xor", "none"], default="none",
                    help="protects the local level from the loss of a node (more than one "
                         "node only; default none)")
    ap.add_argument("--persist-every", type=int, default=10, metavar="K",
                    help="with --local: drain every K-th save to ROOT (0: only the emergency "
                         "save and the newest at the end; default 10)")
    ap.add_argument("--index", choices=["auto", "inline", "per-rank"], default="auto",
                    help="where the ranks' tensor records go: the manifest, or an index part "
                         "per rank (auto: per rank above 64 ranks)")
    ap.add_argument("--files", choices=["per-rank", "per-node"], default="per-rank",
                    help="one shard per rank, or one per node (parallel file systems)")
    ap.add_argument("--fanout", type=int, default=1024, metavar="N",
                    help="at most N shards per directory; more go into sub-directories")
    args = ap.parse_args()

    comm = World()
    state = make_state(comm.rank, args.width)
    start = 0
    ckpt = None
    if not args.no_checkpoint:
        redundancy = None if args.redundancy == "none" else args.redundancy
        if redundancy and not args.local:
            raise SystemExit("--redundancy protects the node-local level: give --local too")
        local = mpickpt.Local(args.local, redundancy=redundancy,
                              persist_every=args.persist_every or None) if args.local else None
        files = mpickpt.Files(per=args.files[len("per-"):], fanout=args.fanout, index=args.index)
        ckpt = mpickpt.Checkpointer(args.root, keep=args.keep, local=local, files=files)
        restored = ckpt.restore(state)  # the number of steps the checkpoint holds, or None
        start = restored or 0
        ckpt.prepare(state)  # the snapshot buffers now, not in the first save's steps
    if comm.rank == 0:
        print(f"training steps {start + 1}..{args.steps} on {comm.size} ranks", flush=True)
    for step in range(start, args.steps):
        loss = train_step(state, comm)
        done = step + 1  # steps completed: the number save() stores and restore() returns
        if ckpt is not None and done % args.every == 0:
            ckpt.save(done, state, metadata={"loss": loss})
        if ckpt is not None:
            # on SIGUSR2/SIGTERM on any rank: all ranks checkpoint this step and exit with code 3
            ckpt.should_exit(done, state)
    if ckpt is not None:
        ckpt.close()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        final = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}
        torch.save(final, os.path.join(args.out, f"rank-{comm.rank}.pt"))
        with open(os.path.join(args.out, f"rank-{comm.rank}.json"), "w") as f:
            json.dump({"start": start, "losses": state["losses"].tolist()}, f)


if __name__ == "__main__":
    main()
