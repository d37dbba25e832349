"""FSDP2 job: save on S ranks, restore on R ranks, with mpickpt and with DCP, side by side.

    python bench/bench_fsdp.py --save-ranks 2 --restore-ranks 1 --gb 6 --dir /tmp/fsdp

The driver runs ``mpiexec -n S python -m mpickpt.run bench/bench_fsdp.py --phase save`` and then
``... -n R ... --phase restore``. The state is an MLP of ``Linear(W, W)`` layers sharded with
``fully_shard`` (FSDP2) plus its Adam moments, ``--gb`` GB in all, taken with
``get_state_dict`` (DTensors) and loaded with ``set_state_dict``, the way PyTorch recommends.

- save: ``Checkpointer.save(...)`` (its return is the training loop's stall) until ``wait()``
  on every rank, barrier to barrier; ``torch.distributed.checkpoint.save`` barrier to barrier.
- restore, on another number of ranks: ``Checkpointer.restore`` + ``set_state_dict``; ``dcp.load``
  + ``set_state_dict``; the page cache dropped before each (when root may).
- correctness: rank 0 hashes every parameter and moment (``full_tensor()``) after the save and
  after each restore; a restore whose hashes differ is reported as FAILED.

Prints a table; writes ``--json`` (default bench/results/fsdp.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(seed: int, gb: float, width: int):
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    layers = max(1, round(gb * 1e9 / (3 * 4 * width * width)))
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)]).to(dev)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(8, width, device=dev, generator=torch.Generator(dev).manual_seed(seed))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    return model, optim, {"model": msd, "optim": osd}, layers


def digests(state: dict) -> dict[str, str]:
    """Rank 0: xxh3 of every tensor's full value (collective: full_tensor gathers)."""
    import torch
    import torch.distributed as dist

    from mpickpt.format import checksum

    out = {}

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, torch.Tensor):
            full = x.full_tensor() if hasattr(x, "full_tensor") else x
            if dist.get_rank() == 0:
                cpu = full.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                out[path] = checksum.digest(memoryview(cpu))

    walk(state, "")
    return out


def scramble(state: dict) -> None:
    """Overwrite every tensor of the state in place, so a restore has to bring each value back."""
    import torch

    for v in state.values():
        if isinstance(v, dict):
            scramble(v)
        elif isinstance(v, torch.Tensor):
            local = v._local_tensor if hasattr(v, "_local_tensor") else v
            local.fill_(-3)


def timed(fn) -> float:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t


def phase(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from bench_gpu import drop_caches  # bench/ is sys.path[0]
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import mpickpt

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    d = Path(args.dir)
    res: dict = {"world": world}
    if args.phase == "save":
        model, optim, state, layers = build(0, args.gb, args.width)
        res["layers"] = layers
        res["bytes"] = 3 * layers * args.width * args.width * 4
        ck = mpickpt.Checkpointer(d / "mpickpt", keep=1)
        stall: list[float] = []

        def save_mpickpt(step: int) -> None:
            t = time.perf_counter()
            h = ck.save(step, state)
            stall.append(time.perf_counter() - t)
            assert h.wait().committed

        for i in range(1, args.rounds + 1):  # the first save allocates the pinned buffers
            res.setdefault("mpickpt_save_s", []).append(timed(lambda i=i: save_mpickpt(i)))
            res.setdefault("dcp_save_s", []).append(
                timed(lambda: dcp.save(state, checkpoint_id=str(d / "dcp"))))
        res["mpickpt_stall_s"] = stall
        ck.close()
        res["digests"] = digests(state)
    else:
        model, optim, state, _ = build(1, args.gb, args.width)  # other values
        ck = mpickpt.Checkpointer(d / "mpickpt")
        cached = {}

        def load_mpickpt() -> None:
            assert ck.restore(state) == args.rounds
            set_state_dict(model, optim, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

        def load_dcp() -> None:
            dcp.load(state, checkpoint_id=str(d / "dcp"))
            set_state_dict(model, optim, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

        for _ in range(args.rounds):  # the first restore allocates the pinned buffer
            for name, fn in (("mpickpt", load_mpickpt), ("dcp", load_dcp)):
                scramble(state)
                set_state_dict(model, optim, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
                cached[name] = drop_caches() if rank == 0 else None
                res.setdefault(f"{name}_restore_s", []).append(timed(fn))
                msd, osd = get_state_dict(model, optim)  # what the model and optimizer hold
                digest = digests({"model": msd, "optim": osd})
                if f"{name}_digests" in res and digest != res[f"{name}_digests"]:
                    digest = {"FAILED": "rounds differ"}
                res[f"{name}_digests"] = digest
        res["caches_dropped"] = cached
        if ck.restore_info is not None:
            res["mpickpt_bytes_read_rank0"] = ck.restore_info.bytes_read
        ck.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps(res))
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> None:
    d = Path(args.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
    extra = ["--allow-run-as-root", "--oversubscribe"] if (
        "Open MPI" in version or "OpenRTE" in version) else []
    runs = {}
    for ph, n in (("save", args.save_ranks), ("restore", args.restore_ranks)):
        out = d / f"{ph}.json"
        cmd = [mpiexec, *extra, "-n", str(n), sys.executable, "-m", "mpickpt.run", __file__,
               "--phase", ph, "--dir", str(d), "--gb", str(args.gb), "--width", str(args.width),
               "--rounds", str(args.rounds), "--out", str(out)]
        t = time.perf_counter()
        subprocess.run(cmd, check=True)
        print(f"{ph} on {n} ranks: {time.perf_counter() - t:.0f} s wall", file=sys.stderr)
        runs[ph] = json.loads(out.read_text())
    s, r = runs["save"], runs["restore"]
    gb = s["bytes"] / 1e9
    ok = {m: r[f"{m}_digests"] == s["digests"] for m in ("mpickpt", "dcp")}
    print(f"\nFSDP2 state {gb:.2f} GB ({s['layers']} x Linear({args.width}, {args.width}) + Adam),"
          f" saved on {s['world']} ranks, restored on {r['world']}")
    print("first round, then the best of the later rounds in parentheses")
    print(f"{'method':<10} {'save s':>14} {'GB/s':>6} {'restore s':>14} {'GB/s':>6}  restored")

    def fmt(ts: list[float]) -> str:
        return f"{ts[0]:.2f}" + (f" ({min(ts[1:]):.2f})" if len(ts) > 1 else "")

    for m in ("mpickpt", "dcp"):
        sv, rs = s[f"{m}_save_s"], r[f"{m}_restore_s"]
        print(f"{m:<10} {fmt(sv):>14} {gb / min(sv):>6.2f} {fmt(rs):>14} {gb / min(rs):>6.2f}  "
              f"{'bit-exact' if ok[m] else 'FAILED'}")
    print(f"mpickpt save() returned after {fmt(s['mpickpt_stall_s'])} s (the training loop's "
          f"stall); page cache dropped before restores: {r['caches_dropped']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"save": s, "restore": r, "bit_exact": ok,
                                           "args": vars(args)}, indent=1))
    shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["save", "restore"])
    ap.add_argument("--save-ranks", type=int, default=2)
    ap.add_argument("--restore-ranks", type=int, default=1)
    ap.add_argument("--gb", type=float, default=6.0)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/mpickpt-bench-fsdp")
    ap.add_argument("--out")
    ap.add_argument("--json", default=str(HERE / "results" / "fsdp.json"))
    args = ap.parse_args()
    (phase if args.phase else driver)(args)


if __name__ == "__main__":
    main()
