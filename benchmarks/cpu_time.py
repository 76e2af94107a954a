"""Where a served run's CPU time goes, by role: the engine loop thread, the grammar mask threads, the
rest of the engine process, the front-ends, the client processes, and the whole host. Read from
/proc before and after a run (Linux; elsewhere nothing is reported): the server names its threads
(`constrained_spec.cpus.name_os_thread`, and "cs-mask" for the native mask pool), so a thread's role
is its name, or its process's.

Cores busy = CPU seconds over the run's wall seconds: on a host of N cores, a host figure near N
means the run was short of CPU, and the roles say who took it.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

ROLES = ["engine loop", "mask threads", "engine other", "front-ends", "clients", "host"]
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return sorted(set(out))


def _stat(path: Path) -> tuple[str, float]:
    """A task's name and CPU seconds (user + system) from its stat file."""
    text = path.read_text()
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return name, (int(fields[11]) + int(fields[12])) / _TICK


def _role(process: str, thread: str) -> str:
    if thread == "cs-engine":
        return "engine loop"
    if thread == "cs-mask":
        return "mask threads"
    if process in ("cs-engine-proc", "cs-server"):  # the single-process server's HTTP work counts here
        return "engine other"
    if process == "cs-frontend":
        return "front-ends"
    return "other"


def snapshot(server_pid: int) -> dict:
    """CPU seconds by role of a server's processes (or of this process, with an in-process engine)
    and the host's, now, with the wall time they were read at (empty off Linux). The client
    processes count their own (`time.process_time`)."""
    if not Path("/proc/stat").is_file():
        return {}
    out: Counter = Counter()
    for pid in process_tree(server_pid):
        try:
            process, _ = _stat(Path(f"/proc/{pid}/stat"))
            for task in Path(f"/proc/{pid}/task").iterdir():
                thread, seconds = _stat(task / "stat")
                out[_role(process, thread)] += seconds
        except (OSError, ValueError):  # a process or thread that ended meanwhile
            pass
    cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    out["host"] = (sum(map(int, cpu)) - int(cpu[3]) - int(cpu[4])) / _TICK  # all but idle and iowait
    return {**out, "at": time.perf_counter()}


def cores_busy(before: dict, after: dict, client_cpu_s: float = 0.0, seconds: float | None = None) -> dict | None:
    """Cores busy by role between two snapshots, and the clients' CPU seconds: CPU seconds over
    `seconds` (the run's own length: the snapshots' wider window also holds the clients' start-up,
    when the server has nothing to do), or over the window between the snapshots."""
    if not before or not after:
        return None
    wall = max(seconds or after["at"] - before["at"], 1e-9)
    busy = {role: (after.get(role, 0.0) - before.get(role, 0.0)) / wall for role in ROLES + ["other"]}
    busy["clients"] = client_cpu_s / wall
    return busy
