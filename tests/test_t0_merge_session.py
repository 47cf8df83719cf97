"""T0: what the ComfyUI merge nodes need from the engine, without ComfyUI: in-memory sources reached
through ``MergeRuntime.resolve``, sessions streamed into any sink or evaluated key by key, the
``MergeCache`` (results reused across merges only where nothing they depend on changed, within a byte
budget), and ``check`` / ``on_progress`` (an interrupt leaves no file and a consistent cache)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t0

ATTN = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"  # makes it sd15
SHAPES = {
    "model.diffusion_model.input_blocks.0.0.weight": (8, 4, 3, 3),
    ATTN: (8, 768),
    "model.diffusion_model.middle_block.1.proj_in.weight": (16, 24),
    "model.diffusion_model.output_blocks.2.0.weight": (12, 10),
    "model.diffusion_model.out.2.weight": (300, 70),
    "cond_stage_model.transformer.text_model.embeddings.position_ids": (1, 7),
}
FLOATS = [k for k in SHAPES if not k.endswith("position_ids")]


class Interrupted(Exception):
    """What a caller's ``check`` raises (ComfyUI's InterruptProcessingException in the nodes)."""


def make_model(path: Path, seed: int) -> Path:
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: torch.arange(s[-1], dtype=torch.int64).reshape(s) if k.endswith("position_ids")
               else torch.randn(s, generator=gen).half() for k, s in SHAPES.items()}
    save_file(tensors, str(path))
    return path


@pytest.fixture
def files(tmp_path):
    return {n: make_model(tmp_path / f"{n}.safetensors", seed) for n, seed in (("a", 1), ("b", 2), ("c", 3))}


class Counting:
    """A resolver: ``mem:<name>`` -> a MemorySource over that file's tensors (counting reads), else
    ``<name>`` -> the file."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files, self.reads = files, []

    def __call__(self, path: str):
        from patchbay_merge.sources import MemorySource, tensor_info

        if not path.startswith("mem:"):
            return self.files[path]
        name = path.removeprefix("mem:")
        tensors = load_file(str(self.files[name]))

        def fetch(key: str) -> torch.Tensor:
            self.reads.append(key)
            return tensors[key].clone()

        infos = {k: tensor_info(t.dtype, tuple(t.shape)) for k, t in tensors.items()}
        return MemorySource(f"memory {name}", infos, fetch, fingerprint=f"mem:{name}")


def options(**kwargs):
    from patchbay_merge.execute import MergeOptions

    return MergeOptions(progress=False, fsync=False, **kwargs)


def run(**kwargs):
    """(options, runtime) for ``merge(recipe, out, *run(...))`` and ``MergeSession(recipe, *run(...))``:
    ``kwargs`` are MergeRuntime's fields and MergeOptions' (progress bar and fsync off)."""
    import dataclasses

    from patchbay_merge.execute import MergeRuntime

    runtime = {f.name: kwargs.pop(f.name) for f in dataclasses.fields(MergeRuntime) if f.name in kwargs}
    return options(**kwargs), MergeRuntime(**runtime)


def recipe_of(alpha=0.3, first="mem:a"):
    from patchbay_merge import recipe as R

    return R.weighted_sum(R.model(first), R.model("b"), alpha=alpha)


def test_a_memory_source_merges_exactly_like_the_file_it_holds(files, tmp_path):
    from patchbay_merge.execute import merge

    resolver = Counting(files)
    merge(recipe_of(first="mem:a"), tmp_path / "mem.safetensors", *run(resolve=resolver))
    merge(recipe_of(first="a"), tmp_path / "file.safetensors", *run(resolve=resolver))
    from_memory = load_file(str(tmp_path / "mem.safetensors"))
    from_file = load_file(str(tmp_path / "file.safetensors"))
    assert sorted(from_memory) == sorted(SHAPES)
    for key in SHAPES:
        assert torch.equal(from_memory[key], from_file[key]), key
    assert sorted(set(resolver.reads)) == sorted(SHAPES)  # read key by key, each key once
    assert len(resolver.reads) == len(SHAPES)


def test_a_source_object_is_a_recipe_leaf_and_the_object_handed_in_is_never_changed(files, tmp_path):
    """Issue 32 item 4: a recipe leaf may be a source object (``recipe.source``: no path, no resolver), as
    a MODEL of ComfyUI's graph enters a recipe. It merges exactly like the file it holds, in the merge space
    the recipe gives it, while the object keeps its own space; leaves compare by name, space and the
    source's fingerprint."""
    from patchbay_merge import recipe as R
    from patchbay_merge.execute import merge

    resolver = Counting(files)
    held = resolver("mem:a")
    leaf = R.source(held)
    assert leaf == R.source(held) and hash(leaf) == hash(R.source(held)) and leaf.path == "memory a"
    assert leaf != R.source(resolver("mem:b")) and leaf != R.source(held, space="delta")
    merge(R.weighted_sum(leaf, R.model("b"), alpha=0.3), tmp_path / "leaf.safetensors",
          *run(resolve=resolver))
    merge(recipe_of(first="a"), tmp_path / "file.safetensors", *run(resolve=resolver))
    merge(R.add_difference(R.model("b"), R.source(held, space="delta"), alpha=0.5),
          tmp_path / "delta.safetensors", *run(resolve=resolver))
    assert held.space == "weight"
    from_leaf, from_file = (load_file(str(tmp_path / f"{n}.safetensors")) for n in ("leaf", "file"))
    delta, b = load_file(str(tmp_path / "delta.safetensors")), load_file(str(files["b"]))
    a = load_file(str(files["a"]))
    for key in FLOATS:
        assert torch.equal(from_leaf[key], from_file[key]), key
        torch.testing.assert_close(delta[key].float(), b[key].float() + 0.5 * a[key].float(), rtol=1e-3,
                                   atol=1e-3, msg=key)


def test_a_refusing_resolver_stops_before_any_output(files, tmp_path):
    from patchbay_merge.execute import merge

    def refuse(path: str):
        raise ValueError(f"{path!r} is outside the model folders")

    with pytest.raises(ValueError, match="'mem:a' is outside"):
        merge(recipe_of(), tmp_path / "out.safetensors", *run(resolve=refuse))
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in files.values())


def test_memory_and_file_inputs_of_different_architectures_are_refused(files, tmp_path):
    from patchbay_merge import io
    from patchbay_merge.execute import merge
    from patchbay_merge.sources import MemorySource, tensor_info

    flux = {"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": tensor_info(torch.float16, (9, 3))}
    odd = MemorySource("graph flux", flux, lambda key: torch.zeros(9, 3), fingerprint="flux")
    resolve = {"flux": odd, "b": files["b"]}.__getitem__
    from patchbay_merge import recipe as R

    with pytest.raises(io.ModelFileError, match="graph flux: is a flux model but b.safetensors is sd15"):
        merge(R.weighted_sum(R.model("b"), R.model("flux")), tmp_path / "out.safetensors",
              *run(resolve=resolve))
    assert not (tmp_path / "out.safetensors").exists()


class DictSink:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def append(self, key: str, tensor: torch.Tensor) -> None:
        self.tensors[key] = tensor.clone()  # the pipeline reuses the buffer


def test_a_session_streams_any_subset_of_keys_into_any_sink_and_evaluates_single_keys(files, tmp_path):
    from patchbay_merge.execute import merge
    from patchbay_merge.session import MergeSession

    merge(recipe_of(), tmp_path / "out.safetensors", *run(resolve=Counting(files), dtype="fp32"))
    written = load_file(str(tmp_path / "out.safetensors"))
    with MergeSession(recipe_of(), *run(resolve=Counting(files), dtype="fp32")) as session:
        assert session.arch == "sd15" and sorted(p.key for p in session.plans) == sorted(SHAPES)
        sink = DictSink()
        session.stream(sink, [p for p in session.plans if "middle_block" in p.key or "out." in p.key],
                       spill_dir=tmp_path)
        assert sorted(sink.tensors) == ["model.diffusion_model.middle_block.1.proj_in.weight",
                                        "model.diffusion_model.out.2.weight"]
        for key, tensor in sink.tensors.items():
            assert torch.equal(tensor, written[key])
        assert torch.equal(session.evaluate(ATTN), written[ATTN])
        assert session.source_dtype(ATTN) == torch.float16


def test_evaluated_keys_are_checked_as_streamed_ones(files, caplog):
    """What a recipe hook adds while sampling: inf or NaN raises, a blow-up is logged and listed."""
    from patchbay_merge import method_registry as registry
    from patchbay_merge import recipe as R
    from patchbay_merge.checks import NonFiniteError
    from patchbay_merge.session import MergeSession

    with registry.scope():
        def times(a, *, factor: float = 1.0):
            """a times factor."""
            return a * factor

        times.__annotations__ = {"a": registry.Weight, "factor": float, "return": registry.Weight}
        registry.merge_method(times)
        resolve = Counting(files)
        with MergeSession(R.call("times", R.model("a"), factor=1e6), *run(resolve=resolve)) as session, \
                caplog.at_level("WARNING", logger="patchbay_merge.checks"):
            session.evaluate(ATTN)
            assert [key for key, *_ in session.report.out_of_range] == [ATTN]
            assert f"{ATTN}: the merged values reach" in caplog.text
        with MergeSession(R.call("times", R.model("a"), factor=1e300), *run(resolve=resolve)) as session, \
                pytest.raises(NonFiniteError, match=f"{ATTN}: the merged tensor holds inf or NaN; the re"):
            session.evaluate(ATTN)


def test_a_cached_merge_reads_and_computes_nothing_and_writes_the_same_bytes(files, tmp_path):
    from patchbay_merge.cache import MergeCache
    from patchbay_merge.execute import merge

    cache = MergeCache(budget_mb=64)
    first = Counting(files)
    report = merge(recipe_of(), tmp_path / "1.safetensors", *run(resolve=first, cache=cache))
    assert report.cached_keys == 0 and len(first.reads) == len(SHAPES)
    again = Counting(files)
    report = merge(recipe_of(), tmp_path / "2.safetensors", *run(resolve=again, cache=cache))
    assert report.cached_keys == len(FLOATS)
    assert again.reads == ["cond_stage_model.transformer.text_model.embeddings.position_ids"]  # not float
    assert (tmp_path / "1.safetensors").read_bytes() == (tmp_path / "2.safetensors").read_bytes()
    other_dtype = merge(recipe_of(), tmp_path / "3.safetensors", *run(resolve=Counting(files), cache=cache,
                                                                         dtype="fp32"))
    assert other_dtype.cached_keys == 0  # a final result is cached per output dtype


def test_changing_one_block_recomputes_only_that_blocks_keys(files, tmp_path):
    from patchbay_merge.cache import MergeCache
    from patchbay_merge.execute import merge

    cache = MergeCache(budget_mb=64)
    blocks = {"IN00": 0.1, "IN01": 0.2, "default": 0.5}
    merge(recipe_of(alpha=blocks), tmp_path / "1.safetensors", *run(resolve=Counting(files), cache=cache))
    resolver = Counting(files)
    report = merge(recipe_of(alpha={**blocks, "IN01": 0.9}), tmp_path / "2.safetensors",
                   *run(resolve=resolver, cache=cache))
    assert set(resolver.reads) == {ATTN, "cond_stage_model.transformer.text_model.embeddings.position_ids"}
    assert report.cached_keys == len(FLOATS) - 1
    fresh = merge(recipe_of(alpha={**blocks, "IN01": 0.9}), tmp_path / "3.safetensors",
                  *run(resolve=Counting(files)))
    assert fresh.cached_keys == 0
    assert (tmp_path / "2.safetensors").read_bytes() == (tmp_path / "3.safetensors").read_bytes()


def test_intermediates_and_method_caches_survive_a_change_of_the_outer_parameter(files, tmp_path):
    from patchbay_merge import method_registry as registry
    from patchbay_merge import recipe as R
    from patchbay_merge.cache import MergeCache
    from patchbay_merge.execute import merge

    calls, decompositions = [], []
    with registry.scope():
        def slow_delta(a, b):
            """A delta computed on whole tensors (not elementwise), counting its calls."""
            if a.device.type != "meta":  # the executor traces non-float keys on meta tensors
                calls.append(1)
            return a - b

        def cached_norm(a, *, alpha: float = 1.0, ctx=None):
            """a times alpha times a per-key constant kept in the method cache."""
            if "norm" not in ctx.cache and a.device.type != "meta":
                decompositions.append(ctx.key)
                ctx.cache["norm"] = torch.ones(4)
            return a * alpha * float(ctx.cache["norm"][0])

        slow_delta.__annotations__ = {"a": registry.Weight, "b": registry.Weight, "return": registry.Delta}
        cached_norm.__annotations__ = {"a": registry.Weight, "alpha": float, "return": registry.Weight,
                                       "ctx": registry.KeyContext}
        registry.merge_method(slow_delta)
        registry.merge_method(cached_norm)
        cache = MergeCache(budget_mb=64)
        for outer, inner in ((0.5, 0.7), (0.25, 0.7), (0.25, 0.3)):
            delta = R.call("slow_delta", R.model("b"), R.model("c"))
            recipe = R.call("cached_norm", R.add_difference(R.model("a"), delta, alpha=inner), alpha=outer)
            merge(recipe, tmp_path / f"{outer}-{inner}.safetensors",
                  *run(resolve=Counting(files), cache=cache))
    assert len(calls) == len(FLOATS)  # the intermediate delta: computed in the first merge only
    # the method cache belongs to the call's inputs: kept when only its own alpha changes (the second
    # merge), made again when its input changes (the third)
    assert len(decompositions) == 2 * len(FLOATS)


def test_a_changed_input_file_is_never_served_from_the_cache(files, tmp_path):
    from patchbay_merge.cache import MergeCache
    from patchbay_merge.execute import merge

    cache = MergeCache(budget_mb=64)
    merge(recipe_of(first="a"), tmp_path / "1.safetensors", *run(resolve=Counting(files), cache=cache))
    make_model(files["b"], seed=7)
    stat = files["b"].stat()
    os.utime(files["b"], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    report = merge(recipe_of(first="a"), tmp_path / "2.safetensors",
                   *run(resolve=Counting(files), cache=cache))
    assert report.cached_keys == 0
    fresh = merge(recipe_of(first="a"), tmp_path / "3.safetensors", *run(resolve=Counting(files)))
    assert fresh.cached_keys == 0
    assert (tmp_path / "2.safetensors").read_bytes() == (tmp_path / "3.safetensors").read_bytes()


def test_a_file_replaced_with_the_same_size_and_mtime_is_never_served_from_the_cache(files, tmp_path):
    """``cp -p`` / ``rsync -t`` keep size and modification time: the fingerprint must still change."""
    from patchbay_merge.cache import MergeCache
    from patchbay_merge.execute import merge

    cache = MergeCache(budget_mb=64)
    merge(recipe_of(first="a"), tmp_path / "1.safetensors", *run(resolve=Counting(files), cache=cache))
    before = files["b"].stat()
    make_model(tmp_path / "b2.safetensors", seed=7)
    files["b"].write_bytes((tmp_path / "b2.safetensors").read_bytes())  # in place, same inode
    os.utime(files["b"], ns=(before.st_atime_ns, before.st_mtime_ns))
    after = files["b"].stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    report = merge(recipe_of(first="a"), tmp_path / "2.safetensors",
                   *run(resolve=Counting(files), cache=cache))
    assert report.cached_keys == 0
    merge(recipe_of(first="a"), tmp_path / "3.safetensors", *run(resolve=Counting(files)))
    assert (tmp_path / "2.safetensors").read_bytes() == (tmp_path / "3.safetensors").read_bytes()


def test_the_fingerprint_digests_the_header_and_samples_the_data_of_large_files(tmp_path):
    from patchbay_merge.fingerprint import BLOCK, SAMPLES, content_digest, file_fingerprint

    header = b'{"w":{"dtype":"F16","shape":[2097152],"data_offsets":[0,4194304]}}'
    data = bytearray(len(header).to_bytes(8, "little") + header + bytes(4 * 2**20))
    path = tmp_path / "big.safetensors"
    path.write_bytes(data)
    first = content_digest(path, len(data))
    start = 8 + len(header)
    sampled = start + (len(data) - start - BLOCK) * 5 // (SAMPLES - 1)  # the 6th sampled block
    for offset in (9, sampled + 100):  # a header byte, a data byte in a sample
        changed = bytearray(data)
        changed[offset] ^= 1
        path.write_bytes(changed)
        assert content_digest(path, len(changed)) != first
    missing = tmp_path / "missing.safetensors"
    assert file_fingerprint(missing) == ("file", str(missing))


def test_a_new_merge_seed_recomputes_only_what_a_random_method_makes(files, tmp_path):
    from patchbay_merge import recipe as R
    from patchbay_merge.cache import MergeCache
    from patchbay_merge.execute import merge

    cache = MergeCache(budget_mb=64)
    plain = recipe_of(first="a")
    merge(plain, tmp_path / "1.safetensors", *run(resolve=Counting(files), cache=cache, seed=1))
    report = merge(plain, tmp_path / "2.safetensors", *run(resolve=Counting(files), cache=cache, seed=2))
    assert report.cached_keys == len(FLOATS)  # no method of the recipe draws random numbers
    a, b, c = R.model("a"), R.model("b"), R.model("c")
    dropped = R.add_difference(a, R.dropout(R.subtract(b, c), R.subtract(c, a), probability=0.5))
    outputs = {}
    for number, seed in enumerate((1, 1, 2)):
        outputs[number] = tmp_path / f"dropout-{number}.safetensors"
        report = merge(dropped, outputs[number], *run(resolve=Counting(files), cache=cache, seed=seed))
        assert report.cached_keys == (len(FLOATS) if number == 1 else 0)
    assert outputs[0].read_bytes() == outputs[1].read_bytes() != outputs[2].read_bytes()


def test_only_a_method_declared_random_sees_the_merge_seed(files, tmp_path):
    from patchbay_merge import method_registry as registry
    from patchbay_merge import recipe as R
    from patchbay_merge.execute import merge

    seen: dict[str, set] = {"plain": set(), "drawn": set()}
    with registry.scope():
        def recorder(name: str):
            def record(a, *, ctx=None):
                """Records the seed its context carries."""
                seen[name].add(ctx.seed)
                return a

            record.__annotations__ = {"a": registry.Weight, "return": registry.Weight,
                                      "ctx": registry.KeyContext}
            return record

        for name, random in (("plain", False), ("drawn", True)):
            registry.merge_method(recorder(name), name=name, random=random)
        recipe = R.call("drawn", R.call("plain", R.model("a")))
        merge(recipe, tmp_path / "out.safetensors", *run(resolve=Counting(files), seed=5))
    assert seen == {"plain": {0}, "drawn": {5}}  # the cache keys only "drawn" (and what uses it) on it


def test_a_cached_intermediate_that_is_an_input_unchanged_stays_right_after_later_keys(tmp_path):
    """rotate(a, b) with alignment 0 and alpha 0 returns a itself: the cache must keep its values, not a
    view of memory that later keys reuse (or a mapping of the file held open)."""
    from patchbay_merge import recipe as R
    from patchbay_merge.cache import MergeCache
    from patchbay_merge.execute import merge

    files = {}
    for name, seed in (("a", 1), ("b", 2)):
        gen = torch.Generator().manual_seed(seed)
        files[name] = tmp_path / f"{name}.safetensors"
        tensors = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items() if k in FLOATS}  # fp32
        save_file(tensors, str(files[name]))
    cache = MergeCache(budget_mb=64)

    def recipe(alpha: float):
        return R.weighted_sum(R.rotate(R.model("a"), R.model("b"), alignment=0.0, alpha=0.0), R.model("b"),
                              alpha=alpha)

    merge(recipe(0.3), tmp_path / "1.safetensors", *run(resolve=files.get, cache=cache, dtype="fp32"))
    merge(recipe(0.6), tmp_path / "2.safetensors", *run(resolve=files.get, cache=cache, dtype="fp32"))
    merge(recipe(0.6), tmp_path / "3.safetensors", *run(resolve=files.get, dtype="fp32"))
    assert (tmp_path / "2.safetensors").read_bytes() == (tmp_path / "3.safetensors").read_bytes()


def test_the_budget_keeps_the_current_run_and_evicts_older_runs_first():
    from patchbay_merge.cache import MergeCache

    kib = torch.zeros(256)  # 1 KiB
    cache = MergeCache(budget_mb=3 / 1024)
    cache.new_run()
    assert cache.put("a", kib.clone()) and cache.put("b", kib.clone()) and cache.put("c", kib.clone())
    assert not cache.put("d", kib.clone())  # full of this run's entries: the newcomer is dropped
    cache.new_run()
    assert cache.get("b") is not None  # b is used again in the new run
    assert cache.put("e", kib.clone())  # evicts a (older run, least recently used), not b
    assert cache.get("a") is None and cache.get("b") is not None and cache.get("c") is not None
    assert cache.stats().evictions == 1 and cache.stats().bytes == 3 * 1024
    assert not cache.put("huge", torch.zeros(4096))  # larger than the whole budget
    cache.set_budget(1 / 1024)
    assert cache.stats().entries == 1 and cache.stats().bytes == 1024
    cache.clear()
    assert cache.stats().entries == 0 and cache.get("e") is None
    cache.set_budget(0)
    assert not cache.put("x", torch.zeros(1))


def test_entries_a_caller_keeps_are_not_evicted_for_others():
    """``put_copy(..., keep=ids)`` (Merge Grid: the results its later variants read): entries in ``keep``
    stay when a newcomer needs room, older ones outside it go first, and a newcomer that fits only by
    evicting kept entries is not stored, with nothing evicted for it; ``discard`` drops entries at once."""
    from patchbay_merge.cache import MergeCache

    kib = torch.zeros(256)  # 1 KiB
    cache = MergeCache(budget_mb=3 / 1024)
    cache.new_run()
    assert cache.put_copy("a", kib) and cache.put_copy("b", kib) and cache.put_copy("c", kib)
    cache.new_run()
    assert cache.put_copy("d", kib, keep={"a", "c", "d"})  # evicts b, the one entry outside keep
    assert cache.get("b") is None and cache.stats().evictions == 1
    cache.new_run()
    assert not cache.put_copy("e", kib, keep={"a", "c", "d", "e"})  # only kept entries could make room
    assert cache.stats().evictions == 1 and cache.stats().entries == 3
    assert cache.put_copy("e", kib, keep={"a", "e"})  # c and d are no longer kept: the older goes
    assert cache.get("c") is None and cache.get("d") is not None and cache.get("a") is not None
    cache.discard(["a", "never stored"])  # read for the last time: dropped at once
    assert cache.get("a") is None and cache.stats().entries == 2 and cache.stats().bytes == 2 * 1024


def test_method_dicts_count_against_the_budget(files, tmp_path):
    from patchbay_merge.cache import MergeCache

    cache = MergeCache(budget_mb=1 / 1024)
    store = cache.method_store(("rotate", "a", "b"))
    store.setdefault("k1", {})["q"] = torch.zeros(128)  # 512 bytes
    cache.settle()
    assert cache.stats().bytes == 512
    cache.new_run()
    store.setdefault("k2", {})["q"] = torch.zeros(192)  # 768 bytes: k1 (older run) goes
    cache.settle()
    assert cache.stats().bytes == 768 and cache.stats().entries == 1
    assert "q" in store.setdefault("k2", {})


def test_check_stops_the_merge_with_no_file_left_and_the_cache_consistent(files, tmp_path):
    from patchbay_merge.cache import MergeCache
    from patchbay_merge.execute import merge

    cache, seen = MergeCache(budget_mb=64), []

    def check() -> None:
        seen.append(1)
        if len(seen) == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        merge(recipe_of(), tmp_path / "out.safetensors",
              *run(resolve=Counting(files), cache=cache, check=check))
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.safetensors", "c.safetensors"]
    assert 0 < cache.stats().entries < len(FLOATS)  # the keys finished before the stop
    report = merge(recipe_of(), tmp_path / "out.safetensors", *run(resolve=Counting(files), cache=cache))
    fresh = tmp_path / "fresh.safetensors"
    merge(recipe_of(), fresh, *run(resolve=Counting(files)))
    assert 0 < report.cached_keys < len(FLOATS)
    assert (tmp_path / "out.safetensors").read_bytes() == fresh.read_bytes()


def test_a_key_stopped_between_its_slices_is_merged_whole_by_the_next_run(files, tmp_path):
    """A key larger than the read budget streams in slices; stopped between two, it is not cached at all
    (not as a key the recipe dropped), so the next run with the cache writes it whole."""
    from patchbay_merge.cache import MergeCache
    from patchbay_merge.execute import merge

    cache, seen = MergeCache(budget_mb=64), []

    def check() -> None:
        seen.append(1)
        if len(seen) == 8:  # before the third of out.2.weight's six units
            raise Interrupted

    sliced = {"memory_budget_mb": 0, "chunk_elements": 4096}  # every key in units of 4096 elements
    with pytest.raises(Interrupted):
        merge(recipe_of(first="a"), tmp_path / "out.safetensors",
              *run(resolve=Counting(files), cache=cache, check=check, **sliced))
    report = merge(recipe_of(first="a"), tmp_path / "out.safetensors",
                   *run(resolve=Counting(files), cache=cache, **sliced))
    fresh = tmp_path / "fresh.safetensors"
    merge(recipe_of(first="a"), fresh, *run(resolve=Counting(files)))
    assert report.skipped == [] and 0 < report.cached_keys < len(FLOATS)
    assert (tmp_path / "out.safetensors").read_bytes() == fresh.read_bytes()


def test_check_runs_inside_long_elementwise_keys_and_progress_reaches_the_total(files, tmp_path):
    from patchbay_merge.execute import merge

    checks, progress = [], []
    merge(recipe_of(), tmp_path / "out.safetensors",
          *run(resolve=Counting(files), check=lambda: checks.append(1), chunk_elements=64,
                  on_progress=lambda done, total: progress.append((done, total))))
    total = sum(torch.Size(s).numel() * (8 if k.endswith("position_ids") else 2) for k, s in SHAPES.items())
    assert progress[-1] == (total, total)
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)
    assert len(checks) > len(SHAPES)  # out.2.weight (21000 elements) is 329 slices: checked inside too


def test_a_key_dropped_below_a_call_is_dropped_not_replaced_by_the_difference_beside_it(files, tmp_path):
    """add_difference(pick_component(a, "diffuser"), delta): the text encoder keys pick_component drops
    stay out of the output; the delta alone is no weight for them (it used to be passed through)."""
    from patchbay_merge import recipe as R
    from patchbay_merge.execute import merge

    clip_key = "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
    save_file({clip_key: torch.ones(4, 4), ATTN: torch.ones(8, 768)}, str(tmp_path / "d.safetensors"))
    a = load_file(str(files["a"]))
    save_file({**a, clip_key: torch.zeros(4, 4, dtype=torch.float16)}, str(files["a"]))
    recipe = R.add_difference(R.pick_component(R.model("a"), component="diffuser"),
                              R.model("d", space="delta"), alpha=0.5)
    resolve = {"a": files["a"], "d": tmp_path / "d.safetensors"}.__getitem__
    report = merge(recipe, tmp_path / "out.safetensors", *run(resolve=resolve, dtype="fp32"))
    out = load_file(str(tmp_path / "out.safetensors"))
    assert clip_key not in out and clip_key in report.skipped
    assert torch.equal(out[ATTN], a[ATTN].float() + 0.5)
