"""mpickpt.save.retention: which committed checkpoints a policy keeps, and why."""

from __future__ import annotations

import pytest

from mpickpt.save.retention import Policy, plan


def cps(*steps: int, **metric: float) -> list[tuple[int, dict[str, float]]]:
    return [(s, {"val": metric[f"s{s}"]} if f"s{s}" in metric else {}) for s in steps]


def test_keep_last_n_deletes_the_older_ones_newest_first():
    doomed, why = plan(Policy(keep=2), cps(10, 30, 20, 40))
    assert doomed == [20, 10]
    assert set(why) == {40, 30}


def test_keep_none_deletes_nothing_whatever_else_is_set():
    assert plan(Policy(keep=None, keep_every=7), cps(1, 2, 3))[0] == []


def test_keep_every_keeps_multiples_for_good():
    doomed, why = plan(Policy(keep=1, keep_every=100), cps(100, 150, 200, 250, 300, 310))
    assert doomed == [250, 150]
    assert why[200] == "every 100" and why[310] == "newest"


def test_keep_best_ranks_by_metadata_min_and_max():
    c = cps(1, 2, 3, 4, 5, s1=0.5, s2=0.1, s3=0.9, s4=0.2, s5=0.7)
    doomed, why = plan(Policy(keep=1, best="val", mode="min", keep_best=2), c)
    assert doomed == [3, 1]
    assert "best 2 by val (min)" in why[2] and "best 2 by val (min)" in why[4]
    doomed, _ = plan(Policy(keep=1, best="val", mode="max", keep_best=2), c)
    assert doomed == [4, 2, 1]


@pytest.mark.guarantee("retention-after-commit")
def test_unranked_checkpoints_are_never_best_and_the_newest_is_always_kept():
    c = [(1, {"val": 0.3}), (2, {"val": float("nan")}), (3, {"val": "inf"}), (4, {}),
         (5, {"val": True}), (6, {"val": 9.0})]
    doomed, why = plan(Policy(keep=1, best="val", keep_best=1), c)
    assert doomed == [5, 4, 3, 2]
    assert why[1].startswith("best") and why[6] == "newest"
    # the newest is kept even when it is the worst and keep_best would not keep it
    doomed, why = plan(Policy(keep=1, best="val", mode="min", keep_best=1), [(1, {"val": 0.0}),
                                                                            (2, {"val": 5.0})])
    assert doomed == [] and why[2] == "newest"


def test_ties_prefer_the_newer_checkpoint():
    doomed, _ = plan(Policy(keep=1, best="val", keep_best=1), cps(1, 2, 3, s1=1.0, s2=1.0, s3=5.0))
    assert doomed == [1]


@pytest.mark.parametrize("bad, word", [
    (Policy(keep=0), "keep"), (Policy(keep_every=0), "keep_every"),
    (Policy(best="val", keep_best=1, mode="low"), "mode"), (Policy(keep=1, keep_best=2), "best="),
    (Policy(keep=1, best="val"), "keep_best"), (Policy(keep_best=-1, best="x"), "keep_best"),
    (Policy(keep_every=10), "only matter with keep"),
])
def test_bad_policies_are_refused_naming_the_option(bad, word):
    with pytest.raises(ValueError, match=word):
        bad.check()
