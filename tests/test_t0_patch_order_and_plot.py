"""T0: patch-order options and object-patch lifting (patcher/patch_order.py), and the trace timeline
renderer (patcher/trace_plot.py) on synthetic traces, without ComfyUI."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.t0


@pytest.fixture(scope="module")
def po(pack) -> types.ModuleType:
    from patchbay.patcher import patch_order

    return patch_order


@pytest.fixture(scope="module")
def tp(pack) -> types.ModuleType:
    from patchbay.patcher import trace_plot

    return trace_plot


@pytest.fixture(scope="module")
def tr(pack) -> types.ModuleType:
    from patchbay.patcher import trace

    return trace


# ---- patch order ---------------------------------------------------------------------------------


def test_options_are_validated_with_the_allowed_values(po):
    assert po.PatchOrder("weight_patch_first", "enabled").weights_first
    assert not po.PatchOrder().weights_first
    with pytest.raises(po.PatchOrderError, match=r"patch_order='weight_first' .*did you mean "
                                                 r"'weight_patch_first'.*use one of object_patch_first"):
        po.PatchOrder("weight_first")
    with pytest.raises(po.PatchOrderError, match=r"full_load=True is not allowed; use one of auto"):
        po.PatchOrder("object_patch_first", True)
    assert issubclass(po.PatchOrderError, ValueError)


@pytest.mark.parametrize(("mode", "core", "expected"), [
    ("auto", True, True), ("auto", False, False), ("enabled", False, True), ("disabled", True, False)])
def test_full_load_resolution(po, mode, core, expected):
    assert po.resolve_full_load(mode, core) is expected


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        self.sampling = torch.nn.Identity()  # holds no weights, like model_sampling


def install(root: torch.nn.Module, name: str, value, backup: dict) -> None:
    """What core's patch_model does for one object patch."""
    owner, leaf = (root, name) if "." not in name else (root.get_submodule(name.rsplit(".", 1)[0]),
                                                        name.rsplit(".", 1)[1])
    backup.setdefault(name, getattr(owner, leaf))
    setattr(owner, leaf, value)


def test_lifting_restores_weight_holders_and_reinstalls_them(po):
    root, backup = Outer(), {}
    body = root.body
    wrapper, other_sampling = torch.nn.Sequential(body), torch.nn.Identity()
    install(root, "body", wrapper, backup)
    install(root, "sampling", other_sampling, backup)
    assert "body.0.weight" not in dict(root.named_parameters())
    with po.lifted_object_patches(root, backup) as lifted:
        assert lifted == ["body"]
        assert root.body is body and "body.0.weight" in dict(root.named_parameters())
        assert root.sampling is other_sampling, "an object patch without weights stays installed"
    assert root.body is wrapper and root.sampling is other_sampling


def test_lifting_reinstalls_even_when_the_block_raises(po):
    root, backup = Outer(), {}
    wrapper = torch.nn.Sequential(root.body)
    install(root, "body", wrapper, backup)
    with pytest.raises(RuntimeError), po.lifted_object_patches(root, backup):
        raise RuntimeError("load failed")
    assert root.body is wrapper


def test_lifting_nested_patches_in_reverse(po):
    root, backup = Outer(), {}
    body, first = root.body, root.body[0]
    install(root, "body.0", torch.nn.Sequential(first), backup)
    install(root, "body", torch.nn.Sequential(body), backup)
    patched_inner = body[0]
    with po.lifted_object_patches(root, backup):
        assert root.body is body and root.body[0] is first
    assert root.body[0] is body and body[0] is patched_inner


def test_nothing_installed_nothing_lifted(po):
    root = Outer()
    with po.lifted_object_patches(root, {}) as lifted:
        assert lifted == []


# ---- trace timeline ------------------------------------------------------------------------------


@pytest.fixture()
def trace(tr):
    steps = 6
    sigmas = tuple(14.6 * 0.5 ** i for i in range(steps + 1))
    schedule = (0.0, 0.0, 0.5, 0.5, 1.0, 1.0)
    events = []
    for step in range(steps):
        events.append(tr.TraceEvent(step, steps, sigmas[step], "event", "step_start"))
        events.append(tr.TraceEvent(step, steps, sigmas[step], "hook", "style lora", schedule[step]))
        events.append(tr.TraceEvent(step, steps, sigmas[step], "wrapper", "APPLY_MODEL torch.compile"))
        if step >= 3:
            events.append(tr.TraceEvent(step, steps, sigmas[step], "patch", "weight patches", -0.5))
    events.append(tr.TraceEvent(steps, steps, None, "event", "sampler_end"))
    return tr.Trace(tuple(events), steps, sigmas)


def test_lanes_one_per_kind_and_name(tp, trace):
    lanes = tp.lanes(trace)
    assert [(lane.kind, lane.name) for lane in lanes] == [
        ("hook", "style lora"), ("patch", "weight patches"), ("wrapper", "APPLY_MODEL torch.compile")]
    assert [cell[1] for cell in lanes[0].cells] == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
    assert [cell[0] for cell in lanes[1].cells] == [3, 4, 5]
    assert all(cell[1] is None for cell in lanes[2].cells)


def test_image_is_a_comfy_image_with_a_lane_per_name(tp, tr, trace):
    image = tp.timeline_tensor(trace)
    assert image.dtype == torch.float32 and image.ndim == 4 and image.shape[0] == 1 and image.shape[3] == 3
    assert image.min() >= 0.0 and image.max() <= 1.0 and image.std() > 0.05
    one_lane = tp.timeline_tensor(tr.Trace(trace.events[:2], 6, trace.sigmas))
    assert image.shape[1] - one_lane.shape[1] == 2 * 30, "one 30 px row per lane (3 lanes vs 1)"


def test_bar_height_follows_strength(tp, trace):
    pixels = np.asarray(tp.timeline_image(trace, width=600))
    top, x0, step_w = 40 + 46, 230 + 16, 100  # below title and sigma strip; right of the labels
    hook_lane = pixels[top:top + 30]
    background = pixels[0, 0]
    height = [int((hook_lane[:, x0 + step * step_w + 10] != background).any(-1).sum()) for step in range(6)]
    assert height[0] == height[1] >= 1 and height[2] == height[3] and height[4] == height[5]
    assert height[4] > height[2] > height[0], height


def test_report_lists_lanes_and_steps(tp, trace):
    text = tp.report(trace)
    assert text.splitlines()[0] == "Patchbay trace: 6 steps, 22 events, sigma 14.6 -> 0.2281"
    assert "hook style lora" in text and "0-5 / 0..1" in text
    assert "patch weight patches" in text and "3-5 / -0.5" in text
    assert "step 4 (sigma 0.9125): style lora=1, weight patches=-0.5, APPLY_MODEL torch.compile" in text


def test_empty_trace_renders_a_message(tp, tr):
    empty = tr.Trace(events=(), total_steps=0)
    assert tp.timeline_tensor(empty, message="no trace").shape[1:] == (40 + 30 + 46 + 40, 230 + 480 + 32, 3)
    assert "No hook, patch, wrapper or callback was recorded" in tp.report(empty)
