"""plait.models: Transformer blocks, Qwen3 and Qwen3-MoE with Hugging Face parity and mappers, parallel plans."""

__all__: list[str] = []
