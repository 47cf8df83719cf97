"""Forward-pass deltas for one module, low-rank (LoRA/LoCon) and dense (everything else), added to the
module's output on the rows that carry each hook: the math of the hook engine. Pure torch. Where it sits
in the hook path: docs/architecture.md; why it is built this way: docs/design-hook-engine.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_ROWS", "DenseDelta", "LowRankDelta", "ModuleDeltas", "RowFactors", "RowStrengths",
           "TokenSubset", "TokenWeights", "chunk_rows", "module_kind"]

_CONV = {torch.nn.Conv1d: 1, torch.nn.Conv2d: 2, torch.nn.Conv3d: 3}
_CONV_FN = {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d}

Run = tuple[int, int, float]  # chunks [start, stop) sharing one nonzero strength
# (hook, module, output) -> a weight broadcasting against the output's rows (None: weight 1 everywhere)
TokenWeights = Callable[[int, torch.nn.Module, torch.Tensor], "torch.Tensor | TokenSubset | None"]
# An input tensor's attribute: the first row of each cond chunk and the end, (0, ..., rows), where a
# chunk's rows are not an equal share of the batch (hooks/couple.py packs the attention couple's text
# that way: each prompt's tokens as rows of their own, so no row is tiled to the longest context)
CHUNK_ROWS = "patchbay_chunk_rows"


def chunk_rows(x: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """``x`` marked with its chunks' row bounds (``CHUNK_ROWS``) for the modules it goes into."""
    setattr(x, CHUNK_ROWS, tuple(bounds))
    return x


@dataclass(frozen=True)
class TokenSubset:
    """A per-token weight that is 0 on some tokens: ``dense`` as a plain weight (broadcasting against
    the output's rows), ``index`` the tokens where it is not 0 and ``values`` its weights there.

    Tokens are dim 1 of a [B, T, C] output (``dense`` [T, 1], ``values`` [n, 1]) or the flattened
    positions of a [B, C, h, w] convolution's (``dense`` [h, w], ``values`` [n]). A low-rank delta
    is then computed on those tokens only; elsewhere the output is left as it is (bit for bit).
    """

    dense: torch.Tensor
    index: torch.Tensor
    values: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor, device: torch.device, dtype: torch.dtype,
           positions: bool = False) -> torch.Tensor | TokenSubset:
        """``weight`` (on the CPU, so finding its tokens costs no device sync) on ``device`` in ``dtype``:
        a subset where it is 0 on some token, else the tensor itself."""
        flat = weight.to(dtype).flatten()
        index = flat.nonzero().flatten()
        dense = weight.to(device, dtype)
        if index.numel() == flat.numel():
            return dense
        values = flat[index].to(device)
        return cls(dense, index.to(device), values if positions else values.unsqueeze(-1))


def module_kind(module: torch.nn.Module) -> str | None:
    """"linear", "conv1d"/"conv2d"/"conv3d", "group_norm", "layer_norm", "rms_norm" or None.

    Norms are affine in their weight and bias, so their deltas are forward deltas too:
    norm(x; w + dw, b + db) = norm(x; w, b) + norm(x; dw, 0) + db.
    """
    if isinstance(module, torch.nn.Linear) or _is_linear_op(module):
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


def _is_linear_op(module: torch.nn.Module) -> bool:
    """ComfyUI's mixed-precision Linear (comfy/ops.py ``mixed_precision_ops``, the layers of its fp8 and
    nvfp4 models): a plain Module with Linear's attributes and function, not a ``torch.nn.Linear``."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Linear" and isinstance(getattr(module, "in_features", None), int)
            and isinstance(weight, torch.Tensor) and weight.ndim == 2)


class RowStrengths:
    """One model call's hook strengths: ``host[chunk][hook]``, as runs of chunks per active hook."""

    __slots__ = ("chunks", "runs", "weights")

    def __init__(self, host: Sequence[Sequence[float]], weights: TokenWeights | None = None) -> None:
        self.chunks = len(host)
        self.weights = weights  # per-token weights of some hooks (hooks/couple.py), None: every token 1
        self.runs: dict[int, tuple[Run, ...]] = {}
        for hook in range(len(host[0]) if host else 0):
            runs: list[Run] = []
            for chunk, row in enumerate(host):
                value = float(row[hook])
                if value == 0.0:
                    continue
                if runs and runs[-1][1] == chunk and runs[-1][2] == value:
                    runs[-1] = (runs[-1][0], chunk + 1, value)
                else:
                    runs.append((chunk, chunk + 1, value))
            if runs:
                self.runs[hook] = tuple(runs)


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
class RowFactors:
    """A module's low-rank deltas side by side, R = the sum of their ranks (``ModuleDeltas.add_rows``).

    down (R, in[, k...]); up (R, out) for a Linear, (out, R, 1...) for a Conv; hook (R,): the hook
    index of each rank; scale (R,): its delta's alpha / rank.
    """

    down: torch.Tensor
    up: torch.Tensor
    hook: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class DenseDelta:
    """A materialised delta of one hook on a module's weight (``bias=False``) or bias (``bias=True``).

    ``fetch(device, dtype, strength)`` returns the delta (from the engine's byte-budgeted cache, so
    it may be rebuilt after an eviction). A ``linear`` delta is fetched at strength 1 and scaled by
    the strength; a non-linear one (DoRA, custom functions) is fetched once per distinct strength.
    A ``replace`` delta (a weight's, fetched in fp32) is not added to the output: the rows that carry
    its hook are recomputed with the module's weight plus the delta, so they see exactly that weight.
    Where two replacing hooks share rows, the later one is added as an ordinary delta.
    """

    hook: int
    fetch: Callable[[torch.device, torch.dtype, float], torch.Tensor]
    bias: bool = False
    linear: bool = True
    replace: bool = False


@dataclass
class ModuleDeltas:
    """Every hook's delta on one module (one per targeted Linear/Conv/Norm module)::

        low-rank hook h with down A_h (r_h, in[, kh, kw]) and up B_h (out, r_h), scale alpha_h / r_h
        forward:  y[rows] += s * scale_h * ((x[rows] (*) A_h) (*) B_h)   rows: a run where h has strength s
                  (times a per-token weight w_h(t) where the call gives h one: ``RowStrengths.weights``;
                  a ``TokenSubset`` weight: x and y only at the tokens where w_h > 0, gathered, added back)
        dense hooks (LoHa, LoKr, DoRA, model-as-LoRA, LoCon with a mid weight, bias diffs):
                  y[rows] += s * (x[rows] (*) D_h)                         D_h materialised by the caller
        replacing dense hooks (weights rounded like LoraLoader, D_h = round(W + dW(s)) - W in fp32):
                  y[rows] = module(x[rows]) with its weight W + D_h        recomputed before any addition

    ``(*)`` is ``F.linear`` for Linear modules and the module's own convolution for Conv modules (the
    down projection takes the module's stride/padding/dilation, the up projection is 1x1), which is
    the same function LoraLoader bakes into the weight: W' = W + s * (B @ A) * alpha / r.

    Rows: a model call's batch is made of cond chunks (``RowStrengths``: one row of hook strengths per
    chunk). Each hook's strengths are turned once per call into runs of consecutive chunks with one
    nonzero strength, so a delta is computed only on the rows that carry its hook, with the strength
    as a scalar (no per-row multiply), and added in place (one fused ``addmm_`` for Linear modules).
    A and B are used as loaded (no concatenated or pre-scaled copies) and cast per call when only the
    dtype differs, so the engine holds nothing beyond the LoRA file's own tensors on the CPU; a copy is
    kept only on another compute device (a GPU), where it must live anyway.
    """

    kind: str
    weight_shape: tuple[int, ...]
    low_rank: list[LowRankDelta] = field(default_factory=list)
    dense: list[DenseDelta] = field(default_factory=list)
    _views: dict = field(default_factory=dict, repr=False)

    def apply(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              strengths: RowStrengths) -> torch.Tensor:
        """``y`` plus every active hook's delta on the rows that carry it (in place where autograd allows)."""
        runs = strengths.runs
        if not any(d.hook in runs for d in (*self.low_rank, *self.dense)):
            return y  # none of this module's hooks is active in this call
        bounds, packed = _chunk_bounds(x, strengths.chunks)
        y = _writable(y)
        replaced = [False] * strengths.chunks
        weigh = strengths.weights or _unweighted
        for d in self.dense:
            if d.replace:
                if weigh(d.hook, module, y) is not None:
                    raise ValueError("a hook with per-token weights (an Attention Couple region's LoRA) "
                                     "cannot use rounding 'loraloader'; use rounding 'compute'.")
                for start, stop, value in runs.get(d.hook, ()):
                    self._replace(module, d.fetch(x.device, torch.float32, value), x, y, start, stop,
                                  bounds, replaced)
        for d in self.low_rank:
            for start, stop, value in runs.get(d.hook, ()):
                xs, ys = _rows(x, y, bounds[start], bounds[stop], packed)
                weight = weigh(d.hook, module, ys if packed else y)
                self._add_low_rank(module, d, xs, ys, value * d.scale, weight)
        for d in self.dense:
            if d.replace:
                continue
            fetched: dict[float, torch.Tensor] = {}
            for start, stop, value in runs.get(d.hook, ()):
                xs, ys = _rows(x, y, bounds[start], bounds[stop], packed)
                strength, alpha = (1.0, value) if d.linear else (value, 1.0)
                if strength not in fetched:
                    fetched[strength] = d.fetch(x.device, x.dtype, strength)
                self._add_dense(module, d, fetched[strength], xs, ys, alpha,
                                _dense(weigh(d.hook, module, ys if packed else y)))
        return y

    def _add_low_rank(self, module: torch.nn.Module, d: LowRankDelta, x: torch.Tensor, y: torch.Tensor,
                      alpha: float, weight: torch.Tensor | TokenSubset | None = None) -> None:
        down, up = self._factors(d, x.device, x.dtype)
        if isinstance(weight, TokenSubset):
            if self._add_subset(module, down, up, x, y, alpha, weight):
                return
            weight = weight.dense
        h = self._op(module, x, down, spatial=True)
        if weight is not None:  # the delta per token times its weight: weigh h (rank wide), not h B^T
            h = h * weight.to(h.dtype)
        if self.kind == "linear" and y.dtype == h.dtype and y.is_contiguous():
            flat = y.view(-1, y.shape[-1])
            flat.addmm_(h.reshape(-1, h.shape[-1]), up, alpha=alpha)
        elif self.kind == "linear":
            y.add_(h @ up, alpha=alpha)
        else:
            y.add_(self._op(module, h, up, spatial=False), alpha=alpha)

    def _add_subset(self, module: torch.nn.Module, down: torch.Tensor, up: torch.Tensor, x: torch.Tensor,
                    y: torch.Tensor, alpha: float, subset: TokenSubset) -> bool:
        """The low-rank delta on the subset's tokens only: gathered from x, weighted, added back into y
        (``index_add_``). False where the module's shapes do not allow it (the caller goes dense)."""
        if subset.index.numel() == 0:
            return True  # weight 0 on every token: nothing to add
        if self.kind == "linear" and x.ndim == 3 and subset.values.ndim == 2 \
                and y.shape[1] == subset.dense.shape[0]:
            h = F.linear(x.index_select(1, subset.index), down) * subset.values.to(x.dtype)
            y.index_add_(1, subset.index, (h @ up).to(y.dtype), alpha=alpha)
            return True
        if self.kind == "conv2d" and _pointwise(module) and module.groups == 1 and x.ndim == 4 \
                and subset.values.ndim == 1 and y.is_contiguous() and x.shape[-2:] == y.shape[-2:]:
            h = down.flatten(1) @ x.flatten(2).index_select(2, subset.index)  # (rows, r, n)
            out = up.flatten(1) @ (h * subset.values.to(x.dtype))
            y.view(*y.shape[:2], -1).index_add_(2, subset.index, out.to(y.dtype), alpha=alpha)
            return True
        return False

    def _factors(self, d: LowRankDelta, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(down, up) shaped for ``_op``, Linear's up transposed for ``addmm_``; the views are made once.

        On the factors' own device they are views of the loaded tensors, cast per call when only the
        dtype differs (low-rank factors are small; no second copy is kept). On another device (a GPU)
        a copy in the compute dtype is kept, where it must live anyway.
        """
        key = (id(d), device, dtype)
        views = self._views.get(key)
        if views is None:
            stored = d.down.dtype if d.down.device == device else dtype
            down = d.down.to(device, stored).reshape(d.rank, *self.weight_shape[1:])
            up = d.up.to(device, stored)
            if self.kind == "linear":
                up = up.reshape(self.weight_shape[0], d.rank).t()
            else:
                up = up.reshape(self.weight_shape[0], d.rank, *([1] * (len(self.weight_shape) - 2)))
            views = self._views[key] = (down, up)
        down, up = views
        if down.dtype != dtype:
            return down.to(dtype), up.to(dtype)
        return down, up

    def row_factors(self, device: torch.device, dtype: torch.dtype) -> RowFactors | None:
        """Every low-rank delta of this module side by side on ``device`` in ``dtype``, for ``add_rows``."""
        if not self.low_rank:
            return None
        pairs = [self._factors(d, device, dtype) for d in self.low_rank]
        hooks = [d.hook for d in self.low_rank for _ in range(d.rank)]
        scales = [d.scale for d in self.low_rank for _ in range(d.rank)]
        return RowFactors(torch.cat([down for down, _ in pairs]),
                          torch.cat([up for _, up in pairs], 0 if self.kind == "linear" else 1),
                          torch.tensor(hooks, device=device), torch.tensor(scales, device=device))

    def add_rows(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                 factors: RowFactors) -> torch.Tensor:
        """``y`` plus every low-rank delta on every row, scaled by its chunk's strength of the delta's hook.

        Compiled form (for hooks/compiled.py): no branch on strengths, every row computed::

            RowFactors: every low-rank delta of the module side by side, R = the sum of their ranks
            y + ((x (*) down_R) * (rows[chunk, hook_of_rank] * scale_of_rank)) (*) up_R

        ``rows``: a tensor (chunks, hooks); a chunk without a hook has strength 0 for it. Two products
        for all the hooks together, out of place, no Python branch on a strength or a rank: one
        compiled graph serves every strength, keyframe and set of LoRAs on the same modules (but a
        new summed rank on a convolution with a kernel larger than 1x1, whose channels compile fixed).
        """
        per_chunk = _rows_per_chunk(x.shape[0], rows.shape[0])
        per_rank = (rows[:, factors.hook] * factors.scale).to(x.dtype).repeat_interleave(per_chunk, dim=0)
        down, up = factors.down.to(x.dtype), factors.up.to(x.dtype)
        if self.kind == "linear":  # h (batch, ..., R)
            h = F.linear(x, down)
            return y + (h * per_rank.view(per_rank.shape[0], *([1] * (h.ndim - 2)), -1)) @ up
        # convolutions as matmuls over the channels, so R stays a dynamic size where the down
        # projection is pointwise (a compiled convolution fixes its channel counts)
        if _pointwise(module):
            h = down.flatten(1) @ x.flatten(2)  # (batch, R, positions)
        else:
            h = self._op(module, x, down, spatial=True).flatten(2)
        return y + (up.flatten(1) @ (h * per_rank.unsqueeze(-1))).view(y.shape)

    def _replace(self, module: torch.nn.Module, delta: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                 start: int, stop: int, bounds: Sequence[int], replaced: list[bool]) -> None:
        """Chunks [start, stop) recomputed with weight W + delta, each stretch of chunks not replaced
        before in one call; chunks another hook replaced already get the delta added instead."""
        chunk = start
        while chunk < stop:
            end = chunk + 1
            while end < stop and replaced[end] == replaced[chunk]:
                end += 1
            a, b = bounds[chunk], bounds[end]
            if replaced[chunk]:
                y[a:b].add_(self._op(module, x[a:b], delta.to(x.dtype), spatial=True))
            else:
                weight = (_weight(module).to(x.device, torch.float32) + delta).to(x.dtype)
                bias = getattr(module, "bias", None)
                bias = None if bias is None else bias.to(x.device, x.dtype)
                y[a:b] = self._op(module, x[a:b], weight, spatial=True, bias=bias)
                replaced[chunk:end] = [True] * (end - chunk)
            chunk = end

    def _add_dense(self, module: torch.nn.Module, d: DenseDelta, delta: torch.Tensor, x: torch.Tensor,
                   y: torch.Tensor, alpha: float, weight: torch.Tensor | None = None) -> None:
        if not d.bias:
            out = self._op(module, x, delta, spatial=True)
        elif self.kind in ("layer_norm", "rms_norm", "linear"):
            out = delta  # broadcast over the last dimension
        else:
            out = delta.reshape(-1, *([1] * (y.ndim - 2)))  # channels first
        y.add_(out if weight is None else out * weight, alpha=alpha)

    def _op(self, module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, spatial: bool,
            bias: torch.Tensor | None = None) -> torch.Tensor:
        """The module's function with ``weight`` (and ``bias``); ``spatial=False``: a plain 1x1 conv."""
        if self.kind == "linear":
            return F.linear(x, weight, bias)
        if self.kind == "group_norm":
            return F.group_norm(x, module.num_groups, weight, bias, module.eps)
        if self.kind == "layer_norm":
            return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)
        if self.kind == "rms_norm":
            return F.rms_norm(x, weight.shape, weight, getattr(module, "eps", None) or 1e-6)
        if spatial:
            return _CONV_FN[self.kind](x, weight, bias, module.stride, module.padding, module.dilation,
                                       module.groups)
        return _CONV_FN[self.kind](x, weight, bias)


def _unweighted(hook: int, module: torch.nn.Module, y: torch.Tensor) -> None:
    return None


def _dense(weight: torch.Tensor | TokenSubset | None) -> torch.Tensor | None:
    return weight.dense if isinstance(weight, TokenSubset) else weight


def _pointwise(conv: torch.nn.Module) -> bool:
    """A 1x1 (1, 1x1x1) convolution with stride 1: a matmul over the channels."""
    padding = conv.padding
    return (all(k == 1 for k in conv.kernel_size) and all(st == 1 for st in conv.stride)
            and (isinstance(padding, str) or all(p == 0 for p in padding)))


def _weight(module: torch.nn.Module) -> torch.Tensor:
    """A module's weight (ComfyUI's Flux/SD3 RMSNorm keeps it as ``scale``)."""
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else module.scale


def _rows_per_chunk(batch: int, chunks: int) -> int:
    """How many of a module's batch rows each cond chunk has (the model may repeat rows per chunk)."""
    if chunks == 0 or batch % chunks:
        raise ValueError(f"a hooked module saw a batch of {batch} rows for {chunks} cond chunks; "
                         "this model reshapes its batch in a way the hook engine cannot follow")
    return batch // chunks


def _chunk_bounds(x: torch.Tensor, chunks: int) -> tuple[Sequence[int], bool]:
    """The first row of each chunk and the end; whether ``x`` carries them (``CHUNK_ROWS``: packed rows)."""
    bounds = getattr(x, CHUNK_ROWS, None)
    if bounds is None:
        per_chunk = _rows_per_chunk(x.shape[0], chunks)
        return range(0, (chunks + 1) * per_chunk, per_chunk), False
    if len(bounds) != chunks + 1 or bounds[-1] != x.shape[0]:
        raise ValueError(f"a hooked module's input carries row bounds {bounds} for {chunks} cond chunks "
                         f"and {x.shape[0]} rows")
    return bounds, True


def _rows(x: torch.Tensor, y: torch.Tensor, a: int, b: int,
          packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [a, b) of x and y; packed rows (pieces of one chunk's tokens) as one row of tokens [1, n, C]."""
    if not packed:
        return x[a:b], y[a:b]
    return x[a:b].reshape(1, -1, x.shape[-1]), y[a:b].view(1, -1, y.shape[-1])


def _writable(y: torch.Tensor) -> torch.Tensor:
    """``y`` itself when adding to it in place is safe (no autograd history to keep, not an inference
    tensor outside inference mode), else a copy. A hooked module's output is always a fresh tensor."""
    if (torch.is_grad_enabled() and y.requires_grad) or (y.is_inference()
                                                        and not torch.is_inference_mode_enabled()):
        return y.clone()
    return y
