"""mpickpt.dcp, DCP's save/async_save/load with checkpoint_id, under mpiexec and under torchrun
(tests/scenarios/dcp_api.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from harness import SCENARIOS, launcher

SCENARIO = str(SCENARIOS / "dcp_api.py")


@pytest.mark.guarantee("failed-save-aborts")
@pytest.mark.parametrize("how", ["mpi", pytest.param("torchrun", marks=pytest.mark.quick)],
                         ids=["mpiexec", "torchrun"])
def test_dcp_shaped_functions_save_replace_refuse_and_load(tmp_path: Path, how: str) -> None:
    p = subprocess.run([*launcher(how, 2), SCENARIO, str(tmp_path / "f"), str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=240, start_new_session=True)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    for r in range(2):
        rep = json.loads((tmp_path / "r" / f"rank-{r}.json").read_text())
        assert rep["async"] and rep["save"] and rep["again"], rep
        assert "step-00000001" in rep["listing"], rep  # the id's second save, a step of its own
        assert rep["failed"].startswith("SaveAborted: checkpoint of step 2 aborted: rank 1: "
                                        "FaultInjected"), rep
        assert rep["load-10"] and rep["load-20"] and rep["load-30"], rep  # 30: its 2nd save
        assert rep["missing"].startswith("FileNotFoundError: mpickpt.dcp.load: no committed "
                                          "checkpoint in "), rep
        assert rep["pickle"].startswith("StateTreeError: state[fn]: cannot save an object of "
                                        "type function; use tensors"), rep
        assert rep["writer"].startswith("ValueError: mpickpt.dcp: storage_writer= is DCP's"), rep
