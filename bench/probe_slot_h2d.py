"""A restore ring slot's copy into the GPU: 64 MiB from ordinary (pageable) memory against
page-locked memory, on 1 and 4 threads at once (the I/O threads copy side by side), and what a
fresh slot costs to zero and page-lock in a quiet process. One GPU.

    python bench/probe_slot_h2d.py
"""

from __future__ import annotations

import threading
import time

import torch

SLOT = 64 << 20  # mpickpt.local.ring.SLOT
REPS = 16


def rate(pinned: bool, threads: int, dst: list[torch.Tensor]) -> float:
    """GB/s of ``threads`` threads each copying a slot into the GPU REPS times."""
    srcs = [torch.ones(SLOT, dtype=torch.uint8).pin_memory() if pinned
            else torch.ones(SLOT, dtype=torch.uint8) for _ in range(threads)]

    def work(i: int) -> None:
        for _ in range(REPS):
            dst[i].copy_(srcs[i])
        torch.cuda.current_stream().synchronize()

    work(0)  # warm-up
    t = time.perf_counter()
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    torch.cuda.synchronize()
    return threads * REPS * SLOT / (time.perf_counter() - t) / 1e9


def main() -> None:
    dst = [torch.empty(SLOT, dtype=torch.uint8, device="cuda") for _ in range(4)]
    t = time.perf_counter()
    fresh = torch.empty(SLOT, dtype=torch.uint8)
    fresh.zero_()
    zeroed = time.perf_counter() - t
    t = time.perf_counter()
    err = torch.cuda.cudart().cudaHostRegister(fresh.data_ptr(), SLOT, 0)
    locked = time.perf_counter() - t
    print(f"fresh 64 MiB: zero {zeroed * 1e3:.1f} ms, register {locked * 1e3:.1f} ms "
          f"(error {int(err)})")
    for pinned in (False, True):
        for threads in (1, 4):
            print(f"pinned={pinned} threads={threads}: {rate(pinned, threads, dst):.1f} GB/s")


if __name__ == "__main__":
    main()
