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


def test_the_one_rank_communicator_copies_what_it_gives_and_matches_its_own_messages() -> None:
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
    assert comm.waitall([r]) is not None  # never sent: an error, not a hang
    comm.isend(np.arange(4, dtype=np.uint8), 0, 7)
    assert r.test() and buf.tolist() == [0, 1, 2, 3]
    comm.post({"a": 1}, 0, 5)
    assert comm.take(5) == (0, {"a": 1}) and comm.take(5) is None
    with pytest.raises(ValueError, match="rank 1 in a job of one rank"):
        comm.isend(buf, 1, 7)
