"""Memory bounds: an out-of-memory size stays out of reach, and the budget is the one the job has.

Unit tests of the bounds, the cgroup reader (fake trees, and a real cgroup where this host lets the
test make one) and the peak reader; a real 2-rank job under mpirun in a cgroup whose limit is below
what the controller would otherwise plan: it finishes, and no rank's peak passes its budget.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

import launching
from dynamix_hvd.control.actions import BatchBounds, memory_limit
from dynamix_hvd.control.core import DecisionCore
from dynamix_hvd.data.memory import (CGROUP_ROOT_VARIABLE, IntervalPeak, cgroup_memory_limit, memory_budget)
from dynamix_hvd.data.resources import ResourceSampler

GIB = 2**30
MIB = 2**20


# --- the out-of-memory ceiling ---------------------------------------------------------------------------
def test_an_out_of_memory_size_is_never_tried_again_whatever_the_fits_say() -> None:
    bounds = BatchBounds(world_size=2, min_batch=1, max_batch=1024)
    assert bounds.record_oom(0, 200) == 160 and bounds.failed == [200, 0]
    # fits that would allow far more: a line of 1 MiB per sample over a 1 GiB floor, 16 GiB of budget
    for size in (40, 80, 120, 160):
        bounds.record_memory(0, size, GIB + size * MIB, 16 * GIB)
        bounds.record_memory(1, size, GIB + size * MIB, 16 * GIB)
        assert bounds.fit_limit[0] > 200 and bounds.upper(0) == 160 < 200
        assert bounds.clip(0, 10_000) == 160
    assert bounds.upper(1) == 1024  # the other rank is bounded by its fit and max_batch only
    # a second failure below the first lowers the ceiling again; a failure above it changes nothing
    bounds.record_oom(0, 150)
    bounds.record_oom(0, 900)
    assert bounds.upper(0) == 120 and bounds.failed[0] == 150


def test_the_ceiling_and_the_fit_survive_a_checkpoint() -> None:
    core = DecisionCore(2, 64, min_batch=1, max_batch=1024)
    core.bounds.record_oom(1, 300)
    core.bounds.record_memory(0, 64, GIB + 64 * 8 * MIB, 4 * GIB)
    state = json.loads(json.dumps(core.state_dict()))  # plain values only
    again = DecisionCore(2, 64, min_batch=1, max_batch=1024)
    again.load_state_dict(state)
    assert again.bounds.upper(1) == 240 and again.bounds.failed == [0, 300]
    assert again.bounds.upper(0) == core.bounds.upper(0) < 1024
    # after restoring, a fit that would allow more still stays below the failed size
    again.bounds.record_memory(1, 100, GIB + 100 * MIB, 64 * GIB)
    again.bounds.record_memory(1, 200, GIB + 200 * MIB, 64 * GIB)
    assert again.bounds.upper(1) == 240
    # a checkpoint that kept only one bound per rank restores it as a ceiling
    legacy = BatchBounds(2, 1, 1024)
    legacy.load_state_dict({"learned_max": [100, 1024]})
    legacy.record_memory(0, 50, GIB + 50 * MIB, 64 * GIB)
    legacy.record_memory(0, 90, GIB + 90 * MIB, 64 * GIB)
    assert legacy.upper(0) == 100


def test_memory_fits() -> None:
    # precise (CUDA): a line through the smallest and largest sizes
    assert memory_limit({10: 2_000, 20: 3_000}, 20, 0, 9_000, precise=True) == 80
    # resident set: twice the latest size's slope over the floor, so never under-predicting upward
    assert memory_limit({100: 1_200}, 100, 1_000, 1_400, precise=False) == 100
    assert memory_limit({100: 900}, 100, 1_000, 1_400, precise=False) is None  # below the floor: no evidence
    bounds = BatchBounds(world_size=1, min_batch=4, max_batch=100)
    bounds.record_memory(0, 10, 1_000 + 10 * 100, 10_000)
    bounds.record_memory(0, 20, 1_000 + 20 * 100, 10_000)
    assert bounds.upper(0) == 80  # (0.9 * 10000 - 1000) / 100


# --- reading the budget ------------------------------------------------------------------------------------
def fake_cgroup_tree(tmp: Path, v2: dict[str, str], v1: dict[str, str], shown_root: str = "/") -> tuple[Path, Path]:
    """Files standing for /proc/self/cgroup and /proc/self/mountinfo, and the cgroup trees they name:
    `v2` and `v1` map a cgroup path to its memory.max / memory.limit_in_bytes content."""
    (tmp / "v2").mkdir()
    (tmp / "v1").mkdir()
    for version, limits, name in ((2, v2, "memory.max"), (1, v1, "memory.limit_in_bytes")):
        for path, value in limits.items():
            folder = tmp / f"v{version}" / path.strip("/")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(value + "\n")
    own = tmp / "cgroup"
    own.write_text("12:memory:/job/step_0/task_1\n3:cpu,cpuacct:/job\n0::/job/step_0/task_1\n")
    mountinfo = tmp / "mountinfo"
    mountinfo.write_text(
        f"30 25 0:26 / /sys rw - sysfs sysfs rw\n"
        f"35 30 0:30 {shown_root} {tmp / 'v2'} rw,nosuid - cgroup2 cgroup2 rw\n"
        f"36 30 0:31 {shown_root} {tmp / 'v1'} rw,nosuid - cgroup cgroup rw,memory\n"
        f"37 30 0:32 / {tmp / 'cpu'} rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n")
    return own, mountinfo


def test_cgroup_v2_limit_is_the_lowest_along_the_ancestors(tmp_path: Path) -> None:
    own, mountinfo = fake_cgroup_tree(tmp_path, v2={"/job": str(4 * GIB), "/job/step_0": "max",
                                                    "/job/step_0/task_1": str(6 * GIB)}, v1={})
    limit = cgroup_memory_limit(own, mountinfo)
    assert limit is not None and limit.bytes == 4 * GIB
    assert limit.file == str(tmp_path / "v2" / "job" / "memory.max")


def test_cgroup_v1_limit_and_the_unlimited_sentinel(tmp_path: Path) -> None:
    unlimited = str(9223372036854771712)
    own, mountinfo = fake_cgroup_tree(tmp_path, v2={}, v1={"/": unlimited, "/job": unlimited,
                                                          "/job/step_0": str(3 * GIB)})
    limit = cgroup_memory_limit(own, mountinfo)
    assert limit is not None and limit.bytes == 3 * GIB and limit.file.endswith("step_0/memory.limit_in_bytes")
    # nothing but the sentinel: no limit
    (tmp_path / "v1" / "job" / "step_0" / "memory.limit_in_bytes").write_text(unlimited)
    assert cgroup_memory_limit(own, mountinfo) is None


def test_cgroup_mount_that_shows_a_subtree(tmp_path: Path) -> None:
    """A container's mount shows the hierarchy from /job down: the path is read relative to it."""
    tmp = tmp_path
    (tmp / "v2" / "step_0").mkdir(parents=True)
    (tmp / "v1").mkdir()
    (tmp / "v2" / "memory.max").write_text(str(2 * GIB))
    (tmp / "v2" / "step_0" / "memory.max").write_text("max")
    own = tmp / "cgroup"
    own.write_text("0::/job/step_0\n")
    mountinfo = tmp / "mountinfo"
    mountinfo.write_text(f"35 30 0:30 /job {tmp / 'v2'} rw - cgroup2 cgroup2 rw\n")
    limit = cgroup_memory_limit(own, mountinfo)
    assert limit is not None and limit.bytes == 2 * GIB and limit.file == str(tmp / "v2" / "memory.max")


def test_budget_is_the_cgroup_limit_shared_by_its_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own_v2 = own_v1 = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            own_v2 = path
        elif "memory" in controllers.split(","):
            own_v1 = path
    root = tmp_path / "root"
    for path, name in ((own_v2, "memory.max"), (f"/memory{own_v1}" if own_v1 else None, "memory.limit_in_bytes")):
        if path is not None:
            folder = root / path.strip("/")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(str(3 * GIB))
    monkeypatch.setenv(CGROUP_ROOT_VARIABLE, str(root))
    budget = memory_budget(None, shared_by=2)
    assert budget.bytes == 3 * GIB // 2 and budget.shared_by == 2
    assert "cgroup" in budget.source and str(root) in budget.source and "3.00 GiB" in budget.describe()
    monkeypatch.delenv(CGROUP_ROOT_VARIABLE)
    host = memory_budget(None)  # this process's own cgroup, or the host
    assert 0 < host.bytes <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert ResourceSampler(budget_bytes=12345).sample().mem_total_bytes == 12345


def test_interval_peak_is_the_peak_since_the_last_reading() -> None:
    peak = IntervalPeak()
    assert peak.kind == ("host" if sys.platform.startswith("linux") else "rss")
    before = peak.take()
    block = bytearray(200 * MIB)
    block[::4096] = b"x" * len(block[::4096])  # touch every page: resident
    del block
    during = peak.take()
    after = peak.take()
    assert during >= before + 150 * MIB, (before, during)
    assert after < during - 150 * MIB, "the reading was reset to the memory in use now"


# --- a real cgroup ----------------------------------------------------------------------------------------
def own_cgroup_dirs() -> list[tuple[int, Path]]:
    """This process's cgroup folders where a child may hold a memory limit: v1's memory hierarchy,
    then v2's (which needs the memory controller enabled for children)."""
    out = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            out.append((1, Path("/sys/fs/cgroup/memory") / path.lstrip("/")))
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                if (mount / "cgroup.controllers").exists():
                    out.append((2, mount / path.lstrip("/")))
    return out


def make_real_cgroup(limit: int) -> Path | None:
    """A child of this process's cgroup with a memory limit of `limit` bytes, or None where this host
    does not let a process make one (no write access, no memory controller)."""
    name = f"dynamix-test-{os.getpid()}-{time.monotonic_ns()}"
    for version, parent in own_cgroup_dirs():
        child = parent / name
        try:
            if version == 2:
                (parent / "cgroup.subtree_control").write_text("+memory")
            child.mkdir()
            (child / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(str(limit))
            return child
        except OSError:
            try:
                child.rmdir()
            except OSError:
                pass
    return None


def remove_cgroup(folder: Path) -> None:
    for _ in range(50):  # its last processes may still be exiting
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[tuple[Path | None, dict[str, str], int]]:
    """A memory-limited place to run a job: a real cgroup (the folder), or, where this host does not
    let a test make one, a fake cgroup tree the library reads through ``DYNAMIX_CGROUP_ROOT`` (None).
    Yields (cgroup folder or None, the job's environment, the limit)."""
    limit = 1400 * MIB  # two ranks: about 700 MiB each, of which torch, MPI and Horovod take ~420
    env = launching.job_env()
    real = make_real_cgroup(limit)
    if real is None:
        root = tmp_path / "cgroup-root"
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, controllers, path = line.split(":", 2)
            if hid == "0" and controllers == "":
                (root / path.strip("/")).mkdir(parents=True, exist_ok=True)
                (root / path.strip("/") / "memory.max").write_text(str(limit))
            elif "memory" in controllers.split(","):
                (root / "memory" / path.strip("/")).mkdir(parents=True, exist_ok=True)
                (root / "memory" / path.strip("/") / "memory.limit_in_bytes").write_text(str(limit))
        env[CGROUP_ROOT_VARIABLE] = str(root)
    try:
        yield real, env, limit
    finally:
        if real is not None:
            remove_cgroup(real)


def run_in(cgroup: Path | None, env: dict[str, str], argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`argv` with its process (and so every child) moved into `cgroup` first, as Slurm or a
    container runtime places a job."""
    if cgroup is not None:
        argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *argv]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_real_cgroup_limit_is_read_from_inside_it(limited) -> None:
    cgroup, env, limit = limited
    code = ("from dynamix_hvd.data.memory import cgroup_memory_limit, memory_budget;"
            "c = cgroup_memory_limit(); b = memory_budget(None, shared_by=2);"
            "print(c.bytes, c.file, b.bytes, b.source, sep='|')")
    proc = run_in(cgroup, env, [sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read, file, budget, source = proc.stdout.strip().split("|")
    assert int(read) == limit and int(budget) == limit // 2 and "cgroup" in source
    if cgroup is not None:
        assert Path(file).parent == cgroup


def test_a_job_in_a_cgroup_never_plans_past_its_budget(limited, tmp_path: Path, cli_here) -> None:
    """Growth on (the global batch doubles at every decision), memory off the node's scale: the
    bounds stop the growth, every rank's peak stays within its budget, and the job finishes."""
    cgroup, env, limit = limited
    out = tmp_path / "out"
    out.mkdir()
    argv = launching.command("mpirun", 2, [sys.executable, str(launching.WORKERS / "memory_budget.py"),
                                           "--out", str(out), "--epochs", "3", "--batch", "128",
                                           "--samples", "12000", "--policy", "adabatch"])
    proc = run_in(cgroup, env, argv, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    budget = ranks[0]["budget"]
    assert budget["bytes"] == limit // 2 and budget["shared_by"] == 2 and "cgroup" in budget["source"], budget
    history = ranks[0]["history"]
    assert len(history) >= 4, history
    for d in history:  # every decision within the bounds it was made under, all below max_batch
        assert all(b <= bound < 1024 for b, bound in zip(d["sizes"], d["bounds"])), d
    # the policy asked for twice the global batch at every decision: memory is what held it
    assert any(b == bound for d in history for b, bound in zip(d["sizes"], d["bounds"])), history
    assert max(max(d["sizes"]) for d in history) > 128, "the batch did grow"
    for r in ranks:
        assert r["peak_rss"] <= r["budget"]["bytes"], (r["peak_rss"] / MIB, r["budget"])
    summary = cli_here("summarize", str(out / "run"))
    assert summary.returncode == 0 and "memory budget rank 0: 0.68 GiB (cgroup" in summary.stdout, summary.stdout
    print(f"cgroup {limit / MIB:.0f} MiB: budget {budget['bytes'] / MIB:.0f} MiB per rank, floor "
          f"{ranks[0]['floor'] / MIB:.0f} MiB, peaks {[round(r['peak_rss'] / MIB) for r in ranks]} MiB, sizes "
          f"{[d['sizes'] for d in history]}, bounds {[d['bounds'] for d in history]}")
