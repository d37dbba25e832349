"""Hugging Face ``Trainer`` on mpickpt: the Trainer's checkpoints (model, optimizer, scheduler,
RNG states, trainer state with the data position) saved and resumed through a
:class:`~mpickpt.Checkpointer`. ``pip install 'mpickpt[hf]'``.

::

    from mpickpt.hf import Trainer                  # instead of transformers.Trainer
    trainer = Trainer(model=model, args=args, train_dataset=data, mpickpt_root="/scratch/ckpt")
    trainer.train(resume_from_checkpoint=trainer.resume_path())

(or ``mpickpt.hf.with_mpickpt(SFTTrainer)`` for a Trainer subclass). Run it under
``mpiexec -n N python -m mpickpt.run train.py`` (``mpickpt.run`` gives torch its RANK,
WORLD_SIZE and MASTER_ADDR from MPI). The smallest extension point that keeps the Trainer's own
policy: the Trainer still decides when to save (``save_steps``, ``save_strategy``); its
``_save_checkpoint`` and the four loaders of ``resume_from_checkpoint`` are replaced, because a
callback's ``on_save`` runs after the Trainer has written its own files, and its loaders read
pickles.

* **Save** (collective, asynchronous): the model and optimizer states (written once: DDP holds
  them alike), the scheduler, this rank's RNG states (Python, numpy, torch CPU and CUDA) and
  the trainer state as JSON (global step, epoch, log history, stateful callbacks: what places
  the data position). ``save_total_limit`` maps to ``keep`` unless ``keep`` is given.
* **Resume**: ``trainer.train(resume_from_checkpoint=True)`` (or ``resume_path()``, or a step)
  restores the newest loadable checkpoint on every rank alike, with fallback, on any number of
  ranks; the trainer state is handed to the Trainer as the ``trainer_state.json`` it reads (JSON,
  in a directory of this rank's own), so it skips the batches already trained as after its own
  checkpoints. Nothing is unpickled.
* **Preemption**: at the end of every step, mpickpt's agreed signal check; on a signal every rank
  saves this step, rank 0 requeues under Slurm, and every rank exits with code 3.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

try:
    import transformers
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("mpickpt.hf needs Hugging Face transformers: pip install "
                      "'mpickpt[hf]'") from e

from .checkpointer import Checkpointer
from .exitcodes import EXIT_PREEMPTED
from .format import rootdir

REPLICATED = ("model", "optimizer")
STATE_FILE = "trainer_state.json"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])


class _Preemption(TrainerCallback):
    """At every step's end: has a preemption signal reached any rank? Then save and exit 3."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        if t.checkpointer.should_exit(state.global_step, t._mpickpt_state, exit=False):
            t.checkpointer.close()
            raise SystemExit(EXIT_PREEMPTED)


class _Mpickpt:
    """What :func:`with_mpickpt` adds to a Trainer class (placed before it in the MRO)."""

    def __init__(self, *args: Any, mpickpt_root: str | os.PathLike[str],
                 mpickpt_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mpickpt_root = os.path.abspath(os.fspath(mpickpt_root))
        options = dict(mpickpt_options or {})
        options.setdefault("replicated", REPLICATED)
        if "keep" not in options and self.args.save_total_limit:
            options["keep"] = self.args.save_total_limit
        self._mpickpt_options = options
        self._mpickpt_ck: Checkpointer | None = None
        self._mpickpt_loaded: dict[str, Any] | None = None
        self.add_callback(_Preemption(self))

    @property
    def checkpointer(self) -> Checkpointer:
        """The Checkpointer (created on every rank as ``train()`` starts, or by a resume)."""
        if self._mpickpt_ck is None:
            self._mpickpt_ck = Checkpointer(self.mpickpt_root, **self._mpickpt_options)
        return self._mpickpt_ck

    def resume_path(self) -> str | None:
        """``resume_from_checkpoint``: ROOT when it holds a committed checkpoint, else None."""
        return self.mpickpt_root if rootdir.committed(self.mpickpt_root) else None

    # ------------------------------------------------------------------------------ save

    def _mpickpt_state(self) -> dict[str, Any]:
        """What a checkpoint holds, as the Trainer's own files would (built at the save)."""
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, transformers.trainer_callback.ExportableState):
                self.state.stateful_callbacks[cb.__class__.__name__] = cb.state()
        return {"model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.lr_scheduler.state_dict(),
                "rng": _rng_state(),
                "trainer_state": json.dumps(asdict(self.state), sort_keys=True)}

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Checkpoint this step on every rank (returns once it is snapshotted)."""
        self.store_flos()
        self.checkpointer.save(self.state.global_step, self._mpickpt_state(),
                               metadata={"epoch": float(self.state.epoch or 0)})

    # ---------------------------------------------------------------------------- resume

    def train(self, resume_from_checkpoint: str | bool | int | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """As ``Trainer.train``; ``resume_from_checkpoint`` True or ROOT: the newest loadable
        mpickpt checkpoint; ``"checkpoint-N"`` or N: step N, or the newest before it."""
        # made now, on every rank (collective): a misconfiguration is refused before a step,
        # and the Checkpointer's start (MPI's own included) is not paid inside the first one
        self.checkpointer  # noqa: B018
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            resume_from_checkpoint = self._mpickpt_restore(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self._mpickpt_ck is not None:  # the saves in flight commit before it returns
                self._mpickpt_ck.close()
                self._mpickpt_ck = None

    def _mpickpt_restore(self, which: str | bool | int) -> str:
        """Restore the checkpoint ``which`` names (collective); the directory holding its
        trainer state for the Trainer to read."""
        upto = None
        if isinstance(which, int) and not isinstance(which, bool):
            upto = which
        elif not (which is True or os.path.abspath(os.fspath(which)) == self.mpickpt_root):
            name = os.path.basename(os.path.normpath(os.fspath(which)))
            upto = int(name.rsplit("-", 1)[-1]) if name.rsplit("-", 1)[-1].isdigit() else None
            if upto is None:
                raise ValueError(f"resume_from_checkpoint={which!r}: give True, the mpickpt "
                                 f"ROOT {self.mpickpt_root}, a step or 'checkpoint-N'")
        state: dict[str, Any] = {"model": self.model.state_dict()}
        got = self.checkpointer.restore(state, upto=upto)
        if got is None:
            raise ValueError(f"no loadable mpickpt checkpoint under {self.mpickpt_root}"
                             + (f" at step {upto} or before" if upto is not None else ""))
        self._mpickpt_loaded = state
        here = tempfile.mkdtemp(prefix=f"mpickpt-hf-{got}-")  # this rank's: no one else's
        with open(os.path.join(here, STATE_FILE), "w") as f:
            f.write(state["trainer_state"])
        return here

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._mpickpt_loaded is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: the restore read the weights into the model in place

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._mpickpt_loaded is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.optimizer.load_state_dict(self._mpickpt_loaded["optimizer"])
        self.lr_scheduler.load_state_dict(self._mpickpt_loaded["scheduler"])
        return None

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._mpickpt_loaded is None:
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._mpickpt_loaded is None:
            super()._load_rng_state(checkpoint)
        else:
            _set_rng_state(self._mpickpt_loaded["rng"])


def with_mpickpt(base: type) -> type:
    """``base`` (``transformers.Trainer`` or a subclass) saving and resuming through mpickpt:
    a subclass that takes ``mpickpt_root=`` and ``mpickpt_options=`` (Checkpointer options)."""
    name = f"Mpickpt{base.__name__}"
    cls = type(name, (_Mpickpt, base), {
        "__doc__": f"{base.__name__}, saving and resuming through mpickpt (mpickpt.hf).",
        "__qualname__": name, "__module__": __name__})
    return cls


Trainer = with_mpickpt(transformers.Trainer)
