"""Holding the sizes against a back-and-forth between two decisions (A, B, A', ...). Pure: no MPI.

A deployed policy whose proposals alternate between two nearby splits pays two re-plans and two
cold intervals for nothing; the guard keeps the current sizes instead. Proposals that dither on
purpose (to identify an unidentified cost line) are exempt.
"""
from __future__ import annotations

from typing import Sequence

NEAR = 0.02
"""Relative tolerance within which two decisions' sizes count as the same. Not a setting: it only has
to cover what rounding a split to whole samples moves between two decisions on the same fits, and a
wider one would hold real corrections of a split as flips."""


def near(a: Sequence[int], b: Sequence[int], rel: float = NEAR) -> bool:
    """Every rank's sizes within max(1 sample, `rel` of the larger) of each other (symmetric)."""
    return len(a) == len(b) and all(abs(x - y) <= max(1.0, rel * max(x, y)) for x, y in zip(a, b))


class FlipGuard:
    """Holds the sizes when a new decision would return to the sizes of two decisions ago, or near
    them (within a sample or `NEAR` of the larger) when those were not themselves near the current
    ones."""

    def __init__(self) -> None:
        self.history: list[list[int]] = []

    def __call__(self, sizes: list[int], current: Sequence[int], exempt: bool) -> tuple[list[int], bool]:
        current = list(current)
        back = len(self.history) >= 2 and (sizes == self.history[-2] or (
            near(sizes, self.history[-2]) and not near(self.history[-2], current)))
        flip = not exempt and back and sizes != current and self.history[-1] == current
        out = current if flip else sizes
        self.history = (self.history + [out])[-2:]
        return out, flip

    def hold(self, sizes: list[int], passes: int, current: Sequence[int], current_passes: int,
             exempt: bool) -> tuple[list[int], int, bool]:
        """`sizes` x `passes` micro-batches, or the current ones where that would flip back (the guard
        compares samples per step: a flip may be in the passes alone); also whether it held."""
        _, held = self(_per_step(sizes, passes), _per_step(current, current_passes), exempt)
        return (list(current), current_passes, True) if held else (list(sizes), passes, False)


def _per_step(sizes: Sequence[int], passes: int) -> list[int]:
    """Samples per optimizer step of each rank."""
    return [passes * b for b in sizes]
