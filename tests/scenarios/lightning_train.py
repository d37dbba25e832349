"""A tiny Lightning job under mpiexec (DDP on CPU, gloo, Lightning's MPIEnvironment), saving
through mpickpt.lightning; it resumes from ROOT when a checkpoint is there.

Usage: lightning_train.py ROOT OUT --epochs E [--batches B] [--no-checkpoint] [--signal-at S]
                          [--top-k K] [--resume root|last] [--keep K] [--single]

A regression MLP on a fixed synthetic dataset: ``B`` batches per rank per epoch, no shuffling,
so a run is deterministic; ``ModelCheckpoint(every_n_epochs=1, save_last=True)`` saves at each
epoch's end (steps B, 2B, ...). Each rank writes OUT/rank-R.pt (the final parameters) and
OUT/rank-R.json (the step it started from). ``--signal-at S``: rank 1 sends itself SIGUSR2 at
the end of step S (a preemption). ``--top-k K``: ``ModelCheckpoint(monitor="train_loss",
save_top_k=K)`` and ``MpickptIO(keep=Retention(1, best=("train_loss", "min"), keep_best=K))``.
``--resume last``: ``fit(ckpt_path="last")`` (the pointer ``last.ckpt``) instead of ROOT.
``--single``: one process with Lightning's own strategy, ``MpickptIO`` given as a plugin.

Run by tests/integrations/test_lightning.py.
"""

from __future__ import annotations

import argparse
import os
import signal

import lightning.pytorch as pl
import torch
from _report import write_report
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from mpickpt import Retention
from mpickpt.lightning import DDPStrategy, MpickptIO, Preemption


class Regression(pl.LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)}


class SignalAt(Callback):
    """Rank 1 sends itself SIGUSR2 once, at the end of step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, i) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("out")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--no-checkpoint", action="store_true")
    ap.add_argument("--signal-at", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--resume", choices=["root", "last"], default="root")
    ap.add_argument("--keep", type=int, default=None, help="MpickptIO's keep")
    ap.add_argument("--single", action="store_true",
                    help="one process, Lightning's own strategy: MpickptIO as a plugin")
    args = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    world = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
    n = 8 * args.batches * world
    x = torch.randn(n, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    keep: dict = {"keep": 3} if args.top_k is None else {
        "keep": Retention(1, best=("train_loss", "min"), keep_best=args.top_k)}
    if args.keep is not None:
        keep = {"keep": args.keep}
    io = None if args.no_checkpoint else MpickptIO(args.root, **keep)
    policy: dict = {"save_top_k": -1} if args.top_k is None else {
        "save_top_k": args.top_k, "monitor": "train_loss", "mode": "min"}
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, max_epochs=args.epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        **({"plugins": [] if io is None else [io]} if args.single else
           {"strategy": DDPStrategy(checkpoint_io=io, process_group_backend="gloo")}),
        enable_checkpointing=io is not None,
        callbacks=[] if io is None else [
            ModelCheckpoint(dirpath=os.path.join(args.root, "lightning"), every_n_epochs=1,
                            save_last=True, **policy), Preemption(io)]
        + ([SignalAt(args.signal_at)] if args.signal_at else []))
    model = Regression()
    start = io.resume_path() if io is not None else None
    if start is not None and args.resume == "last":
        start = "last"
    trainer.fit(model, loader, ckpt_path=start)
    rank = trainer.global_rank
    os.makedirs(args.out, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               os.path.join(args.out, f"rank-{rank}.pt"))
    write_report(args.out, f"rank-{rank}.json",
                 {"resumed_from": start, "global_step": trainer.global_step})


if __name__ == "__main__":
    main()
