"""plait's benchmarks, run from the repository root as modules: ``python3 -m benchmarks.<area>.<script>``."""
