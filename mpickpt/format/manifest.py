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
* With index parts (version 2 or 3), ``replicated``, when present, is the part
  ``index/replicated.json`` (its exact size and xxh3-64): the records of the tensors every rank
  holds alike (DDP's), by the rank that wrote each, sent to rank 0 with the summaries and
  written by it before the manifest. They are in their writers' parts too: the replicated part
  spares a restoring rank one part per writer (:meth:`Manifest.replica_entry`). Older readers
  ignore it.
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
import marshal
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError
from . import checksum
from .entry import (
    MAX_BYTES,
    Bad,
    IndexRef,
    RankEntry,
    count_read,
    entry_refs,
    field_of,
    open_regular,
    parse_entry,
    parse_replicas,
    parse_summary,
    part_errors,
    read_json_part,
    steps_field,
)
from .names import REPLICATED_PART

NAME = "MANIFEST.json"
FORMAT = "mpickpt"
VERSION = 1  # every rank's records inline
SPLIT_VERSION = 2  # per-rank index parts
EXT_VERSION = 3  # records may refer to older shards (incremental) or be compressed
VERSIONS = (VERSION, SPLIT_VERSION, EXT_VERSION)
CHECKSUM_FIELD = "manifest_checksum"


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
    # with index parts: the records of the tensors every rank holds alike, in one part
    replicated: IndexRef | None = None
    directory: str | None = field(default=None, compare=False, repr=False)
    _replicas: dict[int, RankEntry] | None = field(default=None, compare=False, repr=False)
    # the ranks' entries in canonical JSON, as assembled (:meth:`assemble`): what to_json
    # writes for them, unless the entries are changed meanwhile
    _texts: list[str] | None = field(default=None, compare=False, repr=False)

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

    def replica_entry(self, rank: int) -> RankEntry:
        """Rank ``rank``'s entry as a restore needs it for the replicated tensors it wrote: from
        the replicated part when there is one and the rank's own part is not read yet (every
        writer's records in one read, not one part per writer), else the whole entry."""
        entry = self.ranks[rank]
        if self.replicated is None or entry.at_hand:
            return entry
        if self._replicas is None:
            self._replicas = self._read_replicas()
        return self._replicas.get(rank, entry)

    def _read_replicas(self) -> dict[int, RankEntry]:
        assert self.replicated is not None
        ref = self.replicated
        if self.directory is None:
            raise ManifestError(f"step {self.step}: the replicated part, and no directory")
        path = os.path.join(self.directory, ref.file)
        with part_errors(path):
            return parse_replicas(read_json_part(path, ref, "the replicated part"), path,
                                  self.ranks)

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
        if self.replicated is not None:
            d["replicated"] = self.replicated.to_dict()
        d["created_iso"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        # written in its canonical form (the checksum's input) with the checksum appended: one
        # encoding, by json's C encoder (never with indent: 10x slower); `mpickpt inspect` shows
        # it laid out. A reader parses it and serializes it canonically again (:func:`_digest`).
        # The entries as the ranks sent them are spliced in, already canonical: serializing
        # them again was half of rank 0's commit of a small state (0.4 of 0.9 ms, 4 ranks)
        texts = self._texts
        if texts is not None:
            d["ranks"] = _Spliced(texts)
        text = _splice(d) if texts is not None else _canonical(d, allow_nan=False)
        return f'{text[:-1]},"{CHECKSUM_FIELD}":"{checksum.digest(text.encode())}"}}'

    @classmethod
    def assemble(cls, step: int, world_size: int, run_id: str,
                 entries: list[dict[str, Any]], metadata: dict[str, Any],
                 checksum_block: int, directory: str | None = None,
                 extended: bool = False, replicated: IndexRef | None = None,
                 memo: Memo | None = None) -> Manifest:
        """The manifest of the ranks' entries (each a :class:`RankEntry` as a dict, or its
        :meth:`RankEntry.summary` with its index part in ``directory``, as the ranks send
        them), held to the rules a parsed manifest obeys; ManifestError otherwise.
        ``extended``: version 3 (incremental or compressed records) whatever the records say;
        ``replicated``: the replicated part rank 0 wrote into ``directory``; ``memo``: the
        entries of the last manifest assembled, each neither checked nor serialized again if
        its rank sent it alike (:class:`Memo`)."""
        memo = memo if memo is not None else Memo()
        texts, known = memo.texts(entries, use=not extended)
        split = bool(entries) and all(isinstance(e, dict) and "index" in e for e in entries)
        refs: set[int] = set()
        for e in entries:
            if isinstance(e, dict):
                refs.update(entry_refs(e))
        d = {"format": FORMAT, "version": EXT_VERSION if refs or extended else
             SPLIT_VERSION if split else VERSION, "step": step,
             "world_size": world_size, "run_id": run_id, "ranks": entries,
             "metadata": metadata, "created": time.time(),
             "checksum_algorithm": checksum.ALGORITHM, "checksum_block": checksum_block}
        if refs or extended:
            d["references"] = sorted(refs)
        if replicated is not None:
            d["replicated"] = replicated.to_dict()
        try:
            manifest = _parse(d, directory, known)
        except Bad as e:
            raise ManifestError(f"the manifest of step {step}: {e}") from None
        manifest._texts = [t for t, _, _ in texts]
        memo.keep(entries, texts, manifest)
        return manifest

    @classmethod
    def read(cls, directory: str) -> Manifest:
        """The manifest of the committed checkpoint in ``directory`` (:func:`read_bytes`,
        then :meth:`from_json`)."""
        return cls.from_json(read_bytes(directory), os.path.join(directory, NAME))

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
            if field_of(d, CHECKSUM_FIELD, str, "manifest") != _digest(d):
                raise Bad("checksum mismatch: the manifest is corrupt")
            return manifest
        except Bad as e:
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
    f, size = open_regular(path, "")
    with f:
        # the size fstat gave and a byte more, not the largest size allowed: a read of n
        # bytes allocates n bytes first (1 GiB per manifest read, before)
        data = f.read(size + 1) if size <= MAX_BYTES else b""
        if size > MAX_BYTES or len(data) > MAX_BYTES:
            raise ManifestError(f"{path}: {max(size, len(data))} bytes is too large for a "
                                "manifest")
    count_read(len(data), False)
    return data


def _digest(d: dict[str, Any]) -> str:
    """xxh3-64 of every field of a manifest but its own checksum, serialized canonically."""
    return checksum.digest(_canonical({k: v for k, v in d.items() if k != CHECKSUM_FIELD})
                           .encode())


def _canonical(d: dict[str, Any], allow_nan: bool = True) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=allow_nan)


class _Spliced(list):  # type: ignore[type-arg]
    """A list of values already in canonical JSON (:func:`_splice`)."""


def _splice(d: dict[str, Any]) -> str:
    """``_canonical(d, allow_nan=False)``, but a top-level :class:`_Spliced` value is written
    as the JSON list of its texts, as they are (json.dumps joins items with the same
    separators, in the same key order)."""
    parts = []
    for k in sorted(d):
        v = d[k]
        text = ("[" + ",".join(v) + "]" if isinstance(v, _Spliced)
                else _canonical(v, allow_nan=False))
        parts.append(f"{json.dumps(k)}:{text}")
    return "{" + ",".join(parts) + "}"


def entry_text(d: dict[str, Any], tree: str | None = None) -> str:
    """A rank's entry ``d`` (:meth:`RankEntry.to_dict` or :meth:`RankEntry.summary`) in the
    canonical JSON the manifest holds it in; ``tree``: its ``"tree"`` already in canonical
    JSON (the shard's attribute, :func:`tree_text`), spliced in rather than serialized again."""
    if tree is None or "tree" not in d:
        return _canonical(d, allow_nan=False)
    rest = {k: v for k, v in d.items() if k != "tree"}
    assert all(k < "tree" for k in rest), rest.keys()  # "tree" comes last in canonical order
    return f'{_canonical(rest, allow_nan=False)[:-1]},"tree":{tree}}}'


def tree_text(tree: dict[str, Any]) -> str:
    """A state tree in canonical JSON: the shard's attribute, and the manifest's."""
    return _canonical(tree, allow_nan=False)


def tree_key(tree: Any) -> bytes | None:
    """A tree's exact value, to tell whether two trees serialize alike: ``==`` takes ``1``,
    ``1.0`` and ``True`` as equal, and ``0.0`` and ``-0.0``; marshal's format 2 (no
    references, floats as their bits) does not. 1.2 ms for the tree of 8,000 tensors. None
    for a value that is not JSON's (marshal cannot hold it): alike to none."""
    try:
        return marshal.dumps(tree, 2)
    except ValueError:
        return None


class Memo:
    """Rank 0's entries of the last manifest it assembled, each as its rank sent it, in
    canonical JSON and parsed: an entry sent again alike (a rank that writes no tensor sends
    the same entry every save while its state's tree stays the same) is neither checked nor
    serialized again, and the tree of one whose records changed is not serialized again.
    Entries with index parts or of version 3 are always parsed."""

    def __init__(self) -> None:
        # by rank: (the entry as sent, its text, its tree's text, the parsed entry, its tree's
        # tree_key or None)
        self._last: dict[int, tuple[Any, str, str | None, RankEntry, bytes | None]] = {}

    def texts(self, entries: list[Any], use: bool = True
              ) -> tuple[list[tuple[str, str | None, bytes | None]], dict[int, RankEntry]]:
        """Each entry's canonical JSON, that of its tree (:func:`entry_text`) and its tree's
        :func:`tree_key`, and the parsed entries (by rank) of those sent alike last time; with
        ``use`` False, none."""
        texts, known = [], {}
        for i, e in enumerate(entries):
            hit = self._last.get(i) if use else None
            has_tree = isinstance(e, dict) and isinstance(e.get("tree"), dict)
            key = tree_key(e["tree"]) if has_tree else None
            same = hit is not None and key is not None and hit[4] == key
            if hit is not None and hit[0] == e and (same or not has_tree):
                texts.append((hit[1], hit[2], key))
                known[i] = hit[3]
                continue
            tree = None
            if has_tree:
                tree = hit[2] if same and hit is not None and hit[2] is not None \
                    else tree_text(e["tree"])
            texts.append((entry_text(e, tree) if isinstance(e, dict)
                          else _canonical(e, allow_nan=False), tree, key))
        return texts, known

    def keep(self, entries: list[Any], texts: list[tuple[str, str | None, bytes | None]],
             manifest: Manifest) -> None:
        """Keep what :meth:`texts` was given and made (and ``manifest``, parsed from them)."""
        self._last = {} if manifest.split or manifest.extended else {
            i: (e, t, tree, parsed, key) for i, (e, (t, tree, key), parsed) in enumerate(
                zip(entries, texts, manifest.ranks, strict=True))}


def _parse(d: Any, directory: str | None = None, known: dict[int, RankEntry] | None = None
           ) -> Manifest:
    """``known``: entries (by rank) already parsed from the same JSON (:class:`Memo`)."""
    fmt = field_of(d, "format", str, "manifest")
    version = field_of(d, "version", int, "manifest")
    if fmt != FORMAT or version not in VERSIONS:
        raise Bad(f"format {fmt!r} version {version} is not {FORMAT!r} version "
                   f"{', '.join(map(str, VERSIONS))}; use the mpickpt release that wrote it")
    world = field_of(d, "world_size", int, "manifest")
    block = field_of(d, "checksum_block", int, "manifest")
    algo = field_of(d, "checksum_algorithm", str, "manifest")
    if algo != checksum.ALGORITHM or block <= 0:
        raise Bad(f"checksum {algo!r} with block {block} is not supported")
    ranks_raw = field_of(d, "ranks", list, "manifest")
    if world <= 0 or len(ranks_raw) != world:
        raise Bad(f"world_size {world} but {len(ranks_raw)} rank entries")
    step = field_of(d, "step", int, "manifest")
    sizes: dict[Any, Any] = {}
    for i, r in enumerate(ranks_raw):  # the ranks of a node's file agree on its size
        if not isinstance(r, dict):
            continue
        if sizes.setdefault(r.get("file"), r.get("bytes")) != r.get("bytes"):
            raise Bad(f"rank entry {i}: file {r.get('file')!r} of {r.get('bytes')} bytes, "
                       f"another rank's entry says {sizes[r.get('file')]}")
    refs = None
    if version == EXT_VERSION:
        refs = frozenset(steps_field(field_of(d, "references", list, "manifest"), "references"))
        if refs and max(refs) >= step:
            raise Bad(f"references {sorted(refs)} must be older steps than {step}")
    elif "references" in d:
        raise Bad(f"'references' (an incremental checkpoint's) in a manifest of version "
                   f"{version}")
    split = version == SPLIT_VERSION or (
        version == EXT_VERSION and all(isinstance(r, dict) and "index" in r for r in ranks_raw))
    if split:
        parts: dict[str, Any] = {}  # node index parts read once for all their ranks
        ranks = [parse_summary(i, r, f"rank entry {i}", directory, refs, parts)
                 for i, r in enumerate(ranks_raw)]
    else:  # the ranks of a DDP job have equal trees: the depth of one is checked
        ranks = []
        for i, r in enumerate(ranks_raw):
            ranks.append(known[i] if known and i in known and refs is None else parse_entry(
                i, r, f"rank entry {i}", refs, ranks[-1].tree if ranks else None))
    if refs is not None:
        used = set().union(*(r.references if split else set(r.referred_steps())
                             for r in ranks))
        if used != refs:
            raise Bad(f"references {sorted(refs)} are not the steps the ranks refer to "
                       f"({sorted(used)})")
    replicated = None
    if "replicated" in d:
        ix = field_of(d, "replicated", dict, "manifest")
        replicated = IndexRef(field_of(ix, "file", str, "replicated"),
                              field_of(ix, "bytes", int, "replicated"),
                              field_of(ix, "xxh3", str, "replicated"))
        if not split or replicated.file != REPLICATED_PART or not (
                0 <= replicated.bytes <= MAX_BYTES):
            raise Bad(f"replicated part {ix!r}: not {REPLICATED_PART!r} of at most "
                       f"{MAX_BYTES} bytes in a manifest with index parts")
    created = field_of(d, "created", (int, float), "manifest")
    return Manifest(
        step=step, world_size=world,
        run_id=field_of(d, "run_id", str, "manifest"), ranks=ranks,
        metadata=field_of(d, "metadata", dict, "manifest"), created=float(created),
        checksum_algorithm=algo, checksum_block=block, version=version,
        references=sorted(refs or ()), replicated=replicated, directory=directory,
    )
