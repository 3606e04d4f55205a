"""`mars kube build` and `mars kube up`: the local Kubernetes control plane of infra/k8s (etcd,
kube-apiserver, kube-controller-manager and kube-scheduler v1.37 built from the Go modules, kwok nodes), to
try the chart against a real API server on a laptop. `up` runs in the foreground until Ctrl-C."""

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
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # `kill` stops it as cleanly as Ctrl-C
    try:
        while not stop.wait(1):
            pass
    except KeyboardInterrupt:
        pass
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
