"""`mars deploy status` and `mars deploy replay-job`: a Helm release of MARS seen from the command line.

Kubernetes access follows kubectl: the in-cluster service account inside a pod, else the kubeconfig
(KUBECONFIG or ~/.kube/config) and its current context, or --context.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from rich.markup import escape

from mars_tools.terminal import console

#: Where a pod finds its own namespace.
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class KubeError(Exception):
    """No usable cluster configuration; the message says what was tried."""


def load_kube(context: str | None) -> str:
    """Configure the kubernetes client; the namespace kubectl would default to. Reads local files only."""
    try:
        from kubernetes import config
    except ImportError:
        raise KubeError("the kubernetes client is not installed: pip install 'mars[deploy]'") from None

    if os.environ.get("KUBERNETES_SERVICE_HOST") and context is None:
        config.load_incluster_config()
        return SA_NAMESPACE.read_text().strip() if SA_NAMESPACE.exists() else "default"
    try:
        config.load_kube_config(context=context)
        _, active = config.list_kube_config_contexts()
    except Exception as exc:  # no file, no such context: say what to fix
        raise KubeError(
            f"no Kubernetes configuration ({type(exc).__name__}: {exc}); set KUBECONFIG or --context"
        ) from None
    if context is not None:
        contexts, _ = config.list_kube_config_contexts()
        active = next((c for c in contexts if c["name"] == context), active)
    return str((active or {}).get("context", {}).get("namespace") or "default")


def cmd_status(args: argparse.Namespace) -> int:
    from mars.kafka_options import kafka_client_options

    from mars_tools.admin_cli import SettingsError, load_settings
    from mars_tools.deploy.lag import TopicLag, fetch_lag
    from mars_tools.deploy.status import (
        WaitingPod,
        all_ready,
        lag_table,
        list_waiting_pods,
        list_workloads,
        status_json,
        waiting_table,
        workload_table,
    )

    try:
        namespace = load_kube(args.context)  # configures the client too
    except KubeError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    from kubernetes import client

    namespace = args.namespace or namespace
    try:
        workloads = list_workloads(client.AppsV1Api(), namespace, args.release)
        # Only when something is not ready: then why (e.g. the scheduler's verdict) is the question.
        waiting: list[WaitingPod] = []
        if not all_ready(workloads):
            waiting = list_waiting_pods(client.CoreV1Api(), namespace, args.release)
    except client.ApiException as exc:
        console.print(f"[red]the API server refused: {exc.status} {exc.reason}[/]")
        return 2

    lags: list[TopicLag] | None = None
    lag_error: str | None = None
    if not args.no_lag:
        try:
            settings = load_settings(kafka_bootstrap=args.bootstrap, topic_prefix=args.topic_prefix)
            lags = asyncio.run(
                asyncio.wait_for(
                    fetch_lag(kafka_client_options(settings), settings.topic_prefix), args.kafka_timeout_s
                )
            )
        except (SettingsError, ValueError) as exc:
            lag_error = str(exc)
        except Exception as exc:  # the broker may be reachable only from inside the cluster
            lag_error = f"cannot read lag from Kafka: {type(exc).__name__}: {exc}"

    ready = all_ready(workloads)
    if args.output == "json":
        print(json.dumps(status_json(namespace, args.release, workloads, lags, lag_error, waiting), indent=2))
    else:
        console.print(f"release [bold]{args.release}[/] in namespace [bold]{namespace}[/]")
        if workloads:
            console.print(workload_table(workloads))
        else:
            console.print(
                f"[red]no Deployments or StatefulSets labelled app.kubernetes.io/instance={args.release} "
                "in this namespace[/]"
            )
        if waiting:
            console.print(waiting_table(waiting))
        if lags is not None:
            console.print(lag_table(lags))
        elif lag_error:
            console.print(f"[yellow]{lag_error}[/] (--no-lag skips it)")
    return 0 if ready else 3


def cmd_replay_job(args: argparse.Namespace) -> int:
    import yaml

    from mars_tools.deploy.replay_job import ReplayJob, create_job, replay_job_manifest

    replay_args = list(args.replay_args)
    if replay_args[:1] == ["--"]:
        replay_args = replay_args[1:]
    replay_args = replay_args or ["read"]
    # Check the replay command line here, not minutes later in a pod.
    from mars_tools.replay.cli import add_replay_parser

    parser = argparse.ArgumentParser(prog="mars")
    add_replay_parser(parser.add_subparsers(dest="command", required=True))
    try:
        parser.parse_args(["replay", *replay_args])
    except SystemExit:
        console.print(f"[red]`mars replay {' '.join(replay_args)}` is not a valid replay command line[/]")
        return 2
    try:
        # Printing needs no cluster, only the namespace kubectl would use; --apply needs the credentials.
        namespace = load_kube(args.context)
    except KubeError as exc:
        if args.apply:
            console.print(f"[red]{escape(str(exc))}[/]")
            return 2
        namespace = "default"
    namespace = args.namespace or namespace
    job = ReplayJob(
        release=args.release,
        namespace=namespace,
        image=args.image,
        replay_args=tuple(replay_args),
        fullname_override=args.fullname_override,
        name=args.name,
        image_pull_policy=args.image_pull_policy,
        service_account=args.service_account,
        kafka_password_secret=args.kafka_password_secret,
        kafka_shared_login=args.kafka_shared_login,
        postgres_role_login=not args.postgres_shared_login,
        postgres_role_prefix=args.postgres_role_prefix,
        kafka_ca_secret=args.kafka_ca_secret,
        identity_secret=args.identity_secret,
        postgres_ca_secret=args.postgres_ca_secret,
        postgres_ca_key=args.postgres_ca_key,
        pvc=args.pvc,
        backoff_limit=args.backoff_limit,
        ttl_seconds_after_finished=args.ttl_s,
        active_deadline_seconds=args.deadline_s,
    )
    try:
        manifest = replay_job_manifest(job, datetime.now(UTC))
    except ValueError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    if not args.apply:
        sys.stdout.write(yaml.safe_dump(manifest, sort_keys=False))
        return 0
    from kubernetes import client

    try:
        name = create_job(client.BatchV1Api(), manifest)
    except client.ApiException as exc:
        console.print(f"[red]the API server refused the Job: {exc.status} {exc.reason}: {exc.body}[/]")
        return 1
    console.print(f"job.batch/{name} created in {namespace}")
    console.print(f"follow it: kubectl logs -f job/{name} -n {namespace}")
    return 0


def add_deploy_parser(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    """Register `mars deploy`; its sub-parsers, for more `mars deploy ...` commands."""
    deploy = sub.add_parser(
        "deploy",
        help="a MARS release on Kubernetes: status, replay Jobs",
        description="Works with a Helm release of charts/mars. Cluster access as kubectl: in-cluster "
        "credentials in a pod, else KUBECONFIG / ~/.kube/config and its current context.",
    )
    deploy_sub = deploy.add_subparsers(dest="deploy_cmd", required=True)

    _add_status_parser(deploy_sub)
    _add_replay_job_parser(deploy_sub)
    return deploy_sub


def _release_args(p: argparse.ArgumentParser) -> None:
    """--release, --namespace and --context: which release, where."""
    p.add_argument("--release", default="mars", help="the Helm release name (default mars)")
    p.add_argument(
        "--namespace", "-n", help="its namespace (default: the kube context's namespace, else default)"
    )
    p.add_argument("--context", help="kubeconfig context (default: the current one)")



def _add_status_parser(deploy_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = deploy_sub.add_parser(
        "status",
        help="each workload's ready/desired replicas and each stage consumer group's lag",
        description="Lists the release's Deployments and StatefulSets (labels app.kubernetes.io/instance="
        "<release>, app.kubernetes.io/part-of=mars) with ready, up-to-date and available replicas; when one "
        "is not ready, its pods that wait and why (the scheduler's verdict, such as Insufficient "
        "nvidia.com/gpu, or a container's waiting reason); then the lag of every stage consumer group on each "
        "topic it reads (committed offsets against end offsets, "
        "from Kafka: MARS_KAFKA_BOOTSTRAP and the MARS_KAFKA_* security settings, or --bootstrap). Exit 0 "
        "when every workload is ready, 3 when one is not (or none was found), 2 when the cluster could not "
        "be asked. Lag does not change the exit code.",
    )
    _release_args(p)
    p.add_argument("--bootstrap", help="Kafka bootstrap servers for the lag (default: MARS_KAFKA_BOOTSTRAP)")
    p.add_argument("--topic-prefix", help="the release's topic prefix (default: MARS_TOPIC_PREFIX)")
    p.add_argument("--no-lag", action="store_true", help="skip the lag (Kafka not reachable from here)")
    p.add_argument(
        "--kafka-timeout-s", type=float, default=15.0, help="give up on Kafka after this long (default 15)"
    )
    p.add_argument(
        "--output", "-o", choices=("table", "json"), default="table", help="table (default) or json"
    )
    p.set_defaults(func=cmd_status)


def _add_replay_job_parser(deploy_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = deploy_sub.add_parser(
        "replay-job",
        help="a Job that runs `mars replay ...` beside the release (prints its YAML; --apply creates it)",
        description="Builds a batch/v1 Job running `mars replay REPLAY_ARGS` (default: read) in --image, "
        "with the release's settings: envFrom the <fullname>-env ConfigMap, MARS_KAFKA_SASL_PASSWORD and "
        "PGPASSWORD from the <fullname>-secrets Secret (optional), the Kafka CA Secret at "
        "/etc/mars/kafka-tls. <fullname> is the chart's: the release name when it contains 'mars', else "
        "<release>-mars. Non-root, read-only root filesystem, no capabilities, RuntimeDefault seccomp, "
        "a writable /tmp. Without --apply the YAML goes to stdout (kubectl apply -f -). The replay summary "
        "is in the Job's log; files must go to a --pvc (mounted at /data) to outlive the pod. Example: "
        "mars deploy replay-job --image reg/mars:1.0 --pvc replay-data -- export --out /data/log.jsonl",
    )
    _release_args(p)
    p.add_argument("--image", required=True, help="the MARS image (the release's, e.g. registry/mars:0.1.0)")
    p.add_argument(
        "--apply", action="store_true", help="create the Job in the cluster instead of printing it"
    )
    p.add_argument("--name", default="", help="the Job's name (default <fullname>-replay-<UTC time>)")
    p.add_argument(
        "--fullname-override", default="", help="the chart's fullnameOverride, if the release set one"
    )
    p.add_argument("--image-pull-policy", default="IfNotPresent", choices=("Always", "IfNotPresent", "Never"))
    p.add_argument(
        "--service-account", default="", help="pod service account (default: the namespace's default)"
    )
    p.add_argument(
        "--kafka-password-secret",
        default="",
        help="with --kafka-shared-login: Secret holding key kafka-password (the chart's kafka.sasl.existingSecret; "
        "default <fullname>-secrets)",
    )
    p.add_argument(
        "--kafka-shared-login",
        action="store_true",
        help="the release has one Kafka login for everything (kafka.sasl.perService=false); default: the tools' "
        "own, <fullname>-kafka-operator, password from the Secret of that name",
    )
    p.add_argument(
        "--postgres-shared-login",
        action="store_true",
        help="the release has one Postgres login for everything (postgres.roles.enabled=false); default: the "
        "tools' role, <prefix>_operator, password from the Secret <fullname>-postgres-operator",
    )
    p.add_argument(
        "--postgres-role-prefix", default="mars", help="the release's postgres.roles.prefix (default mars)"
    )
    p.add_argument(
        "--kafka-ca-secret", default="", help="Secret with the brokers' CA (the chart's kafka.tls.caSecret)"
    )
    p.add_argument(
        "--postgres-ca-secret",
        default="",
        help="Secret with the Postgres server's CA (the chart's postgres.caSecret)",
    )
    p.add_argument("--postgres-ca-key", default="ca.crt", help="its key (the chart's postgres.caKey)")
    p.add_argument(
        "--identity-secret",
        default=None,
        help="Secret with the replay tool's service identity (default: the chart's <fullname>-identity-replay; "
        "'' for a release without identities)",
    )
    p.add_argument("--pvc", default="", help="PersistentVolumeClaim to mount at /data for output files")
    p.add_argument("--backoff-limit", type=int, default=0, help="retries of a failed pod (default 0)")
    p.add_argument(
        "--ttl-s", type=int, default=86_400, help="delete the finished Job after this long (default 1 day)"
    )
    p.add_argument(
        "--deadline-s", type=int, default=3_600, help="stop the Job after this long (default 1 hour)"
    )
    p.add_argument(
        "replay_args",
        nargs=argparse.REMAINDER,
        metavar="-- REPLAY_ARGS",
        help="arguments of `mars replay` after --, e.g. -- read --since-ms 1700000000000 (default: read)",
    )
    p.set_defaults(func=cmd_replay_job)
