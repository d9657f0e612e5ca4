"""Gradient noise scale from a real 3-rank job with unequal batches vs brute-force truth (10%)."""
from __future__ import annotations

import json

from launching import launch


def test_smoothed_estimates_within_ten_percent_of_per_sample_truth(tmp_path):
    launch("mpirun", 3, "gns_validation.py", "--out", str(tmp_path), "--sizes", "3,7,12", "--epochs", "8")
    r = json.loads((tmp_path / "gns.json").read_text())
    err_trace = abs(r["trace_est"] / r["trace_true"] - 1)
    err_g2 = abs(r["g2_est"] / r["g2_true"] - 1)
    err_noise = abs(r["b_noise_est"] / r["b_noise_true"] - 1)
    print(f"after {r['steps']:.0f} steps: tr(Sigma) error {err_trace:.1%}, |G|^2 error {err_g2:.1%}, "
          f"B_noise {r['b_noise_est']:.1f} vs true {r['b_noise_true']:.1f} ({err_noise:.1%})")
    assert err_trace < 0.10 and err_g2 < 0.10
    assert r["layer_variance"] and all(v == v for v in r["layer_variance"].values())
