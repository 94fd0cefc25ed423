"""Mooncake-compatible global KV-cache indexer service."""

__version__ = "0.1.0"
