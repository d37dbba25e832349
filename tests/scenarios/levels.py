"""A training job with the node-local level, for the multi-level tests.

Usage (under mpiexec): ``levels.py PLAN.json``. PLAN keys:

* ``root``, ``local``: the directories; ``per_node``: ranks per simulated node (rank r runs on
  node ``n{r // per_node}``, through ``$MPICKPT_NODE``); ``redundancy``, ``persist_every``,
  ``keep_local``, ``local_budget``, ``xor_set``: the Checkpointer's ``Local(...)`` settings;
* ``steps``: train up to this step; ``every``: save every that many steps;
* ``crash_after``: after the save of this step is protected, every rank SIGKILLs itself (the
  drain that would follow never runs; node loss is the test's wiping of a node's directory);
* ``out``: every rank writes ``out/rank-R.json``: the restore (step, level, source, bytes over the
  network and from ROOT, skipped, whether the state is bit for bit the one trained to that
  step), the saves' results, and the final state's digest;
* ``fault``: an ``MPICKPT_FAULT`` spec armed once the Checkpointer exists (before the restore);
* ``damage_pool``: after the save of this step, each node's lowest rank writes garbage over every
  file in its node's ``.pool`` (the retired files the next save writes over) and cuts them short
  (not with ``damage_cut`` false);
* ``window``: the bytes the redundancy exchange moves at a time (default 32 MiB: one window
  for this small state; a few KiB make many, in flight two at a time);
* ``replicated``: the model is the same on every rank (as under DDP) and saved with
  ``replicated=("model",)``: each rank writes a share of it (``Files(min_write_share=0)``), and a
  restore from the local level needs the shares of other nodes' ranks; ``"fewest"``: the default
  share, the last rank writes all of this small model and the others a shard of no tensor;
* ``device``: where the model's tensors live (default ``cpu``; ``cuda``: on the GPU);
* ``alignment``: tensors of that many bytes and more start on that boundary (a smaller one
  than the default leaves padding after the tensors of this small state);
* ``room``: checksum blocks and tensor alignment of that many bytes, and a restore whose
  bytes move over MPI goes the way it goes for a state on a GPU with room
  (``restore/device_room.py``, ``local/ring.py``), in host memory: the room set aside is CPU
  memory, and the ring's slots hold two blocks, so that the small state moves in many groups
  and every slot is used again;
* ``verify``: restore only, then check ROOT alone: a Checkpointer without the local level
  restores every step committed in ROOT explicitly; each must be bit for bit the state trained
  to that step (``root_steps`` in the report).

The state of a rank is a pure function of (rank, step) through a deterministic training step,
so a resumed run that restored bit for bit ends with the digest of an uninterrupted one.

Run by tests/multirank/test_levels.py, tests/matrix/test_level_matrix.py,
tests/cli/test_cli_levels.py, tests/test_permissions.py and tests/gpu/test_cuda_levels.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from typing import Any

import torch
from _report import write_report
from mpi4py import MPI

import mpickpt
from mpickpt import faults
from mpickpt.format import rootdir
from mpickpt.local import exchange, ring
from mpickpt.restore import device_room, restorer

NAMES = ("w1", "w2", "b")


REPLICATED = False  # the plan's "replicated": the model is the same on every rank
DEVICE = "cpu"  # the plan's "device": where the model's tensors live


def initial(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + (0 if REPLICATED else rank))
    model = {"w1": torch.randn(96, 128, generator=g),
             "w2": torch.randn(64, 64, generator=g, dtype=torch.float64),
             "b": torch.randn(333, generator=g).to(torch.bfloat16)}
    return {"model": {k: v.to(DEVICE) for k, v in model.items()},
            "opt": {"count": torch.zeros((), dtype=torch.int64)}, "epoch": 0}


def train_step(state: dict[str, Any], rank: int, step: int) -> None:
    """One deterministic step: every value depends on the whole history."""
    g = torch.Generator().manual_seed(7919 * ((0 if REPLICATED else rank) + 1) + step)
    for name in NAMES:
        t = state["model"][name]
        t.mul_(0.5).add_(torch.randn(t.shape, generator=g).to(t.dtype).to(t.device))
    state["opt"]["count"] += step
    state["epoch"] = step // 7


def digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name in NAMES:
        h.update(state["model"][name].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    h.update(state["opt"]["count"].numpy().tobytes())
    h.update(str(state["epoch"]).encode())
    return h.hexdigest()


def trained(rank: int, step: int) -> dict[str, Any]:
    """The state of ``rank`` after ``step`` steps of an uninterrupted run."""
    state = initial(rank)
    for s in range(1, step + 1):
        train_step(state, rank, s)
    return state


def check_root(plan: dict[str, Any], rank: int) -> dict[str, bool]:
    """Every step committed in ROOT, restored from ROOT alone: bit for bit the trained state?"""
    ck = mpickpt.Checkpointer(plan["root"], timeout=plan.get("timeout", 60),
                              replicated=("model",) if REPLICATED else (), files=files_of(plan))
    out = {}
    for step, _ in rootdir.committed(plan["root"]):
        state = initial(rank)
        got = ck.restore(state, step=step)
        out[str(step)] = got == step and digest(state) == digest(trained(rank, step))
    ck.close()
    return out


def files_of(plan: dict[str, Any]) -> mpickpt.Files:
    """The plan's file layout: its ``room`` or ``alignment``, and the replicated model's share."""
    kw: dict[str, int] = {}
    if plan.get("replicated") is True:
        kw["min_write_share"] = 0
    if plan.get("room"):
        kw.update(checksum_block=plan["room"], alignment=plan["room"])
    elif plan.get("alignment"):
        kw["alignment"] = plan["alignment"]
    return mpickpt.Files(**kw)


def _node_listing(local: str, node: str) -> dict[str, list[str]]:
    """{entry of LOCAL/<node>/: its files} (a directory's), or {} when there is none."""
    top = os.path.join(local, node)
    if not os.path.isdir(top):
        return {}
    return {name: sorted(os.listdir(os.path.join(top, name)))
            if os.path.isdir(os.path.join(top, name)) else [] for name in os.listdir(top)}


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    comm = MPI.COMM_WORLD
    rank = comm.rank
    global REPLICATED, DEVICE
    REPLICATED = bool(plan.get("replicated"))
    DEVICE = plan.get("device", "cpu")
    os.environ["MPICKPT_NODE"] = f"n{rank // plan.get('per_node', 1)}"
    if plan.get("window"):
        exchange.WINDOW = plan["window"]
    if plan.get("room"):
        _host_room(plan["room"])
    report: dict[str, Any] = {"rank": rank, "saves": {}}
    ck = mpickpt.Checkpointer(
        plan["root"], keep=plan.get("keep"), timeout=plan.get("timeout", 60),
        local=mpickpt.Local(plan["local"], redundancy=plan.get("redundancy"),
                            persist_every=plan.get("persist_every"),
                            keep=plan.get("keep_local", 1), budget=plan.get("local_budget"),
                            xor_set=plan.get("xor_set")),
        replicated=("model",) if REPLICATED else (), files=files_of(plan))
    faults.configure(plan.get("fault", ""))
    state = initial(rank)
    start = ck.restore(state) or 0
    info = ck.restore_info
    assert info is not None
    report["restore"] = {
        "step": info.step, "level": info.level, "source": info.source,
        "network_bytes": info.network_bytes, "total_network_bytes": info.total_network_bytes,
        "root_bytes": info.root_bytes, "skipped": info.skipped, "digest": digest(state),
        "fetched_bytes": info.fetched_bytes, "mapped_bytes": info.mapped_bytes,
        "bytes_read": info.bytes_read, "room_bytes": info.room_bytes,
        "model_bytes": sum(t.nbytes for t in state["model"].values()),
        "exact": digest(state) == digest(trained(rank, start))}
    ck.wait()  # a lost node's shards, loaded from their copies, are written back behind it
    # this rank's node directory once the restore's write-back is done (a rebuilt node: whole)
    report["restore"]["node_dir"] = _node_listing(plan["local"], os.environ["MPICKPT_NODE"])
    if plan.get("verify"):
        ck.close()
        report["root_steps"] = check_root(plan, rank)
        _write(plan, rank, report)
        return
    every = plan.get("every", 10)
    for step in range(start + 1, plan["steps"] + 1):
        train_step(state, rank, step)
        if step % every == 0:
            try:
                result = ck.save(step, state).wait()
                report["saves"][step] = {"committed": result.committed, "level": result.level,
                                         "error": result.error, "parity_from_snapshot":
                                         result.stats.get("parity_from_snapshot")}
            except Exception as e:
                report["saves"][step] = {"raised": f"{type(e).__name__}: {e}"}
            if plan.get("damage_pool") == step:
                # while no rank is in a save: every one has retired its files into the pool,
                # and none writes into a recycled one (or keeps it mapped as it is cut short)
                # before the damage is done
                comm.Barrier()
                if rank % plan.get("per_node", 1) == 0:
                    _damage_pool(os.path.join(plan["local"], os.environ["MPICKPT_NODE"],
                                              ".pool"), plan.get("damage_cut", True))
                comm.Barrier()
            if plan.get("crash_after") == step:
                _write(plan, rank, report)
                comm.Barrier()
                os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
    report["final"] = digest(state)
    report["drained"] = ck.drained
    _write(plan, rank, report)


def _host_room(block: int) -> None:
    """The plan's ``room``: restore/device_room.py's room taken in host memory (CPU tensors),
    and the ring's slots two checksum blocks of ``block`` bytes."""
    class HostRoom(device_room.DeviceRoom):
        @classmethod
        def find(cls, devices: Any, fetched: Any) -> device_room.DeviceRoom:
            return cls(torch.device("cpu"), fetched)

        def buffers(self, sizes: list[int]) -> list[torch.Tensor]:
            self.held += [torch.empty(n, dtype=torch.uint8) for n in sizes]
            return self.held[-len(sizes):]

    restorer.DeviceRoom = HostRoom  # type: ignore[misc]
    ring.SLOT = 2 * block


def _damage_pool(pool: str, cut: bool) -> None:
    """Garbage over every retired file of the node, and (``cut``) the file cut to a third."""
    names = sorted(os.listdir(pool))
    assert names, f"nothing in {pool} to damage"
    for name in names:
        path = os.path.join(pool, name)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(os.urandom(size))
        if cut:
            os.truncate(path, size // 3)


def _write(plan: dict[str, Any], rank: int, report: dict[str, Any]) -> None:
    if plan.get("out"):
        write_report(plan["out"], f"rank-{rank}.json", report)


if __name__ == "__main__":
    main()
