"""The run directory: its layout (every name in it), its committed checkpoints, its lock, and its
copy on object storage."""
