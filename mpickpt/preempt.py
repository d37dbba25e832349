"""Preemption signals: SIGUSR2 (configurable) and SIGTERM set a flag; nothing else happens in the
handler. :meth:`mpickpt.Checkpointer.should_exit` agrees on the flag across ranks at a safe point.

``MPICKPT_SIGNAL`` names the preemption signal instead of SIGUSR2 (e.g. ``SIGUSR1``); SIGTERM is
always watched, since Slurm and most schedulers send it before they kill a job.
"""

from __future__ import annotations

import atexit
import signal
import threading

from . import knobs

_received: list[int] = []
_installed: set[signal.Signals] = set()


def _handler(signum: int, frame: object) -> None:
    _received.append(signum)


def signals() -> list[signal.Signals]:
    name = knobs.SIGNAL.get()
    try:
        main = signal.Signals[name]
    except KeyError:
        raise ValueError(f"MPICKPT_SIGNAL={name!r} is not a signal name") from None
    return list(dict.fromkeys([main, signal.SIGTERM]))


def hold_early() -> None:
    """At ``import mpickpt``: hold the preemption signal until a Checkpointer exists, so that an
    early SIGUSR2 does not kill the rank; only where the program has no handler of its own, and
    never failing the import (a bad ``MPICKPT_SIGNAL`` is refused by the Checkpointer)."""
    try:
        sig = signals()[0]
        if signal.getsignal(sig) is signal.SIG_DFL:
            install(term=False)
    except ValueError:
        pass  # the Checkpointer's install() raises it, naming the variable


def install(term: bool = True) -> bool:
    """Install the handlers from the main thread (False where that is impossible). Without
    ``term`` only the preemption signal's: the run wrapper does that at start, so an early
    SIGUSR2 does not kill a rank, while SIGTERM still ends a script that has no Checkpointer."""
    wanted = [s for s in signals() if term or s != signal.SIGTERM]
    if all(s in _installed for s in wanted):
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if not _installed:
        atexit.register(_ignore_at_exit)
    for sig in wanted:
        signal.signal(sig, _handler)
        _installed.add(sig)
    return True


def _ignore_at_exit() -> None:
    """At interpreter exit the preemption signal is ignored where our handler still has it.
    Python resets its handlers to the default after the ``atexit`` hooks, and the default of
    SIGUSR2 ends the process: a signal that came late (Slurm sends ``--signal`` up to a minute
    early, so it may reach a rank that has trained and committed its last step and is tearing
    down) would turn a finished run into one killed by signal 12. ``SIG_IGN`` survives that reset.
    SIGTERM keeps its meaning: it is how a job is ended on purpose."""
    for sig in _installed:
        if sig != signal.SIGTERM and signal.getsignal(sig) is _handler:
            signal.signal(sig, signal.SIG_IGN)


NONE, TERMINATE, PREEMPT = 0, 1, 2


def kind() -> int:
    """PREEMPT if the preemption signal (SIGUSR2 by default) came, TERMINATE if only SIGTERM did,
    else NONE. Only PREEMPT asks for a requeue: SIGTERM is also how ``scancel`` ends a job."""
    if not _received:
        return NONE
    return TERMINATE if all(s == signal.SIGTERM for s in _received) else PREEMPT
