"""How much a plain O_DIRECT dd slows CPU training steps on this machine (the I/O path itself).

    python bench/probe_io.py [DIR]     # the 768 MiB MLP+Adam of bench_gpu.py --device cpu
"""

import statistics
import subprocess
import sys
import time

import torch

torch.manual_seed(0)
layers = [m for _ in range(16) for m in (torch.nn.Linear(2048, 2048), torch.nn.ReLU())]
model = torch.nn.Sequential(*layers)
opt = torch.optim.Adam(model.parameters(), lr=1e-5)
x = torch.randn(64, 2048)
target = (sys.argv[1] if len(sys.argv) > 1 else "/tmp") + "/probe-io.bin"


def step() -> float:
    t = time.perf_counter()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t


for _ in range(3):
    step()
for _round in range(2):
    base = statistics.median([step() for _ in range(6)])
    dd = ["dd", "if=/dev/zero", f"of={target}", "bs=64M", "count=13", "oflag=direct",
          "conv=fsync"]
    p = subprocess.Popen(dd, stderr=subprocess.DEVNULL)
    t0, during = time.perf_counter(), []
    while p.poll() is None:
        during.append(step())
    dd_s, mid = time.perf_counter() - t0, statistics.median(during)
    print(f"base step {base:.3f} s; during dd ({dd_s:.2f} s) {len(during)} steps, median "
          f"{mid:.3f} s: +{(mid / base - 1) * 100:.0f}%")
subprocess.run(["rm", "-f", target], check=True)
