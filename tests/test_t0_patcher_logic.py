"""T0: the pure logic under the registry, step events and tracing, without ComfyUI.

patcher/ordering.py (priority order, namespaces, did-you-mean), patcher/signatures.py (registration
checks), patcher/step_clock.py (step bookkeeping per sampler pattern, schedule slices), patcher/trace.py's
recorder, patcher/calls.py (core's arguments by name).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from progress import run_watched

pytestmark = pytest.mark.t0

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pure(pack):
    import types

    from patchbay.patcher import calls, errors, ordering, signatures, step_clock, trace

    return types.SimpleNamespace(errors=errors, ordering=ordering, signatures=signatures, steps=step_clock,
                                 trace=trace, calls=calls)


def test_pure_modules_import_no_comfy():
    """calls, ordering, signatures, step_clock, errors and trace import without ComfyUI (fresh
    interpreter)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "  # devtools/standalone: the name patchbay, as in T0
        "from patchbay.patcher import calls, errors, ordering, signatures, step_clock, trace; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('comfy', 'torch')); "
        "assert not bad, bad"
    )
    run_watched([sys.executable, "-c", code, str(ROOT / "devtools" / "standalone")], check=True)


# ---- calls: core's arguments by name ----------------------------------------------------------------


class _Model:
    """Shaped like core's ``BaseModel._apply_model`` (and a newer core that inserts a parameter)."""

    def apply(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs):
        return x

    def newer(self, x, t, extra=None, c_concat=None, c_crossattn=None, control=None,
              transformer_options=None):
        return x

    def passes_on(self, *args, force=False, **kwargs):  # another pack's override (ComfyUI-GGUF's load)
        return args


def test_arguments_are_found_by_name_in_the_called_signature(pure):
    calls, model = pure.calls, _Model()
    options = {"uuids": [1]}
    assert calls.position(model.apply, "transformer_options") == 5  # self not counted
    assert calls.position(_Model.apply, "transformer_options") == 6  # a plain function counts it
    assert calls.position(model.newer, "transformer_options") == 6
    for method, args in ((model.apply, ("x", "t", None, None, None, options)),
                         (model.newer, ("x", "t", None, None, None, None, options))):
        assert calls.argument(method, "transformer_options", args, {}) is options
        assert calls.argument(method, "x", args, {}) == "x"
    assert calls.argument(model.apply, "transformer_options", ("x", "t"), {"transformer_options": options}) \
        is options
    assert calls.argument(model.apply, "control", ("x", "t"), {}, default="none") == "none"
    # *args and keyword-only: no position, so only a keyword is found
    assert calls.position(model.passes_on, "force") is None
    assert calls.argument(model.passes_on, "force", (1, 2, 3, 4), {"force": True}) is True


def test_an_argument_is_replaced_where_the_caller_passed_it(pure):
    calls, model = pure.calls, _Model()
    args, kwargs = calls.with_argument(model.apply, "transformer_options", "new", ("x", "t", 1, 2, 3, "old"),
                                       {"extra": 9})
    assert args == ("x", "t", 1, 2, 3, "new") and kwargs == {"extra": 9}
    args, kwargs = calls.with_argument(model.apply, "transformer_options", "new", ("x", "t"),
                                       {"transformer_options": "old"})
    assert args == ("x", "t") and kwargs == {"transformer_options": "new"}
    args, kwargs = calls.with_argument(model.apply, "control", "c", ("x",), {})  # not passed: by keyword
    assert args == ("x",) and kwargs == {"control": "c"}


# ---- ordering -----------------------------------------------------------------------------------


def test_priority_order_is_descending_and_stable_on_ties(pure):
    priorities = {"a": 0, "b": 5, "c": 0, "d": -1, "e": 5}
    assert pure.ordering.ordered_keys("abcde", priorities.get) == ["b", "e", "a", "c", "d"]


def test_reorder_in_place_keeps_the_dict_object(pure):
    store = {"x": [1], "y": [2], "z": [3]}
    same = store
    assert pure.ordering.reorder_in_place(store, lambda key: int(key == "z"))
    assert same is store and list(store) == ["z", "x", "y"] and store["z"] == [3]
    assert not pure.ordering.reorder_in_place(store, lambda key: int(key == "z"))


def test_registry_meta_gives_foreign_and_none_keys_priority_zero(pure):
    meta = pure.ordering.RegistryMeta({("wrapper", "apply_model", "patchbay.inner"): -3,
                                       ("wrapper", "apply_model", "patchbay.outer"): 7})
    store = {None: ["core"], "ADE": ["ade"], "patchbay.inner": ["i"], "patchbay.outer": ["o"]}
    assert meta.reorder("wrapper", "apply_model", store)
    assert list(store) == ["patchbay.outer", None, "ADE", "patchbay.inner"]
    assert not meta.reorder("wrapper", "predict_noise", {"a": [1]})  # no priorities for that type
    assert meta.is_ours("wrapper", "apply_model", "patchbay.inner")
    assert not meta.is_ours("wrapper", "apply_model", "ADE")


@pytest.mark.parametrize(("name", "kwargs", "expected"), [
    ("blur", {}, "patchbay.blur"),
    ("mypack.blur", {}, "mypack.blur"),
    ("ADE", {"verbatim": True}, "ADE"),
])
def test_namespaced_key(pure, name, kwargs, expected):
    assert pure.ordering.namespaced_key(name, **kwargs) == expected


@pytest.mark.parametrize("bad", [None, "", "  ", 3])
def test_bad_keys_raise_a_typed_error_with_the_fix(pure, bad):
    with pytest.raises(pure.errors.InvalidKeyError, match="pass a name such as 'my_wrapper'"):
        pure.ordering.namespaced_key(bad)


def test_did_you_mean(pure):
    choices = ["outer_sample", "predict_noise", "apply_model"]
    assert pure.ordering.did_you_mean("predict_nosie", choices) == " Did you mean 'predict_noise'?"
    assert pure.ordering.did_you_mean("APLY_MODEL", choices) == " Did you mean 'apply_model'?"
    assert pure.ordering.did_you_mean("zzz", choices) == ""


# ---- signatures ---------------------------------------------------------------------------------


def _check_wrapper(pure, fn, type_):
    pure.signatures.check_signature(fn, pure.signatures.WRAPPER_SHAPES[type_], what=f"wrapper {type_!r}",
                                     leading=("executor",))


def test_portable_and_exact_wrappers_pass(pure):
    def portable(executor, *args, **kwargs):
        return executor(*args, **kwargs)

    def exact(executor, x, timestep, model_options, seed):
        return executor(x, timestep, model_options, seed)

    def acn_style(executor, x, *args, **kwargs):
        return executor(x, *args, **kwargs)

    for type_ in pure.signatures.WRAPPER_SHAPES:
        _check_wrapper(pure, portable, type_)
    _check_wrapper(pure, exact, "predict_noise")
    _check_wrapper(pure, acn_style, "diffusion_model")


@pytest.mark.parametrize(("fn_text", "type_", "reason"), [
    ("lambda executor, x: None", "predict_noise", "too many positional"),
    ("lambda x, timestep, model_options, seed: None", "predict_noise", "too many positional"),
    ("lambda executor, x, t, c_concat, c_crossattn, control, transformer_options: None", "apply_model",
     "no \\*\\*kwargs"),
    ("lambda executor, noise, latent_image, sampler, sigmas, denoise_mask, callback, disable_pbar, seed: 0",
     "outer_sample", "latent_shapes"),
])
def test_wrong_wrapper_signatures_say_what_is_expected(pure, fn_text, type_, reason):
    fn = eval(fn_text)
    with pytest.raises(pure.errors.SignatureMismatchError, match=reason) as info:
        _check_wrapper(pure, fn, type_)
    message = str(info.value)
    assert "Expected (executor, " in message and "(executor, *args, **kwargs)" in message
    assert isinstance(info.value, TypeError)


def test_callback_and_listener_shapes(pure):
    sig = pure.signatures
    sig.check_signature(lambda patcher: None, sig.CALLBACK_SHAPES["on_cleanup"], what="callback")
    with pytest.raises(sig.SignatureMismatchError, match=r"Expected \(patcher, device_to, lowvram"):
        sig.check_signature(lambda patcher: None, sig.CALLBACK_SHAPES["on_load_after"], what="callback")
    with pytest.raises(sig.SignatureMismatchError, match="not callable"):
        sig.check_signature(42, sig.EVENT_LISTENER_SHAPE, what="listener")
    sig.check_signature(print, sig.EVENT_LISTENER_SHAPE, what="listener")  # builtins: trusted
    sig.check_signature(lambda ev: None, None, what="type unknown to the table")  # only callable checked


# ---- step bookkeeping ---------------------------------------------------------------------------

SIGMAS = (14.6, 1.6, 0.03, 0.0)


def _drive(pure, script, mode="callback", sigmas=SIGMAS):
    """Run a sampler pattern: ('e', sigma) model evaluation, ('c', i) callback. Returns the emissions
    and, per evaluation, the step it was attributed to."""
    tracker = pure.steps.StepTracker(sigmas, mode)
    out, owners = [], []
    for what, value in script:
        if what == "e":
            emitted, step = tracker.evaluation(value)
            owners.append(step)
        else:
            emitted = tracker.callback(value)
        out += [(e.name[5:], e.step) for e in emitted]
    out += [(e.name[5:], e.step) for e in tracker.finish()]
    return out, owners


ORDERED = [("start", 0), ("end", 0), ("start", 1), ("end", 1), ("start", 2), ("end", 2)]


@pytest.mark.parametrize(("pattern", "script", "owners"), [
    ("euler", [("e", 14.6), ("c", 0), ("e", 1.6), ("c", 1), ("e", 0.03), ("c", 2)], [0, 1, 2]),
    ("heun: corrector at the next sigma", [("e", 14.6), ("c", 0), ("e", 1.6), ("e", 1.6), ("c", 1),
                                           ("e", 0.03), ("e", 0.03), ("c", 2)], [0, 1, 1, 2, 2]),
    ("dpmpp_sde: midpoint after the callback", [("e", 14.6), ("c", 0), ("e", 4.8), ("e", 1.6), ("c", 1),
                                                ("e", 0.2), ("e", 0.03), ("c", 2)], [0, 0, 1, 1, 2]),
    ("heunpp2: looks two sigmas ahead", [("e", 14.6), ("c", 0), ("e", 1.6), ("e", 0.03), ("e", 1.6),
                                         ("c", 1), ("e", 0.03), ("e", 0.03), ("c", 2)], [0, 1, 1, 1, 2, 2]),
    ("sa_solver_pece: trailing corrector", [("e", 14.6), ("c", 0), ("e", 1.6), ("c", 1), ("e", 1.6),
                                            ("e", 0.03), ("c", 2), ("e", 0.03)], [0, 1, 1, 2, 2]),
    ("sampler that never calls back", [("e", 14.6), ("e", 1.6), ("e", 0.03)], [0, 0, 0]),
    ("churn: sigma_hat above the step's sigma", [("e", 20.0), ("c", 0), ("e", 2.0), ("c", 1), ("e", 0.05),
                                                 ("c", 2)], [0, 0, 1]),
])
def test_callback_mode_emits_each_step_once_in_order(pure, pattern, script, owners):
    emitted, seen = _drive(pure, script)
    assert emitted == ORDERED, pattern
    assert seen == owners, pattern


def test_sigma_mode_follows_the_intervals_for_off_grid_samplers(pure):
    # dpm_fast with 3 steps: evaluations at its own points, callbacks numbered on its own grid
    emitted, owners = _drive(pure, [("e", 14.6), ("c", 0), ("e", 3.1), ("e", 0.65), ("c", 1)], mode="sigma")
    assert emitted == ORDERED and owners == [0, 0, 1]
    # dpm_adaptive: many callbacks with indices past the run's steps
    script = [("e", 14.6 - i * 0.7) if i % 2 == 0 else ("c", i) for i in range(40)]
    emitted, _ = _drive(pure, script, mode="sigma")
    assert emitted == ORDERED


def test_zero_and_one_step_runs(pure):
    assert _drive(pure, [], sigmas=(1.0,)) == ([], [])
    assert _drive(pure, [("e", 1.0), ("c", 0)], sigmas=(1.0, 0.0)) == ([("start", 0), ("end", 0)], [0])


def test_find_slice_exact_and_forced_end(pure):
    full = [9.0, 5.0, 2.0, 1.0, 0.5, 0.0]
    assert pure.steps.find_slice([2.0, 1.0, 0.5, 0.0], full) == 2
    assert pure.steps.find_slice([9.0, 5.0, 2.0], full) == 0
    assert pure.steps.find_slice([9.0, 5.0, 0.0], full) is None
    assert pure.steps.find_slice([9.0, 5.0, 0.0], full, forced_end=True) == 0
    assert pure.steps.find_slice([5.0, 2.0 * (1 + 1e-7)], full) == 1  # float noise tolerated
    assert pure.steps.find_slice([5.0, 2.1], full) is None


def test_locate_run_prefers_the_shortest_schedule_and_exact_slices(pure):
    short = ("short", [9.0, 5.0, 0.0])
    long_ = ("long", [9.0, 5.0, 3.0, 1.0, 0.0])
    longer_forced = ("forced", [9.0, 5.0, 2.0, 1.0, 0.0])
    match = pure.steps.locate_run([5.0, 3.0, 1.0, 0.0], [[short], [long_]])
    assert (match.first_step, match.total_steps, match.scheduler, match.known) == (1, 4, "long", True)
    match = pure.steps.locate_run([9.0, 5.0, 0.0], [[longer_forced, short]])  # exact beats forced
    assert match.scheduler == "short" and match.total_steps == 2
    match = pure.steps.locate_run([7.0, 3.0, 0.0], [[short], [long_]])
    assert (match.first_step, match.total_steps, match.known) == (0, 2, False)
    assert match.schedule == (7.0, 3.0, 0.0)


# ---- trace recorder -----------------------------------------------------------------------------


def test_trace_recorder_logs_rows_at_debug_and_freezes(pure, caplog):
    recorder = pure.trace.TraceRecorder(4, (3.0, 2.0, 1.0, 0.5, 0.0), first_step=2, schedule_known=True)
    with caplog.at_level(logging.DEBUG, logger="patchbay.trace"):
        recorder.record(2, 1.0, "hook", "WeightHook 1", 0.25, "on positive")
        recorder.record(3, 0.5, "event", "step_end")
    trace = recorder.finish()
    assert [e.name for e in trace.events] == ["WeightHook 1", "step_end"]
    assert trace.total_steps == 4 and trace.first_step == 2 and trace.schedule_known
    assert "step 2/4 sigma=1 hook WeightHook 1 strength=0.25 (on positive)" in caplog.text
    with pytest.raises(AttributeError):
        trace.events[0].strength = 1.0
    assert pure.trace.Trace(events=(), total_steps=0).sigmas == ()  # the shape nodes build by hand
