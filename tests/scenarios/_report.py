"""What the scenarios share: how a rank writes its report for the test that runs it."""

from __future__ import annotations

import json
import os
from typing import Any


def write_report(folder: str, name: str, data: dict[str, Any]) -> None:
    """Write one rank's report as ``folder/name`` (JSON), whole or not at all: a file per rank,
    since lines printed by several ranks may interleave."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(f"{path}.tmp", "w") as f:
        json.dump(data, f)
    os.replace(f"{path}.tmp", path)
