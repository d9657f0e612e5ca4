#!/bin/sh
# Rewrite every docs/integration/NAME.diff from the plain script (horovod/NAME.py, or torch/NAME.py
# for torch.distributed) and dynamix/NAME.py (tests/test_integration_*.py check that they agree).
cd "$(dirname "$0")" || exit 1
for ours in dynamix/*.py; do
    name=$(basename "$ours" .py)
    base=horovod
    [ -f "torch/$name.py" ] && base=torch
    diff -u --label "$base/$name.py" --label "dynamix/$name.py" "$base/$name.py" "$ours" > "$name.diff"
    [ $? -le 1 ] || exit 1
done
