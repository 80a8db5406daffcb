"""DistributedContext: node count and master address on a 2-node launch, registered mesh domains,
log level, wait_world."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from plait.dist_core import (
    DOMAIN_DIMS,
    DeviceMeshParameters,
    DistributedContext,
    domain_layout,
    register_mesh_domain,
    unregister_mesh_domain,
)
from plait.dist_core.testing import run_distributed

from tests.dist_core._dist_fns import registered_domain_facts

_NODE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from plait.dist_core import DeviceMeshParameters, DistributedContext
    ctx = DistributedContext.from_env(DeviceMeshParameters(data_shard=2), device="cpu")
    ctx.wait_world()
    print("FACTS " + json.dumps({"rank": ctx.rank, "node_rank": ctx.node_rank, "num_nodes": ctx.num_nodes,
                                 "master_addr": ctx.master_addr, "world": ctx.world_size}), flush=True)
    ctx.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
def test_two_node_launch_reports_nodes_and_master(tmp_path: object) -> None:
    """Two torchrun agents (one per 'node', one process each) on localhost."""
    port = _free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)),
                *("--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)),
                *("--no-python", sys.executable, "-c", _NODE_SCRIPT),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    facts = sorted(
        (json.loads(line[6:]) for out in outs for line in out.splitlines() if line.startswith("FACTS ")),
        key=lambda f: f["rank"],
    )
    assert [(f["rank"], f["node_rank"], f["num_nodes"], f["world"]) for f in facts] == [
        (0, 0, 2, 2),
        (1, 1, 2, 2),
    ]
    assert {f["master_addr"] for f in facts} == {"127.0.0.1"}


def test_registered_domain_on_4_ranks() -> None:
    config = {"data_shard": 2, "tensor": 2}
    facts = run_distributed(registered_domain_facts, 4, config)
    for rank, f in enumerate(facts):
        assert f["dims"] == ("dp", "rest")
        # the registered dp dimension holds the same ranks as the built-in batch domain's dp dimension
        assert f["dp_group"] == f["ctx_dp_group"] == f["batch_dp_group"], rank
        assert f["dp_sum"] == float(sum(f["batch_dp_group"])), rank  # type: ignore[arg-type]
    assert "dp_rest" not in DOMAIN_DIMS


def test_register_domain_errors() -> None:
    with pytest.raises(ValueError, match="'dense' already exists"):
        register_mesh_domain("dense", ("a",), lambda p: torch.arange(p.world_size))
    with pytest.raises(ValueError, match="must be distinct"):
        register_mesh_domain("x", ("a", "a"), lambda p: torch.arange(p.world_size).reshape(1, -1))
    with pytest.raises(ValueError, match="built in"):
        unregister_mesh_domain("flat")
    register_mesh_domain("broken", ("a",), lambda p: torch.zeros(p.world_size, dtype=torch.int64))
    register_mesh_domain("flat2d", ("a",), lambda p: torch.arange(p.world_size).reshape(1, -1))
    try:
        with pytest.raises(ValueError, match=r"'broken': its layout must hold every rank 0\.\.1 once"):
            domain_layout(DeviceMeshParameters(data_shard=2), "broken")
        with pytest.raises(ValueError, match="'flat2d': its layout has 2 dimensions but the domain names 1"):
            domain_layout(DeviceMeshParameters(data_shard=2), "flat2d")
    finally:
        unregister_mesh_domain("broken")
        unregister_mesh_domain("flat2d")


def test_log_level_master_addr_and_wait_world_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger("plait")
    before = logger.level
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    try:
        ctx = DistributedContext.from_env(DeviceMeshParameters(), device="cpu", log_level="debug")
        assert logger.level == logging.DEBUG
        assert ctx.master_addr is None and ctx.num_nodes == 1
        ctx.wait_world()  # single process: nothing to wait for, no group created
        ctx.shutdown()
        monkeypatch.setenv("MASTER_ADDR", "localhost")
        assert DistributedContext.from_env(DeviceMeshParameters(), device="cpu").master_addr == "127.0.0.1"
        monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
        with pytest.raises(ValueError, match=r"MASTER_ADDR='no-such-host\.invalid' does not resolve"):
            DistributedContext.from_env(DeviceMeshParameters(), device="cpu")
    finally:
        logger.setLevel(before)


def test_shutdown_frees_cuda_graphs_before_it_destroys_the_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL waits forever to destroy a communicator that a live CUDA graph captured (pytorch#115388):
    the context frees the compiled graphs first, while its groups still exist."""
    from plait.dist_core import context

    ctx = DistributedContext.from_env(DeviceMeshParameters(), device="cpu")
    ctx.mesh_for("dense")  # a single process builds (and owns) its default group lazily
    assert torch.distributed.is_initialized()
    seen: list[bool] = []
    monkeypatch.setattr(
        context, "release_cuda_graphs", lambda: seen.append(torch.distributed.is_initialized())
    )
    ctx.shutdown()
    assert seen == [True] and not torch.distributed.is_initialized()


def test_release_cuda_graphs_resets_the_graph_trees_once_cuda_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from plait.dist_core import release_cuda_graphs
    from torch._inductor import cudagraph_trees

    resets: list[int] = []
    monkeypatch.setattr(cudagraph_trees, "reset_cudagraph_trees", lambda: resets.append(1))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    release_cuda_graphs()
    assert resets == []  # no CUDA: no graphs
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    release_cuda_graphs()
    assert resets == [1]
