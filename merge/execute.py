"""The merge executor: a closed recipe streamed key by key into one .safetensors file.

``merge(recipe, out_path, MergeOptions(...))`` plans first (opens every input lazily, checks
architectures, the output path, missing keys and shapes, works out every output tensor), then
streams (merge/pipeline.py): a reader thread fills reused byte arenas with the next key's input
tensors, the calling thread evaluates the recipe for that key (merge/stream.py), a writer thread
appends the result to a temporary file, which is fsynced and renamed into place at the end.
Nothing finished stays in memory; peak memory is torch itself plus about half the memory budget.

Speed comes from not touching memory twice: methods flagged elementwise (weighted_sum,
add_difference, n_average, ...) run on slices of 64K elements cast to fp32 into reused buffers, so
the working set stays in cache, the allocator never faults fresh pages and no full-size fp32 copy
exists. Every other method gets whole fp32 tensors. Results are cast once into a reused output
buffer. The math runs on one torch thread by default: on a small machine the reader and writer
threads need the other cores, and an oversubscribed OpenMP pool is many times slower.

Devices: ``device="cuda"`` moves each key's inputs to the GPU and runs whole-tensor evaluation
there (untested here: the development machine has no GPU).

Policies (``MergeOptions``):
- ``shape_policy``: when a method's inputs disagree in shape, ``"overlap"`` (default) merges the
  common leading region and keeps the first input's shape and its values outside the overlap (an
  inpainting 9-channel ``conv_in`` merged with a 4-channel one keeps the 5 extra channels of the
  first model), ``"first"`` keeps the first input unchanged, ``"error"`` stops at plan time.
  Every such key is listed in ``MergeReport.shape_mismatches``.
- ``missing_policy``: for a key that some weight inputs lack, ``"first"`` (default) passes the first
  available input through unchanged, ``"skip"`` leaves the key out, ``"error"`` stops at plan time.
  Delta inputs (LoRAs) that lack a key contribute zero. Methods registered with
  ``accepts_missing`` receive ``None`` instead.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import io as mio
from . import pipeline
from .steps import Graph, check_maps, compile_recipe, recipe_text

OUT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SHAPE_POLICIES = ("overlap", "first", "error")
MISSING_POLICIES = ("first", "skip", "error")


class MergeError(ValueError):
    """A merge that cannot run as asked; the message names the key or input and the remedy."""


@dataclass(frozen=True)
class MergeOptions:
    """How to run a merge (see the module docstring for the policies).

    ``threads``: torch intra-op threads while merging (0 keeps torch's setting). ``device``: where
    the math runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``). ``memory_budget_mb`` bounds what the merge holds
    besides torch itself: read-ahead arenas get a quarter (one arena, no read-ahead, when a key's
    inputs are larger), the intermediates of one key half; above that they are spilled to a
    temporary file next to the output.
    ``nonfinite``: ``"error"`` or ``"warn"`` when an output tensor holds inf/NaN. ``search_dirs``:
    folders where relative model paths are looked up after the current folder. ``cache``: pass
    the same dict to successive merges so methods reuse per-key work (``KeyContext.cache``).
    """

    dtype: str = "fp16"
    device: str = "cpu"
    threads: int = 1
    memory_budget_mb: int = 1024
    overwrite: bool = False
    shape_policy: str = "overlap"
    missing_policy: str = "first"
    nonfinite: str = "error"
    seed: int = 0
    progress: bool = True
    fsync: bool = True
    prefetch: int = 1
    chunk_elements: int = 1 << 16
    search_dirs: tuple[Path, ...] = ()
    cache: dict | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name, value, allowed in (("dtype", self.dtype, tuple(OUT_DTYPES)),
                                     ("shape_policy", self.shape_policy, SHAPE_POLICIES),
                                     ("missing_policy", self.missing_policy, MISSING_POLICIES),
                                     ("nonfinite", self.nonfinite, ("error", "warn"))):
            if value not in allowed:
                raise ValueError(f"MergeOptions.{name}={value!r}; choose one of {', '.join(allowed)}")


@dataclass
class MergeReport:
    """What a merge did: output, key counts, seconds, and every key a policy touched."""

    path: Path
    keys: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    arch: str = "unknown"
    shape_mismatches: list[str] = field(default_factory=list)
    missing: dict[str, list[str]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    nonfinite_origin: str = ""
    spilled_bytes: int = 0
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class KeyPlan:
    """One output key: the canonical key, which sources have it, output dtype and planned shape."""

    key: str
    present: tuple[bool, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    passthrough: int | None = None  # source index copied raw (non-float tensors, missing policy)


def merge(recipe: object, out_path: str | os.PathLike, options: MergeOptions | None = None) -> MergeReport:
    """Merge ``recipe`` (a closed recipe graph) into ``out_path``; returns a ``MergeReport``.

    Raises ``MergeError``, ``io.ModelFileError`` or ``FileExistsError`` before any output exists when
    the plan fails; an error or Ctrl-C during streaming removes the temporary file and re-raises.
    """
    options = options or MergeOptions()
    start = time.perf_counter()
    out_path = Path(out_path)
    mio.check_output_path(out_path, options.overwrite)
    graph = compile_recipe(recipe, options.search_dirs, options.cache)
    report = MergeReport(path=out_path)
    sources = graph.open_sources()
    try:
        plans = plan_keys(graph, sources, options, report)
        metadata = {"patchbay.recipe": recipe_text(recipe, report.arch),
                    "patchbay.generator": "ComfyUI-Patchbay merge"}
        outputs = [mio.OutputTensor(p.key, p.dtype, p.shape) for p in plans]
        with mio.SafetensorsWriter(out_path, outputs, metadata, options.overwrite, options.fsync) as writer:
            pipeline.run(graph, sources, plans, writer, options, report)
            writer.commit()
        if report.nonfinite:
            shown = ", ".join(report.nonfinite[:3]) + (", ..." if len(report.nonfinite) > 3 else "")
            report.warnings.append(f"{len(report.nonfinite)} tensors hold inf or NaN and were written anyway "
                                   f"(--nonfinite warn): {shown}; at the first, {report.nonfinite_origin}")
        report.keys = len(writer.entries)
        report.bytes_written = writer.position
    finally:
        for source in sources:
            source.close()
    report.seconds = time.perf_counter() - start
    return report


@dataclass(frozen=True)
class PlanSummary:
    """What ``plan`` found: output key count, architecture, input file names, warnings."""

    keys: int
    arch: str
    sources: list[str]
    warnings: list[str]


def plan(recipe: object, options: MergeOptions | None = None,
         search_dirs: tuple[Path, ...] = ()) -> PlanSummary:
    """Check a recipe against its files without writing anything (``validate`` in the CLI)."""
    options = options or MergeOptions(search_dirs=tuple(search_dirs))
    graph = compile_recipe(recipe, options.search_dirs)
    report = MergeReport(path=Path())
    sources = graph.open_sources()
    try:
        plans = plan_keys(graph, sources, options, report)
    finally:
        for source in sources:
            source.close()
    return PlanSummary(len(plans), report.arch, [s.name for s in sources], report.warnings)


# ---- planning ---------------------------------------------------------------------------------------


def plan_keys(graph: Graph, sources: list, options: MergeOptions, report: MergeReport) -> list[KeyPlan]:
    """Output keys in order, with dtypes and shapes, after the missing-key and shape policies."""
    weights = [i for i, s in enumerate(sources) if s.space == "weight"] or list(range(len(sources)))
    report.arch = sources[weights[0]].arch if sources else "unknown"
    keys: dict[str, None] = {}
    for i in weights:
        keys.update(dict.fromkeys(sources[i].keys()))
    out_dtype = OUT_DTYPES[options.dtype]
    plans, lacking = [], {}
    for key in keys:
        present = tuple(s.has(key) for s in sources)
        absent = [sources[i].name for i in weights if not present[i]]
        if absent:
            lacking[key] = absent
            if options.missing_policy == "skip":
                report.skipped.append(key)
                continue
        first = next(i for i in weights if present[i])
        info = sources[first].info(key)
        if not info.is_float:
            plans.append(KeyPlan(key, present, info.torch_dtype, info.shape, passthrough=first))
            continue
        shape = planned_shape(sources, key, present, options, report)
        plans.append(KeyPlan(key, present, out_dtype, shape))
    if lacking:
        example = next(iter(lacking))
        if options.missing_policy == "error":
            raise MergeError(f"{len(lacking)} keys are missing from some inputs, e.g. {example!r} from "
                             f"{', '.join(lacking[example])}; use missing_policy 'first' or 'skip'")
        report.missing = lacking
        report.warnings.append(f"{len(lacking)} keys missing from some inputs ({options.missing_policy}), "
                               f"e.g. {example!r}")
    for source in sources:
        if unmapped := getattr(source, "unmapped", None):
            report.warnings.append(f"{source.name}: {len(unmapped)} LoRA modules match no key of the base "
                                   f"model and are ignored, e.g. {unmapped[0]}")
    check_maps(graph, report.arch, [p.key for p in plans if p.passthrough is None])
    if report.shape_mismatches:
        report.warnings.append(f"{len(report.shape_mismatches)} keys with mismatched shapes "
                               f"({options.shape_policy}), e.g. {report.shape_mismatches[0]!r}")
    return plans


def planned_shape(sources: list, key: str, present: tuple[bool, ...], options: MergeOptions,
                  report: MergeReport) -> tuple[int, ...]:
    """The planned output shape of ``key``: its first input's (every shape policy keeps that shape).

    Methods are not traced ahead of time: one that drops a key or changes a shape at run time is
    still written correctly (the writer lays out offsets as tensors arrive).
    """
    shapes = [sources[i].info(key).shape for i in range(len(sources)) if present[i]]
    if len(set(shapes)) > 1:
        if options.shape_policy == "error":
            detail = ", ".join(f"{sources[i].name} {list(sources[i].info(key).shape)}"
                               for i in range(len(sources)) if present[i])
            raise MergeError(f"{key!r} has different shapes: {detail}; use shape_policy 'overlap' or 'first'")
        report.shape_mismatches.append(key)
    return shapes[0]
