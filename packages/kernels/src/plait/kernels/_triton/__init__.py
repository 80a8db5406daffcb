"""Triton kernels; imported lazily by the public ops when the Triton path is taken."""
