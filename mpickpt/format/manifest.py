"""MANIFEST.json: the record that makes a checkpoint exist.

Rules, in one place:

* A checkpoint exists if and only if ``ROOT/step-XXXXXXXX/MANIFEST.json`` is there; it is written
  into the partial directory (temp file, fsync, rename) before that directory is renamed into place.
* ``version`` is checked exactly: a manifest of another format or version is refused.
* Rank ``r``'s shard is the file ``rank-{r:05d}.h5`` beside the manifest; any other name (a path,
  ``..``, an absolute path) is refused, so a manifest cannot point outside its directory.
  Version 3 also allows a node's file ``node-NNNNN.h5`` (``files="per-node"``: the node's ranks
  wrote disjoint regions of it, each rank's datasets in HDF5 group ``rank-RRRRR``), and either
  kind in a sub-directory ``shards-NNNN/`` (more files than :data:`FANOUT`; index parts then
  lie in ``index/part-NNNN/``).
* ``bytes`` is the exact size of the shard; every tensor record must fit in it (see
  :func:`mpickpt.format.records.check_records`), and its ``checksums`` cover ``checksum_block``-byte
  blocks.
* ``tree`` is the rank's state tree (see :mod:`mpickpt.format.state_tree`), plain JSON.
* Version 2 (per-rank index parts, for jobs of many ranks): a rank entry holds ``file`` and
  ``bytes`` and, instead of ``tree`` and ``tensors``, ``index``: the file
  ``index/rank-{r:05d}.json`` beside the manifest, its exact size and xxh3-64. The rank wrote
  that part (its entry, as in version 1) before it voted; a reader loads it only when it needs
  that rank's records, checked against the size and checksum the manifest gives, so the
  manifest's checksum protects the parts too. Version 1 (every entry inline) is still read.
* Version 3 (written with incremental checkpoints, compression, node files or sub-directories):
  as version 1 or 2, and a record may be compressed (``codec`` and ``chunks``:
  :mod:`mpickpt.format.records`) or carry ``source``, the shard of an older checkpoint its bytes
  lie in (``step-XXXXXXXX/`` and a shard file name, resolved beside this checkpoint's directory;
  ``offset`` and ``checksums`` are those in that file). The rank's entry lists each such file
  with its exact size (``sources``), and the manifest lists the steps referred to
  (``references``; with index parts each rank's summary lists its own), so that retention
  keeps what a kept checkpoint needs without reading any record. A source is always where the
  bytes were written (never a record that itself refers further): no chains.
* ``manifest_checksum`` covers every other field (canonical JSON, xxh3-64), so damage that leaves
  the file valid JSON (a flipped digit of a shape, a letter of a key) is refused as corruption
  instead of passing for a checkpoint that does not fit the state.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError
from . import checksum, rootdir
from .records import TensorRecord

NAME = "MANIFEST.json"
FORMAT = "mpickpt"
VERSION = 1  # every rank's records inline
SPLIT_VERSION = 2  # per-rank index parts
EXT_VERSION = 3  # records may refer to older shards (incremental) or be compressed
VERSIONS = (VERSION, SPLIT_VERSION, EXT_VERSION)
# a shard file relative to its checkpoint directory: a rank's own, or a node's (its ranks' regions),
# in a sub-directory when the checkpoint has more files than FANOUT
SHARD_RE = re.compile(r"^(?:shards-\d{4,}/)?(rank|node)-(\d{5,})\.h5$")
RANK_FILE_RE = re.compile(r"^rank-(\d{5,})\.h5$")  # a rank's own shard, by its file name alone
SOURCE_RE = re.compile(r"^step-(\d{8,})/((?:shards-\d{4,}/)?(?:rank|node)-\d{5,}\.h5)$")
INDEX_DIR = "index"
INDEX_RE = re.compile(r"^index/(?:part-\d{4,}/)?(rank|node)-(\d{5,})\.json$")
FANOUT = 1024  # files per directory, at most: more go into sub-directories of this many
MAX_BYTES = 1 << 30  # a manifest larger than this is refused before it is parsed
MAX_TREE_DEPTH = 256  # JSON levels of a rank's tree (3 per level of the state); deeper is refused
CHECKSUM_FIELD = "manifest_checksum"


def _fanned(name: str, n: int, count: int, fanout: int, group: str) -> str:
    """``name``, in sub-directory ``{group}-NNNN/`` (the ``n // fanout``-th) when there are more
    than ``fanout`` files of its kind."""
    return name if count <= fanout else f"{group}-{n // fanout:04d}/{name}"


def shard_name(rank: int, world: int = 1, fanout: int = FANOUT) -> str:
    """Rank ``rank``'s own shard of a checkpoint of ``world`` ranks, relative to its directory."""
    return _fanned(f"rank-{rank:05d}.h5", rank, world, fanout, "shards")


def node_name(node: int, nodes: int, fanout: int = FANOUT) -> str:
    """Node ``node``'s shard (``files="per-node"``: the regions of the node's ranks)."""
    return _fanned(f"node-{node:05d}.h5", node, nodes, fanout, "shards")


def source_step(source: str) -> int | None:
    """The step of an incremental record's source file, or None for a name that is not
    ``step-XXXXXXXX/rank-XXXXX.h5`` (a path elsewhere, ``..``, an absolute path)."""
    m = SOURCE_RE.match(source)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ShardFile:
    """One file a rank's records lie in: its path, exact size, and the records in it."""

    path: str
    bytes: int
    records: list[TensorRecord]


def index_name(rank: int, world: int = 1, fanout: int = FANOUT) -> str:
    """Rank ``rank``'s index part, relative to its checkpoint directory."""
    return f"{INDEX_DIR}/{_fanned(f'rank-{rank:05d}.json', rank, world, fanout, 'part')}"


def node_index_name(node: int, nodes: int, fanout: int = FANOUT) -> str:
    """Node ``node``'s index part (``files="per-node"``): its ranks' entries."""
    return f"{INDEX_DIR}/{_fanned(f'node-{node:05d}.json', node, nodes, fanout, 'part')}"


@dataclass(frozen=True)
class IndexRef:
    """Where a rank's entry lies in a version-2 checkpoint: file, exact size, xxh3-64."""

    file: str
    bytes: int
    xxh3: str

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "bytes": self.bytes, "xxh3": self.xxh3}


class RankEntry:
    """One rank's shard: file name, exact byte size, state tree and tensor records.

    In a version-2 manifest the tree and the records are in the rank's index part, read and
    checked the first time either is asked for (:class:`ManifestError` naming the part if it
    is missing, of another size or checksum, or not a valid entry of this rank)."""

    def __init__(self, rank: int, file: str, bytes: int, tree: dict[str, Any] | None = None,
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
        (first, even without records), then each older one an incremental record refers to."""
        own = [r for r in self.tensors if r.source is None]
        out = [ShardFile(os.path.join(directory, self.file), self.bytes, own)]
        parent = os.path.dirname(os.path.normpath(directory))
        for src, size in sorted(self.sources.items()):
            out.append(ShardFile(os.path.join(parent, src), size,
                                 [r for r in self.tensors if r.source == src]))
        return out

    def file_of(self, directory: str, record: TensorRecord) -> tuple[str, int]:
        """(path, exact size) of the file ``record`` lies in."""
        if record.source is None:
            return os.path.join(directory, self.file), self.bytes
        parent = os.path.dirname(os.path.normpath(directory))
        return os.path.join(parent, record.source), self.sources[record.source]

    @property
    def loaded(self) -> bool:
        """Whether the tree and records are in memory (always, for a version-1 entry)."""
        return self._tensors is not None

    def _load(self) -> None:
        global _PARTS_READ
        if self.index is None or self.directory is None:
            raise ManifestError(f"rank {self.rank}'s entry has no records and no index part")
        path = os.path.join(self.directory, self.index.file)
        key = f"{path}:{self.index.bytes}:{self.index.xxh3}"  # as this entry says it is
        d = self._parts.get(key) if self._parts is not None else None
        try:
            if d is None:
                data = read_part(path, self.index.bytes)
                _PARTS_READ += 1
                if checksum.digest(data) != self.index.xxh3:
                    raise ManifestError(f"{path}: checksum mismatch: the index part of rank "
                                        f"{self.rank} is corrupt")
                d = json.loads(data)
                if self._parts is not None and isinstance(d, dict) and "ranks" in d:
                    self._parts[key] = d  # a node's part: its other ranks need it too
            if isinstance(d, dict) and "ranks" in d:  # a node's part: this rank's entry in it
                mine = [e for e in _get(d, "ranks", list, path)
                        if isinstance(e, dict) and e.get("rank") == self.rank]
                if len(mine) != 1:
                    raise _Bad(f"{path}: {len(mine)} entries of rank {self.rank} in a node's "
                               "index part, not 1")
                d = mine[0]
            entry = _entry(self.rank, d, f"{path}: rank entry {self.rank}", self.references)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise ManifestError(f"{path}: nested too deeply to be an index part") from None
        except _Bad as e:
            raise ManifestError(str(e)) from None
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
        """A version-2 (or 3) manifest's entry: the shard and the index part, no records."""
        assert self.index is not None
        d = {"rank": self.rank, "file": self.file, "bytes": self.bytes,
             "index": self.index.to_dict()}
        if self.sources:
            d["references"] = self.referred_steps()
        return d


_PARTS_READ = 0


def parts_read() -> int:
    """How many index parts this process has read (each rank reads its own at a restore)."""
    return _PARTS_READ


def read_part(path: str, size: int) -> bytes:
    """The bytes of an index part: a regular file (no link) of exactly ``size`` bytes."""
    try:
        fd = rootdir.open_regular(path)
    except OSError as e:
        raise ManifestError(f"{path}: cannot open the index part: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ManifestError(f"{path}: the index part has {actual} bytes, the manifest says "
                                f"{size} (truncated or replaced)")
        return f.read(size + 1)


@dataclass
class Manifest:
    step: int
    world_size: int
    run_id: str
    ranks: list[RankEntry]
    metadata: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    checksum_algorithm: str = checksum.ALGORITHM
    checksum_block: int = checksum.DEFAULT_BLOCK
    format: str = FORMAT
    version: int = VERSION
    references: list[int] = field(default_factory=list)  # steps whose shards records refer to

    @property
    def extended(self) -> bool:
        """Whether this is a version-3 manifest (records may refer to older shards or be
        compressed)."""
        return self.version == EXT_VERSION or bool(self.references)

    @property
    def total_bytes(self) -> int:
        """The bytes of this checkpoint's own shards (not those of the older ones it refers to)."""
        return sum({r.file: r.bytes for r in self.ranks}.values())  # a node's file once

    def load_all(self) -> Manifest:
        """Read every rank's index part now (the operator's tools check whole checkpoints);
        :class:`ManifestError` naming the first that cannot be read."""
        for r in self.ranks:
            _ = r.tensors
        return self

    @property
    def split(self) -> bool:
        """Whether the ranks' records are in index parts (version 2)."""
        return any(r.index is not None for r in self.ranks)

    def to_json(self) -> str:
        split = self.split
        d = {"step": self.step, "world_size": self.world_size, "run_id": self.run_id,
             "ranks": [r.summary() if split else r.to_dict() for r in self.ranks],
             "metadata": self.metadata,
             "created": self.created, "checksum_algorithm": self.checksum_algorithm,
             "checksum_block": self.checksum_block, "format": self.format,
             "version": EXT_VERSION if self.extended else SPLIT_VERSION if split else VERSION}
        if self.extended:
            d["references"] = list(self.references)
        d["created_iso"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        d[CHECKSUM_FIELD] = _digest(d)
        # one line: json's C encoder runs only without indent (10x faster: 3 ms of rank 0's CPU
        # per save for a 35 kB manifest); `mpickpt inspect` shows it laid out
        return json.dumps(d, allow_nan=False)

    @classmethod
    def assemble(cls, step: int, world_size: int, run_id: str,
                 entries: list[dict[str, Any]], metadata: dict[str, Any],
                 checksum_block: int, directory: str | None = None,
                 extended: bool = False) -> Manifest:
        """The manifest of the ranks' entries (each a :class:`RankEntry` as a dict, or its
        :meth:`RankEntry.summary` with its index part in ``directory``, as the ranks send
        them), held to the rules a parsed manifest obeys; ManifestError otherwise.
        ``extended``: version 3 (incremental or compressed records) whatever the records say."""
        split = bool(entries) and all(isinstance(e, dict) and "index" in e for e in entries)
        refs: set[int] = set()
        for e in entries:
            if isinstance(e, dict):
                refs.update(_entry_refs(e))
        d = {"format": FORMAT, "version": EXT_VERSION if refs or extended else
             SPLIT_VERSION if split else VERSION, "step": step,
             "world_size": world_size, "run_id": run_id, "ranks": entries,
             "metadata": metadata, "created": time.time(),
             "checksum_algorithm": checksum.ALGORITHM, "checksum_block": checksum_block}
        if refs or extended:
            d["references"] = sorted(refs)
        try:
            return _parse(d, directory)
        except _Bad as e:
            raise ManifestError(f"the manifest of step {step}: {e}") from None

    @classmethod
    def from_json(cls, text: str | bytes, where: str, directory: str | None = None
                  ) -> Manifest:
        """Parse and validate; every problem is a :class:`ManifestError` naming ``where``.
        A version-2 manifest's index parts are read from ``directory`` (by default, that of
        ``where`` when it names a MANIFEST.json) when they are needed."""
        if directory is None and os.path.basename(where) == NAME:
            directory = os.path.dirname(where)
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"{where}: not valid JSON ({e})") from None
        except RecursionError:
            raise ManifestError(f"{where}: nested too deeply to be a manifest") from None
        try:
            manifest = _parse(d, directory)
            if _get(d, CHECKSUM_FIELD, str, "manifest") != _digest(d):
                raise _Bad("checksum mismatch: the manifest is corrupt")
            return manifest
        except _Bad as e:
            raise ManifestError(f"{where}: {e}") from None
        except RecursionError:
            raise ManifestError(f"{where}: nested too deeply to be a manifest") from None


def read_bytes(directory: str) -> bytes:
    """The bytes of ``directory``/MANIFEST.json: never through a symbolic link, never more than
    :data:`MAX_BYTES`, never from a directory that is a link, a FIFO or a device;
    :class:`ManifestError` naming the file otherwise."""
    path = os.path.join(directory, NAME)
    if os.path.islink(directory):
        raise ManifestError(f"{path}: cannot open: {directory} is a symbolic link, and "
                            "checkpoints are never read through one")
    try:
        fd = rootdir.open_regular(path)
    except OSError as e:
        raise ManifestError(f"{path}: cannot open: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        data = f.read(MAX_BYTES + 1) if size <= MAX_BYTES else b""
        if size > MAX_BYTES or len(data) > MAX_BYTES:
            raise ManifestError(f"{path}: {max(size, len(data))} bytes is too large for a "
                                "manifest")
        return data


class _Bad(Exception):
    pass


def _digest(d: dict[str, Any]) -> str:
    """xxh3-64 of every field of a manifest but its own checksum, serialized canonically."""
    body = {k: v for k, v in d.items() if k != CHECKSUM_FIELD}
    return checksum.digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _get(d: Any, key: str, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise _Bad(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise _Bad(f"{where}: field {key!r} has type {type(v).__name__}")
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
            raise _Bad(f"{where}: {key} {v!r} is not {ndim} non-negative integers")
    if any(a + n > b for a, n, b in zip(o, t["shape"], g, strict=True)):
        raise _Bad(f"{where}: the piece {t['shape']} at {o} does not lie within {g}")
    return g, o


def _depth(node: Any) -> int:
    """How deeply JSON containers nest in ``node`` (without recursion)."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def _shard(i: int, r: Any, w: str, extended: bool) -> tuple[str, int]:
    """Rank ``i``'s shard file name and size from its entry, checked (node files and
    sub-directories: version 3 only)."""
    if _get(r, "rank", int, w) != i:
        raise _Bad(f"{w}: rank field is {r['rank']}")
    name = _get(r, "file", str, w)
    m = SHARD_RE.match(name)
    if m is None or (m.group(1) == "rank" and int(m.group(2)) != i):
        raise _Bad(f"{w}: shard file {name!r} is not {shard_name(i)!r} (nor a node's file "
                   "node-NNNNN.h5; either in a sub-directory shards-NNNN/ or none)")
    if not extended and name != shard_name(i):
        raise _Bad(f"{w}: shard file {name!r} in a manifest of version 1 or 2")
    size = _get(r, "bytes", int, w)
    if size < 0:
        raise _Bad(f"{w}: negative size")
    return name, size


def _entry_refs(e: dict[str, Any]) -> set[int]:
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
        raise _Bad(f"{w}: 'sources' (an incremental checkpoint's) in a manifest of version 1 or 2")
    raw = _get(r, "sources", dict, w)
    for f, size in raw.items():
        step = source_step(f)
        if step is None:
            raise _Bad(f"{w}: source {f!r} is not step-XXXXXXXX/rank-XXXXX.h5 (or a node's file, "
                       "in a sub-directory shards-NNNN/ or none)")
        if step not in references:
            raise _Bad(f"{w}: source {f!r} is of step {step}, which the manifest does not list "
                       "among its references")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _Bad(f"{w}: source {f!r} has size {size!r}")
    return raw


def _entry(i: int, r: Any, w: str, references: frozenset[int] | None = None) -> RankEntry:
    """Rank ``i``'s entry with its tree and records (version 1, or a version-2 index part;
    version 3: records may refer to older shards, of the steps in ``references``)."""
    name, size = _shard(i, r, w, references is not None)
    sources = _sources(r, w, references)
    tensors = []
    for j, t in enumerate(_get(r, "tensors", list, w)):
        tw = f"{w} tensor {j}"
        shape = _get(t, "shape", list, tw)
        sums = _get(t, "checksums", list, tw)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
            raise _Bad(f"{tw}: shape {shape!r} is not a list of integers")
        if not all(isinstance(x, str) for x in sums):
            raise _Bad(f"{tw}: checksums are not strings")
        src = t.get("source")
        if src is not None and src not in sources:
            raise _Bad(f"{tw}: source {src!r} is not among the rank's sources")
        codec, chunks = t.get("codec"), t.get("chunks")
        if codec is not None or chunks is not None:
            if references is None:
                raise _Bad(f"{tw}: a compressed record in a manifest of version 1 or 2")
            if not isinstance(codec, str) or not isinstance(chunks, list):
                raise _Bad(f"{tw}: codec {codec!r} with chunks of type {type(chunks).__name__}")
        tensors.append(TensorRecord(
            _get(t, "name", str, tw), _get(t, "dtype", str, tw), shape,
            _get(t, "offset", int, tw), _get(t, "nbytes", int, tw), sums,
            *_piece(t, len(shape), tw), source=src, codec=codec, chunks=chunks,
        ))
    tree = _get(r, "tree", dict, w)
    if _depth(tree) > MAX_TREE_DEPTH:
        raise _Bad(f"{w}: the state tree is nested deeper than {MAX_TREE_DEPTH} levels")
    return RankEntry(i, name, size, tree, tensors, sources=sources, references=references)


def _summary(i: int, r: Any, w: str, directory: str | None,
             references: frozenset[int] | None = None,
             parts: dict[str, Any] | None = None) -> RankEntry:
    """Rank ``i``'s version-2 (or 3) entry: shard and index part, records read when needed;
    version 3: the steps it refers to, among ``references``."""
    name, size = _shard(i, r, w, references is not None)
    ix = _get(r, "index", dict, w)
    part = _get(ix, "file", str, f"{w} index")
    m = INDEX_RE.match(part)
    if m is None or (m.group(1) == "rank" and int(m.group(2)) != i):
        raise _Bad(f"{w}: index part {part!r} is not {index_name(i)!r}, in a sub-directory "
                   "index/part-NNNN/ or none")
    if references is None and part != index_name(i):
        raise _Bad(f"{w}: index part {part!r} in a manifest of version 2")
    part_bytes = _get(ix, "bytes", int, f"{w} index")
    if not 0 <= part_bytes <= MAX_BYTES:
        raise _Bad(f"{w}: index part of {part_bytes} bytes")
    digest = _get(ix, "xxh3", str, f"{w} index")
    own = None
    if references is not None:
        own = frozenset(_steps(r.get("references", []), f"{w} references"))
        if not own <= references:
            raise _Bad(f"{w}: refers to steps the manifest does not list among its references")
    elif "references" in r:
        raise _Bad(f"{w}: 'references' (an incremental checkpoint's) in a manifest of version 2")
    return RankEntry(i, name, size, index=IndexRef(part, part_bytes, digest), parts=parts,
                     directory=directory, references=own)


def _steps(v: Any, where: str) -> list[int]:
    """A list of distinct non-negative step numbers in increasing order, checked."""
    if not (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                        and x >= 0 for x in v) and v == sorted(set(v))):
        raise _Bad(f"{where}: {v!r} is not distinct step numbers in increasing order")
    return v


def _parse(d: Any, directory: str | None = None) -> Manifest:
    fmt = _get(d, "format", str, "manifest")
    version = _get(d, "version", int, "manifest")
    if fmt != FORMAT or version not in VERSIONS:
        raise _Bad(f"format {fmt!r} version {version} is not {FORMAT!r} version "
                   f"{', '.join(map(str, VERSIONS))}; use the mpickpt release that wrote it")
    world = _get(d, "world_size", int, "manifest")
    block = _get(d, "checksum_block", int, "manifest")
    algo = _get(d, "checksum_algorithm", str, "manifest")
    if algo != checksum.ALGORITHM or block <= 0:
        raise _Bad(f"checksum {algo!r} with block {block} is not supported")
    ranks_raw = _get(d, "ranks", list, "manifest")
    if world <= 0 or len(ranks_raw) != world:
        raise _Bad(f"world_size {world} but {len(ranks_raw)} rank entries")
    step = _get(d, "step", int, "manifest")
    sizes: dict[Any, Any] = {}
    for i, r in enumerate(ranks_raw):  # the ranks of a node's file agree on its size
        if not isinstance(r, dict):
            continue
        if sizes.setdefault(r.get("file"), r.get("bytes")) != r.get("bytes"):
            raise _Bad(f"rank entry {i}: file {r.get('file')!r} of {r.get('bytes')} bytes, "
                       f"another rank's entry says {sizes[r.get('file')]}")
    refs = None
    if version == EXT_VERSION:
        refs = frozenset(_steps(_get(d, "references", list, "manifest"), "references"))
        if refs and max(refs) >= step:
            raise _Bad(f"references {sorted(refs)} must be older steps than {step}")
    elif "references" in d:
        raise _Bad(f"'references' (an incremental checkpoint's) in a manifest of version "
                   f"{version}")
    split = version == SPLIT_VERSION or (
        version == EXT_VERSION and all(isinstance(r, dict) and "index" in r for r in ranks_raw))
    if split:
        parts: dict[str, Any] = {}  # node index parts read once for all their ranks
        ranks = [_summary(i, r, f"rank entry {i}", directory, refs, parts)
                 for i, r in enumerate(ranks_raw)]
    else:
        ranks = [_entry(i, r, f"rank entry {i}", refs) for i, r in enumerate(ranks_raw)]
    if refs is not None:
        used = set().union(*(r.references if split else set(r.referred_steps())
                             for r in ranks))
        if used != refs:
            raise _Bad(f"references {sorted(refs)} are not the steps the ranks refer to "
                       f"({sorted(used)})")
    created = _get(d, "created", (int, float), "manifest")
    return Manifest(
        step=step, world_size=world,
        run_id=_get(d, "run_id", str, "manifest"), ranks=ranks,
        metadata=_get(d, "metadata", dict, "manifest"), created=float(created),
        checksum_algorithm=algo, checksum_block=block, version=version,
        references=sorted(refs or ()),
    )
