"""From ComfyUI WeightHooks to per-module forward deltas: what the engine can run, and how.

Data flow (once per hook content and model; the result is cached by the engine)::

    WeightHook (core's CreateHookLora / CreateHookModelAsLora / ours)
      .weights: a raw LoRA state dict (need_weight_init) -> convert_lora + load_lora with the
                model's key map, exactly as LoraLoader parses it (BFL-layout Flux LoRAs included)
               or ready patches {key: ("model_as_lora", (tensor,)) | adapter | diff}
      -> HookPatches(patches, reason)     reason: why the engine cannot run it (core runs it then)
    build_modules(model, [(index, HookPatches)], dense_fetch)
      -> {module: ModuleDeltas}: LoRA/LoCon on Linear/Conv weights as LowRankDelta (A, B used as
         loaded), everything else as DenseDelta materialised on demand through ``dense_fetch``
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import comfy.lora
import comfy.lora_convert
import comfy.utils
import comfy.weight_adapter
import torch

from .lowrank import DenseDelta, LowRankDelta, ModuleDeltas, module_kind

__all__ = ["HookPatches", "PatchKey", "WideningHookError", "build_modules", "dense_delta",
           "load_hook_patches", "split_key"]

DenseFetch = Callable[[int, "PatchKey", Any, torch.device, torch.dtype, float], torch.Tensor]


class WideningHookError(ValueError):
    """A hook whose patches would change a weight's shape (control LoRAs); it cannot be a hook."""


@dataclass(frozen=True)
class PatchKey:
    key: str
    offset: tuple | None = None
    function: Callable | None = None

    @property
    def module_path(self) -> str:
        return self.key.rsplit(".", 1)[0]

    @property
    def is_bias(self) -> bool:
        return self.key.endswith(".bias")

    @property
    def is_weight(self) -> bool:
        return self.key.endswith((".weight", ".scale"))  # RMSNorm keeps its weight as "scale"


def split_key(k: str | tuple) -> PatchKey:
    if isinstance(k, str):
        return PatchKey(k)
    return PatchKey(k[0], k[1], k[2] if len(k) > 2 else None)


@dataclass(frozen=True, eq=False)
class HookPatches:
    """One hook's patches for one model; ``reason`` says why the engine cannot run it (None: it can)."""

    patches: dict
    reason: str | None


def load_hook_patches(model: torch.nn.Module, hook: Any) -> HookPatches:
    """Parse a WeightHook's weights for ``model`` (a BaseModel) the way LoraLoader does."""
    if hook.need_weight_init:
        key_map = comfy.lora.model_lora_keys_unet(model, {})
        lora = comfy.lora_convert.convert_lora(hook.weights)
        patches = comfy.lora.load_lora(lora, key_map, log_missing=False)
    else:
        patches = dict(hook.weights or {})
    # like core's add_hook_patches: keys the model does not have are ignored
    patches = {k: v for k, v in patches.items() if _has_tensor(model, split_key(k).key)}
    for k, v in patches.items():
        reshape = v.weights[5] if isinstance(v, comfy.weight_adapter.LoRAAdapter) else None
        if reshape is not None:
            raise WideningHookError(
                f"this LoRA widens {split_key(k).key} to {list(reshape)}: it is a control LoRA (such as Flux "
                "canny/depth) that changes the model's input, which a hook applied to some prompts cannot "
                "do. Load it with LoraLoader (LoraLoaderModelOnly) instead of Create Hook LoRA.")
    return HookPatches(patches, _unsupported_reason(model, patches))


def _has_tensor(model: torch.nn.Module, key: str) -> bool:
    try:
        return isinstance(comfy.utils.get_attr(model, key), torch.Tensor)
    except AttributeError:
        return False


def _module(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        module = comfy.utils.get_attr(model, path)
    except AttributeError:
        return None
    return module if isinstance(module, torch.nn.Module) else None


def _unsupported_reason(model: torch.nn.Module, patches: dict) -> str | None:
    for k, v in patches.items():
        pk = split_key(k)
        if not (pk.is_weight or pk.is_bias):
            return f"{pk.key} is not a module weight or bias"
        module = _module(model, pk.module_path)
        if module_kind(module) is None:
            return f"{pk.key} belongs to a {type(module).__name__} module, not a Linear, Conv or norm"
        if isinstance(v, list):
            return f"{pk.key} carries a nested patch list"
    return None


def _is_low_rank(pk: PatchKey, v: Any, module: torch.nn.Module) -> bool:
    if pk.offset is not None or pk.function is not None or pk.is_bias:
        return False
    kind = module_kind(module)
    if not isinstance(v, comfy.weight_adapter.LoRAAdapter) or not (kind or "").startswith(("linear", "conv")):
        return False
    up, down, _alpha, mid, dora, reshape = v.weights[:6]
    if mid is not None or dora is not None or reshape is not None or getattr(module, "groups", 1) != 1:
        return False
    weight = module.weight
    rank = down.shape[0]
    return up.numel() == weight.shape[0] * rank and down.numel() == rank * weight[0].numel()


# Adapters that add ``strength * diff`` (unless they carry a DoRA magnitude), with its index.
_LINEAR_ADAPTERS = {"lora": 4, "loha": 7, "lokr": 8}


def _is_linear_in_strength(pk: PatchKey, v: Any) -> bool:
    """True when W(s) - W = s * (W(1) - W), so one delta serves every strength."""
    if pk.function is not None:
        return False
    if isinstance(v, comfy.weight_adapter.WeightAdapterBase):
        dora_index = _LINEAR_ADAPTERS.get(v.name)
        return dora_index is not None and v.weights[dora_index] is None
    return len(v) == 1 or v[0] in ("diff", "model_as_lora")  # "set" replaces whatever the strength


def build_modules(model: torch.nn.Module, hooks: Iterable[tuple[int, HookPatches]],
                  dense_fetch: DenseFetch) -> dict[torch.nn.Module, ModuleDeltas]:
    """Per-module deltas of every (engine index, patches) pair; hooks with a ``reason`` must not be passed."""
    out: dict[torch.nn.Module, ModuleDeltas] = {}
    for index, hp in hooks:
        for k, v in hp.patches.items():
            pk = split_key(k)
            module = _module(model, pk.module_path)
            weight = getattr(module, "weight", None)
            shape = tuple((weight if isinstance(weight, torch.Tensor) else module.scale).shape)
            deltas = out.setdefault(module, ModuleDeltas(module_kind(module), shape))
            if _is_low_rank(pk, v, module):
                up, down, alpha = v.weights[0], v.weights[1], v.weights[2]
                scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
                deltas.low_rank.append(LowRankDelta(index, down, up, scale))
            else:
                def fetch(device, dtype, strength, _i=index, _pk=pk, _v=v):
                    return dense_fetch(_i, _pk, _v, device, dtype, strength)
                deltas.dense.append(DenseDelta(index, fetch, pk.is_bias, _is_linear_in_strength(pk, v)))
    return out


def dense_delta(patch: Any, pk: PatchKey, base: torch.Tensor, strength: float) -> torch.Tensor:
    """W(strength) - W for one patch, computed by core's own ``comfy.lora.calculate_weight`` in fp32.

    ``base`` is the weight without any patch (model-as-LoRA deltas are taken against it).
    """
    w32 = base.to(torch.float32)
    patches = [(strength, patch, 1.0, pk.offset, pk.function)]
    patched = comfy.lora.calculate_weight(patches, w32.clone(), pk.key, intermediate_dtype=torch.float32,
                                          original_weights={pk.key: [(w32, lambda a, **kw: a)]})
    return patched - w32
