"""The processes a command runs on: one, or every rank of ``mpiexec -n N mpickpt ...``.

Rank 0 runs the command (it alone reads ROOT's listing, prints and changes anything); the other
ranks wait for work. Full verification is the one piece of work shared: rank 0 splits the shards to
check over the ranks (largest first, each to the least loaded rank), broadcasts the plan, checks
its own share, and gathers everyone's verdicts. All communication goes through
:class:`mpickpt.protocol.Protocol` (deadlines included); payloads are plain tuples of paths,
numbers and sentences. A single process does everything itself and never communicates: MPI
(mpi4py) is imported only when the environment says that a launcher started this process
(:func:`launched`), so a plain ``mpickpt ls`` never initialises it.

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
from typing import TYPE_CHECKING, Any

from .. import checksum, layout
from ..errors import CollectiveTimeout
from ..manifest import Manifest
from . import EXIT_ERROR
from .catalog import MANIFEST, Entry, ManifestUnreadable, Problem, read_manifest
from .checks import verify_shard
from .render import Out, Progress, ranks_text

if TYPE_CHECKING:
    from ..protocol import Protocol

# one shard to check: (checkpoint directory, rank of the shard, its tensor bytes, manifest digest)
Job = tuple[str, int, int, str]
# its verdict: (checkpoint directory, rank, reason or None, file or None, bytes checked,
# whether restore loads it all the same: the problem is in its HDF5 metadata only)
Verdict = tuple[str, int, str | None, str | None, int, bool]

# set by the process managers of MPICH/Intel MPI (Hydra), Open MPI, PMIx and MVAPICH in every rank
LAUNCH_ENV = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
              "OMPI_COMM_WORLD_RANK", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")


def launched() -> bool:
    """Whether an MPI launcher (mpiexec, mpirun, srun with PMI) started this process."""
    return any(os.environ.get(k) for k in LAUNCH_ENV)


def _digest(m: Manifest) -> str:
    return checksum.digest(m.to_json().encode())


View = tuple[str, list[str], str | None, str]


def root_view(path: str) -> View:
    """What this process sees at ``path``: (what it is, the committed checkpoints' names, the
    hash of the newest one's MANIFEST.json, the absolute path). Reads, never writes."""
    root = os.path.abspath(path)
    kind = "directory" if os.path.isdir(root) else "file" if os.path.exists(root) else "nothing"
    found = layout.committed(root) if kind == "directory" else []
    digest = None
    if found:
        try:
            fd = layout.open_regular(os.path.join(found[0][1], MANIFEST))
            with os.fdopen(fd, "rb") as f:
                digest = checksum.digest(f.read())
        except OSError as e:
            digest = f"unreadable: {e.strerror}"
    return kind, [os.path.basename(p) for _, p in found], digest, root


def _seen(view: View) -> str:
    kind, names, digest, where = view
    if kind != "directory":
        what = {"nothing": "no such directory", "file": "a file"}.get(kind, f"{kind} {digest}")
    elif not names:
        what = "no committed checkpoint"
    else:
        what = f"{len(names)} committed checkpoint(s), the newest {names[0]} (manifest {digest})"
    return f"{where}: {what}"


class Team:
    def __init__(self, timeout: float, threads: int) -> None:
        self.rank, self.size = 0, 1
        self.threads = threads
        self.proto: Protocol | None = None  # when several ranks run the command
        if launched():
            from ..protocol import Protocol  # initialises MPI

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
        self.proto.bcast(("root", path), "cli-work")
        views = self.proto.gather(root_view(path), "cli-verdicts") or []
        # the absolute paths may differ (mount points, working directories): not compared
        differ = [r for r, v in enumerate(views) if v[:3] != views[0][:3]]
        if not differ:
            return None
        verb = "sees" if len(differ) == 1 else "see"
        return (f"{path}: {ranks_text(differ)} of this command {verb} another directory there "
                f"than rank 0 (rank 0, {_seen(views[0])}; rank {differ[0]}, "
                f"{_seen(views[differ[0]])}): {layout.not_shared_hint()}. If a job is writing "
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
                    self.proto.bcast(("stop", code), "cli-work")
                except CollectiveTimeout as e:
                    print(f"mpickpt: {e}; aborting the job", file=sys.stderr)
                    self.proto.abort(EXIT_ERROR)
                self.proto.free()
        return code

    def _serve(self) -> int:
        assert self.proto is not None
        while True:
            msg = self.proto.bcast(None, "cli-work")
            if msg[0] == "stop":
                self.proto.free()
                return int(msg[1])
            if msg[0] == "root":
                try:
                    view: Any = root_view(msg[1])
                except Exception as e:  # say so rather than leave rank 0 waiting
                    view = ("error", [], f"{type(e).__name__}: {e}", msg[1])
                self.proto.gather(view, "cli-verdicts")
                continue
            try:
                verdicts = self._check(msg[1][self.rank], None)
            except Exception as e:  # say so rather than leave rank 0 waiting for the deadline
                verdicts = [(path, rank, f"rank {rank}: {path}: rank {self.rank} of this command "
                             f"could not check it: {type(e).__name__}: {e}", None, 0, False)
                            for path, rank, _, _ in msg[1][self.rank]]
            self.proto.gather(verdicts, "cli-verdicts")

    def verify(self, entries: list[Entry], out: Out) -> tuple[int, float]:
        """Rank 0: check every checksum of the entries that passed the quick check, spread over
        the ranks; mark each corrupt or 'full'. Returns (tensor bytes read, seconds)."""
        t0 = time.monotonic()
        jobs = [(e.path, r.rank, sum(t.nbytes for t in r.tensors), _digest(e.manifest))
                for e in entries if e.status == "committed" and e.manifest is not None
                for r in e.manifest.ranks]
        shares: list[list[Job]] = [[] for _ in range(self.size)]
        load = [0] * self.size
        for job in sorted(jobs, key=lambda j: -j[2]):
            i = load.index(min(load))
            shares[i].append(job)
            load[i] += job[2]
        known = {e.path: e.manifest for e in entries if e.manifest is not None}
        label = "verifying" if self.size == 1 else f"verifying (rank 0's share of {self.size})"
        progress = out.progress(label, load[0])
        if self.proto is not None:
            self.proto.bcast(("verify", shares), "cli-work")
        verdicts = self._check(shares[0], known, progress)
        progress.close()
        if self.proto is not None:
            gathered = self.proto.gather(verdicts, "cli-verdicts") or []
            verdicts = [v for share in gathered for v in share]
        by_path = {e.path: e for e in entries}
        checked = 0
        for path, rank, reason, file, nbytes, restorable in sorted(verdicts,
                                                                  key=lambda v: (v[0], v[1])):
            checked += nbytes
            if reason is not None:
                by_path[path].fail([Problem(reason, rank, file, restorable=restorable)])
        for e in entries:
            if e.status == "committed" and e.manifest is not None:
                e.verified = "full"
        return checked, time.monotonic() - t0

    def _check(self, share: list[Job], known: dict[str, Any] | None,
               progress: Progress | None = None) -> list[Verdict]:
        manifests: dict[str, Manifest | str] = dict(known or {})
        out = []
        for path, rank, nbytes, digest in share:
            m = manifests.get(path)
            if m is None:
                try:
                    m = read_manifest(path)
                    if _digest(m) != digest:
                        m = f"{os.path.join(path, MANIFEST)} changed while it was being verified"
                except ManifestUnreadable as e:
                    m = f"{e} (it changed while it was being verified)"
                manifests[path] = m
            if isinstance(m, str):
                out.append((path, rank, m, os.path.join(path, MANIFEST), 0, False))
                continue
            try:
                p = verify_shard(path, m, rank, self.threads,
                                 progress.add if progress is not None else None)
            except Exception as e:  # an I/O error of this process: report it, do not hang others
                p = Problem(f"rank {rank}: {path}: {type(e).__name__}: {e}", rank, None)
            out.append((path, rank, p and p.reason, p and p.file, nbytes,
                        bool(p and p.restorable)))
        return out
