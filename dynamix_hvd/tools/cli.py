"""``dynamix-hvd``: launch a training script after checking the launch, summarise and plot runs.

    dynamix-hvd run --np 2 --launcher mpirun --batch-sizes 16,48 --epochs 3 --out runs/mlp
    dynamix-hvd run --np 4 --script train.py -- --lr 0.1   # your own script through the same checks
    dynamix-hvd check --np 4 --launcher mpirun             # only the launch checks
    dynamix-hvd summarize runs/mlp
    dynamix-hvd plot runs/mlp [-o report.png]              # also: dynamix-hvd report
    dynamix-hvd tensorboard runs/mlp
    dynamix-hvd settings                                   # regenerate docs/settings.md's reference

Also ``python -m dynamix_hvd``. Every subcommand has ``--help``. Policy tools, the simulator and the
benchmarks belong to the source tree's lab (``python -m bench.lab.policy_tools``, ``python -m bench.suite``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from . import launchcheck, settings_doc
from ..comm import set_horovod_stall_defaults
from ..control.controller import POLICY_NAMES
from ..logs import configure_logging

PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the directory that holds dynamix_hvd/
EXAMPLE = "dynamix_hvd.examples.mlp"


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
    if args.script:
        if not Path(args.script).is_file():
            return _fail(f"--script {args.script}: no such file")
        job = [sys.executable, args.script]
    else:
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
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), env.get("PYTHONPATH", "")]))
    if os.sep in args.mpirun:  # horovodrun --mpi looks mpirun up on PATH
        env["PATH"] = os.pathsep.join([str(Path(args.mpirun).parent), env.get("PATH", "")])
    cmd = launchcheck.command(plan, job, mpirun=args.mpirun, env=env)
    print(f"[dynamix-hvd] {plan.describe()}\n[dynamix-hvd] {' '.join(cmd)}", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(cmd, env=env).returncode


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
    if run.meta.get("controller_config") is not None:  # the controller's settings that are not the defaults
        from ..control.config import settings_line

        print(settings_line(run.meta["controller_config"]))
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


def cmd_explain(args: argparse.Namespace) -> int:
    from ..runs.explain import explain_lines, legend_lines
    from ..runs.rundir import read_run

    try:
        run = read_run(args.run_dir)
    except FileNotFoundError as exc:
        return _fail(str(exc), 1)
    if args.phases:
        print("phases:")
        print("\n".join(legend_lines()))
        print()
    print("\n".join(explain_lines(run.history, verbose=args.all)))
    return 0


def cmd_tensorboard(args: argparse.Namespace) -> int:
    from ..runs.tensorboard import write_run_tensorboard

    try:
        out = write_run_tensorboard(args.run_dir, args.logdir)
    except (FileNotFoundError, ImportError) as exc:
        return _fail(str(exc), 1)
    print(out)
    return 0


# --- parser ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dynamix-hvd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the example training job (or --script) through a launcher",
                       description="Run the example MLP job (dynamix_hvd.examples.mlp) or --script on --np "
                                   "ranks. Arguments after '--' go to the script (see its --help).")
    _add_launch_options(p)
    p.add_argument("--batch-sizes", default=None, help="local batch size per rank, e.g. 16,48 (default 32 each)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    p.add_argument("--samples", type=int, default=8192, help="generated training samples (default 8192)")
    p.add_argument("--policy", default="model", choices=POLICY_NAMES,
                   help="batch-size policy: model (the cost-model proposal, default), ppo (DYNAMIX's learned "
                        "refinement of it), static or a classic rule")
    p.add_argument("--policy-file", default=None, help="PPO policy to start from: name in policies/ or path")
    p.add_argument("--out", default="runs/mlp", help="run directory for records and report (default runs/mlp)")
    p.add_argument("--script", default=None,
                   help="a training script to run instead of the example (then only the launch options "
                        "and the arguments after '--' apply)")
    p.add_argument("--dry-run", action="store_true", help="check and print the command without running it")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments for the example")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="only check a launch configuration (no job is started)",
                       description=launchcheck.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_launch_options(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("summarize", help="table of a finished run, one row per epoch, and its straggler diagnosis")
    p.add_argument("run_dir", help="the run's OUT directory (holds trace.h5 and epochs.csv)")
    p.set_defaults(func=cmd_summarize)

    p = sub.add_parser("explain", help="why each decision of a finished run was made, phase by phase",
                       description="Print a run's decisions: the phase each was made in, what the interval "
                                   "before it concluded, why the sizes changed (or not), the evidence and the "
                                   "alternatives weighed with their predicted step times. Runs of decisions "
                                   "that changed nothing are folded into one line (--all shows each).")
    p.add_argument("run_dir", help="the run's OUT directory (holds trace.h5)")
    p.add_argument("--all", action="store_true", help="every decision, with its evidence and alternatives")
    p.add_argument("--phases", action="store_true", help="first list the phases and what each means")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("plot", aliases=["report"], help="write the PNG report of a finished run")
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

    p = sub.add_parser("settings", help="regenerate docs/settings.md's reference from the config dataclasses",
                       description=settings_doc.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    settings_doc.add_arguments(p)
    p.set_defaults(func=settings_doc.run)

    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    result: Any = args.func(args)
    return int(result)


if __name__ == "__main__":
    sys.exit(main())
