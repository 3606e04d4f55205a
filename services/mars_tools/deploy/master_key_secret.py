"""`mars keys ensure-secret`: the chart's master key, made in the cluster once and never again.

A key minted while rendering the chart (Helm's `lookup` + `randBytes`) is new on every render that cannot
look the cluster up: `helm template`, and so every GitOps tool. Each sync would then ship a different master
key, and every sealed event and stored data key would stop opening. So the chart renders no key: a Job
(a Helm hook; under `helm template | kubectl apply` an ordinary Job, which works the same) runs this
command, which creates the Secret through the API server only if it does not exist, and leaves an existing
one alone, whatever made it. It never overwrites, so no render, sync or re-run can replace the key.

Talks to the API server with the pod's service account (in-cluster: KUBERNETES_SERVICE_HOST, the mounted
token and CA), over httpx: the image carries no Kubernetes client. `secret_manifest` and `ensure_secret`
are tested with an httpx mock transport.
"""

from __future__ import annotations

import base64
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from mars import sealing

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class SecretError(RuntimeError):
    """The API server refused or could not be reached; the message says what to fix."""


@dataclass(frozen=True)
class ApiServer:
    url: str
    token: str
    ca_file: str | bool
    namespace: str

    @classmethod
    def in_cluster(cls, namespace: str = "") -> ApiServer:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise SecretError("not in a cluster: KUBERNETES_SERVICE_HOST and _PORT are unset")
        try:
            token = (SA_DIR / "token").read_text().strip()
            own_namespace = (SA_DIR / "namespace").read_text().strip()
        except OSError as exc:
            raise SecretError(
                f"no service account token in {SA_DIR} ({exc.strerror}): the Job needs "
                "automountServiceAccountToken: true"
            ) from None
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", token, str(SA_DIR / "ca.crt"), namespace or own_namespace)


def secret_manifest(name: str, key: str, labels: dict[str, str]) -> dict[str, Any]:
    """A v1 Secret holding a new master key (32 random bytes, base64, as `mars keys master` prints it)."""
    text = sealing.master_key_text()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": labels},
        "type": "Opaque",
        "data": {key: base64.b64encode(text.encode()).decode()},
    }


def ensure_secret(
    api: ApiServer, name: str, key: str, labels: dict[str, str], transport: httpx.BaseTransport | None = None
) -> bool:
    """Create the master key Secret unless it exists; True when created now, False when one was there.
    An existing Secret without `key` is an error (something else took the name), never overwritten."""
    base = f"{api.url}/api/v1/namespaces/{api.namespace}/secrets"
    headers = {"Authorization": f"Bearer {api.token}"}
    verify = ssl.create_default_context(cafile=api.ca_file) if isinstance(api.ca_file, str) else api.ca_file
    with httpx.Client(verify=verify, transport=transport, timeout=30) as client:
        try:
            created = client.post(base, json=secret_manifest(name, key, labels), headers=headers)
            if created.status_code == 201:
                return True
            if created.status_code != 409:
                raise SecretError(_refusal("create", name, created))
            found = client.get(f"{base}/{name}", headers=headers)
        except httpx.HTTPError as exc:
            raise SecretError(
                f"cannot reach the API server at {api.url}: {type(exc).__name__}: {exc}"
            ) from None
    if found.status_code != 200:
        raise SecretError(_refusal("read", name, found))
    if key not in (found.json().get("data") or {}):
        raise SecretError(
            f"Secret {name} exists without the key {key!r}: it is not a MARS master key; it was left as it is "
            "(choose another eventSealing.key, or put the master key there)"
        )
    return False


def _refusal(verb: str, name: str, response: httpx.Response) -> str:
    try:
        detail = str(response.json().get("message", ""))[:300]
    except ValueError:
        detail = response.text[:300]
    return f"the API server refused to {verb} Secret {name}: HTTP {response.status_code} {detail}"
