"""The node-local level's directories: one per node under LOCAL, laid out like ROOT.

``LOCAL/<node>/`` belongs to one ROOT (``OWNER.json`` says which; another ROOT's is refused) and
holds, per committed local checkpoint, ``step-XXXXXXXX/`` with:

* ``MANIFEST.json``: the checkpoint's manifest, the same that ROOT gets when it is drained; its
  presence commits the step on this node, as in ROOT;
* ``LEVEL.json``: the redundancy layout (scheme, every rank's node, the teams, the XOR chunk
  size): any surviving node can tell who held what;
* ``rank-RRRRR.h5``: the shards of this node's ranks, and (``partner``) the copies of the shards
  this node holds for other nodes' ranks, under the same names and with the same bytes (of
  HDF5's and the tensors'; a recycled file's alignment padding may differ);
* ``xor-RRRRR.bin``: (``xor``) the parity rank R stores for its team.

``.pool/`` holds the files of the step retention retired last, which the next save writes over
(:mod:`mpickpt.local.pool`): the node holds ``keep + 1`` checkpoints' worth, as while it saves.

A directory holding every rank's ``rank-*.h5`` and the manifest is a complete checkpoint
that every tool reads like one under ROOT. Being written: ``step-XXXXXXXX.partial-<run>/``.

LOCAL and everything under it is private to the job's user: directories 0700, files 0600,
whatever the umask; a directory on the way to it that another user made, or a symbolic link put
there, is refused (``/dev/shm`` and ``/tmp`` are every user's to create in).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re

from ..format import commit, rootdir

LEVEL = "LEVEL.json"
POOL = ".pool"  # the files of the step retention retired last (mpickpt.local.pool)
OWNER = "OWNER.json"


def node_dirname(node: str) -> str:
    """A node name as a directory name (anything but letters, digits, '.', '_', '-' becomes
    '_')."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", node) or "_"
    return "_" + name if name.startswith(".") else name


PARITY_RE = re.compile(r"^xor-(\d{5,})\.bin$")


def parity_name(rank: int) -> str:
    return f"xor-{rank:05d}.bin"


class NodeDir:
    """This node's directory of the local level."""

    def __init__(self, base: str, node: str, root: str) -> None:
        self.base = os.path.abspath(base)
        self.node = node
        self.dir = self.dir_of(node)
        self.root = os.path.realpath(root)
        rootdir.mark_private(self.base)  # the files this rank makes there: 0600

    def prepare(self, run_id: str, log: logging.Logger) -> None:
        """Create the node's directory (or adopt it when it is this ROOT's) and remove what
        earlier runs left half done; refuse another ROOT's, and a directory on the way that
        another user made (:func:`mpickpt.format.rootdir.make_private`: the level is the job user's
        alone, 0700 and its files 0600)."""
        rootdir.make_private(self.base)
        rootdir.make_private(self.dir)
        owner = os.path.join(self.dir, OWNER)
        try:
            with open(owner) as f:
                mine = json.load(f).get("root")
        except FileNotFoundError:
            mine = None
        if mine is None:
            rootdir.atomic_write(owner, json.dumps({"root": self.root}).encode())
        elif mine != self.root:
            raise ValueError(
                f"the local level {self.dir} holds the checkpoints of ROOT {mine}, not of "
                f"{self.root}: give each job its own local directory (e.g. one per ROOT), or "
                "remove it if those checkpoints are no longer wanted")
        for path in rootdir.leftovers(self.dir, run_id):
            log.debug("removing %s, left by an earlier run", path)
            rootdir.remove(path, run_id)

    def dir_of(self, node: str) -> str:
        """The directory of node ``node`` (this one's, or another's as it is on that node)."""
        return os.path.join(self.base, node_dirname(node))

    @property
    def pool_dir(self) -> str:
        """Where retired steps' files wait to be written over (:mod:`mpickpt.local.pool`)."""
        return os.path.join(self.dir, POOL)

    def partial(self, step: int, run_id: str) -> str:
        return os.path.join(self.dir, rootdir.partial_name(step, run_id))

    def final(self, step: int) -> str:
        return os.path.join(self.dir, rootdir.step_name(step))

    def committed(self) -> list[int]:
        """The steps committed on this node, newest first."""
        return [s for s, _ in rootdir.committed(self.dir)]

    def publish(self, partial: str, step: int, manifest: bytes, level: bytes) -> str:
        """Write the layout and the manifest into ``partial`` and rename it into place (the
        node's commit)."""
        return commit.publish(self.dir, partial, step, manifest, side=[(LEVEL, level)],
                              existing=lambda final: rootdir.remove(final, "replaced"))

    def retain(self, keep: int, run_id: str, newest: int) -> list[int]:
        """Keep ``newest`` (the step just committed, whatever its number: a rerun may save a
        lower one) and the ``keep - 1`` highest others; remove the rest. The steps removed."""
        order = [newest] + [s for s in self.committed() if s != newest]
        gone = order[keep:]
        for step in gone:  # their files wait in the pool for the next save to write over
            retire(self.final(step), self.pool_dir, run_id)
        return gone

    def free(self) -> int:
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize


def retire(step_dir: str, pool_dir: str, run_id: str) -> None:
    """Move a retired step's shard, copy and parity files into the pool (replacing what is
    there under the same name), then remove the step's directory."""
    os.makedirs(pool_dir, mode=0o700, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(step_dir):
            if entry.is_file(follow_symlinks=False) and entry.name.endswith((".h5", ".bin")):
                os.replace(entry.path, os.path.join(pool_dir, entry.name))
    rootdir.remove(step_dir, run_id)
