"""Waiting on another process by its progress, never by a wall-clock budget.

A test that waits for a ComfyUI server or a child process must not fail because the machine is busy
with other work (work that takes seconds on a quiet machine can take minutes on a loaded one), and must
not hang when the other side hangs. So a wait ends on an outcome, or after ``STALL_SECONDS`` in which
the other process tree showed no sign of work (``Activity``: CPU time, disk reads, major page faults).
devtools/comfy_server.py waits on its server this way; ``run_watched`` runs a child process so.
Linux only (/proc); standard library only.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import memwatch

# Waits end on an outcome, or on this many seconds with no sign of work (Activity):
# never on a wall-clock budget, which a busy machine can exceed for work that normally takes seconds.
STALL_SECONDS = 120.0


class Activity:
    """When a process tree last showed it was working: CPU time, disk reads or major page faults.

    Checked over windows of ``window`` seconds: a window counts as work when the tree used at least
    ``min_cpu`` of one core, or read from disk, or faulted a page in from disk. A server computing,
    loading a model or swapping pages back in does one of these however slowly a busy machine runs
    it; a hung one does none (answering the waiter's polls costs about 1 % of a core).
    """

    def __init__(self, pid: int, window: float = 2.0, min_cpu: float = 0.05) -> None:
        self.pid, self.window, self.min_cpu = pid, window, min_cpu
        self._mark, self._counts = time.monotonic(), self._counters()
        self._since = self._mark

    def _counters(self) -> tuple[float, int, int]:
        """CPU seconds (every thread's, to the nanosecond), major faults, bytes read from storage; summed
        over the tree."""
        cpu = faults = read = 0
        for pid in memwatch.tree(self.pid) if self.pid else []:
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                faults += int(fields[9])  # majflt
                cpu += _thread_cpu_ns(pid, fields)
            with contextlib.suppress(OSError, KeyError, ValueError):
                io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
                read += int(io["read_bytes"])
        return cpu / 1e9, faults, read

    def idle_for(self) -> float:
        """Seconds since the last window that showed work."""
        now = time.monotonic()
        if now - self._mark >= self.window:
            counts = self._counters()
            cpu, faults, read = (new - old for new, old in zip(counts, self._counts, strict=True))
            if cpu >= self.min_cpu * (now - self._mark) or faults or read:
                self._since = now
            self._mark, self._counts = now, counts
        return now - self._since


def _thread_cpu_ns(pid: int, stat_fields: list[str]) -> int:
    """The process's CPU time in ns: its threads' schedstat, or utime + stime (10 ms ticks) without it."""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks)
    except OSError:
        ticks = int(stat_fields[11]) + int(stat_fields[12])
        return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def run_watched(command: list[str], *, stall: float = STALL_SECONDS,
                **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **popen)`` (``capture_output``, ``text``, ``env``, ``cwd``, ``check``
    as there) with no limit on how long a working child may take (``communicate_watched``)."""
    check = popen.pop("check", False)
    if popen.pop("capture_output", False):
        popen["stdout"] = popen["stderr"] = subprocess.PIPE
    with subprocess.Popen(command, **popen) as process:
        out, err = communicate_watched(process, stall)
    result = subprocess.CompletedProcess(command, process.returncode, out, err)
    if check:
        result.check_returncode()
    return result


def communicate_watched(process: subprocess.Popen, stall: float = STALL_SECONDS) -> tuple[Any, Any]:
    """``process.communicate()`` that kills the child if it makes no progress for ``stall`` seconds,
    raising ``TimeoutError`` with what it printed to stderr so far."""
    activity = Activity(process.pid, window=min(2.0, stall / 4))
    while True:
        try:
            return process.communicate(timeout=0.5)
        except subprocess.TimeoutExpired:
            if activity.idle_for() > stall:
                process.kill()
                _, err = process.communicate()
                raise TimeoutError(f"{process.args!r:.200} made no progress for {stall:g} s; stderr so "
                                   f"far: {err!r:.2000}") from None
