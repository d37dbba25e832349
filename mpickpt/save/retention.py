"""Which committed checkpoints to keep: the rules of a retention policy, in one place.

A checkpoint is kept if any rule keeps it, and deleted only when none does:

* ``keep``: the N newest (``None``: every checkpoint is kept and the other rules change nothing);
* ``keep_every``: every step divisible by K, for good (Orbax's ``keep_period``);
* ``best`` with ``keep_best``: the M best by a number in the user metadata (``mode`` "min" or
  "max"; Lightning's ``save_top_k``); a checkpoint without a finite number there is not ranked;
* the newest committed checkpoint is always kept, whatever the rules say;
* a step that a kept incremental checkpoint refers to is kept while that one is.

Used by the Checkpointer after each commit and by ``mpickpt-restore --prune``; torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Policy:
    """A retention policy (see the module docstring)."""

    keep: int | None = None
    keep_every: int | None = None
    best: str | None = None
    mode: str = "min"
    keep_best: int = 0

    @classmethod
    def of(cls, keep: int | None, keep_every: int | None, best: Sequence[str] | None,
           keep_best: int) -> Policy:
        """The policy of the Checkpointer's options (``best``: (metadata key, "min" or "max")),
        checked: ValueError naming a bad one."""
        if best is not None and not (isinstance(best, (tuple, list)) and len(best) == 2
                                     and isinstance(best[0], str)):
            raise ValueError(f"best must be (metadata key, 'min' or 'max'), not {best!r}")
        policy = cls(keep, keep_every, best[0] if best else None, best[1] if best else "min",
                     keep_best)
        policy.check()
        return policy

    def check(self) -> None:
        """ValueError naming the option that cannot be."""
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be at least 1, not {self.keep}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"keep_every must be at least 1, not {self.keep_every}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"the best checkpoint's mode must be 'min' or 'max', not "
                             f"{self.mode!r}")
        if self.keep_best < 0:
            raise ValueError(f"keep_best must be at least 0, not {self.keep_best}")
        if self.keep_best and not self.best:
            raise ValueError(f"keep_best={self.keep_best} needs best=(metadata key, 'min' or "
                             "'max') to rank the checkpoints by")
        if self.keep is None and (self.keep_every or self.keep_best):
            raise ValueError("keep_every and keep_best only matter with keep=N: without keep, "
                             "every checkpoint is kept")
        if self.best and not self.keep_best:
            raise ValueError(f"best={self.best!r} needs keep_best=N (how many of the best to "
                             "keep)")

    @property
    def deletes(self) -> bool:
        """Whether this policy ever deletes a checkpoint."""
        return self.keep is not None

    def describe(self) -> str:
        """The options as given: ``keep=3, keep_every=1000, best=val_loss (min), keep_best=2``."""
        parts = [f"keep={self.keep}"]
        if self.keep_every:
            parts.append(f"keep_every={self.keep_every}")
        if self.best and self.keep_best:
            parts.append(f"best={self.best} ({self.mode}), keep_best={self.keep_best}")
        return ", ".join(parts)


def metric(metadata: Mapping[str, Any], key: str) -> float | None:
    """The finite number under ``key`` in ``metadata``, or None (not ranked)."""
    v = metadata.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def plan(policy: Policy, checkpoints: Sequence[tuple[int, Mapping[str, Any]]],
         references: Mapping[int, Sequence[int]] | None = None
         ) -> tuple[list[int], dict[int, str]]:
    """Apply ``policy`` to the committed checkpoints, given as (step, user metadata) in any
    order: (the steps to delete, newest first; {each kept step: why it is kept}).

    ``references`` gives the older steps each incremental checkpoint refers to: a step a kept
    one refers to is kept too, whatever the rules say (references never chain, so one pass
    finds them all)."""
    steps = sorted({s for s, _ in checkpoints}, reverse=True)
    if not steps:
        return [], {}
    why: dict[int, list[str]] = {s: [] for s in steps}
    why[steps[0]].append("newest")
    if policy.keep is None:
        for s in steps[1:]:
            why[s].append("keep all")
    else:
        for s in steps[1:policy.keep]:
            why[s].append(f"newest {policy.keep}")
    if policy.keep_every:
        for s in steps:
            if s % policy.keep_every == 0:
                why[s].append(f"every {policy.keep_every}")
    if policy.best and policy.keep_best:
        ranked = [(m, s) for s, md in checkpoints
                  if (m := metric(md, policy.best)) is not None]
        # ties: the newer checkpoint first
        ranked.sort(key=lambda ms: (ms[0] if policy.mode == "min" else -ms[0], -ms[1]))
        for _, s in ranked[:policy.keep_best]:
            why[s].append(f"best {policy.keep_best} by {policy.best} ({policy.mode})")
    for s in [s for s in steps if why[s]]:
        for r in (references or {}).get(s, ()):
            if r in why:
                why[r].append(f"referenced by step {s}")
    doomed = [s for s in steps if not why[s]]
    return doomed, {s: ", ".join(dict.fromkeys(r)) for s, r in why.items() if r}
