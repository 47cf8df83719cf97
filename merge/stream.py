"""Streaming a planned merge: read-ahead thread, per-key evaluation, writer thread.

Three threads share the work and never hold more than a few keys: the reader fills one of a few
reused byte arenas with the next key's raw input tensors (``os.preadv``, GIL released) and computes
LoRA deltas; the calling thread evaluates the recipe for that key into one of two reused output
buffers; the writer appends finished buffers to the temporary output file. Buffers go back to
their pools as soon as they are consumed, so memory stays flat whatever the model size.

``Evaluator`` evaluates one key either on whole fp32 tensors or, for trees of elementwise methods,
slice by slice through small reused fp32 buffers (cache-resident, no page faults, no full-size
fp32 copies). When the intermediates of one key exceed the memory budget they are spilled to a
temporary file next to the output and read back just before the method that needs them.
"""

from __future__ import annotations

import math
import os
import queue
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .context import KeyContext
from .steps import Call, Graph, Leaf

if TYPE_CHECKING:
    from .execute import KeyPlan, MergeOptions, MergeReport
    from .io import SafetensorsWriter

ALIGN = 64
_DONE = object()


class NonFiniteError(ArithmeticError):
    """An output tensor holds inf or NaN (MergeOptions.nonfinite='error')."""


class Evaluator:
    """Evaluates the compiled recipe for one key at a time (whole tensors or elementwise slices)."""

    def __init__(self, graph: Graph, shape_policy: str, spill: Spill | None = None, spill_limit: int = 0,
                 sources: list | None = None) -> None:
        self.graph, self.shape_policy, self.spill, self.spill_limit = graph, shape_policy, spill, spill_limit
        self.sources = sources or []
        self._chunk_buffers: list[torch.Tensor] = []

    # -- whole tensors ----------------------------------------------------------------------------

    def evaluate(self, step: Any, leaves: list, ctx: KeyContext) -> Any:
        """``step`` on whole tensors; ``leaves[i]`` is source i's fp32 tensor for this key, or None."""
        if isinstance(step, Leaf):
            return leaves[step.index]
        if not isinstance(step, Call):
            return step
        args: list = []
        for arg in step.args:
            args.append(self.evaluate(arg, leaves, ctx))
            if self.spill is not None and isinstance(arg, Call):
                self._spill_if_over(args)
        if self.spill is not None:
            args = [self.spill.load(a) if isinstance(a, SpillRef) else a for a in args]
        scalars = {name: self.graph.scalar(v, ctx.key, ctx.arch) for name, v in step.kwargs.items()}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        call_ctx = context_for(ctx, step)
        if len(tensors) < len(args) and not step.method.accepts_missing:
            args = [fill_missing(step, i, a, tensors) for i, a in enumerate(args)]
            if any(a is None for a in args):  # a weight input lacks the key: pass the first one through
                return tensors[0] if tensors else None
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) <= 1:
            return step.method.fn(*args, **scalars, ctx=call_ctx)
        if self.shape_policy == "first" or len({len(s) for s in shapes}) > 1:
            return tensors[0]
        return merge_overlap(step, args, scalars, call_ctx)

    def _spill_if_over(self, args: list) -> None:
        held = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device.type != "meta"]
        if sum(args[i].numel() * args[i].element_size() for i in held) > self.spill_limit:
            for i in held:
                args[i] = self.spill.store(args[i])

    # -- elementwise slices -------------------------------------------------------------------------

    def evaluate_chunked(self, root: Any, raw: list, ctx: KeyContext, out: torch.Tensor, chunk: int) -> None:
        """Evaluate an elementwise tree slice by slice into ``out`` (flat, output dtype)."""
        prepared: dict[int, tuple[dict, KeyContext]] = {}
        leaf_count = self._prepare(root, ctx, prepared)
        while len(self._chunk_buffers) < leaf_count:
            self._chunk_buffers.append(torch.empty(chunk, dtype=torch.float32))
        flat = [0.0 if r is None else r.reshape(-1) for r in raw]  # None: a delta source without the key
        total = out.numel()
        for start in range(0, total, chunk):
            end = min(total, start + chunk)
            counter = iter(self._chunk_buffers)
            result = self._slice(root, flat, start, end, prepared, counter)
            if result.numel() != end - start:
                raise RuntimeError(f"{ctx.key}: an elementwise method changed the element count")
            out[start:end].copy_(result.reshape(-1))

    def _prepare(self, step: Any, ctx: KeyContext, prepared: dict) -> int:
        if isinstance(step, Leaf):
            return 1
        if not isinstance(step, Call):
            return 0
        scalars = {name: self.graph.scalar(v, ctx.key, ctx.arch) for name, v in step.kwargs.items()}
        prepared[id(step)] = (scalars, context_for(ctx, step))
        return sum(self._prepare(a, ctx, prepared) for a in step.args)

    def _slice(self, step: Any, flat: list, start: int, end: int, prepared: dict, buffers) -> Any:
        if isinstance(step, Leaf):
            buffer, source = next(buffers)[: end - start], flat[step.index]
            return buffer.fill_(source) if isinstance(source, float) else buffer.copy_(source[start:end])
        if not isinstance(step, Call):
            return step
        args = [self._slice(a, flat, start, end, prepared, buffers) for a in step.args]
        scalars, ctx = prepared[id(step)]
        return step.method.fn(*args, **scalars, ctx=ctx)


def context_for(ctx: KeyContext, step: Call) -> KeyContext:
    """The KeyContext of one (method call, key): its cache persists across merges of this recipe."""
    return KeyContext(key=ctx.key, cache=step.cache.setdefault(ctx.key, {}), seed=ctx.seed,
                      device=ctx.device, arch=ctx.arch)


def fill_missing(step: Call, index: int, value: Any, tensors: list) -> Any:
    """A missing delta-space input contributes zeros; a missing weight input stays None."""
    if value is None and tensors and step.method.input_space(index) == "delta":
        return torch.zeros_like(tensors[0])
    return value


def merge_overlap(step: Call, args: list, scalars: dict, ctx: KeyContext) -> torch.Tensor:
    """The method on the common leading region; outside it the first input's values stay."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    region = tuple(slice(0, min(a.shape[d] for a in args if isinstance(a, torch.Tensor)))
                   for d in range(first.dim()))
    sliced = [a[region] if isinstance(a, torch.Tensor) else a for a in args]
    merged = step.method.fn(*sliced, **scalars, ctx=ctx)
    if first.device.type == "meta":
        return torch.empty(first.shape, device="meta")
    out = first.clone()
    out[region] = merged
    return out


def chunkable(step: Any) -> bool:
    """Whether a step can be evaluated slice by slice (elementwise calls over leaves and scalars)."""
    if isinstance(step, Call):
        return step.elementwise and all(chunkable(a) for a in step.args)
    return True


def all_finite(out: torch.Tensor) -> bool:
    """True when every element is finite: one sum (inf/NaN propagate), an exact mask only when that
    sum is not finite (it may have overflowed the dtype's range)."""
    if math.isfinite(out.sum().item()):  # accumulates in fp32 for fp16/bf16, without a widened copy
        return True
    return bool(torch.isfinite(out).all())


# ---- spill file ---------------------------------------------------------------------------------------


class SpillRef:
    """A tensor parked in the spill file: offset, dtype, shape, device."""

    def __init__(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
        self.offset, self.dtype, self.shape, self.device = offset, dtype, shape, device


class Spill:
    """A temporary file next to the output for intermediates over the memory budget (rewound per key)."""

    def __init__(self, folder: Path) -> None:
        self.fd, name = tempfile.mkstemp(dir=folder, prefix=".patchbay-merge-", suffix=".spill")
        os.unlink(name)  # anonymous: vanishes with the descriptor, whatever happens
        self.position = 0
        self.spilled_bytes = 0

    def rewind(self) -> None:
        self.position = 0

    def store(self, tensor: torch.Tensor) -> SpillRef:
        data = tensor.detach().to("cpu").contiguous()
        view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
        ref = SpillRef(self.position, tensor.dtype, tuple(tensor.shape), tensor.device)
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], self.position + done)
        self.position += len(view) + (-len(view) % ALIGN)
        self.spilled_bytes += len(view)
        return ref

    def load(self, ref: SpillRef) -> torch.Tensor:
        out = torch.empty(ref.shape, dtype=ref.dtype)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            done += os.preadv(self.fd, [view[done:]], ref.offset + done)
        return out.to(ref.device)

    def close(self) -> None:
        os.close(self.fd)


# ---- the pipeline -------------------------------------------------------------------------------------


def run(graph: Graph, sources: list, plans: list[KeyPlan], writer: SafetensorsWriter, options: MergeOptions,
        report: MergeReport) -> None:
    """Stream every planned key through read-ahead, evaluation and the writer (see module docstring)."""
    budget = options.memory_budget_mb * 2**20
    arena_bytes = max((_arena_size(sources, p) for p in plans), default=ALIGN)
    arenas = max(1, min(options.prefetch + 1, (budget // 2) // max(arena_bytes, 1)))
    out_bytes = max((math.prod(p.shape) * p.dtype.itemsize for p in plans), default=ALIGN)
    spill = Spill(writer.path.parent)
    evaluator = Evaluator(graph, options.shape_policy, spill, budget // 2, sources)
    pipe = _Pipeline(sources, plans, writer, arenas, arena_bytes, out_bytes)
    previous_threads = torch.get_num_threads()
    if options.threads > 0:
        torch.set_num_threads(options.threads)
    try:
        pipe.start()
        progress = _progress(options, sum(math.prod(p.shape) * p.dtype.itemsize for p in plans), writer.path)
        with progress:
            for plan, arena, raw in pipe.inputs():
                spill.rewind()
                result = compute_key(evaluator, graph, plan, raw, pipe.take_out_buffer(), options, report)
                pipe.release_arena(arena)
                if result is not None:
                    pipe.write(plan.key, result)
                progress.update(math.prod(plan.shape) * plan.dtype.itemsize)
        pipe.finish()
    finally:
        pipe.stop()
        torch.set_num_threads(previous_threads)
        report.spilled_bytes = spill.spilled_bytes
        spill.close()


def compute_key(evaluator: Evaluator, graph: Graph, plan: KeyPlan, raw: list, out_buffer: torch.Tensor,
                options: MergeOptions, report: MergeReport) -> torch.Tensor | None:
    """Evaluate one key into ``out_buffer``; returns the typed output view (None: key dropped)."""
    if plan.passthrough is not None:
        source = raw[plan.passthrough]
        out = out_buffer[: source.numel() * source.element_size()].view(source.dtype).view(source.shape)
        return out.copy_(source)
    ctx = KeyContext(key=plan.key, seed=options.seed, device=options.device, arch=report.arch)
    numel = math.prod(plan.shape)
    shapes = {tuple(r.shape) for r in raw if r is not None}
    complete = all(r is not None or s.space == "delta" for r, s in zip(raw, evaluator.sources, strict=True))
    if (options.device == "cpu" and complete and len(shapes) == 1
            and next(iter(shapes)) == plan.shape and chunkable(graph.root)):
        out = out_buffer[: numel * plan.dtype.itemsize].view(plan.dtype)
        evaluator.evaluate_chunked(graph.root, raw, ctx, out, options.chunk_elements)
        out = out.view(plan.shape)
    else:
        leaves = [None if r is None else r.to(options.device).float() for r in raw]
        result = evaluator.evaluate(graph.root, leaves, ctx)
        if result is None:
            report.skipped.append(plan.key)
            return None
        size = result.numel() * plan.dtype.itemsize
        if size > out_buffer.numel():
            out_buffer = torch.empty(size, dtype=torch.uint8)
        out = out_buffer[:size].view(plan.dtype).view(result.shape).copy_(result)
    if not all_finite(out):
        if options.nonfinite == "error":
            raise NonFiniteError(f"{plan.key}: the merged tensor holds inf or NaN; check the recipe's "
                                 "parameters (or merge with nonfinite='warn' to write it anyway)")
        report.nonfinite.append(plan.key)
    return out


def _arena_size(sources: list, plan: KeyPlan) -> int:
    total = 0
    for source, present in zip(sources, plan.present, strict=True):
        if present and hasattr(source, "read_into"):
            size = source.info(plan.key).nbytes
            total += size + (-size % ALIGN)
    return max(total, ALIGN)


class _NullProgress:
    def __enter__(self) -> _NullProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int) -> None:
        return None


def _progress(options: MergeOptions, total: int, path: Path) -> Any:
    if not options.progress:
        return _NullProgress()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=path.name, leave=False)


class _Pipeline:
    """The reader and writer threads with their buffer pools; errors surface in the calling thread."""

    def __init__(self, sources: list, plans: list, writer: SafetensorsWriter, arenas: int, arena_bytes: int,
                 out_bytes: int) -> None:
        self.sources, self.plans, self.writer = sources, plans, writer
        self.free_arenas: queue.Queue = queue.Queue()
        for _ in range(arenas):
            self.free_arenas.put(torch.empty(arena_bytes, dtype=torch.uint8))
        self.free_out: queue.Queue = queue.Queue()
        for _ in range(2):
            self.free_out.put(torch.empty(out_bytes, dtype=torch.uint8))
        self.ready: queue.Queue = queue.Queue()
        self.to_write: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.reader = threading.Thread(target=self._read_all, name="patchbay-merge-reader", daemon=True)
        self.writer_thread = threading.Thread(target=self._write_all, name="patchbay-merge-writer",
                                              daemon=True)
        self._pending_out: torch.Tensor | None = None
        self.main = threading.current_thread()

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
        try:
            for plan in self.plans:
                arena = self._get(self.free_arenas)
                raw, offset = [], 0
                for source, present in zip(self.sources, plan.present, strict=True):
                    if not present:
                        raw.append(None)
                    elif hasattr(source, "read_into"):
                        tensor = source.read_into(plan.key, arena[offset:])
                        offset += tensor.numel() * tensor.element_size()
                        offset += -offset % ALIGN
                        raw.append(tensor)
                    else:
                        raw.append(source.delta(plan.key))
                self.ready.put((plan, arena, raw))
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

    def release_arena(self, arena: torch.Tensor) -> None:
        self.free_arenas.put(arena)

    def take_out_buffer(self) -> torch.Tensor:
        if self._pending_out is None:
            self._pending_out = self._get(self.free_out)
        return self._pending_out

    def write(self, key: str, tensor: torch.Tensor) -> None:
        buffer, self._pending_out = self._pending_out, None
        self.to_write.put((key, tensor.contiguous(), buffer))

    def _write_all(self) -> None:
        try:
            while True:
                item = self._get(self.to_write)
                if item is _DONE:
                    return
                key, tensor, buffer = item
                self.writer.append(key, tensor)
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
        self.stopping.set()
        for thread in (self.reader, self.writer_thread):
            if thread.is_alive():
                thread.join()


class _Stopped(Exception):
    """Raised inside a pipeline thread when the merge is being torn down."""
