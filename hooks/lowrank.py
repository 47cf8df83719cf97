"""Forward-pass deltas for one module: low-rank (LoRA/LoCon) and dense (everything else).

Pure torch. One ``ModuleDeltas`` per targeted Linear/Conv module holds every hook's contribution::

    low-rank hook h with down A_h (r_h, in[, kh, kw]) and up B_h (out, r_h), scale alpha_h / r_h
    forward:  y += ((x (*) A_h) * S[:, h] * scale_h) (*) B_h     S: (batch, H) per-row hook strengths
    dense hooks (LoHa, LoKr, DoRA, model-as-LoRA, LoCon with a mid weight, bias diffs):
              y += S[:, h] * (x (*) D_h)                          D_h materialised by the caller

``(*)`` is ``F.linear`` for Linear modules and the module's own convolution for Conv modules (the
down projection takes the module's stride/padding/dilation, the up projection is 1x1), which is
the same function LoraLoader bakes into the weight: W' = W + s * (B @ A) * alpha / r.
Rows whose strength is zero contribute zero; hooks not active in a call are skipped. A and B are
used as loaded (no concatenated or pre-scaled copies) and cast per call when only the dtype differs,
so the engine holds nothing beyond the LoRA file's own tensors on the CPU; a copy is kept only on
another compute device (a GPU), where it must live anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["DenseDelta", "LowRankDelta", "ModuleDeltas", "module_kind"]

_CONV = {torch.nn.Conv1d: 1, torch.nn.Conv2d: 2, torch.nn.Conv3d: 3}


def module_kind(module: torch.nn.Module) -> str | None:
    """"linear", "conv1d"/"conv2d"/"conv3d", "group_norm", "layer_norm", "rms_norm" or None.

    Norms are affine in their weight and bias, so their deltas are forward deltas too:
    norm(x; w + dw, b + db) = norm(x; w, b) + norm(x; dw, 0) + db.
    """
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if isinstance(module, torch.nn.GroupNorm):
        return "group_norm"
    if isinstance(module, torch.nn.LayerNorm):
        return "layer_norm"
    if isinstance(module, torch.nn.RMSNorm) or (type(module).__name__ == "RMSNorm"
                                               and isinstance(getattr(module, "scale", None), torch.Tensor)):
        return "rms_norm"  # torch's (weight) or ComfyUI's Flux/SD3 RMSNorm (scale, eps 1e-6)
    for cls, dims in _CONV.items():
        if isinstance(module, cls) and module.padding_mode == "zeros":
            return f"conv{dims}d"
    return None


@dataclass(frozen=True)
class LowRankDelta:
    """``scale * up @ down`` for one hook on one weight: down (r, in[, k...]), up (out, r[, 1...])."""

    hook: int
    down: torch.Tensor
    up: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass(frozen=True)
class DenseDelta:
    """A materialised delta of one hook on a module's weight (``bias=False``) or bias (``bias=True``).

    ``fetch(device, dtype, strength)`` returns the delta (from the engine's byte-budgeted cache, so
    it may be rebuilt after an eviction). A ``linear`` delta is fetched at strength 1 and scaled per
    row; a non-linear one (DoRA, custom functions) is fetched once per distinct strength.
    """

    hook: int
    fetch: Callable[[torch.device, torch.dtype, float], torch.Tensor]
    bias: bool = False
    linear: bool = True


@dataclass
class ModuleDeltas:
    """Every hook's delta on one module, concatenated for one extra matmul pair per forward."""

    kind: str
    weight_shape: tuple[int, ...]
    low_rank: list[LowRankDelta] = field(default_factory=list)
    dense: list[DenseDelta] = field(default_factory=list)
    _device_copies: dict = field(default_factory=dict, repr=False)

    def hooks(self) -> set[int]:
        return {d.hook for d in self.low_rank} | {d.hook for d in self.dense}

    def _cast(self, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``t`` on the compute device and dtype. On its own device a dtype change is cast per call
        (low-rank factors are small; no second copy is kept); a copy on another device (a GPU) is kept."""
        if t.device == device:
            return t if t.dtype == dtype else t.to(dtype)
        key = (id(t), device, dtype)
        if key not in self._device_copies:
            self._device_copies[key] = t.to(device=device, dtype=dtype)
        return self._device_copies[key]

    def apply(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, strengths: torch.Tensor,
              host: Sequence[Sequence[float]], active: set[int]) -> torch.Tensor:
        """``y`` plus every active hook's delta.

        strengths: (chunks, hooks) on y's device; host: the same values as Python floats.
        """
        rows = _rows_view(strengths, x.shape[0])
        for d in self.low_rank:
            if d.hook not in active:
                continue
            down = self._cast(d.down, x.device, x.dtype).reshape(d.rank, *self.weight_shape[1:])
            up = self._cast(d.up, x.device, x.dtype).reshape(self.weight_shape[0], d.rank,
                                                               *([1] * (len(self.weight_shape) - 2)))
            h = self._op(module, x, down, spatial=True)
            s = (rows[:, d.hook] * d.scale).to(h.dtype)
            h = h * (s.reshape(-1, *([1] * (h.ndim - 1))))
            y = y + self._op(module, h, up, spatial=False)
        for d in self.dense:
            if d.hook not in active:
                continue
            if d.linear:
                y = y + self._dense(module, x, y, d, 1.0, rows[:, d.hook])
                continue
            for value in sorted({chunk[d.hook] for chunk in host} - {0.0}):
                mask = torch.tensor([float(chunk[d.hook] == value) for chunk in host], device=y.device)
                y = y + self._dense(module, x, y, d, value, _rows_view(mask[:, None], x.shape[0])[:, 0])
        return y

    def _dense(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, d: DenseDelta,
               strength: float, row_scale: torch.Tensor) -> torch.Tensor:
        s = row_scale.to(y.dtype).reshape(-1, *([1] * (y.ndim - 1)))
        delta = d.fetch(x.device, x.dtype, strength)
        if d.bias:
            if self.kind in ("layer_norm", "rms_norm"):
                return s * delta
            shape = [1] * y.ndim
            shape[-1 if self.kind == "linear" else 1] = -1
            return s * delta.reshape(shape)
        return s * self._op(module, x, delta, spatial=True)

    def _op(self, module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
            spatial: bool) -> torch.Tensor:
        if self.kind == "linear":
            return F.linear(x, weight)
        if self.kind == "group_norm":
            return F.group_norm(x, module.num_groups, weight, None, module.eps)
        if self.kind == "layer_norm":
            return F.layer_norm(x, module.normalized_shape, weight, None, module.eps)
        if self.kind == "rms_norm":
            return F.rms_norm(x, weight.shape, weight, getattr(module, "eps", None) or 1e-6)
        conv = {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d}[self.kind]
        if spatial:
            return conv(x, weight, None, module.stride, module.padding, module.dilation, module.groups)
        return conv(x, weight)


def _rows_view(strengths: torch.Tensor, batch: int) -> torch.Tensor:
    """Per-call strengths (chunks, hooks) spread over a module's batch dimension (rows per chunk)."""
    chunks = strengths.shape[0]
    if batch == chunks:
        return strengths
    if batch % chunks:
        raise ValueError(f"a hooked module saw a batch of {batch} rows for {chunks} cond chunks; "
                         "this model reshapes its batch in a way the hook engine cannot follow")
    return strengths.repeat_interleave(batch // chunks, dim=0)
