"""How much a plain O_DIRECT dd slows CPU training steps on this machine (the I/O path itself)."""
import statistics
import subprocess
import time

import torch

torch.manual_seed(0)
layers = [m for _ in range(16) for m in (torch.nn.Linear(2048, 2048), torch.nn.ReLU())]
model = torch.nn.Sequential(*layers)
opt = torch.optim.Adam(model.parameters(), lr=1e-5)
x = torch.randn(64, 2048)
def step():
    t = time.perf_counter()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t
for _ in range(3): step()
for rnd in range(2):
    base = [step() for _ in range(6)]
    p = subprocess.Popen(["dd", "if=/dev/zero", "of=/tmp/bcpu/ddx", "bs=64M", "count=13", "oflag=direct", "conv=fsync"], stderr=subprocess.DEVNULL)
    t0 = time.perf_counter(); during = []
    while p.poll() is None: during.append(step())
    dd_s = time.perf_counter() - t0
    print(f"base step {statistics.median(base):.3f} s; during dd ({dd_s:.2f} s) {len(during)} steps median {statistics.median(during):.3f} s -> +{(statistics.median(during)/statistics.median(base)-1)*100:.0f}%")
