"""Key logistics: fall back for absent keys, keep or drop a component or a non-finite key, cast, stack."""

from __future__ import annotations

import torch

from ..blocks import COMPONENTS, component_of
from ..context import KeyContext
from ..declare import AnySpace, builtin_method
from ..names import did_you_mean

SD_MECHA = "https://github.com/ljleb/sd-mecha"


@builtin_method(paper=SD_MECHA, accepts_missing=True)
def fallback(a: AnySpace, default: AnySpace) -> AnySpace:
    """A's tensor where A has the key, otherwise default's (None in = key absent)."""
    return a if a is not None else default


@builtin_method(paper=SD_MECHA)
def pick_component(a: AnySpace, *, component: str = "diffuser", ctx: KeyContext) -> AnySpace:
    """Only the keys of one component (diffuser, clip_l, clip_g, vae, ...); other keys are absent."""
    return a if _component(ctx, component) == component else None


@builtin_method(paper=SD_MECHA)
def omit_component(a: AnySpace, *, component: str = "diffuser", ctx: KeyContext) -> AnySpace:
    """Every key except those of one component (diffuser, clip_l, clip_g, vae, ...)."""
    return None if _component(ctx, component) == component else a


def _component(ctx: KeyContext, wanted: str) -> str | None:
    """The key's component, after checking ``wanted`` exists for the architecture."""
    valid = COMPONENTS.get(ctx.arch)
    if valid is None:
        raise ValueError(f"components are known for {', '.join(COMPONENTS)} models, not {ctx.arch!r}")
    if wanted not in valid:
        raise ValueError(f"component {wanted!r} does not exist in {ctx.arch}; valid components: {valid}")
    return component_of(ctx.arch, ctx.key)


CAST_DTYPES = {name: getattr(torch, name) for name in (
    "float64", "int64", "float32", "int32", "float16", "bfloat16", "int16", "int8", "bool", "uint8",
    "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    "float8_e8m0fnu")
    if hasattr(torch, name)}  # sd-mecha's names


@builtin_method(paper=SD_MECHA)
def cast(a: AnySpace, *, device: str | None = None, dtype: str | None = None) -> AnySpace:
    """Round the values to dtype (float16, bfloat16, float8_e4m3fn, int8, ...); the merge goes on in fp32."""
    if dtype is None:
        return a
    if dtype not in CAST_DTYPES:
        raise ValueError(f"cast: unknown dtype {dtype!r}{did_you_mean(dtype, CAST_DTYPES)}; "
                         f"valid: {', '.join(CAST_DTYPES)} (or none)")
    return a.to(CAST_DTYPES[dtype]).to(a.dtype)


@builtin_method(paper=SD_MECHA)
def stack(*values: AnySpace) -> AnySpace:
    """The tensors stacked along a new first dimension ([n, *shape]), for a method taking them together."""
    return torch.stack(values)


@builtin_method(paper=SD_MECHA)
def omit_non_finite(a: AnySpace) -> AnySpace:
    """The tensor, or the key left out of the output where it holds a NaN or an infinity."""
    return a if bool(a.isfinite().all()) else None
