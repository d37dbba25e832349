"""Probe: emptying a GPU staging buffer into pageable host memory through the snapshot's ring
(``mpickpt.save.snapshot._unstage_ring``), with the CPU's copy of each piece into place split
over 1, 2, 4 or 8 threads (``LAND_THREADS``); and what page-locking a fresh host buffer of the
same size costs (touching its pages, then ``cudaHostRegister``), as a restore does.

    python bench/probe_land.py [--gb 3] [--json bench/results/land.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mpickpt.save import snapshot
from mpickpt.save.pinned_pool import host_buffer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "land.json"))
    a = ap.parse_args()
    n = int(a.gb * 1e9) // (1 << 20) * (1 << 20) + 12345  # a short last piece
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = host_buffer(n, huge=True)
    dst.fill_(1)  # reused between saves: its pages exist
    ring = torch.empty(2 * snapshot.RING_PIECE, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    rows = []
    for threads in (1, 2, 4, 8, 1, 4):
        snapshot.LAND_THREADS = threads
        snapshot._LANDERS.clear()
        dst.fill_(0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        snapshot._unstage_ring(stream, src, dst, ring)
        s = time.perf_counter() - t
        ok = all(torch.equal(dst[i:i + 4096], src[i:i + 4096].cpu())
                 for i in (0, n // 3, n - 4096))
        rows.append({"land_threads": threads, "s": s, "GBps": n / s / 1e9, "bytes_ok": ok})
    del dst
    fresh = host_buffer(n, huge=True)
    t = time.perf_counter()
    fresh.zero_()
    touched = time.perf_counter() - t
    t = time.perf_counter()
    err = torch.cuda.cudart().cudaHostRegister(fresh.data_ptr(), n, 0)
    locked = time.perf_counter() - t
    torch.cuda.cudart().cudaHostUnregister(fresh.data_ptr())
    out = {"bytes": n, "torch_threads": torch.get_num_threads(), "rows": rows,
           "fresh_touch_s": touched, "fresh_register_s": locked, "register_error": int(err)}
    print(f"{n / 1e9:.2f} GB from the GPU into pageable memory through the ring "
          f"({snapshot.RING_PIECE >> 20} MiB pieces), torch threads {torch.get_num_threads()}")
    print(f"{'land threads':>12} {'s':>7} {'GB/s':>6}  bytes")
    for r in rows:
        print(f"{r['land_threads']:>12} {r['s']:7.3f} {r['GBps']:6.2f}  "
              f"{'ok' if r['bytes_ok'] else 'WRONG'}")
    print(f"a fresh buffer of the same size: touched in {touched:.3f} s, then page-locked in "
          f"{locked:.3f} s (cudaHostRegister error {int(err)})")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
