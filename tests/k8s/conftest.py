"""The local Kubernetes control plane (infra/k8s) for the chart's tests against a real API server.

`make test-k8s` builds the binaries first (Go from the module proxy); where they are not built and no Go
toolchain is on PATH, these tests skip and say so.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mars_stack import kube

sys.path.insert(0, str(Path(__file__).resolve().parent))
from master_key_kubelet import COMPONENT, MasterKeyKubelet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))

#: What the chart requires beyond its defaults (tests/chart: BASE).
BASE: dict[str, Any] = {"kafka": {"bootstrapServers": "kafka-0.kafka:9092"}, "postgres": {"host": "pg.db"}}
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


@pytest.fixture(scope="session")
def cluster_and_kubelet() -> Iterator[tuple[kube.LocalCluster, MasterKeyKubelet]]:
    if not kube.built() and shutil.which("go") is None:
        pytest.skip("needs the local control plane (infra/k8s): `make test-k8s` builds it with Go >= 1.26")
    # No GPU node at first: the vLLM pod must wait for one (test_chart_on_cluster adds it).
    # The master-key hook's pods are run for real by MasterKeyKubelet, not completed by kwok.
    with (
        kube.LocalCluster(nodes=kube.CPU_NODES, held_components=(COMPONENT,)) as local,
        MasterKeyKubelet(local) as kubelet,
    ):
        yield local, kubelet


@pytest.fixture(scope="session")
def cluster(cluster_and_kubelet: tuple[kube.LocalCluster, MasterKeyKubelet]) -> kube.LocalCluster:
    return cluster_and_kubelet[0]


@pytest.fixture(scope="session")
def master_keys(cluster_and_kubelet: tuple[kube.LocalCluster, MasterKeyKubelet]) -> MasterKeyKubelet:
    """What the master-key hook's pods did (namespace, pod, created or the error), in order."""
    return cluster_and_kubelet[1]
