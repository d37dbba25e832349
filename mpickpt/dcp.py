"""The functions of ``torch.distributed.checkpoint``, over mpickpt: a code base that calls
``dcp.save``, ``dcp.async_save`` and ``dcp.load`` switches with its import line::

    import mpickpt.dcp as dcp          # was: import torch.distributed.checkpoint as dcp

    dcp.save(state_dict, checkpoint_id=f"{folder}/step-{step}")
    future = dcp.async_save(state_dict, checkpoint_id=f"{folder}/step-{step}")
    future.result()                    # before the next async_save, as with DCP
    dcp.load(state_dict, checkpoint_id=f"{folder}/step-{step}")

``checkpoint_id`` means what it means to DCP: the directory of one checkpoint, shared by every
rank. Inside it mpickpt keeps one committed checkpoint (``step-N/``, a ROOT of its own, with
``keep=1``): saving the same id again replaces it atomically, and a save that fails or is killed
leaves the one before it. Every call is collective, over MPI or, under torchrun, over a gloo group
of mpickpt's own (a ``process_group`` given must span every rank: it is not used). The state
may hold tensors, DTensors, modules, optimizers and any object with ``state_dict()`` and
``load_state_dict()`` (DCP's ``Stateful``), and plain Python values; what could only be stored
by pickling is refused, naming its key (nothing on the load path runs code from a checkpoint).
``load`` loads in place, on any number of ranks (resharding), and raises ``FileNotFoundError``
where no committed checkpoint is.

A Checkpointer stays open per ``checkpoint_id`` while its saves may be in flight: the two used
last; the one before is closed (collectively, so every rank closes the same one) when a third
is used. :func:`close` closes them all (at interpreter exit, the saves in flight finish anyway).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

from .checkpointer import Checkpointer
from .format import rootdir
from .save.request import SaveHandle, SaveResult

__all__ = ["async_save", "close", "committed", "load", "save"]

OPEN_IDS = 2  # Checkpointers kept open, by last use
_OPEN: dict[str, Checkpointer] = {}  # absolute checkpoint_id -> its Checkpointer, oldest first
_NEXT: dict[str, int] = {}  # the step number the next save into that directory takes


def _same_ranks(process_group: Any, ck: Checkpointer) -> None:
    """DCP's ``process_group``: mpickpt runs over a group of its own with every rank of the job,
    which stands for the given one only when that one has every rank too."""
    if process_group is None:
        return
    import torch.distributed as dist

    size = dist.get_world_size(process_group)
    if size != ck.world_size:
        raise ValueError(
            f"mpickpt.dcp: process_group= has {size} ranks, the job {ck.world_size}: mpickpt "
            f"saves over a group of its own with every rank; checkpoint a part of the job with a "
            f"Checkpointer(comm=...) of an MPI communicator instead")


def _refuse(**given: Any) -> None:
    for name, value in given.items():
        if value is not None:
            raise ValueError(
                f"mpickpt.dcp: {name}= is DCP's and has no meaning here: mpickpt writes its own "
                f"format (one HDF5 file per rank, a manifest committed last) and plans the "
                f"layout itself; leave {name} out")


def _checkpointer(checkpoint_id: str | os.PathLike[str]) -> Checkpointer:
    path = os.path.abspath(os.fspath(checkpoint_id))
    ck = _OPEN.pop(path, None)
    if ck is None:
        ck = Checkpointer(path, keep=1, on_error="raise", preemption=False)
        while len(_OPEN) >= OPEN_IDS:  # the same ones on every rank: the calls are collective
            _OPEN.pop(next(iter(_OPEN))).close()
    _OPEN[path] = ck  # now the newest
    return ck


def _next_step(ck: Checkpointer) -> int:
    """One more than the newest step committed in the directory (agreed by every rank)."""
    if ck.root not in _NEXT:
        newest = max((s for s, _ in rootdir.committed(ck.root)), default=-1) \
            if os.path.isdir(ck.root) else -1
        _NEXT[ck.root] = ck._proto.max(newest + 1, "dcp-step")
    step = _NEXT[ck.root]
    _NEXT[ck.root] = step + 1
    return step


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str],
               storage_writer: Any = None, planner: Any = None,
               process_group: Any = None) -> Future[SaveResult]:
    """Snapshot ``state_dict`` and return at once; the future gives the
    :class:`~mpickpt.SaveResult` once the checkpoint is committed on every rank, or raises
    :class:`~mpickpt.SaveAborted` (with each failed rank's reason) if it was not."""
    _refuse(storage_writer=storage_writer, planner=planner)
    ck = _checkpointer(checkpoint_id)
    _same_ranks(process_group, ck)
    return _future(ck.save(_next_step(ck), state_dict))


def _future(handle: SaveHandle) -> Future[SaveResult]:
    out: Future[SaveResult] = Future()

    def done(_: object) -> None:
        try:
            out.set_result(handle.wait())
        except Exception as e:
            out.set_exception(e)

    handle.add_done_callback(done)
    return out


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str],
         storage_writer: Any = None, planner: Any = None,
         process_group: Any = None) -> SaveResult:
    """Save ``state_dict`` as the checkpoint ``checkpoint_id`` and return once it is committed
    on every rank (the write still runs off the training thread's copy of the state)."""
    return async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                      planner=planner, process_group=process_group).result()


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str],
         storage_reader: Any = None, planner: Any = None, process_group: Any = None) -> None:
    """Load the checkpoint ``checkpoint_id`` into ``state_dict`` in place (tensors copied into,
    stateful objects given ``load_state_dict``)."""
    _refuse(storage_reader=storage_reader, planner=planner)
    ck = _checkpointer(checkpoint_id)
    _same_ranks(process_group, ck)
    if ck.restore(state_dict) is None:
        raise FileNotFoundError(f"mpickpt.dcp.load: no committed checkpoint in {ck.root}")


def committed(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint_id`` holds a committed checkpoint (reads the directory; not
    collective): what code written for DCP learns by probing for its ``.metadata`` file."""
    path = os.fspath(checkpoint_id)
    return os.path.isdir(path) and bool(rootdir.committed(path))


def close() -> None:
    """Collective: wait for the saves in flight, close every Checkpointer this module opened."""
    while _OPEN:
        _OPEN.pop(next(iter(_OPEN))).close()
