#!/usr/bin/env bash
# Horovod 0.28.1 from PyPI's sdist: the source fixes, the toolkit and NCCL look-ups and the build
# command, in one place for launch/setup_env.sh and bench/gpu_check.sh.
#
#   horovod_build.sh prepare SDIST DIR [--no-cuda]
#       Extract SDIST (horovod-0.28.1.tar.gz) into DIR/horovod-0.28.1 (replacing an earlier copy), apply
#       and verify every source fix below, and put the C++17 compiler wrapper at DIR/cxx17.
#       --no-cuda leaves the torch extension's CUDA code out (a fallback when nvcc cannot build it).
#   horovod_build.sh cuda-home PYTHON WORKDIR
#       Print "DIR VERSION" of a CUDA toolkit whose major version matches PYTHON's torch: DYNAMIX_CUDA_HOME
#       (a folder, or "pip" for the pip packages only), else $CUDA_HOME, nvcc on PATH, /usr/local/cuda,
#       else the pip packages (nvidia-cuda-nvcc, -runtime, -cccl, nvidia-nvvm) in PYTHON's site-packages,
#       merged into WORKDIR/cuda (nvcc wants one folder with lib64). Exit 1 with the reason when none fits
#       or a part is missing.
#   horovod_build.sh nccl PYTHON WORKDIR
#       Print "INCLUDE_DIR LIB_DIR VERSION" of NCCL: DYNAMIX_NCCL_HOME or HOROVOD_NCCL_HOME, the system's
#       (nccl.h and libnccl.so), else the pip package (nvidia-nccl-cu*), whose libnccl.so.2 gets a
#       libnccl.so link under WORKDIR/nccl. Exit 1 with the reason when none is found.
#   horovod_build.sh wheel SRC OUTDIR [VAR=VALUE ...]
#       Build the wheel of a prepared SRC into OUTDIR with PyTorch + Gloo, MPI when mpicc and mpirun are
#       found (HOROVOD_WITHOUT_MPI=1 or HOROVOD_WITH_MPI=1 among VAR=VALUE override it), CXX=the
#       wrapper, and CMake 4's policy minimum. VAR=VALUE adds build settings (HOROVOD_GPU_OPERATIONS=NCCL,
#       HOROVOD_CUDA_HOME=..., ...). PYTHON (default python3) is the interpreter whose torch it builds
#       against; JOBS (default nproc) the parallel compiles.
#
# The source fixes (each checked after it is applied; a failed check stops with the file's name):
#   1. C++17 everywhere: torch >= 2.1 headers need it, Horovod asks for C++14 (g++) and C++11 (nvcc).
#      The wrapper rewrites g++'s -std flag (upstream's unreleased fix only changes the standard); the
#      CUDA kernels' CMake file is patched to CMAKE_CUDA_STANDARD 17, since nvcc runs the wrapper as its
#      host compiler and both passes must agree.
#   2. No distutils (gone in Python 3.12): the torch CMake file asks sysconfig for Python's headers and
#      horovodrun's js_run.py takes shutil.which.
#   3. Open MPI 5: horovodrun passes '-bind-to none -map-by slot', which Open MPI 5's mpirun misreads
#      (it takes 'none' for the program); the double-dash spelling works with Open MPI 4 and 5.
#   4. CMake 4 refuses the cmake_minimum_required(VERSION 2.8.12) of Gloo and FlatBuffers:
#      `wheel` sets CMAKE_POLICY_VERSION_MINIMUM=3.5 (CMake 3 ignores it).
set -euo pipefail
HVD_VERSION=0.28.1
_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { printf '[horovod_build] ERROR: %s\n' "$*" >&2; exit 1; }

# patch FILE SED_EXPR CHECK_REGEX WHAT: apply, then require CHECK_REGEX in FILE.
patch_file() {
  local file=$1 expr=$2 check=$3 what=$4
  [ -f "$file" ] || die "$what: $file is missing from the sdist"
  sed -i "$expr" "$file"
  grep -Eq "$check" "$file" || die "$what: the fix did not apply to $file"
}

cmd_prepare() {
  local sdist=${1:?prepare needs SDIST DIR} dir=${2:?prepare needs SDIST DIR} no_cuda=${3:-}
  [ -f "$sdist" ] || die "sdist $sdist not found"
  [ -z "$no_cuda" ] || [ "$no_cuda" = --no-cuda ] || die "prepare: unknown option $no_cuda (only --no-cuda)"
  mkdir -p "$dir"
  local src=$dir/horovod-$HVD_VERSION
  rm -rf "$src"
  tar xzf "$sdist" -C "$dir" || die "cannot extract $sdist"
  [ -f "$src/setup.py" ] || die "$sdist is not Horovod $HVD_VERSION's sdist (no $src/setup.py)"
  patch_file "$src/horovod/common/ops/cuda/CMakeLists.txt" 's/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' \
    'CMAKE_CUDA_STANDARD 17' "C++17 for nvcc"
  patch_file "$src/horovod/torch/CMakeLists.txt" \
    "s|from distutils.sysconfig import get_python_inc; print(get_python_inc())|import sysconfig; print(sysconfig.get_paths()['include'])|" \
    "sysconfig.get_paths\(\)\['include'\]" "Python headers without distutils"
  patch_file "$src/horovod/runner/js_run.py" 's|^from distutils.spawn import find_executable$|from shutil import which as find_executable|' \
    '^from shutil import which as find_executable$' "horovodrun without distutils"
  ! grep -rq "^from distutils\|^import distutils" "$src/horovod/runner" "$src/horovod/torch" \
    || die "distutils imports left in $src/horovod/runner or horovod/torch"
  patch_file "$src/horovod/runner/mpi_run.py" \
    "s/'-bind-to none', '-map-by slot'/'--bind-to none', '--map-by slot'/; s/'-bind-to socket', '-map-by socket', '-rank-by core'/'--bind-to socket', '--map-by socket', '--rank-by core'/" \
    "'--bind-to none', '--map-by slot'" "horovodrun on Open MPI 5"
  grep -q "'--rank-by core'" "$src/horovod/runner/mpi_run.py" || die "horovodrun on Open MPI 5: socket binding flags not fixed"
  if [ "$no_cuda" = --no-cuda ]; then
    patch_file "$src/horovod/torch/CMakeLists.txt" \
      '/elseif (Pytorch_CUDA AND NOT HAVE_CUDA)/{n;s/add_cuda()/# add_cuda() (left out: --no-cuda)/}' \
      'left out: --no-cuda' "torch extension without CUDA"
  fi
  cp "$_here/cxx17" "$dir/cxx17"  # a copy, so a checkout without the exec bit works
  chmod +x "$dir/cxx17"
  echo "$src"
}

# The site-packages folders of PYTHON.
site_dirs() { "$1" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))'; }

torch_cuda() { "$1" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null; }

nvcc_version() {  # nvcc_version NVCC -> 12.8
  "$1" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p' | head -n 1
}

cmd_cuda_home() {
  local py=${1:?cuda-home needs PYTHON WORKDIR} work=${2:?cuda-home needs PYTHON WORKDIR} want cand v tried=()
  want=$(torch_cuda "$py") || true
  [ -n "$want" ] || die "the torch of $py has no CUDA (torch.version.cuda is None): no CUDA toolkit needed"
  local major=${want%%.*} cands=()
  case ${DYNAMIX_CUDA_HOME:-} in
    pip) ;;
    "") [ -n "${CUDA_HOME:-}" ] && cands+=("$CUDA_HOME")
        command -v nvcc >/dev/null 2>&1 && cands+=("$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
        cands+=(/usr/local/cuda) ;;
    *) [ -x "$DYNAMIX_CUDA_HOME/bin/nvcc" ] || die "DYNAMIX_CUDA_HOME=$DYNAMIX_CUDA_HOME has no bin/nvcc"
       cands+=("$DYNAMIX_CUDA_HOME") ;;
  esac
  for cand in "${cands[@]}"; do
    [ -x "$cand/bin/nvcc" ] || continue
    v=$(nvcc_version "$cand/bin/nvcc")
    if [ "${v%%.*}" = "$major" ]; then echo "$cand $v"; return 0; fi
    tried+=("$cand (nvcc $v)")
  done
  [ -n "${DYNAMIX_CUDA_HOME:-}" ] && [ "$DYNAMIX_CUDA_HOME" != pip ] \
    && die "DYNAMIX_CUDA_HOME=$DYNAMIX_CUDA_HOME has nvcc $v but torch is built for CUDA $want"
  # The pip packages: CUDA 13 keeps everything in nvidia/cu13; CUDA 12 splits it over nvidia/cuda_*.
  local site parts=()
  while read -r site; do
    [ -x "$site/nvidia/cu$major/bin/nvcc" ] && parts=("$site/nvidia/cu$major") && break
    if [ -x "$site/nvidia/cuda_nvcc/bin/nvcc" ]; then
      parts=("$site/nvidia/cuda_nvcc")
      for p in cuda_runtime cuda_cccl cuda_crt nvvm; do [ -d "$site/nvidia/$p" ] && parts+=("$site/nvidia/$p"); done
      break
    fi
  done < <(site_dirs "$py")
  [ ${#parts[@]} -gt 0 ] || die "no CUDA $major toolkit for torch's CUDA $want: tried ${tried[*]:-no nvcc on PATH, no CUDA_HOME} and
  the pip packages in $py's site-packages. Install one: $py -m pip install 'nvidia-cuda-nvcc$( [ "$major" -ge 13 ] || echo -cu$major)==$want.*'"
  v=$(nvcc_version "${parts[0]}/bin/nvcc")
  [ "${v%%.*}" = "$major" ] || die "pip nvcc ${parts[0]}/bin/nvcc is CUDA $v, torch is built for CUDA $want"
  local home=${parts[0]}
  if [ ${#parts[@]} -gt 1 ] || [ ! -f "$home/include/cuda_runtime.h" ] || [ ! -e "$home/lib64/libcudart_static.a" ]; then
    # One folder as nvcc, CMake and torch expect (bin, include, lib64, nvvm): nvcc copied (it finds
    # its siblings from its own location), everything else linked.
    home=$work/cuda
    rm -rf "$home"
    mkdir -p "$home/bin"
    cp -a "${parts[0]}/bin/." "$home/bin/"
    for p in "${parts[@]}"; do
      for sub in include lib nvvm; do
        [ -d "$p/$sub" ] && mkdir -p "$home/$sub" && cp -rsn "$p/$sub/." "$home/$sub/"
      done
    done
    [ -d "$(dirname "${parts[0]}")/nvvm" ] && [ ! -d "$home/nvvm" ] && ln -s "$(dirname "${parts[0]}")/nvvm" "$home/nvvm"
    local rt
    rt=$(ls "$home"/lib/libcudart.so.* 2>/dev/null | head -n 1 || true)
    [ -n "$rt" ] && [ ! -e "$home/lib/libcudart.so" ] && ln -s "$(basename "$rt")" "$home/lib/libcudart.so"
    ln -s lib "$home/lib64"  # nvcc links from lib64
  fi
  [ -x "$home/nvvm/bin/cicc" ] || [ -x "$(dirname "$(readlink -f "$home/bin/nvcc")")/../nvvm/bin/cicc" ] \
    || die "CUDA toolkit $home lacks nvvm/bin/cicc: $py -m pip install 'nvidia-nvvm$( [ "$major" -ge 13 ] || echo -cu$major)==$want.*'"
  [ -f "$home/include/cuda_runtime.h" ] \
    || die "CUDA toolkit $home lacks include/cuda_runtime.h: $py -m pip install 'nvidia-cuda-runtime$( [ "$major" -ge 13 ] || echo -cu$major)==$want.*'"
  [ -f "$home/include/nv/target" ] || [ -f "$home/include/cccl/nv/target" ] \
    || die "CUDA toolkit $home lacks the CCCL headers (include/nv/target): $py -m pip install 'nvidia-cuda-cccl$( [ "$major" -ge 13 ] || echo -cu$major)==$want.*'"
  echo "$home $v"
}

nccl_version() {  # nccl_version NCCL_H -> 2.21.5
  awk '/^#define NCCL_(MAJOR|MINOR|PATCH)[ \t]/ {v[$2]=$3} END {if (v["NCCL_MAJOR"] != "") print v["NCCL_MAJOR"] "." v["NCCL_MINOR"] "." v["NCCL_PATCH"]}' "$1"
}

cmd_nccl() {
  local py=${1:?nccl needs PYTHON WORKDIR} work=${2:?nccl needs PYTHON WORKDIR} home inc lib site
  home=${DYNAMIX_NCCL_HOME:-${HOROVOD_NCCL_HOME:-}}
  if [ -n "$home" ]; then
    [ -f "$home/include/nccl.h" ] || die "NCCL home $home has no include/nccl.h"
    for lib in "$home/lib" "$home/lib64"; do ls "$lib"/libnccl.so* >/dev/null 2>&1 && break; done
    ls "$lib"/libnccl.so* >/dev/null 2>&1 || die "NCCL home $home has no lib/libnccl.so*"
    echo "$home/include $lib $(nccl_version "$home/include/nccl.h")"; return 0
  fi
  for inc in ${CUDA_HOME:+$CUDA_HOME/include} /usr/include /usr/local/include /usr/local/cuda/include; do
    [ -f "$inc/nccl.h" ] || continue
    for lib in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib ${CUDA_HOME:+$CUDA_HOME/lib64} /usr/local/cuda/lib64; do
      if [ -e "$lib/libnccl.so" ]; then echo "$inc $lib $(nccl_version "$inc/nccl.h")"; return 0; fi
    done
  done
  while read -r site; do
    [ -f "$site/nvidia/nccl/include/nccl.h" ] || continue
    local so
    so=$(ls "$site"/nvidia/nccl/lib/libnccl.so* 2>/dev/null | head -n 1 || true)
    [ -n "$so" ] || die "pip NCCL in $site/nvidia/nccl has nccl.h but no lib/libnccl.so*"
    # Only NCCL's own files (CUDA 13's pip packages share include/ and lib/ with the toolkit).
    rm -rf "$work/nccl" && mkdir -p "$work/nccl/include" "$work/nccl/lib"
    ln -s "$site"/nvidia/nccl/include/nccl*.h "$work/nccl/include/"
    ln -s "$so" "$work/nccl/lib/libnccl.so"
    echo "$work/nccl/include $work/nccl/lib $(nccl_version "$site/nvidia/nccl/include/nccl.h")"; return 0
  done < <(site_dirs "$py")
  die "no NCCL found: no nccl.h with libnccl.so in /usr/include, /usr/local/cuda or \$CUDA_HOME, and no pip
  package nvidia-nccl-cu* in $py's site-packages. Install one ($py -m pip install nvidia-nccl-cu13 for torch
  built with CUDA 13) or set DYNAMIX_NCCL_HOME"
}

cmd_wheel() {
  local src=${1:?wheel needs SRC OUTDIR} out=${2:?wheel needs SRC OUTDIR} mpi=() a
  shift 2
  [ -f "$src/setup.py" ] && grep -q 'CMAKE_CUDA_STANDARD 17' "$src/horovod/common/ops/cuda/CMakeLists.txt" \
    || die "$src is not a prepared Horovod source (run: horovod_build.sh prepare SDIST DIR)"
  [ -x "$src/../cxx17" ] || die "$src/../cxx17 (the C++17 wrapper) is missing"
  for a in "$@"; do
    [[ $a == *=* ]] || die "build setting '$a' is not VAR=VALUE"
    case $a in HOROVOD_WITH_MPI=* | HOROVOD_WITHOUT_MPI=*) mpi=(-) ;; esac
  done
  if [ ${#mpi[@]} = 0 ]; then
    if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then mpi=(HOROVOD_WITH_MPI=1)
    else mpi=(HOROVOD_WITHOUT_MPI=1); fi
  else mpi=(); fi
  local jobs=${JOBS:-$(nproc)}
  mkdir -p "$out"
  echo "[horovod_build] building Horovod $HVD_VERSION: ${mpi[*]} $* (-j$jobs)"
  env CXX="$(cd "$src/.." && pwd)/cxx17" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    MAKEFLAGS="-j$jobs" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "${mpi[@]}" "$@" \
    "${PYTHON:-python3}" -m pip --disable-pip-version-check wheel --no-deps --no-build-isolation --no-cache-dir \
    -w "$out" "$src"
}

case ${1:-} in
  prepare) shift; cmd_prepare "$@" ;;
  cuda-home) shift; cmd_cuda_home "$@" ;;
  nccl) shift; cmd_nccl "$@" ;;
  wheel) shift; cmd_wheel "$@" ;;
  *) die "usage: horovod_build.sh prepare SDIST DIR [--no-cuda] | cuda-home PYTHON WORKDIR | nccl PYTHON WORKDIR | wheel SRC OUTDIR [VAR=VALUE ...] (got '${1:-}')" ;;
esac
