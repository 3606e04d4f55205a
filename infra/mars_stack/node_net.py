"""The network of the local cluster's real node (mars_stack.kubelet), all of it on this machine.

- The node's address sits on a link the run makes (`mars-node0`, 10.89.0.1/32: a bridge with no ports,
  which does what a dummy link would; this kernel has no dummy driver), never on the machine's own
  interface: the kubelet registers it, the API server listens there for the pods, and the
  host processes the pods use (Kafka, Postgres, the LLM stand-in, CoreDNS) listen there too.
- Pods live on the CNI bridge (`mars0`, 10.88.0.0/16, the bridge plugin's gateway 10.88.0.1).
- The Service range (10.96.0.0/16) is routed into that portless link, which drops whatever reaches it: a
  ClusterIP is only ever reached through kube-proxy's DNAT, and a packet for one without rules goes
  nowhere, instead of following the default route off the machine.
- A guard chain in FORWARD rejects anything a pod sends to an address outside the pod network (what is on
  this machine is delivered locally, not forwarded), so no pod packet leaves the machine.

`NodeNetwork.setup()` first removes what an earlier run that died may have left (a second run on the same
machine starts clean); `teardown()` removes the link, the bridge, the guard and kube-proxy's rules.
Needs root and `ip`/`iptables` (Debian's iproute2 and iptables).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

NODE_LINK = "mars-node0"
NODE_ADDRESS = "10.89.0.1"
BRIDGE = "mars0"
POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
#: The cluster DNS Service's address (the kubelet's clusterDNS): kube-proxy sends it to CoreDNS.
DNS_SERVICE_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
GUARD_CHAIN = "MARS-NODE-GUARD"
_FORWARD_SYSCTL = Path("/proc/sys/net/ipv4/ip_forward")


class NetworkError(RuntimeError):
    """The node's network could not be made (not root, no iproute2 or iptables)."""


def missing() -> list[str]:
    """What the node's network needs and this machine lacks."""
    needs = [
        tool for tool in ("ip", "iptables", "iptables-restore", "conntrack") if shutil.which(tool) is None
    ]
    if not _FORWARD_SYSCTL.exists():
        needs.append("an IPv4 stack with forwarding")
    return needs


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkError(f"{' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


@dataclass
class NodeNetwork:
    """The node's link and address, the Service route, forwarding and the guard."""

    address: str = NODE_ADDRESS
    link: str = NODE_LINK
    pod_cidr: str = POD_CIDR
    service_cidr: str = SERVICE_CIDR
    _forwarding_was: str = ""

    def setup(self) -> NodeNetwork:
        if needs := missing():
            raise NetworkError("the node's network needs " + ", ".join(needs))
        self.teardown()  # what a run that died left behind
        self._forwarding_was = _FORWARD_SYSCTL.read_text().strip()
        try:
            _run("ip", "link", "add", self.link, "type", "bridge")
            _run("ip", "addr", "add", f"{self.address}/32", "dev", self.link)
            _run("ip", "link", "set", self.link, "up")
            _run("ip", "route", "add", self.service_cidr, "dev", self.link)
            _run("iptables", "-w", "-N", GUARD_CHAIN)
            _run(
                "iptables", "-w", "-A", GUARD_CHAIN, "-s", self.pod_cidr, "-d", self.pod_cidr, "-j", "RETURN"
            )
            _run(
                "iptables", "-w", "-A", GUARD_CHAIN, "-s", self.pod_cidr, "-j", "REJECT",
                "--reject-with", "icmp-net-unreachable",
            )  # fmt: skip
            _run("iptables", "-w", "-I", "FORWARD", "1", "-j", GUARD_CHAIN)
            # Pod -> ClusterIP -> pod is routed through the host (the bridge plugin turns it on too).
            _FORWARD_SYSCTL.write_text("1\n")
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> None:
        """Remove the link (its routes go with it), the pods' bridge, the guard and kube-proxy's chains;
        each step is skipped where there is nothing to remove."""
        _run("ip", "link", "del", self.link, check=False)
        _run("ip", "link", "del", BRIDGE, check=False)
        while _run("iptables", "-w", "-D", "FORWARD", "-j", GUARD_CHAIN, check=False).returncode == 0:
            pass
        _run("iptables", "-w", "-F", GUARD_CHAIN, check=False)
        _run("iptables", "-w", "-X", GUARD_CHAIN, check=False)
        remove_kube_proxy_rules()
        if self._forwarding_was:
            _FORWARD_SYSCTL.write_text(self._forwarding_was + "\n")
            self._forwarding_was = ""

    def __enter__(self) -> NodeNetwork:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.teardown()


def remove_kube_proxy_rules() -> None:
    """Delete every KUBE-* chain and the jumps into them from the filter and nat tables (what
    `kube-proxy --cleanup` does, without needing its binary or a config)."""
    for table in ("filter", "nat", "mangle"):
        listed = _run("iptables-save", "-t", table, check=False)
        if listed.returncode != 0 or "KUBE-" not in listed.stdout:
            continue
        kept: list[str] = []
        for line in listed.stdout.splitlines():
            if line.startswith(":KUBE-") or (line.startswith("-A") and "KUBE-" in line):
                continue
            kept.append(line)
        restored = subprocess.run(
            ["iptables-restore", "-w"], input="\n".join(kept) + "\n", capture_output=True, text=True
        )
        if restored.returncode != 0:
            raise NetworkError(f"iptables-restore ({table}): {restored.stderr.strip()}")
