"""T0: schedule text (loractl strength@position), FLOATS spread and interpolation (hooks/schedule_text.py)."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.t0


@pytest.fixture(scope="module")
def st(pack):
    from patchbay.hooks import schedule_text

    return schedule_text


def pairs(points):
    return [(p.strength, p.at) for p in points]


def test_loractl_form(st):
    assert pairs(st.parse_schedule("0@0, 1@0.3, 0.2@1")) == [(0.0, 0.0), (1.0, 0.3), (0.2, 1.0)]


def test_separators_comments_bare_strength_and_sorting(st):
    text = "1@0.5; 0.5\n# a comment line\n2@0.25 # trailing"
    assert pairs(st.parse_schedule(text)) == [(0.5, 0.0), (2.0, 0.25), (1.0, 0.5)]


def test_same_position_keeps_order_so_the_later_wins(st):
    assert pairs(st.parse_schedule("0@0.5, 1@0.5")) == [(0.0, 0.5), (1.0, 0.5)]


def test_steps_and_sigmas(st):
    assert pairs(st.parse_schedule("1@0, 0@3", "step")) == [(1.0, 0.0), (0.0, 3.0)]
    # sigmas run downwards during sampling: the highest sigma comes first
    assert pairs(st.parse_schedule("0.2@0.9, 1@14.6", "sigma")) == [(1.0, 14.6), (0.2, 0.9)]


@pytest.mark.parametrize(("text", "unit", "needle"), [
    ("0@0, 1@1.5", "percent", "'1.5' at line 1, column 8 is outside [0, 1]"),
    ("0@0, 1@3", "percent", "choose positions in steps"),
    ("0@0,\n  x@0.5", "percent", "'x@0.5' at line 2, column 3: strength 'x' is not a number"),
    ("1@", "percent", "no position after '@'"),
    ("1@0.5x", "percent", "position '0.5x' is not a number"),
    ("1@nan", "percent", "not finite"),
    ("0@0, 1@2.5", "step", "'2.5' at line 1, column 8 is not a step number"),
    ("1@-2", "sigma", "negative sigma"),
    ("  # only a comment", "percent", "holds no keyframe"),
    ("1@0", "seconds", "unknown position unit 'seconds'"),
])
def test_errors_point_at_the_column(st, text, unit, needle):
    with pytest.raises(st.ScheduleError) as info:
        st.parse_schedule(text, unit)
    assert needle in str(info.value)


def test_spread_matches_cores_percents(st):
    assert pairs(st.spread([0, 0.25, 0.75, 1])) == [(0.0, 0.0), (0.25, 1 / 3), (0.75, 2 / 3), (1.0, 1.0)]
    assert pairs(st.spread([2.0], 0.2, 0.8)) == [(2.0, 0.2)]
    assert pairs(st.spread([1, 0], 0.5, 0.9)) == [(1.0, 0.5), (0.0, 0.9)]


@pytest.mark.parametrize(("args", "needle"), [
    (([],), "the FLOATS list is empty"),
    (([1.0], -0.1, 1.0), "start_percent -0.1 is outside [0, 1]"),
    (([1.0], 0.0, 1.2), "end_percent 1.2 is outside [0, 1]"),
    (([1.0, 2.0], 0.8, 0.2), "end_percent 0.2 is before start_percent 0.8"),
    (([1.0, math.inf],), "FLOATS value 1 (inf) is not finite"),
])
def test_spread_errors(st, args, needle):
    with pytest.raises(st.ScheduleError) as info:
        st.spread(*args)
    assert needle in str(info.value)


@pytest.mark.parametrize(("method", "middle"), [
    ("linear", 0.5), ("ease_in", 0.25), ("ease_out", 0.75), ("ease_in_out", 0.5)])
def test_interpolate_uses_cores_curves(st, method, middle):
    points = st.interpolate(0.0, 1.0, 3, method, 0.0, 0.5)
    assert [p.at for p in points] == [0.0, 0.25, 0.5]
    assert [p.strength for p in points] == pytest.approx([0.0, middle, 1.0])


def test_interpolate_ease_in_out_is_cosine_like_core(st):
    # core: (1 - cos(pi t)) / 2 at t = 1/4
    expected = (1 - math.cos(math.pi / 4)) / 2
    assert st.interpolate(0.0, 1.0, 5, "ease_in_out")[1].strength == pytest.approx(expected)


def test_interpolate_errors(st):
    with pytest.raises(st.ScheduleError, match="unknown interpolation 'cubic'; choose one of linear"):
        st.interpolate(0, 1, 3, "cubic")
    with pytest.raises(st.ScheduleError, match="keyframes count 1 is below 2"):
        st.interpolate(0, 1, 1)


@pytest.fixture(scope="module")
def tags(pack):
    from patchbay.hooks import prompt_tags

    return prompt_tags


def test_prompt_tags_are_split_off(tags):
    clean, found = tags.split_prompt("a knight <lora:armor:0.8> in a field,  <LORA:style/ink:0@0,1@0.5>")
    assert clean == "a knight in a field,"
    assert [(t.name, t.strength, t.column) for t in found] == [("armor", 0.8, 10), ("style/ink", 1.0, 40)]
    assert found[0].schedule is None and pairs(found[1].schedule) == [(0.0, 0.0), (1.0, 0.5)]
    assert tags.split_prompt("<lora:plain>")[1][0].strength == 1.0
    assert tags.split_prompt("no tags here") == ("no tags here", ())


@pytest.mark.parametrize(("text", "needle"), [
    ("a <lora:x:strong>", "'<lora:x:strong>' at column 3: strength 'strong' is not a number"),
    ("a <lora::0.5>", "has no name"),
    ("a <lora:x:0@0,1@2>", "'<lora:x:0@0,1@2>' at column 3: schedule position '2' at line 1, column 7"),
    ("a <lora:x:0.5", "LoRA tag at column 3 is not closed"),
])
def test_prompt_tag_errors(tags, text, needle):
    with pytest.raises(ValueError) as info:
        tags.split_prompt(text)
    assert needle in str(info.value)
