"""mpickpt export: one torch.save file and one safetensors file, bit for bit what was saved."""

from __future__ import annotations

import sys

import pytest
import torch
from clikit import cli, cli_json, copy_tree, pristine
from harness import flip_data_byte, manifest, shard, step_dir

from mpickpt.cli import EXIT_DAMAGED, EXIT_ERROR, EXIT_OK
from mpickpt.format.manifest import Manifest
from mpickpt.format.reader import read_shard

try:
    import safetensors.torch as safetensors_torch
except ImportError:  # export then writes the torch file only; the safetensors checks skip
    safetensors_torch = None


def needs_safetensors() -> None:
    if safetensors_torch is None:
        pytest.skip("safetensors is not installed (pip install safetensors)")


def saved_tensors(root, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read by mpickpt.format.reader.read_shard, named as export
    does."""
    text = (step_dir(root, step) / "MANIFEST.json").read_text()
    m = Manifest.from_json(text, "test")
    out = {}
    for r in m.ranks:
        got = read_shard(r.rank, str(shard(root, step, r.rank)), r.tensors, r.bytes,
                         block=m.checksum_block)
        for name, t in got.items():
            out[(f"rank{r.rank}/" if m.world_size > 1 else "") + name] = t
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.contiguous().view(-1).view(torch.uint8).equal(
                b.contiguous().view(-1).view(torch.uint8)))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_export_equals_the_saved_tensors_bit_for_bit(tmp_path, tmp_path_factory, n):
    root = pristine(n, tmp_path_factory)
    target = tmp_path / ("model" if safetensors_torch is not None else "model.pt")
    code, doc = cli_json("export", root, target)
    assert code == EXIT_OK and doc["step"] == 20
    files = {o["format"]: o["path"] for o in doc["outputs"]}
    assert files["torch"] == str(tmp_path / "model.pt")
    want = saved_tensors(root, 20)
    assert doc["tensors"] == len(want)
    if n > 1:
        assert "rank0/model/0.weight" in want and f"rank{n - 1}/model/0.weight" in want
    else:
        assert "model/0.weight" in want
    from_torch = torch.load(files["torch"], weights_only=True)
    assert sorted(from_torch) == sorted(want)
    for k, t in want.items():
        assert same_bits(from_torch[k], t), k
    needs_safetensors()
    assert files["safetensors"] == str(tmp_path / "model.safetensors")
    from_st = safetensors_torch.load_file(files["safetensors"])
    assert sorted(from_st) == sorted(want)
    for k, t in want.items():
        assert same_bits(from_st[k], t), k
    with safetensors_torch.safe_open(files["safetensors"], "pt") as f:
        meta = f.metadata()
    assert meta["mpickpt_step"] == "20" and meta["mpickpt_world_size"] == str(n)
    assert "loss" in meta["mpickpt_metadata"]


@pytest.mark.quick
def test_export_one_format_a_step_and_no_overwrite(tmp_path, tmp_path_factory):
    root = pristine(2, tmp_path_factory)
    target = tmp_path / "m15.pt"
    code, doc = cli_json("export", root, target, "--step", "15")
    assert code == EXIT_OK and [o["format"] for o in doc["outputs"]] == ["torch"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m15.pt"]
    first = target.read_bytes()
    code, doc = cli_json("export", root, target)
    assert code == EXIT_ERROR and "--force" in doc["error"]
    assert target.read_bytes() == first
    code, doc = cli_json("export", step_dir(root, 20), target, "--force")
    assert code == EXIT_OK and doc["step"] == 20
    assert target.read_bytes() != first
    needs_safetensors()
    code, doc = cli_json("export", root, tmp_path / "only.safetensors")
    assert [o["format"] for o in doc["outputs"]] == ["safetensors"]
    assert manifest(root, 20)["step"] == 20


def test_export_of_a_damaged_checkpoint_writes_nothing(tmp_path, tmp_path_factory):
    root = copy_tree(2, tmp_path_factory, tmp_path / "ckpt")
    path, tensor = flip_data_byte(root, 20, rank=1)
    out = tmp_path / "out"
    out.mkdir()
    code, doc = cli_json("export", step_dir(root, 20), out / "model.pt")
    assert code == EXIT_DAMAGED
    assert str(path) in doc["error"] and f"tensor '{tensor}': checksum mismatch" in doc["error"]
    assert list(out.iterdir()) == []
    code, _, err = cli("export", step_dir(root, 20), out / "model.pt")
    assert "nothing was written" in err and "--verify full" in err


def test_export_creates_missing_parent_folders(tmp_path, tmp_path_factory):
    root = pristine(2, tmp_path_factory)
    target = tmp_path / "not" / "yet" / "there" / "model.pt"
    code, doc = cli_json("export", root, target)
    assert code == EXIT_OK, doc
    assert [o["path"] for o in doc["outputs"]] == [str(target)]
    loaded = torch.load(target, weights_only=True)
    assert "rank0/model/0.weight" in loaded
    assert oct(target.parent.stat().st_mode & 0o002) == "0o0"  # never world-writable


def test_export_without_safetensors_names_the_extra(tmp_path, tmp_path_factory, monkeypatch):
    """With safetensors not importable, export says which extra to install, writes nothing."""
    root = pristine(1, tmp_path_factory)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors: ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    code, doc = cli_json("export", root, tmp_path / "model")
    assert code == EXIT_ERROR
    assert "pip install 'mpickpt[export]'" in doc["error"] and ".pt" in doc["error"]
    assert list(tmp_path.iterdir()) == []
