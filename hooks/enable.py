"""Turning the hook engine on for a MODEL (and the encode cache for a CLIP): the one place that puts the
engine into the patcher's claimer slot and registers its wrappers. Data flow: docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..patcher import registry
from ..patcher.model_patcher import hook_claimer, set_hook_claimer, upgrade
from .clip_cache import CachedEncode
from .engine import (
    ROUNDINGS,
    HookEngine,
    apply_model_wrapper,
    calc_cond_batch_wrapper,
    outer_sample_wrapper,
)

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP

__all__ = ["ROUNDINGS", "WRAPPER_KEY", "clip_cache_of", "enable_clip_cache", "enable_hook_engine",
           "hook_engine_of"]

_ENCODE = "encode_token_weights"

CLAIMER_KEY = "hooks"  # the engine's slot among the patcher's hook claimers
WRAPPER_KEY = "patchbay.hooks"  # the registry key (patchbay.<name>) of its wrappers
# (type, wrapper, priority): APPLY_MODEL runs inside every wrapper of priority 0, core's torch.compile
# wrapper included, so on a compiled model it sees the compiled module that wrapper installs
_WRAPPERS = (("outer_sample", outer_sample_wrapper, 0), ("calc_cond_batch", calc_cond_batch_wrapper, 0),
             ("apply_model", apply_model_wrapper, -1))


@dataclass(frozen=True)
class FastHooks:
    """The hook engine as the patcher's hook claimer (patcher.model_patcher.HookClaimer), with a rounding."""

    engine: HookEngine
    rounding: str = "compute"

    def claim(self, patcher: ModelPatcher, hooks: Any, model_options: dict) -> list[Any]:
        return self.engine.claim(patcher, hooks, model_options, self.rounding)

    def for_core(self, patcher: ModelPatcher, hook: Any) -> Any:
        return self.engine.for_core(patcher, hook)

    def runs_hooks_on(self, patcher: ModelPatcher) -> bool:
        return self.engine.runs_hooks_on(patcher)


def hook_engine_of(model: ModelPatcher) -> HookEngine | None:
    """The hook engine enabled on ``model``, or None."""
    claimer = hook_claimer(model, CLAIMER_KEY)
    return claimer.engine if isinstance(claimer, FastHooks) else None


def enable_hook_engine(model: ModelPatcher, cache_mb: float = 2048.0,
                       rounding: str = "compute") -> ModelPatcher:
    """A clone of ``model`` on which every hook (core's or ours) runs through Patchbay's engine.

    cache_mb: memory budget for materialised deltas (LoHa, LoKr, DoRA, model-as-LoRA), in MiB.
    rounding: for weights stored in less than fp32 (fp8, fp16, bf16). "compute" adds the LoRA in the
        compute dtype (closest to the fp32 result; what LoraLoader does under lowvram); "loraloader"
        rounds W + delta to the stored dtype first, as full-load LoraLoader does, for its images bit
        for bit (dense deltas in fp32 through the cache, one per strength; slower, more memory).
    ``model`` is not changed.
    """
    if cache_mb < 0:
        raise ValueError(f"cache_mb must be >= 0, got {cache_mb}; use 0 to rebuild dense deltas every step.")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}.")
    engine = hook_engine_of(model)
    clone = upgrade(model)
    if engine is None:
        engine = HookEngine(int(cache_mb * 2**20))
    else:
        engine.cache.resize(int(cache_mb * 2**20))
    set_hook_claimer(clone, CLAIMER_KEY, FastHooks(engine, rounding))
    for wrapper_type, fn, priority in _WRAPPERS:
        registry.set_wrapper(clone, wrapper_type, WRAPPER_KEY, fn, priority=priority)
    return clone


def clip_cache_of(clip: CLIP) -> CachedEncode | None:
    """The encode cache enabled on ``clip`` (or an ancestor it was cloned from), or None."""
    cached = clip.patcher.object_patches.get(_ENCODE)
    return cached if isinstance(cached, CachedEncode) else None


def enable_clip_cache(clip: CLIP) -> CLIP:
    """A clone of ``clip`` that remembers its encodings per prompt, CLIP hooks and strengths.

    Clones made from it later (SetClipHooks, CLIPSetLastLayer ...) share the cache. ``clip`` is not changed.
    """
    if not hasattr(clip, "patcher") or not hasattr(clip, "cond_stage_model"):
        raise TypeError(f"expected a CLIP (comfy.sd.CLIP), got {type(clip).__name__}; "
                        "connect the CLIP output of a checkpoint or CLIP loader.")
    cached = clip_cache_of(clip) or CachedEncode(clip.cond_stage_model)
    clone = clip.clone()
    clone.patcher.add_object_patch(_ENCODE, cached)
    return clone
