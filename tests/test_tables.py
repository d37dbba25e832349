"""The tables the docs show are the code's: environment variables (mpickpt/knobs.py) and exit
codes (mpickpt/exitcodes.py); no module reads an MPICKPT_ variable but through knobs."""

from __future__ import annotations

import re

import pytest
from harness import REPO

from mpickpt import exitcodes, knobs, run


def block(doc: str, what: str) -> str:
    """The generated table after ``<!-- WHAT: generated ... -->`` in docs/DOC."""
    text = (REPO / "docs" / doc).read_text()
    m = re.search(rf"<!-- {what}: generated [^>]*-->\n(.*?)\n<!-- end -->", text, re.S)
    assert m, f"docs/{doc} has no generated {what} table"
    return m.group(1)


def test_the_environment_variables_table_is_knobs():
    assert block("using.md", "knobs") == knobs.markdown_table()


@pytest.mark.parametrize("doc, codes", [("using.md", exitcodes.JOB),
                                        ("operations.md", exitcodes.TOOLS)])
def test_the_exit_code_tables_are_exitcodes(doc, codes):
    assert block(doc, "exit codes") == exitcodes.markdown_table(codes)


def test_the_run_wrappers_help_lists_the_jobs_exit_codes():
    listed = re.findall(r"^ {4}(\d+) +(EXIT_[A-Z_]+) ", run.__doc__, re.M)
    assert [(int(v), n) for v, n in listed] == [(c.value, c.name) for c in exitcodes.JOB]
    for c in exitcodes.JOB:
        assert getattr(exitcodes, c.name) == c.value


def test_every_mpickpt_variable_is_a_knob_and_read_only_through_knobs():
    names = {k.name for k in knobs.ALL}
    for path in (REPO / "mpickpt").rglob("*.py"):
        text = path.read_text()
        for name in set(re.findall(r"MPICKPT_[A-Z_]+", text)):
            assert name in names, f"{path.relative_to(REPO)} mentions {name}, not in knobs.py"
        if path.name != "knobs.py":
            assert not re.search(r"environ[^\n]*MPICKPT_", text), \
                f"{path.relative_to(REPO)} reads an MPICKPT_ variable itself"


def test_a_bad_value_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="MPICKPT_TIMEOUT='soon': expected seconds"):
        knobs.TIMEOUT.get({"MPICKPT_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="MPICKPT_REQUEUE='yes': must be 0 or 1"):
        knobs.REQUEUE.get({"MPICKPT_REQUEUE": "yes"})
    assert knobs.SIGNAL.get({"MPICKPT_SIGNAL": "usr1"}) == "SIGUSR1"
    assert knobs.DEADLINE.get({}) is None and knobs.TIMEOUT.get({"MPICKPT_TIMEOUT": " "}) == 900
