"""The node-local level with the state on a GPU (two ranks sharing it, as two simulated nodes):
a lost node comes back from its partner copy bit for bit, and nothing of a damaged step reaches
the state before every rank's vote.

Skipped without a GPU (CI has none); run on a GPU machine: python -m pytest tests/gpu -v
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import SCENARIOS, flip_data_byte, run_mpi

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

JOB = SCENARIOS / "levels.py"
CRASH, LAST = 40, 60  # the step protected before the crash, the end


@pytest.fixture
def shm():
    where = Path(f"/dev/shm/mpickpt-gpu-test-{uuid.uuid4().hex[:8]}")
    yield where
    shutil.rmtree(where, ignore_errors=True)


def job(base: Path, local: Path, name: str, env: dict[str, str] | None = None, n: int = 2,
        **plan: Any) -> tuple[Any, dict[int, dict]]:
    """tests/scenarios/levels.py on ``n`` ranks, one per node, the model on the GPU."""
    out = base / f"out-{name}"
    full = {"root": str(base / "root"), "local": str(local), "steps": LAST, "every": 10,
            "persist_every": 3, "out": str(out), "device": "cuda", "redundancy": "partner",
            "per_node": 1, **plan}
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"plan-{name}.json"
    path.write_text(json.dumps(full))
    done = run_mpi(n, [str(JOB), str(path)], timeout=240, env=env)
    reports = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(n)
               if (out / f"rank-{r}.json").exists()}
    return done, reports


@pytest.mark.quick
@pytest.mark.parametrize("room", ["1", "0"], ids=["gpu-room", "host-memory"])
def test_a_lost_node_on_the_gpu_comes_back_from_its_partner_and_ends_bit_identical(
        tmp_path: Path, shm: Path, room: str) -> None:
    """The lost shard comes through the ring into GPU memory set aside (restore/device_room.py),
    the holder's own shard read into it through page-locked buffers; or with
    MPICKPT_RESTORE_GPU_ROOM=0 through host memory, the holder's own shard used where it lies
    (mapped); bit for bit either way."""
    ref, refs = job(tmp_path / "ref", shm / "ref", "ref")
    assert ref.returncode == 0, ref.output
    crashed, _ = job(tmp_path / "run", shm / "run", "crash", crash_after=CRASH)
    assert crashed.returncode != 0, crashed.output
    shutil.rmtree(shm / "run" / "n1")
    done, reports = job(tmp_path / "run", shm / "run", "resume",
                        env={"MPICKPT_RESTORE_GPU_ROOM": room})
    assert done.returncode == 0, done.output
    restored = [reports[r]["restore"] for r in range(2)]
    assert [r["step"] for r in restored] == [CRASH, CRASH], restored
    assert [r["level"] for r in restored] == ["local", "local"], restored
    assert restored[1]["source"].startswith("partner copy from rank 0"), restored
    assert all(r["exact"] for r in restored), restored
    # the holder's own shard: read into the room, or (room off) verified where it lies
    assert (restored[0]["mapped_bytes"] > 0) == (room == "0"), restored
    # the lost rank's whole model through the ring into the room; of the holder's own, the
    # tensors that lie whole in its shard (its small ones are packed: read into host memory,
    # see the test below); none with the room off
    assert (restored[1]["room_bytes"] >= restored[1]["model_bytes"]) == (room == "1"), restored
    assert all((r["room_bytes"] > 0) == (room == "1") for r in restored), restored
    for r in range(2):
        assert reports[r]["final"] == refs[r]["final"], f"rank {r} did not end bit-identical"


@pytest.mark.quick
@pytest.mark.parametrize("room", ["1", "0"], ids=["gpu-room", "host-memory"])
def test_a_restart_on_the_same_nodes_reads_its_own_shards_into_gpu_room(
        tmp_path: Path, shm: Path, room: str) -> None:
    """Every shard its own rank's, nothing over MPI: each rank's shard is read into GPU memory
    set aside through page-locked buffers and verified there before the vote
    (restore/device_room.py), or with MPICKPT_RESTORE_GPU_ROOM=0 verified where it lies
    (mapped) and taken by the state from host memory after it; bit for bit.
    (Tensors of 512 bytes or more aligned to 512: each model tensor then lies where it can be
    used in place; with the default alignment these small ones are packed and read instead.)"""
    ref, refs = job(tmp_path / "ref", shm / "ref", "ref", alignment=512)
    assert ref.returncode == 0, ref.output
    crashed, _ = job(tmp_path / "run", shm / "run", "crash", crash_after=CRASH, alignment=512)
    assert crashed.returncode != 0, crashed.output
    done, reports = job(tmp_path / "run", shm / "run", "resume",
                        env={"MPICKPT_RESTORE_GPU_ROOM": room}, alignment=512)
    assert done.returncode == 0, done.output
    restored = [reports[r]["restore"] for r in range(2)]
    assert [r["step"] for r in restored] == [CRASH, CRASH], restored
    assert [r["level"] for r in restored] == ["local", "local"], restored
    assert all((r["mapped_bytes"] > 0) == (room == "0") for r in restored), restored
    assert all(r["exact"] for r in restored), restored
    if room == "1":
        assert all(r["room_bytes"] >= r["model_bytes"] > 0 for r in restored), restored
    else:
        assert all(r["room_bytes"] == 0 for r in restored), restored
    for r in range(2):
        assert reports[r]["final"] == refs[r]["final"], f"rank {r} did not end bit-identical"


@pytest.mark.quick
@pytest.mark.parametrize("rounds", ["1", "0"], ids=["rounds-order", "address-order"])
def test_an_xor_team_on_the_gpu_makes_its_parity_from_the_landing_snapshot_and_rebuilds(
        tmp_path: Path, shm: Path, rounds: str) -> None:
    """Three ranks as three nodes, one XOR team: each save's parity goes from the snapshot as
    it lands in host memory, in the order the parity's rounds take it
    (MPICKPT_XOR_LAND_BY_ROUNDS=1: landing.prefer) or in address order; a lost node is rebuilt
    from it into the restore, bit for bit. (Tensors aligned to 512 bytes, so that the small
    model's tensors lie apart: the parity takes them from the snapshot.)"""
    xor = {"redundancy": "xor", "xor_set": 3, "alignment": 512, "n": 3}
    env = {"MPICKPT_XOR_LAND_BY_ROUNDS": rounds}
    ref, refs = job(tmp_path / "ref", shm / "ref", "ref", env, **xor)
    assert ref.returncode == 0, ref.output
    crashed, _ = job(tmp_path / "run", shm / "run", "crash", env, crash_after=CRASH, **xor)
    assert crashed.returncode != 0, crashed.output
    shutil.rmtree(shm / "run" / "n1")
    done, reports = job(tmp_path / "run", shm / "run", "resume", env, **xor)
    assert done.returncode == 0, done.output
    restored = [reports[r]["restore"] for r in range(3)]
    assert [r["step"] for r in restored] == [CRASH] * 3, restored
    assert restored[1]["source"] == "XOR rebuild into the restore", restored
    assert all(r["exact"] for r in restored), restored
    for r in range(3):
        assert reports[r]["final"] == refs[r]["final"], f"rank {r} did not end bit-identical"
        saves = reports[r]["saves"]
        assert saves and all(v["parity_from_snapshot"] == 1.0 for v in saves.values()), saves


def test_a_damaged_step_on_the_gpu_never_reaches_the_state(
        tmp_path: Path, shm: Path) -> None:
    """Rank 0's shard and its partner copy both damaged, nothing in ROOT: the vote fails, and
    the state is still the one the job built (a run from step 0 that ends bit-identical)."""
    ref, refs = job(tmp_path / "ref", shm / "ref", "ref")
    assert ref.returncode == 0, ref.output
    crashed, _ = job(tmp_path / "run", shm / "run", "crash", crash_after=CRASH)
    assert crashed.returncode != 0, crashed.output
    for node in ("n0", "n1"):
        flip_data_byte(shm / "run" / node, CRASH, rank=0)  # a node's directory: ROOT's layout
        for older in (shm / "run" / node).glob("step-*"):  # the damaged step is the only one
            if older.name != f"step-{CRASH:08d}":
                shutil.rmtree(older)
    shutil.rmtree(tmp_path / "run" / "root")
    done, reports = job(tmp_path / "run", shm / "run", "resume")
    assert done.returncode == 0, done.output
    restored = [reports[r]["restore"] for r in range(2)]
    assert [r["step"] for r in restored] == [None, None], restored
    assert any(step == CRASH for step, _ in restored[0]["skipped"]), restored
    assert all(r["exact"] for r in restored), "a failed candidate's bytes reached the state"
    assert "checksum mismatch" in done.output, done.output[-3000:]
    for r in range(2):
        assert reports[r]["final"] == refs[r]["final"], f"rank {r} did not end bit-identical"
