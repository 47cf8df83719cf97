"""Benchmark (issue 16 item 10): four SD1.5-size models averaged in the graph and sampled once, Patchbay's
Merge node vs a chain of core ModelMergeSimple nodes. Not CI. One JSON line on stdout.

Run ``make bench-merge-nodes`` (or ``python devtools/bench_merge_nodes.py [--arch tiny|sd15-full]
[--rounds N]`` inside the environment devtools/env.sh makes).

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

Figures: ``*_first_latent_s``: from the first loader node to the sampled latent (ComfyUI and the pack
imported before); ``*_peak_rss_mb``: peak RSS of that span over the RSS before it (VmHWM after
clear_refs); ``*_peak_rss_abs_mb``: the process's peak RSS. Medians over rounds; ratios are
patchbay / core of the medians. ``max_abs_latent_diff``: the two latents of the last round (the same
average: fp16 rounding only), next to ``latent_max_abs``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "devtools"))
import devpaths  # noqa: E402

MODELS = 4
CACHE_TAG = "v1"
CONTENDERS = ("patchbay", "core")
TARGETS = {"peak_rss_ratio": 0.5, "time_ratio": 1.2}
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


def ensure_models(arch: str) -> None:
    """Generate the missing model files in a child process (it imports ComfyUI), disk checked first."""
    missing = [p for p in model_paths(arch) if not p.is_file()]
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
    command = [sys.executable, __file__, "--generate", "--arch", arch]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")


def generate(arch: str) -> None:
    """Write each missing file: the UNet's parameters from tiny_models' seeded initialisation."""
    import tiny_models
    import torch

    tiny_models.import_comfy_on_cpu()
    import comfy.supported_models

    with torch.device("meta"):
        model = comfy.supported_models.SD15(dict(unet_config(arch))).get_model({}, device="meta")
    for path in model_paths(arch):
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


def probe(contender: str, arch: str, steps: int, latent_out: Path) -> dict:
    """Import ComfyUI and the pack, then time loading + merging + sampling once; peak RSS of that span."""
    import comfy_inprocess
    import torch

    torch.set_num_threads(1)
    nodes = comfy_inprocess.start_comfy()
    from comfy.cli_args import args

    args.fp16_unet = True  # read when a model is built (comfy.model_management.unet_dtype)
    import folder_paths

    folder_paths.add_model_folder_path("diffusion_models", str(bench_dir() / "diffusion_models"))
    comfy_inprocess.load_pack(nodes, Path(tempfile.mkdtemp(prefix="bench-merge-nodes-")))
    n = nodes.NODE_CLASS_MAPPINGS
    cond = [[torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(1)), {}]]
    uncond = [[torch.zeros(1, 77, 768), {}]]
    (latent,) = n["EmptyLatentImage"]().generate(SIDE, SIDE, 1)
    before = _rss_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    start = time.perf_counter()
    with torch.inference_mode():
        model = (_core_chain if contender == "core" else _patchbay_merge)(n, model_names(arch))
        (out,) = n["KSampler"]().sample(model, 7, steps, 7.0, "euler", "normal", cond, uncond, latent)
    seconds = time.perf_counter() - start
    peak = _rss_kb("VmHWM")
    torch.save(out["samples"].clone(), latent_out)
    return {"probe": contender, "seconds": seconds, "peak_rss_mb": (peak - before) / 1024,
            "peak_rss_abs_mb": peak / 1024}


# ---- the benchmark ------------------------------------------------------------------------------------


def run_probe(contender: str, arch: str, steps: int, latent_out: Path, tries: int = 3) -> dict:
    """One contender in a fresh process; a run the OOM killer stops (the machine is shared) is retried."""
    command = [sys.executable, __file__, "--probe", contender, "--arch", arch, "--steps", str(steps),
               "--latent-out", str(latent_out)]
    for attempt in range(1, tries + 1):
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != -9 or attempt == tries:
            break
        print(f"probe {contender} killed (OOM: other processes need memory too); retry {attempt} in 30 s",
              file=sys.stderr)
        time.sleep(30)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"probe"')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"probe {contender} failed ({proc.returncode}; -9 is the OOM killer):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def bench(arch: str, rounds: int, steps: int) -> dict:
    import torch

    ensure_models(arch)
    runs: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    with tempfile.TemporaryDirectory() as scratch:
        latents = {c: Path(scratch) / f"{c}.pt" for c in CONTENDERS}
        for r in range(rounds):
            for contender in (CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]):
                result = run_probe(contender, arch, steps, latents[contender])
                runs[contender].append(result)
                print(f"round {r + 1}/{rounds} {contender}: {result['seconds']:.1f} s, "
                      f"+{result['peak_rss_mb']:.0f} MB", file=sys.stderr)
        ours, theirs = torch.load(latents["patchbay"]), torch.load(latents["core"])
        diff, scale = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    med = {c: {k: statistics.median(run[k] for run in runs[c]) for k in ("seconds", "peak_rss_mb",
                                                                          "peak_rss_abs_mb")}
           for c in CONTENDERS}
    out = {"bench": "merge_nodes", "arch": arch, "models": MODELS, "rounds": rounds, "steps": steps,
           "side": SIDE}
    for c in CONTENDERS:
        out.update({f"{c}_first_latent_s": round(med[c]["seconds"], 2),
                    f"{c}_peak_rss_mb": round(med[c]["peak_rss_mb"]),
                    f"{c}_peak_rss_abs_mb": round(med[c]["peak_rss_abs_mb"])})
    out["time_ratio"] = round(med["patchbay"]["seconds"] / med["core"]["seconds"], 3)
    out["peak_rss_ratio"] = round(med["patchbay"]["peak_rss_mb"] / med["core"]["peak_rss_mb"], 3)
    out["peak_rss_abs_ratio"] = round(med["patchbay"]["peak_rss_abs_mb"] / med["core"]["peak_rss_abs_mb"], 3)
    out["max_abs_latent_diff"] = diff
    out["latent_max_abs"] = scale
    out["targets"] = TARGETS
    out["met"] = {k: out[k] <= v for k, v in TARGETS.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=list(ARCHES), default="sd15-full")
    parser.add_argument("--rounds", type=int, default=None, help="default: 3 (sd15-full), 2 (tiny)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default 2)")
    parser.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--latent-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or ARCHES[args.arch]["steps"]
    if args.generate:
        generate(args.arch)
        return 0
    if args.probe:
        print(json.dumps(probe(args.probe, args.arch, steps, args.latent_out)))
        return 0
    try:
        result = bench(args.arch, args.rounds or ARCHES[args.arch]["rounds"], steps)
    except RuntimeError as err:
        print(f"bench_merge_nodes: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
