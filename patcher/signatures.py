"""What ComfyUI passes to each wrapper and callback type, and the check made at registration, so a wrong
signature fails when it is registered rather than mid-sampling.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from .errors import SignatureMismatchError

__all__ = ["CALLBACK_SHAPES", "EVENT_LISTENER_SHAPE", "WRAPPER_SHAPES", "CallShape", "check_signature"]


@dataclass(frozen=True)
class CallShape:
    """The arguments one call site passes: positional names, keyword names, and ``**kwargs`` needs."""

    positional: tuple[str, ...]
    keywords: tuple[str, ...] = ()
    var_keywords: bool = False  # the call site passes further keyword arguments that vary
    note: str = ""

    def render(self, leading: tuple[str, ...] = ()) -> str:
        parts = [*leading, *self.positional, *(f"{k}=..." for k in self.keywords)]
        if self.var_keywords:
            parts.append("**kwargs")
        return "(" + ", ".join(parts) + ")"


WRAPPER_SHAPES: dict[str, CallShape] = {
    "outer_sample": CallShape(
        ("noise", "latent_image", "sampler", "sigmas", "denoise_mask", "callback", "disable_pbar", "seed"),
        ("latent_shapes",), note="executor.class_obj is the CFGGuider"),
    "prepare_sampling": CallShape(("model", "noise_shape", "conds"), ("model_options",)),
    "sampler_sample": CallShape(
        ("guider", "sigmas", "extra_args", "callback", "noise", "latent_image", "denoise_mask",
         "disable_pbar"),
        note="executor.class_obj is the sampler; callback(step, denoised, x, total_steps) is the per-step "
             "hook"),
    "predict_noise": CallShape(("x", "timestep", "model_options", "seed"),
                               note="executor.class_obj is the CFGGuider"),
    "calc_cond_batch": CallShape(("model", "conds", "x_in", "timestep", "model_options")),
    "apply_model": CallShape(("x", "t", "c_concat", "c_crossattn", "control", "transformer_options"),
                             var_keywords=True, note="args[5] is transformer_options"),
    "diffusion_model": CallShape(("x", "timesteps", "context", "y", "control", "transformer_options"),
                                 var_keywords=True,
                                 note="this is what SD1/SDXL UNets pass; other model families pass other "
                                      "positional arguments, so (executor, x, *args, **kwargs) fits all"),
}

CALLBACK_SHAPES: dict[str, CallShape] = {
    "on_clone": CallShape(("patcher", "clone")),
    "on_load_after": CallShape(("patcher", "device_to", "lowvram_model_memory", "force_patch_weights",
                                "full_load")),
    "on_detach_after": CallShape(("patcher", "unpatch_all")),
    "on_cleanup": CallShape(("patcher",)),
    "on_pre_run": CallShape(("patcher",)),
    "on_prepare_state": CallShape(("patcher", "timestep")),
    "on_apply_hooks": CallShape(("patcher", "hooks")),
    "on_register_all_hook_patches": CallShape(("patcher", "hooks", "target_dict", "model_options",
                                               "registered")),
    "on_inject_model": CallShape(("patcher",)),
    "on_eject_model": CallShape(("patcher",)),
}

EVENT_LISTENER_SHAPE = CallShape(("event",))

_PLACEHOLDER = object()


def _bind_problem(fn: Callable, args: int, keywords: tuple[str, ...], var_keywords: bool) -> str | None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables have no signature: trust them
        return None
    try:
        signature.bind(*([_PLACEHOLDER] * args), **dict.fromkeys(keywords, _PLACEHOLDER))
    except TypeError as exc:
        return str(exc)
    kinds = {p.kind for p in signature.parameters.values()}
    if var_keywords and inspect.Parameter.VAR_KEYWORD not in kinds:
        return "it has no **kwargs for the extra keyword arguments ComfyUI passes"
    return None


def check_signature(fn: object, shape: CallShape | None, *, what: str, leading: tuple[str, ...] = ()) -> None:
    """Raise SignatureMismatchError unless ``fn`` can be called as ``fn(*leading, *positional, **keywords)``.

    ``what`` names the registration in the message ("wrapper 'predict_noise'"); ``leading`` are the
    arguments before the call site's own (``("executor",)`` for wrappers).

    A wrapper receives the executor and then the arguments of the function it wraps; a callback receives
    the patcher and a few values. The shapes below are ComfyUI 0.3.75's (comfy/samplers.py,
    comfy/sampler_helpers.py, comfy/model_base.py, comfy/model_patcher.py). Newer ComfyUI passes more
    keyword arguments to some of them, so ``(executor, *args, **kwargs)`` is the portable way to write one.

    Pure: stdlib ``inspect`` only; a type ComfyUI has but this table lacks is only checked to be callable.
    """
    name = getattr(fn, "__qualname__", None) or repr(fn)
    if not callable(fn):
        raise SignatureMismatchError(
            f"{what}: {fn!r} is not callable; pass a function"
            + (f" taking {shape.render(leading)}." if shape else ".")
        )
    if shape is None:
        return
    problem = _bind_problem(fn, len(leading) + len(shape.positional), shape.keywords, shape.var_keywords)
    if problem is None:
        return
    portable = "(executor, *args, **kwargs)" if leading else "(*args, **kwargs)"
    raise SignatureMismatchError(
        f"{what}: {name}{_signature_text(fn)} cannot be called the way ComfyUI calls it ({problem}). "
        f"Expected {shape.render(leading)}"
        + (f"; {shape.note}" if shape.note else "")
        + f". Fix: accept those arguments, or write it as {portable}"
        + (" and pass them on with executor(*args, **kwargs)." if leading else ".")
    )


def _signature_text(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"
