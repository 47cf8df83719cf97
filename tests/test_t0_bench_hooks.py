"""T0: the hooks benchmark (devtools/bench_hooks.py, bench_models.py, bench_memory.py): the final JSON
line has exactly issues 4, 18 and 34's keys, the options resolve to each arch's defaults, the memory
arithmetic and the printed targets follow the arch, the region scenarios (issue 34 item 3) run only the
contenders that apply. Nothing here is timed or imports ComfyUI."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.t0

KEYS = {"patchbay_s", "core_s", "nohook_s", "loraloader_s", "bypass_s", "couple_s",
        "patchbay_rss_mb_over_plain", "lora_files_mb", "x_plain_paired"}
RUN = {"arch": "sd15-full", "device": "cpu", "steps": 10, "compile": False, "comfyui": "0.33.0",
       "memory": "peak_rss"}
ISSUE_4 = {"positive_lora", "scheduled_lora", "regional_two_loras", "seed_rerun"}
REGIONS = {"regions_2_loras", "regions_4_loras", "regions_8_loras"}
SCENARIOS = ISSUE_4 | REGIONS


def test_json_line_has_the_required_keys_and_nulls_for_a_missing_contender():
    import bench_hooks

    medians = {s: {"nohook": 1.0, "loraloader": 1.1, "core": 1.5, "patchbay": None} for s in SCENARIOS}
    medians["seed_rerun"].pop("core")  # a contender that did not run at all
    medians["positive_lora"]["bypass"] = 1.23456  # ComfyUI 0.33's LoraLoaderBypass
    rss = {"positive_lora": {"patchbay": None}}
    line = bench_hooks.json_line(medians, rss, {s: 2.0 for s in SCENARIOS}, RUN)
    assert "\n" not in line
    data = json.loads(line)
    assert list(data) == ["bench", *RUN, "scenarios"] and data["bench"] == "hooks"
    assert {key: data[key] for key in RUN} == RUN
    assert set(data["scenarios"]) == SCENARIOS
    for figures in data["scenarios"].values():
        assert set(figures) == KEYS
        assert figures["patchbay_s"] is None and figures["patchbay_rss_mb_over_plain"] is None
        assert figures["lora_files_mb"] == 2.0
    assert data["scenarios"]["seed_rerun"]["core_s"] is None
    assert data["scenarios"]["positive_lora"]["core_s"] == 1.5
    assert data["scenarios"]["positive_lora"]["bypass_s"] == 1.2346
    assert data["scenarios"]["scheduled_lora"]["bypass_s"] is None
    assert all(figures["x_plain_paired"] == {} for figures in data["scenarios"].values())
    medians["regions_8_loras"]["couple"] = 1.25
    ratios = {"regions_8_loras": {"couple": 1.23456, "core": None}}
    regions = json.loads(bench_hooks.json_line(medians, rss, {}, RUN, ratios))["scenarios"]["regions_8_loras"]
    assert regions["couple_s"] == 1.25 and regions["x_plain_paired"] == {"couple": 1.235}
    no_run = json.loads(bench_hooks.json_line(medians, rss, {}))  # what was measured where: null if unknown
    assert all(no_run[key] is None for key in RUN)


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
    assert parse("regions_8_loras,regions_2_loras") == ("regions_2_loras", "regions_8_loras")
    assert bench_hooks._contenders("couple,core") == ("core", "couple")
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


def test_region_scenarios_run_the_couple_and_the_rows_against_plain_and_print_issue_34s_targets(capsys):
    import bench_hooks

    ran = {s: [c for c in bench_hooks.CONTENDERS if bench_hooks.applies(s, c)] for s in SCENARIOS}
    assert all(ran[s] == ["nohook", "core", "patchbay", "couple"] for s in REGIONS)
    assert all("couple" not in ran[s] and "loraloader" in ran[s] for s in ISSUE_4)
    loras = ("a.safetensors", "b.safetensors")
    assert bench_hooks.scenario_loras("regions_4_loras", loras) == ["a.safetensors", "b.safetensors"] * 2
    assert len(bench_hooks.scenario_loras("regions_8_loras", loras)) == 8
    times = {("regions_4_loras", 16, c): [t] for c, t in
             (("nohook", 1.0), ("core", 4.0), ("patchbay", 2.0), ("couple", 1.25))}
    times.update({("regions_8_loras", 16, c): [t] for c, t in (("nohook", 1.0), ("couple", 1.2))})
    bench_hooks.print_targets(times, 16, {})
    out = capsys.readouterr().out
    assert "regions_4_loras      couple / plain 1.25 (paired 1.25) (target <= 1.15)" in out
    assert "regions_4_loras      patchbay (rows) / couple 1.60 (paired 1.60) (target > 1)" in out
    assert "regions_4_loras      core (rows) / couple 3.20 (paired 3.20) (target > 1)" in out
    assert "regions_8_loras      couple / plain 1.20 (paired 1.20) (target <= 1.30)" in out
    assert "regions_8_loras      patchbay" not in out and "patchbay / plain" not in out


def test_each_arch_resolves_to_its_defaults_and_quick_to_one_round_of_its_smallest_latent():
    import bench_hooks

    tiny = bench_hooks.parse_options([])
    assert (tiny.setup.spec.name, tiny.setup.device, tiny.setup.steps) == ("tiny", "cpu", 10)
    assert (tiny.rounds, tiny.sizes, tiny.json_side) == (5, (8, 16), 16)
    assert set(tiny.scenarios) == SCENARIOS and tiny.contenders == bench_hooks.CONTENDERS
    assert "couple" in tiny.contenders
    sd15 = bench_hooks.parse_options(["--arch", "sd15-full"])
    assert (sd15.setup.steps, sd15.rounds, sd15.sizes, sd15.json_side) == (10, 5, (16,), 16)
    assert "bypass" in sd15.contenders and set(sd15.scenarios) == SCENARIOS
    sdxl = bench_hooks.parse_options(["--arch", "sdxl-full", "--device", "cuda"])
    assert (sdxl.setup.device, sdxl.setup.steps, sdxl.sizes, sdxl.json_side) == ("cuda", 20, (128,), 128)
    assert sdxl.scenarios == ("regional_two_loras",) and sdxl.contenders == ("nohook", "core", "patchbay")
    # the CPU check of the GPU command: same code path, small latent, few steps
    small = bench_hooks.parse_options(["--arch", "sdxl-full", "--sizes", "8", "--steps", "2", "--quick"])
    assert (small.rounds, small.sizes, small.json_side, small.setup.steps) == (1, (8,), 8, 2)
    assert bench_hooks.parse_options(["--quick"]).sizes == (8,)
    # nohook, the baseline every ratio needs, is always run; the order is the benchmark's
    picked = bench_hooks.parse_options(["--arch", "sd15-full", "--contenders", "patchbay,bypass"])
    assert picked.contenders == ("nohook", "bypass", "patchbay")
    assert bench_hooks.parse_options(["--arch", "sd15-full", "--quick"]).sizes == (16,)


def test_bad_options_are_refused_naming_the_value(capsys):
    import bench_hooks

    bad = ((["--arch", "sd21"], "invalid choice: 'sd21'"), (["--steps", "0"], "--steps 0"),
           (["--rounds", "-1"], "--rounds -1"), (["--device", "mps"], "invalid choice: 'mps'"),
           (["--contenders", "core,lora"], "unknown contender(s) ['lora']; choose from nohook"))
    for argv, message in bad:
        with pytest.raises(SystemExit):
            bench_hooks.parse_options(argv)
        assert message in capsys.readouterr().err


def test_a_probe_process_gets_the_same_setup():
    import bench_hooks

    setup = bench_hooks.parse_options(["--arch", "sdxl-full", "--steps", "3", "--device", "cuda"]).setup
    probe = bench_hooks.parse_options(["--probe", "seed_rerun", "core", "--side", "8", *setup.argv()])
    assert probe.setup == setup and probe.probe == ["seed_rerun", "core"] and probe.side == 8


def test_archs_name_known_scenarios_and_contenders_and_generate_into_the_ignored_cache():
    import bench_hooks
    import bench_models
    import devpaths

    for spec in bench_models.ARCHES.values():
        assert set(spec.scenarios) <= SCENARIOS and spec.contenders[0] == "nohook"
        assert set(spec.scenarios) >= REGIONS or not REGIONS & set(spec.scenarios)  # all three or none
        assert {"core", "patchbay"} <= set(spec.contenders) <= set(bench_hooks.CONTENDERS)
        assert len(set(spec.lora_files())) == 2
        for path in bench_models.lora_paths(spec):
            assert path.is_relative_to(devpaths.cache_dir())  # .cache/ is git-ignored: never in the repo
    full = [s for s in bench_models.ARCHES.values() if s.model_class]
    assert {s.name for s in full} == {"sd15-full", "sdxl-full", "sdxl-small", "wan-full", "flux-full"}
    for spec in full:
        assert bench_models.CACHE_TAG in spec.unet_file() and f"r{bench_models.RANK}" in spec.lora_files()[0]
        assert bench_models.unet_path(spec).is_relative_to(devpaths.cache_dir())
        assert spec.targets == bench_models.Targets(plain=1.05, regional=2.0, rerun=1.05, memory=1.2)
    # the CPU check of the GPU command differs from it only in the UNet's size
    small, xl = bench_models.ARCHES["sdxl-small"], bench_models.ARCHES["sdxl-full"]
    assert (small.lora_names, small.prompts, small.scenarios, small.contenders) == (
        xl.lora_names, xl.prompts, xl.scenarios, xl.contenders)


def test_memory_over_plain_subtracts_the_scenarios_nohook_and_keeps_nulls():
    import bench_memory

    peaks = {("regional_two_loras", "nohook"): 100.0, ("regional_two_loras", "patchbay"): 112.5,
             ("regional_two_loras", "core"): None, ("seed_rerun", "patchbay"): 50.0}
    scenarios, contenders = ("regional_two_loras", "seed_rerun"), ("nohook", "core", "patchbay")
    over = bench_memory.over_plain(peaks, scenarios, contenders)
    assert over["regional_two_loras"] == {"nohook": 0.0, "core": None, "patchbay": 12.5}
    assert over["seed_rerun"] == {"nohook": None, "core": None, "patchbay": None}  # no baseline, no figure
    # CUDA: medians over rounds of the timed runs' peaks at the JSON side
    timed = {("regional_two_loras", 128, "nohook"): [10.0, 30.0, 20.0],
             ("regional_two_loras", 128, "patchbay"): [45.0, 50.0, 40.0],
             ("regional_two_loras", 128, "core"): []}
    over = bench_memory.in_process(timed, 128, ("regional_two_loras",), ("nohook", "core", "patchbay"))
    assert over == {"regional_two_loras": {"nohook": 0.0, "core": None, "patchbay": 25.0}}


def test_the_cpu_meter_sees_an_allocation_made_during_the_run():
    import bench_memory

    meter = bench_memory.RunMeter("cpu")
    meter.start()
    block = bytearray(64 * 2**20)  # touched pages: 64 MiB of RSS
    meter.fence()
    assert 60 < meter.peak_mb() < 64 + 48
    del block
    meter.start()  # the peak is reset: a run that allocates nothing has (almost) none
    assert meter.peak_mb() < 16


def test_targets_follow_the_arch_and_memory_is_read_against_the_lora_files(capsys):
    import bench_hooks
    import bench_models

    times = {("seed_rerun", 16, c): [t] for c, t in
             (("nohook", 1.0), ("loraloader", 1.0), ("core", 3.0), ("patchbay", 1.02))}
    over = {"seed_rerun": {"patchbay": 31.2}}
    bench_hooks.print_targets(times, 16, over, bench_models.ARCHES["sd15-full"].targets, {"seed_rerun": 26.0})
    out = capsys.readouterr().out
    assert "seed_rerun           patchbay / plain 1.02 (paired 1.02) (target <= 1.05)" in out
    assert "seed_rerun patchbay / loraloader 1.02 (paired 1.02) (target <= 1.05)" in out
    assert "peak over plain 31.20 MB = 1.20x LoRA files (target <= 1.2)" in out
    assert "regional" not in out
