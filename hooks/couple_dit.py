"""Attention couple on DiT joint attention (Flux.1, Flux.2, SD3/3.5): image and text tokens share one
softmax, so instead of blending per-prompt attention (hooks/couple.py) one attention mask per model call
keeps each image token's text to the prompts of its regions (docs/design-attention-couple.md).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import comfy.conds
import torch

from ..patcher import registry
from ..patcher.calls import argument
from .couple_regions import CoupleError, RegionTokenWeights, Segments
from .engine import TOKEN_WEIGHTS_KEY
from .lowrank import TokenSubset

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

    from .couple_regions import CoupleWeights

__all__ = ["TEXT_LENGTH", "WRAPPER_KEY", "CoupleError", "JointAttention", "JointTokenWeights", "PaddedText",
           "as_model_pads", "is_joint", "joint_mask", "patch_joint"]

WRAPPER_KEY = "patchbay.couple"
_OVERRIDE = "optimized_attention_override"  # comfy.ldm.modules.attention.wrap_attn reads it
_NEG = float("-inf")
_FLUX2_TEXT = 512  # Flux.2 pads shorter prompts to this many tokens
TEXT_LENGTH = "patchbay_text_length"  # a model cond: each row's own text tokens ([B, 1]; PaddedText)


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
    """One model call of a couple: its text tokens (the longest row's), image patch grid, the couple's rows
    (a bool per batch row) and the rows grouped by how they attend: "couple" (the mask), a shorter text
    length (that row's own text and the image: the padding left out) or None (as they are)."""

    owner: int  # id of the JointAttention the call is for
    text: int
    grid: tuple[int, int]
    rows: tuple[bool, ...]
    groups: tuple[tuple[str | int | None, tuple[int, ...]], ...]

    @property
    def length(self) -> int:
        return self.text + self.grid[0] * self.grid[1]


_CALL: ContextVar[_Call | None] = ContextVar("patchbay_couple_call", default=None)


class PaddedText(comfy.conds.CONDRegular):
    """A text context (c_crossattn) that batches with other text lengths: shorter rows get zero tokens at
    the end, and TEXT_LENGTH (a model cond of its own) tells the couple's attention override each row's own
    length, so those keys are left out of its attentions (exact: Flux.1 and SD3 give text no position,
    Flux.2 counts positions from the front, and nothing but attention mixes tokens)."""

    def can_concat(self, other: Any) -> bool:
        a, b = self.cond, other.cond
        if type(other) is not PaddedText or a.ndim != 3 or b.ndim != 3 or a.shape[::2] != b.shape[::2]:
            return super().can_concat(other)
        return a.device == b.device

    def concat(self, others: list) -> torch.Tensor:
        conds = [self.cond, *(o.cond for o in others)]
        longest = max(c.shape[1] for c in conds)
        return torch.cat([torch.nn.functional.pad(c, (0, 0, 0, longest - c.shape[1])) for c in conds])


def calc_cond_batch_wrapper(executor, model, conds, x_in, timestep, model_options, *args, **kwargs):
    """CALC_COND_BATCH: every prompt's text context as a PaddedText (copies: the conds are not changed),
    so the couple's [base | regions] and the negative's own text share one model call."""
    padded = [None if cond is None else [_padded(c) for c in cond] for cond in conds]
    return executor(model, padded, x_in, timestep, model_options, *args, **kwargs)


def _padded(cond: dict) -> dict:
    model_conds = cond.get("model_conds", {})
    text = model_conds.get("c_crossattn")
    if type(text) is not comfy.conds.CONDRegular or text.cond.ndim != 3:  # exact type: others batch their way
        return cond
    length = comfy.conds.CONDRegular(torch.tensor([[text.cond.shape[1]]]))
    return {**cond, "model_conds": {**model_conds, "c_crossattn": PaddedText(text.cond), TEXT_LENGTH: length}}


def segment_ids(segments: Segments, length: int, device: torch.device, padded: bool = False) -> torch.Tensor:
    """The prompt (0 = base) of each of ``length`` text tokens; a tiled context repeats the segments, a
    ``padded`` one has -1 past the couple's tokens."""
    stops = torch.tensor([stop for _, stop in segments.ranges], device=device)
    count = torch.arange(length, device=device)
    ids = torch.bucketize(count % segments.total, stops, right=True)
    return ids.masked_fill_(count >= segments.total, -1) if padded else ids


def joint_mask(weights: CoupleWeights, segments: Segments, text: int, grid: tuple[int, int],
               device: torch.device, dtype: torch.dtype, padded: bool = False) -> torch.Tensor:
    """The additive mask [text + image, text + image] of one couple row (text first). ``padded``: the text
    past the couple's tokens is padding, attended by no token (its own tokens attend the image only)."""
    w = weights.at(*grid, device, torch.float32).flatten(1)  # [S, image tokens]
    seg = segment_ids(segments, text, device, padded)
    image = w.shape[1]
    apart = (seg[:, None] != seg[None, :]) | (seg < 0)  # another prompt's tokens, or padding
    own = torch.zeros((text, text), device=device).masked_fill_(apart, _NEG)
    top = torch.cat([own, torch.zeros((text, image), device=device)], 1)
    logs = torch.cat([w.log(), torch.full((1, image), _NEG, device=device)])  # row -1: the padding
    bottom = torch.cat([logs[seg].t(), torch.zeros((image, image), device=device)], 1)
    return torch.cat([top, bottom]).to(dtype)


class JointAttention:
    """transformer_options["optimized_attention_override"]: the couple's mask on the couple's rows."""

    def __init__(self, weights: CoupleWeights, segments: Segments, patch: int,
                 previous: Callable | None = None) -> None:
        self.weights = weights
        self.segments = segments
        self.patch = patch
        self.previous = previous
        self._masks: dict[tuple, torch.Tensor] = {}  # per call shape (at full size, tens of MB each)
        self._index: dict[tuple, torch.Tensor] = {}  # rows and kept keys, per call shape

    def __deepcopy__(self, memo: dict) -> JointAttention:
        return self  # not changed after construction but for its mask cache; clones share it

    def call_for(self, x: torch.Tensor, context: torch.Tensor | None, chunks: list,
                 lengths: torch.Tensor | None = None) -> _Call | None:
        """The couple's part of a model call on latent ``x`` with text ``context`` (rows shorter than it,
        ``lengths``, padded: PaddedText), or None where no row is the couple's or padded."""
        if context is None or context.ndim != 3 or not chunks:
            return None
        text, rows = context.shape[1], x.shape[0]
        own = [text] * rows if lengths is None else [int(n) for n in lengths.flatten().tolist()]
        per = rows // len(chunks)
        mine = tuple(c == 0 and own[i * per + j] == self.segments.total
                     for i, c in enumerate(chunks) for j in range(per))
        keys = ["couple" if m else n if n < text else None for m, n in zip(mine, own, strict=True)]
        if len(mine) != rows or not any(keys):
            return None
        if any(mine):
            self.weights.check_latent(*x.shape[-2:])
        grid = (math.ceil(x.shape[-2] / self.patch), math.ceil(x.shape[-1] / self.patch))
        groups = tuple((k, tuple(i for i, key in enumerate(keys) if key == k)) for k in dict.fromkeys(keys))
        return _Call(id(self), text, grid, mine, groups)

    def __call__(self, func: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        call = _CALL.get()
        q = args[0] if args else kwargs.get("q")
        seq = 2 if kwargs.get("skip_reshape") else 1  # the token dimension of q, k, v
        length = None if q is None else q.shape[seq]
        if call is None or call.owner != id(self) or length != call.length or q.shape[0] != len(call.rows):
            return self._attend(func, args, kwargs)
        if len(call.groups) == 1:
            return self._group(func, args, kwargs, call, call.groups[0][0], None, seq)
        out = None
        for key, rows in call.groups:
            index = self._cached(("rows", rows, q.device), lambda r=rows: torch.tensor(r, device=q.device))
            part = self._group(func, args, kwargs, call, key, index, seq)
            if out is None:
                out = torch.empty((q.shape[0], *part.shape[1:]), device=part.device, dtype=part.dtype)
            out.index_copy_(0, index, part)
        return out

    def _group(self, func: Callable, args: tuple, kwargs: dict, call: _Call, key: str | int | None,
               rows: torch.Tensor | None, seq: int) -> torch.Tensor:
        """The attention of one group of rows (None: all): masked, without the padding, or as it is."""
        q = args[0] if args else kwargs["q"]
        if key == "couple":
            return self._attend(func, args, kwargs, self._mask(call, q.device, q.dtype), rows)
        if key is None:
            return self._attend(func, args, kwargs, None, rows)
        keep = self._cached(("keys", key, call.text, call.length, q.device), lambda: torch.cat([
            torch.arange(key, device=q.device), torch.arange(call.text, call.length, device=q.device)]))
        return self._attend(func, args, kwargs, None, rows, (seq, keep))

    def _cached(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        store, limit = (self._masks, 4) if key[0] == "mask" else (self._index, 16)
        if key not in store:
            if len(store) >= limit:
                store.pop(next(iter(store)))
            store[key] = make()
        return store[key]

    def _attend(self, func: Callable, args: tuple, kwargs: dict, mask: torch.Tensor | None = None,
                rows: torch.Tensor | None = None,
                keys: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
        """``func`` (through an override set before ours) on ``rows`` (None: all) and the ``keys`` (token
        dimension, indices; None: all), ``mask`` added."""
        given = kwargs.get("mask")
        batch = (args[0] if args else kwargs["q"]).shape[0]

        def take(t: Any, kv: bool) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            t = t if rows is None else t.index_select(0, rows)
            return t.index_select(keys[0], keys[1]) if kv and keys is not None else t
        if rows is not None or keys is not None:
            args = tuple(take(a, i in (1, 2)) for i, a in enumerate(args))
            kwargs = {k: take(v, k in ("k", "v")) if k in ("q", "k", "v") else v for k, v in kwargs.items()}
            if given is not None and rows is not None and given.ndim >= 3 and given.shape[0] == batch:
                given = given.index_select(0, rows)
            if given is not None and keys is not None:
                given = given.index_select(-1, keys[1])
        if mask is not None:
            if given is not None and given.dtype == torch.bool:
                given = torch.zeros(given.shape, device=mask.device, dtype=mask.dtype).masked_fill(~given,
                                                                                                    _NEG)
            given = mask if given is None else given + mask
        if rows is not None or keys is not None or mask is not None:
            kwargs = {**kwargs, "mask": given}
        return self.previous(func, *args, **kwargs) if self.previous else func(*args, **kwargs)

    def _mask(self, call: _Call, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self._cached(("mask", call.text, call.grid, device, dtype), lambda: joint_mask(
            self.weights, self.segments, call.text, call.grid, device, dtype, padded=True).unsqueeze(0))

    def text_positions(self, args: dict) -> dict:
        """Flux "post_input" patch: on the couple's rows each prompt's text positions (Flux.2's RoPE
        ids, 0 to n - 1 for a plain prompt) restart at 0, so a prompt sits where it would alone."""
        call, ids = _CALL.get(), args.get("txt_ids")
        if call is None or call.owner != id(self) or ids is None or not any(call.rows) or not ids.any():
            return args
        seg = segment_ids(self.segments, ids.shape[1], ids.device, padded=True)
        starts = torch.tensor([start for start, _ in self.segments.ranges], device=ids.device)
        count = torch.arange(ids.shape[1], device=ids.device)
        plain = count.to(ids.dtype)
        local = torch.where(seg >= 0, count - starts[seg.clamp(min=0)], count).to(ids.dtype)  # padding kept
        ids = ids.clone()
        positional = (ids == plain.view(1, -1, 1)).all(1)  # [B, axes]: the axes that count the tokens
        for row in (i for i, mine in enumerate(call.rows) if mine):
            ids[row][:, positional[row]] = local.unsqueeze(-1)
        return {**args, "txt_ids": ids}


def apply_model_wrapper(executor, *args, **kwargs):
    """Sets _CALL for the couple's (and the padded) rows of this model call (the couple is this clone's
    JointAttention); takes TEXT_LENGTH out of the model's arguments."""
    lengths = kwargs.pop(TEXT_LENGTH, None)
    core = executor.original  # BaseModel._apply_model: its arguments by name (patcher/calls.py)
    options = argument(core, "transformer_options", args, kwargs, {})
    couple = options.get(_OVERRIDE)
    while couple is not None and not isinstance(couple, JointAttention):
        couple = getattr(couple, "previous", None)
    context = argument(core, "c_crossattn", args, kwargs)
    x = argument(core, "x", args, kwargs)
    chunks = list(options.get("cond_or_uncond", ()))
    call = None if couple is None else couple.call_for(x, context, chunks, lengths)
    if call is not None and any(call.rows) and kwargs.get("ref_latents") is not None:
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


class JointTokenWeights(RegionTokenWeights):
    """A DiT's region hooks weighted per token, by each module's role (``_role``: text, joint, image)."""

    def __init__(self, weights: CoupleWeights, segments: Segments, region_refs: dict[Any, int],
                 roles: weakref.WeakKeyDictionary, patch: int) -> None:
        super().__init__(weights, segments, region_refs)
        self.roles = roles  # module -> "text" | "joint" | "image"
        self.patch = patch

    def module_key(self, module: torch.nn.Module) -> str:
        return self.roles.get(module, "image")

    def weigher(self, x: torch.Tensor) -> Callable[[int, str, torch.Tensor], torch.Tensor | TokenSubset]:
        grid = (math.ceil(x.shape[-2] / self.patch), math.ceil(x.shape[-1] / self.patch))
        return lambda s, role, y: self._weight(s, role, y, grid)

    def _text(self, s: int, tokens: int) -> torch.Tensor:
        if tokens < self.segments.total:
            raise CoupleError(f"attention couple: a text-stream module saw {tokens} text tokens, fewer "
                              f"than the couple's {self.segments.total}; sample the couple's "
                              f"conditioning as the positive.")
        return (segment_ids(self.segments, tokens, torch.device("cpu"), padded=True) == s).float()

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


def patch_joint(clone: ModelPatcher, weights: CoupleWeights, segments: Segments, refs: dict) -> None:
    """Sets the couple on ``clone`` (a fresh clone on Fast Hooks) whose diffusion model ``is_joint``::

        CALC_COND_BATCH wrapper "patchbay.couple": every prompt's text context a PaddedText, so the
            couple's [base | region 1 | ...] and the negative's text batch in one model call (the shorter
            padded with zero tokens at the end), TEXT_LENGTH each row's own length
        APPLY_MODEL wrapper "patchbay.couple": per model call, the positive rows (cond_or_uncond 0)
            whose own text is the couple's -> _CALL (a ContextVar): text tokens, the image's patch grid,
            which rows, which rows are padded
        transformer_options["optimized_attention_override"] = JointAttention: each attention over
            text + image tokens (text first, as Flux and SD3 concatenate them) gets, on the couple's rows,
              text of prompt s  -> its own tokens 0, other prompts' tokens -inf; -> image tokens 0
              image token p     -> text of prompt s: log w_s(p) (-inf where w_s(p) = 0); -> image 0
              padding           -> attended by no token
            padded rows attend their own text and the image (the padding's keys left out); other rows and
            attentions of other lengths run as they are; an override set before runs after ours
        Flux.2 (text positions in its RoPE): a "post_input" patch restarts each prompt's positions at 0
        transformer_options[TOKEN_WEIGHTS_KEY] = JointTokenWeights: a region's LoRA per token:
            image-stream modules: w_r at the patch grid; text-stream modules: 1 on the region's tokens,
            0 elsewhere; single-stream modules ([text | image]): both; no tokens (modulation): the mean;
            the delta computed on the tokens where that weight is > 0 only (hooks/lowrank.py TokenSubset)
    """
    dit = clone.get_model_object("diffusion_model")
    patch = dit.patch_size if isinstance(dit.patch_size, int) else dit.patch_size[-1]
    options = clone.model_options.setdefault("transformer_options", {})
    previous = options.get(_OVERRIDE)
    attention = JointAttention(weights, segments, patch, previous)
    options[_OVERRIDE] = attention
    clone.set_model_patch(attention.text_positions, "post_input")
    registry.set_wrapper(clone, "apply_model", WRAPPER_KEY, apply_model_wrapper)
    registry.set_wrapper(clone, "calc_cond_batch", WRAPPER_KEY, calc_cond_batch_wrapper)
    roles = weakref.WeakKeyDictionary({m: _role(n) for n, m in dit.named_modules()})
    options[TOKEN_WEIGHTS_KEY] = JointTokenWeights(weights, segments, refs, roles, patch)
