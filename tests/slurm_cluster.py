"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd started by hand (no systemd).

Everything lives in one temporary directory (slurm.conf, munge key and socket, state, spool, logs,
pid files) and on free TCP ports, so it neither needs nor touches a system Slurm. Clients find it
through ``SLURM_CONF`` in `SlurmCluster.env`. Daemons run in the foreground as our children and are
stopped by pid at teardown, so none is left running.

Partitions: ``debug`` (the default), ``low`` and ``high``; a job in ``high`` preempts (cancels) jobs of
``low`` that hold the CPUs it needs, after sending them SIGTERM and waiting ``GraceTime``; jobs of
``debug`` are never preempted (they may run beside a preemption).

Requires root (apt, daemons as root) and the Debian packages ``slurm-wlm munge``, which
`ensure_installed` installs with apt-get when they are missing.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here (not root, no apt); tests skip with this message."""


def ensure_installed(timeout: float = 600) -> None:
    """Install slurm-wlm and munge with apt-get (after apt-get update) unless already present."""
    if all(shutil.which(b) for b in BINARIES):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("slurm-wlm/munge are missing and apt-get cannot install them (need root + apt)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        raise SlurmUnavailable(f"installed {PACKAGES} but {missing} are still not on PATH")


def _free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports that were free a moment ago (all held open while choosing)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    """Start with `start()` (or use as a context manager); `stop()` kills every daemon it started."""

    def __init__(self, cpus: int | None = None, root: Path | None = None, grace_s: int = 60) -> None:
        self.node = socket.gethostname().split(".")[0]   # NodeName must equal `hostname -s`
        self.cpus = max(cpus or os.cpu_count() or 1, 2)  # 2-rank jobs must fit even on one core
        self.grace_s = grace_s  # partition "low": a job preempted by one of "high" gets this long to end
        self._tmp = None if root else tempfile.TemporaryDirectory(prefix="dx-slurm-")
        self.root = Path(root or self._tmp.name)        # type: ignore[union-attr]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # --- set-up -------------------------------------------------------------------------------------
    def _write_munge(self) -> None:
        d = self.munge_socket.parent
        d.mkdir(parents=True)
        d.chmod(0o711)                                   # munged refuses a socket dir others can write
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)

    def _write_conf(self) -> None:
        r = self.root
        ctld_port, slurmd_port = _free_ports(2)
        for sub in ("state", "spool", "log"):
            (r / sub).mkdir()
        self.conf.write_text(f"""\
# Single-node test cluster written by tests/slurm_cluster.py
ClusterName=dxtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
InactiveLimit=0
KillWait=5
MinJobAge=600
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF
PartitionName=low Nodes={self.node} MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={self.grace_s}
PartitionName=high Nodes={self.node} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
""")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.console", "w")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        log.close()

    def _wait(self, what: str, ready: Any, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n"
                                       f"{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"{what} not ready within {timeout} s:\n{self.logs()}")

    def start(self, timeout: float = 60) -> "SlurmCluster":
        """Start munged, slurmctld and slurmd; return once the node is idle."""
        ensure_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test cluster runs its daemons as root")
        self._write_munge()
        self._write_conf()
        r = self.root
        try:
            self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.munge_socket}",
                                   f"--key-file={r}/munge.key", f"--pid-file={r}/munged.pid",
                                   f"--log-file={r}/log/munged.log", f"--seed-file={r}/munged.seed"])
            self._wait("munged socket", self.munge_socket.exists, timeout)
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._wait("slurmctld", lambda: self.run("scontrol", "ping", check=False).returncode == 0, timeout)
            self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
            self._wait(f"node {self.node} idle", self._node_idle, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-n", self.node, "-o", "%t", check=False).stdout.strip()
        return out.startswith("idle")

    # --- use ------------------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}{proc.stdout}")
        return proc

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit a batch job; returns its id."""
        proc = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, StdOut, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, timeout: float = 120) -> dict[str, str]:
        """Poll squeue until the job leaves the queue, then return its final `job_info`."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            queued = self.run("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False).stdout.strip()
            info = self.job_info(job_id)
            if not queued and info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return info
            time.sleep(0.5)
        self.run("scancel", str(job_id), check=False)
        raise TimeoutError(f"job {job_id} still {self.job_info(job_id).get('JobState')} after {timeout} s:\n"
                           f"{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # --- teardown -------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop slurmd, slurmctld and munged (in that order) by pid; SIGKILL whatever lingers."""
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
