"""Soak: 1000 saves of a small state with keep=2 on 4 ranks (tests/scenarios/soak.py).

Every save must commit; after warm-up each rank's open file descriptors stay exactly the same and
its resident memory grows by less than RSS_BOUND (and by less than HALF_BOUND over the second
half: a leak of half a kilobyte per save shows there); ROOT holds exactly stats.jsonl, the two
newest checkpoints and, past the second save, ``.pool`` (the retired checkpoint's shards, which
the next save writes over) after every save: at most three checkpoints' bytes, as while a save
writes. The figures are printed.

The bounds come from measurements on a 2-core VM (4 ranks, 1000 saves): after warm-up (save 50)
the resident memory of a rank grew by 350-450 KiB, of which 50-80 KiB over saves 500-1000. With
a new I/O thread per save (what mpickpt did before its threads were kept), MPICH's few hundred
bytes per thread started after MPI_Init made it grow 1.0-1.1 MiB, 500 KiB over the second half.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch
from harness import SCENARIOS, run_mpi

import mpickpt
from mpickpt.save import upkeep

N, KEEP = 4, 2
SAVES = int(os.environ.get("MPICKPT_SOAK_SAVES", "1000"))
RSS_BOUND = 2 << 20  # bytes, from the warm-up sample to the end
HALF_BOUND = 256 << 10  # bytes, over the second half of the saves
LINE_BOUND = 1024  # bytes per stats.jsonl line
pytestmark = pytest.mark.guarantee("flat-forever")


def reports(where) -> dict[int, dict]:
    """The reports the ranks wrote to ``where``/rank-R.json, by rank."""
    found = [json.loads(p.read_text()) for p in where.glob("rank-*.json")] if where.exists() else []
    return {r["rank"]: r for r in found}


def figures(found: dict[int, dict], wall: float) -> dict:
    seconds = sorted(s for rep in found.values() for s in rep["seconds"])
    rss = {r: [s[1] for s in rep["samples"]] for r, rep in sorted(found.items())}
    return {
        "saves": SAVES, "ranks": N, "keep": KEEP, "wall_s": round(wall, 1),
        "save_s": {"mean": statistics.mean(seconds), "median": statistics.median(seconds),
                   "p99": seconds[int(0.99 * (len(seconds) - 1))], "max": seconds[-1]},
        "samples_at": [s[0] for s in found[0]["samples"]],
        "rss_MiB": {r: [round(x / 2**20, 2) for x in v] for r, v in sorted(rss.items())},
        "rss_growth_KiB": {r: (v[-1] - v[0]) >> 10 for r, v in sorted(rss.items())},
        "fds": {r: [s[2] for s in rep["samples"]] for r, rep in sorted(found.items())},
        "root_max_bytes": found[0]["most"]["bytes"],
        "root_max_checkpoints": found[0]["most"]["entries"],
        "checkpoint_bytes": max(found[0]["checkpoint_bytes"]),
        "stats_jsonl_bytes": found[0]["stats_bytes"],
    }


def problems(found: dict[int, dict], fig: dict) -> list[str]:
    out = []
    half = SAVES // 2
    for r, rep in sorted(found.items()):
        if rep["failed"]:
            out.append(f"rank {r}: {len(rep['failed'])} saves not committed, first "
                       f"{rep['failed'][0]}")
        if rep["restored"] != [SAVES, True]:
            out.append(f"rank {r}: the last checkpoint restored as {rep['restored']}")
        fds = fig["fds"][r]
        if len(set(fds)) != 1:
            out.append(f"rank {r}: open descriptors {fds} at saves {fig['samples_at']}")
        samples = {s[0]: s[1] for s in rep["samples"]}
        grew = rep["samples"][-1][1] - rep["samples"][0][1]
        if grew >= RSS_BOUND:
            out.append(f"rank {r}: resident memory grew {grew >> 10} KiB after warm-up")
        if half in samples and samples[SAVES] - samples[half] >= HALF_BOUND:
            out.append(f"rank {r}: resident memory grew {(samples[SAVES] - samples[half]) >> 10}"
                       f" KiB over saves {half}..{SAVES}")
    if found[0]["wrong"]:
        out.append(f"ROOT held something else than stats.jsonl, the {KEEP} newest "
                   f"checkpoints and the pool: {found[0]['wrong']}")
    if fig["root_max_checkpoints"] > KEEP or \
            fig["root_max_bytes"] > (KEEP + 1) * fig["checkpoint_bytes"]:
        out.append(f"ROOT grew to {fig['root_max_checkpoints']} entries, "
                   f"{fig['root_max_bytes']} bytes")
    if fig["stats_jsonl_bytes"] > SAVES * LINE_BOUND:
        out.append(f"stats.jsonl holds {fig['stats_jsonl_bytes']} bytes after {SAVES} saves")
    return out


def test_soak_thousand_saves_keep_two_on_four_ranks(tmp_path, guarantees, capsys):
    t = time.monotonic()
    try:
        job = run_mpi(N, [str(SCENARIOS / "soak.py"), str(tmp_path / "ckpt"), str(SAVES),
                          str(KEEP), str(tmp_path / "reports")], timeout=900)
    except pytest.fail.Exception as e:
        guarantees.record("soak", f"{SAVES} saves, keep={KEEP}, {N} ranks", "hang", str(e)[:2000])
        raise
    wall = time.monotonic() - t
    found = reports(tmp_path / "reports")
    bad, fig = [], {}
    if job.returncode != 0 or sorted(found) != list(range(N)):
        bad.append(f"the job failed (exit {job.returncode}):\n{job.output}")
    else:
        fig = figures(found, wall)
        bad = problems(found, fig)
        with capsys.disabled():
            print(f"\nsoak: {json.dumps(fig)}")
    guarantees.record("soak", f"{SAVES} saves, keep={KEEP}, {N} ranks",
                      "failed" if bad else "correct",
                      "; ".join(bad)[:2000] if bad else json.dumps(fig)[:2000])
    assert not bad, "\n".join(bad)


@pytest.mark.quick
def test_stats_jsonl_is_bounded(tmp_path, monkeypatch, guarantees):
    """stats.jsonl, a line per commit, becomes stats.jsonl.1 at STATS_MAX_BYTES: together they
    hold the newest lines, in order, and at most twice that plus a line (one process)."""
    limit = 4096
    monkeypatch.setattr(upkeep, "STATS_MAX_BYTES", limit)
    state = {"w": torch.zeros(16), "step": 0}
    with mpickpt.Checkpointer(tmp_path, keep=KEEP) as ck:
        for step in range(1, 61):
            state["w"] += 1
            assert ck.save(step, state).wait().committed
    new, old = tmp_path / "stats.jsonl", tmp_path / "stats.jsonl.1"
    sizes = [p.stat().st_size if p.exists() else None for p in (new, old)]
    lines = [json.loads(x)["step"] for p in (old, new) if p.exists() for x in p.open()]
    longest = max(len(x) for p in (old, new) if p.exists() for x in p.open())
    bad = []
    if None in sizes or sizes[0] >= limit + longest or not limit <= sizes[1] < limit + longest:
        bad.append(f"stats.jsonl and stats.jsonl.1 hold {sizes} bytes (limit {limit})")
    if not lines or lines != list(range(lines[0], 61)) or len(lines) < limit // longest:
        bad.append(f"the two hold steps {lines}")
    guarantees.record("soak", "stats.jsonl bounded", "failed" if bad else "correct",
                      "; ".join(bad))
    assert not bad, "\n".join(bad)
