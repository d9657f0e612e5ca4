#!/usr/bin/env bash
# Horovod elastic with dynamix_hvd: workers may die and hosts come and go; training continues on the
# workers left and grows back when hosts return (docs/faults.md "Elastic Horovod" shows this file verbatim).
#   DISCOVERY=            required: an executable printing one "host:slots" line per usable host, e.g.
#                           #!/bin/sh
#                           echo node1:2
#                           echo node2:2
#   NP=$MIN_NP MIN_NP=2 MAX_NP=4   workers to start with, and the bounds of the world
#   GLOO_TIMEOUT=30       seconds a Gloo collective waits for a lost worker before Horovod resets the
#                         world; ControllerConfig.timeout_s must be longer (ElasticState refuses it otherwise)
#   COOLDOWN="10 60"      --blacklist-cooldown-range: a host whose worker failed is tried again after
#                         10 to 60 s (growing with repeated failures); without it it never rejoins
#   SCRIPT=               the training script (with ElasticState and @hvd.elastic.run); SCRIPT_ARGS= its arguments
#   PYTHON=python         the interpreter of the workers (run inside the venv of launch/setup_env.sh)
set -euo pipefail
: "${DISCOVERY:?set DISCOVERY to a host discovery script}" "${SCRIPT:?set SCRIPT to the training script}"
MIN_NP=${MIN_NP:-2} MAX_NP=${MAX_NP:-4} GLOO_TIMEOUT=${GLOO_TIMEOUT:-30} COOLDOWN=${COOLDOWN:-10 60}
NP=${NP:-$MIN_NP} PYTHON=${PYTHON:-python} SCRIPT_ARGS=${SCRIPT_ARGS:-}
# shellcheck disable=SC2086  # COOLDOWN is two numbers; SCRIPT_ARGS is word-split on purpose
exec horovodrun --gloo -np "$NP" --min-np "$MIN_NP" --max-np "$MAX_NP" --host-discovery-script "$DISCOVERY" \
  --blacklist-cooldown-range $COOLDOWN --gloo-timeout-seconds "$GLOO_TIMEOUT" \
  "$PYTHON" "$SCRIPT" $SCRIPT_ARGS "$@"
