"""Why a process's first ``torch._foreach_copy_`` on a GPU is slow: its kernels' loading, or the
fresh memory it writes? One process per mode (each starts cold)::

    for m in cold warm32 coldbf16 warm32bf16 warmallbf16 premem; do
        python bench/probe_first_copy.py $m; done

24 tensors of 4096 x 4096 (fp32, or bf16 for the ``*bf16`` modes) are copied on a side stream
into a new buffer, three times. ``warm32`` first copies one fp32 element (``warmall``: one of
fp32, bf16 and fp16 each); ``premem`` first writes the whole buffer's size of fresh memory with
another kernel. Found (one H200, s66): the first call 0.026 s (fp32) and 0.013 s (bf16), later
ones 0.0002 s; after a copy of one fp32 element (0.020-0.024 s) 0.0002-0.0004 s whatever the
dtype, and fresh memory written first does not help (0.018 s): the kernels' loading. The
Checkpointer now makes that one-element copy when it is made in a process that uses CUDA.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["cold", "warm32", "coldbf16", "warm32bf16", "warmallbf16",
                                     "premem"])
    mode = ap.parse_args().mode
    dt = torch.bfloat16 if "bf16" in mode else torch.float32
    src = [torch.randn(4096, 4096, device="cuda").to(dt) for _ in range(24)]
    nbytes = sum(x.numel() * x.element_size() for x in src)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    if mode.startswith("warm"):
        t = time.perf_counter()
        kinds = ((torch.float32,) if mode.startswith("warm32")
                 else (torch.float32, torch.bfloat16, torch.float16))
        for wdt in kinds:
            a = [torch.zeros(1, device="cuda", dtype=wdt)]
            b = [torch.empty(1, device="cuda", dtype=wdt)]
            with torch.cuda.stream(s):
                torch._foreach_copy_(b, a, non_blocking=True)
        s.synchronize()
        print(f"{mode}: warm {time.perf_counter() - t:.4f} s")
    if mode == "premem":
        junk = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        junk.fill_(1)
        del junk
        torch.cuda.synchronize()
    kept = []
    for i in range(3):
        t = time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        alloc = time.perf_counter() - t
        views, o = [], 0
        for x in src:
            n = x.numel() * x.element_size()
            views.append(buf[o:o + n].view(x.dtype).view(x.shape))
            o += n
        t = time.perf_counter()
        with torch.cuda.stream(s):
            torch._foreach_copy_(views, src, non_blocking=True)
        call = time.perf_counter() - t
        s.synchronize()
        print(f"{mode} {dt}: copy {i}: alloc {alloc:.4f} s, call {call:.4f} s, to done "
              f"{time.perf_counter() - t:.4f} s")
        kept.append(buf)


if __name__ == "__main__":
    main()
