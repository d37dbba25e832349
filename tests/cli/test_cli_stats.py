"""mpickpt stats: stats.jsonl as a table, JSON and a PNG timeline."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
from clikit import cli, cli_json, pristine

from mpickpt.cli import EXIT_ERROR, EXIT_OK


@pytest.mark.quick
def test_stats_table_json_and_plot(tmp_path, tmp_path_factory):
    root = tmp_path / "ckpt"
    shutil.copytree(pristine(2, tmp_path_factory), root)
    lines = (root / "stats.jsonl").read_text().splitlines()
    with open(root / "stats.jsonl", "a") as f:
        f.write('{"step": 30, "time": 17')  # a line cut short by a crash
    png = tmp_path / "plots" / "new" / "timeline.png"  # its folder is made
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


def _with_gap(root, tmp_path):
    """A stats.jsonl of the tree's real records, re-timed: ten commits 10 min apart, the job
    down for 3 hours, then five more 10 min apart."""
    rec = json.loads((root / "stats.jsonl").read_text().splitlines()[0])
    t0, out = 1_700_000_000.0, []
    for i in range(15):
        t = t0 + i * 600 + (3 * 3600 if i >= 10 else 0)
        out.append({**rec, "step": 100 * (i + 1), "time": t,
                    "stall_s": 0.001 * (i + 1), "persist_GBps": 0.5 + i / 100})
    gap_root = tmp_path / "gap"
    gap_root.mkdir()
    (gap_root / "stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))
    return gap_root, out


def test_stats_plot_has_one_time_unit_and_breaks_at_a_gap(tmp_path, tmp_path_factory):
    root, recs = _with_gap(pristine(2, tmp_path_factory), tmp_path)
    png = tmp_path / "t.png"
    code, doc = cli_json("stats", root, "--plot", png)
    assert code == EXIT_OK and png.read_bytes()[:4] == b"\x89PNG"
    assert doc["gaps"] == [{"after_step": 1000, "before_step": 1100, "seconds": 3 * 3600 + 600}]
    code, out, _ = cli("stats", root)
    assert "(3 h 10 min gap)" in out

    from mpickpt.cli import stats

    fig = stats.figure(recs, "t")
    try:
        stall_ax, gbps_ax = fig.axes
        assert gbps_ax.get_xlabel().startswith("hours since the first commit")
        for ax, key, scale in ((stall_ax, "stall_s", 1e3), (gbps_ax, "persist_GBps", 1.0)):
            line = ax.get_lines()[0]
            x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
            want_x = [(r["time"] - recs[0]["time"]) / 3600 for r in recs]
            assert len(x) == len(recs) + 1 and np.isnan(x[10]) and np.isnan(y[10])
            assert np.allclose(np.delete(x, 10), want_x)  # one unit: hours since the first
            assert np.allclose(np.delete(y, 10), [r[key] * scale for r in recs])
            # no segment joins two finite points across the gap
            finite = ~np.isnan(x)
            joined = finite[:-1] & finite[1:]
            assert np.diff(x)[joined].max() < 0.2  # 10 min, not 3 h
            spans = [p.get_x() for p in ax.patches]  # the shaded gap
            assert len(spans) == 1 and np.isclose(spans[0], want_x[9])
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_stats_plot_without_matplotlib_names_the_extra(tmp_path, tmp_path_factory,
                                                       monkeypatch):
    root = pristine(2, tmp_path_factory)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    code, doc = cli_json("stats", root, "--plot", tmp_path / "t.png")
    assert code == EXIT_ERROR and "pip install 'mpickpt[plot]'" in doc["error"]
    assert not (tmp_path / "t.png").exists()
