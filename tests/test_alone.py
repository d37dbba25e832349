"""A process that no launcher started runs alone: no communication, MPI never started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpickpt.mpi.backend import MPI_LAUNCHER_VARS, PEER_VARS
from mpickpt.mpi.selfcomm import SelfComm

PY = sys.executable


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (*MPI_LAUNCHER_VARS, *PEER_VARS, "SLURM_STEP_NUM_TASKS",
                        "MPICKPT_BACKEND")}
    return {**env, **extra}


def _backend_in(env: dict[str, str]) -> str:
    out = subprocess.run([PY, "-c", "from mpickpt.mpi.backend import backend; print(backend())"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


@pytest.mark.quick
def test_a_process_alone_takes_no_communication_and_any_launcher_sign_takes_mpi() -> None:
    assert _backend_in(_clean_env()) == "self"
    # an MPI launcher's variables, a Slurm step of several tasks, or a torch launcher's
    # partial variables: not alone (MPI, as before, finds the peers or says it has none)
    assert _backend_in(_clean_env(PMI_RANK="0", PMI_SIZE="2")) == "mpi"
    assert _backend_in(_clean_env(PALS_RANKID="0")) == "mpi"
    assert _backend_in(_clean_env(SLURM_STEP_NUM_TASKS="4")) == "mpi"
    assert _backend_in(_clean_env(SLURM_STEP_NUM_TASKS="1")) == "self"
    assert _backend_in(_clean_env(LOCAL_RANK="0")) == "mpi"
    assert _backend_in(_clean_env(MPICKPT_BACKEND="mpi")) == "mpi"


SAVE_ALONE = r"""
import sys, torch, mpickpt
root = sys.argv[1]
torch.manual_seed(0)
m = torch.nn.Linear(64, 32)
o = torch.optim.Adam(m.parameters())
m(torch.randn(8, 64)).sum().backward()
o.step()
ck = mpickpt.Checkpointer(root, keep=2)
assert type(ck._proto.comm).__name__ == "SelfComm", type(ck._proto.comm)
ck.save(1, {"model": m, "optim": o}).wait()
m(torch.randn(8, 64)).sum().backward()
o.step()
ck.save(2, {"model": m, "optim": o}).wait()
assert not ck.should_exit(2)
ref = {k: v.clone() for k, v in m.state_dict().items()}
with torch.no_grad():
    for p in m.parameters():
        p.zero_()
assert ck.restore({"model": m, "optim": o}) == 2
assert all(torch.equal(ref[k], v) for k, v in m.state_dict().items())
ck.close()
torch.save(ref, root + "/ref.pt")
assert "mpi4py.MPI" not in sys.modules, "MPI was started"
print("ALONE OK")
"""

RESTORE_MPI = r"""
import sys, torch, mpickpt
from mpi4py import MPI
root = sys.argv[1]
m = torch.nn.Linear(64, 32)
o = torch.optim.Adam(m.parameters())
ck = mpickpt.Checkpointer(root, keep=2)
assert type(ck._proto.comm).__name__ == "MpiComm", type(ck._proto.comm)
assert ck.restore({"model": m, "optim": o}) == 2
ref = torch.load(root + "/ref.pt", weights_only=True)
assert all(torch.equal(ref[k], v) for k, v in m.state_dict().items())
ck.close()
print("MPI OK")
"""


def test_a_process_alone_saves_and_restores_without_mpi_and_mpi_reads_it(
        tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = subprocess.run([PY, "-c", SAVE_ALONE, str(root)], env=_clean_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ALONE OK" in out.stdout, out.stdout + out.stderr
    # the same checkpoint, restored by a process that started MPI: one format, either way
    out = subprocess.run([PY, "-c", RESTORE_MPI, str(root)], env=_clean_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "MPI OK" in out.stdout, out.stdout + out.stderr


def test_the_one_rank_communicator_copies_what_it_gives_and_matches_its_own_messages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPICKPT_TIMEOUT", "0.3")  # how long a receive never sent is waited for
    comm = SelfComm().dup()
    entry = {"step": 3, "tensors": [1, 2]}
    got = comm.igather(entry, 0)
    assert got.test() and got.result() == [entry]
    got.result()[0]["tensors"].append(9)  # what was "received" is not the sender's object
    assert entry["tensors"] == [1, 2]
    assert comm.ialltoall([entry]).result() == [entry]
    recv = np.zeros(2, dtype=np.int64)
    assert comm.iallreduce(np.array([4, -1], dtype=np.int64), recv, "max").test()
    assert recv.tolist() == [4, -1]
    # a receive completes once its tag was sent, with the sent bytes
    buf = np.zeros(4, dtype=np.uint8)
    r = comm.irecv(buf, 0, 7)
    assert not r.test()
    assert comm.waitall([r]) is not None  # never sent: an error after the timeout
    comm.isend(np.arange(4, dtype=np.uint8), 0, 7)
    assert r.test() and buf.tolist() == [0, 1, 2, 3]
    comm.post({"a": 1}, 0, 5)
    assert comm.take(5) == (0, {"a": 1}) and comm.take(5) is None
    with pytest.raises(ValueError, match="rank 1 in a job of one rank"):
        comm.isend(buf, 1, 7)


def test_mpickpt_run_alone_where_mpi_cannot_load_runs_the_program(tmp_path: Path) -> None:
    """An mpi4py whose MPI cannot load (its wheel without an MPI library): the wrapper, alone,
    runs the program without MPI instead of dying in MPI's start."""
    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("class _RC:\n    initialize = True\nrc = _RC()\n")
    (fake / "MPI.py").write_text('raise RuntimeError("no MPI library (this test)")\n')
    env = _clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH",
                                                                                "")]))
    out = subprocess.run([PY, "-m", "mpickpt.run", "-c", "import mpickpt; print('RAN',"
                          " mpickpt.backend())"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "RAN self" in out.stdout, out.stdout + out.stderr


def test_a_receive_started_before_its_send_completes_when_the_send_comes() -> None:
    """As MPI's Waitall: a receive this rank waits for in one thread completes once another
    thread sends it (the protocol starts some receives before their sends)."""
    import threading

    comm = SelfComm()
    buf = np.zeros(3, dtype=np.uint8)
    r = comm.irecv(buf, 0, 9)
    done: list[str | None] = []
    waiter = threading.Thread(target=lambda: done.append(comm.waitall([r])))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # still waiting: nothing was sent
    comm.isend(np.array([7, 8, 9], dtype=np.uint8), 0, 9)
    waiter.join(30)
    assert done == [None] and buf.tolist() == [7, 8, 9]


def test_a_torch_group_of_several_ranks_already_up_is_not_alone(tmp_path: Path) -> None:
    """Workers a script spawned itself, in a torch.distributed group of two set up without the
    launchers' variables: not alone (each would otherwise write as rank 0 of 1)."""
    code = r"""
import sys, torch.distributed as dist, torch.multiprocessing as mp
def work(rank, path):
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
    from mpickpt.mpi.backend import alone
    import os
    # one write per line: unbuffered (PYTHONUNBUFFERED), print() writes each part apart and
    # the two workers' lines interleave on the shared pipe
    os.write(1, f"ALONE {rank} {alone(dict(os.environ))}\n".encode())
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1],), nprocs=2)
"""
    script = tmp_path / "spawned.py"
    script.write_text(code)
    out = subprocess.run([PY, str(script), str(tmp_path / "rendezvous")], env=_clean_env(),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(x for x in out.stdout.splitlines() if x.startswith("ALONE")) == [
        "ALONE 0 False", "ALONE 1 False"], out.stdout
