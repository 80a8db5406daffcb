"""The distributed test harness: results per rank, failures naming the rank, crashes, timeouts."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from plait.dist_core.testing import DistributedTestError, run_distributed


def _all_reduce_rank(offset: int, *, scale: int = 1) -> int:
    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)
    return int(t.item()) * scale


def _env() -> dict[str, str]:
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    return {k: os.environ[k] for k in keys} | {"backend": dist.get_backend(), "pid": str(os.getpid())}


def _fail_on_rank(bad: int) -> int:
    if dist.get_rank() == bad:
        raise ValueError(f"deliberate failure on rank {bad}")
    return dist.get_rank()


def _fail_then_others_hang(bad: int) -> None:
    if dist.get_rank() == bad:
        raise RuntimeError("boom before the collective")
    time.sleep(3600)  # never finishes on its own


def _crash_on_rank(bad: int) -> int:
    if dist.get_rank() == bad:
        os._exit(3)
    return dist.get_rank()


def _sleep_forever() -> None:
    time.sleep(3600)


def _return_tensor(n: int) -> torch.Tensor:
    return torch.full((n,), float(dist.get_rank()))


def _set_env_var() -> str | None:
    previous = os.environ.get("PLAIT_HARNESS_TEST_VAR")
    os.environ["PLAIT_HARNESS_TEST_VAR"] = "set"
    torch.set_default_dtype(torch.float64)
    return previous


def _default_dtype() -> str:
    return str(torch.get_default_dtype())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    expected = sum(range(world_size)) + 10 * world_size
    assert run_distributed(_all_reduce_rank, world_size, 10, scale=2) == [2 * expected] * world_size


def test_eight_ranks() -> None:
    assert run_distributed(_all_reduce_rank, 8, 0) == [28] * 8


def test_torchrun_environment_is_set() -> None:
    envs = run_distributed(_env, 2)
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert all(e["WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2" for e in envs)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert all(e["backend"] == "gloo" for e in envs)
    assert envs[0]["pid"] != envs[1]["pid"] != str(os.getpid())


def test_pool_is_reused_and_fresh_port_per_call() -> None:
    first = run_distributed(_env, 2)
    second = run_distributed(_env, 2)
    assert [e["pid"] for e in first] == [e["pid"] for e in second]
    assert first[0]["MASTER_PORT"] != second[0]["MASTER_PORT"]


def test_tensors_round_trip() -> None:
    out = run_distributed(_return_tensor, 2, 3)
    torch.testing.assert_close(out[1], torch.ones(3))


def test_state_is_restored_between_calls() -> None:
    assert run_distributed(_set_env_var, 1) == [None]
    assert run_distributed(_set_env_var, 1) == [None]
    assert run_distributed(_default_dtype, 1) == [str(torch.get_default_dtype())]


def test_failing_rank_is_named_with_traceback() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank, 2, 1)
    assert info.value.failed_ranks == [1]
    message = str(info.value)
    assert "rank 1" in message and "deliberate failure on rank 1" in message and "ValueError" in message
    # The pool survives a clean failure.
    assert run_distributed(_all_reduce_rank, 2, 0) == [1, 1]


def test_ranks_stuck_after_a_failure_are_reported_and_replaced() -> None:
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_then_others_hang, 2, 0, timeout=60)
    assert time.monotonic() - t0 < 30  # does not wait for the full timeout
    assert info.value.failed_ranks == [0]
    message = str(info.value)
    assert "boom before the collective" in message and "ranks [1] did not finish" in message
    assert "_fail_then_others_hang" in message.split("did not finish")[1]  # rank 1's stack
    assert run_distributed(_all_reduce_rank, 2, 0) == [1, 1]


def test_crashed_rank_is_reported_and_pool_replaced() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_crash_on_rank, 2, 1)
    assert 1 in info.value.failed_ranks
    assert "exit code 3" in str(info.value)
    assert run_distributed(_all_reduce_rank, 2, 0) == [1, 1]


def test_timeout_dumps_stacks() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_sleep_forever, 2, timeout=2.0)
    message = str(info.value)
    assert "timed out" in message and info.value.failed_ranks == [0, 1]
    assert "_sleep_forever" in message  # faulthandler stack of the stuck rank


def test_unpicklable_function_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="module level"):
        run_distributed(lambda: 1, 2)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_env, 0)
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_env, 1, timeout=0)


def test_warm_four_rank_call_is_fast() -> None:
    run_distributed(_all_reduce_rank, 4, 0)  # warm-up (starts the workers if needed)
    timings = []
    for _ in range(3):  # best of 3: the CI machine is shared
        t0 = time.perf_counter()
        assert run_distributed(_all_reduce_rank, 4, 0) == [6] * 4
        timings.append(time.perf_counter() - t0)
    assert min(timings) < 1.0, timings


def _nccl_all_reduce() -> float:
    t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(t)
    assert torch.cuda.current_device() == int(os.environ["LOCAL_RANK"])
    return float(t[0].item())


@pytest.mark.multigpu
def test_nccl_backend() -> None:
    assert run_distributed(_nccl_all_reduce, 2, backend="nccl") == [3.0, 3.0]
