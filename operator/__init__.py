"""pdpool.operator."""
