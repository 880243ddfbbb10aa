"""Checkpoint policy: when to save and what, background saves, and the resume's checks."""
