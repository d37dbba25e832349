"""Plain ``DistributedDataParallel`` resumed bit for bit: :func:`prime_ddp`.

DDP builds its gradient buckets in parameter order, reduces its first iteration in that layout,
and then, once, rebuilds them in the order the gradients became ready (with
``find_unused_parameters=True`` it never does; with ``static_graph=True`` after its second
iteration). A job resumed from a checkpoint is in its first iteration at the resume step, so it
reduces that step in the first layout where the uninterrupted run used the rebuilt one. On 3
ranks or more, gloo's ring allreduce (and NCCL's) sums each element in an order set by its place
in the bucket: the resumed run's gradients differ in their last bits from that step on. 2 ranks
are exact (a + b == b + a).

:func:`prime_ddp` runs the iterations DDP needs to settle (one forward and backward, two with
``static_graph``) on a batch the caller gives, and undoes what they did to the state: the
gradients, the module's buffers (batch-norm statistics) and the random number generators are as
before; the optimizer is not touched. DDP's next forward then rebuilds the buckets as the
uninterrupted run's did, so the first real step reduces in the same layout. Public APIs only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["prime_ddp"]


def prime_ddp(model: torch.nn.Module, step: Callable[[torch.nn.Module], object]) -> None:
    """Settle DDP's gradient buckets after a restore, so that the resumed run reduces every step
    in the layout the uninterrupted run used; the state is left as it was.

    ``model`` is the ``DistributedDataParallel`` module; ``step(model)`` runs one forward and
    backward of any batch of the right shape (``lambda m: loss_fn(m(x), y).backward()``; the
    values do not matter, the order the gradients become ready in does), and no optimizer step.
    Collective, like any DDP iteration: every rank calls it, after ``restore()`` and only when it
    restored a step (a fresh run needs none)::

        start = ckpt.restore(state) or 0
        if start:
            mpickpt.prime_ddp(model, lambda m: loss_fn(m(x0), y0).backward())
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"prime_ddp takes the DistributedDataParallel module, not a "
                        f"{type(model).__name__}")
    if model.find_unused_parameters:
        return  # DDP never rebuilds its buckets: nothing to settle
    params = [p for p in model.parameters() if p.requires_grad]
    if any(p.grad is not None and bool(p.grad.any()) for p in params):
        raise RuntimeError("prime_ddp: some parameters hold gradients; call it before the "
                           "training step, where the gradients are zero or None")
    buffers = [b.detach().clone() for b in model.buffers()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        for _ in range(2 if getattr(model, "static_graph", False) else 1):
            step(model)
    for p in params:
        p.grad = None
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers, strict=True):
            b.copy_(saved)
