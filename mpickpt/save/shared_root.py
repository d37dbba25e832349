"""Proof, before a Checkpointer's first save, that every rank sees ROOT as one directory and
that no other job is saving into it (rank 0 takes ROOT's writer lock, :mod:`..format.rootlock`).

Rank 0 writes a token into ROOT; every rank reads it back through its own path; an allreduce
decides. A ROOT rank 0 cannot write (the save will fail on it anyway, saying why) is compared by
its inode and its entries instead. Otherwise every rank raises
:class:`~mpickpt.errors.RootNotSharedError` naming the ranks and hosts that do not see it:
node-local storage given as ROOT would let rank 0 "commit" checkpoints whose other shards lie on
other nodes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable

from ..errors import RootInUseError, RootNotSharedError
from ..format import rootdir, rootlock
from ..mpi.protocol import Protocol, ranks_text


def check(proto: Protocol, root: str, run_id: str, logger: logging.Logger) -> None:
    """Collective over ``proto``: return if every rank's ``root`` is rank 0's directory and no
    other job is saving into it. Rank 0 then holds ROOT's writer lock until ``proto`` is freed
    (:mod:`mpickpt.format.rootlock`)."""
    busy, release = claim(proto, root, logger) if proto.rank == 0 else (None, None)
    with proto.fatal_timeouts(logger):
        busy = proto.bcast(busy, "root-lock")
    if busy is not None:
        raise RootInUseError(busy)
    try:
        _same_directory(proto, root, run_id, logger)
    except RootNotSharedError:
        if release is not None:  # no save into it: the lock is not this job's to keep
            release()
        raise


def claim(proto: Protocol, root: str, logger: logging.Logger
          ) -> tuple[str | None, Callable[[], None] | None]:
    """Rank 0: take ROOT's writer lock until ``proto`` is freed: (None, the call that lets it go
    sooner), or (the sentence that refuses the save, None)."""
    busy, release = rootlock.take(root, logger)
    if busy is not None:
        return (f"ROOT {root} is being saved into by another job: {busy} holds its writer "
                "lock. Two jobs saving into one ROOT remove and replace each other's "
                "checkpoints; give this job its own ROOT, or end the other one first. (Where "
                "the ranks of one job each think they are alone, set MPICKPT_BACKEND=mpi: "
                "their launcher is not one mpickpt recognises. Where the holder is an mpickpt "
                "command, a drain or a rollback, start the job again once it has ended.)"), None
    proto.on_free(release)
    return None, release


def _same_directory(proto: Protocol, root: str, run_id: str, logger: logging.Logger) -> None:
    name = f".mpickpt-root-check-{run_id}"
    token: str | None = uuid.uuid4().hex
    listing = None
    if proto.rank == 0:
        try:
            rootdir.atomic_write(os.path.join(root, name), token.encode())
        except OSError:
            token = None
            try:
                listing = _fingerprint(root)
            except OSError:  # nothing to compare: every rank then reads a missing token
                token = uuid.uuid4().hex
    with proto.fatal_timeouts(logger):
        token, listing, root0 = proto.bcast((token, listing, root), "root")
    why = None
    try:
        if token is not None:
            with open(os.path.join(root, name), "rb") as f:
                if f.read() != token.encode():
                    why = "it holds another run's token"
        elif _fingerprint(root) != listing:
            why = f"{root} is another directory than rank 0's (its inode or entries differ)"
    except OSError as e:
        why = e.strerror or str(e)
    with proto.fatal_timeouts(logger):
        ok = proto.all_ok(why is None, "root")
        bad = [] if ok else proto.allgather((proto.rank, socket.gethostname(), root, why),
                                            "root-report")
    if proto.rank == 0 and token is not None:
        with contextlib.suppress(OSError):  # a leftover is harmless, and never loaded
            os.unlink(os.path.join(root, name))
    if ok:
        return
    bad = [b for b in bad if b[3] is not None]
    hosts = ", ".join(sorted({h for _, h, _, _ in bad}))
    r, _, path, reason = bad[0]
    raise RootNotSharedError(
        f"ROOT {root0} (rank 0) is not one directory shared by every rank: "
        f"{ranks_text(b[0] for b in bad)} on {hosts} cannot read the file rank 0 wrote there "
        f"(rank {r}, {os.path.join(path, name)}: {reason}); {rootdir.NOT_SHARED_ADVICE}")


def _fingerprint(root: str) -> tuple[int, list[str]]:
    """What tells two directories apart without writing to them: inode and entries."""
    return os.stat(root).st_ino, sorted(os.listdir(root))
