"""Fixtures shared by the tests. setup.cfg's ``pythonpath`` puts the repository root (dynamix_hvd,
bench) and tests/ (launching.py, workers/) on sys.path."""
from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

import launching

CliRunner = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="session")
def repo() -> Path:
    """The repository root (where bench/, launch/ and policies/ are)."""
    return launching.REPO


@pytest.fixture
def job_env() -> dict[str, str]:
    """The environment of a real job on this host: Open MPI's root permission, one thread per rank,
    this tree first on PYTHONPATH (what `launching.launch` gives its jobs)."""
    return launching.job_env()


@pytest.fixture
def cli_here(capsys: pytest.CaptureFixture[str]) -> CliRunner:
    """``dynamix-hvd ARGS`` in this process (cheaper than a new interpreter importing torch again);
    returns the exit code and what it printed as a CompletedProcess."""
    from dynamix_hvd.tools.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


# --- tiers ------------------------------------------------------------------------------------------------
# Every test belongs to exactly one tier (docs/testing.md; `bash launch/run_tests.sh --tier unit`):
#   unit    no multi-process job: one process, with children that start none (`python -c`, a launch
#           wrapper's checks that refuse or print the command); safe to run several at once
#   mpi     real multi-process jobs started the way users start them (mpirun, horovodrun, dynamix-hvd run)
#   system  Slurm, the chaos soak, elastic Horovod, the benchmarks run as tests, the set-up and packaging
# launch/run_tests.sh runs the unit tier over several processes, then the mpi and system tiers one test at
# a time: their jobs use every core, and many measure time.
# A test's tier: its own @pytest.mark.<tier>, else TEST_TIER, else MODULE_TIER, else its module's source
# decides (it imports `launching`: mpi; else unit).
TIERS = ("unit", "mpi", "system")

MODULE_TIER = {
    "test_accumulate_mpi.py": "mpi", "test_controller_mpi.py": "mpi", "test_dataplane_mpi.py": "mpi",
    "test_dba_mpi.py": "mpi", "test_dropin_mpi.py": "mpi", "test_faults_mpi.py": "mpi", "test_gns_mpi.py": "mpi",
    "test_model_mpi.py": "mpi", "test_preemption_mpi.py": "mpi", "test_progress_mpi.py": "mpi",
    "test_slow_rank_mpi.py": "mpi", "test_stall_mpi.py": "mpi", "test_tokens_mpi.py": "mpi",
    "test_integration_horovod.py": "mpi",
    "test_slurm.py": "system", "test_slurm_torchrun.py": "system", "test_chaos.py": "system", "test_packaging.py": "system",
    "test_setup_env.py": "system", "test_bench_overhead.py": "system",
    # mixed: unit by default, the tests that launch jobs say so themselves
    "test_bad_input.py": "unit", "test_bench_suite.py": "unit", "test_cli.py": "unit",
    "test_comm_collectives.py": "unit", "test_decision_core.py": "unit", "test_elastic.py": "unit",
    "test_plain_state.py": "unit", "test_zoo.py": "unit",
    "test_gpu_check.py": "unit", "test_tiers.py": "unit", "test_memory_budget.py": "unit", "test_launch.py": "unit",
}

# Tests in modules whose owners do not mark them (tests/test_memory_*.py): node id -> tier.
TEST_TIER = {
    "tests/test_memory_budget.py::test_a_job_in_a_cgroup_never_plans_past_its_budget": "mpi",
}


def _module_tier(path: Path) -> str:
    if path.name in MODULE_TIER:
        return MODULE_TIER[path.name]
    try:
        source = path.read_text()
    except OSError:
        return "unit"
    return "mpi" if "import launching" in source or "from launching import" in source else "unit"


def tier_of(item: pytest.Item) -> str:
    """The tier a test belongs to (see above)."""
    own = [m.name for m in item.iter_markers() if m.name in TIERS]
    if own:
        return own[0]  # the closest: a test's own marker before its class's or module's
    key = f"tests/{Path(str(item.path)).name}::{item.name.split('[')[0]}"
    return TEST_TIER.get(key) or _module_tier(Path(str(item.path)))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    collected = {}
    for item in items:
        tier = tier_of(item)
        if not any(m.name == tier for m in item.iter_markers()):
            item.add_marker(getattr(pytest.mark, tier))
        collected[item.nodeid] = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
    config.stash[COLLECTED_TIERS] = collected
    seed = config.getoption("--shuffle")
    if seed is not None:
        _shuffle(items, seed)


COLLECTED_TIERS = pytest.StashKey[dict]()


# --- time ---------------------------------------------------------------------------------------------------
# Each phase (set-up, call, teardown) of each test: (seconds, phase, node id, tier). launch/run_tests.sh runs
# two sessions (the unit tier over several processes, then the others one at a time) and sets
# DYNAMIX_TEST_LOG, a file every session appends its records to, and DYNAMIX_TEST_SUMMARY=N for the last
# one, which prints the time per tier and the N slowest phases of all of them.
_RECORDS: list[tuple[float, str, str, str]] = []
_STARTED: list[float] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _STARTED.append(time.perf_counter())


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller gets every worker's reports
    tier = next((k for k in report.keywords if k in TIERS), "?")
    _RECORDS.append((report.duration, report.when, report.nodeid, tier))


def _workers(config: pytest.Config) -> int:
    return int(getattr(config.option, "numprocesses", None) or 0)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    log = os.environ.get("DYNAMIX_TEST_LOG")
    if os.environ.get("PYTEST_XDIST_WORKER") or not (_RECORDS or log):
        return
    wall = time.perf_counter() - _STARTED[0] if _STARTED else 0.0
    session = {"wall_s": wall, "workers": _workers(config), "tiers": sorted({r[3] for r in _RECORDS})}
    records, sessions = list(_RECORDS), [session]
    if log:
        path = Path(log)
        earlier = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
        records += [tuple(e["record"]) for e in earlier if "record" in e]
        sessions = [e["session"] for e in earlier if "session" in e] + sessions
        with path.open("a") as f:
            f.writelines(json.dumps({"record": r}) + "\n" for r in _RECORDS)
            f.write(json.dumps({"session": session}) + "\n")
    show = int(os.environ.get("DYNAMIX_TEST_SUMMARY", "0") or 0) if log else 0
    if log and not show:
        return  # a later session prints the whole run's summary
    if not records:
        return
    per_tier: dict[str, float] = {}
    for seconds, _, _, tier in records:
        per_tier[tier] = per_tier.get(tier, 0.0) + seconds
    parts = [f"{t} {per_tier[t]:.0f} s" for t in (*TIERS, "?") if t in per_tier]
    write = terminalreporter.write_line
    write(f"time per tier (set-up + test + teardown, summed): {', '.join(parts)}")
    if len(sessions) > 1 or session["workers"]:
        write("sessions: " + "; ".join(
            f"{'/'.join(s['tiers'])} {s['wall_s']:.0f} s wall" + (f" on {s['workers']} processes" if s["workers"] else "")
            for s in sessions) + f"; {sum(s['wall_s'] for s in sessions):.0f} s in all")
    if show:
        terminalreporter.write_sep("=", f"slowest {show} set-ups/tests/teardowns of the whole run")
        for seconds, when, nodeid, _ in sorted(records, reverse=True)[:show]:
            write(f"{seconds:8.2f}s {when:<8} {nodeid}")


# --- order --------------------------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle", type=int, default=None, metavar="SEED",
                     help="run the modules in a random order and each module's tests in a random order "
                          "(no test may depend on the order; docs/testing.md)")


def _shuffle(items: list[pytest.Item], seed: int) -> None:
    """Modules in a random order, each module's tests in a random order (a module's tests stay together,
    so that its module-scoped fixtures are set up once)."""
    rng = random.Random(seed)
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(str(item.path), []).append(item)
    groups = list(modules.values())
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    items[:] = [item for group in groups for item in group]
