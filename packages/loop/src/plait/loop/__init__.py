"""plait.loop: The training loop: config, data, gradients, optimizers, LR schedules, metrics, trackers, profiling, async checkpointing."""

__all__: list[str] = []
