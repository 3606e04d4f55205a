"""`mars kube build`, `mars kube up` and `mars kube serve`: the local Kubernetes control plane of infra/k8s
(etcd, kube-apiserver, kube-controller-manager and kube-scheduler v1.37 built from the Go modules), with kwok
nodes (`up`: try the chart against a real API server) or one real node that runs the pods, with Kafka,
Postgres and the stand-in LLM behind Services (`serve`: MARS answering turns in Kubernetes on a laptop).
Both run in the foreground until Ctrl-C."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import threading

from rich.markup import escape

from mars_tools.terminal import console


def cmd_build(args: argparse.Namespace) -> int:
    from mars_stack import kube

    try:
        with console.status("building the control plane (cold: about ten minutes)"):
            kube.build()
    except kube.ClusterError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 1
    console.print(f"[green]built[/] in {kube.BIN_DIR}")
    return 0


def _until_stopped() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # `kill` stops it as cleanly as Ctrl-C
    try:
        while not stop.wait(1):
            pass
    except KeyboardInterrupt:
        pass


def cmd_serve(args: argparse.Namespace) -> int:
    import json
    import os

    from mars_stack import kube, kubelet, serving_cluster

    if os.geteuid() != 0:
        console.print("[red]a real node needs root (network links, iptables, containerd)[/]")
        return 2
    needs = serving_cluster.missing()
    if needs:
        console.print(
            f"[red]missing: {escape(', '.join(needs))}[/] (make test-k8s-e2e installs and builds them)"
        )
        return 2
    if not kubelet.podman_has(args.image):
        console.print(
            f"[red]the image {escape(args.image)} is not in podman's store: make image builds it[/]"
        )
        return 2
    cluster = serving_cluster.ServingCluster(
        args.image, kubelet.base_image(args.image), partitions=args.partitions
    )
    try:
        with console.status("starting the cluster") as status:
            cluster.start(progress=lambda msg: status.update(msg))
    except (kube.ClusterError, OSError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 1
    values = cluster.workdir / "values.json"
    values.write_text(json.dumps(cluster.chart_values(), indent=2))
    values.chmod(0o600)  # it holds the Postgres password
    console.print(
        f"[green]Kubernetes {kube.KUBERNETES_VERSION} with a real node up[/] (logs in {cluster.cluster.logdir})"
    )
    console.print(f"  export KUBECONFIG={cluster.cluster.kubeconfig}")
    console.print(f"  helm install mars charts/mars -n mars --create-namespace -f {values}")
    console.print(f"  then an API key: mars tenant create demo --postgres-dsn {cluster.postgres_dsn}")
    console.print(
        "  and turns through the ingress Service: mars send --target <its ClusterIP>:50051 --api-key KEY "
        "--tenant demo 'hello' (kubectl -n mars get svc mars-ingress)"
    )
    console.print("[bold]Ctrl-C stops it and removes its files, links and rules[/]")
    try:
        _until_stopped()
    finally:
        console.print("stopping the cluster")
        cluster.stop()
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from mars_stack import kube

    nodes = tuple(kube.KwokNode(f"cpu-{i}") for i in range(args.cpu_nodes))
    nodes += tuple(dataclasses.replace(kube.GPU_NODE, name=f"gpu-{i}") for i in range(args.gpu_nodes))
    cluster = kube.LocalCluster(nodes=nodes, volumes=args.volumes)
    try:
        with console.status("starting the local Kubernetes control plane") as status:
            cluster.start(progress=lambda msg: status.update(msg))
    except kube.ClusterError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 1
    console.print(
        f"[green]Kubernetes {kube.KUBERNETES_VERSION} up[/] at {cluster.server} (logs in {cluster.logdir})"
    )
    console.print(
        f"  nodes: {', '.join(n.name for n in nodes)}; default StorageClass {kube.DEFAULT_STORAGE_CLASS}"
    )
    console.print(f"  export KUBECONFIG={cluster.kubeconfig}")
    console.print("[bold]Ctrl-C stops it and removes its files[/]")
    try:
        _until_stopped()
    finally:
        console.print("stopping the control plane")
        cluster.stop()
    return 0


def add_kube_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    kube = sub.add_parser(
        "kube",
        help="a local Kubernetes control plane to install the chart on (infra/k8s)",
        description="A real Kubernetes v1.37 API server, controller manager and scheduler with etcd, built "
        "from the Go module proxy (needs Go >= 1.26; cached in infra/k8s/bin), and kwok nodes that make "
        "scheduled pods Running and Ready and Jobs complete without running containers.",
    )
    kube_sub = kube.add_subparsers(dest="kube", required=True)
    p = kube_sub.add_parser("build", help="build the binaries (a stamp check when already built)")
    p.set_defaults(func=cmd_build)
    p = kube_sub.add_parser(
        "up",
        help="start the control plane in the foreground and print its KUBECONFIG",
        description="Starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok on free "
        "loopback ports with a fresh CA, registers the nodes and a default StorageClass with pre-made "
        "volumes, prints `export KUBECONFIG=...`, and runs until Ctrl-C. Example: mars kube up, then in "
        "another shell: helm install mars charts/mars --set kafka.bootstrapServers=k:9092 --set "
        "postgres.host=pg.",
    )
    p.add_argument("--cpu-nodes", type=int, default=2, help="CPU nodes (default 2)")
    p.add_argument("--gpu-nodes", type=int, default=1, help="nodes with one nvidia.com/gpu each (default 1)")
    p.add_argument("--volumes", type=int, default=4, help="PersistentVolumes to pre-make (default 4)")
    p.set_defaults(func=cmd_up)
    p = kube_sub.add_parser(
        "serve",
        help="the control plane with one real node that runs the pods, and Kafka, Postgres and an LLM stand-in",
        description="As root: the control plane on a node address of its own (10.89.0.1 on a link it makes), "
        "the upstream kubelet over containerd, kube-proxy and CoreDNS (infra/k8s/build.sh --e2e), and Kafka, "
        "Postgres and the stand-in LLM as Services in namespace mars-infra; writes the chart values for it "
        "(the image, no vLLM, small requests) and prints how to install the chart. Everything stays on this "
        "machine. Runs until Ctrl-C, then removes what it made (links, iptables rules, containers).",
    )
    p.add_argument("--image", default="localhost/mars:latest", help="the MARS image in podman's store")
    p.add_argument("--partitions", type=int, default=12, help="partitions of the local broker (default 12)")
    p.set_defaults(func=cmd_serve)
