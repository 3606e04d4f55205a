"""A one-node Kubernetes that serves MARS for real: the local control plane (mars_stack.kube) on the node's
address, a real node (the kubelet over containerd, kube-proxy, CoreDNS: mars_stack.kubelet), and Kafka,
Postgres and the LLM stand-in as host processes on the node's address (mars_stack.stack), published to the
pods as Services without selectors in the `mars-infra` namespace:

    kafka.mars-infra.svc.cluster.local:9092      Apache Kafka (one KRaft broker)
    postgres.mars-infra.svc.cluster.local:5432   Postgres (the `mars` role, SCRAM password for pods)
    llm.mars-infra.svc.cluster.local:8080        the OpenAI-compatible stand-in LLM

`chart_values()` are the chart's values for that cluster: the defaults, with only the image, the GPU parts
(no vLLM: the state controller and the model pool on the stand-in), resource requests a 2-core node can
hold, and what a single broker needs (replication factor 1). Everything stays on this machine
(mars_stack.node_net). `make test-k8s-e2e` runs the chart on it (tests/k8s_e2e).
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mars import topology

from mars_stack import kube, kubelet, node_net
from mars_stack.settings import launcher_settings
from mars_stack.stack import LocalStack
from mars_stack.stack_settings import StackSettings

INFRA_NAMESPACE = "mars-infra"
KAFKA_SERVICE = f"kafka.{INFRA_NAMESPACE}.svc.{node_net.CLUSTER_DOMAIN}"
POSTGRES_SERVICE = f"postgres.{INFRA_NAMESPACE}.svc.{node_net.CLUSTER_DOMAIN}"
LLM_SERVICE = f"llm.{INFRA_NAMESPACE}.svc.{node_net.CLUSTER_DOMAIN}"
KAFKA_PORT, POSTGRES_PORT, LLM_PORT = 9092, 5432, 8080
#: A request small enough that every pod of the default release fits a 2-core node.
SMALL_REQUESTS = {"cpu": "10m", "memory": "64Mi"}


def missing() -> list[str]:
    """What this cluster needs and the machine lacks (empty: it can run)."""
    needs = kubelet.missing(services=True)
    if not kube.built():
        needs.append("the control plane (infra/k8s/build.sh)")
    return needs


class ServingCluster:
    """Network, control plane, infrastructure and the real node, started in that order and stopped in
    reverse. `image`: the MARS image in podman's store (`make image`), copied onto the node."""

    def __init__(
        self,
        image: str,
        base_image: str,
        workdir: Path | None = None,
        partitions: int = 12,
        standin_latency_ms: float = 20.0,
    ) -> None:
        self.image = image
        self.base_image = base_image
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="mars-serving-"))
        self.network = node_net.NodeNetwork()
        (self.workdir / "kube").mkdir(parents=True, exist_ok=True)
        self.cluster = kube.LocalCluster(
            nodes=(), address=self.network.address, workdir=self.workdir / "kube"
        )
        self.postgres_password = secrets.token_urlsafe(18)
        self.infra = LocalStack(
            StackSettings(
                workdir=self.workdir / "infra",
                partitions=partitions,
                services=(),
                llm="standin",
                standin_latency_ms=standin_latency_ms,
                host=self.network.address,
                postgres_clients=(node_net.POD_CIDR,),
                postgres_password=self.postgres_password,
                tenant="",
                identity=False,
                # The chart takes no per-service Kafka logins yet: the pods reach a plaintext broker.
                kafka_security="plaintext",
            )
        )
        self.node = kubelet.RealNode(self.cluster, images=(image,), network=self.network, services=True)
        self._started: list[Callable[[], None]] = []

    def start(self, progress: Callable[[str], None] = lambda _: None) -> ServingCluster:
        if needs := missing():
            raise kube.ClusterError("a serving cluster needs " + ", ".join(needs))
        try:
            progress(f"node network: {self.network.link} {self.network.address}, pods {node_net.POD_CIDR}")
            self.network.setup()
            self._started.append(self.network.teardown)
            progress("control plane on the node's address")
            self.cluster.start(progress)
            self._started.append(self.cluster.stop)
            progress("Kafka, Postgres and the stand-in LLM on the node's address")
            self.infra.start(progress)
            self._started.append(self.infra.stop)
            progress("the real node: containerd, the kubelet, kube-proxy, CoreDNS; images copied in")
            self.node.start(self.base_image)
            self._started.append(self.node.stop)
            self._publish_infra()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        while self._started:
            self._started.pop()()
        kubelet.unmount_below(self.workdir)
        if self._own_workdir and not launcher_settings().keep_kube_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ServingCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _publish_infra(self) -> None:
        address = self.network.address
        for name, port, target in (
            ("kafka", KAFKA_PORT, self.infra.ports["broker"]),
            ("postgres", POSTGRES_PORT, self.infra.ports["postgres"]),
            ("llm", LLM_PORT, self.infra.ports["llm"]),
        ):
            kubelet.publish_host_service(
                self.cluster, INFRA_NAMESPACE, name, address, [(name, port, target, "TCP")]
            )

    @property
    def postgres_dsn(self) -> str:
        """The host's way into the same database the pods use (loopback, trusted)."""
        return self.infra.env["MARS_POSTGRES_DSN"]

    def postgres_role_secrets(self, fullname: str = "mars") -> list[dict[str, Any]]:
        """The Secrets the chart's postgres.roles reads (<fullname>-postgres-<login>, key password), holding
        the passwords the node's Postgres roles were made with: what an operator creates before installing."""
        return [
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": f"{fullname}-postgres-{login}"},
                "stringData": {"password": password},
            }
            for login, password in sorted(self.infra.postgres_logins.items())
        ]

    @property
    def kafka_bootstrap(self) -> str:
        return self.infra.env["MARS_KAFKA_BOOTSTRAP"]

    def chart_values(self) -> dict[str, Any]:
        """The chart's values for this cluster: the defaults, overriding only what the module says."""
        repository, _, tag = self.image.rpartition(":")
        pool_arm = {
            "base_url": f"http://{LLM_SERVICE}:{LLM_PORT}/v1",
            "model": "standin",
            "context_window": 4096,
            "output_reserve": 256,
            "safety_margin": 128,
            "timeout_s": 30,
        }
        small = {"resources": {"requests": dict(SMALL_REQUESTS)}}
        return {
            "image": {"repository": repository, "tag": tag},
            "kafka": {
                "bootstrapServers": f"{KAFKA_SERVICE}:{KAFKA_PORT}",
                "replicationFactor": 1,
                # The node's broker is plaintext (no KafkaUser operator here to make the logins' Secrets).
                "securityProtocol": "PLAINTEXT",
                "allowPlaintext": True,
            },
            # The node's Postgres has no TLS: sslmode prefer, which NOTES lists as an insecure default.
            "postgres": {
                "host": POSTGRES_SERVICE,
                "port": POSTGRES_PORT,
                "password": self.postgres_password,
                "sslMode": "prefer",
            },
            "vllm": {"enabled": False},
            "state": {
                "qtmBackend": "openai",
                "qtmUrl": f"http://{LLM_SERVICE}:{LLM_PORT}/v1",
                "qtmModel": "standin",
            },
            "modelPool": [
                {"name": "standin-short", **pool_arm, "input_price_per_m": 0.05, "output_price_per_m": 0.10},
                {"name": "standin-long", **pool_arm, "input_price_per_m": 0.35, "output_price_per_m": 0.40},
            ],
            "services": {name: small for name in topology.NAMES},
            "gateway": small,
        }
