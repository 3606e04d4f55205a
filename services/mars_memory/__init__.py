"""MARS memory service (see service.py)."""

import os

# One OpenBLAS thread unless told otherwise (read when numpy is first imported, so it is set here, before
# the service imports numpy). A view's matrix products are small (50 candidates, a few hundred groups); with
# two BLAS threads on two cores, `mars bench realmem --policy mars-ranker` measured retrieval p50 / p99 32.7 /
# 84.4 ms and the ranker's own p99 14.4 ms, against 24.8 / 61.2 ms and 3.5 ms with one (2026-12-03).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
