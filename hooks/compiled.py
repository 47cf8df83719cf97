"""Fast Hooks on a model compiled by ComfyUI's TorchCompileModel: the deltas run inside compiled graphs of
their own, since dynamo would keep running graphs compiled before a hook was added. Data flow:
docs/architecture.md; why and what was measured: docs/design-hook-engine.md.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from ..patcher.calls import argument
from .lowrank import ModuleDeltas, RowFactors, module_kind

__all__ = ["TWIN_NAME", "CompiledRun", "RowHook", "twin_settings"]

TWIN_NAME = "patchbay.hooks"  # torch.compile(name=...): what sets the twins' inductor backend apart
_SETTINGS = ("mode", "fullgraph", "dynamic")
_HOOK_COLUMNS = 8

_CALL: ContextVar[_Call | None] = ContextVar("patchbay_compiled_hook_call", default=None)


def twin_settings(compile_kwargs: dict | None) -> tuple[dict | None, str | None]:
    """torch.compile's keyword arguments for the twins of a TorchCompileModel compile, or why there are none.

    ``compile_kwargs``: what ComfyUI's set_torch_compile_wrapper keeps in ``model_options``. The twins
    take the same backend, mode, options, fullgraph and dynamic, and a backend that compares unequal:
    inductor under its own ``name`` (inductor backends compare by settings and name), any other backend
    in a ``functools.partial`` (compared by identity; the twin is made once and reused).
    """
    if not isinstance(compile_kwargs, dict):
        return None, "its compile settings (model_options['torch_compile_kwargs']) are missing"
    settings = {k: compile_kwargs[k] for k in _SETTINGS if compile_kwargs.get(k) is not None}
    if compile_kwargs.get("options"):
        settings["options"] = dict(compile_kwargs["options"])
    parameters = inspect.signature(torch.compile).parameters
    if "isolate_recompiles" in parameters:  # the twins' recompiles do not count against core's graphs
        settings["isolate_recompiles"] = True
    backend = compile_kwargs.get("backend", "inductor")
    if backend == "inductor":
        if "name" not in parameters:
            return None, (f"this torch ({torch.__version__}) has no torch.compile(name=...) to keep hooked "
                          "graphs apart")
        return {**settings, "backend": "inductor", "name": TWIN_NAME}, None
    compiler = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    return {**settings, "backend": functools.partial(compiler)}, None


@dataclass(frozen=True)
class _Call:
    """What the forward hooks of one model call read: the strengths and every hooked module's factors."""

    rows: torch.Tensor  # (chunks, hook columns)
    factors: list  # RowFactors per slot (CompiledRun.factors)


class RowHook:
    """A compiled run's forward hook on one module: its deltas (or none) and their slot among the factors.

    The factors come through the ContextVar, not as attributes of the hook: dynamo keeps the sizes of
    tensors it finds on a module fixed, but honours a dynamic rank on tensors it reaches from a global.
    """

    def __init__(self, deltas: ModuleDeltas | None, slot: int | None) -> None:
        self.deltas = deltas
        self.slot = slot

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        call = _CALL.get()
        if call is None or self.slot is None:
            return None
        return self.deltas.add_rows(module, args[0], output, call.rows, call.factors[self.slot])


@dataclass
class CompiledRun:
    """One sampling run's hooks on a compiled model (held by the engine's RunPlan).

    Why not trace the eager forward hooks: dynamo does not guard on a module's *empty* hook dict
    (``torch._dynamo.config.skip_nnmodule_hook_guards``), a strength read as a Python float is guarded
    (a new one compiles again), and the eager engine branches on which rows carry a hook. So every
    Linear/Conv/Norm gets a RowHook (deltas or none), strengths travel as a tensor in a ContextVar
    (dynamo honours dynamic sizes on tensors it reaches from a global, not on a module), and each
    compiled module runs as its twin under a backend that compares unequal to core's.
    """

    settings: dict  # torch.compile keyword arguments of the twins (twin_settings)
    twins: weakref.WeakKeyDictionary  # the engine's, shared by its runs: compiled module -> {settings: twin}
    factors: list[RowFactors | None] = field(default_factory=list)  # per slot, made on the first call
    hooked: set = field(default_factory=set)  # modules with a RowHook
    pending: dict[torch.nn.Module, list[tuple[int, ModuleDeltas]]] = field(default_factory=dict)
    parts: dict[torch.nn.Module, list[tuple[str, torch.nn.Module]]] = field(default_factory=dict)
    calls: dict[tuple, _Call] = field(default_factory=dict)
    handles: list = field(default_factory=list)

    def install(self, model: torch.nn.Module, deltas: dict[torch.nn.Module, ModuleDeltas]) -> None:
        """A RowHook on every module of ``model`` (a BaseModel) that can carry a delta."""
        pending = self.pending.setdefault(model, [])
        for module in model.modules():
            if module_kind(module) is None or module in self.hooked:
                continue
            found, slot = deltas.get(module), None
            if found is not None and found.low_rank:
                slot = len(self.factors)
                self.factors.append(None)
                pending.append((slot, found))
            self.hooked.add(module)
            self.handles.append(module.register_forward_hook(RowHook(found, slot)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.factors, self.hooked = [], [], set()
        self.pending, self.parts, self.calls = {}, {}, {}

    def call(self, executor: Any, args: tuple, kwargs: dict, strengths: list[list[float]]) -> Any:
        """``executor`` (APPLY_MODEL) with the strengths as a tensor, the twins in place of core's modules."""
        base, x = executor.class_obj, argument(executor.original, "x", args, kwargs)
        self._prepare(base, x.device)
        key = (x.device, tuple(map(tuple, strengths)))
        call = self.calls.get(key)
        if call is None:
            call = self.calls[key] = _Call(_rows_tensor(strengths, x.device), self.factors)
        if base not in self.parts:
            self.parts[base] = _compiled_parts(base)
        swapped = [(path, opt) for path, opt in self.parts[base] if _get(base, path) is opt]
        for path, opt in swapped:
            _set(base, path, self._twin(opt))
        token = _CALL.set(call)
        try:
            return executor(*args, **kwargs)
        finally:
            _CALL.reset(token)
            for path, opt in swapped:
                _set(base, path, opt)

    def _prepare(self, base: torch.nn.Module, device: torch.device) -> None:
        """The factors of ``base``'s hooked modules on the compute device; the summed rank is dynamic."""
        dtype = getattr(base, "manual_cast_dtype", None) or base.get_dtype()
        for slot, deltas in self.pending.pop(base, ()):
            factors = self.factors[slot] = deltas.row_factors(device, dtype)
            up_rank = 0 if deltas.kind == "linear" else 1
            for tensor, dim in ((factors.down, 0), (factors.up, up_rank), (factors.hook, 0),
                                (factors.scale, 0)):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)

    def _twin(self, opt: Any) -> Callable:
        """The twin of core's ``opt``: one per compiled module and settings, so a TorchCompileModel node
        run again on the same model (a new OptimizedModule, core's graphs reused) reuses the hooked graphs
        (with ``isolate_recompiles`` only the same twin finds them)."""
        backend = self.settings["backend"]
        key = repr(sorted({**self.settings, "backend": getattr(backend, "func", backend)}.items()))
        per_module = self.twins.setdefault(opt._orig_mod, {})
        twin = per_module.get(key)
        if twin is None:
            twin = per_module[key] = torch.compile(opt._orig_mod, **_with_guard_filter(self.settings, opt))
        return twin


def _with_guard_filter(settings: dict, opt: Any) -> dict:
    """``settings`` plus the guard_filter_fn core's compile of ``opt`` was given, if any.

    ComfyUI 0.33's TorchCompileModel drops dynamo's guards on ``transformer_options`` through
    ``options["guard_filter_fn"]``, which torch.compile pops from the options ComfyUI keeps; it is read
    back from the compiled module (torch-internal: where this torch keeps it elsewhere, the twins keep
    those guards, as every graph on ComfyUI 0.3.75 does).
    """
    hooks = getattr(getattr(opt, "dynamo_ctx", None), "_hooks", None)
    guard_filter = getattr(hooks, "guard_filter_fn", None)
    if guard_filter is None:
        return settings
    return {**settings, "options": {**settings.get("options", {}), "guard_filter_fn": guard_filter}}


def _rows_tensor(strengths: list[list[float]], device: torch.device) -> torch.Tensor:
    """(chunks, hook columns), the columns padded with zeros to a multiple of _HOOK_COLUMNS, so a run
    with another number of hooks reuses the graphs."""
    hooks = len(strengths[0]) if strengths else 0
    rows = torch.zeros(len(strengths), -(-max(hooks, 1) // _HOOK_COLUMNS) * _HOOK_COLUMNS)
    rows[:, :hooks] = torch.tensor(strengths, dtype=torch.float32).reshape(len(strengths), hooks)
    return rows.to(device)


def _get(root: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), root)


def _set(root: Any, path: str, value: Any) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, value)


def _compiled_parts(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every OptimizedModule under ``root``, not looking inside them."""
    found, stack = [], [("", root)]
    while stack:
        path, module = stack.pop()
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if isinstance(child, torch._dynamo.eval_frame.OptimizedModule):
                found.append((child_path, child))
            else:
                stack.append((child_path, child))
    return found
