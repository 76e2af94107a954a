"""The cores this process may run on (its affinity set, which a container or `taskset` narrows;
os.cpu_count() counts the whole machine's): what thread pools and front-end counts are sized by."""
from __future__ import annotations

import os


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 2


def name_os_thread(name: str) -> None:
    """Gives the calling thread a name the OS shows (`top -H`, /proc/<pid>/task/<tid>/comm; 15
    characters at most), so a server's CPU time can be told apart by thread: Python's thread names
    stay inside Python. Does nothing where it cannot (not Linux)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
