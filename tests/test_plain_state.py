"""State is plain data and nothing happens behind the user's back.

Checkpoints hold only tensors and plain values and load with ``weights_only=True``: a crafted file
is refused and runs nothing. Importing any module changes no signal handler, starts no thread,
leaves Horovod's handler registry and the logging set-up alone; `close()` stops the resource thread.
"""
from __future__ import annotations

import io
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import zipfile
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import dynamix_hvd
from dynamix_hvd.control.actions import ActionSpace
from dynamix_hvd.control.refine import make_learner
from dynamix_hvd.control.policy import StaticPolicy
from dynamix_hvd.control.refine import PPOPolicy
from dynamix_hvd.control.rules import BASELINES, make_baseline
from dynamix_hvd.control.state import GLOBAL_FEATURES, RANK_FEATURES
from dynamix_hvd.data.loader import AdaptiveLoader
from dynamix_hvd.data.resources import ResourceSampler
from dynamix_hvd.logs import DEFAULT_HANDLER, RankFormatter, configure_logging, get_logger, launcher_rank
from dynamix_hvd.resilience.checkpoint import FORMAT, FORMAT_VERSION, non_plain_entry
from dynamix_hvd.control.ppo import PPOLearner
from launching import REPO, job_env, launch


class RunsCommand:
    """Unpickling this runs a shell command, as a crafted checkpoint would."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _crafted(tmp_path: Path, marker: Path) -> tuple[Path, Path]:
    payload = RunsCommand(f"touch {marker}")
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "version": FORMAT_VERSION, "model": payload}, buf)  # torch.save's zip layout
    evil_torch, evil_raw = tmp_path / "evil_torch.pt", tmp_path / "evil_raw.pt"
    evil_torch.write_bytes(buf.getvalue())
    evil_raw.write_bytes(pickle.dumps(payload))  # a bare pickle under the same name
    with zipfile.ZipFile(evil_torch) as archive:  # the pickle inside torch.save's layout
        inner = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    for path, raw in ((evil_torch, inner), (evil_raw, evil_raw.read_bytes())):
        pickle.loads(raw)  # the files are live: any full unpickling runs the command
        assert marker.exists(), f"{path.name} did not run its command: the test would prove nothing"
        marker.unlink()
    return evil_torch, evil_raw


@pytest.mark.mpi
def test_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    evil_torch, evil_raw = _crafted(tmp_path, marker)
    out = launch("mpirun", 2, "safety.py", "checkpoint", "--ckpt", str(tmp_path / "ck"), "--marker", str(marker),
                 "--evil-torch", str(evil_torch), "--evil-raw", str(evil_raw)).stdout
    for ok in ("FALLBACK-PAST-CRAFTED-OK", "CRAFTED-TORCH-REFUSED-OK", "CRAFTED-RAW-REFUSED-OK",
               "VERSION-SKIPPED-OK", "NONPLAIN-REFUSED-OK"):
        assert out.count(ok) == 2, f"{ok} missing on a rank:\n{out}"
    assert "skipping checkpoint" in out, "the refused newest checkpoint was skipped silently"
    assert not marker.exists(), "restore() ran code from a crafted checkpoint"


@pytest.mark.mpi
def test_checkpointer_signals_only_on_request_and_controller_close_stops_its_thread(tmp_path):
    out = launch("mpirun", 2, "safety.py", "close", "--ckpt", str(tmp_path / "ck")).stdout
    assert out.count("SIGNALS-OK") == 2 and out.count("CLOSE-OK") == 2, out


def test_non_plain_entry_names_the_path():
    plain = {"a": [1, 2.5, None, True, "x", (torch.zeros(2), {"b": torch.Size([3])})], 3: torch.float64}
    assert non_plain_entry(plain) is None
    assert non_plain_entry({"a": [0, {"b": threading.Lock()}]}) == "state['a'][1]['b']: _thread.lock"
    assert non_plain_entry({(1, 2): 0}) is None
    assert non_plain_entry({(1, Fraction(1, 2)): 0}) == "state key (1, Fraction(1, 2))[1]: fractions.Fraction"
    import numpy as np
    assert non_plain_entry({"x": np.float64(1.0)}) == "state['x']: numpy.float64"


def _round_trip(state):
    assert non_plain_entry(state) is None, non_plain_entry(state)
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_every_state_dict_is_plain_and_loads_weights_only():
    data = torch.utils.data.TensorDataset(torch.arange(40.0))
    loader = AdaptiveLoader(data, [3, 5], 0, seed=1)
    for _ in zip(range(2), loader):
        pass
    again = AdaptiveLoader(data, [3, 5], 0, seed=1)
    again.load_state_dict(_round_trip(loader.state_dict()))
    assert again.state_dict() == loader.state_dict()

    learner = make_learner(ActionSpace())
    obs = torch.randn(2, learner.obs_dim)
    learner.act(obs)
    learner.record([1.0, -1.0])
    learner.act(obs)  # a pending decision is part of the state too
    copy = PPOLearner.from_state_dict(_round_trip(learner.state_dict()))
    assert torch.equal(copy.act(obs, deterministic=True)[0], learner.act(obs, deterministic=True)[0])

    policy = PPOPolicy(learner)
    PPOPolicy().load_state_dict(_round_trip(policy.state_dict()))
    _round_trip(StaticPolicy().state_dict())
    for name in sorted(BASELINES):
        _round_trip(make_baseline(name).state_dict())


def test_resource_thread_stops_within_a_second_of_close():
    sampler = ResourceSampler(background_period_s=60.0)  # a sleeping loop would take a minute to notice
    thread = sampler._thread
    assert thread is not None and thread.is_alive()
    t0 = time.monotonic()
    sampler.close()
    assert not thread.is_alive() and time.monotonic() - t0 < 1.0
    assert "dynamix-resources" not in [t.name for t in threading.enumerate()]
    assert sampler.latest().interval_s > 0  # still usable: samples on demand
    sampler.close()  # idempotent
    with ResourceSampler(background_period_s=60.0) as other:
        thread = other._thread
    assert not thread.is_alive()


_IMPORT_PROBE = r"""
import importlib, json, logging, signal, sys, threading, warnings
import pytest
import torch
import horovod.torch
from horovod.torch.elastic import state as hvd_state

def snapshot():
    handlers = {}
    for s in signal.valid_signals():
        try:
            handlers[int(s)] = repr(signal.getsignal(s))
        except (OSError, ValueError):
            pass
    registry = hvd_state.get_handler_registry()
    return {"signals": handlers, "threads": sorted(t.name for t in threading.enumerate()),
            "registry": [id(registry), [(a.__qualname__, b.__qualname__) for a, b in registry]],
            "root_handlers": [repr(h) for h in logging.getLogger().handlers],
            "package_handlers": sorted({type(h).__name__ for h in logging.getLogger("dynamix_hvd").handlers}
                                       - {"DefaultHandler"}),  # the package's own, from its first import
            "warning_filters": len(warnings.filters)}

changes = []
before = snapshot()
for name in sys.argv[1:]:
    importlib.import_module(name)
    after = snapshot()
    for key in before:
        if after[key] != before[key]:
            changes.append(f"importing {name} changed {key}: {before[key]} -> {after[key]}")
    before = after
print(json.dumps(changes))
"""


def _all_modules() -> list[str]:
    root = Path(dynamix_hvd.__file__).parent
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # `python -m dynamix_hvd` runs the CLI by design
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_importing_any_module_has_no_side_effects():
    modules = _all_modules()
    assert len(modules) > 30 and "dynamix_hvd.resilience.elastic" in modules
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, *modules], env=job_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    changes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert changes == [], "\n".join(changes)


def test_rank_prefixed_logging_is_opt_in(monkeypatch):
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "HOROVOD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert launcher_rank() is None
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("HOROVOD_RANK", "3")
    assert launcher_rank() == 3  # HOROVOD_RANK is read before SLURM_PROCID
    log = get_logger("dynamix_hvd.resilience.checkpoint")
    assert get_logger("elsewhere").name == "dynamix_hvd.elsewhere"
    stream = io.StringIO()
    package = logging.getLogger("dynamix_hvd")
    level = package.level
    try:
        first = configure_logging(stream=io.StringIO())
        handler = configure_logging(stream=stream)  # replaces the first, no duplicate lines
        assert first not in package.handlers and handler in package.handlers
        log.info("checkpoint written")
        log.warning("skipping checkpoint")
        log.debug("hidden at INFO")
        assert DEFAULT_HANDLER not in package.handlers  # configured: the default gave way
    finally:
        package.removeHandler(handler)
        package.setLevel(level)
        package.addHandler(DEFAULT_HANDLER)
    assert stream.getvalue().splitlines() == ["[dynamix_hvd rank 3] checkpoint written",
                                              "[dynamix_hvd rank 3] warning: skipping checkpoint"]
    assert RankFormatter(rank=0).prefix == "[dynamix_hvd rank 0]"
    monkeypatch.delenv("SLURM_PROCID")
    monkeypatch.delenv("HOROVOD_RANK")
    assert RankFormatter().prefix == "[dynamix_hvd]"  # not launched: no rank to name


_WARN = r"""
import logging, sys
setup = sys.argv[1]
import dynamix_hvd
from dynamix_hvd.logs import DEFAULT_HANDLER, configure_logging, get_logger
if setup == "basic":
    logging.basicConfig(format="app %(levelname)s %(name)s: %(message)s")
elif setup == "configured":
    configure_logging()
elif setup == "silenced":
    logging.getLogger("dynamix_hvd").setLevel(logging.ERROR)
log = get_logger("dynamix_hvd.resilience.checkpoint")
log.info("checkpoint written")
log.warning("stop requested: checkpoint written to /ck; exiting with code 143")
"""


@pytest.mark.parametrize("setup, rank, expected", [
    ("none", None, ["[dynamix_hvd] warning: stop requested: checkpoint written to /ck; exiting with code 143"]),
    ("none", "1", ["[dynamix_hvd rank 1] warning: stop requested: checkpoint written to /ck; exiting with code 143"]),
    ("basic", "1", ["app WARNING dynamix_hvd.resilience.checkpoint: stop requested: checkpoint written to /ck; "
                    "exiting with code 143"]),
    ("configured", "1", ["[dynamix_hvd rank 1] checkpoint written",
                         "[dynamix_hvd rank 1] warning: stop requested: checkpoint written to /ck; exiting with code 143"]),
    ("silenced", "1", []),
])
def test_warnings_a_user_needs_are_shown_by_default_once(setup, rank, expected):
    """Without any logging set-up a warning reaches stderr, rank-prefixed, and nothing below it does;
    an application that configured the root logger gets it once, through its own handler; the
    package's configure_logging replaces the default; the package logger's level silences it."""
    env = {k: v for k, v in job_env().items() if k not in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "HOROVOD_RANK",
                                                           "SLURM_PROCID")}
    if rank is not None:
        env["OMPI_COMM_WORLD_RANK"] = rank
    proc = subprocess.run([sys.executable, "-c", _WARN, setup], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "checkpoint" in line]
    assert lines == expected, proc.stderr


@pytest.fixture
def small_mounts(tmp_path):
    """A full-able 1 MB tmpfs and a read-only one (we run as root), unmounted at teardown."""
    full, readonly = tmp_path / "full", tmp_path / "readonly"
    mounted = []
    try:
        for path, options in ((full, "size=1m"), (readonly, "ro,size=1m")):
            path.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True,
                           capture_output=True, text=True)
            mounted.append(path)
        yield full, readonly
    finally:
        for path in mounted:
            subprocess.run(["umount", str(path)], check=False)


@pytest.mark.mpi
def test_restore_is_all_or_nothing_and_saves_clean_up(tmp_path, small_mounts):
    full, readonly = small_mounts
    out = launch("mpirun", 2, "ckpt_faults.py", "fit", "nothing", "full", "readonly", "--ckpt", str(tmp_path / "ck"),
                 "--full", str(full), "--readonly", str(readonly)).stdout
    for ok in ("FIT-FALLBACK-OK step-00000-0000002", "APPLY-ROLLED-BACK-OK", "DATASET-REFUSED-OK",
               "FULL-DISK-CLEAN-OK", "READONLY-REFUSED-OK"):
        assert out.count(ok) == 2, f"{ok} missing on a rank:\n{out}"
    assert "skipping checkpoint" in out and "step-00000-0000009/state.pt does not fit this job" in out, out
