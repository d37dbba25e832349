"""mpickpt/local/xorlanding.py: a lost shard's bytes, coming in file order a block at a time, land
in the restore's spans and every checksum block is checked on the way."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from mpickpt.errors import ShardError
from mpickpt.format import checksum
from mpickpt.format.entry import RankEntry
from mpickpt.format.reader import Span
from mpickpt.format.records import TensorRecord
from mpickpt.local.xorlanding import XorLanding, landable_shard

BLOCK = 4096


def shard(sizes: list[int], gap: int = 512, seed: int = 0
          ) -> tuple[np.ndarray, list[TensorRecord]]:
    """A shard file's bytes: records of ``sizes`` bytes with ``gap`` bytes of other things
    between them, and their records."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, sum(sizes) + gap * (len(sizes) + 1), dtype=np.uint8)
    records, at = [], gap
    for i, n in enumerate(sizes):
        body = data[at:at + n]
        sums = [checksum.digest(body[b:b + BLOCK].tobytes()) for b in range(0, n, BLOCK)]
        records.append(TensorRecord(f"t{i}", "uint8", [n], at, n, sums))
        at += n + gap
    return data, records


def feed(landing: XorLanding, data: np.ndarray, pieces: list[int]) -> None:
    """The file's bytes (zeros past them) to ``landing`` as a ring gives them: four posted
    ahead, in order."""
    data = np.concatenate([data, np.zeros(sum(pieces), np.uint8)])
    at, posted = 0, []
    for n in pieces:
        posted.append((landing.into(at, n), at, n))
        at += n
        if len(posted) > 3:
            view, a, k = posted.pop(0)
            view[:] = data[a:a + k]
            landing.arrived()
    for view, a, k in posted:
        view[:] = data[a:a + k]
        landing.arrived()


def fresh(n: int) -> list[Callable[[], torch.Tensor]]:
    return [lambda: torch.empty(8 * BLOCK, dtype=torch.uint8) for _ in range(n)]


def cuts(total: int, seed: int) -> list[int]:
    rng, out = random.Random(seed), []
    while total > 0:
        out.append(min(total, rng.choice([1000, 3000, BLOCK, 7 * BLOCK + 5])))
        total -= out[-1]
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_span_lands_whole_through_a_few_buffers(seed: int) -> None:
    """Spans of whole records and pieces of records (on checksum block boundaries) get their
    bytes, blocks of any size straddling them; five buffers are used again and again."""
    data, recs = shard([10 * BLOCK + 77, 3 * BLOCK, 5], seed=seed)
    spans = [Span(recs[0], 0, recs[0].nbytes, torch.zeros(recs[0].nbytes, dtype=torch.uint8)),
             Span(recs[1], BLOCK, 3 * BLOCK, torch.zeros(2 * BLOCK, dtype=torch.uint8)),
             Span(recs[2], 0, 5, torch.zeros(5, dtype=torch.uint8))]
    bufs = [torch.empty(8 * BLOCK, dtype=torch.uint8) for _ in range(5)]
    landing = XorLanding(3, "/x/rank-00003.h5", len(data), spans, BLOCK,
                         [lambda b=b: b for b in bufs])
    done = threading.Event()

    def ring() -> None:
        feed(landing, data, cuts(len(data) + 3000, seed))  # (past the end: a chunk's zeros)
        done.set()

    # four blocks posted ahead, one in use: into() may wait for the landing to free one
    t = threading.Thread(target=ring)
    t.start()
    t.join(30)
    assert done.is_set()
    assert landing.finish() is None
    for s in spans:
        lo = s.record.offset + s.lo
        assert bytes(s.dest.numpy()) == data[lo:lo + s.nbytes].tobytes(), s.record.name
    assert landing.received == len(data)


def test_a_buffer_is_asked_for_only_when_no_used_one_is_free() -> None:
    """The first block waits for one buffer (they may be page-locked one at a time); one given
    back is used again before another is asked for."""
    data, recs = shard([6 * BLOCK])
    rec = recs[0]
    asked: list[int] = []

    def buffer(i: int) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            asked.append(i)
            return torch.empty(2 * BLOCK, dtype=torch.uint8)
        return make

    dest = torch.zeros(rec.nbytes, dtype=torch.uint8)
    landing = XorLanding(1, "/n1/rank-00001.h5", len(data), [Span(rec, 0, rec.nbytes, dest)],
                         BLOCK, [buffer(i) for i in range(4)])
    view = landing.into(0, BLOCK)
    assert asked == [0]
    view[:] = data[:BLOCK]
    second = landing.into(BLOCK, BLOCK)  # the first still not arrived: a second buffer
    assert asked == [0, 1]
    landing.arrived()
    second[:] = data[BLOCK:2 * BLOCK]
    landing.arrived()
    landing._worker.submit(lambda: None).result()  # (both used: their buffers given back)
    at = 2 * BLOCK
    while at < len(data):
        n = min(BLOCK, len(data) - at)
        landing.into(at, n)[:] = data[at:at + n]
        landing.arrived()
        landing._worker.submit(lambda: None).result()
        at += n
    assert landing.finish() is None
    assert set(asked) == {0, 1}, "a fresh buffer was asked for while a used one was free"
    assert bytes(dest.numpy()) == data[rec.offset:rec.offset + rec.nbytes].tobytes()


def test_a_buffer_is_swapped_for_its_page_locked_twin_once_there_is_one() -> None:
    """A lost member's landing starts in ordinary buffers and lands the blocks after in each
    buffer's twin once the ring has made it (copied into the GPU from ordinary pages, its blocks
    were used more slowly than the ring brought them); every byte still lands."""
    data, recs = shard([6 * BLOCK])
    rec = recs[0]
    plain = torch.empty(BLOCK, dtype=torch.uint8)
    twin = torch.empty(BLOCK, dtype=torch.uint8)
    made = threading.Event()
    dest = torch.zeros(rec.nbytes, dtype=torch.uint8)
    landing = XorLanding(1, "/n1/rank-00001.h5", len(data), [Span(rec, 0, rec.nbytes, dest)],
                         BLOCK, [lambda: twin if made.is_set() else plain])
    used = []
    at = 0
    while at < len(data):
        n = min(BLOCK, len(data) - at)
        view = landing.into(at, n)
        used.append(view.ctypes.data)
        view[:] = data[at:at + n]
        landing.arrived()
        if at >= 2 * BLOCK:
            made.set()  # the twin made while the third block was used
        at += n
    assert landing.finish() is None
    assert used[:3] == [plain.data_ptr()] * 3 and twin.data_ptr() in used[3:], used
    assert bytes(dest.numpy()) == data[rec.offset:rec.offset + rec.nbytes].tobytes()


@pytest.mark.parametrize("where", ["first block", "block straddled", "last short block"])
def test_a_damaged_byte_is_named_by_its_tensor_and_block(where: str) -> None:
    data, recs = shard([6 * BLOCK + 100])
    rec = recs[0]
    at = {"first block": 10, "block straddled": 3 * BLOCK + 1,
          "last short block": 6 * BLOCK + 50}[where]
    bad = data.copy()
    bad[rec.offset + at] ^= 0x40
    dest = torch.zeros(rec.nbytes, dtype=torch.uint8)
    landing = XorLanding(2, "/n1/rank-00002.h5", len(data), [Span(rec, 0, rec.nbytes, dest)],
                      BLOCK, fresh(6))
    feed(landing, bad, cuts(len(bad), 7))
    err = landing.finish()
    assert isinstance(err, ShardError), err
    text = str(err)
    assert "rank-00002.h5" in text and "'t0'" in text, text
    assert f"checksum mismatch in block {at // BLOCK} " in text, text


def test_bytes_that_never_came_are_said() -> None:
    data, recs = shard([4 * BLOCK])
    rec = recs[0]
    landing = XorLanding(0, "/n0/rank-00000.h5", len(data),
                      [Span(rec, 0, rec.nbytes, torch.zeros(rec.nbytes, dtype=torch.uint8))],
                      BLOCK, fresh(6))
    feed(landing, data[:rec.offset + 2 * BLOCK], [rec.offset + 2 * BLOCK])
    err = landing.finish()
    assert isinstance(err, ShardError) and f"only {2 * BLOCK} of the {4 * BLOCK}" in str(err)


def test_only_uncompressed_records_of_the_shards_own_file_land() -> None:
    _, recs = shard([BLOCK, BLOCK])
    entry = RankEntry(0, "rank-00000.h5", 3 * BLOCK, {}, recs)
    assert landable_shard(entry)
    recs[1].source = "step-00000001/rank-00000.h5"
    assert not landable_shard(entry)
    recs[1].source, recs[1].codec = None, "zstd"
    assert not landable_shard(entry)
