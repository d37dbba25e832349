"""DDP (gloo on CPU) under mpickpt.run with ``Checkpointer(replicated=("model", "optim"))``: the
state every rank holds alike is written once, by the fewest of the highest ranks that give each
writer 16 MiB or more (this 19 MB state: rank 3 alone), and a checkpoint of 4 ranks restores on 2
with the same parameters and optimizer state and the same training. One 4-rank job trains 8 steps,
saving at step 4 (tests/scenarios/ddp_train.py, which takes the state from ``get_state_dict`` as a
user of any wrapped model would) and writing the full tensors there as the reference; its losses of
steps 5-8 are the uninterrupted run's.

And a 4-rank DDP job killed mid-save and resumed ends bit for bit like an uninterrupted one
(tests/scenarios/ddp_resume.py, saving every 3 of 9 steps): the rank that writes the model is
SIGKILLed while writing step 6, a rerun restores step 3 and trains to 9. This holds because
ddp_train.ddp builds DDP with ``find_unused_parameters=True``: DDP then keeps the gradient buckets
it starts with, where by default it rebuilds them after its first iteration, so a resumed run (in
its first iteration at the resume step) would sum that step's gradients in another layout, another
float order, than the uninterrupted run did (on 4 ranks gloo's ring allreduce orders a sum by the
element's place in its bucket). The bucket layouts each run recorded show the remedy is in force.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from harness import (
    SCENARIOS,
    Job,
    assert_restored_whole,
    assert_same_final,
    manifest,
    run_mpi,
    starts,
    step_dir,
)
from test_fsdp import SAVE_AT, STEPS, WORLD, full_nbytes, losses, scenario, trained

from mpickpt.sharding import MIN_WRITE_SHARE


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The 4-rank DDP run: (checkpoint root, output directory)."""
    return trained("ddp_train.py", tmp_path_factory)


def test_ddp_state_is_written_once_by_the_fewest_highest_ranks(saved):
    root, out = saved
    full = full_nbytes(torch.load(out / "reference.pt", weights_only=True))
    m = manifest(root, SAVE_AT)
    assert m["world_size"] == WORLD
    names = [r["name"] for e in m["ranks"] for r in e["tensors"]]
    assert sorted(names) == sorted(full), "each tensor must be written by exactly one rank"
    by_rank = [sum(r["nbytes"] for r in e["tensors"]) for e in m["ranks"]]
    # 1x the model and optimizer tensors, not WORLD x
    total = sum(full.values())
    assert sum(by_rank) == total
    # as few writers as gives each MIN_WRITE_SHARE bytes, the highest ranks: rank 0 commits
    few = max(1, min(WORLD, total // MIN_WRITE_SHARE))
    assert by_rank[:WORLD - few] == [0] * (WORLD - few), by_rank
    assert all(b >= min(total, MIN_WRITE_SHARE) / 2 for b in by_rank[WORLD - few:]), by_rank


@pytest.mark.guarantee("reshard-bit-exact")
@pytest.mark.quick
def test_ddp_restores_on_two_ranks(saved):
    root, out = saved
    scenario("ddp_train.py", 2, "resume", root, out)
    assert_restored_whole(out, 2, SAVE_AT, WORLD)
    # every rank needs the whole state: it reads every record once, from whichever rank wrote it
    total = sum(r["nbytes"] for e in manifest(root, SAVE_AT)["ranks"] for r in e["tensors"])
    read = [json.loads((out / f"bytes-2-rank-{r}.json").read_text())["bytes_read"]
            for r in range(2)]
    assert read == [total, total]

    whole, resumed = losses(out, "train"), losses(out, "resume-2")
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    assert [resumed[s] for s in sorted(resumed)] == pytest.approx(
        [whole[s] for s in sorted(resumed)], rel=1e-5)


# ------------------------------------------------- killed and resumed on 4 ranks, bit for bit

# the rank that writes this small model (the highest: see the test above)
RESUME_STEPS, EVERY, KILLED_AT, KILLED_RANK = 9, 3, 6, 3
RESUMED_FROM = KILLED_AT - EVERY  # the newest save that committed before the kill
CASE = (f"DDP on {WORLD} ranks: SIGKILL of rank {KILLED_RANK} mid-write of step {KILLED_AT}, "
        f"resumed from step {RESUMED_FROM} to {RESUME_STEPS}, bit for bit")


@dataclass
class Runs:
    """The uninterrupted, killed and resumed jobs (a str where the job hung: why) and their
    output directories (rank-R.pt, rank-R.json, see ddp_resume.py)."""

    whole: Job | str
    dead: Job | str
    resumed: Job | str
    whole_out: Path
    resumed_out: Path
    after_kill: list[str]  # what the killed job left under its checkpoint root


def resume_job(root: Path, out: Path, fault: str | None = None, extra: tuple[str, ...] = ()
               ) -> Job | str:
    """ddp_resume.py on WORLD ranks; a job that hangs gives the reason as a str."""
    t = time.monotonic()
    try:
        job = run_mpi(WORLD, ["-m", "mpickpt.run", str(SCENARIOS / "ddp_resume.py"), "--root",
                              str(root), "--out", str(out), "--steps", str(RESUME_STEPS),
                              "--every", str(EVERY), *extra],
                      env={"MPICKPT_FAULT": fault} if fault else None, timeout=120)
    except pytest.fail.Exception as e:
        return str(e)
    print(f"[timing] ddp_resume.py{' ' + fault if fault else ''} on {WORLD} ranks: "
          f"{time.monotonic() - t:.1f} s wall")
    return job


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    base = tmp_path_factory.mktemp("ddp_resume")
    whole = resume_job(base / "whole-ckpt", base / "whole")
    root = base / "ckpt"
    dead = resume_job(root, base / "dead", f"mid-write:{KILLED_RANK}:kill:{KILLED_AT}")
    after_kill = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    resumed = resume_job(root, base / "resumed")
    return Runs(whole, dead, resumed, base / "whole", base / "resumed", after_kill)


def rank_losses(out: Path, r: int) -> dict[int, float]:
    found = json.loads((out / f"rank-{r}.json").read_text())["losses"]
    return {int(k): v for k, v in found.items()}


def judge(runs: Runs) -> tuple[str, str]:
    """(outcome, detail) for the guarantee report."""
    jobs = {"uninterrupted": runs.whole, "killed": runs.dead, "resumed": runs.resumed}
    for name, job in jobs.items():
        if isinstance(job, str):
            return "hang", f"the {name} job: {job[-2000:]}"
    assert isinstance(runs.whole, Job) and isinstance(runs.dead, Job)
    assert isinstance(runs.resumed, Job)
    if runs.whole.returncode != 0:
        return "failed", f"the uninterrupted job failed: {runs.whole.output[-2000:]}"
    if runs.dead.returncode == 0:
        return "failed", f"the job survived a SIGKILL of one rank: {runs.dead.output[-2000:]}"
    # the save of RESUMED_FROM committed; the torn one is only a partial directory
    steps = [n for n in runs.after_kill if n.startswith("step-") and ".partial-" not in n]
    if steps != [step_dir(Path(), RESUMED_FROM).name]:
        return "failed", f"the killed job left {runs.after_kill}"
    if runs.resumed.returncode != 0:
        return "failed", f"the resumed job failed: {runs.resumed.output[-2000:]}"
    begun = starts(runs.resumed_out, WORLD)
    if len(set(begun)) > 1:
        return "torn", f"the ranks resumed from different steps: {begun}"
    if begun != [RESUMED_FROM] * WORLD:
        return ("silent-wrong" if begun[0] else "failed"), f"resumed from step {begun[0]}"
    try:
        assert_same_final(runs.resumed_out, runs.whole_out, WORLD)
    except AssertionError as e:
        return "silent-wrong", f"the resumed run ended otherwise than the uninterrupted one: {e}"
    for r in range(WORLD):
        got, whole = rank_losses(runs.resumed_out, r), rank_losses(runs.whole_out, r)
        if sorted(got) != list(range(RESUMED_FROM + 1, RESUME_STEPS + 1)):
            return "failed", f"rank {r} ran steps {sorted(got)}"
        if any(got[s] != whole[s] for s in got):
            return "silent-wrong", f"rank {r}: losses {got} where the uninterrupted run had {whole}"
    return "correct", ""


@pytest.mark.guarantee("resume-bit-identical")
def test_ddp_killed_and_resumed_on_four_ranks_ends_bit_identical(ddp_runs, guarantees):
    """Final parameters, Adam state (exp_avg, exp_avg_sq, step) and every loss after the resume
    step equal the uninterrupted run's exactly, on every rank."""
    outcome, detail = judge(ddp_runs)
    guarantees.record("ddp-resume", CASE, outcome, detail)
    assert outcome == "correct", detail


def test_ddp_bucket_layout_never_changes(ddp_runs):
    """Every run keeps the bucket layout DDP was built with, the same on every rank, in the
    resumed and the uninterrupted run: DDP's bucket rebuild is off (find_unused_parameters)."""
    for job in (ddp_runs.whole, ddp_runs.resumed):
        assert isinstance(job, Job), job
        assert job.returncode == 0, job.output
    built = None
    model = torch.load(ddp_runs.whole_out / "rank-0.pt", weights_only=True)["model"]
    for out, first in ((ddp_runs.whole_out, 1), (ddp_runs.resumed_out, RESUMED_FROM + 1)):
        for r in range(WORLD):
            got = json.loads((out / f"rank-{r}.json").read_text())
            assert got["find_unused_parameters"] is True
            layouts = got["buckets"]
            # recorded when built and after each step, the first and the last included
            assert list(layouts) == ["built", *map(str, range(first, RESUME_STEPS + 1))]
            built = built or layouts["built"]
            changed = {when: lay for when, lay in layouts.items() if lay != built}
            assert not changed, f"{out.name} rank {r}: DDP's buckets were {built}, then {changed}"
    assert built is not None and len(built) >= 3, f"the model should span several buckets: {built}"
    assert sorted(n for bucket in built for n in bucket) == sorted(model)


# ------------------------------------- plain DDP (buckets rebuilt), resumed with mpickpt.prime_ddp

PLAIN = ("--plain",)
PLAIN_CASE = (f"plain DDP on {WORLD} ranks: SIGKILL of rank {KILLED_RANK} mid-write of step "
              f"{KILLED_AT}, resumed from step {RESUMED_FROM} with prime_ddp, bit for bit")


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Runs, Job | str, Path]:
    """The same three jobs with plain DDP (the resumed one calls prime_ddp after restoring),
    and the resume of a copy of the killed job's ROOT without prime_ddp (and its output)."""
    base = tmp_path_factory.mktemp("ddp_plain")
    whole = resume_job(base / "whole-ckpt", base / "whole", extra=PLAIN)
    root = base / "ckpt"
    dead = resume_job(root, base / "dead", f"mid-write:{KILLED_RANK}:kill:{KILLED_AT}", PLAIN)
    after_kill = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    shutil.copytree(root, base / "ckpt-unprimed")
    resumed = resume_job(root, base / "resumed", extra=(*PLAIN, "--prime"))
    unprimed = resume_job(base / "ckpt-unprimed", base / "unprimed", extra=PLAIN)
    return (Runs(whole, dead, resumed, base / "whole", base / "resumed", after_kill), unprimed,
            base / "unprimed")


@pytest.mark.guarantee("resume-bit-identical")
def test_plain_ddp_primed_after_restore_ends_bit_identical(plain_runs, guarantees):
    """Plain DDP: with prime_ddp after restore(), the resumed run reduces every step in the
    bucket layout the uninterrupted run used, and ends equal to it, bit for bit."""
    runs, _, _ = plain_runs
    outcome, detail = judge(runs)
    guarantees.record("ddp-resume", PLAIN_CASE, outcome, detail)
    assert outcome == "correct", detail
    for r in range(WORLD):
        whole = json.loads((runs.whole_out / f"rank-{r}.json").read_text())
        resumed = json.loads((runs.resumed_out / f"rank-{r}.json").read_text())
        assert not whole["find_unused_parameters"]
        assert whole["buckets"]["2"] != whole["buckets"]["built"]  # rebuilt in step 2
        for step in range(RESUMED_FROM + 1, RESUME_STEPS + 1):
            assert resumed["buckets"][str(step)] == whole["buckets"][str(step)], (r, step)


def test_plain_ddp_resumed_without_prime_differs_in_the_last_bits(plain_runs):
    """Why prime_ddp exists: the same resume without it reduces its first step in DDP's first
    layout; the losses agree to float precision, the final state not bit for bit."""
    runs, unprimed, out = plain_runs
    assert isinstance(unprimed, Job) and unprimed.returncode == 0, unprimed
    assert starts(out, WORLD) == [RESUMED_FROM] * WORLD
    with pytest.raises(AssertionError, match=r"rank \d: (parameter|optim)"):
        assert_same_final(out, runs.whole_out, WORLD)
    got, whole = rank_losses(out, 0), rank_losses(runs.whole_out, 0)
    assert [got[s] for s in sorted(got)] == pytest.approx([whole[s] for s in sorted(got)],
                                                          rel=1e-5)
