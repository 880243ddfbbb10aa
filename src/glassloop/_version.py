"""The version, in a module of its own: ``glassloop --version`` reads it without importing
torch."""

__version__ = "0.1.0"
