"""mpickpt.format.records: the torch-free half of the shard format, and the dtype table it holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mpickpt.errors import ShardError
from mpickpt.format import dtypes, reader, records, shard


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_the_torch_free_table_agrees_with_torch_and_numpy():
    assert list(records.DTYPES) == dtypes.names()  # every name this torch has, in order
    for name, (size, storage) in records.DTYPES.items():
        assert records.itemsize(name) == size == dtypes.itemsize(name)
        assert torch.empty(0, dtype=dtypes.torch_dtype(name)).element_size() == size, name
        assert np.dtype(storage).itemsize == size and dtypes.storage_dtype(name) == storage
    with pytest.raises(KeyError):
        records.itemsize("float128")


def test_the_shard_module_names_the_records_objects_themselves():
    for name in ("TensorRecord", "check_records", "check_file", "FORMAT", "VERSION",
                 "TENSORS_GROUP"):
        assert getattr(shard, name) is getattr(records, name), name


def test_check_records_refuses_an_unknown_dtype(tmp_path):
    r = records.TensorRecord("x", "float128", [2], 0, 32, ["0"])
    with pytest.raises(ShardError, match="unknown dtype 'float128'"):
        records.check_records(0, str(tmp_path / "f"), [r], 64, 1 << 20)


def heavy_modules_after(imports: str, heavy: tuple[str, ...]) -> list[str]:
    """Which of ``heavy`` a fresh interpreter holds after ``import`` of ``imports``."""
    code = (f"import json, sys, {imports}; "
            f"print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_records_and_manifest_import_without_torch_numpy_or_h5py():
    imports = ("mpickpt.format.records, mpickpt.format.manifest, mpickpt.format.entry, "
               "mpickpt.format.names, mpickpt.format.rootdir")
    assert heavy_modules_after(imports, ("torch", "numpy", "h5py", "mpi4py")) == []


def test_the_block_reader_imports_without_torch_numpy_or_h5py():
    heavy = ("torch", "numpy", "h5py", "mpi4py", "ctypes")
    assert heavy_modules_after("mpickpt.format.blocks", heavy) == []


@pytest.mark.parametrize("direct", [False, True])
def test_one_block_reader_streams_or_reads_in_place_with_the_same_verdict(tmp_path, direct):
    """The CLI streams a block through a buffer smaller than it, restore reads it into place:
    the same bytes verified, the same sentence at a mismatch."""
    import mmap

    from mpickpt.format.blocks import BlockFile

    block = 1 << 16
    t = {"big": torch.arange(100_000, dtype=torch.float32), "empty": torch.empty(0)}
    path = str(tmp_path / "s.h5")
    w = shard.ShardWriter(path, t, {"tree": "{}"})
    w.write(t, block=block, threads=2)
    size = w.seal()
    big, empty = (next(r for r in w.records if r.name == n) for n in ("big", "empty"))
    whole = memoryview(mmap.mmap(-1, 2 * block))  # page-aligned: O_DIRECT where it can
    small = memoryview(bytearray(10_000))  # a block in 7 pieces, the last one short
    with BlockFile(0, path, size, block, direct=direct) as f:
        assert f.read_block(empty, 0, small) == 0
        got = bytearray()
        for b in range(len(big.checksums)):
            n = f.read_block(big, b, whole)
            got += whole[:n]
            assert f.read_block(big, b, small) == n
        assert bytes(got) == t["big"].numpy().tobytes()
    fd = os.open(path, os.O_RDWR)
    at = big.offset + 5 * block + 12_345  # in block 5, in the streaming's second piece
    os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 1]), at)
    os.close(fd)
    where = big.offset + 5 * block
    msg = (f"rank 2: {path}: tensor 'big': checksum mismatch in block 5 "
           f"(bytes {where}..{where + block}): the data is corrupt")
    with BlockFile(2, path, size, block, direct=direct) as f:
        for buf in (whole, small):
            with pytest.raises(ShardError) as e:
                f.read_block(big, 5, buf)
            assert str(e.value) == msg
        f.read_block(big, 4, small)
    with pytest.raises(ShardError) as e:
        reader.read_shard(2, path, w.records, size, block=block)
    assert str(e.value) == msg
