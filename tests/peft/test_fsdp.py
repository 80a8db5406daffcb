"""FSDP2 (fully_shard, CPU gloo, 2 ranks): LoRA/DoRA/expert-LoRA training step, merge/unmerge and
adapter IO on sharded parameters equal a single-process run of the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from plait.peft import (
    DoRAConfig,
    FullTuneConfig,
    LoRAConfig,
    apply_peft,
    export_hf_adapter,
    grouped_mm,
    load_adapter,
    load_base_checkpoint,
    merge_peft,
    save_adapter,
    shard_expert_adapters,
    trainable_parameters,
    unmerge_peft,
)
from torch import nn

testing = pytest.importorskip("plait.dist_core.testing")


class Experts(nn.Module):
    """An expert module implementing plait.peft.ExpertAdapterHost."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 6, 7) / 3)  # [E, out, in]; E=4 shards evenly
        self.lora = nn.ModuleDict()

    @property
    def adapters(self) -> nn.ModuleDict:
        return self.lora

    def attach_adapter(self, param_name: str, adapter: nn.Module) -> None:
        self.lora[param_name] = adapter

    def detach_adapters(self) -> None:
        self.lora.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tpe = torch.tensor([2, 1, 0, x.shape[0] - 3])
        out = grouped_mm(x, self.gate_up_proj, tpe, trans_w=True)
        if "gate_up_proj" in self.lora:
            out = self.lora["gate_up_proj"](out, x, tpe)
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(7, 5)  # out=5: uneven shards over 2 ranks
        self.o_proj = nn.Linear(5, 7, bias=False)
        self.norm = nn.LayerNorm(7)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.o_proj(torch.relu(self.q_proj(x)))
        return self.norm(h + self.experts(h)[:, :7].tanh().sum(-1, keepdim=True))


CONFIGS = [
    LoRAConfig(r=3, alpha=6, target_modules=r".*q_proj", target_parameters=r".*gate_up_proj", init="random"),
    DoRAConfig(r=2, alpha=2, target_modules=r".*o_proj", init="random"),
    FullTuneConfig(target_parameters=r".*norm\.weight"),
]


def build() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    apply_peft(model, CONFIGS)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 7, generator=g), torch.randn(8, 7, generator=g)


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(list(trainable_parameters(model).values()), lr=0.5)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def merge_cycle(model: nn.Module, x: torch.Tensor) -> dict[str, object]:
    """States and outputs of a trained model, merged, then unmerged."""
    out: dict[str, object] = {"trained": full_state(model)}
    with torch.no_grad():
        out["out_trained"] = model(x)
    merge_peft(model)
    out["merged"] = full_state(model)
    with torch.no_grad():
        out["out_merged"] = model(x)
    unmerge_peft(model)
    out["unmerged"] = full_state(model)
    return out


def run_fsdp(out_dir: str) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = data()
    per = x.shape[0] // world
    # each rank its slice of the batch; FSDP averages gradients over ranks = the full-batch mean
    train_step(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
    save_adapter(model, Path(out_dir) / "adapter.safetensors")
    cycle = merge_cycle(model, x)
    # loading the saved adapter into a fresh sharded model reproduces the trained adapter
    fresh = build()
    for block in fresh:
        fully_shard(block, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    load_adapter(fresh, Path(out_dir) / "adapter.safetensors")
    reloaded = full_state(fresh)
    return {
        **cycle,
        "reloaded": reloaded,
        "local_shape": tuple(model[0].q_proj.base_layer.weight.to_local().shape),
    }


def run_fsdp_export(out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    apply_peft(model, LoRAConfig(r=2, target_modules=r"0|1", init="random"))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    export_hf_adapter(model, out_dir)


def test_fsdp2_train_merge_io_equal_single_process(tmp_path: Path) -> None:
    results = testing.run_distributed(run_fsdp, 2, str(tmp_path), timeout=120.0)
    assert results[0]["local_shape"] == (3, 7) and results[1]["local_shape"] == (2, 7)

    ref = build()
    x, y = data()
    train_step(ref, x, y)
    expect = merge_cycle(ref, x)
    trained, merged, unmerged = expect["trained"], expect["merged"], expect["unmerged"]
    out_trained, out_merged = expect["out_trained"], expect["out_merged"]

    before = full_state(build())
    moved = [k for k in trained if not torch.equal(trained[k], before[k])]
    assert any("lora_A" in k for k in moved) and any("norm.weight" in k for k in moved)
    assert any("lora_magnitude_vector" in k for k in moved) and any("experts.lora" in k for k in moved)
    for res in results:
        for name, expected in (("trained", trained), ("merged", merged), ("unmerged", unmerged)):
            got = res[name]
            assert set(got) == set(expected)
            for k in expected:
                torch.testing.assert_close(got[k], expected[k], atol=1e-5, rtol=1e-5, msg=f"{name}: {k}")
        for k in trainable_parameters(ref):  # save -> load on sharded models is bit-exact
            torch.testing.assert_close(res["reloaded"][k], res["trained"][k], atol=0, rtol=0)
        torch.testing.assert_close(res["out_trained"], out_trained, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res["out_merged"], out_merged, atol=1e-5, rtol=1e-5)
    # the merge really changed the sharded base weights
    assert not torch.allclose(merged["0.q_proj.base_layer.weight"], unmerged["0.q_proj.base_layer.weight"])
    assert not torch.allclose(merged["1.experts.gate_up_proj"], unmerged["1.experts.gate_up_proj"])


def test_fsdp2_hf_export_matches_single_process(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    testing.run_distributed(run_fsdp_export, 2, str(tmp_path / "dist"), timeout=60.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    apply_peft(model, LoRAConfig(r=2, target_modules=r"0|1", init="random"))
    export_hf_adapter(model, tmp_path / "single")
    got = load_file(tmp_path / "dist" / "adapter_model.safetensors")
    expected = load_file(tmp_path / "single" / "adapter_model.safetensors")
    assert (
        set(got) == set(expected) == {f"base_model.model.{i}.lora_{ab}.weight" for i in "01" for ab in "AB"}
    )
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def meta_injected_then_loaded(ckpt: str, shard: bool) -> dict[str, torch.Tensor]:
    """Meta-device model -> apply_peft -> (fully_shard) -> load_base_checkpoint (re-inits adapters)."""
    with torch.device("meta"):
        model = nn.Sequential(Block(), Block())
    apply_peft(
        model, [c.model_copy(update={"init": "kaiming"}) if c.method != "full" else c for c in CONFIGS]
    )
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    torch.manual_seed(5)
    load_base_checkpoint(model, ckpt)
    return full_state(model)


def test_fsdp2_meta_init_and_base_checkpoint_equal_single_process(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block())
    ckpt = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, ckpt)
    expected = meta_injected_then_loaded(ckpt, shard=False)
    assert torch.equal(expected["0.q_proj.base_layer.weight"], base[0].q_proj.weight)
    assert torch.equal(expected["1.experts.gate_up_proj"], base[1].experts.gate_up_proj)
    assert expected["0.q_proj.lora_A.weight"].abs().sum() > 0
    torch.testing.assert_close(expected["1.o_proj.lora_magnitude_vector"], base[1].o_proj.weight.norm(dim=1))
    for got in testing.run_distributed(meta_injected_then_loaded, 2, ckpt, True, timeout=120.0):
        assert set(got) == set(expected)
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], atol=1e-6, rtol=1e-6, msg=k)


EP_TPE = ([2, 4, 0, 0], [0, 0, 3, 3])  # rank r owns experts 2r, 2r+1


def ep_experts() -> Experts:
    torch.manual_seed(0)
    ex = Experts()
    apply_peft(ex, LoRAConfig(r=2, alpha=3, target_parameters="gate_up_proj", init="random"))
    return ex


def run_expert_parallel() -> dict[str, torch.Tensor]:
    """Expert weights Shard(0) over 2 ranks (as plait.moe's expert_parallel does); adapters follow."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ex = ep_experts()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ex.gate_up_proj = nn.Parameter(
        distribute_tensor(ex.gate_up_proj.detach(), mesh, [Shard(0)]), requires_grad=False
    )
    assert shard_expert_adapters(ex) == 1
    rank = dist.get_rank()
    tpe = torch.tensor(EP_TPE[rank][2 * rank : 2 * rank + 2])
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(3))
    adapter = ex.lora["gate_up_proj"]
    out = adapter(grouped_mm(x, ex.gate_up_proj.to_local(), tpe, trans_w=True), x, tpe)
    out.square().sum().backward()
    result = {
        "out": out.detach(),
        "grad_A": adapter.lora_A.grad.full_tensor(),
        "grad_B": adapter.lora_B.grad.full_tensor(),
    }
    merge_peft(ex)
    result["merged"] = ex.gate_up_proj.full_tensor()
    return result


def test_expert_parallel_adapters_equal_single_process() -> None:
    results = testing.run_distributed(run_expert_parallel, 2, timeout=60.0)
    ex = ep_experts()
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(3))
    adapter = ex.lora["gate_up_proj"]
    outs = []
    for counts in EP_TPE:
        tpe = torch.tensor(counts)
        outs.append(adapter(grouped_mm(x, ex.gate_up_proj, tpe, trans_w=True), x, tpe))
    sum(o.square().sum() for o in outs).backward()
    merge_peft(ex)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["out"], outs[rank].detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(res["grad_A"], adapter.lora_A.grad, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(res["grad_B"], adapter.lora_B.grad, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(res["merged"], ex.gate_up_proj.detach(), atol=1e-6, rtol=1e-6)
