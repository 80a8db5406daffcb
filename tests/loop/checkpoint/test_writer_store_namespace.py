"""DCP's checkpoint writer processes build their gloo group in the job's store, which outlives them:
torchrun's agent keeps one store for all the restarts of its group, and a process keeps its store for a
later writer. A new writer group must not read a dead one's addresses there: each group of writers gets
a key namespace of its own, drawn by rank 0 and broadcast over the live process group."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from plait.dist_core.testing import run_distributed
from plait.loop.checkpoint import dcp_compat
from torch.distributed import HashStore
from torch.distributed.checkpoint import _async_process_executor as ape

HERE = Path(__file__).parent


def _namespaces() -> list[str]:
    return [getattr(dcp_compat.writer_init_info(None), dcp_compat.STORE_NAMESPACE_ATTR) for _ in range(2)]


def test_every_writer_group_gets_a_namespace_of_its_own_shared_by_its_ranks():
    first, second = run_distributed(_namespaces, 2)
    assert first == second, "the ranks of one writer group must agree on its namespace"
    assert first[0] and first[0] != first[1], "each writer group gets a new namespace"


def test_the_writer_entry_puts_its_keys_under_the_namespace(monkeypatch):
    """Independent of DCP's entry: a stand-in entry wraps a store as DCP's does; its keys land under
    ``AsyncCheckpointProcess/<namespace>``."""
    # DCP's own entry builds its store with the module's PrefixStore, looked up when it runs
    assert "PrefixStore" in dcp_compat.DCP_WRITER_ENTRY.__code__.co_names
    monkeypatch.setattr(ape, "PrefixStore", ape.PrefixStore)  # restored after the test
    monkeypatch.setattr(ape, "_init_logger", ape._init_logger)
    base = HashStore()
    base.set_timeout(timedelta(seconds=5))

    def dcp_like_entry(pg_init_info, parent_conn):
        ape.PrefixStore("AsyncCheckpointProcess/", base).set("rank_0", b"address")

    monkeypatch.setattr(dcp_compat, "DCP_WRITER_ENTRY", dcp_like_entry)

    class Info:
        plait_store_namespace = "n1"

    dcp_compat.run_writer_process_entry(Info(), None, init_logger=lambda rank: None)
    assert base.check(["AsyncCheckpointProcess/n1/rank_0"]), "the key is not under the namespace"
    assert not base.check(["AsyncCheckpointProcess//rank_0"])
