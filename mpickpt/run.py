"""Run a Python program on every rank of an MPI job; a failure on one rank ends the whole job.

    mpirun -n 8 python -m mpickpt.run train.py --lr 3e-4
    srun python -m mpickpt.run -m mypackage.train --lr 3e-4
    mpickpt.run.main(fn)         # the same for a function, from a script started with mpirun
    torchrun --nproc-per-node 8 -m mpickpt.run train.py   # no MPI (docs/torchrun.md)

Under torchrun (no MPI launcher, RANK etc. set: :func:`mpickpt.mpi.backend.backend`) steps 1 and 2
are torchrun's, the exit-code agreement runs over gloo, and an abort ends this rank with its code
(torchrun's agent then ends the others and names the code in its report).

What it does, in order (one small function each):

1. MPI is initialised with MPI_THREAD_MULTIPLE, which the checkpointer needs (it runs collectives
   from a background thread); an MPI library that cannot provide it stops the job, saying so.
2. RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set from MPI,
   each unless already set, so ``torch.distributed.init_process_group()`` needs no arguments
   (gloo or nccl). LOCAL_* come from the ranks sharing this node (MPI_COMM_TYPE_SHARED);
   MASTER_ADDR is 127.0.0.1 when the whole job is on one node, else rank 0's host name;
   MASTER_PORT is a TCP port that was free on rank 0.
3. Where torch sees CUDA GPUs, each rank takes one: ``torch.cuda.set_device(LOCAL_RANK % count)``.
4. The program runs as ``python`` would run it: a script as ``__main__`` with
   ``sys.argv = [script, *args]`` and its directory as ``sys.path[0]``; ``-m module``; ``-c code``.
5. How a rank's program ends decides how the job ends:

   - An uncaught exception: the traceback is printed with every line prefixed by ``[rank N]``
     and the job is aborted at once (MPI_Abort, code 1). Without this, the other ranks would
     wait forever in their next collective.
   - KeyboardInterrupt: the job is aborted with code 130.
   - A normal end or ``SystemExit(code)``: the rank waits, on a communicator of its own, until
     every rank has ended. Then MPI is finalized and every rank exits with the largest code any
     rank gave: a clean end, no abort. A rank whose code is not 0 waits at most
     ``$MPICKPT_EXIT_GRACE`` seconds (30): if the others have not ended by then, they are
     still working or waiting for it, so it aborts the job with its code. A rank ending with 0
     waits as long as it takes, as MPI_Finalize would.

   So ``SystemExit(3)`` raised on every rank (a preempted job, after its checkpoint) ends the job
   with code 3 on every rank; ``sys.exit(3)`` on one rank alone aborts the job with code 3.
   Once the ranks agreed on a non-zero code they ignore SIGTERM (:func:`leave_together`).

Exit codes (the job's, as mpirun or srun reports it):

    0    EXIT_OK                    every rank finished
    1    EXIT_FAILED                an uncaught exception on some rank; the job was aborted
    2    EXIT_USAGE                 bad command line, or the script does not exist
    3    EXIT_PREEMPTED             preempted: the checkpoint was saved, every rank exited cleanly
    75   EXIT_COLLECTIVE_TIMEOUT    a collective of the checkpoint protocol missed its deadline;
                                    the checkpointer aborted the job
    130  EXIT_INTERRUPTED           KeyboardInterrupt on some rank; the job was aborted

Any other code is the program's own ``SystemExit``. 0, 1, 3 and 75 come from
:mod:`mpickpt.exitcodes`, shared with the checkpointer.
"""

from __future__ import annotations

import atexit
import math
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import Any, NoReturn

from . import errors, knobs, preempt
from .exitcodes import (
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USAGE,
)

__all__ = ["EXIT_COLLECTIVE_TIMEOUT", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK",
           "EXIT_PREEMPTED", "EXIT_USAGE", "LaunchError", "main"]


USAGE = """\
usage: python -m mpickpt.run [-h] <script.py> [arg ...]
   or: python -m mpickpt.run -m <module> [arg ...]
   or: python -m mpickpt.run -c <code> [arg ...]"""


class LaunchError(RuntimeError):
    """The job cannot start as asked; the message says why and what to do."""


def init_mpi() -> Any:
    """Initialise MPI with MPI_THREAD_MULTIPLE (if not yet done), MPICH's single-copy
    transfers within a node preferred (:func:`mpickpt.mpi.prefer_single_copy`); return
    ``MPI.COMM_WORLD``."""
    import mpi4py

    from .mpi import prefer_single_copy

    prefer_single_copy()

    if "mpi4py.MPI" not in sys.modules:  # (importing mpickpt usually has initialised it)
        mpi4py.rc.threads = True
        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    if not MPI.Is_initialized():  # mpi4py.rc.initialize was turned off: do what it would do
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(lambda: MPI.Is_finalized() or MPI.Finalize())
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                 MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise LaunchError(
            f"the MPI library provides only MPI_THREAD_{names.get(provided, provided)}, but "
            "mpickpt needs MPI_THREAD_MULTIPLE: its checkpointer runs collectives from a "
            "background thread. Use an MPI built with thread support (the mpich wheel and the "
            "usual system MPIs are), and do not lower the level with MPI4PY_RC_THREAD_LEVEL or "
            "mpi4py.rc.thread_level.")
    return MPI.COMM_WORLD


def command_line(args: list[str], show: bool) -> Callable[[], None]:
    """The program named by ``[-h] (script | -m module | -c code) [arg ...]``, ready to run.

    Help and usage errors are printed where ``show`` (rank 0) and end in ``SystemExit``.
    """
    def usage(code: int, message: str = "") -> NoReturn:
        if show:
            out = sys.stderr if code else sys.stdout
            print(f"python -m mpickpt.run: {message}\n{USAGE}" if message else
                  f"{USAGE}\n\n{__doc__}", file=out)
        raise SystemExit(code)

    if not args:
        usage(EXIT_USAGE, "no program to run")
    first, rest = args[0], args[1:]
    if first in ("-h", "--help"):
        usage(EXIT_OK)
    if first in ("-m", "-c"):
        if not rest:
            usage(EXIT_USAGE, f"{first} needs an argument")
        run = run_module if first == "-m" else run_code
        return lambda: run(rest[0], rest[1:])
    if first.startswith("-"):
        usage(EXIT_USAGE, f"unknown option {first}")
    if not os.path.exists(first):
        usage(EXIT_USAGE, f"cannot open file {first!r}: no such file")
    return lambda: run_script(first, rest)


def run_script(path: str, args: list[str]) -> None:
    """Run a script (or a directory or zip file with ``__main__.py``) as ``python path`` would."""
    sys.argv[:] = [path, *args]
    if not sys.flags.isolated:
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    runpy.run_path(path, run_name="__main__")


def run_module(module: str, args: list[str]) -> None:
    """Run a module as ``python -m module`` would (``sys.path[0]`` stays the working directory)."""
    sys.argv[:] = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_code(code: str, args: list[str]) -> None:
    """Run a string as ``python -c code`` would, in a fresh ``__main__`` module."""
    sys.argv[:] = ["-c", *args]
    module, saved = types.ModuleType("__main__"), sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        exec(compile(code, "<string>", "exec"), module.__dict__)
    finally:
        sys.modules["__main__"] = saved


def torch_env(comm: Any) -> dict[str, str]:
    """Collective: the ``torch.distributed`` environment of this rank, from MPI.

    Rank 0's MASTER_ADDR and MASTER_PORT, if set, are given to every rank.
    """
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    local_rank, local_size = node.rank, node.size
    node.Free()
    master = None
    if comm.rank == 0:
        one_node = local_size == comm.size
        master = (os.environ.get("MASTER_ADDR") or ("127.0.0.1" if one_node
                                                     else socket.gethostname()),
                  os.environ.get("MASTER_PORT") or str(free_port()))
    addr, port = comm.bcast(master, root=0)
    return {"RANK": str(comm.rank), "WORLD_SIZE": str(comm.size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": addr, "MASTER_PORT": port}


def free_port() -> int:
    """A TCP port free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def set_torch_env(env: dict[str, str]) -> None:
    """Set each variable unless already set; a RANK or WORLD_SIZE that contradicts MPI is fatal."""
    for name in ("RANK", "WORLD_SIZE"):
        have = os.environ.get(name)
        if have is not None and have != env[name]:
            raise LaunchError(
                f"{name}={have} is set in the environment, but MPI says {env[name]}: "
                f"unset {name} (mpickpt.run sets it from MPI)")
    for name, value in env.items():
        os.environ.setdefault(name, value)


def select_gpu() -> int | None:
    """One CUDA GPU per local rank, where torch sees any: the device taken, or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    local_rank, local_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if local_size > count and local_rank == 0:
        print(f"mpickpt.run: {local_size} ranks share {count} GPUs on {socket.gethostname()}; "
              "NCCL refuses two ranks of one communicator on the same GPU", file=sys.stderr)
    device = local_rank % count
    torch.cuda.set_device(device)
    return device


def exit_code(exc: SystemExit) -> int:
    """The process exit status ``SystemExit`` stands for, as Python turns it into one (a
    message in it is printed, and the status is 1; a number is taken modulo 256)."""
    if exc.code is None:
        return EXIT_OK
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return EXIT_FAILED


def print_prefixed(text: str, rank: int) -> None:
    """Write ``text`` to stderr with every line prefixed by ``[rank N] ``, in one write."""
    sys.stdout.flush()
    lines = text.rstrip("\n").splitlines()
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
    sys.stderr.flush()


def print_traceback(exc: BaseException, rank: int) -> None:
    """The traceback of ``exc``, as Python prints it, less the frames of this wrapper and runpy."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_globals.get("__name__") == "runpy"):
        tb = tb.tb_next
    print_prefixed("".join(traceback.format_exception(type(exc), exc, tb)), rank)


def abort(code: int, why: str) -> NoReturn:
    """End every rank of the job now (MPI_Abort; under torchrun this rank's exit, and the
    agent ends the others), after saying why on stderr."""
    from .mpi.backend import abort_world, world_rank

    why = why.rstrip(".")
    rank = world_rank()
    print_prefixed(f"mpickpt.run: {why}; aborting the job with exit code {code}",
                   rank if rank is not None else int(os.environ.get("RANK", "0")))
    # The launcher forwards our stderr through a pipe; MPI_Abort can tear the job down before
    # the traceback got through it (seen with MPICH's hydra): give the forwarder a moment.
    time.sleep(knobs.ABORT_DELAY.get())
    abort_world(code)


def agree_on_exit(comm: Any, code: int, grace: float) -> int:
    """Collective on ``comm``: wait for every rank to end; the largest exit code of all.

    A rank with a non-zero ``code`` waits at most ``grace`` seconds, then aborts the job: the
    ranks still running would otherwise wait for it forever.
    """
    import numpy as np

    request = comm.ibarrier()
    deadline = time.monotonic() + grace if code else math.inf
    while not request.test():
        if time.monotonic() > deadline:
            abort(code, f"this rank exited with code {code}, but the other ranks did not end "
                        f"within {grace:g} s (MPICKPT_EXIT_GRACE)")
        time.sleep(0.005)
    agreed = np.zeros(1, dtype=np.int64)
    request = comm.iallreduce(np.array([code], dtype=np.int64), agreed, "max")
    while not request.test():
        time.sleep(0.001)
    comm.free()
    return int(agreed[0])


def run_program(program: Callable[[], object], rank: int) -> int:
    """Run it: the exit code of its normal end or ``SystemExit``; any other ending aborts."""
    try:
        program()
    except SystemExit as e:
        return exit_code(e)
    except KeyboardInterrupt:
        abort(EXIT_INTERRUPTED, "interrupted (KeyboardInterrupt)")
    except BaseException as e:
        line = errors.short_form(e, rank)  # raised alike on every rank: rank 0 prints it
        if line is None:
            print_traceback(e, rank)
        else:
            sys.stdout.flush()
            sys.stderr.write(line)
            time.sleep(errors.OTHERS_WAIT_S)  # rank 0 aborts the job, having printed it
        abort(EXIT_FAILED, f"uncaught {type(e).__name__}")
    return EXIT_OK


def finish_saves() -> bool:
    """The saves a program left in flight (it did not call ``Checkpointer.close()``) finish and
    commit before the ranks agree on the exit code; False if one could not."""
    checkpointer = sys.modules.get("mpickpt.checkpointer")  # not imported: no Checkpointer
    if checkpointer is None:
        return True
    return checkpointer.finish_saves("the program returned without Checkpointer.close()")


def main(fn: Callable[[], object] | None = None) -> NoReturn:
    """Run ``fn()``, or without it the program on the command line, on this rank; never returns.

    Every rank of the job must call it. Its ending is the rank's ending (see the module's
    docstring): it raises ``SystemExit`` with the job's agreed exit code (MPI is then finalized
    at interpreter exit, as mpi4py does), or aborts the job. ``fn``'s return value is ignored.
    """
    from .mpi.backend import backend, mpi_loads, open_comm

    try:
        chosen = backend()  # alone too MPI, where it loads: this wrapper's promise
        mpi = chosen == "mpi" or (chosen == "self" and mpi_loads())
        world = open_comm(init_mpi() if mpi else None)
        rank = world.rank
        preempt.install(term=False)  # an early SIGUSR2 is held for the Checkpointer, not fatal
        exit_comm = world.dup()  # before any user code, so no other traffic meets the exit barrier
        if mpi:  # (torchrun set them)
            set_torch_env(torch_env(world.comm))  # collective: before a usage error parts ranks
        program = fn if fn is not None else command_line(sys.argv[1:], show=rank == 0)
        select_gpu()
    except LaunchError as e:
        abort(EXIT_FAILED, str(e))
    except SystemExit as e:  # --help or a usage error, the same on every rank
        program, code = None, exit_code(e)
    if program is not None:
        code = run_program(program, rank)
        if not finish_saves():
            code = code or EXIT_FAILED
    grace = knobs.EXIT_GRACE.get()
    try:
        code = agree_on_exit(exit_comm, code, grace)
    except KeyboardInterrupt:
        abort(EXIT_INTERRUPTED, "interrupted (KeyboardInterrupt) while waiting for the other ranks")
    if code:
        leave_together()
    raise SystemExit(code)


def leave_together() -> None:
    """Every rank agreed on a non-zero code: let none of them be killed on the way out.

    A launcher that ends a job when one task exits non-zero (``srun -K1``, torchrun's agent)
    sends SIGTERM to the ranks still in MPI_Finalize or the interpreter's teardown: a clean exit
    with code 3 on every rank would end as 143 on the slower ones, and the batch script take the
    preemption for a failure. The job's ending is decided here; SIGTERM is ignored until the
    process has gone (a launcher that insists sends SIGKILL). Only from the main thread, where
    Python lets a handler be set (``main(fn)`` called elsewhere keeps the default).
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


if __name__ == "__main__":
    main()
