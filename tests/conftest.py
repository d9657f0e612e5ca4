"""Fixtures shared by the tests. setup.cfg's ``pythonpath`` puts the repository root (dynamix_hvd,
bench) and tests/ (launching.py, workers/) on sys.path."""
from __future__ import annotations

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
