"""Per-rank index parts (manifest version 2) in one process: written, read only when needed,
checked, and a damaged part makes the restore fall back, naming the part."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import mpickpt
from mpickpt.errors import ManifestError
from mpickpt.format import entry, manifest


def state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"w": torch.randn(64, 32), "b": torch.randn(32), "note": f"seed {seed}"}


def saved(root: Path, steps=(1, 2)) -> dict[int, dict]:
    out = {}
    with mpickpt.Checkpointer(root, files=mpickpt.Files(index="per-rank")) as ck:
        for s in steps:
            out[s] = state(s)
            assert ck.save(s, out[s]).wait().committed
    return out


def restore(root: Path) -> tuple[int | None, dict, mpickpt.RestoreInfo]:
    fresh = {"w": torch.zeros(64, 32), "b": torch.zeros(32), "note": ""}
    with mpickpt.Checkpointer(root) as ck:
        step = ck.restore(fresh)
        info = ck.restore_info
    assert info is not None
    return step, fresh, info


def test_the_manifest_names_the_part_by_size_and_checksum(tmp_path):
    saved(tmp_path, steps=(1,))
    step = tmp_path / "step-00000001"
    m = json.loads((step / "MANIFEST.json").read_text())
    assert m["version"] == 2 and "tensors" not in m["ranks"][0]
    part = (step / "index" / "rank-00000.json").read_bytes()
    assert m["ranks"][0]["index"] == {"file": "index/rank-00000.json", "bytes": len(part),
                                      "xxh3": mpickpt.format.checksum.digest(part)}
    parsed = manifest.Manifest.from_json((step / "MANIFEST.json").read_text(),
                                         str(step / "MANIFEST.json"))
    before = entry.parts_read()
    assert not parsed.ranks[0].loaded
    assert {r.name for r in parsed.ranks[0].tensors} == {"w", "b"}
    assert parsed.ranks[0].tree == json.loads(part)["tree"]
    assert entry.parts_read() == before + 1  # once, then kept


def test_the_newest_part_is_read_and_restored(tmp_path):
    values = saved(tmp_path)
    step, got, info = restore(tmp_path)
    assert step == 2 and not info.skipped
    assert torch.equal(got["w"], values[2]["w"]) and got["note"] == "seed 2"


@pytest.mark.guarantee("damage-detected")
@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(p.read_bytes().replace(b'"w"', b'"v"')), "checksum mismatch"),
    (lambda p: p.write_bytes(p.read_bytes()[:-5]), "truncated or replaced"),
    (lambda p: p.unlink(), "cannot open the index part"),
    (lambda p: (p.unlink(), os.symlink("/etc/hostname", p)), "cannot open the index part"),
], ids=["flipped", "truncated", "missing", "symlink"])
def test_a_damaged_part_falls_back_to_the_previous_checkpoint_naming_it(tmp_path, damage,
                                                                       words):
    values = saved(tmp_path)
    part = tmp_path / "step-00000002" / "index" / "rank-00000.json"
    damage(part)
    step, got, info = restore(tmp_path)
    assert step == 1 and torch.equal(got["w"], values[1]["w"]) and got["note"] == "seed 1"
    assert [s for s, _ in info.skipped] == [2]
    assert str(part) in info.skipped[0][1] and words in info.skipped[0][1], info.skipped


def test_a_part_of_another_rank_or_shard_is_refused(tmp_path):
    saved(tmp_path, steps=(1,))
    step = tmp_path / "step-00000001"
    text = (step / "MANIFEST.json").read_text()
    part = step / "index" / "rank-00000.json"
    d = json.loads(part.read_text())
    d["bytes"] += 1
    data = json.dumps(d).encode()
    part.write_bytes(data)
    m = json.loads(text)
    m["ranks"][0]["index"].update(bytes=len(data), xxh3=mpickpt.format.checksum.digest(data))
    del m["manifest_checksum"]
    m["manifest_checksum"] = manifest._digest(m)
    parsed = manifest.Manifest.from_json(json.dumps(m), str(step / "MANIFEST.json"))
    with pytest.raises(ManifestError, match=r"says rank-00000\.h5 has"):
        _ = parsed.ranks[0].tensors


def test_cli_verify_checks_the_parts(tmp_path, capsys):
    from mpickpt.cli.main import main

    saved(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    part = tmp_path / "step-00000002" / "index" / "rank-00000.json"
    part.write_bytes(part.read_bytes().replace(b'"b"', b'"c"'))
    assert main(["verify", str(tmp_path)]) != 0
    assert "rank-00000.json" in capsys.readouterr().out
