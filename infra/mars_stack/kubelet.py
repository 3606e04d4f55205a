"""A real node for the local control plane (infra/k8s): the upstream kubelet (`infra/k8s/build.sh
--kubelet`) over Debian's containerd and runc, with a CNI bridge, running images imported from podman's
store (no registry). Opt-in beside kwok's nodes: `RealNode(cluster).start()`.

With `services=True` (`infra/k8s/build.sh --e2e` builds them) the node also runs what makes Services work
as on any cluster: kube-proxy (iptables mode) and CoreDNS as the cluster DNS (`kube-dns` in kube-system,
the kubelet's clusterDNS), serving `*.svc.cluster.local` from the API server. The node's address and the
pods' network are mars_stack.node_net's, all on this machine.

What this sandbox needed, and why (found by running it; see charts/README.md):
- the hosts here mount cgroup v1, which kubelet v1.37 refuses unless `failCgroupV1: false`;
- lowering a process's oom_score_adj is denied, so the pause container (-998) failed in runc's nsexec
  until containerd's CRI `restrict_oom_score_adj` kept scores at containerd's own;
- the node IP cannot be loopback (the kubelet refuses it), so it sits on a link of its own (node_net);
- the sandbox ("pause") image cannot be pulled: it is built from the image's own Debian base.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from mars_stack import node_net
from mars_stack.kube import LocalCluster
from mars_stack.kube_control_plane import BIN_DIR, ClusterError, stop_processes, wait_for
from mars_stack.readiness import free_port

PAUSE_IMAGE = "localhost/mars-pause:local"
CNI_SUBNET = node_net.POD_CIDR
CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
#: What `services=True` adds (infra/k8s/build.sh --e2e).
SERVICE_BINARIES = ("kube-proxy", "coredns")


def missing(services: bool = False) -> list[str]:
    """What a real node needs and this machine lacks (empty: it can run)."""
    needs = []
    if not (BIN_DIR / "kubelet").is_file():
        needs.append("the kubelet (infra/k8s/build.sh --kubelet)")
    if services:
        needs += [f"{b} (infra/k8s/build.sh --e2e)" for b in SERVICE_BINARIES if not (BIN_DIR / b).is_file()]
    for tool in ("containerd", "runc", "ctr", "podman"):
        if shutil.which(tool) is None:
            needs.append(tool)
    if not any(Path(d, "bridge").exists() for d in CNI_BIN_DIRS):
        needs.append("the CNI plugins (Debian containernetworking-plugins)")
    return needs + node_net.missing()


def podman_has(image: str) -> bool:
    """Whether podman's store holds `image` (the node copies images in from there)."""
    return subprocess.run(["podman", "image", "exists", image], capture_output=True).returncode == 0


def base_image(fallback: str) -> str:
    """The MARS image's Debian base when podman has it (small to import; the pause container is built on
    it), else `fallback` (the image itself)."""
    listed = subprocess.run(
        ["podman", "images", "--format", "{{.Repository}}:{{.Tag}}", "localhost/mars-base"],
        capture_output=True,
        text=True,
    )
    bases = [line for line in listed.stdout.split() if line.startswith("localhost/mars-base:")]
    return bases[0] if bases else fallback


class RealNode:
    """containerd + kubelet registered as `name` with the cluster; `images` are copied in from podman.

    `network`: the node's network (node_net), made by the caller when the API server must listen on the
    node's address for the pods (LocalCluster(address=...)); None: the node makes and removes its own.
    `services`: also run kube-proxy and CoreDNS, so Services and their names work for the pods."""

    def __init__(
        self,
        cluster: LocalCluster,
        name: str = "real-0",
        images: tuple[str, ...] = (),
        network: node_net.NodeNetwork | None = None,
        services: bool = False,
    ) -> None:
        self.cluster = cluster
        self.name = name
        self.images = images
        self.services = services
        self._own_network = network is None
        self.network = network or node_net.NodeNetwork()
        self.workdir = Path(tempfile.mkdtemp(prefix="mars-node-", dir=cluster.workdir))
        self.socket = self.workdir / "containerd.sock"
        self._procs: list[subprocess.Popen[bytes]] = []
        self.ports: dict[str, int] = {}

    @property
    def address(self) -> str:
        return self.network.address

    def start(self, base_image: str) -> RealNode:
        """`base_image`: a local podman image with `sleep` (the pause container is built on it)."""
        if needs := missing(self.services):
            raise ClusterError("a real node needs " + ", ".join(needs))
        try:
            if self._own_network:
                self.network.setup()
            self._start_containerd()
            self._import(self._pause_image(base_image))
            for image in self.images:
                self._import(image)
            self._start_kubelet()
            if self.services:
                self._start_kube_proxy()
                self._start_cluster_dns()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_processes(list(reversed(self._procs)), timeout_s=20)
        self._procs.clear()
        self._kill_containers()
        unmount_below(self.workdir)
        if self._own_network:
            self.network.teardown()
        else:
            node_net.remove_kube_proxy_rules()

    def _kill_containers(self) -> None:
        """The kubelet and containerd leave the pods' containers running under their shims: kill each
        container's first process (its PID namespace goes with it), then the shim."""
        pattern = f"containerd-shim-runc-v2 -namespace k8s.io .*-address {self.socket}"
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        shims = found.stdout.split()
        for shim in shims:
            subprocess.run(["pkill", "-KILL", "-P", shim], capture_output=True)
        for shim in shims:
            subprocess.run(["kill", "-KILL", shim], capture_output=True)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = self.cluster.logdir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._procs.append(popen)
        return popen

    def _start_containerd(self) -> None:
        cni_bin = next(d for d in CNI_BIN_DIRS if Path(d, "bridge").exists())
        cni_conf = self.workdir / "cni"
        cni_conf.mkdir()
        (cni_conf / "10-mars.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "mars-local",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": "mars0",
                            "isGateway": True,
                            # Pods route Service addresses through the host (kube-proxy's rules); what
                            # is not on this machine is refused there (node_net's guard).
                            "isDefaultGateway": True,
                            "ipMasq": False,
                            # A pod reaching itself through its Service (kube-proxy masquerades that).
                            "hairpinMode": True,
                            "ipam": {"type": "host-local", "ranges": [[{"subnet": CNI_SUBNET}]]},
                        },
                        {"type": "loopback"},
                    ],
                }
            )
        )
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = f"""version = 2
root = "{self.workdir}/containerd/root"
state = "{self.workdir}/containerd/state"
[grpc]
  address = "{self.socket}"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"""
        (self.workdir / "containerd.toml").write_text(config)
        self._spawn("containerd", ["containerd", "--config", str(self.workdir / "containerd.toml")])
        ctr = ["ctr", "--address", str(self.socket), "version"]
        wait_for(lambda: subprocess.run(ctr, capture_output=True).returncode == 0, 30, "containerd")

    def _pause_image(self, base_image: str) -> str:
        folder = self.workdir / "pause"
        folder.mkdir()
        (folder / "Containerfile").write_text(
            f'FROM {base_image}\nUSER 65535:65535\nCMD ["sleep", "infinity"]\n'
        )
        done = subprocess.run(
            ["podman", "build", "--network", "none", "-q", "-t", PAUSE_IMAGE, str(folder)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise ClusterError(f"podman could not build the pause image: {done.stderr[-1500:]}")
        return PAUSE_IMAGE

    def _import(self, image: str) -> None:
        """podman save | ctr import, into the CRI's namespace (k8s.io)."""
        archive = self.workdir / "image.tar"
        save = subprocess.run(
            ["podman", "save", "--format", "docker-archive", "-o", str(archive), image],
            capture_output=True,
            text=True,
        )
        if save.returncode != 0:
            raise ClusterError(f"podman save {image}: {save.stderr[-1500:]}")
        try:
            done = subprocess.run(
                ["ctr", "--address", str(self.socket), "-n", "k8s.io", "images", "import", str(archive)],
                capture_output=True,
                text=True,
            )
        finally:
            archive.unlink(missing_ok=True)
        if done.returncode != 0:
            raise ClusterError(f"ctr import {image}: {done.stderr[-1500:]}")

    def _start_kubelet(self) -> None:
        port = free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failSwapOn": False,
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": "0.0.0.0",
            "port": port,
            "readOnlyPort": 0,
            "healthzPort": free_port(),
            "healthzBindAddress": "127.0.0.1",
            # The API server reaches it with no client certificate: only this throwaway cluster's.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "evictionHard": {},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "localStorageCapacityIsolation": False,
            # Pods get the cluster DNS only: nothing of the machine's own resolver leaks into them.
            "resolvConf": str(self._empty_resolv_conf()),
            "clusterDomain": node_net.CLUSTER_DOMAIN,
            # The containers' logs go with the node's work folder, not into the machine's /var/log/pods.
            "podLogsDir": str(self.workdir / "pod-logs"),
            "clusterDNS": [node_net.DNS_SERVICE_IP] if self.services else [],
        }
        path = self.workdir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        self._spawn(
            "kubelet",
            [
                str(BIN_DIR / "kubelet"),
                f"--kubeconfig={self.cluster.kubeconfig}",
                f"--config={path}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.address}",
                f"--root-dir={self.workdir / 'kubelet'}",
                f"--cert-dir={self.workdir / 'kubelet-pki'}",
            ],
        )
        from kubernetes import client

        core: Any = client.CoreV1Api(self.cluster.api_client())

        def ready() -> bool:
            node = core.read_node(self.name)
            return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

        wait_for(ready, 60, f"the kubelet's node {self.name} Ready")

    def _empty_resolv_conf(self) -> Path:
        path = self.workdir / "resolv.conf"
        path.write_text("")
        return path

    def _start_kube_proxy(self) -> None:
        """kube-proxy in iptables mode for this node: ClusterIPs DNATed to endpoints, for the pods and for
        this machine's own processes (the tests' clients reach Services as pods do). Its conntrack sysctls
        are left as they are (maxPerCore 0); NodePorts only on the node's address."""
        health, metrics = free_port(), free_port()
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.cluster.kubeconfig)},
            "hostnameOverride": self.name,
            "bindAddress": self.address,
            "healthzBindAddress": f"127.0.0.1:{health}",
            "metricsBindAddress": f"127.0.0.1:{metrics}",
            "clusterCIDR": CNI_SUBNET,
            "mode": "iptables",
            "conntrack": {"maxPerCore": 0, "min": 0},
            "nodePortAddresses": [f"{self.address}/32"],
            "iptables": {"syncPeriod": "10s", "minSyncPeriod": "0s"},
        }
        path = self.workdir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        popen = self._spawn("kube-proxy", [str(BIN_DIR / "kube-proxy"), f"--config={path}", "--v=1"])
        self.ports["kube-proxy-metrics"] = metrics
        import httpx

        def healthy() -> bool:
            return httpx.get(f"http://127.0.0.1:{health}/healthz", timeout=2).status_code == 200

        wait_for(healthy, 60, "kube-proxy healthy", popen, self.cluster.logdir / "kube-proxy.log")

    def _start_cluster_dns(self) -> None:
        """CoreDNS on the node's address, answering for the cluster domain from the API server (and
        nothing else: no forwarder, so no query leaves the machine), published as kube-system/kube-dns."""
        ready, health = free_port(), free_port()
        corefile = self.workdir / "Corefile"
        corefile.write_text(
            f""".:53 {{
    bind {self.address}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes {node_net.CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {self.cluster.kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
    loadbalance
}}
"""
        )
        popen = self._spawn("coredns", [str(BIN_DIR / "coredns"), "-conf", str(corefile)])
        import httpx

        def serving() -> bool:
            return httpx.get(f"http://127.0.0.1:{ready}/ready", timeout=2).status_code == 200

        wait_for(serving, 60, "CoreDNS ready", popen, self.cluster.logdir / "coredns.log")
        publish_host_service(
            self.cluster,
            "kube-system",
            "kube-dns",
            self.address,
            [("dns", 53, 53, "UDP"), ("dns-tcp", 53, 53, "TCP")],
            cluster_ip=node_net.DNS_SERVICE_IP,
        )


def publish_host_service(
    cluster: LocalCluster,
    namespace: str,
    name: str,
    address: str,
    ports: list[tuple[str, int, int, str]],
    cluster_ip: str | None = None,
) -> None:
    """A Service without a selector whose one endpoint is a process of this machine at `address`: pods
    reach it by name and ClusterIP through kube-proxy, as any Service. `ports`: (name, service port, the
    process's port, protocol)."""
    from kubernetes import client

    api = cluster.api_client()
    core: Any = client.CoreV1Api(api)
    discovery: Any = client.DiscoveryV1Api(api)
    if not any(ns.metadata.name == namespace for ns in core.list_namespace().items):
        core.create_namespace({"metadata": {"name": namespace}})
    spec: dict[str, Any] = {
        "ports": [
            {"name": n, "port": port, "targetPort": target, "protocol": proto}
            for n, port, target, proto in ports
        ]
    }
    if cluster_ip:
        spec["clusterIP"] = cluster_ip
    core.create_namespaced_service(namespace, {"metadata": {"name": name}, "spec": spec})
    discovery.create_namespaced_endpoint_slice(
        namespace,
        {
            "metadata": {"name": f"{name}-host", "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [{"name": n, "port": target, "protocol": proto} for n, _, target, proto in ports],
        },
    )


def unmount_below(folder: Path) -> None:
    """Lazily unmount what the kubelet and containerd mounted under `folder` (the kubelet bind-mounts its
    root onto itself; volumes and container root filesystems hang below), deepest first, so it can go."""
    prefix = str(folder.resolve())
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in sorted(
        {p for p in points if p == prefix or p.startswith(prefix + "/")}, key=len, reverse=True
    ):
        subprocess.run(["umount", "-l", point], capture_output=True)
