"""T1: the merge-node benchmark (devtools/bench_merge_nodes.py) runs end to end in its tiny mode and prints
one JSON line whose two contenders sampled the same average (core's ModelMergeSimple chain with ratios
1/2, 1/3, 1/4 and Patchbay's n_average), and whose grid (a 2x1 Merge Grid, alpha x block preset) gave
the images of the separate Merge runs, so its figures compare like with like. Every contender runs in one
child process (--one-process: ComfyUI imported once, not once per contender).

Marked ``once``: the benchmark is a development tool run on one version (`make bench-merge-nodes`, ComfyUI
0.3.75 unless told); what it times, the Merge node and core's ModelMergeSimple, is tested on every
version (tests/test_t1_merge_nodes.py, test_t1_merge_graph.py, T2), so a second run here checks no more
than the first and costs 20 s of CI."""

from __future__ import annotations

import json
import sys

import devpaths
import pytest
from progress import run_watched

pytestmark = [pytest.mark.t1, pytest.mark.once]

BENCH = devpaths.ROOT / "devtools" / "bench_merge_nodes.py"


def test_the_tiny_benchmark_prints_one_json_line_and_both_contenders_sample_the_same_average():
    command = [sys.executable, str(BENCH), "--arch", "tiny", "--rounds", "1", "--steps", "1", "--one-process",
               "--grid-shape", "2x1"]
    proc = run_watched(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]
    result = json.loads(lines[0])
    assert result["bench"] == "merge_nodes" and result["arch"] == "tiny" and result["models"] == 4
    for contender in ("patchbay", "core"):
        assert result[f"{contender}_first_latent_s"] > 0 and result[f"{contender}_peak_rss_mb"] > 0
    assert result["time_ratio"] > 0 and result["peak_rss_ratio"] > 0
    assert result["max_abs_latent_diff"] <= 1e-2 * result["latent_max_abs"]
    for contender in ("grid", "grid_nine"):
        assert result[f"{contender}_s"] > 0 and result[f"{contender}_peak_rss_mb"] > 0
        assert set(result[f"{contender}_phases_s"]) >= {"sampling", "decode", "merge_fill", "model_build"}
    assert result["grid_shape"] == "2x1" and result["grid_time_ratio"] > 0
    assert result["grid_max_abs_image_diff"] <= 4 / 255, "a grid cell differs from its Merge run"
    assert 0 < result["grid_time_ratio_floor"] < 1 and result["grid_time_ratio_besides_sampling"] > 0
    assert set(result["met"]) == {"peak_rss_ratio", "time_ratio", "grid_time_ratio",
                                  "grid_one_merge_peak_rss"}
