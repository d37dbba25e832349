"""A LoRA-like job saving incremental checkpoints; restore and check, on any number of ranks.

Usage: incremental.py train ROOT REPORTS --steps N [--every E] [--incremental K] [--keep K]
                      [--frozen] [--index auto|inline|per-rank] [--compress CODEC]
                      [--per-node K]
       incremental.py check ROOT REPORTS [--step S | --all]

The state at step ``s`` is a pure function of ``s`` (and of the rank, for per-rank tensors), so a
job that is killed and started again must end with exactly what an uninterrupted one has, and
``check`` can compare any restored checkpoint with what its step should hold:

- ``model/base.weight`` float32 (96, 256) and ``model/base.bias``: frozen, never change;
- ``model/lora.A``, ``model/lora.B``: small, change every step, like ``optim/lora.A.exp_avg``;
- ``embed``: a frozen float32 (40, 300) table sharded by rows (a :class:`mpickpt.Piece`);
- ``head``: a bf16 (12, 64) table sharded by rows that changes every step;
- ``mine``: a per-rank int64 tensor that changes only every 3 steps.

``train`` restores (if there is a checkpoint), then steps to ``--steps``, saving every
``--every`` steps with ``Checkpointer(incremental=K)`` (0: full saves); each rank writes
REPORTS/train-rank-R.json with the restored step and every save's figures. ``check`` restores
into a zeroed state (``--step``: that one; ``--all``: every committed one in turn) and writes
REPORTS/check-rank-R.json: the step, and whether every tensor is what that step should hold.

Run by tests/multirank/test_incremental.py, tests/faults/test_fault_incremental.py,
tests/cli/test_cli_incremental.py and tests/multirank/test_node_files.py (``--per-node``).
"""

from __future__ import annotations

import argparse
import os

import torch
from _report import write_report
from mpi4py import MPI

import mpickpt

BASE, LORA, EMBED, HEAD = (96, 256), (8, 256), (40, 300), (12, 64)


def split(world: int, total: int, rank: int) -> tuple[int, int]:
    return total * rank // world, total * (rank + 1) // world


def value(name: str, shape: tuple[int, ...], step: int, dtype: torch.dtype = torch.float32
          ) -> torch.Tensor:
    """The tensor ``name`` should hold at ``step`` (its whole, for a sharded one)."""
    n = 1
    for d in shape:
        n *= d
    seed = sum(map(ord, name))
    return ((torch.arange(n, dtype=torch.float64) * (seed % 7 + 1) + step * 0.5 + seed)
            .reshape(shape) / 1000).to(dtype)


def make_state(rank: int, world: int, step: int, fill: bool) -> dict:
    e0, e1 = split(world, EMBED[0], rank)
    h0, h1 = split(world, HEAD[0], rank)
    s = step if fill else -1
    zero = (lambda t: t) if fill else torch.zeros_like
    return {
        "model": {
            "base.weight": zero(value("base.weight", BASE, 0)),
            "base.bias": zero(value("base.bias", (BASE[0],), 0)),
            "lora.A": zero(value("lora.A", LORA, s)),
            "lora.B": zero(value("lora.B", LORA[::-1], s)),
        },
        "optim": {"lora.A.exp_avg": zero(value("exp_avg", LORA, s))},
        "embed": mpickpt.Piece(zero(value("embed", EMBED, 0)[e0:e1].clone()), EMBED, (e0, 0)),
        "head": mpickpt.Piece(zero(value("head", HEAD, s, torch.bfloat16)[h0:h1].clone()),
                              HEAD, (h0, 0)),
        "mine": zero(torch.full((16,), (s // 3) * 100 + rank, dtype=torch.int64)),
        "step": step if fill else -1,
    }


def matches(state: dict, expected: dict) -> dict[str, bool]:
    out = {}
    for k in ("model", "optim"):
        for n, t in expected[k].items():
            out[f"{k}/{n}"] = torch.equal(state[k][n], t)
    for k in ("embed", "head"):
        out[k] = torch.equal(state[k].tensor, expected[k].tensor)
    out["mine"] = torch.equal(state["mine"], expected["mine"])
    out["step"] = state["step"] == expected["step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "check"])
    ap.add_argument("root")
    ap.add_argument("reports")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--incremental", type=int, default=4)
    ap.add_argument("--keep", type=int, default=None)
    ap.add_argument("--frozen", action="store_true")
    ap.add_argument("--index", default="auto")
    ap.add_argument("--compress", default=None, help="Encoding(compression=...)")
    ap.add_argument("--per-node", type=int, default=0,
                    help="files='per-node', nodes of this many ranks ($MPICKPT_NODE)")
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    frozen = ["model/base.weight", "model/base.bias", "embed"] if args.frozen else None
    if args.per_node:
        os.environ["MPICKPT_NODE"] = f"n{rank // args.per_node}"
    ck = mpickpt.Checkpointer(args.root, keep=args.keep, on_error="raise",
                              encoding=mpickpt.Encoding(incremental=args.incremental or None,
                                                        frozen=frozen,
                                                        compression=args.compress),
                              files=mpickpt.Files(per="node" if args.per_node else "rank",
                                                  index=args.index, checksum_block=4096,
                                                  alignment=4096))
    report: dict = {"rank": rank, "world": world}
    if args.all:
        steps = comm.bcast(sorted(int(n[5:]) for n in os.listdir(args.root)
                                  if n.startswith("step-") and n[5:].isdigit()))
        report["all"] = {}
        for step in steps:  # each committed step loads exactly what it should hold
            state = make_state(rank, world, 0, fill=False)
            got = ck.restore(state, step=step)
            report["all"][step] = got == step and all(
                matches(state, make_state(rank, world, step, fill=True)).values())
        ck.close()
        write_report(args.reports, f"{args.mode}-rank-{rank}.json", report)
        return
    state = make_state(rank, world, 0, fill=args.mode == "train")
    restored = ck.restore(state, step=args.step)
    info = ck.restore_info
    assert info is not None
    report["restored"] = restored
    report["skipped"] = [list(s) for s in info.skipped]
    if args.mode == "train":
        saves = []
        for step in range((restored or 0) + 1, args.steps + 1):
            state = make_state(rank, world, step, fill=True)  # "training" to step
            if step % args.every == 0:
                r = ck.save(step, state).wait()
                saves.append({"step": step, "committed": r.committed, **{
                    k: r.stats.get(k) for k in ("bytes", "reused_bytes", "hashed_bytes",
                                                "compare_s", "persist_s")}})
        report["saves"] = saves
        report["final"] = all(matches(state, make_state(rank, world, args.steps, True)).values())
    else:
        got = restored if restored is not None else 0
        expected = make_state(rank, world, got, fill=True)
        saved_by = info.world_size or world  # rank r takes stored rank r mod N's own tensors
        expected["mine"] = make_state(rank % saved_by, world, got, fill=True)["mine"]
        report["matches"] = matches(state, expected)
        report["bytes_read"] = info.bytes_read
    ck.close()
    write_report(args.reports, f"{args.mode}-rank-{rank}.json", report)




if __name__ == "__main__":
    main()
