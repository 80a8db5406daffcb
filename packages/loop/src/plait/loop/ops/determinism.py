"""The process-global settings a run's determinism options make."""

from __future__ import annotations

import os

import torch
from plait.loop.config.sections import DeterminismConfig

__all__ = ["apply_determinism"]


def apply_determinism(settings: DeterminismConfig, seed: int) -> None:
    """Set this process's global torch state for a run: deterministic algorithms, then the seed.

    With ``settings.deterministic_algorithms``, torch raises on ops that have no deterministic kernel
    and cuBLAS gets the fixed workspace it needs for reproducible GEMMs (``CUBLAS_WORKSPACE_CONFIG``,
    unless already set). Then the default generators are seeded with ``seed``, so that the model's
    initial weights (drawn next) are the same on every run. Both are global: they stay in force for
    everything else the process runs afterwards.

    Args:
        settings: the run's ``determinism`` section.
        seed: ``run.seed``.
    """
    if settings.deterministic_algorithms:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
