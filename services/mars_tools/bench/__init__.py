"""Offline benchmarks for MARS retrieval (pure Python, no network, no database)."""
