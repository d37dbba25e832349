"""Helpers shared by the fault tests: what is on disk under ROOT, and what a job reported."""

from __future__ import annotations

import json
import re
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d{8})$")




def committed_steps(root: Path) -> list[int]:
    """Steps of the committed checkpoints (``step-XXXXXXXX/MANIFEST.json`` present), ascending."""
    return sorted(
        int(m.group(1)) for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / "MANIFEST.json").is_file()
    )


def step_dirs(root: Path) -> list[str]:
    """Names of every ``step-...`` entry under ROOT: committed, partial, or on its way out."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def partials(root: Path, step: int | None = None) -> list[Path]:
    prefix = f"step-{step:08d}.partial-" if step is not None else "step-"
    return sorted(p for p in root.iterdir() if p.name.startswith(prefix) and ".partial-" in p.name)






def losses(out: Path, n: int) -> list[list[float]]:
    return [json.loads((out / f"rank-{r}.json").read_text())["losses"] for r in range(n)]


def reports(where: Path) -> dict[int, dict]:
    """The reports a scenario's ranks wrote to ``where``/rank-R.json, by rank."""
    found = [json.loads(p.read_text()) for p in where.glob("rank-*.json")] if where.exists() else []
    return {r["rank"]: r for r in found}


def agreed_step(found: dict[int, dict], n: int, returncode: int = 0
                ) -> tuple[str | None, object]:
    """(None, the step every one of ``n`` ranks reports it restored), or, as the guarantee
    report counts it, ("failed", why) when the job failed or a rank's report is missing and
    ("torn", why) when the ranks restored different steps."""
    if returncode != 0 or sorted(found) != list(range(n)):
        return "failed", f"the job exited {returncode} with reports of ranks {sorted(found)}"
    steps = {rep["step"] for rep in found.values()}
    if len(steps) > 1:
        return "torn", f"the ranks restored steps {sorted(steps, key=str)}"
    return None, steps.pop()
