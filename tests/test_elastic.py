"""Horovod elastic: kill -9 one of 3 workers mid-epoch; 2 carry on, a worker comes back and joins."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

from launching import WORKERS, job_env
from workers.elastic import MIN_EPOCHS, SAMPLES


def test_worker_killed_mid_epoch_then_rejoins_without_losing_samples(tmp_path):
    discovery = tmp_path / "discover.sh"
    # Two names of this machine, so Horovod sees two hosts and can blacklist the victim's alone.
    victim = socket.gethostname() if socket.gethostname() != "localhost" else "127.0.0.1"
    discovery.write_text(f"#!/bin/sh\necho localhost:2\necho {victim}:1\n")
    discovery.chmod(0o755)
    cmd = ["horovodrun", "--gloo", "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(discovery),
           "--blacklist-cooldown-range", "1", "2", "--gloo-timeout-seconds", "10", sys.executable, str(WORKERS / "elastic.py"), "--out", str(tmp_path), "--victim", victim]
    proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=400, cwd=tmp_path)
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
