"""Triton kernels; imported lazily by the public ops when the Triton path is taken."""

from __future__ import annotations

import torch


def row_bounded_programs(tiles: int, device: torch.device, bounded: bool) -> int:
    """Programs of a row-tiled kernel whose tiles loop grid-stride (``range(pid, live_tiles, programs)``).

    Without a device-side row bound, one program per tile (each loops once). With one (``bounded``:
    the live tiles are known only on the device), at most 64 programs per SM, each looping over a few
    tiles, so that the tiles past the bound cost no program at all: a launch over a buffer that a
    static bound sizes at ``P`` times its use then costs what one over the used part does. (16 per SM
    made the MoE SwiGLU backward's loops ~20% slower than one program per tile on an H200.)
    """
    if not bounded:
        return tiles
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(tiles, 64 * sms))
