"""T1: the merge-node benchmark (devtools/bench_merge_nodes.py) runs end to end in its tiny mode and prints
one JSON line whose two contenders sampled the same average (core's ModelMergeSimple chain with ratios
1/2, 1/3, 1/4 and Patchbay's n_average), so its figures compare like with like."""

from __future__ import annotations

import json
import subprocess
import sys

import devpaths
import pytest

pytestmark = pytest.mark.t1

BENCH = devpaths.ROOT / "devtools" / "bench_merge_nodes.py"


def test_the_tiny_benchmark_prints_one_json_line_and_both_contenders_sample_the_same_average():
    command = [sys.executable, str(BENCH), "--arch", "tiny", "--rounds", "1", "--steps", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]
    result = json.loads(lines[0])
    assert result["bench"] == "merge_nodes" and result["arch"] == "tiny" and result["models"] == 4
    for contender in ("patchbay", "core"):
        assert result[f"{contender}_first_latent_s"] > 0 and result[f"{contender}_peak_rss_mb"] > 0
    assert result["time_ratio"] > 0 and result["peak_rss_ratio"] > 0
    assert result["max_abs_latent_diff"] <= 1e-2 * result["latent_max_abs"]
    assert set(result["met"]) == {"peak_rss_ratio", "time_ratio"}
