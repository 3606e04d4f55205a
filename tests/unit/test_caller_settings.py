"""Caller settings (TLS and service identity) and the tools' defaults come from typed settings models."""

from __future__ import annotations

import argparse

import pytest
from mars.config import CallerSettings
from mars.identity import CallerIdentity, IdentityConfigError
from mars.tls import ClientTls
from mars_tools.send_cli import caller_args


def test_caller_settings_of_a_mapping_ignore_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_TLS_CA_FILE", "/process/ca.pem")
    given = CallerSettings.from_env({"MARS_TLS_CLIENT_CERT_FILE": "/c.pem", "MARS_TLS_CLIENT_KEY_FILE": "/k.pem"})
    assert (given.tls_ca_file, given.tls_client_cert_file, given.tls_client_key_file) == ("", "/c.pem", "/k.pem")
    assert CallerSettings.from_env().tls_ca_file == "/process/ca.pem"
    assert ClientTls.from_env({"MARS_TLS_CA_FILE": "/ca.pem"}) == ClientTls("/ca.pem", "", "")
    assert ClientTls.from_env().ca_file == "/process/ca.pem"


def test_an_identity_needs_both_files_and_none_is_none() -> None:
    assert CallerIdentity.from_env({}) is None
    with pytest.raises(IdentityConfigError, match="go together"):
        CallerIdentity.from_env({"MARS_IDENTITY_CERT_FILE": "/only-the-cert.pem"})


def test_tool_defaults_come_from_the_settings_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_INGRESS_ADDR", "10.0.0.7:443")
    monkeypatch.setenv("MARS_TENANT", "acme")
    parser = argparse.ArgumentParser()
    caller_args(parser, "demo")
    args = parser.parse_args([])
    assert (args.target, args.tenant, args.api_key) == ("10.0.0.7:443", "acme", "")
    assert parser.parse_args(["--tenant", "other"]).tenant == "other"
