"""MARS ingress service (see service.py)."""
