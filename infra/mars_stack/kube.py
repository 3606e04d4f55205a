"""A local Kubernetes control plane (infra/k8s), the chart's test cluster: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler built from the Go modules (`infra/k8s/build.sh`), with kwok
playing the nodes.

`LocalCluster` starts them on free loopback ports with a fresh CA and an admin kubeconfig, registers kwok
nodes (CPU nodes and one GPU node with `nvidia.com/gpu` capacity and the NVIDIA taint), a default
StorageClass with pre-made volumes (static provisioning: the PV controller binds claims as on a cluster
without a provisioner), and stops it all again. Nothing runs a container: kwok's stages make a scheduled
pod Running and Ready and a Job's pod Succeeded, so Deployments become Available and Helm hooks complete.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mars_stack.certs import KubePKI, make_kube_pki
from mars_stack.settings import launcher_settings
from mars_stack.stack import free_port, wait_until

K8S_DIR = Path(__file__).resolve().parents[2] / "infra" / "k8s"
BIN_DIR = K8S_DIR / "bin"
STAGES = K8S_DIR / "stages.yaml"
KUBERNETES_VERSION = "v1.37.2"
SERVICE_CIDR = "10.96.0.0/16"
#: Nodes kwok manages carry this annotation (kwok --manage-nodes-with-annotation-selector).
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
GPU_RESOURCE = "nvidia.com/gpu"
#: The taint GPU node pools carry (GKE, the GPU Operator's guidance); the chart's vLLM pods tolerate it.
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
DEFAULT_STORAGE_CLASS = "local"


class ClusterError(RuntimeError):
    """The local control plane could not be built or started."""


def build(progress: Callable[[str], None] = lambda _: None) -> None:
    """Build the binaries (infra/k8s/build.sh: a few seconds when cached, several minutes cold)."""
    progress("building the local Kubernetes control plane (infra/k8s/build.sh)")
    done = subprocess.run([str(K8S_DIR / "build.sh")], capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"infra/k8s/build.sh failed:\n{(done.stdout + done.stderr)[-3000:]}")


def built() -> bool:
    return (BIN_DIR / "cluster").is_file() and (BIN_DIR / "kwok").is_file()


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


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


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
        #: The nodes registered so far.
        self.nodes: tuple[KwokNode, ...] = ()
        self.volumes = volumes
        self.held_components = held_components
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="mars-kube-"))
        self.logdir = self.workdir / "logs"
        self.kubeconfig = self.workdir / "kubeconfig"
        self.ports: dict[str, int] = {}
        self._procs: list[_Proc] = []
        self._pki: KubePKI | None = None
        self._configuration: Any = None
        self.address = address

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.ports['kube-apiserver']}"

    def start(self, progress: Callable[[str], None] = lambda _: None) -> LocalCluster:
        if not built():
            build(progress)
        self.logdir.mkdir(parents=True, exist_ok=True)
        try:
            self._pki = make_kube_pki(self.workdir / "pki", extra_hosts=(self.address,))
            self.ports["kube-apiserver"] = free_port()
            self._write_kubeconfig()
            progress("starting etcd")
            self._start_etcd()
            progress("starting kube-apiserver")
            self._start_apiserver()
            progress("starting the controller manager, the scheduler and kwok")
            self._start_controllers()
            progress("registering kwok nodes and volumes")
            for node in self._initial_nodes:
                self.add_node(node)
            self._add_storage()
            self.wait_nodes_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every component (controllers first, etcd last); the workdir goes too when it was ours."""
        stop_processes([proc.popen for proc in reversed(self._procs)])
        self._procs.clear()
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
        from kubernetes import client

        core: Any = client.CoreV1Api(self.api_client())  # the typed client takes plain manifests too
        core.create_node(node.manifest())
        self.nodes = (*self.nodes, node)

    def wait_nodes_ready(self, timeout_s: float = 60.0) -> None:
        from kubernetes import client

        core: Any = client.CoreV1Api(self.api_client())
        names = {n.name for n in self.nodes}

        def ready() -> bool:
            ok = set()
            for node in core.list_node().items:
                conditions = {c.type: c.status for c in node.status.conditions or []}
                if conditions.get("Ready") == "True":
                    ok.add(node.metadata.name)
            return names <= ok

        wait_until(ready, timeout_s, "kwok nodes Ready", log=self.logdir / "kwok.log")

    # --- the components ------------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> _Proc:
        log = self.logdir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        proc = _Proc(name, popen, log)
        self._procs.append(proc)
        return proc

    def _start_etcd(self) -> None:
        client_port, peer_port = free_port(), free_port()
        self.ports["etcd"] = client_port
        peer = f"http://127.0.0.1:{peer_port}"
        proc = self._spawn(
            "etcd",
            [
                str(BIN_DIR / "cluster"),
                "etcd",
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{client_port}",
                f"--advertise-client-urls=http://127.0.0.1:{client_port}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--unsafe-no-fsync",  # a throwaway test cluster: durability costs seconds per install
                "--log-level=warn",
            ],
        )
        import httpx

        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{client_port}/health", timeout=1).status_code == 200,
            30,
            "etcd",
            proc.popen,
            proc.log,
        )

    def _start_apiserver(self) -> None:
        pki = self._require_pki()
        port = self.ports["kube-apiserver"]
        proc = self._spawn(
            "kube-apiserver",
            [
                str(BIN_DIR / "cluster"),
                "kube-apiserver",
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                f"--bind-address={self.address}",
                f"--advertise-address={self.address}",
                f"--secure-port={port}",
                f"--tls-cert-file={pki.apiserver_cert}",
                f"--tls-private-key-file={pki.apiserver_key}",
                f"--client-ca-file={pki.ca}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                # On loopback the default reconciler would publish 127.0.0.1 as the kubernetes Service's
                # endpoint, which the API refuses; on a node address it publishes that, for pods to use.
                f"--endpoint-reconciler-type={'none' if self.address == '127.0.0.1' else 'lease'}",
                "--profiling=false",
                # Node names need not resolve (kwok's never do): reach a real kubelet by its address.
                "--kubelet-preferred-address-types=InternalIP,Hostname",
            ],
        )
        context = self._ssl_context()
        import httpx

        wait_until(
            lambda: httpx.get(f"{self.server}/readyz", verify=context, timeout=2).status_code == 200,
            90,
            "kube-apiserver",
            proc.popen,
            proc.log,
        )

    def _start_controllers(self) -> None:
        pki = self._require_pki()
        kubeconfig = str(self.kubeconfig)
        delegated = [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
        ]
        self.ports["kube-controller-manager"] = free_port()
        self._spawn(
            "kube-controller-manager",
            [
                str(BIN_DIR / "cluster"),
                "kube-controller-manager",
                *delegated,
                f"--secure-port={self.ports['kube-controller-manager']}",
                f"--root-ca-file={pki.ca}",
                f"--service-account-private-key-file={pki.service_account_key}",
                "--use-service-account-credentials=true",
            ],
        )
        self.ports["kube-scheduler"] = free_port()
        self._spawn(
            "kube-scheduler",
            [
                str(BIN_DIR / "cluster"),
                "kube-scheduler",
                *delegated,
                f"--secure-port={self.ports['kube-scheduler']}",
            ],
        )
        self.ports["kwok"] = free_port()
        self._spawn(
            "kwok",
            [
                str(BIN_DIR / "kwok"),
                f"--kubeconfig={kubeconfig}",
                f"--config={self._stages()}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
                "--node-lease-duration-seconds=40",
                "--cidr=10.244.0.0/16",
                "--node-ip=10.0.0.1",
                f"--server-address=127.0.0.1:{self.ports['kwok']}",
            ],
        )
        import httpx

        # Their serving certificates are self-signed (no --tls-cert-file): only liveness is checked here.
        for name in ("kube-controller-manager", "kube-scheduler"):
            proc = next(p for p in self._procs if p.name == name)
            url = f"https://127.0.0.1:{self.ports[name]}/healthz"
            wait_until(
                lambda url=url: httpx.get(url, verify=False, timeout=2).status_code == 200,  # type: ignore[misc]
                60,
                name,
                proc.popen,
                proc.log,
            )

    def _stages(self) -> Path:
        if not self.held_components:
            return STAGES
        stages = list(yaml.safe_load_all(STAGES.read_text()))
        for stage in stages:
            if stage["metadata"]["name"] == "pod-complete":
                stage["spec"]["selector"]["matchExpressions"].append(
                    {
                        "key": '.metadata.labels["app.kubernetes.io/component"]',
                        "operator": "NotIn",
                        "values": list(self.held_components),
                    }
                )
        path = self.workdir / "stages.yaml"
        path.write_text(yaml.safe_dump_all(stages))
        return path

    def _add_storage(self) -> None:
        """A default StorageClass without a provisioner and `volumes` PersistentVolumes in it: claims bind
        as on a cluster whose volumes an administrator made (the PV controller, no kubelet)."""
        from kubernetes import client

        api = self.api_client()
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
        for i in range(self.volumes):
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

    # --- credentials ---------------------------------------------------------------------------------

    @property
    def pki(self) -> KubePKI:
        return self._require_pki()

    def _require_pki(self) -> KubePKI:
        if self._pki is None:
            raise ClusterError("the cluster's certificates are not made yet")
        return self._pki

    def _ssl_context(self) -> ssl.SSLContext:
        pki = self._require_pki()
        context = ssl.create_default_context(cafile=str(pki.ca))
        context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
        return context

    def _write_kubeconfig(self) -> None:
        pki = self._require_pki()

        def data(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "mars-local",
                    "cluster": {"server": self.server, "certificate-authority-data": data(pki.ca)},
                }
            ],
            "users": [
                {
                    "name": "mars-admin",
                    "user": {
                        "client-certificate-data": data(pki.admin_cert),
                        "client-key-data": data(pki.admin_key),
                    },
                }
            ],
            "contexts": [{"name": "mars-local", "context": {"cluster": "mars-local", "user": "mars-admin"}}],
            "current-context": "mars-local",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.kubeconfig.chmod(0o600)


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout_s: float = 15.0) -> None:
    """SIGTERM each running process in turn and wait for it; one that outlives `timeout_s` is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(
    check: Callable[[], Any],
    timeout_s: float,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> Any:
    """Poll `check` until it returns something truthy (returned), or ClusterError after `timeout_s`, or at
    once when `proc` exits first (with the tail of its `log`)."""
    return wait_until(check, timeout_s, what, proc, log, every_s=0.25, error=ClusterError)
