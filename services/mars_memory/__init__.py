"""MARS memory service (see service.py)."""
