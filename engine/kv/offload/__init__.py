"""KV offload tiers below the block pool: files on a local disk or a directory shared by the
pool, keyed by content (chained block hash + a fingerprint of what produced the KV)."""
