"""The Kafka launcher's pure parts: broker choice, Java version parsing, the KRaft config."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from mars_stack import kafka


def _fake_java(tmp_path: Path, version_line: str) -> str:
    script = tmp_path / "java"
    script.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.parametrize(
    ("line", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_392"', 8),
        ("no version here", None),
    ],
)
def test_java_major_reads_the_version_line(tmp_path: Path, line: str, major: int | None) -> None:
    assert kafka.java_major(_fake_java(tmp_path, line)) == major


def test_choose_broker_honours_the_request_and_rejects_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MARS_BROKER", raising=False)
    assert kafka.choose_broker("tansu") == "tansu"
    monkeypatch.setenv("MARS_BROKER", "kafka")
    assert kafka.choose_broker() == "kafka"
    with pytest.raises(ValueError, match="MARS_BROKER must be one of"):
        kafka.choose_broker("redpanda")


def test_choose_broker_falls_back_to_tansu_without_java(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MARS_BROKER", raising=False)
    monkeypatch.setenv("MARS_JAVA", "/nonexistent/java")
    assert kafka.choose_broker() == "tansu"


def test_server_properties_is_one_kraft_node_on_loopback(tmp_path: Path) -> None:
    props = dict(
        line.split("=", 1) for line in kafka.server_properties(tmp_path / "data", 9092, 9093, 6).splitlines()
    )
    assert props["process.roles"] == "broker,controller"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:9093"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:9092"
    assert props["log.dirs"] == str(tmp_path / "data")
    assert props["num.partitions"] == "6"
    assert props["auto.create.topics.enable"] == "false"


def test_extra_server_properties_override_the_defaults(tmp_path: Path) -> None:
    extra = kafka.parse_server_properties(" num.io.threads=2, num.partitions = 1 ,")
    assert extra == {"num.io.threads": "2", "num.partitions": "1"}
    text = kafka.server_properties(tmp_path / "data", 9092, 9093, 6, extra=extra)
    props = dict(line.split("=", 1) for line in text.splitlines())
    assert (props["num.io.threads"], props["num.partitions"]) == ("2", "1")
    assert [line for line in text.splitlines() if line.startswith("num.partitions=")] == ["num.partitions=1"]
    for bad in ("num.io.threads", "=2"):
        with pytest.raises(kafka.KafkaUnavailable, match="is not key=value"):
            kafka.parse_server_properties(bad)


def test_cluster_ids_are_kafka_uuids_never_read_as_options() -> None:
    ids = {kafka.cluster_id() for _ in range(500)}
    assert len(ids) == 500 and all(len(i) == 22 and not i.startswith("-") for i in ids)


def test_the_launcher_reads_its_environment_through_one_settings_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mars_stack.settings import launcher_settings

    for name in ("MARS_KAFKA_HEAP", "MARS_KAFKA_JVM_OPTS", "MARS_KAFKA_LIBS", "MARS_KEEP_STACK"):
        monkeypatch.delenv(name, raising=False)
    defaults = launcher_settings()
    assert (defaults.kafka_heap, defaults.kafka_jvm_opts, defaults.keep_stack) == ("512m", None, False)
    assert kafka.libs_dir() == kafka.DEFAULT_LIBS
    monkeypatch.setenv("MARS_KAFKA_LIBS", str(tmp_path))
    monkeypatch.setenv("MARS_KEEP_STACK", "1")
    monkeypatch.setenv("MARS_KAFKA_JVM_OPTS", "")  # set but empty: no extra options, not the defaults
    assert kafka.libs_dir() == tmp_path
    assert launcher_settings().keep_stack is True
    assert launcher_settings().kafka_jvm_opts == ""
