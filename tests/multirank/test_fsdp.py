"""FSDP2 (``fully_shard``, gloo on CPU) under mpickpt.run: a checkpoint of 4 ranks restores on 4,
2 and 1 ranks with every parameter and optimizer state value bit for bit, and training goes on
as if never interrupted (exactly on 4 ranks; up to float reduction order on 2 and 1).

One 4-rank job trains 8 steps, saving at step 4 (tests/scenarios/fsdp_train.py) and writing the
full tensors there as the reference; its losses of steps 5-8 are the uninterrupted run's.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest
import torch
from harness import SCENARIOS, assert_restored_whole, manifest, run_mpi

STEPS, SAVE_AT, WORLD = 8, 4, 4


def scenario(script: str, n: int, mode: str, root: Path, out: Path, *extra: str) -> None:
    """Run the scenario on ``n`` ranks under mpickpt.run; print the job's wall and CPU time (the
    CPU seconds of all its processes: on a machine shared with other jobs, the better measure
    of what it costs)."""
    t, cpu = time.monotonic(), _children_cpu()
    job = run_mpi(n, ["-m", "mpickpt.run", str(SCENARIOS / script), mode, "--root", str(root),
                      "--out", str(out), "--steps", str(STEPS), *extra])
    wall, cpu = time.monotonic() - t, _children_cpu() - cpu
    assert job.returncode == 0, job.output
    name = f"{mode}-{n}" if mode == "resume" else mode
    inner = json.loads((out / f"{name}-timing.json").read_text())
    print(f"[timing] {script} {mode} on {n} ranks: {wall:.1f} s wall, {cpu:.1f} s CPU (in the job: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in inner.items()) + ")")


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def losses(out: Path, name: str) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((out / f"{name}-losses.json").read_text()).items()}


def full_nbytes(ref: dict) -> dict[str, int]:
    """The bytes of every full tensor of the reference, by the checkpoint's record name."""
    out = {f"model/{k}": v.nbytes for k, v in ref["model"].items()}
    for k, st in ref["optim"].items():
        out.update({f"optim/state/{k}/{n}": v.nbytes for n, v in st.items()})
    return out


def trained(script: str, factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 4-rank training run of ``script`` that saves at SAVE_AT: (checkpoint root, output)."""
    base = factory.mktemp(script.removesuffix("_train.py"))
    root, out = base / "ckpt", base / "out"
    scenario(script, WORLD, "train", root, out, "--save-at", str(SAVE_AT))
    return root, out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The 4-rank FSDP2 run: (checkpoint root, output directory)."""
    return trained("fsdp_train.py", tmp_path_factory)


@pytest.mark.quick
def test_fsdp_checkpoint_holds_each_shard_once(saved):
    root, out = saved
    ref = torch.load(out / "reference.pt", weights_only=True)
    m = manifest(root, SAVE_AT)
    assert m["world_size"] == WORLD
    written: dict[str, int] = {}
    for entry in m["ranks"]:
        for rec in entry["tensors"]:
            if rec["global_shape"] is not None:
                written[rec["name"]] = written.get(rec["name"], 0) + rec["nbytes"]
    full = full_nbytes(ref)
    sharded = {k: v for k, v in full.items() if not k.endswith("/step")}
    # every parameter and Adam moment is stored as pieces that add up to the whole tensor once
    assert {k: written.get(k) for k in sharded} == sharded
    # Adam's step counters are plain tensors in FSDP2: per-rank values, one per rank
    steps = [r for e in m["ranks"] for r in e["tensors"] if r["name"].endswith("/step")]
    assert len(steps) == WORLD * len(ref["optim"])


@pytest.mark.guarantee("reshard-bit-exact")
@pytest.mark.parametrize("n", [4, 2, 1])
def test_fsdp_restores_on_any_number_of_ranks(saved, n):
    root, out = saved
    scenario("fsdp_train.py", n, "resume", root, out)
    assert_restored_whole(out, n, SAVE_AT, WORLD)

    # what each rank read: its own pieces on 4 ranks, everything on 1, not everything on 2
    m = manifest(root, SAVE_AT)
    total = sum(r["nbytes"] for e in m["ranks"] for r in e["tensors"])
    read = [json.loads((out / f"bytes-{n}-rank-{r}.json").read_text())["bytes_read"]
            for r in range(n)]
    if n == WORLD:
        assert read == [sum(r["nbytes"] for r in e["tensors"]) for e in m["ranks"]]
    elif n == 1:
        assert read == [total - sum(r["nbytes"] for e in m["ranks"][1:] for r in e["tensors"]
                                    if r["global_shape"] is None)]
    else:
        assert all(0 < b < total for b in read), (read, total)

    whole = losses(out, "train")
    resumed = losses(out, f"resume-{n}")
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    expected = [whole[s] for s in sorted(resumed)]
    if n == WORLD:
        assert [resumed[s] for s in sorted(resumed)] == expected
    else:
        assert [resumed[s] for s in sorted(resumed)] == pytest.approx(expected, rel=1e-5)
