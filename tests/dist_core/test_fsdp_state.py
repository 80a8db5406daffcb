"""``plait.dist_core.fsdp_state.keep_unsharded_storage`` against the installed torch, by both of its paths
(torch's ``set_keep_unsharded_storage`` where it exists, and the per-parameter fallback for older torch).

Two gloo ranks train a two-layer model whose inner layer is its own FSDP2 unit, resharded after every
forward and backward: with the storage kept, every all-gather writes the inner weight at one address and
the training equals single-process training (so each all-gather still brings the updated weights); without
it, the memory is freed at each reshard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from plait.dist_core.fsdp_state import keep_unsharded_storage, param_groups
from plait.dist_core.testing import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

_TORCH_API = "set_keep_unsharded_storage"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=gen) for _ in range(3)]


def _train(model: nn.Module, batches: list[torch.Tensor], on_forward: Any = None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x in batches:
        out = model(x)
        if on_forward is not None:
            on_forward()
        loss = out.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(keep: bool, torch_api: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,))
    model = _model()
    inner = model[0]
    fully_shard(inner, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    assert isinstance(inner, FSDPModule)
    api = getattr(FSDPModule, _TORCH_API, None)
    if keep and not torch_api and api is not None:  # the older torch's path, on this torch
        delattr(FSDPModule, _TORCH_API)
    try:
        if keep:
            keep_unsharded_storage(inner)
    finally:
        if api is not None and not hasattr(FSDPModule, _TORCH_API):
            setattr(FSDPModule, _TORCH_API, api)
    unsharded = param_groups(inner)[0].fsdp_params[0]
    addresses: list[int] = []
    left: list[int] = []

    def after_forward() -> None:
        inner.unshard()  # the forward resharded it; gather it again, as the backward will
        addresses.append(inner.weight.data_ptr())
        inner.reshard()
        left.append(unsharded._unsharded_param.untyped_storage().size())  # what the reshard left of it

    losses = _train(model, _batches(), after_forward)
    return {"losses": losses, "addresses": addresses, "left": left}


@pytest.mark.parametrize("torch_api", [True, False], ids=["torch_api", "older_torch_path"])
def test_kept_storage_keeps_one_address_and_trains_like_one_process(torch_api: bool) -> None:
    if torch_api and not hasattr(FSDPModule, _TORCH_API):
        pytest.skip(f"this torch has no FSDPModule.{_TORCH_API}; the other case covers it")
    expected = _train(_model(), _batches())
    for result in run_distributed(_worker, 2, True, torch_api):
        torch.testing.assert_close(result["losses"], expected)
        assert len(set(result["addresses"])) == 1
        assert all(size > 0 for size in result["left"])  # the reshards freed nothing


def test_without_it_each_reshard_frees_the_unsharded_memory() -> None:
    expected = _train(_model(), _batches())
    for result in run_distributed(_worker, 2, False, True):
        torch.testing.assert_close(result["losses"], expected)
        assert result["left"] == [0, 0, 0]
