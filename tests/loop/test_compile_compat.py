"""The torch.compile internals of the loop's compile adapter still exist as used there."""

from __future__ import annotations

import torch._functorch.config as functorch_config
from plait.loop.compile_compat import allow_retained_compiled_backward


def test_donated_buffer_is_still_a_boolean_functorch_setting():
    # A torch upgrade that renames or drops the flag fails here, by name, instead of a split-backward
    # schedule failing inside a compiled backward on the GPU.
    config = functorch_config.get_config_copy()
    assert "donated_buffer" in config, "torch._functorch.config.donated_buffer is gone"
    assert isinstance(config["donated_buffer"], bool)


def test_allow_retained_compiled_backward_turns_donation_off_once():
    with functorch_config.patch(donated_buffer=True):
        assert allow_retained_compiled_backward() is True
        assert functorch_config.donated_buffer is False
        assert allow_retained_compiled_backward() is False
        assert functorch_config.donated_buffer is False
