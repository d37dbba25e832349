"""Options that belong together, given to :class:`~mpickpt.Checkpointer` as one object that
checks its own settings (:class:`Local`, :class:`Files`, :class:`Retention`), and the check of
the options that cannot go together (:func:`check_combinations`).

``Checkpointer(root, local=Local("/dev/shm/run", redundancy="partner", persist_every=10))``.
A bare path (``local="/dev/shm/run"``) is ``Local(path)``, with every default. The flat
keywords of earlier releases (``redundancy=``, ``persist_every=``, ``keep_local=``,
``local_budget=``, ``xor_set=``, ``drain_bandwidth=``) still work, with a
:class:`DeprecationWarning` that shows the ``Local(...)`` to write instead. The same for
``Files(per="node", fanout=..., index=...)``: ``files="per-node"`` is ``Files(per="node")``, and
``fanout=`` and ``index=`` are the deprecated flat keywords; and for ``keep=Retention(3,
keep_every=1000, best=("val_loss", "min"), keep_best=2)``: ``keep=3`` is ``Retention(3)``, and
``keep_every=``, ``best=`` and ``keep_best=`` are the deprecated flat keywords.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from .format import codec
from .format.checksum import DEFAULT_BLOCK
from .format.names import FANOUT
from .format.shard import DEFAULT_ALIGNMENT
from .save.incremental import frozen_matcher
from .save.retention import Policy
from .sharding import MIN_WRITE_SHARE

SCHEMES = ("partner", "xor")  # the node-local level's redundancy (mpickpt.local.topology)


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # a flat keyword the caller did not give


class _Group:
    """Options that go together. Its repr is the call that makes it: the first ``POSITIONAL``
    fields by position, the others only where they differ from their default (what the
    deprecation warnings show the caller to write)."""

    POSITIONAL = 0

    def __repr__(self) -> str:
        every = fields(self)  # type: ignore[arg-type]
        shown = [repr(_plain(getattr(self, f.name))) for f in every[:self.POSITIONAL]]
        shown += [f"{f.name}={getattr(self, f.name)!r}" for f in every[self.POSITIONAL:]
                  if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(shown)})"


def _plain(value: object) -> object:
    return os.fspath(value) if isinstance(value, os.PathLike) else value

# the flat keywords of Checkpointer, and the field of Local each one became
LOCAL_KEYWORDS = {"redundancy": "redundancy", "persist_every": "persist_every",
                  "keep_local": "keep", "local_budget": "budget", "xor_set": "xor_set",
                  "drain_bandwidth": "drain_bandwidth"}


@dataclass(frozen=True, repr=False)
class Local(_Group):
    """The node-local level: every save is committed in ``path`` on each node first (memory,
    ``/dev/shm/...``, or an NVMe scratch directory) and protected from the loss of a node by
    ``redundancy``: ``"partner"`` (a copy of each shard on another node), ``"xor"`` (parity over
    sets of ``xor_set`` nodes, default 4) or None (a restart of the job, not the loss of a node).
    Every ``persist_every``-th save (None: none besides the emergency one and the last) is then
    drained to ROOT, at most ``drain_bandwidth`` bytes per second per rank. ``keep`` protected
    checkpoints stay on the nodes besides the one being written, within ``budget`` bytes per
    node."""

    POSITIONAL = 1
    path: str | os.PathLike[str]
    redundancy: str | None = None
    persist_every: int | None = 10
    keep: int = 1
    budget: int | None = None
    xor_set: int | None = None
    drain_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"Local(path) must be a directory path, not {self.path!r}")
        if self.redundancy not in (None, *SCHEMES):
            raise ValueError(f"Local(redundancy=) must be 'partner', 'xor' or None, not "
                             f"{self.redundancy!r}")
        if self.persist_every is not None and not _positive_int(self.persist_every):
            raise ValueError(f"Local(persist_every=) must be a positive int or None, not "
                             f"{self.persist_every!r}")
        if not _positive_int(self.keep):
            raise ValueError(f"Local(keep=) must be 1 or more, not {self.keep!r}")
        if self.budget is not None and not _positive_int(self.budget):
            raise ValueError(f"Local(budget=) must be a positive number of bytes or None, not "
                             f"{self.budget!r}")
        if self.xor_set is not None:
            if self.redundancy != "xor":
                raise ValueError(f"Local(xor_set={self.xor_set!r}) sizes the parity sets of "
                                 f"redundancy='xor', not of redundancy={self.redundancy!r}")
            if not _positive_int(self.xor_set) or self.xor_set < 2:
                raise ValueError(f"Local(xor_set=) must be 2 nodes or more, not "
                                 f"{self.xor_set!r}")
        if self.drain_bandwidth is not None and not (
                isinstance(self.drain_bandwidth, (int, float)) and self.drain_bandwidth > 0):
            raise ValueError(f"Local(drain_bandwidth=) must be bytes per second > 0 or None, "
                             f"not {self.drain_bandwidth!r}")


def local_of(local: str | os.PathLike[str] | Local | None, flat: dict[str, Any],
             stacklevel: int = 3) -> Local | None:
    """The node-local level's settings from Checkpointer's ``local=`` and its deprecated flat
    keywords (``flat``: keyword -> value, :data:`UNSET` where not given)."""
    if local is None:
        if flat.get("redundancy", UNSET) not in (UNSET, None):
            raise ValueError("redundancy protects the node-local level: give local= too")
        return None
    return _grouped(local, Local, "local", "the node-local level's settings", flat,
                    lambda given: Local(local, **{LOCAL_KEYWORDS[k]: v
                                                  for k, v in given.items()}), stacklevel)


G = TypeVar("G", bound=_Group)


def _grouped(value: object, cls: type[G], keyword: str, what: str, flat: dict[str, Any],
             make: Callable[[dict[str, Any]], G], stacklevel: int) -> G:
    """The group Checkpointer's ``keyword=`` gives: ``value`` itself when it is a ``cls`` (a
    flat keyword given too is refused), else ``make`` of the flat keywords given (``flat``:
    :data:`UNSET` where not), with a DeprecationWarning naming them and the ``cls(...)`` to
    write instead, at the caller ``stacklevel`` frames up from the ``*_of`` function."""
    given = {k: v for k, v in flat.items() if v is not UNSET}
    if isinstance(value, cls):
        if given:
            raise ValueError(f"give {what} in {cls.__name__}(...) only, not also as "
                             f"Checkpointer keywords ({', '.join(given)})")
        return value
    group = make(given)
    if given:
        warnings.warn(f"Checkpointer({', '.join(f'{k}=' for k in given)}...) is deprecated: "
                      f"write Checkpointer(..., {keyword}=mpickpt.{group!r}); the flat keywords "
                      "go in a later release", DeprecationWarning, stacklevel=stacklevel + 1)
    return group


def choose(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Refuse ``value`` for option ``name`` unless it is one of ``choices`` (ValueError)."""
    if value not in choices:
        said = " or ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be {said}, not {value!r}")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


INDEXES = ("auto", "inline", "per-rank")
MIN_CHECKSUM_BLOCK = 4096
# the flat keywords of Checkpointer that became fields of Files
FILES_KEYWORDS = ("fanout", "index", "alignment", "checksum_block")


@dataclass(frozen=True, repr=False)
class Files(_Group):
    """How a checkpoint is laid out in ROOT: a shard per rank (``per="rank"``) or per node
    (``per="node"``: the node's ranks write disjoint aligned regions of one file, for parallel
    file systems whose metadata servers are the limit); no directory holds more than ``fanout``
    shards or index parts (more go into sub-directories); ``index``: every rank's records in the
    manifest (``"inline"``), in an index part per rank (``"per-rank"``), or ``"auto"`` (per rank
    above 64 ranks). In every shard, in ROOT and on the nodes: tensors of ``alignment`` bytes or
    more start on an ``alignment`` boundary (for direct and parallel I/O), and a checksum covers
    each ``checksum_block`` bytes (4096 or more). The tensors several ranks hold alike
    (``replicated=``) are written by as few of those ranks as gives each writer
    ``min_write_share`` bytes or more, the highest ranks first (a small DDP state: one rank, not
    every rank, writes and syncs it; rank 0 commits); ``0`` spreads them over every rank that
    holds them."""

    per: str = "rank"
    fanout: int = FANOUT
    index: str = "auto"
    alignment: int = DEFAULT_ALIGNMENT
    checksum_block: int = DEFAULT_BLOCK
    min_write_share: int = MIN_WRITE_SHARE

    def __post_init__(self) -> None:
        if self.per not in ("rank", "node"):
            raise ValueError(f"Files(per=) must be 'rank' or 'node', not {self.per!r}")
        if not _positive_int(self.fanout):
            raise ValueError(f"Files(fanout=) must be a positive int, not {self.fanout!r}")
        if self.index not in INDEXES:
            raise ValueError(f"Files(index=) must be 'auto', 'inline' or 'per-rank', not "
                             f"{self.index!r}")
        m = self.min_write_share
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"Files(min_write_share=) must be an int >= 0 (bytes), not {m!r}")
        for name in ("alignment", "checksum_block"):
            value = getattr(self, name)
            if not _positive_int(value) or value & (value - 1):
                raise ValueError(f"Files({name}=) must be a power of two, not {value!r}")
        if self.checksum_block < MIN_CHECKSUM_BLOCK:  # 8 bytes of checksum per block
            raise ValueError(f"Files(checksum_block={self.checksum_block}) is below 4096: a "
                             "checksum of 8 bytes per block would make the records as large as "
                             "the data they describe; give 4096 or more (default 1 MiB)")

    @property
    def per_node(self) -> bool:
        return self.per == "node"


def files_of(files: str | Files, flat: dict[str, Any], stacklevel: int = 3) -> Files:
    """The file layout from Checkpointer's ``files=`` (a :class:`Files`, or ``"per-rank"`` /
    ``"per-node"`` for ``Files(per=...)``) and its deprecated flat keywords ``fanout=``,
    ``index=``, ``alignment=`` and ``checksum_block=`` (``flat``: :data:`UNSET` where not
    given)."""
    if not isinstance(files, Files) and files not in ("per-rank", "per-node"):
        raise ValueError(f"files must be 'per-rank' or 'per-node' (or a Files), not {files!r}")
    return _grouped(files, Files, "files", "the file layout", flat,
                    lambda given: Files(per=str(files)[len("per-"):], **given), stacklevel)


def check_combinations(local: Local | None, files: Files, encoding: Encoding) -> None:
    """Refuse options that cannot go together, naming what to change (ValueError)."""
    if encoding.incremental is not None and local is not None:
        raise ValueError("incremental checkpoints are written to ROOT only: local= drains "
                         "whole shards; give one or the other")
    if encoding.compression is not None and local is not None:
        raise ValueError("compression is written to ROOT only: local= keeps shards raw for "
                         "its redundancy; give one or the other")
    if files.per_node and local is not None:
        raise ValueError("files='per-node' is for ROOT: the node-local level keeps a shard "
                         "per rank for its redundancy; give one or the other")
    if files.per_node and encoding.compression is not None:
        raise ValueError("files='per-node' writes raw regions: compressed chunks are "
                         "written by each shard's own HDF5 file; give one or the other")


# the flat keywords of Checkpointer that became fields of Encoding
ENCODING_KEYWORDS = ("incremental", "frozen", "compression")


@dataclass(frozen=True, repr=False)
class Encoding(_Group):
    """How tensors are written to ROOT (not with ``local=``). ``incremental=N``: a tensor
    whose every block hashes as in the last committed checkpoint is referred to, not written
    again; every ``N``-th save is full. ``frozen``: key paths (or a predicate of tensor names)
    referred to without copying or hashing them until the next full save. ``compression``:
    ``"zstd"`` or ``"zstd+shuffle"`` for every tensor of 64 KiB or more, or key paths to
    codecs (``{"optim": "zstd+shuffle"}``, the longest prefix wins)."""

    incremental: int | None = None
    frozen: Sequence[str] | Callable[[str], bool] | None = None
    compression: str | Mapping[str, str | None] | None = None

    def __post_init__(self) -> None:
        if self.incremental is not None and (not _positive_int(self.incremental)
                                             or self.incremental < 2):
            raise ValueError(f"Encoding(incremental=) must be an int of at least 2 (a full "
                             f"checkpoint every N saves) or None, not {self.incremental!r}")
        if self.frozen and not self.incremental:
            raise ValueError("frozen= names tensors an incremental checkpoint refers to "
                             "without hashing: give incremental=N too")
        self.matcher()  # TypeError for a lone string
        self.chooser()  # ValueError naming an unknown codec

    def matcher(self) -> Callable[[str], bool] | None:
        """``frozen`` as a predicate of tensor names."""
        return frozen_matcher(self.frozen)

    def chooser(self) -> Callable[[str], str | None] | None:
        """``compression`` as tensor name -> codec (None: not compressed)."""
        return codec.chooser(self.compression)


def encoding_of(encoding: Encoding | None, flat: dict[str, Any],
                stacklevel: int = 3) -> Encoding:
    """The encoding from Checkpointer's ``encoding=`` and its deprecated flat keywords
    ``incremental=``, ``frozen=`` and ``compression=``."""
    return _grouped(encoding, Encoding, "encoding", "the encoding", flat,
                    lambda given: Encoding(**given), stacklevel)


# the flat keywords of Checkpointer that became fields of Snapshots
SNAPSHOTS_KEYWORDS = ("max_in_flight", "if_busy", "pinned_budget", "device_staging")


@dataclass(frozen=True, repr=False)
class Snapshots(_Group):
    """The snapshots of the state, taken on the training thread: ``max_in_flight`` may be held
    at once; a save asked for while that many still persist waits for the oldest
    (``if_busy="wait"``) or is skipped on every rank (``"skip"``). They live in host buffers
    allocated once and reused, page-locked with CUDA, within ``pinned_budget`` bytes per node
    (half the node's memory by default); ``device_staging`` lets a CUDA snapshot go through a
    GPU staging buffer when GPU memory allows."""

    max_in_flight: int = 1
    if_busy: str = "wait"
    pinned_budget: int | None = None
    device_staging: bool = True

    def __post_init__(self) -> None:
        if not _positive_int(self.max_in_flight):
            raise ValueError(f"Snapshots(max_in_flight=) must be 1 or more, not "
                             f"{self.max_in_flight!r}")
        choose("if_busy", self.if_busy, ("wait", "skip"))
        if self.pinned_budget is not None and not _positive_int(self.pinned_budget):
            raise ValueError(f"Snapshots(pinned_budget=) must be a positive number of bytes "
                             f"or None, not {self.pinned_budget!r}")

    def budget(self) -> int:
        """``pinned_budget``, or half of this node's memory."""
        if self.pinned_budget is not None:
            return self.pinned_budget
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def snapshots_of(snapshots: Snapshots | None, flat: dict[str, Any],
                 stacklevel: int = 3) -> Snapshots:
    """The snapshots' settings from Checkpointer's ``snapshots=`` and its deprecated flat
    keywords ``max_in_flight=``, ``if_busy=``, ``pinned_budget=`` and ``device_staging=``."""
    return _grouped(snapshots, Snapshots, "snapshots", "the snapshots' settings", flat,
                    lambda given: Snapshots(**given), stacklevel)


# the flat keywords of Checkpointer that became fields of Preemption
PREEMPTION_KEYWORDS = ("deadline", "requeue")


@dataclass(frozen=True, repr=False)
class Preemption(_Group):
    """What a preemption does. ``signals``: handlers for SIGUSR2 (``MPICKPT_SIGNAL`` names
    another) and SIGTERM that only raise a flag, which ``should_exit`` agrees on. ``deadline``
    (Unix time; default ``$MPICKPT_DEADLINE`` or ``$SLURM_JOB_END_TIME``): when the job will be
    killed; an emergency save that cannot finish before it is skipped. ``requeue`` (default:
    under Slurm unless ``$MPICKPT_REQUEUE`` is 0): rank 0 requeues the job once after the
    emergency save when the preemption signal came."""

    POSITIONAL = 1
    signals: bool = True
    deadline: float | None = None
    requeue: bool | None = None


def preemption_of(preemption: bool | Preemption, flat: dict[str, Any],
                  stacklevel: int = 3) -> Preemption:
    """The preemption settings from Checkpointer's ``preemption=`` (a :class:`Preemption`, or
    a bool for ``Preemption(signals)``) and its deprecated flat keywords ``deadline=`` and
    ``requeue=``."""
    if not isinstance(preemption, (bool, Preemption)):
        raise ValueError(f"preemption must be a bool or a Preemption, not {preemption!r}")
    return _grouped(preemption, Preemption, "preemption", "the preemption settings", flat,
                    lambda given: Preemption(bool(preemption), **given), stacklevel)


# the flat keywords of Checkpointer that became fields of Retention
RETENTION_KEYWORDS = ("keep_every", "best", "keep_best")


@dataclass(frozen=True, repr=False)
class Retention(_Group):
    """Which committed checkpoints to keep (see :mod:`mpickpt.save.retention`): the ``keep`` newest,
    every ``keep_every``-th step besides, and the ``keep_best`` best by ``best`` = (metadata
    key, ``"min"`` or ``"max"``). Without ``keep`` every checkpoint is kept. The newest is never
    deleted, and nothing is deleted before a newer checkpoint has committed."""

    POSITIONAL = 1
    keep: int | None = None
    keep_every: int | None = None
    best: tuple[str, str] | None = None
    keep_best: int = 0

    def __post_init__(self) -> None:
        self.policy()  # ValueError naming the option that cannot be

    def policy(self) -> Policy:
        return Policy.of(self.keep, self.keep_every, self.best, self.keep_best)


def retention_of(keep: int | Retention | None, flat: dict[str, Any],
                 stacklevel: int = 3) -> Retention:
    """The retention from Checkpointer's ``keep=`` (a :class:`Retention`, or a number for
    ``Retention(keep)``) and its deprecated flat keywords ``keep_every=``, ``best=`` and
    ``keep_best=`` (``flat``: :data:`UNSET` where not given)."""
    return _grouped(keep, Retention, "keep", "the retention", flat,
                    lambda given: Retention(keep, **given), stacklevel)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Options:
    """Every group of a Checkpointer's options, each checked, and checked together."""

    local: Local | None
    files: Files
    retention: Retention
    encoding: Encoding
    snapshots: Snapshots
    preemption: Preemption


def gather(local: str | os.PathLike[str] | Local | None, files: str | Files,
           keep: int | Retention | None, encoding: Encoding | None,
           snapshots: Snapshots | None, preemption: bool | Preemption,
           deprecated: dict[str, Any], stacklevel: int = 2) -> Options:
    """The groups from Checkpointer's keywords and its deprecated flat ones (``deprecated``:
    every keyword it did not name; one that no group takes is a TypeError), with the
    DeprecationWarnings pointing ``stacklevel`` frames up from here."""
    def flat(keys: Iterable[str]) -> dict[str, Any]:
        return {k: deprecated.pop(k, UNSET) for k in keys}

    up = stacklevel + 2  # _grouped warns from two frames below here
    options = Options(local_of(local, flat(LOCAL_KEYWORDS), up),
                      files_of(files, flat(FILES_KEYWORDS), up),
                      retention_of(keep, flat(RETENTION_KEYWORDS), up),
                      encoding_of(encoding, flat(ENCODING_KEYWORDS), up),
                      snapshots_of(snapshots, flat(SNAPSHOTS_KEYWORDS), up),
                      preemption_of(preemption, flat(PREEMPTION_KEYWORDS), up))
    if deprecated:  # after every group took its own
        raise TypeError(f"Checkpointer() got an unexpected keyword argument "
                        f"{next(iter(deprecated))!r}")
    check_combinations(options.local, options.files, options.encoding)
    return options
