#!/usr/bin/env bash
# Run the test suite; does all set-up first (Open MPI, venv, Horovod build or cached wheel).
# Extra arguments go to pytest, e.g. `bash launch/run_tests.sh -k plan -x`; test files or node ids among
# them replace the default `tests` (`bash launch/run_tests.sh tests/test_plan.py`).
#
#   --tier TIER    only the tests of TIER: unit (one process, no launcher), mpi (real mpirun/horovodrun
#                  jobs) or system (Slurm, the chaos soak, elastic Horovod, benchmarks as tests, set-up,
#                  packaging); a comma list (--tier unit,mpi) or the option repeated runs several; all
#                  tiers by default. docs/testing.md says how long each takes.
#   --workers N    processes for the unit tier (pytest-xdist, one test file at a time per process);
#                  default: the machine's cores, at most 4; 1 runs it in one process. (-n N says the same.)
#
# Two pytest sessions: the unit tier spread over the workers, then the mpi and system tiers one test at a
# time (their jobs use every core, and some of them measure time). When the unit and system tiers both run
# on the whole of tests/, the chaos soak (tests/test_chaos.py, a system test that spends its time in timed
# fault injections rather than on the cores, and measures no time) runs in a third session beside the unit
# tier. With `-m EXPR` of your own, one session runs it, in one process. At the end: the time per tier and
# the 15 slowest set-ups/tests of all sessions together. The exit code is pytest's (the worst session's).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

_die() { echo "run_tests.sh: $*" >&2; exit 2; }
_tiers=()
_args=()
_paths=()
_workers=""
_own_m=0
_exitfirst=0
while [ $# -gt 0 ]; do
  case $1 in
    --tier) [ $# -ge 2 ] || _die "--tier needs a tier: unit, mpi or system"
            _tiers+=("$2"); shift 2 ;;
    --tier=*) _tiers+=("${1#--tier=}"); shift ;;
    --workers) [ $# -ge 2 ] || _die "--workers needs a number"; _workers=$2; shift 2 ;;
    --workers=*) _workers=${1#--workers=}; shift ;;
    -n|--numprocesses) [ $# -ge 2 ] || _die "$1 needs a number"  # pytest-xdist's own: the unit tier's workers
                       _workers=$2; shift 2 ;;
    --numprocesses=*) _workers=${1#--numprocesses=}; shift ;;
    -m|-m*|--markexpr*) _own_m=1; _args+=("$1"); shift ;;
    -x|--exitfirst|--maxfail*) _exitfirst=1; _args+=("$1"); shift ;;
    -*) _args+=("$1"); shift ;;
    *) if [ -e "${1%%::*}" ]; then _paths+=("$1"); else _args+=("$1"); fi; shift ;;
  esac
done
[ ${#_paths[@]} -gt 0 ] || _paths=(tests)
[ "$_workers" != auto ] || _workers=""
if [ -n "$_workers" ]; then
  [[ $_workers =~ ^[1-9][0-9]*$ ]] || _die "--workers needs a number of processes (1 or more), not '$_workers'"
fi
_want_unit=0 _want_jobs=""
if [ ${#_tiers[@]} -eq 0 ]; then
  _want_unit=1 _want_jobs="mpi or system"
fi
for _list in ${_tiers[@]+"${_tiers[@]}"}; do
  IFS=, read -r -a _names <<<"$_list"
  [ ${#_names[@]} -gt 0 ] || _die "--tier needs a tier: unit, mpi or system"
  for _t in "${_names[@]}"; do
    case $_t in
      unit) _want_unit=1 ;;
      mpi|system) _want_jobs=${_want_jobs:+$_want_jobs or }$_t ;;
      *) _die "unknown tier '$_t' (unit, mpi or system)" ;;
    esac
  done
done

. launch/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# One record of every session's durations (tests/conftest.py); the last session prints them together.
DYNAMIX_TEST_LOG=$(mktemp "${TMPDIR:-/tmp}/dynamix-tests.XXXXXX")
export DYNAMIX_TEST_LOG
trap 'rm -f "$DYNAMIX_TEST_LOG"' EXIT

_session() {  # _session LAST ARGS...: one pytest session; LAST=1 prints the summary of all sessions
  local last=$1 rc=0
  shift
  DYNAMIX_TEST_SUMMARY=$([ "$last" = 1 ] && echo 15 || echo 0) python -m pytest "$@" || rc=$?
  return $rc
}

if [ "$_own_m" = 1 ]; then  # the caller's own marker expression: one session, as asked
  _rc=0
  _session 1 "${_paths[@]}" ${_args[@]+"${_args[@]}"} || _rc=$?
  exit "$_rc"
fi

# Beside the unit tier: system tests that wait on timed events and measure no time (see above).
_beside=()
_beside_pid=""
_beside_rc=5
if [ "$_want_unit" = 1 ] && [[ " $_want_jobs " == *" system "* ]] && [ "${_paths[*]}" = tests ]; then
  _beside=(tests/test_chaos.py)
  _beside_log=$(mktemp "${TMPDIR:-/tmp}/dynamix-tests-beside.XXXXXX")  # its records, added to the others' after
  _beside_out=$(mktemp "${TMPDIR:-/tmp}/dynamix-tests-beside-out.XXXXXX")
  trap '[ -z "$_beside_pid" ] || kill "$_beside_pid" 2>/dev/null; rm -f "$DYNAMIX_TEST_LOG" "$_beside_log" "$_beside_out"' EXIT
  echo "run_tests.sh: ${_beside[*]} runs beside the unit tier; its output follows the unit tier's"
  DYNAMIX_TEST_LOG=$_beside_log DYNAMIX_TEST_SUMMARY=0 python -m pytest "${_beside[@]}" -m system \
    ${_args[@]+"${_args[@]}"} >"$_beside_out" 2>&1 &
  _beside_pid=$!
fi
_beside_wait() {  # wait for the session beside the unit tier; show its output; add its records to the log
  [ -n "$_beside_pid" ] || return 0
  _beside_rc=0
  wait "$_beside_pid" || _beside_rc=$?
  _beside_pid=""
  echo "=== run_tests.sh: ${_beside[*]} (beside the unit tier) ==="
  cat "$_beside_out"
  cat "$_beside_log" >>"$DYNAMIX_TEST_LOG"
}

_rc_unit=5 _rc_jobs=5
if [ "$_want_unit" = 1 ]; then
  _parallel=()
  _n=${_workers:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}
  if [ "$_n" -gt 1 ]; then
    if python -c 'import xdist' 2>/dev/null; then
      _parallel=(-n "$_n" --dist loadfile)
    else
      echo "run_tests.sh: pytest-xdist is missing: the unit tier runs in one process" >&2
    fi
  fi
  _rc_unit=0
  _session "$([ -z "$_want_jobs" ] && echo 1 || echo 0)" "${_paths[@]}" -m unit ${_parallel[@]+"${_parallel[@]}"} \
    ${_args[@]+"${_args[@]}"} || _rc_unit=$?
fi
_beside_wait
if [ -n "$_want_jobs" ]; then
  if [ "$_exitfirst" = 1 ] && { { [ "$_rc_unit" != 0 ] && [ "$_rc_unit" != 5 ]; } ||
                                { [ "$_beside_rc" != 0 ] && [ "$_beside_rc" != 5 ]; }; }; then
    echo "run_tests.sh: the unit tier or ${_beside[*]} failed and -x/--maxfail was given: the $_want_jobs" \
         "tiers are not run" >&2
    exit "$([ "$_rc_unit" != 0 ] && [ "$_rc_unit" != 5 ] && echo "$_rc_unit" || echo "$_beside_rc")"
  fi
  _ignore=()
  for _f in ${_beside[@]+"${_beside[@]}"}; do _ignore+=("--ignore=$_f"); done
  _rc_jobs=0
  _session 1 "${_paths[@]}" -m "$_want_jobs" ${_ignore[@]+"${_ignore[@]}"} ${_args[@]+"${_args[@]}"} || _rc_jobs=$?
fi
# pytest's codes: 0 passed, 1 failures, 2 interrupted, 3 internal error, 4 usage error, 5 nothing collected
_rc=5
for _c in "$_rc_unit" "$_beside_rc" "$_rc_jobs"; do
  case $_c in
    5) ;;
    0) [ "$_rc" != 5 ] || _rc=0 ;;
    1) if [ "$_rc" = 0 ] || [ "$_rc" = 5 ]; then _rc=1; fi ;;
    *) if [ "$_rc" -le 1 ] || [ "$_rc" = 5 ]; then _rc=$_c; fi ;;
  esac
done
exit "$_rc"
