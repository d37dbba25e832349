"""The node-local level as the tools see it: ``mpickpt ls ROOT --local LOCAL`` and what
``mpickpt drain`` plans from.

Each process of the command looks under LOCAL (:func:`look`): its node directories
(``LOCAL/<node>/``, or LOCAL itself when it is one), their ``OWNER.json`` and their committed
steps, with each step's manifest (hashed and validated), its redundancy layout and the size of
every ``rank-*.h5`` there. Under ``mpiexec`` with one process per node each process sees only its
own node's directory; rank 0 pools what all saw (:func:`pool`): a step is *complete* when every
rank's shard is in some node directory that holds the step's manifest, at the size the manifest
records (the quick check: drain reads every checksum before it copies). Where node directories
hold different manifests of one step, the one most of them hold counts (a tie: the newest).

Each process checks its shards against its own node's manifest, so only hashes, sizes and
sentences travel (the small frozen records below). :func:`look` and :func:`pool` only read;
:mod:`mpickpt.cli.localshow` shows them (``mpickpt ls --local``), and
:mod:`mpickpt.cli.drainpart` is one process's part of ``mpickpt drain``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError
from ..format import checksum, rootdir
from ..format.manifest import NAME as MANIFEST
from ..format.manifest import Manifest, read_bytes
from ..format.names import RANK_FILE_RE, shard_name
from ..format.rollback import Rollback
from ..local.nodedir import LEVEL, OWNER, PARITY_RE, node_dirname
from ..ranks import ranks_text
from .render import iso_utc

MAX_NAMES = 8  # node names listed in a sentence before the rest is counted


@dataclass(frozen=True, slots=True)
class NodeStep:
    """One committed step in one node directory: its manifest's hash and summary (hash None
    when it is unusable, then ``problem`` says why), the ranks whose shard is there at the size
    the manifest records, those there at another size (sentences), the redundancy layout."""

    node: str
    path: str
    step: int
    digest: str | None
    problem: str | None
    world_size: int = 0
    total_bytes: int = 0
    created: float = 0.0
    run_id: str = ""
    sized: list[int] = field(default_factory=list)
    wrong: dict[int, str] = field(default_factory=dict)
    scheme: str | None = None
    nodes: list[str] | None = None  # LEVEL.json: the node of every rank
    teams: list[list[int]] | None = None  # LEVEL.json: the redundancy teams
    parity: list[int] = field(default_factory=list)  # ranks whose XOR parity file is there


@dataclass(frozen=True, slots=True)
class NodeListing:
    """A node directory: its name, path, the ROOT its OWNER.json names, its committed steps."""

    name: str
    path: str
    owner: str | None
    steps: list[NodeStep]


@dataclass(frozen=True, slots=True)
class LocalView:
    """What one process sees under LOCAL: the node directories, or why none (``problem``)."""

    where: str
    problem: str | None
    dirs: list[NodeListing]


def _owner(path: str) -> str | None:
    try:
        fd = rootdir.open_regular(os.path.join(path, OWNER))
        with os.fdopen(fd, "rb") as f:
            root = json.loads(f.read()).get("root")
        return root if isinstance(root, str) else None
    except (OSError, ValueError, AttributeError, RecursionError):
        return None




def _shards(step_dir: str) -> tuple[dict[int, int], list[int]]:
    """(rank -> size of each ``rank-*.h5`` there, the ranks whose ``xor-*.bin`` is there)."""
    out, parity = {}, []
    with os.scandir(step_dir) as it:
        for e in it:
            if not e.is_file(follow_symlinks=False):
                continue
            if m := RANK_FILE_RE.match(e.name):
                out[int(m.group(1))] = e.stat(follow_symlinks=False).st_size
            elif m := PARITY_RE.match(e.name):
                parity.append(int(m.group(1)))
    return out, sorted(parity)


def _layout(step_dir: str) -> tuple[str | None, list[str] | None, list[list[int]] | None]:
    """LEVEL.json's scheme, node of every rank and teams (None where it says nothing usable)."""
    try:
        fd = rootdir.open_regular(os.path.join(step_dir, LEVEL))
        with os.fdopen(fd, "rb") as f:
            d = json.loads(f.read())
        nodes, teams, scheme = d.get("nodes"), d.get("teams"), d.get("scheme")
        ok = isinstance(nodes, list) and all(isinstance(n, str) for n in nodes)
        good_teams = isinstance(teams, list) and all(
            isinstance(t, list) and all(isinstance(r, int) for r in t) for t in teams)
        return ((scheme if isinstance(scheme, str) else None), (nodes if ok else None),
                (teams if good_teams else None))
    except (OSError, ValueError, AttributeError, RecursionError):
        return None, None, None


def read_manifest(step_dir: str) -> tuple[Manifest, bytes]:
    """A local step's manifest, validated as restore validates it, and its bytes;
    ManifestError naming the file otherwise."""
    path = os.path.join(step_dir, MANIFEST)
    data = read_bytes(step_dir)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ManifestError(f"{path}: not UTF-8 text") from None
    return Manifest.from_json(text, path), data


def _node_step(node: str, step: int, d: str) -> NodeStep:
    scheme, nodes, teams = _layout(d)
    try:
        m, data = read_manifest(d)
        if m.step != step:
            raise ManifestError(f"{os.path.join(d, MANIFEST)} says step {m.step}")
        shards, parity = _shards(d)
    except ManifestError as e:
        return NodeStep(node, d, step, None, str(e), scheme=scheme, nodes=nodes, teams=teams)
    except OSError as e:
        return NodeStep(node, d, step, None, f"{d}: cannot list: {e.strerror}", scheme=scheme,
                        nodes=nodes, teams=teams)
    sized, wrong = [], {}
    for r in m.ranks:
        size = shards.get(r.rank)
        if size == r.bytes:
            sized.append(r.rank)
        elif size is not None:
            wrong[r.rank] = f"{os.path.join(d, r.file)} has {size} bytes, not {r.bytes}"
    return NodeStep(node, d, step, checksum.digest(data), None, m.world_size, m.total_bytes,
                    m.created, m.run_id, sized, wrong, scheme, nodes, teams, parity)


def _node_dir(path: str) -> NodeListing:
    name = os.path.basename(path)
    steps = [_node_step(name, step, d) for step, d in rootdir.committed(path)]
    return NodeListing(name, path, _owner(path), steps)


def _is_node_dir(path: str) -> bool:
    if not rootdir.is_real_dir(path):
        return False
    if os.path.lexists(os.path.join(path, OWNER)):
        return True
    try:
        return any(rootdir.STEP_RE.match(n) or rootdir.PARTIAL_RE.match(n)
                   for n in os.listdir(path))
    except OSError:
        return False


def look(local: str) -> LocalView:
    """What this process sees under ``local`` (read only)."""
    where = os.path.abspath(local)
    if not os.path.isdir(where):
        what = "not a directory" if os.path.lexists(where) else "no such directory"
        return LocalView(where, f"{where}: {what}", [])
    if os.path.lexists(os.path.join(where, OWNER)):  # LOCAL/<node> itself
        return LocalView(where, None, [_node_dir(where)])
    try:
        names = sorted(os.listdir(where))
    except OSError as e:
        return LocalView(where, f"{where}: cannot list: {e.strerror}", [])
    return LocalView(where, None, [_node_dir(os.path.join(where, n)) for n in names
                                   if _is_node_dir(os.path.join(where, n))])


@dataclass(frozen=True, slots=True)
class Holder:
    """A copy of one rank's shard of the step: in node directory ``node`` at ``path``, seen by
    process ``proc`` of the command."""

    proc: int
    node: str
    path: str


@dataclass
class LocalStep:
    """One step of the local level, pooled over every node directory seen."""

    step: int
    digest: str | None = None  # of the manifest counted (None: no valid one)
    first: NodeStep | None = None  # a node directory's summary of that manifest
    source: Holder | None = None  # where that manifest can be read
    scheme: str | None = None
    layout: list[str] | None = None  # the node of every rank, from LEVEL.json
    nodes: list[str] = field(default_factory=list)  # node directories holding this manifest
    holders: dict[int, list[Holder]] = field(default_factory=dict)  # rank -> copies at its size
    wrong: dict[int, list[str]] = field(default_factory=dict)  # rank -> copies of another size
    notes: list[str] = field(default_factory=list)
    in_root: bool = False
    parity: set[int] = field(default_factory=set)  # ranks whose XOR parity a node seen holds

    @property
    def missing(self) -> list[int]:
        if self.first is None:
            return []
        return [r for r in range(self.first.world_size) if not self.holders.get(r)]

    @property
    def complete(self) -> bool:
        return self.first is not None and not self.missing

    @property
    def rebuildable(self) -> bool:
        """Complete, or (XOR) each missing shard alone in its team, whose other members' shards
        and parities are seen: what a restart of the job can rebuild (as
        :class:`mpickpt.local.recovery.LocalRecovery` plans it)."""
        if self.first is None:
            return False
        missing = set(self.missing)
        if not missing:
            return True
        teams = self.first.teams
        if self.scheme != "xor" or not teams:
            return False
        for r in missing:
            team = next((t for t in teams if r in t), None)
            others = [m for m in team or [] if m != r]
            if not others or any(m in missing or m not in self.parity for m in others):
                return False
        return True

    def home(self, rank: int) -> str | None:
        """The directory name of rank ``rank``'s own node (from LEVEL.json), or None."""
        if self.layout is None or rank >= len(self.layout):
            return None
        return node_dirname(self.layout[rank])

    def missing_text(self) -> str:
        """Which ranks' shards no node directory seen holds, and what was found instead."""
        if self.first is None:
            return "no node directory seen holds a valid manifest of it"
        gone = self.missing
        text = f"no node directory seen holds the shard of {ranks_text(gone)}"
        homes = sorted({h for r in gone if (h := self.home(r)) is not None})
        if homes:
            text += f" (their node{'s' if len(homes) > 1 else ''}: {names_text(homes)})"
        wrong = [w for r in gone for w in self.wrong.get(r, [])]
        if wrong:
            text += f"; of another size than the manifest records: {'; '.join(wrong[:4])}"
        return text

    def to_json(self, now: float) -> dict[str, Any]:
        m = self.first
        return {
            "step": self.step, "nodes": self.nodes, "complete": self.complete,
            "rebuildable": self.rebuildable,
            "missing": self.missing, "scheme": self.scheme, "drained": self.in_root,
            "world_size": m.world_size if m else None, "bytes": m.total_bytes if m else None,
            "time": m.created if m else None, "time_iso": iso_utc(m.created) if m else None,
            "age_s": round(now - m.created, 3) if m else None,
            "run_id": m.run_id if m else None, "notes": self.notes,
        }


def names_text(names: list[str]) -> str:
    """``"n0, n1"``; past :data:`MAX_NAMES` names the rest is counted."""
    head = ", ".join(names[:MAX_NAMES])
    return head + (f" and {len(names) - MAX_NAMES} more" if len(names) > MAX_NAMES else "")


def _choose(copies: list[NodeStep]) -> str | None:
    """The manifest hash most node directories hold (a tie: the newest manifest)."""
    count: dict[str, int] = {}
    created: dict[str, float] = {}
    for c in copies:
        if c.digest is not None:
            count[c.digest] = count.get(c.digest, 0) + 1
            created[c.digest] = c.created
    if not count:
        return None
    return max(count, key=lambda d: (count[d], created[d]))


def pool(views: list[LocalView], root: str | None) -> list[LocalStep]:
    """Every step any node directory seen committed, newest first, pooled over the views (view
    ``i`` is process ``i``'s)."""
    by_step: dict[int, list[tuple[int, NodeStep]]] = {}
    for proc, v in enumerate(views):
        for nd in v.dirs:
            for s in nd.steps:
                by_step.setdefault(s.step, []).append((proc, s))
    in_root = {s for s, _ in rootdir.committed(root)} if root else set()
    out = []
    for step in sorted(by_step, reverse=True):
        copies = by_step[step]
        ls = LocalStep(step, in_root=step in in_root)
        out.append(ls)
        ls.digest = chosen = _choose([c for _, c in copies])
        for _, c in copies:
            if c.problem is not None:
                ls.notes.append(f"{c.node}: {c.problem}")
            elif c.digest != chosen:
                ls.notes.append(f"{c.node} holds another manifest of this step (another save "
                                "of it); its shards are not used")
        mine = [(p, c) for p, c in copies if chosen is not None and c.digest == chosen]
        if not mine:
            continue
        ls.first = next((c for _, c in mine if c.nodes is not None), mine[0][1])
        ls.source = Holder(mine[0][0], mine[0][1].node, mine[0][1].path)
        ls.nodes = sorted({c.node for _, c in mine})
        ls.scheme, ls.layout = ls.first.scheme, ls.first.nodes
        for proc, c in mine:
            for r in c.sized:
                ls.holders.setdefault(r, []).append(
                    Holder(proc, c.node, os.path.join(c.path, shard_name(r))))
            for r, why in c.wrong.items():
                ls.wrong.setdefault(r, []).append(why)
            ls.parity.update(c.parity)
    return out


def next_restore(steps: list[LocalStep], undo: Rollback | None) -> LocalStep | None:
    """The local step a restart of the job loads first, as far as the node directories seen
    tell: the newest one it can make whole that ROOT's rollback (if any) does not undo."""
    return next((s for s in steps if s.rebuildable and s.first is not None
                 and (undo is None or not undo.excludes(s.step, s.first.created))), None)


def undone(steps: list[LocalStep], undo: Rollback | None) -> list[int]:
    """The local steps the rollback ``undo`` undoes (a restart of the job discards them)."""
    if undo is None:
        return []
    return [s.step for s in steps
            if undo.excludes(s.step, s.first.created if s.first is not None else None)]


def foreign(views: list[LocalView], root: str) -> list[tuple[NodeListing, str]]:
    """The node directories whose OWNER.json names another ROOT than ``root``."""
    real = os.path.realpath(root)
    return [(nd, nd.owner) for v in views for nd in v.dirs
            if nd.owner is not None and nd.owner != real]


def node_names(views: list[LocalView]) -> list[str]:
    return sorted({nd.name for v in views for nd in v.dirs})


def problem(views: list[LocalView]) -> str | None:
    """Why no process sees any node directory, or None."""
    if any(v.dirs for v in views):
        return None
    where = views[0].where if views else "LOCAL"
    seen = "; ".join(sorted({v.problem for v in views if v.problem}))
    seen = seen or "no LOCAL/<node>/ with OWNER.json or step-XXXXXXXX directories"
    return (f"{where}: no node directory of the local level there ({seen}): give the directory "
            "the job was given as Checkpointer(local=...)")
