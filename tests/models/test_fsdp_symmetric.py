"""FSDP2's all-gathers into NCCL symmetric memory (``ParallelConfig.fsdp_symmetric_memory``,
``plait.dist_core.fsdp_symmetric``).

On NCCL (two GPUs): the same seeded model, FSDP2 over both ranks, gives the same loss and the same reduced
gradients with the symmetric all-gather as with FSDP2's own, every unit gathers into symmetric memory when
asked, and the default turns it on exactly where this machine supports it; after the process groups were
destroyed and made again, it is refused. On gloo: asking for it is refused naming the key and why; the default
leaves FSDP2's own all-gather; a second process group, or one made again, is refused once a group gathered
into symmetric memory; with the group made to look capable, the default is off under CUDA graphs and over
several nodes, and asking for it with graphs is refused.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from plait.dist_core import fsdp_symmetric
from plait.dist_core.fsdp_state import param_groups
from plait.dist_core.fsdp_symmetric import SymmetricAllGather, symmetric_memory_unavailable
from plait.dist_core.testing import run_distributed
from plait.models import ParallelConfig, parallelize
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.models.test_parallel import DENSE, EXPERT, _batch, _model


def _build(setting: bool | None, device: str):
    with torch.device("meta"):
        model = _model("qwen3_moe", False)
    dense = init_device_mesh(device, (1, 1, 2, 1, 1), mesh_dim_names=DENSE)
    experts = init_device_mesh(device, (1, 2, 1), mesh_dim_names=EXPERT)
    parallelize(
        model, dense_mesh=dense, expert_mesh=experts, config=ParallelConfig(fsdp_symmetric_memory=setting)
    )
    return model


def _symmetric_units(model) -> list[bool]:
    """Per FSDP2 parameter group of the model: whether it gathers into symmetric memory."""
    groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in param_groups(m)]
    return [isinstance(g._all_gather_comm, SymmetricAllGather) for g in dict.fromkeys(groups)]


def _loss_and_grads(setting: bool | None) -> dict:
    model = _build(setting, "cuda")
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    model.reset_parameters()  # DTensor init: the same full tensors whichever all-gather runs
    ids, labels = _batch()
    rank = dist.get_rank()
    out = model(input_ids=ids[rank * 2 : rank * 2 + 2].cuda(), labels=labels[rank * 2 : rank * 2 + 2].cuda())
    out["loss_sum"].backward()
    loss = out["loss_sum"].detach().clone()
    dist.all_reduce(loss)
    grads = {
        n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for n, p in model.named_parameters()
    }
    return {"loss": loss.item(), "grads": grads, "symmetric": _symmetric_units(model)}


def _nccl_rank(last: bool | None) -> dict:
    """The default decided first (a model built, nothing gathered), FSDP2's own trained, then a third model:
    ``last=True`` trains it with the symmetric all-gather (the error's text where that is refused), None
    builds it with the default (its units)."""
    out = {
        "default": _symmetric_units(_build(None, "cuda")),
        "available": symmetric_memory_unavailable(dist.group.WORLD) is None,  # type: ignore[arg-type]
        "off": _loss_and_grads(False),
    }
    if last is None:
        out["last"] = _symmetric_units(_build(None, "cuda"))
    else:
        try:
            out["last"] = _loss_and_grads(True)
        except ValueError as e:
            out["last"] = str(e)
    return out


@pytest.mark.multigpu
def test_symmetric_all_gather_gives_fsdp2s_own_loss_and_gradients_on_nccl() -> None:
    """Then twice more in the same rank processes, whose process groups were destroyed and made again: there
    the default is off and asking for it is refused (``fsdp_symmetric._other_group``: torch would gather
    through the first groups' registrations, which it keeps under names the new groups get back)."""
    first, default_again, asked_again = (
        run_distributed(_nccl_rank, 2, last, backend="nccl", timeout=300.0) for last in (True, None, True)
    )
    for r, r2, r3 in zip(first, default_again, asked_again, strict=True):
        assert r["available"], "NCCL symmetric memory should be available on this machine"
        assert r["off"]["symmetric"] and not any(r["off"]["symmetric"])
        assert r["last"]["symmetric"] and all(r["last"]["symmetric"])
        assert r["default"] == r["last"]["symmetric"]
        assert r["last"]["loss"] == pytest.approx(r["off"]["loss"], rel=1e-6)
        for name, want in r["off"]["grads"].items():
            torch.testing.assert_close(r["last"]["grads"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        assert r2["last"] and not any(r2["last"])
        assert "parallel.fsdp_symmetric_memory = true" in r3["last"] and "another process group" in r3["last"]
        assert r2["off"]["loss"] == r3["off"]["loss"] == r["off"]["loss"]


def _first() -> list[str | None]:
    """A 2-rank gloo group taken as the one :class:`SymmetricAllGather` notes at its first gather; then that
    group and another group of the same ranks, made after it."""
    group = init_device_mesh("cpu", (2,)).get_group()
    fsdp_symmetric._GATHERING.append((group, group.group_name))
    return [fsdp_symmetric._other_group(g) for g in (group, dist.new_group([0, 1]))]


def _made_again() -> str | None:
    return fsdp_symmetric._other_group(init_device_mesh("cpu", (2,)).get_group())


def _forget() -> None:
    fsdp_symmetric._GATHERING.clear()  # the pool's processes serve later tests


def test_one_group_per_process_gathers_into_symmetric_memory() -> None:
    try:
        for same, other in run_distributed(_first, 2):
            assert same is None  # the group itself gathers on
            assert other is not None and "another process group" in other, other
        for why in run_distributed(_made_again, 2):  # the groups destroyed and made again (the same names)
            assert why is not None and "another process group" in why, why
    finally:
        run_distributed(_forget, 2)


def _decisions() -> list[object]:
    """``plan._symmetric`` on a 2-rank gloo mesh, the group made to look capable: the default follows
    ``cuda_graphs`` and stays off over several nodes; asking for it with graphs is refused naming both keys."""
    from plait.models.common.parallel import plan

    mesh = init_device_mesh("cpu", (2,))
    real, local = plan.symmetric_memory_unavailable, os.environ["LOCAL_WORLD_SIZE"]
    plan.symmetric_memory_unavailable = lambda group: None  # type: ignore[assignment]  # the pool's processes live on
    try:
        out: list[object] = [plan._symmetric(None, mesh, False), plan._symmetric(None, mesh, True)]
        out.append(plan._symmetric(False, mesh, False))
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # two nodes of one rank each: off by default, on when asked
        out += [plan._symmetric(None, mesh, False), plan._symmetric(True, mesh, False)]
        try:
            plan._symmetric(True, mesh, True)
        except ValueError as e:
            out.append(str(e))
    finally:
        plan.symmetric_memory_unavailable = real
        os.environ["LOCAL_WORLD_SIZE"] = local
    return out


def test_default_follows_cuda_graphs_and_nodes_and_true_with_graphs_is_refused() -> None:
    for on, with_graphs, off, nodes, nodes_asked, msg in run_distributed(_decisions, 2):
        assert (on, with_graphs, off, nodes, nodes_asked) == (True, False, False, False, True)
        assert "parallel.fsdp_symmetric_memory = true" in msg and "parallel.cuda_graphs" in msg, msg


def _gloo_rank(setting: bool | None) -> str:
    try:
        model = _build(setting, "cpu")
    except ValueError as e:
        return str(e)
    return "on" if any(_symmetric_units(model)) else "off"


def test_on_gloo_it_is_refused_when_asked_and_off_by_default() -> None:
    asked, default = (run_distributed(_gloo_rank, 2, s) for s in (True, None))
    for msg in asked:
        assert "parallel.fsdp_symmetric_memory = true" in msg and "gloo" in msg, msg
    assert default == ["off", "off"]
