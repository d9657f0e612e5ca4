"""The memory a rank may plan with, and the peak it used: as the process really has them. No MPI, no Horovod.

Budget (`memory_budget`):

- CUDA: the allocator's cap for this process, ``total x fraction`` when a fraction was set with
  ``torch.cuda.set_per_process_memory_fraction``; without one, the device's memory divided among the
  ranks of the job that share the device. Not ``torch.cuda.mem_get_info``: it is device-wide, so
  another process's memory would count as this rank's use.
- CPU: the host's memory, or the memory limit of the process's cgroup where that is lower (cgroup v2
  ``memory.max``, v1 ``memory.limit_in_bytes``, the lowest along the cgroup's ancestors: Slurm's
  ``--mem`` and a container's limit are set there), divided among the job's ranks in that cgroup.
  Past it the kernel kills the process, leaving no error to recover from, so the controller must
  never plan beyond it.

Peak (`IntervalPeak`): on CUDA the allocator's peak, per step (`dynamix_hvd.data.metrics`); on CPU the
peak resident set over a decision interval: ``VmHWM`` of ``/proc/self/status``, reset by writing ``5``
to ``/proc/self/clear_refs`` (Linux). Where it cannot be reset, only the lifetime peak is known,
which says nothing about a batch size, and no memory fit is made from it.
"""
from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:  # torch is imported where a device is read: a run's report reads budgets without it
    import torch

UNLIMITED = 1 << 60
"""A cgroup limit at or above this many bytes means no limit (v1 writes 2**63 rounded to a page)."""

CGROUP_ROOT_VARIABLE = "DYNAMIX_CGROUP_ROOT"
"""Environment variable: a folder to read cgroup files under instead of the mounts the kernel lists
(a container that mounts the cgroup file system elsewhere)."""


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class CgroupLimit:
    """The lowest memory limit among a process's cgroup and its ancestors."""

    bytes: int
    file: str
    """The file the limit was read from (``.../memory.max`` or ``.../memory.limit_in_bytes``)."""


@dataclass(frozen=True)
class MemoryBudget:
    """The bytes one rank may plan to use at its peak, and where that number comes from."""

    bytes: int
    source: str
    """What was read: e.g. ``cgroup v2 /sys/fs/cgroup/job/memory.max (8.00 GiB)``."""
    shared_by: int = 1
    """Ranks of the job drawing on the same memory (the same device, or the same cgroup on a host)."""

    def describe(self) -> str:
        shared = f", shared by {self.shared_by} ranks" if self.shared_by > 1 else ""
        return f"{gib(self.bytes)} ({self.source}{shared})"

    def to_dict(self) -> dict:
        return asdict(self)


# --- cgroups -----------------------------------------------------------------------------------------
def _mounts(mountinfo: str | Path) -> list[tuple[int, Path, str]]:
    """(cgroup version, mount point, root of the hierarchy it shows) of every cgroup mount that can
    hold a memory limit: the cgroup2 mounts and the v1 mounts of the memory controller."""
    out = []
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            out.append((2, Path(fields[4]), fields[3]))
        elif fstype == "cgroup" and "memory" in options:
            out.append((1, Path(fields[4]), fields[3]))
    return out


def _own_paths(proc_cgroup: str | Path) -> dict[int, str]:
    """This process's cgroup path in the v2 hierarchy and in the v1 memory hierarchy."""
    paths: dict[int, str] = {}
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths[2] = parts[2]
        elif "memory" in parts[1].split(","):
            paths[1] = parts[2]
    return paths


def _read_limit(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    if text in ("", "max") or not text.isdigit():
        return None
    value = int(text)
    return value if 0 < value < UNLIMITED else None


def _lowest_along(mount: Path, start: Path, name: str) -> CgroupLimit | None:
    """The lowest limit in file `name` from `start` up to `mount` (a parent's limit applies too)."""
    best: CgroupLimit | None = None
    here = start
    while True:
        value = _read_limit(here / name)
        if value is not None and (best is None or value < best.bytes):
            best = CgroupLimit(value, str(here / name))
        if here == mount or mount not in here.parents:
            return best
        here = here.parent


def cgroup_memory_limit(proc_cgroup: str | Path = "/proc/self/cgroup",
                        mountinfo: str | Path = "/proc/self/mountinfo") -> CgroupLimit | None:
    """The memory limit of this process's cgroup (v2 or v1), the lowest along its ancestors; None
    when there is none. With ``DYNAMIX_CGROUP_ROOT`` set, that folder stands for the mount points:
    ``ROOT/PATH/memory.max`` (v2) and ``ROOT/memory/PATH/memory.limit_in_bytes`` (v1) are read."""
    own = _own_paths(proc_cgroup)
    override = os.environ.get(CGROUP_ROOT_VARIABLE)
    if override:
        mounts = [(2, Path(override), "/"), (1, Path(override) / "memory", "/")]
    else:
        mounts = _mounts(mountinfo)
    found: list[CgroupLimit] = []
    for version, mount, shown_root in mounts:
        path = own.get(version)
        if path is None:
            continue
        # the mount shows the hierarchy from `shown_root` down; inside a cgroup namespace the path is
        # already relative to it
        if shown_root != "/" and (path == shown_root or path.startswith(shown_root.rstrip("/") + "/")):
            path = path[len(shown_root.rstrip("/")):]
        start = mount / path.lstrip("/")
        while start != mount and mount in start.parents and not start.is_dir():
            start = start.parent  # a cgroup this mount does not show: its nearest shown ancestor
        limit = _lowest_along(mount, start, "memory.max" if version == 2 else "memory.limit_in_bytes")
        if limit is not None:
            found.append(limit)
    return min(found, key=lambda c: c.bytes) if found else None


# --- the budget ----------------------------------------------------------------------------------------
def _cuda_fraction(device: torch.device) -> float:
    import torch

    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return 1.0
    try:
        return float(getter(device))
    except (RuntimeError, TypeError):
        return 1.0


def sharing_key(device: torch.device | None) -> str:
    """What identifies the memory this rank draws on; ranks with equal keys share one budget."""
    host = socket.gethostname()
    if device is not None and device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        return f"{host}|cuda|{getattr(props, 'uuid', device.index)}"
    limit = cgroup_memory_limit()
    return f"{host}|cgroup|{limit.file}" if limit is not None else f"{host}|host"


def memory_budget(device: torch.device | None, shared_by: int = 1) -> MemoryBudget:
    """The peak bytes this rank may plan with, `shared_by` ranks of the job sharing its memory."""
    shared_by = max(1, int(shared_by))
    if device is not None and device.type == "cuda":
        import torch

        total = int(torch.cuda.get_device_properties(device).total_memory)
        fraction = _cuda_fraction(device)
        if fraction < 1.0:  # a cap of this process's own: the other ranks have theirs
            return MemoryBudget(int(total * fraction), f"{device} {gib(total)} x per-process fraction "
                                                       f"{fraction:g}")
        return MemoryBudget(total // shared_by, f"{device} {gib(total)}", shared_by)
    host = int(psutil.virtual_memory().total)
    limit = cgroup_memory_limit()
    if limit is not None and limit.bytes < host:
        version = "v2" if limit.file.endswith("memory.max") else "v1"
        return MemoryBudget(limit.bytes // shared_by, f"cgroup {version} {limit.file} ({gib(limit.bytes)})", shared_by)
    return MemoryBudget(host // shared_by, f"host memory ({gib(host)})", shared_by)


def memory_in_use(device: torch.device | None) -> int:
    """This process's memory now: the allocator's reserved bytes on CUDA, the resident set on CPU."""
    if device is not None and device.type == "cuda":
        import torch

        return int(torch.cuda.memory_reserved(device))
    return int(psutil.Process().memory_info().rss)


class IntervalPeak:
    """Peak resident memory of this process since the last `take()` (CPU; Linux).

    `kind` is ``"host"`` where the kernel's high-water mark can be reset, so the peak belongs to the
    interval's batch sizes; ``"rss"`` elsewhere (the lifetime peak, which no fit may use)."""

    def __init__(self, status: str = "/proc/self/status", clear_refs: str = "/proc/self/clear_refs") -> None:
        self._status, self._clear = status, clear_refs
        self.kind = "host" if self._reset() else "rss"

    def _reset(self) -> bool:
        try:
            with open(self._clear, "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def _high_water(self) -> int:
        try:
            with open(self._status) as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return int(psutil.Process().memory_info().rss)

    def take(self) -> int:
        """The peak since the last call (or since construction), then start a new interval."""
        peak = self._high_water()
        if self.kind == "host":
            self._reset()
        return peak
