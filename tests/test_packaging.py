"""The shipped policy travels with the package: wheel and sdist carry policies/ as package data, and a
wheel installed into a fresh virtual environment outside the repository loads the default policy and
has the example script and the CLI. The lab (bench/) is not part of the wheel."""
from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("default.pt", "default.json")

CHECK = """
import dynamix_hvd, sys
from pathlib import Path
from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.config import ControllerConfig, make_policy
from dynamix_hvd.control.policy_store import default_policy_dir, load_policy
assert Path(dynamix_hvd.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), dynamix_hvd.__file__
learner, meta = load_policy("default", ActionSpace())
policy = make_policy(ControllerConfig(policy="ppo"))
assert policy.learner.config == learner.config
print("package", dynamix_hvd.__file__)
print("policy dir", default_policy_dir())
print("default policy sha256", meta["sha256"], "updates", meta["provenance"]["num_updates"])
import dynamix_hvd.examples.mlp, dynamix_hvd.tools.cli
print("example", dynamix_hvd.examples.mlp.__file__)
try:
    import bench
    print("bench found", bench.__file__)
except ImportError:
    print("no bench")
"""


def run(*cmd: str, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(REPO), "-w", str(out))
    (whl,) = out.glob("dynamix_hvd-*.whl")
    return whl


def test_wheel_ships_the_policies(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for f in SHIPPED:
        assert f"dynamix_hvd/policies/{f}" in names, f"{f} missing from {wheel.name}"
    assert "dynamix_hvd/examples/mlp.py" in names, f"the example script is missing from {wheel.name}"
    assert not [n for n in names if n.startswith("bench/")], f"the lab (bench/) is in {wheel.name}"


def test_sdist_ships_the_policies(tmp_path):
    run(sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path), cwd=REPO)
    (sdist,) = tmp_path.glob("dynamix_hvd-*.tar.gz")
    names = tarfile.open(sdist).getnames()
    for f in SHIPPED:
        assert any(n.endswith(f"/policies/{f}") for n in names), f"{f} missing from {sdist.name}"


def test_wheel_in_a_fresh_venv_outside_the_repo_loads_the_default_policy(wheel, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv))
    # without the caller's PYTHONPATH: a repository on it (its egg-info) would make pip skip the wheel
    run(str(venv / "bin" / "pip"), "install", "-q", "--no-deps", str(wheel), env={"PATH": "/usr/bin:/bin"})
    # torch, numpy, ... come from the shared environment; the repository is not on the path.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": sysconfig.get_paths()["purelib"], "OMP_NUM_THREADS": "1"}
    out = run(str(venv / "bin" / "python"), "-c", CHECK, cwd=tmp_path, env=env)
    print(out)
    assert f"policy dir {venv}" in out and "dynamix_hvd/policies" in out
    shipped = json.loads((REPO / "policies" / "default.json").read_text())["sha256"]
    assert f"default policy sha256 {shipped} " in out, "the wheel carries this tree's default policy"
    assert f"example {venv}" in out and "no bench" in out, out
