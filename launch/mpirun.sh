#!/usr/bin/env bash
# Launch a dynamix_hvd job with Open MPI's mpirun; configured by environment variables (defaults shown):
#   NP=2                  number of ranks
#   HOSTFILE=             hostfile, one 'host slots=N' line per node (see hostfile.example); unset: this host
#   HOSTS=                or a host list instead: node1:2,node2:2
#   SCRIPT=               Python script run on every rank; unset: `python -m $MODULE`
#   MODULE=dynamix_hvd.examples.mlp
#   SCRIPT_ARGS=          arguments for the script (word-split); this wrapper's own arguments follow them
#   PYTHON=               interpreter for the ranks (default: the venv's python, by absolute path)
#   OVERSUBSCRIBE=0       1: allow more ranks than cores (or than the hostfile's slots): --oversubscribe
#   ALLOW_RUN_AS_ROOT=1   as root, export OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 (0: refuse to run as root)
#   MPIRUN=mpirun         the mpirun to use (name on PATH or a path)
#   MPIRUN_ARGS=          extra mpirun options (word-split), e.g. "--mca btl_tcp_if_include eth0"
#   DRY_RUN=0             1: check and print the command without running it
# The example also reads EPOCHS, BATCH_SIZES, OUT, POLICY, POLICY_FILE; they are forwarded to every rank.
# Examples:  NP=4 OVERSUBSCRIBE=1 bash launch/mpirun.sh --epochs 2
#            NP=8 HOSTFILE=hostfile bash launch/mpirun.sh --batch-sizes 16,16,32,32,64,64,64,64
# Checks run first (python -m dynamix_hvd.tools.launchcheck) and stop a misconfigured launch with exit 2.
set -euo pipefail
# Relative paths (HOSTFILE, SCRIPT, the example's --out) are taken from the directory you call it from.
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set -euo pipefail  # setup_env.sh relaxes these for interactive callers

NP=${NP:-2} HOSTFILE=${HOSTFILE:-} HOSTS=${HOSTS:-} SCRIPT=${SCRIPT:-} SCRIPT_ARGS=${SCRIPT_ARGS:-}
MODULE=${MODULE:-dynamix_hvd.examples.mlp} PYTHON=${PYTHON:-$(command -v python)}
OVERSUBSCRIBE=${OVERSUBSCRIBE:-0} ALLOW_RUN_AS_ROOT=${ALLOW_RUN_AS_ROOT:-1}
MPIRUN=${MPIRUN:-mpirun} MPIRUN_ARGS=${MPIRUN_ARGS:-} DRY_RUN=${DRY_RUN:-0}
# Horovod's stall warning and shutdown (docs/faults.md "A rank that stops answering"); set them to override.
export HOROVOD_STALL_CHECK_TIME_SECONDS=${HOROVOD_STALL_CHECK_TIME_SECONDS:-60}
export HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=${HOROVOD_STALL_SHUTDOWN_TIME_SECONDS:-900}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DYNAMIX_LAUNCHER=mpirun
# Ranks cannot tell whether a person watches (Open MPI gives them a pty anyway): we can.
if [ -t 2 ]; then export DYNAMIX_PROGRESS=${DYNAMIX_PROGRESS:-bar}; fi
if [ "$(id -u)" = 0 ] && [ "$ALLOW_RUN_AS_ROOT" = 1 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # Open MPI refuses root otherwise
fi
"$PYTHON" -m dynamix_hvd.tools.launchcheck --launcher mpirun --np "$NP" --hostfile "$HOSTFILE" --hosts "$HOSTS" \
  --oversubscribe "$OVERSUBSCRIBE" --allow-root "$ALLOW_RUN_AS_ROOT" --mpirun "$MPIRUN" || exit $?

cmd=("$MPIRUN" -np "$NP" --bind-to none)
if [ -n "$HOSTFILE" ]; then cmd+=(--hostfile "$HOSTFILE"); elif [ -n "$HOSTS" ]; then cmd+=(-H "$HOSTS"); fi
if [ "$OVERSUBSCRIBE" = 1 ]; then cmd+=(--oversubscribe); fi
for var in PATH LD_LIBRARY_PATH PYTHONPATH OMP_NUM_THREADS DYNAMIX_LAUNCHER EPOCHS BATCH_SIZES OUT POLICY \
           POLICY_FILE DYNAMIX_POLICY_DIR DYNAMIX_PROGRESS OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM \
           HOROVOD_STALL_CHECK_TIME_SECONDS HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; do
  if [ -n "${!var+x}" ]; then cmd+=(-x "$var"); fi
done
# shellcheck disable=SC2206  # word-splitting of the *_ARGS variables is intended
cmd+=($MPIRUN_ARGS)
if [ -n "$SCRIPT" ]; then job=("$PYTHON" "$SCRIPT"); else job=("$PYTHON" -m "$MODULE"); fi
# shellcheck disable=SC2206
job+=($SCRIPT_ARGS "$@")
echo "[mpirun.sh] ${cmd[*]} ${job[*]}" >&2
if [ "$DRY_RUN" = 1 ]; then exit 0; fi
exec "${cmd[@]}" "${job[@]}"
