"""The stages of the mpickpt demo (launch/demo sets up the virtualenv, then runs this).

1. reference: examples/train.py on R ranks for N steps without checkpoints; each rank writes its
   final parameters and optimizer state.
2. crash: the same training with a checkpoint every K steps; one rank SIGKILLs itself in the
   middle of writing its shard of one checkpoint (MPICKPT_FAULT=mid-write:RANK:kill:STEP), and
   mpiexec takes the whole job down, as a dead node would on a cluster.
3. restart: the same command without the fault; mpickpt restores the last committed checkpoint
   and the job finishes.
4. compare: every rank's final parameters, optimizer state and loss history must be bit-identical
   to the reference run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
WIDTH = 100  # wrap explanations at this many columns
STEP_DIR = re.compile(r"^step-(\d{8,})$")
PARTIAL_DIR = re.compile(r"^step-(\d{8,})\.partial-([0-9a-z]+)$")
# the restore's log line: "restored step 20 from /path/step-00000020 in 0.08 s: ..."
RESTORED = re.compile(r"restored step (?P<step>\d+) from (?P<path>.+?) in [0-9.]+ s")


class DemoFailed(Exception):
    """A stage did not go as the demo expects; the message says what happened."""


# --------------------------------------------------------------------------------------- output


def say(text: str = "", indent: str = "") -> None:
    """Print a paragraph wrapped for a terminal."""
    if not text:
        print(flush=True)
        return
    print(textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent), flush=True)


def heading(n: int, title: str) -> None:
    print(f"\n=== Stage {n} of 4: {title} ".ljust(WIDTH, "="), flush=True)


def human(nbytes: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


class Shortener:
    """Write the work directory as $WORK in the commands shown."""

    def __init__(self, work: Path) -> None:
        self.work = str(work)

    def __call__(self, text: str) -> str:
        return text.replace(self.work, "$WORK")


# ------------------------------------------------------------------------------------------ MPI


def mpiexec_command() -> list[str]:
    """$MPICKPT_MPIEXEC, else the mpiexec of the 'mpich' wheel beside this Python."""
    exe = os.environ.get("MPICKPT_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
    found = shutil.which(exe)
    if not found:
        raise DemoFailed(f"no mpiexec at {exe}: run launch/demo, which installs the 'mpich' wheel, "
                         f"or set MPICKPT_MPIEXEC")
    cmd = [found]
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    if "Open MPI" in version or "OpenRTE" in version:
        cmd.append("--oversubscribe")  # more ranks than cores is fine for this demo
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd


def run_job(cmd: list[str], env: dict[str, str], timeout: float,
            short: Shortener) -> tuple[int, list[str], float]:
    """Run ``cmd``, showing its output indented as it comes; return (exit code, lines, seconds).

    The job gets its own process group so that a hung job can be ended whole after ``timeout``.
    """
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=env, cwd=REPO, start_new_session=True)
    timed_out = threading.Event()

    def kill_group() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill_group)
    timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if line.strip():
                print(f"    | {short(line)}", flush=True)
        rc = proc.wait()
    except BaseException:
        kill_group()
        proc.wait()
        raise
    finally:
        timer.cancel()
    if timed_out.is_set():
        raise DemoFailed(f"the job did not finish within {timeout:.0f} s and was killed; "
                         f"it should take a few seconds (a hang in MPI start-up or in the job)")
    return rc, lines, time.monotonic() - t0


def launcher_command(args: argparse.Namespace) -> list[str]:
    """What starts the ranks, up to the script: mpiexec (MPI), or torchrun (no MPI)."""
    if args.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={args.ranks}", "--monitor-interval=0.1"]
    return [*mpiexec_command(), "-n", str(args.ranks), sys.executable]


def train_cmd(launcher: list[str], args: argparse.Namespace, root: Path, out: Path,
              checkpoint: bool) -> list[str]:
    cmd = [*launcher, str(TRAIN), "--root", str(root),
           "--steps", str(args.steps), "--every", str(args.every), "--keep", str(args.keep)]
    if not checkpoint:
        cmd.append("--no-checkpoint")
    return [*cmd, "--out", str(out)]


def job_env(fault: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MPICKPT_FAULT"}
    env["PYTHONUNBUFFERED"] = "1"  # so the ranks' lines come out as they happen
    if fault:
        env["MPICKPT_FAULT"] = fault
    return env


def show_cmd(cmd: list[str], short: Shortener, fault: str | None = None) -> None:
    shown = [Path(cmd[0]).name, *cmd[1:]]
    if shown[:3] == [Path(sys.executable).name, "-m", "torch.distributed.run"]:
        shown = ["torchrun", *shown[3:]]
    shown = ["python" if c == sys.executable else c for c in shown]
    shown = [os.path.relpath(c, REPO) if c == str(TRAIN) else c for c in shown]
    prefix = f"MPICKPT_FAULT={fault} " if fault else ""
    print(f"  $ {prefix}{short(shlex.join(shown))}", flush=True)


def check_world(lines: list[str], ranks: int) -> None:
    """examples/train.py's rank 0 says how many ranks it sees; anything else than ``ranks`` means
    mpiexec and mpi4py belong to different MPI libraries (each process alone in its world)."""
    sizes = {int(m.group(1)) for line in lines if (m := re.search(r" on (\d+) ranks$", line))}
    if sizes and sizes != {ranks}:
        raise DemoFailed(f"the processes saw worlds of {sorted(sizes)} ranks, not {ranks}: this "
                         f"mpiexec does not match the MPI that mpi4py uses (MPICKPT_MPIEXEC?)")


# ------------------------------------------------------------------------------------ the disk


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def list_root(root: Path, short: Shortener) -> None:
    """Show the checkpoint directory the way a newcomer needs to read it."""
    print(f"  {short(str(root))}/", flush=True)
    if not root.is_dir():
        print("    (does not exist)")
        return
    for p in sorted(root.iterdir()):
        if p.is_dir() and STEP_DIR.match(p.name):
            shards = sorted(p.glob("rank-*.h5"))
            has_manifest = (p / "MANIFEST.json").is_file()
            state = "committed: MANIFEST.json" if has_manifest else "NO MANIFEST.json (skipped)"
            print(f"    {p.name + '/':<36} {state} + {len(shards)} shards, "
                  f"{human(dir_bytes(p))}", flush=True)
        elif p.is_dir() and PARTIAL_DIR.match(p.name):
            print(f"    {p.name + '/':<36} partial: no MANIFEST.json, never loaded", flush=True)
            for f in sorted(p.iterdir()):
                print(f"      {f.name:<34} {f.stat().st_size:>12,} bytes", flush=True)
        else:
            kind = "/" if p.is_dir() else ""
            note = "(timings of the committed saves)" if p.name == "stats.jsonl" else ""
            print(f"    {p.name + kind:<36} {note}".rstrip(), flush=True)


def committed_steps(root: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if (m := STEP_DIR.match(p.name)) and (p / "MANIFEST.json").is_file())


def partial_dirs(root: Path, step: int) -> list[Path]:
    return [p for p in root.iterdir()
            if (m := PARTIAL_DIR.match(p.name)) and int(m.group(1)) == step]


# ------------------------------------------------------------------------------------ comparing


def flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    """Every leaf of a state_dict (tensors, numbers, strings, tuples) under a dotted path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = obj


def same_bits(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        # compare the raw bytes, not the values: -0.0 vs 0.0 or two NaNs would slip through ==
        return torch.equal(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
                           b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    return type(a) is type(b) and a == b


def compare(ref: Path, resumed: Path, ranks: int) -> list[str]:
    """Compare each rank's final state; return one summary line per rank. Raise on a difference."""
    import torch

    summaries = []
    for r in range(ranks):
        files = [d / f"rank-{r}.pt" for d in (ref, resumed)]
        for f in files:
            if not f.is_file():
                raise DemoFailed(f"rank {r} wrote no final state: {f} is missing")
        a, b = (torch.load(f, weights_only=True) for f in files)
        counts = {}
        for part in ("model", "optim"):
            fa: dict[str, Any] = {}
            fb: dict[str, Any] = {}
            flatten(a[part], part, fa)
            flatten(b[part], part, fb)
            if fa.keys() != fb.keys():
                raise DemoFailed(f"rank {r}: the {part} entries differ: "
                                 f"{sorted(fa.keys() ^ fb.keys())[:5]}")
            for key in fa:
                if not same_bits(fa[key], fb[key]):
                    raise DemoFailed(f"rank {r}: {key} differs between the uninterrupted and the "
                                     f"resumed run")
            tensors = [v for v in fa.values() if isinstance(v, torch.Tensor)]
            counts[part] = (len(tensors), sum(t.numel() for t in tensors), len(fa) - len(tensors))
        la, lb = (json.loads((d / f"rank-{r}.json").read_text())["losses"] for d in (ref, resumed))
        if la != lb:
            pairs = enumerate(zip(la, lb, strict=False))
            first = next((i for i, (x, y) in pairs if x != y), min(len(la), len(lb)))
            raise DemoFailed(f"rank {r}: the loss histories differ from step {first + 1} on")
        (mt, mv, _), (ot, ov, oo) = counts["model"], counts["optim"]
        summaries.append(f"rank {r}: {mt} parameter + {ot} optimizer tensors "
                         f"({mv + ov:,} numbers), {oo} optimizer settings, {len(la)} losses: "
                         f"identical")
    return summaries


# ---------------------------------------------------------------------------------------- stages


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Kill a rank in the middle of a checkpoint, restart, and check the result "
                    "bit for bit against an uninterrupted run.")
    ap.add_argument("--ranks", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--launcher", choices=["mpiexec", "torchrun"], default="mpiexec",
                    help="what starts the ranks: mpiexec (the protocol over MPI), or torchrun "
                         "(no MPI: the protocol over gloo); default mpiexec")
    ap.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every K steps (default 10)")
    ap.add_argument("--keep", type=int, default=3, help="checkpoints kept (default 3)")
    ap.add_argument("--kill-rank", type=int, default=2, help="the rank that dies (default 2)")
    ap.add_argument("--kill-step", type=int, default=30,
                    help="it dies while writing the checkpoint of this step (default 30)")
    ap.add_argument("--workdir", type=Path,
                    help="where the runs write (default: a new temporary directory)")
    ap.add_argument("--keep-workdir", action="store_true",
                    help="keep the work directory after a successful run (it is always kept after "
                         "a failure)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds allowed per job")
    args = ap.parse_args()
    if args.ranks < 2 or not 0 <= args.kill_rank < args.ranks:
        ap.error("need at least 2 ranks and 0 <= --kill-rank < --ranks")
    if args.every < 1 or args.kill_step % args.every or not 0 < args.kill_step <= args.steps:
        ap.error("--kill-step must be a checkpoint step: a multiple of --every, at most --steps")

    if args.workdir:
        work = args.workdir.resolve()
        if work.exists() and any(work.iterdir()):
            ap.error(f"--workdir {work} is not empty")
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="mpickpt-demo-"))
    t_start = time.monotonic()
    try:
        ok = stages(args, work)
    except DemoFailed as e:
        print(f"\nRESULT: FAILED: {e}", flush=True)
        print(f"The files of the runs are kept in {work}", flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted; the files of the runs are in {work}", flush=True)
        return 130
    took = time.monotonic() - t_start
    if ok and not args.keep_workdir and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
        print(f"(the four stages took {took:.0f} s; their temporary files were removed: run with "
              f"--keep-workdir to look at them)", flush=True)
    else:
        print(f"(the four stages took {took:.0f} s; their files are in {work})", flush=True)
    return 0


def stages(args: argparse.Namespace, work: Path) -> bool:
    short = Shortener(work)
    launcher = launcher_command(args)
    by = args.launcher
    root, ref, resumed = work / "checkpoints", work / "reference", work / "resumed"
    n, k, victim, kstep = args.steps, args.every, args.kill_rank, args.kill_step
    last_good = kstep - k  # the newest checkpoint committed before the crash (0: none)

    say("mpickpt demo: what happens to a training job when one of its processes dies while it "
        "is saving a checkpoint.")
    say(f"{args.ranks} ranks ({by}) train a small model together (examples/train.py: an MLP with "
        f"dropout, Adam and a learning-rate schedule; gradients averaged over the ranks) for {n} "
        f"steps. With checkpoints on, every rank saves its whole state every {k} steps, and "
        f"mpickpt makes each save all-or-nothing across the ranks.")
    print(f"  work directory: WORK={work}")
    print(f"  launcher:       {' '.join(launcher)}")

    # ---------------------------------------------------------------- 1: the uninterrupted run
    heading(1, "reference run, never interrupted")
    say(f"First the answer we expect: {n} steps straight through, no checkpoints. Each rank writes "
        f"its final parameters and optimizer state to $WORK/reference/rank-R.pt.", "  ")
    cmd = train_cmd(launcher, args, work / "unused", ref, checkpoint=False)
    show_cmd(cmd, short)
    rc, lines, secs = run_job(cmd, job_env(None), args.timeout, short)
    check_world(lines, args.ranks)
    if rc != 0:
        raise DemoFailed(f"the reference run failed with exit code {rc} (its output is above)")
    say(f"-> done in {secs:.1f} s: {args.ranks} final states written.", "  ")

    # ---------------------------------------------------------------- 2: the crash
    heading(2, f"checkpointed run; rank {victim} is killed in the middle of a save")
    say(f"The same training, now saving a checkpoint every {k} steps into $WORK/checkpoints. "
        f"Fault injection (MPICKPT_FAULT) makes rank {victim} kill itself with SIGKILL while it "
        f"is writing its shard of the checkpoint of step {kstep}: no cleanup, no exception, no "
        f"last words, like a node losing power. {by} then ends the other ranks, so the whole "
        f"job dies, as it would on a cluster.", "  ")
    fault = f"mid-write:{victim}:kill:{kstep}"
    cmd = train_cmd(launcher, args, root, resumed, checkpoint=True)
    show_cmd(cmd, short, fault)
    rc, lines, secs = run_job(cmd, job_env(fault), args.timeout, short)
    check_world(lines, args.ranks)
    if rc == 0:
        raise DemoFailed(f"the job was meant to die at step {kstep} but finished normally: the "
                         f"fault {fault} did not fire")
    how = "killed by SIGKILL" if rc in (9, 128 + 9, -9) else f"exit code {rc}"
    saved = committed_steps(root)
    partial = partial_dirs(root, kstep)
    say(f"-> the job died after {secs:.1f} s ({by} reports {how}).", "  ")
    print("  What is on disk now:")
    list_root(root, short)
    if not partial:
        raise DemoFailed(f"no partial directory of step {kstep}: rank {victim} did not die "
                         f"while saving it")
    if kstep in saved:
        raise DemoFailed(f"the checkpoint of step {kstep} was committed although rank {victim} "
                         f"died while writing it")
    expected = [s for s in range(k, kstep, k)][-args.keep:]
    if saved != expected:
        raise DemoFailed(f"expected committed checkpoints of steps {expected}, found {saved}")
    shard = partial[0] / f"rank-{victim:05d}.h5"
    others = [p.stat().st_size for p in partial[0].glob("rank-*.h5") if p != shard]
    detail = ""
    if shard.is_file() and others and shard.stat().st_size < min(others):
        detail = (f" Rank {victim}'s shard there has {shard.stat().st_size:,} bytes where the "
                  f"others' have {max(others):,}: it was cut off mid-write.")
    say(("Saved before the crash: " + (
        f"the checkpoints of steps {', '.join(map(str, saved))}, each committed (its "
        f"MANIFEST.json, written last by rank 0 after all ranks voted that their shards were "
        f"complete and on disk)." if saved else "nothing yet.")
        + f" The save of step {kstep} never got past the vote: its directory "
        f"{partial[0].name}/ has no MANIFEST.json, so it does not count as a checkpoint."
        + detail), "  ")

    # ---------------------------------------------------------------- 3: the restart
    heading(3, "restart: the same command, without the fault")
    say("Resubmitting the job is all it takes: at start-up every rank calls "
        "Checkpointer.restore(), which finds the newest checkpoint that all ranks can load, "
        "verifies every shard's size and checksums, and loads it into the model, the optimizer, "
        "the schedule, the data generator and the RNG.", "  ")
    cmd = train_cmd(launcher, args, root, resumed, checkpoint=True)
    show_cmd(cmd, short)
    rc, lines, secs = run_job(cmd, job_env(None), args.timeout, short)
    check_world(lines, args.ranks)
    if rc != 0:
        raise DemoFailed(f"the restarted run failed with exit code {rc} (its output is above)")
    restored_line = next((i for i, s in enumerate(lines) if "restored step" in s), None)
    if restored_line is None:
        raise DemoFailed("the restarted run did not log which checkpoint it restored")
    restored = RESTORED.search(lines[restored_line])
    removed_line = next((i for i, s in enumerate(lines)
                         if "removing" in s and partial[0].name in s), None)
    starts = {json.loads((resumed / f"rank-{r}.json").read_text())["start"]
              for r in range(args.ranks)}
    if starts != {last_good}:
        raise DemoFailed(f"the restarted ranks began at steps {sorted(starts)}, expected all at "
                         f"{last_good} (the last committed checkpoint)")
    if restored is None or int(restored["step"]) != last_good or \
            Path(restored["path"]).name != f"step-{last_good:08d}":
        raise DemoFailed(f"mpickpt reported restoring something else than step-{last_good:08d}: "
                         f"{lines[restored_line].strip()}")
    if any(partial[0].name in s for s in lines if "restored" in s) or partial[0].exists():
        raise DemoFailed(f"{partial[0].name} was not cleaned up as expected")
    say(f"-> done in {secs:.1f} s. What the restart found and did:", "  ")
    found = (f"committed checkpoints of steps {', '.join(map(str, saved))} (newest: "
             f"{last_good})" if saved else "no committed checkpoint")
    say(f"* It found {found}, and the partial directory of the killed save of step {kstep}.",
        "    ")
    if removed_line is not None and (removed_line < restored_line):
        say(f"* It removed {partial[0].name}/ at start-up, before restoring, without reading "
            f"it: a directory without a manifest is never a candidate, so none of the killed "
            f"save's bytes were loaded.", "    ")
    if last_good:
        say(f"* All {args.ranks} ranks restored step {last_good} and trained steps "
            f"{last_good + 1} to {n}. Lost to the crash and redone: steps {last_good + 1} to "
            f"{kstep}, the work since the last committed checkpoint.", "    ")
    else:
        say(f"* No checkpoint had been committed, so all {args.ranks} ranks started over from "
            f"step 0.", "    ")
    print("  The checkpoint directory now:")
    list_root(root, short)

    # ---------------------------------------------------------------- 4: the comparison
    heading(4, "compare the resumed run with the uninterrupted one")
    say("Every rank's final parameters, optimizer state (Adam's moments, step counts, learning "
        "rate) and loss history, compared byte for byte with the reference run:", "  ")
    for line in compare(ref, resumed, args.ranks):
        print(f"    {line}", flush=True)
    print(f"\nRESULT: the resumed run matches the uninterrupted run bit for bit "
          f"({args.ranks} ranks, {n} steps; rank {victim} killed while saving step {kstep}, "
          + (f"resumed from step {last_good})" if last_good else
             "no checkpoint had committed, restarted from step 0)"), flush=True)
    return True


if __name__ == "__main__":
    sys.exit(main())
