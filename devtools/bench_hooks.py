"""Benchmark: LoRA hooks, core vs Patchbay vs LoraLoader vs no hooks. Not part of CI.

Run ``make bench-hooks`` (or ``python devtools/bench_hooks.py [--arch A] [--device D] [--rounds N]
[--quick]`` inside the environment that devtools/env.sh makes). ComfyUI is imported in-process the
way tests/conftest.py's ``comfy`` fixture does it (main.py is not run: on a GPU, ComfyUI 0.33's
dynamic VRAM stays off), with torch pinned to one thread. A focused re-check of one figure:
``BENCH_ARGS="--scenarios regional_two_loras --sizes 16 --memory none"`` (about 5 minutes).
The attention couple figures: ``BENCH_ARGS="--arch sd15-full --scenarios
regions_2_loras,regions_4_loras,regions_8_loras --steps 4 --rounds 2 --memory none"`` (about 10 minutes).

Models (``--arch``, devtools/bench_models.py; euler, CFG 7): ``tiny``, the tiny SD1.5 checkpoint,
10 steps at 8x8 and 16x16; ``sd15-full``, an SD1.5-size UNet with rank-32 LoRAs, 10 steps
at 16x16; ``sdxl-full``, an SDXL-size UNet, 20 steps at 128x128 (1024 x 1024), the regional scenario
with plain, core and Fast Hooks, for ``--device cuda`` (``sdxl-small``: its code path, CPU-sized);
``wan-full``, a 2026 DiT at its real width: two of Wan 2.1 14B's 40 blocks (5120
wide, 935.5 M parameters), rank-32 LoRAs on every attention and feed-forward linear, 4 steps on one
16x16 latent frame, synthesized 4096-wide text tokens; every scenario and contender. ``flux-full``
(the attention couple on a DiT): Flux.1 [dev] at its real width, one double and one
single block (545.5 M parameters), rank-32 LoRAs on every attention and MLP linear, 4 steps at 16x16
(64 image tokens beside 4 synthesized T5 tokens per prompt, a 1024 x 1024 image's 16:1 ratio):
``BENCH_ARGS="--arch flux-full --scenarios regions_2_loras,regions_4_loras,regions_8_loras --memory none"``.
``--compile``: every contender samples the model compiled by ComfyUI's
TorchCompileModel (inductor); "plain" is then the compiled model without hooks, and the untimed warm-up
round compiles every graph. No memory probes then.

Scenarios (each times the *same* workflow per contender; only how the LoRA is applied differs):
  positive_lora       one LoRA hook on the positive prompt
  scheduled_lora      the same with a 4-keyframe strength schedule (1, 0.75, 0.5, 0.25)
  regional_two_loras  two masked regions (left/right halves), one LoRA hook each
  seed_rerun          positive_lora run once, then re-queued with a new seed; only the re-run is timed
  regions_N_loras     (N = 2, 4, 8) N vertical stripes covering the image, a prompt and a
                      LoRA hook each (the two LoRA files alternate, one hook per region)

Contenders build the sampling inputs (model, positive, negative) from real ComfyUI nodes:
  nohook      plain; for regional_two_loras, the same two masked regions without hooks; for regions_N_loras
              the plain prompt alone (one row, no regions, no hooks), the couple's targets' baseline
  loraloader  the LoRA(s) baked with LoraLoader at strength 1 (strength_clip 0). Not an exact equivalent for
              scheduled_lora (no schedule) nor regional_two_loras (both LoRAs baked into the whole
              model, regions kept) nor for positive-only (baked = positive+negative); it is the cost
              floor a hook engine is compared against.
  bypass      the same through core's forward-pass LoraLoaderBypass (ComfyUI 0.33; null on versions
              without it)
  core        core hook nodes: CreateHookLora, CreateHookKeyframesFromFloats + SetHookKeyframes,
              ConditioningSetProperties (with masks for regions), ConditioningCombine
  patchbay    the core workflow unchanged, its MODEL passed through "Fast Hooks (Patchbay)" once (for
              regions: what Regional LoRA (Patchbay) builds, one batch row per region)
  couple      regions_N_loras only: hooks/couple.attention_couple (what "Attention Couple (Patchbay)"
              calls) on the Fast Hooks model with the same prompts, masks and LoRA hooks as core: one row
              for every region; null where the model is not one the couple runs on
LoraLoader and bypass do not run the regions_N_loras scenarios (N LoRAs baked into the whole model is no
floor for regional prompting). Targets for regions_N_loras: couple / plain <= 1.15 at 4 regions and
<= 1.30 at 8; couple faster than core and patchbay (rows) from 2 regions.

Timing: only the KSampler call is timed (time.perf_counter; on CUDA after a synchronize on both
sides), which includes ComfyUI's model load and patching and, for core, hook registration at sample
time. Every model is unloaded before each run. Contenders are interleaved round-robin
over ``--rounds`` rounds after one untimed warm-up round (each round starts with the next
contender, so none always runs first); medians are reported, and next to them the median of the
per-round ratios (one scenario's contenders run back to back, so the machine's slow drift cancels).
For seed_rerun each round builds fresh inputs, samples once with seed 1 (untimed), then times seed 2
with the same inputs: in the server only KSampler re-executes on a seed change (the hook/LoRA
nodes are cached), which is what calling the same objects again models. In-process node calls skip
the executor's caching and its IS_CHANGED/graph work, so this is the sampling cost, not the whole
queue latency.

Memory (devtools/bench_memory.py): on the CPU the peak RSS of a second run (inputs built, including
reading the LoRA file, then sampled) in a fresh process per (scenario, contender) (``--probe``, run
before the timing, so that this process holds no model meanwhile); on
CUDA the timed runs' ``torch.cuda.max_memory_allocated``; both over the memory before the run, minus
the scenario's nohook figure. ``--memory all`` also measures the other contenders.

Timings on a shared machine are noisy; read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass

import bench_memory
import bench_models
from bench_models import ARCHES, ArchSpec, Targets

SCENARIOS = bench_models.ALL_SCENARIOS
CONTENDERS = bench_models.ALL_CONTENDERS
JSON_KEYS = ("patchbay_s", "core_s", "nohook_s", "loraloader_s", "bypass_s", "couple_s",
             "patchbay_rss_mb_over_plain", "lora_files_mb", "x_plain_paired")
RUN_KEYS = ("arch", "device", "steps", "compile", "comfyui", "memory")
SCHEDULE = [1.0, 0.75, 0.5, 0.25]
CFG, SAMPLER, SCHEDULER = 7.0, "euler", "normal"
NOT_AVAILABLE = "not available in this ComfyUI version"
NOT_RUN = "not run (why: printed above the table)"
REGION_COUNTS = bench_models.REGION_COUNTS


class NotImplementedContender(Exception):
    """A contender that has no implementation; its figures are reported as null."""


@dataclass(frozen=True)
class RunSetup:
    """What one benchmark run samples: the model (``spec``), where, and for how many steps."""

    spec: ArchSpec
    device: str = "cpu"
    steps: int = 10

    def argv(self) -> list[str]:
        """The options that make the same setup in a ``--probe`` process."""
        return ["--arch", self.spec.name, "--device", self.device, "--steps", str(self.steps)]


def scenario_loras(scenario: str, loras: tuple[str, str]) -> list[str]:
    """The LoRA files a scenario reads, one entry per hook (regions_N_loras: N, the two alternating)."""
    if scenario in REGION_COUNTS:
        return [loras[i % 2] for i in range(REGION_COUNTS[scenario])]
    return list(loras) if scenario == "regional_two_loras" else [loras[0]]


def applies(scenario: str, contender: str) -> bool:
    """Whether ``contender`` runs ``scenario``: the couple only the regions_N_loras scenarios, which
    LoraLoader and bypass do not run."""
    if scenario in REGION_COUNTS:
        return contender not in ("loraloader", "bypass")
    return contender != "couple"


def json_line(medians: dict, rss_over_plain_mb: dict, lora_files_mb: dict, run: dict | None = None,
              ratios: dict | None = None) -> str:
    """The final JSON line. ``medians[scenario][contender]`` is seconds or None (missing = None);
    ``rss_over_plain_mb[scenario][contender]`` likewise; ``lora_files_mb[scenario]`` is a float;
    ``run`` holds RUN_KEYS (what was measured where), null where missing; ``ratios[scenario][contender]``
    the paired ratio over nohook (``paired``), kept where not None as ``x_plain_paired``."""
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
            "bypass_s": r(m.get("bypass"), 4),
            "couple_s": r(m.get("couple"), 4),
            "patchbay_rss_mb_over_plain": r(rss_over_plain_mb.get(name, {}).get("patchbay"), 2),
            "lora_files_mb": r(lora_files_mb.get(name), 3),
            "x_plain_paired": {c: r(x, 3) for c, x in (ratios or {}).get(name, {}).items() if x is not None},
        }
    assert all(tuple(figures) == JSON_KEYS for figures in scenarios.values())
    header = {key: (run or {}).get(key) for key in RUN_KEYS}
    return json.dumps({"bench": "hooks", **header, "scenarios": scenarios}, separators=(", ", ": "))


# ---- ComfyUI in-process ---------------------------------------------------------------------------


def init_comfy(device: str = "cpu"):
    """Import ComfyUI like tests/conftest.py's ``comfy`` fixture, on ``device``; returns the node mappings."""
    import tempfile
    from pathlib import Path

    import comfy_inprocess

    nodes = comfy_inprocess.start_comfy(cpu=device == "cpu")
    pack = comfy_inprocess.load_pack(nodes, Path(tempfile.mkdtemp(prefix="patchbay-bench-")))
    import comfy.utils

    comfy.utils.PROGRESS_BAR_ENABLED = False  # no tqdm bars between the table rows
    return {**nodes.NODE_CLASS_MAPPINGS, **pack.NODE_CLASS_MAPPINGS}


class Bench:
    """Loads the model and prompts once; contenders build per-scenario inputs from them."""

    def __init__(self, n, setup: RunSetup = RunSetup(ARCHES["tiny"])):
        import torch

        self.n, self.setup, self.torch = n, setup, torch
        inputs = bench_models.load(setup.spec, n)
        self.model, self.clip, self.loras = inputs.model, inputs.clip, inputs.loras
        self.positive, self.negative = inputs.prompts["positive"], inputs.prompts["negative"]
        self.left, self.right = inputs.prompts["left"], inputs.prompts["right"]
        self.fast_model, _clip = n["PatchbayHookEngine"]().execute(self.model, 2048.0)
        self.meter = bench_memory.RunMeter(setup.device)
        self.compiled = False

    def latent(self, side: int):
        if self.setup.spec.video:  # what a video model's empty-latent node gives: [1, C, T, H, W]
            channels, frames = self.setup.spec.video
            return {"samples": self.torch.zeros((1, channels, frames, side, side))}
        (latent,) = self.n["EmptyLatentImage"]().generate(side * 8, side * 8, 1)
        return latent

    def masks(self, side: int):
        left = self.torch.zeros((1, side * 8, side * 8))
        left[:, :, : side * 4] = 1.0
        return left, 1.0 - left

    def stripes(self, side: int, count: int) -> list:
        """``count`` vertical stripes of the image, [1, H, W] each, covering it."""
        edges = [round(i * side * 8 / count) for i in range(count + 1)]
        out = []
        for start, stop in zip(edges, edges[1:], strict=False):
            mask = self.torch.zeros((1, side * 8, side * 8))
            mask[:, :, start:stop] = 1.0
            out.append(mask)
        return out

    def region_hooks(self, scenario: str) -> list:
        """One core LoRA hook (CreateHookLora, strength 1) per region of a regions_N_loras scenario."""
        return [self.n["CreateHookLora"]().create_hook(lora, 1.0, 1.0)[0]
                for lora in scenario_loras(scenario, self.loras)]

    def region_parts(self, scenario: str, side: int) -> list[tuple]:
        """(prompt, stripe mask, LoRA hooks) per region of a regions_N_loras scenario (prompts alternate)."""
        count = REGION_COUNTS[scenario]
        prompts = [(self.left, self.right)[i % 2] for i in range(count)]
        return list(zip(prompts, self.stripes(side, count), self.region_hooks(scenario), strict=True))

    def _stripe_regions(self, scenario: str, side: int):
        """regions_N_loras as core builds it: each stripe's prompt with its mask and LoRA hook, combined."""
        props, combine = self.n["ConditioningSetProperties"](), self.n["ConditioningCombine"]()
        combined = None
        for cond, mask, hooks in self.region_parts(scenario, side):
            (cond,) = props.set_properties(cond, 1.0, "default", mask=mask, hooks=hooks)
            combined = cond if combined is None else combine.combine(combined, cond)[0]
        return combined

    def sample(self, inputs, latent, seed: int):
        model, positive, negative = inputs
        (out,) = self.n["KSampler"]().sample(
            model, seed, self.setup.steps, CFG, SAMPLER, SCHEDULER, positive, negative, latent)
        return out

    # -- regions without hooks (nohook / loraloader / bypass for regional_two_loras)
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

    def _whole_model(self, node: str, scenario: str, side: int):
        """The scenario's LoRA(s) on the whole model through ``node``, strength_clip 0 (the CLIP, where
        there is one, only maps the LoRA's text-encoder keys, so none is reported as not loaded)."""
        model, clip = self.model, self.clip
        for lora in scenario_loras(scenario, self.loras):
            model, clip = self.n[node]().load_lora(model, clip, lora, 1.0, 0.0)
        _plain, positive, negative = self.nohook(scenario, side)
        return model, positive, negative

    def loraloader(self, scenario: str, side: int):
        return self._whole_model("LoraLoader", scenario, side)

    def bypass(self, scenario: str, side: int):
        if "LoraLoaderBypass" not in self.n:
            raise NotImplementedContender(f"core's LoraLoaderBypass: {NOT_AVAILABLE}")
        return self._whole_model("LoraLoaderBypass", scenario, side)

    def core(self, scenario: str, side: int):
        n = self.n
        lora_a, lora_b = self.loras
        if scenario in REGION_COUNTS:
            return self.model, self._stripe_regions(scenario, side), self.negative
        if scenario == "regional_two_loras":
            (hooks_a,) = n["CreateHookLora"]().create_hook(lora_a, 1.0, 1.0)
            (hooks_b,) = n["CreateHookLora"]().create_hook(lora_b, 1.0, 1.0)
            return self.model, self._regions(side, (hooks_a, hooks_b)), self.negative
        (hooks,) = n["CreateHookLora"]().create_hook(lora_a, 1.0, 1.0)
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

    def couple(self, scenario: str, side: int):
        """hooks/couple.attention_couple, the library call of Attention Couple (Patchbay), on the Fast Hooks
        model: the plain positive as the base prompt (no position is left to it), the stripes as regions."""
        import importlib

        pack = self.n["PatchbayAttentionCouple"].__module__.rsplit(".nodes.", 1)[0]
        lib = importlib.import_module(pack + ".hooks.couple")
        if self.compiled:
            raise NotImplementedContender("attention couple: region LoRAs do not run on a compiled model")
        regions = [lib.CoupleRegion(*part) for part in self.region_parts(scenario, side)]
        try:
            model, positive = lib.attention_couple(self.fast_model, self.positive, regions)
        except lib.CoupleError as error:
            raise NotImplementedContender(f"attention couple: {error}") from None
        return model, positive, self.negative

    def run_once(self, contender: str, scenario: str, side: int, seeds=(1, 2)) -> tuple[float, float]:
        """Time one KSampler call (seed_rerun: the second seed) and measure the peak memory over the
        memory before building the inputs (MB; bench_memory.RunMeter). Building the inputs is not timed."""
        import comfy.model_management

        comfy.model_management.unload_all_models()  # each contender loads (and patches) for itself
        self.meter.start()
        inputs = getattr(self, contender)(scenario, side)
        latent = self.latent(side)
        if scenario == "seed_rerun":
            self.sample(inputs, latent, seeds[0])
            seed = seeds[1]
        else:
            seed = seeds[0]
        self.meter.fence()
        start = time.perf_counter()
        self.sample(inputs, latent, seed)
        self.meter.fence()
        elapsed = time.perf_counter() - start
        return elapsed, self.meter.peak_mb()


def lora_files_mb(spec: ArchSpec, scenario: str) -> float:
    paths = dict(zip(spec.lora_files(), bench_models.lora_paths(spec), strict=True))
    return sum(paths[name].stat().st_size for name in scenario_loras(scenario, spec.lora_files())) / 2**20


def measure(bench: Bench, rounds: int, sizes: tuple[int, ...], scenarios: tuple[str, ...] = SCENARIOS,
            contenders: tuple[str, ...] = CONTENDERS) -> tuple[dict, dict]:
    """Round-robin over contenders; returns {(scenario, side, contender): [seconds]} and [peak MB]."""
    keys = [(s, side, c) for side in sizes for s in scenarios for c in contenders]
    times: dict = {k: [] for k in keys}
    peaks: dict = {k: [] for k in keys}
    missing: set = set()  # (scenario, contender) pairs that cannot run
    for rnd in range(rounds + 1):  # round 0 is an untimed warm-up
        order = contenders[rnd % len(contenders):] + contenders[:rnd % len(contenders)]  # no fixed position
        for scenario, side, contender in [(s, side, c) for side in sizes for s in scenarios for c in order]:
            if (scenario, contender) in missing or not applies(scenario, contender):
                continue
            try:
                elapsed, peak = bench.run_once(contender, scenario, side, seeds=(1 + 2 * rnd, 2 + 2 * rnd))
            except NotImplementedContender as exc:
                print(f"{contender} ({scenario}): {exc}", file=sys.stderr)
                missing.add((scenario, contender))
                continue
            if rnd:
                times[(scenario, side, contender)].append(elapsed)
                peaks[(scenario, side, contender)].append(peak)
        print(f"round {rnd}/{rounds} done{' (warm-up)' if not rnd else ''}", file=sys.stderr)
    return times, peaks


def _median(values: list) -> float | None:
    return statistics.median(values) if values else None


def paired(times: dict, scenario: str, side: int, contender: str, base: str = "nohook") -> float | None:
    """Median over rounds of contender / base timed in the same round, minutes apart at most: the
    machine's speed drifts (identical runs here vary by up to 14% over minutes), and a per-round ratio
    cancels what the two runs share."""
    a, b = times[(scenario, side, contender)], times[(scenario, side, base)]
    return _median([x / y for x, y in zip(a, b, strict=True)]) if a and len(a) == len(b) else None


def print_times(times: dict, setup: RunSetup, sizes: tuple[int, ...], rounds: int,
                scenarios: tuple[str, ...] = SCENARIOS, contenders: tuple[str, ...] = CONTENDERS) -> None:
    med = {k: _median(v) for k, v in times.items()}
    print(f"\nhooks benchmark: {setup.spec.title}, {setup.steps} {SAMPLER} steps, CFG {CFG}, "
          f"{setup.device}, torch threads 1, {rounds} round(s) + warm-up, median of KSampler wall time "
          "(noisy on a shared machine); 'paired': median of the per-round ratios")
    print(f"{'scenario':<20} {'latent':<7} {'contender':<11} {'median s':>9} {'x plain':>8} {'x core':>7} "
          f"{'x plain paired':>15}")
    for scenario in scenarios:
        for side in sizes:
            plain, core = med[(scenario, side, "nohook")], med.get((scenario, side, "core"))
            for contender in (c for c in contenders if applies(scenario, c)):
                m = med[(scenario, side, contender)]
                x_core = "-" if core is None or m is None else f"{m / core:.2f}"
                why = NOT_AVAILABLE if contender == "bypass" else NOT_RUN
                row = (f"{'-':>9} {'-':>8}  {why}" if m is None
                       else f"{m:>9.4f} {m / plain:>8.2f} {x_core:>7} "
                            f"{paired(times, scenario, side, contender):>15.2f}")
                print(f"{scenario:<20} {side}x{side:<5} {contender:<11} {row}")


def print_targets(times: dict, side: int, over: dict, targets: Targets = ARCHES["tiny"].targets,
                  files_mb: dict | None = None) -> None:
    """The issue's targets with the measured figures: ratio of medians (paired: median of per-round
    ratios); memory over plain against ``files_mb[scenario]``, the scenario's LoRA files."""
    def ratio(scenario: str, a: str, b: str) -> str:
        ma, mb = _median(times[(scenario, side, a)]), _median(times[(scenario, side, b)])
        return f"{ma / mb:.2f} (paired {paired(times, scenario, side, a, b):.2f})"

    def ran(scenario: str, contender: str) -> bool:
        return bool(times.get((scenario, side, contender)))

    print(f"\ntargets ({side}x{side}):")
    done = {s for s in SCENARIOS if ran(s, "patchbay")}
    for scenario in SCENARIOS:
        if scenario in done and scenario not in REGION_COUNTS:
            print(f"  {scenario:<20} patchbay / plain {ratio(scenario, 'patchbay', 'nohook')} "
                  f"(target <= {targets.plain:.2f})")
    for scenario, count in REGION_COUNTS.items():
        if not ran(scenario, "couple"):
            continue
        limit = bench_models.COUPLE_TARGETS.get(count)
        print(f"  {scenario:<20} couple / plain {ratio(scenario, 'couple', 'nohook')}"
              + ("" if limit is None else f" (target <= {limit:.2f})"))
        for rows in ("patchbay", "core"):
            if ran(scenario, rows):
                print(f"  {scenario:<20} {rows} (rows) / couple {ratio(scenario, rows, 'couple')} "
                      "(target > 1)")
    if "regional_two_loras" in done and ran("regional_two_loras", "core"):
        print(f"  regional speed-up over core {ratio('regional_two_loras', 'core', 'patchbay')} "
              f"(target >= {targets.regional:.1f}; no engine can beat the same regions without hooks, so the "
              "ceiling here is core / nohook = "
              f"{ratio('regional_two_loras', 'core', 'nohook')})")
    if "seed_rerun" in done and ran("seed_rerun", "loraloader"):
        print(f"  seed_rerun patchbay / loraloader {ratio('seed_rerun', 'patchbay', 'loraloader')} "
              f"(target <= {targets.rerun:.2f})")
    for scenario in SCENARIOS:
        mb = over.get(scenario, {}).get("patchbay")
        if mb is not None and files_mb:
            print(f"  {scenario:<20} peak over plain {mb:.2f} MB = {mb / files_mb[scenario]:.2f}x LoRA files "
                  f"(target <= {targets.memory:.1f})")


def probe(setup: RunSetup, scenario: str, contender: str, side: int) -> None:
    """Subprocess body: one warm-up run, then the peak RSS of a second run over the RSS before it."""
    if not applies(scenario, contender):
        print(json.dumps({"probe": [scenario, contender], "peak_mb": None}))
        return
    bench = Bench(init_comfy(setup.device), setup)
    bench.run_once(contender, scenario, side)  # first-use allocations (kernels, caches) happen here
    _elapsed, peak_mb = bench.run_once(contender, scenario, side, seeds=(3, 4))
    print(json.dumps({"probe": [scenario, contender], "peak_mb": peak_mb}))


def probe_memory(setup: RunSetup, side: int, scenarios: tuple[str, ...], contenders: tuple[str, ...],
                 which: str) -> dict:
    """CPU: MB over plain from fresh-process probes of ``which`` ("patchbay", "all"; "none": {})."""
    if which == "none":
        return {}
    probed = ("patchbay",) if which == "patchbay" else tuple(c for c in contenders if c != "nohook")

    def command(scenario: str, contender: str) -> list[str]:
        return [sys.executable, __file__, "--probe", scenario, contender, "--side", str(side), *setup.argv()]

    return bench_memory.probe_processes(command, scenarios, probed)


def _subset(allowed: tuple[str, ...], what: str):
    """An argparse type: comma-separated names from ``allowed``, returned in ``allowed``'s order."""
    def parse(text: str) -> tuple[str, ...]:
        picked = {t.strip() for t in text.split(",") if t.strip()}
        unknown = sorted(picked - set(allowed))
        if unknown or not picked:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown or [text]}; choose from "
                                             + ", ".join(allowed))
        return tuple(name for name in allowed if name in picked)  # the benchmark's own order
    return parse


_scenarios = _subset(SCENARIOS, "scenario")
_contenders = _subset(CONTENDERS, "contender")


COMPILE_PLAIN_TARGET = 1.10  # --compile: Fast Hooks on the compiled model / the compiled model plain


def compile_models(bench: Bench) -> None:
    """``--compile``: every contender samples the checkpoint compiled by ComfyUI's TorchCompileModel
    (inductor), Fast Hooks on top of it; "plain" is then the compiled model without hooks. The untimed
    warm-up round compiles every graph (core's, the hooked ones, each batch and latent size)."""
    bench.model = bench.n["TorchCompileModel"].execute(bench.model, "inductor")[0]
    bench.fast_model, _clip = bench.n["PatchbayHookEngine"]().execute(bench.model, 2048.0)
    bench.compiled = True
    print("--compile: every contender samples the TorchCompileModel (inductor) model; no memory probes",
          file=sys.stderr)



def _sizes(text: str) -> tuple[int, ...]:
    try:
        sides = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        sides = ()
    if not sides or min(sides) < 1:
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: give latent sides as positive integers, "
                                         "e.g. 8,16")
    return sides


def parse_options(argv=None) -> argparse.Namespace:
    """The command line, with the arch's defaults filled in (``setup``, ``rounds``, ``sizes``, ``scenarios``,
    ``contenders``, ``json_side``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=tuple(ARCHES), default="tiny",
                        help="model to sample (default tiny; see the module docstring)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default cpu")
    parser.add_argument("--steps", type=int, default=None,
                        help="sampler steps (default: the arch's, 10 or 20 for sdxl-full)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per contender (default: the arch's, 5 or 3 for sdxl-full)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, the arch's smallest latent")
    parser.add_argument("--scenarios", type=_scenarios, default=None, metavar="A,B",
                        help="comma-separated subset of " + ",".join(SCENARIOS) + " (default: the arch's, "
                        "all but for sdxl-full; the JSON line carries nulls for the others)")
    parser.add_argument("--contenders", type=_contenders, default=None, metavar="A,B",
                        help="comma-separated subset of " + ",".join(CONTENDERS) + " (default: the arch's; "
                        "nohook, the baseline, is always run)")
    parser.add_argument("--sizes", type=_sizes, default=None, metavar="8,16",
                        help="comma-separated latent sides (default: the arch's, 8,16 for tiny; --quick: "
                        "the smallest)")
    parser.add_argument("--memory", choices=("patchbay", "all", "none"), default="patchbay",
                        help="contenders whose peak memory is measured (default patchbay)")
    parser.add_argument("--compile", action="store_true",
                        help="every contender on the model compiled by TorchCompileModel (inductor): hooked "
                        "compiled vs compiled plain; no memory probes")
    parser.add_argument("--probe", nargs=2, metavar=("SCENARIO", "CONTENDER"), help=argparse.SUPPRESS)
    parser.add_argument("--side", type=int, default=16, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    spec = ARCHES[opts.arch]
    for name in ("steps", "rounds"):
        if getattr(opts, name) is not None and getattr(opts, name) < 1:
            parser.error(f"--{name} {getattr(opts, name)}: give a positive integer")
    opts.setup = RunSetup(spec, opts.device, opts.steps or spec.steps)
    opts.rounds = 1 if opts.quick else (opts.rounds or spec.rounds)
    opts.sizes = opts.sizes or ((min(spec.sizes),) if opts.quick else spec.sizes)
    opts.scenarios = opts.scenarios or spec.scenarios
    picked = opts.contenders or spec.contenders
    opts.contenders = tuple(c for c in CONTENDERS if c == "nohook" or c in picked)
    opts.json_side = spec.sizes[-1] if spec.sizes[-1] in opts.sizes else opts.sizes[-1]
    return opts


def main(argv=None) -> int:
    opts = parse_options(argv)
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: torch {torch.__version__} sees no CUDA device (built for CUDA "
              f"{torch.version.cuda}); run on a GPU machine with a CUDA build of torch.", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    setup = opts.setup
    if opts.probe:
        probe(setup, opts.probe[0], opts.probe[1], opts.side)
        return 0
    sizes, scenarios, contenders, side = opts.sizes, opts.scenarios, opts.contenders, opts.json_side
    if opts.compile:
        opts.memory = "none"  # the probes would sample uncompiled models in fresh processes
    # CPU: the probes first, while this process holds no model (a full-size one is GBs) next to theirs
    over = probe_memory(setup, side, scenarios, contenders, opts.memory) if setup.device == "cpu" else {}
    bench = Bench(init_comfy(setup.device), setup)
    if opts.compile:
        compile_models(bench)
    times, peaks = measure(bench, opts.rounds, sizes, scenarios, contenders)
    if setup.device == "cuda" and opts.memory != "none":
        over = bench_memory.in_process(peaks, side, scenarios, contenders)
    print_times(times, setup, sizes, opts.rounds, scenarios, contenders)
    files_mb = {s: lora_files_mb(setup.spec, s) for s in SCENARIOS}
    if over:
        bench_memory.print_table(over, side, setup.device, files_mb, contenders)
    if side != setup.spec.sizes[-1]:
        print(f"(the JSON line carries {side}x{side} figures, not the arch's {setup.spec.sizes[-1]})")
    medians = {s: {c: _median(times[(s, side, c)]) for c in contenders} for s in scenarios}
    ratios = {s: {c: paired(times, s, side, c) for c in contenders if c != "nohook"} for s in scenarios}
    targets = setup.spec.targets
    if opts.compile:  # issue 18 item 3: hooked compiled <= 1.10x compiled plain, whatever the arch
        targets = dataclasses.replace(targets, plain=COMPILE_PLAIN_TARGET)
    print_targets(times, side, over, targets, files_mb)
    print(json_line(medians, over, files_mb, run_info(setup, opts.memory, opts.compile), ratios))
    return 0


def run_info(setup: RunSetup, memory: str, compiled: bool = False) -> dict:
    """RUN_KEYS for the JSON line: the arch, device, steps, compile, ComfyUI version and memory method."""
    import devpaths

    method = {"cpu": "peak_rss", "cuda": "cuda_max_memory_allocated"}[setup.device]
    return {"arch": setup.spec.name, "device": setup.device, "steps": setup.steps,
            "compile": compiled, "comfyui": devpaths.comfyui_version(),
            "memory": None if memory == "none" else method}


if __name__ == "__main__":
    sys.exit(main())
