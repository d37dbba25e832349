"""mpickpt.records: the torch-free half of the shard format, and the dtype table it holds."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mpickpt import dtypes, records, shard
from mpickpt.errors import ShardError


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_the_torch_free_table_agrees_with_torch_and_numpy():
    assert list(records.DTYPES) == dtypes.names()  # every name this torch has, in order
    for name, (size, storage) in records.DTYPES.items():
        assert records.itemsize(name) == size == dtypes.itemsize(name)
        assert torch.empty(0, dtype=dtypes.torch_dtype(name)).element_size() == size, name
        assert np.dtype(storage).itemsize == size and dtypes.storage_dtype(name) == storage
    with pytest.raises(KeyError):
        records.itemsize("float128")


def test_the_old_import_paths_are_the_same_objects():
    for name in ("TensorRecord", "check_records", "check_file", "FORMAT", "VERSION",
                 "TENSORS_GROUP"):
        assert getattr(shard, name) is getattr(records, name), name
    from mpickpt.manifest import TensorRecord

    assert TensorRecord is records.TensorRecord


def test_check_records_refuses_an_unknown_dtype(tmp_path):
    r = records.TensorRecord("x", "float128", [2], 0, 32, ["0"])
    with pytest.raises(ShardError, match="unknown dtype 'float128'"):
        records.check_records(0, str(tmp_path / "f"), [r], 64, 1 << 20)


def test_records_and_manifest_import_without_torch_numpy_or_h5py():
    code = ("import sys, mpickpt.records, mpickpt.manifest, mpickpt.layout; "
            "print(sorted(m for m in ('torch', 'numpy', 'h5py', 'mpi4py') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
