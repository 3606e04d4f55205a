"""Plays the kubelet for the chart's master-key Job: kwok leaves its pods Running (LocalCluster
held_components), and this runs their command for real, `mars keys ensure-secret` with the container's own
arguments, against the API server with a token of the pod's service account bound to the pod, then
reports the container's exit as a kubelet would. So the hook's Role is what is tested, not an admin's
rights."""

from __future__ import annotations

import threading
from typing import Any

from mars_stack.kube import LocalCluster
from mars_tools.cli import build_parser
from mars_tools.deploy.master_key_secret import ApiServer, SecretError, ensure_secret

COMPONENT = "master-key"


class MasterKeyKubelet:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.ran: list[tuple[str, str, bool | str]] = []  # (namespace, pod, created or the error)
        self._done: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> MasterKeyKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self.cluster.api_client())
        while not self._stop.wait(0.2):
            pods = core.list_pod_for_all_namespaces(
                label_selector=f"app.kubernetes.io/component={COMPONENT}"
            ).items
            for pod in pods:
                if pod.metadata.uid in self._done or pod.status.phase != "Running":
                    continue
                self._done.add(pod.metadata.uid)
                self._run(core, pod)

    def _run(self, core: Any, pod: Any) -> None:
        from kubernetes import client

        namespace, name = pod.metadata.namespace, pod.metadata.name
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[],
                expiration_seconds=600,
                bound_object_ref=client.V1BoundObjectReference(
                    kind="Pod", api_version="v1", name=name, uid=pod.metadata.uid
                ),
            )
        )
        token = core.create_namespaced_service_account_token(
            pod.spec.service_account_name, namespace, request
        ).status.token
        (container,) = pod.spec.containers
        args = build_parser().parse_args(list(container.args)[1:])  # container args start with "mars"
        api = ApiServer(self.cluster.server, token, str(self.cluster.pki.ca), args.namespace or namespace)
        outcome: bool | str
        try:
            outcome = ensure_secret(
                api, args.name, args.key, dict(label.split("=", 1) for label in args.label)
            )
            exit_code = 0
        except SecretError as exc:
            outcome, exit_code = str(exc), 1
        self.ran.append((namespace, name, outcome))
        now = pod.status.start_time
        state = {"terminated": {"exitCode": exit_code, "startedAt": now, "finishedAt": now}}
        core.patch_namespaced_pod_status(
            name,
            namespace,
            {
                "status": {
                    "phase": "Succeeded" if exit_code == 0 else "Failed",
                    "containerStatuses": [
                        {
                            "name": container.name,
                            "image": container.image,
                            "ready": False,
                            "restartCount": 0,
                            "state": state,
                        }
                    ],
                }
            },
        )
