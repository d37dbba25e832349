"""Save a state holding every supported kind of value, restore it into a fresh state, compare.

Usage: roundtrip.py ROOT. Exits non-zero with a message on the first difference.

Run by tests/multirank/test_roundtrip.py.
"""

from __future__ import annotations

import random
import sys
import warnings

import numpy as np
import torch
from mpi4py import MPI

import mpickpt
from mpickpt.format import dtypes

rank = MPI.COMM_WORLD.rank
warnings.filterwarnings("ignore", "ComplexHalf support is experimental")


def make(seed: int) -> dict:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=10)
    if seed == 0:  # the state to save has taken steps; the fresh one has empty optimizer state
        for _ in range(3):
            model(torch.randn(5, 8)).square().sum().backward()
            optim.step()
            sched.step()
    tensors = {}
    for name in dtypes.names():
        dt = dtypes.torch_dtype(name)
        raw = torch.randint(0, 256, (3, 5, 16), dtype=torch.uint8, generator=torch.Generator()
                            .manual_seed(seed * 100 + len(name)))
        if dt == torch.bool:
            raw &= 1
        t = raw.view(-1).view(dt).reshape(3, 5, -1)
        tensors[name] = t.clone()
    return {
        "model": model, "optim": optim, "sched": sched, "rng": mpickpt.RNGState(),
        "dtypes": tensors,
        "scalar0d": torch.tensor(float(seed) + 0.5),
        "empty": torch.empty(0, 3),
        "noncontig": torch.arange(12.0).reshape(3, 4).t() + seed,
        "np": {"f": np.arange(6.0).reshape(2, 3) + seed, "i": np.arange(4, dtype=np.int32) * seed,
               "u4": np.array([seed, 2**32 - 1], dtype=np.uint32), "s": np.float32(seed)},
        "py": {"int": 7 + seed, "big": 2**80 + seed, "float": 0.1 + seed, "nan": float("nan"),
               "inf": float("-inf"), "bool": bool(seed), "str": f"s{seed}", "none": None,
               "bytes": bytes([seed, 255]), "tuple": (1, (2, seed)), "list": [1, [seed]],
               7: "int key", "dt": torch.bfloat16 if seed == 0 else torch.float32},
        "gens": {"torch": torch.Generator().manual_seed(seed + 5),
                 "np": np.random.default_rng(seed + 6), "py": random.Random(seed + 7)},
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: object, b: object, path: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(_bytes(a), _bytes(b)), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} {list(b)}"
        for k in a:
            same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}/{i}")
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def snapshot(s: dict) -> dict:
    """Comparable values of everything in the state, the generators' next draws included."""
    return {
        "model": s["model"].state_dict(), "optim": s["optim"].state_dict(),
        "sched": s["sched"].state_dict(), "dtypes": s["dtypes"], "scalar0d": s["scalar0d"],
        "empty": s["empty"], "noncontig": s["noncontig"], "np": s["np"], "py": s["py"],
        "draws": [torch.rand(3), np.random.rand(3), random.random(),
                  torch.rand(3, generator=s["gens"]["torch"]), s["gens"]["np"].random(3),
                  s["gens"]["py"].random()],
    }


root = sys.argv[1]
saved = make(0)
ck = mpickpt.Checkpointer(root)
assert ck.save(11, saved, metadata={"rank0": "meta"}).wait().committed
expected = snapshot(saved)  # draws advance the RNGs, so take them after the save
fresh = make(1)
assert ck.restore(fresh) == 11
assert ck.restore_info.metadata == {"rank0": "meta"}
same(expected, snapshot(fresh), "state")
ck.close()
print(f"rank {rank}: round trip OK", flush=True)
