"""Key logistics: fall back to another model for absent keys, keep or drop a model component."""

from __future__ import annotations

from ..blocks import component_of
from ..context import KeyContext
from ..registry import AnySpace, merge_method

SD_MECHA = "https://github.com/ljleb/sd-mecha"


@merge_method(paper=SD_MECHA, accepts_missing=True)
def fallback(a: AnySpace, default: AnySpace) -> AnySpace:
    """A's tensor where A has the key, otherwise default's (None in = key absent)."""
    return a if a is not None else default


@merge_method(paper=SD_MECHA)
def pick_component(a: AnySpace, *, component: str = "diffuser", ctx: KeyContext) -> AnySpace:
    """Only the keys of one component (diffuser, clip_l, clip_g, vae, ...); other keys are absent."""
    return a if component_of(ctx.arch, ctx.key) == component else None


@merge_method(paper=SD_MECHA)
def omit_component(a: AnySpace, *, component: str = "diffuser", ctx: KeyContext) -> AnySpace:
    """Every key except those of one component (diffuser, clip_l, clip_g, vae, ...)."""
    return None if component_of(ctx.arch, ctx.key) == component else a
