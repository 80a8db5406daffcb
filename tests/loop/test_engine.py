"""The batch copy to the device (:func:`plait.loop.engine.to_device`)."""

from __future__ import annotations

import time

import pytest
import torch
from plait.loop.engine import to_device


def test_to_device_keeps_values_and_cpu_tensors():
    batch = {"input_ids": torch.arange(12).view(3, 4), "labels": torch.ones(3, 4, dtype=torch.int64)}
    out = to_device(batch, torch.device("cpu"))
    assert set(out) == set(batch)
    for k, v in batch.items():
        assert torch.equal(out[k], v)


@pytest.mark.gpu
def test_to_device_does_not_wait_for_queued_gpu_work():
    """A pageable host tensor copied with plain ``.to("cuda", non_blocking=True)`` waits for the queued
    work; through ``to_device`` the host returns while a long kernel still runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    batch = {"input_ids": torch.randint(0, 100, (4, 2048))}  # pageable
    to_device(batch, device)  # warm up the pinned-memory cache
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time queued
    t0 = time.perf_counter()
    out = to_device(batch, device)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert host < 0.2, f"the copy held the host {host:.2f} s: it waited for the queued kernel"
    assert torch.equal(out["input_ids"].cpu(), batch["input_ids"])
