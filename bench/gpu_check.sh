#!/usr/bin/env bash
# The GPU check in ONE device call (docs/gpu.md has the exact call). Results under $OUT:
#   gpu_check.log  everything, with a line per step;  results.json  every step's outcome and numbers;
#   summary.md     the tables;  build_<tag>.log  the end of each Horovod build log.
# Steps, each under its own time budget, logged and continued after a failure:
#   env      machine, driver, versions (nvidia-smi, torch, numba, numba-cuda, numpy, cmake, nvcc)
#   wheels   carried .whl/*.whl into /tmp/site (numpy 2.4.x, numba-cuda 0.30.x; bench/gpu_fetch_wheels.sh)
#   horovod  Horovod 0.28.1 from the carried sdist, PyTorch + Gloo (+ MPI only if mpicc/mpirun exist),
#            CUDA-aware (host-staged allreduce), -j$(nproc), in the background while `kernel` runs;
#            if it fails, once more with CUDA off (then CUDA tensors are staged without ready events)
#   kernel   bench/bench_sqnorm_gpu.py: fused kernel vs torch on 1 GiB float32 and bf16 (+ sweep)
#   train1 / oom1 / train2   bench/gpu_job.py: 1 rank, the out-of-memory run, 2 ranks sharing the GPU
#            under horovodrun --gloo
#   nccl     a second Horovod build with NCCL from the pip package (nice 19, while the jobs run, within
#            what time is left), then a one-rank NCCL allreduce; never delays the steps above
# Environment: OUT (default /tmp/gpuout), GPU_CHECK_BUDGET_S (whole script, default 480),
# GPU_CHECK_DRY=1 (rehearsal here: no wheels, no build, the active venv's Horovod; CUDA steps say
# "skipped: no CUDA"), GPU_CHECK_NCCL=0 (no NCCL build), PYTHON (default python3),
# GPU_CHECK_STEPS (comma list of kernel,train1,oom1,train2; default all: for a rerun of some).
set -uo pipefail
export ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export OUT=${OUT:-/tmp/gpuout}
export WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work}
# Horovod builds live outside WORK: a second call on the still-warm machine reuses them (GPU_CHECK_REBUILD=1: no).
export HVD_DIR=${GPU_CHECK_HVD_DIR:-/tmp/gpu_check_hvd}
export PY=${PYTHON:-python3}
export J=${GPU_CHECK_JOBS:-$(nproc)}
DRY=${GPU_CHECK_DRY:-0}
NCCL=${GPU_CHECK_NCCL:-1}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
T0=$(date +%s)
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
export LOG=$OUT/gpu_check.log
: >"$LOG"
: >"$WORK/steps.tsv"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda

STEPS=",${GPU_CHECK_STEPS:-kernel,train1,oom1,train2},"
want() { [[ $STEPS == *",$1,"* ]] || { record "$1" skipped 0 "not in GPU_CHECK_STEPS"; return 1; }; }
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((BUDGET - $(elapsed))); }
log() { printf '[gpu_check %4ss] %s\n' "$(elapsed)" "$*" | tee -a "$LOG"; }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$WORK/steps.tsv"; log "step $1: $2 (${3}s) $4"; }

# run_step NAME BUDGET_S JSON_OR_- CMD...: run under `timeout`, log, record the outcome, never exit.
run_step() {
  local name=$1 budget=$2 json=$3 start rc note=""
  shift 3
  local room=$(($(left) - 20))  # 20 s stay for the report
  if ((room < 10)); then record "$name" skipped 0 "no time left"; return 1; fi
  ((budget > room)) && budget=$room
  log "== $name (budget ${budget}s): $*"
  start=$(date +%s)
  { timeout -k 5 "$budget" "$@" 2>&1; echo $? >"$WORK/$name.rc"; } | tee -a "$LOG"
  rc=$(cat "$WORK/$name.rc")
  if [ "$json" != - ] && [ -f "$json" ]; then
    note=$("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); c=d.get("checks",{})
bad=[k for k,v in c.items() if v.get("pass") is False]; skip=[k for k,v in c.items() if v.get("pass") is None]
parts=(["checks failed: "+",".join(bad)] if bad else [])+(["not checked (no CUDA): "+",".join(skip)] if skip else [])
print("skipped: "+d.get("reason","") if d.get("status")=="skipped" else "; ".join(parts))' "$json" 2>/dev/null)
  fi
  case $rc in
    0) if [ "$json" != - ] && [ ! -f "$json" ]; then record "$name" failed $(($(date +%s) - start)) "no result file"
       elif [[ $note == skipped* ]]; then record "$name" skipped $(($(date +%s) - start)) "$note"
       else record "$name" ok $(($(date +%s) - start)) "$note"; fi ;;
    124 | 137) record "$name" timeout $(($(date +%s) - start)) "over its ${budget}s budget" ;;
    *) record "$name" failed $(($(date +%s) - start)) "exit $rc" ;;
  esac
  [ "$rc" = 0 ]
}

env_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || echo "no nvidia-smi"
  "$PY" - <<'EOF'
import importlib, platform, sys
print("python", sys.version.split()[0], sys.executable, platform.machine())
for name in ("torch", "numpy", "numba", "llvmlite", "numba_cuda", "cuda.bindings", "horovod", "mpi4py", "pandas", "h5py"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:14s} {getattr(mod, '__version__', '?')}  {getattr(mod, '__file__', '')}")
    except Exception as exc:
        print(f"{name:14s} MISSING ({type(exc).__name__}: {exc})")
import torch
print("cuda available", torch.cuda.is_available(), "torch.version.cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "SMs", p.multi_processor_count, "memory GiB", round(p.total_memory / 2**30, 1))
try:
    import numpy as np
    from numba import cuda
    print("numba.cuda available", cuda.is_available())
    if cuda.is_available():
        @cuda.jit
        def one(a):
            a[0] = 1.0
        d = cuda.to_device(np.zeros(1))
        one[1, 1](d)
        print("numba.cuda kernel compiled and ran:", d.copy_to_host()[0] == 1.0)
except Exception as exc:
    print("numba.cuda unusable:", type(exc).__name__, exc)
EOF
  echo "nproc $(nproc)"; free -g | head -2; df -h /tmp | tail -1
  for t in nvcc cmake mpirun mpicc horovodrun g++; do printf '%-10s %s\n' "$t" "$(command -v $t || echo -)"; done
  nvcc --version 2>/dev/null | tail -2
}
export -f env_info

# build_horovod TAG VAR=VALUE...: Horovod 0.28.1 from the carried sdist into $HVD_DIR/hvd_TAG/site. The
# source fixes and the build command are launch/horovod_build.sh's, shared with launch/setup_env.sh.
build_horovod() {
  local tag=$1 d=$HVD_DIR/hvd_$1 no_cuda="" a settings=()
  shift
  if [ -f "$d/ok" ] && [ "${GPU_CHECK_REBUILD:-0}" != 1 ]; then echo "reused the build in $d"; return 0; fi
  rm -rf "$d"
  for a in "$@"; do if [ "$a" = HVD_NO_CUDA=1 ]; then no_cuda=--no-cuda; else settings+=("$a"); fi; done
  local src
  src=$(bash "$ROOT/launch/horovod_build.sh" prepare "$ROOT/.whl/horovod-0.28.1.tar.gz" "$d" $no_cuda) || return 1
  [ "${GPU_CHECK_DRY:-0}" = 1 ] && { echo "dry run: sources prepared in $src, build skipped"; return 0; }
  echo "building Horovod ($tag) with -j$J, $*"
  JOBS=$J PYTHON="$PY" nice -n "${NICE:-0}" bash "$ROOT/launch/horovod_build.sh" wheel "$src" "$d/out" \
    HOROVOD_BUILD_CUDA_CC_LIST=90 "${settings[@]}" >"$d/build.log" 2>&1 || { tail -n 40 "$d/build.log"; return 1; }
  "$PY" -m pip --disable-pip-version-check install -q --no-index --no-deps --no-compile --target "$d/site" \
    "$d"/out/horovod-*.whl >>"$d/build.log" 2>&1 || { tail -n 20 "$d/build.log"; return 1; }
  PYTHONPATH=$d/site:${PYTHONPATH:-} "$PY" -c "import horovod, horovod.torch as h; print('horovod', horovod.__version__,
    'gloo', h.gloo_built(), 'mpi', h.mpi_built(), 'nccl', h.nccl_built(), 'cuda', h.cuda_built())" &&
    touch "$d/ok"
}
export -f build_horovod

# ---------------------------------------------------------------------------------------------------
log "GPU check: budget ${BUDGET}s, $J cores, OUT=$OUT, dry=$DRY"
run_step env 40 - bash -c env_info

if [ "$DRY" = 1 ]; then
  record wheels skipped 0 "dry run: the active venv"
else
  run_step wheels 90 - bash -c 'ls .whl/*.whl && "$PY" -m pip --disable-pip-version-check install -q --no-index \
    --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && "$PY" -c "import numpy, numba; \
    print(\"numpy\", numpy.__version__, \"numba\", numba.__version__)"' ||
    log "wheels missing or not installed: run bench/gpu_fetch_wheels.sh and carry .whl"
  export PYTHONPATH=$ROOT:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
CUDA_OK=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

# Horovod (Gloo, CUDA-aware) builds in the background while the kernel benchmark runs.
HVD_TAG=gloo
start_build() {  # start_build TAG NICE BUDGET [VAR=VALUE...]
  local tag=$1 nice=$2 budget=$3
  shift 3
  ((budget < 10)) && budget=10
  log "== horovod_$tag build started in the background (budget ${budget}s)"
  ( s=$(date +%s); NICE=$nice timeout -k 5 "$budget" bash -c 'build_horovod "$@"' _ "$tag" "$@" >"$WORK/build_$tag.out" 2>&1
    echo "$? $(($(date +%s) - s))" >"$WORK/build_$tag.rc" ) &
}
wait_build() {  # wait_build TAG: record the outcome; succeeds if Horovod is usable
  local tag=$1 rc secs
  while [ ! -f "$WORK/build_$tag.rc" ]; do sleep 2; done
  read -r rc secs <"$WORK/build_$tag.rc"
  cat "$WORK/build_$tag.out" >>"$LOG"
  case $rc in
    0) record "horovod_$tag" ok "$secs" "$(tail -n 1 "$WORK/build_$tag.out")" ;;
    124 | 137) record "horovod_$tag" timeout "$secs" "build over its budget" ;;
    *) record "horovod_$tag" failed "$secs" "exit $rc; see build_$tag.log" ;;
  esac
  [ "$rc" = 0 ]
}
start_build gloo 10 $(($(left) > 330 ? 330 : $(left) - 60))  # nice 10: the kernel timing keeps its core

if ! want kernel; then :
elif [ "$CUDA_OK" = 1 ]; then
  run_step kernel 170 "$WORK/kernel.json" "$PY" bench/bench_sqnorm_gpu.py --json "$WORK/kernel.json"
else
  run_step kernel 60 "$WORK/kernel.json" "$PY" bench/bench_sqnorm_gpu.py --json "$WORK/kernel.json"
fi

if ! wait_build gloo && [ "$DRY" != 1 ] && (($(left) > 240)); then
  HVD_TAG=gloo_nocuda
  start_build gloo_nocuda 0 $(($(left) - 150)) HVD_NO_CUDA=1
  wait_build gloo_nocuda || HVD_TAG=none
fi
if [ "$DRY" != 1 ]; then
  export PYTHONPATH=$PYTHONPATH:$HVD_DIR/hvd_$HVD_TAG/site PATH=$HVD_DIR/hvd_$HVD_TAG/site/bin:$PATH
fi

# NCCL from the pip package: needs nccl.h and libnccl.so (the wheel ships libnccl.so.2 only).
NCCL_ENV=()
if [ "$NCCL" = 1 ] && [ "$DRY" != 1 ] && [ "$CUDA_OK" = 1 ]; then
  # nccl.h and a libnccl.so link to the pip package's libnccl.so.2 (launch/horovod_build.sh nccl).
  if nccl_out=$(bash launch/horovod_build.sh nccl "$PY" "$WORK" 2>&1); then
    read -r nccl_inc nccl_lib nccl_v <<<"$(tail -n 1 <<<"$nccl_out")"
    nccl_dir=$(dirname "$(dirname "$(readlink -f "$nccl_lib/libnccl.so")")")  # the package folder (lib/ below it)
    log "NCCL $nccl_v: $nccl_inc, $nccl_lib"
    NCCL_ENV=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_NCCL_INCLUDE=$nccl_inc" "HOROVOD_NCCL_LIB=$nccl_lib"
              HOROVOD_NCCL_LINK=SHARED)
    start_build nccl 19 $(($(left) - 45)) "${NCCL_ENV[@]}"
  else
    record horovod_nccl skipped 0 "no NCCL: ${nccl_out##*ERROR: }"
  fi
elif [ "$NCCL" = 1 ]; then
  record horovod_nccl skipped 0 "$([ "$DRY" = 1 ] && echo 'dry run' || echo 'skipped: no CUDA')"
fi

if [ "$CUDA_OK" = 1 ]; then
  TRAIN=(--steps 60 --batch 256)
  TRAIN2=(--steps 40 --batch 256)
  OOM=(--steps 30 --cap-gib 4)
else  # CPU rehearsal: a few steps of everything
  TRAIN=(--steps 8 --batch 16 --samples 512 --image 8 --width 8 --check-every 3 --decide-every 4 --overhead-blocks 1 --overhead-block 2)
  TRAIN2=("${TRAIN[@]}")
  OOM=(--steps 10 --width 8)
fi
if [ "$HVD_TAG" != none ]; then
  want train1 && run_step train1 100 "$WORK/train1.json" "$PY" bench/gpu_job.py --mode train "${TRAIN[@]}" --json "$WORK/train1.json"
  want oom1 && run_step oom1 100 "$WORK/oom1.json" "$PY" bench/gpu_job.py --mode oom "${OOM[@]}" --json "$WORK/oom1.json"
  want train2 && run_step train2 130 "$WORK/train2.json" horovodrun --gloo -np 2 -H localhost:2 \
    "$PY" bench/gpu_job.py --mode train "${TRAIN2[@]}" --json "$WORK/train2.json"
else
  for s in train1 oom1 train2; do record $s skipped 0 "no usable Horovod build"; done
fi

if [ ${#NCCL_ENV[@]} -gt 0 ]; then
  if wait_build nccl; then
    run_step nccl_smoke 30 - env PYTHONPATH="$ROOT:/tmp/site:$HVD_DIR/hvd_nccl/site" \
      LD_LIBRARY_PATH="$nccl_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PY" -c "
import torch, horovod.torch as hvd
hvd.init(); x = torch.arange(4., device='cuda'); y = hvd.allreduce(x, op=hvd.Sum)
print('nccl_built', hvd.nccl_built(), 'allreduce ok', bool((y == x).all()))"
  fi
fi

for f in "$HVD_DIR"/hvd_*/build.log; do
  [ -f "$f" ] && tail -n 3000 "$f" >"$OUT/build_$(basename "$(dirname "$f")" | sed 's/^hvd_//').log"
done
"$PY" bench/gpu_report.py "$WORK" "$OUT" "$(elapsed)" "$BUDGET" 2>&1 | tee -a "$LOG"
log "done in $(elapsed)s"
