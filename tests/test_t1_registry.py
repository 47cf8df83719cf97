"""T1: patcher/registry.py and upgrade() on real ComfyUI patchers, with in-process sampling.

upgrade/clone keep the input and our class; priority order lives in core's own dicts and is what
runs; keyed add/set/remove; other packs' registrations (core's two storages) and ours see each other;
typed errors for unknown names and wrong signatures; a raising wrapper leaves weights and registry
as they were.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch

pytestmark = pytest.mark.t1


@pytest.fixture(scope="module")
def pb(comfy):
    name = comfy.pack.__name__
    modules = ("registry", "events", "trace", "model_patcher", "errors")
    return types.SimpleNamespace(**{m: importlib.import_module(f"{name}.patcher.{m}") for m in modules})


@pytest.fixture(scope="module")
def env(sd15):
    n, model, clip, latent = sd15.nodes, sd15.model, sd15.clip, sd15.latent
    positive, negative = sd15.encode("a knight"), sd15.encode("blurry")

    def sample(m, positive=positive, steps=1, cfg=1.0, sampler="euler"):
        (out,) = n["KSampler"]().sample(m, 3, steps, cfg, sampler, "normal", positive, negative, latent)
        return out["samples"]

    def hooked_positive():
        return sd15.hooked(positive, sd15.lora_hooks())

    return types.SimpleNamespace(model=model, clip=clip, sample=sample, hooked_positive=hooked_positive,
                                 nodes=n)


def recorder(log: list, name: str):
    def wrapper(executor, *args, **kwargs):
        log.append(name)
        return executor(*args, **kwargs)
    wrapper.__qualname__ = f"wrapper_{name}"
    return wrapper


# ---- upgrade and clone ----------------------------------------------------------------------------


def test_upgrade_returns_a_fresh_clone_and_never_changes_the_input(pb, env):
    from comfy.model_patcher import ModelPatcher

    plain = env.model.clone()
    before = (type(plain), dict(plain.attachments), {k: dict(v) for k, v in plain.wrappers.items()},
              dict(plain.patches), plain.patches_uuid)
    upgraded = pb.model_patcher.upgrade(plain)
    assert upgraded is not plain and upgraded.model is plain.model
    assert isinstance(upgraded, pb.model_patcher.PatchbayPatcherMixin) and isinstance(upgraded, ModelPatcher)
    after = (type(plain), dict(plain.attachments), {k: dict(v) for k, v in plain.wrappers.items()},
             dict(plain.patches), plain.patches_uuid)
    assert after == before and type(plain) is ModelPatcher
    again = pb.model_patcher.upgrade(upgraded)
    assert again is not upgraded and type(again) is type(upgraded)
    with pytest.raises(TypeError, match="connect the MODEL output"):
        pb.model_patcher.upgrade("not a model")


def test_clone_keeps_our_class_and_state_also_for_a_foreign_subclass(pb, env):
    from comfy.model_patcher import ModelPatcher

    class ForeignPatcher(ModelPatcher):  # another pack's subclass with its own field
        def clone(self, *args, **kwargs):
            n = super().clone(*args, **kwargs)
            n.foreign_note = getattr(self, "foreign_note", None)
            return n

    foreign = ForeignPatcher(env.model.model, env.model.load_device, env.model.offload_device)
    foreign.foreign_note = "kept"
    upgraded = pb.model_patcher.upgrade(foreign)
    assert isinstance(upgraded, ForeignPatcher) and type(foreign) is ForeignPatcher
    assert type(upgraded).__name__ == "PatchbayForeignPatcher"

    def listener(event):
        return None

    pb.registry.add_wrapper(upgraded, "predict_noise", "kept", recorder([], "k"), priority=3)
    pb.events.on_step_end(upgraded, "kept", listener)
    pb.trace.enable_trace(upgraded)
    clone = upgraded.clone()
    assert type(clone) is type(upgraded) and clone.foreign_note == "kept"
    assert clone.patchbay is not upgraded.patchbay
    assert pb.registry.registrations(clone) == pb.registry.registrations(upgraded)
    assert pb.events.event_listeners(clone) == pb.events.event_listeners(upgraded)
    assert pb.trace.trace_enabled(clone)
    pb.registry.remove_wrapper(clone, "predict_noise", "kept")  # the clone's state is its own
    assert any(r.key == "patchbay.kept" for r in pb.registry.registrations(upgraded))
    assert not any(r.key == "patchbay.kept" for r in pb.registry.registrations(clone))


# ---- order, keys, interop -------------------------------------------------------------------------


def test_priority_order_is_core_dict_order_and_run_order(pb, env):
    import comfy.patcher_extension as ext

    m = pb.model_patcher.upgrade(env.model)
    log: list[str] = []
    pb.registry.add_wrapper(m, "predict_noise", "low", recorder(log, "low"), priority=-5)
    pb.registry.add_wrapper(m, "predict_noise", "mid", recorder(log, "mid"))
    pb.registry.add_wrapper(m, "PREDICT_NOISE", "high", recorder(log, "high"), priority=10)
    m.add_wrapper_with_key(ext.WrappersMP.PREDICT_NOISE, "other.pack", recorder(log, "other"))  # after ours
    ext.add_wrapper_with_key(ext.WrappersMP.PREDICT_NOISE, "options.pack", recorder(log, "options"),
                             m.model_options, is_model_options=True)
    expected_keys = ["patchbay.high", "patchbay.mid", "other.pack", "patchbay.low"]
    assert list(m.wrappers["predict_noise"]) == expected_keys
    found = pb.registry.registrations(m, "wrapper", "predict_noise")
    assert [(r.key, r.position, r.priority, r.ours, r.source) for r in found] == [
        ("options.pack", 0, 0, False, "model_options"),
        ("patchbay.high", 1, 10, True, "patcher"),
        ("patchbay.mid", 2, 0, True, "patcher"),
        ("other.pack", 3, 0, False, "patcher"),
        ("patchbay.low", 4, -5, True, "patcher"),
    ]
    env.sample(m)
    assert log == ["options", "high", "mid", "other", "low"]  # one model evaluation, outermost first


def test_callback_priorities_order_calls(pb, env):
    m = pb.model_patcher.upgrade(env.model)
    calls: list[str] = []
    pb.registry.add_callback(m, "on_pre_run", "second", lambda patcher: calls.append("second"))
    m.add_callback_with_key("on_pre_run", "ADE", lambda patcher: calls.append("ADE"))
    pb.registry.add_callback(m, "ON_PRE_RUN", "first", lambda patcher: calls.append("first"), priority=1)
    env.sample(m)
    assert calls == ["first", "second", "ADE"]


def test_keyed_add_is_idempotent_set_replaces_remove_removes(pb, env):
    m = pb.model_patcher.upgrade(env.model)
    one, two = recorder([], "one"), recorder([], "two")
    first = pb.registry.add_wrapper(m, "apply_model", "k", one)
    assert pb.registry.add_wrapper(m, "apply_model", "k", one, priority=4).functions == (one,)  # no-op
    assert m.get_wrappers("apply_model", "patchbay.k") == [one] and first.priority == 0
    with pytest.raises(pb.errors.DuplicateKeyError, match=r"use set_wrapper\(...\) to replace it"):
        pb.registry.add_wrapper(m, "apply_model", "k", two)
    replaced = pb.registry.set_wrapper(m, "apply_model", "k", two, priority=2)
    assert m.get_wrappers("apply_model", "patchbay.k") == [two] and replaced.priority == 2
    assert pb.registry.set_wrapper(m, "apply_model", "k", two, priority=2) == replaced  # idempotent setter
    assert pb.registry.remove_wrapper(m, "apply_model", "k") is True
    assert pb.registry.remove_wrapper(m, "apply_model", "k") is False
    assert "patchbay.k" not in m.wrappers["apply_model"]
    assert not any(r.key == "patchbay.k" for r in pb.registry.registrations(m))
    # a plain (never upgraded) ModelPatcher works too; the registry adds its attachment to it
    plain = env.model.clone()
    pb.registry.add_callback(plain, "on_cleanup", "mine", lambda patcher: None, priority=1)
    assert plain.get_callbacks("on_cleanup", "patchbay.mine") and plain.get_attachment("patchbay") is not None


def test_interop_both_ways(pb, env):
    import comfy.patcher_extension as ext

    m = pb.model_patcher.upgrade(env.model)
    log: list[str] = []
    ours = recorder(log, "ours")
    pb.registry.add_wrapper(m, "calc_cond_batch", "ours", ours)
    # other packs see ours through core's API ...
    assert m.get_wrappers(ext.WrappersMP.CALC_COND_BATCH, "patchbay.ours") == [ours]
    assert ours in m.get_all_wrappers(ext.WrappersMP.CALC_COND_BATCH)
    # ... and can remove it by key, after which our introspection no longer lists it
    clone = m.clone()
    clone.remove_wrappers_with_key(ext.WrappersMP.CALC_COND_BATCH, "patchbay.ours")
    assert not pb.registry.registrations(clone, "wrapper", "calc_cond_batch")
    # we see and run theirs: both of core's storages, keyed or not
    m.add_wrapper(ext.WrappersMP.CALC_COND_BATCH, recorder(log, "anonymous"))
    ext.add_wrapper_with_key(ext.WrappersMP.CALC_COND_BATCH, "theirs", recorder(log, "theirs"),
                             m.model_options, is_model_options=True)
    keys = [(r.key, r.ours) for r in pb.registry.registrations(m, "wrapper", "calc_cond_batch")]
    assert keys == [("theirs", False), ("patchbay.ours", True), (None, False)]
    env.sample(m.clone())
    assert log == ["theirs", "ours", "anonymous"]
    assert "patchbay.ours" in pb.registry.describe(m)
    # removing another pack's key needs verbatim=True (plain names are ours: patchbay.<name>)
    assert pb.registry.remove_wrapper(m, "calc_cond_batch", "theirs") is False
    assert pb.registry.remove_wrapper(m, "calc_cond_batch", "theirs", verbatim=True) is True


def test_scope_undoes_everything_registered_inside(pb, env):
    import comfy.patcher_extension as ext

    m = pb.model_patcher.upgrade(env.model)
    pb.registry.add_wrapper(m, "outer_sample", "kept", recorder([], "kept"), priority=2)
    m.add_callback_with_key(ext.CallbacksMP.ON_CLEANUP, "ADE", lambda patcher: None)
    before = pb.registry.registrations(m)
    with pb.registry.scope(m):
        pb.registry.add_wrapper(m, "outer_sample", "temp", recorder([], "temp"), priority=9)
        pb.registry.set_wrapper(m, "outer_sample", "kept", recorder([], "other"))
        pb.registry.remove_callback(m, "on_cleanup", "ADE", verbatim=True)
        pb.events.on_step_end(m, "temp", lambda event: None)
        ext.add_wrapper_with_key(ext.WrappersMP.APPLY_MODEL, "opt", recorder([], "o"), m.model_options,
                                 is_model_options=True)
        assert pb.registry.registrations(m) != before
    assert pb.registry.registrations(m) == before
    assert pb.events.event_listeners(m) == ()
    assert list(m.wrappers["outer_sample"]) == ["patchbay.kept"]
    plain = env.model.clone()
    with pb.registry.scope(plain):
        pb.registry.add_wrapper(plain, "outer_sample", "x", recorder([], "x"))
    assert plain.get_attachment("patchbay") is None and not plain.wrappers.get("outer_sample")


# ---- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda r, m: r.add_wrapper(m, "predict_nosie", "k", lambda executor, *a, **k: None),
     "UnknownWrapperTypeError", "Did you mean 'predict_noise'"),
    (lambda r, m: r.add_wrapper(m, "OUTER_SAMPEL", "k", lambda executor, *a, **k: None),
     "UnknownWrapperTypeError", "Did you mean 'OUTER_SAMPLE'"),
    (lambda r, m: r.add_callback(m, "on_clenaup", "k", lambda patcher: None),
     "UnknownCallbackTypeError", "Did you mean 'on_cleanup'"),
    (lambda r, m: r.remove_callback(m, "on_laod_after", "k"), "UnknownCallbackTypeError",
     "Did you mean 'on_load_after'"),
    (lambda r, m: r.add_wrapper(m, "predict_noise", "k", lambda executor, x: None),
     "SignatureMismatchError", r"Expected \(executor, x, timestep, model_options, seed\)"),
    (lambda r, m: r.add_wrapper(m, "apply_model", "k", lambda executor, *args: None),
     "SignatureMismatchError", r"\*\*kwargs"),
    (lambda r, m: r.add_callback(m, "on_load_after", "k", lambda patcher: None),
     "SignatureMismatchError", r"Expected \(patcher, device_to"),
    (lambda r, m: r.add_wrapper(m, "predict_noise", "", lambda executor, *a, **k: None),
     "InvalidKeyError", "non-empty string"),
    (lambda r, m: r.add_wrapper(object(), "predict_noise", "k", lambda executor, *a, **k: None),
     "NotAModelError", "expected a MODEL"),
])
def test_bad_input_gets_typed_errors_and_changes_nothing(pb, env, call, error, message):
    m = pb.model_patcher.upgrade(env.model)
    before = pb.registry.registrations(m)
    with pytest.raises(getattr(pb.errors, error), match=message) as info:
        call(pb.registry, m)
    assert isinstance(info.value, (ValueError, TypeError))
    assert pb.registry.registrations(m) == before


def test_raising_wrapper_propagates_and_leaves_model_and_registry_as_they_were(pb, env, weights_digest):
    m = pb.model_patcher.upgrade(env.model)
    seen = {}

    def exploding_apply_model(executor, *args, **kwargs):
        patcher = executor.class_obj.current_patcher
        if patcher.current_hooks:  # inside sampling, while the hook's LoRA weights are patched in
            seen["patched"] = weights_digest(patcher)
            raise RuntimeError("wrapper exploded on purpose")
        return executor(*args, **kwargs)

    pb.registry.add_wrapper(m, "apply_model", "explode", exploding_apply_model, priority=1)
    pb.events.on_step_end(m, "count", lambda event: None)
    before = (pb.registry.registrations(m), pb.events.event_listeners(m), weights_digest(m))
    with pytest.raises(RuntimeError, match="wrapper exploded on purpose") as info:
        env.sample(m, positive=env.hooked_positive(), steps=2, cfg=2.0)
    assert info.traceback[-1].name == "exploding_apply_model"  # its own frame, not re-raised by us
    after = (pb.registry.registrations(m), pb.events.event_listeners(m), weights_digest(m))
    assert seen["patched"] != before[2], "the wrapper did not raise while the LoRA hook was applied"
    assert after == before
    pb.registry.remove_wrapper(m, "apply_model", "explode")
    assert torch.isfinite(env.sample(m, positive=env.hooked_positive(), steps=1)).all()
