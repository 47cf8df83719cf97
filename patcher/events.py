"""Sampler step events (sampler_start, step_start, evaluation, step_end, sampler_end) on any ModelPatcher,
built only from core's wrappers and callbacks, with the global step of a split run. Data flow:
docs/architecture.md; API: docs/node-authors.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import registry
from .calls import argument, with_argument
from .errors import DuplicateKeyError, UnknownEventError
from .ordering import did_you_mean, namespaced_key
from .schedule import locate, step_mode
from .signatures import EVENT_LISTENER_SHAPE, check_signature
from .state import existing_state, patchbay_state, require_model
from .step_clock import SIGMA_MODE, Emission, ScheduleMatch, StepTracker

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

__all__ = [
    "EVENTS",
    "Listener",
    "SamplingRun",
    "StepEvent",
    "add_event_listener",
    "event_listeners",
    "on_sampler_end",
    "on_sampler_start",
    "on_step_end",
    "on_step_start",
    "remove_event_listener",
    "set_event_listener",
]

EVENTS = ("sampler_start", "step_start", "step_end", "sampler_end", "evaluation")
DISPATCH_KEY = "patchbay.events"
DISPATCH_PRIORITY = -1_000_000  # innermost: sees the sigmas and callback the sampler really gets
RUN_KEY = "patchbay.run"


@dataclass(frozen=True)
class SamplingRun:
    """One sampler run: what every event of the run shares. Read it, do not change it."""

    model: Any  # the ModelPatcher being sampled (the guider's model_patcher)
    guider: Any  # the CFGGuider (``.conds`` holds the processed conds during the run)
    sampler: Any  # the KSAMPLER (or other Sampler) object
    model_options: dict  # the run's model_options (transformer_options["wrappers"] as they run)
    sigmas: tuple[float, ...]  # the run's own sigmas
    match: ScheduleMatch  # where they sit in the full schedule
    mode: str  # "callback" or "sigma" (patcher/step_clock.py)


@dataclass(frozen=True)
class StepEvent:
    """What a listener receives.

    name: one of EVENTS. step: global step index (sampler_start: the run's first step, sampler_end:
    its last). total_steps: steps of the full schedule. sigma: the step's starting sigma (evaluation:
    the evaluated sigma). sigmas: the run's sigmas; schedule: the full schedule (== sigmas when
    ``schedule_known`` is False). x / denoised: tensors where the sampler provides them (step_end:
    the sampler's callback values; evaluation: model input and CFG result; sampler_end: the output
    latent), else None. Treat tensors as read-only. evaluation: index of the model call within its
    step (evaluation events only).
    """

    name: str
    step: int
    total_steps: int
    sigma: float | None
    sigmas: tuple[float, ...]
    schedule: tuple[float, ...]
    first_step: int
    run_steps: int
    schedule_known: bool
    x: Any = field(default=None, repr=False, compare=False)
    denoised: Any = field(default=None, repr=False, compare=False)
    evaluation: int | None = None
    run: SamplingRun | None = field(default=None, repr=False, compare=False)

    @property
    def run_step(self) -> int:
        """The step index within this run (0-based)."""
        return self.step - self.first_step


@dataclass(frozen=True)
class Listener:
    """One registered listener; higher ``priority`` is called first, ties in registration order."""

    event: str
    key: str
    fn: Callable[[StepEvent], Any]
    priority: int = 0
    seq: int = 0


class ListenerTable:
    """``PatchbayState.events``: listeners per event and key. A clone gets its own table, same functions."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Listener]] = {}
        self.seq = 0

    def copy(self) -> ListenerTable:
        copy = ListenerTable()
        copy.entries = {event: dict(keys) for event, keys in self.entries.items()}
        copy.seq = self.seq
        return copy

    def __bool__(self) -> bool:
        return any(self.entries.values())

    def ordered(self, event: str) -> list[Listener]:
        return sorted(self.entries.get(event, {}).values(), key=lambda item: (-item.priority, item.seq))


def _resolve_event(name: str) -> str:
    if name in EVENTS:
        return name
    raise UnknownEventError(
        f"unknown sampler event {name!r}.{did_you_mean(name, EVENTS)} Use one of: {', '.join(EVENTS)}."
    )


def _table(model: ModelPatcher | None) -> ListenerTable | None:
    state = existing_state(model) if model is not None else None
    return None if state is None else state.events


def _sync_dispatch(model: ModelPatcher) -> None:
    if _table(model):
        for type_, fn in (("sampler_sample", _sampler_sample), ("predict_noise", _predict_noise)):
            registry.add_wrapper(model, type_, DISPATCH_KEY, fn, priority=DISPATCH_PRIORITY)
    else:
        registry.remove_wrapper(model, "sampler_sample", DISPATCH_KEY)
        registry.remove_wrapper(model, "predict_noise", DISPATCH_KEY)


def add_event_listener(model: ModelPatcher, event: str, key: str, fn: Callable[[StepEvent], Any], *,
                       priority: int = 0, replace: bool = False, verbatim: bool = False) -> Listener:
    """Call ``fn(event)`` on ``event`` of every sampler run of ``model`` (and of its later clones).

    Keyed like the registry (``patchbay.<key>`` unless namespaced): the same ``fn`` again is a no-op,
    a different one raises DuplicateKeyError unless ``replace=True`` (see ``set_event_listener``).
    Changes ``model`` in place: call it on a clone you own.

    Listeners are ``fn(event: StepEvent)``; their exceptions propagate unchanged (core's cleanup still
    restores the model). The wrappers are installed while a listener exists and removed with the last one;
    listeners live in the "patchbay" attachment, so clones keep them.
    """
    model = require_model(model)
    name = _resolve_event(event)
    full_key = namespaced_key(key, verbatim=verbatim)
    check_signature(fn, EVENT_LISTENER_SHAPE, what=f"listener for {name!r}")
    state = patchbay_state(model)
    if state.events is None:
        state.events = ListenerTable()
    table = state.events
    existing = table.entries.get(name, {}).get(full_key)
    if existing is not None and existing.fn is not fn and not replace:
        raise DuplicateKeyError(
            f"listener key {full_key!r} for {name!r} already holds {existing.fn!r}; use set_event_listener"
            f"(...) to replace it, or remove_event_listener(model, {name!r}, {key!r}) first."
        )
    seq = existing.seq if existing is not None else table.seq
    table.seq += existing is None
    listener = Listener(name, full_key, fn, priority, seq)
    table.entries.setdefault(name, {})[full_key] = listener
    _sync_dispatch(model)
    return listener


def set_event_listener(model: ModelPatcher, event: str, key: str, fn: Callable[[StepEvent], Any], *,
                       priority: int = 0, verbatim: bool = False) -> Listener:
    """``add_event_listener`` that replaces whatever ``key`` held for ``event``."""
    return add_event_listener(model, event, key, fn, priority=priority, replace=True, verbatim=verbatim)


def remove_event_listener(model: ModelPatcher, event: str, key: str, *, verbatim: bool = False) -> bool:
    """Remove the listener under ``key`` for ``event``; False if there was none."""
    model = require_model(model)
    name = _resolve_event(event)
    table = _table(model)
    removed = table is not None and table.entries.get(name, {}).pop(namespaced_key(key, verbatim=verbatim),
                                                                    None) is not None
    if table is not None:
        _sync_dispatch(model)
    return removed


def event_listeners(model: ModelPatcher, event: str | None = None) -> tuple[Listener, ...]:
    """The listeners of ``model`` (for one event or all), in call order per event."""
    table = _table(require_model(model))
    if table is None:
        return ()
    names = EVENTS if event is None else (_resolve_event(event),)
    return tuple(listener for name in names for listener in table.ordered(name))


def on_sampler_start(model: ModelPatcher, key: str, fn: Callable[[StepEvent], Any], *, priority: int = 0
                     ) -> Listener:
    """``add_event_listener(model, "sampler_start", key, fn)``."""
    return add_event_listener(model, "sampler_start", key, fn, priority=priority)


def on_step_start(model: ModelPatcher, key: str, fn: Callable[[StepEvent], Any], *, priority: int = 0
                  ) -> Listener:
    """``add_event_listener(model, "step_start", key, fn)``."""
    return add_event_listener(model, "step_start", key, fn, priority=priority)


def on_step_end(model: ModelPatcher, key: str, fn: Callable[[StepEvent], Any], *, priority: int = 0
                ) -> Listener:
    """``add_event_listener(model, "step_end", key, fn)``."""
    return add_event_listener(model, "step_end", key, fn, priority=priority)


def on_sampler_end(model: ModelPatcher, key: str, fn: Callable[[StepEvent], Any], *, priority: int = 0
                   ) -> Listener:
    """``add_event_listener(model, "sampler_end", key, fn)``."""
    return add_event_listener(model, "sampler_end", key, fn, priority=priority)


# ---- one run --------------------------------------------------------------------------------------


class _Run:
    """The live state of one sampler run; travels in transformer_options (never deep-copied)."""

    def __init__(self, info: SamplingRun, table: ListenerTable) -> None:
        self.info = info
        self.tracker = StepTracker(info.sigmas, info.mode)
        self.listeners = {name: table.ordered(name) for name in EVENTS}
        self.reports: dict[int, tuple[Any, Any]] = {}  # step -> (x, denoised) from the sampler callback
        self.latest: tuple[Any, Any] = (None, None)
        self.evaluations: dict[int, int] = {}

    def __deepcopy__(self, memo: dict) -> _Run:
        return self

    def emit(self, name: str, local_step: int, *, sigma: float | None = None, x: Any = None,
             denoised: Any = None, evaluation: int | None = None) -> None:
        listeners = self.listeners[name]
        if not listeners:
            return
        info, match = self.info, self.info.match
        if sigma is None and info.sigmas:
            sigma = info.sigmas[min(local_step, len(info.sigmas) - 1)]
        event = StepEvent(name, match.first_step + local_step, match.total_steps, sigma, info.sigmas,
                          match.schedule, match.first_step, self.tracker.steps, match.known, x, denoised,
                          evaluation, info)
        for listener in listeners:
            listener.fn(event)

    def apply(self, emissions: list[Emission], x: Any = None) -> None:
        for emission in emissions:
            if emission.name == "step_end":
                default = self.latest if self.info.mode == SIGMA_MODE else (None, None)
                end_x, denoised = self.reports.get(emission.step, default)
                self.emit("step_end", emission.step, x=end_x, denoised=denoised)
            else:
                self.emit("step_start", emission.step, x=x)

    def callback(self, index: int, denoised: Any, x: Any) -> None:
        self.latest = (x, denoised)
        if 0 <= index < self.tracker.steps:
            self.reports[index] = (x, denoised)
        self.apply(self.tracker.callback(index))

    def before_evaluation(self, sigma: float, x: Any) -> tuple[int, int]:
        emissions, step = self.tracker.evaluation(sigma)
        self.apply(emissions, x)
        count = self.evaluations.get(step, 0)
        self.evaluations[step] = count + 1
        return step, count

    def finish(self, samples: Any) -> None:
        self.apply(self.tracker.finish())
        last = max(self.tracker.steps - 1, 0)
        self.emit("sampler_end", last, sigma=self.info.sigmas[-1] if self.info.sigmas else None, x=samples)

    def wrap_callback(self, callback: Callable | None) -> Callable:
        def per_step(step, denoised, x, total_steps, *args, **kwargs):
            self.callback(step, denoised, x)
            if callback is not None:
                return callback(step, denoised, x, total_steps, *args, **kwargs)
            return None
        return per_step


def _first_float(value: Any) -> float:
    flat = value.flatten() if hasattr(value, "flatten") else [value]
    return float(flat[0])


def _start_run(model: ModelPatcher, guider: Any, sampler: Any, sigmas: Any, model_options: dict,
               table: ListenerTable) -> _Run:
    values = tuple(float(s) for s in (sigmas.tolist() if hasattr(sigmas, "tolist") else sigmas))
    match = locate(model.get_model_object("model_sampling"), values, sampler)
    info = SamplingRun(model, guider, sampler, model_options, values, match, step_mode(sampler))
    return _Run(info, table)


def _sampler_sample(executor, *args, **kwargs):
    """SAMPLER_SAMPLE wrapper: (model_wrap (the guider), sigmas, extra_args, callback, noise, ...), found by
    name in the sampler's ``sample``."""
    core = executor.original
    guider = argument(core, "model_wrap", args, kwargs)
    model = getattr(guider, "model_patcher", None)
    table = _table(model)
    if not table:
        return executor(*args, **kwargs)
    sigmas, extra_args = argument(core, "sigmas", args, kwargs), argument(core, "extra_args", args, kwargs)
    options = extra_args["model_options"].setdefault("transformer_options", {})
    run = _start_run(model, guider, executor.class_obj, sigmas, extra_args["model_options"], table)
    callback = run.wrap_callback(argument(core, "callback", args, kwargs))
    args, kwargs = with_argument(core, "callback", callback, args, kwargs)
    options[RUN_KEY] = run
    try:
        run.emit("sampler_start", 0)
        samples = executor(*args, **kwargs)
        run.finish(samples)
    finally:
        options.pop(RUN_KEY, None)
    return samples


def _predict_noise(executor, *args, **kwargs):
    """PREDICT_NOISE wrapper: (x, timestep, model_options, seed), found by name in the guider's
    ``predict_noise``; one call per model evaluation."""
    core = executor.original
    model_options = argument(core, "model_options", args, kwargs) or {}
    run = model_options.get("transformer_options", {}).get(RUN_KEY)
    if not isinstance(run, _Run):
        return executor(*args, **kwargs)
    x, sigma = argument(core, "x", args, kwargs), _first_float(argument(core, "timestep", args, kwargs))
    step, count = run.before_evaluation(sigma, x)
    denoised = executor(*args, **kwargs)
    run.emit("evaluation", step, sigma=sigma, x=x, denoised=denoised, evaluation=count)
    return denoised
