"""Block checksums: xxh3-64 of each fixed-size block of a tensor's bytes.

Blocks (64 MiB by default) let several threads hash and write one large tensor in parallel and let
verification name the damaged range. xxhash releases the GIL, so threads scale.
"""

from __future__ import annotations

import xxhash

ALGORITHM = "xxh3_64"
DEFAULT_BLOCK = 64 << 20


def block_count(nbytes: int, block: int) -> int:
    return max(1, -(-nbytes // block))


def hasher() -> xxhash.xxh3_64:
    """A running xxh3-64: ``update`` it with a block's bytes in order; ``hexdigest`` is then
    :func:`digest` of the whole block."""
    return xxhash.xxh3_64()


def digest(buf: memoryview | bytes) -> str:
    """Hex xxh3-64 of one block."""
    return xxhash.xxh3_64_hexdigest(buf)
