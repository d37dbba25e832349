"""A save that never committed: the CLI names the rank whose shard was left incomplete or missing.

The tree is a real crash (clikit): examples/train.py on 4 ranks, rank 2 SIGKILLed in the middle of
writing its shard of step 25 (MPICKPT_FAULT=mid-write:2:kill:25). Without a manifest the size a
shard should have is not known; what the CLI claims is checked here against what can be known:
HDF5 itself (h5py refuses a file its writer never sealed: the HDF5 metadata is written last) and
the size the shard's own superblock records.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import h5py
import pytest
from clikit import PARTIAL, by_step, cli, cli_json, copy_tree, partial_dirs, pristine

from mpickpt.cli import EXIT_OK
from mpickpt.ranks import ranks_text


def _declared(path) -> int:
    """The size a shard's HDF5 superblock (version 0) gives its file: its full size (step 20's
    committed shards are no measure of it: the state's "losses" grows with the step)."""
    head = path.read_bytes()[:48]
    assert head[:8] == b"\x89HDF\r\n\x1a\n" and head[8] == 0, path
    return struct.unpack("<Q", head[40:48])[0]


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
    for r in range(4):
        path = partial / f"rank-{r:05d}.h5"
        if r in shards["complete"]:  # HDF5 closed it, and it has its full size
            assert _opens(path) and path.stat().st_size == _declared(path) == \
                shards["bytes"][str(r)]
        elif r in shards["incomplete"]:  # HDF5 itself refuses it, or it is short
            assert not _opens(path) or path.stat().st_size < _declared(path)
        else:
            assert r in shards["missing"] and not path.exists()
    done = shards["complete"]
    if done == [0, 1, 3]:  # the usual outcome: the others had finished when rank 2 died
        assert row["note"].startswith("a save that never committed; rank 2's shard is "
                                      "incomplete (")
        assert "its writer never sealed it: no HDF5 header yet" in row["note"]
        assert row["note"].endswith("ranks 0-1,3 wrote theirs")
    code, out, _ = cli("ls", root)
    assert said in out


def test_a_missing_shard_is_called_missing_and_restore_records_the_ranks(tmp_path,
                                                                         tmp_path_factory):
    root = copy_tree(4, tmp_path_factory, tmp_path / "ckpt")
    partial = partial_dirs(root)[0]
    shards = by_step(cli_json("ls", root)[1])[(PARTIAL, "partial")]["shards"]
    done = [r for r in shards["complete"] if r != 2]
    if not done:  # rank 2 died before any other rank had finished its shard
        pytest.skip(f"no rank had finished its shard when rank 2 died: {shards}")
    victim = max(done)  # usually rank 3: as if it had died before creating its shard
    (partial / f"rank-{victim:05d}.h5").unlink()
    missing = sorted({*shards["missing"], victim})  # (a rank that had not begun is missing too)
    said = (f"rank {victim}'s shard is missing" if missing == [victim] else
            f"the shards of {ranks_text(missing)} are missing")
    row = by_step(cli_json("ls", root)[1])[(PARTIAL, "partial")]
    assert row["shards"]["missing"] == missing and 2 in row["shards"]["incomplete"]
    assert said in row["note"], row["note"]
    # mpickpt-restore quarantines it, and the reason it records names the ranks
    code, doc = cli_json(root, "--grace", "0", restore=True)
    assert code == EXIT_OK
    moved = [a for a in doc["actions"] if a["path"] == str(partial)]
    assert len(moved) == 1 and said in moved[0]["reason"]
    assert "rank 2" in moved[0]["reason"]
    log = (root / "quarantine" / "QUARANTINE.jsonl").read_text()
    assert said in log


@pytest.mark.quick
def test_a_shard_is_complete_once_sealed_and_short_when_cut(tmp_path):
    """shard_state on shards as the save writes them (the HDF5 metadata from the layout's
    template, written last): sealed, complete; cut short, short; data without its seal (a writer
    killed mid-write), unsealed."""
    import json

    import torch

    from mpickpt.cli.diagnose import shard_state
    from mpickpt.format.h5template import Templates
    from mpickpt.format.shard import ShardWriter

    tensors = {"w": torch.arange(70_000, dtype=torch.float32), "b": torch.ones(3)}
    attrs = {"rank": 0, "step": 5, "world_size": 1, "tree": json.dumps({"type": "dict"})}
    template = Templates().get(tensors, attrs, alignment=1 << 16, block=1 << 16)
    assert template is not None
    path = tmp_path / "rank-00000.h5"
    w = ShardWriter(str(path), tensors, attrs, alignment=1 << 16, block=1 << 16,
                    template=template)
    w.write(tensors, block=1 << 16)
    size = w.seal()
    assert shard_state(str(path)) == "complete" and _declared(path) == size
    os.truncate(path, size - 1)
    assert shard_state(str(path)) == "short"
    torn = tmp_path / "rank-00001.h5"
    w = ShardWriter(str(torn), tensors, attrs, alignment=1 << 16, block=1 << 16,
                    template=template)
    w.write(tensors, block=1 << 16)
    w.close()  # never sealed
    assert shard_state(str(torn)) == "unsealed" and not _opens(torn)
    # a shard HDF5 writes itself (no template: a node's file, compressed chunks) and whose
    # writer dies before it closes it: its superblock is still marked open for writing
    killed = tmp_path / "rank-00002.h5"
    code = (
        "import os, sys, torch\n"
        "from mpickpt.format.shard import ShardWriter\n"
        "t = {'w': torch.arange(70_000, dtype=torch.float32)}\n"
        "w = ShardWriter(sys.argv[1], t, {'rank': 2, 'tree': '{}'}, alignment=1 << 16)\n"
        "w.write(t)\n"
        "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code, str(killed)], check=True, timeout=120)
    assert shard_state(str(killed)) == "unclosed"
