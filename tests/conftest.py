"""Shared fixtures; the helpers they use live in harness.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from guarantees import MAP_ENV, GuaranteeReport, function_of, proved_by
from harness import train

_REPORT = GuaranteeReport()


@pytest.fixture(scope="session")
def guarantees() -> GuaranteeReport:
    """Where fault, corruption and soak cases are counted (see guarantees.py)."""
    return _REPORT


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Note which guarantees each test proves (@pytest.mark.guarantee); refuse a marker that
    names no guarantee of guarantees.py."""
    for item in items:
        try:
            _REPORT.collected(item.nodeid, proved_by(item))
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None


def pytest_collection_finish(session: pytest.Session) -> None:
    """With $MPICKPT_GUARANTEE_MAP set (guarantees.collect), write there what was collected."""
    path = os.environ.get(MAP_ENV)
    if not path:
        return
    cases: dict[str, int] = {}
    for item in session.items:
        cases[function_of(item.nodeid)] = cases.get(function_of(item.nodeid), 0) + 1
    marked = {i.nodeid: _REPORT.proves[i.nodeid] for i in session.items
              if i.nodeid in _REPORT.proves}
    Path(path).write_text(json.dumps({"marked": marked, "cases": cases}, indent=1))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _REPORT.ran(report.nodeid, report.when, report.outcome)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _REPORT.cases and not _REPORT.results:
        return
    terminalreporter.section("mpickpt guarantees")
    if _REPORT.results:
        terminalreporter.write_line("the guarantees of README.md and the marked tests that ran:")
        for line in _REPORT.guarantee_lines():
            terminalreporter.write_line(line)
    if _REPORT.cases:
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
