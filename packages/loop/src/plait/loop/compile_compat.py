"""Every use of torch.compile internals by the loop, in one place.

A split-backward pipeline schedule keeps the autograd graph of the input-gradient pass for the
weight-gradient pass (``retain_graph``). A backward compiled by AOTAutograd with donated buffers
refuses that, and torch has no public switch for it: only ``torch._functorch.config.donated_buffer``.
``tests/loop/test_compile_compat.py`` checks that the flag still exists as a boolean setting and
that this function turns it off, so a torch upgrade that removes or renames it fails there, by name.
"""

from __future__ import annotations

import torch._functorch.config as functorch_config

__all__ = ["allow_retained_compiled_backward"]


def allow_retained_compiled_backward() -> bool:
    """Make backwards compiled from now on keep their buffers, so that their graph can be retained.

    Process-wide (torch's flag is global); backwards compiled before the call are not changed.

    Returns:
        Whether the setting changed (False: donation was already off).
    """
    if not functorch_config.donated_buffer:
        return False
    functorch_config.donated_buffer = False
    return True
