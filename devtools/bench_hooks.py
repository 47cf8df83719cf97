"""Benchmark: LoRA hooks, core vs Patchbay vs LoraLoader vs no hooks (issue 4). Not part of CI.

Run ``make bench-hooks`` (or ``python devtools/bench_hooks.py [--rounds N] [--quick]`` inside the
environment that devtools/env.sh makes). ComfyUI is imported in-process on the CPU the way
tests/conftest.py's ``comfy`` fixture does it; the tiny checkpoint samples 10 euler steps at CFG 7 on
8x8 and 16x16 latents, with torch pinned to one thread. A focused re-check of one figure:
``BENCH_ARGS="--scenarios regional_two_loras --sizes 16 --memory none"`` (about 5 minutes).

Scenarios (each times the *same* workflow per contender; only how the LoRA is applied differs):
  positive_lora       one LoRA hook on the positive prompt
  scheduled_lora      the same with a 4-keyframe strength schedule (1, 0.75, 0.5, 0.25)
  regional_two_loras  two masked regions (left/right halves), one LoRA hook each
  seed_rerun          positive_lora run once, then re-queued with a new seed; only the re-run is timed

Contenders build the sampling inputs (model, positive, negative) from real ComfyUI nodes:
  nohook      plain; for regional, the same two masked regions without hooks
  loraloader  the LoRA(s) baked with LoraLoader at strength 1 (strength_clip 0). Not an exact
              equivalent for scheduled_lora (no schedule) nor regional_two_loras (both LoRAs baked
              into the whole model, regions kept) nor for positive-only (baked = positive+negative);
              it is the cost floor a hook engine is compared against.
  core        core hook nodes: CreateHookLora, CreateHookKeyframesFromFloats + SetHookKeyframes,
              ConditioningSetProperties (with masks for regions), ConditioningCombine
  patchbay    the core workflow unchanged, its MODEL passed through "Fast Hooks (Patchbay)" once

Timing: only the KSampler call is timed (time.perf_counter), which includes ComfyUI's model load and
patching and, for core, hook registration at sample time. Contenders are interleaved round-robin
over ``--rounds`` rounds after one untimed warm-up round (each round starts with the next
contender, so none always runs first); medians are reported, and next to them the median of the
per-round ratios (one scenario's contenders run back to back, so the machine's slow drift cancels).
For seed_rerun each round builds fresh inputs, samples once with seed 1 (untimed), then times seed 2
with the same inputs: in the server only KSampler re-executes on a seed change (the hook/LoRA
nodes are cached), which is what calling the same objects again models. In-process node calls skip
the executor's caching and its IS_CHANGED/graph work, so this is the sampling cost, not the whole
queue latency.

Memory: each (scenario, contender) runs in a fresh process (``--probe``): ComfyUI and the checkpoint
are loaded, one warm-up run is made, every model is unloaded, then the peak RSS is reset
(``/proc/self/clear_refs`` = 5) and the second run (inputs built, including reading the LoRA file,
then sampled) is measured as VmHWM over the RSS before it. "Over plain" subtracts the scenario's
nohook probe. In one process the contenders disturb each other's figures (the allocator keeps what
one frees for the next), so they are kept apart. ``--memory all`` also probes LoraLoader and core.

Timings on a shared 2-core machine are noisy; read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCENARIOS = ("positive_lora", "scheduled_lora", "regional_two_loras", "seed_rerun")
CONTENDERS = ("nohook", "loraloader", "core", "patchbay")
JSON_KEYS = ("patchbay_s", "core_s", "nohook_s", "loraloader_s", "patchbay_rss_mb_over_plain",
             "lora_files_mb")
CKPT = "patchbay-sd15-tiny-a.safetensors"
LORA_A = "patchbay-lora-r4.safetensors"
LORA_B = "patchbay-lora-r16.safetensors"
SCHEDULE = [1.0, 0.75, 0.5, 0.25]
STEPS, CFG, SAMPLER, SCHEDULER = 10, 7.0, "euler", "normal"
SIZES = (8, 16)  # latent side; pixels = 8x
NOT_IMPLEMENTED = "not implemented yet (issue 4)"
MEMORY_METHOD = ("a fresh process per scenario and contender: after one warm-up run, the peak RSS of "
                 "a second run (VmHWM after clear_refs) over the RSS before it, minus the scenario's "
                 "nohook probe")


class NotImplementedContender(Exception):
    """A contender that has no implementation; its figures are reported as null."""


def scenario_loras(scenario: str) -> list[str]:
    return [LORA_A, LORA_B] if scenario == "regional_two_loras" else [LORA_A]


def json_line(medians: dict, rss_over_plain_mb: dict, lora_files_mb: dict) -> str:
    """The final JSON line. ``medians[scenario][contender]`` is seconds or None (missing = None);
    ``rss_over_plain_mb[scenario][contender]`` likewise; ``lora_files_mb[scenario]`` is a float."""
    def r(value, digits):
        return None if value is None else round(float(value), digits)

    scenarios = {}
    for name in SCENARIOS:
        m = medians.get(name, {})
        scenarios[name] = {
            "patchbay_s": r(m.get("patchbay"), 4),
            "core_s": r(m.get("core"), 4),
            "nohook_s": r(m.get("nohook"), 4),
            "loraloader_s": r(m.get("loraloader"), 4),
            "patchbay_rss_mb_over_plain": r(rss_over_plain_mb.get(name, {}).get("patchbay"), 2),
            "lora_files_mb": r(lora_files_mb.get(name), 3),
        }
    assert all(tuple(figures) == JSON_KEYS for figures in scenarios.values())
    return json.dumps({"bench": "hooks", "scenarios": scenarios}, separators=(", ", ": "))


# ---- ComfyUI in-process ---------------------------------------------------------------------------


def init_comfy():
    """Import ComfyUI on the CPU like tests/conftest.py's ``comfy`` fixture; returns the node mappings."""
    import tempfile
    from pathlib import Path

    import comfy_inprocess
    import devpaths
    import tiny_models

    tiny_models.ensure_models(devpaths.models_dir())
    nodes = comfy_inprocess.start_comfy()
    pack = comfy_inprocess.load_pack(nodes, Path(tempfile.mkdtemp(prefix="patchbay-bench-")))
    import comfy.utils

    comfy.utils.PROGRESS_BAR_ENABLED = False  # no tqdm bars between the table rows
    return {**nodes.NODE_CLASS_MAPPINGS, **pack.NODE_CLASS_MAPPINGS}


class Bench:
    """Loads the checkpoint and prompts once; contenders build per-scenario inputs from them."""

    def __init__(self, n):
        import torch

        self.n = n
        self.torch = torch
        self.model, self.clip, _ = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
        (self.positive,) = n["CLIPTextEncode"]().encode(self.clip, "a knight in armor")
        (self.negative,) = n["CLIPTextEncode"]().encode(self.clip, "blurry")
        (self.left,) = n["CLIPTextEncode"]().encode(self.clip, "a red castle")
        (self.right,) = n["CLIPTextEncode"]().encode(self.clip, "a green forest")
        self.fast_model, _clip = n["PatchbayHookEngine"]().enable(self.model, 2048.0)

    def latent(self, side: int):
        (latent,) = self.n["EmptyLatentImage"]().generate(side * 8, side * 8, 1)
        return latent

    def masks(self, side: int):
        left = self.torch.zeros((1, side * 8, side * 8))
        left[:, :, : side * 4] = 1.0
        return left, 1.0 - left

    def sample(self, inputs, latent, seed: int):
        model, positive, negative = inputs
        (out,) = self.n["KSampler"]().sample(
            model, seed, STEPS, CFG, SAMPLER, SCHEDULER, positive, negative, latent)
        return out

    # -- regions without hooks (nohook / loraloader for regional_two_loras)
    def _regions(self, side: int, hooks=(None, None)):
        n = self.n
        mask_l, mask_r = self.masks(side)
        if hooks == (None, None):
            (a,) = n["ConditioningSetMask"]().append(self.left, mask_l, "default", 1.0)
            (b,) = n["ConditioningSetMask"]().append(self.right, mask_r, "default", 1.0)
        else:
            props = n["ConditioningSetProperties"]()
            (a,) = props.set_properties(self.left, 1.0, "default", mask=mask_l, hooks=hooks[0])
            (b,) = props.set_properties(self.right, 1.0, "default", mask=mask_r, hooks=hooks[1])
        (combined,) = n["ConditioningCombine"]().combine(a, b)
        return combined

    # -- contenders: (scenario, side) -> (model, positive, negative)
    def nohook(self, scenario: str, side: int):
        if scenario == "regional_two_loras":
            return self.model, self._regions(side), self.negative
        return self.model, self.positive, self.negative

    def loraloader(self, scenario: str, side: int):
        model = self.model
        for lora in scenario_loras(scenario):
            model, _clip = self.n["LoraLoader"]().load_lora(model, self.clip, lora, 1.0, 0.0)
        if scenario == "regional_two_loras":
            return model, self._regions(side), self.negative
        return model, self.positive, self.negative

    def core(self, scenario: str, side: int):
        n = self.n
        if scenario == "regional_two_loras":
            (hooks_a,) = n["CreateHookLora"]().create_hook(LORA_A, 1.0, 1.0)
            (hooks_b,) = n["CreateHookLora"]().create_hook(LORA_B, 1.0, 1.0)
            return self.model, self._regions(side, (hooks_a, hooks_b)), self.negative
        (hooks,) = n["CreateHookLora"]().create_hook(LORA_A, 1.0, 1.0)
        if scenario == "scheduled_lora":
            (kf,) = n["CreateHookKeyframesFromFloats"]().create_hook_keyframes(list(SCHEDULE), 0.0, 1.0)
            (hooks,) = n["SetHookKeyframes"]().set_hook_keyframes(hooks, kf)
        props = n["ConditioningSetProperties"]()
        (positive,) = props.set_properties(self.positive, 1.0, "default", hooks=hooks)
        return self.model, positive, self.negative

    def patchbay(self, scenario: str, side: int):
        """The core workflow, its MODEL through Fast Hooks (made once, as a cached node output is)."""
        _model, positive, negative = self.core(scenario, side)
        return self.fast_model, positive, negative

    def run_once(self, contender: str, scenario: str, side: int, seeds=(1, 2)) -> tuple[float, float]:
        """Time one KSampler call (seed_rerun: the second seed) and measure the peak RSS over the RSS
        before building the inputs (MB). Building the inputs is not timed."""
        import comfy.model_management

        comfy.model_management.unload_all_models()  # each contender loads (and patches) for itself
        rss_before = _rss_kb("VmRSS")
        _reset_peak_rss()
        inputs = getattr(self, contender)(scenario, side)
        latent = self.latent(side)
        if scenario == "seed_rerun":
            self.sample(inputs, latent, seeds[0])
            seed = seeds[1]
        else:
            seed = seeds[0]
        start = time.perf_counter()
        self.sample(inputs, latent, seed)
        elapsed = time.perf_counter() - start
        return elapsed, (_rss_kb("VmHWM") - rss_before) / 1024


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def lora_files_mb(scenario: str) -> float:
    import devpaths

    folder = devpaths.models_dir() / "loras"
    return sum((folder / name).stat().st_size for name in scenario_loras(scenario)) / 2**20


def measure(bench: Bench, rounds: int, sizes: tuple[int, ...],
            scenarios: tuple[str, ...] = SCENARIOS) -> tuple[dict, dict]:
    """Round-robin over contenders; returns {(scenario, side, contender): [seconds]} and [peak MB]."""
    keys = [(s, side, c) for side in sizes for s in scenarios for c in CONTENDERS]
    times: dict = {k: [] for k in keys}
    peaks: dict = {k: [] for k in keys}
    missing: set = set()
    for rnd in range(rounds + 1):  # round 0 is an untimed warm-up
        order = CONTENDERS[rnd % len(CONTENDERS):] + CONTENDERS[:rnd % len(CONTENDERS)]  # no fixed position
        for scenario, side, contender in [(s, side, c) for side in sizes for s in scenarios for c in order]:
            if contender in missing:
                continue
            try:
                elapsed, peak = bench.run_once(contender, scenario, side, seeds=(1 + 2 * rnd, 2 + 2 * rnd))
            except NotImplementedContender as exc:
                print(f"{contender}: {exc}", file=sys.stderr)
                missing.add(contender)
                continue
            if rnd:
                times[(scenario, side, contender)].append(elapsed)
                peaks[(scenario, side, contender)].append(peak)
        if rnd:
            print(f"round {rnd}/{rounds} done", file=sys.stderr)
    return times, peaks


def _median(values: list) -> float | None:
    return statistics.median(values) if values else None


def paired(times: dict, scenario: str, side: int, contender: str, base: str = "nohook") -> float | None:
    """Median over rounds of contender / base timed in the same round, minutes apart at most: the
    machine's speed drifts (identical runs here vary by up to 14% over minutes), and a per-round ratio
    cancels what the two runs share."""
    a, b = times[(scenario, side, contender)], times[(scenario, side, base)]
    return _median([x / y for x, y in zip(a, b, strict=True)]) if a and len(a) == len(b) else None


def print_times(times: dict, sizes: tuple[int, ...], rounds: int,
                scenarios: tuple[str, ...] = SCENARIOS) -> None:
    med = {k: _median(v) for k, v in times.items()}
    print(f"\nhooks benchmark: tiny SD1.5 checkpoint, {STEPS} {SAMPLER} steps, CFG {CFG}, torch threads 1, "
          f"{rounds} round(s) + warm-up, median of KSampler wall time (CPU; noisy on a shared machine); "
          "'paired': median of the per-round ratios")
    print(f"{'scenario':<20} {'latent':<7} {'contender':<11} {'median s':>9} {'x plain':>8} {'x core':>7} "
          f"{'x plain paired':>15}")
    for scenario in scenarios:
        for side in sizes:
            plain, core = med[(scenario, side, "nohook")], med[(scenario, side, "core")]
            for contender in CONTENDERS:
                m = med[(scenario, side, contender)]
                row = (f"{'-':>9} {'-':>8}  {NOT_IMPLEMENTED}" if m is None
                       else f"{m:>9.4f} {m / plain:>8.2f} {m / core:>7.2f} "
                            f"{paired(times, scenario, side, contender):>15.2f}")
                print(f"{scenario:<20} {side}x{side:<5} {contender:<11} {row}")


def print_targets(times: dict, side: int, over: dict) -> None:
    """Issue 4's targets with the measured figures: ratio of medians (paired: median of per-round ratios)."""
    def ratio(scenario: str, a: str, b: str) -> str:
        ma, mb = _median(times[(scenario, side, a)]), _median(times[(scenario, side, b)])
        return f"{ma / mb:.2f} (paired {paired(times, scenario, side, a, b):.2f})"

    print(f"\ntargets ({side}x{side}):")
    done = {s for s in SCENARIOS if times.get((s, side, "patchbay"))}
    for scenario in SCENARIOS:
        if scenario in done:
            print(f"  {scenario:<20} patchbay / plain {ratio(scenario, 'patchbay', 'nohook')} "
                  "(target <= 1.10)")
    if "regional_two_loras" in done:
        print(f"  regional speed-up over core {ratio('regional_two_loras', 'core', 'patchbay')} "
              "(target >= 1.5; no engine can beat the same regions without hooks, so the ceiling here is "
              "core / nohook = "
              f"{ratio('regional_two_loras', 'core', 'nohook')})")
    if "seed_rerun" in done:
        print(f"  seed_rerun patchbay / loraloader {ratio('seed_rerun', 'patchbay', 'loraloader')} "
              "(target <= 1.10)")
    for scenario in SCENARIOS:
        mb = over.get(scenario, {}).get("patchbay")
        if mb is not None:
            files = lora_files_mb(scenario)
            print(f"  {scenario:<20} peak over plain {mb:.2f} MB = {mb / files:.2f}x LoRA files "
                  "(target <= 1.2)")


def probe(scenario: str, contender: str, side: int) -> None:
    """Subprocess body: one warm-up run, then the peak RSS of a second run over the RSS before it."""
    bench = Bench(init_comfy())
    bench.run_once(contender, scenario, side)  # first-use allocations (kernels, caches) happen here
    _elapsed, peak_mb = bench.run_once(contender, scenario, side, seeds=(3, 4))
    print(json.dumps({"probe": [scenario, contender], "peak_mb": peak_mb}))


def probe_memory(side: int, contenders: tuple[str, ...], scenarios: tuple[str, ...] = SCENARIOS) -> dict:
    """Peak MB over the scenario's nohook probe, each (scenario, contender) in a fresh process."""
    import subprocess

    peaks: dict = {}
    for scenario in scenarios:
        for contender in ("nohook", *contenders):
            cmd = [sys.executable, __file__, "--probe", scenario, contender, "--side", str(side)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"probe"')]
            if not lines:
                print(f"probe {scenario}/{contender} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            peaks[(scenario, contender)] = json.loads(lines[-1])["peak_mb"] if lines else None
    return {s: {c: None if peaks.get((s, c)) is None or peaks[(s, "nohook")] is None
                else peaks[(s, c)] - peaks[(s, "nohook")] for c in CONTENDERS} for s in scenarios}


def print_memory(over: dict, side: int) -> None:
    print(f"\npeak memory over plain (MB) at {side}x{side}, method: {MEMORY_METHOD}")
    print(f"{'scenario':<20} " + " ".join(f"{c:>11}" for c in CONTENDERS) + f" {'lora files':>11}")
    for scenario in over:
        cells = " ".join(f"{'-' if v is None else format(v, '.2f'):>11}" for v in over[scenario].values())
        print(f"{scenario:<20} {cells} {lora_files_mb(scenario):>11.2f}")


def compile_models(bench: Bench) -> None:
    """``--compile``: every contender samples the checkpoint compiled by ComfyUI's TorchCompileModel
    (inductor), Fast Hooks on top of it; "plain" is then the compiled model without hooks. The untimed
    warm-up round compiles every graph (core's, the hooked ones, each batch and latent size)."""
    bench.model = bench.n["TorchCompileModel"].execute(bench.model, "inductor")[0]
    bench.fast_model, _clip = bench.n["PatchbayHookEngine"]().enable(bench.model, 2048.0)
    print("--compile: every contender samples the TorchCompileModel (inductor) model; no memory probes",
          file=sys.stderr)


def _scenarios(text: str) -> tuple[str, ...]:
    picked = {t.strip() for t in text.split(",") if t.strip()}
    unknown = sorted(picked - set(SCENARIOS))
    if unknown or not picked:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown or [text]}; choose from "
                                         + ", ".join(SCENARIOS))
    return tuple(s for s in SCENARIOS if s in picked)  # the benchmark's own order


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sides = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        sides = ()
    if not sides or min(sides) < 1:
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: give latent sides as positive integers, "
                                         "e.g. 8,16")
    return sides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per contender (default 5)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 8x8 only")
    parser.add_argument("--scenarios", type=_scenarios, default=SCENARIOS, metavar="A,B",
                        help="comma-separated subset of " + ",".join(SCENARIOS) + " (default all; the "
                        "JSON line then carries nulls for the others)")
    parser.add_argument("--sizes", type=_sizes, default=None, metavar="8,16",
                        help="comma-separated latent sides (default 8,16; --quick: 8)")
    parser.add_argument("--memory", choices=("patchbay", "all", "none"), default="patchbay",
                        help="contenders whose peak memory is probed in fresh processes (default patchbay)")
    parser.add_argument("--compile", action="store_true",
                        help="every contender on the model compiled by TorchCompileModel (inductor): hooked "
                        "compiled vs compiled plain; no memory probes")
    parser.add_argument("--probe", nargs=2, metavar=("SCENARIO", "CONTENDER"), help=argparse.SUPPRESS)
    parser.add_argument("--side", type=int, default=16, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    if opts.probe:
        probe(opts.probe[0], opts.probe[1], opts.side)
        return 0
    rounds = 1 if opts.quick else opts.rounds
    sizes = opts.sizes or ((8,) if opts.quick else SIZES)
    scenarios = opts.scenarios
    bench = Bench(init_comfy())
    if opts.compile:
        compile_models(bench)
        opts.memory = "none"  # the probes would sample uncompiled models in fresh processes
    times, _peaks = measure(bench, rounds, sizes, scenarios)
    print_times(times, sizes, rounds, scenarios)

    json_side = 16 if 16 in sizes else sizes[-1]
    over: dict = {}
    if opts.memory != "none":
        probed = ("patchbay",) if opts.memory == "patchbay" else tuple(c for c in CONTENDERS if c != "nohook")
        over = probe_memory(json_side, probed, scenarios)
        print_memory(over, json_side)
    if json_side != 16:
        print(f"(the JSON line carries {json_side}x{json_side} figures, not 16x16)")
    medians = {s: {c: _median(times[(s, json_side, c)]) for c in CONTENDERS} for s in scenarios}
    print_targets(times, json_side, over)
    print(json_line(medians, over, {s: lora_files_mb(s) for s in SCENARIOS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
