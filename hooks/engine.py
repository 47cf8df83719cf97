"""The hook engine: claims ComfyUI's WeightHooks at registration and runs them as forward-pass deltas, all
cond groups in one batch, the weights never written. Data flow: docs/architecture.md; design and
limits: docs/design-hook-engine.md.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import comfy.hooks
import comfy.utils
import torch
from comfy.patcher_extension import WrappersMP

from ..patcher.calls import argument
from ..patcher.step_clock import cond_active
from .compiled import CompiledRun, twin_settings
from .delta_cache import TensorCache
from .delta_plan import (
    ROUNDINGS,
    HookPatches,
    Parts,
    build_modules,
    dense_delta,
    dense_key,
    load_hook_patches,
)
from .lowrank import ModuleDeltas, RowStrengths
from .quantized import plain_weight

__all__ = ["ROUNDINGS", "RUN_KEY", "TOKEN_WEIGHTS_KEY", "HookEngine", "RunPlan", "apply_model_wrapper",
           "calc_cond_batch_wrapper", "outer_sample_wrapper"]

log = logging.getLogger("patchbay.hooks")

RUN_KEY = "patchbay.hooks.run"
# transformer_options entry: an object with ``for_call(RunPlan.index, x) -> TokenWeights | None``
# that weights some hooks' deltas per token (hooks/couple.py: a region's LoRA inside its mask)
TOKEN_WEIGHTS_KEY = "patchbay.hooks.token_weights"
_COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers.torch_compile.COMPILE_KEY
_COMPILE_KWARGS = "torch_compile_kwargs"  # comfy_api.torch_helpers.torch_compile.TORCH_COMPILE_KWARGS
_PLANS_KEPT = 8


@dataclass
class _Call:
    run: RunPlan
    strengths: RowStrengths


_CALL: ContextVar[_Call | None] = ContextVar("patchbay_hook_call", default=None)


@dataclass
class RunPlan:
    """The claimed hooks of one sampling run and their per-module deltas."""

    index: dict[Any, int]
    modules: dict[torch.nn.Module, ModuleDeltas]
    build: Callable[[Any], dict[torch.nn.Module, ModuleDeltas]] | None = None  # the plan for another copy
    covered: list = field(default_factory=list)  # the models (BaseModel) whose modules are in ``modules``
    current: dict[Any, list[float]] = field(default_factory=dict)
    groups: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    handles: list = field(default_factory=list)
    installed: bool = False
    compiled: CompiledRun | None = None  # set on a torch.compile'd model (hooks/compiled.py)

    def strengths(self, uuids: Sequence[Any]) -> list[list[float]]:
        """Per cond chunk of a model call, each claimed hook's strength (0 where the chunk lacks it)."""
        zeros = [0.0] * len(self.index)
        return [self.current.get(u, zeros) for u in uuids]

    def call_for(self, uuids: Sequence[Any]) -> _Call | None:
        strengths = RowStrengths(self.strengths(uuids))
        return _Call(self, strengths) if strengths.runs else None

    def install(self) -> None:
        if self.compiled is not None:
            for model in self.covered:
                self.compiled.install(model, self.modules)
        else:
            self.handles = [m.register_forward_hook(_forward_hook) for m in self.modules]
        self.installed = True

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self.compiled is not None:
            self.compiled.remove()
        self.handles = []
        self.installed = False

    def cover(self, patchers: Iterable[Any]) -> None:
        """The same deltas on other copies of the model (ComfyUI's per-device multi-GPU clones).

        ``modules`` is the engine's cached plan, so the copies' modules go into a new dict.
        """
        for patcher in patchers:
            if any(patcher.model is model for model in self.covered):
                continue
            extra = self.build(patcher)
            self.modules = {**self.modules, **extra}
            self.covered.append(patcher.model)
            if self.installed and self.compiled is not None:
                self.compiled.install(patcher.model, extra)
            elif self.installed:
                self.handles += [m.register_forward_hook(_forward_hook) for m in extra]


def _forward_hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    call = _CALL.get()
    if call is None:
        return None
    deltas = call.run.modules.get(module)
    return None if deltas is None else deltas.apply(module, args[0], output, call.strengths)


class HookEngine:
    """Per model family: parsed hooks, per-module plans and the dense-delta cache.

    What the patcher's hook claimer (hooks/enable.py FastHooks, a patcher.model_patcher.HookClaimer)
    runs, shared by every clone of the patcher it was enabled on, so a re-run with only a new seed finds
    everything parsed and planned.
    """

    def __init__(self, cache_bytes: int = 2 << 30) -> None:
        self.cache = TensorCache(cache_bytes)
        self._patches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._plans: OrderedDict[tuple, dict] = OrderedDict()  # (model, hook ref ids) -> modules
        self._twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # hooks/compiled.py
        self.parses = 0
        self.plans_built = 0

    def hook_patches(self, model: torch.nn.Module, hook: Any) -> HookPatches:
        per_model = self._patches.setdefault(hook.hook_ref, weakref.WeakKeyDictionary())
        if model not in per_model:
            self.parses += 1
            per_model[model] = load_hook_patches(model, hook)
        return per_model[model]

    def runs_hooks_on(self, patcher: Any) -> bool:
        """Whether the engine runs hooks on ``patcher`` (not if compiled other than by TorchCompileModel)."""
        return _compile_mode(patcher, patcher.model_options)[1] is None

    def claim(self, patcher: Any, hooks: Any, model_options: dict, rounding: str = "compute") -> list[Any]:
        """The WeightHooks of ``hooks`` the engine runs; stores the run's plan in ``model_options``.

        rounding: one of ROUNDINGS (hooks/delta_plan.py), the setting of the claimer that asks.
        """
        model = patcher.model
        settings, why_not = _compile_mode(patcher, model_options)
        if why_not is not None:
            log.debug("hooks run on ComfyUI's weight-swapping path: %s", why_not)
            return []
        claimed: list[Any] = []
        by_ref: dict = {}
        for hook in hooks.get_type(comfy.hooks.EnumHookType.Weight):
            hp = self.hook_patches(model, hook)
            reason = hp.reason
            if reason is None and settings is not None and (key := dense_key(model, hp, rounding)):
                reason = (f"{key} needs a dense delta (LoHa, LoKr, DoRA, model-as-LoRA, a bias, rounding "
                          "'loraloader'), which the engine runs only on a model that is not compiled")
            if reason is None:
                claimed.append(hook)
                by_ref[hook.hook_ref] = hp
            else:
                log.debug("hook %s runs on ComfyUI's weight-swapping path: %s", _name(hook), reason)
        if not claimed:
            return []
        log.debug("%d hook(s) run in the forward pass on %s", len(claimed), type(patcher).__name__)
        refs = tuple(by_ref)
        modules = self._modules(patcher, refs, by_ref, rounding)
        def build(other: Any) -> dict:
            return self._modules(other, refs, by_ref, rounding)
        compiled = None if settings is None else CompiledRun(settings, self._twins)
        model_options.setdefault("transformer_options", {})[RUN_KEY] = RunPlan(
            {ref: i for i, ref in enumerate(refs)}, modules, build, [model], compiled=compiled)
        return claimed

    def for_core(self, patcher: Any, hook: Any) -> Any:
        """``hook`` as core should register it when the engine does not run it.

        A LoRA hook gets its file parsed the way LoraLoader parses it (``convert_lora`` first): core's
        own hook path skips that conversion, so BFL-layout Flux LoRAs would silently patch nothing.
        The copy keeps the hook's ref, so the conds' hook groups still match it.
        """
        if hook.hook_type != comfy.hooks.EnumHookType.Weight or not hook.need_weight_init:
            return hook
        copy = hook.clone()
        copy.weights, copy.need_weight_init = self.hook_patches(patcher.model, hook).patches, False
        return copy

    def _modules(self, patcher: Any, refs: tuple, by_ref: dict, rounding: str) -> dict:
        """Per-module deltas for this ordered set of hooks, built once and kept for the next runs.

        A plan lives only as long as all its hooks do (a finalizer on each hook ref drops it), so
        the LoRA tensors of hooks ComfyUI has discarded are never kept alive here.
        """
        key = (patcher.model, rounding, *map(id, refs))  # the model itself: its id could be reused once freed
        if key in self._plans:
            self._plans.move_to_end(key)
            return self._plans[key]
        self.plans_built += 1
        modules = build_modules(patcher.model, [(i, by_ref[ref]) for i, ref in enumerate(refs)],
                                self._dense_fetcher(patcher), rounding)
        self._plans[key] = modules
        for ref in refs:
            weakref.finalize(ref, self._plans.pop, key, None)
        while len(self._plans) > _PLANS_KEPT:
            self._plans.popitem(last=False)
        return modules

    def _dense_fetcher(self, patcher: Any):
        model = patcher.model
        backup = patcher.backup

        def fetch(index: int, parts: Parts, device: torch.device, dtype: torch.dtype, strength: float,
                  rounded: bool) -> torch.Tensor:
            key = parts[0][0].key

            def make() -> torch.Tensor:
                entry = backup.get(key)
                base = entry.weight if entry is not None else comfy.utils.get_attr(model, key)
                round_to = base.dtype if rounded else None
                plain = plain_weight(comfy.utils.get_attr(model, parts[0][0].module_path), key, base, device)
                return dense_delta(parts, plain, strength, round_to).to(dtype)
            # the patch objects themselves (not their ids, which later patches could reuse) key the delta
            patches = tuple((patch, pk.offset) for pk, patch in parts)
            return self.cache.get_or_make((patches, key, device, dtype, strength, rounded), make)
        return fetch


def _compile_mode(patcher: Any, model_options: dict) -> tuple[dict | None, str | None]:
    """(twin settings, None) for a model compiled by TorchCompileModel, (None, None) for one not compiled,
    (None, why) where the engine leaves the hooks to core."""
    for key, value in patcher.object_patches.items():
        if isinstance(value, torch._dynamo.eval_frame.OptimizedModule):
            return None, (f"object patch {key!r} is compiled with torch.compile outside ComfyUI's "
                          "TorchCompileModel (use Patch Order weight_patch_first)")
    if _COMPILE_KEY not in patcher.wrappers.get(WrappersMP.APPLY_MODEL, {}):
        return None, None
    settings, why_not = twin_settings(model_options.get(_COMPILE_KWARGS))
    return settings, None if why_not is None else f"the model is compiled by TorchCompileModel, but {why_not}"


def _name(hook: Any) -> str:
    return f"{type(hook).__name__}@{id(hook.hook_ref):x}"


# ---- wrappers (registered by hooks/enable.py under the key "patchbay.hooks") ---------------------------

def outer_sample_wrapper(executor, *args, **kwargs):
    run: RunPlan | None = executor.class_obj.model_options.get("transformer_options", {}).get(RUN_KEY)
    if run is None:
        return executor(*args, **kwargs)
    run.install()
    try:
        return executor(*args, **kwargs)
    finally:
        run.remove()
        run.current.clear()
        run.groups.clear()


def calc_cond_batch_wrapper(executor, model, conds, x_in, timestep, model_options, *args, **kwargs):
    transformer_options = model_options.get("transformer_options", {})
    run: RunPlan | None = transformer_options.get(RUN_KEY)
    if run is None:
        return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
    clones = model_options.get("multigpu_clones")
    if clones:
        run.cover(clones.values())
    run.current = {}
    stripped = [None if cond is None else [_strip(run, c, timestep, transformer_options) for c in cond]
                for cond in conds]
    return executor(model, stripped, x_in, timestep, model_options, *args, **kwargs)


def _strip(run: RunPlan, cond: dict, timestep: torch.Tensor, transformer_options: dict) -> dict:
    group = cond.get("hooks")
    if group is None:
        return cond
    mine = [h for h in group.hooks if h.hook_ref in run.index]
    if not mine:
        return cond
    if cond_active(cond, timestep[0]):
        row = [0.0] * len(run.index)
        for hook in mine:
            hook.hook_keyframe.prepare_current_keyframe(curr_t=timestep[0],
                                                        transformer_options=transformer_options)
            row[run.index[hook.hook_ref]] += float(hook.strength_model)
        run.current[cond["uuid"]] = row
    out = cond.copy()
    out["hooks"] = _rest(run, group)
    return out


def _rest(run: RunPlan, group: Any) -> Any:
    """One shared replacement per original HookGroup (core batches conds by group identity)."""
    cached = run.groups.get(id(group))
    if cached is None or cached[0] is not group:
        rest = comfy.hooks.HookGroup()
        for hook in group.hooks:
            if hook.hook_ref not in run.index:
                rest.add(hook)
        cached = (group, rest if len(rest) else None)
        run.groups[id(group)] = cached
    return cached[1]


def apply_model_wrapper(executor, *args, **kwargs):
    """APPLY_MODEL (``BaseModel._apply_model``; its arguments found by name in its signature)."""
    transformer_options = argument(executor.original, "transformer_options", args, kwargs, {})
    run: RunPlan | None = transformer_options.get(RUN_KEY)
    x = argument(executor.original, "x", args, kwargs)
    if run is not None and run.compiled is not None:
        tokens = transformer_options.get(TOKEN_WEIGHTS_KEY)
        if tokens is not None and tokens.for_call(run.index, x) is not None:
            raise ValueError("per-token hook weights (Attention Couple's region LoRAs) do not run on a "
                             "model compiled by TorchCompileModel yet; remove TorchCompileModel or the "
                             "regions' LoRAs.")
        return run.compiled.call(executor, args, kwargs, run.strengths(transformer_options.get("uuids", ())))
    call = None if run is None else run.call_for(transformer_options.get("uuids", ()))
    if call is None:
        return executor(*args, **kwargs)
    tokens = transformer_options.get(TOKEN_WEIGHTS_KEY)
    if tokens is not None:
        call.strengths.weights = tokens.for_call(run.index, x)
    token = _CALL.set(call)
    try:
        return executor(*args, **kwargs)
    finally:
        _CALL.reset(token)
