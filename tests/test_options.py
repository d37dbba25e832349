"""Grouped options (mpickpt/options.py): ``Local(...)`` checks its own combinations, a bare path
is ``Local(path)``, and the flat keywords of earlier releases still work, with a deprecation
warning that says what to write (a real Checkpointer, one rank, real files)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import mpickpt
from mpickpt.options import UNSET, local_of

FLAT = dict.fromkeys(("redundancy", "persist_every", "keep_local", "local_budget", "xor_set",
                      "drain_bandwidth"), UNSET)


@pytest.mark.parametrize(("given", "words"), [
    ({"redundancy": "raid"}, "Local(redundancy=) must be 'partner', 'xor' or None"),
    ({"keep": 0}, "Local(keep=) must be 1 or more"),
    ({"persist_every": 0}, "Local(persist_every=) must be a positive int or None"),
    ({"budget": -5}, "Local(budget=) must be a positive number of bytes"),
    ({"xor_set": 3}, "sizes the parity sets of redundancy='xor', not of redundancy=None"),
    ({"redundancy": "xor", "xor_set": 1}, "Local(xor_set=) must be 2 nodes or more"),
    ({"drain_bandwidth": 0}, "Local(drain_bandwidth=) must be bytes per second > 0"),
])
def test_local_refuses_a_setting_or_a_combination_that_cannot_work(tmp_path, given, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        mpickpt.Local(tmp_path, **given)


def test_a_bare_path_is_local_with_every_default_and_no_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert local_of(str(tmp_path), FLAT) == mpickpt.Local(str(tmp_path))
        assert local_of(None, FLAT) is None
    level = mpickpt.Local(tmp_path)
    assert (level.redundancy, level.persist_every, level.keep) == (None, 10, 1)


def test_flat_keywords_still_work_and_say_what_to_write_instead(tmp_path):
    flat = {**FLAT, "redundancy": "xor", "keep_local": 2, "xor_set": 3}
    with pytest.warns(DeprecationWarning) as seen:
        level = local_of(str(tmp_path), flat)
    assert level == mpickpt.Local(str(tmp_path), redundancy="xor", keep=2, xor_set=3)
    said = str(seen[0].message)
    assert "redundancy=, keep_local=, xor_set=" in said
    assert f"local=mpickpt.Local({str(tmp_path)!r}, redundancy='xor', keep=2, xor_set=3)" in said


def test_settings_given_twice_or_without_a_level_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"in Local\(\.\.\.\) only.*\(persist_every\)"):
        local_of(mpickpt.Local(tmp_path), {**FLAT, "persist_every": 5})
    with pytest.raises(ValueError, match="redundancy protects the node-local level"):
        local_of(None, {**FLAT, "redundancy": "partner"})


def test_a_checkpointer_with_the_old_keywords_keeps_its_level_on_the_node(tmp_path):
    """``persist_every=None`` given flat: the save is protected on the node, nothing reaches
    ROOT until close() drains the newest, as with ``Local(path, persist_every=None)``."""
    state = {"w": torch.arange(8.0)}
    with pytest.warns(DeprecationWarning, match="persist_every=") as seen:
        ck = mpickpt.Checkpointer(tmp_path / "root", local=tmp_path / "local",
                                  persist_every=None)
    assert seen[0].filename == __file__  # the warning points at the caller's line
    with ck:
        result = ck.save(3, state).wait()
        assert result.committed and result.level == "local"
        assert not (tmp_path / "root" / "step-00000003").exists()
    assert (tmp_path / "root" / "step-00000003" / "MANIFEST.json").exists()  # the close drain
    with mpickpt.Checkpointer(tmp_path / "root", local=mpickpt.Local(tmp_path / "local")) as ck:
        fresh = {"w": torch.zeros(8)}
        assert ck.restore(fresh) == 3 and torch.equal(fresh["w"], state["w"])


def test_an_unknown_keyword_is_still_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'redundnacy'"):
        mpickpt.Checkpointer(tmp_path, local=tmp_path / "local", redundnacy="partner")
    assert not (tmp_path / "local").exists()  # refused before anything was made


def test_files_checks_its_settings_and_the_flat_keywords_say_what_to_write(tmp_path):
    from mpickpt.options import files_of

    for given, words in (({"per": "host"}, "Files(per=) must be 'rank' or 'node'"),
                         ({"fanout": 0}, "Files(fanout=) must be a positive int"),
                         ({"index": "split"}, "Files(index=) must be 'auto', 'inline'")):
        with pytest.raises(ValueError, match=re.escape(words)):
            mpickpt.Files(**given)
    assert files_of("per-node", {"fanout": UNSET, "index": UNSET}) == mpickpt.Files(per="node")
    with pytest.raises(ValueError, match="'per-rank' or 'per-node'"):
        files_of("per-host", {"fanout": UNSET, "index": UNSET})
    with pytest.warns(DeprecationWarning) as seen:
        layout = files_of("per-node", {"fanout": 8, "index": UNSET})
    assert layout == mpickpt.Files(per="node", fanout=8)
    assert "files=mpickpt.Files(per='node', fanout=8)" in str(seen[0].message)
    with pytest.raises(ValueError, match=r"in Files\(\.\.\.\) only"):
        files_of(mpickpt.Files(), {"fanout": UNSET, "index": "inline"})


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"encoding": mpickpt.Encoding(incremental=5), "local": "L"},
     "incremental checkpoints are written to ROOT only"),
    ({"encoding": mpickpt.Encoding(compression="zstd"), "local": "L"},
     "compression is written to ROOT only"),
    ({"files": mpickpt.Files(per="node"), "local": "L"}, "is for ROOT"),
    ({"files": "per-node", "encoding": mpickpt.Encoding(compression="zstd")},
     "writes raw regions"),
    ({"frozen": ["model"]}, "give incremental=N too"),  # a flat keyword, refused alike
])
def test_options_that_cannot_go_together_are_refused_before_anything_is_made(
        tmp_path, kwargs, words):
    if "local" in kwargs:
        kwargs = {**kwargs, "local": tmp_path / kwargs["local"]}
    with pytest.raises(ValueError, match=words):
        mpickpt.Checkpointer(tmp_path / "root", **kwargs)
    assert not (tmp_path / "root").exists() and not (tmp_path / "L").exists()


def test_retention_checks_its_rules_and_the_flat_keywords_say_what_to_write():
    from mpickpt.options import retention_of

    flat = dict.fromkeys(("keep_every", "best", "keep_best"), UNSET)
    with pytest.raises(ValueError, match="needs best="):
        mpickpt.Retention(3, keep_best=2)
    with pytest.raises(ValueError, match="only matter with keep=N"):
        mpickpt.Retention(keep_every=10)
    assert retention_of(3, flat) == mpickpt.Retention(3)
    with pytest.warns(DeprecationWarning) as seen:
        kept = retention_of(3, {**flat, "best": ("val", "min"), "keep_best": 2})
    assert kept == mpickpt.Retention(3, best=("val", "min"), keep_best=2)
    assert kept.policy().describe() == "keep=3, best=val (min), keep_best=2"
    assert ("keep=mpickpt.Retention(3, best=('val', 'min'), keep_best=2)"
            in str(seen[0].message))
    with pytest.raises(ValueError, match=r"in Retention\(\.\.\.\) only"):
        retention_of(mpickpt.Retention(2), {**flat, "keep_every": 5})


@pytest.mark.parametrize(("make", "words"), [
    (lambda: mpickpt.Encoding(incremental=1),
     "Encoding(incremental=) must be an int of at least 2"),
    (lambda: mpickpt.Encoding(frozen=["model"]), "give incremental=N too"),
    (lambda: mpickpt.Encoding(compression="lz5"), "unknown codec 'lz5'"),
    (lambda: mpickpt.Snapshots(max_in_flight=0), "Snapshots(max_in_flight=) must be 1 or more"),
    (lambda: mpickpt.Snapshots(if_busy="drop"), "if_busy must be 'wait' or 'skip'"),
    (lambda: mpickpt.Snapshots(pinned_budget=-1),
     "Snapshots(pinned_budget=) must be a positive"),
    (lambda: mpickpt.Files(alignment=3000), "Files(alignment=) must be a power of two"),
    (lambda: mpickpt.Files(checksum_block=0), "Files(checksum_block=) must be a power of two"),
    (lambda: mpickpt.Files(checksum_block=1), "Files(checksum_block=1) is below 4096"),
    (lambda: mpickpt.Files(checksum_block=2048), "Files(checksum_block=2048) is below 4096"),
    (lambda: mpickpt.Files(min_write_share=-1), "Files(min_write_share=) must be an int >= 0"),
    (lambda: mpickpt.Files(min_write_share=1.5), "Files(min_write_share=) must be an int >= 0"),
])
def test_encoding_snapshots_and_files_refuse_a_setting_that_cannot_work(make, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        make()


def test_the_flat_keywords_of_every_group_still_work_and_say_what_to_write(tmp_path):
    """A Checkpointer built with the flat keywords of earlier releases behaves as the groups
    say: an incremental second save refers to the first, two snapshots may be in flight, the
    deadline and requeue are the ones given, shards are aligned as asked; each keyword's
    warning names the group to write and points at this file."""
    with pytest.warns(DeprecationWarning) as seen:
        ck = mpickpt.Checkpointer(tmp_path, incremental=3, max_in_flight=2, deadline=4e9,
                                  requeue=False, alignment=8192, preemption=False)
    try:
        said = {str(w.message): w.filename for w in seen}
        assert len(said) == 4 and set(said.values()) == {__file__}
        for flat, group in (
                ("incremental=", "encoding=mpickpt.Encoding(incremental=3)"),
                ("max_in_flight=", "snapshots=mpickpt.Snapshots(max_in_flight=2)"),
                ("deadline=, requeue=",
                 "preemption=mpickpt.Preemption(False, deadline=4000000000.0, requeue=False)"),
                ("alignment=", "files=mpickpt.Files(alignment=8192)")):
            assert any(m.startswith(f"Checkpointer({flat}...) is deprecated: write "
                                    f"Checkpointer(..., {group})") for m in said), (flat, said)
        assert (ck.deadline, ck.requeue, ck.preemption) == (4e9, False, False)
        assert ck._pool.slots == 2
        w = torch.arange(4096, dtype=torch.float32)
        assert ck.save(1, {"w": w, "v": torch.zeros(8)}).wait().committed
        second = ck.save(2, {"w": w, "v": torch.ones(8)}).wait()
        assert second.committed and second.stats["reused_bytes"] == w.numel() * 4
    finally:
        ck.close()
