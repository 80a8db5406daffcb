"""Every mapper against hand-written torch references, and its inverse round trip."""

from __future__ import annotations

import pytest
import torch
from plait.model_state import (
    AddPrefix,
    Cast,
    Chunk,
    Concatenate,
    Deinterleave,
    Drop,
    Identity,
    Interleave,
    KeyTemplate,
    MapperError,
    MapperGroup,
    Parallel,
    RankShard,
    Rename,
    Reshape,
    Scoped,
    Select,
    Sequential,
    Stack,
    TensorSpec,
    Transpose,
    Unstack,
)


def _rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def _round_trip(mapper, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = mapper.map_state(state)
    _same(mapper.inverse().map_state(out), state)
    return out


@pytest.fixture
def moe_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    s = {f"model.layers.{i}.mlp.experts.{e}.up.weight": _rand(3, 4) for i in range(2) for e in range(3)}
    s.update(
        {f"model.layers.{i}.attn.{p}.weight": _rand(2 if p == "q" else 1, 4) for i in range(2) for p in "qkv"}
    )
    s["model.norm.weight"] = _rand(4)
    s["lm_head.weight"] = _rand(5, 4)
    return s


def test_templates() -> None:
    t = KeyTemplate("model.layers.{i}.{*rest}")
    assert t.match("model.layers.3.mlp.up.weight") == {"i": "3", "rest": "mlp.up.weight"}
    assert t.match("model.layers.3") is None
    assert KeyTemplate("a.{x}.b").match("a.1.2.b") is None  # {x} is one segment
    assert t.format({"i": 7, "rest": "w"}) == "model.layers.7.w"
    with pytest.raises(MapperError, match="malformed"):
        KeyTemplate("a.{b")
    with pytest.raises(MapperError, match="repeats"):
        KeyTemplate("{a}.{a}")


def test_identity_and_passthrough(moe_state) -> None:
    _same(_round_trip(Identity(), moe_state), moe_state)
    _same(Identity("model.{*k}").map_state(moe_state), moe_state)


def test_rename_exact_and_template(moe_state) -> None:
    m = Rename({"lm_head.weight": "head.w", "model.layers.{i}.attn.{p}.weight": "blocks.{i}.{p}"})
    out = _round_trip(m, moe_state)
    assert torch.equal(out["head.w"], moe_state["lm_head.weight"])
    assert torch.equal(out["blocks.1.k"], moe_state["model.layers.1.attn.k.weight"])
    assert "model.norm.weight" in out  # unmatched keys pass through
    with pytest.raises(MapperError, match="not in the source"):
        Rename({"a.{i}": "b.{j}"})
    with pytest.raises(MapperError, match="not invertible"):
        Rename({"a.{i}.{j}": "b.{i}"}).inverse()


def test_select_addprefix_scoped_drop(moe_state) -> None:
    out = Select("model.").map_state(moe_state)
    assert sorted(out) == sorted(k.removeprefix("model.") for k in moe_state if k.startswith("model."))
    _same(AddPrefix("model.").map_state(out), {k: v for k, v in moe_state.items() if k.startswith("model.")})
    _same(AddPrefix("x.").inverse().map_state(AddPrefix("x.").map_state(moe_state)), moe_state)

    scoped = Scoped("model.layers.1.", Rename({"attn.{p}.weight": "attention.{p}"}))
    out = _round_trip(scoped, moe_state)
    assert "model.layers.1.attention.q" in out and "model.layers.0.attn.q.weight" in out

    out = Drop("model.layers.{i}.attn.{*x}", "lm_head.weight").map_state(moe_state)
    assert not any("attn" in k for k in out) and "lm_head.weight" not in out
    with pytest.raises(MapperError, match="no inverse"):
        Drop("x").inverse()


def test_stack_unstack(moe_state) -> None:
    m = Stack("model.layers.{i}.mlp.experts.{e}.up.weight", "model.layers.{i}.mlp.up", over="e")
    out = _round_trip(m, moe_state)
    ref = torch.stack([moe_state[f"model.layers.1.mlp.experts.{e}.up.weight"] for e in range(3)])
    assert torch.equal(out["model.layers.1.mlp.up"], ref)
    m2 = Stack("model.layers.{i}.mlp.experts.{e}.up.weight", "model.layers.{i}.mlp.up", over="e", dim=-1)
    out2 = _round_trip(m2, moe_state)
    assert torch.equal(
        out2["model.layers.1.mlp.up"],
        torch.stack([moe_state[f"model.layers.1.mlp.experts.{e}.up.weight"] for e in range(3)], -1),
    )
    un = Unstack("w", "w.{e}", over="e", dim=1).map_state({"w": torch.arange(6).reshape(2, 3)})
    assert torch.equal(un["w.2"], torch.tensor([2, 5]))


def test_stack_errors_list_keys() -> None:
    s = {f"x.{e}": torch.zeros(2) for e in (0, 1, 3)}
    with pytest.raises(MapperError, match=r"missing inputs to stack: \['x.2'\]"):
        Stack("x.{e}", "x", over="e").map_state(s)
    with pytest.raises(MapperError, match="differ in shape"):
        Stack("x.{e}", "x", over="e").map_state({"x.0": torch.zeros(2), "x.1": torch.zeros(3)})
    with pytest.raises(MapperError, match="non-integer"):
        Stack("x.{e}", "x", over="e").map_state({"x.a": torch.zeros(2)})


def test_chunk_concatenate(moe_state) -> None:
    m = Concatenate(
        [
            "model.layers.{i}.attn.q.weight",
            "model.layers.{i}.attn.k.weight",
            "model.layers.{i}.attn.v.weight",
        ],
        "model.layers.{i}.attn.qkv",
        sizes=[2, 1, 1],
    )
    out = _round_trip(m, moe_state)
    ref = torch.cat([moe_state[f"model.layers.0.attn.{p}.weight"] for p in "qkv"])
    assert torch.equal(out["model.layers.0.attn.qkv"], ref)
    gu = {"gate_up": torch.arange(12.0).reshape(4, 3)}
    parts = Chunk("gate_up", ["gate", "up"]).map_state(gu)
    assert torch.equal(parts["gate"], gu["gate_up"][:2]) and torch.equal(parts["up"], gu["gate_up"][2:])
    _same(Concatenate(["gate", "up"], "gate_up").map_state(parts), gu)
    with pytest.raises(MapperError, match="missing inputs to concatenate"):
        m.map_state({"model.layers.0.attn.q.weight": torch.zeros(2, 4)})
    with pytest.raises(MapperError, match="not divisible"):
        Chunk("gate_up", ["a", "b", "c"], dim=0).map_state({"gate_up": torch.zeros(4, 3)})


def test_transpose_reshape_cast() -> None:
    s = {"a": _rand(2, 3), "b": _rand(6), "i": torch.arange(4)}
    out = _round_trip(Transpose("a"), s)
    assert torch.equal(out["a"], s["a"].T) and out["a"].is_contiguous()
    out = _round_trip(Reshape("b", (2, -1), from_shape=(6,)), s)
    assert out["b"].shape == (2, 3) and torch.equal(out["b"].flatten(), s["b"])
    s = {
        k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in s.items()
    }  # exact in bf16
    out = _round_trip(Cast(torch.bfloat16, from_dtype=torch.float32), s)
    assert out["a"].dtype == torch.bfloat16 and out["i"].dtype == torch.int64
    assert torch.equal(out["a"], s["a"].to(torch.bfloat16))
    with pytest.raises(MapperError, match="from_dtype"):
        Cast(torch.float16).inverse()
    with pytest.raises(MapperError, match="cannot reshape"):
        Reshape("b", (4, 4)).map_state(s)


def test_deinterleave_interleave() -> None:
    s = {"gu": torch.arange(24.0).reshape(2, 12), "other": _rand(3)}
    out = _round_trip(Deinterleave("gu"), s)
    assert torch.equal(out["gu"], torch.cat([s["gu"][:, 0::2], s["gu"][:, 1::2]], dim=1))
    assert torch.equal(out["other"], s["other"])
    out = _round_trip(Deinterleave("gu", dim=1, parts=3), s)
    assert torch.equal(out["gu"], torch.cat([s["gu"][:, i::3] for i in range(3)], dim=1))
    w = {"w": torch.arange(60.0).reshape(2, 5, 6)}  # [E, H, 2I] input-major, interleaved -> [E, 2I, H]
    out = _round_trip(Transpose("w", 1, 2) >> Deinterleave("w", dim=1), w)
    assert torch.equal(out["w"], torch.cat([w["w"][..., 0::2], w["w"][..., 1::2]], dim=-1).transpose(1, 2))
    assert torch.equal(Interleave("gu").map_state(Deinterleave("gu").map_state(s))["gu"], s["gu"])
    with pytest.raises(MapperError, match="not divisible"):
        Deinterleave("gu", parts=5).map_state(s)


def test_sequential_fuses_groups(moe_state) -> None:
    m = (
        Select("model.")
        >> Rename({"layers.{i}.mlp.experts.{e}.up.weight": "layers.{i}.experts.{e}.up"})
        >> Stack("layers.{i}.experts.{e}.up", "layers.{i}.experts.up", over="e")
        >> Transpose("layers.{i}.experts.up", 1, 2)
    )
    plan = m.plan({k: TensorSpec.of(v) for k, v in moe_state.items()})
    stacked = [g for g in plan.groups if "layers.0.experts.up" in g.outputs]
    assert len(stacked) == 1 and len(stacked[0].inputs) == 3  # one fused group per stacked tensor
    assert plan.outputs["layers.0.experts.up"] == TensorSpec((3, 4, 3), torch.float32)
    out = _round_trip(m, {k: v for k, v in moe_state.items() if k.startswith("model.")})
    ref = torch.stack([moe_state[f"model.layers.0.mlp.experts.{e}.up.weight"] for e in range(3)]).transpose(
        1, 2
    )
    assert torch.equal(out["layers.0.experts.up"], ref)
    assert isinstance(m, Sequential) and len(m.mappers) == 4


def test_parallel(moe_state) -> None:
    m = Parallel(
        Rename({"lm_head.weight": "head"}),
        Stack("model.layers.{i}.mlp.experts.{e}.up.weight", "model.layers.{i}.up", over="e"),
        Rename({"model.norm.weight": "norm"}) >> Cast(torch.float64, "norm"),
    )
    out = m.map_state(moe_state)
    assert out["norm"].dtype == torch.float64 and "head" in out and "model.layers.0.up" in out
    assert "model.layers.0.attn.q.weight" in out
    per_layer = Parallel(
        *(Scoped(f"model.layers.{i}.", Rename({"attn.{p}.weight": "attention.{p}"})) for i in range(2))
    )
    out = per_layer.map_state(moe_state)
    assert torch.equal(out["model.layers.1.attention.v"], moe_state["model.layers.1.attn.v.weight"])
    assert "model.layers.0.mlp.experts.2.up.weight" in out  # unclaimed keys in a scope pass through
    with pytest.raises(MapperError, match="claim the same keys"):
        Parallel(Rename({"lm_head.weight": "a"}), Transpose("lm_head.weight")).map_state(moe_state)


def test_validation_overlap_and_absent_inputs() -> None:
    s = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(MapperError, match=r"overlapping outputs.*'b'"):
        Rename({"a": "b"}).map_state(s)

    class Bad(Identity):
        def groups(self, source):
            return [MapperGroup(("a", "ghost"), {"c": TensorSpec((2,), torch.float32)}, lambda t: {})]

    with pytest.raises(MapperError, match="ghost"):
        Bad().map_state(s)


def test_shard_partitions_groups(moe_state) -> None:
    inner = Stack("model.layers.{i}.mlp.experts.{e}.up.weight", "model.layers.{i}.up", over="e")
    full = inner.map_state(moe_state)
    parts = [RankShard(inner, 3, r).map_state(moe_state) for r in range(3)]
    merged: dict[str, torch.Tensor] = {}
    for p in parts:
        assert not set(p) & set(merged)
        merged.update(p)
    _same(merged, full)
    assert all(parts)  # each rank got work


def test_slicers_produce_exact_regions(moe_state) -> None:
    m = (
        Select("model.")
        >> Stack("layers.{i}.mlp.experts.{e}.up.weight", "layers.{i}.up", over="e")
        >> Transpose("layers.{i}.up", 1, 2)
    )
    specs = {k: TensorSpec.of(v) for k, v in moe_state.items()}
    g = m.plan(specs).producer("layers.1.up")
    region = ((1, 3), (1, 3), (0, 2))  # experts 1-2 of the transposed [3, 4, 3]
    in_regions, fn = g.sliced({"layers.1.up": region})
    assert in_regions["model.layers.1.mlp.experts.0.up.weight"] == ((0, 0), (0, 0))  # not read
    assert in_regions["model.layers.1.mlp.experts.1.up.weight"] == ((0, 2), (1, 3))
    tensors = {k: moe_state[k][tuple(slice(a, b) for a, b in r)] for k, r in in_regions.items()}
    got = fn(tensors)["layers.1.up"]
    full = m.map_state(moe_state)["layers.1.up"]
    assert torch.equal(got, full[1:3, 1:3, 0:2])

    c = Concatenate(["a", "b"], "ab", dim=0)
    s = {"a": _rand(3, 2), "b": _rand(2, 2)}
    g = c.plan({k: TensorSpec.of(v) for k, v in s.items()}).producer("ab")
    in_regions, fn = g.sliced({"ab": ((2, 4), (1, 2))})
    assert in_regions == {"a": ((2, 3), (1, 2)), "b": ((0, 1), (1, 2))}
    tensors = {k: s[k][tuple(slice(a, b) for a, b in r)] for k, r in in_regions.items()}
    assert torch.equal(fn(tensors)["ab"], torch.cat([s["a"], s["b"]])[2:4, 1:2])
