"""Peak memory for devtools/bench_hooks.py: RSS on the CPU, torch's allocator on CUDA; timing fences.

On the CPU the benchmark reads the peak RSS of one run in a fresh process per (scenario, contender)
(``bench_hooks.py --probe``), because in one process the contenders disturb each other's figures
(the allocator keeps what one frees for the next). On CUDA ``torch.cuda.max_memory_allocated``
counts only live tensors, so the timed runs measure it in-process. ``RunMeter`` brackets one run:
``start()`` before building the inputs, ``fence()`` around the timed call (a CUDA synchronize, so
perf_counter sees the kernels finish), ``peak_mb()`` after.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable

METHODS = {
    "cpu": ("a fresh process per scenario and contender: after one warm-up run, the peak RSS of a second run "
            "(VmHWM after clear_refs) over the RSS before it, minus the scenario's nohook probe"),
    "cuda": ("torch.cuda.max_memory_allocated of each timed run over the allocation before it (inputs built, "
             "model loaded to the GPU, sampled), median over rounds, minus the scenario's nohook median"),
}


class RunMeter:
    """Peak memory of one run over the memory before it, and the synchronisation timing needs."""

    def __init__(self, device: str) -> None:
        import torch

        self.device, self.torch, self.before = device, torch, 0.0

    def start(self) -> None:
        if self.device == "cuda":
            self.fence()
            self.torch.cuda.reset_peak_memory_stats()
            self.before = self.torch.cuda.memory_allocated() / 2**20
        else:
            self.before = _rss_kb("VmRSS") / 1024
            _reset_peak_rss()

    def fence(self) -> None:
        """Wait for queued GPU work (a no-op on the CPU) so a clock read after it covers that work."""
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def peak_mb(self) -> float:
        if self.device == "cuda":
            self.fence()
            return self.torch.cuda.max_memory_allocated() / 2**20 - self.before
        return _rss_kb("VmHWM") / 1024 - self.before


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def over_plain(peaks: dict, scenarios: tuple[str, ...], contenders: tuple[str, ...]) -> dict:
    """``{scenario: {contender: MB over the scenario's nohook}}`` from ``peaks[(scenario, contender)]``
    (MB or None); None where either is missing."""
    return {s: {c: None if peaks.get((s, c)) is None or peaks.get((s, "nohook")) is None
                else peaks[(s, c)] - peaks[(s, "nohook")] for c in contenders} for s in scenarios}


def in_process(peaks: dict, side: int, scenarios: tuple[str, ...], contenders: tuple[str, ...]) -> dict:
    """CUDA: over_plain of the median peak of the timed runs (``peaks[(scenario, side, contender)]``)."""
    medians = {(s, c): statistics.median(peaks[(s, side, c)]) if peaks.get((s, side, c)) else None
               for s in scenarios for c in contenders}
    return over_plain(medians, scenarios, contenders)


def probe_processes(command: Callable[[str, str], list[str]], scenarios: tuple[str, ...],
                    contenders: tuple[str, ...]) -> dict:
    """CPU: run ``command(scenario, contender)`` (a ``--probe`` argv) for the nohook baseline and each
    of ``contenders``; over_plain of the ``peak_mb`` they print."""
    peaks: dict = {}
    for scenario in scenarios:
        for contender in ("nohook", *contenders):
            proc = subprocess.run(command(scenario, contender), capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"probe"')]
            if not lines:
                print(f"probe {scenario}/{contender} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            peaks[(scenario, contender)] = json.loads(lines[-1])["peak_mb"] if lines else None
    return over_plain(peaks, scenarios, contenders)


def print_table(over: dict, side: int, device: str, files_mb: dict, contenders: tuple[str, ...]) -> None:
    print(f"\npeak memory over plain (MB) at {side}x{side}, method: {METHODS[device]}")
    print(f"{'scenario':<20} " + " ".join(f"{c:>11}" for c in contenders) + f" {'lora files':>11}")
    for scenario, row in over.items():
        cells = " ".join(f"{'-' if row.get(c) is None else format(row[c], '.2f'):>11}" for c in contenders)
        print(f"{scenario:<20} {cells} {files_mb[scenario]:>11.2f}")
