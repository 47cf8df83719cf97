"""T1: sampler step events (patcher/events.py) and tracing (patcher/trace.py) with in-process sampling.

Every KSampler sampler name fires sampler_start, step_start/step_end once per step in order and
sampler_end, with the run's sigmas; SamplerCustom / SamplerCustomAdvanced with other SAMPLER nodes
and split runs report global steps; the schedule matcher on real schedules; listener errors
propagate and leave the model as it was; the trace records a scheduled LoRA hook's strength per step.

Sampler needing special handling here: dpm_adaptive picks its own step count (about 60 model
evaluations for the full range on the tiny model), so it runs with karras at denoise 0.1 - which also
checks the denoise rule: its 3 steps are reported as the tail of the int(3 / 0.1)-step schedule.
"""

from __future__ import annotations

import ast
import importlib
import logging
import types

import pytest
import torch
from tiny_models import SD15_LORA as LORA

pytestmark = pytest.mark.t1

STEPS = 3
SPECIAL = {"dpm_adaptive": {"scheduler": "karras", "denoise": 0.1}}
OFF_GRID = {"dpm_fast", "dpm_adaptive"}  # followed by sigma intervals (patcher/step_clock.py)


def core_sampler_names() -> list[str]:
    """comfy.samplers.SAMPLER_NAMES read from the source, so that collection needs no ComfyUI import
    (test_parametrized_samplers_are_core_s checks it against the imported list)."""
    try:
        import devpaths

        tree = ast.parse((devpaths.comfyui_dir() / "comfy" / "samplers.py").read_text())
    except (RuntimeError, OSError):
        return []
    values: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "KSAMPLER_NAMES":
                values[name] = ast.literal_eval(node.value)
            elif name == "SAMPLER_NAMES" and isinstance(node.value, ast.BinOp):
                values[name] = values["KSAMPLER_NAMES"] + ast.literal_eval(node.value.right)
    return values.get("SAMPLER_NAMES", [])


SAMPLERS = core_sampler_names()


@pytest.fixture(scope="module")
def pb(comfy):
    name = comfy.pack.__name__
    modules = ("registry", "events", "trace", "model_patcher", "schedule", "errors")
    return types.SimpleNamespace(**{m: importlib.import_module(f"{name}.patcher.{m}") for m in modules})


@pytest.fixture(scope="module")
def env(sd15, pb):
    listened = pb.model_patcher.upgrade(sd15.model)
    log: list = []
    for event in pb.events.EVENTS:
        pb.events.add_event_listener(listened, event, "log", log.append)
    return types.SimpleNamespace(nodes=sd15.nodes, model=sd15.model, clip=sd15.clip,
                                 positive=sd15.encode("a knight"), negative=sd15.encode("blurry"),
                                 latent=sd15.latent, listened=listened, log=log)


def ksample(env, model, sampler="euler", scheduler="normal", steps=STEPS, denoise=1.0, positive=None):
    (out,) = env.nodes["KSampler"]().sample(model, 7, steps, 1.0, sampler, scheduler,
                                             positive or env.positive, env.negative, env.latent, denoise)
    return out["samples"]


def take(log: list) -> list:
    events = list(log)
    log.clear()
    return events


def check_run(events, first: int, total: int, run_sigmas, *, off_grid: bool = False) -> None:
    """One run's events: order, global steps, totals, sigmas, payloads."""
    steps = len(run_sigmas) - 1
    flow = [e for e in events if e.name != "evaluation"]
    assert [e.name for e in flow] == ["sampler_start"] + ["step_start", "step_end"] * steps + ["sampler_end"]
    assert [e.step for e in flow[1:-1]] == [first + i // 2 for i in range(2 * steps)]
    assert (flow[0].step, flow[-1].step) == (first, first + steps - 1)
    assert {e.total_steps for e in events} == {total}
    assert all(e.schedule_known and e.first_step == first and e.run_steps == steps for e in events)
    assert flow[0].sigmas == pytest.approx(run_sigmas) and len(flow[0].schedule) == total + 1
    assert flow[0].schedule[first:first + steps + 1] == pytest.approx(run_sigmas)
    for e in flow[1:-1]:
        assert e.sigma == pytest.approx(run_sigmas[e.run_step])
    assert isinstance(flow[-1].x, torch.Tensor)
    evaluations = [e for e in events if e.name == "evaluation"]
    assert evaluations and all(first <= e.step < first + steps for e in evaluations)
    assert [e.step for e in evaluations] == sorted(e.step for e in evaluations)
    if not off_grid:
        assert {e.step for e in evaluations} == set(range(first, first + steps))
        assert all(isinstance(e.x, torch.Tensor) and isinstance(e.denoised, torch.Tensor)
                   for e in flow if e.name == "step_end")


def test_parametrized_samplers_are_core_s(comfy):
    from comfy import samplers

    assert SAMPLERS == samplers.SAMPLER_NAMES, "the sampler list parsed for parametrization is stale"


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_events_fire_for_every_ksampler_sampler(pb, env, sampler):
    from comfy import samplers

    options = SPECIAL.get(sampler, {})
    scheduler, denoise = options.get("scheduler", "normal"), options.get("denoise", 1.0)
    take(env.log)
    ksample(env, env.listened, sampler, scheduler, denoise=denoise)
    run = samplers.KSampler(env.listened, STEPS, "cpu", sampler, scheduler, denoise).sigmas.tolist()
    total = int(STEPS / denoise) if denoise < 1.0 else STEPS
    check_run(take(env.log), total - STEPS, total, run, off_grid=sampler in OFF_GRID)


def test_ksampler_advanced_split_reports_global_steps(env):
    n = env.nodes
    take(env.log)
    advanced = n["KSamplerAdvanced"]()
    (half,) = advanced.sample(env.listened, "enable", 5, 20, 1.0, "euler", "normal", env.positive,
                              env.negative, env.latent, 0, 10, "enable")
    first = take(env.log)
    advanced.sample(env.listened, "disable", 5, 20, 1.0, "euler", "normal", env.positive,
                    env.negative, half, 10, 10000, "disable")
    second = take(env.log)
    from comfy import samplers

    full = samplers.KSampler(env.listened, 20, "cpu", "euler", "normal").sigmas.tolist()
    check_run(first, 0, 20, full[:11])
    check_run(second, 10, 20, full[10:])
    assert [e.step for e in first + second if e.name == "step_end"] == list(range(20))


def test_sampler_custom_with_split_sigmas(env):
    n = env.nodes
    sigmas = n["BasicScheduler"].execute(env.listened, "karras", 4, 1.0)[0]
    high, low = n["SplitSigmas"].execute(sigmas, 2)[0:2]
    sampler = n["KSamplerSelect"].execute("dpmpp_2m")[0]
    take(env.log)
    out = n["SamplerCustom"].execute(env.listened, True, 1, 1.0, env.positive, env.negative, sampler, high,
                                     env.latent)[0]
    check_run(take(env.log), 0, 4, high.tolist())
    n["SamplerCustom"].execute(env.listened, False, 1, 1.0, env.positive, env.negative, sampler, low, out)
    check_run(take(env.log), 2, 4, low.tolist())


@pytest.mark.parametrize(("sampler_node", "args"), [
    ("SamplerEulerAncestral", (1.0, 1.0)),
    ("SamplerDPMPP_2M_SDE", ("midpoint", 1.0, 1.0, "cpu")),
    ("SamplerLMS", (4,)),
])
def test_sampler_custom_advanced_with_sampler_nodes(env, sampler_node, args):
    n = env.nodes
    sampler = n[sampler_node].execute(*args)[0]
    noise = n["RandomNoise"].execute(3)[0]
    guider = n["CFGGuider"].execute(env.listened, env.positive, env.negative, 1.0)[0]
    sigmas = n["BasicScheduler"].execute(env.listened, "exponential", STEPS, 1.0)[0]
    take(env.log)
    n["SamplerCustomAdvanced"].execute(noise, guider, sampler, sigmas, env.latent)
    check_run(take(env.log), 0, STEPS, sigmas.tolist())


def test_schedule_matching_on_real_schedules(pb, env):
    from comfy import samplers

    ms = env.model.get_model_object("model_sampling")
    for name in samplers.SCHEDULER_NAMES:
        full = samplers.calculate_sigmas(ms, name, 12).tolist()
        total = len(full) - 1  # ddim_uniform gives 13 steps for 12
        cases = {"complete": (0, full), "head": (0, full[:7]), "tail": (6, full[6:]),
                 "middle": (3, full[3:9]), "head, force_full_denoise": (0, full[:6] + [0.0])}
        for case, (first, run) in cases.items():
            match = pb.schedule.locate(ms, run)
            # documented: sgm_uniform(N) shares all but its last sigma with normal(N + 1)
            ambiguous = name == "sgm_uniform" and case not in ("complete", "tail")
            expected = (first, total + 1 if ambiguous else total, True)
            assert (match.first_step, match.total_steps, match.known) == expected, (name, case)
    dpm_2 = samplers.ksampler("dpm_2")  # KSampler drops the penultimate sigma of a one-step-longer schedule
    full = samplers.KSampler(env.model, 12, "cpu", "dpm_2", "karras").sigmas.tolist()
    tail, complete = pb.schedule.locate(ms, full[4:], dpm_2), pb.schedule.locate(ms, full, dpm_2)
    assert (tail.first_step, tail.total_steps, complete.first_step, complete.total_steps) == (4, 12, 0, 12)
    custom = pb.schedule.locate(ms, [10.0, 4.0, 1.0, 0.0])
    assert (custom.known, custom.first_step, custom.total_steps) == (False, 0, 3)


def hooked_positive(env, strengths=None):
    n = env.nodes
    (hooks,) = n["CreateHookLora"]().create_hook(LORA, 1.0, 1.0)
    if strengths is not None:
        (keyframes,) = n["CreateHookKeyframesFromFloats"]().create_hook_keyframes(strengths, 0.0, 1.0)
        (hooks,) = n["SetHookKeyframes"]().set_hook_keyframes(hooks, keyframes)
    (cond,) = n["ConditioningSetProperties"]().set_properties(env.positive, 1.0, "default", hooks=hooks)
    return cond, hooks


def test_listener_error_propagates_with_its_traceback_and_leaves_the_model(pb, env, weights_digest):
    m = pb.model_patcher.upgrade(env.model)

    def failing_listener(event):
        if event.step == 1:
            raise ValueError("listener failed on purpose")

    pb.events.on_step_end(m, "fails", failing_listener)
    before = (pb.registry.registrations(m), pb.events.event_listeners(m), weights_digest(m))
    positive, _ = hooked_positive(env)
    with pytest.raises(ValueError, match="listener failed on purpose") as info:
        ksample(env, m, positive=positive)
    assert info.traceback[-1].name == "failing_listener"
    assert (pb.registry.registrations(m), pb.events.event_listeners(m), weights_digest(m)) == before
    assert pb.events.remove_event_listener(m, "step_end", "fails")
    assert pb.events.event_listeners(m) == () and "sampler_sample" not in {
        r.type for r in pb.registry.registrations(m)}, "the dispatch wrappers leave with the last listener"
    with pytest.raises(pb.errors.UnknownEventError, match="Did you mean 'step_end'"):
        pb.events.add_event_listener(m, "step_ned", "x", print)
    with pytest.raises(pb.errors.SignatureMismatchError, match=r"Expected \(event\)"):
        pb.events.on_step_start(m, "x", lambda: None)


def test_trace_records_a_scheduled_lora_hook_per_step(pb, env, caplog):
    from comfy import samplers

    strengths = [0.0, 0.25, 0.75, 1.0]
    m = pb.trace.enable_trace(pb.model_patcher.upgrade(env.model))
    (baked, _clip) = env.nodes["LoraLoader"]().load_lora(m, env.clip, LORA, 0.5, 0.5)  # a downstream clone
    positive, hooks = hooked_positive(env, strengths)
    with caplog.at_level(logging.DEBUG, logger="patchbay.trace"):
        ksample(env, baked, steps=4, positive=positive)
    trace = pb.trace.last_trace(m)
    assert trace is pb.trace.last_trace(baked) and trace is not None and trace.total_steps == 4
    sigmas = samplers.KSampler(baked, 4, "cpu", "euler", "normal").sigmas
    # what core's keyframe logic gives at each step's sigma (the same calls _calc_cond_batch makes)
    keyframes = hooks.hooks[0].hook_keyframe.clone()
    keyframes.initialize_timesteps(baked.model)
    keyframes.reset()
    expected = []
    for sigma in sigmas[:-1]:
        keyframes.prepare_current_keyframe(curr_t=sigma, transformer_options={"sample_sigmas": sigmas})
        expected.append(keyframes.strength)
    rows = [e for e in trace.events if e.kind == "hook"]
    assert [e.step for e in rows] == [0, 1, 2, 3] and {e.name for e in rows} == {"WeightHook 1"}
    assert [e.strength for e in rows] == pytest.approx(expected) and len(set(expected)) >= 3
    assert "on positive" in rows[0].detail and "LoRA keys" in rows[0].detail
    patch_rows = [e for e in trace.events if e.kind == "patch" and e.name == "weight patches"]
    assert [e.step for e in patch_rows] == [0, 1, 2, 3] and patch_rows[0].strength == pytest.approx(0.5)
    assert any(e.kind == "wrapper" and e.name == "predict_noise patchbay.events" for e in trace.events)
    assert [e.name for e in trace.events if e.kind == "event"][:2] == ["sampler_start", "step_start"]
    assert "hook WeightHook 1 strength=" in caplog.text and "patch weight patches" in caplog.text
    assert pb.trace.last_trace(env.model) is None
