"""A recipe as a difference, evaluated one key at a time: what a Recipe Hook adds to a model (the recipe
minus its base, as core's model-as-LoRA hook adds ``B - W``). ComfyUI-free.
"""

from __future__ import annotations

import threading

import torch

from .graph import CallNode, Node, RecipeError, label
from .names import DELTA, WEIGHT
from .plan import NO_RUNTIME, MergeOptions, MergeRuntime
from .recipe import output_space
from .session import MergeSession

__all__ = ["RecipeDeltas", "delta_recipe"]

_WHERE = ("recipe hook",)


def delta_recipe(recipe: Node, base: Node | None = None) -> Node:
    """The difference a recipe hook adds: ``recipe - base``, or a delta-space recipe as it is."""
    space = output_space(recipe)
    if space == DELTA:
        if base is not None:
            raise RecipeError(_WHERE, f"the recipe ({label(recipe)}) is already a difference (delta space); "
                                      f"leave base unconnected, or give a weight-space recipe")
        return recipe
    if space != WEIGHT:
        raise RecipeError(_WHERE, f"the recipe ({label(recipe)}) gives {space}-space values; a hook needs a "
                                  f"merged model and its base, or a difference (delta space)")
    if base is None:
        raise RecipeError(_WHERE, f"no base: the recipe ({label(recipe)}) is a whole model, and the hook "
                                  f"adds its difference to a base; connect base (the checkpoint you sample, "
                                  f"e.g. the first input of the merge), or give a difference such as "
                                  f"subtract(merged, base)")
    if output_space(base) != WEIGHT:
        raise RecipeError(_WHERE, f"base ({label(base)}) must be a model (weight space), not "
                                  f"{output_space(base)}-space")
    return CallNode("subtract", (recipe, base))


class RecipeDeltas:
    """One key's delta at a time from a delta recipe (see the module docstring); thread-safe.

    A recipe hook (ComfyUI node PatchbayRecipeHook, hooks/recipe_hook.py) applies ``strength * delta`` to the
    model it runs on, the way core's model-as-LoRA hook applies ``strength * (B - W)``. The delta is the
    recipe minus its base::

        delta_recipe(recipe, base)       weight-space recipe and a base  -> subtract(recipe, base)
                                         delta-space recipe (subtract(...), a LoRA, TIES of differences),
                                         no base                         -> the recipe itself
                                         anything else                   -> RecipeError naming the fix
        RecipeDeltas(delta, options[,    a MergeSession opened once (headers only, every input checked:
          runtime])                      one architecture); ``shapes`` lists the float keys and their
                                         shapes, ``delta(key)`` evaluates one key in fp32 on first use
                                         (MergeSession.evaluate, with the runtime's MergeCache)

    At strength 1 on the base model the hook gives ``base + (recipe - base)``: the merged model.
    ComfyUI-free; the keys are the recipe's canonical ones (``model.diffusion_model.X``).
    """

    def __init__(self, delta: Node, options: MergeOptions, runtime: MergeRuntime = NO_RUNTIME) -> None:
        self.session = MergeSession(delta, options, runtime=runtime)
        self.arch = self.session.arch
        self.shapes: dict[str, tuple[int, ...]] = {p.key: tuple(p.shape) for p in self.session.plans
                                                   if p.passthrough is None}
        self._lock = threading.Lock()

    def delta(self, key: str) -> torch.Tensor | None:
        """``key``'s delta in fp32 (None: the recipe drops the key, the hook leaves it unchanged)."""
        with self._lock:
            return self.session.evaluate(key)

    def close(self) -> None:
        self.session.close()
