"""One phase of the 2-rank ``async_mode="process"`` test, run under torchrun (the writer process is a
child of each rank, which the test pool's daemonic workers may not have).

Usage, in the repository root: ``torchrun --nproc-per-node 2 -m tests.loop.checkpoint._process_mode_script
PHASE ROOT OUT [RECORD]``. ``train`` and ``resume``: rank 0 saves ``(losses, tensors)`` to OUT with
``torch.save``, the losses after the save (train) or after the resume, and every parameter and AdamW moment
(whole) at the save (train) or right after loading. ``resume`` then acts twice as a restarted job in
process mode (a new Checkpointer each time): resume, one step, save, the second time with a new entry,
recording each global planning in RECORD (``P`` planned, ``R`` reused).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests.loop.checkpoint.test_distributed_checkpoint import (
    _resave,
    _resume_snapshot,
    _train_save_snapshot,
)


def main() -> None:
    phase, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    result = _train_save_snapshot(root, 3, 5, "process") if phase == "train" else _resume_snapshot(root, 5)
    if dist.get_rank() == 0:
        torch.save(result, out)
    if phase == "resume":
        _resave(root, sys.argv[4], extra=False)
        _resave(root, sys.argv[4], extra=True)
    # Both ranks done before either tears gloo down: a rank that destroyed its group while the other was
    # still writing OUT aborted once on a loaded machine ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
