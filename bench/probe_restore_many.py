"""A restore of a state of many small tensors against ``torch.load`` of the same state (one
process, no MPI launcher, the page cache warm: what the per-tensor work costs, not the disk).

    python bench/probe_restore_many.py --layers 1000 --rounds 3 --out restore-many.json

The state: ``--layers`` ``Linear(16, 16)`` layers and their Adam state (8 tensors a layer). Each
round times, alternating, ``Checkpointer.restore`` into the live model and optimizer, and
``torch.load(weights_only=True)`` of a ``torch.save`` file of the same state followed by the
two ``load_state_dict`` calls. Both pay torch's ``Module.load_state_dict`` (timed apart: it
filters the whole state dict once per module, so it grows with layers times tensors).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

os.environ.setdefault("MPICKPT_LOG", "WARNING")  # (a line per restore otherwise)
from small_layers import small_layers, write_rows

import mpickpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/restore-many.json")
    a = ap.parse_args()
    model, opt, tensors = small_layers(a.layers)
    in_module = [0.0]
    plain = torch.nn.Module.load_state_dict

    def timed_load(self: torch.nn.Module, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return plain(self, *args, **kw)
        finally:
            in_module[0] += time.perf_counter() - t

    root = tempfile.mkdtemp(prefix="mpickpt-restore-many-")
    rows: list[dict[str, Any]] = []
    try:
        path = os.path.join(root, "state.pt")
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        with mpickpt.Checkpointer(os.path.join(root, "ckpt"), keep=1) as ck:
            ck.save(1, {"model": model, "optim": opt}).wait()

            def mpickpt_restore() -> None:
                ck.restore({"model": model, "optim": opt})

            def torch_load() -> None:
                sd = torch.load(path, weights_only=True)
                model.load_state_dict(sd["model"])
                opt.load_state_dict(sd["optim"])

            methods = {"mpickpt restore": mpickpt_restore, "torch.load": torch_load}
            for fn in methods.values():  # warm: the page cache, torch's first calls
                fn()
            torch.nn.Module.load_state_dict = timed_load  # type: ignore[method-assign]
            try:
                for r in range(a.rounds):
                    for name in methods if r % 2 == 0 else reversed(list(methods)):
                        in_module[0] = 0.0
                        t = time.perf_counter()
                        methods[name]()
                        rows.append({"round": r + 1, "method": name,
                                     "s": time.perf_counter() - t,
                                     "module_load_state_dict_s": in_module[0]})
            finally:
                torch.nn.Module.load_state_dict = plain  # type: ignore[method-assign]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{tensors} tensors ({a.layers} x Linear(16, 16) + Adam), one process, page cache warm")
    print(f"{'method':<16} {'median s':>8} {'min s':>6} {'max s':>6} "
          f"{'of it Module.load_state_dict':>29}")
    summary = {}
    for name in ("mpickpt restore", "torch.load"):
        s = [x["s"] for x in rows if x["method"] == name]
        m = statistics.median(x["module_load_state_dict_s"] for x in rows if x["method"] == name)
        summary[name] = statistics.median(s)
        print(f"{name:<16} {statistics.median(s):>8.3f} {min(s):>6.3f} {max(s):>6.3f} {m:>29.3f}")
    print(f"mpickpt / torch.load: {summary['mpickpt restore'] / summary['torch.load']:.2f}x")
    write_rows(a.out, a, tensors, rows)


if __name__ == "__main__":
    main()
