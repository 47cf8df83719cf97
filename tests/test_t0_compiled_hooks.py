"""T0: hooks/compiled.py on a small torch.compile'd model (dynamo, "eager" backend: no C++ compile).

What makes Fast Hooks safe on a compiled model, without ComfyUI: hooked calls run graphs of their own
even when a graph without hooks exists first, the deltas equal the eager engine's, and new strengths
or another set of LoRAs compile nothing. tests/test_t1_compile_hooks.py does the same through
ComfyUI's TorchCompileModel with inductor.
"""

from __future__ import annotations

import functools
import types
import weakref

import pytest
import torch

pytestmark = pytest.mark.t0


@pytest.fixture(scope="module")
def hc(pack) -> types.ModuleType:
    from patchbay.hooks import compiled

    return compiled


@pytest.fixture(scope="module")
def lr(pack) -> types.ModuleType:
    from patchbay.hooks import lowrank

    return lowrank


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Conv2d(6, 8, 1)
        self.mlp = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).flatten(2).transpose(1, 2)  # (batch, positions, 8)
        return self.mlp(torch.relu(h))


class Base(torch.nn.Module):
    """Stands for ComfyUI's BaseModel: ``diffusion_model`` is swapped for a compiled module while it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.diffusion_model = Net()

    def get_dtype(self) -> torch.dtype:
        return torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.diffusion_model(x)


class Executor:
    """Like core's WrapperExecutor for APPLY_MODEL: ``class_obj`` is the model, ``original`` the function
    it wraps (whose signature names the arguments), calling it runs the model."""

    def __init__(self, base: Base) -> None:
        self.class_obj = base
        self.original = base.forward

    def __call__(self, *args, **kwargs):
        return self.class_obj(*args, **kwargs)


def graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def deltas_for(lr, net: Net, ranks: tuple[int, ...], seed: int) -> dict:
    """One LoRA per rank (hook index = position) on both modules."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module, tail, up_tail in ((net.proj, (1, 1), (1, 1)), (net.mlp, (), ())):
        out_ch, in_ch = module.weight.shape[:2]
        low = [lr.LowRankDelta(h, torch.randn(r, in_ch, *tail, generator=g) * 0.3,
                               torch.randn(out_ch, r, *up_tail, generator=g) * 0.3, 1.0 / r)
               for h, r in enumerate(ranks)]
        out[module] = lr.ModuleDeltas(lr.module_kind(module), tuple(module.weight.shape), low)
    return out


def run_compiled(hc, base: Base, deltas: dict, strengths, twins, settings, x):
    run = hc.CompiledRun(settings, twins)
    run.install(base, deltas)
    try:
        return run.call(Executor(base), (x,), {}, strengths)
    finally:
        run.remove()


def run_eager(lr, base: Base, deltas: dict, strengths, x):
    row = lr.RowStrengths(strengths)
    handles = [m.register_forward_hook(lambda mod, args, y, d=d: d.apply(mod, args[0], y.clone(), row))
               for m, d in deltas.items()]
    try:
        return base(x)
    finally:
        for handle in handles:
            handle.remove()


def test_twin_settings_keep_the_compile_and_set_its_backend_apart(hc):
    kwargs = {"backend": "inductor", "options": {"max_autotune": False}, "mode": None, "fullgraph": False,
              "dynamic": None}
    settings, why_not = hc.twin_settings(kwargs)
    assert why_not is None and settings["backend"] == "inductor" and settings["name"] == hc.TWIN_NAME
    assert settings["options"] == {"max_autotune": False} and settings["options"] is not kwargs["options"]
    assert settings["fullgraph"] is False and "mode" not in settings and "dynamic" not in settings
    eager, _ = hc.twin_settings({"backend": "eager"})
    assert isinstance(eager["backend"], functools.partial)
    assert eager["backend"] != hc.twin_settings({"backend": "eager"})[0]["backend"], "partials must differ"
    assert hc.twin_settings(None) == (None, "its compile settings (model_options['torch_compile_kwargs']) "
                                            "are missing")


def test_hooked_calls_get_graphs_of_their_own_and_equal_the_eager_engine(hc, lr):
    torch._dynamo.reset()
    base = Base()
    net = base.diffusion_model
    x = torch.randn(6, 6, 4, 4, generator=torch.Generator().manual_seed(0))  # 3 cond chunks x 2 rows
    compiled = torch.compile(net, backend="eager")
    settings, _ = hc.twin_settings({"backend": "eager", "dynamic": None})
    twins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def eager(deltas, rows):
        base.diffusion_model = net
        try:
            return run_eager(lr, base, deltas, rows, x)
        finally:
            base.diffusion_model = compiled

    base.diffusion_model = compiled  # what core's compile wrapper installs while the model runs
    plain = base(x)  # core's graph, compiled with no hook anywhere
    plain_graphs = graphs()
    one = deltas_for(lr, net, (4,), seed=1)
    rows = [[1.0], [0.5], [0.0]]
    out = run_compiled(hc, base, one, rows, twins, settings, x)
    assert graphs() > plain_graphs, "the hooked call reused the plain graph"
    hooked_graphs = graphs()
    torch.testing.assert_close(out, eager(one, rows), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, plain, atol=1e-3)
    torch.testing.assert_close(out[4:], plain[4:])  # the chunk without the hook
    # new strengths, then two LoRAs of other ranks on the same modules: the same graphs
    two = deltas_for(lr, net, (2, 8), seed=2)
    for deltas, rows in ((one, [[0.25], [1.0], [2.0]]), (two, [[1.0, 0.0], [0.0, 1.0], [0.3, 0.3]])):
        out = run_compiled(hc, base, deltas, rows, twins, settings, x)
        assert graphs() == hooked_graphs, f"strengths {rows} compiled again"
        torch.testing.assert_close(out, eager(deltas, rows), rtol=1e-5, atol=1e-5)
    assert base.diffusion_model is compiled, "the twin was left in place"
    torch.testing.assert_close(base(x), plain)  # core's graph, no hook left behind
    assert graphs() == hooked_graphs
    # core compiles the same module again (a TorchCompileModel node run again): the twin is reused
    base.diffusion_model = torch.compile(net, backend="eager")
    out = run_compiled(hc, base, one, rows, twins, settings, x)
    assert graphs() == hooked_graphs, "a new compile of the same module compiled the hooked graph again"
    torch.testing.assert_close(out, eager(one, rows), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


class Flipping(torch.nn.Module):
    def forward(self, x: torch.Tensor, transformer_options: dict) -> torch.Tensor:
        return -x if transformer_options["flip"] else x * 2  # a Python bool: dynamo guards on it


class Passing(Base):
    def forward(self, x: torch.Tensor, transformer_options: dict) -> torch.Tensor:
        return self.diffusion_model(x, transformer_options)


def drop_transformer_options_guards(entries):  # what ComfyUI 0.33's TorchCompileModel passes
    return [("transformer_options" not in entry.name) for entry in entries]


@pytest.mark.parametrize("guard_filter", [True, False], ids=["guard_filter", "none"])
def test_twins_keep_the_guard_filter_of_cores_compile(hc, guard_filter):
    """torch.compile pops ``options["guard_filter_fn"]`` from the options ComfyUI keeps; the twin still
    gets core's filter: a changed value in transformer_options then compiles nothing, as in core's
    graphs (without a filter it compiles again, in both)."""
    torch._dynamo.reset()
    base, net = Passing(), Flipping()
    kwargs = {"backend": "eager", "options": {"guard_filter_fn": drop_transformer_options_guards}
              if guard_filter else None}
    base.diffusion_model = torch.compile(net, **kwargs)
    settings, _ = hc.twin_settings(kwargs)
    run = hc.CompiledRun(settings, weakref.WeakKeyDictionary())
    run.install(base, {})
    x = torch.ones(2, 3)
    try:
        run.call(Executor(base), (x, {"flip": False}), {}, [[0.0], [0.0]])
        before = graphs()
        run.call(Executor(base), (x, {"flip": True}), {}, [[0.0], [0.0]])
    finally:
        run.remove()
    assert (graphs() == before) == guard_filter
    torch._dynamo.reset()
