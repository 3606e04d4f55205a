"""The local broker's launcher (infra/kafka/launcher/FormatAndServe.java, mars_stack.kafka.ensure_launcher):
the broker's own JVM formats its log dir, once, and the file that handed it the SCRAM passwords does not
outlive the start; a Java without javac, or MARS_KAFKA_FORMAT_IN_BROKER=false, formats in a JVM of its own,
as before."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import broker_only, require_kafka
from mars_stack import LocalStack, kafka

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def launched_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with broker_only(tmp_path_factory.mktemp("format") / "stack") as stack:  # SASL_SSL: SCRAM from the format
        yield stack


def _broker_cmd(stack: LocalStack) -> list[str]:
    return next(p.cmd for p in stack.procs if p.name == "broker")


def test_the_broker_formats_its_own_log_dir_and_leaves_no_passwords_behind(
    launched_broker: LocalStack,
) -> None:
    cmd = _broker_cmd(launched_broker)
    assert kafka.LAUNCHER_CLASS in cmd and "kafka.Kafka" not in cmd
    data = launched_broker.workdir / "kafka"
    assert (data / "data" / "meta.properties").exists()
    assert not (data / "format.args").exists()  # read and deleted: it held every service's SCRAM password
    # The services' SCRAM logins, which the format writes, are test_kafka_acls's (its broker starts so too).


def test_a_restart_serves_the_formatted_log_dir_without_formatting_it_again(tmp_path: Path) -> None:
    require_kafka()
    libs = kafka.ensure_kafka_libs()
    java = kafka.local_java()
    if kafka.ensure_launcher(java, libs) is None:
        pytest.skip(
            "no javac beside this Java (a JRE, not a JDK): the launcher cannot be compiled, so brokers "
            "here format in a JVM of their own and there is no in-broker format to test"
        )
    config = tmp_path / "kafka" / "server.properties"
    cmd = kafka.prepare(tmp_path, 1, 2, 1, java)
    args_file = Path(cmd[-2])
    assert cmd[-4:] == [kafka.LAUNCHER_CLASS, str(tmp_path / "kafka" / "data" / "meta.properties"),
                        str(args_file), str(config)]  # fmt: skip
    assert args_file.stat().st_mode & 0o077 == 0 and "format" in args_file.read_text().splitlines()
    # A log dir formatted already (a restart): no arguments are written, the launcher formats nothing.
    args_file.unlink()
    (tmp_path / "kafka" / "data").mkdir(parents=True)
    (tmp_path / "kafka" / "data" / "meta.properties").write_text("version=1\n")
    kafka.prepare(tmp_path, 1, 2, 1, java)
    assert not args_file.exists()


def test_without_javac_or_when_turned_off_a_jvm_of_its_own_formats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_kafka()
    libs = kafka.ensure_kafka_libs()
    jre = tmp_path / "jre" / "bin"
    jre.mkdir(parents=True)
    real = Path(shutil.which("java") or "java").resolve()
    (jre / "java").write_text(f'#!/bin/sh\nexec {real} "$@"\n')  # a java with no javac beside it
    (jre / "java").chmod(0o755)
    assert kafka.ensure_launcher(str(jre / "java"), libs) is None
    monkeypatch.setenv("MARS_KAFKA_FORMAT_IN_BROKER", "false")
    assert kafka.ensure_launcher(kafka.local_java(), libs) is None
    cmd = kafka.prepare(tmp_path, 1, 2, 1, kafka.local_java())
    assert cmd[-2:] == ["kafka.Kafka", str(tmp_path / "kafka" / "server.properties")]
    assert (tmp_path / "kafka" / "data" / "meta.properties").exists()  # formatted before the broker runs
