"""T0: the FLOATS makers' pure logic (hooks/floats.py) and node bodies, without ComfyUI."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.t0


@pytest.fixture(scope="module")
def floats(pack):
    from patchbay.hooks import floats

    return floats


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0, 0.25, 1", [0.0, 0.25, 1.0]),
        ("0 0.25 1", [0.0, 0.25, 1.0]),
        ("1,\n-0.5\n\n  2e-1 ", [1.0, -0.5, 0.2]),
        ("1, 2, # comment, 3\n4", [1.0, 2.0, 4.0]),
        ("0.5,", [0.5]),
    ],
)
def test_parse_floats_accepts_lists(floats, text, expected):
    assert floats.parse_floats(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("0, abc, 1", "'abc' at line 1, column 4"),
        ("0, 1\n2, 3x", "'3x' at line 2, column 4"),
        ("0, , 1", "empty item at line 1, column 3"),
        (", 1", "empty item at line 1, column 1"),
        ("1, nan", "'nan' at line 1, column 4 is not finite"),
        ("  \n # only a comment", "holds no number"),
    ],
)
def test_parse_floats_errors_name_the_column(floats, text, fragment):
    with pytest.raises(floats.FloatsError) as info:
        floats.parse_floats(text)
    assert fragment in str(info.value)


def test_ramp_linear_and_endpoints(floats):
    assert floats.ramp(0.0, 1.0, 5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert floats.ramp(2.0, -2.0, 3) == [2.0, 0.0, -2.0]
    assert floats.ramp(0.3, 0.9, 1) == [0.3]


@pytest.mark.parametrize("easing", ["linear", "ease_in", "ease_out", "ease_in_out", "ease_in_cubic",
                                    "ease_out_cubic", "ease_in_out_cubic", "ease_in_out_sine"])
def test_every_easing_hits_both_ends_and_is_monotonic(floats, easing):
    values = floats.ramp(0.0, 1.0, 21, easing)
    assert values[0] == pytest.approx(0.0, abs=1e-12)
    assert values[-1] == pytest.approx(1.0, abs=1e-12)
    assert all(b >= a for a, b in zip(values, values[1:], strict=False))


def test_easings_follow_their_formulas(floats):
    assert floats.ramp(0.0, 1.0, 3, "ease_in")[1] == pytest.approx(0.25)
    assert floats.ramp(0.0, 1.0, 3, "ease_out")[1] == pytest.approx(0.75)
    assert floats.ramp(0.0, 1.0, 5, "ease_in_out")[1] == pytest.approx(0.125)
    assert floats.ramp(0.0, 1.0, 3, "ease_in_out_sine")[1] == pytest.approx(0.5)
    assert floats.ramp(0.0, 1.0, 5, "ease_in_out_sine")[1] == pytest.approx((1 - math.cos(math.pi / 4)) / 2)


def test_ramp_rejects_bad_input(floats):
    with pytest.raises(floats.FloatsError, match="count 0 is below 1"):
        floats.ramp(0.0, 1.0, 0)
    with pytest.raises(floats.FloatsError, match="unknown easing 'bounce'; choose one of linear"):
        floats.ramp(0.0, 1.0, 3, "bounce")
    with pytest.raises(floats.FloatsError, match="start inf is not finite"):
        floats.ramp(math.inf, 1.0, 3)


def test_repeat_cycle_and_pingpong(floats):
    assert floats.repeat("0, 1", 5) == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert floats.repeat("1, 0.5, 0", 7, "pingpong") == [1.0, 0.5, 0.0, 0.5, 1.0, 0.5, 0.0]
    assert floats.repeat("1, 0", 4, "pingpong") == [1.0, 0.0, 1.0, 0.0]
    assert floats.repeat("0.7", 3) == [0.7, 0.7, 0.7]


def test_repeat_rejects_bad_input(floats):
    with pytest.raises(floats.FloatsError, match="repeat pattern: 'x' at line 1, column 4"):
        floats.repeat("1, x", 3)
    with pytest.raises(floats.FloatsError, match="length 0 is below 1"):
        floats.repeat("1", 0)
    with pytest.raises(floats.FloatsError, match="unknown repeat mode 'zigzag'"):
        floats.repeat("1", 2, "zigzag")
