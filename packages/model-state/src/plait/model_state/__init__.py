"""plait.model_state: Streaming safetensors IO through declarative mapper graphs; usable from any framework (torch + safetensors only)."""

__all__: list[str] = []
