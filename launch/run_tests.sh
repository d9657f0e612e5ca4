#!/usr/bin/env bash
# Run the test suite; does all set-up first (Open MPI, venv, Horovod build or cached wheel).
# Extra arguments go to pytest, e.g. `bash launch/run_tests.sh -k plan -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. launch/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest tests "$@"
