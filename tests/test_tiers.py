"""The suite's tiers (tests/conftest.py, docs/testing.md): every collected test is in exactly one of unit, mpi
and system, `-m TIER` selects by them, and launch/run_tests.sh refuses a tier it does not know."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import COLLECTED_TIERS, MODULE_TIER, TIERS
from launching import REPO, job_env


def test_every_collected_test_has_exactly_one_tier(request: pytest.FixtureRequest):
    collected = request.config.stash[COLLECTED_TIERS]  # the whole collection, before -m/-k deselect
    assert request.node.nodeid in collected
    wrong = {nodeid: tiers for nodeid, tiers in collected.items() if len(tiers) != 1 or tiers[0] not in TIERS}
    assert not wrong, f"tests without exactly one tier: {wrong}"
    for name in MODULE_TIER:  # no stale entries
        assert (REPO / "tests" / name).is_file(), f"MODULE_TIER names {name}, which is not in tests/"


def test_a_tier_selects_its_tests_and_only_them():
    # the tier markers are there before -m deselects (a module of each kind: mixed, whole-module, by default)
    files = ["tests/test_elastic.py", "tests/test_gns_mpi.py", "tests/test_tiers.py"]
    procs = {tier: subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                     "-p", "no:xdist", "-m", tier, *files], cwd=REPO, env=job_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for tier in TIERS}  # side by side: each is mostly the start-up of Python and torch
    chosen = {}
    for tier, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode in (0, 5), out
        chosen[tier] = {line for line in out.splitlines() if "::" in line}
    elastic = "tests/test_elastic.py::test_worker_killed_mid_epoch_then_rejoins_without_losing_samples"
    assert elastic in chosen["system"] and elastic not in chosen["unit"] | chosen["mpi"], chosen
    assert "tests/test_elastic.py::test_controller_deadline_must_outlast_gloo_timeout" in chosen["unit"], chosen
    assert "tests/test_gns_mpi.py::test_smoothed_estimates_within_ten_percent_of_per_sample_truth" in chosen["mpi"]
    assert "tests/test_tiers.py::test_every_collected_test_has_exactly_one_tier" in chosen["unit"], chosen
    assert not (chosen["unit"] & chosen["mpi"] or chosen["unit"] & chosen["system"] or chosen["mpi"] & chosen["system"])


@pytest.mark.parametrize("args, message", [(["--tier", "fast"], "unknown tier 'fast'"),
                                           (["--tier", "unit,gpu"], "unknown tier 'gpu'"),
                                           (["--tier"], "--tier needs a tier"),
                                           (["--workers", "0"], "--workers needs a number of processes"),
                                           (["-n", "two"], "--workers needs a number of processes")])
def test_run_tests_refuses_an_unknown_tier_before_any_set_up(args, message):
    proc = subprocess.run(["bash", str(REPO / "launch" / "run_tests.sh"), *args], capture_output=True, text=True,
                          timeout=30, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and message in proc.stderr, proc.stdout + proc.stderr
    assert "[setup_env]" not in proc.stderr
