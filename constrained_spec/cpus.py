"""The cores this process may run on (its affinity set, which a container or `taskset` narrows;
os.cpu_count() counts the whole machine's): what thread pools and front-end counts are sized by."""
from __future__ import annotations

import os


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 2
