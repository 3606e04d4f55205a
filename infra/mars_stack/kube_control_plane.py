"""The local Kubernetes control plane's processes (mars_stack.kube): etcd, kube-apiserver,
kube-controller-manager and kube-scheduler built from the Go modules (`infra/k8s/build.sh`), and kwok
playing the nodes, on free loopback ports with a fresh CA and an admin kubeconfig."""

from __future__ import annotations

import base64
import signal
import ssl
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mars_stack.certs import KubePKI, make_kube_pki
from mars_stack.kube_nodes import KWOK_ANNOTATION
from mars_stack.readiness import free_port, wait_until

K8S_DIR = Path(__file__).resolve().parents[2] / "infra" / "k8s"
BIN_DIR = K8S_DIR / "bin"
STAGES = K8S_DIR / "stages.yaml"
KUBERNETES_VERSION = "v1.37.2"
SERVICE_CIDR = "10.96.0.0/16"


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


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


class ControlPlane:
    """Starts the components in order (etcd, the API server, then the controllers and kwok, which need it)
    with their output in `logdir/<name>.log`, and stops them in reverse. `address` is where the API server
    listens and what it advertises; `held_components` are left for kwok not to complete (LocalCluster)."""

    def __init__(
        self, workdir: Path, logdir: Path, kubeconfig: Path, address: str, held_components: tuple[str, ...]
    ) -> None:
        self.workdir = workdir
        self.logdir = logdir
        self.kubeconfig = kubeconfig
        self.address = address
        self.held_components = held_components
        self.ports: dict[str, int] = {}
        self._procs: list[_Proc] = []
        self._pki: KubePKI | None = None

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.ports['kube-apiserver']}"

    @property
    def pki(self) -> KubePKI:
        if self._pki is None:
            raise ClusterError("the cluster's certificates are not made yet")
        return self._pki

    def start(self, progress: Callable[[str], None]) -> None:
        self._pki = make_kube_pki(self.workdir / "pki", extra_hosts=(self.address,))
        self.ports["kube-apiserver"] = free_port()
        self._write_kubeconfig()
        progress("starting etcd")
        self._start_etcd()
        progress("starting kube-apiserver")
        self._start_apiserver()
        progress("starting the controller manager, the scheduler and kwok")
        self._start_controllers()

    def stop(self) -> None:
        """Stop every component, the last started first (controllers first, etcd last)."""
        stop_processes([proc.popen for proc in reversed(self._procs)])
        self._procs.clear()

    def kwok_stages(self) -> Path:
        """kwok's stages: infra/k8s's, or a copy whose pod-complete stage leaves `held_components` alone."""
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
        pki = self.pki
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
        pki = self.pki
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
        self._start_kwok(kubeconfig)
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

    def _start_kwok(self, kubeconfig: str) -> None:
        self.ports["kwok"] = free_port()
        self._spawn(
            "kwok",
            [
                str(BIN_DIR / "kwok"),
                f"--kubeconfig={kubeconfig}",
                f"--config={self.kwok_stages()}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
                "--node-lease-duration-seconds=40",
                "--cidr=10.244.0.0/16",
                "--node-ip=10.0.0.1",
                f"--server-address=127.0.0.1:{self.ports['kwok']}",
            ],
        )

    # --- the admin's credentials ---------------------------------------------------------------------

    def _ssl_context(self) -> ssl.SSLContext:
        pki = self.pki
        context = ssl.create_default_context(cafile=str(pki.ca))
        context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
        return context

    def _write_kubeconfig(self) -> None:
        pki = self.pki

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
