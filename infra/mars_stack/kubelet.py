"""A real node for the local control plane (infra/k8s): the upstream kubelet (`infra/k8s/build.sh
--kubelet`) over Debian's containerd and runc, with a CNI bridge, running images imported from podman's
store (no registry). Opt-in beside kwok's nodes: `RealNode(cluster).start()`.

What this sandbox needed, and why (found by running it; see charts/README.md):
- the hosts here mount cgroup v1, which kubelet v1.37 refuses unless `failCgroupV1: false`;
- lowering a process's oom_score_adj is denied, so the pause container (-998) failed in runc's nsexec
  until containerd's CRI `restrict_oom_score_adj` kept scores at containerd's own;
- the node IP cannot be loopback (the kubelet refuses it), so it is the host's first non-loopback address;
- the sandbox ("pause") image cannot be pulled: it is built from the image's own Debian base.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from mars_stack.kube import BIN_DIR, ClusterError, LocalCluster, stop_processes, wait_for
from mars_stack.stack import free_port

PAUSE_IMAGE = "localhost/mars-pause:local"
CNI_SUBNET = "10.88.0.0/16"
CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")


def missing() -> list[str]:
    """What a real node needs and this machine lacks (empty: it can run)."""
    needs = []
    if not (BIN_DIR / "kubelet").is_file():
        needs.append("the kubelet (infra/k8s/build.sh --kubelet)")
    for tool in ("containerd", "runc", "ctr", "podman"):
        if shutil.which(tool) is None:
            needs.append(tool)
    if not any(Path(d, "bridge").exists() for d in CNI_BIN_DIRS):
        needs.append("the CNI plugins (Debian containernetworking-plugins)")
    return needs


def host_ip() -> str:
    """The address the default route leaves from (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        return str(s.getsockname()[0])


class RealNode:
    """containerd + kubelet registered as `name` with the cluster; `images` are copied in from podman."""

    def __init__(self, cluster: LocalCluster, name: str = "real-0", images: tuple[str, ...] = ()) -> None:
        self.cluster = cluster
        self.name = name
        self.images = images
        self.workdir = Path(tempfile.mkdtemp(prefix="mars-node-", dir=cluster.workdir))
        self.socket = self.workdir / "containerd.sock"
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, base_image: str) -> RealNode:
        """`base_image`: a local podman image with `sleep` (the pause container is built on it)."""
        if needs := missing():
            raise ClusterError("a real node needs " + ", ".join(needs))
        try:
            self._start_containerd()
            self._import(self._pause_image(base_image))
            for image in self.images:
                self._import(image)
            self._start_kubelet()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop_processes(list(reversed(self._procs)), timeout_s=20)
        self._procs.clear()
        # The kubelet leaves its pods' containers to the runtime: stop them with it.
        subprocess.run(["pkill", "-f", f"containerd-shim-runc-v2 -namespace k8s.io -address {self.socket}"])
        unmount_below(self.workdir)

    def _spawn(self, name: str, args: list[str]) -> None:
        log = self.cluster.logdir / f"{name}.log"
        with log.open("ab") as out:
            self._procs.append(
                subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            )

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
                            "ipMasq": False,
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
            "resolvConf": "/etc/resolv.conf",
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
                f"--node-ip={host_ip()}",
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
