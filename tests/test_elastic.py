"""Horovod elastic through the documented recipe (launch/elastic.sh): kill -9 one of 3 workers mid-epoch; 2 carry
on, a worker comes back and joins. The controller deadline is checked against Gloo's timeout."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from dynamix_hvd.resilience.elastic import check_timeouts
from launching import REPO, WORKERS, job_env
from workers.elastic import MIN_EPOCHS, SAMPLES


@pytest.mark.system
def test_worker_killed_mid_epoch_then_rejoins_without_losing_samples(tmp_path):
    discovery = tmp_path / "discover.sh"
    # Two names of this machine, so Horovod sees two hosts and can blacklist the victim's alone.
    victim = socket.gethostname() if socket.gethostname() != "localhost" else "127.0.0.1"
    discovery.write_text(f"#!/bin/sh\necho localhost:2\necho {victim}:1\n")
    discovery.chmod(0o755)
    recipe = REPO / "launch" / "elastic.sh"  # exactly what docs/faults.md shows
    env = dict(job_env(), DISCOVERY=str(discovery), NP="3", MIN_NP="2", MAX_NP="3", COOLDOWN="1 2", GLOO_TIMEOUT="10",
               PYTHON=sys.executable, SCRIPT=str(WORKERS / "elastic.py"), SCRIPT_ARGS=f"--out {tmp_path} --victim {victim}")
    proc = subprocess.run(["bash", str(recipe)], env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert (tmp_path / "victim-killed").exists(), "the victim never died: the test proved nothing"
    served = json.loads((tmp_path / "rank0.json").read_text())["served"]
    worlds = [s["world"] for s in served]
    assert 3 in worlds and 2 in worlds, f"expected the job to shrink to 2 and grow back: {worlds}"
    assert worlds.index(2) < len(worlds) - 1 - worlds[::-1].index(3), "no rejoin after the failure"
    epochs = sorted({s["epoch"] for s in served})
    assert epochs == list(range(len(epochs))) and len(epochs) >= MIN_EPOCHS
    for epoch in epochs:
        seen = [i for s in served if s["epoch"] == epoch for i in s["indices"]]
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: samples lost or repeated"
    for s in served:
        assert len(s["sizes"]) == s["world"] and min(s["sizes"]) >= 1
    victim_pid = int((tmp_path / "victim-killed").read_text())
    joined = {int(p.name.split("-")[1]): json.loads(p.read_text()) for p in tmp_path.glob("joined-*.json")}
    newcomers = [j for pid, j in joined.items() if pid != victim_pid and j["host"] == victim and j["epoch"] >= 1]
    assert newcomers, f"no new worker joined on {victim} after the failure: {joined}"
    assert all(j["world"] == 3 and j["batch_sizes"][j["rank"]] >= 1 for j in newcomers), newcomers


def test_faults_page_shows_the_elastic_recipe_verbatim():
    recipe = (REPO / "launch" / "elastic.sh").read_text()
    assert f"```bash\n{recipe}```" in (REPO / "docs" / "faults.md").read_text()
    assert "--blacklist-cooldown-range" in recipe and "--host-discovery-script" in recipe
    assert "--gloo-timeout-seconds" in recipe


def test_controller_deadline_must_outlast_gloo_timeout():
    assert check_timeouts(60, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "10"}) == 10
    assert check_timeouts(31, {}) == 30  # Horovod's default
    with pytest.raises(ValueError, match=r"timeout_s=20 s must be longer than Gloo's timeout of 30 s"):
        check_timeouts(20, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "30"})
    with pytest.raises(ValueError, match="HOROVOD_GLOO_TIMEOUT_SECONDS='soon'"):
        check_timeouts(60, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "soon"})
