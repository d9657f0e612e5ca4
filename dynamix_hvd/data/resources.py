"""System resource and network counters of this host/process. No MPI, no Horovod.

Network counters come from the kernel: bytes from /proc/net/dev (all interfaces but loopback, or
loopback too when that is all there is, as on a single machine) and TCP retransmitted segments from
/proc/net/snmp. Values are cumulative; `ResourceSampler.sample()` turns them into rates since the
previous sample.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from .memory import memory_budget, memory_in_use


@dataclass
class ResourceSample:
    """Resource use over the interval since the previous sample."""

    cpu_util: float
    """Busy fraction of this process's CPU time budget (0..1 per core allotted by torch threads)."""
    gpu_util: float
    """GPU busy fraction (0..1); NaN without a CUDA device or without NVML."""
    mem_used_bytes: int
    """This process's memory in use: the CUDA allocator's reserved bytes, or the resident set (CPU)."""
    mem_total_bytes: int
    """The memory budget of this rank (:func:`dynamix_hvd.data.memory.memory_budget`)."""
    net_bytes_per_s: float
    """Bytes sent + received per second on the measured interfaces."""
    tcp_retrans_per_s: float
    """TCP segments retransmitted per second, host-wide."""
    interval_s: float


def read_net_bytes(path: str = "/proc/net/dev") -> int:
    """Total bytes received + sent; excludes loopback unless it is the only interface."""
    totals: dict[str, int] = {}
    try:
        lines = Path(path).read_text().splitlines()[2:]
    except OSError:
        return 0
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if len(fields) >= 9:
            totals[name.strip()] = int(fields[0]) + int(fields[8])
    external = {k: v for k, v in totals.items() if k != "lo"}
    return sum((external or totals).values())


def read_tcp_retransmits(path: str = "/proc/net/snmp") -> int:
    """Cumulative TCP RetransSegs of the host (0 where the file is not readable)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return 0
    tcp = [line.split()[1:] for line in lines if line.startswith("Tcp:")]
    if len(tcp) < 2:
        return 0
    header, values = tcp[0], tcp[1]
    return int(values[header.index("RetransSegs")]) if "RetransSegs" in header else 0


def _gpu_util(device: torch.device | None) -> float:
    if device is None or device.type != "cuda":
        return float("nan")
    try:
        return float(torch.cuda.utilization(device)) / 100.0
    except Exception:  # NVML missing or not permitted: the feature is then simply unknown
        return float("nan")


class ResourceSampler:
    """Samples resource use of this process since the previous sample.

    With `background_period_s` > 0 a daemon thread samples periodically and `latest()` returns the
    newest sample without touching the kernel, so a decision never waits for /proc reads. `close()`
    (or leaving a ``with`` block) stops the thread at once; `latest()` then samples on demand.
    """

    def __init__(self, device: torch.device | None = None, background_period_s: float = 0.0,
                 budget_bytes: int | None = None) -> None:
        self.device = device
        self.budget_bytes = memory_budget(device).bytes if budget_bytes is None else int(budget_bytes)
        self._proc = psutil.Process()
        self._t = time.monotonic()
        self._cpu = self._cpu_seconds()
        self._net = read_net_bytes()
        self._retrans = read_tcp_retransmits()
        self._latest: ResourceSample | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background_period_s > 0:
            self._latest = self.sample()
            self._thread = threading.Thread(target=self._loop, args=(background_period_s,), daemon=True,
                                            name="dynamix-resources")
            self._thread.start()

    def _loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):  # wakes at once when close() sets the event
            self._latest = self.sample()

    def close(self) -> None:
        """Stop the background thread (returns once it has ended); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._latest = None

    def __enter__(self) -> "ResourceSampler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def latest(self) -> ResourceSample:
        """The newest background sample, or a fresh one when no thread runs."""
        return self._latest if self._latest is not None else self.sample()

    def _cpu_seconds(self) -> float:
        times = self._proc.cpu_times()
        return times.user + times.system

    def sample(self) -> ResourceSample:
        now, cpu, net, retrans = time.monotonic(), self._cpu_seconds(), read_net_bytes(), read_tcp_retransmits()
        dt = max(now - self._t, 1e-9)
        threads = max(torch.get_num_threads(), 1)
        cuda = self.device is not None and self.device.type == "cuda"
        used = memory_in_use(self.device) if cuda else self._proc.memory_info().rss  # (no new psutil.Process)
        total = self.budget_bytes
        out = ResourceSample(cpu_util=min((cpu - self._cpu) / dt / threads, 1.0), gpu_util=_gpu_util(self.device),
                             mem_used_bytes=int(used), mem_total_bytes=int(total),
                             net_bytes_per_s=max(net - self._net, 0) / dt,
                             tcp_retrans_per_s=max(retrans - self._retrans, 0) / dt, interval_s=dt)
        self._t, self._cpu, self._net, self._retrans = now, cpu, net, retrans
        return out
