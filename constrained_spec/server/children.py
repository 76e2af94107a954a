"""The `serve` process's child processes (the engine process, the other front-ends) and the signals
meant for it.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group; `timeout`, `kill --
-PGID` and systemd (KillMode=control-group: SIGTERM to every process of the unit) do the same with
SIGTERM. A child that took such a signal as its own died of it in the middle of the `serve`
process's drain: the engine process's requests in flight failed, and the supervisor started it
again (a model load) during the shutdown. So a child ignores SIGINT and SIGTERM, from its first
instruction: `start` forks it with both blocked (a child inherits the mask of the thread that
forks it, through the exec, so one that arrives while the interpreter starts up waits), and
`ignore_stop_signals`, the first thing the child's target runs, sets them to SIG_IGN (a blocked
signal still pending is discarded then) and unblocks them. The parent stops its children itself
as part of its orderly shutdown, through each child's pipe ("stop"); a child whose parent is gone
sees that pipe's end (EOF) and stops too, so none is left behind.

A child that ignores SIGTERM also ignores `Process.terminate()`, which multiprocessing's own exit
handler sends to daemonic children still alive before it joins them without a time limit: a
parent that exits without having stopped one (an error, Ctrl-C while the model loads) would wait
for ever. So this module's exit handler, which runs before multiprocessing's, kills such a child.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing.util  # noqa: F401  (its exit handler is registered first, so it runs after ours)
import signal
import weakref

log = logging.getLogger("constrained_spec.children")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_started: "weakref.WeakSet" = weakref.WeakSet()


def start(process) -> None:
    """`process.start()`, the child shielded from SIGINT and SIGTERM from its first instruction
    (see above). Any thread may call it (the mask is the calling thread's alone: a signal for this
    process meanwhile goes to another thread, or waits until the mask is restored)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    _started.add(process)


def ignore_stop_signals() -> None:
    """The first thing a child started by `start` runs: SIGINT and SIGTERM ignored, then unblocked."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _kill_left_behind() -> None:
    for process in list(_started):
        try:
            if process.is_alive():
                log.warning("%s (pid %s) was not stopped; killing it", process.name, process.pid)
                process.kill()
                process.join(5)
        except Exception:  # (a process object of another process, after a fork)
            pass


atexit.register(_kill_left_behind)
