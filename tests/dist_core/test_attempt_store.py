"""Under a torchrun agent's shared store, each restart attempt's process group keeps its keys apart."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from plait.dist_core import context


def test_each_attempt_writes_under_a_prefix_of_its_own(monkeypatch) -> None:
    master = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert context._attempt_store(1, None) is None  # no agent store: env:// as usual
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for attempt in (0, 1):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        store = context._attempt_store(1, timedelta(seconds=30))
        assert store is not None
        store.set("rank0_address", f"attempt {attempt}")
    # the dead attempt's key is not the restarted one's: each sits under its own prefix in the agent's store
    assert master.get("plait/attempt_0/rank0_address") == b"attempt 0"
    assert master.get("plait/attempt_1/rank0_address") == b"attempt 1"
