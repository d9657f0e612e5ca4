"""Fit the cluster simulator to a real run's per-step log. Pure NumPy/pandas: no MPI, no Horovod.

Input: the per-step records every rank writes (:class:`~dynamix_hvd.data.metrics.StepRecord` columns, e.g.
``steps_rank*.csv`` of the example jobs) and, optionally, rank 0's ``decisions.csv`` (loss, decision
interval). Output: a :class:`~bench.lab.simulator.ClusterSpec` plus the fit error.

Throughput model (the simulator's): rank i arrives at the allreduce after ``data_i + alpha_i + beta_i b_i``;
the step ends ``(max_i arrival_i ** gamma + net ** gamma) ** (1 / gamma) + optimizer`` after it started.
``alpha_i, beta_i`` come from a least-absolute-deviation line of each rank's ``compute_s`` against its
local batch; data and optimizer times are medians; ``net`` and ``gamma`` are
chosen on a grid to minimise the mean absolute percentage error (MAPE) of the predicted step time.
The fit uses the first ``1 - holdout`` of the steps (in time order); the error is reported on the rest
(held back), per step and per window of ``window`` steps (what a decision interval averages).

Noise-scale trajectory: per window of steps, the pooled unbiased estimates of tr(Sigma) and |G|^2
(:func:`noise_scale.pooled_estimate`, from ``local_grad_sq``/``global_grad_sq``) are averaged and
divided; ``log phi`` and ``log |G|^2`` are fitted linearly against the fraction of samples processed.

``python -m bench.lab.calibrate RUN_DIR --out calibration.json`` (the JSON feeds
``python -m bench.lab.pretrain --calibration``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from dynamix_hvd.stats.noise_scale import pooled_estimate
from .simulator import ClusterSpec

GAMMAS = (1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)


@dataclass
class ThroughputFit:
    """Fitted step-time model (seconds); per-rank lists have one entry per rank."""

    alpha_s: list[float]
    beta_s: list[float]
    data_s: list[float]
    optimizer_s: float
    net_s: float
    gamma: float
    jitter: float = 0.0
    """Log-normal sigma of compute time around the fitted line."""

    def predict(self, batches: np.ndarray) -> np.ndarray:
        """Step time for per-step local batches ``[S, R]``."""
        b = np.asarray(batches, dtype=np.float64)
        arrival = np.asarray(self.data_s) + np.asarray(self.alpha_s) + np.asarray(self.beta_s) * b
        g = self.gamma
        return (arrival.max(axis=-1) ** g + self.net_s ** g) ** (1 / g) + self.optimizer_s


@dataclass
class CalibrationResult:
    spec: ClusterSpec
    throughput: ThroughputFit
    statistics: dict[str, Any]
    fit: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec.to_dict(), "throughput": asdict(self.throughput), "statistics": self.statistics,
                "fit": self.fit}

    def save(self, path: str | Path, source: Optional[dict[str, Any]] = None) -> Path:
        """Write the JSON (``source``: where the log came from, kept as provenance)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**self.to_dict(), **({"source": source} if source else {})}, indent=2) + "\n")
        return path


def run_source(run_dir: str | Path) -> dict[str, Any]:
    """Provenance of a run directory: its path, and what its meta.json and command.txt say."""
    run_dir = Path(run_dir)
    out: dict[str, Any] = {"run_dir": os.path.relpath(run_dir)}
    meta = run_dir / "meta.json"
    if meta.is_file():
        m = json.loads(meta.read_text())
        out.update({k: m[k] for k in ("created", "example", "batch_sizes", "policy", "lr_rule", "epochs", "slow_rank",
                                      "dynamix_hvd", "torch", "horovod") if k in m})
    cmd = run_dir / "command.txt"
    if cmd.is_file():
        out["command"] = cmd.read_text().strip()
        module = re.search(r"-m (?:bench\.jobs|dynamix_hvd\.examples)\.(\w+)", out["command"])
        if module and "example" not in out:
            out["example"] = module.group(1)
    return out


def load_run(run_dir: str | Path) -> tuple[pd.DataFrame, Optional[pd.DataFrame]]:
    """``(steps of all ranks, decisions or None)`` from a run directory with ``steps_rank*.csv``."""
    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("steps_rank*.csv"))
    if not files:
        raise FileNotFoundError(f"no steps_rank*.csv in {run_dir}")
    steps = pd.concat([pd.read_csv(f) for f in files], ignore_index=True)
    dec = run_dir / "decisions.csv"
    return steps, (pd.read_csv(dec) if dec.exists() else None)


def step_table(df: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per-step arrays in time order: ``batches``, ``compute``, ``data``, ``optimizer`` ``[S, R]``,
    ``step`` ``[S]`` (mean over ranks), ``local_sq [S, R]``, ``global_sq [S]``. Steps that some rank
    did not log, or that failed (``status`` other than ok), are dropped."""
    if "status" in df.columns:
        df = df[df.status.fillna("ok") == "ok"]
    R = int(df["rank"].max()) + 1
    counts = df.groupby(["epoch", "step"])["rank"].nunique()
    complete = counts[counts == R].index
    df = df.set_index(["epoch", "step"]).loc[complete].reset_index().sort_values(["epoch", "step", "rank"])

    def piv(col: str) -> np.ndarray:
        return df.pivot_table(index=["epoch", "step"], columns="rank", values=col, aggfunc="first").to_numpy()

    out = {"batches": piv("local_batch"), "compute": piv("compute_s"), "data": piv("data_wait_s"),
           "optimizer": piv("optimizer_s"), "step_rank": piv("step_s")}
    out["step"] = out["step_rank"].mean(axis=1)
    for col in ("local_grad_sq", "global_grad_sq"):
        out[col] = piv(col) if col in df.columns else np.full_like(out["compute"], np.nan)
    return out


def _robust_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """``(intercept >= 0, slope > 0, robust log-residual sigma)`` of a least-absolute-deviation line
    y ~ a + b x (iteratively reweighted least squares): per-step timings on a shared machine have a
    heavy right tail (descheduling), which a median line ignores and a least-squares line does not."""
    keep = np.isfinite(x) & np.isfinite(y) & (y > 0) & (x > 0)
    x, y = x[keep].astype(np.float64), y[keep].astype(np.float64)
    if np.unique(x).size < 2:  # one batch size: no slope information, assume proportional cost
        a, b = 0.0, float(np.median(y / x))
    else:
        w = np.ones_like(y)
        a, b = 0.0, 0.0
        for _ in range(50):
            sw = np.sqrt(w)
            b, a = np.linalg.lstsq(np.stack([x * sw, sw], 1), y * sw, rcond=None)[0]
            w = 1.0 / np.maximum(np.abs(y - a - b * x), 1e-3 * float(np.median(y)))
        if b <= 0:  # no measurable per-sample cost: keep a tiny slope so the model stays increasing
            a, b = float(np.median(y)), 1e-3 * float(np.median(y)) / float(np.median(x))
        if a < 0:
            a, b = 0.0, float(np.median(y / x))
    lr = np.log(y / np.maximum(a + b * x, 1e-12))
    sigma = float(1.4826 * np.median(np.abs(lr - np.median(lr)))) if len(y) > 1 else 0.0
    return float(a), float(b), sigma


def mape(pred: np.ndarray, actual: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    ok = np.isfinite(pred) & np.isfinite(actual) & (actual > 0)
    return float(100 * np.mean(np.abs(pred[ok] - actual[ok]) / actual[ok]))


def window_means(x: np.ndarray, window: int) -> np.ndarray:
    """Means over consecutive windows of ``window`` steps (a partial last window is dropped)."""
    n = len(x) // window
    return np.asarray(x[: n * window]).reshape(n, window).mean(axis=1) if n else np.asarray(x).mean(keepdims=True)


def fit_throughput(t: dict[str, np.ndarray]) -> ThroughputFit:
    """Fit the step-time model to a :func:`step_table` (see the module docstring)."""
    b, comp = t["batches"], t["compute"]
    R = b.shape[1]
    lines = [_robust_line(b[:, r], comp[:, r]) for r in range(R)]
    data = [float(np.nanmedian(t["data"][:, r])) for r in range(R)]
    opt = float(np.nanmedian(t["optimizer"]))
    fit = ThroughputFit([a for a, _, _ in lines], [bb for _, bb, _ in lines], data, opt, 0.0, 1.0,
                        float(np.median([s for _, _, s in lines])))
    arrival_max = fit.predict(b) - opt
    resid = np.maximum(t["step"] - opt - arrival_max, 0.0)
    candidates = np.unique(np.quantile(resid, np.linspace(0.0, 0.95, 39)))
    best = (math.inf, 0.0, 1.0)
    for g in GAMMAS:
        for net in candidates:
            fit.net_s, fit.gamma = float(net), g
            err = mape(fit.predict(b), t["step"])
            if err < best[0]:
                best = (err, float(net), g)
    fit.net_s, fit.gamma = best[1], best[2]
    return fit


def fit_statistics(t: dict[str, np.ndarray], windows: int = 8) -> dict[str, Any]:
    """Noise-scale and |G|^2 trajectories against the fraction of samples processed."""
    b, ls, gs = t["batches"].astype(np.int64), t["local_grad_sq"], t["global_grad_sq"][:, 0]
    B = b.sum(axis=1)
    frac = (np.cumsum(B) - B / 2) / B.sum()
    edges = np.linspace(0, len(B), windows + 1).astype(int)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        tr, g2, n = 0.0, 0.0, 0
        for s in range(lo, hi):
            if not (np.isfinite(ls[s]).all() and np.isfinite(gs[s])):
                continue
            est = pooled_estimate(b[s], ls[s], gs[s])
            if est is not None:
                tr, g2, n = tr + float(est.trace_sigma), g2 + float(est.grad_sq), n + 1
        if n and tr > 0 and g2 > 0:
            rows.append({"fraction": float(frac[lo:hi].mean()), "phi": tr / g2, "grad_sq": g2 / n, "steps": n})
    out: dict[str, Any] = {"windows": rows}
    if len(rows) >= 2:
        x = np.array([r["fraction"] for r in rows])
        for key, name in (("phi", "phi"), ("grad_sq", "grad_sq")):
            slope, icpt = np.polyfit(x, np.log([r[key] for r in rows]), 1)
            out[f"{name}_start"], out[f"{name}_end"] = float(np.exp(icpt)), float(np.exp(icpt + slope))
    elif rows:
        out.update(phi_start=rows[0]["phi"], phi_end=rows[0]["phi"], grad_sq_start=rows[0]["grad_sq"],
                   grad_sq_end=rows[0]["grad_sq"])
    return out


def calibrate(steps: pd.DataFrame, decisions: Optional[pd.DataFrame] = None, holdout: float = 0.25,
              window: int = 20, name: str = "calibrated") -> CalibrationResult:
    """Fit throughput on the first ``1 - holdout`` of the steps, report errors on the rest, fit the
    statistics on all of them, and return a simulator spec of the logged job."""
    if not 0 <= holdout < 1:
        raise ValueError(f"holdout={holdout} must be in [0, 1)")
    t = step_table(steps)
    S, R = t["batches"].shape
    n_train = max(2, int(round(S * (1 - holdout))))
    train = {k: v[:n_train] for k, v in t.items()}
    test = {k: v[n_train:] for k, v in t.items()}
    tp = fit_throughput(train)
    fit = {"steps": float(S), "train_steps": float(n_train), "holdout_steps": float(S - n_train),
           "train_mape_pct": mape(tp.predict(train["batches"]), train["step"])}
    if S - n_train > 0:
        pred = tp.predict(test["batches"])
        fit.update(holdout_mape_pct=mape(pred, test["step"]),
                   holdout_median_ape_pct=float(100 * np.nanmedian(np.abs(pred - test["step"]) / test["step"])),
                   holdout_window_mape_pct=mape(window_means(pred, window), window_means(test["step"], window)),
                   holdout_batch_range=float(np.ptp(test["batches"].sum(1))))
    stats = fit_statistics(t)
    init = [int(x) for x in t["batches"][0]]
    B = t["batches"].sum(axis=1).astype(float)
    phi0, phi1 = stats.get("phi_start", 1e3), stats.get("phi_end", 1e3)
    frac = np.cumsum(B) / B.sum()
    phi_t = phi0 * (phi1 / phi0) ** frac
    ref = float(sum(init))
    target = float(np.sum(B * (phi_t + ref) / (phi_t + B)))
    epochs = sorted(steps.epoch.unique())
    first = steps[(steps.epoch == epochs[0]) & (steps["rank"] == 0)]
    dataset = int(first.global_batch.sum())
    k = window
    loss0, loss1 = 2.3, 0.3
    if decisions is not None and "loss" in decisions and decisions.loss.notna().sum() >= 2:
        losses = decisions.loss.dropna().to_numpy()
        loss0, loss1 = float(losses[0]), float(min(losses[-max(1, len(losses) // 5):].mean(), losses[0]))
        k = max(1, int(round(S / max(len(decisions), 1))))
    gpu = bool("memory_kind" in steps and (steps.memory_kind == "cuda").any())
    R_net = max(R, 2)
    spec = ClusterSpec(
        alpha_s=tp.alpha_s, beta_s=[max(x, 1e-9) for x in tp.beta_s], initial_batch=init, gpu=gpu,
        mem_base_bytes=[1e9] * R, mem_per_sample_bytes=[1e6] * R, mem_total_bytes=[1e9 + 1e6 * 4096] * R,
        net_latency_s=0.0, bandwidth_Bps=1e9, model_bytes=tp.net_s * 1e9 * R_net / (2 * (R_net - 1)),
        gamma=tp.gamma, data_s=float(np.mean(tp.data_s)), optimizer_s=tp.optimizer_s, jitter=min(tp.jitter, 0.5),
        phi_start=phi0, phi_end=phi1, grad_sq_start=stats.get("grad_sq_start", 1.0),
        grad_sq_end=stats.get("grad_sq_end", 0.1), loss_start=loss0, loss_end=loss1 * 0.9,
        target_progress=target, dataset_size=max(dataset, 1), total_epochs=len(epochs), steps_per_decision=k,
        max_batch=1024, name=name)
    return CalibrationResult(spec, tp, stats, fit)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.lab.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="directory with steps_rank*.csv (and optionally decisions.csv)")
    ap.add_argument("--out", default="", help="write the calibration JSON here")
    ap.add_argument("--holdout", type=float, default=0.25, help="fraction of steps (the last ones) held back")
    ap.add_argument("--window", type=int, default=20, help="steps per window for the windowed error")
    ap.add_argument("--name", default="", help="the spec's name (default: the run directory's name)")
    args = ap.parse_args(argv)
    steps, decisions = load_run(args.run_dir)
    res = calibrate(steps, decisions, args.holdout, args.window, name=args.name or Path(args.run_dir).name)
    tp = res.throughput
    print(f"ranks {len(tp.alpha_s)}: alpha (ms) {[round(a * 1e3, 3) for a in tp.alpha_s]}, "
          f"beta (us/sample) {[round(b * 1e6, 2) for b in tp.beta_s]}, net {tp.net_s * 1e3:.3f} ms, gamma {tp.gamma}")
    print("fit: " + ", ".join(f"{k} {v:.3g}" for k, v in res.fit.items()))
    print(f"noise scale {res.spec.phi_start:.1f} -> {res.spec.phi_end:.1f}")
    if args.out:
        print(f"wrote {res.save(args.out, source=run_source(args.run_dir))}")


if __name__ == "__main__":
    main()
