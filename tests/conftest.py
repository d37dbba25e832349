"""Shared fixtures; the helpers they use live in harness.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from guarantees import GuaranteeReport
from harness import train

_REPORT = GuaranteeReport()


@pytest.fixture(scope="session")
def guarantees() -> GuaranteeReport:
    """Where fault, corruption and soak cases are counted (see guarantees.py)."""
    return _REPORT


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _REPORT.cases:
        return
    terminalreporter.section("mpickpt guarantees")
    for line in _REPORT.lines():
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"written to {_REPORT.write()}")


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], Path]:
    """Uninterrupted runs without checkpoints, made on first use per (ranks, steps)."""
    base = tmp_path_factory.mktemp("reference")

    class Lazy(dict):
        def __missing__(self, key: tuple[int, int]) -> Path:
            n, steps = key
            out = base / f"n{n}-s{steps}"
            job = train(n, base / "unused", steps, out, extra=["--no-checkpoint"])
            assert job.returncode == 0, job.output
            self[key] = out
            return out

    return Lazy()
