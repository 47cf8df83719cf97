"""What was applied when: the trace of one sampling run (hooks and strengths, patches, wrappers, events
per step), for DEBUG logs and the Trace node. Data flow: docs/architecture.md; API: docs/node-authors.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .step_clock import cond_active

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

    from .events import StepEvent

__all__ = ["LOGGER", "TRACE_KEY", "Trace", "TraceEvent", "TraceListener", "TraceRecorder", "disable_trace",
           "enable_trace", "last_trace", "trace_enabled"]

LOGGER = logging.getLogger("patchbay.trace")
TRACE_KEY = "patchbay.trace"
TRACE_PRIORITY = 1000  # before other listeners: a listener that raises does not hide the row


@dataclass(frozen=True)
class TraceEvent:
    """One thing that ran at one sampler step.

    kind: "hook" (a hook's weights/strength), "patch" (weight or object patch), "wrapper",
    "callback" or "event" (sampler_start, step_start, step_end, sampler_end).
    strength: the hook or patch strength in effect, None where it has no meaning.
    """

    step: int
    total_steps: int
    sigma: float | None
    kind: str
    name: str
    strength: float | None = None
    detail: str = ""


@dataclass(frozen=True)
class Trace:
    """The events of one sampling run, in the order they happened.

    total_steps and sigmas describe the full schedule (steps are global, see patcher/events.py);
    first_step is the run's first step, schedule_known whether the run was found in a full schedule.
    """

    events: tuple[TraceEvent, ...]
    total_steps: int
    sigmas: tuple[float, ...] = ()
    first_step: int = 0
    schedule_known: bool = False


class TraceRecorder:
    """Collects the rows of one run and logs each at DEBUG; ``finish`` freezes them into a Trace."""

    def __init__(self, total_steps: int, sigmas: tuple[float, ...] = (), *, first_step: int = 0,
                 schedule_known: bool = False, logger: logging.Logger = LOGGER) -> None:
        self.total_steps = total_steps
        self.sigmas = tuple(sigmas)
        self.first_step = first_step
        self.schedule_known = schedule_known
        self.logger = logger
        self.events: list[TraceEvent] = []

    def record(self, step: int, sigma: float | None, kind: str, name: str, strength: float | None = None,
               detail: str = "") -> TraceEvent:
        event = TraceEvent(step, self.total_steps, sigma, kind, name, strength, detail)
        self.events.append(event)
        self.logger.debug("step %d/%d sigma=%s %s %s%s%s", step, self.total_steps,
                          "-" if sigma is None else f"{sigma:.4g}", kind, name,
                          "" if strength is None else f" strength={strength:.4g}",
                          f" ({detail})" if detail else "")
        return event

    def finish(self) -> Trace:
        return Trace(tuple(self.events), self.total_steps, self.sigmas, self.first_step, self.schedule_known)


# ---- what one step applied (read from core's objects by attribute; no comfy import) -------------------


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _active_hooks(guider: Any, sigma: float) -> dict[Any, tuple[Any, list[str]]]:
    """hook_ref -> (hook, names of the conds it is on), in order of first appearance."""
    found: dict[Any, tuple[Any, list[str]]] = {}
    for cond_name, conds in (getattr(guider, "conds", None) or {}).items():
        for cond in conds or ():
            group = cond.get("hooks") if isinstance(cond, dict) else None
            if group is None or not cond_active(cond, sigma):
                continue
            for hook in getattr(group, "hooks", ()):
                entry = found.setdefault(getattr(hook, "hook_ref", hook), (hook, []))
                if cond_name not in entry[1]:
                    entry[1].append(cond_name)
    return found


def _hook_detail(hook: Any, conds: list[str]) -> str:
    parts = [f"{type(hook).__name__} on {'+'.join(conds)}"]
    weights = getattr(hook, "weights", None)
    if weights:
        parts.append(f"{len(weights)} LoRA keys")
    if hasattr(hook, "strength_model"):
        parts.append(f"strength_model={hook.strength_model:.4g}")
    return ", ".join(parts)


def _record_hooks(rec: TraceRecorder, step: int, sigma: float, guider: Any, names: dict[Any, str]) -> None:
    for ref, (hook, conds) in _active_hooks(guider, sigma).items():
        default = f"{type(hook).__name__} {len(names) + 1}"
        name = names.setdefault(ref, getattr(hook, "hook_id", None) or default)
        rec.record(step, sigma, "hook", name, float(hook.strength), _hook_detail(hook, conds))


def _record_patches(rec: TraceRecorder, step: int, sigma: float, model: Any) -> None:
    patches = getattr(model, "patches", {}) or {}
    if patches:
        strengths = sorted({float(p[0]) for entries in patches.values() for p in entries})
        rec.record(step, sigma, "patch", "weight patches", strengths[0] if len(strengths) == 1 else None,
                   f"{len(patches)} keys, {sum(map(len, patches.values()))} patches, "
                   f"strengths {', '.join(f'{s:.4g}' for s in strengths)}")
    for name, obj in (getattr(model, "object_patches", {}) or {}).items():
        rec.record(step, sigma, "patch", f"object patch {name}", None, type(obj).__name__)


def _record_registered(rec: TraceRecorder, step: int, sigma: float, model_options: dict) -> None:
    options = model_options.get("transformer_options", {})
    for kind, store in (("wrapper", "wrappers"), ("callback", "callbacks")):
        for type_, keys in options.get(store, {}).items():
            for key, fns in keys.items():
                if fns:
                    rec.record(step, sigma, kind, f"{type_} {key}", None, ", ".join(map(_fn_name, fns)))


class TraceListener:
    """The step-event listener behind ``enable_trace``; ``last`` is the last finished run's Trace."""

    def __init__(self, logger: logging.Logger = LOGGER) -> None:
        self.logger = logger
        self.last: Trace | None = None
        self._runs: dict[int, tuple[TraceRecorder, dict[Any, str]]] = {}

    def __call__(self, event: StepEvent) -> None:
        run_id = id(event.run)
        if event.name == "sampler_start":
            if len(self._runs) > 8:  # runs that raised never reached sampler_end
                self._runs.clear()
            recorder = TraceRecorder(event.total_steps, event.schedule, first_step=event.first_step,
                                     schedule_known=event.schedule_known, logger=self.logger)
            self._runs[run_id] = (recorder, {})
        if run_id not in self._runs:
            return
        rec, names = self._runs[run_id]
        if event.name == "evaluation":
            if event.evaluation == 0 and event.run is not None:
                self._record_step(rec, names, event)
            return
        rec.record(event.step, event.sigma, "event", event.name)
        if event.name == "sampler_end":
            self.last = rec.finish()
            del self._runs[run_id]

    @staticmethod
    def _record_step(rec: TraceRecorder, names: dict[Any, str], event: StepEvent) -> None:
        run = event.run
        sigma = float(event.sigma) if event.sigma is not None else 0.0
        _record_hooks(rec, event.step, sigma, run.guider, names)
        _record_patches(rec, event.step, sigma, run.model)
        _record_registered(rec, event.step, sigma, run.model_options)


def _listener(model: ModelPatcher) -> TraceListener | None:
    from .events import event_listeners

    for listener in event_listeners(model, "sampler_end"):
        if listener.key == TRACE_KEY and isinstance(listener.fn, TraceListener):
            return listener.fn
    return None


def enable_trace(model: ModelPatcher, *, logger: logging.Logger = LOGGER) -> ModelPatcher:
    """Record a Trace of every sampler run of ``model`` (and of clones made from it afterwards).

    Changes ``model`` in place and returns it: call it on a clone you own (``upgrade(model)``).
    Idempotent: a model already traced keeps its listener and its last trace.

    Every row is also logged at DEBUG on the ``patchbay.trace`` logger. ``last_trace`` answers for the
    model given to ``enable_trace`` and for every clone made of it afterwards (they share one listener),
    so a node downstream of the sampler that receives the same MODEL reads the run that just finished.
    ComfyUI-dependent modules are imported only inside the functions that take a model, so the data
    types and the recorder work without ComfyUI (T0 tests, trace_plot).
    """
    from .events import EVENTS, add_event_listener

    if _listener(model) is None:
        listener = TraceListener(logger)
        for name in EVENTS:
            add_event_listener(model, name, TRACE_KEY, listener, priority=TRACE_PRIORITY, replace=True)
    return model


def disable_trace(model: ModelPatcher) -> ModelPatcher:
    """Stop tracing ``model`` (its clones made earlier keep tracing); returns ``model``."""
    from .events import EVENTS, remove_event_listener

    for name in EVENTS:
        remove_event_listener(model, name, TRACE_KEY)
    return model


def trace_enabled(model: ModelPatcher) -> bool:
    return _listener(model) is not None


def last_trace(model: ModelPatcher) -> Trace | None:
    """The Trace of the last run that finished on ``model`` or a clone sharing its listener, else None."""
    listener = _listener(model)
    return listener.last if listener is not None else None
