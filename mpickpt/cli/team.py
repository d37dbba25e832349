"""The processes a command runs on: one, or every rank of ``mpiexec -n N mpickpt ...``.

Rank 0 runs the command (it alone reads ROOT's listing, prints and changes anything); the other
ranks wait for work. Full verification is shared: rank 0 splits the shards to check over the ranks
(largest first, each to the least loaded rank), broadcasts the plan, checks its own share, and
gathers everyone's verdicts. So is the node-local level (:mod:`.local`), of which each rank may
see only its own node's directory: every rank sends what it sees there (:class:`LookLocal`), and
``mpickpt drain`` has each shard verified and copied into ROOT by a rank that holds it
(:class:`CopyShards`). All communication goes through :class:`mpickpt.mpi.protocol.Protocol`
(deadlines included); payloads are the small frozen records below and in :mod:`.local`
(:class:`Job`, :class:`Verdict`, :class:`View` and the orders :class:`LookAt`, :class:`Check`,
:class:`LookLocal`, :class:`ReadManifest`, :class:`CopyShards`, :class:`Stop`), of paths, numbers
and sentences only (and once, for a drain, one manifest's bytes). A single process does everything
itself and never communicates: MPI (mpi4py) is imported only when the environment says that a
launcher started this process (:func:`launched`), so a plain ``mpickpt ls`` never initialises it.

Before a command that reads ROOT, :meth:`Team.same_root` makes sure every rank sees the same
directory: each rank lists the path it was given (resolved in its own working directory, as the
job's ranks would) and hashes the newest manifest; nothing is written into ROOT.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CollectiveTimeout, ManifestError
from ..format import checksum, rootdir
from ..format.manifest import Manifest, read_bytes
from ..ranks import ranks_text
from . import EXIT_ERROR
from .catalog import MANIFEST, Entry, ManifestUnreadable, Problem, read_manifest
from .checks import verify_shard
from .drainpart import Copied, CopyJob, copy_share
from .local import LocalView, look
from .render import Out, Progress

if TYPE_CHECKING:
    from ..mpi.protocol import Protocol



@dataclass(frozen=True, slots=True)
class Job:
    """One shard to check: rank ``rank``'s shard of the checkpoint in ``checkpoint``, of
    ``nbytes`` tensor bytes, as the manifest of digest ``digest`` describes it."""

    checkpoint: str
    rank: int
    nbytes: int
    digest: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """What checking a :class:`Job` found: ``reason`` and ``file`` are None when the shard is
    intact; ``restorable`` when restore loads it all the same (the problem is in its HDF5
    metadata only)."""

    checkpoint: str
    rank: int
    reason: str | None
    file: str | None
    nbytes: int  # tensor bytes checked
    restorable: bool


@dataclass(frozen=True, slots=True)
class View:
    """What one process sees at a path: what it is (``directory``, ``file``, ``nothing``, or
    ``error``), the committed checkpoints' names, newest first, the hash of the newest one's
    MANIFEST.json (or why there is none, or the error), and the absolute path."""

    kind: str
    names: list[str]
    digest: str | None
    where: str

    def same(self, other: View) -> bool:
        """Whether both see the same; the absolute paths may differ (mount points, working
        directories) and are not compared."""
        return (self.kind, self.names, self.digest) == (other.kind, other.names, other.digest)


# rank 0's orders to the other ranks
@dataclass(frozen=True, slots=True)
class LookAt:
    """Send back your :class:`View` of ``path``."""

    path: str


@dataclass(frozen=True, slots=True)
class Check:
    """Check your share ``shares[rank]`` and send back its verdicts (:class:`Verdict`)."""

    shares: list[list[Job]]


@dataclass(frozen=True, slots=True)
class LookLocal:
    """Send back your :class:`~.local.LocalView` of the local level at ``path``."""

    path: str


@dataclass(frozen=True, slots=True)
class ReadManifest:
    """Rank ``rank``: send back the bytes of the MANIFEST.json in ``path`` (or why not); the
    others: None."""

    rank: int
    path: str


@dataclass(frozen=True, slots=True)
class CopyShards:
    """Verify and copy your share ``shares[rank]`` of a drain and send back what became of
    each (:class:`~.drainpart.Copied`)."""

    shares: list[list[CopyJob]]
    threads: int


@dataclass(frozen=True, slots=True)
class Stop:
    """The command is done: return ``code``."""

    code: int

# set by the process managers of MPICH/Intel MPI (Hydra), Open MPI, PMIx and MVAPICH in every rank
LAUNCH_ENV = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
              "OMPI_COMM_WORLD_RANK", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")


def launched() -> bool:
    """Whether an MPI launcher (mpiexec, mpirun, srun with PMI) started this process."""
    return any(os.environ.get(k) for k in LAUNCH_ENV)


def _digest(m: Manifest) -> str:
    return checksum.digest(m.to_json().encode())


def root_view(path: str) -> View:
    """What this process sees at ``path`` (:class:`View`). Reads, never writes."""
    root = os.path.abspath(path)
    kind = "directory" if os.path.isdir(root) else "file" if os.path.exists(root) else "nothing"
    found = rootdir.committed(root) if kind == "directory" else []
    digest = None
    if found:
        try:
            fd = rootdir.open_regular(os.path.join(found[0][1], MANIFEST))
            with os.fdopen(fd, "rb") as f:
                digest = checksum.digest(f.read())
        except OSError as e:
            digest = f"unreadable: {e.strerror}"
    return View(kind, [os.path.basename(p) for _, p in found], digest, root)


def _seen(view: View) -> str:
    if view.kind != "directory":
        what = {"nothing": "no such directory", "file": "a file"}.get(
            view.kind, f"{view.kind} {view.digest}")
    elif not view.names:
        what = "no committed checkpoint"
    else:
        what = (f"{len(view.names)} committed checkpoint(s), the newest {view.names[0]} "
                f"(manifest {view.digest})")
    return f"{view.where}: {what}"


class Team:
    def __init__(self, timeout: float, threads: int) -> None:
        self.rank, self.size = 0, 1
        self.threads = threads
        self.proto: Protocol | None = None  # when several ranks run the command
        if launched():
            from ..mpi.protocol import Protocol  # initialises MPI

            proto = Protocol(None, timeout)
            self.rank, self.size = proto.rank, proto.size
            if proto.size == 1:
                proto.free()
            else:
                self.proto = proto

    def same_root(self, path: str) -> str | None:
        """Rank 0: None when every rank sees the same ``path`` (the same committed checkpoints,
        the same newest manifest), else the sentence saying which ranks do not, and what to do."""
        if self.proto is None:
            return None
        self.proto.bcast(LookAt(path), "cli-work")
        try:
            mine = root_view(path)
        except Exception as e:  # the others are in the gather already: answer it all the same
            mine = View("error", [], f"{type(e).__name__}: {e}", path)
        views: list[View] = self.proto.gather(mine, "cli-verdicts") or []
        differ = [r for r, v in enumerate(views) if not v.same(views[0])]
        if not differ:
            return None
        verb = "sees" if len(differ) == 1 else "see"
        return (f"{path}: {ranks_text(differ)} of this command {verb} another directory there "
                f"than rank 0 (rank 0, {_seen(views[0])}; rank {differ[0]}, "
                f"{_seen(views[differ[0]])}): {rootdir.not_shared_hint()}. If a job is writing "
                "into ROOT right now, run the command again once it has committed.")

    def checked(self, out: Out, name: str, path: str, command: Callable[[], int]
                ) -> Callable[[], int]:
        """``command`` for :meth:`lead`, run only once every rank sees the same ``path``; else
        exit 1 with the reason (also as ``--json``, command ``name``)."""

        def run() -> int:
            why = self.same_root(path)
            if why is None:
                return command()
            out.problem(why)
            out.json({"command": name, "exit_code": EXIT_ERROR, "error": why})
            return EXIT_ERROR

        return run

    def local_views(self, path: str) -> list[LocalView]:
        """Rank 0: every process's view of the local level at ``path`` (process ``i``'s at
        ``i``)."""
        if self.proto is None:
            return [look(path)]
        self.proto.bcast(LookLocal(path), "cli-work")
        return self.proto.gather(_look(path), "cli-verdicts") or []

    def manifest_bytes(self, rank: int, path: str) -> bytes | str:
        """Rank 0: the bytes of ``path``/MANIFEST.json as process ``rank`` reads them, or why it
        cannot."""
        if self.proto is not None and rank != 0:
            self.proto.bcast(ReadManifest(rank, path), "cli-work")
            got = self.proto.gather(None, "cli-verdicts") or []
            return got[rank]
        return _read_manifest(path)

    def copy(self, shares: list[list[CopyJob]], progress: Progress | None = None
             ) -> list[Copied]:
        """Rank 0: each process verifies and copies its share of a drain; what became of every
        job."""
        if self.proto is not None:
            self.proto.bcast(CopyShards(shares, self.threads), "cli-work")
        mine = _copy(shares[0], self.threads, progress.add if progress else None)
        if self.proto is None:
            return mine
        return [c for part in self.proto.gather(mine, "cli-verdicts") or [] for c in part]

    def lead(self, command: Callable[[], int]) -> int:
        """Run ``command`` on rank 0 while the other ranks serve; every rank returns its code."""
        if self.rank != 0:
            return self._serve()
        code = EXIT_ERROR
        try:
            code = command()
        except CollectiveTimeout as e:
            print(f"mpickpt: {e}; aborting the job", file=sys.stderr)
            assert self.proto is not None
            self.proto.abort(EXIT_ERROR)
        except BrokenPipeError:  # the reader went away (| head): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except Exception:
            traceback.print_exc()
            print("mpickpt: internal error (above); nothing further was changed", file=sys.stderr)
        finally:
            if self.proto is not None:
                try:
                    self.proto.bcast(Stop(code), "cli-work")
                except CollectiveTimeout as e:
                    print(f"mpickpt: {e}; aborting the job", file=sys.stderr)
                    self.proto.abort(EXIT_ERROR)
                self.proto.free()
        return code

    def _serve(self) -> int:
        assert self.proto is not None
        while True:
            msg: Stop | LookAt | Check | LookLocal | ReadManifest | CopyShards = \
                self.proto.bcast(None, "cli-work")
            if isinstance(msg, Stop):
                self.proto.free()
                return int(msg.code)
            if isinstance(msg, LookLocal):
                self.proto.gather(_look(msg.path), "cli-verdicts")
                continue
            if isinstance(msg, ReadManifest):
                mine = _read_manifest(msg.path) if msg.rank == self.rank else None
                self.proto.gather(mine, "cli-verdicts")
                continue
            if isinstance(msg, CopyShards):
                self.proto.gather(_copy(msg.shares[self.rank], msg.threads, None),
                                  "cli-verdicts")
                continue
            if isinstance(msg, LookAt):
                try:
                    view = root_view(msg.path)
                except Exception as e:  # say so rather than leave rank 0 waiting
                    view = View("error", [], f"{type(e).__name__}: {e}", msg.path)
                self.proto.gather(view, "cli-verdicts")
                continue
            share = msg.shares[self.rank]
            try:
                verdicts = self._check(share, None)
            except Exception as e:  # say so rather than leave rank 0 waiting for the deadline
                verdicts = [Verdict(j.checkpoint, j.rank, f"rank {j.rank}: {j.checkpoint}: rank "
                                    f"{self.rank} of this command could not check it: "
                                    f"{type(e).__name__}: {e}", None, 0, False)
                            for j in share]
            self.proto.gather(verdicts, "cli-verdicts")

    def verify(self, entries: list[Entry], out: Out) -> tuple[int, float]:
        """Rank 0: check every checksum of the entries that passed the quick check, spread over
        the ranks; mark each corrupt or 'full'. Returns (tensor bytes read, seconds)."""
        t0 = time.monotonic()
        jobs = [Job(e.path, r.rank, sum(t.nbytes for t in r.tensors), _digest(e.manifest))
                for e in entries if e.status == "committed" and e.manifest is not None
                for r in e.manifest.ranks]
        shares: list[list[Job]] = [[] for _ in range(self.size)]
        load = [0] * self.size
        for job in sorted(jobs, key=lambda j: -j.nbytes):
            i = load.index(min(load))
            shares[i].append(job)
            load[i] += job.nbytes
        known = {e.path: e.manifest for e in entries if e.manifest is not None}
        label = "verifying" if self.size == 1 else f"verifying (rank 0's share of {self.size})"
        progress = out.progress(label, load[0])
        if self.proto is not None:
            self.proto.bcast(Check(shares), "cli-work")
        verdicts = self._check(shares[0], known, progress)
        progress.close()
        if self.proto is not None:
            gathered = self.proto.gather(verdicts, "cli-verdicts") or []
            verdicts = [v for share in gathered for v in share]
        by_path = {e.path: e for e in entries}
        checked = 0
        for v in sorted(verdicts, key=lambda v: (v.checkpoint, v.rank)):
            checked += v.nbytes
            if v.reason is not None:
                by_path[v.checkpoint].fail([Problem(v.reason, v.rank, v.file,
                                                    restorable=v.restorable)])
        for e in entries:
            if e.status == "committed" and e.manifest is not None:
                e.verified = "full"
        return checked, time.monotonic() - t0

    def _check(self, share: list[Job], known: dict[str, Any] | None,
               progress: Progress | None = None) -> list[Verdict]:
        manifests: dict[str, Manifest | str] = dict(known or {})
        out = []
        for job in share:
            path, rank = job.checkpoint, job.rank
            m = manifests.get(path)
            if m is None:
                try:
                    m = read_manifest(path)
                    if _digest(m) != job.digest:
                        m = f"{os.path.join(path, MANIFEST)} changed while it was being verified"
                except ManifestUnreadable as e:
                    m = f"{e} (it changed while it was being verified)"
                manifests[path] = m
            if isinstance(m, str):
                out.append(Verdict(path, rank, m, os.path.join(path, MANIFEST), 0, False))
                continue
            try:
                p = verify_shard(path, m, rank, self.threads,
                                 progress.add if progress is not None else None)
            except Exception as e:  # an I/O error of this process: report it, do not hang others
                p = Problem(f"rank {rank}: {path}: {type(e).__name__}: {e}", rank, None)
            out.append(Verdict(path, rank, p and p.reason, p and p.file, job.nbytes,
                               bool(p and p.restorable)))
        return out


def _look(path: str) -> LocalView:
    """This process's view of the local level; an error is said in it, never raised (the others
    are waiting in the gather)."""
    try:
        return look(path)
    except Exception as e:
        return LocalView(os.path.abspath(path), f"{path}: {type(e).__name__}: {e}", [])


def _read_manifest(path: str) -> bytes | str:
    try:
        return read_bytes(path)
    except Exception as e:
        return str(e) if isinstance(e, ManifestError) else f"{path}: {type(e).__name__}: {e}"


def _copy(share: list[CopyJob], threads: int,
          on_bytes: Callable[[int], None] | None) -> list[Copied]:
    """:func:`~.drainpart.copy_share`, every failure said in the results rather than raised."""
    try:
        return copy_share(share, threads, on_bytes)
    except Exception as e:
        return [Copied(j.rank, j.src, None, f"rank {j.rank}: {j.src}: {type(e).__name__}: {e}", 0)
                for j in share]
