"""mpickpt inspect: tensors and metadata of one checkpoint, from its manifest."""

from __future__ import annotations

import pytest
from clikit import cli, cli_json, copy_tree, garble_manifest, pristine
from harness import manifest, shard, step_dir

from mpickpt.cli import EXIT_DAMAGED, EXIT_ERROR, EXIT_OK


@pytest.mark.parametrize("n", [1, 2, 4])
def test_inspect_shows_the_manifest_of_every_rank(tmp_path_factory, n):
    root = pristine(n, tmp_path_factory)
    m = manifest(root, 20)
    code, doc = cli_json("inspect", root, "--all")
    assert code == EXIT_OK and doc["step"] == 20 and doc["path"] == str(step_dir(root, 20))
    assert doc["world_size"] == n and doc["metadata"] == m["metadata"]
    assert "loss" in doc["metadata"]
    assert [r["rank"] for r in doc["ranks"]] == list(range(n))
    for r, entry in enumerate(m["ranks"]):
        got = doc["ranks"][r]
        assert got["file"] == f"rank-{r:05d}.h5" and got["bytes"] == entry["bytes"]
        assert got["tensors"] == [{k: t[k] for k in ("name", "dtype", "shape", "nbytes",
                                                     "offset", "checksums", "global_shape",
                                                     "offsets")}
                                  for t in entry["tensors"]]
        assert "tree" not in got


def test_inspect_one_rank_by_path_and_step(tmp_path_factory):
    root = pristine(4, tmp_path_factory)
    code, doc = cli_json("inspect", step_dir(root, 15), "--rank", "3", "--tree")
    assert code == EXIT_OK and doc["step"] == 15
    assert [r["rank"] for r in doc["ranks"]] == [3]
    assert doc["ranks"][0]["tree"]["type"] == "dict"
    assert cli_json("inspect", root, "--step", "10")[1]["step"] == 10
    code, out, _ = cli("inspect", root, "--step", "10")
    assert code == EXIT_OK
    assert "model/0.weight" in out and "float32" in out and "[64, 32]" in out
    assert "metadata" in out and "loss" in out and "--all for every rank" in out
    code, doc = cli_json("inspect", root, "--rank", "4")
    assert code == EXIT_ERROR and "ranks 0..3" in doc["error"]
    code, doc = cli_json("inspect", root, "--step", "11")
    assert code == EXIT_ERROR and "no committed checkpoint of step 11" in doc["error"]


@pytest.mark.quick
def test_inspect_damaged(tmp_path, tmp_path_factory):
    root = copy_tree(2, tmp_path_factory, tmp_path / "ckpt")
    shard(root, 20, 1).unlink()
    code, doc = cli_json("inspect", step_dir(root, 20))
    assert code == EXIT_DAMAGED and doc["status"] == "corrupt"
    assert doc["problems"][0]["rank"] == 1 and doc["ranks"]  # the manifest is still shown
    # ROOT alone: the newest that passes the quick check
    assert cli_json("inspect", root)[1]["step"] == 15
    garble_manifest(root, 15)
    code, doc = cli_json("inspect", step_dir(root, 15))
    assert code == EXIT_DAMAGED and doc["ranks"] == [] and doc["metadata"] is None
    code, out, _ = cli("inspect", step_dir(root, 15))
    assert "not valid JSON" in out and "nothing more to show" in out


def test_inspect_tree_is_an_indented_outline_and_raw_json_with_json(tmp_path_factory):
    root = pristine(2, tmp_path_factory)
    m = manifest(root, 20)
    code, out, _ = cli("inspect", root, "--tree")
    assert code == EXIT_OK
    tree = out[out.index("  state tree:\n"):].splitlines()[1:]
    assert "{" not in "\n".join(tree) and '"type"' not in out  # no raw JSON for a person
    lines = [x.rstrip() for x in tree]
    # key paths by indentation, types, tensor dtype and shape from the manifest, scalar values
    assert "    model: torch.nn.modules.container.Sequential (state_dict)" in lines
    assert "      0.weight: tensor float32 [64, 32]" in lines
    assert "    optim: torch.optim.adam.Adam (state_dict)" in lines
    assert "        0: dict, 3 items" in lines
    assert "          step: tensor float32 []" in lines
    assert "          betas: (0.9, 0.999)" in lines
    assert "          amsgrad: False" in lines and "          foreach: None" in lines
    lr = next(x for x in lines if x.startswith("          lr: "))
    groups = dict(dict(m["ranks"][0]["tree"]["items"])["optim"]["state"]["items"])
    want_lr = dict(groups["param_groups"]["items"][0]["items"])["lr"]["value"]
    assert float(lr.split(": ")[1]) == want_lr
    assert "    data: torch.Generator (cpu)" in lines
    # --json keeps the raw tree, exactly the manifest's
    code, doc = cli_json("inspect", root, "--tree")
    assert doc["ranks"][0]["tree"] == m["ranks"][0]["tree"]
