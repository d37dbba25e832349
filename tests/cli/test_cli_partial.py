"""A save that never committed: the CLI names the rank whose shard was left incomplete or missing.

The tree is a real crash (clikit): examples/train.py on 4 ranks, rank 2 SIGKILLed in the middle of
writing its shard of step 25 (MPICKPT_FAULT=mid-write:2:kill:25). Without a manifest the size a
shard should have is not known; what the CLI claims is checked here against what can be known:
HDF5 itself (h5py refuses a file its writer never closed) and the same rank's shard of step 20,
committed by the same run (the state, so each shard's size, is the same at every step).
"""

from __future__ import annotations

import h5py
import pytest
from clikit import PARTIAL, by_step, cli, cli_json, copy_tree, partial_dirs, pristine
from harness import manifest

from mpickpt.cli import EXIT_OK


def _opens(path) -> bool:
    """Whether h5py reads the file's root attributes (those its writer sets, then closes)."""
    try:
        with h5py.File(path, "r") as f:
            return int(f.attrs["rank"]) >= 0 and f.attrs["mpickpt_format"] == "mpickpt-shard"
    except Exception:  # h5py raises OSError, KeyError, RuntimeError ... for a torn file
        return False


def spans(ranks: list[int]) -> str:
    """Sorted ranks as the CLI writes them: runs of consecutive ranks as ``a-b``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


@pytest.mark.quick
def test_the_killed_rank_is_named_and_the_claim_holds(tmp_path_factory):
    root = pristine(4, tmp_path_factory)
    partial = partial_dirs(root)[0]
    code, doc = cli_json("ls", root)
    assert code == EXIT_OK
    row = by_step(doc)[(PARTIAL, "partial")]
    shards = row["shards"]
    assert shards["world_size"] == 4 and shards["world_size_from"] is None  # the run's own
    assert row["world_size"] == 4
    assert 2 in shards["incomplete"], shards  # the killed one
    bad = shards["incomplete"]
    said = ("rank 2's shard is incomplete" if bad == [2] else
            f"the shards of ranks {spans(bad)} are incomplete")
    assert row["note"].startswith(f"a save that never committed; {said} ("), row["note"]
    sizes = {r["rank"]: r["bytes"] for r in manifest(root, 20)["ranks"]}
    for r in range(4):
        path = partial / f"rank-{r:05d}.h5"
        if r in shards["complete"]:  # HDF5 closed it, and it has its full size
            assert _opens(path) and path.stat().st_size == sizes[r] == shards["bytes"][str(r)]
        elif r in shards["incomplete"]:  # HDF5 itself refuses it, or it is short
            assert not _opens(path) or path.stat().st_size < sizes[r]
        else:
            assert r in shards["missing"] and not path.exists()
    done = shards["complete"]
    if done == [0, 1, 3]:  # the usual outcome: the others had finished when rank 2 died
        assert row["note"].startswith("a save that never committed; rank 2's shard is "
                                      "incomplete (")
        assert "its writer never closed it" in row["note"]
        assert row["note"].endswith("ranks 0-1,3 wrote theirs")
    code, out, _ = cli("ls", root)
    assert said in out


def test_a_missing_shard_is_called_missing_and_restore_records_the_ranks(tmp_path,
                                                                         tmp_path_factory):
    root = copy_tree(4, tmp_path_factory, tmp_path / "ckpt")
    partial = partial_dirs(root)[0]
    shards = by_step(cli_json("ls", root)[1])[(PARTIAL, "partial")]["shards"]
    if 3 not in shards["complete"]:
        pytest.skip(f"rank 3 had not finished its shard when the job died: {shards}")
    (partial / "rank-00003.h5").unlink()  # as if rank 3 had died before creating it
    row = by_step(cli_json("ls", root)[1])[(PARTIAL, "partial")]
    assert row["shards"]["missing"] == [3] and 2 in row["shards"]["incomplete"]
    assert "rank 3's shard is missing" in row["note"]
    # mpickpt-restore quarantines it, and the reason it records names the ranks
    code, doc = cli_json(root, "--grace", "0", restore=True)
    assert code == EXIT_OK
    moved = [a for a in doc["actions"] if a["path"] == str(partial)]
    assert len(moved) == 1 and "rank 3's shard is missing" in moved[0]["reason"]
    assert "rank 2" in moved[0]["reason"]
    log = (root / "quarantine" / "QUARANTINE.jsonl").read_text()
    assert "rank 3's shard is missing" in log
