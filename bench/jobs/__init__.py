"""The benchmark's training jobs (MLP, CNN, char-level transformer) and what they share: each is a
Horovod script with the marked ``# dx`` lines plus the suite's arms (plain Horovod reference, slowed
rank, records, evaluation), driven by bench/suite.py, bench/demo.py and the calibration runs."""
from __future__ import annotations

import time


def busy_wait(seconds: float) -> None:
    """Burn CPU like a slower device would (sleeping would free the core for the other ranks)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
