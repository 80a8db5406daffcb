"""The mesh section's type: plait.dist_core's ``DeviceMeshParameters``."""

from __future__ import annotations

from plait.dist_core import DeviceMeshParameters

__all__ = ["DeviceMeshParameters"]
