"""Apache Kafka for the local stack: one KRaft broker (combined broker + controller) run on the local
Java from the jars Maven fetches (infra/kafka/pom.xml), with its log dir on disk so a restart keeps
every topic. `choose_broker` picks Kafka wherever Java >= 17 is found and Tansu otherwise."""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mars_stack.certs import write_private
from mars_stack.kafka_cds import ScratchBroker, archive_options
from mars_stack.readiness import free_port
from mars_stack.settings import launcher_settings

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
KAFKA_DIR = REPO_ROOT / "infra" / "kafka"
POM = KAFKA_DIR / "pom.xml"
LOG4J_CONFIG = KAFKA_DIR / "log4j2.properties"
LAUNCHER_CLASS = "FormatAndServe"
LAUNCHER_SOURCE = KAFKA_DIR / "launcher" / f"{LAUNCHER_CLASS}.java"
#: Where `mvn dependency:copy-dependencies` puts kafka_2.13 and its dependencies (MARS_KAFKA_LIBS overrides).
DEFAULT_LIBS = KAFKA_DIR / "target" / "kafka-libs"
BROKERS = ("kafka", "tansu")


class KafkaUnavailable(RuntimeError):
    pass


def kafka_version() -> str:
    match = re.search(r"<kafka.version>([^<]+)</kafka.version>", POM.read_text())
    if match is None:  # pragma: no cover - the pom is ours
        raise KafkaUnavailable(f"no kafka.version in {POM}")
    return match.group(1)


@functools.cache
def java_version_text(java: str) -> str | None:
    """What `java -version` prints (None where it cannot run): asked once per process and binary, for the
    broker choice and the class archive's build (mars_stack.kafka_cds)."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stderr + out.stdout


def java_major(java: str | None = None) -> int | None:
    """The major version of `java` on PATH (or MARS_JAVA), None when there is none."""
    java = java or launcher_settings().java or shutil.which("java")
    if not java:
        return None
    text = java_version_text(java)
    if text is None:
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if match is None:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major  # "1.8" is Java 8


def choose_broker(requested: str | None = None) -> str:
    """kafka or tansu: `requested` (or MARS_BROKER) when set, else Kafka wherever Java >= 17 runs."""
    choice = (requested or launcher_settings().broker).strip().lower()
    if choice and choice not in BROKERS:
        raise ValueError(f"MARS_BROKER must be one of {', '.join(BROKERS)}, got {choice!r}")
    if choice:
        return choice
    major = java_major()
    return "kafka" if major is not None and major >= 17 else "tansu"


def libs_dir() -> Path:
    return Path(launcher_settings().kafka_libs or DEFAULT_LIBS)


def ensure_kafka_libs(quiet: bool = True) -> Path:
    """The broker's jars, fetched from Maven Central on first use (about 45 MB, cached)."""
    libs = libs_dir()
    version = kafka_version()
    if (libs / f"kafka_2.13-{version}.jar").exists():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaUnavailable(
            "Apache Kafka's jars are not fetched and `mvn` is not installed; install Maven "
            "(apt-get install maven) or run with MARS_BROKER=tansu"
        )
    if libs.exists():
        shutil.rmtree(libs)  # another version's jars would shadow this one on the classpath
    cmd = [
        mvn,
        "-B",
        *(["-q"] if quiet else []),
        "-f",
        str(POM),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={libs}",
        "-DincludeScope=runtime",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (libs / f"kafka_2.13-{version}.jar").exists():
        raise KafkaUnavailable(
            f"fetching Apache Kafka {version} failed:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return libs


def cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, base64url without padding (what kafka-storage random-uuid gives),
    never starting with "-" (a command line would read it as an option, as Kafka's own generator avoids)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


#: The local broker's JVM: the client compiler only and a serial collector. With C2 the broker's CPU in its
#: first minutes was mostly the JIT compiling (jstack: C2 ~55% of a core under load), taken from the
#: services on a 2-core machine; a production broker is a JVM of its own, tuned there.
LOCAL_JVM_OPTS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")


_SASL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def sasl_listener_properties(sasl_port: int, users: Mapping[str, str]) -> dict[str, str]:
    """A second listener, SASL_PLAINTEXT with PLAIN logins for `users` (name -> password), beside the
    PLAINTEXT one everything else uses: for testing clients with MARS_KAFKA_SECURITY_PROTOCOL=SASL_*."""
    bad = [u for u in users if not _SASL_NAME.fullmatch(u)] + [
        u for u, pw in users.items() if not pw or '"' in pw or "\\" in pw or "\n" in pw
    ]
    if not users or bad:
        raise ValueError(
            f"SASL users need plain names and non-empty passwords without quotes: {bad or users}"
        )
    logins = " ".join(f'user_{u}="{pw}"' for u, pw in users.items())
    return {
        "sasl.enabled.mechanisms": "PLAIN",
        "listener.name.sasl_plaintext.plain.sasl.jaas.config": (
            f"org.apache.kafka.common.security.plain.PlainLoginModule required {logins};"
        ),
    }


#: The broker's own principal (inter-broker and controller links, and whoever creates the ACLs): its only
#: super user. It logs in with PLAIN on the two loopback listeners, never on the clients' listener.
BROKER_ADMIN = "admin"
#: The clients' SASL mechanism on the SASL_SSL listener.
SCRAM = "SCRAM-SHA-512"


@dataclass(frozen=True)
class BrokerSecurity:
    """The broker's clients' listener as SASL_SSL: SCRAM-SHA-512 logins for `users` (principal -> password),
    TLS with the PEM `keystore` (private key and certificate chain), and Kafka's StandardAuthorizer with no
    rule allowing anything by default (the rules come from mars.kafka_acls once it runs). The broker's own
    links (inter-broker, controller) are SASL_PLAINTEXT with PLAIN on loopback, as `admin_password`'s
    BROKER_ADMIN, the only super user; `internal_port` is that inter-broker listener."""

    users: Mapping[str, str]
    admin_password: str
    keystore: Path
    internal_port: int


def new_password() -> str:
    """A login password: URL-safe characters only (JAAS and --add-scram quote nothing)."""
    return secrets.token_urlsafe(24)


def _jaas_plain(password: str) -> str:
    return (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        f'username="{BROKER_ADMIN}" password="{password}" user_{BROKER_ADMIN}="{password}";'
    )


def secure_properties(host: str, port: int, controller_port: int, security: BrokerSecurity) -> dict[str, str]:
    """Listeners, logins, TLS and the authorizer of a SASL_SSL broker (see BrokerSecurity)."""
    bad = [u for u in security.users if not _SASL_NAME.fullmatch(u)]
    bad += [u for u, pw in security.users.items() if not _SASL_NAME.fullmatch(pw)]
    if bad or not _SASL_NAME.fullmatch(security.admin_password):
        raise ValueError(f"SCRAM users need plain names and URL-safe passwords: {bad}")
    internal = f"INTERNAL://127.0.0.1:{security.internal_port}"
    return {
        "listeners": f"SASL_SSL://{host}:{port},{internal},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"SASL_SSL://{host}:{port},{internal}",
        "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT,INTERNAL:SASL_PLAINTEXT,SASL_SSL:SASL_SSL",
        "inter.broker.listener.name": "INTERNAL",
        "sasl.mechanism.inter.broker.protocol": "PLAIN",
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config": _jaas_plain(security.admin_password),
        "listener.name.internal.sasl.enabled.mechanisms": "PLAIN",
        "listener.name.internal.plain.sasl.jaas.config": _jaas_plain(security.admin_password),
        "listener.name.sasl_ssl.sasl.enabled.mechanisms": SCRAM,
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        ),
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(security.keystore),
        "ssl.client.auth": "none",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": f"User:{BROKER_ADMIN}",
        "allow.everyone.if.no.acl.found": "false",
    }


def scram_format_args(security: BrokerSecurity) -> list[str]:
    """StorageTool format's --add-scram arguments: the users exist in the metadata from the first start."""
    args: list[str] = []
    for user, password in security.users.items():
        args += ["--add-scram", f"{SCRAM}=[name={user},password={password}]"]
    return args


def server_properties(
    log_dir: Path,
    port: int,
    controller_port: int,
    partitions: int,
    sasl_port: int | None = None,
    sasl_users: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    security: BrokerSecurity | None = None,
) -> str:
    """One node that is both broker and controller, sized for one machine: single replicas, a handful of
    internal partitions (fast start), no initial rebalance delay (services join groups as they start).
    `host`: the address the client listeners bind and advertise (the controller's stays on loopback).
    `sasl_port`: also a SASL_PLAINTEXT listener there, for `sasl_users` (see sasl_listener_properties).
    `security`: the client listener is SASL_SSL with ACLs instead of PLAINTEXT (see BrokerSecurity).
    `extra`: properties that override these (MARS_KAFKA_SERVER_PROPERTIES, see parse_server_properties)."""
    if security is not None and sasl_port is not None:
        raise ValueError("a SASL_SSL broker has no second SASL_PLAINTEXT listener")
    listeners = f"PLAINTEXT://{host}:{port}"
    if sasl_port is not None:
        listeners += f",SASL_PLAINTEXT://{host}:{sasl_port}"
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"{listeners},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": listeners,
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
        "log.dirs": str(log_dir),
        "num.partitions": str(partitions),
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": str(max(1, partitions)),
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        # Our topics are created by the services (mars.bus.topics.ensure_topics) with the shared partition count.
        "auto.create.topics.enable": "false",
    }
    if sasl_port is not None:
        props.update(sasl_listener_properties(sasl_port, sasl_users or {}))
    if security is not None:
        props.update(secure_properties(host, port, controller_port, security))
    props.update(extra or {})
    return "".join(f"{k}={v}\n" for k, v in props.items())


def parse_server_properties(text: str) -> dict[str, str]:
    """`key=value,key=value` (MARS_KAFKA_SERVER_PROPERTIES) as a mapping; a pair without `=` is an error."""
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise KafkaUnavailable(f"MARS_KAFKA_SERVER_PROPERTIES: {item!r} is not key=value")
        pairs[key.strip()] = value.strip()
    return pairs


def scratch_broker() -> ScratchBroker:
    """A plaintext broker on free ports, to make the class archive with (mars_stack.kafka_cds)."""
    return ScratchBroker(
        properties=lambda folder: server_properties(folder, free_port(), free_port(), 1),
        log4j_config=LOG4J_CONFIG,
        cluster_id=cluster_id(),
    )


def local_jvm_opts() -> list[str]:
    """The local broker's JVM options (MARS_KAFKA_JVM_OPTS, or LOCAL_JVM_OPTS), heap aside."""
    configured = launcher_settings().kafka_jvm_opts
    return list(LOCAL_JVM_OPTS) if configured is None else configured.split()


def class_archive_options(java: str, libs: Path, jvm_opts: list[str]) -> list[str]:
    """The class archive's options for a JVM on the broker's class path (the archive made first where there
    is none yet); [] where MARS_KAFKA_CLASS_ARCHIVE=false or it cannot be made (mars_stack.kafka_cds)."""
    if not launcher_settings().kafka_class_archive:
        return []
    return archive_options(
        java, java_version_text(java) or "", libs, kafka_version(), jvm_opts, scratch_broker()
    )


def local_java() -> str:
    """The java that runs the local broker: MARS_JAVA, else the one on PATH."""
    return launcher_settings().java or shutil.which("java") or "java"


def ensure_class_archive() -> str:
    """Make the class archive now (`make kafka`), so that the first stack does not wait for it; what was done,
    in words."""
    options = class_archive_options(local_java(), ensure_kafka_libs(), local_jvm_opts())
    return " ".join(options) if options else "no class archive (turned off, or it could not be made)"


def prepare(
    workdir: Path,
    port: int,
    controller_port: int,
    partitions: int,
    java: str = "java",
    sasl_port: int | None = None,
    sasl_users: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    security: BrokerSecurity | None = None,
) -> list[str]:
    """Write the config and return the command that runs the broker in the foreground (client listeners on
    `host`). The log dir is formatted once (a restart reuses it, data included): by the broker's own JVM
    where the launcher compiled (`ensure_launcher`), else by a JVM of its own, now."""
    libs = ensure_kafka_libs()
    classpath = f"{libs}/*"
    config = workdir / "kafka" / "server.properties"
    log_dir = workdir / "kafka" / "data"
    config.parent.mkdir(parents=True, exist_ok=True)
    launcher = launcher_settings()
    extra = parse_server_properties(launcher.kafka_server_properties)
    write_private(  # it holds the broker's passwords when it runs SASL_SSL
        config,
        server_properties(
            log_dir, port, controller_port, partitions, sasl_port, sasl_users, extra, host, security
        ).encode(),
    )
    heap = launcher.kafka_heap
    jvm_opts = local_jvm_opts()
    shared = class_archive_options(java, libs, jvm_opts)
    meta = log_dir / "meta.properties"
    format_args = [
        "format",
        f"--cluster-id={cluster_id()}",
        "-c",
        str(config),
        *(scram_format_args(security) if security is not None else []),
    ]
    serve = [
        java,
        f"-Xmx{heap}",
        f"-Xms{heap}",
        *jvm_opts,
        *shared,
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
        "-cp",
    ]
    formats = ensure_launcher(java, libs)
    if formats is not None:  # the broker's own JVM formats its log dir (infra/kafka/launcher)
        args_file = workdir / "kafka" / "format.args"
        if not meta.exists():
            write_private(args_file, "\n".join(format_args).encode())  # the SCRAM passwords among them
        return [*serve, f"{classpath}:{formats}", LAUNCHER_CLASS, str(meta), str(args_file), str(config)]
    if not meta.exists():
        done = subprocess.run(
            [java, *shared, "-cp", classpath, "kafka.tools.StorageTool", *format_args],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise KafkaUnavailable(
                f"formatting the Kafka log dir failed:\n{(done.stdout + done.stderr)[-3000:]}"
            )
    return [*serve, classpath, "kafka.Kafka", str(config)]


def ensure_launcher(java: str, libs: Path) -> Path | None:
    """The folder of the compiled launcher (FormatAndServe: format, then serve, in one JVM), compiled once
    beside the jars by the javac of `java`'s own JDK. None where that JDK has no javac (a JRE), where the
    compile fails, or where MARS_KAFKA_FORMAT_IN_BROKER=false: a JVM of its own then formats the log dir
    first, as before."""
    if not launcher_settings().kafka_format_in_broker:
        return None
    real = Path(shutil.which(java) or java).resolve()
    javac = real.parent / "javac"
    if real.name != "java" or not javac.exists():  # not a JDK's own java (MARS_JAVA may name anything)
        return None
    # Per JDK (a class file's version is its javac's); compiled again when the source is newer.
    out = libs.parent / "launcher" / hashlib.sha256(str(real).encode()).hexdigest()[:12]
    compiled = out / f"{LAUNCHER_CLASS}.class"
    failed = out / "compile.failed"  # a compile that failed is not tried again at every start
    for made in (compiled, failed):
        if made.exists() and made.stat().st_mtime >= LAUNCHER_SOURCE.stat().st_mtime:
            return out if made is compiled else None
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as scratch:  # then one rename: a stack beside sees all or none
        done = subprocess.run(
            [str(javac), "-cp", f"{libs}/*", "-d", scratch, str(LAUNCHER_SOURCE)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            failed.write_text((done.stdout + done.stderr)[-2000:])
            log.warning(
                "the broker's launcher did not compile; brokers format in a JVM of their own:\n%s",
                (done.stdout + done.stderr)[-2000:],
            )
            return None
        os.replace(Path(scratch) / compiled.name, compiled)
    return out
