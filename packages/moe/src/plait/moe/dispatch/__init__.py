"""Token dispatchers: move routed tokens to their experts and the results back."""

from plait.moe.dispatch.all_gather import AllGatherDispatcher
from plait.moe.dispatch.all_to_all import AllToAllDispatcher, all_to_all
from plait.moe.dispatch.base import TokenDispatcher
from plait.moe.dispatch.deepep import DeepEPDispatcher
from plait.moe.dispatch.local import LocalDispatcher

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "DeepEPDispatcher",
    "LocalDispatcher",
    "TokenDispatcher",
    "all_to_all",
]
