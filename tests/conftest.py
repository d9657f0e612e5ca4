"""Fixtures shared by the tests. setup.cfg's ``pythonpath`` puts the repository root (dynamix_hvd,
bench) and tests/ (launching.py, workers/) on sys.path."""
from __future__ import annotations

import random
import subprocess
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
#   unit    one process, no launcher (a plain `python -c` child at most); seconds in all
#   mpi     real multi-process jobs started the way users start them (mpirun, horovodrun, dynamix-hvd run)
#   system  Slurm, the chaos soak, elastic Horovod, the benchmarks run as tests, the set-up and packaging
# A test's tier: its own @pytest.mark.<tier>, else TEST_TIER, else MODULE_TIER, else its module's source
# decides (it imports `launching`: mpi; else unit).
TIERS = ("unit", "mpi", "system")

MODULE_TIER = {
    "test_accumulate_mpi.py": "mpi", "test_controller_mpi.py": "mpi", "test_dataplane_mpi.py": "mpi",
    "test_dba_mpi.py": "mpi", "test_dropin_mpi.py": "mpi", "test_faults_mpi.py": "mpi", "test_gns_mpi.py": "mpi",
    "test_model_mpi.py": "mpi", "test_preemption_mpi.py": "mpi", "test_progress_mpi.py": "mpi",
    "test_slow_rank_mpi.py": "mpi", "test_stall_mpi.py": "mpi", "test_tokens_mpi.py": "mpi",
    "test_integration_horovod.py": "mpi", "test_launch.py": "mpi",
    "test_slurm.py": "system", "test_chaos.py": "system", "test_packaging.py": "system",
    "test_setup_env.py": "system", "test_bench_overhead.py": "system",
    # mixed: unit by default, the tests that launch jobs say so themselves
    "test_bad_input.py": "unit", "test_bench_suite.py": "unit", "test_cli.py": "unit",
    "test_comm_collectives.py": "unit", "test_decision_core.py": "unit", "test_elastic.py": "unit",
    "test_plain_state.py": "unit", "test_zoo.py": "unit",
    "test_gpu_check.py": "unit", "test_tiers.py": "unit", "test_memory_budget.py": "unit",
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
_TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = next((k for k in report.keywords if k in TIERS), None)
    if tier is not None:
        _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if _TIER_SECONDS:
        parts = [f"{t} {_TIER_SECONDS[t]:.0f} s" for t in TIERS if t in _TIER_SECONDS]
        terminalreporter.write_line(f"time per tier (set-up + test + teardown): {', '.join(parts)}")


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
