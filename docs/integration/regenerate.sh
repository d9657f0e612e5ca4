#!/bin/sh
# Rewrite every docs/integration/NAME.diff from horovod/NAME.py and dynamix/NAME.py
# (tests/test_integration_horovod.py checks that they agree).
cd "$(dirname "$0")" || exit 1
for ours in dynamix/*.py; do
    name=$(basename "$ours" .py)
    diff -u --label "horovod/$name.py" --label "dynamix/$name.py" "horovod/$name.py" "$ours" > "$name.diff"
    [ $? -le 1 ] || exit 1
done
