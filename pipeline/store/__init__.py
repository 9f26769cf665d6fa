"""The store steps: shard, replicate, verify, rotate (and the rotation trash)."""
