"""16 and 32 ranks on this 2-core machine (oversubscribed, a tiny state): one rank killed in the
middle of a save, the job restarted, the last committed checkpoint restored, and the end
bit-identical to an uninterrupted run. 32 ranks write per-rank index parts (manifest version 2)
and restore through them."""

from __future__ import annotations

import pytest
from faultkit import committed_steps, partials
from harness import assert_same_final, manifest, starts, train

STEPS, EVERY, KILLED = 10, 5, 10


@pytest.mark.slow
@pytest.mark.guarantee("no-torn-load", "resume-bit-identical")
@pytest.mark.parametrize(("n", "index"), [(16, "inline"), (32, "per-rank")])
def test_many_ranks_killed_mid_save_resume_from_the_last_commit(tmp_path, n, index):
    root, out, ref = tmp_path / "ckpt", tmp_path / "out", tmp_path / "ref"
    extra = ["--index", index]
    clean = train(n, tmp_path / "unused", STEPS, ref, extra=["--no-checkpoint"], timeout=300)
    assert clean.returncode == 0, clean.output

    dead = train(n, root, STEPS, every=EVERY, fault=f"mid-write:{n - 1}:kill:{KILLED}",
                 extra=extra, timeout=300)
    assert dead.returncode != 0, f"the job survived a SIGKILL of one rank\n{dead.output}"
    assert committed_steps(root) == [5], dead.output
    assert manifest(root, 5)["version"] == (2 if index == "per-rank" else 1)
    assert len(partials(root, KILLED)) == 1

    resumed = train(n, root, STEPS, out, every=EVERY, extra=extra, timeout=300)
    assert resumed.returncode == 0, resumed.output
    assert starts(out, n) == [5] * n, resumed.output
    assert committed_steps(root) == [5, 10]
    assert_same_final(out, ref, n)
