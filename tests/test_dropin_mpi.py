"""The weighted optimizer as a drop-in for real training scripts, under `mpirun -np 2`.

One job (tests/workers/dropin.py) runs every LR scheduler with an LR rule and changing batch sizes,
Horovod's mixed-precision pattern (float64 under a GradScaler with an injected inf step, fp16
autocast with a scaler, bf16 autocast) and gradient accumulation; this process replays the steps as
single-process full-batch training (float64) where exactness applies.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dynamix_hvd.optim.lr_scaling import LRCoupling
from launching import launch
from workers.dataplane import IndexedData, make_model
from workers.dropin import B0, INF_STEP, SAMPLES, SCHEDULERS

RANKS = 2
TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropin")
    launch("mpirun", RANKS, "dropin.py", "--out", str(out), timeout=600)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(RANKS)]


def replay(opt_factory, batches, lrs=None, max_grad_norm=None, skip=(), momenta=None, samples=SAMPLES):
    """Full-batch single-process training over `batches` (lists of sample indices of `samples`)."""
    data = IndexedData(samples)
    model = make_model()
    opt = opt_factory(model.parameters())
    for step, idx in enumerate(batches):
        opt.zero_grad()
        idx = torch.tensor(idx)
        nn.functional.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
        if step in skip:
            continue
        if max_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        for g in opt.param_groups:
            if lrs is not None:
                g["lr"] = lrs[step]
            if momenta is not None:
                g["momentum"] = momenta[step]
        opt.step()
    return model


def assert_params(model, params, tol=TOLERANCE):
    for name, p in model.named_parameters():
        got = torch.tensor(params[name], dtype=torch.float64)
        err = (got - p.detach().flatten()).abs().max().item()
        assert err <= tol, f"{name}: max deviation {err:.3g} from the single-process reference"


def union(per_rank_steps):
    return [[i for s in per_rank for i in s["indices"]] for per_rank in zip(*per_rank_steps)]


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


# --- LR schedulers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*SCHEDULERS, "steplr_adascale"])
def test_scheduler_and_lr_rule_compose_without_compounding(results, name):
    runs = [r["schedulers"][name] for r in results]
    steps = runs[0]["steps"]
    assert len({tuple(s["sizes"]) for s in steps}) > 1, "the global batch never changed"
    coupling = LRCoupling()  # the optimizer's default warm-up after B grows (8 -> 11 at step 3)
    ramped = 0
    for s in steps:
        B = sum(s["sizes"])
        factor = s["gain"] if name.endswith("adascale") else math.sqrt(B / B0)
        applied = coupling.plan("adascale" if name.endswith("adascale") else "sqrt", B, B0, s["gain"],
                                math.ceil(SAMPLES / B))
        coupling.commit()
        ramped += applied != factor
        assert applied <= factor
        assert s["effective_lr"] == s["base_lr"] * applied, s   # exactly: scheduler LR x ramped rule factor
        assert s["after_lr"] == s["base_lr"], "the rule's factor leaked into group['lr']"
    assert ramped == (0 if name.endswith("adascale") else 1), "the warm-up after B grew is missing"
    base = [s["base_lr"] for s in steps]
    assert len(set(base)) > 1, f"{name} never changed the learning rate"
    if name in SCHEDULERS and name != "plateau":  # the schedule is the one a plain optimizer gets
        plain = torch.optim.SGD(make_model().parameters(), lr=0.1, momentum=0.9)
        sched = SCHEDULERS[name](plain, runs[0]["total"])
        want = []
        for _ in steps:
            want.append(plain.param_groups[0]["lr"])
            plain.step()
            sched.step()
        assert base == want
    model = replay(sgd, union([r["steps"] for r in runs]), lrs=[s["effective_lr"] for s in steps],
                   momenta=[s["momentum"] for s in steps])
    for run in runs:
        assert_params(model, run["params"])


def test_state_dict_and_broadcast_optimizer_state(results):
    states = [r["state"] for r in results]
    for s in states:
        assert s["is_optimizer"] and s["class"] == "WeightedDistributedAdam"
        assert s["initialised"] == 4, "broadcast_optimizer_state did not create the Adam state"
        assert s["roundtrip_same"]
        assert len(s["refused"]) == 2 and all("pass the plain torch optimizer" in m for m in s["refused"])
    assert states[0]["exp_avg"] == states[1]["exp_avg"], "rank 1 kept its own optimizer state"


# --- mixed precision --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fp64_plain", "fp64_scaler", "fp64_scaler_ready"])
def test_scaled_float64_matches_the_unscaled_single_process_run(results, mode):
    runs = [r["amp"][mode] for r in results]
    steps = runs[0]["steps"]
    assert [s["status"] for s in steps].count("nonfinite") == 1 and steps[INF_STEP]["status"] == "nonfinite"
    for run in runs:
        assert run["skipped"] == {"nonfinite": 1, "oom": 0}
        assert [s["status"] for s in run["steps"]] == [s["status"] for s in steps]
    if mode != "fp64_plain":
        scales = [s["scale"] for s in steps]
        assert scales[INF_STEP + 1] == scales[INF_STEP] / 2, "the scaler did not back off after the inf step"
        assert max(scales) > 2.0**12, "the scale never grew"
    model = replay(sgd, union([r["steps"] for r in runs]), max_grad_norm=0.5, skip={INF_STEP})
    for run in runs:
        assert_params(model, run["params"])


@pytest.mark.parametrize("mode", ["fp64_scaler", "fp64_scaler_ready"])
def test_gradient_statistics_are_of_unscaled_gradients(results, mode):
    for r in results:
        plain, scaled = r["amp"]["fp64_plain"]["steps"], r["amp"][mode]["steps"]
        for i, (a, b) in enumerate(zip(plain, scaled)):
            if i == INF_STEP:
                continue
            for key in ("global_grad_sq", "local_grad_sq"):
                assert b[key] == pytest.approx(a[key], rel=1e-9), (i, key, a[key], b[key])


@pytest.mark.parametrize("mode", ["fp16_scaler", "bf16"])
def test_low_precision_autocast_trains_identically_on_every_rank(results, mode):
    runs = [r["amp"][mode] for r in results]
    assert runs[0]["params"] == runs[1]["params"], "ranks diverged"
    statuses = [[s["status"] for s in run["steps"]] for run in runs]
    assert statuses[0] == statuses[1]
    want_skips = 0 if mode == "bf16" else 1
    assert statuses[0][INF_STEP] == ("ok" if mode == "bf16" else "nonfinite")
    assert statuses[0].count("nonfinite") >= want_skips
    assert all(math.isfinite(v) for vs in runs[0]["params"].values() for v in vs)
    # close to the float64 run (low precision: loose), and it did learn something
    ref = replay(sgd, union([run["steps"] for run in runs]), skip={INF_STEP} if want_skips else set())
    start = make_model()
    for name, p in ref.named_parameters():
        got = torch.tensor(runs[0]["params"][name], dtype=torch.float64)
        moved = (p.detach().flatten() - dict(start.named_parameters())[name].detach().flatten()).abs().max()
        assert (got - p.detach().flatten()).abs().max() <= 0.1 * moved + 1e-3, name


# --- gradient accumulation ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["sgd_k3", "adam_k2", "sgd_k1"])
def test_accumulation_is_the_exact_mean_over_all_micro_batches(results, case):
    runs = [r["accum"][case] for r in results]
    k = int(case.split("_k")[1])
    groups = runs[0]["groups"]
    assert all(len(g["micro"]) <= k for g in groups) and any(len(g["micro"]) == k for g in groups)
    if k > 1:
        assert any(len(g["micro"]) < k for g in groups), "no partial group at an epoch's end"
    for rank, run in enumerate(runs):
        for g in run["groups"]:
            assert g["local_batch"] == sum(m["counts"][rank] for m in g["micro"])
            assert g["global_batch"] == sum(sum(m["counts"]) for m in g["micro"])
    batches = [[i for run in runs for m in run["groups"][j]["micro"] for i in m["indices"]]
               for j in range(len(groups))]
    make = sgd if case.startswith("sgd") else (lambda ps: torch.optim.Adam(ps, lr=1e-2))
    model = replay(make, batches, max_grad_norm=1.0)
    for run in runs:
        assert_params(model, run["params"])


def test_adam_noise_statistics_are_of_the_preconditioned_gradient(results):
    """Each step's recorded local and global squared norms are those of this rank's local mean gradient
    and of the global mean gradient times the weights of the step AdamW (amsgrad) took,
    ``1 / (sqrt(max v_hat) + eps)``, its second moments including that step's gradient."""
    for r in results:
        run = r["adam_noise"]
        assert run["mode"] == "adam"
        steps = run["steps"]
        assert len(steps) > 10
        for k, s in enumerate(steps):
            assert s["weights_vs_adam"] < 1e-5, (k, s["weights_vs_adam"])
            assert s["local_grad_sq"] == pytest.approx(s["local_expected"], rel=1e-5), k
            assert s["global_grad_sq"] == pytest.approx(s["global_expected"], rel=1e-5), k
            # Adam scales each coordinate to about 1 / sqrt(its recent squared gradients)
            assert s["global_grad_sq"] > 10 * s["raw_global_sq"], k
    assert results[0]["adam_noise"]["steps"][3]["global_grad_sq"] == pytest.approx(
        results[1]["adam_noise"]["steps"][3]["global_grad_sq"], rel=1e-12)
