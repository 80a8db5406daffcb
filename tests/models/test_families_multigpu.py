"""The families' distributed checks again on NCCL, one GPU per rank (2 GPUs): ``pytest -m multigpu tests/models``.

Every layout's loss against one GPU from one seed checkpoint is ``benchmarks/training/layouts.py --family``;
here, what a loss curve cannot show: DeepSeek-V3's auxiliary-loss-free biases stay equal, bit for bit, on both
ranks of an EP=2 x FSDP2 Trainer run on NCCL.
"""

from __future__ import annotations

import pytest
import torch
from plait.dist_core.testing import run_distributed
from plait.models import save_hf_checkpoint
from plait.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

from tests.models.test_deepseek_v3_parallel import CFG, TRAINER_CFG, _trainer_worker

pytestmark = pytest.mark.multigpu


def test_deepseek_v3_biases_agree_on_both_ranks_on_nccl(tmp_path):
    torch.manual_seed(0)
    seed = DeepseekV3ForCausalLM(DeepseekV3Config(**{**CFG, **TRAINER_CFG}))
    seed.reset_parameters()
    ckpt = str(save_hf_checkpoint(seed, tmp_path / "seed"))
    ranks = run_distributed(
        _trainer_worker, 2, str(tmp_path / "ep"), 4, 2, ckpt, backend="nccl", timeout=300.0
    )
    assert len(ranks[0]) == len(ranks[1]) > 0
    for a, b in zip(ranks[0], ranks[1], strict=True):
        assert torch.equal(a, b)
        assert a.abs().max() > 0  # the run moved them
