"""Incremental checkpoints under faults: a SIGKILL in every phase of an incremental save and of
the retention after it, and damage to an older shard that later checkpoints refer to.

The job (tests/scenarios/incremental.py, 2 ranks, ``incremental=4``, ``keep=2``) saves every
step to 8; step 6 refers to step 5's shards. Whatever the phase, every checkpoint left committed
must load exactly what its step held, and the restarted job must end as an uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faultkit import committed_steps, step_dirs
from harness import SCENARIOS, Job, run_mpi

from mpickpt.format.manifest import Manifest, read_bytes

SCENARIO = str(SCENARIOS / "incremental.py")
STEPS, KILLED = 8, 6


def run(mode: str, root: Path, reports: Path, *extra: str, fault: str | None = None
        ) -> tuple[Job, dict[int, dict]]:
    done = run_mpi(2, [SCENARIO, mode, str(root), str(reports), *extra],
                   env={"MPICKPT_FAULT": fault} if fault else None, timeout=150)
    return done, {r: json.loads(p.read_text()) for r in range(2)
                  if (p := reports / f"{mode}-rank-{r}.json").exists()}


def every_committed_step_loads(root: Path, reports: Path) -> list[int]:
    done, found = run("check", root, reports, "--all")
    assert done.returncode == 0, done.output
    steps = committed_steps(root)
    for r in found.values():
        assert r["all"] == {str(s): True for s in steps}, (r["all"], step_dirs(root))
    return steps


@pytest.mark.guarantee("incremental", "no-torn-load", "resume-bit-identical")
@pytest.mark.parametrize("fault", [
    "mid-write:1", "after-fsync-before-vote:1", "after-vote-before-manifest:0",
    "mid-manifest-write:0", "after-commit-before-retention:0", "mid-retention:0"])
def test_a_kill_in_any_phase_leaves_every_checkpoint_loadable(tmp_path: Path, fault: str):
    root = tmp_path / "root"
    dead, _ = run("train", root, tmp_path / "dead", "--steps", str(STEPS), "--keep", "2",
                  fault=f"{fault}:kill:{KILLED}")
    assert dead.returncode != 0, dead.output
    committed = fault in ("after-commit-before-retention:0", "mid-retention:0")
    steps = every_committed_step_loads(root, tmp_path / "check")
    assert (KILLED in steps) == committed, steps
    assert 5 in steps  # the newest full checkpoint, which step 6 refers to
    if fault.startswith("mid-retention"):  # retention stopped after its first removal
        assert steps == [1, 3, 5, 6], step_dirs(root)

    done, found = run("train", root, tmp_path / "resumed", "--steps", str(STEPS), "--keep", "2")
    assert done.returncode == 0, done.output
    for r in found.values():
        assert r["restored"] == (KILLED if committed else 5) and r["final"], r
    steps = every_committed_step_loads(root, tmp_path / "check2")
    assert steps[-2:] == [7, 8], steps


@pytest.mark.guarantee("incremental", "damage-detected")
@pytest.mark.quick
def test_damage_to_a_referred_to_shard_falls_back_naming_it(tmp_path: Path):
    """A flipped byte in step 5's frozen base weights (written once, referred to by steps 6 to
    8): those four fail, naming step 5's file; the restore loads step 4, which does not refer to
    step 5, exactly as it was."""
    root = tmp_path / "root"
    done, _ = run("train", root, tmp_path / "r", "--steps", str(STEPS))
    assert done.returncode == 0, done.output
    d = root / "step-00000005"
    m = Manifest.from_json(read_bytes(str(d)), str(d / "MANIFEST.json"))
    rec = next(t for t in m.ranks[1].tensors if t.name == "model/base.weight")
    shard = d / "rank-00001.h5"
    with open(shard, "r+b") as f:
        f.seek(rec.offset + 100)
        byte = f.read(1)
        f.seek(rec.offset + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    done, found = run("check", root, tmp_path / "c")
    assert done.returncode == 0, done.output
    for r in found.values():
        assert r["restored"] == 4 and all(r["matches"].values()), r
        skipped = {s: why for s, why in r["skipped"]}
        assert sorted(skipped) == [5, 6, 7, 8], skipped
        for s in (6, 7, 8):  # named: the file, the tensor
            assert str(shard) in skipped[s] and "model/base.weight" in skipped[s], skipped[s]
            assert "checksum mismatch" in skipped[s], skipped[s]


@pytest.mark.guarantee("incremental", "no-torn-load", "resume-bit-identical")
def test_a_kill_while_compressed_frames_are_written_leaves_every_checkpoint_loadable(
        tmp_path: Path):
    """Compressed (the I/O threads write each frame where HDF5 placed it: format/framesink), a
    kill in the shard's write leaves that step uncommitted and every committed one loadable,
    and the resumed job, compressed too, ends as an uninterrupted one. (The fault fires at the
    first block written, which in this job is a raw one: the frames' own kill is the unit test's
    failing write, tests/test_framesink.py.)"""
    root = tmp_path / "root"
    zstd = ("--compress", "zstd")
    dead, _ = run("train", root, tmp_path / "dead", "--steps", str(STEPS), "--keep", "2", *zstd,
                  fault=f"mid-write:1:kill:{KILLED}")
    assert dead.returncode != 0, dead.output
    steps = every_committed_step_loads(root, tmp_path / "check")
    assert KILLED not in steps and 5 in steps, steps
    done, found = run("train", root, tmp_path / "resumed", "--steps", str(STEPS), "--keep", "2",
                      *zstd)
    assert done.returncode == 0, done.output
    for r in found.values():
        assert r["restored"] == 5 and r["final"], r
