"""The chart serving on a real node (mars_stack.serving_cluster): one cluster and one release for the whole
session, installed by the first test (test_turns_in_cluster.py runs in file order).

Needs root, the control plane, the kubelet, kube-proxy and CoreDNS (`infra/k8s/build.sh --e2e`),
containerd, runc, the CNI plugins, iptables and the MARS image (`make image`): `make test-k8s-e2e` provides
them. Where one is missing every test here skips and names it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mars_stack import kubelet, serving_cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))

IMAGE = os.environ.get("MARS_IMAGE", "localhost/mars:latest")
#: The run's figures (install time, turns answered, the fault runs' counts), printed at its end.
REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORT:
        terminalreporter.section("MARS on a real node: figures")
        for line in REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def serving() -> Iterator[serving_cluster.ServingCluster]:
    if os.geteuid() != 0:
        pytest.skip("a real node needs root (network links, iptables, containerd)")
    needs = serving_cluster.missing()
    if needs:
        pytest.skip("the serving cluster needs " + ", ".join(needs) + ": `make test-k8s-e2e` provides them")
    if not kubelet.podman_has(IMAGE):
        pytest.skip(f"the MARS image {IMAGE} is not in podman's store: `make image` builds it")
    cluster = serving_cluster.ServingCluster(IMAGE, kubelet.base_image(IMAGE))
    cluster.start(lambda message: print(f"[serving cluster] {message}", flush=True))
    try:
        yield cluster
    finally:
        cluster.stop()
