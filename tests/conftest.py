"""Shared fixtures; the helpers they use live in harness.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import train


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
