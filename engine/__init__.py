"""pdpool.engine."""
