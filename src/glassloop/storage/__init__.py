"""Bytes on disk, pickle-free and link-safe: atomic writes, SHA-256-hashed files, safetensors
weights, the flattening of a state into JSON and tensors, a frozen base's record, Hugging Face
layouts, file names, redaction and the cache folder."""
