#!/usr/bin/env bash
# Run the test suite; does all set-up first (Open MPI, venv, Horovod build or cached wheel).
# Extra arguments go to pytest, e.g. `bash launch/run_tests.sh -k plan -x`.
#
#   --tier TIER   only the tests of TIER: unit (one process, seconds), mpi (real mpirun/horovodrun jobs) or
#                 system (Slurm, the chaos soak, elastic Horovod, benchmarks as tests, set-up, packaging);
#                 a comma list (--tier unit,mpi) or the option repeated runs several; all tiers by default.
#                 docs/testing.md says how long each takes.
# The 15 slowest set-ups/tests are listed at the end (--durations=N of your own overrides it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

_tiers=()
_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --tier) [ $# -ge 2 ] || { echo "run_tests.sh: --tier needs a tier: unit, mpi or system" >&2; exit 2; }
            _tiers+=("$2"); shift 2 ;;
    --tier=*) _tiers+=("${1#--tier=}"); shift ;;
    *) _args+=("$1"); shift ;;
  esac
done
_expr=""
for _list in ${_tiers[@]+"${_tiers[@]}"}; do
  IFS=, read -r -a _names <<<"$_list"
  [ ${#_names[@]} -gt 0 ] || { echo "run_tests.sh: --tier needs a tier: unit, mpi or system" >&2; exit 2; }
  for _t in "${_names[@]}"; do
    case $_t in
      unit|mpi|system) _expr=${_expr:+$_expr or }$_t ;;
      *) echo "run_tests.sh: unknown tier '$_t' (unit, mpi or system)" >&2; exit 2 ;;
    esac
  done
done
_select=()
[ -z "$_expr" ] || _select=(-m "$_expr")

. launch/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest tests --durations=15 ${_select[@]+"${_select[@]}"} ${_args[@]+"${_args[@]}"}
