"""Collect what bench/gpu_check.sh produced into OUT/results.json and OUT/summary.md (printed too).

Usage: ``python bench/gpu_report.py WORK OUT ELAPSED_S BUDGET_S``. WORK holds steps.tsv (one line per
step: name, status, seconds, note) and the steps' JSON files (kernel, train1, oom1, train2).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

JOBS = ("kernel", "train1", "oom1", "train2")


def load(work: Path) -> tuple[list[dict[str, str]], dict[str, Any]]:
    steps = []
    for line in (work / "steps.tsv").read_text().splitlines():
        name, status, secs, note = (line.split("\t") + ["", "", "", ""])[:4]
        steps.append({"step": name, "status": status, "seconds": secs, "note": note})
    results = {}
    for name in JOBS:
        path = work / f"{name}.json"
        if path.exists():
            try:
                results[name] = json.loads(path.read_text())
            except ValueError as exc:
                results[name] = {"status": "failed", "reason": f"unreadable JSON: {exc}"}
    return steps, results


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else (f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}")
    return str(v)


def kernel_table(k: dict[str, Any]) -> list[str]:
    if k.get("status") != "ok":
        return [f"kernel: {k.get('reason', k.get('status'))}"]
    lines = [f"{k['device']}, {k['gib']} GiB per dtype, {k['tensors']} tensors, median of {k['reps']} x "
             f"{k['inner']} calls; goal {k['goal_tbps']} TB/s; best numba {k['best_numba_tbps']}", "",
             "| dtype | method | stage | ms | TB/s read | rel err (total) | worst segment |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in k["rows"]:
        lines.append(f"| {r['dtype']} | {r['method']} | {r['stage']} | {fmt(r['ms'])} | {fmt(r['tbps'])} | "
                     f"{fmt(r['err'])} | {fmt(r.get('seg_err', math.nan))} |")
    return lines


def checks_table(results: dict[str, Any]) -> list[str]:
    lines = ["| job | check | pass | numbers |", "| --- | --- | --- | --- |"]
    for job in ("train1", "train2", "oom1"):
        r = results.get(job)
        if r is None:
            continue
        for name, c in r.get("checks", {}).items():
            nums = ", ".join(f"{k}={fmt(v)}" for k, v in c.items() if k not in ("pass", "trace", "probe_peaks_mib"))
            lines.append(f"| {job} ({r.get('device_name', '?')}, {r.get('ranks')} rank(s)) | {name} | "
                         f"{c.get('pass')} | {nums} |")
    return lines


def main(argv: list[str]) -> int:
    work, out = Path(argv[1]), Path(argv[2])
    elapsed, budget = argv[3], argv[4]
    steps, results = load(work)
    for r in results.values():  # per-step raw data stays in WORK; the summary numbers travel
        if isinstance(r, dict):
            r.pop("raw", None)
    (out / "results.json").write_text(json.dumps({"steps": steps, "results": results,
                                                  "elapsed_s": elapsed, "budget_s": budget}, indent=1, default=str))
    md = [f"# GPU check ({elapsed} s of {budget} s)", "", "| step | status | s | note |", "| --- | --- | --- | --- |"]
    md += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['note']} |" for s in steps]
    md += ["", "## Kernel", ""] + kernel_table(results.get("kernel", {"status": "not run"}))
    md += ["", "## Training jobs", ""] + checks_table(results)
    oom = results.get("oom1", {}).get("checks", {}).get("oom_recovery")
    if oom:
        md += ["", "OOM trace (step:local batch:status:bound): " + " ".join(oom.get("trace", []))]
    not_done = [s for s in steps if s["status"] != "ok"]
    md += ["", "## Not done", ""] + ([f"- {s['step']}: " + (s["note"] if s["note"].startswith(s["status"])
                                                            else f"{s['status']} {s['note']}") for s in not_done]
                                     or ["- nothing"])
    text = "\n".join(md) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
