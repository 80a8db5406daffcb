"""The mesh section's type: plait.dist_core's ``DeviceMeshParameters``."""

from __future__ import annotations

try:
    from plait.dist_core import DeviceMeshParameters  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - TEMPORARY until plait.dist_core publishes it
    from pydantic import BaseModel, ConfigDict, Field

    class DeviceMeshParameters(BaseModel):  # type: ignore[no-redef]
        """Stand-in with the brief's field names (removed once dist-core lands)."""

        model_config = ConfigDict(frozen=True, extra="forbid")
        pipeline: int = Field(1, ge=1)
        data_replicate: int = Field(1, ge=1)
        data_shard: int = Field(1, ge=1)
        context_shard: int = Field(1, ge=1)
        context_replicate: int = Field(1, ge=1)
        tensor: int = Field(1, ge=1)
        expert: int = Field(1, ge=1)


__all__ = ["DeviceMeshParameters"]
