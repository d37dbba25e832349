"""The guarantee report: every fault, corruption and soak case counted by outcome.

Tests record each case through the ``guarantees`` fixture (tests/conftest.py) *before* asserting,
so a failing case is counted too. At the end of the session the counts are printed and written as
JSON to ``$MPICKPT_REPORT`` (default ``test-report/guarantees.json`` at the repository root).

Outcomes:

- ``correct``: every rank restored the expected checkpoint bit for bit, or, when none was
  loadable, every rank refused with a clear error and left its state untouched; for a save-side
  case (a full disk, a soak), the property the case checks held.
- ``torn``: ranks loaded different steps, or one rank's state mixes data of two steps.
- ``silent-wrong``: a restore reported success but loaded something other than what was saved at
  the expected step (another step without saying why, or different bytes).
- ``hang``: a job did not end by itself within its timeout.
- ``failed``: anything else the case did not expect (a crash, a wrong error, a lost checkpoint).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

OUTCOMES = ("correct", "torn", "silent-wrong", "hang", "failed")
REPO = Path(__file__).resolve().parent.parent


@dataclass
class GuaranteeReport:
    """Cases recorded during one pytest session."""

    cases: list[dict[str, str]] = field(default_factory=list)

    def record(self, suite: str, case: str, outcome: str, detail: str = "") -> None:
        """Count one case of ``suite`` (e.g. "fault-matrix", "corruption", "disk", "soak")."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is not one of {OUTCOMES}")
        self.cases.append({"suite": suite, "case": case, "outcome": outcome, "detail": detail})

    def summary(self) -> dict[str, object]:
        total = Counter(c["outcome"] for c in self.cases)
        suites: dict[str, dict[str, int]] = {}
        for c in self.cases:
            suites.setdefault(c["suite"], dict.fromkeys(OUTCOMES, 0))[c["outcome"]] += 1
        return {
            "cases_run": len(self.cases),
            "restores_correct": total["correct"],
            "torn_loads": total["torn"],
            "silent_wrong_loads": total["silent-wrong"],
            "hangs": total["hang"],
            "other_failures": total["failed"],
            "by_suite": suites,
            "not_correct": [c for c in self.cases if c["outcome"] != "correct"],
        }

    def lines(self) -> list[str]:
        s = self.summary()
        out = [f"{'suite':<16} " + " ".join(f"{o:>12}" for o in OUTCOMES)]
        for suite, counts in sorted(s["by_suite"].items()):  # type: ignore[union-attr]
            out.append(f"{suite:<16} " + " ".join(f"{counts[o]:>12}" for o in OUTCOMES))
        out.append(f"cases run {s['cases_run']}, restores correct {s['restores_correct']}, "
                   f"torn loads {s['torn_loads']}, silent wrong loads "
                   f"{s['silent_wrong_loads']}, hangs {s['hangs']}, other failures "
                   f"{s['other_failures']}")
        for c in s["not_correct"]:  # type: ignore[union-attr]
            out.append(f"  {c['outcome']}: {c['suite']} {c['case']}: {c['detail']}")
        return out

    def write(self) -> Path:
        path = Path(os.environ.get("MPICKPT_REPORT", REPO / "test-report" / "guarantees.json"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**self.summary(), "cases": self.cases}, indent=1) + "\n")
        return path
