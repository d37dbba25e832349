"""mpickpt stats: stats.jsonl as a table, JSON and a PNG timeline."""

from __future__ import annotations

import json
import shutil

import numpy as np
from clikit import cli, cli_json, pristine

from mpickpt.cli import EXIT_ERROR, EXIT_OK


def test_stats_table_json_and_plot(tmp_path, tmp_path_factory):
    root = tmp_path / "ckpt"
    shutil.copytree(pristine(2, tmp_path_factory), root)
    lines = (root / "stats.jsonl").read_text().splitlines()
    with open(root / "stats.jsonl", "a") as f:
        f.write('{"step": 30, "time": 17')  # a line cut short by a crash
    png = tmp_path / "timeline.png"
    code, doc = cli_json("stats", root, "--plot", png)
    assert code == EXIT_OK
    assert [r["step"] for r in doc["records"]] == [5, 10, 15, 20]
    assert doc["records"] == sorted((json.loads(x) for x in lines), key=lambda r: r["time"])
    assert doc["skipped_lines"] == [len(lines) + 1] and doc["plot"] == str(png)
    for key in ("stall_s", "persist_s", "persist_GBps", "commit_s", "bytes"):
        assert all(key in r for r in doc["records"]), key

    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert img.shape[0] >= 400 and img.shape[1] >= 600, img.shape
    rgb = img[..., :3]
    assert np.unique(rgb.reshape(-1, 3), axis=0).shape[0] > 10  # not blank: lines, text, axes
    assert (np.abs(rgb - rgb[0, 0]).sum(axis=-1) > 0.1).mean() > 0.01

    code, out, _ = cli("stats", root)
    assert code == EXIT_OK
    assert "STALL" in out and "RANK 0 GB/s" in out and "skipped line(s)" in out


def test_stats_without_a_file(tmp_path):
    code, doc = cli_json("stats", tmp_path)
    assert code == EXIT_ERROR and "stats.jsonl: cannot read" in doc["error"]


def test_stats_reads_the_rotated_file_too(tmp_path, tmp_path_factory):
    """Once the Checkpointer has rotated stats.jsonl to stats.jsonl.1, both are shown, in order."""
    root = tmp_path / "ckpt"
    shutil.copytree(pristine(2, tmp_path_factory), root)
    lines = (root / "stats.jsonl").read_text().splitlines()
    (root / "stats.jsonl.1").write_text("\n".join(lines[:2]) + "\n")
    (root / "stats.jsonl").write_text("\n".join(lines[2:]) + "\n")
    code, doc = cli_json("stats", root)
    assert code == EXIT_OK
    assert [r["step"] for r in doc["records"]] == [5, 10, 15, 20]
