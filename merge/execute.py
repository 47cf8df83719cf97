"""The merge executor's entry point: a closed recipe streamed key by key into one .safetensors file, planned
first, streamed by a MergeSession. Data flow: docs/architecture.md; design and measurements:
docs/design-merge.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from . import io as mio
from .plan import NO_RUNTIME, MergeError, MergeOptions, MergeReport, MergeRuntime, PlanSummary, plan
from .session import MergeSession

__all__ = ["MergeError", "MergeOptions", "MergeReport", "MergeRuntime", "MergeSession", "PlanSummary",
           "merge", "plan"]  # the Python API


def merge(recipe: object, out_path: str | os.PathLike, options: MergeOptions | None = None,
          runtime: MergeRuntime = NO_RUNTIME) -> MergeReport:
    """Merge ``recipe`` (a closed recipe graph) into ``out_path``; returns a ``MergeReport``.

    Raises ``MergeError``, ``io.ModelFileError`` or ``FileExistsError`` before any output exists when
    the plan fails; an error or Ctrl-C during streaming removes the temporary file and re-raises.

    ``merge(recipe, out_path, MergeOptions(...))`` plans first (opens every input lazily, checks
    architectures, the output path, missing keys and shapes, works out every output tensor), then
    streams (merge/pipeline.py): a reader thread maps the next keys' input tensors from their files
    (read in place from the page cache), the calling thread evaluates the recipe for that key
    (merge/stream.py) and checks it (merge/checks.py), a writer thread appends the result to a temporary
    file, the disk writing as it goes (a large output around the page cache), which is fsynced and
    renamed into place at the end.
    Nothing finished stays in memory; peak memory is torch itself plus about half the memory budget.

    Speed comes from not touching memory twice: methods flagged elementwise (weighted_sum,
    add_difference, n_average, ...) run on slices of 128K elements cast to fp32 into reused buffers, so
    the working set stays in cache, the allocator never faults fresh pages and no full-size fp32 copy
    exists. Every other method gets whole fp32 tensors. Results are cast once into a reused output
    buffer. The math runs on one torch thread by default (an oversubscribed OpenMP pool is many times
    slower, and on 128K-element slices a 2-thread pool gains nothing); a large elementwise key is cut into
    ``workers`` spans (2 by default) evaluated side by side, as torch releases the GIL inside each
    operation.

    Devices: ``device="cuda"`` moves each key's inputs to the GPU and runs whole-tensor evaluation
    there (untested here: the development machine has no GPU).

    Options, the runtime (cache, path lookup, interrupt, progress callbacks), the report and the policies
    for shape mismatches and missing keys: merge/plan.py. The
    plan-then-stream steps themselves are ``MergeSession`` (merge/session.py), which other callers stream
    into other sinks (the ComfyUI Merge node fills a model's parameters).
    """
    options = options or MergeOptions()
    start = time.perf_counter()
    out_path = Path(out_path)
    mio.check_output_path(out_path, options.overwrite)
    with MergeSession(recipe, options, runtime, out_path) as session:
        report = session.report
        metadata = {"patchbay.recipe": session.recipe_text(), "patchbay.generator": "ComfyUI-Patchbay merge"}
        outputs = [mio.OutputTensor(p.key, p.dtype, p.shape) for p in session.plans]
        with mio.SafetensorsWriter(out_path, outputs, metadata, options.overwrite, options.fsync) as writer:
            session.stream(writer)
            writer.commit()
        session.finish()
        report.keys = len(writer.entries)
        report.bytes_written = writer.position
    report.seconds = time.perf_counter() - start
    return report
