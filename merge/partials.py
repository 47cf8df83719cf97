"""Temporary ``.<name>.<pid>-XXXXXXXX.partial`` files of merges killed before cleaning up (SIGKILL, power
loss): removed before a merge writes ``<name>``, unless their process still runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_PARTIAL = re.compile(r"(?:(\d+)-)?[a-z0-9_]{8}")  # <pid>-<mkstemp's 8 characters>


def remove_stale(path: Path) -> list[Path]:
    """Delete ``.<name>.<pid>-*.partial`` files of ``path`` left by a merge whose process is gone
    (killed before it could clean up); a running merge's file is kept. Returns what was removed."""
    removed = []
    prefix = f".{path.name}."
    for candidate in path.parent.glob(".*.partial"):
        middle = candidate.name[len(prefix):-len(".partial")] if candidate.name.startswith(prefix) else ""
        match = _PARTIAL.fullmatch(middle)
        if match is None:  # another output's file (``.<name>.x.<pid>-...``) or not ours at all
            continue
        pid = int(match[1]) if match[1] else None  # no pid: written before pids were recorded
        if pid is not None and (pid == os.getpid() or _alive(pid)):
            continue
        candidate.unlink(missing_ok=True)
        removed.append(candidate)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
