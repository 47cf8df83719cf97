"""The regions of an attention couple, shared by its UNet path (hooks/couple.py) and its DiT path
(hooks/couple_dit.py): the per-position weights of the regions and the base prompt, resized per grid, the
prompts' token ranges in the couple's context, and the base of the per-token weights of the regions' LoRAs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .lowrank import TokenSubset
from .regions import feather

__all__ = ["MAX_REGIONS", "CoupleError", "CoupleWeights", "RegionTokenWeights", "Segments", "couple_weights",
           "region_mask"]

MAX_REGIONS = 8


class CoupleError(ValueError):
    """Bad regions for an attention couple; the message names the value and the fix."""


def couple_weights(masks: Sequence[torch.Tensor], feather_px: int = 0) -> torch.Tensor:
    """[1 + R, H, W] weights summing to 1 at every position: the base first, then the regions.

    Each mask is feathered; where masks sum to more than 1 they share the position in proportion,
    where they sum to less the base prompt takes the rest.
    """
    if not masks:
        raise CoupleError("no region: connect at least one region's prompt and mask.")
    if len(masks) > MAX_REGIONS:
        raise CoupleError(f"{len(masks)} regions, at most {MAX_REGIONS}: merge regions that share a "
                          f"prompt into one mask.")
    sized = [feather(region_mask(mask, i).float(), feather_px)[0] for i, mask in enumerate(masks, 1)]
    shapes = sorted({tuple(m.shape) for m in sized})
    if len(shapes) > 1:
        raise CoupleError(f"region masks differ in size {shapes}; make them one size (the image's or "
                          f"the latent's).")
    stacked = torch.stack(sized).clamp(0.0, 1.0)
    total = stacked.sum(0)
    regions = stacked / total.clamp(min=1.0)
    return torch.cat([(1.0 - total.clamp(max=1.0)).unsqueeze(0), regions])


def region_mask(mask: torch.Tensor, number: int) -> torch.Tensor:
    """Region ``number``'s MASK as [1, H, W]; refuses a batch of masks and an empty mask."""
    m = mask.unsqueeze(0) if mask.ndim == 2 else mask
    if m.ndim != 3 or m.shape[0] != 1:
        raise CoupleError(f"region {number}'s mask has shape {tuple(mask.shape)}; a region takes one mask "
                          f"[H, W] or [1, H, W]: pick one mask of the batch.")
    if float(m.max()) <= 0:
        raise CoupleError(f"region {number}'s mask is empty (all 0): draw the region, or disconnect it.")
    return m


class CoupleWeights:
    """The weights resized per grid (area averaging), cached per (h, w, device, dtype)."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights  # [S, Hm, Wm], S = 1 + regions
        self._cache: dict[tuple, torch.Tensor] = {}
        self._live: dict[tuple[int, int], tuple[bool, ...]] = {}
        self._subsets: dict[tuple, torch.Tensor | TokenSubset] = {}

    def live(self, h: int, w: int) -> tuple[bool, ...]:
        """Per segment: whether its weight is above 0 anywhere on the (h, w) grid (on the CPU: no sync)."""
        if (h, w) not in self._live:
            pooled = F.adaptive_avg_pool2d(self.weights.unsqueeze(0), (h, w))[0]
            self._live[(h, w)] = tuple(bool(p.max() > 0) for p in pooled)
        return self._live[(h, w)]

    def at(self, h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[S, h, w]."""
        key = (h, w, device, dtype)
        if key not in self._cache:
            pooled = F.adaptive_avg_pool2d(self.weights.unsqueeze(0), (h, w))[0]
            self._cache[key] = pooled.to(device, dtype)
        return self._cache[key]

    def subset(self, s: int, h: int, w: int, device: torch.device, dtype: torch.dtype,
               positions: bool = False) -> torch.Tensor | TokenSubset:
        """Segment s's weight on the (h, w) grid for a LoRA: [h, w] (``positions``) or [h * w, 1], as a
        ``TokenSubset`` where it is 0 on some token (the delta is then computed where it is not)."""
        key = (s, h, w, device, dtype, positions)
        if key not in self._subsets:
            cpu = self.at(h, w, torch.device("cpu"), torch.float32)[s]
            self._subsets[key] = TokenSubset.of(cpu if positions else cpu.reshape(-1, 1), device, dtype,
                                                positions)
        return self._subsets[key]

    def check_latent(self, height: int, width: int) -> None:
        """A mask of another aspect than the latent's cannot be placed on it."""
        mh, mw = self.weights.shape[-2:]
        if abs(mh / height - mw / width) > 0.02 * max(mh / height, mw / width):
            raise CoupleError(f"region masks are {mh}x{mw} (HxW) but the latent is {height}x{width} "
                              f"({height * 8}x{width * 8} pixels): make the masks the image's size or "
                              f"the latent's.")


@dataclass(frozen=True)
class Segments:
    """Token ranges of the prompts in the couple's context: [(start, stop)] base first; ``total`` tokens."""

    ranges: tuple[tuple[int, int], ...]
    total: int


class RegionTokenWeights:
    """transformer_options[TOKEN_WEIGHTS_KEY] (hooks/engine.py): each region's hooks weighted per token.

    The engine asks ``for_call`` once per model call; the weight of region s on one module's output is
    cached per (s, ``module_key(module)``, output shape, device, dtype). Subclasses give ``module_key``
    and ``weigher`` (UNets: CoupleTokenWeights; DiTs: hooks/couple_dit.py JointTokenWeights).
    """

    def __init__(self, weights: CoupleWeights, segments: Segments, region_refs: dict[Any, int]) -> None:
        self.weights = weights
        self.segments = segments
        self.region_refs = region_refs  # hook_ref -> segment (1..R)

    def __deepcopy__(self, memo: dict) -> RegionTokenWeights:
        return self  # shared by clones: it holds hook refs and modules, which must stay themselves

    def module_key(self, module: torch.nn.Module) -> Any:
        """What, besides the output's shape, a module's weight depends on."""
        raise NotImplementedError

    def weigher(self, x: torch.Tensor) -> Callable[[int, Any, torch.Tensor], torch.Tensor | TokenSubset]:
        """(segment, module_key, output) -> the weight, for a model call on latent ``x``."""
        raise NotImplementedError

    def for_call(self, index: dict, x: torch.Tensor) -> Callable | None:
        """(hook index, module, output) -> weight or None for this model call (None: no region hook)."""
        segment_of = {i: self.region_refs[ref] for ref, i in index.items() if ref in self.region_refs}
        if not segment_of:
            return None
        self.weights.check_latent(*x.shape[-2:])
        weight = self.weigher(x)
        cache: dict[tuple, torch.Tensor | TokenSubset] = {}

        def weigh(hook: int, module: torch.nn.Module, y: torch.Tensor) -> torch.Tensor | TokenSubset | None:
            s = segment_of.get(hook)
            if s is None:
                return None
            key = (s, self.module_key(module), tuple(y.shape[1:]), y.device, y.dtype)
            if key not in cache:
                cache[key] = weight(s, key[1], y)
            return cache[key]
        return weigh
