"""The save pipeline and its stores (mpickpt/save/, mpickpt/local/, mpickpt/assembly.py)
and the coordinated restore (mpickpt/restore/coordinate.py, mpickpt/format/rootstart.py), on one
rank in this process: real Checkpointers, real files, injected faults."""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from pathlib import Path

import h5py
import pytest
import torch

import mpickpt
from mpickpt import faults
from mpickpt.errors import CheckpointError, RankFailure
from mpickpt.format import rootdir, rootstart
from mpickpt.format.entry import RankEntry
from mpickpt.format.manifest import Manifest
from mpickpt.format.records import TensorRecord
from mpickpt.local.nodestore import NodeStore
from mpickpt.restore import coordinate
from mpickpt.save import assemble, store
from mpickpt.save.pipeline import Pipeline
from mpickpt.save.rootstore import RootStore, check_shards

LOG = logging.getLogger("mpickpt")


def state(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "step": step}


@pytest.fixture
def no_faults():
    yield
    faults.configure("")


def test_both_stores_have_every_step_of_the_pipeline_with_the_same_signature():
    """The pipeline runs one sequence with no destination flag: each store answers every step
    of :class:`mpickpt.save.store.Store`, called the same way."""
    steps = [n for n, v in vars(store.Store).items()
             if callable(v) and not n.startswith("_")]
    assert set(steps) >= {"partial", "final", "manifest", "write", "protect", "publish",
                          "discard", "retain"}
    for cls in (RootStore, NodeStore):
        for name in steps:
            want = list(inspect.signature(getattr(store.Store, name)).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got[:len(want)] == want, (cls.__name__, name, got)


def test_a_save_into_root_goes_through_the_root_store_and_is_committed(tmp_path: Path):
    with mpickpt.Checkpointer(tmp_path) as ck:
        pipe = ck._pipeline
        assert isinstance(pipe, Pipeline) and pipe.store is pipe.root and not pipe.drains
        r = ck.save(3, state(3)).wait()
        assert r.committed and r.level == "root" and r.failures == []
        assert r.path == pipe.root.final(3) and os.path.isdir(r.path)
        assert pipe.root.manifest(3).step == 3


def test_a_failed_write_aborts_with_a_typed_record_per_failed_rank(tmp_path: Path, no_faults):
    """The vote's failures travel as RankFailure records that the error lists; nothing of the
    step is left in ROOT."""
    faults.configure("mid-write:0:raise")
    with mpickpt.Checkpointer(tmp_path) as ck:
        r = ck.save(4, state(4)).wait()
    assert not r.committed
    assert r.failures == [RankFailure(0, "vote", r.failures[0].reason)]
    assert "injected fault at mid-write on rank 0" in r.failures[0].reason
    assert r.error == str(r.failures[0])
    assert rootdir.committed(str(tmp_path)) == []
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]


def test_a_failed_commit_on_rank_0_is_a_record_of_the_commit_phase(tmp_path: Path, no_faults):
    faults.configure("after-vote-before-manifest:0:raise")
    with mpickpt.Checkpointer(tmp_path) as ck:
        r = ck.save(5, state(5)).wait()
    assert not r.committed and [(f.rank, f.phase) for f in r.failures] == [(0, "commit")]
    assert r.failures[0].reason.startswith("commit failed: FaultInjected")


def test_the_node_store_commits_first_and_the_drain_is_the_same_steps_into_root(tmp_path: Path):
    """With a local level the save commits on the node (level "local"); the drain then
    publishes, in ROOT, the very manifest the node committed."""
    local = mpickpt.Local(tmp_path / "local", persist_every=1)
    with mpickpt.Checkpointer(tmp_path / "root", local=local) as ck:
        pipe = ck._pipeline
        assert isinstance(pipe.store, NodeStore) and pipe.drains
        r = ck.save(6, state(6)).wait()
        assert r.committed and r.level == "local" and r.path == pipe.store.final(6)
        ck.wait()  # the drain that persist_every=1 asks for
        assert ck.drained == 6
        node, root = pipe.store.manifest(6), pipe.root.manifest(6)
        assert [e.to_dict() for e in node.ranks] == [e.to_dict() for e in root.ranks]
        assert (node.step, node.run_id) == (root.step, root.run_id)


def test_an_emergency_save_is_judged_against_the_deadline_by_the_last_commit(
        tmp_path: Path, caplog):
    with mpickpt.Checkpointer(tmp_path, preemption=False) as ck:
        assert ck._pipeline.time_for(1, time.time() - 1)  # nothing committed: nothing to judge
        assert ck.save(1, state(1)).wait().committed
        assert ck._pipeline.time_for(2, None)
        assert ck._pipeline.time_for(2, time.time() + 3600)
        with caplog.at_level(logging.ERROR, "mpickpt"):
            assert not ck._pipeline.time_for(2, time.time() - 1)
        assert "no time for the emergency checkpoint of step 2" in caplog.text


def test_rank_0_refuses_pieces_that_do_not_tile_and_shards_it_cannot_see(tmp_path: Path):
    def piece(rank: int, offset: int) -> RankEntry:
        r = TensorRecord("w", "float32", [4], 0, 16, ["0"])
        r.global_shape, r.offsets = [8], [offset]
        return RankEntry(rank, f"rank-{rank:05d}.h5", 16, {}, [r])

    assemble.check_pieces([piece(0, 0), piece(1, 4)])  # tiles [0, 8)
    with pytest.raises(ValueError, match="'w'"):
        assemble.check_pieces([piece(0, 0), piece(1, 2)])  # overlaps, leaves [6, 8) uncovered
    partial = tmp_path / "step-00000001.partial-r"
    partial.mkdir()
    (partial / "rank-00000.h5").write_bytes(b"x" * 16)
    (partial / "rank-00001.h5").write_bytes(b"x" * 10)
    with pytest.raises(CheckpointError, match="rank 2 are not in"):
        check_shards(str(partial), [piece(0, 0), piece(2, 4)])
    with pytest.raises(CheckpointError, match=r"rank 1 in .* are not of the size"):
        check_shards(str(partial), [piece(0, 0), piece(1, 4)])


def test_root_at_the_start_is_prepared_and_listed_or_said_unusable(tmp_path: Path, caplog):
    root = tmp_path / "root"
    leftover = root / rootdir.partial_name(7, "earlier")
    leftover.mkdir(parents=True)
    assert rootstart.prepare(str(root), "now", LOG) is None
    assert not leftover.exists()
    assert rootstart.listing(str(root), LOG, local=False) == ([], None, None)
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    why = rootstart.prepare(str(blocked / "root"), "now", LOG)  # a file on the way
    assert why is not None and why.startswith(f"{blocked / 'root'}: FileExistsError")
    with caplog.at_level(logging.WARNING, "mpickpt"):
        steps, undo, why = rootstart.listing(str(blocked), LOG, local=True)
    assert (steps, undo) == ([], None) and "NotADirectoryError" in why
    assert "restoring from the node-local level alone" in caplog.text


def test_a_coordinated_restore_takes_the_step_asked_for_or_names_what_is_missing(
        tmp_path: Path):
    with mpickpt.Checkpointer(tmp_path) as ck:
        for s in (1, 2):
            assert ck.save(s, state(s)).wait().committed
        listed = rootstart.listing(str(tmp_path), LOG, local=False)
        fresh = state(0)
        info, manifest = coordinate.restore(
            ck._proto, ck._pool, fresh, str(tmp_path), listed, None, LOG, step=None, upto=1,
            io_threads=2, replicated=(), world_change="reshard")
        assert info.step == 1 and manifest is not None and manifest.step == 1
        assert torch.equal(fresh["w"], state(1)["w"]) and fresh["step"] == 1
        with pytest.raises(CheckpointError, match=f"no checkpoint of step 9 under {tmp_path}"):
            coordinate.restore(ck._proto, ck._pool, fresh, str(tmp_path), listed, None, LOG,
                               step=9, upto=None, io_threads=2, replicated=(),
                               world_change="reshard")


@pytest.mark.parametrize("kw", [{"step": "2"}, {"upto": "2"}, {"step": True}, {"upto": -1},
                                {"step": 2.0}])
def test_restore_takes_step_numbers_only(tmp_path: Path, kw):
    """step="2" said 'no checkpoint of step 2' although step 2 was there; upto="2" raised a bare
    TypeError from deep inside."""
    with mpickpt.Checkpointer(tmp_path) as ck:
        assert ck.save(2, state(2)).wait().committed
        name = next(iter(kw))
        with pytest.raises(ValueError, match=rf"restore\({name}=\.\.\.\) takes a step number"):
            ck.restore(state(0), **kw)
        assert ck.restore(fresh := state(0), step=2) == 2 and fresh["step"] == 2


def test_shard_options_say_when_a_manifest_is_version_3():
    from mpickpt.save.shards import ShardOptions

    assert not ShardOptions().extended(4)
    assert ShardOptions(per_node=True).extended(2)
    assert ShardOptions(incremental=3).extended(1)
    assert ShardOptions(fanout=2).extended(3)  # sub-directories in ROOT
    assert not ShardOptions(fanout=2).extended(0)  # the node-local level's: flat, per rank


def test_frozen_names_match_whole_key_paths_only():
    from mpickpt.save.incremental import frozen_matcher

    match = frozen_matcher(["model/base", "/embed/"])
    assert match is not None
    assert [n for n in ("model/base", "model/base/w", "model/base.weight", "embed.w",
                        "model/based", "model/bas", "lora/model/base") if match(n)] == [
        "model/base", "model/base/w", "model/base.weight", "embed.w"]
    assert frozen_matcher([]) is None and frozen_matcher(None) is None


def test_metadata_is_checked_on_the_training_thread_and_named_where_it_fails():
    from mpickpt.save import metadata

    got = metadata.resolve(metadata.check({"loss": torch.tensor(0.5), "tags": ["a", 1]}))
    assert got == {"loss": 0.5, "tags": ["a", 1]}
    with pytest.raises(mpickpt.MetadataError, match="'bad'"):
        metadata.check({"ok": 1, "bad": object()})


def test_an_aborted_save_raises_from_its_handle_with_on_error_raise(tmp_path: Path, no_faults):
    from mpickpt.save.request import SaveHandle

    faults.configure("mid-write:0:raise")
    with mpickpt.Checkpointer(tmp_path, on_error="raise") as ck:
        handle = ck.save(1, state(1))
        assert isinstance(handle, SaveHandle)
        with pytest.raises(mpickpt.SaveAborted, match="checkpoint of step 1 aborted: rank 0: "):
            handle.wait()
        faults.configure("")
        assert ck.save(2, state(2)).wait().committed  # the next one, once the fault is gone


def test_the_root_check_passes_on_one_directory_and_leaves_nothing_behind(tmp_path: Path):
    from mpickpt.mpi.protocol import Protocol
    from mpickpt.save import shared_root

    proto = Protocol(None, timeout=30)
    try:
        shared_root.check(proto, str(tmp_path), "run1", LOG)
    finally:
        proto.free()
    assert os.listdir(tmp_path) == []


def test_the_node_level_refuses_a_checkpoint_beyond_its_budget_before_writing(tmp_path: Path):
    """local/level.py: the first save votes on the node's room; a budget that cannot hold the
    kept checkpoints and the one being written aborts it on every rank and raises, naming the
    budget; nothing is written on the node. A budget that holds them is taken, however small
    the shards (a bound of each file, not 1 MiB a file and 1 MiB a tensor), and holds them."""
    local = mpickpt.Local(tmp_path / "local", budget=100_000)
    with mpickpt.Checkpointer(tmp_path / "root", local=local) as ck:
        with pytest.raises(mpickpt.LocalTierFull, match=r"Local\(budget=100000\)"):
            ck.save(1, state(1))
        assert ck._local.nodedir.committed() == []
    budget = 300_000  # keep 1 and the one being written: two shards of 16 kB and their metadata
    local = mpickpt.Local(tmp_path / "local2", budget=budget)
    with mpickpt.Checkpointer(tmp_path / "root2", local=local) as ck:
        for step in (1, 2, 3):
            assert ck.save(step, state(step)).wait().committed
            used = sum(os.path.getsize(os.path.join(d, f))
                       for d, _, files in os.walk(tmp_path / "local2") for f in files)
            assert used <= budget, used


def test_a_node_directory_belongs_to_one_root_and_keeps_the_newest(tmp_path: Path):
    from mpickpt.local.nodedir import NodeDir, node_dirname

    assert node_dirname("gpu-01.cluster") == "gpu-01.cluster"
    assert node_dirname("a/b c") == "a_b_c" and node_dirname(".hidden") == "_.hidden"
    mine = NodeDir(str(tmp_path / "L"), "n0", str(tmp_path / "rootA"))
    mine.prepare("run1", LOG)
    with pytest.raises(ValueError, match="holds the checkpoints of ROOT"):
        NodeDir(str(tmp_path / "L"), "n0", str(tmp_path / "rootB")).prepare("run2", LOG)
    for step in (1, 2, 3):
        partial = mine.partial(step, "run1")
        os.makedirs(partial)
        mine.publish(partial, step, b"{}", b"{}")
    assert mine.committed() == [3, 2, 1]
    assert mine.retain(2, "run1", newest=1) == [2]  # a rerun saved a lower step: it stays
    assert mine.committed() == [3, 1]


def test_assembly_makes_no_level_without_local_and_the_root_store_first(tmp_path: Path):
    from mpickpt import assembly
    from mpickpt.options import gather

    with mpickpt.Checkpointer(tmp_path) as ck:
        o = gather(None, "per-rank", None, None, None, True, {})
        assert assembly.local_level(ck._proto, o, str(tmp_path), ck.run_id, None, 2,
                                    LOG) == (None, None)
        assert isinstance(ck._pipeline.store, RootStore)


def test_a_state_saved_again_with_values_only_equal_to_the_last_is_stored_as_it_is_now(
        tmp_path: Path) -> None:
    """The writer and rank 0 reuse the last save's JSON of a tree that is the same value; a
    value == takes as the same (0.0 and -0.0; the keys 1 and True) is not: the shard's
    attribute and the manifest hold what the second save was given."""
    t = torch.arange(4.0)
    with mpickpt.Checkpointer(str(tmp_path), keep=3) as ck:
        ck.save(1, {"t": t, "x": 0.0, "d": {1: "a"}}).wait()
        ck.save(2, {"t": t, "x": -0.0, "d": {True: "a"}}).wait()
    step = tmp_path / "step-00000002"
    m = Manifest.read(str(step))
    with h5py.File(step / m.ranks[0].file, "r") as f:
        attr = json.loads(f.attrs["tree"])
    for tree in (m.ranks[0].tree, attr):
        items = dict((k, v) for k, v in tree["items"])
        assert repr(items["x"]["value"]) == "-0.0"
        [[key, _]] = items["d"]["items"]
        assert key is True
