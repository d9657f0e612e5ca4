"""Chaos soak: random faults in real jobs, then proof that nothing was lost or left behind.

    python -m bench.chaos                 # about 10 minutes
    python -m bench.chaos --minutes 60    # longer
    python -m bench.chaos --quick         # every fault kind once, about 2 minutes (tests/test_chaos.py)

Two lanes run one after the other, both training tests/workers/chaos.py (float64, 2 or 3 ranks):

- mpirun with checkpoints (a checkpoint every 10 steps on a small tmpfs): every 20-60 s one fault on
  rank 1: kill -9; SIGSTOP for less than the control-plane timeout, then SIGCONT (the job must carry
  on); SIGSTOP for longer (the job must end naming rank 1); SIGTERM (preemption: a checkpoint, exit
  143); an injected out-of-memory error; a NaN loss; a full checkpoint disk for a while. A job that
  ended is relaunched and must resume from its newest checkpoint.
- elastic horovodrun (3 workers, 2 at least): kill -9 of a worker, and a short SIGSTOP.

Afterwards: every committed epoch saw every sample exactly once (mpirun: each attempt's steps up to
the position the next attempt resumed from; elastic: the committed steps), the mpirun lane's final
parameters equal an uninterrupted run that replays the same OOM and NaN steps, and no process, network
namespace, mount, shared-memory segment or temporary file of the soak is left. Prints one row per
fault kind: injected, survived, and the time lost per fault: from the injection until training
first passes the position it had reached when the fault hit (relaunch and redone steps included).
Exit code 0 only when every fault was survived and every check passed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.chaos_system import (_TMP, _env, _in_use, _mounted, _ours, _pids, _progress, _signal, _snapshot,
                                 _start, _stop_job)
from dynamix_hvd.tools.launchcheck import command as launch_command
from dynamix_hvd.tools.launchcheck import local_plan

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "chaos.py"  # a plain Horovod script, run, never imported
SAMPLES = 480  # tests/workers/chaos.py
MPI_KINDS = ("kill-9", "stop-short", "stop-long", "sigterm", "oom", "nan", "disk-full")
ELASTIC_KINDS = ("kill-9", "stop-short")
ENDS_JOB = {"kill-9", "stop-long", "sigterm"}
# Restarts reproduce the uninterrupted run bit for bit (tests/test_preemption_mpi.py), NaN and
# out-of-memory steps included.
PARAM_TOLERANCE = 0.0


def command(launcher: str, np: int, argv: list[str]) -> list[str]:
    """The launcher line `dynamix-hvd run` uses, on this host, oversubscribed."""
    return launch_command(local_plan(launcher, np), argv, forward=())


@dataclass
class Fault:
    lane: str
    kind: str
    t: float
    position: tuple[int, int]
    attempt: int
    victim: int = 0
    survived: bool | None = None
    lost_s: float | None = None
    note: str = ""


@dataclass
class Soak:
    out: Path
    rng: random.Random
    gap: tuple[float, float]
    timeout_s: float
    overrun_s: float = 600.0  # a lane still running this long after its time is stuck: killed, reported
    reference_timeout_s: float = 900.0  # the uninterrupted reference run's limit
    faults: list[Fault] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def say(self, message: str) -> None:
        print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Lane:
    """One job at a time with one fault at a time; relaunches (mpirun) after a job ended."""

    name = ""
    kinds: tuple[str, ...] = ()

    def __init__(self, soak: Soak, seconds: float, every_kind: bool) -> None:
        self.soak, self.seconds, self.every_kind = soak, seconds, every_kind
        self.out = soak.out / self.name
        (self.out / "pids").mkdir(parents=True, exist_ok=True)
        self.attempt = 0
        self.proc: subprocess.Popen | None = None
        self.deck: list[str] = []
        self.pending: list[Fault] = []   # injected, training not yet past its position
        self.resume: dict = {}           # stop-short: when to SIGCONT whom

    def next_kind(self) -> str:
        if not self.deck:
            self.deck = list(self.kinds)
            self.soak.rng.shuffle(self.deck)
        return self.deck.pop()

    def launch(self) -> None:
        raise NotImplementedError

    def inject(self, kind: str, fault: Fault) -> None:
        raise NotImplementedError

    def ended(self, rc: int) -> bool:
        """The job ended with `rc` while not asked to stop; True: relaunch."""
        raise NotImplementedError

    def run(self) -> None:
        soak = self.soak
        self.launch()
        end = time.monotonic() + self.seconds
        next_at = time.monotonic() + soak.rng.uniform(*soak.gap)
        stopping = False
        while True:
            now = time.monotonic()
            self._check_recovery()
            if self.resume and now >= self.resume["at"]:
                _signal(self.resume["pid"], signal.SIGCONT)
                self.resume = {}
            rc = self.proc.poll()
            if rc is not None:
                if stopping and rc == 0:
                    break
                if stopping or not self.ended(rc):
                    soak.problems.append(f"{self.name}: the job ended with exit code {rc} "
                                         f"(see {self.log().name})")
                    break
                self.attempt += 1
                self.launch()
                continue
            done = now >= end and (not self.every_kind or (not self.deck and self._injected_all()))
            if done and not stopping and not self.pending:
                (self.out / "stop").write_text("")
                stopping = True
                soak.say(f"{self.name}: time is up; the job ends at the next epoch end")
            if (not stopping and not self.pending and not self.resume and now >= next_at and _progress(self.out)
                    and self.ready()):
                kind = self.next_kind()
                position = _progress(self.out)[0]
                fault = Fault(self.name, kind, time.time(), position, self.attempt)
                soak.say(f"{self.name}: injecting {kind} at epoch {position[0]}, sample {position[1]}")
                self.inject(kind, fault)
                soak.faults.append(fault)
                self.pending.append(fault)
            if self.pending or self.resume:
                next_at = time.monotonic() + soak.rng.uniform(*soak.gap)
            if time.monotonic() > end + self.soak.overrun_s:
                soak.problems.append(f"{self.name}: the lane overran its time by {self.soak.overrun_s:.0f} s "
                                     f"(pending faults: {[f.kind for f in self.pending]}, progress: "
                                     f"{_progress(self.out)}); job killed")
                _stop_job(self.proc)
                break
            time.sleep(0.1)
        for fault in self.pending:
            fault.survived, fault.note = False, fault.note or "training never got past the fault's position"

    def ready(self) -> bool:
        """Whether the job is in a state the next fault may hit."""
        return True

    def recoverable(self, fault: Fault) -> bool:
        """Whether training may count as past `fault` yet (a fault that ends the job needs a relaunch)."""
        return True

    def _injected_all(self) -> bool:
        return {f.kind for f in self.soak.faults if f.lane == self.name} >= set(self.kinds)

    def _check_recovery(self) -> None:
        now = _progress(self.out)
        for fault in list(self.pending):
            if now and now[1] > fault.t and now[0] > fault.position and self.recoverable(fault):
                if fault.lost_s is None:
                    fault.lost_s = now[1] - fault.t
                if fault.survived is None:
                    fault.survived = self.confirm(fault)
                self.pending.remove(fault)

    def confirm(self, fault: Fault) -> bool:
        return True

    def log(self) -> Path:
        return self.out / f"log-a{self.attempt}.txt"

    def victim(self, rank: int = 1) -> int:
        for info in sorted(_pids(self.out), key=lambda i: -os.stat(self.out / "pids" / f"{i['pid']}.json").st_mtime):
            if info["rank"] == rank:
                return info["pid"]
        raise RuntimeError(f"{self.name}: no live rank {rank}")


class MpirunLane(Lane):
    name, kinds = "mpirun", MPI_KINDS

    def __init__(self, soak: Soak, seconds: float, every_kind: bool) -> None:
        super().__init__(soak, seconds, every_kind)
        self.ckpt = self.out / "ckpt"
        self.ckpt.mkdir(exist_ok=True)
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(self.ckpt)],
                               capture_output=True, text=True)
        self.tmpfs = mount.returncode == 0
        if not self.tmpfs:
            soak.say(f"no tmpfs for the checkpoints ({mount.stderr.strip()}): no full-disk faults")
            self.kinds = tuple(k for k in MPI_KINDS if k != "disk-full")
        self.expect_end: Fault | None = None
        self.disk_until = 0.0

    def argv(self, *extra: str) -> list[str]:
        return [sys.executable, str(WORKER), "--out", str(self.out), "--timeout", str(self.soak.timeout_s), *extra]

    def launch(self) -> None:
        self.soak.say(f"mpirun: launching attempt {self.attempt}")
        (self.out / "progress.json").unlink(missing_ok=True)  # the new job's progress only
        self.proc = _start(command("mpirun", 2, self.argv("--ckpt", str(self.ckpt), "--attempt", str(self.attempt))),
                           self.log())

    def inject(self, kind: str, fault: Fault) -> None:
        pid = fault.victim = self.victim(1)
        if kind == "kill-9":
            _signal(pid, signal.SIGKILL)
        elif kind == "sigterm":
            _signal(pid, signal.SIGTERM)
        elif kind in ("stop-short", "stop-long"):
            _signal(pid, signal.SIGSTOP)
            if kind == "stop-short":
                self.resume = {"at": time.monotonic() + 0.4 * self.soak.timeout_s, "pid": pid}
        elif kind in ("oom", "nan"):
            (self.out / f"trigger-{kind}").write_text("")
        elif kind == "disk-full":
            self._fill_disk(fault)
        if kind in ENDS_JOB:
            self.expect_end = fault

    def _fill_disk(self, fault: Fault) -> None:
        ballast = self.ckpt / "ballast"
        try:
            with open(ballast, "wb") as f:
                while True:
                    f.write(b"\0" * 65536)
        except OSError:
            pass
        hold = max(4.0, 2 * self.soak.gap[0])
        failed_before = self._failed_saves()
        until = time.monotonic() + hold
        while time.monotonic() < until:  # the job goes on training; its saves fail meanwhile
            now = _progress(self.out)
            if fault.lost_s is None and now and now[1] > fault.t and now[0] > fault.position:
                fault.lost_s = now[1] - fault.t
            time.sleep(0.1)
        ballast.unlink()
        failed = self._failed_saves() - failed_before
        fault.note = f"{failed} save(s) failed during {hold:.0f} s"
        if failed == 0:
            fault.survived, fault.note = False, f"no save was attempted during {hold:.0f} s of full disk"
        leftovers = [p.name for p in self.ckpt.iterdir() if p.name.startswith(".")]
        if leftovers:
            fault.survived, fault.note = False, f"a failed save left {leftovers}"

    def _failed_saves(self) -> int:
        return sum(len(f.read_text().splitlines()) for f in self.out.glob("save-failed-a*.txt"))

    def ended(self, rc: int) -> bool:
        fault, self.expect_end = self.expect_end, None
        text = self.log().read_text(errors="replace")
        if fault is None:
            return False
        if fault.kind == "sigterm" and "stop requested: checkpoint written" not in text:
            fault.survived, fault.note = False, "no checkpoint was written on SIGTERM"
        if fault.kind == "stop-long":
            named = "rank(s) [1] did not answer" in text
            fault.note = f"job ended with {rc}, " + ("naming rank 1" if named else "NOT naming rank 1")
            if not named:
                fault.survived = False
            _signal(fault.victim, signal.SIGCONT)
            _signal(fault.victim, signal.SIGKILL)
        return True

    def recoverable(self, fault: Fault) -> bool:
        if fault.kind in ("oom", "nan"):  # only once rank 1 took the trigger and ran that step
            status = {"oom": "oom", "nan": "nonfinite"}[fault.kind]
            path = self.out / f"served-a{self.attempt}-r1.jsonl"
            return (not (self.out / f"trigger-{fault.kind}").exists() and path.exists()
                    and any(json.loads(line)["status"] == status for line in path.read_text().splitlines()
                            if (json.loads(line)["epoch"], json.loads(line)["end"]) > fault.position))
        return fault.kind not in ENDS_JOB or (self.attempt > fault.attempt
                                              and (self.out / f"restore-a{self.attempt}.json").exists())

    def confirm(self, fault: Fault) -> bool:
        if fault.kind in ENDS_JOB:
            restored = json.loads((self.out / f"restore-a{self.attempt}.json").read_text())
            fault.note = (fault.note + "; " if fault.note else "") + f"resumed from {restored['checkpoint']}"
            return self.attempt > fault.attempt
        return self.attempt == fault.attempt  # the same job carried on  # stop-short, disk-full: the same job carried on

    # --- afterwards ---------------------------------------------------------------------------------
    def committed(self) -> tuple[dict[int, list[dict]], list[dict]]:
        """Per rank, the steps that count: each attempt's records up to where the next one resumed."""
        timelines: dict[int, list[dict]] = {0: [], 1: []}
        injections: list[dict] = []
        for a in range(self.attempt + 1):
            restored = json.loads((self.out / f"restore-a{a}.json").read_text())
            cut = (restored["epoch"], restored["cursor"]) if restored["checkpoint"] else (-1, -1)
            for r in timelines:
                timelines[r] = [s for s in timelines[r] if (s["epoch"], s["end"]) <= cut]
                path = self.out / f"served-a{a}-r{r}.jsonl"
                timelines[r] += [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
            injections = [i for i in injections if (i["epoch"], i["start"]) < cut]
            path = self.out / f"injected-a{a}.jsonl"
            injections += [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return timelines, injections

    def verify(self) -> None:
        soak = self.soak
        final = json.loads((self.out / "final.json").read_text())
        timelines, injections = self.committed()
        for epoch in range(final["epochs"]):
            seen = sorted(i for r in timelines.values() for s in r if s["epoch"] == epoch and s["status"] != "oom"
                          for i in s["indices"])
            if seen != list(range(SAMPLES)):
                soak.problems.append(f"mpirun: epoch {epoch} saw {len(seen)} samples, {len(set(seen))} distinct "
                                     f"(want each of {SAMPLES} once)")
        replay = self.out / "replay.json"
        replay.write_text(json.dumps(injections))
        ref = self.out / "reference"
        (ref / "pids").mkdir(parents=True, exist_ok=True)
        soak.say(f"mpirun: uninterrupted reference run, {final['epochs']} epochs, replaying {len(injections)} "
                 "OOM/NaN steps")
        argv = [sys.executable, str(WORKER), "--out", str(ref), "--ckpt", str(ref / "ckpt"), "--epochs",
                str(final["epochs"]), "--save-every", "0", "--step-sleep", "0", "--replay", str(replay)]
        proc = subprocess.run(command("mpirun", 2, argv), env=_env(), capture_output=True, text=True,
                              timeout=self.soak.reference_timeout_s)
        if proc.returncode != 0:
            soak.problems.append(f"mpirun: the reference run failed ({proc.returncode}): {proc.stdout[-2000:]}")
            return
        want = json.loads((ref / "final.json").read_text())["params"]
        diff = max(abs(a - b) for x, y in zip(final["params"], want) for a, b in zip(x, y))
        soak.say(f"mpirun: max |parameter difference| against the uninterrupted run: {diff:.3e}")
        self.param_diff = diff
        if diff > PARAM_TOLERANCE:
            soak.problems.append(f"mpirun: final parameters differ from the uninterrupted run by {diff:.3e}")
        leftovers = [p.name for p in self.ckpt.iterdir() if p.name.startswith(".")]
        if leftovers:
            soak.problems.append(f"mpirun: temporary checkpoint files left: {leftovers}")

    def close(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", str(self.ckpt)], check=False)


class ElasticLane(Lane):
    name, kinds = "elastic", ELASTIC_KINDS

    def launch(self) -> None:
        host = socket.gethostname() if socket.gethostname() != "localhost" else "127.0.0.1"
        self.host = host
        discovery = self.out / "discover.sh"
        discovery.write_text(f"#!/bin/sh\necho localhost:2\necho {host}:1\n")
        discovery.chmod(0o755)
        env = dict(_env(), DISCOVERY=str(discovery), NP="3", MIN_NP="2", MAX_NP="3", COOLDOWN="1 2",
                   GLOO_TIMEOUT="10", PYTHON=sys.executable, SCRIPT=str(WORKER),
                   SCRIPT_ARGS=f"--elastic --out {self.out} --timeout 20")
        self.soak.say("elastic: launching horovodrun (3 workers, at least 2)")
        self.proc = _start(["bash", str(REPO / "launch" / "elastic.sh")], self.log(), env)

    def ready(self) -> bool:
        live = _pids(self.out)
        return len(live) == 3 and any(i["host"] == self.host for i in live)

    def inject(self, kind: str, fault: Fault) -> None:
        # The worker on the host with one slot: killing it blacklists that host alone (for 1-2 s).
        pid = fault.victim = next(i["pid"] for i in _pids(self.out) if i["host"] == self.host)
        if kind == "kill-9":
            _signal(pid, signal.SIGKILL)
        else:
            _signal(pid, signal.SIGSTOP)
            self.resume = {"at": time.monotonic() + 4.0, "pid": pid}  # below Gloo's 10 s timeout

    def ended(self, rc: int) -> bool:
        return False  # horovodrun itself must never end early

    def victim(self, rank: int = 1) -> int:
        raise NotImplementedError

    def verify(self) -> None:
        final = json.loads((self.out / "final.json").read_text())
        worlds = [s["world"] for s in final["served"]]
        for epoch in range(final["epochs"]):
            seen = sorted(i for s in final["served"] if s["epoch"] == epoch for i in s["indices"])
            if seen != list(range(SAMPLES)):
                self.soak.problems.append(f"elastic: epoch {epoch} saw {len(seen)} samples, {len(set(seen))} "
                                          f"distinct (want each of {SAMPLES} once)")
        self.soak.say(f"elastic: {final['epochs']} epochs, world sizes seen {sorted(set(worlds))}")

    def close(self) -> None:
        pass


def table(faults: list[Fault]) -> str:
    rows = ["| lane | fault | injected | survived | time lost per fault (s): mean / max |", "|---|---|---|---|---|"]
    for lane, kinds in (("mpirun", MPI_KINDS), ("elastic", ELASTIC_KINDS)):
        for kind in kinds:
            got = [f for f in faults if f.lane == lane and f.kind == kind]
            if not got:
                continue
            lost = [f.lost_s for f in got if f.lost_s is not None]
            timing = f"{sum(lost) / len(lost):.1f} / {max(lost):.1f}" if lost else "-"
            rows.append(f"| {lane} | {kind} | {len(got)} | {sum(1 for f in got if f.survived)} | {timing} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="total time of both lanes (default 10)")
    ap.add_argument("--quick", action="store_true", help="every fault kind once, faults 3-6 s apart (~2 minutes)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default="runs/chaos", help="work and result directory (emptied first)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    out = Path(args.out).resolve()
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    _TMP[:] = [out / "tmp"]
    _TMP[0].mkdir()
    before = _snapshot()
    seconds = 60.0 if args.quick else args.minutes * 60
    soak = Soak(out, random.Random(seed), (3.0, 6.0) if args.quick else (20.0, 60.0), timeout_s=8.0,
                overrun_s=180.0 if args.quick else 600.0, reference_timeout_s=240.0 if args.quick else 900.0)
    soak.say(f"seed {seed}; output in {out}")
    t0 = time.monotonic()
    lanes = [MpirunLane(soak, 0.6 * seconds, args.quick), ElasticLane(soak, 0.3 * seconds, args.quick)]
    for lane in lanes:
        try:
            lane.run()
            lane.verify()
        except Exception as exc:  # report, clean up, and go on to the other lane and the checks
            soak.problems.append(f"{lane.name}: {type(exc).__name__}: {exc}")
        finally:
            if lane.proc is not None and lane.proc.poll() is None:
                soak.problems.append(f"{lane.name}: the job was still running at the end; killed")
                _stop_job(lane.proc)
                for pid in _ours(str(lane.out)):
                    _signal(pid, signal.SIGKILL)
            lane.close()
    deadline = time.monotonic() + 30
    while _ours(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _ours(str(out))
    if left:
        names = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode(errors="replace")
                 for pid in left if Path(f"/proc/{pid}").exists()]
        soak.problems.append(f"processes left behind 30 s after the end: {names}")
        for pid in left:
            _signal(pid, signal.SIGKILL)
    after, used = _snapshot(), _in_use()
    for spot in before:
        new = sorted(n for n in after[spot] - before[spot] if f"{spot}/{n}" not in used)
        if new:
            soak.problems.append(f"left behind in {spot}: {new}")
    # torch keeps its compile cache in TMPDIR/torchinductor_<user> on purpose (reused by later runs).
    tmp_left = sorted(p.name for p in _TMP[0].iterdir() if not p.name.startswith("torchinductor_"))
    if tmp_left:
        soak.problems.append(f"left behind in the jobs' TMPDIR: {tmp_left}")
    else:
        subprocess.run(["rm", "-rf", str(_TMP[0])], check=False)
    if any(_mounted(lane.out / "ckpt") for lane in lanes):
        soak.problems.append("the checkpoint tmpfs is still mounted")
    unsurvived = [f for f in soak.faults if not f.survived]
    report = table(soak.faults)
    summary = (f"chaos soak: {len(soak.faults)} faults in {time.monotonic() - t0:.0f} s (seed {seed}), "
               f"{len(soak.faults) - len(unsurvived)} survived; checks: "
               + ("all passed" if not soak.problems else "; ".join(soak.problems)))
    print("\n" + report + "\n\n" + summary, flush=True)
    for f in unsurvived:
        print(f"not survived: {f.lane} {f.kind} at {f.position}: {f.note}", flush=True)
    (out / "faults.json").write_text(json.dumps([f.__dict__ for f in soak.faults], indent=1, default=str))
    (out / "report.md").write_text(f"```\npython -m bench.chaos {' '.join(argv or sys.argv[1:])}\n```\n\n"
                                   f"{report}\n\n{summary}\n")
    return 0 if not unsurvived and not soak.problems else 1


if __name__ == "__main__":
    sys.exit(main())
