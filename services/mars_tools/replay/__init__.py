"""Replay and offline evaluation over the event log."""
