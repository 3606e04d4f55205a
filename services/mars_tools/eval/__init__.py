"""Benchmarks driven through a running pipeline (`mars eval ...`)."""
