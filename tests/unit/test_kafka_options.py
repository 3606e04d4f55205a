"""Kafka security settings: the MARS_KAFKA_* names the chart sets, the checks at load, and the aiokafka
options every client is built with."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from mars.config import ServiceSettings
from mars.kafka_options import env_kafka_options, kafka_client_options
from pydantic import ValidationError

SECURITY_ENV = (
    "MARS_KAFKA_SECURITY_PROTOCOL",
    "MARS_KAFKA_SASL_MECHANISM",
    "MARS_KAFKA_SASL_USERNAME",
    "MARS_KAFKA_SASL_PASSWORD",
    "MARS_KAFKA_SSL_CAFILE",
    "MARS_KAFKA_SSL_CERTFILE",
    "MARS_KAFKA_SSL_KEYFILE",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*SECURITY_ENV, "MARS_KAFKA_BOOTSTRAP", "MARS_ENV_FILE"):
        monkeypatch.delenv(name, raising=False)


def ca_bundle() -> str:
    certifi = pytest.importorskip("certifi")
    return str(certifi.where())


def test_plaintext_is_the_default_and_adds_nothing() -> None:
    opts = kafka_client_options(ServiceSettings(kafka_bootstrap="k:9092"))
    assert opts == {"bootstrap_servers": "k:9092", "security_protocol": "PLAINTEXT"}


def test_bootstrap_can_be_overridden_by_a_tool_flag() -> None:
    opts = kafka_client_options(ServiceSettings(kafka_bootstrap="k:9092"), bootstrap="other:9093")
    assert opts["bootstrap_servers"] == "other:9093"


def test_env_names_are_the_ones_the_chart_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    ca = ca_bundle()
    monkeypatch.setenv("MARS_KAFKA_BOOTSTRAP", "b1:9093,b2:9093")
    monkeypatch.setenv("MARS_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("MARS_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("MARS_KAFKA_SASL_USERNAME", "mars")
    monkeypatch.setenv("MARS_KAFKA_SASL_PASSWORD", "s3cret")
    monkeypatch.setenv("MARS_KAFKA_SSL_CAFILE", ca)
    s = ServiceSettings()
    assert s.kafka_security_protocol == "SASL_SSL"
    assert s.kafka_sasl_mechanism == "SCRAM-SHA-512"
    assert s.kafka_sasl_username == "mars"
    assert s.kafka_sasl_password.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(s)  # never printed with the settings
    assert s.kafka_ssl_cafile == ca
    opts = env_kafka_options()
    assert opts["bootstrap_servers"] == "b1:9093,b2:9093"
    assert opts["security_protocol"] == "SASL_SSL"
    assert opts["sasl_mechanism"] == "SCRAM-SHA-512"
    assert opts["sasl_plain_username"] == "mars"
    assert opts["sasl_plain_password"] == "s3cret"
    context = opts["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_sasl_plaintext_logs_in_without_tls() -> None:
    s = ServiceSettings(
        kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_username="u", kafka_sasl_password="p"
    )
    opts = kafka_client_options(s)
    assert opts["sasl_mechanism"] == "PLAIN"
    assert (opts["sasl_plain_username"], opts["sasl_plain_password"]) == ("u", "p")
    assert "ssl_context" not in opts


def test_ssl_without_a_ca_file_trusts_the_system_cas() -> None:
    opts = kafka_client_options(ServiceSettings(kafka_security_protocol="SSL"))
    assert "sasl_mechanism" not in opts
    assert opts["ssl_context"].verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize("protocol", ["SASL_PLAINTEXT", "SASL_SSL"])
def test_sasl_without_a_username_is_refused_at_load(protocol: str) -> None:
    with pytest.raises(ValidationError, match="needs MARS_KAFKA_SASL_USERNAME"):
        ServiceSettings(kafka_security_protocol=protocol, kafka_sasl_password="p")


def test_sasl_without_a_password_is_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("MARS_KAFKA_SASL_USERNAME", "mars")
    with pytest.raises(ValidationError, match="needs MARS_KAFKA_SASL_PASSWORD"):
        ServiceSettings()


def test_unknown_protocol_or_mechanism_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_KAFKA_SECURITY_PROTOCOL", "TLS")
    with pytest.raises(ValidationError, match="kafka_security_protocol"):
        ServiceSettings()
    monkeypatch.setenv("MARS_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("MARS_KAFKA_SASL_MECHANISM", "GSSAPI")
    with pytest.raises(ValidationError, match="kafka_sasl_mechanism"):
        ServiceSettings(kafka_sasl_username="u", kafka_sasl_password="p")


def test_tls_files_without_tls_are_refused_rather_than_ignored() -> None:
    with pytest.raises(ValidationError, match=r"MARS_KAFKA_SSL_CAFILE set but .*PLAINTEXT uses no TLS"):
        ServiceSettings(kafka_ssl_cafile="/etc/ca.crt")


def test_a_key_without_its_certificate_is_refused() -> None:
    with pytest.raises(ValidationError, match="MARS_KAFKA_SSL_KEYFILE needs MARS_KAFKA_SSL_CERTFILE"):
        ServiceSettings(kafka_security_protocol="SSL", kafka_ssl_keyfile="/k.pem")


def test_a_missing_ca_file_names_its_variable(tmp_path: Path) -> None:
    s = ServiceSettings(kafka_security_protocol="SSL", kafka_ssl_cafile=str(tmp_path / "nope.crt"))
    with pytest.raises(ValueError, match=r"MARS_KAFKA_SSL_CAFILE=.*nope.crt: no such file"):
        kafka_client_options(s)


def test_a_file_that_is_no_certificate_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "ca.crt"
    bad.write_text("not a certificate\n")
    s = ServiceSettings(kafka_security_protocol="SSL", kafka_ssl_cafile=str(bad))
    with pytest.raises(ValueError, match="Kafka TLS files could not be loaded"):
        kafka_client_options(s)


def test_every_kafka_client_in_the_services_is_built_from_the_options() -> None:
    """No Kafka client in services/ may skip the security settings: each constructor call takes the
    options (`**kafka...`), none a bare bootstrap_servers= of its own."""
    root = Path(__file__).resolve().parents[2] / "services"
    offenders = []
    for path in root.rglob("*.py"):
        text = path.read_text()
        for ctor in ("AIOKafkaProducer(", "AIOKafkaConsumer(", "AIOKafkaAdminClient("):
            start = 0
            while (i := text.find(ctor, start)) >= 0:
                start = i + 1
                if text[i - 6 : i] in ("class ", "mport ") or text[i - 1] == "[":
                    continue
                call = text[i : i + 120]
                if "**" not in call.split(")")[0]:
                    offenders.append(f"{path.relative_to(root)}: {call.splitlines()[0]}")
    assert not offenders, offenders


def test_local_kafka_can_add_a_sasl_listener_for_tests(tmp_path: Path) -> None:
    from mars_stack import kafka

    props = dict(
        line.split("=", 1)
        for line in kafka.server_properties(tmp_path, 9092, 9093, 3, 9094, {"u1": "p1"}).splitlines()
    )
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:9092,SASL_PLAINTEXT://127.0.0.1:9094"
    assert props["inter.broker.listener.name"] == "PLAINTEXT"
    assert props["sasl.enabled.mechanisms"] == "PLAIN"
    assert 'user_u1="p1";' in props["listener.name.sasl_plaintext.plain.sasl.jaas.config"]
    with pytest.raises(ValueError, match="SASL users"):
        kafka.sasl_listener_properties(9094, {"u1": 'has"quote'})
