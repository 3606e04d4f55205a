"""TLS and mutual TLS on a real gRPC server bound the way every service binds its port (mars.tls.add_port)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from mars import tls
from mars.config import ServiceSettings
from mars_stack.certs import LocalCerts, make_local_ca


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> LocalCerts:
    return make_local_ca(tmp_path_factory.mktemp("ca"))


async def _serve(settings: ServiceSettings) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = tls.add_port(server, "127.0.0.1:0", settings)
    await server.start()
    return server, port


def _check(port: int, client_tls: tls.ClientTls) -> int:
    with tls.channel(f"127.0.0.1:{port}", client_tls) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


async def test_tls_server_answers_a_client_that_trusts_its_ca_and_no_plaintext_one(certs: LocalCerts) -> None:
    settings = ServiceSettings(tls_cert_file=str(certs.server_cert), tls_key_file=str(certs.server_key))
    server, port = await _serve(settings)
    try:
        serving = health_pb2.HealthCheckResponse.SERVING
        assert await asyncio.to_thread(_check, port, tls.ClientTls(ca_file=str(certs.ca))) == serving
        with pytest.raises(grpc.RpcError) as plain:
            await asyncio.to_thread(_check, port, tls.ClientTls())
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


async def test_mutual_tls_refuses_a_client_without_a_certificate(certs: LocalCerts) -> None:
    settings = ServiceSettings(
        tls_cert_file=str(certs.server_cert),
        tls_key_file=str(certs.server_key),
        tls_client_ca_file=str(certs.ca),
    )
    server, port = await _serve(settings)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            await asyncio.to_thread(_check, port, tls.ClientTls(ca_file=str(certs.ca)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with_cert = tls.ClientTls(str(certs.ca), str(certs.client_cert), str(certs.client_key))
        assert await asyncio.to_thread(_check, port, with_cert) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(None)


def test_plaintext_without_certificates_and_clear_errors_for_half_settings(tmp_path: Path) -> None:
    assert tls.server_credentials(ServiceSettings()) is None
    with pytest.raises(tls.TlsConfigError, match="set both or neither"):
        tls.server_credentials(ServiceSettings(tls_cert_file="/x.crt"))
    with pytest.raises(tls.TlsConfigError, match="MARS_TLS_CLIENT_CA_FILE"):
        tls.server_credentials(ServiceSettings(tls_client_ca_file="/ca.crt"))
    with pytest.raises(tls.TlsConfigError, match="cannot read it"):
        tls.server_credentials(
            ServiceSettings(tls_cert_file=str(tmp_path / "no.crt"), tls_key_file=str(tmp_path / "no.key"))
        )
    with pytest.raises(tls.TlsConfigError, match="go together"):
        tls.ClientTls(cert_file="/c.crt").credentials()
