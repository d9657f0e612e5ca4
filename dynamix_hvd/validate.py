"""Checks of user-given parameters: one message form for every configuration and call in the package.

Each check returns the value when it passes and otherwise raises ``ValueError`` naming the parameter,
the value and what it must be: ``ControllerConfig.max_passes=0; it must be an integer >= 1``. `name`
is what the user wrote (``"ControllerConfig.learn"``, ``"AdaptiveLoader seed"``); `what` replaces the
requirement's text where a parameter needs more words (``"a share of training time in [0, 1)"``).
Bools are never integers or numbers here (``True`` is not a batch size). Imports nothing of the package.
"""
from __future__ import annotations

import math
from typing import Any, Optional

__all__ = ["boolean", "fail", "integer", "is_integer", "is_number", "number"]


def fail(name: str, value: Any, what: str) -> None:
    """Raise the package's ValueError for parameter `name` holding `value`, which must be `what`."""
    raise ValueError(f"{name}={value!r}; it must be {what}")


def is_integer(value: Any, minimum: Optional[int] = None, maximum: Optional[int] = None) -> bool:
    """An ``int`` (not a bool) within ``[minimum, maximum]`` (either bound may be None)."""
    return (isinstance(value, int) and not isinstance(value, bool)
            and (minimum is None or value >= minimum) and (maximum is None or value <= maximum))


def is_number(value: Any, minimum: Optional[float] = None, *, above: Optional[float] = None,
              maximum: Optional[float] = None, below: Optional[float] = None, finite: bool = True) -> bool:
    """An ``int`` or ``float`` (not a bool), finite unless ``finite=False``, with ``minimum <= value``,
    ``above < value``, ``value <= maximum`` and ``value < below`` for the bounds given. NaN never passes."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    if isinstance(value, float) and (math.isnan(value) or (finite and math.isinf(value))):
        return False  # (an int is always finite, and may be too large for a float)
    return ((minimum is None or value >= minimum) and (above is None or value > above)
            and (maximum is None or value <= maximum) and (below is None or value < below))


def integer(name: str, value: Any, minimum: Optional[int] = None, maximum: Optional[int] = None, *,
            what: Optional[str] = None) -> int:
    """`value` if it is an integer (not a bool) within the bounds, else ValueError naming `name` and `value`."""
    if not is_integer(value, minimum, maximum):
        if what is None:
            what = "an integer" + _range(minimum, None, maximum, None)
        fail(name, value, what)
    return value


def number(name: str, value: Any, minimum: Optional[float] = None, *, above: Optional[float] = None,
           maximum: Optional[float] = None, below: Optional[float] = None, finite: bool = True,
           what: Optional[str] = None) -> float:
    """`value` if it is a real number (int or float, not a bool; finite unless ``finite=False``; never NaN)
    within the bounds (`minimum`/`maximum` inclusive, `above`/`below` exclusive), else ValueError."""
    if not is_number(value, minimum, above=above, maximum=maximum, below=below, finite=finite):
        if what is None:
            what = ("a finite number" if finite else "a number") + _range(minimum, above, maximum, below)
        fail(name, value, what)
    return value


def boolean(name: str, value: Any, *, what: str = "True or False") -> bool:
    """`value` if it is a bool (not 0/1 or a string), else ValueError naming `name` and `value`."""
    if not isinstance(value, bool):
        fail(name, value, what)
    return value


def _range(minimum: Any, above: Any, maximum: Any, below: Any) -> str:
    low = f"[{minimum}" if minimum is not None else f"({above}" if above is not None else None
    high = f"{maximum}]" if maximum is not None else f"{below})" if below is not None else None
    if low and high:
        return f" in {low}, {high}"
    if low:
        return f" >= {minimum}" if minimum is not None else f" > {above}"
    if high:
        return f" <= {maximum}" if maximum is not None else f" < {below}"
    return ""
