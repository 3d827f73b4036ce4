"""pdpool.sidecar."""
