"""The engine's step thread: runs a step's Python work while the engine thread is inside one
GIL-free call (xgrammar's mask fill), so that the two overlap.

Why this way round (the Python work handed over, the GIL-free call kept): a thread woken to run
Python must take the GIL. Here the engine thread enters the GIL-free call right after waking the
step thread, so the woken thread finds the GIL free, and the wake-up (some 20-60 us) passes while
the fill runs. Handing the fill to a woken thread instead leaves the engine thread waiting until
that thread has taken the GIL and entered the call (or, if it did not wait, the woken thread waits
for the GIL up to the interpreter's switch interval, 5 ms).

While the step thread runs, the engine thread is inside the call or waiting for the step thread
(`wait`); between the two it only notes that the call returned. Engine state is therefore used by
one thread at a time, and callbacks (`on_output`) still come one at a time, in order.
"""
from __future__ import annotations

import threading


class StepThread:
    """One call at a time: `submit` hands it over and returns at once, `wait` waits for it and
    raises what it raised. Plain locks, held while nothing is pending, do the hand-over."""

    def __init__(self, name: str = "constrained-spec-step"):
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._call = None
        self._error: BaseException | None = None
        self.busy = False  # submitted and not waited for (the submitting thread's view)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> None:
        if self.busy:
            raise RuntimeError("the step thread runs one call at a time")
        self._call = (fn, args)
        self.busy = True
        self._go.release()

    def wait(self) -> None:
        if not self.busy:
            return
        self._done.acquire()
        self.busy = False
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - closing: nobody is left to hand it to
            pass
        self._call = None
        self._go.release()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            self._go.acquire()
            call, self._call = self._call, None
            if call is None:
                return
            fn, args = call
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised by `wait`, on the engine thread
                self._error = e
            self._done.release()
