"""plait.peft: Parameter-efficient fine-tuning: LoRA/DoRA for linear layers and grouped experts, full-tune, method stacking, Hugging Face PEFT adapter IO."""

__all__: list[str] = []
