"""The node-local level on real MPI jobs: nodes simulated with $MPICKPT_NODE, each with its own
local directory; a lost node is its ranks killed and its directory wiped (as a replacement node
comes back: empty).

Each case trains tests/scenarios/levels.py to step 40 with a save every 10 steps, drained to ROOT
every third (step 30), and kills every rank once step 40 is protected (before any drain of it).
Then nodes are wiped, a new job restores and trains on to step 60, and its final state must be
bit-identical to an uninterrupted run's. Cases are counted in the guarantee report (suite
"levels") before their assertions.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from harness import NO_DAC, SCENARIOS, run_mpi

from mpickpt.local.topology import xor_chunk, xor_chunk_bytes

JOB = SCENARIOS / "levels.py"
SUITE = "levels"
CRASH, LAST, DRAINED = 40, 60, 30  # the step protected before the crash, the end, ROOT's newest


def job(tmp: Path, name: str, n: int, prefix: list[str] | None = None, **plan: Any
        ) -> tuple[Any, dict[int, dict]]:
    """Run the scenario on ``n`` ranks (behind ``prefix``); (the job, each rank's report)."""
    out = tmp / f"out-{name}"
    full = {"root": str(tmp / "root"), "local": str(local_of(tmp)), "steps": LAST,
            "every": 10, "persist_every": 3, "out": str(out), **plan}
    path = tmp / f"plan-{name}.json"
    path.write_text(json.dumps(full))
    done = run_mpi(n, [str(JOB), str(path)], timeout=120, prefix=prefix)
    reports = {}
    for r in range(n):
        f = out / f"rank-{r}.json"
        if f.exists():
            reports[r] = json.loads(f.read_text())
    return done, reports


def local_of(tmp: Path) -> Path:
    """The local level's directory of a test: under tmp, or where tmp/LOCAL says (/dev/shm)."""
    link = tmp / "LOCAL"
    return Path(link.read_text()) if link.exists() else tmp / "local"


@pytest.fixture
def in_memory(tmp_path: Path):
    """Put the test's local level in /dev/shm (tmpfs: memory, as in production)."""
    where = Path(f"/dev/shm/mpickpt-test-{uuid.uuid4().hex[:8]}")
    (tmp_path / "LOCAL").write_text(str(where))
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The final digests of uninterrupted runs, per rank count and for a replicated model
    (key ``(n, True)``), made on first use (they depend on nothing else)."""
    class Lazy(dict):
        def __missing__(self, key: int | tuple[int, bool]) -> dict[int, str]:
            n, replicated = key if isinstance(key, tuple) else (key, False)
            tmp = tmp_path_factory.mktemp(f"reference{n}{'r' if replicated else ''}")
            done, reports = job(tmp, "ref", n, per_node=1, replicated=replicated)
            assert done.returncode == 0, done.output
            self[key] = {r: rep["final"] for r, rep in reports.items()}
            return self[key]

    return Lazy()


def crash_then_resume(tmp: Path, n: int, wipe: list[int], **settings: Any
                      ) -> tuple[Any, dict[int, dict]]:
    """Train to CRASH and die there, wipe the nodes ``wipe``, resume to LAST."""
    crashed, _ = job(tmp, "crash", n, crash_after=CRASH, **settings)
    assert crashed.returncode != 0, crashed.output
    copies: dict[str, list[Path]] = {}  # a shard and its partner copies: the same HDF5 file
    for f in sorted(local_of(tmp).glob(f"*/step-{CRASH:08d}/rank-*.h5")):
        copies.setdefault(f.name, []).append(f)
    for first, *others in copies.values():
        for other in others:
            assert_same_hdf5(first, other)
    assert (tmp / "root" / f"step-{DRAINED:08d}" / "MANIFEST.json").exists()
    assert not (tmp / "root" / f"step-{CRASH:08d}").exists()  # the crash came before its drain
    for node in wipe:
        shutil.rmtree(local_of(tmp) / f"n{node}")
    return job(tmp, "resume", n, **settings)


def node_1_back_from_partners(done: Any, reports: dict[int, dict]) -> list[dict]:
    """The 4-rank resume after node 1's loss: every rank restored CRASH from the local level,
    ranks 2 and 3 (node 1) from partner copies. Each rank's restore report."""
    assert done.returncode == 0, done.output
    restored = [reports[r]["restore"] for r in range(4)]
    assert {r["step"] for r in restored} == {CRASH} and {r["level"] for r in restored} == {
        "local"}, restored
    assert [r["source"].startswith("partner copy") for r in restored] == [False, False, True,
                                                                            True], restored
    return restored


def outcome(reports: dict[int, dict], n: int, step: int, finals: dict[int, str]) -> str:
    if len(reports) != n or any("final" not in r for r in reports.values()):
        return "failed"
    steps = {r["restore"]["step"] for r in reports.values()}
    if len(steps) > 1:
        return "torn"
    if steps != {step} or any(r["final"] != finals[k] for k, r in reports.items()):
        return "silent-wrong"
    return "correct"


WINDOW = 7000  # bytes moved at a time in the cases that set it: a shard takes ~15 windows
LOSSES = [
    # (id, redundancy, ranks, ranks per node, xor_set, nodes wiped, restored from, window,
    #  replicated: the model is the same on every rank, replicated=("model",) as under DDP;
    #  True: spread over the ranks, "fewest": the default Files, the last rank writes it all)
    ("partner-2x2-one-node", "partner", 4, 2, None, [1], "local", WINDOW, False),
    ("partner-4x1-two-pairs", "partner", 4, 1, None, [0, 2], "local", None, False),
    ("partner-2x2-both-nodes", "partner", 4, 2, None, [0, 1], "root", None, False),
    ("partner-4x1-one-pair", "partner", 4, 1, None, [2, 3], "root", None, False),
    ("xor-3x2-one-node", "xor", 6, 2, 3, [1], "local", WINDOW, False),
    ("xor-6x1-two-sets", "xor", 6, 1, 3, [0, 4], "local", None, False),
    ("xor-3x2-two-nodes", "xor", 6, 2, 3, [0, 2], "root", None, False),
    ("replicated-partner-2x2-node-0", "partner", 4, 2, None, [0], "local", None, True),
    ("replicated-partner-4x1-two-pairs", "partner", 4, 1, None, [1, 3], "local", WINDOW, True),
    ("replicated-partner-2x2-both-nodes", "partner", 4, 2, None, [0, 1], "root", None, True),
    ("replicated-xor-3x2-one-node", "xor", 6, 2, 3, [0], "local", WINDOW, True),
    ("replicated-xor-6x1-two-sets", "xor", 6, 1, 3, [1, 5], "local", None, True),
    ("fewest-partner-2x2-writer-node", "partner", 4, 2, None, [1], "local", None, "fewest"),
    ("fewest-xor-3x2-writer-node", "xor", 6, 2, 3, [2], "local", WINDOW, "fewest"),
]
QUICK_LOSSES = ("replicated-partner-2x2-node-0", "xor-3x2-one-node")  # ./launch/test --quick


@pytest.mark.guarantee("local-survives-node-loss", "resume-bit-identical")
@pytest.mark.parametrize("case", [
    pytest.param(c, id=c[0], marks=[pytest.mark.quick] if c[0] in QUICK_LOSSES else [])
    for c in LOSSES])
def test_a_lost_node_is_rebuilt_from_redundancy_else_root(
        tmp_path: Path, reference, guarantees, case: tuple, request) -> None:
    name, redundancy, n, per_node, xor_set, wipe, level, window, replicated = case
    if window:  # these cases also put the local level in memory, as in production
        assert request.getfixturevalue("in_memory").parent == Path("/dev/shm")
    done, reports = crash_then_resume(tmp_path, n, wipe, redundancy=redundancy,
                                      per_node=per_node, xor_set=xor_set, window=window,
                                      replicated=replicated)
    step = CRASH if level == "local" else DRAINED
    finals = reference[n, bool(replicated)]
    guarantees.record(SUITE, name, outcome(reports, n, step, finals), done.output[-2000:])
    assert done.returncode == 0, done.output
    restored = [reports[r]["restore"] for r in range(n)]
    assert {r["step"] for r in restored} == {step}, restored
    assert {r["level"] for r in restored} == {level}
    lost = [r for r in range(n) if r // per_node in wipe]
    if level == "local":
        assert {r["root_bytes"] for r in restored} == {0}  # nothing read from ROOT
        how = "partner copy from rank" if redundancy == "partner" else "XOR rebuild"
        for r in range(n):
            assert restored[r]["source"].startswith(how if r in lost else "own"), restored[r]
            if r in lost and redundancy == "xor":  # (replicated: others read its shard)
                assert restored[r]["source"].endswith("into the restore") != bool(replicated)
            # a node directory in memory: a survivor's own tensors are used where they lie
            # (verified in place, no copy; a replicated model is put together from the ranks'
            # shares, and its one other tensor is 8 bytes); on disk, every byte is read
            mapped = restored[r]["mapped_bytes"]
            if not window:
                assert mapped == 0, restored[r]
            elif r not in lost and not replicated:
                assert mapped > 0, restored[r]
            assert mapped <= restored[r]["bytes_read"], restored[r]
        assert restored[0]["total_network_bytes"] == sum(r["network_bytes"] for r in restored)
        assert all(restored[r]["network_bytes"] > 0 for r in lost)
        # a replicated model: every rank gets the shares of other nodes' ranks over MPI; all of
        # it from the last rank when that one writes it all (its node's other ranks: from its
        # shard's partner copy, or its shard rebuilt in place by XOR)
        fetched = [r["fetched_bytes"] > 0 for r in restored]
        if replicated == "fewest":
            writer_node = (n - 1) // per_node
            assert not fetched[n - 1], restored
            assert all(fetched[r] for r in range(n) if r // per_node != writer_node), restored
        else:
            assert fetched == [replicated] * n, restored
        for r in lost:  # the wiped node has the step back, committed as a save commits it
            listing = restored[r]["node_dir"]
            assert not [n for n in listing if ".partial-" in n], listing
            files = listing[f"step-{CRASH:08d}"]
            assert {"MANIFEST.json", "LEVEL.json", f"rank-{r:05d}.h5"} <= set(files), files
            if redundancy == "xor":  # its parity too, rebuilt once the restore returned
                assert f"xor-{r:05d}.bin" in files, files
    else:
        assert restored[0]["root_bytes"] > 0
        if len(wipe) < n // per_node:  # a surviving node still holds step 40: tried first
            assert any(step == CRASH and "from the local level" in why
                       for step, why in restored[0]["skipped"]), restored[0]["skipped"]
    for r in range(n):
        assert reports[r]["final"] == finals[r], f"rank {r} did not end bit-identical"
        assert all(s["committed"] for s in reports[r]["saves"].values())
    assert reports[0]["drained"] == LAST  # close() drained the newest to ROOT


def assert_same_hdf5(a: Path, b: Path) -> None:
    """Both files open with h5py, with the same attributes and every dataset's values."""
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        assert dict(fa.attrs) == dict(fb.attrs), (a, b)
        names: list[str] = []
        fa.visit(lambda n: names.append(n) if isinstance(fa[n], h5py.Dataset) else None)
        assert names, a
        for n in names:
            assert fa[n][()].tobytes() == fb[n][()].tobytes(), (a, b, n)
            assert dict(fa[n].attrs).keys() == dict(fb[n].attrs).keys()


@pytest.mark.guarantee("local-survives-node-loss", "resume-bit-identical")
@pytest.mark.parametrize("case", ["damaged-recycled-files", "peer-killed-mid-rebuild"])
def test_recycled_files_and_a_recovery_that_dies_cost_nothing(
        tmp_path: Path, reference, guarantees, in_memory, case: str) -> None:
    """The pool's retired files garbage and cut short before the saves that write over them;
    or the rank that sends a lost node its shard killed mid-copy (the restore ends, no hang,
    and the next one recovers): either way node 1's loss is rebuilt from partner copies and
    the run ends bit-identical."""
    settings: dict[str, Any] = {"redundancy": "partner", "per_node": 2, "window": WINDOW}
    if case == "damaged-recycled-files":
        settings["damage_pool"] = 20  # step 30's and 40's saves write over the damaged files
    crashed, _ = job(tmp_path, "crash", 4, crash_after=CRASH, **settings)
    assert crashed.returncode != 0, crashed.output
    for r in range(4):  # each partner copy is the shard HDF5 reads, tensor for tensor
        own, copy = (local_of(tmp_path) / f"n{n}" / f"step-{CRASH:08d}" / f"rank-{r:05d}.h5"
                     for n in (r // 2, 1 - r // 2))
        assert_same_hdf5(own, copy)
    shutil.rmtree(local_of(tmp_path) / "n1")
    if case == "peer-killed-mid-rebuild":
        died, _ = job(tmp_path, "died", 4, fault="mid-rebuild:0:kill,mid-rebuild:1:kill",
                      **settings)
        assert died.returncode != 0, died.output
    done, reports = job(tmp_path, "resume", 4, **settings)
    guarantees.record(SUITE, case, outcome(reports, 4, CRASH, reference[4]),
                      done.output[-2000:])
    node_1_back_from_partners(done, reports)
    assert all(reports[r]["final"] == reference[4][r] for r in range(4))


XOR_3X2 = {"redundancy": "xor", "per_node": 2, "xor_set": 3, "window": WINDOW}  # teams 0-2-4, 1-3-5


@pytest.mark.guarantee("local-survives-node-loss", "resume-bit-identical")
@pytest.mark.parametrize("case", ["parity-back-serves-a-second-loss", "peers-killed-mid-rebuild",
                                  "damaged-parity", "no-room-on-the-new-node"])
def test_a_node_rebuilt_from_xor_parity_over_the_ring(
        tmp_path: Path, reference, guarantees, in_memory, case: str) -> None:
    """Node 1 of three lost under XOR redundancy (local/xorring.py: its shards come around the
    ring, its parity after the restore):
    - its parity files, rebuilt once the restore returned, are the ones the save wrote, and
      they serve the loss of node 0 next: its shards rebuilt from them, bit for bit;
    - the two survivors of team 0-2-4 killed in the midst of the rebuild: that job ends, no
      hang, and the next one rebuilds node 1 and runs on bit-identical;
    - a flipped byte in node 0's parity where it makes rank 2's rebuilt bytes: the restore
      verifies them, names rank 2's tensor, and ROOT takes over; the run ends bit-identical;
    - the new node 1 with no room for its shards (a 16 KiB tmpfs): the shards need none to
      be restored (they land straight in the restore, local/xorlanding.py), so the step comes
      from the local level; writing them back to the node afterwards says why it cannot, and
      the run goes on, its saves failing there, and ends bit-identical. (Its ranks take part
      in the write-back's ring all the same, into a scratch buffer, so that the survivors'
      blocks go; this state's blocks are small enough to go eagerly even without.)"""
    crashed, _ = job(tmp_path, "crash", 6, crash_after=CRASH, **XOR_3X2)
    assert crashed.returncode != 0, crashed.output

    def step_dir(node: int) -> Path:
        return local_of(tmp_path) / f"n{node}" / f"step-{CRASH:08d}"

    saved = {p.name: p.read_bytes() for p in step_dir(1).glob("xor-*.bin")}
    assert sorted(saved) == ["xor-00002.bin", "xor-00003.bin"], sorted(saved)
    shutil.rmtree(local_of(tmp_path) / "n1")
    into = "XOR rebuild into the restore"  # local/xorlanding.py
    expect, step = ["own", "own", into, into, "own", "own"], CRASH
    if case == "peers-killed-mid-rebuild":
        died, _ = job(tmp_path, "died", 6, fault="mid-rebuild:0:kill,mid-rebuild:4:kill",
                      **XOR_3X2)
        assert died.returncode != 0, died.output
    if case == "damaged-parity":  # rank 0's parity holds rank 2's first chunk, XORed with 4's
        m = json.loads((step_dir(0) / "MANIFEST.json").read_text())
        chunk = -(-max(m["ranks"][r]["bytes"] for r in (0, 2, 4)) // 2)
        rec = max((t for t in m["ranks"][2]["tensors"] if t["offset"] < chunk),
                  key=lambda t: min(t["nbytes"], chunk - t["offset"]))
        parity = step_dir(0) / "xor-00000.bin"
        data = bytearray(parity.read_bytes())
        data[rec["offset"] + min(rec["nbytes"], chunk - rec["offset"]) // 2] ^= 0xFF
        parity.write_bytes(bytes(data))
        step = DRAINED
    if case == "no-room-on-the-new-node":
        node1 = local_of(tmp_path) / "n1"
        node1.mkdir()
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(node1)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
        try:  # (its saves fail there too, each one aborted on every rank, and the run goes on)
            done, reports = job(tmp_path, "resume", 6, **XOR_3X2)
        finally:
            subprocess.run(["umount", "-l", str(node1)], check=True)
        guarantees.record(SUITE, "xor-no-room-on-the-new-node",
                          outcome(reports, 6, CRASH, reference[6]), done.output[-2000:])
        assert done.returncode == 0, done.output
        assert re.search(r"writing the lost shards back to their nodes failed.*No space left "
                         "on device", done.stderr), done.output
        restored = [reports[r]["restore"] for r in range(6)]
        assert {(r["step"], r["level"]) for r in restored} == {(CRASH, "local")}, restored
        assert [r["source"] for r in restored] == expect, restored
        assert all(reports[r]["final"] == reference[6][r] for r in range(6))
        return
    steps = CRASH if case == "parity-back-serves-a-second-loss" else LAST
    done, reports = job(tmp_path, "resume", 6, steps=steps, **XOR_3X2)
    assert done.returncode == 0, done.output
    restored = [reports[r]["restore"] for r in range(6)]
    if case == "damaged-parity":
        guarantees.record(SUITE, "xor-damaged-parity", outcome(reports, 6, step, reference[6]),
                          done.output[-2000:])
        assert rec["name"] in done.stderr and "rank-00002.h5" in done.stderr, done.output
        assert re.search(r"checksum mismatch in block \d+", done.stderr), done.output
        assert {r["level"] for r in restored} == {"root"}, restored
    else:
        assert [r["source"] for r in restored] == expect, restored
        assert {r["step"] for r in restored} == {CRASH} and all(r["exact"] for r in restored)
    if case == "parity-back-serves-a-second-loss":
        for name, data in saved.items():
            assert (step_dir(1) / name).read_bytes() == data, name
        assert not [p.name for p in step_dir(1).iterdir() if "rebuilding" in p.name]
        shutil.rmtree(local_of(tmp_path) / "n0")  # its teams' parities: node 1's and 2's
        done, reports = job(tmp_path, "again", 6, **XOR_3X2)
        assert done.returncode == 0, done.output
        restored = [reports[r]["restore"] for r in range(6)]
        assert [r["source"] for r in restored] == [into] * 2 + ["own"] * 4, restored
    else:
        guarantees.record(SUITE, f"xor-{case}", outcome(reports, 6, step, reference[6]),
                          done.output[-2000:])
    assert {r["level"] for r in restored} == {"root" if case == "damaged-parity" else "local"}
    assert all(reports[r]["final"] == reference[6][r] for r in range(6))


def team_parities(step_dirs: dict[int, Path], teams: list[list[int]]) -> dict[int, bytes]:
    """Every rank's parity computed here from the team's shard files (rank -> bytes)."""
    files = {r: (step_dirs[r] / f"rank-{r:05d}.h5").read_bytes() for t in teams for r in t}
    out = {}
    for team in teams:
        n = len(team)
        chunk = xor_chunk_bytes(max(len(files[r]) for r in team), n)
        for k, rank in enumerate(team):
            acc = np.zeros(chunk, np.uint8)
            for j, other in enumerate(team):
                if j != k:
                    start = xor_chunk(n, j, k) * chunk
                    piece = np.frombuffer(files[other][start:start + chunk], np.uint8)
                    acc[:len(piece)] ^= piece
            out[rank] = acc.tobytes()
    return out


@pytest.mark.guarantee("local-survives-node-loss", "resume-bit-identical")
@pytest.mark.parametrize("case", ["damaged-recycled-files", "killed-mid-parity",
                                  "raised-mid-parity"])
def test_xor_parity_made_from_the_snapshot_is_the_parity_of_the_files(
        tmp_path: Path, reference, guarantees, in_memory, case: str) -> None:
    """XOR saves make the parity of the tensors' bytes from the snapshot while the shards are
    written, and add the HDF5 metadata after (local/parity.py): every parity file is the XOR
    numpy makes of the team's shard files, byte for byte, and node 1's loss is rebuilt from
    them bit for bit:
    - over recycled files that were garbage before the save of step 40 wrote over them
      (their alignment padding made zeros);
    - with rank 2 killed, or raising, in the midst of step 40's parity: that save is not
      protected, and step 30's parities (made the same way) bring node 1 back."""
    settings: dict[str, Any] = {**XOR_3X2, "crash_after": CRASH, "timeout": 10}
    if case == "damaged-recycled-files":  # w1 (48 KiB) padded to 64 KiB in every shard
        settings.update(damage_pool=DRAINED, damage_cut=False, alignment=32 << 10)
    else:
        action = "kill" if case == "killed-mid-parity" else "raise"
        settings["fault"] = f"mid-exchange:2:{action}:{CRASH}"
    crashed, reports = job(tmp_path, "crash", 6, **settings)
    assert crashed.returncode != 0, crashed.output
    step = CRASH if case == "damaged-recycled-files" else DRAINED
    if case == "killed-mid-parity":
        assert not (local_of(tmp_path) / "n0" / f"step-{CRASH:08d}").exists()
    else:
        saves = [reports[r]["saves"] for r in range(6)]
        for s in saves:  # every save's parity went from the snapshot
            assert all(v["parity_from_snapshot"] == 1.0 for k, v in s.items() if int(k) <= step), s
        if case == "raised-mid-parity":
            assert "FaultInjected" in str(saves[2][str(CRASH)]["error"]), saves[2]
            assert not any(s[str(CRASH)]["committed"] for s in saves), saves
    dirs = {r: local_of(tmp_path) / f"n{r // 2}" / f"step-{step:08d}" for r in range(6)}
    want = team_parities(dirs, [[0, 2, 4], [1, 3, 5]])
    for r in range(6):
        assert (dirs[r] / f"xor-{r:05d}.bin").read_bytes() == want[r], f"rank {r}'s parity"
    shutil.rmtree(local_of(tmp_path) / "n1")
    done, reports = job(tmp_path, "resume", 6, **{**XOR_3X2, **{
        k: v for k, v in settings.items() if k == "alignment"}})
    guarantees.record(SUITE, f"xor-from-snapshot-{case}", outcome(reports, 6, step,
                      reference[6]), done.output[-2000:])
    assert done.returncode == 0, done.output
    restored = [reports[r]["restore"] for r in range(6)]
    into = "XOR rebuild into the restore"
    assert [r["source"] for r in restored] == ["own", "own", into, into, "own", "own"], restored
    assert {(r["step"], r["level"]) for r in restored} == {(step, "local")}, restored
    assert all(r["exact"] for r in restored)
    assert all(reports[r]["final"] == reference[6][r] for r in range(6))


ROOM_BLOCK = 4096  # the checksum block of the room cases: the ring's slots hold 8 KiB


@pytest.mark.guarantee("local-survives-node-loss", "resume-bit-identical")
@pytest.mark.parametrize("replicated", [False, True], ids=["own-state", "replicated"])
def test_a_lost_nodes_bytes_go_through_the_ring_into_room_set_aside(
        tmp_path: Path, reference, guarantees, in_memory, replicated: bool) -> None:
    """The way a restore over MPI goes for a state on a GPU with room (restore/device_room.py,
    local/ring.py), run in host memory with 4 KiB checksum blocks, so that each shard moves in
    many groups through the ring's six slots: node 1 lost, its shards come from node 0's
    partner copies through the ring into the room (a replicated model: every rank's shares
    of other nodes too), node 0's own tensors are read into it through its buffers, and the
    run ends bit-identical. Rank 2's copy out of the first group's slot is held up a second
    (a fault point): the groups that come meanwhile wait for it rather than land in a slot in
    use."""
    done, reports = crash_then_resume(tmp_path, 4, [1], redundancy="partner", per_node=2,
                                      window=WINDOW, replicated=replicated, room=ROOM_BLOCK,
                                      fault="mid-ring-copy:2:delay:0")
    finals = reference[4, replicated]
    guarantees.record(SUITE, f"ring-{'replicated' if replicated else 'own'}",
                      outcome(reports, 4, CRASH, finals), done.output[-2000:])
    restored = node_1_back_from_partners(done, reports)
    for r in range(4):  # the model staged in the room: all of it that came over MPI; of a
        # survivor's own, the tensors that lie whole in its shard (a block or more, aligned)
        least = restored[r]["model_bytes"] - (0 if r >= 2 or replicated else ROOM_BLOCK)
        assert restored[r]["room_bytes"] >= least > 0, (r, str(restored[r]))
    for r in (2, 3):  # the lost shard: many groups, so every slot of the ring used again
        if not replicated:
            assert restored[r]["network_bytes"] > 6 * 2 * ROOM_BLOCK, restored[r]
    # a replicated model: every rank gets the shares of the other node's ranks through it
    assert all((r["fetched_bytes"] > 0) == replicated for r in restored), restored
    assert all(reports[r]["final"] == finals[r] for r in range(4))


@pytest.mark.guarantee("local-survives-node-loss", "resume-bit-identical")
def test_a_lost_nodes_xor_rebuild_lands_through_the_ring_into_room_set_aside(
        tmp_path: Path, reference, guarantees, in_memory) -> None:
    """The same way for XOR (local/xorlanding.py): node 1 of three lost, the blocks its teams
    rebuild land in the ring's slots (page-locked on a thread while the transfer starts: the
    first blocks wait for them), are checked there and copied into the room, and the run ends
    bit-identical."""
    done, reports = crash_then_resume(tmp_path, 6, [1], room=ROOM_BLOCK, **XOR_3X2)
    guarantees.record(SUITE, "ring-xor", outcome(reports, 6, CRASH, reference[6]),
                      done.output[-2000:])
    assert done.returncode == 0, done.output
    restored = [reports[r]["restore"] for r in range(6)]
    into = "XOR rebuild into the restore"
    assert [r["source"] for r in restored] == ["own", "own", into, into, "own", "own"], restored
    for r in (2, 3):  # all of the lost shard's model in the room, in many blocks
        assert restored[r]["room_bytes"] >= restored[r]["model_bytes"] > 0, restored[r]
        assert restored[r]["network_bytes"] > 6 * 2 * ROOM_BLOCK, restored[r]
    assert all(reports[r]["final"] == reference[6][r] for r in range(6))


@pytest.mark.guarantee("damage-detected", "resume-bit-identical")
@pytest.mark.parametrize("room", [False, True], ids=["host", "ring"])
def test_a_damaged_copy_served_to_a_lost_node_is_named_and_root_takes_over(
        tmp_path: Path, reference, guarantees, room: bool) -> None:
    """Node 1 lost, and node 0's copy of rank 2's shard has a flipped byte: rank 2 verifies the
    bytes it received (where they landed: its buffer, or a slot of the ring), the restore names
    the file they came from, the sender and the tensor and falls back to ROOT; the run ends
    bit-identical."""
    settings: dict[str, Any] = {"redundancy": "partner", "per_node": 2}
    if room:
        settings["room"] = ROOM_BLOCK
    crashed, _ = job(tmp_path, "crash", 4, crash_after=CRASH, **settings)
    assert crashed.returncode != 0, crashed.output
    shutil.rmtree(local_of(tmp_path) / "n1")
    copy = local_of(tmp_path) / "n0" / f"step-{CRASH:08d}" / "rank-00002.h5"
    m = json.loads((copy.parent / "MANIFEST.json").read_text())
    rec = max(m["ranks"][2]["tensors"], key=lambda t: t["nbytes"])
    data = bytearray(copy.read_bytes())
    data[rec["offset"] + rec["nbytes"] // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    done, reports = job(tmp_path, "resume", 4, **settings)
    guarantees.record(SUITE, "damaged-copy-served" + ("-ring" if room else ""),
                      outcome(reports, 4, DRAINED, reference[4]), done.output[-2000:])
    assert done.returncode == 0, done.output
    assert str(copy) in done.stderr and rec["name"] in done.stderr, done.output
    assert re.search(r"checksum mismatch in block \d+ \(bytes \d+\.\.\d+\) as rank [01] sent "
                     r"it", done.stderr), done.output
    assert {reports[r]["restore"]["level"] for r in range(4)} == {"root"}
    assert all(reports[r]["final"] == reference[4][r] for r in range(4))


@pytest.mark.guarantee("local-survives-node-loss", "damage-detected")
@pytest.mark.parametrize(("redundancy", "replicated", "memory"), [
    ("partner", False, False), (None, False, False), ("partner", True, False),
    ("partner", False, True), (None, False, True)])
def test_a_corrupt_local_shard_is_rebuilt_or_falls_back_and_is_named(
        tmp_path: Path, reference, guarantees, redundancy: str | None,
        replicated: bool, memory: bool, request) -> None:
    """A flipped byte in rank 1's own local shard: rebuilt from its partner copy on the other
    node (nothing from ROOT), or without redundancy, the step falls back to ROOT; the log names
    the file and the tensor either way. ``memory``: the level in /dev/shm, where the own shards
    are verified where they lie rather than read."""
    if memory:
        request.getfixturevalue("in_memory")
    crashed, _ = job(tmp_path, "crash", 4, crash_after=CRASH, redundancy=redundancy,
                     per_node=2, replicated=replicated)
    assert crashed.returncode != 0
    shard = local_of(tmp_path) / "n0" / f"step-{CRASH:08d}" / "rank-00001.h5"
    data = bytearray(shard.read_bytes())
    m = json.loads((shard.parent / "MANIFEST.json").read_text())
    rec = max(m["ranks"][1]["tensors"], key=lambda t: t["nbytes"])
    data[rec["offset"] + rec["nbytes"] // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    done, reports = job(tmp_path, "resume", 4, redundancy=redundancy, per_node=2,
                        replicated=replicated)
    step = CRASH if redundancy else DRAINED
    finals = reference[4, replicated]
    guarantees.record(SUITE, f"corrupt-local-shard-{redundancy}"
                      + ("-replicated" if replicated else "") + ("-in-memory" if memory else ""),
                      outcome(reports, 4, step, finals), done.output[-2000:])
    assert done.returncode == 0, done.output
    assert str(shard) in done.stderr and rec["name"] in done.stderr
    restored = [reports[r]["restore"] for r in range(4)]
    assert {r["step"] for r in restored} == {step}
    if redundancy:
        assert restored[1]["source"] == "partner copy from rank 3"
        assert {r["source"] for k, r in enumerate(restored) if k != 1} == {"own"}
        assert {r["root_bytes"] for r in restored} == {0}
    else:
        assert {r["level"] for r in restored} == {"root"}
        assert "checksum mismatch" in restored[0]["skipped"][0][1]
    assert all(reports[r]["final"] == finals[r] for r in range(4))


def test_a_local_level_too_small_is_refused_on_every_rank_at_the_first_save(
        tmp_path: Path) -> None:
    done, reports = job(tmp_path, "small", 4, per_node=2, redundancy="partner",
                        local_budget=100_000, steps=10)
    assert done.returncode == 0, done.output
    for r in range(4):
        raised = reports[r]["saves"]["10"]["raised"]
        assert raised.startswith("LocalTierFull") and "Local(budget=100000)" in raised, raised
        assert "Local(keep=)" in raised
    for node in ("n0", "n1"):
        assert [p.name for p in (tmp_path / "local" / node).iterdir()] == ["OWNER.json"]
    assert not any(p.name.startswith("step-") for p in (tmp_path / "root").iterdir())


def test_redundancy_on_one_node_is_refused_at_construction(tmp_path: Path) -> None:
    """Refused on every rank; the error is printed in full once (rank 0), each other rank says
    in one line that it raised it too."""
    done, reports = job(tmp_path, "one", 4, per_node=4, redundancy="partner", steps=10)
    assert done.returncode != 0
    assert "run on one node" in done.stderr and "redundancy=None" in done.stderr
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    assert done.stderr.count("run on one node") == 1, done.stderr
    for r in (1, 2, 3):
        assert f"[rank {r}] TopologyError (raised alike on every rank; rank 0 prints it in " \
            "full)" in done.stderr, done.stderr
    assert not reports


def test_another_number_of_ranks_restores_from_root(tmp_path: Path) -> None:
    """The local level restores on as many ranks as saved it; 2 ranks reshard ROOT's newest."""
    crashed, _ = job(tmp_path, "crash", 4, crash_after=CRASH, redundancy="partner", per_node=2)
    assert crashed.returncode != 0
    done, reports = job(tmp_path, "two", 2, redundancy="partner", per_node=1, steps=DRAINED)
    assert done.returncode == 0, done.output
    restored = [reports[r]["restore"] for r in range(2)]
    assert {(r["step"], r["level"]) for r in restored} == {(DRAINED, "root")}
    assert "written by 4 ranks" in restored[0]["skipped"][0][1]


@pytest.mark.guarantee("local-survives-node-loss")
def test_a_root_that_cannot_be_read_does_not_stop_a_restart_from_the_nodes(
        tmp_path: Path, reference) -> None:
    """ROOT exists but cannot be listed (mode 000, the job without root's power over file
    permissions), as when the parallel file system is down: the job restores step 40 from the
    nodes, says that ROOT cannot be used, trains on with every save protected on the nodes and
    every drain failing loudly. With the nodes empty too, it refuses a fresh start."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE")
    crashed, _ = job(tmp_path, "crash", 4, crash_after=CRASH, redundancy="partner", per_node=2)
    assert crashed.returncode != 0
    root = tmp_path / "root"
    root.chmod(0)
    try:
        done, reports = job(tmp_path, "resume", 4, prefix=["setpriv", *NO_DAC],
                            redundancy="partner", per_node=2)
        assert done.returncode == 0, done.output
        assert {(reports[r]["restore"]["step"], reports[r]["restore"]["level"])
                for r in range(4)} == {(CRASH, "local")}
        assert all(reports[r]["final"] == reference[4][r] for r in range(4))
        assert all(s["committed"] and s["level"] == "local"
                   for r in range(4) for s in reports[r]["saves"].values())
        assert reports[0]["drained"] is None
        assert "ROOT cannot be used" in done.stderr and "Permission denied" in done.stderr
        assert "the drain of step 60 to ROOT failed" in done.stderr
        for node in ("n0", "n1"):
            shutil.rmtree(local_of(tmp_path) / node)
        done, _ = job(tmp_path, "empty", 4, prefix=["setpriv", *NO_DAC],
                      redundancy="partner", per_node=2)
        assert done.returncode != 0
        assert "refusing to start afresh while ROOT may hold checkpoints" in done.stderr
    finally:
        root.chmod(0o755)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000030"]


def test_a_save_at_once_after_a_lost_nodes_restore_neither_hangs_nor_crashes(tmp_path):
    """The restore writes the rebuilt shards back on the save thread; the first save's checks
    ran beside it on the same communicator (5 of 5 such jobs hung, aborted or failed MPI)."""
    script = str(SCENARIOS / "levels_resume.py")
    root, local, out = tmp_path / "root", tmp_path / "local", tmp_path / "out"
    out.mkdir()
    first = run_mpi(4, [script, "save", str(root), str(local), str(out)], timeout=120)
    assert first.returncode != 0, first.output  # every rank killed itself after step 3
    shutil.rmtree(local / "n1")  # the lost node
    job = run_mpi(4, [script, "resume", str(root), str(local), str(out)], timeout=120)
    assert job.returncode == 0, job.output
    seen = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    assert seen == [{"start": 3, "restored": True, "level": "local", "saved": True}] * 4, seen
