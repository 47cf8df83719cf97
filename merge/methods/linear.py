"""Linear and near-linear methods: weighted sum, averages, slerp, task arithmetic, masks."""

from __future__ import annotations

from typing import Annotated, Any

import torch

from ..declare import AnySpace, Delta, Param, Range, Weight, builtin_method
from ._util import is_close, model_weights

SOUPS = "https://arxiv.org/abs/2203.05482"
TASK_ARITHMETIC = "https://arxiv.org/abs/2212.04089"
SUPERMERGER = "https://github.com/hako-mikan/sd-webui-supermerger"
SD_MECHA = "https://github.com/ljleb/sd-mecha"
NEARSWAP = "https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001"


def _weighted_sum_passes(params: dict[str, Any], same_inputs: bool = False) -> int | None:
    """The input weighted_sum returns unchanged: a at alpha 0 (or when a and b are the same), b at 1."""
    if same_inputs or is_close(params["alpha"], 0.0):
        return 0
    return 1 if is_close(params["alpha"], 1.0) else None


@builtin_method(paper=SOUPS, elementwise=True, passes_input=_weighted_sum_passes)
def weighted_sum(a: AnySpace, b: AnySpace, *, alpha: float = 0.5) -> AnySpace:
    """Linear interpolation a + (b - a) * alpha (alpha=0 gives A, 1 gives B)."""
    passed = _weighted_sum_passes({"alpha": alpha})
    if passed is not None:
        return (a, b)[passed]
    return torch.lerp(a, b, alpha)


@builtin_method(paper=SOUPS, elementwise=True)
def n_average(*models: AnySpace) -> AnySpace:
    """Plain mean of any number of models (running lerp, as sd-mecha)."""
    res = models[0]
    for i, model in enumerate(models[1:], start=2):
        res = torch.lerp(res, model, 1 / i)
    return res


@builtin_method(paper=SOUPS, elementwise=True)
def linear(*models: AnySpace, weights: str = "", normalize: bool = True) -> AnySpace:
    """Weighted sum of any number of models, sum(w_i * m_i) / sum(w_i) when normalized (mergekit's linear)."""
    w = model_weights(weights, len(models), "linear")
    total = sum(w)
    if normalize and total == 0:
        raise ValueError(f"linear: weights={weights!r} sum to 0, so they cannot be normalized; change a "
                         f"weight or set normalize=false")
    res = sum(weight * model for weight, model in zip(w, models, strict=True))
    return res / total if normalize else res


@builtin_method(paper=NEARSWAP, elementwise=True)
def nearswap(a: AnySpace, b: AnySpace, *, t: Annotated[float, Range(0.0)] = 1e-4) -> AnySpace:
    """NearSwap (mergekit): B where it is within t of A, else lerp by t / |a - b| (clamped to [0, 1])."""
    weight = (t / (a - b).abs().clamp(min=1e-6)).clamp(0, 1)
    return torch.lerp(a, b, weight)


@builtin_method(paper=SD_MECHA, elementwise=True)
def scale(a: Delta, *, alpha: float = 1.0) -> Delta:
    """A delta times alpha (0 gives zeros, 1 the delta unchanged)."""
    if is_close(alpha, 1.0):
        return a
    return a * alpha


@builtin_method(paper="https://doi.org/10.1145/325165.325242")
def slerp(a: AnySpace, b: AnySpace, *, alpha: float = 0.5) -> AnySpace:
    """Spherical interpolation of the flattened tensors; lerp when they are (anti)parallel."""
    a_norm, b_norm = a.norm(), b.norm()
    a_unit, b_unit = a / a_norm, b / b_norm
    omega = torch.arccos((a_unit * b_unit).sum().clamp(-1, 1))
    res = (a_unit * torch.sin((1 - alpha) * omega) + b_unit * torch.sin(alpha * omega)) / torch.sin(omega)
    res = res * torch.lerp(a_norm, b_norm, torch.as_tensor(alpha, dtype=a.dtype))
    if res.isnan().any():
        return torch.lerp(a, b, alpha)
    return res


@builtin_method(paper=TASK_ARITHMETIC, elementwise=True)
def add_difference(a: AnySpace, b: Delta, *, alpha: float = 1.0) -> AnySpace:
    """Task arithmetic: a + b * alpha, b a delta (e.g. subtract(B, C))."""
    if is_close(alpha, 0.0):
        return a
    return torch.addcmul(a, b, torch.as_tensor(alpha, dtype=a.dtype, device=a.device))


@builtin_method(paper=TASK_ARITHMETIC, elementwise=True)
def subtract(a: Weight, b: Weight) -> Delta:
    """The delta a - b (a task vector when b is the base model)."""
    return a - b


@builtin_method(paper=SD_MECHA)
def perpendicular_component(a: AnySpace, b: AnySpace) -> AnySpace:
    """The part of b orthogonal to a (zeros when a is zero)."""
    norm_a = torch.linalg.norm(a)
    res = b - a * (a / norm_a * (b / norm_a)).sum()
    if res.isnan().any():
        return torch.zeros_like(a)
    return res


@builtin_method(paper=SUPERMERGER, elementwise=True)
def train_difference_mask(a: AnySpace, b: AnySpace, c: AnySpace, *, alpha: float = 1.0) -> Param:
    """Per-element weight alpha * 1.8 * |b - a| / (|b - a| + |b - c|) for add_difference."""
    ba = (b - a).abs()
    return alpha * 1.8 * torch.nan_to_num(ba / (ba + (b - c).abs()), nan=0)


@builtin_method(paper=SUPERMERGER, elementwise=True)
def train_difference(a: AnySpace, b: Weight, c: Weight, *, alpha: float = 1.0) -> AnySpace:
    """Supermerger's train difference: a + (b - c) * train_difference_mask(a, b, c, alpha)."""
    mask = train_difference_mask(a, b, c, alpha=alpha)
    return torch.addcmul(a, b - c, mask)


@builtin_method(paper=SD_MECHA)
def multiply_quotient(a: AnySpace, b: AnySpace, c: AnySpace, *, alpha: float = 1.0) -> AnySpace:
    """a * (b / c) ** (alpha * agreement), where b and c move a in the same log direction."""
    ac_log = torch.log(a.abs()) - torch.log(c.abs())
    bc_log = torch.log(b.abs()) - torch.log(c.abs())
    b_c = torch.complex(b, torch.zeros_like(b)) / torch.complex(c, torch.zeros_like(c))
    threshold = torch.maximum(ac_log.abs(), bc_log.abs())
    power = alpha * torch.clamp(-torch.nan_to_num(ac_log * bc_log / threshold**2, nan=0), 0)
    res = a * b_c**power
    res = torch.where(torch.isnan(res), a, res)
    return res.real


@builtin_method(paper=SD_MECHA)
def add_opposite_mask(a: AnySpace, b: AnySpace, c: AnySpace, *, alpha: float = 1.0) -> Param:
    """Per-element weight alpha * 2 * |a - b| / (|a - b| + |a + b - 2c|) for add_difference."""
    ab = (a - b).abs()
    return alpha * 2 * torch.nan_to_num(ab / (ab + (a + b - 2 * c).abs()), nan=0)


@builtin_method(paper=SD_MECHA)
def add_strict_opposite_mask(a: AnySpace, b: AnySpace, c: AnySpace, *, alpha: float = 1.0) -> Param:
    """Per-element weight 2 * alpha * max(0, (c - a)(b - c) / max(|a - c|, |b - c|)^2)."""
    threshold = torch.maximum((a - c).abs(), (b - c).abs())
    return alpha * torch.clamp(torch.nan_to_num((c - a) * (b - c) / threshold**2, nan=0), 0) * 2


@builtin_method(paper=SD_MECHA)
def geometric_sum(a: AnySpace, b: AnySpace, *, alpha: float = 0.5) -> AnySpace:
    """Element-wise weighted geometric mean a^(1 - alpha) * b^alpha (real part, negatives via complex)."""
    a_c = torch.complex(a, torch.zeros_like(a))
    b_c = torch.complex(b, torch.zeros_like(b))
    return (a_c ** (1 - alpha) * b_c**alpha).real
