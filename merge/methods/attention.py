"""balance_attention: rescale each attention head's q/k and v/o pairs to equal energy, same function, so
later merges of such models are better behaved (sd-mecha 1.1.8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..context import KeyContext
from ..declare import Weight, WeightGroup, builtin_method
from .logistics import SD_MECHA

HEAD = 64
FAMILIES = ("sd15", "sd2", "sdxl")


@dataclass(frozen=True)
class _Layout:
    """One kind of attention module: its key pattern (``stem``, ``part``) and its parts, in the order
    q weight, q bias, k weight, k bias, v weight, v bias, o weight (``None``: no such part); a fused
    ``in_proj`` holds q, k and v stacked."""

    pattern: re.Pattern
    parts: tuple[str | None, ...]
    fused: bool = False
    unet: bool = False  # SD 1.x UNets have 8 heads per layer, not 64-channel heads

    def members(self, stem: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f"{stem}.{part}" for part in self.parts if part is not None))


_LAYOUTS = (
    _Layout(re.compile(r"^(?P<stem>model\.diffusion_model\..*transformer_blocks\.\d+\.attn[12])"
                       r"\.(?P<part>to_[qkv]\.weight|to_out\.0\.weight)$"),
            ("to_q.weight", None, "to_k.weight", None, "to_v.weight", None, "to_out.0.weight"), unet=True),
    _Layout(re.compile(r"^(?P<stem>.*text_model\.encoder\.layers\.\d+\.self_attn)"
                       r"\.(?P<part>[qkv]_proj\.(?:weight|bias)|out_proj\.weight)$"),
            ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
             "out_proj.weight")),
    _Layout(re.compile(r"^(?P<stem>.*transformer\.resblocks\.\d+\.attn)"
                       r"\.(?P<part>in_proj_weight|in_proj_bias|out_proj\.weight)$"),
            ("in_proj_weight", "in_proj_bias", "in_proj_weight", "in_proj_bias", "in_proj_weight",
             "in_proj_bias", "out_proj.weight"), fused=True),
    _Layout(re.compile(r"^(?P<stem>first_stage_model\.(?:encoder|decoder)\.mid\.attn_1)"
                       r"\.(?P<part>[qkv]\.(?:weight|bias)|proj_out\.weight)$"),
            ("q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias", "proj_out.weight")),
)


def _find(key: str) -> tuple[_Layout, str] | None:
    for layout in _LAYOUTS:
        if match := layout.pattern.match(key):
            return layout, match["stem"]
    return None


def _attention_keys(key: str, arch: str, keys: frozenset[str]) -> tuple[str, ...]:
    found = _find(key) if arch in FAMILIES else None
    if found is None:
        return (key,)
    members = found[0].members(found[1])
    return members if all(k in keys for k in members) else (key,)


@builtin_method(paper=SD_MECHA, related=_attention_keys)
def balance_attention(a: WeightGroup, *, ctx: KeyContext) -> Weight:
    """Rescale every attention head's q/k and v/o to equal energy; the model's output stays the same.

    For one head, the logits depend on q and k only through ``q^T k`` and the output on v and o only
    through ``o v``. With ``s`` symmetric positive definite per head, ``q' = s q`` and ``k' = s^-1 k`` give
    ``q'^T k' = q^T k`` (likewise ``v' = s v``, ``o' = o s^-1``): the model computes the same thing, but
    its two factors carry comparable energy, which makes later merges of such models better behaved.
    ``s = A^-1/2 (A^1/2 B A^1/2)^1/2 A^-1/2`` with ``A = q q^T``, ``B = k k^T`` (biases folded into q, k
    and v as one more input column) is sd-mecha 1.1.8's choice (it solves ``s A s = B``).

    ``s`` must stay inside a head, so the head size matters: 64 channels in SDXL and SD 2.x UNets, CLIP-L,
    OpenCLIP and the VAE (whose mid attention is one head: any block size keeps its function); SD 1.x
    UNets have 8 heads per layer. sd-mecha implements SDXL (``sdxl-sgm``); SD 1.x and 2.x follow from
    the same layouts. Keys outside attention pass through; other families are refused.
    """
    if ctx.arch not in FAMILIES:
        raise ValueError(f"balance_attention knows the attention layouts of {', '.join(FAMILIES)}, not of "
                         f"{ctx.arch!r}; leave it out of this recipe")
    found = _find(ctx.key)
    if found is None or any(k not in a for k in found[0].members(found[1])):  # no attention / a part missing
        return a.get(ctx.key)
    layout, stem = found
    head = a[f"{stem}.{layout.parts[0]}"].shape[0] // 8 if layout.unet and ctx.arch == "sd15" else HEAD
    return _balanced(layout, stem, a, head)[ctx.key]


def _balanced(layout: _Layout, stem: str, a: dict[str, torch.Tensor], head: int) -> dict[str, torch.Tensor]:
    """Every key of one attention module, balanced head by head."""
    q, k, v = (_input_side(layout, stem, a, i) for i in range(3))
    o_weight = a[f"{stem}.{layout.parts[6]}"]
    o = o_weight.flatten(1).T  # its input channels, as rows like q, k and v
    rows = o.shape[0]
    if rows % head:
        raise ValueError(f"{stem}: {rows} channels are not a whole number of {head}-channel heads")
    q, k = _balance(q.unflatten(0, (-1, head)), k.unflatten(0, (-1, head)))
    v, o = _balance(v.unflatten(0, (-1, head)), o.unflatten(0, (-1, head)))
    sides = [side.flatten(0, 1) for side in (q, k, v)]
    out = {f"{stem}.{layout.parts[6]}": o.flatten(0, 1).T.reshape(o_weight.shape)}
    if layout.fused:
        weight, bias = layout.parts[0], layout.parts[1]
        out[f"{stem}.{weight}"] = torch.cat([s[:, :-1] for s in sides]).reshape(a[f"{stem}.{weight}"].shape)
        out[f"{stem}.{bias}"] = torch.cat([s[:, -1] for s in sides])
        return out
    for i, side in enumerate(sides):
        weight, bias = layout.parts[2 * i], layout.parts[2 * i + 1]
        shape = a[f"{stem}.{weight}"].shape
        out[f"{stem}.{weight}"] = (side[:, :-1] if bias else side).reshape(shape)
        if bias:
            out[f"{stem}.{bias}"] = side[:, -1]
    return out


def _input_side(layout: _Layout, stem: str, a: dict[str, torch.Tensor], index: int) -> torch.Tensor:
    """q, k or v (``index`` 0, 1, 2) as a matrix [out, in], its bias as one more column."""
    weight = a[f"{stem}.{layout.parts[2 * index]}"].flatten(1)
    bias_part = layout.parts[2 * index + 1]
    bias = a[f"{stem}.{bias_part}"] if bias_part else None
    if layout.fused:
        rows = weight.shape[0] // 3
        weight, bias = weight[index * rows:(index + 1) * rows], bias[index * rows:(index + 1) * rows]
    return weight if bias is None else torch.cat([weight, bias.unsqueeze(1)], dim=1)


def _balance(first: torch.Tensor, second: torch.Tensor, eps: float = 1e-6,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s first, s^-1 second)`` per head ([heads, head, columns]), with ``s`` symmetric positive definite
    and ``s A s = B`` for the Gram matrices ``A``, ``B`` of ``first`` and ``second``; computed in fp64."""
    dtype, first, second = first.dtype, first.double(), second.double()  # fp32 eigh is off by ~1e-5
    eye = eps * torch.eye(first.shape[1], dtype=first.dtype, device=first.device)
    gram_a, gram_b = first @ first.mT + eye, second @ second.mT + eye
    root_a, inverse_root_a = _powers(gram_a, eps, 0.5, -0.5)
    (root_c,) = _powers(root_a @ gram_b @ root_a, eps, 0.5)
    s = inverse_root_a @ root_c @ inverse_root_a
    return (s @ first).to(dtype), torch.linalg.solve(s, second).to(dtype)


def _powers(matrix: torch.Tensor, eps: float, *exponents: float) -> tuple[torch.Tensor, ...]:
    """``matrix ** e`` for each exponent, through one symmetric eigendecomposition (eigenvalues >= eps)."""
    values, vectors = torch.linalg.eigh(matrix)
    values = values.clamp_min(eps)
    return tuple((vectors * values.pow(e).unsqueeze(-2)) @ vectors.mT for e in exponents)
