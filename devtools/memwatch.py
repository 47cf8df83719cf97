"""Peak memory of a process tree, sampled: what `make test` prints with each tier's time.

    python devtools/memwatch.py --pid PID --labels DIR --out FILE
    python devtools/memwatch.py --summarize FILE REPORT...

samples the tree under PID (the test run: pytest, the ComfyUI servers it starts, Chromium) every
``--interval`` seconds until PID exits or this process gets SIGTERM, then writes FILE (JSON): the peak
of the whole tree and, per label, the peak while that label was current. A label is the text of a file
in DIR (one file per concurrent job: the test runner writes ``0.3.75 t1`` into its file when the tier
changes, tests/conftest.py), so memory is attributed to the tier and version that used it. A label
file's further lines (the running test's id) are not part of the label; the peak records them
(``peak_during``), so the summary names the tests that ran when the whole run peaked.
``--summarize`` prints FILE with the test reports (tests/conftest.py's $PATCHBAY_TEST_REPORT, a tier's
seconds and outcomes) as one table: what `make test` ends with.

Memory is the sum of each process's private resident memory (``RssAnon + RssShmem`` in
/proc/PID/status): what the run holds. File-backed pages (torch's libraries, model files mapped from
disk) are page cache the kernel can drop, and are left out. ``--measure pss`` sums the proportional set
size (``Pss`` in /proc/PID/smaps_rollup) instead, libraries included (about 0.8 GB more per T1 process);
reading it walks the process's page tables (85 ms for a 6 GB process on this machine, in the kernel, on
the cores the tests run on), so it is not the default. Linux only; standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

MB = 1 << 20


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process readable in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def tree(root: int) -> list[int]:
    """``root`` and all its descendants."""
    children, todo, found = children_map(), [root], []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def resident_bytes(pid: int) -> int:
    """The process's private resident memory (RssAnon + RssShmem); 0 if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return sum(int(line.split()[1]) * 1024 for line in status
                       if line.startswith(("RssAnon:", "RssShmem:")))
    except (OSError, ValueError, IndexError):
        return 0


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (for comparison: reading it walks the page tables)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


MEASURES = {"resident": resident_bytes, "pss": pss_bytes}


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


@dataclass
class Peaks:
    """The largest total seen, what held it, and the largest total per label."""

    total: int = 0
    at: float = 0.0
    top: list[tuple[int, str]] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)
    during: list[str] = field(default_factory=list)  # the label files' further lines at the peak

    def add(self, sample: dict[int, int], labels: list[str], seconds: float) -> None:
        total = sum(sample.values())
        for text in labels:
            label = text.splitlines()[0]
            self.labels[label] = max(self.labels.get(label, 0), total)
        if total > self.total:
            self.total, self.at = total, seconds
            self.during = sorted(" ".join(text.splitlines()[1:]) for text in labels if "\n" in text)
            biggest = sorted(sample.items(), key=lambda item: -item[1])[:5]
            self.top = [(size // MB, command(pid)) for pid, size in biggest]

    def as_json(self) -> dict:
        return {"peak_mb": self.total // MB, "peak_at_s": round(self.at), "top": self.top,
                "labels_mb": {label: size // MB for label, size in self.labels.items()},
                "peak_during": self.during}


def current_labels(folder: Path | None) -> list[str]:
    if folder is None or not folder.is_dir():
        return []
    labels = []
    for path in folder.iterdir():
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            labels.append(text)
    return labels


def watch(pid: int, labels: Path | None, interval: float, measure: str = "resident") -> Peaks:
    """Sample until ``pid`` exits or SIGTERM arrives."""
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    peaks, began = Peaks(), time.monotonic()
    while not stop and os.path.exists(f"/proc/{pid}"):
        sample = {p: MEASURES[measure](p) for p in tree(pid)}
        peaks.add(sample, current_labels(labels), time.monotonic() - began)
        time.sleep(interval)
    return peaks


def _program(cmd: str) -> str:
    """What a command line runs, shortly: ``pytest``, ``.../comfyui/main.py``, ``chromium``."""
    words = cmd.split()
    if len(words) > 2 and words[1] == "-m":
        return words[2]
    script = next((w for w in words[1:] if w.endswith(".py")), words[0] if words else "?")
    return "/".join(Path(script).parts[-2:])


def summary(memory: dict, reports: list[dict], seconds: int) -> str:
    """The table `make test` ends with: each version's tiers (seconds, peak, outcomes), then the run."""
    labels = memory.get("labels_mb", {})
    lines = ["peak MB: the whole run's memory while the tier ran (tiers run side by side share it)",
             "version  tier  seconds  peak MB  tests", "-------  ----  -------  -------  -----"]
    for report in reports:
        version = report["version"]
        for tier, result in report["tiers"].items():
            outcomes = ", ".join(f"{n} {o}" for o, n in sorted(result.items()) if o != "seconds")
            peak = labels.get(f"{version} {tier}", "?")
            lines.append(f"{version:<7}  {tier:<4}  {result['seconds']:7.0f}  {peak:>7}  {outcomes}")
    for label, peak in sorted(labels.items()):
        if label.startswith("models"):
            lines.append(f"{label}: peak {peak} MB")
    top = ", ".join(f"{size} MB {_program(cmd)}" for size, cmd in memory["top"][:3])
    lines.append(f"whole run: {seconds // 60} min {seconds % 60} s, peak {memory['peak_mb']} MB "
                 f"(at {memory['peak_at_s']} s: {top}); private resident memory of every process it started")
    if memory.get("peak_during"):
        lines.append("running at the peak: " + "; ".join(memory["peak_during"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--summarize", nargs="+", type=Path, metavar="FILE",
                        help="print the memory report FILE and the test reports after it as a table")
    parser.add_argument("--seconds", type=int, default=0, help="with --summarize: the run's wall time")
    parser.add_argument("--pid", type=int, help="the root of the process tree")
    parser.add_argument("--out", type=Path, help="JSON report written at the end")
    parser.add_argument("--labels", type=Path, help="folder of label files (see the module docstring)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--measure", choices=sorted(MEASURES), default="resident",
                        help="resident (default): RssAnon + RssShmem; pss: proportional set size (slow)")
    args = parser.parse_args(argv)
    if args.summarize:
        memory, *reports = args.summarize
        found = [json.loads(report.read_text()) for report in reports if report.is_file()]
        print(summary(json.loads(memory.read_text()), found, args.seconds))
        return 0
    if args.pid is None or args.out is None:
        parser.error("give --pid and --out (or --summarize)")
    peaks = watch(args.pid, args.labels, args.interval, args.measure)
    args.out.write_text(json.dumps(peaks.as_json(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
