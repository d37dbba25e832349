"""PyTorch Lightning on mpickpt: a ``CheckpointIO`` that saves Lightning's checkpoint dict through
a :class:`~mpickpt.Checkpointer`, a DDP strategy that calls it on every rank, and a callback for
mpickpt's agreed preemption. ``pip install 'mpickpt[lightning]'``.

::

    from mpickpt.lightning import DDPStrategy, MpickptIO, Preemption

    io = MpickptIO("/scratch/run42/ckpt")
    trainer = L.Trainer(strategy=DDPStrategy(checkpoint_io=io), callbacks=[Preemption(io)],
                        plugins=[SLURMEnvironment(auto_requeue=False)])  # under srun
    trainer.fit(model, data, ckpt_path=io.resume_path())

How Lightning's parts map onto mpickpt's:

* ``ModelCheckpoint`` decides when to save and names a file; :meth:`MpickptIO.save_checkpoint`
  saves the dict as ``global_step`` (asynchronously: the call returns once it is snapshotted;
  ``{"lightning": dict}`` is the state, DDP's identical model, optimizer and scheduler states
  written once) and rank 0 writes at that name a small JSON *pointer* (root and step). A pointer
  says "step N, or the newest committed step before it": it is written when the save starts,
  so a save that never committed resolves to the one before.
* ``trainer.fit(ckpt_path=...)`` with a pointer, ``"last"`` (``ModelCheckpoint(save_last=True)``)
  or the ROOT directory itself (:meth:`MpickptIO.resume_path`) restores through mpickpt's
  coordinated restore with fallback, on any number of ranks (resharding: the replicated states,
  and rank r takes stored rank r mod N's own). The dict is rebuilt from the checkpoint, no pickle.
* Removing a checkpoint (``save_top_k``) removes its pointer; the data is mpickpt's retention's
  (``keep=mpickpt.Retention(1, best=..., keep_best=K)`` given to :class:`MpickptIO`). The value
  ``ModelCheckpoint`` monitors is put in each save's metadata under the monitor's name, so
  ``best=("val_loss", "min")`` ranks them.
* Preemption: mpickpt's signal (SIGUSR2, ``$MPICKPT_SIGNAL``) and SIGTERM, agreed on by every rank
  at the end of a batch by :class:`Preemption`, which saves Lightning's dict as an emergency
  checkpoint, requeues once under Slurm and exits with code 3. Lightning's own Slurm requeue
  (``SLURMEnvironment(auto_requeue=True)``, the default under ``srun``) would save on a signal
  from inside a signal handler, on its own: it is refused at setup; pass
  ``SLURMEnvironment(auto_requeue=False)``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.environments import SLURMEnvironment
    from lightning.pytorch.plugins.io import CheckpointIO
    from lightning.pytorch.strategies import DDPStrategy as _DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("mpickpt.lightning needs PyTorch Lightning: pip install "
                      "'mpickpt[lightning]'") from e

from .checkpointer import Checkpointer
from .format import rootdir

POINTER_FORMAT = "mpickpt-lightning-pointer"
STATE_KEY = "lightning"
# what every DDP rank holds alike: written once, restored on any number of ranks
REPLICATED = (f"{STATE_KEY}/state_dict", f"{STATE_KEY}/optimizer_states",
              f"{STATE_KEY}/lr_schedulers")


class MpickptIO(CheckpointIO):
    """Lightning's checkpoint files, saved and loaded through a :class:`~mpickpt.Checkpointer`
    on ``root`` (created on every rank by :class:`DDPStrategy`'s setup for ``fit``, before
    the first training step: use it with that strategy, which also saves on every rank).
    ``kwargs`` go to the Checkpointer (``keep=N`` or ``keep=mpickpt.Retention(...)``,
    ``encoding`` ...); ``replicated`` defaults to DDP's model, optimizer and scheduler
    states."""

    def __init__(self, root: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        self.root = os.path.abspath(os.fspath(root))
        kwargs.setdefault("replicated", REPLICATED)
        self.kwargs = kwargs
        self._ck: Checkpointer | None = None
        self._saved: int | None = None  # the last step saved (last.ckpt names it again)
        # the live model, optimizer and scheduler states (DDPStrategy sets it): restore fills
        # them in place and rebuilds the rest of the dict from the checkpoint
        self.template: Callable[[], dict[str, Any]] | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        if self._ck is None:
            self._ck = Checkpointer(self.root, **self.kwargs)
        return self._ck

    def resume_path(self) -> str | None:
        """``ckpt_path`` for ``trainer.fit``: ROOT when it holds a committed checkpoint (the
        newest loadable one is restored), else None (a fresh start)."""
        return self.root if rootdir.committed(self.root) else None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as step ``global_step`` (collective; asynchronous) and, on rank
        0, a pointer at ``path``."""
        step = int(checkpoint["global_step"])
        if step != self._saved:
            self.checkpointer.save(step, {STATE_KEY: checkpoint}, metadata=_metadata(checkpoint))
            self._saved = step
        if self.checkpointer.rank == 0:
            write_pointer(os.fspath(path), self.root, step)

    def load_checkpoint(self, path: _PATH, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's dict of the step ``path`` points at, or of the newest committed step
        before it (collective): ``path`` is a pointer, or ROOT (the newest)."""
        upto = None if os.path.abspath(os.fspath(path)) == self.root else \
            read_pointer(os.fspath(path), self.root)
        state: dict[str, Any] = {STATE_KEY: self.template() if self.template else {}}
        got = self.checkpointer.restore(state, upto=upto)
        if got is None:
            raise FileNotFoundError(
                f"{path}: no loadable mpickpt checkpoint under {self.root}"
                + (f" at step {upto} or before" if upto is not None else ""))
        return state[STATE_KEY]

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the pointer (rank 0); the checkpoint itself is left to mpickpt's retention."""
        if self.checkpointer.rank == 0 and os.path.lexists(os.fspath(path)):
            os.unlink(os.fspath(path))

    def teardown(self) -> None:
        """Wait for the saves in flight and close the Checkpointer (collective)."""
        if self._ck is not None:
            self._ck.close()
            self._ck = None
            self._saved = None


class DDPStrategy(_DDPStrategy):
    """Lightning's DDP strategy, but saving and removing checkpoints on every rank: mpickpt's
    save is collective (every rank snapshots, votes, and the commit is all or nothing), where
    Lightning's strategies call the CheckpointIO on rank 0 alone."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Any | None = None) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        self.checkpoint_io.remove_checkpoint(filepath)

    def setup(self, trainer: pl.Trainer) -> None:
        env = self.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and \
                isinstance(self.checkpoint_io, MpickptIO):
            raise ValueError(
                "Lightning's SLURM auto-requeue is on next to mpickpt's preemption: two handlers "
                "would checkpoint and requeue on one signal. Pass "
                "plugins=[SLURMEnvironment(auto_requeue=False)] and let mpickpt.lightning."
                "Preemption checkpoint (agreed on every rank) and requeue")
        super().setup(trainer)
        if isinstance(self.checkpoint_io, MpickptIO):
            self.checkpoint_io.template = self._live_states
            if trainer.state.fn == TrainerFn.FITTING:  # (not for validate, test or predict)
                # made now, on every rank: a misconfiguration is refused before training, and
                # the Checkpointer's start (MPI's own included) is not paid in the first save
                self.checkpoint_io.checkpointer  # noqa: B018

    def _live_states(self) -> dict[str, Any]:
        """The states every rank holds alike, as Lightning's checkpoint dict names them."""
        trainer = self.lightning_module.trainer
        return {"state_dict": self.lightning_module_state_dict(),
                "optimizer_states": [o.state_dict() for o in self.optimizers],
                "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]}


class Preemption(Callback):
    """At the end of every training batch, on every rank: has a preemption signal reached any
    rank (one non-blocking allreduce)? If so, Lightning's checkpoint dict is saved as an
    emergency checkpoint of the current step and committed, rank 0 requeues the job under Slurm
    (mpickpt's rules), and every rank exits with code 3."""

    def __init__(self, io: MpickptIO) -> None:
        self.io = io

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For ``fit``, make the Checkpointer now, on every rank, with any strategy (one process
        without :class:`DDPStrategy` included): a misconfiguration fails before a step, and the
        first save does not pay the Checkpointer's start, nor its copy stream's."""
        if stage == "fit":
            self.io.checkpointer  # noqa: B018

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        dump: Callable[[], dict[str, Any]] = lambda: {  # noqa: E731
            STATE_KEY: trainer._checkpoint_connector.dump_checkpoint()}
        ck = self.io.checkpointer
        if ck.should_exit(trainer.global_step, dump, exit=False):
            self.io.teardown()
            raise SystemExit(3)


def _metadata(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The epoch, and each monitored value ``ModelCheckpoint`` saw (its ``current_score``), under
    the monitor's name: what ``best=(name, mode)`` ranks checkpoints by."""
    out: dict[str, Any] = {"epoch": int(checkpoint.get("epoch", 0))}
    for key, cb in (checkpoint.get("callbacks") or {}).items():
        if isinstance(key, str) and key.startswith("ModelCheckpoint") and isinstance(cb, dict):
            name, score = cb.get("monitor"), cb.get("current_score")
            if isinstance(name, str) and score is not None:
                out[name] = float(score)
    return out


def write_pointer(path: str, root: str, step: int) -> None:
    """Durably write at ``path`` the pointer to ``step`` of ``root``."""
    rootdir.make_dirs(os.path.dirname(os.path.abspath(path)))
    data = json.dumps({"format": POINTER_FORMAT, "root": root, "step": step}).encode()
    rootdir.atomic_write(path, data)


def read_pointer(path: str, root: str) -> int:
    """The step a pointer names; ValueError naming the file for anything else (a checkpoint of
    Lightning's own format, another ROOT's pointer)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
        d = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not an mpickpt pointer ({e})") from None
    if not isinstance(d, dict) or d.get("format") != POINTER_FORMAT or \
            not isinstance(d.get("step"), int) or isinstance(d.get("step"), bool):
        raise ValueError(f"{path}: not an mpickpt pointer")
    if d.get("root") != root:
        raise ValueError(f"{path}: points into {d.get('root')}, not this MpickptIO's {root}")
    return int(d["step"])
