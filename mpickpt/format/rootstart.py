"""ROOT at the start of a job: made ready for saves (created, what earlier runs left half done
removed, unless a live job holds ROOT's writer lock) and listed for a restore (its committed
steps, the rollback in effect). Both run on rank 0; a ROOT that cannot be used is said, not
raised, so that a job with a node-local level can still restore from the nodes."""

from __future__ import annotations

import logging

from .. import log
from . import rollback, rootdir, rootlock
from .rollback import Rollback


def prepare(root: str, run_id: str, logger: logging.Logger) -> str | None:
    """Create ROOT and remove what earlier runs left half done; why ROOT cannot be used, or
    None."""
    try:
        rootdir.make_dirs(root)
        doomed = rootdir.leftovers(root, run_id)
    except OSError as e:
        return f"{root}: {type(e).__name__}: {e.strerror or e}"
    if doomed and not rootlock.free(root):  # a live job's steps in the making: not ours to take
        logger.info("not removing %d half-written or half-deleted steps in %s: another job "
                    "holds its writer lock (it is saving into it now)", len(doomed), root)
        return None
    for path in doomed:
        logger.info("removing %s, left by an earlier run that did not finish its save", path)
        try:
            rootdir.remove(path, run_id)
        except OSError as e:  # e.g. a read-only ROOT: restore must still work
            logger.warning("could not remove %s (%s); it is never loaded, and removed at a "
                           "later start", path, log.os_error(e, path))
    return None


def listing(root: str, logger: logging.Logger, local: bool
            ) -> tuple[list[tuple[int, str]], Rollback | None, str | None]:
    """(ROOT's committed steps, its rollback in effect, why ROOT cannot be listed). With a
    node-local level (``local``), an unreadable ROOT is logged and restore goes on without it."""
    try:
        candidates = rootdir.committed(root, require_manifest=False)
    except OSError as e:
        why = f"{root}: {type(e).__name__}: {e.strerror or e}"
        if local:
            logger.warning("cannot list the checkpoints under ROOT (%s): restoring from the "
                           "node-local level alone (a rollback recorded in ROOT cannot be seen "
                           "either)", why)
        return [], None, why
    return candidates, rollback.active(root), None
