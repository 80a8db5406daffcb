"""plait.pipelining: Pipeline-parallel schedule IR, program builders (GPipe to DualPipeV), validator, simulator and executor with split backward."""

__all__: list[str] = []
