"""What the framework integration tests share: how a scenario's training job runs, the committed
steps of a ROOT, and the final parameters and report each rank of a scenario wrote."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import run_mpi


def launch(program: list[str], n: int, root: Path, out: Path, *extra: str,
           fault: str | None = None) -> Any:
    """Run a training ``program`` (its argv: ROOT and OUT follow) on ``n`` ranks, with
    ``fault`` (an MPICKPT_FAULT spec) armed if given."""
    return run_mpi(n, [*program, str(root), str(out), *extra],
                   env={"MPICKPT_FAULT": fault} if fault else None, timeout=300)


def committed_steps(root: Path) -> list[int]:
    """Steps of the committed checkpoints (MANIFEST.json present), ascending."""
    return sorted(int(p.name[5:]) for p in root.glob("step-*")
                  if p.name[5:].isdigit() and (p / "MANIFEST.json").is_file())


def finals(out: Path, n: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's final parameters (OUT/rank-R.pt, written by the test's own job)."""
    return [torch.load(out / f"rank-{r}.pt") for r in range(n)]


def report(out: Path, r: int) -> dict:
    """Rank ``r``'s report (OUT/rank-R.json)."""
    return json.loads((out / f"rank-{r}.json").read_text())


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same parameters, bit for bit."""
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def killed_then_resumed(train: Callable[..., Any], n: int, tmp_path: Path, args: list[str],
                        fault: str, committed: list[int]) -> tuple[Path, Path, Any]:
    """A reference run of ``train`` with ``args`` and no checkpoints; a run with ``fault`` (a
    SIGKILL) that dies with just the steps ``committed``; a rerun that resumes, ends 0 and
    bit-identical to the reference. (ROOT, the rerun's output directory, the rerun.)"""
    ref = train(n, tmp_path / "unused", tmp_path / "ref", *args, "--no-checkpoint")
    assert ref.returncode == 0, ref.output
    root = tmp_path / "root"
    dead = train(n, root, tmp_path / "dead", *args, fault=fault)
    assert dead.returncode != 0, f"the job survived a SIGKILL\n{dead.output}"
    assert committed_steps(root) == committed, dead.output
    out = tmp_path / "out"
    resumed = train(n, root, out, *args)
    assert resumed.returncode == 0, resumed.output
    for got, want in zip(finals(out, n), finals(tmp_path / "ref", n), strict=True):
        assert_same(got, want)
    return root, out, resumed


def preempted_then_resumed(train: Callable[..., Any], n: int, tmp_path: Path, args: list[str],
                           signal_at: int, saved: int, within: range) -> tuple[int, Path]:
    """A first run of ``train`` that gets the preemption signal at step ``signal_at``: it exits
    3 with two checkpoints, the regular one of step ``saved`` and the emergency one of a step
    ``within`` that range; then a rerun with the same ``args`` that resumes from the emergency
    one. (That step, the rerun's output directory.)"""
    root = tmp_path / "root"
    first = train(n, root, tmp_path / "first", *args, "--signal-at", str(signal_at))
    assert first.returncode == 3, first.output
    steps = committed_steps(root)
    assert steps[0] == saved and len(steps) == 2 and steps[1] in within, (steps, first.output)
    assert f"INFO emergency checkpoint of step {steps[1]} committed" in first.stderr, first.output
    out = tmp_path / "out"
    again = train(n, root, out, *args)
    assert again.returncode == 0, again.output
    assert f"restored step {steps[1]}" in again.stderr + again.stdout, again.output
    return steps[1], out
