"""plait.moe: Mixture-of-Experts: routers with load balancing, grouped experts, expert-parallel token dispatch."""

__all__: list[str] = []
