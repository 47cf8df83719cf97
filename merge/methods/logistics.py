"""Key logistics: fall back to another model for absent keys, keep or drop a model component."""

from __future__ import annotations

from ..blocks import COMPONENTS, component_of
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
    return a if _component(ctx, component) == component else None


@merge_method(paper=SD_MECHA)
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
