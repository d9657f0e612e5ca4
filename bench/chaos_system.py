"""What the chaos soak (`bench.chaos`) reads from and does to the operating system: the workers'
progress and pid files, signals, the processes, mounts and files a job may leave behind, and starting
and stopping jobs in their own session and TMPDIR."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from dynamix_hvd.tools.launchcheck import local_env

REPO = Path(__file__).resolve().parents[1]


def _progress(out: Path) -> tuple[tuple[int, int], float] | None:
    try:
        p = json.loads((out / "progress.json").read_text())
    except (OSError, ValueError):
        return None
    return (p["epoch"], p["end"]), p["t"]


def _pids(out: Path) -> list[dict]:
    found = []
    for f in (out / "pids").glob("*.json"):
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if _alive(info["pid"]):
            found.append(info)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _ancestors() -> set[int]:
    """This process and the ones that started it (a wrapper's command line names the output too)."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            break
    return pids


def _ours(token: str) -> list[int]:
    """Live processes whose command line names `token` (the soak's output directory)."""
    pids, mine = [], _ancestors()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in mine:
            continue
        try:
            if token in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") and _alive(int(d.name)):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


_TMP: list[Path] = []  # the soak's own TMPDIR, which every job it starts uses


def _env() -> dict[str, str]:
    return local_env(REPO, TMPDIR=str(_TMP[0]))


def _snapshot() -> dict[str, set[str]]:
    spots = {"/dev/shm": Path("/dev/shm"), "/run/netns": Path("/run/netns")}
    return {name: {p.name for p in path.iterdir()} if path.is_dir() else set() for name, path in spots.items()}


def _in_use() -> set[str]:
    """Every path a live process has open or mapped (so a shared-memory file in use is no leftover)."""
    used = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            used.update(os.readlink(fd) for fd in (d / "fd").iterdir())
            used.update(line.split(None, 5)[5].strip() for line in (d / "maps").read_text().splitlines()
                        if len(line.split(None, 5)) == 6)
        except OSError:
            continue
    return used


def _mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines())


def _start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env or _env(), start_new_session=True,
                                cwd=log.parent)


def _stop_job(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        _signal(-proc.pid, signal.SIGCONT)
        _signal(-proc.pid, signal.SIGKILL)
        proc.wait()
