"""Damaged checkpoints on disk: a flipped data byte, a truncated or deleted shard, a deleted or
garbled manifest. Restore must detect the damage before any tensor is used, fall back to the older
checkpoint, say which file is damaged, and the resumed run must end bit-identical to an
uninterrupted one. Each case is counted in the guarantee report (suite "corruption") before its
assertions. (HDF5 metadata, wrong versions, lying sizes, swapped shards, shards of another step and
hostile input: tests/faults/test_fault_hostile.py.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from faultkit import agreed_step, losses, reports
from harness import (
    SCENARIOS,
    Job,
    assert_same_final,
    flip_data_byte,
    run_mpi,
    shard,
    starts,
    step_dir,
    train,
)

N, STEPS, EVERY = 2, 20, 5
NEWEST, OLDER = 20, 15
RESUMED_STEPS = 30
pytestmark = pytest.mark.guarantee("damage-detected")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints 10, 15 and 20 of a 2-rank run; every test damages its own copy."""
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    job = train(N, root, STEPS, every=EVERY, keep=3)
    assert job.returncode == 0, job.output
    return root


@pytest.fixture
def root(tmp_path: Path, pristine: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


def probe_restore(root: Path, reports_dir: Path, *extra: str) -> tuple[Job, dict[int, dict]]:
    """Restore ROOT into a fresh state on every rank (tests/scenarios/fault_restore.py); the
    callers check the job's exit code (after counting the case)."""
    job = run_mpi(N, [str(SCENARIOS / "fault_restore.py"), str(root), str(reports_dir), *extra],
                  timeout=90)
    return job, reports(reports_dir)


def loaded_outcome(job: Job, found: dict[int, dict], step: int | None,
                   skipped: list[tuple[int, list[str]]], refused: bool = False
                   ) -> tuple[str, str]:
    """How the guarantee report counts a probe: every rank restored ``step`` (None: nothing, the
    state untouched) after skipping ``skipped`` (step, the words its reason must hold), or
    (``refused``) raised."""
    verdict, got = agreed_step(found, N, job.returncode)
    if verdict is not None:
        return verdict, str(got)
    for r, rep in found.items():
        damaged = {s for s, _ in skipped}
        if got in damaged or (got is None and not rep["untouched"]):
            return "silent-wrong", f"rank {r} restored {got}, untouched {rep['untouched']}"
        if got != step or (rep["error"] is not None) != refused:
            return "failed", f"rank {r} restored {got}, error {rep['error']}"
        if refused:
            continue
        if [s[0] for s in rep["skipped"]] != [s for s, _ in skipped]:
            return "failed", f"rank {r} skipped {rep['skipped']}"
        for (_, reason), (s, words) in zip(rep["skipped"], skipped, strict=True):
            if not all(w in reason for w in words):
                return "failed", f"rank {r}: the reason for step {s} lacks {words}: {reason}"
    return "correct", ""


def check_fallback(root: Path, tmp_path: Path, damaged: Path, why: str, reference_runs,
                   guarantees, case: str) -> None:
    """Restore skips the newest checkpoint naming ``damaged`` and ``why``, loads the older one,
    and training resumed from it ends exactly like the uninterrupted run."""
    probe, found = probe_restore(root, tmp_path / "reports")
    outcome, detail = loaded_outcome(probe, found, OLDER, [(NEWEST, [str(damaged), why])])
    out = tmp_path / "out"
    ref = reference_runs[(N, RESUMED_STEPS)]
    resumed = train(N, root, RESUMED_STEPS, out, every=EVERY, keep=3, timeout=90)
    if outcome == "correct":
        if resumed.returncode != 0 or starts(out, N) != [OLDER] * N:
            outcome, detail = "failed", f"the resumed job: {resumed.output[-2000:]}"
        else:
            try:
                assert_same_final(out, ref, N)
                assert losses(out, N) == losses(ref, N), "losses differ"
            except AssertionError as e:
                outcome, detail = "silent-wrong", f"the resumed run ended otherwise: {e}"
    guarantees.record("corruption", case, outcome, detail)
    assert probe.returncode == 0, probe.output
    assert sorted(found) == list(range(N)), probe.output
    for r, rep in found.items():
        assert rep["error"] is None, rep
        assert rep["step"] == OLDER, rep
        assert [s[0] for s in rep["skipped"]] == [NEWEST], rep
        reason = rep["skipped"][0][1]
        assert str(damaged) in reason and why in reason, f"rank {r}: {reason}"
    assert f"checkpoint step {NEWEST} cannot be restored, falling back" in probe.stderr
    assert str(damaged) in probe.stderr, probe.output

    assert resumed.returncode == 0, resumed.output
    assert starts(out, N) == [OLDER] * N, resumed.output
    assert str(damaged) in resumed.stderr and why in resumed.stderr, resumed.output
    assert f"restored step {OLDER} from" in resumed.stderr, resumed.output
    assert_same_final(out, ref, N)
    assert losses(out, N) == losses(ref, N)


@pytest.mark.quick
def test_flipped_data_byte_falls_back(root, tmp_path, reference_runs, guarantees):
    damaged, tensor = flip_data_byte(root, NEWEST, rank=1)
    check_fallback(root, tmp_path, damaged, f"tensor {tensor!r}: checksum mismatch",
                   reference_runs, guarantees, "data byte flipped")


def test_truncated_shard_falls_back(root, tmp_path, reference_runs, guarantees):
    damaged = shard(root, NEWEST, rank=0)
    size = damaged.stat().st_size
    os.truncate(damaged, size // 2)
    check_fallback(root, tmp_path, damaged,
                   f"size is {size // 2} bytes, the manifest says {size}", reference_runs,
                   guarantees, "shard truncated")


def test_deleted_shard_falls_back(root, tmp_path, reference_runs, guarantees):
    damaged = shard(root, NEWEST, rank=1)
    damaged.unlink()
    check_fallback(root, tmp_path, damaged, "cannot open", reference_runs, guarantees,
                   "shard missing")


def test_deleted_manifest_falls_back(root, tmp_path, reference_runs, guarantees):
    damaged = step_dir(root, NEWEST) / "MANIFEST.json"
    damaged.unlink()
    check_fallback(root, tmp_path, damaged, "cannot open", reference_runs, guarantees,
                   "manifest missing")


def test_garbled_manifest_falls_back(root, tmp_path, reference_runs, guarantees):
    damaged = step_dir(root, NEWEST) / "MANIFEST.json"
    text = damaged.read_bytes()
    mid = len(text) // 2
    damaged.write_bytes(text[:mid] + b"\x00\xff garbage }{" + text[mid + 16:])
    check_fallback(root, tmp_path, damaged, "not valid JSON", reference_runs, guarantees,
                   "manifest garbled")


def flip_bit_at(path: Path, where: int) -> None:
    data = bytearray(path.read_bytes())
    data[where] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("target", ["shape", "tree-key"])
def test_manifest_bit_flip_that_stays_valid_json_falls_back(root, tmp_path, reference_runs,
                                                             target, guarantees):
    """One flipped bit in MANIFEST.json that leaves it valid JSON: in a tensor's shape (64 -> 74)
    or in a state key of the tree ("0.weight" -> "0.weighu"). Either is corruption of the
    checkpoint, not a state that does not fit: restore must fall back, not give up."""
    damaged = step_dir(root, NEWEST) / "MANIFEST.json"
    text = damaged.read_text()
    if target == "shape":
        i = text.index('"shape":[')
        where = i + next(k for k, c in enumerate(text[i:]) if c.isdigit())
    else:
        where = text.index('"0.weight",') + len('"0.weigh')
    flip_bit_at(damaged, where)
    json.loads(damaged.read_text())  # still valid JSON
    check_fallback(root, tmp_path, damaged, "checksum mismatch", reference_runs, guarantees,
                   f"manifest bit flip in a {target}, still valid JSON")


def test_nothing_is_loaded_until_every_rank_verified(root, tmp_path, guarantees):
    """Rank 1's shard of the newest checkpoint is corrupt, rank 0's is intact: restoring that
    step explicitly fails on both ranks, and rank 0 has not copied a single tensor."""
    damaged, _ = flip_data_byte(root, NEWEST, rank=1)
    job, found = probe_restore(root, tmp_path / "reports", "--step", str(NEWEST))
    outcome, detail = loaded_outcome(job, found, None, [], refused=True)
    want = [f"checkpoint step {NEWEST} cannot be restored", str(damaged)]
    if outcome == "correct" and not all(
            rep["error"] and all(w in rep["error"] for w in want) for rep in found.values()):
        outcome, detail = "failed", f"the errors do not say {want}"
    guarantees.record("corruption", "restore(step=) of a damaged step refused", outcome, detail)
    assert job.returncode == 0, job.output
    assert sorted(found) == list(range(N)), job.output
    for rep in found.values():
        assert rep["step"] is None, rep
        assert rep["error"] and f"checkpoint step {NEWEST} cannot be restored" in rep["error"], rep
        assert str(damaged) in rep["error"], rep
        assert rep["untouched"], f"rank {rep['rank']}: the state was modified by a failed restore"


def test_every_candidate_corrupt_leaves_state_untouched(root, tmp_path, guarantees):
    """All three checkpoints damaged in different ways: restore returns None, reports each one,
    and the state keeps its initial values on every rank."""
    flip_data_byte(root, 20, rank=0)
    os.truncate(shard(root, 15, rank=1), 100)
    (step_dir(root, 10) / "MANIFEST.json").unlink()
    probe, found = probe_restore(root, tmp_path / "reports")
    outcome, detail = loaded_outcome(probe, found, None, [
        (20, [str(shard(root, 20, 0)), "checksum mismatch"]),
        (15, [str(shard(root, 15, 1)), "size is 100 bytes"]),
        (10, [str(step_dir(root, 10) / "MANIFEST.json")])])
    guarantees.record("corruption", "every checkpoint damaged: fresh start", outcome, detail)
    assert probe.returncode == 0, probe.output
    assert sorted(found) == list(range(N)), probe.output
    for rep in found.values():
        assert rep["error"] is None, rep
        assert rep["step"] is None, rep
        assert [s[0] for s in rep["skipped"]] == [20, 15, 10], rep
        r20, r15, r10 = (s[1] for s in rep["skipped"])
        assert str(shard(root, 20, 0)) in r20 and "checksum mismatch" in r20, r20
        assert str(shard(root, 15, 1)) in r15 and "size is 100 bytes" in r15, r15
        assert str(step_dir(root, 10) / "MANIFEST.json") in r10, r10
        assert rep["untouched"], f"rank {rep['rank']}: the state was modified by a failed restore"
    assert "no loadable checkpoint" in probe.stderr and "3 skipped" in probe.stderr, probe.output


def test_checkpoint_moved_under_another_step_name_falls_back(root, tmp_path, guarantees):
    # step 20's directory replaced by a copy of step 10's: a manifest of another step
    shutil.rmtree(step_dir(root, 20))
    shutil.copytree(step_dir(root, 10), step_dir(root, 20))
    job, reps = probe_restore(root, tmp_path / "reports")
    why = "is the manifest of step 10, not of step 20"
    outcome, detail = loaded_outcome(job, reps, OLDER, [(NEWEST, [why])])
    guarantees.record("corruption", "checkpoint copied under another step's name", outcome,
                      detail)
    assert job.returncode == 0, job.output
    for rep in reps.values():
        assert rep["step"] == OLDER and [s[0] for s in rep["skipped"]] == [NEWEST], rep
        assert "is the manifest of step 10, not of step 20" in rep["skipped"][0][1], rep
