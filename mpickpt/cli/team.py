"""The processes a command runs on: one, or every rank of ``mpiexec -n N mpickpt ...``.

Rank 0 runs the command (it alone reads ROOT's listing, prints and changes anything); the other
ranks wait for work. Full verification is the one piece of work shared: rank 0 splits the shards to
check over the ranks (largest first, each to the least loaded rank), broadcasts the plan, checks
its own share, and gathers everyone's verdicts. All communication goes through
:class:`mpickpt.protocol.Protocol` (deadlines included); payloads are plain tuples of paths,
numbers and sentences. A single process does everything itself and never communicates.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from .. import checksum
from ..errors import CollectiveTimeout
from ..manifest import Manifest
from ..protocol import Protocol
from . import EXIT_ERROR
from .catalog import MANIFEST, Entry, ManifestUnreadable, Problem, read_manifest
from .checks import verify_shard
from .render import Out, Progress

# one shard to check: (checkpoint directory, rank of the shard, its tensor bytes, manifest digest)
Job = tuple[str, int, int, str]
# its verdict: (checkpoint directory, rank, reason or None, file or None, bytes checked,
# whether restore loads it all the same: the problem is in its HDF5 metadata only)
Verdict = tuple[str, int, str | None, str | None, int, bool]


def _digest(m: Manifest) -> str:
    return checksum.digest(m.to_json().encode())


class Team:
    def __init__(self, timeout: float, threads: int) -> None:
        proto = Protocol(None, timeout)
        self.rank, self.size = proto.rank, proto.size
        self.threads = threads
        self.proto: Protocol | None = proto
        if proto.size == 1:
            proto.free()
            self.proto = None

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
