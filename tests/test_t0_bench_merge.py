"""T0: the merge benchmark's final JSON line (devtools/bench_merge.py) has exactly issue 6's keys."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.t0

KEYS = {"patchbay_s", "sdmecha_s", "floor_s", "patchbay_peak_rss_mb", "max_abs_diff_vs_sdmecha"}


def test_json_line_has_the_required_keys_and_nulls_for_what_did_not_run():
    import bench_merge

    results = {"weighted_sum_2": {"patchbay_s": 1.234, "sdmecha_s": 30.0, "floor_s": 1.0,
                                  "patchbay_peak_rss_mb": 700.123, "max_abs_diff_vs_sdmecha": 0.0},
               "average_8": {"patchbay_s": 2.0, "floor_s": 1.5}}  # sd-mecha skipped (--no-sdmecha)
    line = bench_merge.json_line(results)
    assert "\n" not in line
    data = json.loads(line)
    assert data["bench"] == "merge" and set(data) == {"bench", "recipes"}
    assert set(data["recipes"]) == {"weighted_sum_2", "add_difference_3", "average_8"}
    assert all(set(figures) == KEYS for figures in data["recipes"].values())
    assert data["recipes"]["weighted_sum_2"]["patchbay_s"] == 1.23
    assert data["recipes"]["average_8"]["sdmecha_s"] is None
    assert all(v is None for v in data["recipes"]["add_difference_3"].values())


def test_sd15_unet_layout_has_686_keys_of_1_72_gb():
    import math

    import bench_merge

    layout = bench_merge.unet_layout()
    assert len(layout) == 686 and all(key.startswith("model.diffusion_model.") for key, _ in layout)
    assert abs(sum(math.prod(shape) for _, shape in layout) * 2 / 1e9 - 1.72) < 0.01
