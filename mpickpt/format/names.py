"""The names of the files in a checkpoint directory, and the patterns that recognise them.

A rank's shard is ``rank-RRRRR.h5``, a node's (``Files(per="node")``) ``node-NNNNN.h5``, either
in a sub-directory ``shards-NNNN/`` once a checkpoint has more than :data:`FANOUT` of them; the
index parts are ``index/rank-RRRRR.json`` (``index/part-NNNN/...`` past :data:`FANOUT`), and
the records of the tensors every rank holds alike ``index/replicated.json``; an
incremental record's source is ``step-XXXXXXXX/`` and a shard's name. Every parser and writer
names files through here; none slices a name.
"""

from __future__ import annotations

import re

# a shard file relative to its checkpoint directory: a rank's own, or a node's (its ranks' regions),
# in a sub-directory when the checkpoint has more files than FANOUT
SHARD_RE = re.compile(r"^(?:shards-\d{4,}/)?(rank|node)-(\d{5,})\.h5$")
RANK_FILE_RE = re.compile(r"^rank-(\d{5,})\.h5$")  # a rank's own shard, by its file name alone
SOURCE_RE = re.compile(r"^step-(\d{8,})/((?:shards-\d{4,}/)?(?:rank|node)-\d{5,}\.h5)$")
INDEX_DIR = "index"
INDEX_RE = re.compile(r"^index/(?:part-\d{4,}/)?(rank|node)-(\d{5,})\.json$")
FANOUT = 1024  # files per directory, at most: more go into sub-directories of this many
# the records of the tensors every rank holds alike (DDP), written once by rank 0 at the commit
REPLICATED_PART = f"{INDEX_DIR}/replicated.json"


def _fanned(name: str, n: int, count: int, fanout: int, group: str) -> str:
    """``name``, in sub-directory ``{group}-NNNN/`` (the ``n // fanout``-th) when there are more
    than ``fanout`` files of its kind."""
    return name if count <= fanout else f"{group}-{n // fanout:04d}/{name}"


def shard_name(rank: int, world: int = 1, fanout: int = FANOUT) -> str:
    """Rank ``rank``'s own shard of a checkpoint of ``world`` ranks, relative to its directory."""
    return _fanned(f"rank-{rank:05d}.h5", rank, world, fanout, "shards")


def node_name(node: int, nodes: int, fanout: int = FANOUT) -> str:
    """Node ``node``'s shard (``files="per-node"``: the regions of the node's ranks)."""
    return _fanned(f"node-{node:05d}.h5", node, nodes, fanout, "shards")


def source_step(source: str) -> int | None:
    """The step of an incremental record's source file, or None for a name that is not
    ``step-XXXXXXXX/rank-XXXXX.h5`` (a path elsewhere, ``..``, an absolute path)."""
    m = SOURCE_RE.match(source)
    return int(m.group(1)) if m else None


def index_name(rank: int, world: int = 1, fanout: int = FANOUT) -> str:
    """Rank ``rank``'s index part, relative to its checkpoint directory."""
    return f"{INDEX_DIR}/{_fanned(f'rank-{rank:05d}.json', rank, world, fanout, 'part')}"


def node_index_name(node: int, nodes: int, fanout: int = FANOUT) -> str:
    """Node ``node``'s index part (``files="per-node"``): its ranks' entries."""
    return f"{INDEX_DIR}/{_fanned(f'node-{node:05d}.json', node, nodes, fanout, 'part')}"
