"""Triton kernels; imported lazily by the public ops when the Triton path is taken."""

from __future__ import annotations

import torch


def row_bounded_programs(tiles: int, device: torch.device, bounded: bool) -> int:
    """Programs of a row-tiled kernel whose tiles loop grid-stride (``range(pid, live_tiles, programs)``).

    Without a device-side row bound, one program per tile (each loops once). With one (``bounded``:
    the live tiles are known only on the device), at most what the GPU keeps resident at once (16
    programs per SM), so the tiles past the bound cost no program: a launch over a buffer that a
    static bound sizes at ``P`` times its use is then as cheap as one over the used part.
    """
    if not bounded:
        return tiles
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(tiles, 16 * sms))
