"""T0: the heavy-test gate of `make test`'s lanes (devtools/lane_gate.py) admits one process at a time.

A child process takes the gate and holds it; this process's ``enter`` blocks until the child gives it
back, or until the child dies holding it (the kernel drops its lock). Without a path it is no gate.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lane_gate
import pytest
from lane_gate import LaneGate

pytestmark = pytest.mark.t0

HOLD = 1.0  # seconds the child holds the gate
CHILD = textwrap.dedent("""
    import sys, time
    from lane_gate import LaneGate
    gate = LaneGate(sys.argv[1])
    gate.enter()
    print("held", flush=True)
    if sys.argv[2] == "die":
        time.sleep(60)  # killed by the test while holding the gate
    time.sleep(float(sys.argv[2]))
    gate.leave()
    time.sleep(60)  # alive after leaving: the gate opened by leave(), not by the exit
""")


def start_holder(path, hold: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(lane_gate.__file__).parent)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), hold], env=env,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_process_waits_until_the_holder_leaves(tmp_path):
    holder = start_holder(tmp_path / "gate.lock", str(HOLD))
    try:
        gate = LaneGate(str(tmp_path / "gate.lock"))
        began = time.monotonic()
        gate.enter()
        waited = time.monotonic() - began
        assert gate.held
        assert waited >= 0.8 * HOLD, f"entered after {waited:.2f} s while another process held the gate"
        assert gate.waited == pytest.approx(waited, abs=0.05)
        gate.enter()  # held already: no second lock, no wait
        gate.leave()
        assert not gate.held
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_that_dies_opens_the_gate(tmp_path):
    holder = start_holder(tmp_path / "gate.lock", "die")
    gate = LaneGate(str(tmp_path / "gate.lock"))
    holder.kill()
    holder.wait()
    began = time.monotonic()
    gate.enter()
    assert time.monotonic() - began < 0.5
    gate.leave()


def test_without_a_path_there_is_no_gate():
    gate = LaneGate(None)
    gate.enter()
    assert not gate.held and gate.waited == 0.0
    gate.leave()
