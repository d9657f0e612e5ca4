#!/usr/bin/env bash
# Run the example dynamix_hvd training job; does all set-up first (see launch/setup_env.sh).
#   NP=2                       number of ranks
#   LAUNCHER=mpirun            mpirun | horovodrun | horovodrun-gloo
#   BATCH_SIZES=16,48          local batch size per rank (default: 32 each)
#   EPOCHS=3  OUT=runs/mlp     epochs and output directory
# Extra arguments go to the training script (python -m dynamix_hvd.examples.mlp_train --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. launch/setup_env.sh
NP=${NP:-2}
LAUNCHER=${LAUNCHER:-mpirun}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} EPOCHS=${EPOCHS:-3} OUT=${OUT:-runs/mlp} BATCH_SIZES=${BATCH_SIZES:-}
if [ "$(id -u)" = 0 ]; then
  # Open MPI refuses to run as root unless told twice; containers and CI often are root.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
job=(python -m dynamix_hvd.examples.mlp_train "$@")
case "$LAUNCHER" in
  mpirun) exec mpirun --oversubscribe --bind-to none -np "$NP" -x OMP_NUM_THREADS -x EPOCHS -x OUT -x BATCH_SIZES "${job[@]}" ;;
  horovodrun) exec horovodrun --mpi -np "$NP" -H "localhost:$NP" "${job[@]}" ;;
  horovodrun-gloo) exec horovodrun --gloo -np "$NP" -H "localhost:$NP" "${job[@]}" ;;
  *) echo "LAUNCHER=$LAUNCHER is not one of mpirun, horovodrun, horovodrun-gloo" >&2; exit 2 ;;
esac
