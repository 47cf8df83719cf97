"""Attention couple on DiT joint attention (Flux.1, Flux.2, SD3/3.5): one attention mask per model call.

Why: joint attention mixes image and text tokens in one softmax, so the prompts cannot be attended one by
one and blended as on a UNet's cross-attention (hooks/couple.py); a mask keeps each image token's text to
the prompts of its regions instead (docs/design-attention-couple.md). Data flow::

    patch_joint(clone, weights, segments, region hook refs)
        APPLY_MODEL wrapper "patchbay.couple": per model call, the positive rows (cond_or_uncond 0)
            whose context is the couple's [base | region 1 | ...] (core may tile it) -> _CALL (a
            ContextVar): text tokens, the image's patch grid, which rows
        transformer_options["optimized_attention_override"] = JointAttention: each attention over
            text + image tokens (text first, as Flux and SD3 concatenate them) gets, on those rows,
              text of prompt s  -> its own tokens 0, other prompts' tokens -inf; -> image tokens 0
              image token p     -> text of prompt s: log w_s(p) (-inf where w_s(p) = 0); -> image 0
            other rows and attentions of other lengths run as they are; an override set before runs
            after ours (with the mask)
        Flux.2 (text positions in its RoPE): a "post_input" patch restarts each prompt's positions at 0
        transformer_options[TOKEN_WEIGHTS_KEY] = JointTokenWeights: a region's LoRA per token:
            image-stream modules: w_r at the patch grid; text-stream modules: 1 on the region's tokens,
            0 elsewhere; single-stream modules ([text | image]): both; no tokens (modulation): the mean;
            the delta computed on the tokens where that weight is > 0 only (hooks/lowrank.py TokenSubset)
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..patcher import registry
from ..patcher.calls import argument
from .engine import TOKEN_WEIGHTS_KEY
from .lowrank import TokenSubset

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

    from .couple import CoupleWeights, _Segments

__all__ = ["WRAPPER_KEY", "CoupleError", "JointAttention", "JointTokenWeights", "as_model_pads", "is_joint",
           "joint_mask", "patch_joint"]

WRAPPER_KEY = "patchbay.couple"
_OVERRIDE = "optimized_attention_override"  # comfy.ldm.modules.attention.wrap_attn reads it
_NEG = float("-inf")
_FLUX2_TEXT = 512  # Flux.2 pads shorter prompts to this many tokens


class CoupleError(ValueError):
    """Bad regions for an attention couple; the message names the value and the fix (hooks/couple.py
    raises it too: it lives here so that this module needs nothing from that one at run time)."""


def is_joint(diffusion_model: torch.nn.Module) -> bool:
    """Whether the couple knows this DiT's joint attention: Flux.1/Flux.2 ([txt | img]) or SD3 (MMDiT)."""
    import comfy.ldm.flux.model
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT

    return isinstance(diffusion_model, comfy.ldm.flux.model.Flux | MMDiT)


def as_model_pads(model: ModelPatcher, tokens: torch.Tensor) -> torch.Tensor:
    """A prompt's tokens padded as the model pads a plain prompt (Flux.2: zeros in front, to 512 tokens:
    comfy/model_base.py Flux2.extra_conds), so each prompt of the couple sees what it sees alone."""
    import comfy.model_base

    flux2 = getattr(comfy.model_base, "Flux2", None)
    if flux2 is None or not isinstance(model.model, flux2) or tokens.shape[1] >= _FLUX2_TEXT:
        return tokens
    return torch.nn.functional.pad(tokens, (0, 0, _FLUX2_TEXT - tokens.shape[1], 0))


@dataclass(frozen=True)
class _Call:
    """One model call of a couple: its text tokens, image patch grid and rows (a bool per batch row)."""

    owner: int  # id of the JointAttention the call is for
    text: int
    grid: tuple[int, int]
    rows: tuple[bool, ...]

    @property
    def length(self) -> int:
        return self.text + self.grid[0] * self.grid[1]


_CALL: ContextVar[_Call | None] = ContextVar("patchbay_couple_call", default=None)


def segment_ids(segments: _Segments, length: int, device: torch.device) -> torch.Tensor:
    """The prompt (0 = base) of each of ``length`` text tokens; a tiled context repeats the segments."""
    stops = torch.tensor([stop for _, stop in segments.ranges], device=device)
    return torch.bucketize(torch.arange(length, device=device) % segments.total, stops, right=True)


def joint_mask(weights: CoupleWeights, segments: _Segments, text: int, grid: tuple[int, int],
               device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [text + image, text + image] of one couple row (text first)."""
    w = weights.at(*grid, device, torch.float32).flatten(1)  # [S, image tokens]
    seg = segment_ids(segments, text, device)
    image = w.shape[1]
    own = torch.zeros((text, text), device=device).masked_fill_(seg[:, None] != seg[None, :], _NEG)
    top = torch.cat([own, torch.zeros((text, image), device=device)], 1)
    bottom = torch.cat([w.log()[seg].t(), torch.zeros((image, image), device=device)], 1)
    return torch.cat([top, bottom]).to(dtype)


class JointAttention:
    """transformer_options["optimized_attention_override"]: the couple's mask on the couple's rows."""

    def __init__(self, weights: CoupleWeights, segments: _Segments, patch: int,
                 previous: Callable | None = None) -> None:
        self.weights = weights
        self.segments = segments
        self.patch = patch
        self.previous = previous
        self._masks: dict[tuple, torch.Tensor] = {}

    def __deepcopy__(self, memo: dict) -> JointAttention:
        return self  # not changed after construction but for its mask cache; clones share it

    def call_for(self, x: torch.Tensor, context: torch.Tensor | None, chunks: list) -> _Call | None:
        """The couple's part of a model call on latent ``x`` with text ``context``, or None."""
        if context is None or context.ndim != 3 or context.shape[1] % self.segments.total or 0 not in chunks:
            return None
        self.weights.check_latent(*x.shape[-2:])
        grid = (math.ceil(x.shape[-2] / self.patch), math.ceil(x.shape[-1] / self.patch))
        per = x.shape[0] // max(1, len(chunks))
        rows = tuple(c == 0 for c in chunks for _ in range(per))
        return _Call(id(self), context.shape[1], grid, rows)

    def __call__(self, func: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        call = _CALL.get()
        q = args[0] if args else kwargs.get("q")
        length = None if q is None else q.shape[2] if kwargs.get("skip_reshape") else q.shape[1]
        if call is None or call.owner != id(self) or length != call.length or q.shape[0] != len(call.rows):
            return self._attend(func, args, kwargs)
        mask = self._mask(call, q.device, q.dtype)
        if all(call.rows):
            return self._attend(func, args, kwargs, mask)
        mine = torch.tensor(call.rows, device=q.device)
        plain = self._attend(func, args, kwargs, None, ~mine)
        out = torch.empty((q.shape[0], *plain.shape[1:]), device=plain.device, dtype=plain.dtype)
        out[~mine] = plain
        out[mine] = self._attend(func, args, kwargs, mask, mine)
        return out

    def _attend(self, func: Callable, args: tuple, kwargs: dict, mask: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``func`` (through an override set before ours) on ``rows`` (None: all), ``mask`` added."""
        given = kwargs.get("mask")
        if rows is not None:
            args = tuple(a[rows] if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: v[rows] if k in ("q", "k", "v") else v for k, v in kwargs.items()}
            if given is not None and given.ndim >= 3 and given.shape[0] == rows.shape[0]:
                given = given[rows]
        if mask is not None:
            if given is not None and given.dtype == torch.bool:
                given = torch.zeros(given.shape, device=mask.device, dtype=mask.dtype).masked_fill(~given,
                                                                                                    _NEG)
            given = mask if given is None else given + mask
        if rows is not None or mask is not None:
            kwargs = {**kwargs, "mask": given}
        return self.previous(func, *args, **kwargs) if self.previous else func(*args, **kwargs)

    def _mask(self, call: _Call, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (call.text, call.grid, device, dtype)
        if key not in self._masks:
            if len(self._masks) >= 4:
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = joint_mask(self.weights, self.segments, call.text, call.grid, device,
                                          dtype).unsqueeze(0)
        return self._masks[key]

    def text_positions(self, args: dict) -> dict:
        """Flux "post_input" patch: on the couple's rows each prompt's text positions (Flux.2's RoPE
        ids, 0 to n - 1 for a plain prompt) restart at 0, so a prompt sits where it would alone."""
        call, ids = _CALL.get(), args.get("txt_ids")
        if call is None or call.owner != id(self) or ids is None or not ids.any():
            return args
        seg = segment_ids(self.segments, ids.shape[1], ids.device)
        starts = torch.tensor([start for start, _ in self.segments.ranges], device=ids.device)
        count = torch.arange(ids.shape[1], device=ids.device)
        plain, local = count.to(ids.dtype), (count % self.segments.total - starts[seg]).to(ids.dtype)
        ids = ids.clone()
        positional = (ids == plain.view(1, -1, 1)).all(1)  # [B, axes]: the axes that count the tokens
        for row in (i for i, mine in enumerate(call.rows) if mine):
            ids[row][:, positional[row]] = local.unsqueeze(-1)
        return {**args, "txt_ids": ids}


def apply_model_wrapper(executor, *args, **kwargs):
    """Sets _CALL for the couple's rows of this model call (the couple is this clone's JointAttention)."""
    core = executor.original  # BaseModel._apply_model: its arguments by name (patcher/calls.py)
    options = argument(core, "transformer_options", args, kwargs, {})
    couple = options.get(_OVERRIDE)
    while couple is not None and not isinstance(couple, JointAttention):
        couple = getattr(couple, "previous", None)
    context = argument(core, "c_crossattn", args, kwargs)
    x = argument(core, "x", args, kwargs)
    call = None if couple is None else couple.call_for(x, context, list(options.get("cond_or_uncond", ())))
    if call is not None and kwargs.get("ref_latents") is not None:
        raise CoupleError("attention couple: reference latents (Flux Kontext, Flux.2 editing) are not "
                          "supported by the couple yet; sample without them or use Regional LoRA.")
    token = _CALL.set(call)
    try:
        return executor(*args, **kwargs)
    finally:
        _CALL.reset(token)


_TEXT = ("txt_in", "context_embedder", "context_block")  # module-name parts on the text stream
_JOINT = ("single_blocks",)  # [text | image] concatenated


def _role(name: str) -> str:
    parts = name.split(".")
    if any(p in _JOINT for p in parts):
        return "joint"
    if any(p in _TEXT or p.startswith("txt_") for p in parts):
        return "text"
    return "image"


class JointTokenWeights:
    """transformer_options[TOKEN_WEIGHTS_KEY] on a DiT: each region's hooks weighted per token."""

    def __init__(self, weights: CoupleWeights, segments: _Segments, region_refs: dict[Any, int],
                 roles: weakref.WeakKeyDictionary, patch: int) -> None:
        self.weights = weights
        self.segments = segments
        self.region_refs = region_refs  # hook_ref -> segment (1..R)
        self.roles = roles  # module -> "text" | "joint" | "image"
        self.patch = patch

    def __deepcopy__(self, memo: dict) -> JointTokenWeights:
        return self  # shared by clones: it holds hook refs and modules, which must stay themselves

    def for_call(self, index: dict, x: torch.Tensor) -> Callable | None:
        segment_of = {i: self.region_refs[ref] for ref, i in index.items() if ref in self.region_refs}
        if not segment_of:
            return None
        self.weights.check_latent(*x.shape[-2:])
        grid = (math.ceil(x.shape[-2] / self.patch), math.ceil(x.shape[-1] / self.patch))
        cache: dict[tuple, torch.Tensor | TokenSubset] = {}

        def weigh(hook: int, module: torch.nn.Module, y: torch.Tensor) -> torch.Tensor | TokenSubset | None:
            s = segment_of.get(hook)
            if s is None:
                return None
            key = (s, self.roles.get(module, "image"), tuple(y.shape[1:]), y.device, y.dtype)
            if key not in cache:
                cache[key] = self._weight(s, key[1], y, grid)
            return cache[key]
        return weigh

    def _text(self, s: int, tokens: int) -> torch.Tensor:
        if tokens % self.segments.total:
            raise CoupleError(f"attention couple: a text-stream module saw {tokens} text tokens, not a "
                              f"multiple of the couple's {self.segments.total}; sample the couple's "
                              f"conditioning as the positive.")
        return (segment_ids(self.segments, tokens, torch.device("cpu")) == s).float()

    def _weight(self, s: int, role: str, y: torch.Tensor,
                grid: tuple[int, int]) -> torch.Tensor | TokenSubset:
        if y.ndim == 4:  # a convolution's output [B, C, h, w] (SD3's patch embedding)
            return self.weights.subset(s, *y.shape[-2:], y.device, y.dtype, positions=True)
        if y.ndim != 3:  # no tokens (modulation, time embedding): the region's share
            return self.weights.weights[s].mean().to(y.device, y.dtype)
        return TokenSubset.of(self._tokens(s, role, y.shape[1], grid), y.device, y.dtype)

    def _tokens(self, s: int, role: str, tokens: int, grid: tuple[int, int]) -> torch.Tensor:
        """[tokens, 1] on the CPU (the tokens a LoRA acts on are found there, without a device sync)."""
        image = grid[0] * grid[1]
        if role == "text":
            return self._text(s, tokens).unsqueeze(-1)
        mapped = self.weights.at(*grid, torch.device("cpu"), torch.float32)[s].flatten()
        if role == "joint" and tokens > image:
            return torch.cat([self._text(s, tokens - image), mapped]).unsqueeze(-1)
        if tokens != image:
            raise CoupleError(f"attention couple: {tokens} image tokens where the latent gives a "
                              f"{grid[0]}x{grid[1]} patch grid; reference latents (Kontext, edit models) "
                              f"are not supported by the couple yet.")
        return mapped.unsqueeze(-1)


def patch_joint(clone: ModelPatcher, weights: CoupleWeights, segments: _Segments, refs: dict) -> None:
    """Sets the couple on ``clone`` (a fresh clone on Fast Hooks) whose diffusion model ``is_joint``."""
    dit = clone.get_model_object("diffusion_model")
    patch = dit.patch_size if isinstance(dit.patch_size, int) else dit.patch_size[-1]
    options = clone.model_options.setdefault("transformer_options", {})
    previous = options.get(_OVERRIDE)
    attention = JointAttention(weights, segments, patch, previous)
    options[_OVERRIDE] = attention
    clone.set_model_patch(attention.text_positions, "post_input")
    registry.set_wrapper(clone, "apply_model", WRAPPER_KEY, apply_model_wrapper)
    roles = weakref.WeakKeyDictionary({m: _role(n) for n, m in dit.named_modules()})
    options[TOKEN_WEIGHTS_KEY] = JointTokenWeights(weights, segments, refs, roles, patch)
