"""What the executor checks in every merged float tensor before it is written: no inf or NaN, and no value
far beyond every input's range (a broken merge with finite values is worse than an error).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .plan import KeyPlan, MergeOptions, MergeReport

RANGE_FACTOR = 100.0  # "far beyond": more than this times the largest magnitude of any input
SAMPLE = 4096  # elements of each input in memory that bound the inputs' magnitude from below


class NonFiniteError(ArithmeticError):
    """An output tensor holds inf or NaN (MergeOptions.nonfinite='error'); ``key`` and ``origin`` (an
    input file or the recipe) let an embedding caller word its own fix."""

    def __init__(self, key: str, origin: str) -> None:
        super().__init__(f"{key}: the merged tensor holds inf or NaN; {origin}; or write it anyway with "
                         "--nonfinite warn (MergeOptions(nonfinite='warn'))")
        self.key, self.origin = key, origin


def magnitude(tensor: torch.Tensor) -> float:
    """The largest absolute value of a float tensor, in one pass; NaN when it holds a NaN, inf for an
    inf, 0 when it is empty."""
    if tensor.numel() == 0:
        return 0.0
    low, high = (float(v) for v in torch.aminmax(tensor))
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def larger(a: float, b: float) -> float:
    """The larger of two magnitudes, NaN if either is (Python's ``max`` depends on the order for NaN)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def all_finite(tensor: torch.Tensor) -> bool:
    return math.isfinite(magnitude(tensor))


def known_magnitude(raw: list) -> float:
    """A lower bound of the inputs' largest magnitude from what is in memory: the first ``SAMPLE``
    elements of each input of the unit just evaluated (None where absent)."""
    return max((magnitude(r.reshape(-1)[:SAMPLE]) for r in raw if r is not None and r.is_floating_point()),
               default=0.0)


def check_output(out: torch.Tensor, plan: KeyPlan, options: MergeOptions, report: MergeReport, sources: list,
                 known: float, size: float | None = None) -> torch.Tensor:
    """``out`` (one key's finished output, as it will be written) after the checks of the module
    docstring; ``known`` bounds the inputs' largest magnitude from below (``known_magnitude``); ``size`` is
    ``magnitude(out)`` where the evaluator measured it while writing ``out`` (None: measured here). The
    pipeline runs it in its writer thread before the key is written or cached (and, for the keys
    already handed over when a merge stops, in the calling thread before they are cached).

    A broken merge is worse than an error when its values are finite: model_stock's degenerate cases once
    wrote +-3.4e38 into 1x1 convolutions, a model that loads and samples NaN. So each output key is
    checked over the tensor as written (``torch.aminmax``, which propagates NaN) before the key is written
    or cached: an elementwise key's magnitude is measured by the evaluator slice by slice as it writes
    them (merge/stream.py), any other key's in one pass here, in the pipeline's writer thread:

    - inf or NaN: ``MergeOptions.nonfinite`` "error" raises ``NonFiniteError`` (naming the key and whether
      an input file or the recipe made it), "warn" lists the key in ``MergeReport.nonfinite``;
    - largest magnitude over ``RANGE_FACTOR`` times the largest magnitude of the key's inputs: listed in
      ``MergeReport.out_of_range`` and turned into a warning (``stream_warnings``). The inputs' magnitude
      is first bounded from below by a few thousand elements of each input in memory (the unit just
      read); only when the output passes ``RANGE_FACTOR`` times that bound are the inputs read again and
      measured whole, so a normal merge pays nothing for it.

    ``stream_warnings(report)`` turns both lists into the report's warnings once streaming is done.
    """
    size = magnitude(out) if size is None else size
    if not math.isfinite(size):
        if options.nonfinite == "error":
            raise NonFiniteError(plan.key, nonfinite_origin(sources, plan))
        if not report.nonfinite:
            report.nonfinite_origin = nonfinite_origin(sources, plan)
        report.nonfinite.append(plan.key)
        return out
    if size > RANGE_FACTOR * known:  # only then measure the whole inputs (they may reach further)
        inputs = max((magnitude(t) for t in _inputs(sources, plan)), default=0.0)
        if size > RANGE_FACTOR * inputs:
            report.out_of_range.append((plan.key, size, inputs))
    return out


def check_evaluated(result: torch.Tensor, key: str, leaves: list, options: MergeOptions, report: MergeReport,
                    sources: list) -> None:
    """The same checks for ``MergeSession.evaluate`` (one key in fp32, its inputs ``leaves`` whole in
    memory; what a recipe hook adds while sampling): inf or NaN raises (``nonfinite="error"``), a value
    far beyond every input's range is listed and logged, since no node shows it at that point."""
    size = magnitude(result)
    present = [(s, t) for s, t in zip(sources, leaves, strict=True) if t is not None]
    if not math.isfinite(size):
        origin = _origin([s.name for s, t in present if not all_finite(t)])
        if options.nonfinite == "error":
            raise NonFiniteError(key, origin)
        report.nonfinite.append(key)
        report.nonfinite_origin = report.nonfinite_origin or origin
        return
    inputs = max((magnitude(t) for _, t in present), default=0.0)
    if size > RANGE_FACTOR * inputs:
        report.out_of_range.append((key, size, inputs))
        logging.getLogger(__name__).warning("%s: the merged values reach %.3g where its inputs reach %.3g "
                                            "(over %gx): change the method or its parameters for this key",
                                            key, size, inputs, RANGE_FACTOR)


def nonfinite_origin(sources: list, plan: KeyPlan) -> str:
    """Where a non-finite output of ``plan.key`` comes from: an input file, or the recipe itself."""
    return _origin([source.name for source, tensor in zip(_present(sources, plan), _inputs(sources, plan),
                                                          strict=True) if not all_finite(tensor)])


def _origin(bad: list[str]) -> str:
    if bad:
        files = " and ".join(bad)
        return f"it comes from the input file {files}, which holds it at this key (fix or re-fetch it)"
    return "the recipe made it (every input is finite here): check the methods' parameters"


def stream_warnings(report: MergeReport) -> list[str]:
    """The warnings about the values written, once streaming is done (see the module docstring)."""
    warnings = []
    if report.nonfinite:
        shown = ", ".join(report.nonfinite[:3]) + (", ..." if len(report.nonfinite) > 3 else "")
        warnings.append(f"{len(report.nonfinite)} tensors hold inf or NaN and were written anyway "
                        f"(--nonfinite warn): {shown}; at the first, {report.nonfinite_origin}")
    if report.out_of_range:
        key, size, inputs = report.out_of_range[0]
        more = f" and {len(report.out_of_range) - 1} more" if len(report.out_of_range) > 1 else ""
        warnings.append(f"{len(report.out_of_range)} tensors hold values far beyond every input's range: "
                        f"{key}{more} reaches {size:.3g} where its inputs reach {inputs:.3g} (over "
                        f"{RANGE_FACTOR:g}x); a model with such values samples noise or NaN. The recipe made "
                        f"them: change the method or its parameters for these keys (a block map can set "
                        f"them per block)")
    return warnings


def _present(sources: list, plan: KeyPlan) -> list:
    return [s for s, present in zip(sources, plan.present, strict=True) if present]


def _inputs(sources: list, plan: KeyPlan) -> list[Any]:
    """Every present input's whole float tensor for ``plan.key``, read again (the unit in memory may be a
    slice of it)."""
    tensors = []
    for source in _present(sources, plan):
        if hasattr(source, "read_into"):
            info = source.info(plan.key)
            tensor = source.read_into(plan.key, torch.empty(info.nbytes, dtype=torch.uint8))
        else:
            tensor = source.tensor(plan.key)
        tensors.append(tensor if tensor.is_floating_point() else torch.zeros(0))
    return tensors
