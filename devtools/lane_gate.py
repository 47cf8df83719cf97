"""One holder at a time across processes: the heavy-test gate of `make test`'s lanes (tests/conftest.py).

    gate = LaneGate("/path/heavy-tests.lock")   # None: no gate (every call does nothing)
    gate.enter()   # blocks while another process holds it; re-entering while held does nothing
    gate.leave()
    gate.waited    # seconds spent blocked in enter(), in total

An exclusive ``flock`` on one file: the kernel gives it back when the holding process exits, so a
crashed lane never blocks the others. Linux and macOS; standard library only.
"""

from __future__ import annotations

import fcntl
import time
from typing import IO


class LaneGate:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self.waited = 0.0
        self._held: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._held is not None

    def enter(self) -> None:
        if not self.path or self._held is not None:
            return
        began = time.monotonic()
        held = open(self.path, "a")  # noqa: SIM115 (open until leave())
        fcntl.flock(held, fcntl.LOCK_EX)
        self._held = held
        self.waited += time.monotonic() - began

    def leave(self) -> None:
        if self._held is not None:
            fcntl.flock(self._held, fcntl.LOCK_UN)
            self._held.close()
            self._held = None
