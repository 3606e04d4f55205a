"""MARS dispatch service (see service.py)."""
