"""Merge planning: the options, the report, and one ``KeyPlan`` per output key, worked out before any
output exists (``plan`` alone is the CLI's ``validate``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .executable import CompiledRecipe, check_maps, compile_recipe
from .io import ARCHITECTURE_POLICIES, OUT_DTYPES

SHAPE_POLICIES = ("overlap", "first", "error")
MISSING_POLICIES = ("first", "skip", "error")
NONFINITE_POLICIES = ("error", "warn")


class MergeError(ValueError):
    """A merge that cannot run as asked; the message names the key or input and the remedy."""


def _option(default: Any, help_text: str) -> Any:
    """A ``MergeOptions`` field; ``help_text`` is its command-line help (merge/cli.py makes one flag per
    field, ``%(default)s`` shows the default)."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class MergeOptions:
    """How to run a merge: configuration only, every field a command-line flag (merge/cli.py), equal
    options merge alike. What a caller hands a run besides (cache, path lookup, interrupt, progress)
    is a ``MergeRuntime``.

    ``shape_policy``: when a method's inputs disagree in shape, ``"overlap"`` (default) merges the common
    leading region and keeps the first input's shape and its values outside the overlap (an inpainting
    9-channel ``conv_in`` merged with a 4-channel one keeps the 5 extra channels of the first model),
    ``"first"`` keeps the first input unchanged, ``"error"`` stops at plan time. Every such key is listed
    in ``MergeReport.shape_mismatches``. ``missing_policy``: for a key that some weight inputs lack,
    ``"first"`` (default) passes the first available input through unchanged, ``"skip"`` leaves the key
    out, ``"error"`` stops at plan time. Delta inputs (LoRAs) that lack a key contribute zero; methods
    registered with ``accepts_missing`` receive ``None`` instead.

    ``memory_budget_mb`` bounds what the merge holds besides torch itself: the inputs of the keys read
    ahead (up to ``prefetch`` keys besides the one being merged; one key, no read-ahead, when a key's
    inputs are larger) get a quarter, the output buffers the writer drains a quarter (two to six), the
    intermediates of one key half; above that they are spilled to a temporary file next to the output
    (or in ``spill_dir``).
    """

    dtype: str = _option("fp16", "output dtype (%(default)s)")
    device: str = _option("cpu", "where the math runs: cpu, cuda, cuda:1 ... (%(default)s)")
    threads: int = _option(1, "torch threads for the math; 0 keeps torch's setting (%(default)s)")
    workers: int = _option(2, "threads evaluating a large elementwise key side by side, the calling thread "
                              "among them, at most one per CPU (%(default)s)")
    memory_budget_mb: int = _option(1024, "read-ahead + output buffers + intermediates, MB; more is spilled "
                                          "to disk (%(default)s)")
    overwrite: bool = _option(False, "replace an existing output file")
    shape_policy: str = _option("overlap", "inputs of different shapes: merge the overlap, keep the first, "
                                           "or stop (%(default)s)")
    missing_policy: str = _option("first", "a key some inputs lack: pass the first input's, leave it out, "
                                           "or stop (%(default)s)")
    architecture_policy: str = _option("refuse", "inputs of different families or block counts: refuse, "
                                                 "or allow to merge them key by key (%(default)s)")
    nonfinite: str = _option("error", "an output tensor with inf or NaN: "
                                      "stop, or warn (%(default)s)")
    seed: int = _option(0, "seed of random methods (%(default)s)")
    progress: bool = _option(True, "show a progress bar")
    fsync: bool = _option(True, "flush the output to disk before it replaces the target")
    prefetch: int = _option(3, "keys read ahead besides the one being merged (%(default)s)")
    chunk_elements: int = _option(1 << 17, "elements per slice of an elementwise key (%(default)s)")
    search_dirs: tuple[Path, ...] = _option((), "where to look for relative model paths (after the current "
                                                "folder and the recipe's folder; repeatable)")
    spill_dir: Path | None = _option(None, "folder for spilled intermediates (default: the output's)")

    CHOICES = {"dtype": tuple(OUT_DTYPES), "shape_policy": SHAPE_POLICIES, "missing_policy": MISSING_POLICIES,
               "architecture_policy": ARCHITECTURE_POLICIES,
               "nonfinite": NONFINITE_POLICIES}  # a class constant (no annotation): not a field

    def __post_init__(self) -> None:
        for name, allowed in self.CHOICES.items():
            if (value := getattr(self, name)) not in allowed:
                raise ValueError(f"MergeOptions.{name}={value!r}; choose one of {', '.join(allowed)}")


@dataclass(frozen=True)
class MergeRuntime:
    """What a caller that embeds the engine (the ComfyUI nodes, a test) hands one run besides its
    ``MergeOptions``; used by merges, LoRA extraction and LoRA stacks alike.

    ``cache``: pass the same dict to successive merges so methods reuse per-key work
    (``KeyContext.cache``), or a ``MergeCache`` (merge/cache.py) to also reuse whole results of keys and
    sub-graphs, in a budget. ``cache_keep``: the ids (``pipeline.root_id``) of the final results worth
    storing in that cache, or None for all: a caller that knows its next merges (Merge Grid) names what
    they will read, so the results nothing reads again are not copied into the cache, and those it names
    are not evicted to make room for others (results inside a recipe are unaffected). ``resolve(path)``
    replaces the path lookup (returns a ``Path`` or a source object, merge/sources.py); ``check()`` runs
    between keys and raises to stop the run (everything is cleaned up as after Ctrl-C);
    ``on_progress(done, total)`` reports work done (output bytes of a merge, keys or modules of an
    extraction or stack), in the calling thread.
    """

    cache: Any = None
    cache_keep: Container | None = None
    resolve: Callable[[str], Any] | None = None
    check: Callable[[], None] | None = None
    on_progress: Callable[[int, int], None] | None = None


NO_RUNTIME = MergeRuntime()


def cache_salt(options: MergeOptions) -> tuple:
    """The options every cached result depends on besides its ``CompiledRecipe.key_id`` (which holds the merge
    seed where a random method uses it): the shape and missing-key policies and the device."""
    return (options.shape_policy, options.missing_policy, options.device)


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
    out_of_range: list[tuple[str, float, float]] = field(default_factory=list)  # (key, output, inputs)
    spilled_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    cached_keys: int = 0  # keys taken whole from a MergeCache (their inputs not read)


@dataclass(frozen=True)
class KeyPlan:
    """One output key: the canonical key, which sources have it, output dtype and planned shape."""

    key: str
    present: tuple[bool, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    passthrough: int | None = None  # source index copied raw (non-float tensors, missing policy)


@dataclass(frozen=True)
class PlanSummary:
    """What ``plan`` found: output key count, architecture, input file names, warnings."""

    keys: int
    arch: str
    sources: list[str]
    warnings: list[str]


def plan(recipe: object, options: MergeOptions | None = None, search_dirs: tuple[Path, ...] = (),
         runtime: MergeRuntime = NO_RUNTIME) -> PlanSummary:
    """Check a recipe against its files without writing anything (``validate`` in the CLI)."""
    options = options or MergeOptions(search_dirs=tuple(search_dirs))
    graph = compile_recipe(recipe, options.search_dirs, resolve=runtime.resolve)
    report = MergeReport(path=Path())
    with opened_sources(graph, options.architecture_policy) as sources:
        plans = plan_keys(graph, sources, options, report)
    return PlanSummary(len(plans), report.arch, [s.name for s in sources], report.warnings)


@contextlib.contextmanager
def opened_sources(graph: CompiledRecipe, architecture_policy: str = "refuse") -> Iterator[list]:
    """The graph's sources opened lazily (headers only), closed on leaving the block."""
    sources = graph.open_sources(architecture_policy)
    try:
        yield sources
    finally:
        for source in sources:
            source.close()


def plan_keys(graph: CompiledRecipe, sources: list, options: MergeOptions,
              report: MergeReport) -> list[KeyPlan]:
    """Output keys in order, with dtypes and shapes, after the missing-key and shape policies: the union
    of the weight inputs' keys, and the recipe's block maps resolved against every planned key (a recipe
    that validates merges). ``plan`` is that check on its own (``validate`` in the CLI); merge/execute.py
    plans, then streams."""
    weights = [i for i, s in enumerate(sources) if s.space == "weight"] or list(range(len(sources)))
    report.arch = sources[weights[0]].arch if sources else "unknown"
    report.warnings += graph.notes
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
    _report_missing(lacking, options, report)
    for source in sources:
        if unmapped := getattr(source, "unmapped", None):
            report.warnings.append(f"{source.name}: {len(unmapped)} LoRA modules match no key of the base "
                                   f"model and are ignored, e.g. {unmapped[0]}")
    check_maps(graph, report.arch, [p.key for p in plans if p.passthrough is None])
    if report.shape_mismatches:
        report.warnings.append(f"{len(report.shape_mismatches)} keys with mismatched shapes "
                               f"({options.shape_policy}), e.g. {report.shape_mismatches[0]!r}")
    return plans


def _report_missing(lacking: dict[str, list[str]], options: MergeOptions, report: MergeReport) -> None:
    """The missing-key policy's verdict on ``lacking`` (key -> inputs without it): an error or a warning."""
    if not lacking:
        return
    example = next(iter(lacking))
    if options.missing_policy == "error":
        raise MergeError(f"{len(lacking)} keys are missing from some inputs, e.g. {example!r} from "
                         f"{', '.join(lacking[example])}; use missing_policy 'first' or 'skip'")
    report.missing = lacking
    report.warnings.append(f"{len(lacking)} keys missing from some inputs ({options.missing_policy}), "
                           f"e.g. {example!r}")


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
