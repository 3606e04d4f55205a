"""MARS on Kubernetes: what the command line needs beside the Helm chart (charts/mars).

`status` (workloads and consumer-group lag of a release), `lag` (lag from Kafka), `replay_job` (a replay
run as a Job in the release's image and settings), `cli` (`mars deploy ...`). Only the few functions that
say so in their docstrings need a live API server or broker; the rest is pure and unit-tested.
"""
