"""The local broker's class archive (mars_stack.kafka_cds): made once by a scratch broker, then mapped by every
JVM on the broker's class path; a dump that fails is recorded, not retried, and the brokers start without."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import require_kafka
from mars_stack import kafka, kafka_cds

pytestmark = pytest.mark.integration


def test_the_archive_is_made_once_and_a_jvm_maps_the_brokers_classes_from_it() -> None:
    require_kafka()
    java = shutil.which("java") or "java"
    libs = kafka.ensure_kafka_libs()
    # The stacks' own archive: made here if no stack of this machine has made it yet, else kept.
    built = kafka.java_version_text(java) or ""
    options = kafka_cds.archive_options(
        java, built, libs, kafka.kafka_version(), list(kafka.LOCAL_JVM_OPTS), kafka.scratch_broker()
    )
    archive = kafka_cds.archive_path(java, built, libs, kafka.kafka_version())
    assert options == [f"-XX:SharedArchiveFile={archive}"] and archive.stat().st_size > 1_000_000
    made = archive.stat().st_mtime_ns
    assert (
        kafka_cds.archive_options(java, built, libs, kafka.kafka_version(), [], kafka.scratch_broker())
        == options
    )
    assert archive.stat().st_mtime_ns == made  # not made again
    # -Xshare:on refuses to start where the archive cannot be mapped; the class-load log names its source.
    run = subprocess.run(
        [java, "-Xshare:on", *options, "-Xlog:class+load=info", "-cp", f"{libs}/*",
         "kafka.tools.StorageTool", "version"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    shared = [line for line in run.stdout.splitlines() if "org.apache.kafka" in line and "shared" in line]
    assert shared, run.stdout[-2000:]


def test_a_failed_dump_is_recorded_and_not_tried_again(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    fake_java = tmp_path / "java"
    # A "java" that answers -version and fails everything else, counting the attempts.
    fake_java.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        'if [ "$1" = "-version" ]; then echo \'openjdk version "17"\' >&2; exit 0; fi\nexit 3\n'
    )
    fake_java.chmod(0o755)
    libs = tmp_path / "kafka-libs"
    libs.mkdir()
    assert kafka_cds.archive_options(str(fake_java), "17", libs, "test", [], kafka.scratch_broker()) == []
    archive = kafka_cds.archive_path(str(fake_java), "17", libs, "test")
    assert archive.with_suffix(".failed").exists() and not archive.exists()
    tries = [line for line in calls.read_text().splitlines() if "StorageTool" in line]
    assert len(tries) == 1
    assert kafka_cds.archive_options(str(fake_java), "17", libs, "test", [], kafka.scratch_broker()) == []
    assert [line for line in calls.read_text().splitlines() if "StorageTool" in line] == tries


def test_a_java_that_prints_no_version_gets_no_archive_and_no_attempt(tmp_path: Path) -> None:
    libs = tmp_path / "kafka-libs"
    libs.mkdir()
    assert kafka_cds.archive_options("/bin/false", "", libs, "test", [], kafka.scratch_broker()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kafka-libs"]  # no lock, marker or archive
