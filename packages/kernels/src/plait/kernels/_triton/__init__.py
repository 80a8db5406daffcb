"""Triton kernels; imported lazily by the public ops when the Triton path is taken."""

from __future__ import annotations

import torch


def row_bounded_programs(tiles: int, device: torch.device, bounded: bool) -> int:
    """Programs of a row-tiled kernel whose tiles loop grid-stride (``range(pid, live_tiles, programs)``).

    Without a device-side row bound, one program per tile (each loops once). With one (``bounded``:
    the live tiles are known only on the device), at most 64 programs per SM, each looping over a few
    tiles, so that the tiles past the bound cost no program at all. For kernels of many tiny programs
    (the MoE row gathers: one 2-4 KiB row each), which the GPU's block scheduling bounds rather than
    memory, a program that only returns costs about what a working one does: on an H200 the
    all-gather dispatch's gathers (a buffer of twice the used rows) took 0.20 ms per layer and step
    with one program per row and a bound checked in each, 0.12 ms looping (0.10 for the used rows
    alone, without expert parallelism).
    """
    if not bounded:
        return tiles
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(tiles, 64 * sms))
