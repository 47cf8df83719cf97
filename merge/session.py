"""A recipe ready to run: compiled, its inputs opened, every output key planned, then streamed or evaluated
key by key into whatever the caller wants (a file, a model's parameters, a hook's delta).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import pipeline
from .checks import check_evaluated, stream_warnings
from .context import KeyContext
from .executable import compile_recipe, recipe_text
from .plan import NO_RUNTIME, KeyPlan, MergeOptions, MergeReport, MergeRuntime, cache_salt, plan_keys
from .stream import Evaluator


class MergeSession:
    """See the module docstring. ``plans`` lists every output key; ``report`` collects what happened.

    ``merge/execute.py`` streams a session into a safetensors file; the ComfyUI Merge node streams one into
    a dict and into a model's parameters (comfy_merge/runtime.py); ``evaluate(key)`` gives one key's
    result on its own (a recipe used as a hook asks for "the delta for key K" that way)::

        with MergeSession(recipe, MergeOptions(dtype="fp32")) as session:
            session.stream(sink)                      # sink.append(key, tensor), from the writer thread
            delta = session.evaluate("model.diffusion_model.out.2.weight")

    Planning happens in the constructor (headers only, nothing written): a recipe that fails to plan
    raises there, with every input closed again.
    """

    def __init__(self, recipe: object, options: MergeOptions | None = None,
                 runtime: MergeRuntime = NO_RUNTIME, path: Path | None = None) -> None:
        self.recipe = recipe
        self.options = options = options or MergeOptions()
        self.runtime = runtime
        self.graph = compile_recipe(recipe, options.search_dirs, runtime.cache, runtime.resolve, options.seed)
        self.report = MergeReport(path=path or Path())
        self.sources = self.graph.open_sources(options.architecture_policy)
        try:
            self.plans: list[KeyPlan] = plan_keys(self.graph, self.sources, options, self.report)
        except BaseException:
            self.close()
            raise
        self._salt = cache_salt(options)

    @property
    def arch(self) -> str:
        """The family of the weight inputs (merge/architectures.py: sd15, flux2, ... or unknown)."""
        return self.report.arch

    def __enter__(self) -> MergeSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for source in self.sources:
            source.close()

    def recipe_text(self) -> str:
        """The recipe as .mecha text, as merged files carry it in their metadata."""
        return recipe_text(self.recipe, self.arch)

    def stream(self, sink: Any, plans: list[KeyPlan] | None = None, spill_dir: Path | None = None) -> None:
        """Evaluate ``plans`` (default: every key) in order into ``sink.append(key, tensor)``."""
        chosen = self.plans if plans is None else plans
        pipeline.run(self.graph, self.sources, chosen, sink, self.options, self.report, spill_dir,
                     self.runtime)

    def finish(self) -> MergeReport:
        """The report once every key is streamed, with the warnings about the values written (inf or NaN
        kept by ``nonfinite="warn"``, values far beyond every input's range: merge/checks.py)."""
        self.report.warnings += stream_warnings(self.report)
        return self.report

    def source_dtype(self, key: str) -> torch.dtype:
        """The stored dtype of ``key`` in the first weight input that has it (what loading it gives)."""
        for source in self.sources:
            if source.space == "weight" and source.has(key):
                return source.info(key).torch_dtype
        return next(s.info(key).torch_dtype for s in self.sources if s.has(key))

    def evaluate(self, key: str) -> torch.Tensor | None:
        """The recipe's fp32 result for one canonical ``key`` (None: the recipe drops it), using and
        filling the runtime's ``MergeCache`` when there is one."""
        cache = self.runtime.cache if hasattr(self.runtime.cache, "put") else None
        ident = ("eval", self._salt, self.graph.key_id(self.graph.root, key, self.arch))
        if cache is not None and (found := cache.get(ident)) is not None:
            return found
        device = self.options.device
        leaves = [source.tensor(key).to(device).float() if source.has(key) else None
                  for source in self.sources]
        evaluator = Evaluator(self.graph, self.options.shape_policy, sources=self.sources, cache=cache,
                              salt=self._salt)
        ctx = KeyContext(key=key, seed=self.options.seed, device=device, arch=self.arch)
        result = evaluator.evaluate(self.graph.root, leaves, ctx)
        if isinstance(result, torch.Tensor) and result.is_floating_point():
            check_evaluated(result, key, leaves, self.options, self.report, self.sources)
        if cache is not None:
            if isinstance(result, torch.Tensor):
                cache.put(ident, result)
            cache.settle()
        return result
