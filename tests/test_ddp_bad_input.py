"""The torch.distributed engine refuses what it cannot run, at construction, naming the value; and in a
one-process group it trains exactly like plain single-process training."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dynamix_hvd as dx
from workers.dataplane import IndexedData, make_model


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make(model: nn.Module | DDP, sizes=(8,), **kwargs):
    """The optimizer for a DDP model, or for a plain model's named_parameters (the flat allreduce)."""
    loader = dx.AdaptiveLoader(IndexedData(40), list(sizes), 0, seed=1)
    inner = model.module if isinstance(model, DDP) else model
    params = model if isinstance(model, DDP) else model.named_parameters()
    return dx.WeightedDistributedOptimizer(torch.optim.SGD(inner.parameters(), lr=0.1), params, loader, **kwargs), loader


def test_a_plain_module_in_place_of_its_parameters_is_refused():
    model = make_model()
    loader = dx.AdaptiveLoader(IndexedData(40), [8], 0, seed=1)
    with pytest.raises(TypeError, match="pass model.named_parameters"):
        dx.WeightedDistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, loader)


def test_gradient_as_bucket_view_is_refused():
    with pytest.raises(ValueError, match="gradient_as_bucket_view=True"):
        make(DDP(make_model(), gradient_as_bucket_view=True))


def test_a_ddp_model_with_its_own_hook_is_refused():
    model = DDP(make_model())
    model.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    with pytest.raises(ValueError, match="already has a communication hook"):
        make(model)


def test_horovod_engine_with_a_ddp_model_is_refused():
    with pytest.raises(ValueError, match="engine='horovod' with a DistributedDataParallel model"):
        make(DDP(make_model()), engine="horovod")


@pytest.mark.parametrize("engine", ["nccl", "", None, "Torch"])
def test_an_unknown_engine_is_named(engine):
    with pytest.raises(ValueError, match=f"engine={engine!r}"):
        make(make_model(), engine=engine)


def test_compression_under_torch_distributed_is_refused():
    with pytest.raises(ValueError, match="compression='fp16' under torch.distributed"):
        make(DDP(make_model()), compression="fp16")


def test_a_loader_for_another_world_size_is_refused():
    with pytest.raises(ValueError, match="loader plans 2 ranks .* but torch.distributed runs 1"):
        make(DDP(make_model()), sizes=(4, 4))


def test_parameters_not_the_ddp_models_are_refused():
    model = DDP(make_model())
    loader = dx.AdaptiveLoader(IndexedData(40), [8], 0, seed=1)
    other = make_model()
    with pytest.raises(ValueError, match="pass the DDP model itself"):
        from dynamix_hvd.engine.torchdist import DDPReducer
        DDPReducer(model, list(other.named_parameters()), owner=None)
    assert loader.world_size == 1


@pytest.mark.parametrize("wrap", ["ddp", "flat"])
def test_one_process_trains_exactly_like_plain_training(wrap):
    model = make_model()
    net = DDP(model) if wrap == "ddp" else model
    opt, loader = make(net, engine="torch")  # "auto" would pick Horovod where a test before set it up
    assert opt.engine == "torch"
    plain = make_model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for _, x, y in loader:
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
            plain_opt.zero_grad()
            nn.functional.cross_entropy(plain(x), y).backward()
            plain_opt.step()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
