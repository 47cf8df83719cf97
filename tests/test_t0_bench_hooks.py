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


def test_paired_ratio_is_the_median_of_per_round_ratios():
    import bench_hooks

    # the machine slows down between rounds: the ratio of medians (2.5 / 2.0 = 1.25) mixes rounds,
    # the per-round ratios (1.2, 1.25, 1.1) do not
    times = {("s", 16, "patchbay"): [1.2, 2.5, 4.4], ("s", 16, "nohook"): [1.0, 2.0, 4.0]}
    assert bench_hooks.paired(times, "s", 16, "patchbay") == pytest.approx(1.2)
    empty = {("s", 16, "patchbay"): [], ("s", 16, "nohook"): []}
    assert bench_hooks.paired(empty, "s", 16, "patchbay") is None


def test_scenario_and_size_options_parse_to_the_benchmark_order_and_name_bad_values():
    import argparse

    import bench_hooks

    parse = bench_hooks._scenarios
    assert parse("seed_rerun, regional_two_loras,seed_rerun") == ("regional_two_loras", "seed_rerun")
    with pytest.raises(argparse.ArgumentTypeError, match="regional.*choose from positive_lora"):
        parse("regional")
    assert bench_hooks._sizes("16,8,16") == (8, 16)
    for bad in ("", "sixteen", "0,8"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
            bench_hooks._sizes(bad)


def test_targets_print_only_the_scenarios_that_ran(capsys):
    import bench_hooks

    times = {("regional_two_loras", 16, c): [t] for c, t in
             (("nohook", 1.0), ("loraloader", 1.0), ("core", 1.4), ("patchbay", 1.05))}
    bench_hooks.print_targets(times, 16, {})
    out = capsys.readouterr().out
    assert "regional_two_loras   patchbay / plain 1.05 (paired 1.05)" in out
    assert "regional speed-up over core 1.33 (paired 1.33)" in out and "core / nohook = 1.40" in out
    assert "positive_lora" not in out and "seed_rerun" not in out
