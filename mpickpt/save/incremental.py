"""Incremental checkpoints: refer to the tensors that did not change instead of writing them again.

Each rank keeps the records of its last committed checkpoint (its :class:`Base`). At the next
save, every tensor of the snapshot is hashed block by block (the digests the writer would compute
anyway, so a changed tensor is not hashed twice) and compared with the base's record of the same
name, dtype, shape and placement: equal digests make a record that refers to the older shard the
bytes lie in (``source``), the others are written. A tensor declared frozen is referred to
without being snapshotted or hashed (:meth:`Tracker.elide`, on the training thread). Rules
that keep it safe:

* **No chains.** A record refers to the file its bytes were written to, never to a record that
  refers further; restore opens each file once and reads each block once.
* **Bounded.** Every ``every``-th save is full (and the first of a job that restored nothing,
  or restored on another number of ranks, and the first after a base file went missing), so a
  checkpoint refers to at most ``every - 1`` older ones. After a restore on as many ranks, the
  restored checkpoint is the base, and the files it refers to count towards the next full save.
* **Cheap when everything changes.** A tensor found changed at two saves in a row is written
  without being compared (a full fine-tune then hashes each block once, as the writer does
  anyway), until every ``every``-th save, after which every tensor is compared again.
* **Checked before use.** A base file whose size is not what its record says (removed, replaced
  by a save of the same step again) is not referred to: that rank writes in full.
* **Committed or nothing.** A checkpoint that refers to older ones is committed by the same vote;
  retention (:func:`mpickpt.save.retention.plan`) keeps every step a kept one refers to.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .. import sharding
from ..format import checksum, rootdir
from ..format.entry import RankEntry
from ..format.iothreads import run_tasks
from ..format.records import TensorRecord
from ..format.shard import byte_view

CHANGED_STREAK = 2


def frozen_matcher(frozen: Sequence[str] | Callable[[str], bool] | None
                   ) -> Callable[[str], bool] | None:
    """A predicate of tensor names from ``frozen``: key paths (a tensor's name, or a prefix of
    it ending before ``/`` or ``.``, e.g. ``"model/base_model"``), or a callable."""
    if frozen is None or callable(frozen):
        return frozen
    if isinstance(frozen, str):
        raise TypeError("frozen must be a list of key paths, not one string")
    exact = frozenset(p.strip("/") for p in frozen)
    if not exact:
        return None
    starts = tuple(p + sep for p in exact for sep in "/.")

    def match(name: str) -> bool:
        return name in exact or name.startswith(starts)

    return match


def frozen_params(module: torch.nn.Module, prefix: str = "model") -> list[str]:
    """The key paths of ``module``'s parameters that do not require grad (frozen base weights
    under LoRA), as they are named in a state ``{prefix: module, ...}``: every name of its
    state dict that holds one, tied weights (an output layer sharing the embedding) included."""
    return [f"{prefix}/{n}" if prefix else n
            for n, p in module.state_dict(keep_vars=True).items()
            if isinstance(p, torch.nn.Parameter) and not p.requires_grad]


@dataclass
class Base:
    """One rank's last committed checkpoint, as later saves refer to it: each tensor's record
    with ``source`` set to the file its bytes lie in (relative to ROOT), and those files' sizes."""

    step: int
    records: dict[str, TensorRecord]
    sources: dict[str, int]
    full: bool  # whether that checkpoint wrote every tensor

    @classmethod
    def of(cls, step: int, entry: RankEntry) -> Base:
        own = f"{rootdir.step_name(step)}/{entry.file}"  # (unused where it has no file)
        records, used = {}, {}
        for r in entry.tensors:
            src = r.source or own
            records[r.name] = TensorRecord(r.name, r.dtype, list(r.shape), r.offset, r.nbytes,
                                           r.checksums, r.global_shape, r.offsets, source=src,
                                           codec=r.codec, chunks=r.chunks)
            used[src] = entry.bytes if src == own else entry.sources[src]
        return cls(step, records, used, not entry.sources)


@dataclass
class Decision:
    """What one save writes and what it refers to."""

    reused: dict[str, TensorRecord] = field(default_factory=dict)  # name -> record in an older file
    digests: dict[str, list[str]] = field(default_factory=dict)  # name -> block digests, computed
    sources: dict[str, int] = field(default_factory=dict)  # the older files referred to
    hashed_bytes: int = 0
    why_full: str | None = None  # why nothing is referred to, when nothing is
    lost: bool = False  # full because a file the base refers to is gone or changed


class Tracker:
    """One rank's incremental state across saves: the base, and how many saves since a full one."""

    def __init__(self, root: str, every: int, frozen: Callable[[str], bool] | None) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 2:
            raise ValueError(f"incremental must be an int of at least 2 (a full checkpoint "
                             f"every that many saves), not {every!r}")
        self.root, self.every, self.frozen = root, every, frozen
        self.base: Base | None = None
        self.since_full = 0  # committed saves since the last full one (that one included)
        self.planned = 0  # what since_full will be once the last decided save commits
        # per tensor, how many saves in a row found it changed: from CHANGED_STREAK on it is
        # written without being compared (a full fine-tune then pays no comparison); every
        # `every`-th decision forgets them all, so that a tensor that stops changing is found
        self.streak: dict[str, int] = {}
        self.decisions = 0

    def elide(self, tensors: Mapping[str, torch.Tensor],
              placements: Mapping[str, sharding.Placement]) -> dict[str, TensorRecord]:
        """On the training thread, before the snapshot: the declared-frozen tensors the next
        save will refer to (the base has them, and that save is not due to be full), with
        their records; they are then neither copied nor hashed."""
        base = self.base
        if self.frozen is None or base is None or self.planned >= self.every:
            return {}
        return {n: r for n, t in tensors.items()
                if self.frozen(n) and (r := base.records.get(n)) is not None
                and _same_layout(r, t, placements.get(n))}

    def decide(self, step: int, host: Mapping[str, torch.Tensor],
               placements: Mapping[str, sharding.Placement], block: int, threads: int,
               elided: Mapping[str, TensorRecord] | None = None) -> Decision:
        """Which tensors of this save are unchanged since the base (referred to) and the block
        digests of the others (for the writer); ``elided`` (not snapshotted, see
        :meth:`elide`) are referred to whatever else is decided."""
        d = self._decide(step, host, placements, block, threads)
        self.planned = 1 if d.why_full is not None and not elided else self.since_full + 1
        if elided:
            for name, r in self._elided(elided).items():
                assert r.source is not None
                d.reused[name] = r
                d.sources[r.source] = self._size_of(r.source)
        return d

    def _elided(self, elided: Mapping[str, TensorRecord]) -> dict[str, TensorRecord]:
        """The records of the elided tensors, from the current base where it has them (a save
        committed since they were elided)."""
        base = self.base
        out = {}
        for name, r in elided.items():
            now = base.records.get(name) if base is not None else None
            same = now is not None and (now.dtype, now.shape, now.global_shape, now.offsets) == \
                (r.dtype, r.shape, r.global_shape, r.offsets)
            out[name] = now if same and now is not None else r
        return out

    def _size_of(self, source: str) -> int:
        """The size of an older shard an elided tensor refers to; CheckpointError if it is gone
        (the save aborts: the tensor was not snapshotted)."""
        from ..errors import CheckpointError

        path = os.path.join(self.root, source)
        expected = self.base.sources.get(source) if self.base is not None else None
        if expected is None:  # referred to by an earlier base only: as big as it is now
            try:
                return os.lstat(path).st_size
            except OSError as e:
                raise CheckpointError(f"{path}, which a frozen tensor of this save refers to: "
                                      f"{e.strerror}") from None
        why = size_problem(path, expected)
        if why is not None:
            raise CheckpointError(f"{why}; a frozen tensor of this save refers to it")
        return expected

    def _decide(self, step: int, host: Mapping[str, torch.Tensor],
                placements: Mapping[str, sharding.Placement], block: int, threads: int
                ) -> Decision:
        base = self.base
        why = None
        if base is None:
            why = "no earlier checkpoint of this run to refer to"
        elif self.since_full >= self.every:
            why = f"every {self.every}th checkpoint is full"
        elif base.step >= step:
            why = f"step {step} is not newer than the base, step {base.step}"
        elif (why := self._missing(base)) is not None:
            return Decision(why_full=why, lost=True)
        self.decisions += 1
        if why is not None or self.decisions % self.every == 0:
            self.streak.clear()  # every tensor is compared again after this save
        if why is not None:
            return Decision(why_full=why)
        assert base is not None
        d = Decision()
        candidates = []
        for name, t in host.items():
            old = base.records.get(name)
            if old is None or not _same_layout(old, t, placements.get(name)):
                continue
            if self.frozen is not None and self.frozen(name):
                d.reused[name] = old
            elif self.streak.get(name, 0) < CHANGED_STREAK:
                candidates.append((name, t, old))
            else:  # changed at each of the last saves: written without comparing
                self.streak[name] += 1
        sums = {name: [""] * checksum.block_count(old.nbytes, block) for name, _, old in candidates}
        views = {name: byte_view(t) for name, t, _ in candidates}

        def task(i: int, b: int) -> None:
            name = candidates[i][0]
            sums[name][b] = checksum.digest(views[name][b * block: (b + 1) * block])

        tasks = [(i, b) for i, (name, _, _) in enumerate(candidates)
                 for b in range(len(sums[name]))]
        run_tasks(tasks, task, threads, background=True)
        for name, _, old in candidates:
            d.hashed_bytes += old.nbytes
            if sums[name] == old.checksums:
                d.reused[name] = old
                self.streak[name] = 0
            else:
                d.digests[name] = sums[name]
                self.streak[name] = self.streak.get(name, 0) + 1
        for r in d.reused.values():
            assert r.source is not None
            d.sources[r.source] = base.sources[r.source]
        return d

    def _missing(self, base: Base) -> str | None:
        """Why a file the base refers to cannot be referred to (gone, or of another size)."""
        for src, size in base.sources.items():
            why = size_problem(os.path.join(self.root, src), size)
            if why is not None:
                return why
        return None

    def committed(self, step: int, entry: RankEntry) -> None:
        """A save committed: it is the base of the next."""
        self.base = Base.of(step, entry)
        self.since_full = 1 if self.base.full else self.since_full + 1
        self.planned = max(self.planned, self.since_full)

    def forget(self) -> None:
        """Before a restore: until one succeeds, the next save is full."""
        self.base, self.since_full, self.planned = None, 0, 0

    def resume(self, step: int, entry: RankEntry) -> None:
        """After a restore on as many ranks as wrote it: this rank's entry of the checkpoint
        restored (as the restore parsed it) is the base of the next save, and the shards it
        refers to count towards the next full one."""
        self.base = Base.of(step, entry)
        self.since_full = self.planned = len(self.base.sources)


def size_problem(path: str, size: int) -> str | None:
    """Why an older shard cannot be referred to as ``size`` bytes (gone, or of another size),
    or None."""
    try:
        actual = os.lstat(path).st_size
    except OSError as e:
        return f"{path}: {e.strerror}"
    if actual != size:
        return f"{path} has {actual} bytes, not the {size} its records were written in"
    return None


def _same_layout(r: TensorRecord, t: torch.Tensor, p: sharding.Placement | None) -> bool:
    """Whether record ``r`` could hold tensor ``t`` (placed as ``p``) unchanged."""
    from ..format import dtypes

    if r.dtype != dtypes.name_of(t.dtype) or list(r.shape) != list(t.shape):
        return False
    if p is None:
        return r.global_shape is None
    return r.global_shape == list(p.global_shape) and r.offsets == list(p.offsets)
