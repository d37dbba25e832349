"""mpickpt.manifest: JSON schema, version and path rules."""

from __future__ import annotations

import json

import pytest

from mpickpt.errors import ManifestError
from mpickpt.manifest import Manifest, RankEntry, shard_name
from mpickpt.shard import TensorRecord


def sample() -> Manifest:
    rec = TensorRecord("w", "float32", [2, 2], 4096, 16, ["abc"])
    ranks = [RankEntry(r, shard_name(r), 8192, {"type": "none"}, [rec]) for r in range(2)]
    return Manifest(7, 2, "run1", ranks, {"lr": 0.1})


def test_round_trip_and_readable():
    m = sample()
    text = m.to_json()
    assert '"step": 7' in text and '"created_iso"' in text
    back = Manifest.from_json(text, "M")
    assert back == m
    assert back.total_bytes == 16384


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d["ranks"][1].update(file="../../etc/passwd"), "is not 'rank-00001.h5'"),
    (lambda d: d["ranks"][0].update(file="/abs/rank-00000.h5"), "is not 'rank-00000.h5'"),
    (lambda d: d.update(world_size=3), "world_size 3 but 2"),
    (lambda d: d["ranks"][0].update(rank=1), "rank field"),
    (lambda d: d["ranks"][0]["tensors"][0].update(shape=["2"]), "not a list of integers"),
    (lambda d: d["ranks"][0].update(bytes=-1), "negative"),
    (lambda d: d.pop("step"), "missing field 'step'"),
    (lambda d: d.update(step=True), "'step' has type bool"),
])
def test_bad_manifests_are_refused(mutate, message):
    d = json.loads(sample().to_json())
    mutate(d)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(json.dumps(d), "/r/step-7/MANIFEST.json")


def test_garbled_json_names_the_file():
    with pytest.raises(ManifestError, match=r"/r/MANIFEST.json: not valid JSON"):
        Manifest.from_json('{"format": "mpickpt", ', "/r/MANIFEST.json")
