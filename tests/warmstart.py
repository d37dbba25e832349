"""Warm rank starts for the tests' MPI jobs: each rank's Python forked from one that has already
imported PyTorch, instead of importing it anew (about 1.5 CPU seconds a rank, and 1 more for
``torch._dynamo``, which an optimizer imports; most of the suite's CPU time on a 2-core machine).

The ranks stay real MPI processes: mpiexec starts each rank as usual, but as this small program
(``python -S -E warmstart.py [python options] script args``, the *shim*, stdlib only, a few
milliseconds), which hands its standard streams, the launcher's PMI descriptor, its arguments,
environment, working directory, umask, resource limits and signal dispositions to the *server*
(started once per test session, ``$MPICKPT_WARM_SOCKET``). The server forks; the child takes all
of that over, initialises MPI itself (the server never does) and runs the script as ``python``
would (``runpy``: a script, ``-m module`` or ``-c code``, then the normal interpreter exit:
threads joined, ``atexit``, MPI_Finalize). The shim forwards the signals it gets to the child and
ends as the child did: the same exit code, or killed by the same signal (SIGKILL included), so
mpiexec sees what it would have seen. When the shim dies first (its job was killed), the server
kills the child; when the server dies, its children die with it (``PR_SET_PDEATHSIG``).

Not used, the shim ``exec``s the real Python instead (same arguments), when no server is set,
it cannot be reached, or the shim runs with other credentials than the server (a job behind
``setpriv``, whose point is to run without root's powers). ``MPICKPT_WARM=0`` turns it off for a
session. What cannot be carried over: Python options other than ``-u``, and state a module
reads when it is imported (PyTorch, NumPy, h5py and mpi4py's package are imported by the server,
with ``OPENBLAS_NUM_THREADS=1``; mpickpt and the rest are imported by each child).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import resource
import signal
import socket
import struct
import sys

SOCKET_ENV = "MPICKPT_WARM_SOCKET"
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
             signal.SIGALRM, signal.SIGQUIT)
LIMITS = [getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")]
BASE_PATH: list[str] = []  # the server's sys.path less its first entry (its own directory)


# -------------------------------------------------------------------------------- the wire


def send_msg(sock: socket.socket, obj: object, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    head = struct.pack("!I", len(data))
    if fds:
        sock.sendmsg([head + data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", fds))])
    else:
        sock.sendall(head + data)


def recv_msg(sock: socket.socket, want_fds: int = 0) -> tuple[object, list[int]] | None:
    """One message and the descriptors that came with it; None at the end of the stream."""
    fds: list[int] = []
    head = b""
    while len(head) < 4:
        if want_fds and not fds:
            chunk, anc, _, _ = sock.recvmsg(4 - len(head), socket.CMSG_LEN(4 * want_fds))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", payload[: len(payload) - len(payload) % 4])
        else:
            chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (size,) = struct.unpack("!I", head)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return json.loads(data), fds


# -------------------------------------------------------------------------------- the shim


def plain(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def shim(argv: list[str]) -> None:
    """This rank: hand everything to the server's child, forward signals, end as it ended."""
    import select

    path = os.environ.get(SOCKET_ENV)
    if not path or os.environ.get("MPICKPT_WARM") == "0":
        plain(argv)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        owner = os.stat(path).st_uid
    except OSError:
        plain(argv)
    if os.geteuid() != owner or os.getuid() != owner or _capabilities() != _server_caps(path):
        sock.close()
        plain(argv)  # setpriv and friends: the point is another identity
    pending: list[int] = []
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # the mask before
    ignored = [int(s) for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]
    targets = sorted(int(fd) for fd in os.listdir("/proc/self/fd")
                     if int(fd) != sock.fileno() and _is_open(int(fd)))
    if len(targets) > 250:  # more than one message can pass (SCM_MAX_FD is 253)
        sock.close()
        plain(argv)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
               "umask": _umask(), "limits": {str(r): resource.getrlimit(r) for r in LIMITS},
               "ignored": ignored, "blocked": sorted(int(s) for s in blocked),
               "targets": targets}
    send_msg(sock, request, targets)

    def forward(signum: int, _frame: object) -> None:
        pending.append(signum)

    for s in FORWARDED:
        if s not in ignored:
            signal.signal(s, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    while True:
        while pending:
            try:
                send_msg(sock, {"signal": pending.pop(0)})
            except OSError:
                break
        try:
            ready, _, _ = select.select([sock], [], [], 0.05)
        except InterruptedError:
            continue
        if not ready:
            continue
        got = recv_msg(sock)
        if got is None:  # the server died
            os._exit(1)
        msg = got[0]
        assert isinstance(msg, dict)
        if msg.get("end") == "signal":  # die of it too
            sig = int(msg["n"])
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            os.kill(os.getpid(), sig)
            os._exit(128 + sig)
        if msg.get("end") == "exit":
            os._exit(int(msg["n"]))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _capabilities() -> str:
    with open("/proc/self/status") as f:
        return "".join(line for line in f if line.startswith(("CapEff", "CapBnd", "CapInh")))


def _server_caps(path: str) -> str:
    try:
        with open(path + ".caps") as f:
            return f.read()
    except OSError:
        return ""


# ------------------------------------------------------------------------------- the server


def serve(path: str) -> dict | None:
    """Accept ranks until killed. Returns (in a forked child only) what that child must run."""
    import selectors

    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    import h5py  # noqa: F401
    import mpi4py  # noqa: F401  (the package; mpi4py.MPI initialises MPI: each child does)
    import numpy  # noqa: F401
    import torch
    import torch._dynamo
    import torch.distributed
    import xxhash  # noqa: F401

    del torch
    import gc

    gc.collect()
    gc.freeze()  # the children's collections skip what is imported here (fewer copied pages)
    BASE_PATH[:] = sys.path[1:]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    listener.bind(path)
    os.chmod(path, 0o600)
    with open(path + ".caps", "w") as f:
        f.write(_capabilities())
    listener.listen(256)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("accept", None))
    children: dict[int, list] = {}  # pid -> [the shim's socket or None once gone, pidfd]
    server = os.getpid()
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            kind, pid = key.data
            try:
                if kind == "accept":
                    job = _accept(listener, sel, children)
                    if job is not None:  # the forked child
                        return job
                elif pid in children:
                    _event(kind, pid, sel, children)
            except Exception:  # one rank's trouble must not end the others'
                import traceback

                traceback.print_exc()
                if os.getpid() != server:  # never a second server: a child that failed ends
                    os._exit(1)


def _accept(listener: socket.socket, sel: object, children: dict[int, list]) -> dict | None:
    """A rank connected: fork its child (which gets what to run), or register it."""
    import selectors

    assert isinstance(sel, selectors.BaseSelector)
    conn, _ = listener.accept()
    got = recv_msg(conn, want_fds=250)
    if got is None:
        conn.close()
        return None
    request, fds = got
    assert isinstance(request, dict)
    pid = os.fork()
    if pid == 0:
        sel.close()
        listener.close()
        for c, pfd in children.values():
            if c is not None:
                c.close()
            os.close(pfd)
        conn.close()
        return {**request, "fds": fds, "base_path": list(BASE_PATH)}
    for fd in fds:
        os.close(fd)
    pfd = os.pidfd_open(pid)
    children[pid] = [conn, pfd]
    sel.register(conn, selectors.EVENT_READ, ("shim", pid))
    sel.register(pfd, selectors.EVENT_READ, ("child", pid))
    return None


def _event(kind: str, pid: int, sel: object, children: dict[int, list]) -> None:
    """The shim of ``pid`` spoke (a signal to forward) or went away (kill the child), or the
    child ended (tell the shim how)."""
    import selectors

    assert isinstance(sel, selectors.BaseSelector)
    conn, pfd = children[pid]
    if kind == "shim":
        try:
            msg = recv_msg(conn)
        except OSError:
            msg = None
        if msg is None:  # the shim is gone: its job was ended
            sel.unregister(conn)
            conn.close()
            children[pid][0] = None
            _kill(pid, signal.SIGKILL)
        elif isinstance(msg[0], dict) and "signal" in msg[0]:
            _kill(pid, int(msg[0]["signal"]))
        return
    del children[pid]  # the child ended
    _, status = os.waitpid(pid, 0)
    sel.unregister(pfd)
    os.close(pfd)
    if conn is None:
        return
    sel.unregister(conn)
    end = ({"end": "signal", "n": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else
           {"end": "exit", "n": os.waitstatus_to_exitcode(status)})
    with contextlib.suppress(OSError):
        send_msg(conn, end)
    conn.close()


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def become(req: dict) -> list[str]:
    """In the forked child: take over the rank's streams, descriptors, environment and process
    attributes; the program's argv (python options removed)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
    if os.getppid() == 1:
        os._exit(1)
    import fcntl

    targets, fds = req["targets"], req["fds"]
    keep = set(targets)
    high = max([*targets, *fds]) + 1  # above every target and every received descriptor
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, high) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target)  # inheritable, as the rank had it
        os.close(fd)
    for fd in os.listdir("/proc/self/fd"):
        n = int(fd)
        if n not in keep and n > 2:
            with contextlib.suppress(OSError):
                os.close(n)
    os.chdir(req["cwd"])
    os.umask(req["umask"])
    for r, (soft, hard) in req["limits"].items():
        if resource.getrlimit(int(r)) != (soft, hard):
            try:
                resource.setrlimit(int(r), (soft, hard))
            except (ValueError, OSError) as e:  # the rank cannot be what it would have been
                os.write(2, f"warmstart: cannot set resource limit {r}: {e}\n".encode())
                os._exit(1)
    for s in range(1, signal.NSIG):
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            signal.signal(s, signal.SIG_IGN if s in req["ignored"] else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python starts
    if signal.SIGINT in req["ignored"]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python starts
    signal.pthread_sigmask(signal.SIG_SETMASK, req["blocked"])
    os.environ.clear()
    os.environ.update(req["env"])
    argv = list(req["argv"])
    while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c"):
        argv.pop(0)  # -u: the server's streams are unbuffered already (it runs with -u)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = (os.path.dirname(os.path.abspath(argv[0])) if argv and argv[0] not in ("-m", "-c")
             else os.getcwd() if argv[:1] == ["-m"] else "")
    sys.path[:] = [first, *extra, *req["base_path"]]
    return argv


def run(argv: list[str]) -> int:
    """Run the program as ``python ARGV`` would; its exit code (an uncaught exception printed
    by ``sys.excepthook``, as Python does)."""
    import runpy

    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code & 0xFF
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def leave(code: int) -> None:
    """End the child as the interpreter ends, less its teardown of every module (what the
    server imported: most of a second of CPU a rank): threads joined and their exit hooks
    (``threading._shutdown``), ``atexit``, MPI_Finalize (mpi4py's own exit hook), the
    streams flushed, then the C library's ``exit``. A program that leaves data in an
    unflushed, unclosed Python file object loses it here, as it would if it were killed."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    import ctypes

    # the C library's exit, the GIL held (its handlers may call Python): they run, MPICH's PMI
    # finalize among them (without it the launcher takes the rank for dead and ends the job)
    ctypes.PyDLL(None).exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        job = serve(sys.argv[2])
        if job is not None:  # a forked child: this rank's program, then its exit
            leave(run(become(job)))
    else:
        shim(sys.argv[1:])
