"""mpickpt.format.h5template: a layout's HDF5 metadata made once, written again with each save's
values, byte for byte what HDF5 itself writes."""

from __future__ import annotations

import json
import os

import h5py
import pytest
import torch

from mpickpt.format import h5layout, h5template, reader, shard
from mpickpt.format.h5image import MetadataImage
from mpickpt.format.h5template import Templates, build, tree_capacity

BLOCK = 1 << 16
ALIGN = 1 << 16


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(200_000, generator=g),  # 13 blocks, aligned
        "model.b": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "optim.step": torch.tensor(3.0),
        "empty": torch.empty(0, 4),
    }


def attrs(step: int, tree: dict) -> dict:
    return {"rank": 2, "step": step, "world_size": 4, "tree": json.dumps(tree)}


def hdf5_runs(tensors, a, sums, capacity):
    """What HDF5 writes for these values, the tree padded as the template pads it."""
    image = MetadataImage()
    layout = h5layout.Layout(image, alignment=ALIGN)
    raw = a["tree"].encode()
    layout.add(tensors, {**a, "tree": (raw + b" " * (capacity - len(raw))).decode()})
    for r, s in zip(layout.records, sums, strict=True):
        r.checksums = s
    layout.seal()
    return list(image.extents([(r.offset, r.nbytes) for r in layout.records if r.nbytes]))


def test_a_rendered_layout_is_byte_for_byte_what_hdf5_writes(tensors):
    t = build(tensors, attrs(1, {"a": 1}), alignment=ALIGN, block=BLOCK)
    assert t is not None
    for step, tree, salt in ((7, {"a": 1}, "0"), (2**40 + 5, {"a": [1, 2, 3], "é": "x"}, "f")):
        a = attrs(step, tree)
        sums = [[(salt + str(i) + format(b, "x")).ljust(16, "9")[:16]
                 for b in range(max(1, -(-r.nbytes // BLOCK)))]
                for i, r in enumerate(t.records)]
        capacity = tree_capacity(len(a["tree"].encode()))
        assert t.render(step, a["tree"], sums) == hdf5_runs(tensors, a, sums, capacity)


def test_a_templated_shard_reads_back_in_h5py_with_this_saves_values(tmp_path, tensors):
    templates = Templates()
    for step in (10, 20):
        tree = {"type": "dict", "step": step, "pad": "x" * step}
        a = attrs(step, tree)
        t = templates.get(tensors, a, alignment=ALIGN, block=BLOCK)
        assert t is not None
        path = str(tmp_path / f"s{step}.h5")
        w = shard.ShardWriter(path, tensors, a, alignment=ALIGN, block=BLOCK, template=t)
        w.write(tensors, block=BLOCK, threads=2)
        size = w.seal()
        assert size == os.path.getsize(path)
        with h5py.File(path) as f:
            assert f.attrs["step"] == step and f.attrs["rank"] == 2
            assert f.attrs["world_size"] == 4 and f.attrs["mpickpt_format"] == "mpickpt-shard"
            assert json.loads(f.attrs["tree"]) == tree
            for r in w.records:
                ds = f[h5layout.dataset_path(r.name)]
                assert ds.attrs["xxh3_64"] == ",".join(r.checksums)
                assert ds.attrs["torch_dtype"] == r.dtype
                assert list(ds.attrs["shape"]) == list(tensors[r.name].shape)
                if r.nbytes:
                    assert ds.id.get_offset() == r.offset
            raw = torch.from_numpy(f["tensors/model.w"][:])
            assert torch.equal(raw, tensors["model.w"])
        back = reader.read_shard(2, path, w.records, size, block=BLOCK, threads=2)
        for name, t in tensors.items():
            assert torch.equal(back[name], t), name


def test_the_same_layout_is_built_once_and_a_changed_one_again(tensors):
    templates = Templates()
    first = templates.get(tensors, attrs(1, {}), alignment=ALIGN, block=BLOCK)
    assert templates.get(tensors, attrs(2, {"b": 1}), alignment=ALIGN, block=BLOCK) is first
    grown = {**tensors, "model.w": torch.zeros(300_000)}
    other = templates.get(grown, attrs(3, {}), alignment=ALIGN, block=BLOCK)
    assert other is not None and other is not first
    long_tree = {"x": "y" * tree_capacity(10)}  # past the padded room: another layout
    longer = templates.get(tensors, attrs(4, long_tree), alignment=ALIGN, block=BLOCK)
    assert longer is not None and longer is not first
    # at most KEEP kept: the first, used least lately, is gone
    assert templates.get(tensors, attrs(5, {}), alignment=ALIGN, block=BLOCK) is not first


def test_a_layout_whose_bytes_are_not_its_values_is_never_templated(monkeypatch, tensors):
    """HDF5 writing anything that changes from one layout to the next (here, an attribute of
    random bytes) fails the check, and the writer lays such a shard out through HDF5."""
    add = h5layout.Layout.add

    def noisy(self, t, a, group=None):
        add(self, t, {**a, "noise": os.urandom(8).hex()}, group)

    monkeypatch.setattr(h5layout.Layout, "add", noisy)
    assert build(tensors, attrs(1, {}), alignment=ALIGN, block=BLOCK) is None


def test_a_layout_holding_a_value_twice_is_never_templated(monkeypatch, tensors):
    """HDF5 keeping a second copy of a value (here, the tree in another attribute): a render
    would write this save's value at one place and leave the other stale, so no template."""
    add = h5layout.Layout.add

    def twice(self, t, a, group=None):
        add(self, t, {**a, "tree_again": a["tree"]}, group)

    monkeypatch.setattr(h5layout.Layout, "add", twice)
    assert build(tensors, attrs(1, {}), alignment=ALIGN, block=BLOCK) is None


def test_values_are_found_in_any_order_across_runs():
    """The search starts where the last value was found and goes round to the start."""
    runs = [(0, b"..BB..AA"), (4096, b"CC.."), (8192, b"DD")]
    assert h5template._places(runs, [b"AA", b"BB", b"DD", b"CC"]) == [
        (0, 6, 2), (0, 2, 2), (2, 0, 2), (1, 0, 2)]
    assert h5template._places(runs, [b"AA", b"EE"]) is None


def test_a_value_of_another_length_is_refused(tensors):
    t = build(tensors, attrs(1, {}), alignment=ALIGN, block=BLOCK)
    assert t is not None
    sums = [["0" * 16] * max(1, -(-r.nbytes // BLOCK)) for r in t.records]
    sums[0][0] = "0" * 15
    with pytest.raises(ValueError, match="bytes where the layout has"):
        t.render(1, "{}", sums)


def test_the_tree_room_is_a_power_of_two():
    assert tree_capacity(0) == h5template.MIN_TREE
    assert tree_capacity(300) == 512 and tree_capacity(512) == 512 and tree_capacity(513) == 1024
