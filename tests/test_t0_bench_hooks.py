"""T0: the hooks benchmark's final JSON line (devtools/bench_hooks.py) has exactly issue 4's keys."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.t0

KEYS = {"patchbay_s", "core_s", "nohook_s", "loraloader_s", "patchbay_rss_mb_over_plain", "lora_files_mb"}
SCENARIOS = {"positive_lora", "scheduled_lora", "regional_two_loras", "seed_rerun"}


def test_json_line_has_the_required_keys_and_nulls_for_a_missing_contender():
    import bench_hooks

    medians = {s: {"nohook": 1.0, "loraloader": 1.1, "core": 1.5, "patchbay": None} for s in SCENARIOS}
    medians["seed_rerun"].pop("core")  # a contender that did not run at all
    rss = {"positive_lora": {"patchbay": None}}
    line = bench_hooks.json_line(medians, rss, {s: 2.0 for s in SCENARIOS})
    assert "\n" not in line
    data = json.loads(line)
    assert set(data) == {"bench", "scenarios"} and data["bench"] == "hooks"
    assert set(data["scenarios"]) == SCENARIOS
    for figures in data["scenarios"].values():
        assert set(figures) == KEYS
        assert figures["patchbay_s"] is None and figures["patchbay_rss_mb_over_plain"] is None
        assert figures["lora_files_mb"] == 2.0
    assert data["scenarios"]["seed_rerun"]["core_s"] is None
    assert data["scenarios"]["positive_lora"]["core_s"] == 1.5
