"""A rank's entry in a manifest (:class:`RankEntry`): its shard, exact size, state tree and
tensor records, inline or in an index part read when first needed; and the rules an entry must
obey to be parsed (:func:`parse_entry`, :func:`parse_summary`), each failure a :class:`Bad`
naming the field.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import ManifestError
from . import checksum, rootdir
from .names import INDEX_RE, SHARD_RE, index_name, shard_name, source_step
from .records import TensorRecord

MAX_BYTES = 1 << 30  # a manifest (or index part) larger than this is refused before it is parsed

MAX_TREE_DEPTH = 256  # JSON levels of a rank's tree (3 per level of the state); deeper is refused


@dataclass(frozen=True)
class ShardFile:
    """One file a rank's records lie in: its path, exact size, and the records in it."""

    path: str
    bytes: int
    records: list[TensorRecord]


@dataclass(frozen=True)
class IndexRef:
    """Where a rank's entry lies in a version-2 checkpoint: file, exact size, xxh3-64."""

    file: str
    bytes: int
    xxh3: str

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "bytes": self.bytes, "xxh3": self.xxh3}


class RankEntry:
    """One rank's shard: file name, exact byte size, state tree and tensor records. A rank that
    wrote no tensor (a small replicated state that other ranks write) has no file: ``file`` is
    None and ``bytes`` 0.

    In a version-2 manifest the tree and the records are in the rank's index part, read and
    checked the first time either is asked for (:class:`ManifestError` naming the part if it
    is missing, of another size or checksum, or not a valid entry of this rank)."""

    def __init__(self, rank: int, file: str | None, bytes: int, tree: dict[str, Any] | None = None,
                 tensors: list[TensorRecord] | None = None, *, index: IndexRef | None = None,
                 directory: str | None = None, sources: dict[str, int] | None = None,
                 references: frozenset[int] | None = None,
                 parts: dict[str, Any] | None = None) -> None:
        self.rank, self.file, self.bytes = rank, file, bytes
        self._parts = parts  # node index parts already read, shared by a manifest's entries
        self.index, self.directory = index, directory
        self._tree, self._tensors = tree, tensors
        self._sources = sources if sources is not None or tensors is None else {}
        # the steps this rank's records may refer to (None: a version 1 or 2 entry, none)
        self.references = references

    def __repr__(self) -> str:
        return f"RankEntry(rank={self.rank}, file={self.file!r}, bytes={self.bytes})"

    def __eq__(self, other: object) -> bool:
        """The same shard, tree and records (the records are loaded to compare)."""
        if not isinstance(other, RankEntry):
            return NotImplemented
        return ((self.rank, self.file, self.bytes, self.index)
                == (other.rank, other.file, other.bytes, other.index)
                and self.tree == other.tree and self.tensors == other.tensors)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaced

    @property
    def tree(self) -> dict[str, Any]:
        if self._tree is None:
            self._load()
        assert self._tree is not None
        return self._tree

    @property
    def tensors(self) -> list[TensorRecord]:
        if self._tensors is None:
            self._load()
        assert self._tensors is not None
        return self._tensors

    @property
    def sources(self) -> dict[str, int]:
        """The older shards this rank's records refer to, each with its exact size."""
        if self._sources is None:
            self._load()
        assert self._sources is not None
        return self._sources

    def referred_steps(self) -> list[int]:
        """The steps of the shards this rank's records refer to, in order."""
        return sorted({s for f in self.sources if (s := source_step(f)) is not None})

    def files(self, directory: str) -> list[ShardFile]:
        """Every file this rank's records lie in, in checkpoint ``directory``: its own shard
        (first, even without records; none if it has no file), then each older one an
        incremental record refers to."""
        own = [r for r in self.tensors if r.source is None]
        out = [ShardFile(os.path.join(directory, f), self.bytes, own) for f in [self.file] if f]
        parent = os.path.dirname(os.path.normpath(directory))
        for src, size in sorted(self.sources.items()):
            out.append(ShardFile(os.path.join(parent, src), size,
                                 [r for r in self.tensors if r.source == src]))
        return out

    def file_of(self, directory: str, record: TensorRecord) -> tuple[str, int]:
        """(path, exact size) of the file ``record`` lies in."""
        if record.source is None:  # (an entry without a file has no records: parse_entry)
            return os.path.join(directory, self.file), self.bytes  # type: ignore[arg-type]
        parent = os.path.dirname(os.path.normpath(directory))
        return os.path.join(parent, record.source), self.sources[record.source]

    @property
    def loaded(self) -> bool:
        """Whether the tree and records are in memory (always, for a version-1 entry)."""
        return self._tensors is not None

    @property
    def at_hand(self) -> bool:
        """Whether the tree and records come without reading a file: loaded, or in a node's
        index part another rank's entry has read."""
        return self.loaded or (self._parts is not None and self._part_key() in self._parts)

    def _part_key(self) -> str:
        assert self.index is not None and self.directory is not None
        path = os.path.join(self.directory, self.index.file)
        return f"{path}:{self.index.bytes}:{self.index.xxh3}"  # as this entry says it is

    def _load(self) -> None:
        if self.index is None or self.directory is None:
            raise ManifestError(f"rank {self.rank}'s entry has no records and no index part")
        path = os.path.join(self.directory, self.index.file)
        key = self._part_key()
        d = self._parts.get(key) if self._parts is not None else None
        with part_errors(path):
            if d is None:
                d = read_json_part(path, self.index, f"the index part of rank {self.rank}")
                if self._parts is not None and isinstance(d, dict) and "ranks" in d:
                    self._parts[key] = d  # a node's part: its other ranks need it too
            if isinstance(d, dict) and "ranks" in d:  # a node's part: this rank's entry in it
                mine = [e for e in field_of(d, "ranks", list, path)
                        if isinstance(e, dict) and e.get("rank") == self.rank]
                if len(mine) != 1:
                    raise Bad(f"{path}: {len(mine)} entries of rank {self.rank} in a node's "
                               "index part, not 1")
                d = mine[0]
            entry = parse_entry(self.rank, d, f"{path}: rank entry {self.rank}", self.references)
        if entry.file != self.file or entry.bytes != self.bytes:
            raise ManifestError(f"{path}: says {entry.file} has {entry.bytes} bytes, the "
                                f"manifest {self.file} with {self.bytes}")
        self._tree, self._tensors, self._sources = entry._tree, entry._tensors, entry._sources

    def to_dict(self) -> dict[str, Any]:
        """As JSON values (the tree is shared, not copied: it is not changed once built)."""
        d = {"rank": self.rank, "file": self.file, "bytes": self.bytes, "tree": self.tree,
             "tensors": [r.to_dict() for r in self.tensors]}
        if self.sources:
            d["sources"] = dict(self.sources)
        return d

    def summary(self) -> dict[str, Any]:
        """A version-2 (or 3) manifest's entry: the shard and the index part, no records. An
        entry made from a summary gives the steps it refers to as the summary did: its index
        part is not read (rank 0's commit reads none)."""
        assert self.index is not None
        d = {"rank": self.rank, "file": self.file, "bytes": self.bytes,
             "index": self.index.to_dict()}
        refs = self.referred_steps() if self._sources is not None else sorted(
            self.references or ())
        if refs:
            d["references"] = refs
        return d


_PARTS_READ = 0
_BYTES_READ = 0


def parts_read() -> int:
    """How many index parts this process has read (each rank reads its own at a restore)."""
    return _PARTS_READ


def metadata_bytes_read() -> int:
    """How many bytes of manifests and index parts this process has read."""
    return _BYTES_READ


def count_read(nbytes: int, part: bool) -> None:
    """Count a manifest (``part`` False) or an index part read."""
    global _PARTS_READ, _BYTES_READ
    _PARTS_READ += part
    _BYTES_READ += nbytes


def open_regular(path: str, what: str) -> tuple[BinaryIO, int]:
    """``path`` open for reading, a regular file never reached through a link, and its size;
    :class:`ManifestError` naming it as ``what`` otherwise."""
    try:
        fd = rootdir.open_regular(path)
    except OSError as e:
        raise ManifestError(f"{path}: cannot open{what}: {e.strerror}") from None
    return os.fdopen(fd, "rb"), os.fstat(fd).st_size


def read_part(path: str, size: int) -> bytes:
    """The bytes of an index part: a regular file (no link) of exactly ``size`` bytes."""
    f, actual = open_regular(path, " the index part")
    with f:
        if actual != size:
            raise ManifestError(f"{path}: the index part has {actual} bytes, the manifest says "
                                f"{size} (truncated or replaced)")
        data = f.read(size + 1)
    count_read(len(data), True)
    return data


def read_json_part(path: str, ref: IndexRef, what: str) -> Any:
    """An index part's JSON, of the size and checksum ``ref`` gives (:class:`ManifestError`
    naming it as ``what`` otherwise; invalid JSON raises ValueError: see :func:`part_errors`)."""
    data = read_part(path, ref.bytes)
    if checksum.digest(data) != ref.xxh3:
        raise ManifestError(f"{path}: checksum mismatch: {what} is corrupt")
    return json.loads(data)


@contextlib.contextmanager
def part_errors(path: str) -> Iterator[None]:
    """What goes wrong parsing the index part ``path``, as a :class:`ManifestError` naming it."""
    try:
        yield
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ManifestError(f"{path}: nested too deeply to be an index part") from None
    except Bad as e:
        raise ManifestError(str(e)) from None


class Bad(Exception):
    pass


def field_of(d: Any, key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise Bad(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise Bad(f"{where}: field {key!r} has type {type(v).__name__}")
    return v


def _piece(t: dict[str, Any], ndim: int, where: str
           ) -> tuple[list[int] | None, list[int] | None]:
    """A record's optional ``global_shape`` and ``offsets`` (both or neither), checked."""
    g, o = t.get("global_shape"), t.get("offsets")
    if g is None and o is None:
        return None, None
    for key, v in (("global_shape", g), ("offsets", o)):
        if not (isinstance(v, list) and len(v) == ndim and
                all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)):
            raise Bad(f"{where}: {key} {v!r} is not {ndim} non-negative integers")
    if any(a + n > b for a, n, b in zip(o, t["shape"], g, strict=True)):
        raise Bad(f"{where}: the piece {t['shape']} at {o} does not lie within {g}")
    return g, o


def _depth(node: Any) -> int:
    """How deeply JSON containers nest in ``node`` (without recursion: a level at a time, the
    next level's containers collected by a list comprehension, 2.6x faster than a stack)."""
    level = [node] if isinstance(node, _CONTAINERS) else []
    depth = 0
    while level:
        depth += 1
        below: list[Any] = []
        for x in level:
            below += [v for v in (x.values() if isinstance(x, dict) else x)
                      if isinstance(v, _CONTAINERS)]
        level = below
    return depth


_CONTAINERS = (dict, list)


def _shard(i: int, r: Any, w: str, extended: bool) -> tuple[str | None, int]:
    """Rank ``i``'s shard file name and size from its entry, checked (node files and
    sub-directories: version 3 only); (None, 0) for a rank that wrote no file."""
    if field_of(r, "rank", int, w) != i:
        raise Bad(f"{w}: rank field is {r['rank']}")
    if "file" in r and r["file"] is None:
        if type(r.get("bytes")) is int and r["bytes"] == 0:
            return None, 0
        raise Bad(f"{w}: no file, and a size of {r.get('bytes')!r} bytes")
    name = field_of(r, "file", str, w)
    m = SHARD_RE.match(name)
    if m is None or (m.group(1) == "rank" and int(m.group(2)) != i):
        raise Bad(f"{w}: shard file {name!r} is not {shard_name(i)!r} (nor a node's file "
                   "node-NNNNN.h5; either in a sub-directory shards-NNNN/ or none)")
    if not extended and name != shard_name(i):
        raise Bad(f"{w}: shard file {name!r} in a manifest of version 1 or 2")
    size = field_of(r, "bytes", int, w)
    if size < 0:
        raise Bad(f"{w}: negative size")
    return name, size


def entry_refs(e: dict[str, Any]) -> set[int]:
    """The steps a rank's entry (or summary) as sent to rank 0 refers to (unchecked)."""
    if isinstance(e.get("references"), list):
        return {s for s in e["references"] if isinstance(s, int)}
    if isinstance(e.get("sources"), dict):
        return {s for f in e["sources"] if isinstance(f, str) and (s := source_step(f)) is not None}
    return set()


def _sources(r: Any, w: str, references: frozenset[int] | None) -> dict[str, int]:
    """An entry's ``sources`` (older shards and their sizes), checked against the steps the
    manifest says it refers to (none before version 3)."""
    if "sources" not in r:
        return {}
    if references is None:
        raise Bad(f"{w}: 'sources' (an incremental checkpoint's) in a manifest of version 1 or 2")
    raw = field_of(r, "sources", dict, w)
    for f, size in raw.items():
        step = source_step(f)
        if step is None:
            raise Bad(f"{w}: source {f!r} is not step-XXXXXXXX/rank-XXXXX.h5 (or a node's file, "
                       "in a sub-directory shards-NNNN/ or none)")
        if step not in references:
            raise Bad(f"{w}: source {f!r} is of step {step}, which the manifest does not list "
                       "among its references")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise Bad(f"{w}: source {f!r} has size {size!r}")
    return raw


def parse_entry(i: int, r: Any, w: str, references: frozenset[int] | None = None,
                like: dict[str, Any] | None = None) -> RankEntry:
    """Rank ``i``'s entry with its tree and records (version 1, or a version-2 index part;
    version 3: records may refer to older shards, of the steps in ``references``). ``like``: a
    tree found shallow enough already (a tree equal to it is, without walking it again)."""
    name, size = _shard(i, r, w, references is not None)
    sources = _sources(r, w, references)
    tensors = _records(r, w, sources, references)
    if name is None and (tensors or sources):
        raise Bad(f"{w}: no file, and {len(tensors)} tensor record(s)")
    tree = field_of(r, "tree", dict, w)
    if not (like is not None and tree == like) and _depth(tree) > MAX_TREE_DEPTH:
        raise Bad(f"{w}: the state tree is nested deeper than {MAX_TREE_DEPTH} levels")
    return RankEntry(i, name, size, tree, tensors, sources=sources, references=references)


def parse_replicas(d: Any, w: str, ranks: list[RankEntry]) -> dict[int, RankEntry]:
    """The replicated part (:data:`~mpickpt.format.names.REPLICATED_PART`): ``{"ranks": [{"rank",
    "tensors", "sources"}]}``, the records of the tensors every rank holds alike, by the rank
    whose shard holds them. Each comes back as an entry of that rank's shard (as ``ranks``, the
    manifest's, give it) with those records alone and no tree: what a restore needs of the
    writers of replicated tensors, without their index parts."""
    out: dict[int, RankEntry] = {}
    for j, r in enumerate(field_of(d, "ranks", list, w)):
        rank = field_of(r, "rank", int, f"{w} entry {j}")
        if not 0 <= rank < len(ranks) or rank in out:
            raise Bad(f"{w} entry {j}: rank {rank} is not a rank of the checkpoint, or twice")
        e, rw = ranks[rank], f"{w} rank {rank}"
        sources = _sources(r, rw, e.references)
        out[rank] = RankEntry(rank, e.file, e.bytes, None, _records(r, rw, sources, e.references),
                              sources=sources, references=e.references)
    return out


def _records(r: Any, w: str, sources: dict[str, int], references: frozenset[int] | None
             ) -> list[TensorRecord]:
    """An entry's tensor records, checked (a source among ``sources``; compressed records and
    sources in version 3 only)."""
    tensors = []
    for j, t in enumerate(field_of(r, "tensors", list, w)):
        tw = f"{w} tensor {j}"
        shape = field_of(t, "shape", list, tw)
        sums = field_of(t, "checksums", list, tw)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
            raise Bad(f"{tw}: shape {shape!r} is not a list of integers")
        if not all(isinstance(x, str) for x in sums):
            raise Bad(f"{tw}: checksums are not strings")
        src = t.get("source")
        if src is not None and src not in sources:
            raise Bad(f"{tw}: source {src!r} is not among the rank's sources")
        codec, chunks = t.get("codec"), t.get("chunks")
        if codec is not None or chunks is not None:
            if references is None:
                raise Bad(f"{tw}: a compressed record in a manifest of version 1 or 2")
            if not isinstance(codec, str) or not isinstance(chunks, list):
                raise Bad(f"{tw}: codec {codec!r} with chunks of type {type(chunks).__name__}")
        tensors.append(TensorRecord(
            field_of(t, "name", str, tw), field_of(t, "dtype", str, tw), shape,
            field_of(t, "offset", int, tw), field_of(t, "nbytes", int, tw), sums,
            *_piece(t, len(shape), tw), source=src, codec=codec, chunks=chunks,
        ))
    return tensors


def parse_summary(i: int, r: Any, w: str, directory: str | None,
                  references: frozenset[int] | None = None,
                  parts: dict[str, Any] | None = None) -> RankEntry:
    """Rank ``i``'s version-2 (or 3) entry: shard and index part, records read when needed;
    version 3: the steps it refers to, among ``references``."""
    name, size = _shard(i, r, w, references is not None)
    ix = field_of(r, "index", dict, w)
    part = field_of(ix, "file", str, f"{w} index")
    m = INDEX_RE.match(part)
    if m is None or (m.group(1) == "rank" and int(m.group(2)) != i):
        raise Bad(f"{w}: index part {part!r} is not {index_name(i)!r}, in a sub-directory "
                   "index/part-NNNN/ or none")
    if references is None and part != index_name(i):
        raise Bad(f"{w}: index part {part!r} in a manifest of version 2")
    part_bytes = field_of(ix, "bytes", int, f"{w} index")
    if not 0 <= part_bytes <= MAX_BYTES:
        raise Bad(f"{w}: index part of {part_bytes} bytes")
    digest = field_of(ix, "xxh3", str, f"{w} index")
    own = None
    if references is not None:
        own = frozenset(steps_field(r.get("references", []), f"{w} references"))
        if not own <= references:
            raise Bad(f"{w}: refers to steps the manifest does not list among its references")
    elif "references" in r:
        raise Bad(f"{w}: 'references' (an incremental checkpoint's) in a manifest of version 2")
    return RankEntry(i, name, size, index=IndexRef(part, part_bytes, digest), parts=parts,
                     directory=directory, references=own)


def steps_field(v: Any, where: str) -> list[int]:
    """A list of distinct non-negative step numbers in increasing order, checked."""
    if not (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                        and x >= 0 for x in v) and v == sorted(set(v))):
        raise Bad(f"{where}: {v!r} is not distinct step numbers in increasing order")
    return v
