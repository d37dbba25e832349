"""Damaged and hostile checkpoints, each case in its own copy of a 2-rank ROOT (steps 10, 15, 20).

Every case damages or forges step 20 (or adds something beside it); then one MPI job restores
every ROOT into a fresh state (tests/scenarios/fault_hostile_restore.py, each rank's address space
limited to what it uses plus 4 GiB), and the CLI (verify, ls, inspect, export, stats,
mpickpt-restore --dry-run) runs on every ROOT in this process. Forged manifests carry a valid
manifest_checksum (the checksum guards against damage, not against someone who writes the
manifest), so the rule under test is the one that must refuse them.

Restore must fall back to step 15 (or load step 20 when the damage cannot change what it loads,
or refuse on every rank with the state untouched), say why naming the rank, file and tensor, load
exactly what was saved (compared with what h5py reads from the pristine shards), never read
outside ROOT, execute nothing, allocate nothing sized by a lie, and change nothing on disk. The
CLI must say the same, never crash or hang, and change nothing.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import pickle
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import xxhash
from faultkit import agreed_step, reports
from harness import SCENARIOS, run_mpi, shard, step_dir, train

from mpickpt.cli import main as cli_main
from mpickpt.format.entry import MAX_BYTES

N, NEWEST, OLDER = 2, 20, 15
BLOCK = 64 << 20
LIMIT_AS_MB = 4096
HUGE = 64 << 30  # the sparse shard of the "sparse-64GiB-shard" case


# ----------------------------------------------------------------------------- forging helpers


def digest(d: dict) -> str:
    """manifest_checksum as a forger computes it: xxh3-64 of the canonical JSON of the rest."""
    body = {k: v for k, v in d.items() if k != "manifest_checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_64_hexdigest(text.encode())


def forge(root: Path, mutate: Callable[[dict], None], step: int = NEWEST) -> Path:
    """Rewrite step's manifest through ``mutate``, with a valid checksum; return its path."""
    path = step_dir(root, step) / "MANIFEST.json"
    d = json.loads(path.read_text())
    mutate(d)
    d["manifest_checksum"] = digest(d)
    path.write_text(json.dumps(d, indent=1))
    return path


def record(d: dict, rank: int, name: str) -> dict:
    return next(t for t in d["ranks"][rank]["tensors"] if t["name"] == name)


def flip(path: Path, where: int, bits: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[where] ^= bits
    path.write_bytes(bytes(data))


def h5_contents(path: Path) -> tuple[dict[str, list], dict]:
    """What h5py reads from a shard: name -> [dtype, shape, xxh3-64 of the bytes], and the tree."""
    arrays: dict[str, list] = {}
    with h5py.File(path, "r") as f:
        tree = json.loads(f.attrs["tree"])

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                data = np.ascontiguousarray(obj[()]).tobytes()
                arrays[name] = [str(obj.attrs["torch_dtype"]), list(obj.shape),
                                xxhash.xxh3_64_hexdigest(data)]

        f["tensors"].visititems(visit)
    return arrays, tree


def h5_readable(path: Path) -> bool:
    """Whether h5py opens the shard and reads every dataset's metadata and the attributes."""
    try:
        with h5py.File(io.BytesIO(path.read_bytes()), "r") as f:
            json.loads(f.attrs["tree"])
            f["tensors"].visititems(lambda n, o: (o.shape, dict(o.attrs), o.id.get_offset())
                                    if isinstance(o, h5py.Dataset) else None)
        return True
    except Exception:
        return False


def snapshot(*dirs: Path) -> dict[str, tuple]:
    """Every entry under ``dirs`` (links not followed): kind, size, mtime and mode."""
    out = {}
    for d in dirs:
        for p in [d, *sorted(d.rglob("*"))]:
            st = p.lstat()
            out[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns,
                           os.readlink(p) if p.is_symlink() else None)
    return out


def cli(*argv: str | Path) -> tuple[int, str, str]:
    """``mpickpt ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def cli_json(*argv: str | Path) -> tuple[int, dict]:
    code, out, err = cli(*argv, "--json")
    doc = json.loads(out)
    assert doc["exit_code"] == code, (doc, err)
    return code, doc


class Boom:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


# --------------------------------------------------------------------------------- the cases


@dataclass
class Case:
    name: str
    suite: str  # corruption | hostile
    # damage(root, outside) -> (the file every message must name, the tensor it must name)
    damage: Callable[[Path, Path], tuple[Path, str | None]]
    why: str  # in restore's reason (or error) and in verify's
    step: int | None = OLDER  # what restore loads; None: it refuses on every rank
    skipped: int | None = NEWEST  # the step restore skips saying ``why`` (None: skips nothing)
    verify_status: str = "corrupt"  # the damaged checkpoint in `mpickpt verify`
    verify_step: int = NEWEST
    verify_level: str = "full"
    cli_why: str | None = None  # what verify says (default: ``why``)
    export_code: int | None = None  # `mpickpt export ROOT/step-00000020`: default from step
    tree_extra: list | None = None  # items the forged tree adds at its top level
    marker: bool = False  # the case tries to run code that creates ROOT/../MARKER
    attrs: dict = field(default_factory=dict)


def hdf5_superblock(root: Path, outside: Path) -> tuple[Path, str | None]:
    path = shard(root, NEWEST, 1)
    flip(path, 1)  # the "HDF" of the signature
    assert not h5_readable(path)
    return path, None


def hdf5_object_header(root: Path, outside: Path) -> tuple[Path, str | None]:
    """A byte of HDF5 metadata between tensor data (an object header), one h5py notices."""
    path = shard(root, NEWEST, 1)
    entry = json.loads((step_dir(root, NEWEST) / "MANIFEST.json").read_text())["ranks"][1]
    spans = sorted((t["offset"], t["offset"] + t["nbytes"])
                   for t in entry["tensors"] if t["nbytes"])
    gaps = [(a[1], b[0]) for a, b in itertools.pairwise(spans) if b[0] > a[1]]
    original = path.read_bytes()
    for lo, hi in gaps:
        for where in range(lo, hi):
            flip(path, where)
            if not h5_readable(path):
                return path, None
            path.write_bytes(original)
    raise AssertionError("no metadata byte between the tensors that h5py notices")


def hdf5_tree_attribute(root: Path, outside: Path) -> tuple[Path, str | None]:
    """A letter of the JSON tree attribute (HDF5 keeps no checksum of it): h5py reads another
    tree than the manifest's."""
    path = shard(root, NEWEST, 1)
    data = path.read_bytes()
    where = data.index(b'"type": "stateful"') + len(b'"type": "s')
    flip(path, where, 0x01)  # "stateful" -> "suateful": still text, still JSON
    assert h5_readable(path)
    return path, None


def wrong_version(root: Path, outside: Path) -> tuple[Path, str | None]:
    return forge(root, lambda d: d.update(version=4)), None


def swapped(root: Path, outside: Path) -> tuple[Path, str | None]:
    a, b = shard(root, NEWEST, 0), shard(root, NEWEST, 1)
    tmp = a.with_suffix(".tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    return b, None


def other_step(root: Path, outside: Path) -> tuple[Path, str | None]:
    shutil.copyfile(shard(root, OLDER, 1), shard(root, NEWEST, 1))
    return shard(root, NEWEST, 1), None


def traversal(name: str) -> Callable[[Path, Path], tuple[Path, str | None]]:
    """Rank 1's entry names ``name`` instead of its shard; a good copy of the shard lies there
    when the name is relative (outside the checkpoint directory)."""
    def damage(root: Path, outside: Path) -> tuple[Path, str | None]:
        target = step_dir(root, NEWEST) / name
        if not name.startswith("/"):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shard(root, NEWEST, 1), target.resolve())
        shard(root, NEWEST, 1).unlink()
        return forge(root, lambda d: d["ranks"][1].update(file=name)), None
    return damage


def step_dir_link(root: Path, outside: Path) -> tuple[Path, str | None]:
    """ROOT/step-00000025 -> a complete checkpoint outside ROOT (manifest of step 25)."""
    real = outside / "step-00000025"
    shutil.copytree(step_dir(root, NEWEST), real)
    forge(outside, lambda d: d.update(step=25), step=25)
    link = step_dir(root, 25)
    link.symlink_to(real)
    return link, None


def shard_link(root: Path, outside: Path) -> tuple[Path, str | None]:
    path = shard(root, NEWEST, 1)
    shutil.move(path, outside / path.name)
    path.symlink_to(outside / path.name)
    return path, None


def manifest_link(root: Path, outside: Path) -> tuple[Path, str | None]:
    path = step_dir(root, NEWEST) / "MANIFEST.json"
    shutil.move(path, outside / path.name)
    path.symlink_to(outside / path.name)
    return path, None


def fifo(which: str) -> Callable[[Path, Path], tuple[Path, str | None]]:
    def damage(root: Path, outside: Path) -> tuple[Path, str | None]:
        path = shard(root, NEWEST, 1) if which == "shard" else (
            step_dir(root, NEWEST) / "MANIFEST.json")
        path.unlink()
        os.mkfifo(path)
        return path, None
    return damage


def shard_directory(root: Path, outside: Path) -> tuple[Path, str | None]:
    path = shard(root, NEWEST, 1)
    path.unlink()
    path.mkdir()
    return path, None


def lie(name: str, change: Callable[[dict, dict], None]) -> Callable[[Path, Path],
                                                                     tuple[Path, str | None]]:
    """Rank 1's record of ``name`` changed by ``change(record, manifest)``."""
    def damage(root: Path, outside: Path) -> tuple[Path, str | None]:
        forge(root, lambda d: change(record(d, 1, name), d))
        return shard(root, NEWEST, 1), name
    return damage


def _huge_shape(r: dict, d: dict) -> None:
    r["shape"], r["nbytes"] = [1 << 40], 4 << 40
    r["checksums"] = ["0" * 16] * math.ceil((4 << 40) / BLOCK)


def _overlap(r: dict, d: dict) -> None:
    prev = record(d, 1, "model/0.weight")
    r["offset"] = prev["offset"] + 8


def _duplicate(r: dict, d: dict) -> None:
    other = record(d, 1, "model/3.bias")  # the same dtype and shape, another place
    other["name"] = r["name"]


def entry_bytes(root: Path, outside: Path) -> tuple[Path, str | None]:
    forge(root, lambda d: d["ranks"][1].update(bytes=1 << 40))
    return shard(root, NEWEST, 1), None


def sparse_huge(root: Path, outside: Path) -> tuple[Path, str | None]:
    """Rank 1's 'losses' (an ndarray the state takes whatever its shape) claims 64 GiB, and the
    shard really is 64 GiB long (sparse): consistent, but more than a rank may allocate."""
    path = shard(root, NEWEST, 1)
    start = -(-path.stat().st_size // 4096) * 4096
    n = (HUGE - start) // 8

    def change(d: dict) -> None:
        r = record(d, 1, "losses")
        r.update(offset=start, shape=[n], nbytes=8 * n,
                 checksums=["0" * 16] * math.ceil(8 * n / BLOCK))
        d["ranks"][1]["bytes"] = start + 8 * n

    forge(root, change)
    os.truncate(path, start + 8 * n)
    return path, None


def deep_json(root: Path, outside: Path) -> tuple[Path, str | None]:
    """A manifest nested 100000 levels deep (valid JSON, valid checksum)."""
    path = step_dir(root, NEWEST) / "MANIFEST.json"
    d = json.loads(path.read_text())
    d["metadata"] = {"deep": "DEEP"}
    body = json.dumps({k: v for k, v in d.items() if k != "manifest_checksum"},
                      sort_keys=True, separators=(",", ":"))
    deep = "[" * 100_000 + "]" * 100_000
    body = body.replace('"DEEP"', deep)
    d_text = body[:-1] + f',"manifest_checksum":"{xxhash.xxh3_64_hexdigest(body.encode())}"}}'
    path.write_text(d_text)
    return path, None


def deep_tree(root: Path, outside: Path) -> tuple[Path, str | None]:
    """Rank 1's tree nested 300 levels (parses, deeper than a state tree may be)."""
    def change(d: dict) -> None:
        node: dict = {"type": "none"}
        for _ in range(300):
            node = {"type": "list", "items": [node]}
        d["ranks"][1]["tree"]["items"].append(["deep", node])
    return forge(root, change), None


def oversized_manifest(root: Path, outside: Path) -> tuple[Path, str | None]:
    path = step_dir(root, NEWEST) / "MANIFEST.json"
    with open(path, "r+b") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: nothing but the size is real
    return path, None


def code_stateful(root: Path, outside: Path) -> tuple[Path, str | None]:
    """A tree node naming os.system as a class to call with a shell command."""
    marker = root.parent / "MARKER"
    node = {"type": "stateful", "class": "posix.system",
            "state": {"type": "str", "value": f"touch {marker}"}}
    for r in (0, 1):
        forge(root, lambda d, r=r: d["ranks"][r]["tree"]["items"].append(["evil", node]))
    return step_dir(root, NEWEST), None


def code_pickle_node(root: Path, outside: Path) -> tuple[Path, str | None]:
    payload = pickle.dumps(Boom(root.parent / "MARKER")).hex()
    node = {"type": "pickle", "value": payload}
    for r in (0, 1):
        forge(root, lambda d, r=r: d["ranks"][r]["tree"]["items"].append(["evil", node]))
    return step_dir(root, NEWEST), None


def code_pickled_bytes(root: Path, outside: Path) -> tuple[Path, str | None]:
    """A pickle that would run a command, as a bytes value: restore hands it over as bytes."""
    payload = pickle.dumps(Boom(root.parent / "MARKER")).hex()
    (root.parent / "payload.hex").write_text(payload)
    for r in (0, 1):
        forge(root, lambda d, r=r: d["ranks"][r]["tree"]["items"].append(
            ["blob", {"type": "bytes", "value": payload}]))
    return step_dir(root, NEWEST), None


FORGED_TREE = "'tree' attribute differs from the state tree in the manifest"
CASES = [
    # --- the corruption matrix (data byte flips, truncation, missing files and garbled
    # manifests are tests/faults/test_fault_corruption.py)
    Case("hdf5-superblock-flip", "corruption", hdf5_superblock, "h5py cannot read it",
         step=NEWEST, skipped=None, verify_status="hdf5-damaged"),
    Case("hdf5-object-header-flip", "corruption", hdf5_object_header,
         "HDF5 metadata is damaged", step=NEWEST, skipped=None, verify_status="hdf5-damaged"),
    Case("hdf5-tree-attribute-flip", "corruption", hdf5_tree_attribute,
         "'tree' attribute differs", step=NEWEST, skipped=None, verify_status="hdf5-damaged"),
    Case("manifest-wrong-version", "corruption", wrong_version, "version 4 is not",
         verify_status="unsupported"),
    Case("shards-swapped-between-ranks", "corruption", swapped,
         "it is rank 0's shard of this checkpoint"),
    Case("shard-from-another-step", "corruption", other_step, "it is rank 1's shard of step 15"),
    Case("manifest-lies-entry-bytes", "corruption", entry_bytes,
         "the manifest says 1099511627776"),
    # --- hostile: paths
    Case("manifest-file-dotdot", "hostile", traversal("../rank-00001.h5"),
         "shard file '../rank-00001.h5' is not 'rank-00001.h5'"),
    Case("manifest-file-absolute", "hostile", traversal("/etc/passwd"),
         "shard file '/etc/passwd' is not 'rank-00001.h5'"),
    Case("manifest-file-a-dotdot-dotdot-b", "hostile", traversal("a/../../b"),
         "shard file 'a/../../b' is not 'rank-00001.h5'"),
    Case("step-dir-symlink-outside-root", "hostile", step_dir_link, "is a symbolic link",
         step=NEWEST, skipped=25, verify_step=25),
    Case("shard-symlink-outside-root", "hostile", shard_link, "it is a symbolic link"),
    Case("manifest-symlink-outside-root", "hostile", manifest_link, "it is a symbolic link"),
    Case("shard-is-a-fifo", "hostile", fifo("shard"), "it is a FIFO, not a regular file"),
    Case("manifest-is-a-fifo", "hostile", fifo("manifest"), "it is a FIFO, not a regular file"),
    Case("shard-is-a-directory", "hostile", shard_directory, "it is a directory"),
    # --- hostile: lying sizes and shapes
    Case("record-shape-2**40", "hostile", lie("model/0.weight", _huge_shape), "lie outside the"),
    Case("record-nbytes-not-shape", "hostile",
         lie("model/0.weight", lambda r, d: r.update(nbytes=r["nbytes"] + 4)),
         "8196 bytes recorded, but float32[64, 32] needs 8192"),
    Case("record-offset-beyond-file", "hostile",
         lie("model/0.weight", lambda r, d: r.update(offset=d["ranks"][1]["bytes"])),
         "lie outside the"),
    Case("record-negative-offset", "hostile",
         lie("model/0.weight", lambda r, d: r.update(offset=-8)), "lie outside the"),
    Case("record-dimension-2**63", "hostile",
         lie("model/0.weight", lambda r, d: r.update(shape=[1 << 63, 0])), "impossible shape"),
    Case("record-unknown-dtype", "hostile",
         lie("model/0.weight", lambda r, d: r.update(dtype="object")), "unknown dtype 'object'"),
    Case("record-checksums-missing", "hostile",
         lie("model/0.weight", lambda r, d: r.update(checksums=[])), "0 checksums recorded"),
    Case("records-overlap", "hostile", lie("model/0.bias", _overlap), "overlap those"),
    Case("record-name-twice", "hostile", lie("model/0.bias", _duplicate), "recorded twice"),
    Case("sparse-64GiB-shard", "hostile", sparse_huge, "PinnedBudgetError",
         verify_status="committed", verify_level="quick", export_code=1),
    Case("manifest-nested-100000-deep", "hostile", deep_json, "nested too deeply"),
    Case("tree-nested-300-deep", "hostile", deep_tree, "nested deeper than 256 levels"),
    Case("manifest-over-1GiB", "hostile", oversized_manifest, "too large for a manifest"),
    # --- hostile: code execution
    # (the forged trees differ from the ones in the shards' HDF5 attributes: verify says so)
    Case("tree-names-os-system", "hostile", code_stateful, "posix.system", step=None,
         verify_status="hdf5-damaged", cli_why=FORGED_TREE, marker=True),
    Case("tree-pickle-node", "hostile", code_pickle_node, "unknown node type 'pickle'",
         step=None, verify_status="hdf5-damaged", cli_why=FORGED_TREE, marker=True),
    Case("tree-pickled-bytes", "hostile", code_pickled_bytes, "", step=NEWEST, skipped=None,
         verify_status="hdf5-damaged", cli_why=FORGED_TREE, marker=True, tree_extra=["blob"]),
]
BY_NAME = {c.name: c for c in CASES}
# what a case proves, by its suite: damage is detected, or nothing hostile escapes ROOT or runs
PROVES = {"corruption": "damage-detected", "hostile": "nothing-escapes-root"}
PARAMS = [pytest.param(c.name, id=c.name, marks=pytest.mark.guarantee(PROVES[c.suite]))
          for c in BY_NAME.values()]


# ------------------------------------------------------------------------------- the matrix


@dataclass
class Prepared:
    root: Path
    outside: Path
    named: Path  # the file (or directory) the messages must name
    tensor: str | None
    before: dict[str, tuple]
    reports: dict[int, dict] = field(default_factory=dict)
    after: dict[str, tuple] = field(default_factory=dict)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile-pristine") / "ckpt"
    job = train(N, root, NEWEST, every=5, keep=3)
    assert job.returncode == 0, job.output
    return root


@pytest.fixture(scope="module")
def expected(pristine: Path) -> dict[tuple[int, int], tuple[dict, dict]]:
    """(step, rank) -> what h5py reads from the pristine shard: arrays and tree."""
    return {(s, r): h5_contents(shard(pristine, s, r)) for s in (OLDER, NEWEST) for r in range(N)}


@pytest.fixture(scope="module")
def matrix(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Prepared]:
    """Every case prepared in its own ROOT, then restored by one job."""
    base = tmp_path_factory.mktemp("hostile")
    prepared, plan = {}, []
    for case in CASES:
        home = base / case.name
        root, outside = home / "ckpt", home / "outside"
        shutil.copytree(pristine, root)
        outside.mkdir()
        named, tensor = case.damage(root, outside)
        prepared[case.name] = Prepared(root, outside, named, tensor, snapshot(root, outside))
        plan.append({"name": case.name, "root": str(root), "reports": str(home / "reports")})
    plan_file = base / "plan.json"
    plan_file.write_text(json.dumps({"width": 64, "cases": plan}))
    job = run_mpi(N, [str(SCENARIOS / "fault_hostile_restore.py"), str(plan_file),
                      "--limit-as-mb", str(LIMIT_AS_MB)], timeout=600)
    for case in CASES:
        p = prepared[case.name]
        p.reports = reports(p.root.parent / "reports")
        p.after = snapshot(p.root, p.outside)
    assert job.returncode == 0, job.output
    return prepared


# ------------------------------------------------------------------------------ the verdicts


def restore_outcome(case: Case, p: Prepared, expected: dict) -> tuple[str, str]:
    """(outcome, what was wrong) of one case's restore, as the guarantee report counts it."""
    reps = p.reports
    verdict, step = agreed_step(reps, N)
    if verdict is not None:
        return verdict, str(step)
    for rank, rep in reps.items():
        if step is not None:
            arrays, tree = expected[(step, rank)]
            if case.tree_extra:
                tree = {**tree, "items": tree["items"] + [
                    it for it in rep["tree"]["items"] if it[0] in case.tree_extra]}
            if rep["arrays"] != arrays or rep["tree"] != tree:
                return "silent-wrong", f"rank {rank} loaded step {step} but not what was saved"
        if step != case.step:
            wrong = step == NEWEST and case.step != NEWEST
            return ("silent-wrong" if wrong else "failed"), f"rank {rank} restored step {step}"
        if case.step is None:
            if not (rep["error"] and case.why in rep["error"] and rep["untouched"]):
                return "failed", f"rank {rank}: error {rep['error']!r}, untouched " \
                                 f"{rep['untouched']}"
            continue
        if rep["error"] is not None:
            return "failed", f"rank {rank}: {rep['error']}"
        skipped = [s for s, _ in rep["skipped"]]
        if skipped != ([] if case.skipped is None else [case.skipped]):
            return "failed", f"rank {rank} skipped {skipped}"
        if case.skipped is not None:
            reason = rep["skipped"][0][1]
            named = str(p.named)
            if case.why not in reason or named not in reason or (
                    p.tensor and f"tensor {p.tensor!r}" not in reason):
                return "failed", f"rank {rank}: the reason does not name {case.why!r}, " \
                                 f"{named} and tensor {p.tensor}: {reason}"
        if rep["maxrss_grew_kb"] > 256 << 10:
            return "failed", f"rank {rank}: resident memory grew {rep['maxrss_grew_kb']} kB"
    if p.after != p.before:
        changed = sorted(set(p.after.items()) ^ set(p.before.items()))
        return "failed", f"restore changed files: {changed[:4]}"
    if case.marker and (p.root.parent / "MARKER").exists():
        return "failed", "the checkpoint's payload was executed"
    return "correct", ""


@pytest.mark.parametrize("name", PARAMS)
def test_restore(name: str, matrix: dict[str, Prepared], expected, guarantees) -> None:
    case, p = BY_NAME[name], matrix[name]
    outcome, detail = restore_outcome(case, p, expected)
    guarantees.record(case.suite, f"restore {name}", outcome, detail)
    assert outcome == "correct", f"{detail}\n{json.dumps(p.reports, indent=1)[:4000]}"
    if case.tree_extra:  # the pickle arrived as bytes, never unpickled
        payload = (p.root.parent / "payload.hex").read_text()
        for rep in p.reports.values():
            assert ["blob", {"type": "bytes", "value": payload}] in rep["tree"]["items"]


def cli_outcome(case: Case, p: Prepared, tmp: Path, expected: dict) -> tuple[str, str]:
    """(outcome, detail) of the CLI on one case's ROOT."""
    before = snapshot(p.root, p.outside)
    level = ["--verify", "quick"] if case.verify_level == "quick" else []
    code, doc = cli_json("verify", p.root, *level)
    entry = next((c for c in doc["checkpoints"] if c["step"] == case.verify_step), None)
    if entry is None:
        return "failed", f"verify lists no step {case.verify_step}: {doc}"
    reasons = " ".join(pr["reason"] for pr in entry["problems"])
    if entry["status"] != case.verify_status:
        fine = entry["status"] == "committed" and case.verify_status != "committed"
        return ("silent-wrong" if fine else "failed"), \
            f"verify: status {entry['status']}, not {case.verify_status}: {reasons}"
    why = case.why if case.cli_why is None else case.cli_why
    if case.verify_status != "committed" and (why not in reasons or str(p.named) not in reasons):
        return "failed", f"verify does not say {why!r} naming {p.named}: {reasons}"
    loads = case.step if case.step is not None else NEWEST
    if doc["current"] != loads and case.verify_level == "full":
        return "failed", f"verify says restore loads {doc['current']}, it loads {loads}"
    if code != (0 if case.verify_status == "committed" else 5):
        return "failed", f"verify exited {code}"
    outputs = []
    for argv in (["ls", p.root], ["inspect", step_dir(p.root, NEWEST)], ["inspect", p.root],
                 ["stats", p.root]):
        c, _, err = cli(*argv)
        outputs.append((argv[0], c, err))
    c, _, err = cli("restore", p.root, "--dry-run")
    outputs.append(("restore --dry-run", c, err))
    for what, c, err in outputs:
        if c not in (0, 1, 4, 5) or "internal error" in err or "Traceback" in err:
            return "failed", f"mpickpt {what} exited {c}: {err[-2000:]}"
    dest = tmp / "export.pt"
    c, _, err = cli("export", step_dir(p.root, NEWEST), dest)
    want = case.export_code if case.export_code is not None else (
        0 if case.step == NEWEST or case.step is None else 5)
    if c != want:
        return "failed", f"export exited {c}, not {want}: {err[-2000:]}"
    if c == 0:
        import torch

        got = torch.load(dest, weights_only=True)
        for rank in range(N):
            arrays, _ = expected[(NEWEST, rank)]
            for name, (_, shape, _) in arrays.items():
                t = got[f"rank{rank}/{name}"]
                data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                if list(t.shape) != shape or xxhash.xxh3_64_hexdigest(data) != arrays[name][2]:
                    return "silent-wrong", f"export: rank {rank} tensor {name} differs"
    elif dest.exists():
        return "failed", "a refused export left a file behind"
    if snapshot(p.root, p.outside) != before:
        return "failed", "the CLI changed files under ROOT or outside it"
    if case.marker and (p.root.parent / "MARKER").exists():
        return "failed", "the checkpoint's payload was executed"
    return "correct", ""


@pytest.mark.parametrize("name", PARAMS)
def test_cli(name: str, matrix: dict[str, Prepared], expected, tmp_path, guarantees) -> None:
    case, p = BY_NAME[name], matrix[name]
    outcome, detail = cli_outcome(case, p, tmp_path, expected)
    guarantees.record(case.suite, f"cli {name}", outcome, detail)
    assert outcome == "correct", detail


# ------------------------------------------------------------- links met by a save and by the CLI


@pytest.mark.guarantee("nothing-escapes-root")
@pytest.mark.quick
def test_a_save_never_writes_through_links_in_root(tmp_path: Path, guarantees) -> None:
    """ROOT/stats.jsonl is a link to a file outside ROOT, ROOT/step-00000005 a link to a
    checkpoint outside ROOT: the job starts fresh (the link is refused, saying so), saves steps 5
    and 10 as real directories (the step-5 link replaced, not followed), warns that it cannot
    append to stats.jsonl, and nothing outside ROOT changes."""
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "victim").write_text("precious\n")
    (outside / "step-00000005").mkdir()
    (outside / "step-00000005" / "MANIFEST.json").write_text("{}")
    (root / "stats.jsonl").symlink_to(outside / "victim")
    step_dir(root, 5).symlink_to(outside / "step-00000005")
    before = snapshot(outside)
    job = train(N, root, 10, every=5, keep=3, timeout=120)
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    checks = {
        "the job ends well": job.returncode == 0,
        "nothing outside ROOT changes": snapshot(outside) == before,
        "steps 5 and 10 are real directories": steps == ["step-00000005", "step-00000010"]
        and not step_dir(root, 5).is_symlink(),
        "the link is refused at restore": "is a symbolic link" in job.stderr,
        "stats.jsonl is not appended through the link": "could not append" in job.stderr
        and (root / "stats.jsonl").is_symlink(),
    }
    failed = [k for k, ok in checks.items() if not ok]
    guarantees.record("hostile", "save with links to outside ROOT in ROOT",
                      "failed" if failed else "correct", "; ".join(failed))
    assert not failed, f"{failed}\n{job.output}"


@pytest.mark.guarantee("nothing-escapes-root")
@pytest.mark.parametrize("delete", [False, True], ids=["quarantine", "delete"])
def test_mpickpt_restore_moves_or_removes_a_linked_step_directory_not_its_target(
        pristine: Path, tmp_path: Path, delete: bool, guarantees) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    shutil.copytree(pristine, root)
    outside.mkdir()
    step_dir_link(root, outside)
    before = snapshot(outside)
    code, out, err = cli("restore", root, *(["--delete"] if delete else []))
    moved = root / "quarantine" / "step-00000025"
    checks = {
        "exit 0": code == 0,
        "the link is gone from ROOT": not os.path.lexists(step_dir(root, 25)),
        "the link itself was moved": delete or moved.is_symlink(),
        "nothing outside ROOT changes": snapshot(outside) == before,
        "step 20 is still the newest": step_dir(root, NEWEST).is_dir(),
    }
    failed = [k for k, ok in checks.items() if not ok]
    guarantees.record("hostile", f"mpickpt-restore {'--delete' if delete else ''} on a step "
                      "link out of ROOT", "failed" if failed else "correct", "; ".join(failed))
    assert not failed, f"{failed}\n{out}\n{err}"


@pytest.mark.guarantee("nothing-escapes-root")
def test_the_cli_reads_no_side_file_through_a_link_or_fifo(pristine: Path, tmp_path: Path,
                                                          guarantees) -> None:
    """stats.jsonl a link to /dev/zero, ROLLBACK.json a FIFO, quarantine/QUARANTINE.jsonl a link
    to /dev/zero: each would hang a reader or fill its memory. ls, verify, stats and
    mpickpt-restore --dry-run end at once, changing nothing; stats says why it cannot read."""
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    (root / "stats.jsonl").unlink()
    (root / "stats.jsonl").symlink_to("/dev/zero")
    os.mkfifo(root / "ROLLBACK.json")
    (root / "quarantine").mkdir()
    (root / "quarantine" / "QUARANTINE.jsonl").symlink_to("/dev/zero")
    before = snapshot(root)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a command blocked"))
    results = {}
    signal.alarm(60)
    try:
        for argv in (["ls", root], ["verify", root], ["stats", root],
                     ["restore", root, "--dry-run"]):
            results[argv[0]] = cli(*argv)
    finally:
        signal.alarm(0)
    checks = {
        "ls, verify and restore --dry-run find step 20 good":
            all(results[c][0] == 0 for c in ("ls", "verify", "restore")),
        "stats refuses the link": results["stats"][0] == 1
        and "symbolic link" in results["stats"][2],
        "nothing changed": snapshot(root) == before,
    }
    failed = [k for k, ok in checks.items() if not ok]
    guarantees.record("hostile", "CLI with side files that are links or FIFOs",
                      "failed" if failed else "correct", "; ".join(failed))
    assert not failed, f"{failed}: {results}"
