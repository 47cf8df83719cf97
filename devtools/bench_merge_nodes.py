"""Benchmark: four SD1.5-size models averaged in the graph and sampled
once, Patchbay's Merge node vs a chain of core ModelMergeSimple nodes (scenario ``average``); and a 3x3
Merge Grid vs nine separate Merge runs (scenario ``grid``). Not CI. One JSON line on stdout.

Run ``make bench-merge-nodes`` (or ``python devtools/bench_merge_nodes.py [--arch tiny|sd15-full]
[--rounds N] [--scenario average|grid|all] [--grid-shape 3x3] [--one-process]`` inside the environment
devtools/env.sh makes; ``--one-process``: every contender of a round in one process, the smoke test's
cheaper form, whose peak RSS figures count from each contender's start in a process that ran others).

Inputs: four diffusion-model files with the full-width SD1.5 UNet (``--arch sd15-full``: ComfyUI's SD15
class with the UNet config its detection reports for a real SD1.5 checkpoint, 859.5 M parameters,
devtools/bench_models.SD15_UNET) or the tiny SD1.5 UNet of devtools/tiny_models (``--arch tiny``, the
smoke test), fp16, random weights from tiny_models' seeded initialisation, one seed stem per file,
generated once into <repo>/.cache/bench-merge-nodes/ in a child process (free disk checked first).

Contenders (the same average, the same sampler), each run in a fresh process (``--probe``) so its
peak RSS is its own, interleaved round by round with the order alternating:
  patchbay  4 x Merge Input: Diffusion Model -> n_average -> Merge (Patchbay) -> KSampler
  core      4 x UNETLoader -> ModelMergeSimple(m2, m1, 1/2) -> (m3, ., 1/3) -> (m4, ., 1/4) -> KSampler
Both run the nodes under torch.inference_mode as ComfyUI's executor does, with ComfyUI told to keep
diffusion weights in fp16 (``--fp16-unet``: on the CPU it would pick fp32 and four core models would
take 14 GB), torch on one thread, a synthesized SD1.5 prompt (77 x 768) and a 64 x 64 image.

Grid scenario (two of the four files): the recipe weighted_sum(a, weighted_sum(a, b, &preset), &alpha),
i.e. a + alpha * preset[block] * (b - a), alpha 0.2 / 0.5 / 0.8 across, the SD1.5 LoRA Block Weight
presets INALL / MIDD / OUTALL (hooks/lbw.py, 0 or 1 per block) down; the tiny checkpoint's CLIP-L and
VAE; prompts encoded with it, seed 7, euler / normal, cfg 7, the steps and image size above; the merge
cache at the nodes' default budget for both contenders:
  grid  one Merge Grid (Patchbay) node: the nine cells, merged, sampled and decoded
  nine  nine Merge (Patchbay) -> KSampler -> VAEDecode runs in one process, as a user re-queueing one
        ComfyUI with new values runs them (the CLIPTextEncode outputs reused, as ComfyUI's executor
        caches them), each MODEL dropped before the next merge (no two models held)
Figures ``grid_*`` / ``grid_nine_*``: seconds and peak RSS of the span, ``*_phases_s`` the span split
by phase (class Phases: sampling, decode, encode, model_build, merge_fill, merge_setup, other);
``grid_one_merge_peak_rss_mb``: the nine runs' peak after the first (one merge, sampled and decoded);
``grid_time_ratio_floor``: the nine runs' sampling + decode + encode over their total, the ratio a grid
would reach if its merges cost nothing; ``grid_time_ratio_besides_sampling``: the two spans less those
phases, compared (the merges and model builds, where a grid saves: what the time ratio tends to where
sampling is cheap, as on a GPU); ``grid_max_abs_image_diff``: the grid's cells against the nine
runs' images (fp16 rounding only).

Figures: ``*_first_latent_s``: from the first loader node to the sampled latent (ComfyUI and the pack
imported before); ``*_peak_rss_mb``: peak RSS of that span over the RSS before it (VmHWM after
clear_refs); ``*_peak_rss_abs_mb``: the process's peak RSS. Medians over rounds; ratios are
patchbay / core of the medians. ``max_abs_latent_diff``: the two latents of the last round (the same
average: fp16 rounding only), next to ``latent_max_abs``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "devtools"))
import devpaths  # noqa: E402

MODELS = 4
CACHE_TAG = "v1"
SCENARIOS = {"average": ("patchbay", "core"), "grid": ("grid", "nine")}
TARGETS = {"average": {"peak_rss_ratio": 0.5, "time_ratio": 1.2},
           "grid": {"time_ratio": 0.4, "one_merge_peak_rss": 1.0}}
GRID_ALPHAS = (0.2, 0.5, 0.8)  # x: weighted_sum's alpha
GRID_PRESETS = ("INALL", "MIDD", "OUTALL")  # y: SD1.5 LoRA Block Weight presets (0/1 per block)
GRID_SHAPE = [3, 3]  # columns (alphas) x rows (presets) used: --grid-shape (the smoke test's 2x2)
GRID_CKPT = "patchbay-sd15-tiny-a.safetensors"  # CLIP-L and VAE (the bench models are UNets only)
PROMPTS = ("a photo of a cat", "blurry")
SEED, CFG, SAMPLER, SCHEDULER = 7, 7.0, "euler", "normal"
ARCHES = {"tiny": {"rounds": 2, "steps": 2}, "sd15-full": {"rounds": 3, "steps": 2}}
SIDE = 64


def bench_dir() -> Path:
    return devpaths.cache_dir() / "bench-merge-nodes"


def model_names(arch: str) -> list[str]:
    return [f"patchbay-bench-merge-{arch}-{i}-{CACHE_TAG}.safetensors" for i in range(MODELS)]


def model_paths(arch: str) -> list[Path]:
    return [bench_dir() / "diffusion_models" / name for name in model_names(arch)]


def unet_config(arch: str) -> dict:
    if arch == "tiny":
        import tiny_models

        return tiny_models.TINY_UNET
    import bench_models

    return bench_models.SD15_UNET


# ---- inputs -------------------------------------------------------------------------------------------


def ensure_models(arch: str, count: int = MODELS) -> None:
    """Generate the first ``count`` model files where missing, in a child process (it imports ComfyUI),
    disk checked first."""
    missing = [p for p in model_paths(arch)[:count] if not p.is_file()]
    if not missing:
        return
    bench_dir().mkdir(parents=True, exist_ok=True)
    need = len(missing) * (1.75e9 if arch == "sd15-full" else 0.25e9)
    free = shutil.disk_usage(bench_dir()).free
    if free < need + 2e9:
        raise RuntimeError(f"{len(missing)} {arch} models need {need / 1e9:.1f} GB and {bench_dir()} has "
                           f"{free / 1e9:.1f} GB free (2 GB kept in reserve); free some disk or use "
                           f"--arch tiny")
    print(f"generating {len(missing)} {arch} models into {bench_dir()} (once)", file=sys.stderr)
    command = [sys.executable, __file__, "--generate", "--arch", arch, "--models", str(count)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")


def generate(arch: str, count: int = MODELS) -> None:
    """Write each missing file: the UNet's parameters from tiny_models' seeded initialisation."""
    import tiny_models
    import torch

    tiny_models.import_comfy_on_cpu()
    import comfy.supported_models

    with torch.device("meta"):
        model = comfy.supported_models.SD15(dict(unet_config(arch))).get_model({}, device="meta")
    for path in model_paths(arch)[:count]:
        if path.is_file():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = tiny_models.init_module(model.diffusion_model, "", f"{path.stem}/unet")
        tiny_models.write_safetensors(path, tensors, tiny_models.model_metadata(
            path.stem, f"bench-merge-nodes/{arch}", "devtools/bench_merge_nodes.py"))
        del tensors


# ---- one contender in this process (--probe) ----------------------------------------------------------


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _core_chain(n: dict, names: list[str]):
    models = [n["UNETLoader"]().load_unet(name, "default")[0] for name in names]
    merged = models[0]
    for i, model in enumerate(models[1:], start=2):  # ratio * model + (1 - ratio) * merged: the mean
        (merged,) = n["ModelMergeSimple"]().merge(model, merged, 1.0 / i)
    return merged


def _patchbay_merge(n: dict, names: list[str]):
    inputs = [n["PatchbayMergeDiffusionModel"]().make(unet_name=name)[0] for name in names]
    (recipe,) = n["PatchbayMethodNAverage"]().build(**{f"models_{i + 1}": r for i, r in enumerate(inputs)})
    return n["PatchbayMerge"]().merge(recipe, cache_mb=0)["result"][0]


def _grid_recipe(pack, n: dict, names: list[str]) -> tuple[Any, str]:
    """weighted_sum(a, weighted_sum(a, b, &preset), &alpha) = a + alpha * preset[block] * (b - a), and
    the y values: the SD1.5 LoRA Block Weight presets as block maps (hooks/lbw.py), one JSON line each."""
    R = importlib.import_module(pack.__name__ + ".merge.recipe")
    lbw = importlib.import_module(pack.__name__ + ".hooks.lbw")
    a, b = (n["PatchbayMergeDiffusionModel"]().make(unet_name=name)[0] for name in names[:2])
    recipe = R.weighted_sum(a, R.weighted_sum(a, b, alpha=R.param("preset")), alpha=R.param("alpha"))
    presets = GRID_PRESETS[:GRID_SHAPE[1]]
    return recipe, "\n".join(json.dumps(lbw.block_map(name, "sd15").blocks) for name in presets)


def _alphas() -> str:
    return ", ".join(str(a) for a in GRID_ALPHAS[:GRID_SHAPE[0]])


def _grid(pack, n: dict, recipe: Any, presets: str, steps: int, clip: Any, vae: Any, latent: dict) -> tuple:
    """One Merge Grid node: 3 alphas x 3 presets; (the nine images in grid order, [])."""
    node = n["PatchbayMergeGrid"]()
    out = node.run(recipe, "alpha", _alphas(), "preset", presets, *PROMPTS, latent, SEED, steps, CFG,
                   SAMPLER, SCHEDULER, clip=clip, vae=vae)
    image = out["result"][0][0]
    side, band = latent["samples"].shape[-1] * 8, importlib.import_module(
        pack.__name__ + ".nodes.merge_grid").LABEL_PX
    cells = [image[r * (side + band) + band:(r + 1) * (side + band), c * side:(c + 1) * side]
             for r in range(GRID_SHAPE[1]) for c in range(GRID_SHAPE[0])]
    return torch_stack(cells), []


def _nine(pack, n: dict, recipe: Any, presets: str, steps: int, clip: Any, vae: Any, latent: dict) -> tuple:
    """Nine Merge (Patchbay) runs, one per variant, as a user re-queueing the graph with new values
    gets them: Merge -> KSampler -> VAEDecode, the prompts encoded once (ComfyUI's executor caches the
    unchanged CLIPTextEncode), each MODEL dropped before the next merge; (images, peak RSS kB after
    the first run: one merge's)."""
    import comfy.model_management

    grid = importlib.import_module(pack.__name__ + ".merge.grid")
    merge_grid = importlib.import_module(pack.__name__ + ".nodes.merge_grid")
    cells = grid.variants(recipe, ("alpha", merge_grid.parse_values(_alphas(), "x")),
                          ("preset", merge_grid.parse_values(presets, "y")))
    pos, neg = (n["CLIPTextEncode"]().encode(clip, text)[0] for text in PROMPTS)
    images, first_peak = [], []
    for _labels, variant in cells:
        model = n["PatchbayMerge"]().merge(variant)["result"][0]
        (out,) = n["KSampler"]().sample(model, SEED, steps, CFG, SAMPLER, SCHEDULER, pos, neg, latent)
        images.append(n["VAEDecode"]().decode(vae, out)[0][0])
        del model, out
        gc.collect()
        comfy.model_management.cleanup_models()
        first_peak = first_peak or [_rss_kb("VmHWM")]
    return torch_stack(images), first_peak


def probe(contenders: list[str], arch: str, steps: int, out_dir: Path) -> list[dict]:
    """Import ComfyUI and the pack, then for each contender time its span (loading, merging, sampling)
    once, with its peak RSS (VmHWM reset before it; the merge cache emptied)."""
    import comfy_inprocess
    import torch

    torch.set_num_threads(1)
    nodes = comfy_inprocess.start_comfy()
    from comfy.cli_args import args

    args.fp16_unet = True  # read when a model is built (comfy.model_management.unet_dtype)
    import folder_paths

    folder_paths.add_model_folder_path("diffusion_models", str(bench_dir() / "diffusion_models"))
    pack = comfy_inprocess.load_pack(nodes, Path(tempfile.mkdtemp(prefix="bench-merge-nodes-")))
    n = nodes.NODE_CLASS_MAPPINGS
    cond = [[torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(1)), {}]]
    uncond = [[torch.zeros(1, 77, 768), {}]]
    (latent,) = n["EmptyLatentImage"]().generate(SIDE, SIDE, 1)
    if set(contenders) & set(SCENARIOS["grid"]):  # loaded once, outside the spans
        _, clip, vae = n["CheckpointLoaderSimple"]().load_checkpoint(GRID_CKPT)
        with torch.inference_mode():
            recipe, presets = _grid_recipe(pack, n, model_names(arch))
    results = []
    for contender in contenders:
        n["PatchbayMergeCacheClear"]().clear()
        gc.collect()
        extra: dict[str, Any] = {}
        before = _rss_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        phases = Phases(pack)
        start = time.perf_counter()
        with torch.inference_mode(), phases:
            if contender in SCENARIOS["grid"]:
                run = _grid if contender == "grid" else _nine
                result, first_peak = run(pack, n, recipe, presets, steps, clip, vae, latent)
                if first_peak:
                    extra["one_merge_peak_rss_mb"] = (first_peak[0] - before) / 1024
            else:
                model = (_core_chain if contender == "core" else _patchbay_merge)(n, model_names(arch))
                (out,) = n["KSampler"]().sample(model, 7, steps, 7.0, "euler", "normal", cond, uncond, latent)
                result = out["samples"]
                del model, out
        seconds = time.perf_counter() - start
        peak = _rss_kb("VmHWM")
        torch.save(result.clone(), out_dir / f"{contender}.pt")
        del result
        gc.collect()
        results.append({"probe": contender, "seconds": seconds, "peak_rss_mb": (peak - before) / 1024,
                        "peak_rss_abs_mb": peak / 1024, **extra, "phases_s": phases.split(seconds)})
    return results


class Phases:
    """Seconds per phase of a contender's span, from timers wrapped around the functions that do each
    (restored on exit): ``sampling`` comfy.sample.sample, ``decode`` VAE.decode, ``encode``
    CLIPTextEncode, ``model_build`` ComfyUI's loader building a MODEL (comfy_merge/runtime._load),
    ``merge_fill`` the rest of comfy_merge/runtime.build_models (the merge math streamed into the model's
    weights: reading, evaluating, checking, caching, copying), ``merge_setup`` the rest of
    merge_models (recipe compiled, inputs opened, keys planned)."""

    def __init__(self, pack) -> None:
        import comfy.sample
        import comfy.sd

        import nodes

        runtime = importlib.import_module(pack.__name__ + ".comfy_merge.runtime")
        self.spans = [(comfy.sample, "sample", "sampling"), (comfy.sd.VAE, "decode", "decode"),
                      (nodes.CLIPTextEncode, "encode", "encode"), (runtime, "_load", "model_build"),
                      (runtime, "build_models", "build_models"), (runtime, "merge_models", "merge_models")]
        self.seconds = {name: 0.0 for _, _, name in self.spans}
        self.saved: list = []

    def __enter__(self) -> Phases:
        for owner, attr, name in self.spans:
            original = getattr(owner, attr)
            self.saved.append((owner, attr, original))
            setattr(owner, attr, self._timed(original, name))
        return self

    def _timed(self, function, name: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original in self.saved:
            setattr(owner, attr, original)

    def split(self, total: float) -> dict[str, float]:
        s = self.seconds
        out = {"sampling": s["sampling"], "decode": s["decode"], "encode": s["encode"],
               "model_build": s["model_build"], "merge_fill": s["build_models"] - s["model_build"],
               "merge_setup": s["merge_models"] - s["build_models"]}
        out["other"] = total - sum(out.values())
        return {k: round(v, 2) for k, v in out.items()}


def torch_stack(tensors: list) -> Any:
    import torch

    return torch.stack([t.float() for t in tensors])


# ---- the benchmark ------------------------------------------------------------------------------------


def run_probe(contenders: list[str], arch: str, steps: int, out_dir: Path, tries: int = 3) -> list[dict]:
    """Contenders in one fresh process; a run the OOM killer stops (the machine is shared) is retried."""
    command = [sys.executable, __file__, "--probe", ",".join(contenders), "--arch", arch, "--steps",
               str(steps), "--out-dir", str(out_dir), "--grid-shape", "x".join(map(str, GRID_SHAPE))]
    for attempt in range(1, tries + 1):
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != -9 or attempt == tries:
            break
        print(f"probe {contenders} killed (OOM: other processes need memory too); retry {attempt} in 30 s",
              file=sys.stderr)
        time.sleep(30)
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith('{"probe"')]
    if proc.returncode != 0 or len(lines) != len(contenders):
        raise RuntimeError(f"probe {contenders} failed ({proc.returncode}; -9 is the OOM killer):\n"
                           f"{proc.stderr[-3000:]}")
    return lines


def bench(arch: str, rounds: int, steps: int, scenarios: list[str], one_process: bool = False) -> dict:
    """Each scenario's two contenders, each in a fresh process (``one_process``: every contender of a
    round in one process, VmHWM reset between them: the smoke test's cheaper form), order alternating
    by round; medians."""
    import torch

    ensure_models(arch, MODELS if "average" in scenarios else 2)
    contenders = [c for name in scenarios for c in SCENARIOS[name]]
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(rounds):
            order = contenders if r % 2 == 0 else contenders[::-1]
            for group in ([order] if one_process else [[c] for c in order]):
                for result in run_probe(group, arch, steps, Path(scratch)):
                    runs[result["probe"]].append(result)
                    print(f"round {r + 1}/{rounds} {result['probe']}: {result['seconds']:.1f} s, "
                          f"+{result['peak_rss_mb']:.0f} MB", file=sys.stderr)
        outputs = {c: torch.load(Path(scratch) / f"{c}.pt") for c in contenders}
    out = {"bench": "merge_nodes", "arch": arch, "scenarios": scenarios, "rounds": rounds, "steps": steps,
           "side": SIDE, "one_process": one_process}
    met = {}
    for name in scenarios:
        ours, theirs = SCENARIOS[name]
        med = {c: {k: statistics.median(run[k] for run in runs[c]) for k in runs[c][0]
                   if k not in ("probe", "phases_s")} for c in (ours, theirs)}
        prefix = "" if name == "average" else f"{name}_"
        if name == "average":
            out["models"] = MODELS
        else:
            out["grid_shape"] = "x".join(map(str, GRID_SHAPE))
            out["grid_one_merge_peak_rss_mb"] = round(med[theirs]["one_merge_peak_rss_mb"])
        for c in (ours, theirs):
            label = c if name == "average" else f"grid_{c}" if c == "nine" else c
            span = "first_latent_s" if name == "average" else "s"
            out[f"{label}_phases_s"] = {k: round(statistics.median(run["phases_s"][k] for run in runs[c]), 2)
                                        for k in runs[c][0]["phases_s"]}
            out.update({f"{label}_{span}": round(med[c]["seconds"], 2),
                        f"{label}_peak_rss_mb": round(med[c]["peak_rss_mb"]),
                        f"{label}_peak_rss_abs_mb": round(med[c]["peak_rss_abs_mb"])})
        for ratio, key in (("time_ratio", "seconds"), ("peak_rss_ratio", "peak_rss_mb"),
                           ("peak_rss_abs_ratio", "peak_rss_abs_mb")):
            out[prefix + ratio] = round(med[ours][key] / med[theirs][key], 3)
        if name == "grid":  # what the grid cannot avoid: nine samplings, decodes (and the prompt encoded)
            fixed = sum(out["grid_nine_phases_s"][k] for k in ("sampling", "decode", "encode"))
            out["grid_time_ratio_floor"] = round(fixed / med[theirs]["seconds"], 3)
            # the rest (merging, model building, the nodes' own work), where a grid saves: on a GPU,
            # where sampling a 64 px image costs next to nothing, the time ratio tends to this one
            ours_fixed = sum(out["grid_phases_s"][k] for k in ("sampling", "decode", "encode"))
            out["grid_time_ratio_besides_sampling"] = round(
                (med[ours]["seconds"] - ours_fixed) / (med[theirs]["seconds"] - fixed), 3)
        diff = (outputs[ours] - outputs[theirs]).abs().max().item()
        scale = outputs[theirs].abs().max().item()
        what = "latent" if name == "average" else "image"
        out[f"{prefix}max_abs_{what}_diff"], out[f"{prefix}{what}_max_abs"] = diff, scale
        for key, target in TARGETS[name].items():
            if key == "one_merge_peak_rss":  # the grid's peak over the first of the nine runs' (one merge)
                met[prefix + key] = med[ours]["peak_rss_mb"] <= med[theirs]["one_merge_peak_rss_mb"] * target
            else:
                met[prefix + key] = out[prefix + key] <= target
    out["targets"] = {("" if name == "average" else f"{name}_") + k: v
                      for name in scenarios for k, v in TARGETS[name].items()}
    out["met"] = met
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=list(ARCHES), default="sd15-full")
    parser.add_argument("--rounds", type=int, default=None, help="default: 3 (sd15-full), 2 (tiny)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default 2)")
    parser.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", type=int, default=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all",
                        help="average: four models averaged, Merge vs core; grid: Merge Grid 3x3 vs nine "
                             "Merge runs; all (default): both")
    parser.add_argument("--one-process", action="store_true",
                        help="every contender of a round in one process (the smoke test: one ComfyUI "
                             "import; peak RSS then counts from each contender's start)")
    parser.add_argument("--grid-shape", default="3x3",
                        help="alphas x presets of the grid scenario, at most 3x3 (the smoke test: 2x2)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or ARCHES[args.arch]["steps"]
    GRID_SHAPE[:] = [min(3, max(1, int(v))) for v in args.grid_shape.lower().split("x")]
    if args.generate:
        generate(args.arch, args.models)
        return 0
    if args.probe:
        for result in probe(args.probe.split(","), args.arch, steps, args.out_dir):
            print(json.dumps(result), flush=True)
        return 0
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    try:
        result = bench(args.arch, args.rounds or ARCHES[args.arch]["rounds"], steps, scenarios,
                       args.one_process)
    except RuntimeError as err:
        print(f"bench_merge_nodes: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
