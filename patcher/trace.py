"""What was applied when: the trace of one sampling run, for DEBUG logs and the timeline node.

Data flow::

    step events (patcher/events.py) + registry wrappers/callbacks + hooks seen per step
        --TraceRecorder.record(...)--> TraceEvent rows --finish()--> Trace (frozen)
    Trace --last_trace(model)--> nodes (timeline IMAGE + STRING report, patcher/trace_plot.py)

Every row is also logged at DEBUG under the ``patchbay`` logger.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Trace", "TraceEvent"]


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
    """The events of one sampling run, in the order they happened."""

    events: tuple[TraceEvent, ...]
    total_steps: int
    sigmas: tuple[float, ...] = ()
