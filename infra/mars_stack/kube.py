"""A local Kubernetes control plane (infra/k8s), the chart's test cluster: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler built from the Go modules (`infra/k8s/build.sh`), with kwok
playing the nodes.

`LocalCluster` starts them on free loopback ports with a fresh CA and an admin kubeconfig
(mars_stack.kube_control_plane), registers kwok nodes (CPU nodes and one GPU node with `nvidia.com/gpu`
capacity and the NVIDIA taint), a default StorageClass with pre-made volumes (static provisioning: the PV
controller binds claims as on a cluster without a provisioner; mars_stack.kube_nodes), and stops it all
again. Nothing runs a container: kwok's stages make a scheduled pod Running and Ready and a Job's pod
Succeeded, so Deployments become Available and Helm hooks complete.

The names the tools and tests use as `kube.<name>` are all here (`__all__`), wherever they are defined.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mars_stack.certs import KubePKI
from mars_stack.kube_control_plane import (
    BIN_DIR,
    KUBERNETES_VERSION,
    STAGES,
    ClusterError,
    ControlPlane,
    build,
    built,
    stop_processes,
    wait_for,
)
from mars_stack.kube_nodes import (
    CPU_NODES,
    DEFAULT_STORAGE_CLASS,
    GPU_NODE,
    GPU_RESOURCE,
    GPU_TAINT,
    KWOK_ANNOTATION,
    KwokNode,
    KwokNodes,
)
from mars_stack.settings import launcher_settings

__all__ = [
    "BIN_DIR",
    "CPU_NODES",
    "DEFAULT_STORAGE_CLASS",
    "GPU_NODE",
    "GPU_RESOURCE",
    "GPU_TAINT",
    "KUBERNETES_VERSION",
    "KWOK_ANNOTATION",
    "STAGES",
    "ClusterError",
    "KwokNode",
    "LocalCluster",
    "build",
    "built",
    "stop_processes",
    "wait_for",
]


class LocalCluster:
    """A Kubernetes control plane on loopback with kwok nodes; `kubeconfig` is its admin kubeconfig."""

    def __init__(
        self,
        nodes: tuple[KwokNode, ...] = (*CPU_NODES, GPU_NODE),
        volumes: int = 4,
        workdir: Path | None = None,
        held_components: tuple[str, ...] = (),
        address: str = "127.0.0.1",
    ) -> None:
        """`held_components`: pods labelled app.kubernetes.io/component=<one of them> become Running but are
        never completed by kwok; whoever holds them (a test playing the kubelet) finishes them.
        `address`: where the API server listens and what it advertises. Loopback (the default) serves kwok's
        nodes; a real node's pods reach the API server through the `kubernetes` Service, whose endpoint is
        this address, so for them it must be one they can route to (the node's, mars_stack.node_net)."""
        self._initial_nodes = nodes
        self.volumes = volumes
        self.held_components = held_components
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="mars-kube-"))
        self.logdir = self.workdir / "logs"
        self.kubeconfig = self.workdir / "kubeconfig"
        self._configuration: Any = None
        self.address = address
        self.control_plane = ControlPlane(
            self.workdir, self.logdir, self.kubeconfig, address, held_components
        )
        self._kwok_nodes = KwokNodes(self.api_client, self.logdir / "kwok.log")

    @property
    def server(self) -> str:
        return self.control_plane.server

    @property
    def ports(self) -> dict[str, int]:
        """Each component's port by name ("etcd", "kube-apiserver", "kwok", ...)."""
        return self.control_plane.ports

    @property
    def pki(self) -> KubePKI:
        return self.control_plane.pki

    @property
    def nodes(self) -> tuple[KwokNode, ...]:
        """The nodes registered so far."""
        return self._kwok_nodes.registered

    def start(self, progress: Callable[[str], None] = lambda _: None) -> LocalCluster:
        if not built():
            build(progress)
        self.logdir.mkdir(parents=True, exist_ok=True)
        try:
            self.control_plane.start(progress)
            progress("registering kwok nodes and volumes")
            for node in self._initial_nodes:
                self.add_node(node)
            self._kwok_nodes.add_storage(self.volumes)
            self.wait_nodes_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every component (controllers first, etcd last); the workdir goes too when it was ours."""
        self.control_plane.stop()
        if self._own_workdir and not launcher_settings().keep_kube_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the API -------------------------------------------------------------------------------------

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient with the admin credentials (the kubeconfig is read once)."""
        from kubernetes import client, config

        if self._configuration is None:
            self._configuration = client.Configuration()
            config.load_kube_config(
                config_file=str(self.kubeconfig), client_configuration=self._configuration
            )
        return client.ApiClient(self._configuration)

    def run_mars(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        """`mars ARGS` (this environment's CLI) against this cluster's kubeconfig, with none of the calling
        shell's MARS_* settings (a test's tools see only what they are given)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARS_")}
        env.update(KUBECONFIG=str(self.kubeconfig), COLUMNS="200")
        return subprocess.run(
            [str(Path(sys.executable).parent / "mars"), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )

    def add_node(self, node: KwokNode) -> None:
        """Register a node for kwok to play; `nodes` and wait_nodes_ready then count it."""
        self._kwok_nodes.add(node)

    def remove_node(self, name: str) -> None:
        """Delete a node (e.g. the GPU node, so vLLM has nowhere to go); missing is no error."""
        self._kwok_nodes.remove(name)

    def wait_nodes_ready(self, timeout_s: float = 60.0) -> None:
        self._kwok_nodes.wait_ready(timeout_s)
