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
    ({"incremental": 5, "local": "L"}, "incremental checkpoints are written to ROOT only"),
    ({"compression": "zstd", "local": "L"}, "compression is written to ROOT only"),
    ({"files": mpickpt.Files(per="node"), "local": "L"}, "is for ROOT"),
    ({"files": "per-node", "compression": "zstd"}, "writes raw regions"),
    ({"frozen": ["model"]}, "give incremental=N too"),
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
