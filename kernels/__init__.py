"""pdpool.kernels."""
