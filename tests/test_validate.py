"""dynamix_hvd.validate: the one form of every parameter check (name, value, what it must be)."""
from __future__ import annotations

import math

import pytest

from dynamix_hvd import validate


@pytest.mark.parametrize("value", [0, -3, 2.0, True, "1", None, math.nan])
def test_integer_refuses_and_names_parameter_and_value(value):
    with pytest.raises(ValueError) as exc:
        validate.integer("Config.count", value, 1)
    assert str(exc.value) == f"Config.count={value!r}; it must be an integer >= 1"


def test_integer_bounds_and_custom_text():
    assert validate.integer("n", 5, 1, 5) == 5
    with pytest.raises(ValueError, match=r"^n=6; it must be an integer in \[1, 5\]$"):
        validate.integer("n", 6, 1, 5)
    with pytest.raises(ValueError, match=r"^n=-1; it must be an integer >= 0 or None$"):
        validate.integer("n", -1, 0, what="an integer >= 0 or None")


@pytest.mark.parametrize("value,kwargs,text", [
    (math.inf, {}, "a finite number"), (math.nan, {"finite": False}, "a number"), (True, {"minimum": 0}, "a finite number >= 0"),
    (0, {"above": 0}, "a finite number > 0"), (1.0, {"minimum": 0, "below": 1}, "a finite number in [0, 1)"),
    (2, {"minimum": -1, "maximum": 1}, "a finite number in [-1, 1]"), ("0.5", {}, "a finite number"),
])
def test_number_refusals(value, kwargs, text):
    with pytest.raises(ValueError) as exc:
        validate.number("x", value, **kwargs)
    assert str(exc.value) == f"x={value!r}; it must be {text}"


def test_number_accepts_ints_floats_and_infinity_when_asked():
    assert validate.number("x", 3, 0) == 3 and validate.number("x", 0.5, 0, below=1) == 0.5
    assert validate.number("x", math.inf, 0, finite=False) == math.inf
    assert validate.number("x", 10**400, 0) == 10**400  # an int too large for a float is still a number
    with pytest.raises(ValueError, match="x=-1000"):
        validate.number("x", -10**400, 0)


@pytest.mark.parametrize("value", [0, 1, "True", None])
def test_boolean(value):
    assert validate.boolean("flag", True) is True
    with pytest.raises(ValueError, match=rf"^flag={value!r}; it must be True or False$"):
        validate.boolean("flag", value)
