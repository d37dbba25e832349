"""The fault matrix: its cells, running their jobs (many cases per launch where a case does not
end the job), and judging each cell from what the jobs and the verification reported.

A cell is (action, rank, phase, ranks). Its fault job (tests/scenarios/fault_matrix.py) saves steps
10, 20 and 30 with the fault armed for step 30 (``mid-restore-read``: saves 10 and 20, then
restores with the fault armed for step 20). kill, exit and hang end the job, so each such cell has
a launch of its own; the raise cells of one (rank, ranks) share a launch, each with its own root.
Then one launch per rank count verifies every root: the restored step, bit for bit, and every
committed step left on disk.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import SCENARIOS, launcher, torchrun_code

from mpickpt.exitcodes import EXIT_COLLECTIVE_TIMEOUT
from mpickpt.faults import PHASES

JOB = SCENARIOS / "fault_matrix.py"
ACTIONS = ("kill", "raise", "hang", "exit")
SIZES = (2, 4)
HANG_DEADLINE_S = 3.0      # the collective deadline of a hang cell's job: how it ends
RAISE_DEADLINE_S = 6.0     # a raise must not need the deadline; if it does, find out quickly
DEADLINE_S = 30.0          # kill and exit: the launcher ends the job, not the deadline
ROLL_CALL_GRACE_S = 2.0    # after a missed deadline, how long the ranks take to tell who is missing
LAUNCH_TIMEOUT_S = float(os.environ.get("MPICKPT_MATRIX_LAUNCH_TIMEOUT", "90"))
SAVE_PHASES = PHASES[:-1]
RESTORE_PHASE = "mid-restore-read"
AFTER_COMMIT = "after-commit-before-retention"
# A non-zero rank has voted and sent its entry; rank 0 writes the manifest and commits meanwhile.
RACING_COMMIT = "mid-manifest-write"
FRESH = 0  # the step a fresh state's values belong to (fault_matrix.FRESH)


@dataclass(frozen=True)
class Cell:
    action: str
    rank: int
    phase: str
    n: int

    @property
    def id(self) -> str:
        return f"{self.action}/rank{self.rank}/{self.phase}/n{self.n}"

    @property
    def dirname(self) -> str:
        return self.id.replace("/", "-")


def cells(n: int) -> list[Cell]:
    """Every cell of one rank count: rank 0 and the last rank, every action and phase."""
    return [Cell(a, r, p, n) for a in ACTIONS for r in (0, n - 1) for p in PHASES]


# Cells that cannot be run meaningfully, with the reason (none: every phase exists on every rank,
# see the faults.hit calls of mpickpt/save/ and mpickpt/save/upkeep.py).
NOT_APPLICABLE: dict[str, str] = {}


@dataclass
class Launch:
    """One launch of the job: exit code (None when it outlived its timeout; under torchrun, the
    code of the rank that ended the job) and its output."""

    rc: int | None
    seconds: float
    output: str
    launcher: str = "mpi"

    @property
    def ranks_output(self) -> str:
        """The output less torchrun's own report of a failed worker (its traceback and table)."""
        if self.launcher == "mpi":
            return self.output
        end = self.output.find("torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
        return self.output if end < 0 else \
            self.output[: self.output.rfind("Traceback (most recent call last)", 0, end)]

    @property
    def killed(self) -> bool:
        """Whether a rank was killed by SIGKILL, as the launcher reports it."""
        return "signal 9" in self.output if self.launcher == "mpi" else self.rc == -9

    def tail(self, lines: int = 6) -> str:
        return " | ".join(self.output.strip().splitlines()[-lines:])

    def complaints(self, lines: int = 8) -> str:
        """The first warnings and errors mpickpt logged (an earlier save's failure, say)."""
        said = [ln for ln in self.output.splitlines() if " ERROR " in ln or " WARNING " in ln]
        return " | ".join(said[:lines]) or "(none)"


@dataclass
class CaseRun:
    """What a cell's fault job left: the launch that ran it (the one it ended, if it did)."""

    launch: Launch
    ended_launch: bool  # this case is where the launch stopped (died, hung, or its last case)
    job: dict[int, dict] = field(default_factory=dict)     # rank -> job report
    verify: dict[int, dict] = field(default_factory=dict)  # rank -> verify report
    verify_launch: Launch | None = None


def launch(n: int, mode: str, plan: dict, where: Path, how: str = "mpi") -> Launch:
    """Run the job on ``n`` ranks under mpickpt.run, started by ``how`` (mpi or torchrun); kill
    its process group after the timeout."""
    where.mkdir(parents=True, exist_ok=True)
    plan_file = where / f"{mode}-plan.json"
    plan_file.write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k != "MPICKPT_FAULT"}
    env.update(PYTHONUNBUFFERED="1", MPICKPT_EXIT_GRACE="10",
               MPICKPT_TIMEOUT_GRACE=str(ROLL_CALL_GRACE_S))
    cmd = [*launcher(how, n), "-m", "mpickpt.run", str(JOB), mode, str(plan_file)]
    t0 = time.monotonic()
    with open(where / f"{mode}.log", "w+") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        try:
            rc: int | None = p.wait(LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        log.seek(0)
        output = log.read()
    took = time.monotonic() - t0
    (where / f"{mode}.seconds").write_text(f"{took:.2f}\n")
    if how == "torchrun" and rc is not None:
        rc = torchrun_code(rc, output)
    return Launch(rc, took, output, how)


def reports(path: Path) -> dict[int, dict]:
    return {int(f.stem.split("-")[1]): json.loads(f.read_text())
            for f in path.glob("rank-*.json")} if path.exists() else {}


def run_batch(n: int, mode: str, dirs: list[Path], plan: Callable[[list[Path]], dict],
              sub: str, where: Path, how: str = "mpi") -> dict[Path, tuple[Launch, bool]]:
    """Run ``dirs`` in one launch; when a launch stops before its last one, launch the rest
    again. Each dir gets the launch that ran it, and whether that launch stopped on it."""
    out: dict[Path, tuple[Launch, bool]] = {}
    todo, k = list(dirs), 0
    while todo:
        run = launch(n, mode, plan(todo), where / f"{mode}-{k}", how)
        done = [d for d in todo if len(reports(d / sub)) == n]
        stop = next((d for d in todo if d not in done), todo[-1])
        for d in todo[: todo.index(stop) + 1]:
            out[d] = (run, d == stop)
        todo, k = todo[todo.index(stop) + 1:], k + 1
    return out


def run_matrix(todo: list[Cell], base: Path, workers: int = 1, how: str = "mpi"
               ) -> dict[str, CaseRun]:
    """Run the fault jobs of ``todo`` (cells of one rank count), then verify every root in one
    launch; every launch by ``how`` (mpi or torchrun)."""
    n = todo[0].n
    assert all(c.n == n and c.id not in NOT_APPLICABLE for c in todo)
    dirs = {c.id: base / c.dirname for c in todo}
    if len(dirs) != len(todo):  # two jobs of one cell would share its root and mix their saves
        raise ValueError(f"cells given twice: {sorted(c.id for c in todo if todo.count(c) > 1)}")

    def fault_plan(cs: list[Cell], deadline: float) -> Callable[[list[Path]], dict]:
        by_dir = {dirs[c.id]: c for c in cs}
        return lambda ds: {"timeout": deadline, "cases": [
            {"dir": str(d), "phase": by_dir[d].phase, "rank": by_dir[d].rank,
             "action": by_dir[d].action} for d in ds]}

    groups: list[tuple[list[Cell], float]] = []
    for rank in (0, n - 1):
        groups.append(([c for c in todo if c.action == "raise" and c.rank == rank],
                       RAISE_DEADLINE_S))
    for c in todo:
        if c.action != "raise":
            groups.append(([c], HANG_DEADLINE_S if c.action == "hang" else DEADLINE_S))
    groups = [g for g in groups if g[0]]

    def run_group(g: tuple[list[Cell], float]) -> dict[Path, tuple[Launch, bool]]:
        cs, deadline = g
        ds = [dirs[c.id] for c in cs]
        return run_batch(n, "fault", ds, fault_plan(cs, deadline), "job", ds[0], how)

    ran: dict[Path, tuple[Launch, bool]] = {}
    with ThreadPoolExecutor(workers) as pool:
        for part in pool.map(run_group, groups):
            ran.update(part)

    order = [dirs[c.id] for c in todo]
    verified = run_batch(n, "verify", order, lambda ds: {"roots": [str(d) for d in ds]},
                         "verify", base / "verify", how)
    out = {}
    for c in todo:
        d = dirs[c.id]
        job_launch, ended = ran[d]
        out[c.id] = CaseRun(job_launch, ended, reports(d / "job"), reports(d / "verify"),
                            verified[d][0])
    return out


# ---------------------------------------------------------------------------------- the judge


class Verdict(Exception):
    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome, self.detail = outcome, detail


def _fail(outcome: str, detail: str) -> Verdict:
    return Verdict(outcome, detail)


def expected_step(cell: Cell, on_disk: list[int]) -> tuple[int, str]:
    """The step a new job must restore, and why."""
    if cell.phase == AFTER_COMMIT:
        return 30, "the fault came after the commit of step 30"
    if cell.phase == RACING_COMMIT and cell.rank != 0:
        if cell.action in ("hang", "raise"):
            return 30, ("rank 0 had every vote and entry, so it committed step 30 while rank "
                        f"{cell.rank} was stuck")
        if 30 in on_disk:  # kill/exit: the launcher's teardown raced rank 0's commit
            return 30, "rank 0 committed step 30 before the launcher tore the job down"
        return 20, "the launcher tore rank 0 down before it committed step 30"
    if cell.phase == RESTORE_PHASE:
        return 20, "the fault came in a restore; nothing was written"
    return 20, "the fault came before the commit of step 30"


def _check_restore(what: str, reps: dict[int, dict], key: str, step: int, n: int,
                   skipped_ok: Callable[[list], bool] = lambda s: not s) -> None:
    """Every rank restored ``step`` bit for bit (the report's ``key`` entry)."""
    got = {r: reps[r][key] if key else reps[r] for r in range(n)}
    steps = {r: g["step"] for r, g in got.items()}
    if len(set(steps.values())) > 1:
        raise _fail("torn", f"{what}: ranks restored different steps {steps}")
    for r, g in got.items():
        if g["error"]:
            raise _fail("failed", f"{what}: rank {r} raised {g['error']}")
        if g["mixed"]:
            raise _fail("torn", f"{what}: rank {r}'s state mixes steps {g['mixed']} "
                                f"(restore said {g['step']})")
        if g["foreign"]:
            raise _fail("silent-wrong", f"{what}: rank {r} restored step {g['step']} but "
                                        f"{g['foreign'][:3]} equal no saved value")
        if g["step"] is None and g["steps"] == [FRESH]:
            raise _fail("failed", f"{what}: rank {r} started fresh, expected step {step} "
                                  f"(skipped {g['skipped']})")
        if g["steps"] != [g["step"]]:
            raise _fail("silent-wrong", f"{what}: rank {r} said step {g['step']}, its state "
                                        f"is step {g['steps']}")
        if g["step"] != step:
            kind = "failed" if g["skipped"] else "silent-wrong"
            raise _fail(kind, f"{what}: rank {r} restored step {g['step']}, expected {step} "
                              f"(skipped {g['skipped']})")
        if not skipped_ok(g["skipped"]):
            raise _fail("failed", f"{what}: rank {r} skipped {g['skipped']}")


def _check_job(cell: Cell, run: CaseRun, expect: int) -> None:
    """The fault job ended as its action should: killed/exited non-zero, hung until the
    deadline (75), or (raise) went on with a consistent result on every rank."""
    launch, n = run.launch, cell.n
    if launch.rc is None:
        raise _fail("hang", f"the fault job did not end within {LAUNCH_TIMEOUT_S:g} s: "
                            f"{launch.tail()}")
    if cell.action != "raise" and "Traceback (most recent call last)" in launch.ranks_output:
        raise _fail("failed", f"a rank raised: {launch.tail(12)}")
    if cell.action == "kill":
        if launch.rc == 0 or not launch.killed:
            raise _fail("failed", f"no rank was killed (exit {launch.rc}): {launch.tail()}")
        return
    if cell.action == "exit":
        # hydra reports 17 (the rank's os._exit), or 9 for the ranks it then killed
        if launch.rc == 0:
            raise _fail("failed", f"the job ended with 0: the fault never fired: {launch.tail()}")
        return
    if cell.action == "hang":
        if launch.rc != EXIT_COLLECTIVE_TIMEOUT:
            raise _fail("failed", f"a hung rank: exit code {launch.rc}, expected "
                                  f"{EXIT_COLLECTIVE_TIMEOUT} (deadline): {launch.tail()}")
        named = re.search(rf"did not arrive: rank {cell.rank}\b|rank {cell.rank} did not arrive",
                          launch.output)
        if "did not all reach phase" not in launch.output or not named:
            raise _fail("failed", f"exit 75 without a deadline report naming rank {cell.rank}: "
                                  f"{launch.tail()}")
        return
    # raise: the job goes on
    if len(run.job) != n:
        raise _fail("failed", f"the job died (exit {launch.rc}) instead of going on; ranks "
                              f"{sorted(run.job)} reported: {launch.tail()}")
    if run.ended_launch and launch.rc != 0:
        raise _fail("failed", f"the job went on but exited {launch.rc}: {launch.tail()}")
    jobs = run.job
    if cell.phase == RESTORE_PHASE:
        def fell_back(skipped: list) -> bool:
            return (len(skipped) == 1 and skipped[0][0] == 20
                    and f"rank {cell.rank}" in skipped[0][1] and "FaultInjected" in skipped[0][1])
        # the job's own restore failed reading step 20 on one rank: all fall back to step 10
        _check_restore("the faulted restore", jobs, "restore", 10, n, fell_back)
        return
    results = {r: jobs[r]["saves"]["30"] for r in range(n)}
    if any("raised" in x for x in results.values()):
        raise _fail("failed", f"save of step 30 raised instead of reporting: {results}")
    if len({json.dumps(x, sort_keys=True) for x in results.values()}) != 1:
        raise _fail("failed", f"ranks disagree on the save of step 30: {results}")
    res = results[0]
    if res["committed"] != (expect == 30):
        raise _fail("failed", f"save of step 30: {res}, expected committed={expect == 30}")
    if not res["committed"] and (f"rank {cell.rank}" not in (res["error"] or "")
                                 or "FaultInjected" not in res["error"]):
        raise _fail("failed", f"the abort does not name rank {cell.rank}'s fault: {res['error']}")
    _check_restore("the job's own restore", jobs, "restore", expect, n)


def judge(cell: Cell, run: CaseRun) -> tuple[str, str]:
    """(outcome, detail) of one cell."""
    n = cell.n
    try:
        vr = run.verify
        if len(vr) != n:
            vl = run.verify_launch
            raise _fail("hang" if vl and vl.rc is None else "failed",
                        f"the verification did not finish for this root: "
                        f"{vl.tail() if vl else ''}")
        on_disk = vr[0]["on_disk"]
        expect, why = expected_step(cell, on_disk)
        _check_job(cell, run, expect)
        _check_restore("the new job's restore", vr, "newest", expect, n)
        required = {expect - 10, expect}
        if not required <= set(on_disk) <= {10, 20, expect}:
            raise _fail("failed", f"committed steps on disk {on_disk}, expected {sorted(required)}"
                                  f" (keep=2) and nothing newer than {expect}; the fault job "
                                  f"said: {run.launch.tail(12)}; its warnings and errors: "
                                  f"{run.launch.complaints()}")
        for s in on_disk:
            _check_restore(f"restore of step {s}", {r: vr[r]["each"][str(s)] for r in range(n)},
                           "", s, n)
        if vr[0]["left"]:
            raise _fail("failed", f"left under ROOT after the new job started: {vr[0]['left']}")
    except Verdict as v:
        return v.outcome, v.detail
    return "correct", f"restored step {expect} ({why}); on disk {on_disk}"


def count_and_check(guarantees: Any, suite: str, cell: Cell, run: CaseRun) -> None:
    """Judge a cell, count it in the guarantee report (before asserting), assert it correct."""
    outcome, detail = judge(cell, run)
    guarantees.record(suite, cell.id, outcome, detail)
    assert outcome == "correct", f"{suite} {cell.id}: {outcome}: {detail}"
