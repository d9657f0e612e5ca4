"""The chaos soak's short version (python -m bench.chaos --quick): every fault kind once on mpirun with
checkpoints and on elastic horovodrun; every fault survived, every epoch's samples exactly once, the
parameters of the mpirun lane equal an uninterrupted run that replays the same OOM and NaN steps,
nothing left behind."""
from __future__ import annotations

import re
import subprocess
import sys

from launching import REPO, job_env

from bench.chaos import ELASTIC_KINDS, MPI_KINDS


def test_quick_chaos_soak_survives_every_fault_and_loses_nothing(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, "-m", "bench.chaos", "--quick", "--seed", "7", "--out", str(out)],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=900)
    text = proc.stdout + proc.stderr
    print(text[-6000:])
    rows = {(m[0], m[1]): (int(m[2]), int(m[3])) for m in
            re.findall(r"^\| (mpirun|elastic) \| ([\w-]+) \| (\d+) \| (\d+) \|", proc.stdout, re.M)}
    for lane, kinds in (("mpirun", MPI_KINDS), ("elastic", ELASTIC_KINDS)):
        for kind in kinds:
            injected, survived = rows.get((lane, kind), (0, 0))
            assert injected >= 1, f"{lane} {kind} was never injected: the soak proved nothing about it\n{text[-4000:]}"
            assert survived == injected, f"{lane} {kind}: {survived} of {injected} survived\n{text[-4000:]}"
    assert "checks: all passed" in proc.stdout and proc.returncode == 0, text[-6000:]
    assert "max |parameter difference| against the uninterrupted run" in proc.stdout
    assert (out / "report.md").is_file()
