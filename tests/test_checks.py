"""The shared value checks: what each accepts, what it refuses, and that the refusal names the field."""

from __future__ import annotations

import math

import pytest

from dual_sampling.checks import need_int, need_number


@pytest.mark.parametrize("value", [True, 1.0, "3", None, 0])
def test_need_int_refuses_non_integers_and_values_below_the_bound(value):
    with pytest.raises(ValueError, match=r"^slots must be an integer >= 1, got"):
        need_int("slots", value, 1)


def test_need_int_returns_what_it_accepts():
    assert need_int("dense_k", 0, 0) == 0 and need_int("slots", 7, 1) == 7


@pytest.mark.parametrize("value", [0, 11, True, 5.0, "5", None])
def test_need_int_with_an_upper_bound_refuses_values_outside_it_by_name(value):
    with pytest.raises(ValueError, match=r"^beam_width must be an integer in \[1, 10\], got"):
        need_int("beam_width", value, 1, most=10)


def test_need_int_with_an_upper_bound_takes_both_ends():
    assert need_int("beam_width", 1, 1, most=10) == 1 and need_int("beam_width", 10, 1, most=10) == 10


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (0, {"positive": True}, "a positive number"),
        (-0.5, {}, "a number >= 0"),
        (math.inf, {}, "a number >= 0"),
        (math.nan, {"finite": False}, r"a number >= 0 \(inf allowed\)"),
        (True, {}, "a number >= 0"),
        ("1", {}, "a number >= 0"),
    ],
)
def test_need_number_refuses_by_name(value, kwargs, message):
    with pytest.raises(ValueError, match=rf"^timeout must be {message}, got"):
        need_number("timeout", value, **kwargs)


def test_need_number_returns_a_float_and_takes_inf_only_when_allowed():
    assert need_number("t", 3) == 3.0 and isinstance(need_number("t", 3), float)
    assert need_number("clip", math.inf, positive=True, finite=False) == math.inf
