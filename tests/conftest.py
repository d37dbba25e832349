"""Shared fixtures; the helpers they use live in harness.py."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from guarantees import MAP_ENV, GuaranteeReport, function_of, proved_by
from harness import MPICH_SEGMENTS, WARMSTART, orphan_segments, train
from warmstart import SOCKET_ENV as WARM_SOCKET

_REPORT = GuaranteeReport()


@pytest.fixture(scope="session", autouse=True)
def warm_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Start tests/warmstart.py's server for this session (one per pytest-xdist worker): the
    ranks of the tests' MPI jobs are forked from it with PyTorch imported already.
    ``MPICKPT_WARM=0`` starts none (every rank imports everything itself)."""
    if os.environ.get("MPICKPT_WARM") == "0" or os.environ.get(WARM_SOCKET):
        yield
        return
    sock = tmp_path_factory.getbasetemp() / "warm.sock"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    log = open(tmp_path_factory.getbasetemp() / "warm.log", "w")  # noqa: SIM115
    server = subprocess.Popen([sys.executable, "-u", str(WARMSTART), "--serve", str(sock)],
                              stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True,
                              text=True)
    assert server.stdout is not None
    ready = server.stdout.readline().strip()  # after its imports: a few seconds
    if ready != "ready":
        server.kill()
        pytest.fail(f"the warm-start server did not start: {ready!r}")
    os.environ[WARM_SOCKET] = str(sock)
    try:
        yield
    finally:
        del os.environ[WARM_SOCKET]
        server.kill()
        server.wait()
        log.close()


@pytest.fixture(scope="session", autouse=True)
def mpich_segments_left() -> Iterator[None]:
    """Remove the MPICH shared-memory segments this session's killed ranks left behind
    (:func:`harness.orphan_segments`), once the session is over."""
    before = set(glob.glob(MPICH_SEGMENTS))
    yield
    for path in orphan_segments(set(glob.glob(MPICH_SEGMENTS)) - before):
        with contextlib.suppress(OSError):  # (gone meanwhile)
            os.unlink(path)


@pytest.fixture(scope="session")
def guarantees() -> GuaranteeReport:
    """Where fault, corruption and soak cases are counted (see guarantees.py)."""
    return _REPORT


CASES, PROVES = "mpickpt-cases", "mpickpt-proves"  # what a test's report carries (below)


TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m selects: the quick marks below count
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Note which guarantees each test proves (@pytest.mark.guarantee); refuse a marker that
    names no guarantee of guarantees.py. Every test of the in-process modules (tests/test_*.py,
    no MPI job) is in the quick tier (``-m quick``); of the others, those marked quick."""
    for item in items:
        if item.path.parent == TESTS:
            item.add_marker(pytest.mark.quick)
        try:
            _REPORT.collected(item.nodeid, proved_by(item))
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (``-n N``): each worker takes a whole *unit* at a time
    (:func:`scheduling.unit`: a module, so its module fixtures run once; Slurm's modules as one;
    the fault matrices cut into groups of cells), the costliest units first."""
    from scheduling import make_scheduler

    return make_scheduler(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """The cases a test recorded, and the guarantees it proves, go with its report (under
    pytest-xdist the worker's report travels to the process that prints the summary)."""
    outcome = yield
    report = outcome.get_result()
    extra = []
    cases = _REPORT.take_pending()
    if cases:
        extra.append((CASES, cases))
    if call.when == "setup" and item.nodeid in _REPORT.proves:
        extra.append((PROVES, _REPORT.proves[item.nodeid]))
    if extra:  # a new list: the item's own is shared by its setup, call and teardown reports
        report.user_properties = [*report.user_properties, *extra]
    return None


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
    quick = [i.nodeid for i in session.items if i.get_closest_marker("quick")]
    Path(path).write_text(json.dumps({"marked": marked, "cases": cases, "quick": quick},
                                     indent=1))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    nodeid = report.nodeid
    for key, value in report.user_properties:
        if key == CASES:
            _REPORT.add(value)
        elif key == PROVES:
            _REPORT.collected(nodeid, value)
    _REPORT.ran(nodeid, report.when, report.outcome)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if hasattr(terminalreporter.config, "workerinput"):
        return  # a pytest-xdist worker: the controller reports
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


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that allocated the snapshot pool's buffers, in order."""
    import threading

    from mpickpt.save.pinned_pool import HostPool

    threads: list[str] = []
    real = HostPool._new

    def spy(self: HostPool, nbytes: int) -> object:
        threads.append(threading.current_thread().name)
        return real(self, nbytes)

    monkeypatch.setattr(HostPool, "_new", spy)
    return threads
