"""Benchmark: merging SD1.5-size UNets, Patchbay vs sd-mecha 1.1.8 vs a read-then-write floor. Not CI.

Run ``make bench-merge`` (or ``python devtools/bench_merge.py [--rounds N] [--only NAME] [--no-sdmecha]``
inside the environment devtools/env.sh makes).

Inputs: eight UNet files with SD1.5's 686 UNet keys and shapes (taken from sd-mecha's sd1-ldm
config, ``model.diffusion_model.`` names so sd-mecha detects them), fp16, 1.72 GB each, made once
into .cache/bench-merge/ from seeded torch.randn (deterministic per torch version).

Recipes: weighted_sum_2 = weighted_sum(m0, m1, alpha=0.5); add_difference_3 = add_difference(m0,
subtract(m1, m2), alpha=1) (sd-mecha's 3-argument add_difference); average_8 = n_average(m0..m7).
All merge in fp32 and write fp16.

Contenders, interleaved per round, each in its own subprocess (``--probe``) so that its peak RSS
(VmHWM) is its own; only the merge call is timed (imports excluded; sd-mecha's import takes
6-8 s):
  floor     read every input byte (os.preadv into one reused buffer) and write one output's bytes,
            fsynced: the I/O a merge cannot avoid
  patchbay  merge.execute.merge with its defaults (1 math thread, reader and writer threads, fsync)
  sdmecha   sd_mecha.merge(recipe, output=path, merge_dtype=fp32, output_dtype=fp16), its defaults
Medians over rounds are reported (pb/floor: of the medians; paired: the median of each round's
patchbay / floor, which a machine's drift between rounds moves less); ``max_abs_diff_vs_sdmecha``
compares the two outputs key by key.
The page cache is warm (inputs are read once before timing). Timings on a shared 2-core machine
are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "devtools"))
import devpaths  # noqa: E402

BENCH_DIR = devpaths.cache_dir() / "bench-merge"
RECIPES = {"weighted_sum_2": 2, "add_difference_3": 3, "average_8": 8}
CONTENDERS = ("floor", "patchbay", "sdmecha")
JSON_KEYS = ("patchbay_s", "sdmecha_s", "floor_s", "patchbay_peak_rss_mb", "max_abs_diff_vs_sdmecha")
BUFFER = 64 * 2**20


def unet_layout() -> list[tuple[str, tuple[int, ...]]]:
    """SD1.5's UNet keys and shapes from sd-mecha's sd1-ldm config (read as YAML, sd-mecha not imported)."""
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("sd_mecha")
    config = Path(spec.submodule_search_locations[0]) / "extensions/builtin/model_configs/sd1-ldm.yaml"
    components = yaml.safe_load(config.read_text())["components"]
    return sorted((k, tuple(v["shape"])) for k, v in components["diffuser"].items())


def input_path(index: int) -> Path:
    return BENCH_DIR / f"sd15-unet-{index}.safetensors"


def ensure_inputs(count: int) -> list[Path]:
    """Generate the missing input files (streamed through our writer, ~1.72 GB each)."""
    merge = load_merge()
    layout = unet_layout()
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    outputs = [merge.io.OutputTensor(k, torch.float16, s) for k, s in layout]
    expected = None
    paths = []
    for index in range(count):
        path = input_path(index)
        paths.append(path)
        if path.exists() and (expected is None or path.stat().st_size == expected):
            expected = path.stat().st_size
            continue
        path.unlink(missing_ok=True)
        start = time.perf_counter()
        metadata = {"patchbay.bench": "sd15-unet"}
        with merge.io.SafetensorsWriter(path, outputs, metadata, fsync=False) as writer:
            for number, (key, shape) in enumerate(layout):
                gen = torch.Generator().manual_seed(index * 100_003 + number)
                writer.append(key, (torch.randn(shape, generator=gen) * 0.05).to(torch.float16))
            writer.commit()
        expected = path.stat().st_size
        print(f"generated {path.name} ({expected / 1e9:.2f} GB) in {time.perf_counter() - start:.1f} s",
              flush=True)
    return paths


def load_merge():
    import pack_imports

    pack_imports.use_standalone_names()
    import patchbay_merge.execute
    import patchbay_merge.io
    import patchbay_merge.recipe  # noqa: F401  (bound as attributes of the package)

    return patchbay_merge


# ---- probes: one contender, one recipe, in this (sub)process -----------------------------------------


def probe(contender: str, recipe: str, out: Path) -> dict:
    inputs = [input_path(i) for i in range(RECIPES[recipe])]
    out.unlink(missing_ok=True)
    run = {"floor": _floor, "patchbay": _patchbay, "sdmecha": _sdmecha}[contender]
    seconds = run(recipe, inputs, out)
    return {"seconds": seconds, "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM). Not ru_maxrss: Linux carries the parent's peak over exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _floor(recipe: str, inputs: list[Path], out: Path) -> float:
    buffer = bytearray(BUFFER)
    view = memoryview(buffer)
    start = time.perf_counter()
    for path in inputs:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [view]) > 0:
                pass
        finally:
            os.close(fd)
    size = inputs[0].stat().st_size
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < size:
            written += os.write(fd, view[: min(BUFFER, size - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _patchbay(recipe: str, inputs: list[Path], out: Path) -> float:
    merge = load_merge()
    R = merge.recipe
    models = [R.model(str(p)) for p in inputs]
    root = {"weighted_sum_2": lambda: R.weighted_sum(models[0], models[1], alpha=0.5),
            "add_difference_3": lambda: R.add_difference(models[0], R.subtract(models[1], models[2])),
            "average_8": lambda: R.n_average(*models)}[recipe]()
    start = time.perf_counter()
    merge.execute.merge(root, out, merge.execute.MergeOptions(progress=False))
    return time.perf_counter() - start


def _sdmecha(recipe: str, inputs: list[Path], out: Path) -> float:
    import sd_mecha

    models = [sd_mecha.model(str(p)) for p in inputs]
    root = {"weighted_sum_2": lambda: sd_mecha.weighted_sum(models[0], models[1], alpha=0.5),
            "add_difference_3": lambda: sd_mecha.add_difference(models[0], models[1], models[2], alpha=1.0),
            "average_8": lambda: sd_mecha.n_average(*models)}[recipe]()
    start = time.perf_counter()
    sd_mecha.merge(root, output=out, merge_dtype=torch.float32, output_dtype=torch.float16,
                   tqdm=SilentProgress)
    return time.perf_counter() - start


class SilentProgress:
    """A tqdm stand-in that prints nothing (sd-mecha's ``tqdm=`` argument)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, *args, **kwargs) -> None:
        return None

    def set_postfix(self, *args, **kwargs) -> None:
        return None

    def close(self) -> None:
        return None


def max_abs_diff(a: Path, b: Path) -> float | None:
    if not (a.exists() and b.exists()):
        return None
    merge = load_merge()
    fa, fb = merge.io.SafetensorsFile(a), merge.io.SafetensorsFile(b)
    worst = 0.0
    for key in fa.tensors:
        if key in fb.tensors:
            worst = max(worst, (fa.read(key).float() - fb.read(key).float()).abs().max().item())
    return worst


# ---- the driver ---------------------------------------------------------------------------------------


def run_probe(contender: str, recipe: str, out: Path) -> dict:
    command = [sys.executable, __file__, "--probe", contender, recipe, str(out)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        print(f"{contender}/{recipe} failed:\n{result.stderr[-3000:]}", file=sys.stderr)
        return {"seconds": None, "peak_rss_mb": None}
    return json.loads(result.stdout.strip().splitlines()[-1])


def json_line(results: dict) -> str:
    """The final JSON line: ``results[recipe]`` holds the JSON_KEYS (None where a contender failed)."""
    def r(value, digits):
        return None if value is None else round(float(value), digits)

    recipes = {name: {key: r(results.get(name, {}).get(key), 6 if key.startswith("max") else 2)
                      for key in JSON_KEYS} for name in RECIPES}
    return json.dumps({"bench": "merge", "recipes": recipes}, separators=(",", ":"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", choices=tuple(RECIPES), action="append")
    parser.add_argument("--no-sdmecha", action="store_true", help="skip sd-mecha (its runs take minutes)")
    parser.add_argument("--probe", nargs=3, metavar=("CONTENDER", "RECIPE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        contender, recipe, out = args.probe
        print(json.dumps(probe(contender, recipe, Path(out))))
        return 0
    ensure_inputs(max(RECIPES.values()))
    contenders = [c for c in CONTENDERS if not (args.no_sdmecha and c == "sdmecha")]
    results: dict[str, dict] = {}
    paired: dict[str, float | None] = {}  # median over rounds of patchbay / floor within the round
    out_dir = BENCH_DIR / "out"
    out_dir.mkdir(exist_ok=True)
    print(f"{'recipe':<18}{'contender':<10}{'round':>6}{'seconds':>9}{'peak RSS MB':>13}", flush=True)
    for name in args.only or RECIPES:
        times: dict[str, list[float]] = {c: [] for c in contenders}
        rss: dict[str, list[float]] = {c: [] for c in contenders}
        for round_number in range(args.rounds):
            for contender in contenders:
                figures = run_probe(contender, name, out_dir / f"{contender}.safetensors")
                print(f"{name:<18}{contender:<10}{round_number:>6}{_fmt(figures['seconds']):>9}"
                      f"{_fmt(figures['peak_rss_mb'], 0):>13}", flush=True)
                if figures["seconds"] is not None:
                    times[contender].append(figures["seconds"])
                    rss[contender].append(figures["peak_rss_mb"])
        diff = max_abs_diff(out_dir / "patchbay.safetensors", out_dir / "sdmecha.safetensors")
        results[name] = {f"{c}_s": statistics.median(times[c]) if times[c] else None for c in contenders}
        results[name]["patchbay_peak_rss_mb"] = max(rss["patchbay"]) if rss["patchbay"] else None
        results[name]["max_abs_diff_vs_sdmecha"] = diff
        pairs = list(zip(times["patchbay"], times["floor"], strict=False))
        paired[name] = statistics.median(p / f for p, f in pairs) if pairs else None
        for path in out_dir.iterdir():
            path.unlink()
    print()
    print(f"{'recipe':<18}{'patchbay s':>11}{'sd-mecha s':>11}{'floor s':>9}{'pb/floor':>9}{'paired':>8}"
          f"{'RSS MB':>8}{'max diff':>10}")
    for name, row in results.items():
        ratio = (row["patchbay_s"] / row["floor_s"]) if row.get("patchbay_s") and row.get("floor_s") else None
        print(f"{name:<18}{_fmt(row.get('patchbay_s')):>11}{_fmt(row.get('sdmecha_s')):>11}"
              f"{_fmt(row.get('floor_s')):>9}{_fmt(ratio):>9}{_fmt(paired.get(name)):>8}"
              f"{_fmt(row.get('patchbay_peak_rss_mb'), 0):>8}"
              f"{_fmt(row.get('max_abs_diff_vs_sdmecha'), 6):>10}")
    print(json_line(results))
    return 0


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
