"""What ``mpickpt-restore`` plans besides the rollback: ``--prune`` (the good checkpoints a
retention policy does not keep, deleted with the reason for each kept one), and which
checkpoints it must leave in place (those a staying incremental checkpoint refers to, and, when
ROOT looks node-local, those that may hold the only copy of some rank's shards)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ranks import ranks_text
from ..save import retention
from . import catalog, diagnose, verify
from .changes import Changes


def describe_policy(pol: retention.Policy) -> str:
    """The policy as its command-line options."""
    text = f"--keep {pol.keep}"
    if pol.keep_every:
        text += f" --keep-every {pol.keep_every}"
    if pol.best:
        text += f" --best {pol.best}:{pol.mode} --keep-best {pol.keep_best}"
    return text


def referenced(s: verify.Survey, planned: set[str]) -> dict[int, int]:
    """{older step: a loadable checkpoint staying in place that refers to its files}: moving
    those would break incremental checkpoints that verify."""
    out: dict[int, int] = {}
    for e in s.committed:
        if e.status in catalog.LOADABLE and e.path not in planned and e.manifest is not None:
            for r in e.manifest.references:
                out.setdefault(r, e.step if e.step is not None else -1)
    return out


def stranded(s: verify.Survey) -> dict[str, str]:
    """When ROOT looks node-local (``s.not_shared``): the directories that may hold the only copy
    of some rank's shards, and why; restore leaves them where they are."""
    if s.not_shared is None:
        return {}
    missing, present = s.not_shared["missing_ranks"], s.not_shared["present_ranks"]
    if not s.committed:  # another node's copy: partial directories of the other ranks' shards
        return {e.path: f"it holds the shards of {ranks_text(present)}, not rank 0's, and may "
                "be their only copy" for e in s.entries
                if e.status == "partial" and ".partial-" in e.name}
    return {e.path: f"the shards of {ranks_text(missing)} are not here, probably on another node"
            for e in s.committed
            if e.manifest is not None and diagnose.absent_ranks(e.path, e.manifest) == missing}


@dataclass
class Pruning:
    """What --prune decided: {kept step: why} newest first, the steps deleted, and those --best
    could not rank (no finite number under its key)."""

    policy: retention.Policy
    kept: dict[int, str]
    deleted: list[int]
    unranked: list[int]

    def to_json(self) -> dict[str, Any]:
        return {"policy": describe_policy(self.policy),
                "kept": [{"step": st, "why": why} for st, why in self.kept.items()],
                "deleted": self.deleted, "unranked": self.unranked}


def prune(s: verify.Survey, chosen: catalog.Entry, changes: Changes,
          pol: retention.Policy) -> Pruning:
    """Plan the deletion of the good checkpoints ``pol`` does not keep, among the chosen one and
    those older (newer ones are being rolled back)."""
    assert chosen.step is not None
    planned = {a.path for a in changes.actions}
    good = {e.step: e for e in s.committed
            if e.status in catalog.LOADABLE and e.step is not None and e.step <= chosen.step
            and e.path not in planned}
    doomed, kept = retention.plan(pol, [(st, e.manifest.metadata if e.manifest else {})
                                        for st, e in good.items()],
                                  {st: e.manifest.references if e.manifest else []
                                   for st, e in good.items()})
    for st in doomed:
        changes.delete(good[st], f"pruned: no rule of {describe_policy(pol)} keeps it")
    unranked = [] if not pol.best else [
        st for st, e in good.items()
        if retention.metric(e.manifest.metadata if e.manifest else {}, pol.best) is None]
    return Pruning(pol, dict(sorted(kept.items(), reverse=True)), doomed,
                   sorted(unranked, reverse=True))
