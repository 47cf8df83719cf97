"""Evaluating a compiled recipe for one key (whole tensors, or slice by slice for elementwise methods),
and the spill file for intermediates over the memory budget.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .checks import larger, magnitude
from .context import KeyContext
from .executable import Call, CompiledRecipe, Leaf
from .io import ALIGN

SPLIT_SLICES = 8  # slices per worker below which a key is evaluated in one span (a hand-off costs ~0.1 ms)
CHECK_SLICES = 8  # slices written between two magnitude passes: 1 Mi elements, still in the CPU's cache


class MethodError(ValueError):
    """A merge method failed on one key; the message names the key, the method and its parameters."""


class Evaluator:
    """Evaluates the compiled recipe for one key at a time (whole tensors or elementwise slices).

    It evaluates one key either on whole fp32 tensors or, for trees of elementwise methods, slice by slice
    through small reused fp32 buffers (cache-resident, no page faults, no full-size fp32 copies). With
    ``workers`` > 1 a large key's element range is cut into that many spans (at slice boundaries)
    evaluated side by side, the calling thread taking the first: torch releases the GIL inside each
    operation, so two single-threaded workers on a 2-core machine take about 0.6x the time of one
    (measured on SD1.5's UNet, fp16 in and out), where a 2-thread torch pool on 128K-element slices gains
    nothing. Elementwise methods are pure, so the result is the same bit for bit. A param-space call given
    as a parameter is evaluated like a tensor input, in both modes. A method that raises on a key becomes
    a ``MethodError`` naming the key, the method and its parameters. A method that reads other keys
    (``related=``) gets each input at those keys, read from the sources. When the intermediates of one key
    exceed the memory budget they are spilled to a temporary file next to the output and read back just
    before the method that needs them.
    """

    def __init__(self, graph: CompiledRecipe, shape_policy: str, spill: Spill | None = None,
                 spill_limit: int = 0,
                 sources: list | None = None, cache: Any = None, salt: tuple = (),
                 check: Callable[[], None] | None = None, workers: int = 1) -> None:
        self.graph, self.shape_policy, self.spill, self.spill_limit = graph, shape_policy, spill, spill_limit
        self.sources = sources or []
        self.cache, self.salt, self.check = cache, salt, check  # MergeCache for intermediates; interrupt
        self.workers = max(1, workers)
        self._chunk_buffers: list[list[torch.Tensor]] = [[] for _ in range(self.workers)]
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the span workers (if any ran); the evaluator can still evaluate afterwards."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- whole tensors ----------------------------------------------------------------------------

    def evaluate(self, step: Any, leaves: list, ctx: KeyContext) -> Any:
        """``step`` on whole tensors; ``leaves[i]`` is source i's fp32 tensor for this key, or None.

        With a cache, the results of non-elementwise calls below the root (TIES, rotate, ...) are
        kept and reused per key (the root's final result is cached by the pipeline)."""
        if isinstance(step, Leaf):
            return leaves[step.index]
        if not isinstance(step, Call):
            return step
        if self.cache is None or step is self.graph.root or step.elementwise or str(ctx.device) != "cpu":
            return self._evaluate_call(step, leaves, ctx)
        ident = ("call", self.salt, self.graph.key_id(step, ctx.key, ctx.arch))
        found = self.cache.get(ident)
        if found is None:
            found = self._evaluate_call(step, leaves, ctx)
            if isinstance(found, torch.Tensor):
                self.cache.put(ident, found)
        return found

    def _evaluate_call(self, step: Call, leaves: list, ctx: KeyContext) -> Any:
        if step.method.related is not None:
            return self._evaluate_group(step, leaves, ctx)
        args: list = []
        for arg in step.args:
            args.append(self.evaluate(arg, leaves, ctx))
            if self.spill is not None and isinstance(arg, Call):
                self._spill_if_over(args)
        if self.spill is not None:
            args = [self.spill.load(a) if isinstance(a, SpillRef) else a for a in args]
        scalars = self._parameters(step, leaves, ctx)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        call_ctx = context_for(ctx, step)
        if scalars is None:  # a param-space parameter lacks the key: as for a missing weight input
            return tensors[0] if tensors else None
        if len(tensors) < len(args) and not step.method.accepts_missing:
            args = [fill_missing(step, i, a, tensors) for i, a in enumerate(args)]
            if any(a is None for a in args):  # a weight input lacks the key: pass the first one through,
                return next((a for i, a in enumerate(args)  # never a difference (it is no weight)
                             if a is not None and step.method.input_space(i) != "delta"), None)
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) <= 1:
            return apply(step, args, scalars, call_ctx)
        if self.shape_policy == "first" or len({len(s) for s in shapes}) > 1:
            return tensors[0]
        return merge_overlap(step, args, scalars, call_ctx)

    def _evaluate_group(self, step: Call, leaves: list, ctx: KeyContext) -> Any:
        """A ``related=`` call (merge/method_registry.py): each input evaluated at every key the method reads,
        handed over as a dict key -> tensor (a key the input lacks is left out)."""
        groups: list[dict[str, torch.Tensor]] = [{} for _ in step.args]
        for key in self.graph.related(step, ctx.key, ctx.arch):
            here, at = (leaves, ctx) if key == ctx.key else (self._leaves(key, ctx), replace(ctx, key=key))
            for group, arg in zip(groups, step.args, strict=True):
                value = self.evaluate(arg, here, at)
                if value is not None:
                    group[key] = value
        scalars = self._parameters(step, leaves, ctx)
        return None if scalars is None else apply(step, groups, scalars, context_for(ctx, step))

    def _leaves(self, key: str, ctx: KeyContext) -> list:
        """Every source's fp32 tensor of another ``key`` (meta tensors in a trace), None where it lacks it."""
        if str(ctx.device) == "meta":
            return [torch.empty(s.info(key).shape, device="meta") if s.has(key) else None
                    for s in self.sources]
        return [s.tensor(key).to(ctx.device, torch.float32) if s.has(key) else None for s in self.sources]

    def _parameters(self, step: Call, leaves: list, ctx: KeyContext) -> dict | None:
        """The call's parameters for this key: scalars, resolved maps, and evaluated param-space calls
        (``alpha=train_difference_mask(a, b, c)``); None when such a call has no value for the key."""
        values = {}
        for name, value in step.kwargs.items():
            if isinstance(value, Call):
                values[name] = self.evaluate(value, leaves, ctx)
                if values[name] is None:
                    return None
            else:
                values[name] = self.graph.scalar(value, ctx.key, ctx.arch)
        return values

    def _spill_if_over(self, args: list) -> None:
        held = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device.type != "meta"]
        if sum(args[i].numel() * args[i].element_size() for i in held) > self.spill_limit:
            for i in held:
                args[i] = self.spill.store(args[i])

    # -- elementwise slices -------------------------------------------------------------------------

    def evaluate_chunked(self, root: Any, raw: list, ctx: KeyContext, out: torch.Tensor, chunk: int) -> float:
        """Evaluate an elementwise tree slice by slice into ``out`` (flat, output dtype); a key of at
        least ``SPLIT_SLICES`` slices per worker is cut into spans evaluated side by side. Returns the
        largest magnitude written (merge/checks.py ``magnitude``: NaN if a NaN was), measured while the
        slices just written are still in the CPU's cache, so the output checks need no pass of their own.
        """
        prepared: dict[int, tuple[dict, KeyContext]] = {}
        leaf_count = self._prepare(root, ctx, prepared)
        flat = [0.0 if r is None else r.reshape(-1) for r in raw]  # None: a delta source without the key
        total = out.numel()
        slices = -(-total // chunk)
        spans = min(self.workers, slices // SPLIT_SLICES) or 1
        bounds = [total * i // spans // chunk * chunk for i in range(spans)] + [total]
        for buffers in self._chunk_buffers[:spans]:
            while len(buffers) < leaf_count:
                buffers.append(torch.empty(chunk, dtype=torch.float32))
        if spans == 1:
            return self._evaluate_span(root, flat, prepared, out, 0, total, chunk, self._chunk_buffers[0],
                                       ctx.key)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers - 1, thread_name_prefix="patchbay-merge-math")
        inference = torch.is_inference_mode_enabled()
        futures = [self._pool.submit(self._evaluate_span_in_mode, inference, root, flat, prepared, out,
                                     bounds[i], bounds[i + 1], chunk, self._chunk_buffers[i], ctx.key)
                   for i in range(1, spans)]
        try:
            size = self._evaluate_span(root, flat, prepared, out, bounds[0], bounds[1], chunk,
                                       self._chunk_buffers[0], ctx.key)
        finally:  # the other spans finish (or fail) before their buffers or inputs can be reused
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        for future in futures:
            size = larger(size, future.result())
        return size

    def _evaluate_span_in_mode(self, inference: bool, *args: Any) -> float:
        with torch.inference_mode(inference):  # as the calling thread (ComfyUI runs nodes in it)
            return self._evaluate_span(*args)

    def _evaluate_span(self, root: Any, flat: list, prepared: dict, out: torch.Tensor, begin: int, stop: int,
                       chunk: int, buffers: list[torch.Tensor], key: str) -> float:
        size, measured = 0.0, begin
        for number, start in enumerate(range(begin, stop, chunk)):
            if self.check is not None and number % 64 == 63:
                self.check()
            end = min(stop, start + chunk)
            result = self._slice(root, flat, start, end, prepared, iter(buffers))
            if result.numel() != end - start:
                raise RuntimeError(f"{key}: an elementwise method changed the element count")
            out[start:end].copy_(result.reshape(-1))
            if number % CHECK_SLICES == CHECK_SLICES - 1 or end == stop:
                size, measured = larger(size, magnitude(out[measured:end])), end
        return size

    def _prepare(self, step: Any, ctx: KeyContext, prepared: dict) -> int:
        if isinstance(step, Leaf):
            return 1
        if not isinstance(step, Call):
            return 0
        scalars = {name: self.graph.scalar(v, ctx.key, ctx.arch) for name, v in step.kwargs.items()
                   if not isinstance(v, Call)}
        prepared[id(step)] = (scalars, context_for(ctx, step))
        tensor_kwargs = [v for v in step.kwargs.values() if isinstance(v, Call)]
        return sum(self._prepare(a, ctx, prepared) for a in (*step.args, *tensor_kwargs))

    def _slice(self, step: Any, flat: list, start: int, end: int, prepared: dict, buffers) -> Any:
        if isinstance(step, Leaf):
            buffer, source = next(buffers)[: end - start], flat[step.index]
            return buffer.fill_(source) if isinstance(source, float) else buffer.copy_(source[start:end])
        if not isinstance(step, Call):
            return step
        args = [self._slice(a, flat, start, end, prepared, buffers) for a in step.args]
        scalars, ctx = prepared[id(step)]
        tensor_kwargs = {name: self._slice(v, flat, start, end, prepared, buffers)
                         for name, v in step.kwargs.items() if isinstance(v, Call)}
        return apply(step, args, {**scalars, **tensor_kwargs}, ctx)


def apply(step: Call, args: list, scalars: dict, ctx: KeyContext) -> Any:
    """``step``'s method on one key; a failure inside it becomes a ``MethodError`` naming the key, the
    method and its scalar parameters (torch's overflow and convergence errors, a method's own checks)."""
    try:
        return step.method.fn(*args, **scalars, ctx=ctx)
    except (RuntimeError, ValueError, TypeError, ArithmeticError, LookupError) as error:
        if isinstance(error, MethodError):
            raise
        given = ", ".join(f"{k}={v!r}" for k, v in scalars.items() if not isinstance(v, torch.Tensor))
        fix = "; change the parameter (a per-block map can set it for some keys only)" if given else ""
        message = f"{ctx.key}: {step.method.name}({given}) failed: {error}".replace("\n", " ")
        raise MethodError(message + fix) from error


def context_for(ctx: KeyContext, step: Call) -> KeyContext:
    """The KeyContext of one (method call, key): its cache persists across merges of this recipe
    (a trace on meta tensors gets a throwaway one); only a random method sees the merge seed (the
    cache keys only those on it: ``CompiledRecipe.key_id``)."""
    cache = {} if str(ctx.device) == "meta" else step.cache.setdefault(ctx.key, {})
    seed = ctx.seed if step.method.random else 0
    return KeyContext(key=ctx.key, cache=cache, seed=seed, device=ctx.device, arch=ctx.arch)


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
    scalars = {k: v[region] if isinstance(v, torch.Tensor) and v.dim() == first.dim() else v
               for k, v in scalars.items()}  # a param-space tensor has the first input's shape
    merged = apply(step, sliced, scalars, ctx)
    if first.device.type == "meta":
        return torch.empty(first.shape, device="meta")
    out = first.clone()
    out[region] = merged
    return out


def chunkable(step: Any) -> bool:
    """Whether a step can be evaluated slice by slice (elementwise calls over leaves and scalars)."""
    if isinstance(step, Call):
        return step.elementwise and all(chunkable(a) for a in (*step.args, *step.kwargs.values()))
    return True


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
