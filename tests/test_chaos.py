"""The chaos soak's short version (python -m bench.chaos --quick): every fault kind once on mpirun with
checkpoints and on elastic horovodrun; every fault survived, every epoch's samples exactly once, the
parameters of the mpirun lane equal an uninterrupted run that replays the same OOM and NaN steps,
nothing left behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from launching import REPO, job_env

from bench.chaos import ELASTIC_KINDS, MPI_KINDS
from bench.chaos_system import _mounted, _ours


@pytest.mark.timeout(900)
def test_quick_chaos_soak_survives_every_fault_and_loses_nothing(tmp_path):
    # The soak bounds itself (a lane stuck 180 s past its time is killed and reported, the reference
    # run has a 240 s limit: about 12 minutes at worst); its output goes
    # to a file so that a run cut short still shows how far it got.
    out, log = tmp_path / "chaos", tmp_path / "chaos.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "bench.chaos", "--quick", "--seed", "7", "--out", str(out)],
                                cwd=REPO, env=job_env(), stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            proc.wait(timeout=840)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the soak; its jobs run in sessions of their own:
            proc.wait()
            for pid in _ours(str(out)):
                os.kill(pid, signal.SIGKILL)
            for ckpt in out.glob("*/ckpt"):
                if _mounted(ckpt.resolve()):
                    subprocess.run(["umount", str(ckpt)], check=False)
            pytest.fail("the quick soak did not end within 840 s; its output:\n" + log.read_text()[-6000:])
    text = log.read_text()
    print(text[-6000:])
    rows = {(m[0], m[1]): (int(m[2]), int(m[3])) for m in
            re.findall(r"^\| (mpirun|elastic) \| ([\w-]+) \| (\d+) \| (\d+) \|", text, re.M)}
    for lane, kinds in (("mpirun", MPI_KINDS), ("elastic", ELASTIC_KINDS)):
        for kind in kinds:
            injected, survived = rows.get((lane, kind), (0, 0))
            assert injected >= 1, f"{lane} {kind} was never injected: the soak proved nothing about it\n{text[-4000:]}"
            assert survived == injected, f"{lane} {kind}: {survived} of {injected} survived\n{text[-4000:]}"
    assert "checks: all passed" in text and proc.returncode == 0, text[-6000:]
    assert "max |parameter difference| against the uninterrupted run" in text
    assert (out / "report.md").is_file()
