"""mpickpt.format.rootdir: names, listing, atomic writes, removal."""

from __future__ import annotations

import os

import pytest

from mpickpt.format import rootdir


def test_listing_orders_newest_first_and_ignores_partials_and_links(tmp_path):
    """Committed: real directories with a manifest. Without require_manifest (what restore and
    the CLI list), also those without one and links, which they then report and refuse."""
    for step in (5, 100, 20):
        d = tmp_path / rootdir.step_name(step)
        d.mkdir()
        (d / "MANIFEST.json").write_text("{}")
    (tmp_path / rootdir.partial_name(200, "abc")).mkdir()
    (tmp_path / "step-00000300").mkdir()  # no manifest
    (tmp_path / "step-00000400").symlink_to(tmp_path / rootdir.step_name(5))
    assert [s for s, _ in rootdir.committed(str(tmp_path))] == [100, 20, 5]
    assert [s for s, _ in rootdir.committed(str(tmp_path), require_manifest=False)] == [
        400, 300, 100, 20, 5]


def test_leftovers_are_other_runs_partials_only(tmp_path):
    (tmp_path / rootdir.partial_name(1, "dead")).mkdir()
    (tmp_path / rootdir.partial_name(2, "mine")).mkdir()
    (tmp_path / "step-00000003.deleting-dead").mkdir()
    names = sorted(os.path.basename(p) for p in rootdir.leftovers(str(tmp_path), "mine"))
    assert names == ["step-00000001.partial-dead", "step-00000003.deleting-dead"]


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "MANIFEST.json"
    rootdir.atomic_write(str(p), b"one")
    rootdir.atomic_write(str(p), b"two")
    assert p.read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["MANIFEST.json"]


def test_remove_goes_through_a_deleting_name(tmp_path):
    d = tmp_path / rootdir.step_name(9)
    d.mkdir()
    (d / "x").write_text("x")
    rootdir.remove(str(d), "run")
    assert os.listdir(tmp_path) == []


def test_copy_file_copies_exactly_and_keeps_to_its_bandwidth(tmp_path):
    """The drain's copy: byte for byte, chunk by chunk, never faster than asked (the throttle
    sleeps until the bytes copied fit the rate), and never through a link."""
    import time

    src, dst = tmp_path / "src", tmp_path / "dst"
    data = os.urandom(3 * rootdir.COPY_CHUNK + 12345)
    src.write_bytes(data)
    seen: list[int] = []
    t0 = time.monotonic()
    assert rootdir.copy_file(str(src), str(dst), seen.append, bandwidth=len(data) / 0.5) == \
        len(data)
    assert time.monotonic() - t0 >= 0.5 * 0.99  # 0.5 s at the rate asked, at the least
    assert dst.read_bytes() == data and sum(seen) == len(data) and len(seen) >= 4
    (tmp_path / "link").symlink_to(src)
    with pytest.raises(OSError):
        rootdir.copy_file(str(tmp_path / "link"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
