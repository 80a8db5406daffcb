"""plait.dist_core: Device meshes, distributed context, seeding, collectives, pytree sharding, parallelize applicators, gradient clipping and a CPU distributed test harness."""

__all__: list[str] = []
