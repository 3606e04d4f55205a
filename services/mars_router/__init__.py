"""MARS router service (see service.py)."""
