"""Streaming a planned merge: a read-ahead thread, per-key evaluation in the calling thread and a writer
thread, holding only a few keys at a time so memory stays flat whatever the model size.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from .checks import check_output, known_magnitude, larger
from .context import KeyContext
from .executable import CompiledRecipe
from .io import ALIGN
from .plan import NO_RUNTIME, cache_salt
from .stream import Evaluator, Spill, chunkable

if TYPE_CHECKING:
    from .plan import KeyPlan, MergeOptions, MergeReport, MergeRuntime

_DONE = object()
OUT_BUFFERS = (2, 6)  # the calling thread computes into one while the writer drains the others


@dataclass(frozen=True)
class Unit:
    """What the reader reads at once: a whole key, or elements ``start:end`` of it (``sliced``); a key
    found in the cache is not read at all (``cached``)."""

    plan: KeyPlan
    start: int = 0
    end: int = 0
    sliced: bool = False
    cached: torch.Tensor | None = None


def run(graph: CompiledRecipe, sources: list, plans: list[KeyPlan], sink: Any, options: MergeOptions,
        report: MergeReport, spill_dir: Path | None = None, runtime: MergeRuntime = NO_RUNTIME) -> None:
    """Stream every planned key through read-ahead, evaluation and ``sink``.

    Three threads share the work and never hold more than a few keys: the reader maps the next units'
    input tensors from their files (``SafetensorsFile.map``: read in place from the page cache, its page
    faults taken in the reader, GIL released) and computes LoRA deltas, at most ``prefetch + 1`` units
    ahead; the calling thread evaluates the recipe into one of two to six reused output buffers (a large
    elementwise key in spans, side by side with ``MergeOptions.workers - 1`` math threads, measuring
    what it writes for the checks); the writer checks each finished tensor (merge/checks.py), caches it
    and appends it to the temporary output file (the disk writing as it goes: merge/io.py). Deep
    queues matter on a busy machine: a thread that was not scheduled for a while catches up without
    stalling the others. A unit's inputs are released by the reader once the calling thread is done
    with them, and buffers go back to their pools as soon as they are consumed.

    A unit is a whole key, or, for elementwise recipes whose inputs for one key would be more than an
    eighth of the memory budget (eight inputs of SD1.5's largest conv are 472 MB), a slice of its
    elements: the reader then maps that byte range of every input and the slices are evaluated into the
    key's output buffer.

    With a ``MergeCache`` (``MergeRuntime.cache``), a key whose result is cached under the same
    ``CompiledRecipe.key_id`` is written from the cache without reading its inputs, and each computed key is
    stored (only those in ``MergeRuntime.cache_keep`` when it is given). ``MergeRuntime.check`` runs
    before every unit (and inside long elementwise loops), so an interrupt stops within one key;
    ``on_progress`` follows the progress bar.

    ``sink`` is anything with ``append(key, tensor)`` (called from the writer thread; the tensor's memory
    is reused afterwards, so a sink copies what it keeps): the safetensors writer, or the ComfyUI Merge
    node's model (comfy_merge/runtime.py).
    """
    check, on_progress = runtime.check, runtime.on_progress
    budget = options.memory_budget_mb * 2**20
    capacity = max(ALIGN, budget // 8)  # a unit's inputs; the units in flight: a quarter of the budget
    cache = runtime.cache if hasattr(runtime.cache, "put") else None
    salt = cache_salt(options)
    cached = _cached_results(graph, plans, cache, salt, report.arch) if cache is not None else {}
    report.cached_keys += len(cached)
    units = list(split_units(graph, sources, plans, options, capacity, cached))
    unit_bytes = max((_unit_bytes(sources, u) for u in units), default=ALIGN)
    slots = max(1, min(options.prefetch + 1, (budget // 4) // unit_bytes))
    out_bytes = max((math.prod(p.shape) * p.dtype.itemsize for p in plans), default=ALIGN)
    outs = max(OUT_BUFFERS[0], min(OUT_BUFFERS[1], (budget // 4) // out_bytes))  # a quarter of the budget
    spill = Spill(spill_dir or options.spill_dir or Path(sink.path).parent)
    workers = max(1, min(options.workers, os.cpu_count() or 1))
    evaluator = Evaluator(graph, options.shape_policy, spill, budget // 2, sources, cache=cache, salt=salt,
                          check=check, workers=workers)
    pipe = _Pipeline(sources, units, sink, slots, outs, out_bytes)
    previous_threads = torch.get_num_threads()
    if options.threads > 0:
        torch.set_num_threads(options.threads)
    try:
        pipe.start()
        total, done = sum(math.prod(p.shape) * p.dtype.itemsize for p in plans), 0
        with _progress(options, total, Path(getattr(sink, "path", "merge"))) as bar:
            for unit, raw in pipe.inputs():
                if check is not None:
                    check()
                _run_unit(pipe, evaluator, graph, unit, raw, options, report, cache, salt,
                          runtime.cache_keep)
                size = (unit.end - unit.start) if unit.sliced else math.prod(unit.plan.shape)
                bar.update(size * unit.plan.dtype.itemsize)
                done += size * unit.plan.dtype.itemsize
                if on_progress is not None:
                    on_progress(min(total, done), total)
        pipe.finish()
    finally:
        pipe.stop()
        evaluator.close()
        torch.set_num_threads(previous_threads)
        report.spilled_bytes = spill.spilled_bytes
        spill.close()


def _run_unit(pipe: _Pipeline, evaluator: Evaluator, graph: CompiledRecipe, unit: Unit, raw: Any,
              options: MergeOptions, report: MergeReport, cache: Any, salt: tuple,
              cache_keep: Any = None) -> None:
    """Evaluate one unit (or take it from the cache) and hand a finished key to the writer; ``cache_keep``
    as ``MergeRuntime.cache_keep``."""
    plan = unit.plan
    if unit.cached is not None:
        if unit.cached is DROPPED:
            report.skipped.append(plan.key)
        else:
            pipe.write(plan.key, unit.cached, cached=True)
        return
    spill = evaluator.spill
    if spill is not None:
        spill.rewind()
    out_buffer = pipe.take_out_buffer()
    if unit.sliced:
        result, size = _compute_slice(pipe, evaluator, graph, unit, raw, out_buffer, options, report)
    else:
        result, size = compute_key(evaluator, graph, plan, raw, out_buffer, options, report)
    known = known_magnitude(raw) if result is not None and plan.passthrough is None else 0.0
    pipe.release(raw)
    if result is None:
        if cache is not None and plan.passthrough is None and not unit.sliced:  # the recipe dropped it
            cache.put(root_id(graph, plan, salt, report.arch), DROPPED)
            cache.settle()
        return
    if plan.passthrough is not None:  # copied, not computed: nothing to check or cache
        pipe.write(plan.key, result)
        return

    ident = root_id(graph, plan, salt, report.arch) if cache is not None else None
    keep = cache is not None and (cache_keep is None or ident in cache_keep)

    def checked(out: torch.Tensor) -> None:  # in the writer thread: checked, then cached, then written
        check_output(out, plan, options, report, evaluator.sources, known, size)
        if keep:
            cache.put_copy(ident, out, keep=cache_keep)

    pipe.write(plan.key, result, before=checked)
    if cache is not None:  # here, not in the writer: the methods fill their cache dicts in this thread,
        cache.settle()  # and settle drops the dicts still empty (it would race a method filling one)


DROPPED = torch.empty(0)  # cached for a key the recipe leaves out (pick_component): nothing to write


def root_id(graph: CompiledRecipe, plan: KeyPlan, salt: tuple, arch: str) -> tuple:
    """The cache id of one output key's final result (in its output dtype)."""
    return ("root", str(plan.dtype), salt, graph.key_id(graph.root, plan.key, arch))


def _cached_results(graph: CompiledRecipe, plans: list[KeyPlan], cache: Any, salt: tuple, arch: str) -> dict:
    """key -> cached final result, for the float keys the cache holds."""
    cache.new_run()
    found = {}
    for plan in plans:
        if plan.passthrough is None:
            value = cache.get(root_id(graph, plan, salt, arch))
            if value is not None:
                found[plan.key] = value
    return found


def split_units(graph: CompiledRecipe, sources: list, plans: list[KeyPlan], options: MergeOptions,
                capacity: int, cached: dict | None = None) -> Iterator[Unit]:
    """One unit per key, or element slices of at most ``capacity`` input bytes for sliceable keys."""
    for plan in plans:
        if cached and plan.key in cached:
            yield Unit(plan, cached=cached[plan.key])
            continue
        whole = Unit(plan)
        if _unit_bytes(sources, whole) <= capacity or not _sliceable(graph, sources, plan, options):
            yield whole
            continue
        numel = math.prod(plan.shape)
        per_element = sum(s.info(plan.key).torch_dtype.itemsize for s in sources)
        chunk = options.chunk_elements
        step = max(chunk, capacity // per_element // chunk * chunk)
        for start in range(0, numel, step):
            yield Unit(plan, start, min(numel, start + step), sliced=True)


def _sliceable(graph: CompiledRecipe, sources: list, plan: KeyPlan, options: MergeOptions) -> bool:
    return (plan.passthrough is None and options.device == "cpu" and chunkable(graph.root)
            and all(present and hasattr(s, "map") and s.info(plan.key).shape == plan.shape
                    for s, present in zip(sources, plan.present, strict=True)))


def _unit_bytes(sources: list, unit: Unit) -> int:
    if unit.cached is not None:
        return ALIGN
    total = 0
    for source, present in zip(sources, unit.plan.present, strict=True):
        if present and hasattr(source, "map"):
            info = source.info(unit.plan.key)
            size = (unit.end - unit.start) * info.torch_dtype.itemsize if unit.sliced else info.nbytes
            total += size + (-size % ALIGN)
    return max(total, ALIGN)


def _compute_slice(pipe: _Pipeline, evaluator: Evaluator, graph: CompiledRecipe, unit: Unit, raw: list,
                   out_buffer: torch.Tensor, options: MergeOptions, report: MergeReport
                   ) -> tuple[torch.Tensor | None, float | None]:
    """Evaluate one slice into the key's output buffer; the finished key (and its largest magnitude) once
    its last slice is in, (None, None) before."""
    plan = unit.plan
    numel = math.prod(plan.shape)
    out = out_buffer[: numel * plan.dtype.itemsize].view(plan.dtype)
    ctx = KeyContext(key=plan.key, seed=options.seed, device=options.device, arch=report.arch)
    size = evaluator.evaluate_chunked(graph.root, raw, ctx, out[unit.start:unit.end], options.chunk_elements)
    key = pipe.assembling
    key.size = larger(key.size, size) if unit.start else size
    return (out.view(plan.shape), key.size) if unit.end == numel else (None, None)


def compute_key(evaluator: Evaluator, graph: CompiledRecipe, plan: KeyPlan, raw: list,
                out_buffer: torch.Tensor,
                options: MergeOptions, report: MergeReport) -> tuple[torch.Tensor | None, float | None]:
    """Evaluate one whole key into ``out_buffer``: the typed output view (None: key dropped), and its
    largest magnitude where the evaluator measured it as it wrote (elementwise keys; None otherwise)."""
    ctx = KeyContext(key=plan.key, seed=options.seed, device=options.device, arch=report.arch)
    if plan.passthrough is not None:  # not float: copied, unless the recipe drops the key
        if _dropped(evaluator, graph, raw, ctx):
            report.skipped.append(plan.key)
            return None, None
        source = raw[plan.passthrough]
        out = out_buffer[: source.numel() * source.element_size()].view(source.dtype).view(source.shape)
        return out.copy_(source), None
    numel = math.prod(plan.shape)
    shapes = {tuple(r.shape) for r in raw if r is not None}
    complete = all(r is not None or s.space == "delta" for r, s in zip(raw, evaluator.sources, strict=True))
    if (options.device == "cpu" and complete and len(shapes) == 1
            and next(iter(shapes)) == plan.shape and chunkable(graph.root)):
        out = out_buffer[: numel * plan.dtype.itemsize].view(plan.dtype)
        size = evaluator.evaluate_chunked(graph.root, raw, ctx, out, options.chunk_elements)
        return out.view(plan.shape), size
    # fp32 copies, never views of the inputs: a method may return an input unchanged, and what the cache
    # keeps must not hold a file mapping (nor its descriptor) open
    leaves = [None if r is None else r.to(options.device, torch.float32, copy=True) for r in raw]
    result = evaluator.evaluate(graph.root, leaves, ctx)
    if result is None:
        report.skipped.append(plan.key)
        return None, None
    size = result.numel() * plan.dtype.itemsize
    if size > out_buffer.numel():
        out_buffer = torch.empty(size, dtype=torch.uint8)
    return out_buffer[:size].view(plan.dtype).view(result.shape).copy_(result), None


def _dropped(evaluator: Evaluator, graph: CompiledRecipe, raw: list, ctx: KeyContext) -> bool:
    """Whether the recipe drops this key (pick/omit_component), traced on float meta tensors."""
    leaves = [None if r is None else torch.empty(r.shape, device="meta") for r in raw]
    meta = KeyContext(key=ctx.key, seed=ctx.seed, device="meta", arch=ctx.arch)
    try:
        return evaluator.evaluate(graph.root, leaves, meta) is None
    except Exception:  # noqa: BLE001 - a method that cannot trace keeps the key, as before
        return False


def _progress(options: MergeOptions, total: int, path: Path) -> tqdm:
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=path.name, leave=False,
                disable=not options.progress)


@dataclass
class _Assembling:
    """The key the calling thread is evaluating: its output buffer (taken from the pool, handed to the
    writer with the finished key) and, for a key evaluated slice by slice, the largest magnitude of its
    slices so far (merge/checks.py)."""

    buffer: torch.Tensor
    size: float = 0.0


class _Pipeline:
    """The reader and writer threads with their buffer pools; errors surface in the calling thread."""

    def __init__(self, sources: list, units: list[Unit], writer: Any, slots: int, outs: int,
                 out_bytes: int) -> None:
        self.sources, self.units, self.writer = sources, units, writer
        self.free_slots: queue.Queue = queue.Queue()  # each holds the inputs of a finished unit, or nothing
        for _ in range(slots):
            self.free_slots.put([])
        self.free_out: queue.Queue = queue.Queue()
        for _ in range(outs):
            self.free_out.put(torch.empty(out_bytes, dtype=torch.uint8))
        self.ready: queue.Queue = queue.Queue()
        self.to_write: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.reader = threading.Thread(target=self._read_all, name="patchbay-merge-reader", daemon=True)
        self.writer_thread = threading.Thread(target=self._write_all, name="patchbay-merge-writer",
                                              daemon=True)
        self.assembling: _Assembling | None = None
        self.main = threading.current_thread()
        # the threads work in the caller's inference mode (ComfyUI runs nodes under torch.inference_mode:
        # a model built there has inference tensors, which only code in inference mode may write)
        self.inference = torch.is_inference_mode_enabled()

    def start(self) -> None:
        self.reader.start()
        self.writer_thread.start()

    def _get(self, q: queue.Queue) -> Any:
        while True:
            if self.stopping.is_set():
                in_main = threading.current_thread() is self.main
                raise self.error if self.error is not None and in_main else _Stopped
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                continue

    def _read_all(self) -> None:
        with torch.inference_mode(self.inference):
            self._read_units()

    def _read_units(self) -> None:
        try:
            for unit in self.units:
                if unit.cached is not None:
                    self.ready.put((unit, None))
                    continue
                self._get(self.free_slots).clear()  # a unit's inputs, released here, off the calling thread
                raw = [_read(source, unit) if present else None
                       for source, present in zip(self.sources, unit.plan.present, strict=True)]
                self.ready.put((unit, raw))
            self.ready.put(_DONE)
        except _Stopped:
            return
        except BaseException as error:  # noqa: BLE001 - handed to the calling thread
            self.ready.put(error)

    def inputs(self):
        while True:
            item = self._get(self.ready)
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            self._check_writer()
            yield item

    def release(self, raw: list | None) -> None:
        """The calling thread is done with a unit's inputs: the reader drops them (and their mappings)."""
        self.free_slots.put(raw if raw is not None else [])

    def take_out_buffer(self) -> torch.Tensor:
        """The output buffer of the key being evaluated (the same one for each of its slices)."""
        if self.assembling is None:
            self.assembling = _Assembling(self._get(self.free_out))
        return self.assembling.buffer

    def write(self, key: str, tensor: torch.Tensor, cached: bool = False,
              before: Callable[[torch.Tensor], None] | None = None) -> None:
        """Hand ``tensor`` to the writer thread, which runs ``before(tensor)`` first (the checks)."""
        buffer = None
        if not cached and self.assembling is not None:
            buffer, self.assembling = self.assembling.buffer, None
        self.to_write.put((key, tensor.contiguous(), buffer, before))

    def _write_all(self) -> None:
        with torch.inference_mode(self.inference):
            self._write_units()

    def _write_units(self) -> None:
        try:
            while True:
                item = self._get(self.to_write)
                if item is _DONE:
                    return
                key, tensor, buffer, before = item
                if before is not None:
                    before(tensor)
                self.writer.append(key, tensor)
                if buffer is not None:
                    self.free_out.put(buffer)
        except _Stopped:
            return
        except BaseException as error:  # noqa: BLE001 - handed to the calling thread
            self.error = error
            self.stopping.set()

    def _check_writer(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self) -> None:
        self.to_write.put(_DONE)
        self.writer_thread.join()
        self._check_writer()

    def stop(self) -> None:
        """Tear down (after ``finish``, or on an error or a Cancel): the keys already computed and handed
        to the writer still pass their checks and reach the cache, so a stopped merge keeps what it
        finished, as when the cache was filled in the calling thread; nothing more is written (the
        temporary file is deleted). A key failing its check there is not cached, and its error is
        dropped: the merge is stopping for another reason already."""
        self.stopping.set()
        for thread in (self.reader, self.writer_thread):
            if thread.is_alive():
                thread.join()
        while True:
            try:
                item = self.to_write.get_nowait()
            except queue.Empty:
                return
            if item is not _DONE and item[3] is not None:
                with contextlib.suppress(Exception), torch.inference_mode(self.inference):
                    item[3](item[1])


def _read(source: Any, unit: Unit) -> torch.Tensor:
    """One input of ``unit``: mapped from its file, or the source's tensor (a LoRA delta, a MODEL)."""
    if not hasattr(source, "map"):
        return source.tensor(unit.plan.key)
    return source.map(unit.plan.key, unit.start, unit.end) if unit.sliced else source.map(unit.plan.key)


class _Stopped(Exception):
    """Raised inside a pipeline thread when the merge is being torn down."""
