"""Trainer.close() destroys the process groups of a context the trainer built, also when closing fails."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from plait.dist_core import DeviceMeshParameters, DistributedContext
from plait.loop import CausalLMTask, DatasetProvider, ModuleProvider, Trainer, load_config, pack_documents

from tests.loop._lm import VOCAB, TinyLM, pattern_tokens


def _trainer(tmp_path, **kw) -> Trainer:
    cfg = load_config(
        overrides=[
            f"--run.run_dir={tmp_path}",
            "--run.steps=2",
            "--batching.global_batch_size=2",
            "--batching.microbatch_size=2",
            "--batching.seq_len=16",
            "--logging.progress_bar=false",
        ]
    )
    data = DatasetProvider(pack_documents(pattern_tokens(), 16, eos_id=VOCAB - 1))
    return Trainer(cfg, ModuleProvider(TinyLM), data, CausalLMTask(), **kw)


class _RecordingContext:
    def __init__(self, ctx) -> None:
        self.ctx, self.shutdowns = ctx, 0

    def __getattr__(self, name: str):
        return getattr(self.ctx, name)

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.ctx.shutdown()


@pytest.mark.parametrize("fails", [False, True], ids=["normal", "closing-fails"])
def test_close_shuts_down_the_context_the_trainer_built(tmp_path, monkeypatch, fails: bool) -> None:
    torch.set_num_threads(1)
    tr = _trainer(tmp_path)
    tr.fit()
    ctx = tr.ctx = _RecordingContext(tr.ctx)  # type: ignore[assignment]
    if fails:

        def broken() -> None:
            raise OSError("tracker disk full")

        monkeypatch.setattr(tr.reporter, "close", broken)
        with pytest.raises(OSError, match="tracker disk full"):
            tr.close()
    else:
        tr.close()
    assert ctx.shutdowns == 1


def test_close_leaves_a_given_context_alone(tmp_path) -> None:
    given = DistributedContext.from_env(DeviceMeshParameters(), device="cpu")
    tr = _trainer(tmp_path, ctx=given)
    ctx = tr.ctx = _RecordingContext(tr.ctx)  # type: ignore[assignment]
    tr.close()
    assert ctx.shutdowns == 0
    given.shutdown()


def test_close_destroys_the_process_group_of_a_context_it_built(tmp_path) -> None:
    """A one-process trainer whose mesh was used: the world-size-1 group DeviceMesh needed goes too."""
    assert not dist.is_initialized(), "a process group left over by another test"
    tr = _trainer(tmp_path)
    tr.ctx.mesh_for("flat")  # creates the one-process group (as parallel plans do)
    assert dist.is_initialized()
    tr.close()
    assert not dist.is_initialized()
