"""format/shard.py: ``size_bound`` is at least the bytes of a real shard file, whatever the
number, sizes and names of its tensors, the tree and the alignment (the node-local level's
budget is checked against it), and not far above it for a small state (the estimate it replaced
took 1 MiB a file and 1 MiB a tensor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mpickpt.format.shard import ShardWriter, size_bound

CASES = [  # (tensors, elements each, name length, alignment)
    (0, 0, 8, 1 << 20), (1, 3, 8, 1 << 20), (10, 3, 8, 1 << 20), (300, 3, 8, 1 << 20),
    (3000, 1, 1, 1 << 20),
    (100, 3, 200, 1 << 20), (40, 1000, 30, 4096), (10, 300_000, 8, 1 << 20),
    (12, 262_145, 60, 1 << 20), (5, 300_000, 8, 4096)]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}-name{c[2]}-a{c[3]}" for c in CASES])
def test_a_shard_is_never_larger_than_its_bound(tmp_path: Path, case: tuple) -> None:
    count, elements, name, alignment = case
    tensors = {f"{'n' * name}/{i}": torch.rand(elements) for i in range(count)}
    tree = json.dumps({"items": [[k, {"name": k, "type": "tensor"}] for k in tensors]})
    attrs = {"rank": 3, "step": 12, "world_size": 8, "tree": tree}
    w = ShardWriter(str(tmp_path / "s.h5"), tensors, attrs, alignment=alignment)
    w.write(tensors, block=1 << 20, threads=1)
    size = w.seal()
    assert size == (tmp_path / "s.h5").stat().st_size
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    bound = size_bound(nbytes, count, len(tree.encode()), alignment=alignment)
    assert size <= bound, (size, bound)
    if nbytes < alignment:  # a small state: within 4x its size and 128 kB
        assert bound <= 4 * size + (128 << 10), (size, bound)
