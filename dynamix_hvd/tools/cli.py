"""``dynamix-hvd``: run the example job, manage policies, summarise and plot runs, run benchmarks.

    dynamix-hvd run --np 2 --launcher mpirun --batch-sizes 16,48 --epochs 3 --out runs/mlp
    dynamix-hvd check --np 4 --launcher mpirun          # only the launch checks
    dynamix-hvd policy list | inspect NAME | validate NAME | compare NAME OTHER
    dynamix-hvd summarize runs/mlp
    dynamix-hvd plot runs/mlp [-o report.png]
    dynamix-hvd bench decision_overhead -- --ranks 2,4
    dynamix-hvd bench suite --quick                     # the benchmark suite (bench/suite.py)

Also ``python -m dynamix_hvd``. Every subcommand has ``--help``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from . import launchcheck
from ..comm import set_horovod_stall_defaults
from ..control.controller import POLICY_NAMES
from ..logs import configure_logging

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "bench"
EXAMPLE = "dynamix_hvd.examples.mlp_train"


def _fail(message: str, code: int = 2) -> int:
    print(f"dynamix-hvd: error: {message}", file=sys.stderr)
    return code


# --- run / check -------------------------------------------------------------------------------------
def _add_launch_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--np", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--launcher", default="mpirun", choices=launchcheck.LAUNCHERS,
                   help="mpirun (Open MPI), horovodrun (its MPI mode) or horovodrun-gloo (no MPI needed)")
    p.add_argument("--hostfile", default=None,
                   help="hostfile with one 'host slots=N' line per node (see hostfile.example); default: this host")
    p.add_argument("--hosts", default=None, help="host list instead of a hostfile, e.g. node1:2,node2:2")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than cores on this host (or than the hostfile's slots, with mpirun)")
    p.add_argument("--no-allow-run-as-root", dest="allow_root", action="store_false",
                   help="do not set OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 when running as root (Open MPI then refuses)")
    p.add_argument("--mpirun", default=os.environ.get("MPIRUN", "mpirun"),
                   help="the mpirun to use, a name on PATH or a path (env MPIRUN; default mpirun)")


def _check(args: argparse.Namespace) -> launchcheck.LaunchPlan:
    return launchcheck.check(args.launcher, args.np, hostfile=args.hostfile, hosts=args.hosts,
                             oversubscribe=args.oversubscribe, allow_root=args.allow_root, mpirun=args.mpirun)


def cmd_check(args: argparse.Namespace) -> int:
    try:
        plan = _check(args)
    except launchcheck.LaunchError as exc:
        return _fail("launch misconfigured:\n" + "\n".join(f"  - {l}" for l in str(exc).splitlines()))
    print(plan.describe())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    sizes = [s for s in (args.batch_sizes or "").split(",") if s.strip()]
    if sizes and (len(sizes) != args.np or not all(s.strip().isdigit() and int(s) > 0 for s in sizes)):
        return _fail(f"--batch-sizes {args.batch_sizes} must be {args.np} positive integers, one per rank "
                     f"(--np {args.np})")
    try:
        plan = _check(args)
    except launchcheck.LaunchError as exc:
        return _fail("launch misconfigured:\n" + "\n".join(f"  - {l}" for l in str(exc).splitlines()))
    job = [sys.executable, "-m", EXAMPLE, "--epochs", str(args.epochs), "--out", args.out,
           "--policy", args.policy, "--samples", str(args.samples)]
    if sizes:
        job += ["--batch-sizes", ",".join(s.strip() for s in sizes)]
    if args.policy_file:
        job += ["--policy-file", args.policy_file]
    job += [a for a in args.extra if a != "--"]
    env = dict(os.environ, **plan.env, DYNAMIX_LAUNCHER=args.launcher)
    env.setdefault("OMP_NUM_THREADS", "1")
    set_horovod_stall_defaults(env)
    if sys.stderr.isatty():  # ranks cannot tell (Open MPI gives them a pty anyway): ask for the bar
        env.setdefault("DYNAMIX_PROGRESS", "bar")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    if os.sep in args.mpirun:  # horovodrun --mpi looks mpirun up on PATH
        env["PATH"] = os.pathsep.join([str(Path(args.mpirun).parent), env.get("PATH", "")])
    cmd = launchcheck.command(plan, job, mpirun=args.mpirun, env=env)
    print(f"[dynamix-hvd] {plan.describe()}\n[dynamix-hvd] {' '.join(cmd)}", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(cmd, env=env).returncode


# --- policy ------------------------------------------------------------------------------------------
def _policy_dir(args: argparse.Namespace) -> Path | None:
    return Path(args.dir) if args.dir else None


def cmd_policy(args: argparse.Namespace) -> int:
    """list / inspect / validate / compare through `policy_tools`."""
    from ..control.policy_store import PolicyError
    from . import policy_tools as tools

    directory = _policy_dir(args)

    try:
        if args.action == "list":
            result: Any = tools.list_policy_summaries(directory)
        elif args.action == "inspect":
            result = tools.inspect_policy(args.name, directory)
        elif args.action == "validate":
            result = tools.validate_policy(args.name, directory)
        else:
            if not args.other:
                return _fail("policy compare needs two policies: NAME OTHER")
            result = tools.compare_policies(args.name, args.other, directory=directory)
    except PolicyError as exc:
        return _fail(str(exc), 1)
    print(json.dumps(result, indent=2, default=str) if args.json else tools.format_result(result))
    failed = args.action == "validate" and not result.get("ok")
    failed |= args.action == "inspect" and ("error" in result or "load_error" in result)
    return 1 if failed else 0


# --- runs --------------------------------------------------------------------------------------------
def cmd_summarize(args: argparse.Namespace) -> int:
    from ..runs.diagnosis import diagnose, format_diagnosis
    from ..runs.report import header_text, summary_table
    from ..runs.rundir import read_run

    try:
        run = read_run(args.run_dir)
    except FileNotFoundError as exc:
        return _fail(str(exc), 1)
    print(header_text(run))
    print()
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.4f}".format):
        print(summary_table(run).to_string(index=False))
    print()
    print(format_diagnosis(diagnose(run.steps)))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from ..runs.report import write_report

    try:
        out = write_report(args.run_dir, args.output)
    except FileNotFoundError as exc:
        return _fail(str(exc), 1)
    print(out)
    return 0


def cmd_tensorboard(args: argparse.Namespace) -> int:
    from ..runs.tensorboard import write_run_tensorboard

    try:
        out = write_run_tensorboard(args.run_dir, args.logdir)
    except (FileNotFoundError, ImportError) as exc:
        return _fail(str(exc), 1)
    print(out)
    return 0


# --- bench -------------------------------------------------------------------------------------------
def bench_scripts() -> dict[str, Path]:
    """Benchmarks in bench/: name (file stem without 'bench_') -> script; "suite" is bench/suite.py."""
    if not BENCH_DIR.is_dir():
        return {}
    scripts = {p.stem.removeprefix("bench_"): p for p in sorted(BENCH_DIR.glob("bench_*.py"))}
    if (BENCH_DIR / "suite.py").is_file():
        scripts["suite"] = BENCH_DIR / "suite.py"
    return scripts


def cmd_bench(args: argparse.Namespace) -> int:
    scripts = bench_scripts()
    if args.list or not args.name:
        for name, path in scripts.items():
            doc = path.read_text().split('"""')[1].strip().splitlines()[0] if '"""' in path.read_text() else ""
            print(f"{name:<22} {doc}")
        return 0 if scripts else _fail(f"no benchmarks found in {BENCH_DIR}", 1)
    script = scripts.get(args.name)
    if script is None:
        return _fail(f"no benchmark {args.name!r} in {BENCH_DIR}; available: {', '.join(scripts) or 'none'}")
    extra = [a for a in args.extra if a != "--"]
    # bench/ is a package of the source tree: run from its root, with this tree's dynamix_hvd first
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    return subprocess.run([sys.executable, "-m", f"bench.{script.stem}", *extra], cwd=REPO, env=env).returncode


# --- parser ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dynamix-hvd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the example training job through a launcher",
                       description="Run the example MLP job (dynamix_hvd.examples.mlp_train) on --np ranks. "
                                   "Arguments after '--' go to the example (see its --help).")
    _add_launch_options(p)
    p.add_argument("--batch-sizes", default=None, help="local batch size per rank, e.g. 16,48 (default 32 each)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    p.add_argument("--samples", type=int, default=8192, help="generated training samples (default 8192)")
    p.add_argument("--policy", default="ppo", choices=POLICY_NAMES,
                   help="batch-size policy: ppo (DYNAMIX, default), static or a classic rule")
    p.add_argument("--policy-file", default=None, help="PPO policy to start from: name in policies/ or path")
    p.add_argument("--out", default="runs/mlp", help="run directory for records and report (default runs/mlp)")
    p.add_argument("--dry-run", action="store_true", help="check and print the command without running it")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments for the example")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="only check a launch configuration (no job is started)",
                       description=launchcheck.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_launch_options(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("policy", help="list, inspect, validate or compare stored PPO policies")
    p.add_argument("action", choices=["list", "inspect", "validate", "compare"],
                   help="list: policies in the directory; inspect: NAME's spec, provenance and size; "
                        "validate: run every check on NAME (exit 1 if one fails); "
                        "compare: action distributions of NAME and OTHER on the same simulated states")
    p.add_argument("name", nargs="?", help="policy name in the directory, or a path (inspect/validate/compare)")
    p.add_argument("other", nargs="?", help="the second policy (compare only)")
    p.add_argument("--dir", default=None, help="policy directory (default $DYNAMIX_POLICY_DIR or policies/)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    p.set_defaults(func=cmd_policy)

    p = sub.add_parser("summarize", help="table of a finished run, one row per epoch, and its straggler diagnosis")
    p.add_argument("run_dir", help="the run's OUT directory (holds trace.h5 and epochs.csv)")
    p.set_defaults(func=cmd_summarize)

    p = sub.add_parser("plot", help="write the PNG report of a finished run")
    p.add_argument("run_dir", help="the run's OUT directory (holds trace.h5 and epochs.csv)")
    p.add_argument("-o", "--output", default=None, help="PNG to write (default RUN_DIR/report.png)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("tensorboard", help="write TensorBoard event files of a finished run",
                       description="Per-rank batch size, throughput, allreduce wait, LR and loss per step, "
                                   "and the controller's sizes, rewards, noise scale, efficiency, throughput "
                                   "and LR gain per decision (needs the tensorboard package).")
    p.add_argument("run_dir", help="the run's OUT directory (holds trace.h5)")
    p.add_argument("--logdir", default=None, help="where to write (default RUN_DIR/tensorboard)")
    p.set_defaults(func=cmd_tensorboard)

    p = sub.add_parser("bench", help="run a benchmark from bench/ (e.g. decision_overhead)")
    p.add_argument("name", nargs="?", help="benchmark name: bench/bench_NAME.py")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments for the benchmark")
    p.set_defaults(func=cmd_bench)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    if args.command == "policy" and args.action != "list" and not args.name:
        return _fail(f"policy {args.action} needs a policy NAME")
    result: Any = args.func(args)
    return int(result)


if __name__ == "__main__":
    sys.exit(main())
