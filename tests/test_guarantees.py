"""The guarantees README.md states are the registry of tests/guarantees.py, each one is proved by
tests marked with its id, and docs/testing.md's list of those tests is the one the markers give.

No MPI: the markers come from one ``pytest --collect-only`` of tests/ in a subprocess (a few
seconds), through the same conftest hooks that feed the guarantee report.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from guarantees import (
    BLOCK,
    BY_ID,
    DOC,
    GUARANTEES,
    GuaranteeReport,
    collect,
    markdown,
    proved_by,
)
from harness import REPO


@pytest.fixture(scope="module")
def collected() -> dict:
    return collect()


def numbered_list(text: str) -> list[tuple[int, str]]:
    """The first Markdown numbered list in ``text``: (number, item text on one line), the items'
    nested bullet lists left out."""
    items: list[tuple[int, str]] = []
    for line in text.splitlines():
        if m := re.match(r"(\d+)\. (.*)", line):
            items.append((int(m.group(1)), m.group(2).strip()))
        elif items and line.startswith(" ") and line.lstrip().startswith("- "):
            continue
        elif items and line.startswith(" ") and line.strip():
            items[-1] = (items[-1][0], f"{items[-1][1]} {line.strip()}")
        elif items and line.strip():
            break
    return items


def section(text: str, heading: str) -> str:
    m = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^#{{1,{heading.index(' ')}}} |\Z)", text,
                  re.S | re.M)
    assert m, f"no section {heading!r}"
    return m.group(1)


def test_the_registry_has_unique_ids_and_one_line_statements():
    assert len(BY_ID) == len(GUARANTEES)
    for g in GUARANTEES:
        assert re.fullmatch(r"[a-z]+(-[a-z]+)*", g.id), g.id
        assert g.statement.endswith(".") and "\n" not in g.statement, g.statement
        assert g.statement == " ".join(g.statement.split()), g.statement


def test_every_guarantee_is_proved_by_a_marked_test(collected):
    proved = {gid for ids in collected["marked"].values() for gid in ids}
    assert proved <= set(BY_ID), f"markers name no registered guarantee: {proved - set(BY_ID)}"
    unproved = [g.id for g in GUARANTEES if g.id not in proved]
    assert not unproved, f"no test is marked @pytest.mark.guarantee(ID) for {unproved}"


# test modules left out of the quick tier, and why (./launch/test --quick)
NOT_QUICK = {
    "tests/faults/test_fault_many_ranks.py": "16 and 32 ranks on 2 cores take a minute; the "
                                             "fault matrix and tests/multirank/test_index.py "
                                             "try the same faults and indexes on fewer",
    "tests/slurm/test_slurm_jobs.py": "each job waits for Slurm to signal, requeue and start "
                                      "it again (30 s to 2.5 min); test_slurm_smoke.py starts "
                                      "the same Slurm and runs a job on it",
    "tests/slurm/test_slurm_levels.py": "as test_slurm_jobs.py; tests/multirank/test_levels.py "
                                        "tries the node-local level outside Slurm",
}


def test_the_quick_tier_proves_every_guarantee_and_runs_every_test_module(collected):
    quick = set(collected["quick"])
    proved = {gid for nodeid, ids in collected["marked"].items() if nodeid in quick
              for gid in ids}
    assert [g.id for g in GUARANTEES if g.id not in proved] == [], \
        "a guarantee no quick test proves: mark one of its tests @pytest.mark.quick"
    modules = {n.split("::")[0] for n in collected["cases"]}
    touched = {n.split("::")[0] for n in quick}
    assert sorted(modules - touched - set(NOT_QUICK)) == [], \
        "a test module with no quick test: mark one @pytest.mark.quick or say why in NOT_QUICK"
    assert set(NOT_QUICK) <= modules - touched


def test_a_marker_that_names_no_registered_guarantee_is_refused():
    def item(*marks: tuple) -> SimpleNamespace:
        found = [SimpleNamespace(args=args, kwargs={}) for args in marks]
        return SimpleNamespace(nodeid="tests/x.py::t", iter_markers=lambda name: iter(found))

    assert proved_by(item(("no-hang", "no-torn-load"), ("no-hang",))) == ["no-hang",
                                                                          "no-torn-load"]
    assert proved_by(item()) == []
    with pytest.raises(ValueError, match=r"tests/x.py::t: .*\('no-such'\) names no guarantee"):
        proved_by(item(("no-hang",), ("no-such",)))
    with pytest.raises(ValueError, match="takes guarantee ids only, at least one"):
        proved_by(item(()))


def test_readme_states_exactly_the_registrys_guarantees():
    brief = section((REPO / "README.md").read_text(), "## Guarantees in brief")
    items = numbered_list(brief)
    assert [n for n, _ in items] == list(range(1, len(items) + 1)), items
    assert [s for _, s in items] == [g.statement for g in GUARANTEES]


def test_docs_testing_lists_the_marked_tests_the_generator_gives(collected):
    m = BLOCK.search(DOC.read_text())
    assert m, "docs/testing.md has no '<!-- guarantees: generated ... -->' block"
    assert m.group(2) == markdown(collected), \
        "docs/testing.md's list is out of date: run python tests/guarantees.py --write"
    stated = [re.match(r"\*\*(.*)\*\* `([a-z-]+)`:$", s) for _, s in numbered_list(m.group(2))]
    assert [(x.group(1), x.group(2)) for x in stated if x] == \
        [(g.statement, g.id) for g in GUARANTEES]


def test_docs_testing_says_how_each_guarantee_is_proved_in_the_registrys_order():
    how = section(DOC.read_text(), "### How each guarantee is proved")
    heads = [re.match(r"\*\*`([a-z-]+)`\.\*\*", s) for _, s in numbered_list(how)]
    assert [h.group(1) if h else None for h in heads] == [g.id for g in GUARANTEES]


def test_the_report_lists_per_guarantee_the_tests_that_ran_and_keeps_counting_cases(
        tmp_path, monkeypatch):
    report = GuaranteeReport()
    report.record("fault-matrix", "kill/rank0/mid-write/n2", "correct")
    report.record("fault-matrix", "hang/rank0/mid-write/n2", "hang", "outlived 90 s")
    report.collected("m.py::t[a]", ["no-torn-load", "no-hang"])
    report.collected("m.py::t[b]", ["no-torn-load"])
    report.collected("m.py::u", ["no-hang"])
    report.collected("m.py::v", ["no-hang"])
    report.collected("m.py::w", [])
    for when in ("setup", "call", "teardown"):
        report.ran("m.py::t[a]", when, "passed")
        report.ran("m.py::t[b]", when, "passed")
        report.ran("m.py::w", when, "passed")
    report.ran("m.py::u", "setup", "passed")
    report.ran("m.py::u", "call", "failed")
    report.ran("m.py::u", "teardown", "passed")
    report.ran("m.py::v", "setup", "skipped")
    report.ran("m.py::v", "teardown", "passed")

    by_id = {g["id"]: g for g in report.by_guarantee()}
    assert list(by_id) == list(BY_ID)
    assert by_id["no-torn-load"]["passed"] == ["m.py::t[a]", "m.py::t[b]"]
    assert (by_id["no-hang"]["passed"], by_id["no-hang"]["failed"],
            by_id["no-hang"]["skipped"]) == (["m.py::t[a]"], ["m.py::u"], ["m.py::v"])
    assert by_id["flat-forever"]["passed"] == []
    lines = report.guarantee_lines()
    assert " 1. no-torn-load: 2 passed" in lines
    assert "      passed  m.py::t (2 cases)" in lines
    assert " 2. no-hang: 1 passed, 1 failed, 1 skipped" in lines
    assert "      failed  m.py::u" in lines and "      skipped m.py::v" in lines
    assert " 8. flat-forever: no test of it ran" in lines

    monkeypatch.setenv("MPICKPT_REPORT", str(tmp_path / "g.json"))
    written = json.loads(report.write().read_text())
    assert (written["cases_run"], written["restores_correct"], written["torn_loads"],
            written["silent_wrong_loads"], written["hangs"]) == (2, 1, 0, 0, 1)
    assert written["by_suite"]["fault-matrix"]["hang"] == 1
    assert [g["id"] for g in written["guarantees"]] == list(BY_ID)
    assert written["guarantees"][0]["statement"] == GUARANTEES[0].statement
