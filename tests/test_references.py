"""Incremental checkpoints in one process: the manifest's rules for references (hostile ones
refused, naming what is wrong), the options refused at once, a referred-to step never replaced,
a missing base file making the next save full."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import xxhash

import mpickpt
from mpickpt.errors import ManifestError
from mpickpt.format.manifest import CHECKSUM_FIELD, Manifest, read_bytes

pytestmark = pytest.mark.guarantee("incremental")


def state(step: int) -> dict:
    torch.manual_seed(0)
    frozen = torch.randn(128, 64)
    return {"frozen": frozen, "lora": torch.full((8, 8), float(step)), "step": step}


def train(root: Path, steps, **kw) -> list[mpickpt.SaveResult]:
    out = []
    enc = mpickpt.Encoding(incremental=kw.pop("incremental", 3), frozen=kw.pop("frozen", None))
    with mpickpt.Checkpointer(root, encoding=enc,
                              files=mpickpt.Files(alignment=4096, checksum_block=4096), **kw) as ck:
        for s in steps:
            out.append(ck.save(s, state(s)).wait())
    return out


def load(root: Path, step: int | None = None) -> tuple[int | None, dict, mpickpt.RestoreInfo]:
    fresh = {"frozen": torch.zeros(128, 64), "lora": torch.zeros(8, 8), "step": -1}
    with mpickpt.Checkpointer(root) as ck:
        got = ck.restore(fresh, step=step)
        assert ck.restore_info is not None
        return got, fresh, ck.restore_info


def raw(root: Path, step: int) -> dict:
    return json.loads((root / f"step-{step:08d}" / "MANIFEST.json").read_text())


def reseal(d: dict) -> str:
    body = {k: v for k, v in d.items() if k != CHECKSUM_FIELD}
    d[CHECKSUM_FIELD] = xxhash.xxh3_64_hexdigest(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps(d)


def test_an_incremental_save_writes_only_what_changed(tmp_path: Path):
    results = train(tmp_path, [1, 2, 3, 4])
    reused = [r.stats["reused_bytes"] for r in results]
    assert reused == [0, 128 * 64 * 4, 128 * 64 * 4, 0]  # full every 3rd
    assert results[1].stats["bytes"] < results[0].stats["bytes"] / 2
    d = raw(tmp_path, 3)
    assert d["version"] == 3 and d["references"] == [1]
    first = tmp_path / "step-00000001" / "rank-00000.h5"
    assert d["ranks"][0]["sources"] == {"step-00000001/rank-00000.h5": first.stat().st_size}
    got, fresh, _ = load(tmp_path, 3)
    assert got == 3 and torch.equal(fresh["frozen"], state(3)["frozen"]) and fresh["step"] == 3
    assert torch.equal(fresh["lora"], state(3)["lora"])


@pytest.mark.parametrize(("edit", "why"), [
    (lambda d: d["ranks"][0]["sources"].update({"../../etc/rank-00000.h5": 1}),
     "is not step-XXXXXXXX/rank-XXXXX.h5"),
    (lambda d: d["ranks"][0]["sources"].update({"/abs/step-00000001/rank-00000.h5": 1}),
     "is not step-XXXXXXXX/rank-XXXXX.h5"),
    (lambda d: d["ranks"][0]["tensors"][0].update(source="step-00000001/rank-00009.h5"),
     "is not among the rank's sources"),
    (lambda d: d.update(references=[1, 2]), "are not the steps the ranks refer to"),
    (lambda d: d.update(references=[3]), "must be older steps than 3"),
    (lambda d: d.update(references=[]), "which the manifest does not list"),
    (lambda d: d.update(version=1), "in a manifest of version 1"),
    (lambda d: d["ranks"][0]["sources"].update({"step-00000001/rank-00000.h5": -5}),
     "has size -5"),
])
def test_hostile_references_are_refused_naming_what_is_wrong(tmp_path: Path, edit, why):
    train(tmp_path, [1, 2, 3])
    d = raw(tmp_path, 3)
    edit(d)
    with pytest.raises(ManifestError, match=why):
        Manifest.from_json(reseal(d), "M")


def test_a_reference_to_a_missing_file_falls_back_naming_it(tmp_path: Path):
    train(tmp_path, [1, 2, 3], incremental=5)
    gone = tmp_path / "step-00000001" / "rank-00000.h5"
    os.unlink(gone)
    got, _, info = load(tmp_path)
    assert got is None, info.skipped  # all three need step 1's shard
    assert [s for s, _ in info.skipped] == [3, 2, 1]
    assert all(str(gone) in why for _, why in info.skipped), info.skipped


def test_a_missing_base_file_makes_the_next_save_full(tmp_path: Path, caplog):
    with mpickpt.Checkpointer(tmp_path, encoding=mpickpt.Encoding(incremental=5),
                              files=mpickpt.Files(alignment=4096)) as ck:
        assert ck.save(1, state(1)).wait().committed
        os.truncate(tmp_path / "step-00000001" / "rank-00000.h5", 10)
        r = ck.save(2, state(2)).wait()
    assert r.committed and r.stats["reused_bytes"] == 0
    assert "written in full" in caplog.text and "step-00000001/rank-00000.h5 has 10 bytes" \
        in caplog.text
    assert raw(tmp_path, 2)["references"] == []  # version 3, referring to nothing
    got, _, _ = load(tmp_path)
    assert got == 2


def test_saving_a_referred_to_step_again_is_refused(tmp_path: Path):
    train(tmp_path, [1, 2, 3])
    before = (tmp_path / "step-00000001" / "rank-00000.h5").read_bytes()
    with mpickpt.Checkpointer(tmp_path, encoding=mpickpt.Encoding(incremental=3)) as ck:
        r = ck.save(1, state(1)).wait()
    assert not r.committed and "step 1 is already committed" in r.error
    assert "of step 2, 3 refer to its files" in r.error, r.error
    assert (tmp_path / "step-00000001" / "rank-00000.h5").read_bytes() == before
    assert load(tmp_path)[0] == 3


def test_options_that_cannot_work_are_refused_at_once(tmp_path: Path):
    with pytest.raises(ValueError, match="at least 2"):
        mpickpt.Checkpointer(tmp_path, encoding=mpickpt.Encoding(incremental=1))
    with pytest.raises(ValueError, match="give incremental=N too"):
        mpickpt.Checkpointer(tmp_path, encoding=mpickpt.Encoding(frozen=["model"]))
    with pytest.raises(ValueError, match="local= drains whole shards"):
        mpickpt.Checkpointer(tmp_path, local=tmp_path / "local",
                             encoding=mpickpt.Encoding(incremental=4))
    with pytest.raises(TypeError, match="not one string"):
        mpickpt.Checkpointer(tmp_path, encoding=mpickpt.Encoding(incremental=4, frozen="model"))


def test_frozen_params_names_the_parameters_that_do_not_require_grad():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    m[0].requires_grad_(False)
    assert mpickpt.frozen_params(m) == ["model/0.weight", "model/0.bias"]
    assert mpickpt.frozen_params(m, "") == ["0.weight", "0.bias"]


def test_version_1_manifests_still_load(tmp_path: Path):
    with mpickpt.Checkpointer(tmp_path) as ck:  # neither incremental nor compressed: version 1
        assert ck.save(1, state(1)).wait().committed
    assert raw(tmp_path, 1)["version"] == 1 and "references" not in raw(tmp_path, 1)
    m = Manifest.from_json(read_bytes(str(tmp_path / "step-00000001")), "M")
    assert m.references == [] and m.ranks[0].sources == {}


def test_a_restarted_job_refers_to_the_checkpoint_it_restored(tmp_path: Path):
    """incremental=3: steps 1 (full) and 2; a new job restores 2, whose two files (its own and
    step 1's) count towards the next full save; its save of step 3 refers to step 1's frozen
    tensor, and the one after that is full."""
    train(tmp_path, [1, 2])
    with mpickpt.Checkpointer(tmp_path, encoding=mpickpt.Encoding(incremental=3),
                              files=mpickpt.Files(alignment=4096, checksum_block=4096)) as ck:
        fresh = {"frozen": torch.zeros(128, 64), "lora": torch.zeros(8, 8), "step": -1}
        assert ck.restore(fresh) == 2
        r3 = ck.save(3, state(3)).wait()
        r4 = ck.save(4, state(4)).wait()
    assert r3.stats["reused_bytes"] == 128 * 64 * 4 and raw(tmp_path, 3)["references"] == [1]
    assert r4.stats["reused_bytes"] == 0  # files 1, 2 and 3 reached incremental=3
    got, fresh, _ = load(tmp_path, 3)
    assert got == 3 and torch.equal(fresh["frozen"], state(3)["frozen"])
    assert torch.equal(fresh["lora"], state(3)["lora"]) and fresh["step"] == 3


def test_declared_frozen_tensors_are_not_even_snapshotted(tmp_path: Path):
    """frozen=["frozen"], incremental=3: saves 2, 3, 5 and 6 neither copy nor hash it (it is
    referred to), saves 1 and 4 are full and write it; every step loads exactly."""
    results = train(tmp_path, [1, 2, 3, 4, 5, 6], frozen=["frozen"])
    nbytes = 128 * 64 * 4
    snap = [r.stats["snapshot_bytes"] for r in results]
    assert snap[0] == snap[3] > nbytes and all(snap[i] < nbytes for i in (1, 2, 4, 5)), snap
    assert [r.stats["reused_bytes"] for r in results] == [0, nbytes, nbytes, 0, nbytes, nbytes]
    assert all(r.stats["hashed_bytes"] < nbytes for r in results)
    assert raw(tmp_path, 6)["references"] == [4]
    for s in (3, 6):
        got, fresh, _ = load(tmp_path, s)
        assert got == s and torch.equal(fresh["frozen"], state(s)["frozen"])
        assert torch.equal(fresh["lora"], state(s)["lora"])


def test_tensors_that_keep_changing_stop_being_compared_for_a_while(tmp_path: Path):
    """A full fine-tune: every tensor changes at every save (so each save is in effect full).
    Saves 2 and 3 compare and find nothing to refer to, 4 writes without comparing; the 5th
    save (incremental=5) forgets that, so 5 and 6 compare again, and 7 and 8 do not."""
    with mpickpt.Checkpointer(tmp_path, encoding=mpickpt.Encoding(incremental=5),
                              files=mpickpt.Files(alignment=4096)) as ck:
        hashed = [ck.save(s, {"w": torch.full((64, 64), float(s))}).wait().stats["hashed_bytes"]
                  for s in range(1, 9)]
    n = 64 * 64 * 4
    assert hashed == [0, n, n, 0, n, n, 0, 0], hashed
    assert load_w(tmp_path) == 8


def load_w(root: Path) -> int | None:
    fresh = {"w": torch.zeros(64, 64)}
    with mpickpt.Checkpointer(root) as ck:
        got = ck.restore(fresh)
    assert torch.equal(fresh["w"], torch.full((64, 64), float(got)))
    return got
