"""The hang hook of the restart tests and the warning about a rendezvous store shared across restarts."""

from __future__ import annotations

import pytest
from plait.loop.resilience import RankHang, rank_hang_from_env, restart_store_warning


def test_rank_hang_env_names_a_rank_a_step_and_the_first_attempt_only():
    env = {"PLAIT_DEBUG_RANK_HANG": "1:6"}
    assert rank_hang_from_env(1, env) == RankHang(6, stop=False)
    assert rank_hang_from_env(0, env) is None
    assert rank_hang_from_env(1, {"PLAIT_DEBUG_RANK_HANG": "1:0:stop"}) == RankHang(0, stop=True)
    assert rank_hang_from_env(1, {**env, "TORCHELASTIC_RESTART_COUNT": "0"}) == RankHang(6)
    assert rank_hang_from_env(1, {**env, "TORCHELASTIC_RESTART_COUNT": "1"}) is None, "a restarted group runs"
    assert rank_hang_from_env(1, {}) is None


@pytest.mark.parametrize("value", ["1", "1:x", "1:-1", "1:2:halt", "1:2:stop:4"])
def test_rank_hang_env_errors_name_the_variable(value):
    with pytest.raises(ValueError, match="PLAIT_DEBUG_RANK_HANG"):
        rank_hang_from_env(1, {"PLAIT_DEBUG_RANK_HANG": value})


def test_restart_store_warning_only_for_multi_node_restarts_in_a_shared_store():
    shared = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_MAX_RESTARTS": "2",
        "GROUP_WORLD_SIZE": "2",
    }
    assert restart_store_warning({**shared, "GROUP_WORLD_SIZE": "1"}) is None  # one node: keys kept apart
    message = restart_store_warning(shared)
    assert message is not None and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in message
    assert restart_store_warning({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert restart_store_warning({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert restart_store_warning({}) is None
