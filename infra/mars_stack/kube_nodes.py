"""What the local Kubernetes control plane (mars_stack.kube) schedules onto: the nodes kwok plays (CPU nodes
and a GPU node with `nvidia.com/gpu` capacity and the NVIDIA taint), registered as a kubelet would register
them, and a default StorageClass with pre-made volumes (static provisioning: the PV controller binds claims
as on a cluster without a provisioner)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars_stack.readiness import wait_until

#: Nodes kwok manages carry this annotation (kwok --manage-nodes-with-annotation-selector).
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
GPU_RESOURCE = "nvidia.com/gpu"
#: The taint GPU node pools carry (GKE, the GPU Operator's guidance); the chart's vLLM pods tolerate it.
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
DEFAULT_STORAGE_CLASS = "local"


@dataclass(frozen=True)
class KwokNode:
    """A node kwok plays: its capacity, labels and taints, as a kubelet would register it."""

    name: str
    cpu: str = "16"
    memory: str = "64Gi"
    gpus: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict[str, str], ...] = ()

    def manifest(self) -> dict[str, Any]:
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": "110", "ephemeral-storage": "500Gi"}
        if self.gpus:
            capacity[GPU_RESOURCE] = str(self.gpus)
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            **self.labels,
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels, "annotations": dict([KWOK_ANNOTATION])},
            "spec": {"taints": [dict(t) for t in self.taints]},
            "status": {"capacity": capacity, "allocatable": capacity},
        }


CPU_NODES = (KwokNode("cpu-0"), KwokNode("cpu-1"))
#: Labelled the way NVIDIA's GPU Feature Discovery labels a GPU node; the capacity is the device plugin's.
GPU_NODE = KwokNode(
    "gpu-0",
    cpu="32",
    memory="256Gi",
    gpus=1,
    labels={"nvidia.com/gpu.present": "true"},
    taints=(GPU_TAINT,),
)


class KwokNodes:
    """Registers nodes and volumes through the API server (`api_client` makes an admin client) and waits
    for kwok to make the nodes Ready (`kwok_log` goes into the timeout's message)."""

    def __init__(self, api_client: Callable[[], Any], kwok_log: Path) -> None:
        self._api_client = api_client
        self._kwok_log = kwok_log
        #: The nodes registered so far.
        self.registered: tuple[KwokNode, ...] = ()

    def add(self, node: KwokNode) -> None:
        """Register a node for kwok to play; `registered` and wait_ready then count it."""
        from kubernetes import client

        core: Any = client.CoreV1Api(self._api_client())  # the typed client takes plain manifests too
        core.create_node(node.manifest())
        self.registered = (*self.registered, node)

    def remove(self, name: str) -> None:
        """Delete a node and, at once, the pods bound to it (the pod garbage collector would take its time,
        and a node added again under the name would find them holding its resources); a node that is not
        there is no error."""
        from kubernetes import client
        from kubernetes.client import ApiException

        core: Any = client.CoreV1Api(self._api_client())
        try:
            core.delete_node(name)
        except ApiException as exc:
            if exc.status != 404:
                raise
        for pod in core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={name}").items:
            try:
                core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        self.registered = tuple(n for n in self.registered if n.name != name)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        from kubernetes import client

        core: Any = client.CoreV1Api(self._api_client())
        names = {n.name for n in self.registered}

        def ready() -> bool:
            ok = set()
            for node in core.list_node().items:
                conditions = {c.type: c.status for c in node.status.conditions or []}
                if conditions.get("Ready") == "True":
                    ok.add(node.metadata.name)
            return names <= ok

        wait_until(ready, timeout_s, "kwok nodes Ready", log=self._kwok_log)

    def add_storage(self, volumes: int) -> None:
        """A default StorageClass without a provisioner and `volumes` PersistentVolumes in it: claims bind
        as on a cluster whose volumes an administrator made (the PV controller, no kubelet)."""
        from kubernetes import client

        api = self._api_client()
        storage: Any = client.StorageV1Api(api)
        storage.create_storage_class(
            {
                "apiVersion": "storage.k8s.io/v1",
                "kind": "StorageClass",
                "metadata": {
                    "name": DEFAULT_STORAGE_CLASS,
                    "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
                },
                "provisioner": "kubernetes.io/no-provisioner",
                "volumeBindingMode": "Immediate",
                "reclaimPolicy": "Retain",
            }
        )
        core: Any = client.CoreV1Api(api)
        for i in range(volumes):
            core.create_persistent_volume(
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolume",
                    "metadata": {"name": f"local-pv-{i}"},
                    "spec": {
                        "capacity": {"storage": "200Gi"},
                        "accessModes": ["ReadWriteOnce"],
                        "persistentVolumeReclaimPolicy": "Retain",
                        "storageClassName": DEFAULT_STORAGE_CLASS,
                        "hostPath": {"path": f"/var/lib/mars-local/pv-{i}"},
                    },
                }
            )
