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
    with pytest.warns(DeprecationWarning, match="persist_every="):
        ck = mpickpt.Checkpointer(tmp_path / "root", local=tmp_path / "local",
                                  persist_every=None)
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
