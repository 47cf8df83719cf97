"""Attention couple: regional prompts in one batch row, each region's LoRA only inside its mask, where
Regional LoRA (hooks/regions.py) spends a batch row per region at every step. Data flow:
docs/architecture.md; design and measurements: docs/design-attention-couple.md.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import comfy.hooks
import torch
from comfy.ldm.modules import attention

from . import couple_dit
from .couple_regions import (
    MAX_REGIONS,
    CoupleError,
    CoupleWeights,
    RegionTokenWeights,
    Segments,
    couple_weights,
    region_mask,
)
from .enable import enable_hook_engine
from .engine import RUN_KEY, TOKEN_WEIGHTS_KEY
from .lora_hooks import combine
from .lowrank import TokenSubset, chunk_rows

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

__all__ = ["MAX_REGIONS", "CoupleError", "CoupleRegion", "CoupleWeights", "RegionTokenWeights", "Segments",
           "attention_couple", "couple_weights", "region_mask"]

_TEXT_MODULES = ("attn2.to_k", "attn2.to_v")  # linears on the prompt's tokens, not the image's
_BLOCKS = ("input", "middle", "output")


@dataclass(frozen=True)
class CoupleRegion:
    """One region: its CONDITIONING, its MASK and its hooks (None: no LoRA)."""

    cond: list
    mask: torch.Tensor
    hooks: comfy.hooks.HookGroup | None = None


def _grid(tokens: int, height: int, width: int) -> tuple[int, int] | None:
    """The UNet level's (h, w) with h * w == tokens (each level halves the latent, rounding up)."""
    h, w = height, width
    while h * w > tokens:
        h, w = math.ceil(h / 2), math.ceil(w / 2)
        if h == 1 and w == 1:
            break
    return (h, w) if h * w == tokens else None


# extra_options entries the attn2_patch (CoupleContext) leaves for the attn2_replace patch (CoupleAttention)
_ROWS = "patchbay.couple.rows"  # per batch row: whether it is the couple's
_OWN = "patchbay.couple.own_tokens"  # the batch's context length before the swap (other rows' tokens)
_PACKED = "patchbay.couple.packed"  # a Packing: the context's rows are pieces of the rows' tokens


@dataclass(frozen=True)
class Packing:
    """The couple's packed context: each batch row's tokens cut into pieces of ``piece`` tokens, one piece
    per context row (the couple's rows: [base | region 1 | ...], the others their own tokens, untiled),
    so to_k/to_v project every prompt's tokens once. ``mine``/``rest``: the pieces of the couple's rows
    and of the others, in row order (index tensors)."""

    piece: int
    mine: torch.Tensor
    rest: torch.Tensor


class CoupleContext:
    """The attn2_patch: the couple's rows get the full context [base | region 1 | ...], the other rows
    their own tokens.

    The couple's conditioning carries the base prompt's tokens only, so core batches it with the negative
    as any plain prompt; its rows are the positive ones (cond_or_uncond 0) whose context is the base
    prompt's tokens (tiled as core tiles them). Decided once per context tensor (one model call).

    Packed (the default): the context handed on is [pieces, piece, D], each row's tokens cut into pieces
    (``Packing``) and marked with its cond chunks' row bounds (hooks/lowrank.py ``CHUNK_ROWS``), so the
    hook engine adds each chunk's deltas on its own pieces; to_k/to_v then project (1 + R) x 77 tokens for
    the couple's row and 77 for the negative's, not (1 + R) x 77 each. Tiled (on a model compiled by
    TorchCompileModel, whose hooks take equal rows per chunk): the other rows' tokens are repeated to the
    couple's length (attention over keys repeated a whole number of times is exact).
    """

    def __init__(self, base: torch.Tensor, full: torch.Tensor, segments: Segments) -> None:
        self.base = base  # [1, Lb, D]
        self.full = full  # [1, total, D]
        self.piece = math.gcd(full.shape[1], *(b - a for a, b in segments.ranges))
        self._cast: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last: tuple[Any, tuple, bool, Any] | None = None

    def __deepcopy__(self, memo: dict) -> CoupleContext:
        return self  # not changed after construction but its caches; ModelPatcher.clone deep-copies patches

    def _at(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._cast:
            self._cast[key] = (self.base.to(device, dtype), self.full.to(device, dtype))
        return self._cast[key]

    def __call__(self, n: torch.Tensor, context: torch.Tensor | None, value: torch.Tensor | None,
                 extra_options: dict) -> tuple:
        chunks = tuple(extra_options.get("cond_or_uncond", ()))
        if context is None or context.ndim != 3 or 0 not in chunks:
            return n, context, value
        run = extra_options.get(RUN_KEY)
        pack = getattr(run, "compiled", None) is None
        swapped = self._swap(context, chunks, pack)
        if swapped is None:
            return n, context, value
        new, rows, packing = swapped
        extra_options[_ROWS] = rows
        extra_options[_OWN] = context.shape[1]
        extra_options[_PACKED] = packing
        if value is context:
            return n, new, new
        same = value is not None and value.shape == context.shape
        other = self._swap(value, chunks, pack) if same else None
        return n, new, value if other is None else other[0]

    def _swap(self, context: torch.Tensor, chunks: tuple, pack: bool) -> tuple | None:
        last = self._last
        if last is not None and last[0]() is context and last[1] == chunks and last[2] == pack:
            return last[3]
        result = self._compute(context, chunks, pack)
        self._last = (weakref.ref(context), chunks, pack, result)
        return result

    def _compute(self, context: torch.Tensor, chunks: tuple, pack: bool) -> tuple | None:
        rows, length, width = context.shape
        base, full = self._at(context.device, context.dtype)
        if rows % len(chunks) or length % base.shape[1]:
            return None
        per = rows // len(chunks)
        positive = [i * per + j for i, c in enumerate(chunks) if c == 0 for j in range(per)]
        tiled = base.repeat(1, length // base.shape[1], 1)
        same = (context[positive] == tiled).flatten(1).all(1).tolist()  # one sync per model call
        mine = {i for i, s in zip(positive, same, strict=True) if s}
        if not mine:
            return None
        flags = tuple(i in mine for i in range(rows))
        piece = math.gcd(self.piece, length)
        if pack:
            own, couple = length // piece, full.shape[1] // piece  # pieces per row
            counts = [couple if f else own for f in flags]
            starts = torch.tensor([0, *counts]).cumsum(0).tolist()
            index = []  # per piece: its row in [context's pieces | the full context's pieces]
            for i, f in enumerate(flags):
                index += range(rows * own, rows * own + couple) if f else range(i * own, (i + 1) * own)
            source = torch.cat([context.reshape(-1, piece, width), full.reshape(-1, piece, width)])
            packed = source.index_select(0, torch.tensor(index, device=context.device))
            bounds = [starts[c * per] for c in range(len(chunks) + 1)]
            device = context.device
            packing = Packing(piece, *(torch.tensor([p for i, f in enumerate(flags) if f == want
                                                     for p in range(starts[i], starts[i + 1])], device=device)
                                       for want in (True, False)))
            return chunk_rows(packed, bounds), flags, packing
        total = math.lcm(length, full.shape[1])
        out = context.repeat(1, total // length, 1)
        index = torch.tensor(sorted(mine), device=context.device)
        out.index_copy_(0, index, full.repeat(1, total // full.shape[1], 1).expand(len(mine), -1, -1))
        return out, flags, None


class CoupleAttention:
    """The attn2_replace patch: the couple's rows attend each prompt separately and blend by weight."""

    def __init__(self, weights: CoupleWeights, segments: Segments) -> None:
        self.weights = weights
        self.segments = segments
        self._index: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __deepcopy__(self, memo: dict) -> CoupleAttention:
        return self  # not changed after construction; ModelPatcher.clone deep-copies model_options

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 extra_options: dict) -> torch.Tensor:
        heads, precision = extra_options["n_heads"], extra_options.get("attn_precision")
        rows = extra_options.get(_ROWS)
        packing = extra_options.get(_PACKED)
        if packing is not None and rows is not None and len(rows) == q.shape[0]:
            return self._packed(q, k, v, heads, precision, rows, packing, extra_options)
        if rows is None or k.shape[1] % self.segments.total or len(rows) != q.shape[0]:
            return attention.optimized_attention(q, k, v, heads, attn_precision=precision)
        latent = extra_options["original_shape"][-2:]
        if all(rows):
            return self._blend(q, k, v, heads, precision, latent)
        own = extra_options[_OWN]  # other rows: their own tokens, tiled; one copy is exact and cheaper
        mine, rest = self._rows(rows, q.device)
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
        out.index_copy_(0, rest, attention.optimized_attention(
            q.index_select(0, rest), k.index_select(0, rest)[:, :own], v.index_select(0, rest)[:, :own],
            heads, attn_precision=precision))
        out.index_copy_(0, mine, self._blend(q.index_select(0, mine), k.index_select(0, mine),
                                             v.index_select(0, mine), heads, precision, latent))
        return out

    def _packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, precision: Any,
                rows: tuple[bool, ...], packing: Packing, extra_options: dict) -> torch.Tensor:
        """Packed keys and values (``Packing``): each row's pieces joined back into its tokens."""
        latent = extra_options["original_shape"][-2:]
        mine, rest = self._rows(rows, q.device)

        def joined(t: torch.Tensor, pieces: torch.Tensor, count: int) -> torch.Tensor:
            return t.index_select(0, pieces).reshape(count, -1, t.shape[-1])

        if not rest.numel():
            return self._blend(q, joined(k, packing.mine, len(rows)), joined(v, packing.mine, len(rows)),
                               heads, precision, latent)
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
        count = rest.numel()
        out.index_copy_(0, rest, attention.optimized_attention(
            q.index_select(0, rest), joined(k, packing.rest, count), joined(v, packing.rest, count), heads,
            attn_precision=precision))
        count = mine.numel()
        out.index_copy_(0, mine, self._blend(q.index_select(0, mine), joined(k, packing.mine, count),
                                             joined(v, packing.mine, count), heads, precision, latent))
        return out

    def _rows(self, rows: tuple[bool, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rows, device)
        if key not in self._index:
            self._index[key] = (torch.tensor([i for i, r in enumerate(rows) if r], device=device),
                                torch.tensor([i for i, r in enumerate(rows) if not r], device=device))
        return self._index[key]

    def _blend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, precision: Any,
               latent: Sequence[int]) -> torch.Tensor:
        """sum over the prompts' segments s of w_s(position) * attention(q, k_s, v_s)."""
        height, width = latent
        self.weights.check_latent(height, width)
        grid = _grid(q.shape[1], height, width)
        if grid is None:
            raise CoupleError(f"attention couple: {q.shape[1]} image tokens fit no level of a "
                              f"{height}x{width} latent; the couple knows SD1.5 and SDXL UNets only.")
        acc = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], device=q.device, dtype=q.dtype)
        for s, ((start, stop), live) in enumerate(zip(self.segments.ranges, self.weights.live(*grid),
                                                      strict=True)):
            if not live:
                continue
            ws = self.weights.subset(s, *grid, q.device, q.dtype)  # [tokens, 1] or where it is > 0
            if isinstance(ws, TokenSubset):  # only the queries the prompt reaches
                if not ws.index.numel():
                    continue  # its weight rounds to 0 in this dtype
                part = attention.optimized_attention(q.index_select(1, ws.index), k[:, start:stop],
                                                     v[:, start:stop], heads, attn_precision=precision)
                acc.index_add_(1, ws.index, part * ws.values)
            else:
                part = attention.optimized_attention(q, k[:, start:stop], v[:, start:stop], heads,
                                                     attn_precision=precision)
                acc.addcmul_(part, ws)
        return acc


class CoupleTokenWeights(RegionTokenWeights):
    """A UNet's region hooks weighted by the region's weight (text modules: on its own prompt's tokens)."""

    def __init__(self, weights: CoupleWeights, segments: Segments, region_refs: dict[Any, int],
                 text_modules: weakref.WeakSet) -> None:
        super().__init__(weights, segments, region_refs)
        self.text_modules = text_modules

    def module_key(self, module: torch.nn.Module) -> bool:
        return module in self.text_modules

    def weigher(self, x: torch.Tensor) -> Callable[[int, bool, torch.Tensor], torch.Tensor | TokenSubset]:
        height, width = x.shape[-2:]
        return lambda s, text, y: self._weight(s, text, y, height, width)

    def _weight(self, s: int, text: bool, y: torch.Tensor, height: int,
                width: int) -> torch.Tensor | TokenSubset:
        if y.ndim == 4:  # a convolution's output [B, C, h, w]
            return self.weights.subset(s, *y.shape[-2:], y.device, y.dtype, positions=True)
        if y.ndim == 3 and text and y.shape[1] % self.segments.total == 0:
            start, stop = self.segments.ranges[s]
            mask = torch.zeros(self.segments.total)
            mask[start:stop] = 1.0
            return TokenSubset.of(mask.repeat(y.shape[1] // self.segments.total).unsqueeze(-1), y.device,
                                  y.dtype)
        grid = _grid(y.shape[1], height, width) if y.ndim == 3 else None
        if grid is not None:
            return self.weights.subset(s, *grid, y.device, y.dtype)
        return self.weights.weights[s].mean().to(y.device, y.dtype)  # no tokens: the region's share


def _context(cond: list, what: str) -> tuple[torch.Tensor, dict]:
    if not cond:
        raise CoupleError(f"{what} is an empty CONDITIONING: connect a text encoder's output.")
    tokens, extra = cond[0]
    if tokens.ndim != 3 or tokens.shape[0] != 1:
        raise CoupleError(f"{what} has a batch of {tokens.shape[0]} prompts; the couple takes one "
                          f"prompt each.")
    return tokens, extra


def _pooled(extras: Sequence[dict], areas: Sequence[float]) -> torch.Tensor | None:
    pooled = [e.get("pooled_output") for e in extras]
    if any(p is None for p in pooled):
        return None
    return sum((p * a for p, a in zip(pooled, areas, strict=True)), torch.zeros_like(pooled[0]))


def _layout(tokens: Sequence[torch.Tensor], drop_base: bool) -> tuple[Segments, torch.Tensor]:
    """The couple's segments and full context [base | region 1 | ...]. ``drop_base`` (UNets whose regions
    cover every position, so the base prompt is attended nowhere): the base's segment is empty and its
    tokens stay out of the context, so each block projects fewer keys and values."""
    lengths = [0 if i == 0 and drop_base else t.shape[1] for i, t in enumerate(tokens)]
    stops = torch.tensor(lengths).cumsum(0).tolist()
    full = torch.cat([t for t, n in zip(tokens, lengths, strict=True) if n], dim=1)
    return Segments(tuple(zip([0, *stops[:-1]], stops, strict=True)), stops[-1]), full


def attention_couple(model: ModelPatcher, base: list, regions: Sequence[CoupleRegion],
                     feather_px: int = 0) -> tuple[ModelPatcher, list]:
    """(MODEL, positive CONDITIONING) of an attention couple: ``base`` where no region is, each region's
    prompt inside its mask, its hooks (LoRA) weighted by its mask. ``model`` is cloned, never changed.

    Masks are MASKs ([H, W] or [1, H, W], 0..1) at the image's or the latent's size. Nothing passed in is
    changed. On a UNet::

        attn2 (the couple's rows): out = sum_s w_s(pos) * attention(q, k_s, v_s) over the
            segments s, w_s area-averaged to the block's grid, each attention on the queries where w_s > 0
            only; other rows attend as usual
        region LoRA r: y[t] += s_r * w_r(t) * delta(x)[t] on image tokens (convs: at their output grid);
            on attn2.to_k/to_v (text tokens) only on r's own segment; elsewhere (time embedding) the area
            mean; the delta is computed on the tokens where w_r > 0 only (hooks/lowrank.py TokenSubset)

    DiT joint attention (Flux.1, Flux.2, SD3): hooks/couple_dit.py, an attention mask instead of attn2.
    """
    weights = CoupleWeights(couple_weights([r.mask for r in regions], feather_px))
    parts = [_context(base, "the base prompt"), *(_context(r.cond, f"region {i}'s prompt")
                                                  for i, r in enumerate(regions, 1))]
    if len({t.shape[-1] for t, _ in parts}) > 1:
        raise CoupleError("the prompts come from different text encoders (token widths "
                          f"{[t.shape[-1] for t, _ in parts]}): encode them all with the model's CLIP.")
    parts = [(couple_dit.as_model_pads(model, t), e) for t, e in parts]
    joint = couple_dit.is_joint(model.get_model_object("diffusion_model"))
    unused_base = not joint and float(weights.weights[0].max()) <= 0
    segments, full = _layout([t for t, _ in parts], drop_base=unused_base)
    extra = dict(parts[0][1])
    areas = [float(w.mean()) for w in weights.weights]
    pooled = _pooled([e for _, e in parts], areas)
    if pooled is not None:
        extra["pooled_output"] = pooled
    hooks = [r.hooks for r in regions if r.hooks is not None and r.hooks.hooks]
    extra.pop("hooks", None)
    if hooks:
        extra["hooks"] = combine(*hooks)
    refs = {h.hook_ref: i for i, r in enumerate(regions, 1) if r.hooks is not None for h in r.hooks.hooks}
    clone = enable_hook_engine(model)
    if joint:
        couple_dit.patch_joint(clone, weights, segments, refs)
        return clone, [[full, extra]]
    # UNets: the cond carries the base prompt's tokens (core batches it with the negative); the full
    # context is swapped in per attention block by CoupleContext
    _patch_unet(clone, weights, segments, refs, CoupleContext(parts[0][0], full, segments))
    return clone, [[parts[0][0], extra]]


def _patch_unet(clone: ModelPatcher, weights: CoupleWeights, segments: Segments, refs: dict,
                context: CoupleContext) -> None:
    unet = clone.get_model_object("diffusion_model")
    if not hasattr(unet, "input_blocks"):
        raise CoupleError(f"attention couple runs on SD1.5/SDXL UNets and Flux.1/Flux.2/SD3 DiTs; this "
                          f"model's {type(unet).__name__} is none of them: use Regional LoRA for it.")
    patch = CoupleAttention(weights, segments)
    clone.set_model_attn2_patch(context)
    for name in _BLOCKS:
        count = 1 if name == "middle" else len(getattr(unet, f"{name}_blocks", ()))
        for number in range(count):
            clone.set_model_attn2_replace(patch, name, number)
    text = weakref.WeakSet(m for n, m in unet.named_modules() if n.endswith(_TEXT_MODULES))
    options = clone.model_options.setdefault("transformer_options", {})
    options[TOKEN_WEIGHTS_KEY] = CoupleTokenWeights(weights, segments, refs, text)
