#!/usr/bin/env bash
# Fetch, HERE (a machine with PyPI), what the GPU check (bench/gpu_check.sh) carries to the device
# machine, into <repo>/.whl/ (git-ignored; never commit it):
#   - Horovod 0.28.1's sdist (the device image has no Horovod; gpu_check.sh builds it there);
#   - cp312 manylinux wheels of what the device image lacks or has in a version that breaks:
#     numpy 2.4.x (numba-cuda 0.30.x fails to import under the image's numpy 2.5) and numba-cuda 0.30.x.
# Everything else the project and Horovod import (torch, numba, llvmlite, mpi4py, pandas, h5py, psutil,
# matplotlib, tqdm, cloudpickle, pyyaml, packaging, cmake, cuda-bindings/-core/-pathfinder) is in the
# image (see the device library's KINDS.md package list). One version of each package only: two stop
# the install there.
# Prints the total size, which must stay well under 64 MiB together with the tracked tree.
# Usage: bash bench/gpu_fetch_wheels.sh        (re-running re-uses what is already there)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=$root/.whl
py=${PYTHON:-python3}
mkdir -p "$dest"
cd "$root"

# .whl/ must be ignored so it travels only when a device call names it in `carry`.
if ! git check-ignore -q .whl/probe 2>/dev/null; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  echo /.whl/ >>"$exclude"
  echo "[fetch] added /.whl/ to $exclude"
fi

pip_dl() { "$py" -m pip --disable-pip-version-check download --no-deps -d "$dest" "$@" 2>&1 \
             | { grep -v "^WARNING: Location 'file:" || true; }; }

[ -f "$dest/horovod-0.28.1.tar.gz" ] || pip_dl --no-binary=:all: horovod==0.28.1
platforms=()
for n in 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for req in numpy==2.4.6 numba-cuda==0.30.4; do
  name=${req%%==*}; name=${name//-/_}
  ls "$dest/${name}-${req##*==}-"*.whl >/dev/null 2>&1 && continue
  pip_dl --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" "$req"
done

# One version per package (a stale one from an earlier run would stop the install there).
dups=$(ls "$dest"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dups" ] || { echo "[fetch] ERROR: several versions of: $dups (delete the old ones in $dest)"; exit 1; }
ls -la "$dest"
carried=$(du -cb "$dest"/* | tail -1 | cut -f1)
tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total=$((carried + tracked + ${untracked:-0}))
printf '[fetch] carried .whl: %.1f MiB; tracked tree: %.1f MiB; untracked, not ignored: %.1f MiB; travels: %.1f MiB of 64\n' \
  "$(echo "$carried / 1048576" | bc -l)" "$(echo "$tracked / 1048576" | bc -l)" \
  "$(echo "${untracked:-0} / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
[ "$total" -lt $((56 << 20)) ] || { echo "[fetch] ERROR: over 56 MiB; carry less"; exit 1; }
