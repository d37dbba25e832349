"""mpickpt.format.manifest: JSON schema, version and path rules."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import resource

import pytest
import xxhash
from harness import never_blocks

import mpickpt.format.entry as entry_module
from mpickpt.errors import ManifestError
from mpickpt.format.entry import MAX_BYTES, MAX_TREE_DEPTH, RankEntry
from mpickpt.format.manifest import Manifest, Memo, entry_text, read_bytes, tree_text
from mpickpt.format.names import shard_name
from mpickpt.format.shard import TensorRecord


def sample() -> Manifest:
    rec = TensorRecord("w", "float32", [2, 2], 4096, 16, ["abc"])
    ranks = [RankEntry(r, shard_name(r), 8192, {"type": "none"}, [rec]) for r in range(2)]
    return Manifest(7, 2, "run1", ranks, {"lr": 0.1})


def test_round_trip_and_readable():
    m = sample()
    text = m.to_json()
    assert '"step":7' in text and '"created_iso"' in text
    # one encoding: the canonical form the checksum covers, with the checksum appended
    body = {k: v for k, v in json.loads(text).items() if k != "manifest_checksum"}
    assert text.startswith(json.dumps(body, sort_keys=True, separators=(",", ":"))[:-1] + ",")
    back = Manifest.from_json(text, "M")
    assert back == m
    assert back.total_bytes == 16384


def test_a_manifest_in_the_older_layout_still_reads():
    """Releases before the canonical layout wrote the fields in their own order, spaced, with
    the checksum among them: the checksum covers the canonical form of the fields, not the
    text, so such a manifest reads as before; a changed value still fails its checksum."""
    m = sample()
    d = json.loads(m.to_json())
    older = {k: d[k] for k in ["step", "world_size", "run_id", "ranks", "metadata", "created",
                               "checksum_algorithm", "checksum_block", "format", "version",
                               "created_iso", "manifest_checksum"]}
    text = json.dumps(older)
    assert text != m.to_json() and '"step": 7' in text
    assert Manifest.from_json(text, "M") == m
    with pytest.raises(ManifestError, match="checksum mismatch"):
        Manifest.from_json(text.replace('"step": 7', '"step": 8'), "M")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d["ranks"][1].update(file="../../etc/passwd"), "is not 'rank-00001.h5'"),
    (lambda d: d["ranks"][0].update(file="/abs/rank-00000.h5"), "is not 'rank-00000.h5'"),
    (lambda d: d["ranks"][1].update(file="a/../../b"), "is not 'rank-00001.h5'"),
    (lambda d: d["ranks"][1].update(file="rank-00000.h5"), "is not 'rank-00001.h5'"),
    (lambda d: d.update(world_size=3), "world_size 3 but 2"),
    (lambda d: d["ranks"][0].update(rank=1), "rank field"),
    (lambda d: d["ranks"][0]["tensors"][0].update(shape=["2"]), "not a list of integers"),
    (lambda d: d["ranks"][0].update(bytes=-1), "negative"),
    (lambda d: d.pop("step"), "missing field 'step'"),
    (lambda d: d.update(step=True), "'step' has type bool"),
    # a rank without a file has no bytes and no records
    (lambda d: d["ranks"][1].update(file=None), "no file, and a size of 8192 bytes"),
    (lambda d: d["ranks"][1].update(file=None, bytes=False), "no file, and a size of False"),
    (lambda d: d["ranks"][1].update(file=None, bytes=0), "no file, and 1 tensor record"),
])
def test_bad_manifests_are_refused(mutate, message):
    d = json.loads(sample().to_json())
    mutate(d)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(json.dumps(d), "/r/step-7/MANIFEST.json")


def test_a_rank_that_wrote_no_tensor_has_no_file_and_reads_back_so():
    """The ranks of a small replicated state that others write: ``file`` null, 0 bytes, no
    records; no file to check, read or count, and the manifest round-trips."""
    m = sample()
    m.ranks[0] = RankEntry(0, None, 0, {"type": "none"}, [])
    back = Manifest.from_json(m.to_json(), "M")
    assert back == m and back.ranks[0].file is None
    assert back.ranks[0].files("/r/step-7") == [] and back.total_bytes == 8192
    assert json.loads(m.to_json())["ranks"][0]["file"] is None
    built = Manifest.assemble(7, 2, "run1", [e.to_dict() for e in m.ranks], {"lr": 0.1},
                              m.checksum_block)
    assert built.ranks == m.ranks


def test_the_manifest_assembles_itself_from_the_ranks_entries():
    """What the ranks send (their entries as dicts) becomes the manifest rank 0 commits, held to
    the rules a parsed manifest obeys: the same mutations are refused the same way."""
    m = sample()
    entries = [e.to_dict() for e in m.ranks]
    built = Manifest.assemble(7, 2, "run1", entries, {"lr": 0.1}, m.checksum_block)
    assert built.ranks == m.ranks and (built.step, built.world_size, built.metadata) == (
        7, 2, {"lr": 0.1})
    assert Manifest.from_json(built.to_json(), "M") == built
    for mutate, message in [
        (lambda es: es[1].update(file="../../etc/passwd"), "is not 'rank-00001.h5'"),
        (lambda es: es[0].update(rank=1), "rank field"),
        (lambda es: es[0]["tensors"][0].update(shape=["2"]), "not a list of integers"),
        (lambda es: es.pop(), "world_size 2 but 1"),
    ]:
        bad = copy.deepcopy(entries)
        mutate(bad)
        with pytest.raises(ManifestError, match=f"the manifest of step 7: .*{message}"):
            Manifest.assemble(7, 2, "run1", bad, {}, m.checksum_block)


def odd_entries() -> list[RankEntry]:
    """Entries whose JSON has every kind of value: escapes, non-ASCII, floats, nesting, a
    source; and one without records (a rank that writes no tensor)."""
    tree = {"type": "dict", "items": [
        ["é\"/\\", {"type": "float", "value": 0.1}], [3, {"type": "str", "value": "\u2603\n"}],
        ["z", {"type": "list", "items": [{"type": "int", "value": -7}, {"type": "none"}]}]]}
    recs = [TensorRecord("a/é", "float32", [2, 3], 4096, 24, ["x1"], [4, 3], [2, 0]),
            TensorRecord("c", "int64", [], 0, 8, source="step-00000002/rank-00000.h5")]
    return [RankEntry(0, shard_name(0), 8192, tree, recs,
                      sources={"step-00000002/rank-00000.h5": 4104}),
            RankEntry(1, shard_name(1), 4096, tree, [])]


def test_the_manifest_splices_its_entries_in_as_their_canonical_json():
    """Rank 0 serializes each rank's entry on its own (its tree apart), and the manifest's
    text is spliced from those: the same bytes, checksum included, as serializing the whole
    manifest, so a reader's check of the checksum holds."""
    for e in odd_entries():
        d = e.to_dict()
        canonical = json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False)
        assert entry_text(d, tree_text(e.tree)) == entry_text(d) == canonical
    entries = [e.to_dict() for e in odd_entries()]
    built = Manifest.assemble(7, 2, "run1", entries, {"ranks": [], "x": "],["}, 4096,
                              extended=True)
    spliced = built.to_json()
    built._texts = None  # serialized whole, as from parsed entries
    assert spliced == built.to_json()
    assert Manifest.from_json(spliced, "M") == built


def test_the_memo_spares_what_a_rank_sends_again_alike_and_checks_the_rest():
    m = sample()
    entries = [e.to_dict() for e in m.ranks]
    memo = Memo()
    first = Manifest.assemble(7, 2, "run1", copy.deepcopy(entries), {}, m.checksum_block,
                              memo=memo)
    changed = copy.deepcopy(entries)
    changed[1]["tensors"][0]["checksums"] = ["def"]
    second = Manifest.assemble(8, 2, "run1", copy.deepcopy(changed), {}, m.checksum_block,
                               memo=memo)
    assert second.ranks[0] is first.ranks[0]  # sent alike: the same entry, not parsed again
    assert second.ranks[1] is not first.ranks[1]
    assert second.ranks[1].tensors[0].checksums == ["def"]
    assert Manifest.from_json(second.to_json(), "M") == second  # its text is the new one's
    bad = copy.deepcopy(changed)
    bad[0]["tensors"][0]["shape"] = ["2", 2]
    with pytest.raises(ManifestError, match="not a list of integers"):  # not alike: checked
        Manifest.assemble(9, 2, "run1", bad, {}, m.checksum_block, memo=memo)
    bad = copy.deepcopy(changed)
    bad[1]["tree"] = {"type": "dict", "items": [["deep", {"type": "dict", "items": []}]]}
    bad[1]["tree"]["items"][0][1]["items"] = [["x", {"type": "int", "value": 1}]]
    third = Manifest.assemble(10, 2, "run1", bad, {}, m.checksum_block, memo=memo)
    assert Manifest.from_json(third.to_json(), "M").ranks[1].tree == bad[1]["tree"]
    fourth = Manifest.assemble(11, 2, "run1", copy.deepcopy(changed), {}, m.checksum_block,
                               memo=memo, extended=True)
    assert fourth.ranks[0] is not third.ranks[0]  # version 3: records are checked against
    # the steps referred to, always parsed


@pytest.mark.parametrize("where,old,new", [("key", 1, True), ("key", 1, 1.0),
                                           ("value", 0.0, -0.0)])
def test_the_memo_takes_trees_alike_only_if_their_values_are_exactly_the_same(
        where: str, old: object, new: object) -> None:
    """== takes 1, True and 1.0 as equal, and 0.0 and -0.0: a tree whose key or value changed
    so must not be written with the last save's text."""
    m = sample()
    memo = Memo()

    def entries(x: object) -> list[dict[str, object]]:
        key, value = (x, "v") if where == "key" else ("k", x)
        out = [e.to_dict() for e in m.ranks]
        for e in out:
            e["tree"] = {"type": "dict", "items": [[key, {"type": "any", "value": value}]]}
        return copy.deepcopy(out)

    Manifest.assemble(7, 2, "run1", entries(old), {}, m.checksum_block, memo=memo)
    second = Manifest.assemble(8, 2, "run1", entries(new), {}, m.checksum_block, memo=memo)
    for e in json.loads(second.to_json())["ranks"]:
        [[key, node]] = e["tree"]["items"]
        assert repr(key if where == "key" else node["value"]) == repr(new)


def test_garbled_json_names_the_file():
    with pytest.raises(ManifestError, match=r"/r/MANIFEST.json: not valid JSON"):
        Manifest.from_json('{"format": "mpickpt", ', "/r/MANIFEST.json")


def _nested(depth: int) -> dict:
    """A tree whose JSON nests ``depth`` (odd) levels: a list node is a dict and a list."""
    node: dict = {"type": "none"}
    for _ in range((depth - 1) // 2):
        node = {"type": "list", "items": [node]}
    return node


def test_json_nested_too_deeply_is_a_manifest_error():
    """json.loads raises RecursionError, not ValueError: it escaped restore and the CLI."""
    text = sample().to_json().replace('"lr":0.1', '"lr":' + "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ManifestError, match="M: nested too deeply"):
        Manifest.from_json(text, "M")


def _with_tree(tree: dict) -> str:
    """sample()'s manifest with rank 1's tree replaced and a valid checksum, written without
    Manifest.to_json (dataclasses.asdict recurses too deep for such trees)."""
    d = json.loads(sample().to_json())
    d["ranks"][1]["tree"] = tree
    return _resum(d)


def test_state_trees_deeper_than_the_limit_are_refused():
    """Deeper trees would exhaust the recursion of the code that walks them (apply, reshard)."""
    tree = _nested(MAX_TREE_DEPTH - 1)
    assert Manifest.from_json(_with_tree(tree), "M").ranks[1].tree == tree
    with pytest.raises(ManifestError, match=f"rank entry 1: the state tree is nested deeper "
                                            f"than {MAX_TREE_DEPTH} levels"):
        Manifest.from_json(_with_tree(_nested(MAX_TREE_DEPTH + 1)), "M")


def test_a_tree_like_the_rank_befores_is_not_walked_again_and_a_deeper_one_still_refused():
    """The depth of a tree equal to the one before it is known; only an equal one skips it."""
    ok, deep = _nested(MAX_TREE_DEPTH - 1), _nested(MAX_TREE_DEPTH + 1)
    d = json.loads(_with_tree(ok))
    d["ranks"][0]["tree"] = ok
    walked = []
    real = entry_module._depth
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(entry_module, "_depth", lambda t: walked.append(t) or real(t))
        assert [r.tree for r in Manifest.from_json(_resum(d), "M").ranks] == [ok, ok]
        assert len(walked) == 1  # rank 0's alone
        d["ranks"][1]["tree"] = deep
        with pytest.raises(ManifestError, match="rank entry 1: the state tree is nested deeper"):
            Manifest.from_json(_resum(d), "M")


def _resum(d: dict) -> str:
    """``d`` as a manifest's text with its checksum made right."""
    body = {k: v for k, v in d.items() if k != "manifest_checksum"}
    d["manifest_checksum"] = xxhash.xxh3_64_hexdigest(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return json.dumps(d)


def _write(directory, text: str = "{}") -> None:
    directory.mkdir()
    (directory / "MANIFEST.json").write_text(text)


@pytest.mark.parametrize("kind", ["dir-link", "file-link", "fifo", "directory"])
def test_read_bytes_refuses_what_is_not_a_manifest_file_of_its_own(tmp_path, kind):
    """Never through a symbolic link (the step directory's or the manifest's), never a FIFO
    (open() would wait for a writer forever), never a directory."""
    step = tmp_path / "step-00000001"
    if kind == "dir-link":
        _write(tmp_path / "elsewhere")
        step.symlink_to(tmp_path / "elsewhere")
        said = f"{step} is a symbolic link"
    else:
        step.mkdir()
        target = step / "MANIFEST.json"
        {"file-link": lambda: target.symlink_to(tmp_path / "x.json"),
         "fifo": lambda: os.mkfifo(target), "directory": target.mkdir}[kind]()
        (tmp_path / "x.json").write_text("{}")
        said = {"file-link": "it is a symbolic link", "fifo": "it is a FIFO",
                "directory": "it is a directory"}[kind]
    with never_blocks("read_bytes"), \
            pytest.raises(ManifestError, match=f"MANIFEST.json: cannot open: {said}"):
        read_bytes(str(step))


def test_an_oversized_manifest_is_refused_unread(tmp_path):
    step = tmp_path / "step-00000001"
    _write(step)
    os.truncate(step / "MANIFEST.json", MAX_BYTES + 1)  # sparse
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ManifestError, match=f"{MAX_BYTES + 1} bytes is too large"):
        read_bytes(str(step))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # kB


def test_to_dict_gives_what_asdict_gives():
    """The hand-written to_dict of records, entries and manifests (asdict's deep copies cost
    milliseconds per save) must stay field for field what asdict gives."""
    recs = [TensorRecord("a/b", "float32", [2, 3], 4096, 24, ["x1"], [4, 3], [2, 0]),
            TensorRecord("c", "int64", [], 0, 8)]
    recs.append(TensorRecord("d", "int8", [3], 64, 3, ["x2"], source="step-00000002/rank-00000.h5",
                             codec="zstd", chunks=[[0, 9]]))
    # asdict less the version-3 fields a record does not use (a version-1 or 2 record has none)
    expected_recs = [{k: v for k, v in dataclasses.asdict(r).items()
                      if k not in ("source", "codec", "chunks") or v is not None} for r in recs]
    assert [r.to_dict() for r in recs] == expected_recs
    assert {f.name for f in dataclasses.fields(TensorRecord)} == set(recs[2].to_dict())
    recs = recs[:2]
    entry = RankEntry(0, "rank-00000.h5", 123, {"type": "dict", "items": []}, recs)
    assert entry.to_dict() == {"rank": 0, "file": "rank-00000.h5", "bytes": 123,
                               "tree": {"type": "dict", "items": []},
                               "tensors": [r.to_dict() for r in recs]}
    m = Manifest(5, 1, "run", [entry], {"loss": 1.5})
    text = json.loads(m.to_json())
    expected = dataclasses.asdict(m)
    expected["ranks"] = [entry.to_dict()]
    assert expected.pop("references") == [] and "references" not in text  # version 1
    # (replicated: none with index parts alone; _texts: an assembled manifest's alone)
    for unwritten in ("replicated", "directory", "_replicas", "_texts"):
        assert expected.pop(unwritten) is None and unwritten not in text
    assert {k: text[k] for k in expected} == expected
