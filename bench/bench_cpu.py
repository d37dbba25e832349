"""CPU checkpoint benchmark: torch.save/load, torch.distributed.checkpoint and mpickpt on one state.

    /work/venv/bin/python bench/bench_cpu.py       # ~1 GB state, 1 + 3 rounds, temp dir, as root
    python bench/bench_cpu.py --gb 4 --dir /scratch/x --json out.json --repeats 5 --profile

The state is an MLP of ``Linear(width, width)`` layers plus its Adam state (one optimizer step
taken, so ``exp_avg``/``exp_avg_sq`` exist): model + optimizer = ``--gb`` GB (1e9 bytes). Every
method saves that state and restores it into a second model/optimizer of the same shape holding
different values, so an in-place load really has to move the bytes; each restore is then compared
tensor by tensor with the saved state, and a mismatch fails the row instead of reporting a
wrong-but-fast time.

The measurements run in rounds: each round runs dd and then every method once (save, then restore),
in an order shuffled from round to round, so that a disk or a neighbour that is slow for a while
slows every method alike and no method always runs after the same one. A first warm-up round
(``--warmup``) is not counted: it pays one-off costs (imports, first touch of buffers that later
saves reuse); its times are in the JSON. Before every timed operation the disk is synced (one
method's dirty pages are not written back during the next one's timing), and before every restore
the page cache is dropped when that is permitted; the output says so when it is not, and reads
then come from memory. The table gives the median over the rounds and, in parentheses, the best.
CPU time used by other processes during the rounds is measured and reported: on a shared machine
it is the first suspect for scattered times.

Rows:
  torch.save / torch.load           torch.save as users call it: it returns once the bytes are in
                                    the page cache, nothing is on the disk yet
  torch.save+fsync / torch.load     the same followed by an fsync of the file and its directory,
                                    which mpickpt and DCP do before they report success
  torch.distributed.checkpoint      dcp.save / dcp.load in one process without a process group
                                    (its default FileSystemWriter fsyncs too)
  mpickpt (1 rank)                  Checkpointer.save(...).wait() / restore(...), MPI.COMM_WORLD of
                                    size 1 in this process; when save() itself returned (the time
                                    training is blocked) is printed under the table
  mpickpt (N ranks, mpiexec)        the same under ``mpiexec -n N`` (this script relaunches itself
                                    with --worker), each rank holding 1/N of the layers; times are
                                    from a barrier before to a barrier after, bytes summed
  dd ...                            the disk's raw bandwidth on the same directory: 1 GiB written
                                    with O_DIRECT, through the page cache + fdatasync (16 MiB and
                                    1 MiB blocks), read back with O_DIRECT
Restore times include the ``load_state_dict`` calls a user makes to get the loaded bytes into the
live model and optimizer (mpickpt's restore makes them itself).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import importlib.util
import io
import json
import mmap
import os
import platform
import pstats
import random
import re
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from mpickpt.format import pages
from mpickpt.format.rootdir import fsync_path

HERE = Path(__file__).resolve().parent
TAG = "BENCH-WORKER "
Pair = tuple[torch.nn.Module, torch.optim.Optimizer]
# (start, seconds) of each full collection of Python's garbage since watch_full_gc()
FULL_GC: list[tuple[float, float]] = []


def watch_full_gc() -> None:
    """Record in FULL_GC every collection of the oldest generation (once per process): one
    takes 0.1-0.4 s with torch loaded and holds the interpreter's lock throughout, so a step or
    window that paid for one is not a save's doing, though a save's objects bring the next one
    closer."""
    if _full_gc not in gc.callbacks:
        gc.callbacks.append(_full_gc)


def _full_gc(phase: str, info: dict[str, int]) -> None:
    if info.get("generation") != 2:
        return
    if phase == "start":
        _full_gc.began = time.perf_counter()  # type: ignore[attr-defined]
    else:
        FULL_GC.append((_full_gc.began, time.perf_counter() - _full_gc.began))  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------- state


def layer_bytes(width: int) -> int:
    """Bytes one Linear(width, width) adds: weight + bias, three times with Adam's two moments,
    plus the two scalar ``step`` tensors."""
    return 3 * (width * width + width) * 4 + 2 * 4


def layer_count(gb: float, width: int) -> int:
    return max(1, round(gb * 1e9 / layer_bytes(width)))


def make_state(layers: int, width: int, seed: int, lr: float) -> Pair:
    """An MLP and its Adam after one step with random gradients (so the moments exist)."""
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def state_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer
                  ) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer state by a stable name (the live tensors)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, st in optim.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{pid}.{k}"] = v
    return out


def payload_bytes(pair: Pair) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(*pair).values())


def scramble(pair: Pair, salt: int) -> None:
    """Overwrite every tensor of a restore target, and its learning rate, with other values."""
    with torch.no_grad():
        for t in state_tensors(*pair).values():
            t.fill_(-1.0 - salt)
    for g in pair[1].param_groups:
        g["lr"] = 0.5 + salt


def verify(src: Pair, dst: Pair) -> None:
    """Raise AssertionError unless ``dst`` holds exactly the state of ``src``."""
    a, b = state_tensors(*src), state_tensors(*dst)
    if a.keys() != b.keys():
        raise AssertionError(f"tensor names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    for k, t in a.items():
        u = b[k]
        if t.dtype != u.dtype or t.shape != u.shape or not torch.equal(t, u):
            raise AssertionError(f"restored tensor {k} differs from the saved one")

    def groups(o: torch.optim.Optimizer) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]

    if groups(src[1]) != groups(dst[1]):
        raise AssertionError(f"optimizer param_groups differ: {groups(src[1])} vs "
                             f"{groups(dst[1])}")


# ------------------------------------------------------------------------------------ machinery


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def drop_caches() -> str | None:
    """Sync and drop the page cache; None when done, else why it could not be."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def evict(top: str, skip: str | None = None) -> tuple[int, int]:
    """Every regular file under ``top`` (but those under ``skip``) written to its disk and its
    pages dropped from the page cache (``POSIX_FADV_DONTNEED``), the rest of the cache left as
    it is: (pages still cached after, or not checked, pages in all), counted with ``mincore``.
    A restore from ``top`` then reads from the disk, without the side effects of dropping the
    whole cache (bench/probe_tmpfs_faults.py)."""
    resident = total = 0
    page = mmap.PAGESIZE
    for d, dirs, names in os.walk(top):
        if skip is not None:
            dirs[:] = [x for x in dirs if os.path.join(d, x) != skip]
        for n in names:
            try:
                fd = os.open(os.path.join(d, n), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:  # gone meanwhile, or a link
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or not st.st_size:
                    continue
                n = -(-st.st_size // page)
                total += n
                try:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    resident += _cached_pages(fd, st.st_size)
                except OSError:  # counted as cached: the note says so
                    resident += n
            finally:
                os.close(fd)
    return resident, total


def _cached_pages(fd: int, size: int) -> int:
    """How many of the file's pages are in the page cache (of a map of it, which brings none
    in)."""
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        return pages.resident(pages.address(m), size)
    finally:
        m.close()


def clear_dir(path: str) -> None:
    """Empty ``path`` (untimed) and sync the deletions."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    os.sync()


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(path) for n in ns)


def filesystem_of(path: str) -> dict[str, str]:
    """Type, device, mount point and options of the file system holding ``path``."""
    path = os.path.realpath(path)
    best: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            mnt = mnt.replace("\\040", " ")
            inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best.get("mount", "")):
                best = {"device": dev, "mount": mnt, "type": fstype, "options": opts}
    return best


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def machine_info(directory: str) -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in read_text("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), "")
    mem = next((int(line.split()[1]) * 1024 for line in read_text("/proc/meminfo").splitlines()
                if line.startswith("MemTotal:")), 0)
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "mem_bytes": mem,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "dir": directory,
        "filesystem": filesystem_of(directory),
    }
    for mod in ("numpy", "h5py", "xxhash", "mpi4py"):
        with contextlib.suppress(Exception):
            info[mod] = __import__(mod).__version__
    info["mpickpt_source"] = mpickpt_source()
    return info


def mpickpt_source() -> dict[str, Any]:
    """Which mpickpt is measured: its directory and, in a git checkout, the commit and whether
    the package differs from it (found without importing it, which would initialize MPI)."""
    spec = importlib.util.find_spec("mpickpt")
    if spec is None or not spec.submodule_search_locations:
        return {}
    pkg = os.path.realpath(next(iter(spec.submodule_search_locations)))
    out: dict[str, Any] = {"path": pkg}
    with contextlib.suppress(Exception):
        def git(*cmd: str) -> str:
            return subprocess.run(["git", "-C", pkg, *cmd], capture_output=True, text=True,
                                  check=True).stdout.strip()

        out["commit"] = git("rev-parse", "HEAD")
        out["modified"] = git("status", "--porcelain", "--", ".").splitlines()
    return out


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, CPU ticks used, name) of every process."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = read_text(f"/proc/{d}/stat")
            if ")" in st:
                name = st[st.index("(") + 1 : st.rindex(")")]
                f = st[st.rindex(")") + 2 :].split()
                out[int(d)] = (int(f[1]), int(f[11]) + int(f[12]), name)
    return out


class Neighbours:
    """CPU seconds used by processes that are not this benchmark (nor its children) between
    calls to ``sample()``: other work on the machine that makes the timings noisy. Processes that
    start and end between two samples are missed."""

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK")
        self.last = self._others()

    def _others(self) -> dict[int, tuple[int, str]]:
        procs = _proc_table()
        ours = {os.getpid()}
        changed = True
        while changed:
            new = {pid for pid, (ppid, _, _) in procs.items() if ppid in ours} - ours
            ours |= new
            changed = bool(new)
        return {pid: (ticks, name) for pid, (_, ticks, name) in procs.items()
                if pid not in ours and pid > 2}

    def sample(self) -> dict[str, Any]:
        now = self._others()
        used: dict[str, float] = {}
        for pid, (ticks, name) in now.items():
            delta = ticks - self.last.get(pid, (0, ""))[0]
            if delta > 0:
                used[name] = used.get(name, 0.0) + delta / self.hz
        self.last = now
        top = sorted(used.items(), key=lambda kv: -kv[1])[:5]
        return {"loadavg": read_text("/proc/loadavg"),
                "io_pressure": read_text("/proc/pressure/io").replace("\n", "; "),
                "others_cpu_s": round(sum(used.values()), 2),
                "others_top": {k: round(v, 2) for k, v in top}}


def summarize(times: list[float], nbytes: int) -> dict[str, Any]:
    if not times:
        return {}
    med, best = statistics.median(times), min(times)
    return {"times_s": times, "median_s": med, "min_s": best,
            "median_GBps": nbytes / med / 1e9, "max_GBps": nbytes / best / 1e9}


# -------------------------------------------------------------------------------------- methods


def io_threads(n: int | None) -> dict[str, int]:
    """Checkpointer keyword for ``--io-threads``: none given keeps mpickpt's default."""
    return {} if n is None else {"io_threads": n}


class Method:
    """One row: ``round(i)`` saves, restores into the scrambled target, verifies, and returns
    (save seconds, restore seconds, details)."""

    name = ""

    def __init__(self, bench: Bench, sub: str) -> None:
        self.b = bench
        self.work = os.path.join(bench.dir, sub)
        clear_dir(self.work)
        self.save_s: list[float] = []
        self.restore_s: list[float] = []
        self.details: list[dict[str, Any]] = []
        self.warmup: list[dict[str, Any]] = []
        self.error: str | None = None

    def save(self, i: int) -> Any:
        raise NotImplementedError

    def restore(self, i: int) -> None:
        raise NotImplementedError

    def extra(self, saved: Any) -> dict[str, Any]:
        return {}

    def round(self, i: int) -> tuple[float, float, dict[str, Any]]:
        os.sync()
        t0 = time.perf_counter()
        saved = self.save(i)
        s = time.perf_counter() - t0
        os.sync()  # write back what the save left dirty before anything else is timed
        scramble(self.b.dst, i)
        self.b.before_read()
        t0 = time.perf_counter()
        self.restore(i)
        r = time.perf_counter() - t0
        verify(self.b.src, self.b.dst)
        details = {"file_bytes": du(self.work), **self.extra(saved)}
        clear_dir(self.work)
        return s, r, details

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def row(self) -> dict[str, Any]:
        n = self.b.nbytes
        row: dict[str, Any] = {"method": self.name, "bytes": n,
                               "save": summarize(self.save_s, n),
                               "restore": summarize(self.restore_s, n),
                               "file_bytes": self.details[-1]["file_bytes"] if self.details
                               else None,
                               "details": self.details, "warmup": self.warmup}
        stalls = [d["save_returned_s"] for d in self.details if "save_returned_s" in d]
        if stalls:
            row["save_returned"] = summarize(stalls, n)
        if self.error:
            row["error"] = self.error
        return row


class TorchSave(Method):
    def __init__(self, bench: Bench, fsync: bool) -> None:
        super().__init__(bench, "torch-fsync" if fsync else "torch")
        self.fsync = fsync
        self.name = "torch.save+fsync / torch.load" if fsync else "torch.save / torch.load"
        self.path = os.path.join(self.work, "ckpt.pt")

    def save(self, i: int) -> None:
        model, optim = self.b.src
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, self.path)
        if self.fsync:
            fsync_path(self.path)
            fsync_path(self.work)

    def restore(self, i: int) -> None:
        model, optim = self.b.dst
        sd = torch.load(self.path, map_location="cpu", weights_only=True)
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])


class DCP(Method):
    name = "torch.distributed.checkpoint"

    def __init__(self, bench: Bench) -> None:
        super().__init__(bench, "dcp")
        import torch.distributed.checkpoint as dcp

        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        self.dcp = dcp

    def save(self, i: int) -> None:
        model, optim = self.b.src
        self.dcp.save({"model": model.state_dict(), "optim": optim.state_dict()},
                      checkpoint_id=os.path.join(self.work, f"step-{i}"))

    def restore(self, i: int) -> None:
        model, optim = self.b.dst
        sd = {"model": model.state_dict(), "optim": optim.state_dict()}
        self.dcp.load(sd, checkpoint_id=os.path.join(self.work, f"step-{i}"))
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])


class MpickptLocal(Method):
    name = "mpickpt (1 rank)"

    def __init__(self, bench: Bench) -> None:
        super().__init__(bench, "mpickpt")
        os.environ.setdefault("MPICKPT_LOG", "WARNING")
        import mpickpt  # initializes MPI: a singleton COMM_WORLD of size 1

        self.ck = mpickpt.Checkpointer(self.work, on_error="raise",
                                       **io_threads(bench.args.io_threads))
        if self.ck.world_size != 1:
            raise SystemExit(f"expected MPI.COMM_WORLD of size 1, not {self.ck.world_size}")

    def src_state(self) -> dict[str, Any]:
        return {"model": self.b.src[0], "optim": self.b.src[1]}

    def dst_state(self) -> dict[str, Any]:
        return {"model": self.b.dst[0], "optim": self.b.dst[1]}

    def save(self, i: int) -> Any:
        t0 = time.perf_counter()
        handle = self.ck.save(i, self.src_state())
        stall = time.perf_counter() - t0  # what the training thread waits for
        return handle.wait(), stall

    def restore(self, i: int) -> None:
        if self.ck.restore(self.dst_state(), step=i) != i:
            raise AssertionError(f"mpickpt restored {self.ck.restore_info}")

    def extra(self, saved: Any) -> dict[str, Any]:
        result, stall = saved
        return {"save_returned_s": stall, "io_threads": self.ck.io_threads,
                "mpickpt_stats": dict(result.stats)}

    def profile(self) -> None:
        """One more save and restore under cProfile (main thread only: the I/O threads' work
        shows up as waiting on futures)."""
        for what in ("save", "restore"):
            prof = cProfile.Profile()
            if what == "save":
                os.sync()
                prof.runcall(self.save, 999)
                os.sync()
            else:
                scramble(self.b.dst, 999)
                self.b.before_read()
                prof.runcall(self.restore, 999)
                verify(self.b.src, self.b.dst)
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(20)
            log(f"--- cProfile of mpickpt {what} (main thread, cumulative) ---\n{buf.getvalue()}")
        clear_dir(self.work)

    def close(self) -> None:
        self.ck.close()
        super().close()


class MpickptRanks(Method):
    """mpickpt on N ranks: a worker job under mpiexec, told round by round on its stdin what to
    run; it answers with one tagged JSON line per round."""

    def __init__(self, bench: Bench, n: int) -> None:
        super().__init__(bench, f"mpickpt-{n}ranks")
        self.name = f"mpickpt ({n} ranks, mpiexec)"
        exe = os.environ.get("MPICKPT_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
        if not os.path.exists(exe):
            exe = shutil.which("mpiexec") or ""
        if not exe:
            raise RuntimeError("no mpiexec found")
        cmd = [exe, "-n", str(n)]
        version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
        if "Open MPI" in version or "OpenRTE" in version:
            cmd += ["--oversubscribe", "--allow-run-as-root"]
        a = bench.args
        cmd += [sys.executable, str(Path(__file__).resolve()), "--worker",
                "--layers", str(max(bench.layers, n)), "--width", str(a.width), "--dir", self.work,
                *(["--io-threads", str(a.io_threads)] if a.io_threads else [])]
        if bench.cache_note is not None:
            cmd.append("--no-drop-caches")
        # this process has not initialized MPI yet; drop any launcher variables all the same
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "PMIX_", "MPIR_", "HYDRA_", "OMPI_"))}
        env.update({"MPICKPT_LOG": "WARNING", "PYTHONUNBUFFERED": "1"})
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.nbytes = self.ask("ready")["bytes"]

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(TAG):
                reply = json.loads(line[len(TAG):])
                if reply.get("error"):
                    raise RuntimeError(reply["error"])
                return reply
            log(line.rstrip())
        raise RuntimeError(f"the mpiexec worker ended (exit code {self.proc.wait()})")

    def round(self, i: int) -> tuple[float, float, dict[str, Any]]:
        r = self.ask(f"round {i}")
        return r["save_s"], r["restore_s"], r["details"]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.ask("quit")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        super().close()

    def row(self) -> dict[str, Any]:
        row = super().row()
        row["bytes"] = self.nbytes
        row["save"] = summarize(self.save_s, self.nbytes)
        row["restore"] = summarize(self.restore_s, self.nbytes)
        return row


# ------------------------------------------------------------------------------------------ dd


DD_BYTES = 16 * 1024 * 1024 * 64
DD_VARIANTS = (
    ("dd write oflag=direct", "write", ["if=/dev/zero", "of={f}", "bs=16M", "count=64",
                                        "oflag=direct"]),
    ("dd write conv=fdatasync", "write", ["if=/dev/zero", "of={f}", "bs=16M", "count=64",
                                          "conv=fdatasync"]),
    # 16 MiB blocks do not fit in a CPU cache, which slows the copy into the page cache
    ("dd write bs=1M conv=fdatasync", "write", ["if=/dev/zero", "of={f}", "bs=1M", "count=1024",
                                                "conv=fdatasync"]),
    ("dd read iflag=direct", "read", ["if={f}", "of=/dev/null", "bs=16M", "iflag=direct"]),
)


class DD:
    def __init__(self, bench: Bench) -> None:
        self.b = bench
        self.file = os.path.join(bench.dir, "ddtest")
        self.times: dict[str, list[float]] = {name: [] for name, _, _ in DD_VARIANTS}
        self.errors: dict[str, str] = {}

    def round(self) -> None:
        for name, kind, args in DD_VARIANTS:
            if name in self.errors:
                continue
            if kind == "read":
                self.b.before_read()
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.file)
                os.sync()
            p = subprocess.run(["dd", *(a.format(f=self.file) for a in args)],
                               capture_output=True, text=True)
            m = re.search(r"copied, ([0-9.eE+-]+) s", p.stderr)
            if p.returncode != 0 or not m:
                self.errors[name] = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
                log(f"  {name}: FAILED: {self.errors[name]}")
                continue
            self.times[name].append(float(m.group(1)))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.file)
        os.sync()
        log("  dd: " + ", ".join(f"{n[3:]} {t[-1]:.3f} s"
                                 for n, t in self.times.items() if t))

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for name, kind, _ in DD_VARIANTS:
            row: dict[str, Any] = {"method": name, "bytes": DD_BYTES}
            row["save" if kind == "write" else "restore"] = summarize(self.times[name], DD_BYTES)
            if name in self.errors:
                row["error"] = self.errors[name]
            out.append(row)
        return out


# ---------------------------------------------------------------------------------------- bench


class Bench:
    def __init__(self, args: argparse.Namespace, directory: str) -> None:
        self.args = args
        self.dir = directory
        self.layers = layer_count(args.gb, args.width)
        t0 = time.perf_counter()
        self.src = make_state(self.layers, args.width, seed=1, lr=1e-3)
        self.dst = make_state(self.layers, args.width, seed=2, lr=3e-4)
        self.build_s = time.perf_counter() - t0
        self.nbytes = payload_bytes(self.src)
        self.cache_note = drop_caches()  # None: restores read from the disk
        self.setup_failures: list[dict[str, Any]] = []

    def before_read(self) -> None:
        if self.cache_note is None:
            self.cache_note = drop_caches()
        else:
            os.sync()

    def run(self, wanted: set[str]) -> tuple[list[Method], DD | None, list[dict[str, Any]]]:
        a = self.args
        methods: list[Method] = []
        dd = DD(self) if "dd" in wanted else None

        def add(make: Any, label: str) -> None:
            try:
                methods.append(make())
            except Exception as e:
                log(f"  {label}: cannot be set up: {type(e).__name__}: {e}")
                self.setup_failures.append({"method": label, "bytes": self.nbytes,
                                            "error": f"setup: {type(e).__name__}: {e}"})

        if "torch" in wanted:
            add(lambda: TorchSave(self, fsync=False), "torch.save / torch.load")
        if "torch-fsync" in wanted:
            add(lambda: TorchSave(self, fsync=True), "torch.save+fsync / torch.load")
        if "dcp" in wanted:
            add(lambda: DCP(self), DCP.name)
        # the worker job starts before this process initializes MPI for the 1-rank row
        if "mpickpt-ranks" in wanted and a.ranks > 1:
            add(lambda: MpickptRanks(self, a.ranks), f"mpickpt ({a.ranks} ranks, mpiexec)")
        if "mpickpt" in wanted:
            add(lambda: MpickptLocal(self), MpickptLocal.name)
            if len(methods) > 1 and isinstance(methods[-2], MpickptRanks):
                methods[-2], methods[-1] = methods[-1], methods[-2]  # rows: 1 rank, then N

        neighbours = Neighbours()
        loads: list[dict[str, Any]] = []
        try:
            for i in range(a.warmup + a.repeats):
                warm = i < a.warmup
                log(f"warm-up round {i + 1}/{a.warmup} (not counted)" if warm else
                    f"round {i + 1 - a.warmup}/{a.repeats}")
                if dd is not None and not warm:
                    dd.round()
                order = [m for m in methods if m.error is None]
                random.Random(i).shuffle(order)  # no method always follows the same one
                for m in order:
                    try:
                        s, r, d = m.round(i)
                    except Exception as e:  # a failed or wrong restore is reported, not timed
                        m.error = f"{type(e).__name__}: {e}"
                        log(f"  {m.name}: FAILED: {m.error}")
                        continue
                    if warm:
                        m.warmup.append({"save_s": s, "restore_s": r, **d})
                    else:
                        m.save_s.append(s)
                        m.restore_s.append(r)
                        m.details.append(d)
                    log(f"  {m.name}: save {s:.3f} s, restore {r:.3f} s (verified)")
                if not warm:
                    loads.append(neighbours.sample())
                    log(f"  other processes used {loads[-1]['others_cpu_s']} CPU s this round "
                        f"{loads[-1]['others_top']}; load average {loads[-1]['loadavg']}")
                else:
                    neighbours.sample()
            if a.profile:
                for m in methods:
                    if isinstance(m, MpickptLocal) and m.error is None:
                        m.profile()
        finally:
            for m in methods:
                m.close()
        return methods, dd, loads


# -------------------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    """One rank of the multi-rank mpickpt row, under mpiexec; rank 0 takes commands on stdin.
    An exception on any rank ends the whole job (the driver then reports the row as failed)
    instead of leaving the other ranks waiting."""
    os.environ.setdefault("MPICKPT_LOG", "WARNING")
    from mpi4py import MPI

    try:
        worker_loop(args, MPI)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def worker_loop(args: argparse.Namespace, mpi: Any) -> None:
    import mpickpt

    comm = mpi.COMM_WORLD
    rank, size = comm.rank, comm.size

    def barrier(poll: float = 0.0005) -> None:
        """A barrier that sleeps while it waits: MPI's blocking calls spin, and a rank spinning
        in one (rank 1 while rank 0 waits for the next command) would take a core from
        everything else measured on a small machine."""
        req = comm.Ibarrier()
        while not req.Test():
            time.sleep(poll)

    layers = args.layers // size + (1 if rank < args.layers % size else 0)
    src = make_state(layers, args.width, seed=1 + 100 * rank, lr=1e-3)
    dst = make_state(layers, args.width, seed=2 + 100 * rank, lr=3e-4)
    nbytes = comm.allreduce(payload_bytes(src))
    if rank == 0:
        clear_dir(args.dir)
    barrier()
    ck = mpickpt.Checkpointer(args.dir, on_error="raise", **io_threads(args.io_threads))
    drop = not args.no_drop_caches

    def reply(obj: dict[str, Any]) -> None:
        if rank == 0:
            print(TAG + json.dumps(obj), flush=True)

    def timed(fn: Any) -> tuple[float, Any]:
        """Seconds from a barrier before to a barrier after, as the slowest rank saw them."""
        barrier()
        t0 = time.perf_counter()
        out = fn()
        barrier()
        return comm.allreduce(time.perf_counter() - t0, op=mpi.MAX), out

    def save(i: int, stall: list[float]) -> Any:
        t0 = time.perf_counter()
        handle = ck.save(i, {"model": src[0], "optim": src[1]})
        stall.append(time.perf_counter() - t0)  # what the training thread waits for
        return handle.wait()

    while True:
        line = sys.stdin.readline() if rank == 0 else None
        barrier(0.01)
        cmd = (comm.bcast(line) or "quit").split()
        if cmd[0] == "ready":
            reply({"bytes": nbytes, "ranks": size})
            continue
        if cmd[0] != "round":
            break
        i = int(cmd[1])
        error = None
        out: dict[str, Any] = {}
        try:
            if rank == 0:
                os.sync()
            stall: list[float] = []
            s, res = timed(functools.partial(save, i, stall))
            stall_max = comm.allreduce(stall[0], op=mpi.MAX)
            if rank == 0:
                os.sync()
            scramble(dst, i)
            barrier()
            if rank == 0:
                drop_caches() if drop else os.sync()
            r, step = timed(lambda i=i: ck.restore({"model": dst[0], "optim": dst[1]}, step=i))
            if step != i:
                raise AssertionError(f"restored step {step}, not {i}")
            verify(src, dst)
            out = {"save_s": s, "restore_s": r,
                   "details": {"file_bytes": du(args.dir), "save_returned_s": stall_max,
                               "io_threads": ck.io_threads, "mpickpt_stats": dict(res.stats)}}
        except Exception as e:
            error = f"rank {rank}: {type(e).__name__}: {e}"
        barrier()
        errors = [e for e in comm.allgather(error) if e]
        reply({"error": "; ".join(errors)} if errors else out)
        if rank == 0:
            for name in os.listdir(args.dir):
                if name.startswith("step-"):
                    shutil.rmtree(os.path.join(args.dir, name))
            os.sync()
        barrier()
        if errors:
            break
    ck.close()


# -------------------------------------------------------------------------------------- report


def table(rows: list[dict[str, Any]]) -> str:
    head = ("method", "bytes", "save s", "save GB/s", "restore s", "restore GB/s")

    def secs(s: dict[str, Any] | None) -> str:
        return f"{s['median_s']:.3f} ({s['min_s']:.3f})" if s else "-"

    def rate(s: dict[str, Any] | None) -> str:
        return f"{s['median_GBps']:.2f} ({s['max_GBps']:.2f})" if s else "-"

    lines = []
    for r in rows:
        save, rest = r.get("save"), r.get("restore")
        name = r["method"] + (f"  [FAILED: {r['error'][:70]}]" if r.get("error") else "")
        lines.append((name, f"{r['bytes']:,}", secs(save), rate(save), secs(rest), rate(rest)))
    return columns(head, lines)


def columns(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned, a rule
    under the head."""
    lines = [head, *rows]
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(v.ljust(w) if c == 0 else v.rjust(w)
                             for c, (v, w) in enumerate(zip(line, widths, strict=True))).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--gb", type=float, default=1.0,
                    help="size of model + Adam state in GB of 1e9 bytes (default 1)")
    ap.add_argument("--width", type=int, default=2048, help="Linear layer width (default 2048)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of measurements (default 3)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="rounds run first and not counted (first-touch of buffers, imports; "
                         "default 1); their times are in the JSON")
    ap.add_argument("--dir", help="where to write (default: a temp dir under /tmp, removed after)")
    ap.add_argument("--json", default=str(HERE / "results" / "cpu.json"),
                    help="results as JSON (default bench/results/cpu.json)")
    ap.add_argument("--ranks", type=int, default=2,
                    help="ranks of the mpiexec mpickpt row; 0 or 1 skips it (default 2)")
    ap.add_argument("--io-threads", type=int,
                    help="mpickpt Checkpointer(io_threads=...) (default: mpickpt's own)")
    ap.add_argument("--methods", default="dd,torch,torch-fsync,dcp,mpickpt,mpickpt-ranks",
                    help="comma-separated rows to run (default: all)")
    ap.add_argument("--profile", action="store_true",
                    help="print a cProfile of one more mpickpt save and restore (not timed)")
    ap.add_argument("--no-drop-caches", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    wanted = {m.strip() for m in args.methods.split(",") if m.strip()}
    own_dir = args.dir is None
    directory = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="mpickpt-bench-", dir="/tmp"))
    os.makedirs(directory, exist_ok=True)
    started = time.time()
    try:
        b = Bench(args, directory)
        info = machine_info(directory)
        fs = info["filesystem"]
        log(f"state: {b.layers} x Linear({args.width}, {args.width}) + Adam = {b.nbytes:,} bytes "
            f"({b.nbytes / 1e9:.3f} GB), built in {b.build_s:.1f} s; dir {directory} "
            f"({fs.get('type', '?')} on {fs.get('device', '?')}); {args.warmup} warm-up + "
            f"{args.repeats} rounds")
        if b.cache_note is None:
            log("page cache: dropped before every restore (reads come from the disk)")
        else:
            log(f"page cache: could NOT be dropped ({b.cache_note}); restores read from the page "
                "cache and overstate the disk")
        methods, dd, loads = b.run(wanted)
        rows = [m.row() for m in methods] + b.setup_failures
        limits = dd.rows() if dd is not None else []
        text = table(rows + limits)
        cache = ("page cache dropped before each restore" if b.cache_note is None else
                 f"page cache NOT dropped ({b.cache_note}): restores read cached data")
        print(f"\n{b.nbytes / 1e9:.3f} GB state, {args.repeats} rounds after {args.warmup} "
              f"warm-up, median (best); {cache}; "
              f"{directory} on {fs.get('type', '?')} ({fs.get('device', '?')}); "
              f"{info['cpu_count']} CPUs, torch {torch.__version__}\n")
        print(text + "\n", flush=True)
        for r in rows:
            if r.get("save_returned"):
                print(f"{r['method']}: save() returned after {r['save_returned']['median_s']:.3f} "
                      f"s (median; best {r['save_returned']['min_s']:.3f} s), the rest of the "
                      "save ran in the background until wait()")
        others = sum(x["others_cpu_s"] for x in loads)
        measured = sum(x for m in methods for x in m.save_s + m.restore_s)
        if others > 0.05 * measured:
            print(f"\nnote: other processes on this machine used {others:.0f} CPU s during the "
                  f"rounds (the timed operations took {measured:.0f} s): the times include that "
                  "noise; see load_per_round in the JSON")
        doc = {
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "layers")},
            "dir": directory,
            "state": {"layers": b.layers, "width": args.width, "bytes": b.nbytes,
                      "build_s": b.build_s},
            "page_cache_dropped": b.cache_note is None,
            "page_cache_note": b.cache_note,
            "machine": info,
            "load_per_round": loads,
            "started": started,
            "elapsed_s": time.time() - started,
            "rows": rows,
            "limits": limits,
            "table": text,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        log(f"\nwrote {args.json} ({time.time() - started:.0f} s in all)")
        if any(r.get("error") for r in rows):
            sys.exit(1)
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
