"""Cluster conditions for the benchmark suite: rank count, a slowed rank, stalls, and a shaped network.

* Heterogeneity: one rank computes `slow_factor` times slower (see the examples' ``--slow-*`` flags),
  constant or following `slow_schedule` ("SECONDS:FACTOR,..." in training seconds). It spins (a
  slower device holding its core) or, with `slow_mode` "sleep", sleeps: needed when there are more
  ranks than cores, where spinning would also steal the other ranks' CPU.
* Stalls: the slowed rank pauses `stall_rate` times per second on average (Poisson), each pause a
  Pareto(1.5) multiple of `stall_ms` (heavy-tailed, at most 10x).
* Network: every rank runs in its own network namespace (``ip netns``), joined to a bridge in the
  root namespace by a veth pair, with addresses from 198.18.0.0/15 (the benchmarking range) only.
  Each rank's link is shaped by the kernel (``tc qdisc ... tbf rate``); `rate_schedule`
  ("SECONDS:MBIT,...") changes the rate while the job runs. Ranks start through ``ip netns exec`` in
  an MPMD ``mpirun`` line; Open MPI is told to use TCP over that subnet only (``btl tcp,self``,
  ``btl_tcp_if_include``, ``oob_tcp_if_include``), and PMIx (the rank <-> mpirun channel, TCP in
  PMIx 4) to listen on the bridge address, since a rank in another namespace cannot reach mpirun's
  loopback.

``netem`` (added delay, loss) needs the kernel's ``sch_netem``; where ``tc qdisc add ... netem`` says
"Specified qdisc kind is unknown" (e.g. this project's VM: CONFIG_NET_SCH_NETEM is not set and there
are no loadable modules), `netem_available` is False and delay conditions are refused with that reason.
Needs root (CAP_NET_ADMIN) and iproute2 (``apt-get install iproute2``).
"""
from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from dynamix_hvd.tools.launchcheck import command, local_plan, mpmd_command

BENCH_NET = ipaddress.ip_network("198.18.0.0/15")
# Waiting ranks yield the CPU instead of spinning: on 2 shared cores Horovod's spinning background
# threads otherwise steal the cores from the ranks still computing (measured on a 2-core VM: median
# allreduce wait per step 40-50 ms without, 8-13 ms with, for a 4 ms compute step).
MPIRUN_OPTIONS = ("--mca", "mpi_yield_when_idle", "1")


@dataclass(frozen=True)
class Condition:
    """One cluster condition of the matrix."""

    name: str
    ranks: int = 2
    slow_rank: int = -1
    """Rank that is slowed (-1: none)."""
    slow_factor: float = 1.0
    """That rank computes this many times slower (2.0: half speed)."""
    slow_schedule: str = ""
    """Slowdown changing over time, "TIME:FACTOR,..." (after `slow_factor` until the first entry); TIME
    counts what `slow_clock` says."""
    slow_clock: str = "seconds"
    """What the schedule's times count: "seconds" of training, or "budget", the fraction (0-1) of the
    epoch budget's samples trained, so every arm meets each phase at the same point of its training
    however fast it runs (a seconds schedule gives a faster arm fewer slow seconds)."""
    rate_mbit: float | None = None
    """Bandwidth cap of every rank's link (None: no namespaces, Open MPI's default transports)."""
    rate_schedule: str = ""
    """Bandwidth changing over time, "SECONDS:MBIT,...", applied by the driver while the job runs."""
    delay_ms: float = 0.0
    """Added one-way delay (needs sch_netem)."""
    slow_mode: str = "spin"
    """"spin" or "sleep" (more ranks than cores)."""
    stall_rate: float = 0.0
    """Pauses of the slowed rank per second of training (0: none)."""
    stall_ms: float = 200.0
    """Scale of a pause."""

    def __post_init__(self) -> None:
        if self.slow_clock not in ("seconds", "budget"):
            raise ValueError(f"Condition {self.name!r}: slow_clock={self.slow_clock!r}; choose seconds or budget")
        if self.slow_clock == "budget" and any(not 0 <= t <= 1 for t, _ in parse_pairs(self.slow_schedule)):
            raise ValueError(f"Condition {self.name!r}: slow_schedule={self.slow_schedule!r}; with the budget "
                             "clock its times are fractions of the budget in [0, 1]")

    @property
    def networked(self) -> bool:
        return self.rate_mbit is not None or self.delay_ms > 0

    def describe(self) -> str:
        parts = [f"{self.ranks} ranks"]
        if self.slow_rank >= 0 and (self.slow_factor != 1.0 or self.slow_schedule):
            parts.append(f"rank {self.slow_rank} x{self.slow_factor:g} slower"
                         + (f" then {self.slow_schedule} ({'budget fraction' if self.slow_clock == 'budget' else 's'}:factor)"
                            if self.slow_schedule else "")
                         + (" (SLEEPS instead of spinning: more ranks than cores)" if self.slow_mode == "sleep" else ""))
        if self.stall_rate:
            parts.append(f"rank {self.slow_rank} stalls {self.stall_rate:g}/s, Pareto(1.5) x {self.stall_ms:g} ms "
                         "(at most 10x)")
        if self.rate_mbit is not None:
            parts.append(f"netns+tbf {self.rate_mbit:g} Mbit/s"
                         + (f" then {self.rate_schedule} (s:Mbit)" if self.rate_schedule else ""))
        if self.delay_ms:
            parts.append(f"netem delay {self.delay_ms:g} ms")
        return ", ".join(parts)


def parse_pairs(text: str) -> list[tuple[float, float]]:
    """'0:2,15:1' -> [(0.0, 2.0), (15.0, 1.0)] sorted by time."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        t, v = part.split(":")
        pairs.append((float(t), float(v)))
    return sorted(pairs)


def slow_args(cond: Condition) -> list[str]:
    """The examples' flags for the condition's slowed rank (every example has them, see
    `bench.jobs.common.add_bench_flags`)."""
    if cond.slow_rank < 0:
        return []
    out = ["--slow-rank", str(cond.slow_rank), "--slow-factor", str(cond.slow_factor), "--slow-mode", cond.slow_mode]
    out += ["--slow-schedule", cond.slow_schedule] if cond.slow_schedule else []
    out += ["--slow-clock", cond.slow_clock] if cond.slow_schedule and cond.slow_clock != "seconds" else []
    return out + (["--stall-rate", str(cond.stall_rate), "--stall-ms", str(cond.stall_ms)] if cond.stall_rate else [])


def split_limit(speeds: Sequence[float]) -> float:
    """Throughput of the best split over the equal split for per-sample speeds `speeds`: the best
    split gives each rank work in proportion to its speed (sum s_i samples per unit time); the equal
    split runs at the slowest rank's pace (R x min s_i). E.g. (1, 1/3) -> 2.0."""
    if not speeds or min(speeds) <= 0:
        raise ValueError(f"speeds {list(speeds)}: need at least one, all > 0")
    return sum(speeds) / (len(speeds) * min(speeds))


def physical_limit(cond: Condition) -> str:
    """`split_limit` of the condition, as text: one number for a constant slowdown, one per phase of
    a schedule, and why there is none for stalls (unpredictable) or a network condition (no compute
    difference: 1.00)."""
    def at(factor: float) -> float:
        return split_limit([1.0 / factor if r == cond.slow_rank else 1.0 for r in range(cond.ranks)])

    if cond.stall_rate:
        return "n/a (transient stalls)"
    if cond.slow_rank < 0:
        return "1.00"
    phases = [cond.slow_factor] + [f for _, f in parse_pairs(cond.slow_schedule)]
    return " then ".join(f"{at(f):.2f}" for f in phases)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def netem_available() -> tuple[bool, str]:
    """Can this kernel add a netem qdisc? (tries it on the loopback of a throw-away namespace)."""
    ns = f"dxprobe{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", ns)
    except (OSError, subprocess.CalledProcessError) as exc:
        return False, f"ip netns add failed: {getattr(exc, 'stderr', exc)}"
    try:
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        res = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                   "delay", "1ms", check=False)
        return res.returncode == 0, (res.stderr.strip() or "ok")
    finally:
        _run("ip", "netns", "del", ns, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 inside 198.18.0.0/15 that no interface on this machine uses yet."""
    used = _run("ip", "-o", "-4", "addr", "show").stdout
    for k in range(1, 255):
        net = ipaddress.ip_network(f"198.18.{k}.0/24")
        if f" 198.18.{k}." not in used:
            assert net.subnet_of(BENCH_NET)
            return net
    raise RuntimeError("no free /24 in 198.18.0.0/15")


class NetworkNamespaces:
    """A bridge plus one namespace and veth per rank, shaped with tbf; a context manager.

    Everything it creates is named ``dx<tag>...`` and removed on exit, even after errors.
    """

    def __init__(self, ranks: int, rate_mbit: float | None, delay_ms: float = 0.0) -> None:
        self.ranks, self.rate, self.delay = ranks, rate_mbit, delay_ms
        self.tag = str(os.getpid())  # names stay <= 15 characters: dx + pid (<= 7 digits) + 4
        self.bridge = f"dx{self.tag}br"
        self.namespaces = [f"dx{self.tag}n{r}" for r in range(ranks)]
        self.links = [f"dx{self.tag}r{r}" for r in range(ranks)]   # rank side, inside its namespace
        self.subnet: ipaddress.IPv4Network | None = None

    def __enter__(self) -> "NetworkNamespaces":
        if self.delay:
            ok, why = netem_available()
            if not ok:
                raise RuntimeError(f"netem delay requested but this kernel has no netem qdisc: {why}")
        try:
            self.subnet = _free_subnet()
            hosts = list(self.subnet.hosts())
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{hosts[-1]}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for r, (ns, link) in enumerate(zip(self.namespaces, self.links)):
                peer = f"dx{self.tag}h{r}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", peer, "type", "veth", "peer", "name", link)
                _run("ip", "link", "set", link, "netns", ns)
                _run("ip", "link", "set", peer, "master", self.bridge)
                _run("ip", "link", "set", peer, "up")
                _run("ip", "-n", ns, "addr", "add", f"{hosts[r]}/24", "dev", link)
                _run("ip", "-n", ns, "link", "set", link, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                self._shape(r, "add")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _qdisc(self) -> list[str]:
        if self.delay:
            spec = ["netem", "delay", f"{self.delay}ms"]
            return spec + (["rate", f"{self.rate}mbit"] if self.rate else [])
        if self.rate is None:
            return []
        # burst: at least a few MTUs; latency: queue up to 200 ms before dropping
        burst = max(16_000, int(self.rate * 1e6 / 8 / 250))
        return ["tbf", "rate", f"{self.rate}mbit", "burst", str(burst), "latency", "200ms"]

    def _shape(self, rank: int, verb: str) -> None:
        spec = self._qdisc()
        if spec:
            _run("ip", "netns", "exec", self.namespaces[rank], "tc", "qdisc", verb, "dev",
                 self.links[rank], "root", *spec)

    def set_rate(self, mbit: float) -> None:
        """Change every link's bandwidth cap now (the job keeps running)."""
        self.rate = mbit
        for r in range(self.ranks):
            self._shape(r, "change")

    def stats(self) -> list[str]:
        """``tc -s qdisc`` of every rank's link (bytes sent, drops, overlimits)."""
        return [_run("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", link, check=False).stdout
                for ns, link in zip(self.namespaces, self.links)]

    def __exit__(self, *exc: object) -> None:
        for r, ns in enumerate(self.namespaces):
            _run("ip", "link", "del", f"dx{self.tag}h{r}", check=False)
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    # --- launching ------------------------------------------------------------------------------
    def mpirun(self, argv: Sequence[str], env_keys: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
        """MPMD mpirun line starting rank r inside namespace r, and the environment it needs."""
        assert self.subnet is not None, "use inside `with NetworkNamespaces(...)`"
        net = str(self.subnet)
        options = [*MPIRUN_OPTIONS, "--mca", "btl", "tcp,self",
                   "--mca", "btl_tcp_if_include", net, "--mca", "oob_tcp_if_include", net]
        apps = [["ip", "netns", "exec", ns, *argv] for ns in self.namespaces]
        cmd = mpmd_command(local_plan("mpirun", self.ranks), apps, env=_every(env_keys), forward=env_keys,
                           options=options)
        env = {"PMIX_MCA_ptl_tcp_if_include": net, "PMIX_MCA_ptl_tcp_remote_connections": "1"}
        return cmd, env


STALE = re.compile(r"^dx(\d+)(?:br|n\d+|h\d+)$")


def cleanup_stale() -> list[str]:
    """Remove namespaces and links left by a NetworkNamespaces whose process died (e.g. killed with
    SIGKILL); the creator's pid is in every name. Returns what was removed."""
    removed = []
    names = _run("ip", "netns", "list", check=False).stdout.split()
    names += re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", check=False).stdout, flags=re.M)
    for name in names:
        m = STALE.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            kind = ("netns", "del", name) if re.search(r"n\d+$", name) else ("link", "del", name)
            if _run("ip", *kind, check=False).returncode == 0:
                removed.append(name)
    return removed


def plain_mpirun(ranks: int, argv: Sequence[str], env_keys: Sequence[str] = ()) -> list[str]:
    """The ordinary single-host line (shared memory between ranks)."""
    return command(local_plan("mpirun", ranks), argv, env=_every(env_keys), forward=env_keys,
                   options=MPIRUN_OPTIONS)


def _every(keys: Sequence[str]) -> dict[str, str]:
    """An environment in which all of `keys` count as set: each is forwarded (-x) whatever its value."""
    return dict.fromkeys(keys, "")


class RateSchedule(threading.Thread):
    """Applies `Condition.rate_schedule` to a running job: at t seconds, set every link to MBIT."""

    def __init__(self, net: NetworkNamespaces, schedule: str) -> None:
        super().__init__(daemon=True)
        self.net, self.pairs = net, parse_pairs(schedule)
        self.t0 = time.monotonic()
        self.applied: list[tuple[float, float]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        for t, mbit in self.pairs:
            if self._stop_event.wait(max(0.0, self.t0 + t - time.monotonic())):
                return
            self.net.set_rate(mbit)
            self.applied.append((round(time.monotonic() - self.t0, 2), mbit))

    def stop(self) -> None:
        self._stop_event.set()
