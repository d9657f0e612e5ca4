#!/usr/bin/env bash
# Launch a dynamix_hvd job with horovodrun; configured by environment variables (defaults shown):
#   NP=2                  number of ranks
#   GLOO=0                0: MPI controller (horovodrun --mpi, needs mpirun); 1: Gloo (--gloo, no MPI needed)
#   HOSTFILE=             hostfile, one 'host slots=N' line per node (see hostfile.example); unset: this host
#   HOSTS=                or a host list instead: node1:2,node2:2 (default: localhost:$NP)
#   SCRIPT=               Python script run on every rank; unset: `python -m $MODULE`
#   MODULE=dynamix_hvd.examples.mlp
#   SCRIPT_ARGS=          arguments for the script (word-split); this wrapper's own arguments follow them
#   PYTHON=               interpreter for the ranks (default: the venv's python, by absolute path)
#   OVERSUBSCRIBE=0       1: allow more ranks than this host has cores (local runs only)
#   ALLOW_RUN_AS_ROOT=1   as root, export OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 (0: refuse to run as root)
#   MPIRUN=mpirun         the mpirun horovodrun --mpi will find (a path puts its folder first on PATH)
#   HOROVODRUN_ARGS=      extra horovodrun options (word-split), e.g. "--timeline-filename t.json"
#   DRY_RUN=0             1: check and print the command without running it
# Horovod's elastic mode (--min-np/--max-np) needs GLOO=1 and goes into HOROVODRUN_ARGS.
# Examples:  GLOO=1 NP=3 OVERSUBSCRIBE=1 bash launch/horovodrun.sh --batch-sizes 8,16,40
#            NP=8 HOSTFILE=hostfile bash launch/horovodrun.sh --epochs 5
set -euo pipefail
# Relative paths (HOSTFILE, SCRIPT, the example's --out) are taken from the directory you call it from.
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set -euo pipefail  # setup_env.sh relaxes these for interactive callers

NP=${NP:-2} GLOO=${GLOO:-0} HOSTFILE=${HOSTFILE:-} HOSTS=${HOSTS:-} SCRIPT=${SCRIPT:-} SCRIPT_ARGS=${SCRIPT_ARGS:-}
MODULE=${MODULE:-dynamix_hvd.examples.mlp} PYTHON=${PYTHON:-$(command -v python)}
OVERSUBSCRIBE=${OVERSUBSCRIBE:-0} ALLOW_RUN_AS_ROOT=${ALLOW_RUN_AS_ROOT:-1}
MPIRUN=${MPIRUN:-mpirun} HOROVODRUN_ARGS=${HOROVODRUN_ARGS:-} DRY_RUN=${DRY_RUN:-0}
if [ "$GLOO" = 1 ]; then launcher=horovodrun-gloo mode=--gloo; else launcher=horovodrun mode=--mpi; fi
# Horovod's stall warning and shutdown (docs/faults.md "A rank that stops answering"); set them to override.
export HOROVOD_STALL_CHECK_TIME_SECONDS=${HOROVOD_STALL_CHECK_TIME_SECONDS:-60}
export HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=${HOROVOD_STALL_SHUTDOWN_TIME_SECONDS:-900}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DYNAMIX_LAUNCHER=$launcher
if [[ "$MPIRUN" == */* && -x "$MPIRUN" ]]; then PATH="$(dirname "$MPIRUN"):$PATH"; export PATH; fi
# Ranks cannot tell whether a person watches (Open MPI gives them a pty anyway): we can.
if [ -t 2 ]; then export DYNAMIX_PROGRESS=${DYNAMIX_PROGRESS:-bar}; fi
if [ "$(id -u)" = 0 ] && [ "$ALLOW_RUN_AS_ROOT" = 1 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # Open MPI refuses root otherwise
fi
"$PYTHON" -m dynamix_hvd.tools.launchcheck --launcher "$launcher" --np "$NP" --hostfile "$HOSTFILE" --hosts "$HOSTS" \
  --oversubscribe "$OVERSUBSCRIBE" --allow-root "$ALLOW_RUN_AS_ROOT" --mpirun "$MPIRUN" || exit $?

cmd=(horovodrun "$mode" -np "$NP")
if [ -n "$HOSTFILE" ]; then cmd+=(-hostfile "$HOSTFILE"); else cmd+=(-H "${HOSTS:-localhost:$NP}"); fi
# shellcheck disable=SC2206  # word-splitting of the *_ARGS variables is intended
cmd+=($HOROVODRUN_ARGS)
if [ -n "$SCRIPT" ]; then job=("$PYTHON" "$SCRIPT"); else job=("$PYTHON" -m "$MODULE"); fi
# shellcheck disable=SC2206
job+=($SCRIPT_ARGS "$@")
echo "[horovodrun.sh] ${cmd[*]} ${job[*]}" >&2
if [ "$DRY_RUN" = 1 ]; then exit 0; fi
exec "${cmd[@]}" "${job[@]}"
