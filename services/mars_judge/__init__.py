"""MARS judge service (see service.py)."""
