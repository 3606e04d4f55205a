"""`mars keys ensure-secret` (mars_tools.deploy.master_key_secret): the master key Secret is created once and an
existing one is never replaced, against a stand-in API server (the request shapes Kubernetes documents)."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from mars import sealing
from mars_tools.deploy.master_key_secret import ApiServer, SecretError, ensure_secret, secret_manifest

API = ApiServer("https://kube.test:443", "sa-token", False, "mars")


class Cluster:
    """Secrets by name, answering POST (201 or 409) and GET (200 or 404) as the API server does."""

    def __init__(self, existing: dict[str, dict[str, str]] | None = None, refuse: int = 0) -> None:
        self.secrets = dict(existing or {})
        self.refuse = refuse
        self.calls: list[tuple[str, str]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.method, request.url.path))
        assert request.headers["Authorization"] == "Bearer sa-token"
        if self.refuse:
            return httpx.Response(self.refuse, json={"message": "secrets is forbidden: User cannot create"})
        if request.method == "POST":
            assert request.url.path == "/api/v1/namespaces/mars/secrets"
            body = json.loads(request.content)
            name = body["metadata"]["name"]
            if name in self.secrets:
                return httpx.Response(409, json={"message": "already exists"})
            self.secrets[name] = body["data"]
            return httpx.Response(201, json=body)
        name = request.url.path.rsplit("/", 1)[-1]
        if name not in self.secrets:
            return httpx.Response(404, json={"message": "not found"})
        return httpx.Response(200, json={"data": self.secrets[name]})


def test_the_manifest_holds_a_master_key_as_its_file_would() -> None:
    manifest = secret_manifest("mars-master-key", "master.key", {"app.kubernetes.io/part-of": "mars"})
    text = base64.b64decode(manifest["data"]["master.key"]).decode()
    assert len(sealing.parse_master_key(text)) == 32
    assert manifest["metadata"]["labels"] == {"app.kubernetes.io/part-of": "mars"}


def test_created_once_then_kept_never_replaced() -> None:
    cluster = Cluster()
    transport = httpx.MockTransport(cluster.handle)
    assert ensure_secret(API, "mars-master-key", "master.key", {}, transport) is True
    first = cluster.secrets["mars-master-key"]["master.key"]
    for _ in range(3):  # every later render, sync or re-run
        assert ensure_secret(API, "mars-master-key", "master.key", {}, transport) is False
    assert cluster.secrets["mars-master-key"]["master.key"] == first


def test_a_secret_of_that_name_without_the_key_is_left_alone_and_said() -> None:
    cluster = Cluster({"mars-master-key": {"other": "eA=="}})
    with pytest.raises(SecretError, match=r"exists without the key 'master\.key'"):
        ensure_secret(API, "mars-master-key", "master.key", {}, httpx.MockTransport(cluster.handle))
    assert cluster.secrets["mars-master-key"] == {"other": "eA=="}


def test_a_refusal_says_what_the_api_server_said() -> None:
    cluster = Cluster(refuse=403)
    with pytest.raises(
        SecretError, match=r"refused to create Secret mars-master-key: HTTP 403 secrets is forbidden"
    ):
        ensure_secret(API, "mars-master-key", "master.key", {}, httpx.MockTransport(cluster.handle))


def test_outside_a_cluster_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(SecretError, match="not in a cluster"):
        ApiServer.in_cluster()
