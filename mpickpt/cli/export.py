"""``mpickpt export SRC OUT``: one checkpoint as one ``torch.save`` file and a safetensors file.

For inference or sharing. SRC is ``ROOT`` (the checkpoint restore would load), ``ROOT --step N`` or
a checkpoint directory. OUT ending in ``.pt``/``.pth`` writes only the torch file, ``.safetensors``
only the safetensors file; any other OUT writes ``OUT.pt`` and ``OUT.safetensors``. Both hold one
flat dict of tensors named as in the checkpoint (``model/0.weight``), prefixed by the rank when
the checkpoint has more than one (``rank0/model/0.weight``); the pieces of a sharded or
replicated tensor (FSDP2, DDP, ``mpickpt.Piece``) are assembled into the whole tensor, named
without a rank. The torch file loads with
``torch.load(path, weights_only=True)``; the safetensors header carries the step, world size, run
and the user metadata. The non-tensor values of the state (its tree) are not exported.

Every tensor is read like restore reads it, with its checksums verified, into memory (the whole
checkpoint is held at once); the files are written to temporary names and renamed only when all of
them are complete, so a failed export leaves nothing behind. Existing files are not overwritten
without ``--force``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from typing import Any

from ..errors import ShardError
from ..format import rootdir
from ..format.records import TensorRecord
from ..log import human_bytes
from . import EXIT_DAMAGED, EXIT_ERROR, EXIT_OK
from .checks import Unusable, pick
from .render import Out
from .team import Team

NO_SAFETENSORS = ("the safetensors package is not installed: pip install 'mpickpt[export]', or "
                  "export to a .pt file only (OUT ending in .pt)")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="one checkpoint as a torch.save file and a safetensors file",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("src", metavar="ROOT[/step-XXXXXXXX]")
    p.add_argument("out", metavar="OUT", help="OUT.pt and OUT.safetensors (or one of them, "
                   "when OUT ends in .pt, .pth or .safetensors)")
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint of step N under ROOT")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.add_argument("--threads", type=int, default=4, metavar="N", help="reader threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def targets(out: str) -> dict[str, str]:
    """Format -> path of each file to write."""
    ext = os.path.splitext(out)[1]
    if ext in (".pt", ".pth"):
        return {"torch": out}
    if ext == ".safetensors":
        return {"safetensors": out}
    return {"torch": out + ".pt", "safetensors": out + ".safetensors"}


def make_parents(paths: list[str], created: list[str]) -> None:
    """Create the missing parent directories of ``paths``, appending each to ``created``
    (outermost first), so that a failure can remove them again."""
    for p in paths:
        missing, d = [], os.path.dirname(p)
        while d and not os.path.isdir(d) and d != os.path.dirname(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            if not os.path.isdir(d):
                os.mkdir(d, rootdir.DIR_MODE)
                created.append(d)


def _unsupported_by_safetensors(names_dtypes: dict[str, str]) -> list[str]:
    import torch
    from safetensors.torch import save

    from ..format import dtypes

    bad = []
    for dt in sorted(set(names_dtypes.values())):
        try:
            save({"x": torch.empty(0, dtype=dtypes.torch_dtype(dt))})
        except Exception:
            bad += [f"{n} ({dt})" for n, d in names_dtypes.items() if d == dt]
    return bad


def command(args: argparse.Namespace, out: Out, team: Team) -> int:
    import torch

    from ..format.reader import read_shard
    from ..save.pinned_pool import available_memory

    t0 = time.monotonic()

    def fail(code: int, msg: str) -> int:
        out.problem(msg)
        out.json({"command": "export", "exit_code": code, "error": msg})
        return code

    try:
        e = pick(args.src, args.step)
    except Unusable as err:
        return fail(err.code, str(err))
    if e.problems or e.manifest is None:
        assert e.problem is not None
        return fail(EXIT_DAMAGED, f"{e.path} fails verification, nothing exported: "
                    f"{e.problem.reason}")
    m = e.manifest
    files = {fmt: os.path.abspath(p) for fmt, p in targets(args.out).items()}
    existing = [p for p in files.values() if os.path.lexists(p)]
    if existing and not args.force:
        return fail(EXIT_ERROR, f"{', '.join(existing)} already exist(s); nothing was written "
                    "(--force overwrites)")
    prefix = m.world_size > 1

    def export_name(rank: int, t: TensorRecord) -> str:
        """A piece of a sharded or replicated tensor goes into its whole tensor, named as in
        the state; a per-rank tensor is prefixed by its rank when there are several."""
        return t.name if t.global_shape is not None or not prefix else f"rank{rank}/{t.name}"

    names = {export_name(r.rank, t): t.dtype for r in m.ranks for t in r.tensors}
    if "safetensors" in files:
        try:
            bad = _unsupported_by_safetensors(names)
        except ImportError:
            return fail(EXIT_ERROR, NO_SAFETENSORS)
        if bad:
            return fail(EXIT_ERROR, f"safetensors cannot hold {len(bad)} tensor(s): "
                        f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; export to a .pt "
                        "file only (OUT ending in .pt)")

    total = sum(t.nbytes for r in m.ranks for t in r.tensors)
    avail = available_memory()
    if avail is not None and total > avail * 0.9:
        return fail(EXIT_ERROR, f"{e.path} holds {human_bytes(total)} of tensors and export holds "
                    f"them all in memory at once, but only {human_bytes(avail)} is available; "
                    "nothing was written")
    progress = out.progress(f"reading step {e.step}", total)
    tensors: dict[str, torch.Tensor] = {}
    try:
        for r in m.ranks:
            for t in r.tensors:
                path, size = r.file_of(e.path, t)  # incremental: maybe an older shard
                got = read_shard(r.rank, path, [t], size, block=m.checksum_block,
                                 threads=args.threads)[t.name]
                name = export_name(r.rank, t)
                if t.global_shape is not None and t.offsets is not None:
                    if name not in tensors:  # the pieces tile it (checked before the commit)
                        tensors[name] = torch.empty(t.global_shape, dtype=got.dtype)
                    box = tuple(slice(o, o + n) for o, n in zip(t.offsets, t.shape, strict=True))
                    tensors[name][box] = got
                else:
                    tensors[name] = got
                progress.add(t.nbytes)
    except ShardError as err:
        progress.close()
        hint = "" if e.status == "quarantined" else (
            f" `mpickpt-restore {os.path.dirname(e.path)} --verify full` quarantines it.")
        return fail(EXIT_DAMAGED, f"{err}; nothing was written.{hint}")
    progress.close()

    temps = {fmt: f"{p}.tmp-{os.getpid()}" for fmt, p in files.items()}
    umask = os.umask(0)
    os.umask(umask)
    mode = rootdir.FILE_MODE & ~umask  # as torch.save's file would be, but never world-writable
    created: list[str] = []
    try:
        make_parents(list(files.values()), created)
        if "torch" in temps:
            torch.save(tensors, temps["torch"])
            os.chmod(temps["torch"], mode)
            rootdir.fsync_path(temps["torch"])
        if "safetensors" in temps:
            from safetensors.torch import save_file

            save_file(tensors, temps["safetensors"], metadata={
                "mpickpt_step": str(m.step), "mpickpt_world_size": str(m.world_size),
                "mpickpt_run_id": m.run_id, "mpickpt_source": e.path,
                "mpickpt_metadata": json.dumps(m.metadata)})
            os.chmod(temps["safetensors"], mode)  # safetensors makes it 0600
            rootdir.fsync_path(temps["safetensors"])
        for fmt, tmp in temps.items():
            os.replace(tmp, files[fmt])
    except (OSError, RuntimeError, ValueError) as err:
        for tmp in temps.values():
            if os.path.lexists(tmp):
                os.unlink(tmp)
        for d in reversed(created):  # the folders this export made, if they are still empty
            with contextlib.suppress(OSError):
                os.rmdir(d)
        return fail(EXIT_ERROR, f"writing the export failed: {err}; nothing was written")

    seconds = time.monotonic() - t0
    outputs = [{"format": fmt, "path": p, "bytes": os.path.getsize(p)} for fmt, p in files.items()]
    out.json({"command": "export", "exit_code": EXIT_OK, "error": None, "source": e.path,
              "step": m.step, "world_size": m.world_size, "tensors": len(tensors),
              "tensor_bytes": total, "seconds": round(seconds, 3), "outputs": outputs})
    out.line(f"exported step {m.step} ({m.world_size} rank(s), {len(tensors)} tensors, "
             f"{human_bytes(total)}, checksums verified) from {e.path} in {seconds:.1f} s:")
    for o in outputs:
        out.line(f"  {o['format']:<12} {o['path']}  ({human_bytes(o['bytes'])})")
    if prefix:
        out.line("tensor names are prefixed by the rank: rank0/..., rank1/...")
    return EXIT_OK
