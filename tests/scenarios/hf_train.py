"""A tiny Hugging Face ``Trainer`` job under mpiexec (run through ``python -m mpickpt.run``: DDP
on CPU with gloo), saving through mpickpt.hf; it resumes from ROOT when a checkpoint is there.

Usage: hf_train.py ROOT OUT --steps N [--save-steps E] [--no-checkpoint] [--signal-at S]

A GPT-2 of 2 layers, width 32, built from a config (no download, dropout 0) trained on a fixed
synthetic token dataset, shuffled by the Trainer's seeded sampler, 4 sequences per rank and
step, saving every ``E`` steps. Each rank writes OUT/rank-R.pt (final parameters) and
OUT/rank-R.json (the step it resumed from, the final step). ``--signal-at S``: rank 1 sends
itself SIGUSR2 at the end of step S (a preemption).

Run by tests/integrations/test_hf.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from _report import write_report
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from mpickpt.hf import Trainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class SignalAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if args.process_index == 1 and state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-steps", type=int, default=4)
    ap.add_argument("--no-checkpoint", action="store_true")
    ap.add_argument("--signal-at", type=int, default=None)
    ap.add_argument("--options", default="{}", help="the Checkpointer's options, as JSON")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(
        output_dir=os.path.join(args.root, "hf"), max_steps=args.steps,
        per_device_train_batch_size=4, learning_rate=1e-3, lr_scheduler_type="linear",
        warmup_steps=2, seed=7, use_cpu=True, report_to=[], logging_steps=1,
        save_strategy="no" if args.no_checkpoint else "steps", save_steps=args.save_steps,
        ddp_backend="gloo", disable_tqdm=True, dataloader_drop_last=True)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(64),
                      mpickpt_root=args.root, mpickpt_options=json.loads(args.options),
                      callbacks=[SignalAt(args.signal_at)] if args.signal_at else None)
    start = None if args.no_checkpoint else trainer.resume_path()
    trainer.train(resume_from_checkpoint=start)
    rank = targs.process_index
    os.makedirs(args.out, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               os.path.join(args.out, f"rank-{rank}.pt"))
    write_report(args.out, f"rank-{rank}.json",
                 {"resumed_from": start, "global_step": trainer.state.global_step})


if __name__ == "__main__":
    main()
