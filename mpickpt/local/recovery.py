"""Restore from the node-local level: make one local checkpoint whole on every node, or say why
it cannot be.

For a step that some node committed locally, collectively:

1. every rank lists what its node's directory holds for the step (manifest, shards, parity); the
   lowest rank that has the manifest sends it and the redundancy layout to all;
2. every rank verifies its own shard there, every checksum (a replaced node has none);
3. every rank decides the same plan from what all reported: a rank whose shard is missing or
   damaged gets it from a rank of another node that holds a copy (``partner``), else rebuilds
   it with its XOR team (every other member whole, with its parity), else the step cannot be
   had from the local level;
4. the copies move and the rebuilds run over MPI; each rebuilt shard is verified against the
   manifest and an allreduce says whether every rank now has its verified shard;
5. a node that held no copy of the step gets it back as a save gives it: its ranks' shards are
   rebuilt into the node's partial directory, and its leader publishes it with the manifest and
   the layout (:meth:`~mpickpt.local.nodedir.NodeDir.publish`, the one commit); a node that
   holds the step has a damaged or missing shard replaced in place.

These are the node store's save steps backwards (:mod:`mpickpt.local.nodestore`): what its
``publish`` committed is found, what its ``protect`` spread brings a shard back, and a node
that lost everything is ``publish``-ed again.

Nothing is loaded into the state here: :class:`mpickpt.restore.restorer.Restorer` then loads the
step from each rank's own node directory, as it loads one from ROOT.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import faults, log
from ..errors import ManifestError, ShardError
from ..format import rootdir
from ..format.blocks import verify_file
from ..format.manifest import NAME as MANIFEST
from ..format.manifest import Manifest, read_bytes
from ..format.names import RANK_FILE_RE, shard_name
from ..format.reader import Span
from ..format.records import check_file, check_records
from ..format.rollback import NAME as ROLLBACK
from ..format.rollback import Rollback
from ..mpi import protocol
from ..mpi.protocol import Protocol, ranks_text
from ..save.store import discard
from . import filemap, xorring
from .exchange import WINDOW, copy_over
from .level import LocalLevel
from .lostplan import plan, receivers
from .nodedir import LEVEL, PARITY_RE
from .ring import Ring
from .xorteam import landable, xor_land, xor_team


@dataclass
class Recovered:
    """Where this rank's shard of the step came from, and what moved over the network."""

    # "own", "partner copy from rank R", "XOR rebuild" (into its files, then loaded), "XOR
    # rebuild into the restore" (xorlanding.py)
    source: str = "own"
    received: int = 0
    rebuilt: list[int] = field(default_factory=list)  # every rank whose shard was rebuilt
    # seconds of each phase on this rank: inventory, verify, transfer, verify-rebuilt,
    # republish (the load that follows is the Restorer's)
    phases: dict[str, float] = field(default_factory=dict)


class LocalRecovery:
    """The restore side of the node-local level, for one Checkpointer."""

    def __init__(self, proto: Protocol, level: LocalLevel, io_threads: int,
                 log: logging.Logger, run_id: str) -> None:
        self.proto, self.level, self.io_threads, self.log = proto, level, io_threads, log
        self.run_id = run_id
        self.rank, self.size = proto.rank, proto.size
        self.last = Recovered()
        self.manifest: Manifest | None = None  # of the step last prepared, parsed once
        self.served: dict[int, int] = {}  # lost rank -> the rank that serves its shard's bytes
        self._pending: tuple[Any, ...] | None = None  # a write-back after a served restore
        self._xor: tuple[Any, ...] | None = None  # the XOR rebuilds a served restore lands

    def path(self, step: int) -> str:
        return self.level.nodedir.final(step)

    def path_of(self, rank: int, step: int) -> str:
        """Where ``rank``'s node holds ``step`` (its directory of the level, on that node): how
        a rank names the copy another rank served it."""
        node = self.level.nodedir.dir_of(self.level.topology.nodes[rank])
        return os.path.join(node, rootdir.step_name(step))

    def steps(self, undo: Rollback | None = None) -> list[int]:
        """The steps any node committed locally, newest first (collective). With ``undo``
        (ROOT's rollback in effect), the steps it undoes are left out and removed from every
        node (:mod:`mpickpt.format.rollback`); rank 0 logs which."""
        mine, gone = [], []
        if self.level.leader:
            for step in self.level.nodedir.committed():
                if undo is not None and undo.excludes(step, _written(self.path(step))):
                    gone.append(step)
                else:
                    mine.append(step)
            for step in gone:
                try:
                    rootdir.remove(self.path(step), "rollback")
                except OSError as e:
                    self.log.warning("could not remove %s, undone by %s: %s", self.path(step),
                                     ROLLBACK, log.os_error(e, self.path(step)))
        parts = self.proto.allgather((mine, gone), "local-list")
        undone = sorted({s for _, g in parts for s in g})
        if undone and undo is not None and self.rank == 0:
            self.log.warning("%s: discarding step(s) %s of the local level, saved before it "
                             "(%s)", undo.describe(), ", ".join(map(str, undone)),
                             self.level.nodedir.base)
        return sorted({s for m, _ in parts for s in m} - set(undone), reverse=True)

    def _inventory(self, d: str) -> tuple[bool, list[int], list[int]]:
        """(manifest there, ranks whose shard file is there, ranks whose parity is there)."""
        try:
            names = os.listdir(d)
        except OSError:
            return False, [], []
        shards = [int(m.group(1)) for n in names if (m := RANK_FILE_RE.match(n))]
        parity = [int(m.group(1)) for n in names if (m := PARITY_RE.match(n))]
        return MANIFEST in names, sorted(shards), sorted(parity)

    def prepare(self, step: int, verify: bool = True, serve: bool = False,
                needs: Callable[[Manifest], set[int]] | None = None) -> str | None:
        """Make ``step`` whole on every node; None, or why it cannot be (the same on every
        rank). Collective. Without ``verify`` a shard counts as whole when it is there with its
        size and records (the load then verifies its checksums). With ``serve``, lost shards
        are not rebuilt first: :attr:`served` names, for each lost rank, the rank whose
        partner copy serves its bytes straight into the restore, or the lost rank itself,
        whose XOR team rebuilds its shard straight into its restore (:meth:`land`), where
        ``needs(manifest)`` (the ranks whose shards a rank's restore reads) says on every rank
        that no other rank reads it (else it is rebuilt first, its parity by
        :meth:`write_back`); :meth:`write_back` rebuilds the files afterwards."""
        d = self.path(step)
        clock = Clock()
        self.served, self._pending, self.manifest, self._xor = {}, None, None, None
        inv = self.proto.allgather(self._inventory(d), "local-inventory")
        holders = [r for r, (has, _, _) in enumerate(inv) if has]
        if not holders:
            return "no node holds its manifest"
        sent = None
        if self.rank == holders[0]:
            try:
                sent = (read_bytes(d).decode(), _read_text(os.path.join(d, LEVEL)), None)
            except (ManifestError, OSError) as e:
                sent = (None, None, str(e))
        text, level_text, err = self.proto.bcast(sent, "local-manifest", root=holders[0])
        if err is not None:
            return err
        try:
            manifest = Manifest.from_json(text, os.path.join(d, MANIFEST))
            layout = json.loads(level_text) if level_text else {}
        except (ManifestError, ValueError) as e:
            return str(e)
        self.manifest = manifest
        if manifest.world_size != self.size:
            return (f"written by {manifest.world_size} ranks, this job has {self.size} (the "
                    "local level restores on as many ranks as saved it; ROOT reshards)")
        clock.lap("inventory")
        mine = self._verify(d, manifest, self.rank, verify)
        problems = self.proto.allgather(mine, "local-verify")
        clock.lap("verify")
        lost = [r for r, p in enumerate(problems) if p]
        moves, xor_lost, why = plan(self.level.topology.nodes, lost, problems, inv, layout)
        if why is not None:
            return why
        if lost and self.rank == 0:
            self.log.warning("step %d: rebuilding the shards of %s from the local level's "
                             "redundancy: %s", step, ranks_text(lost),
                             "; ".join(p for p in problems if p))
        self.last = Recovered(rebuilt=lost, phases=clock.phases)
        if not lost:
            return None
        if xor_lost:  # the rebuild's threads made before the restore's reads page-lock
            xorring.prestart()
            filemap.prestart()
            protocol.prestart()
        if serve and (not xor_lost or landable(self.proto, manifest, xor_lost, needs)):
            self.served = {r: dn for dn, r in moves} | {r: r for r in xor_lost.values()}
            self._pending = ("copies", (step, inv[self.rank][0], manifest, text, level_text,
                                        moves, xor_lost, layout))
            self._xor = (step, manifest, xor_lost, layout) if xor_lost else None
            self.last.source = self._source(moves)
            return None
        later = serve and bool(xor_lost)  # the lost parity after the restore, off its path
        why, received = self._rebuild(step, inv[self.rank][0], manifest, text, level_text,
                                      moves, xor_lost, layout, verify, clock,
                                      "shard" if later else "both")
        if why is None:
            self.last.source, self.last.received = self._source(moves), received
            if later:
                self._pending = ("parity", (step, manifest, xor_lost, layout))
        return why

    def land(self, spans: list[Span], ring: Ring | None) -> str | None:
        """The XOR teams that lost a member rebuild it straight into its restore
        (:func:`~mpickpt.local.xorteam.xor_land`: into ``spans`` through ``ring``'s slots).
        Collective, after :meth:`prepare` served XOR rebuilds. This rank's error, or None."""
        assert self._xor is not None
        step, manifest, xor_lost, layout = self._xor
        window, buffers = self._transfer()
        return xor_land(self.proto, self.path(step), manifest, xor_lost, layout, spans, ring,
                        min(window, xorring.BLOCK), buffers)

    def _transfer(self) -> tuple[int, Callable[[str, int], memoryview]]:
        """(The bytes a rebuild moves at a time, its reused buffers): the level's exchange's."""
        ex = self.level.exchange
        return (ex.window, ex.buffer) if ex is not None else (WINDOW, _Buffers().get)

    def _source(self, moves: list[tuple[int, int]]) -> str:
        """Where this rank's shard of the step comes from (``moves``: (donor, receiver))."""
        donor = {r: dn for dn, r in moves}.get(self.rank)
        return ("own" if self.rank not in self.last.rebuilt else
                f"partner copy from rank {donor}" if donor is not None else
                "XOR rebuild into the restore" if self._xor is not None else "XOR rebuild")

    def write_back(self) -> None:
        """After a restore that loaded lost shards from partner copies (:attr:`served`): copy
        the files into the lost nodes and publish the step there, each copy verified, as
        :meth:`prepare` does without ``serve``; after one that rebuilt shards from XOR parity:
        rebuild the parity of each, which the node held with its shard. Collective; it runs on
        the save thread once ``restore()`` has returned. A failure is logged: the copies still
        protect the step (an XOR team with a lost parity survives no further loss until the
        next save)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t = time.perf_counter()
        kind, args = pending
        if kind == "parity":
            step, manifest, xor_lost, layout = args
            d = self.path(step)
            err, _ = self._receive(d, d, manifest, [], xor_lost, layout, "parity")
            if failed := self.proto.agree(err, "local-parity-back"):
                self.log.error("step %d was restored, but rebuilding the XOR parity of %s "
                               "failed (their team survives no other loss of that step): %s",
                               step, ranks_text(sorted(xor_lost.values())), failed)
            elif self.rank == 0:
                self.log.info("step %d: the XOR parity of %s rebuilt in %.2f s", step,
                              ranks_text(sorted(xor_lost.values())), time.perf_counter() - t)
            return
        step, whole, manifest, text, level_text, moves, xor_lost, layout = args
        why, _ = self._rebuild(step, whole, manifest, text, level_text, moves, xor_lost,
                               layout, True, Clock())
        if self.rank == 0:
            if why is not None:
                self.log.error("step %d was restored, but writing the lost shards back to their "
                               "nodes failed (the %s they came from still protect it): %s", step,
                               "XOR parities" if xor_lost else "partner copies", why)
            else:
                self.log.info("step %d: the shards of %s written back to their nodes in %.2f s",
                              step, ranks_text(sorted(self.served)), time.perf_counter() - t)

    @property
    def pending(self) -> bool:
        """Whether a restore left lost shards to write back (:meth:`write_back`)."""
        return self._pending is not None

    def _verify(self, d: str, manifest: Manifest, rank: int, full: bool = True) -> str | None:
        entry = manifest.ranks[rank]
        path = os.path.join(d, entry.file)
        try:
            if full:
                verify_file(rank, path, entry.bytes, entry.tensors, manifest.checksum_block,
                            self.io_threads)
            else:
                check_file(rank, path, entry.bytes)
                check_records(rank, path, entry.tensors, entry.bytes, manifest.checksum_block)
        except ShardError as e:
            return str(e)
        return None

    def _rebuild(self, step: int, whole: bool, manifest: Manifest, text: str,
                 level_text: str | None, moves: list[tuple[int, int]],
                 xor_lost: dict[int, int], layout: dict[str, Any], verify: bool,
                 clock: Clock, parts: str = "both") -> tuple[str | None, int]:
        """Bring every lost shard back (``moves``: partner copies, ``xor_lost``: a rebuild per
        team, its parity too unless ``parts`` is "shard"), into the node's committed directory
        where it holds the step (``whole``), else into its partial directory, which its
        leader then publishes. Collective. (Why it failed, or None; the bytes this rank
        received.)"""
        d = self.path(step)
        out = d if whole else self.level.nodedir.partial(step, self.run_id)
        err = self._clear(out) if self.rank in receivers(moves, xor_lost) else None
        if failed := self.proto.agree(err, "local-rebuild-start", "local-rebuild-report"):
            return str(failed), 0
        err, received = self._receive(d, out, manifest, moves, xor_lost, layout, parts)
        clock.lap("transfer")
        if self.rank in receivers(moves, xor_lost) and err is None:
            # fully verified only when asked: otherwise the load that follows verifies it
            err = self._verify(out, manifest, self.rank, verify)
        clock.lap("verify-rebuilt")
        if failed := self.proto.agree(err, "local-rebuild"):
            if not whole and self.level.leader:
                discard(out, self.run_id, self.log)
            return f"rebuilding from redundancy failed: {failed}", received
        if why := self._republish(step, whole, out, text, level_text):
            return why, received
        clock.lap("republish")
        return None, received

    def _clear(self, out: str) -> str | None:
        """Make room in ``out`` for this rank's shard, which it is to receive."""
        try:
            rootdir.make_dirs(out)
            shard = os.path.join(out, shard_name(self.rank))
            if os.path.lexists(shard):
                os.unlink(shard)
        except OSError as e:
            return f"rank {self.rank}: {type(e).__name__}: {e}"
        return None

    def _receive(self, d: str, out: str, manifest: Manifest, moves: list[tuple[int, int]],
                 xor_lost: dict[int, int], layout: dict[str, Any], parts: str = "both"
                 ) -> tuple[str | None, int]:
        """The partner copies and the XOR rebuilds (``parts``: "both" a lost member's shard
        and parity, "shard" or "parity" one of them), over MPI: survivors read from their
        node's directory ``d``, the lost files are written into ``out`` (a parity alone under
        another name first, renamed once whole); (this rank's error, the bytes it
        received)."""
        window, buffers = self._transfer()
        err, received = None, 0
        try:
            received += copy_over(self.proto, [
                (donor, r, os.path.join(out, shard_name(r)), manifest.ranks[r].bytes)
                for donor, r in moves], window,
                lambda: faults.hit("mid-rebuild", self.rank, manifest.step))
        except OSError as e:
            err = f"rank {self.rank}: the copy failed: {e}"
        if xor_lost:
            try:
                received += xor_team(self.proto, d, out, manifest, xor_lost, layout, parts,
                                      window, buffers)
            except OSError as e:
                err = err or f"rank {self.rank}: the XOR rebuild failed: {e}"
        return err, received

    def _republish(self, step: int, whole: bool, out: str, text: str,
                   level_text: str | None) -> str | None:
        """A node that held no copy of the step: its leader commits the rebuilt directory, as
        the node store's publish does (collective: every node answers)."""
        err = None
        if not whole and self.level.leader:
            try:
                layout = level_text.encode() if level_text else self.level.level_record()
                self.level.nodedir.publish(out, step, text.encode(), layout)
            except OSError as e:
                err = f"rank {self.rank}: publishing the rebuilt step failed: {e}"
                discard(out, self.run_id, self.log)
        if failed := self.proto.agree(err, "local-republish"):
            return f"rebuilding from redundancy failed: {failed}"
        return None


class Clock:
    """Seconds per phase, each lap from the end of the one before."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._t
        self._t = now


class _Buffers:
    def __init__(self) -> None:
        self._bufs: dict[str, bytearray] = {}

    def get(self, name: str, nbytes: int) -> memoryview:
        buf = self._bufs.get(name)
        if buf is None or len(buf) < nbytes:
            buf = self._bufs[name] = bytearray(max(nbytes, 1))
        return memoryview(buf)[:nbytes]


def _written(step_dir: str) -> float | None:
    """When the manifest in ``step_dir`` says it was written; None when it cannot tell."""
    try:
        created = json.loads(read_bytes(step_dir)).get("created")
    except (ManifestError, ValueError, AttributeError, RecursionError):
        return None
    return float(created) if isinstance(created, (int, float)) else None


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None

