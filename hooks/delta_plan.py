"""From ComfyUI WeightHooks to per-module forward deltas: what the engine can run, and how (parsed as
LoraLoader parses a file; rounding "loraloader" reproduces its rounding). Data flow:
docs/architecture.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import comfy.float
import comfy.lora
import comfy.lora_convert
import comfy.model_patcher
import comfy.utils
import comfy.weight_adapter
import torch

from .lowrank import DenseDelta, LowRankDelta, ModuleDeltas, module_kind
from .quantized import kept_quantized

__all__ = ["ROUNDINGS", "HookPatches", "PatchKey", "ShapeMismatchError", "WideningHookError", "build_modules",
           "dense_delta", "dense_key", "has_tensor", "load_hook_patches", "misfit_message", "misfitting",
           "split_key"]

# One hook's patches on one tensor: ((PatchKey, patch), ...), all with the same PatchKey.key.
Parts = tuple[tuple["PatchKey", Any], ...]
# dense_fetch(hook index, parts, device, dtype, strength, rounded) -> W(strength) - W
DenseFetch = Callable[[int, Parts, torch.device, torch.dtype, float, bool], torch.Tensor]

# How a delta meets a weight stored in less than fp32: "compute" adds it in the compute dtype (the
# closest to fp32; what LoraLoader does under lowvram), "loraloader" rounds W + delta to the stored
# dtype first, as full-load LoraLoader does.
ROUNDINGS = ("compute", "loraloader")
_string_to_seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed


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
    """Parse a WeightHook's weights for ``model`` (a BaseModel) the way LoraLoader does.

    A hook with a ``check_model(model)`` method (a recipe hook) is asked first whether it fits.
    """
    if (check := getattr(hook, "check_model", None)) is not None:
        check(model)
    if hook.need_weight_init:
        key_map = comfy.lora.model_lora_keys_unet(model, {})
        lora = comfy.lora_convert.convert_lora(hook.weights)
        patches = comfy.lora.load_lora(lora, key_map, log_missing=False)
    else:
        patches = dict(hook.weights or {})
    # like core's add_hook_patches: keys the model does not have are ignored
    patches = {k: v for k, v in patches.items() if has_tensor(model, split_key(k).key)}
    if misfits := misfitting(model, patches):
        raise ShapeMismatchError(misfit_message("this hook", misfits, len(patches), model))
    for k, v in patches.items():
        reshape = _reshape(v)
        shape = list(comfy.utils.get_attr(model, split_key(k).key).shape)
        if reshape is not None and reshape != shape:
            raise WideningHookError(
                f"this LoRA widens {split_key(k).key} from {shape} to {reshape}: it is a control LoRA (such "
                "as Flux canny/depth) that changes the model's input, which a hook applied to some prompts "
                "cannot do. Load it with LoraLoader (LoraLoaderModelOnly) instead of Create Hook LoRA.")
    return HookPatches(patches, _unsupported_reason(model, patches))


class ShapeMismatchError(ValueError):
    """Patches whose deltas have another shape than the weights they name: made for another model of the
    same key names (Flux.1 and Flux.2, Wan 14B and 5B). ComfyUI skips such a patch with a log line; a
    hook that silently does nothing is worse than an error."""


def _delta_numel(patch: Any) -> tuple[int, int] | int | None:
    """What a patch's delta covers: (rows, values per row) for LoRA/LoCon, a value count for LoHa, LoKr
    and whole-tensor diffs, None where this is not known cheaply (other adapters, Tucker factors)."""
    if isinstance(patch, comfy.weight_adapter.WeightAdapterBase):
        w = patch.weights
        if patch.name == "lora" and w[3] is None:
            up, down = w[0], w[1]
            return up.shape[0], down.flatten(1).shape[1]
        if patch.name == "loha" and w[5] is None:
            return w[0].shape[0] * w[1].flatten(1).shape[1]
        if patch.name == "lokr" and w[7] is None:
            first = w[0].numel() if w[0] is not None else w[3].shape[0] * w[4].flatten(1).shape[1]
            second = w[1].numel() if w[1] is not None else w[5].shape[0] * w[6].flatten(1).shape[1]
            return first * second
        return None
    if isinstance(patch, tuple) and len(patch) == 2 and patch[0] in ("diff", "model_as_lora"):
        return patch[1][0].numel()
    if isinstance(patch, tuple) and len(patch) == 1 and isinstance(patch[0], torch.Tensor):
        return patch[0].numel()
    return None


def misfitting(model: torch.nn.Module, patches: dict) -> list[tuple[str, list[int], Any]]:
    """(key, the weight's shape, what the delta covers) of each patch whose delta cannot have the shape
    of the tensor it names (a widening control LoRA's ``reshape_weight`` is checked where it is read)."""
    out = []
    for k, v in patches.items():
        if _reshape(v) is not None:
            continue
        pk = split_key(k)
        key, shape = pk.key, [int(n) for n in comfy.utils.get_attr(model, pk.key).shape]
        if pk.offset is not None:  # a slice of a fused weight (q of qkv): (dim, start, length)
            dim, _start, length = pk.offset
            shape[dim] = int(length)
        covers = _delta_numel(v)
        if isinstance(covers, tuple):
            fits = covers == (shape[0], math.prod(shape[1:])) if shape else False
        else:
            fits = covers is None or covers == math.prod(shape)
        if not fits:
            out.append((key, shape, list(covers) if isinstance(covers, tuple) else covers))
    return out


def misfit_message(what: str, misfits: list, count: int, model: torch.nn.Module) -> str:
    """The error for ``misfitting``'s list: the first keys with both shapes, and the fix."""
    shown = "; ".join(f"{key} is {shape} in this model, the LoRA's delta covers {covers}"
                      for key, shape, covers in misfits[:3])
    return (f"{what}: {len(misfits)} of its {count} patched weights do not fit this model "
            f"({type(model).__name__}) ({shown}); it was made for another model with the same key names "
            f"(another family or size: Flux.1 vs Flux.2, Wan 14B vs 5B). ComfyUI's LoraLoader would skip "
            f"them silently. Pick a LoRA trained for this model.")


def _reshape(patch: Any) -> list[int] | None:
    """The shape a LoRA patch pads its weight to (``reshape_weight``), or None.

    ``comfy.lora_convert`` adds one to every BFL-layout Flux LoRA, equal to the weight's own shape
    unless the LoRA is a control LoRA that widens ``img_in``.
    """
    if not isinstance(patch, comfy.weight_adapter.LoRAAdapter) or patch.weights[5] is None:
        return None
    return [int(n) for n in patch.weights[5]]


def has_tensor(model: torch.nn.Module, key: str) -> bool:
    """``key`` names a tensor of ``model`` (a patch key of the diffusion model, not of the CLIP)."""
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
    if pk.function is not None or pk.is_bias:
        return False
    kind = module_kind(module)
    if not isinstance(v, comfy.weight_adapter.LoRAAdapter) or not (kind or "").startswith(("linear", "conv")):
        return False
    up, down, _alpha, mid, dora = v.weights[:5]
    weight = module.weight
    reshape = _reshape(v)
    if mid is not None or dora is not None or getattr(module, "groups", 1) != 1:
        return False
    if reshape is not None and (pk.offset is not None or reshape != list(weight.shape)):
        return False
    rows = _output_rows(pk, kind, weight)
    if rows is None:
        return False
    rank = down.shape[0]  # shapes from weight.shape: a quantized weight's storage has another shape
    return up.numel() == rows[1] * rank and down.numel() == rank * math.prod(weight.shape[1:])


def _output_rows(pk: PatchKey, kind: str, weight: torch.Tensor) -> tuple[int, int] | None:
    """(first, count) of the output rows a patch covers: all of them, or the slice of a fused Linear
    weight that a diffusers LoRA's q, k, v (or mlp) patches (ComfyUI's offset ``(0, first, count)``,
    Flux's qkv and linear1); None for a slice along another dimension (the input's)."""
    if pk.offset is None:
        return 0, int(weight.shape[0])
    dim, first, count = pk.offset
    if dim != 0 or kind != "linear":
        return None
    return int(first), int(count)


def _full_rows(up: torch.Tensor, pk: PatchKey, weight: torch.Tensor) -> torch.Tensor:
    """The up projection of a patch on some output rows, zero on the rest: (out, r), so the slice's delta
    is a low-rank delta of the whole weight (a few KB where the dense delta is the weight's size)."""
    if pk.offset is None:
        return up
    _dim, first, count = pk.offset  # dim 0 of a Linear weight: _is_low_rank let nothing else through
    full = up.new_zeros((int(weight.shape[0]), up.numel() // count))
    full[first:first + count] = up.reshape(count, -1)
    return full


# Adapters that add ``strength * diff`` (unless they carry a DoRA magnitude), with its index.
_LINEAR_ADAPTERS = {"lora": 4, "loha": 7, "lokr": 8}


def _is_linear_in_strength(pk: PatchKey, v: Any) -> bool:
    """True when W(s) - W = s * (W(1) - W), so one delta serves every strength."""
    if pk.function is not None:
        return False
    if getattr(v, "linear_in_strength", False):  # an adapter that says so (hooks/recipe_hook.py)
        return True
    if isinstance(v, comfy.weight_adapter.WeightAdapterBase):
        dora_index = _LINEAR_ADAPTERS.get(v.name)
        return dora_index is not None and v.weights[dora_index] is None
    return len(v) == 1 or v[0] in ("diff", "model_as_lora")  # "set" replaces whatever the strength


def build_modules(model: torch.nn.Module, hooks: Iterable[tuple[int, HookPatches]],
                  dense_fetch: DenseFetch, rounding: str = "compute") -> dict[torch.nn.Module, ModuleDeltas]:
    """Per-module deltas of every (engine index, patches) pair; hooks with a ``reason`` must not be passed.

    rounding: one of ROUNDINGS (see there).

    LoRA/LoCon on Linear/Conv weights become LowRankDelta (A, B used as loaded); everything else a
    DenseDelta materialised on demand through ``dense_fetch``. With rounding "loraloader" every patched
    weight stored in less than fp32 (fp8, fp16, bf16; quantized ones are not rounded, see
    hooks/quantized.py) instead gets one DenseDelta per (hook, weight), fetched per strength as
    round(W + dW(s)) - W with ComfyUI's own rounding (``comfy.float.stochastic_rounding``, seeded by the
    key); the forward pass then recomputes the hooked rows with W plus that delta (``replace``), the exact
    weight full-load LoraLoader writes.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}: use one of {ROUNDINGS}")
    out: dict[torch.nn.Module, ModuleDeltas] = {}
    for index, hp in hooks:
        rounded: dict[str, list[tuple[PatchKey, Any]]] = {}
        for k, v in hp.patches.items():
            pk = split_key(k)
            module = _module(model, pk.module_path)
            deltas = out.setdefault(module, _module_deltas(module))
            if _rounded(model, pk, rounding):
                rounded.setdefault(pk.key, []).append((pk, v))
            elif _is_low_rank(pk, v, module):
                up, down, alpha = v.weights[0], v.weights[1], v.weights[2]
                scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
                deltas.low_rank.append(LowRankDelta(index, down, _full_rows(up, pk, module.weight), scale))
            else:
                deltas.dense.append(DenseDelta(index, _fetcher(dense_fetch, index, ((pk, v),), False),
                                               pk.is_bias, _is_linear_in_strength(pk, v)))
        for parts in rounded.values():
            pk = parts[0][0]
            deltas = out[_module(model, pk.module_path)]
            fetch = _fetcher(dense_fetch, index, tuple(parts), True)
            deltas.dense.append(DenseDelta(index, fetch, pk.is_bias, linear=False, replace=not pk.is_bias))
    return out


def dense_key(model: torch.nn.Module, hp: HookPatches, rounding: str = "compute") -> str | None:
    """The first tensor that ``build_modules`` gives ``hp`` a dense delta on (not low-rank), or None."""
    for k, v in hp.patches.items():
        pk = split_key(k)
        if _rounded(model, pk, rounding) or not _is_low_rank(pk, v, _module(model, pk.module_path)):
            return pk.key
    return None


def _rounded(model: torch.nn.Module, pk: PatchKey, rounding: str) -> bool:
    """Whether ``rounding`` makes the patched tensor a dense delta rounded like LoraLoader's."""
    return rounding == "loraloader" and _rounded_when_patched(_module(model, pk.module_path),
                                                              comfy.utils.get_attr(model, pk.key))


def _rounded_when_patched(module: torch.nn.Module | None, weight: torch.Tensor) -> bool:
    """Whether "loraloader" rounds W + delta back into this weight's storage: below fp32, and not kept
    quantized (ComfyUI-GGUF adds LoRAs at dequantize time, in the compute dtype, as "compute" does;
    ComfyUI's quantized layers requantize, which only their own code can do: hooks/quantized.py)."""
    return weight.dtype != torch.float32 and not kept_quantized(module, weight)


def _module_deltas(module: torch.nn.Module) -> ModuleDeltas:
    weight = getattr(module, "weight", None)
    shape = tuple((weight if isinstance(weight, torch.Tensor) else module.scale).shape)
    return ModuleDeltas(module_kind(module), shape)


def _fetcher(dense_fetch: DenseFetch, index: int, parts: Parts, rounded: bool):
    def fetch(device: torch.device, dtype: torch.dtype, strength: float) -> torch.Tensor:
        return dense_fetch(index, parts, device, dtype, strength, rounded)
    return fetch


def dense_delta(parts: Parts, base: torch.Tensor, strength: float, round_to: torch.dtype | None = None
                ) -> torch.Tensor:
    """W(strength) - W for one hook's patches on one tensor, by core's ``calculate_weight`` in fp32.

    ``base`` is the tensor without any patch (model-as-LoRA deltas are taken against it). With
    ``round_to``, W(strength) is first rounded to that dtype the way ModelPatcher.patch_weight_to_device
    rounds it (stochastic rounding seeded by the key, for fp8), so W + delta is the weight full-load
    LoraLoader writes, exactly (the difference of two values of a narrower dtype is exact in fp32).
    """
    key = parts[0][0].key
    w32 = base.to(torch.float32)
    patches = [(strength, patch, 1.0, pk.offset, pk.function) for pk, patch in parts]
    patched = comfy.lora.calculate_weight(patches, w32.clone(), key, intermediate_dtype=torch.float32,
                                          original_weights={key: [(w32, lambda a, **kw: a)]})
    if round_to is not None:
        patched = comfy.float.stochastic_rounding(patched, round_to, seed=_string_to_seed(key))
        patched = patched.to(torch.float32)
    return patched - w32
