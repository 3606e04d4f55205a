"""MARS state service (see service.py)."""
